// What the CPU and CUDA kernels of onnxfuse::FusedAttention share (docs/format.md,
// FusedAttention): the perms, the node's inputs and the geometry of the logical operands.
//
// Inputs 0, 1, 2 are the base tensors of Q, K^T and V (contiguous, rank r = 3 or 4); the
// logical operands are Transpose(base, perm): logical dim i has size base[perm[i]] and stride
// base_stride[perm[i]]. With split_q (split_k, split_v) = [offset, heads, head_dim], input 0
// (1, 2) is a contiguous X of rank r - 1 and the operand's base tensor is X[..., offset : offset
// + heads * head_dim] reshaped to [X's leading dims..., heads, head_dim], read in place: base
// shape X.shape[:-1] + [heads, head_dim], base strides contiguous_strides(X)[:-1] + [head_dim,
// 1], at element `offset` of X (AttentionGeometry's q_off, k_off, v_off). Q is [..., Sq, D], K^T [..., D, Sk], V [..., Sk, Dv]; their r - 2
// leading dims are Y's or 1 (broadcast, stride 0). The kernels see them as [B, H]: r = 4, the
// two dims; r = 3, B = 1 and H the one dim. Output 0 is Y's base tensor, Transpose(logical Y,
// perm_y) with logical Y [..., Sq, Dv]. Inputs 3, 4, ... (the score program's extras) each
// broadcast (numpy rules) to the scores [..., Sq, Sk]. With bias_q (bias_k, bias_v) = i, the
// operand's packed input X is read as round_to_dtype(X + input i), input i 1-D of X's last dim
// (a packed projection's bias, its Add absorbed); the bias inputs follow the extras, and the
// operand's split must make its heads its logical H dim and its head_dim its D (Dv for V), where
// the kernels read a head's slice of the bias (AttentionGeometry's bias_h).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "common.h"

namespace onnxfuse {

constexpr const char* kFusedAttention = "FusedAttention";

// The four perms as the node gives them (empty: absent, the identity of the inputs' rank).
struct AttentionPerms {
  std::vector<int64_t> q, k, v, y;

  static constexpr const char* kNames[4] = {"perm_q", "perm_k", "perm_v", "perm_y"};
  const std::vector<int64_t>& get(int i) const { return i == 0 ? q : i == 1 ? k : i == 2 ? v : y; }
  std::vector<int64_t>& get(int i) { return i == 0 ? q : i == 1 ? k : i == 2 ? v : y; }

  // The rank the given perms imply (0: none given).
  size_t rank() const {
    for (int i = 0; i < 4; ++i)
      if (!get(i).empty()) return get(i).size();
    return 0;
  }
  // Perm i for rank r: the given one, or the identity.
  std::vector<int64_t> resolved(int i, size_t r) const {
    if (!get(i).empty()) return get(i);
    std::vector<int64_t> id(r);
    for (size_t d = 0; d < r; ++d) id[d] = static_cast<int64_t>(d);
    return id;
  }
};

inline std::string ints_str(const std::vector<int64_t>& v) {
  std::string r = "[";
  for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
  return r + "]";
}

// Whether p is a permutation of 0 .. p.size() - 1.
inline bool is_permutation(const std::vector<int64_t>& p) {
  std::vector<char> seen(p.size(), 0);
  for (int64_t x : p) {
    if (x < 0 || x >= static_cast<int64_t>(p.size()) || seen[x]) return false;
    seen[x] = 1;
  }
  return true;
}

// The node's perm_q, perm_k, perm_v, perm_y (ints; absent: the identity), checked: each a
// permutation of 0 .. r-1 with r 3 or 4, all given ones of the same length. Throws Error.
inline AttentionPerms read_attention_perms(const OrtKernelInfo* info) {
  AttentionPerms p;
  for (int i = 0; i < 4; ++i) {
    const char* name = AttentionPerms::kNames[i];
    std::vector<int64_t>& v = p.get(i);
    if (!get_ints_attr(info, name, &v)) continue;
    if (v.size() != 3 && v.size() != 4)
      throw Error(std::string(name) + " " + ints_str(v) + " must have 3 or 4 entries (the inputs' rank)");
    if (!is_permutation(v))
      throw Error(std::string(name) + " " + ints_str(v) + " is not a permutation of 0 .. " +
                  std::to_string(v.size() - 1));
  }
  const size_t r = p.rank();
  for (int i = 0; i < 4; ++i)
    if (!p.get(i).empty() && p.get(i).size() != r)
      throw Error(std::string(AttentionPerms::kNames[i]) + " " + ints_str(p.get(i)) + " and the other perms (" +
                  std::to_string(r) + " entries) differ in length");
  return p;
}

// The node's kv_group (absent: 1): grouped-query attention, query head h reads K's and V's head
// h / kv_group. Throws Error unless it is positive.
inline int64_t read_attention_kv_group(const OrtKernelInfo* info) {
  int64_t g = 1;
  if (get_int_attr(info, "kv_group", &g) && g < 1)
    throw Error("kv_group " + std::to_string(g) + " must be positive");
  return g;
}

// The node's split_q, split_k, split_v (empty: absent; else [offset, heads, head_dim]).
struct AttentionSplits {
  std::vector<int64_t> q, k, v;

