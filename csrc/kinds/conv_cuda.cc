// CUDA kernel of onnxfuse::FusedConv (docs/format.md, "FusedConv", kernel_meta kind
// "conv"): the layer's checks, int32 parameters N H W P Q OP OQ and the extras' strides, a
// grid of BLOCK_M x BLOCK_N tiles, split K where the plain tiles would leave most SMs idle
// (the workspace lent by the CUDA EP), else the small-M variant where M is at most its
// max_m.
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <algorithm>
#include <cmath>

#include "conv.h"

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;

// A variant's tile: BLOCK_M output positions x BLOCK_N output channels.
struct Tile {
  int64_t block_m = 0;
  int64_t block_n = 0;
};

struct ConvKernel : cuda::CudaKernel {
  static constexpr const char* kOp = "FusedConv";
  ConvParams conv;
  bool has_pool = false;
  PoolParams pool;
  ConvLayouts lay;
  // kernel_meta: the pool window (PH, PW) when the max pool runs in the epilogue; the
  // layouts the kernel was compiled for ("x_layout", "y_layout": "nchw" when absent;
  // "w_layout": "rsck"; "extra_layouts": all 0), as the node's attributes must say
  bool meta_pool = false;
  int64_t pool_window[2] = {1, 1};
  bool meta_x_nhwc = false, meta_y_nhwc = false, meta_w_krsc = false;
  std::vector<int64_t> meta_extra_layouts;
  std::vector<Tile> tiles;  // per variant

  const char* kind() const override { return "conv"; }

  void init(const OrtKernelInfo* info) override {
    if (prog.outputs.size() != 1)
      throw Error("the program has " + std::to_string(prog.outputs.size()) + " outputs, expected 1");
    if (prog.inputs.empty()) throw Error("the program has no inputs (its %0 is the conv output)");
    conv = read_conv_params(info);
    has_pool = read_pool_params(info, /*required=*/false, &pool);
    lay = read_conv_layouts(info, prog.inputs.size() - 1);
  }

  void read_meta(const Json& j, size_t n_inputs) override {
    cuda::check_n_extras(j, n_inputs);
    cuda::read_xy_layouts(j, &meta_x_nhwc, &meta_y_nhwc);
    const Json* pool_j = j.get("pool_in_epilogue");
    if (pool_j && pool_j->kind != Json::NUL) {
      if (pool_j->kind != Json::ARRAY || pool_j->arr.size() != 2)
        throw Error("kernel_meta: pool_in_epilogue must be null or [PH, PW]");
      for (int d = 0; d < 2; ++d) {
        const Json& v = pool_j->arr[d];
        if (v.kind != Json::NUMBER || v.num != std::floor(v.num) || v.num < 1 || v.num > 65536)
          throw Error("kernel_meta: pool_in_epilogue must be null or [PH, PW] of positive integers");
        pool_window[d] = static_cast<int64_t>(v.num);
      }
      meta_pool = true;
    }
    if (const Json* v = j.get("w_layout")) {
      if (v->kind != Json::STRING || (v->str != "rsck" && v->str != "krsc"))
        throw Error("kernel_meta: w_layout must be \"rsck\" or \"krsc\"");
      meta_w_krsc = v->str == "krsc";
    }
    meta_extra_layouts.assign(n_inputs - 1, 0);
    if (const Json* el = j.get("extra_layouts")) {
      if (el->kind != Json::ARRAY || el->arr.size() != n_inputs - 1)
        throw Error("kernel_meta: extra_layouts must be a list of " + std::to_string(n_inputs - 1) +
                    " numbers (one per extra input)");
      for (size_t e = 0; e < el->arr.size(); ++e) {
        const Json& v = el->arr[e];
        if (v.kind != Json::NUMBER || (v.num != 0 && v.num != 1))
          throw Error("kernel_meta: extra_layouts must hold 0 (as is) or 1 (NHWC)");
        meta_extra_layouts[e] = static_cast<int64_t>(v.num);
      }
    }
  }

  void read_variant(const Json& vj, const std::string& where, Variant* var) override {
    Tile t;
    t.block_m = cuda::meta_positive(vj, "block_m", where);
    t.block_n = cuda::meta_positive(vj, "block_n", where);
    if (vj.get("split")) var->split = cuda::meta_positive(vj, "split", where);
    if (vj.get("max_m")) var->max_m = cuda::meta_positive(vj, "max_m", where);
    if (var->split > 1 && var->max_m > 0)
      throw Error("kernel_meta: " + where + " has both split and max_m (a split-K variant has no M limit)");
    tiles.push_back(t);
  }

  void check_meta() override {
    check_pool_meta();
    check_layout_meta();
  }

  // The node's layouts and the kernel's must agree: the kernel addresses X, W and Y in the
  // layouts it was compiled for (docs/format.md, FusedConv, Layouts).
  void check_layout_meta() {
    if (!meta_error.empty()) return;
    if (lay.x_nhwc != meta_x_nhwc || lay.y_nhwc != meta_y_nhwc)
      meta_error = cuda::xy_layout_mismatch(lay.x_nhwc, lay.y_nhwc, meta_x_nhwc, meta_y_nhwc);
    else if (lay.extra != meta_extra_layouts)
      meta_error = "the node has extra_layouts " + ints_str(lay.extra.data(), lay.extra.size()) +
                   ", its kernel_meta has extra_layouts " +
                   ints_str(meta_extra_layouts.data(), meta_extra_layouts.size()) + " (absent: all 0)";
    else if (lay.w_krsc != meta_w_krsc)
      meta_error = std::string("the node has w_layout ") + w_layout_name(lay.w_krsc) +
                   ", its kernel_meta has w_layout \"" + (meta_w_krsc ? "krsc" : "rsck") + "\" (absent: \"rsck\")";
  }

