// CPU kernel of onnxfuse::FusedMaxPool (docs/format.md): the prologue program with the
// PointwiseChain evaluator, then ONNX's max pool (any kernel, strides, pads, dilations,
// ceil_mode), each pass parallel on ORT's intra-op thread pool (cpu_ops.h). float16
// tensors are widened to fp32 first; all arithmetic is fp32.
//
// x_layout / y_layout: the program reads an NHWC X through its strides over [N, C, H, W];
// an NHWC output is the pooled NCHW result stored transposed.
#include "conv.h"
#include "cpu_ops.h"

namespace onnxfuse {
namespace {

struct MaxPoolKernel : LayerKernel {
  static constexpr const char* kOp = "FusedMaxPool";
  PoolParams pool;
  PoolLayouts lay;

  void init(const OrtKernelInfo* info) {
    read_pool_params(info, /*required=*/true, &pool);
    lay = read_pool_layouts(info);
  }

  // The program runs over X's logical [N, C, H, W]; an NHWC X is read through its strides
  // (no copy), an NHWC output is stored transposed after the pool.
  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 1, /*f32_for_half=*/true);
    const Shape xs = pool_input_shape(t[0].shape, lay.x_nhwc);
    for (size_t i = 1; i < t.size(); ++i)
      check_extra(i, static_cast<int>(i), t[i].shape, xs,
                  lay.x_nhwc ? "X's logical shape (x_layout NHWC) [N, C, H, W] =" : "X's shape");
    const Shape pooled = pool_shape(pool, xs);
    const TensorRef out = layer_output(prog, ctx, /*f32_for_half=*/true, pool_y_shape(pooled, lay.y_nhwc));
    if (numel(pooled) == 0) return;
    const int64_t C = xs[1], H = xs[2], W = xs[3];
    const Shape x_strides = lay.x_nhwc ? Shape{H * W * C, 1, W * C, C} : Shape{};
    const HostTensor x{actual_dtype(t[0].type, prog.inputs[0]), t[0].data, xs, x_strides};
    program_then_pool(ctx, alloc, prog, program_inputs(prog, x, t, 1), xs, &pool, out, lay.y_nhwc);
  }
};

}  // namespace

void append_maxpool_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<MaxPoolKernel>(1, create_layer_kernel<MaxPoolKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse
