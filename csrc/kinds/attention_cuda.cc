// CUDA kernel of onnxfuse::FusedAttention (docs/format.md, "FusedAttention", kernel_meta kind
// "attention"): launches the node's embedded Triton flash-attention kernel.
//
// Launch: pointers to Q, K^T, V (the base tensors; with split_q / split_k / split_v the packed
// input's pointer advanced by the split's offset, in bytes offset * the element size, and the
// strides inside it: attention.h), the score program's extras and Y (Y's base
// tensor); with bias_q / bias_k / bias_v, between the extras and Y, per biased operand in the
// order Q, K^T, V its bias input's pointer advanced by the operand's split offset; int32 H, SQ,
// SK; then four int32 element strides per operand over its logical dims [B, H, then its last
// two] (Q [B, H, Sq, D], K^T [B, H, D, Sk], V [B, H, Sk, Dv], Y [B, H, Sq, Dv] inside Y's base
// tensor), then per extra its four strides over the scores [B, H, Sq, Sk] (0 on broadcast dims;
// attention.h computes them from the base shapes and the perms), then per biased operand its
// bias's stride along H (attention.h's bias_h); the two scratch pointers. Grid: (ceil(SQ /
// block_m), B * H). D and Dv are the kernel's constexprs (kernel_meta's head_d, head_dv), and
// kernel_meta's "bias" says which operands it adds a bias to. Nothing is launched when Y is
// empty; Y is zeroed on the stream (cuMemsetD8Async) when Sk = 0.
#include "attention.h"
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

namespace onnxfuse {
namespace {

using cuda::Params;
using cuda::Target;
using cuda::Variant;
using cuda::thread_params;

struct AttentionTile {
  int64_t block_m = 1, block_n = 1;
  // 16: the kernel was compiled knowing the head dims of Q, K^T, V and Y contiguous (stride 1)
  // and their other strides multiples of 16 (and the pointers 16-byte aligned: ptr_align); 1: any
  int64_t stride_multiple = 1;
};

struct AttentionKernel : cuda::CudaKernel {
  static constexpr const char* kOp = kFusedAttention;
  AttentionPerms perms;
  AttentionSplits splits;
  AttentionBiases biases;
  int64_t meta_rank = 0, head_d = 0, head_dv = 0;
  int64_t kv_group = 1, meta_kv_group = 1;  // the node's attribute; kernel_meta's "kv_group" (absent: 1)
  std::vector<int64_t> meta_perms[4];
  int64_t meta_bias[3] = {0, 0, 0};  // kernel_meta's "bias": the kernel adds Q's, K^T's, V's bias
  // kernel_meta's "extras_broadcast", read once: per extra, what the launcher checks of it. "m"
  // (one row for every query: its stride over Sq unread) and "mn" need stride 0 along Sq, "n"
  // and "mn" along Sk; "causal" and "causal_add" (not read: a constant causal mask computed
  // from the indices) need the shape [..., SQ, SK]; "" (a full tile) and "row" (its first query
  // row: the optimizer showed its rows equal) nothing.
  struct ExtraRead {
    bool one_row = false, one_column = false, causal = false;
  };
  std::vector<ExtraRead> extra_reads;
  std::vector<AttentionTile> tiles;  // per variant

  const char* kind() const override { return "attention"; }

  // A bad program, perm, split or bias attribute fails session creation (cuda::create_kernel), as
  // on the CPU.
  void init(const OrtKernelInfo* info) override {
    check_attention_program(prog);
    perms = read_attention_perms(info);
    splits = read_attention_splits(info);
    biases = read_attention_biases(info, splits, prog.inputs.size() - 1);
    kv_group = read_attention_kv_group(info);
  }

