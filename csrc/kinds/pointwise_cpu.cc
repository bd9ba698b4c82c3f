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

struct CpuKernel {
  static constexpr const char* kOp = "PointwiseChain";
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  Program prog;
  std::string name;
  std::vector<int64_t> rotate;  // attribute rotate_half, per program input
  std::vector<std::vector<int64_t>> perms;  // attribute transpose, per program input (empty: none)

  void compute(OrtKernelContext* ctx) const {
    Io io = bind_io(prog, ctx, /*f32_for_half=*/true, &perms);
    std::vector<HostTensor> in, out;
    std::vector<std::vector<uint8_t>> rotated(io.in.size()), permuted(io.in.size());
    for (size_t i = 0; i < io.in.size(); ++i) {
      const DType dt = actual_dtype(io.in[i].type, prog.inputs[i]);
      void* data = io.in[i].data;
      Shape shape = io.in[i].shape;
      if (!perms[i].empty()) {  // Transpose(x, perm) first, then rotated
        permuted[i] = transposed(data, elem_size(dt), shape, perms[i]);
        data = permuted[i].data();
        shape = transposed_view(shape, perms[i]).first;
      }
      if (rotate[i]) {
        if (shape != io.out_shape)
          throw Error("input " + std::to_string(i) + " has shape " + shape_str(shape) +
                      ", read rotated (rotate_half) it needs the output's " + shape_str(io.out_shape));
        rotated[i] = rotate_half(data, dt, shape);
        data = rotated[i].data();
      }
      in.push_back({dt, data, shape});
    }
    for (size_t j = 0; j < io.out.size(); ++j)
      out.push_back({actual_dtype(io.out[j].type, prog.outputs[j].second), io.out[j].data, io.out_shape});
    run_program(prog, in, out, io.out_shape, ctx);
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<CpuKernel>();
    k->prog = read_program(info);
    k->name = name;
    k->rotate = read_rotate_half(info, k->prog.inputs.size());
    k->perms = read_transpose(info, k->prog.inputs.size());
    for (size_t i = 0; i < k->rotate.size(); ++i)
      if (k->rotate[i] && k->prog.inputs[i] == DType::BOOL) throw Error("rotate_half of a bool input");
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
