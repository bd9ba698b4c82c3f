// What the CPU kernels of the layer kinds (FusedConv, FusedMaxPool) share (cpu_ops.h):
// ONNX's max pool, any kernel, strides, pads, dilations and ceil_mode, in one pass over an
// fp32 buffer, parallel on ORT's intra-op thread pool; the program-then-pool pass; NHWC
// stores.
#include <algorithm>
#include <limits>

#include "cpu_ops.h"

namespace onnxfuse {
namespace {

// The window positions i (0 <= i < k) with 0 <= start + i * d < n: [*lo, *hi).
void window(int64_t start, int64_t k, int64_t d, int64_t n, int64_t* lo, int64_t* hi) {
  *lo = start >= 0 ? 0 : ceil_div(-start, d);
  *hi = n - 1 - start < 0 ? 0 : std::min(k, (n - 1 - start) / d + 1);
}

// max(m, v) propagating NaN, as numpy's maximum and torch's max pool: v when it is larger
// or NaN; once m is NaN it stays NaN (no v compares larger).
inline float max_nan(float m, float v) { return (v > m || v != v) ? v : m; }

// The valid part of each window along one axis: output o reads input start[o] + i * d for
// i in [lo[o], hi[o]) (lo >= hi: the window is all padding).
struct Windows {
  std::vector<int64_t> start, lo, hi;
  Windows(int64_t out, int64_t n, int64_t k, int64_t s, int64_t pad, int64_t d) : start(out), lo(out), hi(out) {
    for (int64_t o = 0; o < out; ++o) {
      start[o] = o * s - pad;
      window(start[o], k, d, n, &lo[o], &hi[o]);
    }
  }
};

// One plane: out_row gets the max over the window's rows (a vectorizable column max over
// the whole input row, `cols`), then over its columns. A window that holds a NaN gives NaN
// wherever the NaN lies, as numpy and torch (and the Triton kernels) compute it; one that
// is all padding gives -inf. ONNX Runtime's own CPU MaxPool mostly drops NaN, differently
// from one code path to another (README, Reliability).
__attribute__((target_clones("avx512f", "avx2", "default")))
void pool_plane(const float* __restrict z, int64_t W, int64_t dh, int64_t dw, const Windows& rows,
                const Windows& colw, float* __restrict cols, float* __restrict out_row, DType declared, DType actual,
                void* out, int64_t out_start) {
  const float kNone = -std::numeric_limits<float>::infinity();
  const int64_t OH = static_cast<int64_t>(rows.start.size()), OW = static_cast<int64_t>(colw.start.size());
  for (int64_t oh = 0; oh < OH; ++oh) {
    std::fill(cols, cols + W, kNone);
    for (int64_t i = rows.lo[oh]; i < rows.hi[oh]; ++i) {
      const float* __restrict zr = z + (rows.start[oh] + i * dh) * W;
      for (int64_t w = 0; w < W; ++w) cols[w] = max_nan(cols[w], zr[w]);
    }
    for (int64_t ow = 0; ow < OW; ++ow) {
      float m = kNone;
      for (int64_t j = colw.lo[ow]; j < colw.hi[ow]; ++j) m = max_nan(m, cols[colw.start[ow] + j * dw]);
      out_row[ow] = m;
    }
    store(declared, actual, out_row, out, out_start + oh * OW, static_cast<size_t>(OW));
  }
}

}  // namespace

// Padding never wins; a NaN always does: pool_plane.
void max_pool(OrtKernelContext* ctx, const PoolParams& pp, const float* z, const Shape& in, const Shape& out_shape,
              DType declared, DType actual, void* out) {
  const int64_t planes = in[0] * in[1], H = in[2], W = in[3];
  const int64_t OH = out_shape[2], OW = out_shape[3];
  if (planes * OH * OW == 0) return;
  const Windows rows(OH, H, pp.kernel[0], pp.strides[0], pp.pads[0], pp.dilations[0]);
  const Windows colw(OW, W, pp.kernel[1], pp.strides[1], pp.pads[1], pp.dilations[1]);
  const int64_t per_plane = std::max<int64_t>(1, H * W + OH * OW * pp.kernel[1]);
  const int64_t planes_per_task = std::max<int64_t>(1, kTaskWork / per_plane);
  parallel_for(ctx, ceil_div(planes, planes_per_task), [&](int64_t task) {
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(W + OW));
    for (int64_t pl = task * planes_per_task; pl < std::min(planes, (task + 1) * planes_per_task); ++pl)
      pool_plane(z + pl * H * W, W, pp.dilations[0], pp.dilations[1], rows, colw, buf.data(), buf.data() + W,
                 declared, actual, out, pl * OH * OW);
  });
}

// Program inputs: `first` (the conv result or X), then the extra tensors from `extras`.
std::vector<HostTensor> program_inputs(const Program& prog, HostTensor first, const std::vector<TensorRef>& t,
                                       size_t extras) {
  std::vector<HostTensor> in{std::move(first)};
  for (size_t i = extras; i < t.size(); ++i)
    in.push_back({actual_dtype(t[i].type, prog.inputs[in.size()]), t[i].data, t[i].shape});
  return in;
}

// out [N, H, W, C] = src [N, C, H, W] (fp32, `nchw`), stored as (declared, actual) dtype.
void store_nhwc(OrtKernelContext* ctx, const float* src, const Shape& nchw, DType declared, DType actual,
                void* out) {
  const int64_t C = nchw[1], HW = nchw[2] * nchw[3];
  const int64_t rows = nchw[0] * HW;  // output rows (n, h, w) of C values
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, C));
  parallel_for(ctx, ceil_div(rows, per_task), [=](int64_t t) {
    thread_local std::vector<float> buf;
    buf.resize(static_cast<size_t>(C));
    for (int64_t r = t * per_task; r < std::min(rows, (t + 1) * per_task); ++r) {
      const float* sp = src + (r / HW) * C * HW + r % HW;
      for (int64_t c = 0; c < C; ++c) buf[c] = sp[c * HW];
      store(declared, actual, buf.data(), out, r * C, static_cast<size_t>(C));
    }
  });
}

// Runs the program over `shape` into `out` (no pool) or into an fp32 buffer that the pool
// reads (values rounded as the program says), then pools into `out`; with out_nhwc the
// pooled result [N, C, OH, OW] is stored transposed, as [N, OH, OW, C] (pool only).
void program_then_pool(OrtKernelContext* ctx, OrtAllocator* alloc, const Program& prog,
                       const std::vector<HostTensor>& in, const Shape& shape, const PoolParams* pool,
                       const TensorRef& out, bool out_nhwc) {
  const DType declared = prog.outputs[0].second;
  const DType actual = actual_dtype(out.type, declared);
  if (!pool) {
    run_program(prog, in, {{actual, out.data, shape}}, shape, ctx);
    return;
  }
  Floats z(alloc, numel(shape));
  run_program(prog, in, {{DType::F32, z.get(), shape}}, shape, ctx);
  if (!out_nhwc) {
    max_pool(ctx, *pool, z.get(), shape, out.shape, declared, actual, out.data);
    return;
  }
  // z holds values already rounded to the declared dtype: pool them in fp32, then round
  // (exactly) while transposing.
  const Shape pooled = pool_shape(*pool, shape);
  Floats zp(alloc, numel(pooled));
  max_pool(ctx, *pool, z.get(), shape, pooled, DType::F32, DType::F32, zp.get());
  store_nhwc(ctx, zp.get(), pooled, declared, actual, out.data);
}

}  // namespace onnxfuse
