// CUDA kernel of onnxfuse::FusedRows (docs/format.md, "FusedRows", kernel_meta kind "rows"):
// launches the node's embedded Triton kernel.
//
// Launch: pointers to the inputs (the prologue's, then the epilogue's extras) and outputs
// (the epilogue's, then x with x_output), int32 n_rows and n_cols, and when some input is
// "strided" the `axis` leading sizes, then per strided input its `axis` leading strides and
// its stride along the row (1, or 0 when it is the same for the whole row); the two scratch
// pointers. Grid: ceil(n_rows / block_m) programs. A variant takes rows of exactly `cols`
// elements, or at most `max_cols` (0: any); rows are addressed in 64 bits in the kernel.
// group_norm: a row is one (image, group), n_rows = N * groups, n_cols = C / groups * pixels;
// inputs read per channel, per image and channel or per image need no parameters (C and the
// groups are compiled in; kernel_meta's "groups", "channels" and "channels_last" say so).
// A variant with "split": S launches S programs per row (grid ceil(n_rows / block_m) * S),
// taken only for at most "max_rows" rows.
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include "rows.h"

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;

enum class RowMode { FULL, LAST, SCALAR, STRIDED, CHANNEL, BATCH_CHANNEL, BATCH };

// A variant's tile and the row lengths it takes (its kernel_meta keys besides "requires").
struct RowsTile {
  int64_t block_m = 1, block_n = 1;
  int64_t cols = 0;      // compiled for rows of exactly this many elements; 0: any
  int64_t max_cols = 0;  // rows of at most this many elements; 0: any
  int64_t split = 1;     // group_norm: programs per row
  int64_t max_rows = 0;  // launches of at most this many rows; 0: any
};

const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::LAYER_NORM: return "layer_norm";
    case Reduction::RMS_NORM: return "rms_norm";
    case Reduction::SOFTMAX: return "softmax";
    case Reduction::LOG_SOFTMAX: return "log_softmax";
    case Reduction::GROUP_NORM: return "group_norm";
  }
  return "?";
}

struct RowsKernel : cuda::CudaKernel {
  static constexpr const char* kOp = kFusedRows;
  RowsAttrs a;
  std::vector<RowMode> modes;  // per node input, from kernel_meta
  bool any_strided = false;
  std::string meta_reduction;
  int64_t meta_axis = -1, meta_n_prologue = -1, meta_n_extras = -1, meta_x_output = -1;
  int64_t meta_groups = 0, meta_channels = 0, meta_channels_last = 0;  // group_norm
  std::vector<RowsTile> tiles;  // per variant

  const char* kind() const override { return "rows"; }

  void init(const OrtKernelInfo* info) override { a = read_rows_attrs(info); }

