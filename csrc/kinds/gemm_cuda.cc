// CUDA kernel of onnxfuse::GemmEpilogue (docs/format.md, "GemmEpilogue", kernel_meta kind
// "gemm"): launches the node's embedded Triton GEMM.
//
// Launch: pointers to A, B, the epilogue's extras and Y; int32 M, N, K, stride_ag,
// stride_a, stride_bg, stride_b (the operands' batch strides, 0 for one shared by every
// GEMM, and the stride of their non-contiguous dim), then per "strided" extra its three
// strides over Y's [G, M, N] view; for a split-K variant ws_ptr and cnt_ptr; the two scratch
// pointers. A batched A times a 2-D B (no trans_a) runs as one GEMM of M = batch * rows (G = 1).
// Grid: (ceil(M / block_m) * ceil(N / block_n), G), and the K slices on z for split K: the
// variant is taken where its tiles · G are at most half the SMs, with min("split", SMs / (tiles
// · G), K blocks) slices (evened out so that none is empty), its workspace lent by the CUDA EP
// (codegen_gemm's module docstring).
//
// A "library" variant (kernel_meta {"library": "cublaslt", "activation", "bias", for float32
// "precision", and "rank", which of the heuristic's algorithms, default 0: its first}) has no
// binary: cuBLASLt runs the product with its own epilogue
// (csrc/cublaslt.h), where the product is one GEMM (G = 1) of 16-bit operands (float32 ones
// where the variant has a precision), the bias (if any) a contiguous row of N values 16-byte
// aligned and cuBLASLt has an algorithm for it; else the next variant runs.
#include "cublaslt.h"
#include "cuda_driver.h"
#include "gemm.h"

#ifdef ONNXFUSE_WITH_CUDA

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;


enum class ExtraMode { FULL, ROW, SCALAR, STRIDED };

constexpr int64_t kMaxSlices = 65535;  // split K: CUDA's grid z limit
constexpr int64_t kMaxRank = 16;       // a library variant's algorithm: one of the heuristic's first 16

// A variant's tile and the launcher's own requirements (kernel_meta keys besides "requires").
struct GemmTile {
  bool library = false;  // cuBLASLt (act, bias), not a binary
  cublaslt::Activation act = cublaslt::Activation::NONE;
  int64_t bias = -1;  // the extra input (0-based) cuBLASLt adds as its bias; -1: none
  std::string precision;  // float32 products: "tf32" or "ieee" (empty: 16-bit only)
  int64_t rank = 0;       // cuBLASLt's algorithm: its heuristic's first (0) or the (rank + 1)-th
  int64_t block_m = 1, block_n = 1;
  int64_t block_k = 0;          // read for split-K variants (their K blocks), else 0
  int64_t stride_multiple = 1;  // the strides passed, N and K are multiples of this (hinted to the compiler)
  int64_t max_m = 0;            // for GEMMs of at most this many rows; 0: any
};

// The stride of Y's dims [lo, hi) as one index, for an input with these per-dim strides
// over Y (0 on broadcast dims); throws when they do not collapse to one.
int64_t collapse_dims(const Shape& y, const Shape& st, size_t lo, size_t hi, size_t input) {
  int64_t inner = -1, inner_size = 1;
  bool zero = true, stacked = true;
  for (size_t d = hi; d-- > lo;) {
    if (y[d] == 1) continue;
    zero &= st[d] == 0;
    if (inner >= 0) stacked &= st[d] == inner * inner_size;
    inner = st[d];
    inner_size = y[d];
  }
  if (zero) return 0;
  if (!stacked)
    throw Error("input " + std::to_string(input) + " does not broadcast over the product as [batch, rows, columns]");
  // the collapsed index's stride is the innermost live dim's
  for (size_t d = hi; d-- > lo;)
    if (y[d] != 1) return st[d];
  return 0;
}

struct GemmKernel : cuda::CudaKernel {
  static constexpr const char* kOp = kGemmEpilogue;
  bool trans_a = false, trans_b = false;
  float alpha = 1.0f;  // the node's alpha (the Triton kernels have it compiled in; cuBLASLt takes it)
  int64_t meta_trans_a = -1, meta_trans_b = -1;
  std::vector<ExtraMode> modes;  // per extra input, from kernel_meta
  std::vector<GemmTile> tiles;   // per variant
  cublaslt::Matmuls blas;        // the library variants' plans

  const char* kind() const override { return "gemm"; }

  void init(const OrtKernelInfo* info) override {
    int64_t v = 0;
    if (get_int_attr(info, "trans_a", &v)) trans_a = v != 0;
    if (get_int_attr(info, "trans_b", &v)) trans_b = v != 0;
    get_float_attr(info, "alpha", &alpha);
  }

