// CPU kernel of onnxfuse::FusedConv (docs/format.md).
//
// A reference implementation, in three passes over fp32 buffers, each parallel on ORT's
// intra-op thread pool:
//   1. the direct convolution plus bias, into [N, K, P, Q] (rounded to the program's %0
//      dtype: fp16 for a float16 node);
//   2. the program (the epilogue), with the PointwiseChain evaluator (cpu_ops.h);
//   3. when pooled: ONNX's max pool, any kernel, strides, pads, dilations and ceil_mode.
// float16 tensors are widened to fp32 first; all arithmetic is fp32.
//
// Layouts (FusedConv's x_layout, y_layout, extra_layouts): an NHWC X is transposed into the
// padded NCHW fp32 copy of X. Without a pool, an NHWC output makes pass 1 store the conv
// result as [N, P, Q, K] and pass 2 run over that order, writing the output directly; with
// a pool, passes 1-3 run in NCHW and the pooled result is transposed into the output. The
// program reads each extra input through its strides over the order it runs in. KRSC
// weights (w_layout) are read in their order when the tile loop repacks them; the rows loop
// reads RSCK, so KRSC weights are first copied into that order.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "conv.h"
#include "cpu_ops.h"

namespace onnxfuse {
namespace {

float widen(const void* src, bool half, int64_t i) {
  return half ? f16_to_f32(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
}

// ---------------------------------------------------------------------------------------
// Convolution
//
// X is first copied into a zero-padded fp32 buffer [N, C, Hp, Wp] (Hp = pad_top + H +
// pad_bottom, ...; skipped for an unpadded float32 X), so the loops need no bounds checks.
// Two loop nests:
//   - tiles (K/group >= 8): vectorized over output channels. The weights are repacked as
//     [group][K block][C/group][R][S][16 channels]; a tile of QB output positions x 16
//     channels accumulates in registers over the C/group * R * S taps, each tap one vector
//     of weights times QB broadcast inputs (a small GEMM micro-kernel, compiled per ISA).
//   - rows (depthwise and other narrow groups): vectorized over the output row, for each
//     tap and output channel.
// ---------------------------------------------------------------------------------------

// Output channels per tile (one AVX-512 vector of fp32).
constexpr int kKB = 16;
// Output positions per task of the tile loop: a multiple of every QB below.
constexpr int64_t kPosAlign = 24;

struct ConvJob {
  OrtAllocator* alloc = nullptr;  // for scratch buffers
  ConvParams c;
  ConvShapes s;
  int64_t Cg = 0, Kg = 0;  // channels per group (in, out)
  int64_t Hp = 0, Wp = 0;  // padded input
  bool x_nhwc = false;        // the node's X is [N, H, W, C] (the padded copy is NCHW all the same)
  bool y_nhwc = false;        // y is [N, P, Q, K]
  bool w_krsc = false;        // the node's W is [K, R, S, C/group] (w_layout KRSC)
  const float* x = nullptr;   // padded X [N, C, Hp, Wp]
  const float* w = nullptr;   // rows: the weights [R, S, C/group, K] (KRSC: repacked so); tiles: repacked (above)
  const float* b = nullptr;   // bias [K]
  float* y = nullptr;         // conv result [N, K, P, Q], or [N, P, Q, K] with y_nhwc
  DType y_dtype = DType::F32;  // the value the conv result is rounded to (program %0)
  std::vector<int64_t> taps;   // tiles: offset in X of tap (c, r, s), in that order
  int64_t k_blocks = 0;        // tiles: per group
  int64_t chunk = 0;           // tiles: output positions per task; rows: output rows per task
  int64_t chunks = 0;          // per (n, group, K block)
};

// Y at (n, k, position m = p * Q + q) = round(acc + bias).
inline void store_y(const ConvJob& j, int64_t n, int64_t k, int64_t m, float acc) {
  const int64_t at = j.y_nhwc ? (n * j.s.P * j.s.Q + m) * j.s.K + k : (n * j.s.K + k) * j.s.P * j.s.Q + m;
  j.y[at] = round_to(j.y_dtype, acc + j.b[k]);
}

// Tiles for output positions [m0, m1) of image n, channels [k0, k0 + kb) of group g.
// V: a vector of fp32 (GCC vector extension); NV vectors make kKB channels.
template <class V, int QB, int NV>
__attribute__((always_inline)) inline void conv_tiles(const ConvJob& j, int64_t n, int64_t g, int64_t kblk,
                                                      int64_t m0, int64_t m1) {
  static_assert(sizeof(V) * NV == kKB * sizeof(float), "a tile row is kKB channels");
  const ConvShapes& s = j.s;
  const int64_t T = static_cast<int64_t>(j.taps.size());
  const int64_t* __restrict taps = j.taps.data();
  const float* xg = j.x + (n * s.C + g * j.Cg) * j.Hp * j.Wp;
  const float* wb = j.w + (g * j.k_blocks + kblk) * T * kKB;
  const int64_t k0 = g * j.Kg + kblk * kKB;
  const int64_t kb = std::min<int64_t>(kKB, j.Kg - kblk * kKB);
  const int64_t last = s.P * s.Q - 1;
  for (int64_t m = m0; m < m1; m += QB) {
    // X offset of each position's window (positions past the end repeat the last one)
    int64_t off[QB];
    for (int i = 0; i < QB; ++i) {
      const int64_t mm = std::min(m + i, last);
      off[i] = (mm / s.Q) * j.c.strides[0] * j.Wp + (mm % s.Q) * j.c.strides[1];
    }
    V acc[QB][NV];
#pragma GCC unroll 16
    for (int i = 0; i < QB; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = V{};
    for (int64_t t = 0; t < T; ++t) {
      V wv[NV];
      std::memcpy(wv, wb + t * kKB, sizeof wv);
      const float* __restrict xt = xg + taps[t];
#pragma GCC unroll 16
      for (int i = 0; i < QB; ++i) {
        const float xv = xt[off[i]];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] += xv * wv[v];
      }
    }
    float out[QB][kKB];
    std::memcpy(out, acc, sizeof out);
    const int64_t qn = std::min<int64_t>(QB, m1 - m);
    if (j.y_nhwc) {
      for (int64_t i = 0; i < qn; ++i)
        for (int64_t kk = 0; kk < kb; ++kk) store_y(j, n, k0 + kk, m + i, out[i][kk]);
    } else {
      for (int64_t kk = 0; kk < kb; ++kk)
        for (int64_t i = 0; i < qn; ++i) store_y(j, n, k0 + kk, m + i, out[i][kk]);
    }
  }
}

typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));
using TileFn = void (*)(const ConvJob&, int64_t, int64_t, int64_t, int64_t, int64_t);

// Register budgets: AVX-512 8 x 1 accumulators of 32; AVX2 6 x 2 of 16; SSE 2 x 4 of 16.
#if defined(__x86_64__)
__attribute__((target("avx512f,avx2,fma"))) void tiles_avx512(const ConvJob& j, int64_t n, int64_t g, int64_t kblk,
                                                               int64_t m0, int64_t m1) {
  conv_tiles<V16, 8, 1>(j, n, g, kblk, m0, m1);
}
__attribute__((target("avx2,fma"))) void tiles_avx2(const ConvJob& j, int64_t n, int64_t g, int64_t kblk, int64_t m0,
                                                     int64_t m1) {
  conv_tiles<V8, 6, 2>(j, n, g, kblk, m0, m1);
}
#endif
void tiles_generic(const ConvJob& j, int64_t n, int64_t g, int64_t kblk, int64_t m0, int64_t m1) {
  conv_tiles<V4, 2, 4>(j, n, g, kblk, m0, m1);
}

bool cpu_has(const char* isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx512") == 0) return __builtin_cpu_supports("avx512f");
  if (std::strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(isa, "generic") == 0;
}

void conv_rows(const ConvJob& j, int64_t n, int64_t g, int64_t kblk, int64_t p0, int64_t p1);

// The loop nest for K/group output channels per group: the widest tile micro-kernel this
// CPU has, or the rows for narrow groups. ONNXFUSE_CPU_CONV=rows|avx512|avx2|generic
// forces one (tests; an ISA the CPU lacks is ignored).
TileFn conv_loop(int64_t kg, bool* tiles) {
  const char* env = std::getenv("ONNXFUSE_CPU_CONV");
  std::string want = env ? env : "";
  if (want != "rows" && want != "avx512" && want != "avx2" && want != "generic") want.clear();
  *tiles = want != "rows" && (kg >= kKB / 2 || !want.empty());
#if defined(__x86_64__)
  if (*tiles && (want.empty() || want == "avx512") && cpu_has("avx512")) return tiles_avx512;
  if (*tiles && (want.empty() || want == "avx512" || want == "avx2") && cpu_has("avx2")) return tiles_avx2;
#endif
  return *tiles ? tiles_generic : conv_rows;
}

// acc[jj * Q + q] = the conv sum of output row p, channel k0 + jj (jj < kb) of the group
// whose X starts at xg; wk: W [R, S, C/group, K] at channel k0. The inner loops run over q,
// contiguous in acc (and in X for stride 1), so they vectorize; xs: scratch of Q floats.
__attribute__((target_clones("avx512f", "avx2", "default")))
void conv_row(const ConvJob& j, const float* xg, const float* wk, int64_t kb, int64_t p, float* __restrict acc,
              float* __restrict xs) {
  const ConvParams& c = j.c;
  const int64_t Q = j.s.Q, K = j.s.K, Cg = j.Cg, R = c.kernel[0], S = c.kernel[1], sw = c.strides[1];
  std::fill(acc, acc + kb * Q, 0.0f);
  for (int64_t ci = 0; ci < Cg; ++ci) {
    for (int64_t r = 0; r < R; ++r) {
      const float* __restrict xrow = xg + (ci * j.Hp + p * c.strides[0] + r * c.dilations[0]) * j.Wp;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t off = s * c.dilations[1];
        const float* __restrict src = xrow + off;
        if (sw != 1) {
          for (int64_t q = 0; q < Q; ++q) xs[q] = xrow[q * sw + off];
          src = xs;
        }
        const float* __restrict wp = wk + ((r * S + s) * Cg + ci) * K;
        for (int64_t jj = 0; jj < kb; ++jj) {
          const float wv = wp[jj];
          float* __restrict a = acc + jj * Q;
          for (int64_t q = 0; q < Q; ++q) a[q] += wv * src[q];
        }
      }
    }
  }
}

// Rows [p0, p1) of image n, channels [k0, k0 + kb) of group g, kb <= kKB.
void conv_rows(const ConvJob& j, int64_t n, int64_t g, int64_t kblk, int64_t p0, int64_t p1) {
  const ConvShapes& s = j.s;
  const int64_t k0 = g * j.Kg + kblk * kKB;
  const int64_t kb = std::min<int64_t>(kKB, j.Kg - kblk * kKB);
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>((kKB + 1) * s.Q);
  if (scratch.size() < need) scratch.resize(need);
  float* acc = scratch.data();
  float* xs = acc + kKB * s.Q;
  const float* xg = j.x + (n * s.C + g * j.Cg) * j.Hp * j.Wp;
  for (int64_t p = p0; p < p1; ++p) {
    conv_row(j, xg, j.w + k0, kb, p, acc, xs);
    if (j.y_nhwc) {
      for (int64_t q = 0; q < s.Q; ++q)
        for (int64_t jj = 0; jj < kb; ++jj) store_y(j, n, k0 + jj, p * s.Q + q, acc[jj * s.Q + q]);
    } else {
      for (int64_t jj = 0; jj < kb; ++jj)
        for (int64_t q = 0; q < s.Q; ++q) store_y(j, n, k0 + jj, p * s.Q + q, acc[jj * s.Q + q]);
    }
  }
}

// The zero-padded fp32 NCHW copy of an NHWC X [N, H, W, C]: one task per group of padded
// rows (n, hp); each input row is read contiguously and scattered into the C planes.
void padded_input_nhwc(OrtKernelContext* ctx, const void* src, bool half, const ConvJob& j, float* dst) {
  const ConvShapes& s = j.s;
  const int64_t* pads = j.c.pads;
  const int64_t rows = s.N * j.Hp, plane = j.Hp * j.Wp;
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, j.Wp * s.C));
  parallel_for(ctx, ceil_div(rows, per_task), [&j, &s, dst, src, half, rows, plane, per_task, pads](int64_t t) {
    for (int64_t r = t * per_task; r < std::min(rows, (t + 1) * per_task); ++r) {
      const int64_t n = r / j.Hp, hp = r % j.Hp, h = hp - pads[0];
      float* d0 = dst + n * s.C * plane + hp * j.Wp;  // row hp of plane (n, 0); plane c is c * plane further
      if (h < 0 || h >= s.H) {
        for (int64_t c = 0; c < s.C; ++c) std::fill(d0 + c * plane, d0 + c * plane + j.Wp, 0.0f);
        continue;
      }
      for (int64_t c = 0; c < s.C; ++c) {
        float* row = d0 + c * plane;
        std::fill(row, row + pads[1], 0.0f);
        std::fill(row + pads[1] + s.W, row + j.Wp, 0.0f);
      }
      const int64_t base = (n * s.H + h) * s.W * s.C;
      for (int64_t w = 0; w < s.W; ++w) {
        float* col = d0 + pads[1] + w;
        const int64_t at = base + w * s.C;
        if (half) {
          const uint16_t* x = static_cast<const uint16_t*>(src) + at;
          for (int64_t c = 0; c < s.C; ++c) col[c * plane] = f16_to_f32(x[c]);
        } else {
          const float* x = static_cast<const float*>(src) + at;
          for (int64_t c = 0; c < s.C; ++c) col[c * plane] = x[c];
        }
      }
    }
  });
}

