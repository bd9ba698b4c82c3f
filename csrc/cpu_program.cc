// The program evaluator of the CPU kernels (cpu_ops.h): evaluates a program over the
// broadcast output in cache-sized blocks, in parallel on ORT's intra-op thread pool.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_ops.h"

namespace onnxfuse {
namespace {

constexpr int kMaxRank = 64;

size_t block_elems() {
  static const size_t b = [] {
    const char* s = std::getenv("ONNXFUSE_CPU_BLOCK");
    long v = s ? std::strtol(s, nullptr, 10) : 0;
    if (v < 64 || v > (1 << 20)) v = 2048;
    return static_cast<size_t>(v) & ~static_cast<size_t>(15);
  }();
  return b;
}

// Elements per parallel task: large enough that scheduling costs nothing, small enough
// to balance the work over the pool's threads.
constexpr int64_t kTaskElems = 1 << 16;

// Per-input gather description (only for InputKind::GATHER).
struct Gather {
  int input = 0;
  DType dtype = DType::F32;
  const void* src = nullptr;
  Shape dims;     // collapsed output index space
  Shape strides;  // element strides of this input over dims
};

template <class T, class Conv>
inline void gather_run(const T* __restrict src, int64_t off, int64_t stride, float* __restrict dst,
                       size_t run, Conv conv) {
  if (stride == 1) {
    const T* s = src + off;
    for (size_t i = 0; i < run; ++i) dst[i] = conv(s[i]);
  } else if (stride == 0) {
    const float v = conv(src[off]);
    for (size_t i = 0; i < run; ++i) dst[i] = v;
  } else {
    for (size_t i = 0; i < run; ++i) dst[i] = conv(src[off + static_cast<int64_t>(i) * stride]);
  }
}

template <class T, class Conv>
void gather_block(const Gather& g, const T* src, int64_t start, size_t len, float* dst, Conv conv) {
  const int r = static_cast<int>(g.dims.size());
  if (r == 0) {
    gather_run(src, 0, 0, dst, len, conv);
    return;
  }
  int64_t idx[kMaxRank];
  int64_t rem = start;
  for (int d = r - 1; d >= 0; --d) {
    idx[d] = rem % g.dims[d];
    rem /= g.dims[d];
  }
  const int64_t inner = g.dims[r - 1];
  const int64_t inner_stride = g.strides[r - 1];
  size_t done = 0;
  while (done < len) {
    int64_t off = 0;
    for (int d = 0; d < r; ++d) off += idx[d] * g.strides[d];
    const size_t run = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(len - done), inner - idx[r - 1]));
    gather_run(src, off, inner_stride, dst + done, run, conv);
    done += run;
    idx[r - 1] += static_cast<int64_t>(run);
    for (int d = r - 1; d > 0 && idx[d] == g.dims[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
}

void gather_any(const Gather& g, int64_t start, size_t len, float* dst) {
  switch (g.dtype) {
    case DType::F32:
      gather_block(g, static_cast<const float*>(g.src), start, len, dst, [](float x) { return x; });
      break;
    case DType::F16:
      gather_block(g, static_cast<const uint16_t*>(g.src), start, len, dst, f16_to_f32);
      break;
    case DType::BF16:
      gather_block(g, static_cast<const uint16_t*>(g.src), start, len, dst, bf16_to_f32);
      break;
    case DType::BOOL:
      gather_block(g, static_cast<const uint8_t*>(g.src), start, len, dst,
                   [](uint8_t b) { return b ? 1.0f : 0.0f; });
      break;
  }
}

// Whether `strides` over `shape` read the elements in row-major order, one after another.
bool contiguous(const Shape& shape, const Shape& strides) {
  const Collapsed c = collapse(shape, {strides});
  return c.dims.empty() || (c.dims.size() == 1 && c.strides[0][0] == 1);
}

float read_scalar(DType d, const void* p) {
  switch (d) {
    case DType::F32: return *static_cast<const float*>(p);
    case DType::F16: return f16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::BF16: return bf16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::BOOL: return *static_cast<const uint8_t*>(p) ? 1.0f : 0.0f;
  }
  return 0.0f;
}

}  // namespace

void store(DType d, DType actual, const float* __restrict src, void* out, int64_t start, size_t len) {
  if (actual == DType::F32 && d != DType::F32) {
    float* __restrict o = static_cast<float*>(out) + start;
    if (d == DType::F16)
      for (size_t i = 0; i < len; ++i) o[i] = f16_to_f32(f32_to_f16(src[i]));
    else
      for (size_t i = 0; i < len; ++i) o[i] = bf16_to_f32(f32_to_bf16(src[i]));
    return;
  }
  switch (d) {
    case DType::F32:
      std::memcpy(static_cast<float*>(out) + start, src, len * sizeof(float));
      break;
    case DType::F16: {
      uint16_t* __restrict o = static_cast<uint16_t*>(out) + start;
      for (size_t i = 0; i < len; ++i) o[i] = f32_to_f16(src[i]);
      break;
    }
    case DType::BF16: {
      uint16_t* __restrict o = static_cast<uint16_t*>(out) + start;
      for (size_t i = 0; i < len; ++i) o[i] = f32_to_bf16(src[i]);
      break;
    }
    case DType::BOOL:
      break;  // not an output dtype (rejected by the parser)
  }
}

namespace {

struct Job {
  const Program* prog;
  ExecPlan plan;
  std::vector<Gather> gathers;
  std::vector<const void*> in_ptr;
  std::vector<void*> out_ptr;
  std::vector<DType> out_dtype;  // as stored (see store)
  int64_t n = 0;
  size_t block = 0;
  int64_t n_blocks = 0;
  int64_t blocks_per_task = 1;
  int64_t n_tasks = 0;
};

void run_task(const Job& job, int64_t task) {
  const ExecPlan& plan = job.plan;
  const size_t B = job.block;
  const size_t n_slots = static_cast<size_t>(plan.n_slots);
  const size_t n_consts = plan.consts.size();

  thread_local std::vector<float> scratch;
  thread_local std::vector<float*> table;
  const size_t need = (n_slots + n_consts) * B + 16;
  if (scratch.size() < need) scratch.assign(need, 0.0f);
  // 64-byte aligned start
  float* base = scratch.data();
  base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;
  float* slots = base;
  float* consts = base + n_slots * B;
  for (size_t c = 0; c < n_consts; ++c)
    if (plan.const_read[c]) std::fill(consts + c * B, consts + (c + 1) * B, plan.consts[c]);

  table.assign(plan.table_size(), nullptr);
  for (size_t c = 0; c < n_consts; ++c) table[plan.n_values + c] = consts + c * B;
  const int nv = plan.n_values;

  const int64_t b0 = task * job.blocks_per_task;
  const int64_t b1 = std::min(job.n_blocks, b0 + job.blocks_per_task);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * static_cast<int64_t>(B);
    const size_t len = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(B), job.n - start));
    for (int v = 0; v < nv; ++v) {
      const Loc& l = plan.loc[v];
      switch (l.kind) {
        case Loc::SLOT: table[v] = slots + static_cast<size_t>(l.index) * B; break;
        case Loc::CONST: table[v] = consts + static_cast<size_t>(l.index) * B; break;
        case Loc::INPUT:
          table[v] = const_cast<float*>(static_cast<const float*>(job.in_ptr[l.index])) + start;
          break;
        case Loc::OUTPUT: table[v] = static_cast<float*>(job.out_ptr[l.index]) + start; break;
        case Loc::NONE: table[v] = nullptr; break;
      }
    }
    for (const Gather& g : job.gathers) gather_any(g, start, len, table[g.input]);
    eval_block(plan, table.data(), len);
    for (size_t j = 0; j < job.prog->outputs.size(); ++j) {
      const int v = job.prog->outputs[j].first;
      const Loc& l = plan.loc[v];
      if (l.kind == Loc::OUTPUT && l.index == static_cast<int>(j)) continue;
      store(job.prog->outputs[j].second, job.out_dtype[j], table[v], job.out_ptr[j], start, len);
    }
  }
}

}  // namespace