  void read_meta(const Json& j, size_t n_inputs) override {
    cuda::check_n_extras(j, n_inputs);
    meta_rank = cuda::meta_int(j, "rank", "kernel_meta");
    if (meta_rank != 3 && meta_rank != 4)
      throw Error("kernel_meta: rank " + std::to_string(meta_rank) + " must be 3 or 4");
    for (int i = 0; i < 4; ++i) {
      const char* key = AttentionPerms::kNames[i];
      for (const Json& x : cuda::meta_array(j, key, "kernel_meta").arr) {
        if (x.kind != Json::NUMBER || x.num != static_cast<double>(static_cast<int64_t>(x.num)))
          throw Error(std::string("kernel_meta: ") + key + " must be an array of integers");
        meta_perms[i].push_back(static_cast<int64_t>(x.num));
      }
      if (meta_perms[i].size() != static_cast<size_t>(meta_rank) || !is_permutation(meta_perms[i]))
        throw Error(std::string("kernel_meta: ") + key + " " + ints_str(meta_perms[i]) +
                    " is not a permutation of 0 .. " + std::to_string(meta_rank - 1) + " (rank " +
                    std::to_string(meta_rank) + ")");
    }
    head_d = cuda::meta_positive(j, "head_d", "kernel_meta");
    head_dv = cuda::meta_positive(j, "head_dv", "kernel_meta");
    meta_kv_group = cuda::meta_int(j, "kv_group", "kernel_meta", false, 1);
    if (meta_kv_group < 1) throw Error("kernel_meta: kv_group must be positive");
    if (j.get("bias")) {  // absent: no operand has a bias
      const Json& b = cuda::meta_array(j, "bias", "kernel_meta");
      if (b.arr.size() != 3)
        throw Error("kernel_meta: bias must have 3 entries (Q, K^T, V), it has " + std::to_string(b.arr.size()));
      for (int i = 0; i < 3; ++i) {
        const Json& x = b.arr[i];
        if (x.kind != Json::NUMBER || (x.num != 0 && x.num != 1))
          throw Error("kernel_meta: bias must be an array of three 0 or 1");
        meta_bias[i] = static_cast<int64_t>(x.num);
      }
    }
    if (j.get("extras_broadcast")) {  // absent: every extra read as a full tile
      const Json& b = cuda::meta_array(j, "extras_broadcast", "kernel_meta");
      const int64_t n_extras = cuda::meta_int(j, "n_extras", "kernel_meta");
      if (static_cast<int64_t>(b.arr.size()) != n_extras)
        throw Error("kernel_meta: extras_broadcast has " + std::to_string(b.arr.size()) + " entries for " +
                    std::to_string(n_extras) + " extras");
      for (const Json& x : b.arr) {
        if (x.kind != Json::STRING || (x.str != "" && x.str != "m" && x.str != "n" && x.str != "mn" &&
                                       x.str != "row" && x.str != "causal" && x.str != "causal_add"))
          throw Error("kernel_meta: extras_broadcast entries must be \"\", \"m\", \"n\", \"mn\", \"row\", "
                      "\"causal\" or \"causal_add\"");
        extra_reads.push_back({x.str == "m" || x.str == "mn", x.str == "n" || x.str == "mn",
                               x.str == "causal" || x.str == "causal_add"});
      }
    }
  }

  void read_variant(const Json& vj, const std::string& where, Variant*) override {
    AttentionTile t;
    t.block_m = cuda::meta_positive(vj, "block_m", where);
    t.block_n = cuda::meta_positive(vj, "block_n", where);
    t.stride_multiple = std::max<int64_t>(1, cuda::meta_int(vj, "stride_multiple", where, false, 1));
    tiles.push_back(t);
  }

  void check_meta() override {
    if (!meta_error.empty()) return;
    const size_t r = static_cast<size_t>(meta_rank);
    std::string node_desc, meta_desc;
    bool same = perms.rank() == 0 || perms.rank() == r;
    for (int i = 0; i < 4; ++i) {
      const std::vector<int64_t> mine = perms.rank() == 0 || perms.rank() == r ? perms.resolved(i, r) : perms.get(i);
      same &= mine == meta_perms[i];
      node_desc += std::string(i ? ", " : "") + AttentionPerms::kNames[i] + " " + ints_str(mine);
      meta_desc += std::string(i ? ", " : "") + AttentionPerms::kNames[i] + " " + ints_str(meta_perms[i]);
    }
    if (!same) {
      meta_error = "kernel_meta (rank " + std::to_string(meta_rank) + ", " + meta_desc +
                   ") does not describe this node (" + node_desc + ")";
      return;
    }
    for (int i = 0; i < 3; ++i)
      if (meta_bias[i] != (biases.get(i) >= 0 ? 1 : 0))
        meta_error = std::string("kernel_meta's bias [") + std::to_string(meta_bias[0]) + ", " +
                     std::to_string(meta_bias[1]) + ", " + std::to_string(meta_bias[2]) +
                     "] does not describe this node (bias_q, bias_k, bias_v " +
                     (biases.q >= 0 ? "given" : "absent") + ", " + (biases.k >= 0 ? "given" : "absent") + ", " +
                     (biases.v >= 0 ? "given" : "absent") + ")";
  }

