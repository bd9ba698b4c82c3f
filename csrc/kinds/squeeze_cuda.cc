// CUDA kernel of onnxfuse::FusedSqueezeExcite (docs/format.md, "FusedSqueezeExcite",
// kernel_meta kind "squeeze_excite"): one launch of grid (N, SPLIT), each program summing a
// CHUNK of pixels of one image into the workspace; the last program of an image to arrive
// (its counter) finishes the pool, FC1, the activation, FC2 and the gate. The workspace and
// the counters are split K's (cuda::SplitBuffers: N tiles of C sums), lent by the CUDA EP.
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <algorithm>

#include "conv.h"
#include "squeeze.h"

namespace onnxfuse {

namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;

// A variant's block sizes: BLOCK_P pixels by BLOCK_C channels per step of the sum; MIN_CHUNK
// the fewest pixels worth a program of their own and MAX_SPLIT the most programs per image
// (the kernel reads their partial sums as one tile of that many rows): the launcher's split, below.
struct SqueezeTile {
  int64_t block_p = 0, block_c = 0, min_chunk = 0, max_split = 0;
};

struct SqueezeKernel : cuda::CudaKernel {
  static constexpr const char* kOp = "FusedSqueezeExcite";
  Program gate;
  PoolLayouts lay;
  int64_t channels = 0, hidden = 0;               // kernel_meta: C and CR, compile-time constants
  bool meta_x_nhwc = false, meta_y_nhwc = false;  // kernel_meta's layouts ("nchw" when absent)
  std::vector<SqueezeTile> tiles;                 // per variant

  const char* kind() const override { return "squeeze_excite"; }

  void init(const OrtKernelInfo* info) override {
    gate = read_squeeze_gate(info, prog);
    lay = read_pool_layouts(info);
  }

  void read_meta(const Json& j, size_t) override {
    channels = cuda::meta_positive(j, "channels", "kernel_meta");
    hidden = cuda::meta_positive(j, "hidden", "kernel_meta");
    cuda::read_xy_layouts(j, &meta_x_nhwc, &meta_y_nhwc);
  }

  void read_variant(const Json& vj, const std::string& where, Variant*) override {
    SqueezeTile t;
    t.block_p = cuda::meta_positive(vj, "block_p", where);
    t.block_c = cuda::meta_positive(vj, "block_c", where);
    t.min_chunk = cuda::meta_positive(vj, "min_chunk", where);
    t.max_split = cuda::meta_positive(vj, "max_split", where);
    tiles.push_back(t);
  }

  // The node's layouts and the kernel's must agree, as FusedMaxPool's: the kernel addresses X
  // in the layout it was compiled for (Y's two layouts are the same bytes, but a y_layout
  // other than kernel_meta's still means the node and its kernel disagree).
  void check_meta() override {
    if (!meta_error.empty()) return;
    if (lay.x_nhwc != meta_x_nhwc || lay.y_nhwc != meta_y_nhwc)
      meta_error = cuda::xy_layout_mismatch(lay.x_nhwc, lay.y_nhwc, meta_x_nhwc, meta_y_nhwc);
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_squeeze_inputs(ctx, prog, lay.x_nhwc, /*f32_for_half=*/false);
    // C and CR are the kernel's constants: the weights' shapes must be the ones it was compiled for
    if (t[1].shape != Shape{hidden, channels})
      throw Error("input 1 (W1) has shape " + shape_str(t[1].shape) + ", the kernel was compiled for [CR, C] = [" +
                  std::to_string(hidden) + ", " + std::to_string(channels) + "] (kernel_meta hidden, channels)");
    const Shape xs = pool_input_shape(t[0].shape, lay.x_nhwc);  // logical [N, C, H, W]
    const int64_t N = xs[0], C = xs[1], HW = xs[2] * xs[3];
    const Shape ys = lay.y_nhwc ? Shape{N, 1, 1, C} : Shape{N, C, 1, 1};  // the same bytes
    const TensorRef y = layer_output(gate, ctx, /*f32_for_half=*/false, ys);
    if (N == 0) return;
    const Target tg = target(ctx);

    int64_t largest = N * C;
    const std::vector<const void*> ptrs = cuda::layer_pointers(t, y, &largest);  // x, w1, b1, w2, b2, y
    const int v = choose_variant(tg, ptrs, N * C, largest, C);
    const SqueezeTile& tile = tiles[v];

    // docs/format.md, kind squeeze_excite: S programs per image, enough to fill the SMs twice
    // over but none with fewer than min_chunk pixels, and at most max_split; CHUNK a multiple
    // of block_p (the kernel's step); SPLIT the programs that CHUNK then needs (at least one:
    // H·W = 0 still launches, and the mean is NaN; never more than S).
    const int64_t S = std::max<int64_t>(
        1, std::min({ceil_div(2 * tg.L->sms, N), ceil_div(HW, tile.min_chunk), tile.max_split}));
    const int64_t CHUNK = std::max(tile.block_p, tile.block_p * ceil_div(ceil_div(HW, S), tile.block_p));
    const int64_t SPLIT = std::max<int64_t>(1, ceil_div(HW, CHUNK));
    if (SPLIT * N * C > INT32_MAX)
      throw Error("the workspace of SPLIT * N * C = " + std::to_string(SPLIT) + " * " + std::to_string(N) + " * " +
                  std::to_string(C) + " sums is too large for the kernel's 32-bit offsets");
    // [N] int32 arrival counters (zeroed here), then [SPLIT, N, C] fp32 partial sums
    const cuda::SplitBuffers sb(ctx, tg.L->device, N, SPLIT, C);
    if (!sb.ok())
      throw Error("the CUDA execution provider lent no workspace for FusedSqueezeExcite (" +
                  std::to_string(SPLIT * N * C * 4) + " bytes of partial sums and " + std::to_string(N) +
                  " arrival counters)");

    Params& p = thread_params();
    for (const void* ptr : ptrs) p.ptr(ptr);
    sb.pass(tg.stream, meta.name, p);  // ws_ptr, cnt_ptr
    p.i32(N, "N");
    p.i32(HW, "H*W");
    p.i32(CHUNK, "CHUNK");
    p.scratch();
    // sb goes back to the EP's arena on return: later work on this stream reuses it in order
    launch(tg, v, N, SPLIT, p);
  }
};

}  // namespace

void append_squeeze_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<SqueezeKernel>(5, cuda::create_kernel<SqueezeKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_squeeze_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