void run_program(const Program& prog, const std::vector<HostTensor>& in, const std::vector<HostTensor>& out,
                 const Shape& out_shape, OrtKernelContext* ctx) {
  Job job;
  job.prog = &prog;
  job.n = numel(out_shape);
  if (job.n == 0) return;
  const size_t n_in = prog.inputs.size();
  std::vector<InputKind> kinds(n_in);
  std::vector<float> scalars(n_in, 0.0f);
  job.in_ptr.resize(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    const HostTensor& t = in[i];
    job.in_ptr[i] = t.data;
    const int64_t ni = numel(t.shape);
    if (!t.strides.empty() && t.strides.size() != out_shape.size())
      throw Error("input " + std::to_string(i) + " has " + std::to_string(t.strides.size()) + " strides over a rank-" +
                  std::to_string(out_shape.size()) + " shape");
    if (ni == 1) {
      kinds[i] = InputKind::SCALAR;
      scalars[i] = read_scalar(t.dtype, t.data);
    } else if (ni == job.n && t.dtype == DType::F32 && t.strides.empty()) {
      kinds[i] = InputKind::DIRECT;  // same shape as the output (up to leading 1s)
    } else if (ni == job.n && t.dtype == DType::F32 && contiguous(out_shape, t.strides)) {
      kinds[i] = InputKind::DIRECT;  // strided, but in the evaluated order
    } else {
      kinds[i] = InputKind::GATHER;
    }
  }
  for (const HostTensor& t : out) {
    job.out_ptr.push_back(t.data);
    job.out_dtype.push_back(t.dtype);
  }
  job.plan = make_plan(prog, kinds, scalars, /*allow_output_direct=*/true);

  for (size_t i = 0; i < n_in; ++i) {
    if (kinds[i] != InputKind::GATHER || job.plan.loc[i].kind == Loc::NONE) continue;
    Gather g;
    g.input = static_cast<int>(i);
    g.dtype = in[i].dtype;
    g.src = in[i].data;
    Collapsed c = collapse(out_shape, {in[i].strides.empty() ? broadcast_strides(in[i].shape, out_shape)
                                                             : in[i].strides});
    if (c.dims.size() > static_cast<size_t>(kMaxRank)) throw Error("rank too large");
    g.dims = std::move(c.dims);
    g.strides = std::move(c.strides[0]);
    job.gathers.push_back(std::move(g));
  }

  job.block = block_elems();
  job.n_blocks = (job.n + static_cast<int64_t>(job.block) - 1) / static_cast<int64_t>(job.block);
  job.blocks_per_task = std::max<int64_t>(1, kTaskElems / static_cast<int64_t>(job.block));
  job.n_tasks = (job.n_blocks + job.blocks_per_task - 1) / job.blocks_per_task;
  parallel_for(ctx, job.n_tasks, [&job](int64_t task) { run_task(job, task); });
}

}  // namespace onnxfuse