  void compute(OrtKernelContext* ctx) override {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_attention_inputs(ctx, prog, /*f32_for_half=*/false, biases.count);
    const size_t n_in = t.size() - biases.count;  // Q, K^T, V and the extras
    std::vector<Shape> extra_shapes, shapes;
    for (size_t i = 3; i < n_in; ++i) extra_shapes.push_back(t[i].shape);
    for (const TensorRef& x : t) shapes.push_back(x.shape);
    if (kv_group != meta_kv_group)
      throw Error("the node has kv_group " + std::to_string(kv_group) + ", the kernel " + meta.name +
                  " was compiled for " + std::to_string(meta_kv_group));
    AttentionGeometry g =
        attention_geometry(t[0].shape, t[1].shape, t[2].shape, extra_shapes, perms, splits, kv_group);
    attention_bias_geometry(shapes, perms, splits, biases, &g);
    if (static_cast<int64_t>(g.rank) != meta_rank)
      throw Error("the inputs have rank " + std::to_string(g.rank) + ", the kernel was compiled for rank " +
                  std::to_string(meta_rank));
    if (g.d != head_d || g.dv != head_dv)
      throw Error("the heads have D = " + std::to_string(g.d) + " and Dv = " + std::to_string(g.dv) + " (Q " +
                  shape_str(t[0].shape) + ", V " + shape_str(t[2].shape) + "), the kernel " + meta.name +
                  " was compiled for D = " + std::to_string(head_d) + " and Dv = " + std::to_string(head_dv) +
                  ": re-run onnxfuse optimize for these shapes");
    OrtValue* yv = nullptr;
    check(g_ort->KernelContext_GetOutput(ctx, 0, g.y_base.data(), g.y_base.size(), &yv));
    TensorRef y;
    read_tensor(yv, &y);
    if (!type_fits(y.type, prog.inputs[0], false))
      throw Error("output 0 is " + std::string(elem_type_name(y.type)) + " in the graph, Q is " +
                  dtype_name(prog.inputs[0]));
    const int64_t ny = numel(g.y_base);
    if (ny == 0) return;
    // an extra the kernel reads as one row (column) must be one: its stride over Sq (Sk) is 0; a
    // causal one, which it computes, must be [1, .., 1, SQ, SK] (its values are the graph's constant)
    for (size_t i = 0; i < extra_reads.size() && i < g.extras.size(); ++i) {
      const ExtraRead& r = extra_reads[i];
      const Shape& es = extra_shapes[i];
      std::string want;
      if (r.causal) {  // the optimizer checked every leading slice equal
        if (!(es.size() >= 2 && es[es.size() - 2] == g.sq && es.back() == g.sk))
          want = "[..., " + std::to_string(g.sq) + ", " + std::to_string(g.sk) + "] (a causal mask)";
      } else if (r.one_row && g.extras[i][2] != 0 && g.sq > 1) {
        want = "one of size 1 along the queries";
      } else if (r.one_column && g.extras[i][3] != 0 && g.sk > 1) {
        want = "one of size 1 along the keys";
      }
      if (!want.empty())
        throw Error("input " + std::to_string(3 + i) + " has shape " + shape_str(es) + ", the kernel " + meta.name +
                    " was compiled for " + want + ": re-run onnxfuse optimize for these shapes");
    }
    const Target tg = target(ctx);
    if (g.sk == 0) {  // softmax over no keys, a product over nothing: Y = 0
      const cuda::Driver& d = cuda::driver();
      const size_t bytes = static_cast<size_t>(ny) * elem_size(prog.inputs[0]);
      const CUresult r = d.MemsetD8Async(reinterpret_cast<CUdeviceptr>(y.data), 0, bytes, tg.stream);
      if (r != CUDA_SUCCESS) throw Error("cuMemsetD8Async of Y for " + meta.name + " failed: " + d.describe(r));
      return;
    }

    Params& p = thread_params();
    // Q, K^T and V at their first elements (a split's offset into the packed input), the extras,
    // each biased operand's bias at the same offset, Y: the pointers launched and checked for the
    // variants' alignment (choose)
    const int64_t offs[3] = {g.q_off, g.k_off, g.v_off};
    const size_t esize = elem_size(prog.inputs[0]);
    std::vector<const void*> ptrs;
    int64_t largest = ny;
    for (size_t i = 0; i < n_in; ++i) {
      const char* at = static_cast<const char*>(t[i].data);
      if (i < 3) at += static_cast<size_t>(offs[i]) * esize;
      ptrs.push_back(at);
      largest = std::max(largest, numel(t[i].shape));
    }
    for (int i = 0; i < 3; ++i)
      if (biases.get(i) >= 0)
        ptrs.push_back(static_cast<const char*>(t[static_cast<size_t>(biases.get(i))].data) +
                       static_cast<size_t>(offs[i]) * esize);
    ptrs.push_back(y.data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(g.h, "H");
    p.i32(g.sq, "SQ");
    p.i32(g.sk, "SK");
    static const char* const kStrideNames[4][4] = {
        {"stride_qb", "stride_qh", "stride_qm", "stride_qd"},
        {"stride_kb", "stride_kh", "stride_kd", "stride_kn"},
        {"stride_vb", "stride_vh", "stride_vn", "stride_vd"},
        {"stride_yb", "stride_yh", "stride_ym", "stride_yd"},
    };
    const int64_t* strides[4] = {g.q, g.k, g.v, g.y};
    for (int o = 0; o < 4; ++o)
      for (int i = 0; i < 4; ++i) p.i32(strides[o][i], kStrideNames[o][i]);
    for (const Shape& st : g.extras)
      for (int i = 0; i < 4; ++i) p.i32(st[i], "an extra input's stride over the scores");
    static const char* const kBiasStrideNames[3] = {"stride_bqh", "stride_bkh", "stride_bvh"};
    for (int i = 0; i < 3; ++i)
      if (biases.get(i) >= 0) p.i32(g.bias_h[i], kBiasStrideNames[i]);
    p.scratch();
    const int v = choose(tg, ptrs, g, largest);
    const AttentionTile& tile = tiles[v];
    launch(tg, v, (g.sq + tile.block_m - 1) / tile.block_m, g.b * g.h, p);
  }

  // Whether Q, K^T, V and Y have contiguous head dims and their other strides (and the biases'
  // strides along H) are multiples of m.
  static bool strides_fit(const AttentionGeometry& g, int64_t m) {
    if (g.q[3] != 1 || g.k[2] != 1 || g.v[3] != 1 || g.y[3] != 1) return false;
    const int64_t others[] = {g.q[0], g.q[1], g.q[2], g.k[0], g.k[1], g.k[3], g.v[0], g.v[1],
                              g.v[2], g.y[0], g.y[1], g.y[2], g.bias_h[0], g.bias_h[1], g.bias_h[2]};
    for (int64_t s : others)
      if (s % m) return false;
    return true;
  }

  // The first variant with a binary for this device whose requirements hold: its tensors fit its
  // 32-bit indices, its pointers are as aligned as it asks, and, for one compiled with
  // stride_multiple > 1, the strides fit (strides_fit).
  int choose(const Target& tg, const std::vector<const void*>& ptrs, const AttentionGeometry& g,
             int64_t largest) const {
    for (size_t v = 0; v < tiles.size(); ++v) {
      if (!tg.L->fn[v]) continue;
      const Variant& var = meta.variants[v];
      if ((var.max_elements > 0 && largest > var.max_elements) || largest > INT32_MAX) continue;
      if (tiles[v].stride_multiple > 1 && !strides_fit(g, tiles[v].stride_multiple)) continue;
      bool aligned = true;
      for (const void* q : ptrs) aligned &= reinterpret_cast<uintptr_t>(q) % static_cast<uint64_t>(var.ptr_align) == 0;
      if (aligned) return static_cast<int>(v);
    }
    throw Error("kernel " + meta.name + ": no variant with a binary for this GPU takes these tensors (largest " +
                std::to_string(largest) + " elements) at these addresses and strides; embedded: " + meta.embedded());
  }
};

}  // namespace

void append_attention_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<AttentionKernel>(3, cuda::create_kernel<AttentionKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_attention_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
