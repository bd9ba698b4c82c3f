// CUDA kernel of onnxfuse::FusedMaxPool (docs/format.md, "FusedMaxPool", kernel_meta kind
// "maxpool"): int32 parameters N C H W OH OW (the logical sizes in any layout) and the
// extras' strides, and the grid of the variant's kernel (flat, rows or nhwc).
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include "conv.h"

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;

// The grid of a maxpool kernel, by the block keys of its variant (docs/format.md, kind
// maxpool): "block" (flat), "block_oh" + "block_ow" (rows), "block_p" + "block_c" (nhwc).
enum class PoolGrid { FLAT, ROWS, PIXELS };

struct PoolTile {
  PoolGrid grid = PoolGrid::FLAT;
  int64_t block = 0;                   // flat
  int64_t block_oh = 0, block_ow = 0;  // rows
  int64_t block_p = 0, block_c = 0;    // nhwc
};

struct MaxPoolKernel : cuda::CudaKernel {
  static constexpr const char* kOp = "FusedMaxPool";
  PoolParams pool;
  PoolLayouts lay;
  bool meta_x_nhwc = false, meta_y_nhwc = false;  // kernel_meta's layouts ("nchw" when absent)
  std::vector<PoolTile> tiles;                     // per variant

  const char* kind() const override { return "maxpool"; }

  void init(const OrtKernelInfo* info) override {
    if (prog.outputs.size() != 1)
      throw Error("the program has " + std::to_string(prog.outputs.size()) + " outputs, expected 1");
    read_pool_params(info, /*required=*/true, &pool);
    lay = read_pool_layouts(info);
  }

  void read_meta(const Json& j, size_t n_inputs) override {
    cuda::check_n_extras(j, n_inputs);
    cuda::read_xy_layouts(j, &meta_x_nhwc, &meta_y_nhwc);
  }

  // The block keys say which kernel the variant is, and so its grid.
  void read_variant(const Json& vj, const std::string& where, Variant*) override {
    PoolTile t;
    if (vj.get("block_oh")) {
      t.grid = PoolGrid::ROWS;
      t.block_oh = cuda::meta_positive(vj, "block_oh", where);
      t.block_ow = cuda::meta_positive(vj, "block_ow", where);
    } else if (vj.get("block_p")) {
      t.grid = PoolGrid::PIXELS;
      t.block_p = cuda::meta_positive(vj, "block_p", where);
      t.block_c = cuda::meta_positive(vj, "block_c", where);
    } else {
      t.block = cuda::meta_positive(vj, "block", where);
    }
    tiles.push_back(t);
  }

  // The node's layouts and the kernel's must agree (docs/format.md, FusedMaxPool).
  void check_meta() override {
    if (!meta_error.empty()) return;
    if (lay.x_nhwc != meta_x_nhwc || lay.y_nhwc != meta_y_nhwc)
      meta_error = cuda::xy_layout_mismatch(lay.x_nhwc, lay.y_nhwc, meta_x_nhwc, meta_y_nhwc);
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 1, /*f32_for_half=*/false);
    const Shape xs = pool_input_shape(t[0].shape, lay.x_nhwc);  // logical [N, C, H, W]
    for (size_t i = 1; i < t.size(); ++i)
      check_extra(i, static_cast<int>(i), t[i].shape, xs,
                  lay.x_nhwc ? "X's logical shape (x_layout NHWC) [N, C, H, W] =" : "X's shape");
    const Shape out_shape = pool_shape(pool, xs);
    const TensorRef y = layer_output(prog, ctx, /*f32_for_half=*/false, pool_y_shape(out_shape, lay.y_nhwc));
    const int64_t n_out = numel(out_shape);
    if (n_out == 0) return;
    const Target tg = target(ctx);

    int64_t largest = n_out;
    const std::vector<const void*> ptrs = cuda::layer_pointers(t, y, &largest);

    // docs/format.md, kind maxpool: pointers, int32 N C H W OH OW (the logical sizes in any
    // layout), 4 strides per extra over [N, C, H, W].
    Params& p = thread_params();
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(xs[0], "N");
    p.i32(xs[1], "C");
    p.i32(xs[2], "H");
    p.i32(xs[3], "W");
    p.i32(out_shape[2], "OH");
    p.i32(out_shape[3], "OW");
    for (size_t i = 1; i < t.size(); ++i)
      for (int64_t st : broadcast_strides(t[i].shape, xs)) p.i32(st, "an extra input's stride");
    p.scratch();

    const int v = choose_variant(tg, ptrs, n_out, largest, xs[1], xs[3]);
    const PoolTile& var = tiles[v];
    const int64_t n = xs[0], c = xs[1], oh = out_shape[2], ow = out_shape[3];
    switch (var.grid) {
      case PoolGrid::FLAT: launch(tg, v, ceil_div(n_out, var.block), 1, p); break;
      case PoolGrid::ROWS:
        launch(tg, v, n * c * ceil_div(oh, var.block_oh) * ceil_div(ow, var.block_ow), 1, p);
        break;
      case PoolGrid::PIXELS: launch(tg, v, ceil_div(n * oh * ow, var.block_p), ceil_div(c, var.block_c), p); break;
    }
  }
};

}  // namespace

void append_maxpool_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<MaxPoolKernel>(1, cuda::create_kernel<MaxPoolKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_maxpool_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
