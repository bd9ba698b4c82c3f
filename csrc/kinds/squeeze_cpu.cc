// CPU kernel of onnxfuse::FusedSqueezeExcite (docs/format.md): a correctness reference in
// passes over small fp32 buffers, each parallel over the images on ORT's intra-op thread pool:
//   1. m [N, C]: each channel's mean over the H·W pixels, summed in fp32 in X's storage order
//      (per plane for NCHW, per pixel's C values for NHWC), rounded to T (program %0's dtype);
//   2. z1 = W1 m + B1 in fp32, rounded to T, then h = program(z1) with the PointwiseChain
//      evaluator (cpu_ops.h), stored rounded as the program declares;
//   3. z2 = W2 h + B2 in fp32, rounded to the gate's %0 dtype, then Y = gate(z2).
// Y [N, C, 1, 1] and its NHWC form [N, 1, 1, C] are the same bytes: y_layout changes only the
// output's shape. float32 tensors may stand for f16 ones (ONNX Runtime's isolated fp16 node):
// the values are then rounded wherever the programs say f16.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "conv.h"
#include "cpu_ops.h"
#include "squeeze.h"

namespace onnxfuse {

// squeeze.h: shared with squeeze_cuda.cc
Program read_squeeze_gate(const OrtKernelInfo* info, const Program& prog) {
  std::string text;
  if (!get_string_attr(info, "gate", &text)) throw Error("the node has no string attribute 'gate'");
  Program gate = parse_program(text);
  const auto check_form = [](const Program& p, const std::string& what) {
    if (p.inputs.size() != 1 || p.outputs.size() != 1)
      throw Error(what + " has " + std::to_string(p.inputs.size()) + " inputs and " +
                  std::to_string(p.outputs.size()) + " outputs, expected 1 and 1");
    for (DType d : {p.inputs[0], p.outputs[0].second})
      if (d != DType::F32 && d != DType::F16)
        throw Error(what + " has a value of dtype " + dtype_name(d) + ", FusedSqueezeExcite computes f32 or f16");
  };
  check_form(prog, "the program (the activation)");
  check_form(gate, "the gate");
  return gate;
}

// squeeze.h: shared with squeeze_cuda.cc
std::vector<TensorRef> read_squeeze_inputs(OrtKernelContext* ctx, const Program& prog, bool x_nhwc,
                                           bool f32_for_half) {
  static const char* const kNames[] = {"X", "W1", "B1", "W2", "B2"};
  size_t n_in = 0, n_out = 0;
  check(g_ort->KernelContext_GetInputCount(ctx, &n_in));
  check(g_ort->KernelContext_GetOutputCount(ctx, &n_out));
  if (n_in != 5 || n_out != 1)
    throw Error("the node has " + std::to_string(n_in) + " inputs and " + std::to_string(n_out) +
                " outputs, expected X, W1, B1, W2, B2 and one output");
  std::vector<TensorRef> t(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    t[i] = input_tensor(ctx, i);
    const std::string what = "input " + std::to_string(i) + " (" + kNames[i] + ") is " + elem_type_name(t[i].type);
    if (i == 0 && !type_fits(t[0].type, prog.inputs[0], f32_for_half))
      throw Error(what + ", the program declares " + dtype_name(prog.inputs[0]));
    if (i > 0 && t[i].type != t[0].type) throw Error(what + ", X is " + elem_type_name(t[0].type));
  }
  const int64_t c = pool_input_shape(t[0].shape, x_nhwc)[1];
  const Shape& w1 = t[1].shape;
  if (w1.size() != 2 || w1[1] != c)
    throw Error("input 1 (W1) has shape " + shape_str(w1) + ", expected [CR, C] with X's C = " + std::to_string(c) +
                (x_nhwc ? " (x_layout NHWC: X is [N, H, W, C])" : ""));
  const int64_t cr = w1[0];
  const Shape want[] = {{cr}, {c, cr}, {c}};
  static const char* const kWant[] = {"[CR]", "[C, CR]", "[C]"};
  for (size_t i = 2; i < 5; ++i)
    if (t[i].shape != want[i - 2])
      throw Error("input " + std::to_string(i) + " (" + kNames[i] + ") has shape " + shape_str(t[i].shape) +
                  ", expected " + kWant[i - 2] + " = " + shape_str(want[i - 2]) + " (C = " + std::to_string(c) +
                  ", CR = " + std::to_string(cr) + ")");
  return t;
}

namespace {

// out[n, j] = Σ_k w[j, k]·v[n, k] + b[j] summed in fp32 and rounded to d: a 1x1 conv of one
// pixel per image (J outputs of K inputs).
void one_pixel_conv(OrtKernelContext* ctx, const std::vector<float>& v, const std::vector<float>& w,
                    const std::vector<float>& b, int64_t N, int64_t J, int64_t K, DType d, std::vector<float>* out) {
  out->resize(static_cast<size_t>(N * J));
  parallel_for(ctx, N, [&](int64_t n) {
    for (int64_t j = 0; j < J; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += w[j * K + k] * v[n * K + k];
      (*out)[n * J + j] = round_to(d, acc + b[j]);
    }
  });
}

struct SqueezeKernel {
  static constexpr const char* kOp = kFusedSqueezeExcite;
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  std::string name;
  Program prog, gate;
  PoolLayouts lay;

  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_squeeze_inputs(ctx, prog, lay.x_nhwc, /*f32_for_half=*/true);
    const Shape xs = pool_input_shape(t[0].shape, lay.x_nhwc);  // logical [N, C, H, W]
    const int64_t N = xs[0], C = xs[1], HW = xs[2] * xs[3], CR = t[1].shape[0];
    const Shape ys = lay.y_nhwc ? Shape{N, 1, 1, C} : Shape{N, C, 1, 1};
    const TensorRef y = layer_output(gate, ctx, /*f32_for_half=*/true, ys);
    if (N * C == 0) return;

