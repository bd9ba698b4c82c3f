// What the CPU and CUDA kernels of onnxfuse::GemmEpilogue share (docs/format.md,
// GemmEpilogue): the products a node runs, from A's and B's shapes.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace onnxfuse {

constexpr const char* kGemmEpilogue = "GemmEpilogue";

// A, B [..., M, K] x [..., K, N] (op() applied): Y's shape and the G products [M, K] x [K, N]
// it runs as. A batched A times a 2-D B (no trans_a) is one product of M = batch * rows
// (G = 1); otherwise G is the product of the batch dims.
struct GemmGeometry {
  Shape y;
  int64_t g = 1, m = 0, n = 0, k = 0;
  // an operand's batch stride in elements (0: one shared by every product) and the stride of
  // its non-contiguous dim
  int64_t stride_ag = 0, stride_a = 0, stride_bg = 0, stride_b = 0;
  size_t lead = 0;  // Y's dims [0, lead) form G, [lead, rank - 1) form M
};

inline GemmGeometry gemm_geometry(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  if (a.size() < 2 || b.size() < 2)
    throw Error("A has shape " + shape_str(a) + " and B " + shape_str(b) + ": both need at least 2 dims");
  const size_t ra = a.size(), rb = b.size();
  GemmGeometry geo;
  const int64_t am = trans_a ? a[ra - 1] : a[ra - 2];
  geo.k = trans_a ? a[ra - 2] : a[ra - 1];
  geo.n = trans_b ? b[rb - 2] : b[rb - 1];
  if ((trans_b ? b[rb - 1] : b[rb - 2]) != geo.k)
    throw Error("A " + shape_str(a) + (trans_a ? " (transposed)" : "") + " and B " + shape_str(b) +
                (trans_b ? " (transposed)" : "") + " do not agree on K");
  const Shape ab(a.begin(), a.end() - 2), bb(b.begin(), b.end() - 2);
  if (!ab.empty() && !bb.empty() && ab != bb)
    throw Error("A's batch dims " + shape_str(ab) + " and B's " + shape_str(bb) + " differ");
  const Shape& batch = ab.empty() ? bb : ab;
  geo.y = batch;
  geo.y.push_back(am);
  geo.y.push_back(geo.n);
  geo.stride_a = trans_a ? am : geo.k;
  geo.stride_b = trans_b ? geo.k : geo.n;
  if (bb.empty() && !trans_a) {  // one GEMM over every row of A
    geo.g = 1;
    geo.m = numel(batch) * am;
    geo.lead = 0;
  } else {
    geo.g = numel(batch);
    geo.m = am;
    geo.stride_ag = ab.empty() ? 0 : am * geo.k;
    geo.stride_bg = bb.empty() ? 0 : geo.k * geo.n;
    geo.lead = batch.size();
  }
  return geo;
}

// The node's inputs A, B and the program's extras, checked (read_operand_inputs).
inline std::vector<TensorRef> read_gemm_inputs(OrtKernelContext* ctx, const Program& prog, bool f32_for_half) {
  return read_operand_inputs(ctx, prog, 2, "A, B", f32_for_half);
}

}  // namespace onnxfuse