// The zero-padded fp32 copy of X, NCHW (or X itself: float32 NCHW without padding).
const float* padded_input(OrtKernelContext* ctx, const TensorRef& x, ConvJob& j, Floats* buf) {
  const ConvShapes& s = j.s;
  const int64_t* pads = j.c.pads;
  j.Hp = s.H + pads[0] + pads[2];
  j.Wp = s.W + pads[1] + pads[3];
  const bool half = x.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  if (!half && !j.x_nhwc && j.Hp == s.H && j.Wp == s.W) return static_cast<const float*>(x.data);
  *buf = Floats(j.alloc, s.N * s.C * j.Hp * j.Wp);
  float* dst = buf->get();
  const void* src = x.data;
  if (j.x_nhwc) {
    padded_input_nhwc(ctx, src, half, j, dst);
    return dst;
  }
  const int64_t planes = s.N * s.C;
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, j.Hp * j.Wp));
  const ConvJob& cj = j;
  parallel_for(ctx, ceil_div(planes, per_task), [&cj, dst, src, half, planes, per_task, pads](int64_t t) {
    const ConvShapes& sh = cj.s;
    for (int64_t pl = t * per_task; pl < std::min(planes, (t + 1) * per_task); ++pl) {
      float* d = dst + pl * cj.Hp * cj.Wp;
      std::fill(d, d + pads[0] * cj.Wp, 0.0f);
      for (int64_t h = 0; h < sh.H; ++h) {
        float* row = d + (pads[0] + h) * cj.Wp;
        std::fill(row, row + pads[1], 0.0f);
        const int64_t base = (pl * sh.H + h) * sh.W;
        for (int64_t w = 0; w < sh.W; ++w) row[pads[1] + w] = widen(src, half, base + w);
        std::fill(row + pads[1] + sh.W, row + cj.Wp, 0.0f);
      }
      std::fill(d + (pads[0] + sh.H) * cj.Wp, d + cj.Hp * cj.Wp, 0.0f);
    }
  });
  return dst;
}