    // 1. the pool: one task per image (a plane is contiguous in NCHW, a pixel's C values in NHWC)
    const DType T = prog.inputs[0];
    const bool half = actual_dtype(t[0].type, T) == DType::F16;
    const auto x_at = [&](int64_t i) {
      return half ? f16_to_f32(static_cast<const uint16_t*>(t[0].data)[i]) : static_cast<const float*>(t[0].data)[i];
    };
    std::vector<float> m(static_cast<size_t>(N * C), 0.0f);
    parallel_for(ctx, N, [&](int64_t n) {
      float* acc = m.data() + n * C;
      const int64_t base = n * C * HW;
      if (lay.x_nhwc) {
        for (int64_t p = 0; p < HW; ++p)
          for (int64_t c = 0; c < C; ++c) acc[c] += x_at(base + p * C + c);
      } else {
        for (int64_t c = 0; c < C; ++c)
          for (int64_t p = 0; p < HW; ++p) acc[c] += x_at(base + c * HW + p);
      }
      // H·W = 0: 0 / 0, the NaN mean of no pixels (numpy's)
      for (int64_t c = 0; c < C; ++c) acc[c] = round_to(T, acc[c] / static_cast<float>(HW));
    });

    // 2-5. FC1, the activation, FC2, the gate
    std::vector<float> z1, h(static_cast<size_t>(N * CR)), z2;
    one_pixel_conv(ctx, m, widen(t[1], T), widen(t[2], T), N, CR, C, T, &z1);
    run_program(prog, {{DType::F32, z1.data(), {N, CR}}}, {{DType::F32, h.data(), {N, CR}}}, {N, CR}, ctx);
    one_pixel_conv(ctx, h, widen(t[3], T), widen(t[4], T), N, C, CR, gate.inputs[0], &z2);
    const DType yd = gate.outputs[0].second;
    run_program(gate, {{DType::F32, z2.data(), {N, C}}}, {{actual_dtype(y.type, yd), y.data, {N, C}}}, {N, C}, ctx);
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<SqueezeKernel>();
    k->name = name;
    k->prog = read_program(info);
    k->gate = read_squeeze_gate(info, k->prog);
    k->lay = read_pool_layouts(info);
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kFusedSqueezeExcite, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_squeeze_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<SqueezeKernel>(5, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