  void read_meta(const Json& j, size_t) override {
    meta_reduction = cuda::meta_str(j, "reduction", "kernel_meta");
    meta_axis = cuda::meta_int(j, "axis", "kernel_meta");
    meta_n_prologue = cuda::meta_int(j, "n_prologue", "kernel_meta");
    meta_n_extras = cuda::meta_int(j, "n_extras", "kernel_meta");
    meta_x_output = cuda::meta_int(j, "x_output", "kernel_meta", false, 0);
    meta_groups = cuda::meta_int(j, "groups", "kernel_meta", false, 0);
    meta_channels = cuda::meta_int(j, "channels", "kernel_meta", false, 0);
    meta_channels_last = cuda::meta_int(j, "channels_last", "kernel_meta", false, 0);
    for (const Json& m : cuda::meta_array(j, "input_modes", "kernel_meta").arr) {
      if (m.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
      if (m.str == "full") modes.push_back(RowMode::FULL);
      else if (m.str == "last") modes.push_back(RowMode::LAST);
      else if (m.str == "scalar") modes.push_back(RowMode::SCALAR);
      else if (m.str == "strided") modes.push_back(RowMode::STRIDED), any_strided = true;
      else if (m.str == "channel") modes.push_back(RowMode::CHANNEL);
      else if (m.str == "batch_channel") modes.push_back(RowMode::BATCH_CHANNEL);
      else if (m.str == "batch") modes.push_back(RowMode::BATCH);
      else throw Error("kernel_meta: unknown input mode \"" + m.str + "\"");
    }
  }

  void read_variant(const Json& vj, const std::string& where, Variant*) override {
    RowsTile t;
    t.block_m = cuda::meta_positive(vj, "block_m", where);
    t.block_n = cuda::meta_positive(vj, "block_n", where);
    t.cols = std::max<int64_t>(0, cuda::meta_int(vj, "cols", where, false, 0));
    t.max_cols = std::max<int64_t>(0, cuda::meta_int(vj, "max_cols", where, false, 0));
    t.split = std::max<int64_t>(1, cuda::meta_int(vj, "split", where, false, 1));
    t.max_rows = std::max<int64_t>(0, cuda::meta_int(vj, "max_rows", where, false, 0));
    tiles.push_back(t);
  }

  // The node and its kernel_meta must describe the same kernel.
  void check_meta() override {
    if (!meta_error.empty()) return;
    if (meta_reduction != reduction_name(a.reduction) || meta_axis != a.axis ||
        meta_n_prologue != static_cast<int64_t>(a.n_prologue()) ||
        meta_n_extras != static_cast<int64_t>(a.n_extras()) || (meta_x_output != 0) != a.x_output ||
        modes.size() != a.n_inputs() || meta_groups != a.groups || (meta_channels_last != 0) != a.channels_last)
      meta_error = "kernel_meta (" + meta_reduction + ", axis " + std::to_string(meta_axis) + ", n_prologue " +
                   std::to_string(meta_n_prologue) + ", n_extras " + std::to_string(meta_n_extras) + ", x_output " +
                   std::to_string(meta_x_output) + ", " + std::to_string(modes.size()) +
                   " input_modes) does not describe this node (" + reduction_name(a.reduction) + ", axis " +
                   std::to_string(a.axis) + ", " + std::to_string(a.n_prologue()) + " prologue and " +
                   std::to_string(a.n_extras()) + " epilogue inputs, x_output " + std::to_string(a.x_output ? 1 : 0) +
                   ", groups " + std::to_string(a.groups) + " (kernel_meta " + std::to_string(meta_groups) +
                   "), channels_last " + std::to_string(a.channels_last ? 1 : 0) + ")";
  }

  // Row offsets are 64-bit in the kernel: tensors are not limited to 2^31 elements (each int
  // parameter is checked to fit 32 bits as it is packed).
  bool int32_params() const override { return false; }

  // Input i read in its mode over x's shape xs: its shape checked; for "strided", its
  // leading strides and its stride along the row pushed to p.
  void check_mode(size_t i, const Shape& s, const Shape& xs, int64_t n_cols, Params* p) const {
    const std::string what = "input " + std::to_string(i) + " has shape " + shape_str(s) + ", its kernel reads it ";
    const Shape norm(xs.begin() + a.axis, xs.end());
    switch (modes[i]) {
      case RowMode::FULL:
        if (numel(s) != numel(xs)) throw Error(what + "in mode 'full', which needs x's shape " + shape_str(xs));
        return;
      case RowMode::SCALAR:
        if (numel(s) != 1) throw Error(what + "in mode 'scalar', which needs one element");
        return;
      case RowMode::CHANNEL:
      case RowMode::BATCH_CHANNEL:
      case RowMode::BATCH: {  // group_norm: [C], [N, C] or [N] values, as their NCHW shapes say
        const int64_t want = modes[i] == RowMode::CHANNEL ? meta_channels
                             : modes[i] == RowMode::BATCH ? xs[0] : xs[0] * meta_channels;
        if (numel(s) != want)
          throw Error(what + "per channel / image (" + std::to_string(want) + " elements) for x " + shape_str(xs));
        return;
      }
      case RowMode::LAST:
        if (numel(s) != n_cols)
          throw Error(what + "in mode 'last', which needs the shape of x's normalized dims " + shape_str(norm));
        return;
      case RowMode::STRIDED: {
        if (!p) return;
        const Shape st = broadcast_strides(s, xs);
        const size_t ax = static_cast<size_t>(a.axis);
        const size_t off = xs.size() - std::min(s.size(), xs.size());
        bool all = true, none = true;  // along the row: every normalized dim read in full, or none
        for (size_t d = ax; d < xs.size(); ++d) {
          const int64_t dim = d >= off ? s[d - off] : 1;
          all &= dim == xs[d];
          none &= dim == 1;
        }
        if (!all && !none)
          throw Error(what + "in mode 'strided', which needs it to span x's normalized dims " + shape_str(norm) +
                      " or be 1 along all of them");
        for (size_t d = 0; d < ax; ++d) p->i32(st[d], "a strided input's stride");
        p->i32(none ? 0 : 1, "a strided input's stride along the row");
        return;
      }
    }
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_rows_inputs(a, ctx, /*f32_for_half=*/false);
    const Shape xs = rows_x_shape(a, t);
    const std::vector<TensorRef> out = rows_outputs(a, ctx, xs, /*f32_for_half=*/false);
    const int64_t total = numel(xs);
    if (total == 0) return;
    const bool group = a.reduction == Reduction::GROUP_NORM;
    if (group && (a.channels_last ? xs.back() : xs[1]) != meta_channels)
      throw Error("x has shape " + shape_str(xs) + ", the kernel was compiled for " + std::to_string(meta_channels) +
                  " channels");
    int64_t n_rows = group ? xs[0] * a.groups : 1;  // group_norm: one row per (image, group)
    for (int64_t d = 0; !group && d < a.axis; ++d) n_rows *= xs[d];
    const int64_t n_cols = total / n_rows;
    for (size_t i = 0; i < t.size(); ++i) check_mode(i, t[i].shape, xs, n_cols, nullptr);
    const Target tg = target(ctx);

    Params& p = thread_params();
    std::vector<const void*> ptrs;
    for (const TensorRef& x : t) ptrs.push_back(x.data);
    for (const TensorRef& y : out) ptrs.push_back(y.data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(n_rows, "the number of rows");
    p.i32(n_cols, "the row length");
    if (any_strided) {
      for (int64_t d = 0; d < a.axis; ++d) p.i32(xs[d], "a leading dim");
      for (size_t i = 0; i < t.size(); ++i)
        if (modes[i] == RowMode::STRIDED) check_mode(i, t[i].shape, xs, n_cols, &p);
    }
    p.scratch();
    const int v = choose(tg, ptrs, n_rows, n_cols);
    launch(tg, v, (n_rows + tiles[v].block_m - 1) / tiles[v].block_m * tiles[v].split, 1, p);
  }

  // The first variant with a binary for this device that takes the row length (and, a split
  // variant, the row count) and whose requirements (the pointers' alignment) hold.
  int choose(const Target& tg, const std::vector<const void*>& ptrs, int64_t n_rows, int64_t n_cols) const {
    for (size_t v = 0; v < tiles.size(); ++v) {
      const RowsTile& tile = tiles[v];
      if ((tile.cols > 0 && tile.cols != n_cols) || (tile.max_cols > 0 && n_cols > tile.max_cols)) continue;
      if (tile.max_rows > 0 && n_rows > tile.max_rows) continue;
      const int found = find_variant_at(tg, ptrs, v);
      if (found >= 0) return found;
    }
    throw Error("kernel " + meta.name + ": no variant with a binary for this GPU takes rows of " +
                std::to_string(n_cols) + " elements at these addresses; embedded: " + meta.embedded());
  }

  // v when it has a binary for this device and its requirements hold, else -1.
  int find_variant_at(const Target& tg, const std::vector<const void*>& ptrs, size_t v) const {
    if (!tg.L->fn[v]) return -1;
    const Variant& var = meta.variants[v];
    for (const void* q : ptrs)
      if (reinterpret_cast<uintptr_t>(q) % static_cast<uint64_t>(var.ptr_align) != 0) return -1;
    return static_cast<int>(v);
  }
};

}  // namespace

void append_rows_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<RowsKernel>(1, cuda::create_kernel<RowsKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_rows_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
