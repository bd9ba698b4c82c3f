// The CPU kernel of onnxfuse::GemmEpilogue (docs/format.md): a correctness reference.
//   1. the product alpha * op(A) @ op(B), summed in double per output row (parallel over rows
//      on ORT's intra-op thread pool), rounded to A's dtype as the original's MatMul stores it;
//   2. the epilogue program over Y's shape with the cpu_program.cc evaluator, reading the
//      product as its %0 and the node's other inputs with numpy broadcasting.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "gemm.h"

namespace onnxfuse {
namespace {

struct GemmKernel {
  static constexpr const char* kOp = kGemmEpilogue;
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  std::string name;
  Program prog;
  bool trans_a = false, trans_b = false;
  float alpha = 1.0f;

  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_gemm_inputs(ctx, prog, /*f32_for_half=*/true);
    const size_t n_in = t.size();
    const GemmGeometry geo = gemm_geometry(t[0].shape, t[1].shape, trans_a, trans_b);
    for (size_t i = 2; i < n_in; ++i)
      if (broadcast_shapes({geo.y, t[i].shape}) != geo.y)
        throw Error("input " + std::to_string(i) + " has shape " + shape_str(t[i].shape) +
                    ", which does not broadcast to the product's " + shape_str(geo.y));
    OrtValue* yv = nullptr;
    check(g_ort->KernelContext_GetOutput(ctx, 0, geo.y.data(), geo.y.size(), &yv));
    TensorRef y;
    read_tensor(yv, &y);
    const DType out_dt = prog.outputs[0].second;
    if (!type_fits(y.type, out_dt, true))
      throw Error("output 0 is " + std::string(elem_type_name(y.type)) + " in the graph, the program stores " +
                  dtype_name(out_dt));
    const int64_t total = numel(geo.y);
    if (total == 0) return;

    // 1. the product, [G, M, N] row-major, rounded to A's dtype
    const std::vector<float> a = widen(t[0], prog.inputs[0]), b = widen(t[1], prog.inputs[0]);
    const int64_t m = geo.m, n = geo.n, k = geo.k;
    std::vector<float> p(static_cast<size_t>(total));
    parallel_for(ctx, geo.g * m, [&](int64_t row) {
      const int64_t g = row / m, i = row % m;
      const float* ag = a.data() + g * geo.stride_ag;
      const float* bg = b.data() + g * geo.stride_bg;
      std::vector<double> acc(static_cast<size_t>(n), 0.0);
      for (int64_t kk = 0; kk < k; ++kk) {
        const double av = trans_a ? ag[kk * m + i] : ag[i * k + kk];
        if (trans_b) {
          for (int64_t j = 0; j < n; ++j) acc[j] += av * bg[j * k + kk];
        } else {
          const float* brow = bg + kk * n;
          for (int64_t j = 0; j < n; ++j) acc[j] += av * brow[j];
        }
      }
      float* out = p.data() + row * n;
      for (int64_t j = 0; j < n; ++j) out[j] = round_to(prog.inputs[0], static_cast<float>(alpha * acc[j]));
    });

    // 2. the epilogue
    std::vector<HostTensor> in;
    in.push_back({DType::F32, p.data(), geo.y});
    for (size_t i = 2; i < n_in; ++i) in.push_back({actual_dtype(t[i].type, prog.inputs[i - 1]), t[i].data, t[i].shape});
    run_program(prog, in, {{actual_dtype(y.type, out_dt), y.data, geo.y}}, geo.y, ctx);
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<GemmKernel>();
    k->name = name;
    k->prog = read_program(info);
    if (k->prog.inputs.empty() || k->prog.outputs.size() != 1)
      throw Error("the program needs the product as input %0 and exactly one output");
    int64_t v = 0;
    if (get_int_attr(info, "trans_a", &v)) k->trans_a = v != 0;
    if (get_int_attr(info, "trans_b", &v)) k->trans_b = v != 0;
    float alpha = 1.0f;
    if (OrtStatus* st = g_ort->KernelInfoGetAttribute_float(info, "alpha", &alpha)) {
      g_ort->ReleaseStatus(st);  // absent: 1
    } else {
      k->alpha = alpha;
    }
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kGemmEpilogue, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_gemm_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<GemmKernel>(2, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
