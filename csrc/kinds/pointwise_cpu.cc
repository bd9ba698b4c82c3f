// CPU kernel of onnxfuse::PointwiseChain (docs/format.md): the node's program over the
// broadcast output, with the program evaluator of cpu_ops.h. float32 tensors may stand for
// f16/bf16 program values (ONNX Runtime's "isolated fp16 node").
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_ops.h"

namespace onnxfuse {
namespace {

// Concat(-x[..., h:], x[..., :h]) of a float tensor (4- or 2-byte elements) along its last dim
// (even; h half of it), into a new buffer: the sign bit flipped is IEEE negation.
std::vector<uint8_t> rotate_half(const void* x, DType dt, const Shape& shape) {
  const int64_t last = shape.empty() ? 1 : shape.back();
  if (shape.empty() || last % 2) throw Error("rotate_half needs an even last dim, the input has " + shape_str(shape));
  const size_t es = elem_size(dt), rows = static_cast<size_t>(numel(shape) / std::max<int64_t>(last, 1));
  const size_t h = static_cast<size_t>(last / 2);
  std::vector<uint8_t> y(rows * static_cast<size_t>(last) * es);
  const uint8_t* src = static_cast<const uint8_t*>(x);
  const size_t sign_byte = es - 1;  // little endian: the sign bit is the top bit of the last byte
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * static_cast<size_t>(last) * es;
    uint8_t* out = y.data() + r * static_cast<size_t>(last) * es;
    std::memcpy(out, row + h * es, h * es);     // x[..., h:], negated below
    std::memcpy(out + h * es, row, h * es);     // x[..., :h]
    for (size_t c = 0; c < h; ++c) out[c * es + sign_byte] ^= 0x80;
  }
  return y;
}

// The interleaved rotation of a float tensor along its last dim (even): each pair (x[2j], x[2j+1])
// becomes (-x[2j+1], x[2j]), into a new buffer.
std::vector<uint8_t> rotate_pairs(const void* x, DType dt, const Shape& shape) {
  const int64_t last = shape.empty() ? 1 : shape.back();
  if (shape.empty() || last % 2) throw Error("rotate_pairs needs an even last dim, the input has " + shape_str(shape));
  const size_t es = elem_size(dt), pairs = static_cast<size_t>(numel(shape) / 2);
  std::vector<uint8_t> y(pairs * 2 * es);
  const uint8_t* src = static_cast<const uint8_t*>(x);
  const size_t sign_byte = es - 1;
  for (size_t p = 0; p < pairs; ++p) {
    std::memcpy(y.data() + 2 * p * es, src + (2 * p + 1) * es, es);
    std::memcpy(y.data() + (2 * p + 1) * es, src + 2 * p * es, es);
    y[2 * p * es + sign_byte] ^= 0x80;
  }
  return y;
}

// Transpose(x, perm) of a tensor of `es`-byte elements, into a new buffer (the evaluator then
// reads it as a contiguous input).
std::vector<uint8_t> transposed(const void* x, size_t es, const Shape& shape, const std::vector<int64_t>& perm) {
  const auto [out_shape, strides] = transposed_view(shape, perm);
  const int64_t n = numel(out_shape);
  std::vector<uint8_t> y(static_cast<size_t>(n) * es);
  const uint8_t* src = static_cast<const uint8_t*>(x);
  std::vector<int64_t> idx(out_shape.size(), 0);
  int64_t off = 0;  // x's element offset of output element i
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(y.data() + static_cast<size_t>(i) * es, src + static_cast<size_t>(off) * es, es);
    for (size_t k = out_shape.size(); k-- > 0;) {  // the next index, row-major
      off += strides[k];
      if (++idx[k] < out_shape[k]) break;
      off -= strides[k] * out_shape[k];
      idx[k] = 0;
    }
  }
  return y;
}

// x[..., a:b] of a tensor of `es`-byte elements (0 <= a < b <= its last dim), into a new buffer.
std::vector<uint8_t> columns(const void* x, size_t es, const Shape& shape, int64_t a, int64_t b) {
  const size_t last = static_cast<size_t>(shape.back()), rows = static_cast<size_t>(numel(shape)) / last;
  const size_t width = static_cast<size_t>(b - a) * es, skip = static_cast<size_t>(a) * es;
  std::vector<uint8_t> y(rows * width);
  const uint8_t* src = static_cast<const uint8_t*>(x);
  for (size_t i = 0; i < rows; ++i) std::memcpy(y.data() + i * width, src + i * last * es + skip, width);
  return y;
}

struct CpuKernel {
  static constexpr const char* kOp = "PointwiseChain";
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  Program prog;
  std::string name;
  std::vector<int64_t> rotate;  // per program input: 1 rotate_half, 2 rotate_pairs (read_rotations)
  std::vector<std::vector<int64_t>> perms;  // attribute transpose, per program input (empty: none)
  std::vector<int64_t> partial;  // attribute partial: {r, k}, {r, k, j} or empty
  Program beyond;                // partial {r, k, j}: x_k + x_j, the output beyond r

