// CUDA kernel of onnxfuse::PointwiseChain (docs/format.md, "The node", kernel_meta kind
// "pointwise"): input modes full / scalar / strided / rotate_half(_strided) / rotate_pairs(_strided) / narrow,
// every integer parameter 64-bit, a flat grid of `block` elements per program.
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <algorithm>

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::thread_params;
using cuda::Target;
using cuda::Variant;

enum class Mode { FULL, SCALAR, STRIDED, ROTATE, ROTATE_STRIDED, NARROW };  // (rotate_pairs: as rotate_half)

struct PointwiseKernel : cuda::CudaKernel {
  static constexpr const char* kOp = "PointwiseChain";
  int rank = 0;
  std::vector<Mode> modes;  // per program input
  bool any_strided = false;
  int64_t rotate_last = 0;       // kernel_meta "rotate_last": the last dim its rotated inputs were compiled for
  std::vector<int64_t> rotate;   // the node's rotate_half (1) and rotate_pairs (2), read_rotations
  std::vector<int64_t> pairs;    // per input: its kernel_meta mode is rotate_pairs(_strided)
  std::vector<std::vector<int64_t>> perms;  // the node's transpose, per input (empty: none)
  std::vector<int64_t> partial;  // the node's partial {r, k}, or empty
  int64_t last_dim = 0;          // kernel_meta "last_dim" (partial): the output's last dim compiled in
  std::vector<int64_t> blocks;  // per variant: elements per program

  const char* kind() const override { return "pointwise"; }
  bool int32_params() const override { return false; }

  void init(const OrtKernelInfo* info) override {
    rotate = read_rotations(info, prog.inputs.size());
    perms = read_transpose(info, prog.inputs.size());
    partial = read_partial(info, prog.inputs.size());
  }

  void read_meta(const Json& j, size_t n_inputs) override {
    const int64_t r = cuda::meta_int(j, "rank", "kernel_meta");
    if (r < 0 || r > 64) throw Error("kernel_meta: bad rank " + std::to_string(r));
    rank = static_cast<int>(r);
    const Json& modes_j = cuda::meta_array(j, "input_modes", "kernel_meta");
    if (modes_j.arr.size() != n_inputs)
      throw Error("kernel_meta has " + std::to_string(modes_j.arr.size()) + " input_modes, the program has " +
                  std::to_string(n_inputs) + " inputs");
    for (const Json& md : modes_j.arr) {
      if (md.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
      if (md.str == "full") modes.push_back(Mode::FULL);
      else if (md.str == "scalar") modes.push_back(Mode::SCALAR);
      else if (md.str == "strided") modes.push_back(Mode::STRIDED), any_strided = true;
      else if (md.str == "rotate_half" || md.str == "rotate_pairs") modes.push_back(Mode::ROTATE);
      else if (md.str == "rotate_half_strided" || md.str == "rotate_pairs_strided")
        modes.push_back(Mode::ROTATE_STRIDED), any_strided = true;
      else if (md.str == "narrow") modes.push_back(Mode::NARROW), any_strided = true;
      else throw Error("kernel_meta: unknown input mode \"" + md.str + "\"");
      pairs.push_back(md.str.rfind("rotate_pairs", 0) == 0 ? 1 : 0);
    }
    bool rotates = false;
    for (size_t i = 0; i < modes.size(); ++i) {
      const bool rotated = modes[i] == Mode::ROTATE || modes[i] == Mode::ROTATE_STRIDED;
      rotates = rotates || rotated;
      if (rotated != (i < rotate.size() && rotate[i] != 0) || (rotated && (rotate[i] == 2) != (pairs[i] != 0)))
        throw Error("kernel_meta's input_modes and the node's rotate_half / rotate_pairs differ at input " +
                    std::to_string(i));
      if (!perms[i].empty() && modes[i] != Mode::STRIDED && modes[i] != Mode::ROTATE_STRIDED)
        throw Error("input " + std::to_string(i) + " is read through a transpose, its kernel_meta mode is not strided");
    }
    if (rotates) rotate_last = cuda::meta_positive(j, "rotate_last", "kernel_meta");
    // partial: compiled in (the columns, the input copied beyond them, the output's last dim)
    std::vector<int64_t> compiled;
    if (j.get("partial")) {
      for (const Json& v : cuda::meta_array(j, "partial", "kernel_meta").arr) compiled.push_back(static_cast<int64_t>(v.num));
      last_dim = cuda::meta_positive(j, "last_dim", "kernel_meta");
    }
    if (compiled != partial) throw Error("kernel_meta's partial and the node's differ");
    for (size_t i = 0; i < modes.size(); ++i)
      if (modes[i] == Mode::NARROW && partial.empty()) throw Error("a narrow input in a kernel without partial");
  }

  void read_variant(const Json& vj, const std::string& where, Variant*) override {
    blocks.push_back(cuda::meta_positive(vj, "block", where));
  }

  // Input i's element strides over the output (0 on broadcast dims): as numpy broadcasts its
  // shape, or, read through a transpose, the permuted strides of the contiguous x, whose
  // transposed shape must broadcast to the output; a rotated one's last dim must be contiguous.
  Shape input_strides(size_t i, const Shape& x, const Shape& out) const {
    if (perms[i].empty()) return broadcast_strides(x, out);
    const auto [shape, strides] = transposed_view(x, perms[i]);
    Shape st = broadcast_strides(shape, out);  // (0 where it broadcasts: bind_io checked that it does)
    const size_t pad = out.size() - shape.size();
    for (size_t k = 0; k < shape.size(); ++k)
      if (st[pad + k] != 0) st[pad + k] = strides[k];
    if (modes[i] == Mode::ROTATE_STRIDED && (st.empty() || st.back() != 1))
      throw Error("input " + std::to_string(i) + " of shape " + shape_str(x) +
                  " is read rotated through a transpose that moves its last dim");
    return st;
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    Io io = bind_io(prog, ctx, false, &perms, &partial);
    if (io.n == 0) return;
    Shape narrow_out = io.out_shape;  // partial: the shape a narrow input broadcasts to
    if (!partial.empty()) {
      if (io.out_shape.back() != last_dim)
        throw Error("output shape " + shape_str(io.out_shape) + ", the kernel computes the first " +
                    std::to_string(partial[0]) + " columns of a last dim of " + std::to_string(last_dim) +
                    " (the model's shapes changed since it was optimized?)");
      narrow_out.back() = partial[0];
    }
    const Target t = target(ctx);

    const size_t n_in = prog.inputs.size();
    const size_t n_out = prog.outputs.size();
    std::vector<size_t> strided;
    for (size_t i = 0; i < n_in; ++i) {
      const int64_t ni = numel(io.in[i].shape);
      switch (modes[i]) {
        case Mode::FULL:
          if (ni != io.n)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it in mode 'full', which needs the output's shape " +
                        shape_str(io.out_shape) + " (the model's shapes changed since it was optimized?)");
          break;
        case Mode::SCALAR:
          if (ni != 1)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it in mode 'scalar', which needs one element");
          break;
        case Mode::STRIDED: strided.push_back(i); break;
        case Mode::NARROW:
          if (io.in[i].shape.empty() || io.in[i].shape.back() != partial[0])
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it over the first " + std::to_string(partial[0]) + " columns alone");
          strided.push_back(i);
          break;
        case Mode::ROTATE_STRIDED:
          strided.push_back(i);
          [[fallthrough]];
        case Mode::ROTATE:
          if (transposed_view(io.in[i].shape, perms[i]).first != io.out_shape || io.out_shape.empty() ||
              io.out_shape.back() != rotate_last)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it rotated (rotate_half or rotate_pairs) over a last dim of " +
                        std::to_string(rotate_last) + ", which needs the output's shape " +
                        shape_str(io.out_shape) + " ending in it (the model's shapes changed since it was optimized?)");
          break;
      }
    }