// The weights ([R, S, C/group, K], or [K, R, S, C/group] with w_krsc) as the tile loop
// reads them: [group][K block][C/group][R][S][kKB], channels past K/group zero.
const float* tile_weights(OrtKernelContext* ctx, const TensorRef& w, const ConvJob& j, Floats* buf) {
  const int64_t R = j.c.kernel[0], S = j.c.kernel[1], Cg = j.Cg, K = j.s.K, T = Cg * R * S;
  const bool half = w.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, krsc = j.w_krsc;
  // element (r, s, ci, k): RSCK ((r * S + s) * Cg + ci) * K + k; KRSC k * T + (r * S + s) * Cg + ci
  const int64_t k_stride = krsc ? T : 1;
  *buf = Floats(j.alloc, j.c.group * j.k_blocks * T * kKB);
  float* dst = buf->get();
  const void* src = w.data;
  parallel_for(ctx, j.c.group * j.k_blocks, [&j, dst, src, half, krsc, k_stride, R, S, Cg, K, T](int64_t gb) {
    const int64_t g = gb / j.k_blocks, kblk = gb % j.k_blocks;
    const int64_t k0 = g * j.Kg + kblk * kKB;
    const int64_t kb = std::min<int64_t>(kKB, j.Kg - kblk * kKB);
    float* d = dst + gb * T * kKB;
    for (int64_t ci = 0; ci < Cg; ++ci)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s, d += kKB) {
          const int64_t tap = (r * S + s) * Cg + ci;
          const int64_t base = krsc ? k0 * T + tap : tap * K + k0;
          for (int64_t kk = 0; kk < kKB; ++kk) d[kk] = kk < kb ? widen(src, half, base + kk * k_stride) : 0.0f;
        }
  });
  return dst;
}