  static constexpr const char* kNames[3] = {"split_q", "split_k", "split_v"};
  const std::vector<int64_t>& get(int i) const { return i == 0 ? q : i == 1 ? k : v; }
  std::vector<int64_t>& get(int i) { return i == 0 ? q : i == 1 ? k : v; }
};

// The node's split_q, split_k, split_v (ints; absent: none), checked: exactly 3 entries, offset
// >= 0, heads >= 1, head_dim >= 1. Throws Error naming the attribute.
inline AttentionSplits read_attention_splits(const OrtKernelInfo* info) {
  AttentionSplits s;
  for (int i = 0; i < 3; ++i) {
    const char* name = AttentionSplits::kNames[i];
    std::vector<int64_t>& v = s.get(i);
    if (!get_ints_attr(info, name, &v)) continue;
    if (v.size() != 3)
      throw Error(std::string(name) + " " + ints_str(v) + " must have 3 entries: [offset, heads, head_dim]");
    if (v[0] < 0 || v[1] < 1 || v[2] < 1)
      throw Error(std::string(name) + " " + ints_str(v) +
                  ": [offset, heads, head_dim] needs offset >= 0, heads >= 1 and head_dim >= 1");
  }
  return s;
}

// The node's bias_q, bias_k, bias_v (-1: absent; else the index of the node input holding the
// operand's bias), and how many bias inputs there are (after the extras).
struct AttentionBiases {
  int64_t q = -1, k = -1, v = -1;
  size_t count = 0;