    // docs/format.md, Launch: every integer 64-bit.
    Params& p = thread_params();
    std::vector<const void*> ptrs;
    for (size_t i = 0; i < n_in; ++i) ptrs.push_back(io.in[i].data);
    for (size_t j = 0; j < n_out; ++j) ptrs.push_back(io.out[j].data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i64(io.n);
    int64_t last = 0;  // the collapsed last dim, for the row variants (last_multiple)
    if (any_strided) {
      std::vector<Shape> st;
      // (a narrow input's strides over the first columns; the kernel masks the others)
      for (size_t i : strided)
        st.push_back(input_strides(i, io.in[i].shape, modes[i] == Mode::NARROW ? narrow_out : io.out_shape));
      Collapsed c = collapse(io.out_shape, st);
      if (c.dims.size() > static_cast<size_t>(rank))
        throw Error("output shape " + shape_str(io.out_shape) + " needs rank " + std::to_string(c.dims.size()) +
                    " for its strided inputs, the kernel was compiled for rank " + std::to_string(rank));
      const size_t pad = static_cast<size_t>(rank) - c.dims.size();
      for (size_t k = 0; k < pad; ++k) p.i64(1);
      for (int64_t dim : c.dims) p.i64(dim);
      last = c.dims.empty() ? 1 : c.dims.back();
      for (size_t s = 0; s < strided.size(); ++s) {
        for (size_t k = 0; k < pad; ++k) p.i64(0);
        for (int64_t stv : c.strides[s]) p.i64(stv);
      }
    }
    p.scratch();

    const int v = choose_variant(t, ptrs, io.n, io.n, 0, 0, last);
    const int64_t block = blocks[v];
    launch(t, v, (io.n + block - 1) / block, 1, p);
  }
};

}  // namespace

void append_pointwise_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<PointwiseKernel>(1, cuda::create_kernel<PointwiseKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_pointwise_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