// KRSC weights [K, R, S, C/group] as fp32 RSCK [R, S, C/group, K], the rows loop's order:
// one task per output channel k, each writing the strided column k of the result.
const float* rsck_weights(OrtKernelContext* ctx, const TensorRef& w, const ConvJob& j, Floats* buf) {
  const int64_t K = j.s.K, T = j.Cg * j.c.kernel[0] * j.c.kernel[1];  // T: taps (r, s, ci) per channel
  const bool half = w.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  *buf = Floats(j.alloc, K * T);
  float* dst = buf->get();
  const void* src = w.data;
  const int64_t per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, T));
  parallel_for(ctx, ceil_div(K, per_task), [dst, src, half, K, T, per_task](int64_t t) {
    for (int64_t k = t * per_task; k < std::min(K, (t + 1) * per_task); ++k)
      for (int64_t tap = 0; tap < T; ++tap) dst[tap * K + k] = widen(src, half, k * T + tap);
  });
  return dst;
}

// Y = conv(X, W) + B, rounded to y_dtype.
void run_conv(OrtKernelContext* ctx, ConvJob& j, const TensorRef& x, const TensorRef& w, const TensorRef& b) {
  const ConvShapes& s = j.s;
  const int64_t R = j.c.kernel[0], S = j.c.kernel[1];
  j.Cg = s.C / j.c.group;
  j.Kg = s.K / j.c.group;
  j.k_blocks = ceil_div(j.Kg, kKB);
  Floats xb, wb, bb;
  j.x = padded_input(ctx, x, j, &xb);
  if (b.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
    bb = Floats(j.alloc, s.K);
    for (int64_t k = 0; k < s.K; ++k) bb[k] = f16_to_f32(static_cast<const uint16_t*>(b.data)[k]);
    j.b = bb.get();
  } else {
    j.b = static_cast<const float*>(b.data);
  }
  const int64_t tap_work = std::max<int64_t>(1, j.Cg * R * S * kKB);  // multiply-adds per output position
  bool tiles = false;
  const TileFn fn = conv_loop(j.Kg, &tiles);
  if (tiles) {
    j.w = tile_weights(ctx, w, j, &wb);
    for (int64_t ci = 0; ci < j.Cg; ++ci)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t sx = 0; sx < S; ++sx)
          j.taps.push_back((ci * j.Hp + r * j.c.dilations[0]) * j.Wp + sx * j.c.dilations[1]);
    j.chunk = std::max<int64_t>(1, kTaskWork / tap_work / kPosAlign) * kPosAlign;
    j.chunks = ceil_div(s.P * s.Q, j.chunk);
  } else {
    if (j.w_krsc) {
      j.w = rsck_weights(ctx, w, j, &wb);
    } else if (w.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      const int64_t nw = numel(w.shape);
      wb = Floats(j.alloc, nw);
      for (int64_t i = 0; i < nw; ++i) wb[i] = f16_to_f32(static_cast<const uint16_t*>(w.data)[i]);
      j.w = wb.get();
    } else {
      j.w = static_cast<const float*>(w.data);
    }
    j.chunk = std::min(s.P, std::max<int64_t>(1, kTaskWork / (tap_work * s.Q)));
    j.chunks = ceil_div(s.P, j.chunk);
  }
  const int64_t end = tiles ? s.P * s.Q : s.P;
  // Task t: image n, group g, K block kblk, chunk of positions (tiles) or rows.
  parallel_for(ctx, s.N * j.c.group * j.k_blocks * j.chunks, [&j, fn, end](int64_t t) {
    const int64_t chunk = t % j.chunks;
    t /= j.chunks;
    const int64_t kblk = t % j.k_blocks;
    t /= j.k_blocks;
    const int64_t g = t % j.c.group, n = t / j.c.group;
    fn(j, n, g, kblk, chunk * j.chunk, std::min(end, (chunk + 1) * j.chunk));
  });
}