  void read_meta(const Json& j, size_t n_inputs) override {
    cuda::check_n_extras(j, n_inputs);
    meta_trans_a = cuda::meta_int(j, "trans_a", "kernel_meta");
    meta_trans_b = cuda::meta_int(j, "trans_b", "kernel_meta");
    for (const Json& m : cuda::meta_array(j, "input_modes", "kernel_meta").arr) {
      if (m.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
      if (m.str == "full") modes.push_back(ExtraMode::FULL);
      else if (m.str == "row") modes.push_back(ExtraMode::ROW);
      else if (m.str == "scalar") modes.push_back(ExtraMode::SCALAR);
      else if (m.str == "strided") modes.push_back(ExtraMode::STRIDED);
      else throw Error("kernel_meta: unknown input mode \"" + m.str + "\"");
    }
  }

  void read_variant(const Json& vj, const std::string& where, Variant* var) override {
    GemmTile t;
    if (vj.get("library")) {
      const std::string lib = cuda::meta_str(vj, "library", where);
      if (lib != "cublaslt") throw Error("kernel_meta: " + where + ".library \"" + lib + "\" is unknown");
      const std::string act = cuda::meta_str(vj, "activation", where);
      if (act == "none") t.act = cublaslt::Activation::NONE;
      else if (act == "relu") t.act = cublaslt::Activation::RELU;
      else if (act == "gelu") t.act = cublaslt::Activation::GELU;
      else throw Error("kernel_meta: " + where + ".activation \"" + act + "\" is unknown (none, relu, gelu)");
      t.bias = cuda::meta_int(vj, "bias", where, false, -1);
      if (vj.get("precision")) {
        t.precision = cuda::meta_str(vj, "precision", where);
        if (t.precision != "tf32" && t.precision != "ieee")
          throw Error("kernel_meta: " + where + ".precision \"" + t.precision + "\" is unknown (tf32, ieee)");
      }
      t.rank = cuda::meta_int(vj, "rank", where, false, 0);
      if (t.rank < 0 || t.rank >= kMaxRank)
        throw Error("kernel_meta: " + where + ".rank must be from 0 to " + std::to_string(kMaxRank - 1));
      t.library = var->library = true;
      tiles.push_back(t);
      return;
    }
    t.block_m = cuda::meta_positive(vj, "block_m", where);
    t.block_n = cuda::meta_positive(vj, "block_n", where);
    t.stride_multiple = std::max<int64_t>(1, cuda::meta_int(vj, "stride_multiple", where, false, 1));
    t.max_m = std::max<int64_t>(0, cuda::meta_int(vj, "max_m", where, false, 0));
    // "split": S > 1, a split-K kernel run with at most S slices on the grid's z (0 or 1: none)
    const int64_t split = cuda::meta_int(vj, "split", where, false, 0);
    if (split < 0 || split > kMaxSlices)
      throw Error("kernel_meta: " + where + ".split must be from 2 to " + std::to_string(kMaxSlices) +
                  " (the most K slices of a split-K variant; 0, 1 or absent: none), not " + std::to_string(split));
    if (split > 1) {
      if (t.max_m > 0)
        throw Error("kernel_meta: " + where + " has both split and max_m (a split-K variant has no M limit)");
      t.block_k = cuda::meta_positive(vj, "block_k", where);
      var->split = split;
    }
    tiles.push_back(t);
  }

  void check_meta() override {
    if (!meta_error.empty()) return;
    if ((meta_trans_a != 0) != trans_a || (meta_trans_b != 0) != trans_b || modes.size() + 1 != prog.inputs.size())
      meta_error = "kernel_meta (trans_a " + std::to_string(meta_trans_a) + ", trans_b " +
                   std::to_string(meta_trans_b) + ", " + std::to_string(modes.size()) +
                   " input_modes) does not describe this node (trans_a " + std::to_string(trans_a ? 1 : 0) +
                   ", trans_b " + std::to_string(trans_b ? 1 : 0) + ", " + std::to_string(prog.inputs.size() - 1) +
                   " extra inputs)";
    if (prog.outputs.size() != 1) meta_error = "the program must have exactly one output";
    for (const GemmTile& t : tiles)
      if (t.library && (t.bias < -1 || t.bias + 1 >= static_cast<int64_t>(prog.inputs.size())))
        meta_error = "kernel_meta: a cuBLASLt variant's bias " + std::to_string(t.bias) + " is not an extra input";
  }

  void check_mode(size_t e, const Shape& s, const GemmGeometry& geo) const {
    const std::string what = "input " + std::to_string(e + 2) + " has shape " + shape_str(s) + ", its kernel reads it ";
    if (broadcast_shapes({geo.y, s}) != geo.y)
      throw Error(what + "broadcast to the product's shape " + shape_str(geo.y) + ", which it does not");
    switch (modes[e]) {
      case ExtraMode::FULL:
        if (numel(s) != numel(geo.y)) throw Error(what + "in mode 'full', which needs the product's shape");
        return;
      case ExtraMode::SCALAR:
        if (numel(s) != 1) throw Error(what + "in mode 'scalar', which needs one element");
        return;
      case ExtraMode::ROW:
        if (numel(s) != geo.n || s.empty() || s.back() != geo.n)
          throw Error(what + "in mode 'row', which needs N = " + std::to_string(geo.n) + " elements along the last dim");
        return;
      case ExtraMode::STRIDED:
        return;
    }
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_gemm_inputs(ctx, prog, /*f32_for_half=*/false);
    const size_t n_in = t.size();
    const GemmGeometry geo = gemm_geometry(t[0].shape, t[1].shape, trans_a, trans_b);
    for (size_t e = 0; e + 2 < n_in; ++e) check_mode(e, t[e + 2].shape, geo);
    OrtValue* yv = nullptr;
    check(g_ort->KernelContext_GetOutput(ctx, 0, geo.y.data(), geo.y.size(), &yv));
    TensorRef y;
    read_tensor(yv, &y);
    if (!type_fits(y.type, prog.outputs[0].second, false))
      throw Error("output 0 is " + std::string(elem_type_name(y.type)) + " in the graph, the program stores " +
                  dtype_name(prog.outputs[0].second));
    if (numel(geo.y) == 0) return;
    const Target tg = target(ctx);

    Params& p = thread_params();
    std::vector<const void*> ptrs;
    int64_t largest = numel(geo.y);
    for (const TensorRef& x : t) {
      ptrs.push_back(x.data);
      largest = std::max(largest, numel(x.shape));
    }
    ptrs.push_back(y.data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(geo.m, "M");
    p.i32(geo.n, "N");
    p.i32(geo.k, "K");
    p.i32(geo.stride_ag, "A's batch stride");
    p.i32(geo.stride_a, "A's stride");
    p.i32(geo.stride_bg, "B's batch stride");
    p.i32(geo.stride_b, "B's stride");
    const size_t rank = geo.y.size();
    for (size_t e = 0; e + 2 < n_in; ++e) {
      if (modes[e] != ExtraMode::STRIDED) continue;
      const Shape st = broadcast_strides(t[e + 2].shape, geo.y);
      p.i32(collapse_dims(geo.y, st, 0, geo.lead, e + 2), "an extra input's batch stride");
      p.i32(collapse_dims(geo.y, st, geo.lead, rank - 1, e + 2), "an extra input's row stride");
      p.i32(collapse_dims(geo.y, st, rank - 1, rank, e + 2), "an extra input's column stride");
    }
    for (size_t start = 0;;) {
      int64_t slices = 0;
      cublaslt::Problem lt;
      const int v = choose(tg, t, y, geo, ptrs, largest, start, &slices, &lt);
      const GemmTile& tile = tiles[v];
      if (tile.library) {
        blas.run(lt, t[0].data, t[1].data, tile.bias >= 0 ? t[tile.bias + 2].data : nullptr, y.data, tg.stream, ctx,
                 tg.L->device);
        return;
      }
      const int64_t grid_x = ((geo.m + tile.block_m - 1) / tile.block_m) * ((geo.n + tile.block_n - 1) / tile.block_n);
      if (slices > 1) {  // split K: [G * tiles] counters, [slices, G * tiles, BLOCK_M * BLOCK_N] partials
        const cuda::SplitBuffers sb(ctx, tg.L->device, grid_x * geo.g, slices, tile.block_m * tile.block_n);
        if (!sb.ok()) {  // no workspace from the EP: the next variant that runs without one
          start = static_cast<size_t>(v) + 1;
          continue;
        }
        sb.pass(tg.stream, meta.name, p);
        p.scratch();
        launch(tg, v, grid_x, geo.g, p, slices);
        return;  // sb goes back to the EP's arena: later work on this stream reuses it in order
      }
      p.scratch();
      launch(tg, v, grid_x, geo.g, p);
      return;
    }
  }

  // The cuBLASLt problem of a library variant, or false where it cannot take this product:
  // G > 1, A, B and Y not all of one type (16-bit, or float32 where the variant has a
  // precision), or the bias not a contiguous row of N.
  bool library_problem(const GemmTile& tile, const std::vector<TensorRef>& t, const TensorRef& y,
                       const GemmGeometry& geo, cublaslt::Problem* p) const {
    const ONNXTensorElementDataType type = y.type;
    const bool f32 = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && !tile.precision.empty();
    if (geo.g != 1 || t[0].type != type || t[1].type != type ||
        (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 && !f32))
      return false;
    p->tf32 = f32 && tile.precision == "tf32";
    p->m = geo.m;
    p->n = geo.n;
    p->k = geo.k;
    p->lda = geo.stride_a;
    p->ldb = geo.stride_b;
    p->trans_a = trans_a;
    p->trans_b = trans_b;
    p->type = type;
    p->act = tile.act;
    p->bias = tile.bias >= 0;
    p->alpha = alpha;
    p->rank = static_cast<int>(tile.rank);
    p->align_a = cublaslt::alignment(t[0].data);
    p->align_b = cublaslt::alignment(t[1].data);
    p->align_y = cublaslt::alignment(y.data);
    p->align_bias = 256;
    if (p->bias) {
      const TensorRef& b = t[tile.bias + 2];
      if (b.type != type || numel(b.shape) != geo.n || modes[tile.bias] != ExtraMode::ROW) return false;
      p->align_bias = cublaslt::alignment(b.data);
    }
    return true;
  }

  // The K slices split-K variant v runs with for this product on this device (codegen_gemm,
  // GemmVariant.slices): min(its "split", SMs / (tiles · G), K blocks), evened out so that no
  // slice is empty; 0 where its tiles · G exceed half the SMs or fewer than 2 slices result.
  int64_t slices_for(const Target& tg, size_t v, const GemmGeometry& geo) const {
    const GemmTile& t = tiles[v];
    const int64_t n_tiles = ((geo.m + t.block_m - 1) / t.block_m) * ((geo.n + t.block_n - 1) / t.block_n) * geo.g;
    const int64_t sms = tg.L->sms;
    if (n_tiles <= 0 || 2 * n_tiles > sms) return 0;
    const int64_t blocks = (geo.k + t.block_k - 1) / t.block_k;
    const int64_t s = std::min(std::min(meta.variants[v].split, sms / n_tiles), std::min(blocks, kMaxSlices));
    if (s < 2) return 0;
    const int64_t per = (blocks + s - 1) / s;
    return (blocks + per - 1) / per;
  }

  // The first variant from `start` on with a binary for this device that takes M rows, whose
  // strides, N, K and pointers are as aligned as it was compiled for, whose tensors fit its
  // 32-bit indices, and, split K, that gets at least 2 slices (*slices; 0 for the others).
  int choose(const Target& tg, const std::vector<TensorRef>& t, const TensorRef& y, const GemmGeometry& geo,
             const std::vector<const void*>& ptrs, int64_t largest, size_t start, int64_t* slices,
             cublaslt::Problem* lt) {
    for (size_t v = start; v < tiles.size(); ++v) {
      const GemmTile& tile = tiles[v];
      if (tile.library) {
        if (library_problem(tile, t, y, geo, lt) && blas.supports(*lt)) {
          *slices = 0;
          return static_cast<int>(v);
        }
        continue;
      }
      if (!tg.L->fn[v] || (tile.max_m > 0 && geo.m > tile.max_m)) continue;
      const int64_t sm = tile.stride_multiple;
      if (geo.stride_ag % sm || geo.stride_a % sm || geo.stride_bg % sm || geo.stride_b % sm || geo.n % sm ||
          geo.k % sm)
        continue;
      const Variant& var = meta.variants[v];
      if ((var.max_elements > 0 && largest > var.max_elements) || largest > INT32_MAX) continue;
      *slices = var.split > 1 ? slices_for(tg, v, geo) : 0;
      if (var.split > 1 && *slices < 2) continue;
      bool aligned = true;
      for (const void* q : ptrs) aligned &= reinterpret_cast<uintptr_t>(q) % static_cast<uint64_t>(var.ptr_align) == 0;
      if (aligned) return static_cast<int>(v);
    }
    throw Error("kernel " + meta.name + ": no variant with a binary for this GPU takes this product (M " +
                std::to_string(geo.m) + ", N " + std::to_string(geo.n) + ", K " + std::to_string(geo.k) +
                ") at these addresses; embedded: " + meta.embedded());
  }
};

}  // namespace

void append_gemm_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<GemmKernel>(2, cuda::create_kernel<GemmKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_gemm_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