  void compute(OrtKernelContext* ctx) const {
    Io io = bind_io(prog, ctx, /*f32_for_half=*/true, &perms, &partial);
    // partial: the program over the first r columns (the inputs as wide as the output cut to them)
    Shape shape_p = io.out_shape;
    if (!partial.empty()) shape_p.back() = partial[0];
    std::vector<HostTensor> in, out;
    std::vector<std::vector<uint8_t>> rotated(io.in.size()), permuted(io.in.size()), cut(io.in.size());
    const void* pass = nullptr;  // partial: input k as wide as the output
    HostTensor added;             // partial {r, k, j}: input j, as wide as the output
    for (size_t i = 0; i < io.in.size(); ++i) {
      const DType dt = actual_dtype(io.in[i].type, prog.inputs[i]);
      void* data = io.in[i].data;
      Shape shape = io.in[i].shape;
      if (!perms[i].empty()) {  // Transpose(x, perm) first, then cut, then rotated
        permuted[i] = transposed(data, elem_size(dt), shape, perms[i]);
        data = permuted[i].data();
        shape = transposed_view(shape, perms[i]).first;
      }
      if (!partial.empty() && !shape.empty() && shape.back() == io.out_shape.back()) {
        if (static_cast<int64_t>(i) == partial[1]) {
          if (shape != io.out_shape)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(shape) +
                        ", copied beyond the first columns it needs the output's " + shape_str(io.out_shape));
          pass = data;
        }
        if (partial.size() == 3 && static_cast<int64_t>(i) == partial[2]) added = {dt, data, shape};
        cut[i] = columns(data, elem_size(dt), shape, 0, partial[0]);
        data = cut[i].data();
        shape.back() = partial[0];
      }
      if (rotate[i]) {
        if (shape != shape_p)
          throw Error("input " + std::to_string(i) + " has shape " + shape_str(shape) + ", read rotated (" +
                      (rotate[i] == 2 ? "rotate_pairs" : "rotate_half") + ") it needs the output's " +
                      shape_str(shape_p));
        rotated[i] = rotate[i] == 2 ? rotate_pairs(data, dt, shape) : rotate_half(data, dt, shape);
        data = rotated[i].data();
      }
      in.push_back({dt, data, shape});
    }
    if (partial.empty()) {
      for (size_t j = 0; j < io.out.size(); ++j)
        out.push_back({actual_dtype(io.out[j].type, prog.outputs[j].second), io.out[j].data, io.out_shape});
      run_program(prog, in, out, io.out_shape, ctx);
      return;
    }
    // partial (one output): the program's r columns into a buffer, then each row of the output
    // from them and the rest of input k's row
    const DType dt = actual_dtype(io.out[0].type, prog.outputs[0].second);
    const size_t k = static_cast<size_t>(partial[1]), es = elem_size(dt);
    if (io.out.size() != 1 || elem_size(actual_dtype(io.in[k].type, prog.inputs[k])) != es)
      throw Error("partial needs one output of input " + std::to_string(k) + "'s dtype");
    std::vector<uint8_t> computed(static_cast<size_t>(numel(shape_p)) * es);
    out.push_back({dt, computed.data(), shape_p});
    run_program(prog, in, out, shape_p, ctx);
    const size_t last = static_cast<size_t>(io.out_shape.back()), r = static_cast<size_t>(partial[0]);
    const size_t rows = static_cast<size_t>(io.n) / last;
    uint8_t* y = static_cast<uint8_t*>(io.out[0].data);
    const uint8_t* x = static_cast<const uint8_t*>(pass);
    size_t x_row = last, x_at = r;  // where row i's columns beyond r are: x + (i * x_row + x_at) * es
    std::vector<uint8_t> sum;       // {r, k, j}: x_k + x_j over the columns beyond r
    if (partial.size() == 3) {
      if (!added.data)
        throw Error("input " + std::to_string(partial[2]) + ", added beyond the first " + std::to_string(r) +
                    " columns, needs the output's last dim " + std::to_string(last));
      Shape rest = io.out_shape;
      rest.back() = static_cast<int64_t>(last - r);
      const int64_t d = io.out_shape.back();
      std::vector<uint8_t> xk = columns(pass, es, io.out_shape, static_cast<int64_t>(r), d);
      std::vector<uint8_t> xj = columns(added.data, elem_size(added.dtype), added.shape, static_cast<int64_t>(r), d);
      Shape j_shape = added.shape;
      j_shape.back() = rest.back();
      sum.resize(static_cast<size_t>(numel(rest)) * es);
      run_program(beyond, {{in[k].dtype, xk.data(), rest}, {added.dtype, xj.data(), j_shape}}, {{dt, sum.data(), rest}},
                  rest, ctx);
      x = sum.data();
      x_row = last - r;
      x_at = 0;
    }
    for (size_t i = 0; i < rows; ++i) {
      std::memcpy(y + i * last * es, computed.data() + i * r * es, r * es);
      std::memcpy(y + (i * last + r) * es, x + (i * x_row + x_at) * es, (last - r) * es);
    }
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<CpuKernel>();
    k->prog = read_program(info);
    k->name = name;
    k->rotate = read_rotations(info, k->prog.inputs.size());
    k->perms = read_transpose(info, k->prog.inputs.size());
    k->partial = read_partial(info, k->prog.inputs.size());
    if (k->partial.size() == 3) {  // x_k + x_j in fp32, rounded once to the output's type
      const DType xk = k->prog.inputs[static_cast<size_t>(k->partial[1])];
      const DType xj = k->prog.inputs[static_cast<size_t>(k->partial[2])];
      k->beyond = parse_program(std::string("onnxfuse.pointwise v1\ninput %0 ") + dtype_name(xk) + "\ninput %1 " +
                                dtype_name(xj) + "\n%2 = add %0 %1\noutput %2 " +
                                dtype_name(k->prog.outputs[0].second) + "\n");
    }
    for (size_t i = 0; i < k->rotate.size(); ++i)
      if (k->rotate[i] && k->prog.inputs[i] == DType::BOOL) throw Error("a rotation of a bool input");
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(CpuKernel::kOp, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_pointwise_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<CpuKernel>(1, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