struct ConvKernel : LayerKernel {
  static constexpr const char* kOp = "FusedConv";
  ConvParams conv;
  bool has_pool = false;
  PoolParams pool;
  ConvLayouts lay;

  void init(const OrtKernelInfo* info) {
    if (prog.inputs.empty()) throw Error("the program has no inputs (its %0 is the conv output)");
    if (prog.inputs[0] != DType::F32 && prog.inputs[0] != DType::F16)
      throw Error(std::string("the program's %0 (the conv output) is ") + dtype_name(prog.inputs[0]) +
                  ", FusedConv computes f32 or f16");
    conv = read_conv_params(info);
    has_pool = read_pool_params(info, /*required=*/false, &pool);
    lay = read_conv_layouts(info, prog.inputs.size() - 1);
  }

  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 3, /*f32_for_half=*/true);
    if (t[0].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && t[0].type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
      throw Error(std::string("input 0 (X) is ") + elem_type_name(t[0].type) + ", FusedConv takes float32 or float16");
    const ConvShapes s =
        conv_shapes(conv, has_pool ? &pool : nullptr, t[0].shape, t[1].shape, t[2].shape, lay.x_nhwc, lay.w_krsc);
    const Shape conv_out = s.conv_out();
    for (size_t i = 3; i < t.size(); ++i)
      check_conv_extra(i, static_cast<int>(i - 2), t[i].shape, lay.extra_nhwc(i - 3), conv_out);
    const TensorRef out = layer_output(prog, ctx, /*f32_for_half=*/true, s.y_shape(lay.y_nhwc));
    if (numel(s.out()) == 0) return;

    // The order the conv result is stored in and the program runs over: the output's when
    // no pool follows (the program writes the output directly), else NCHW (the pool's).
    const bool nhwc = lay.y_nhwc && !has_pool;
    const Shape space = nhwc ? Shape{s.N, s.P, s.Q, s.K} : conv_out;
    ConvJob job;
    job.alloc = alloc;
    job.c = conv;
    job.s = s;
    job.x_nhwc = lay.x_nhwc;
    job.y_nhwc = nhwc;
    job.w_krsc = lay.w_krsc;
    job.y_dtype = prog.inputs[0];
    Floats y(alloc, numel(conv_out));
    job.y = y.get();
    run_conv(ctx, job, t[0], t[1], t[2]);
    std::vector<HostTensor> in = program_inputs(prog, {DType::F32, y.get(), space}, t, 3);
    if (lay.any()) {
      // each extra through its strides over [N, K, P, Q], permuted to the order of `space`
      for (size_t e = 1; e < in.size(); ++e) {
        const Shape st = conv_extra_strides(t[e + 2].shape, lay.extra_nhwc(e - 1), conv_out);
        in[e].strides = nhwc ? Shape{st[0], st[2], st[3], st[1]} : st;
      }
    }
    program_then_pool(ctx, alloc, prog, in, space, has_pool ? &pool : nullptr, out, lay.y_nhwc && has_pool);
  }
};


}  // namespace

void append_conv_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<ConvKernel>(3, create_layer_kernel<ConvKernel>);
  ops->push_back(&op);
}

}  // namespace onnxfuse