  static constexpr const char* kNames[3] = {"bias_q", "bias_k", "bias_v"};
  int64_t get(int i) const { return i == 0 ? q : i == 1 ? k : v; }
  int64_t& get(int i) { return i == 0 ? q : i == 1 ? k : v; }
};

// The node's bias_q, bias_k, bias_v (ints; absent: none), checked: each needs its operand's split
// (the bias is added to the packed input) and names an input after Q, K^T, V and the `n_extras`
// extras; those inputs are the biases, each named by one attribute or more (Q, K and V usually
// share one). Throws Error naming the attribute.
inline AttentionBiases read_attention_biases(const OrtKernelInfo* info, const AttentionSplits& splits,
                                             size_t n_extras) {
  AttentionBiases b;
  const int64_t first = 3 + static_cast<int64_t>(n_extras);
  std::vector<int64_t> seen;
  for (int i = 0; i < 3; ++i) {
    const char* name = AttentionBiases::kNames[i];
    int64_t at = 0;
    if (!get_int_attr(info, name, &at)) continue;
    const std::string desc = std::string(name) + " " + std::to_string(at);
    if (splits.get(i).empty())
      throw Error(desc + " needs " + AttentionSplits::kNames[i] +
                  ": a bias is added to the packed input the operand is split from");
    if (at < first)
      throw Error(desc + " names an input before the biases, which follow Q, K^T, V and the " +
                  std::to_string(n_extras) + " extras (input " + std::to_string(first) + " on)");
    b.get(i) = at;
    if (std::find(seen.begin(), seen.end(), at) == seen.end()) seen.push_back(at);
  }
  std::sort(seen.begin(), seen.end());
  for (size_t j = 0; j < seen.size(); ++j)
    if (seen[j] != first + static_cast<int64_t>(j))
      throw Error("the bias inputs are " + ints_str(seen) + ": they must be inputs " + std::to_string(first) +
                  " on, one after the other, each named by bias_q, bias_k or bias_v");
  b.count = seen.size();
  return b;
}

// The logical operands and Y: sizes, and element strides over [B, H, then the last two dims]
// (0 on broadcast dims).
struct AttentionGeometry {
  size_t rank = 0;
  int64_t b = 1, h = 1, sq = 0, sk = 0, d = 0, dv = 0;
  int64_t kv_group = 1;         // K's and V's head for query head h: h / kv_group (their strides' H)
  int64_t q[4] = {0, 0, 0, 0};  // [B, H, Sq, D]
  int64_t k[4] = {0, 0, 0, 0};  // [B, H / kv_group, D, Sk]
  int64_t v[4] = {0, 0, 0, 0};  // [B, H / kv_group, Sk, Dv]
  int64_t y[4] = {0, 0, 0, 0};  // [B, H, Sq, Dv], inside Y's base tensor
  // each operand's first element inside its input, in elements (a split's offset; 0 without)
  int64_t q_off = 0, k_off = 0, v_off = 0;
  // per operand (Q, K^T, V) with a bias: the bias's element stride along H (head_dim; 0 when the
  // operand has one head), read from element q_off (k_off, v_off) of the bias, stride 1 along D
  int64_t bias_h[3] = {0, 0, 0};
  Shape batch;                  // the broadcast leading dims (r - 2 of them)
  Shape scores;                 // [batch..., Sq, Sk]
  Shape y_base;                 // Y's base (output) shape: Transpose(logical Y, perm_y)
  std::vector<Shape> extras;    // per extra input: its 4 strides over [B, H, Sq, Sk]
};

namespace attention_detail {

// Transpose(base, perm) of a base tensor with these strides: the logical shape and each
// logical dim's stride.
inline void logical(const Shape& base, const Shape& base_strides, const std::vector<int64_t>& perm, Shape* shape,
                    Shape* strides) {
  shape->resize(perm.size());
  strides->resize(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    (*shape)[i] = base[perm[i]];
    (*strides)[i] = base_strides[perm[i]];
  }
}

// An operand's base tensor inside its input x: x itself (contiguous), or with a split
// [offset, heads, head_dim] the slice x[..., offset : offset + heads * head_dim] reshaped to
// [x.shape[:-1]..., heads, head_dim]. `what` names the operand and input for errors.
inline void operand_base(const Shape& x, const std::vector<int64_t>& split, const std::string& what,
                         const char* split_name, Shape* shape, Shape* strides, int64_t* offset) {
  if (split.empty()) {
    *shape = x;
    *strides = contiguous_strides(x);
    *offset = 0;
    return;
  }
  const int64_t last = x.empty() ? 0 : x.back();
  if (x.empty() || split[0] + split[1] * split[2] > last)
    throw Error(std::string(split_name) + " " + ints_str(split) + " reads elements [" + std::to_string(split[0]) +
                ", " + std::to_string(split[0] + split[1] * split[2]) + ") of the last dim of " + what + " " +
                shape_str(x) + ", which has " + std::to_string(last) +
                ": offset + heads * head_dim must be at most its last dim");
  const Shape xs = contiguous_strides(x);
  *shape = Shape(x.begin(), x.end() - 1);
  *strides = Shape(xs.begin(), xs.end() - 1);
  shape->push_back(split[1]);
  shape->push_back(split[2]);
  strides->push_back(split[2]);
  strides->push_back(1);
  *offset = split[0];
}

// Strides of r leading-and-last-two dims into [B, H, x, y]: r = 4 as is, r = 3 with B = 1.
inline void to4(const Shape& st, int64_t out[4]) {
  if (st.size() == 4) {
    for (int i = 0; i < 4; ++i) out[i] = st[i];
  } else {
    out[0] = 0;
    for (int i = 0; i < 3; ++i) out[i + 1] = st[i];
  }
}

}  // namespace attention_detail

// The geometry from the shapes of inputs 0, 1, 2 (Q's, K^T's and V's base tensors, or with a
// split the packed X each is read from), the extras' (`extras`, in input order), the perms and
// the splits; throws Error naming the problem. The rank r: the perms' length when any is given,
// else input 0's rank (+ 1 with split_q); every operand's base tensor (an input's rank, + 1 with
// its split) must then have rank r, 3 or 4. With kv_group G > 1 (rank 4), K^T and V have H / G
// heads (logical dim 1) where Q has H.
inline AttentionGeometry attention_geometry(const Shape& qx, const Shape& kx, const Shape& vx,
                                            const std::vector<Shape>& extras, const AttentionPerms& perms,
                                            const AttentionSplits& splits = AttentionSplits(),
                                            int64_t kv_group = 1) {
  using namespace attention_detail;
  AttentionGeometry g;
  const Shape* xs[3] = {&qx, &kx, &vx};
  static const char* const kOperand[3] = {"Q", "K^T", "V"};
  auto base_rank = [&](int i) { return xs[i]->size() + (splits.get(i).empty() ? 0 : 1); };
  auto describe = [&](int i) {
    std::string d = std::string(kOperand[i]) + " " + shape_str(*xs[i]);
    if (!splits.get(i).empty())
      d = std::string(kOperand[i]) + "'s input " + shape_str(*xs[i]) + " (" + AttentionSplits::kNames[i] + " " +
          ints_str(splits.get(i)) + ")";
    return d;
  };
  const bool any_split = !splits.q.empty() || !splits.k.empty() || !splits.v.empty();
  const size_t r = perms.rank() != 0 ? perms.rank() : base_rank(0);
  if (!any_split) {
    if (qx.size() != 3 && qx.size() != 4)
      throw Error("Q has shape " + shape_str(qx) + ": Q, K^T and V must have rank 3 or 4");
    if (kx.size() != qx.size() || vx.size() != qx.size())
      throw Error("Q " + shape_str(qx) + ", K^T " + shape_str(kx) + " and V " + shape_str(vx) +
                  " must have the same rank");
    if (perms.rank() != 0 && perms.rank() != qx.size())
      throw Error("the perms have " + std::to_string(perms.rank()) + " entries, the inputs rank " +
                  std::to_string(qx.size()) + " (Q " + shape_str(qx) + ")");
  } else {
    const std::string from = perms.rank() != 0 ? "the perms' length" : describe(0);
    if (r != 3 && r != 4)
      throw Error("the operands have rank " + std::to_string(r) + " (from " + from +
                  "): Q, K^T and V must have rank 3 or 4 (a split input rank 2 or 3)");
    for (int i = 0; i < 3; ++i)
      if (base_rank(i) != r)
        throw Error(describe(i) + " gives a base tensor of rank " + std::to_string(base_rank(i)) +
                    ", the operands have rank " + std::to_string(r) + " (from " + from +
                    "); an input with a split has rank r - 1");
  }
  g.rank = r;
  Shape qb, qbs, kb, kbs, vb, vbs;
  operand_base(qx, splits.q, "Q's input", "split_q", &qb, &qbs, &g.q_off);
  operand_base(kx, splits.k, "K^T's input", "split_k", &kb, &kbs, &g.k_off);
  operand_base(vx, splits.v, "V's input", "split_v", &vb, &vbs, &g.v_off);
  Shape qs, qst, ks, kst, vs, vst;
  logical(qb, qbs, perms.resolved(0, r), &qs, &qst);
  logical(kb, kbs, perms.resolved(1, r), &ks, &kst);
  logical(vb, vbs, perms.resolved(2, r), &vs, &vst);
  const std::string shapes = " (logical Q " + shape_str(qs) + ", K^T " + shape_str(ks) + ", V " + shape_str(vs) + ")";
  g.sq = qs[r - 2];
  g.d = qs[r - 1];
  g.sk = ks[r - 1];
  g.dv = vs[r - 1];
  if (ks[r - 2] != g.d)
    throw Error("Q's last dim D = " + std::to_string(g.d) + " and K^T's second-to-last " +
                std::to_string(ks[r - 2]) + " differ" + shapes);
  if (vs[r - 2] != g.sk)
    throw Error("K^T's last dim Sk = " + std::to_string(g.sk) + " and V's second-to-last " +
                std::to_string(vs[r - 2]) + " differ" + shapes);
  if (kv_group > 1) {  // K's and V's heads as the queries see them: G each
    if (r != 4)
      throw Error("kv_group " + std::to_string(kv_group) + " needs rank-4 operands [B, H, ., .]" + shapes);
    if (qs[1] != ks[1] * kv_group || qs[1] != vs[1] * kv_group)
      throw Error("Q has " + std::to_string(qs[1]) + " heads, K^T " + std::to_string(ks[1]) + " and V " +
                  std::to_string(vs[1]) + ": with kv_group " + std::to_string(kv_group) +
                  " K^T and V must have H / kv_group" + shapes);
  }
  g.kv_group = kv_group;
  // the batch dims: each operand's are the broadcast's or 1 (K's and V's heads: G x theirs)
  for (size_t i = 0; i + 2 < r; ++i) {
    int64_t n = 1;
    for (const Shape* s : {&qs, &ks, &vs}) {
      const int64_t x = (*s)[i] * (i == 1 && s != &qs ? kv_group : 1);
      if (x == 1) continue;
      if (n != 1 && x != n)
        throw Error("the batch dims of Q, K^T and V do not broadcast" + shapes);
      n = x;
    }
    g.batch.push_back(n);
  }
  for (Shape* st : {&qst, &kst, &vst}) {
    const Shape& s = st == &qst ? qs : st == &kst ? ks : vs;
    for (size_t i = 0; i + 2 < r; ++i)
      if (s[i] == 1) (*st)[i] = 0;
  }
  to4(qst, g.q);
  to4(kst, g.k);
  to4(vst, g.v);
  if (r == 4) {
    g.b = g.batch[0];
    g.h = g.batch[1];
  } else {
    g.b = 1;
    g.h = g.batch[0];
  }
  // Y: logical [batch..., Sq, Dv]; base dim i is logical dim perm_y[i]
  Shape yl = g.batch;
  yl.push_back(g.sq);
  yl.push_back(g.dv);
  const std::vector<int64_t> py = perms.resolved(3, r);
  g.y_base.resize(r);
  for (size_t i = 0; i < r; ++i) g.y_base[i] = yl[py[i]];
  const Shape ybs = contiguous_strides(g.y_base);
  Shape yst(r);
  for (size_t i = 0; i < r; ++i) yst[py[i]] = ybs[i];
  for (size_t i = 0; i < r; ++i)
    if (yl[i] == 1) yst[i] = 0;
  to4(yst, g.y);
  // the scores and the extras over them
  g.scores = g.batch;
  g.scores.push_back(g.sq);
  g.scores.push_back(g.sk);
  for (size_t e = 0; e < extras.size(); ++e) {
    const Shape& s = extras[e];
    bool ok = s.size() <= r;
    for (size_t i = 0; ok && i < s.size(); ++i) {
      const int64_t x = s[s.size() - 1 - i];
      ok = x == 1 || x == g.scores[r - 1 - i];
    }
    if (!ok)
      throw Error("input " + std::to_string(e + 3) + " (extra %" + std::to_string(e + 1) + ") has shape " +
                  shape_str(s) + ", which does not broadcast to the scores' shape " + shape_str(g.scores));
    Shape st4(4, 0);
    int64_t tmp[4];
    to4(broadcast_strides(s, g.scores), tmp);
    for (int i = 0; i < 4; ++i) st4[i] = tmp[i];
    g.extras.push_back(st4);
  }
  return g;
}

// Checks the operands' biases (`biases`; `shapes`: every node input's shape) against the inputs
// Q, K^T and V are split from and the perms, and sets g's bias_h: a bias is 1-D of its packed
// input's last dim, and the split's heads are the operand's logical H dim (r - 3), its head_dim
// the operand's D (Q, V: dim r - 1; K^T: dim r - 2). Throws Error naming the problem.
inline void attention_bias_geometry(const std::vector<Shape>& shapes, const AttentionPerms& perms,
                                    const AttentionSplits& splits, const AttentionBiases& biases,
                                    AttentionGeometry* g) {
  static const char* const kInput[3] = {"Q's input", "K^T's input", "V's input"};
  const size_t r = g->rank;
  for (int i = 0; i < 3; ++i) {
    const int64_t at = biases.get(i);
    if (at < 0) continue;
    const Shape& x = shapes[i];
    const Shape& b = shapes[static_cast<size_t>(at)];
    if (b.size() != 1 || x.empty() || b[0] != x.back())
      throw Error("input " + std::to_string(at) + " (" + AttentionBiases::kNames[i] + ") has shape " + shape_str(b) +
                  ": a bias must be 1-D of its packed input's last dim (" + kInput[i] + " " + shape_str(x) + ")");
    const std::vector<int64_t> p = perms.resolved(i, r);
    const size_t d_dim = i == 1 ? r - 2 : r - 1;
    if (p[r - 3] != static_cast<int64_t>(r - 2) || p[d_dim] != static_cast<int64_t>(r - 1))
      throw Error(std::string(AttentionBiases::kNames[i]) + ": " + AttentionPerms::kNames[i] + " " + ints_str(p) +
                  " must read " + AttentionSplits::kNames[i] + "'s heads as the operand's head dim (dim " +
                  std::to_string(r - 3) + ") and its head_dim as D (dim " + std::to_string(d_dim) +
                  "), where the kernels add a head's slice of the bias");
    const std::vector<int64_t>& split = splits.get(i);
    g->bias_h[i] = split[1] == 1 ? 0 : split[2];
  }
}

// The node's inputs Q, K^T, V, the program's extras and `n_biases` biases, checked
// (read_operand_inputs).
inline std::vector<TensorRef> read_attention_inputs(OrtKernelContext* ctx, const Program& prog, bool f32_for_half,
                                                    size_t n_biases = 0) {
  return read_operand_inputs(ctx, prog, 3, "Q, K^T, V", f32_for_half, n_biases, "biases");
}

// The program's contract: %0 the scores, exactly one output. Throws Error.
inline void check_attention_program(const Program& prog) {
  if (prog.inputs.empty() || prog.outputs.size() != 1)
    throw Error("the score program needs the scores as input %0 and exactly one output (it has " +
                std::to_string(prog.inputs.size()) + " inputs and " + std::to_string(prog.outputs.size()) +
                " outputs)");
  if (prog.inputs[0] == DType::BOOL) throw Error("the score program's %0 (the scores) cannot be bool");
}

}  // namespace onnxfuse