  // The node's pool and the kernel's must agree: the kernel pools in its epilogue, which
  // needs windows that tile the conv output (docs/format.md, FusedConv).
  void check_pool_meta() {
    if (!meta_error.empty()) return;
    if (has_pool != meta_pool) {
      meta_error = has_pool ? "the node has pool_* attributes, its kernel_meta has no pool_in_epilogue"
                            : "the node has no pool_* attributes, its kernel_meta has pool_in_epilogue";
      return;
    }
    if (!has_pool) return;
    const bool tiles = pool.kernel[0] == pool.strides[0] && pool.kernel[1] == pool.strides[1] &&
                       pool.pads[0] == 0 && pool.pads[1] == 0 && pool.pads[2] == 0 && pool.pads[3] == 0 &&
                       pool.dilations[0] == 1 && pool.dilations[1] == 1 && !pool.ceil_mode;
    if (!tiles || pool.kernel[0] != pool_window[0] || pool.kernel[1] != pool_window[1])
      meta_error = "the node's max pool (pool_kernel " + ints_str(pool.kernel, 2) + ", pool_strides " +
                   ints_str(pool.strides, 2) + ", pool_pads " + ints_str(pool.pads, 4) + ", pool_dilations " +
                   ints_str(pool.dilations, 2) + ", pool_ceil_mode " + std::to_string(pool.ceil_mode ? 1 : 0) +
                   ") is not the kernel's pool_in_epilogue " + ints_str(pool_window, 2) +
                   " with windows that tile the conv output";
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 3, /*f32_for_half=*/false);
    const ConvShapes s =
        conv_shapes(conv, has_pool ? &pool : nullptr, t[0].shape, t[1].shape, t[2].shape, lay.x_nhwc, lay.w_krsc);
    const Shape conv_out = s.conv_out();
    for (size_t i = 3; i < t.size(); ++i)
      check_conv_extra(i, static_cast<int>(i - 2), t[i].shape, lay.extra_nhwc(i - 3), conv_out);
    const TensorRef y = layer_output(prog, ctx, /*f32_for_half=*/false, s.y_shape(lay.y_nhwc));
    const int64_t n_out = numel(s.out());
    // M: the output positions the kernel computes (with the pool: the windows' positions,
    // each window padded to a power of two of rows)
    int64_t win = 1;
    while (win < pool_window[0] * pool_window[1]) win *= 2;
    const int64_t m = meta_pool ? s.N * s.OP * s.OQ * win : s.N * s.P * s.Q;
    if (n_out == 0 || m == 0) return;
    const Target tg = target(ctx);

    int64_t largest = std::max(numel(conv_out), n_out);
    const std::vector<const void*> ptrs = cuda::layer_pointers(t, y, &largest);

    // docs/format.md, kind conv: pointers, int32 N H W P Q OP OQ (whatever the layouts:
    // the kernel addresses X, W and Y in its compiled layouts), then each extra input's 4
    // strides over [N, K, P, Q] (an NHWC extra's permuted).
    Params& p = thread_params();
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(s.N, "N");
    p.i32(s.H, "H");
    p.i32(s.W, "W");
    p.i32(s.P, "P");
    p.i32(s.Q, "Q");
    p.i32(s.OP, "OP");
    p.i32(s.OQ, "OQ");
    for (size_t i = 3; i < t.size(); ++i)
      for (int64_t st : conv_extra_strides(t[i].shape, lay.extra_nhwc(i - 3), conv_out))
        p.i32(st, "an extra input's stride");

    // Split K where the split variant's tiles number at most half the SMs (codegen_conv: a
    // small M, typically a deep layer at batch 1) and the EP lends a workspace; otherwise
    // the small-M variant or the plain one (below).
    const int sv = find_variant(tg, ptrs, n_out, largest, 0, 0, /*split=*/true);
    if (sv >= 0) {
      const Variant& var = meta.variants[sv];
      const Tile& tile = tiles[sv];
      const int64_t gx = (m + tile.block_m - 1) / tile.block_m, gy = (s.K + tile.block_n - 1) / tile.block_n;
      if (2 * gx * gy <= tg.L->sms) {
        // [tiles] int32 arrival counters (zeroed here), then [split, tiles, BLOCK_M * BLOCK_N] fp32 partials
        const cuda::SplitBuffers sb(ctx, tg.L->device, gx * gy, var.split, tile.block_m * tile.block_n);
        if (sb.ok()) {
          sb.pass(tg.stream, meta.name, p);
          p.scratch();
          launch(tg, sv, gx, gy, p, var.split);
          return;  // sb goes back to the EP's arena: later work on this stream reuses it in order
        }
      }
    }
    p.scratch();
    // Else the small-M variant (kernel_meta "max_m", a 16-row tile) where M is at most its
    // max_m (BENCHMARKS.md, Decisions, conv-small-m); otherwise the plain one.
    int v = find_variant(tg, ptrs, n_out, largest, 0, 0, /*split=*/false, m);
    if (v < 0) v = choose_variant(tg, ptrs, n_out, largest);
    const Tile& tile = tiles[v];
    launch(tg, v, (m + tile.block_m - 1) / tile.block_m, (s.K + tile.block_n - 1) / tile.block_n, p);
  }
};

}  // namespace

void append_conv_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<ConvKernel>(3, cuda::create_kernel<ConvKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_conv_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
