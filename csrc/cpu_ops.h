// What the CPU kernels of every kind (csrc/kinds/<kind>_cpu.cc) share: the program
// evaluator over broadcast tensors, stores with rounding and a parallel loop on ORT's
// intra-op thread pool (cpu_program.cc); and for the layer kinds (FusedConv, FusedMaxPool)
// fp32 scratch buffers, ONNX's max pool, the program-then-pool pass and the kernel base
// they build on (cpu_layers.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "conv.h"

namespace onnxfuse {

// A host tensor as the evaluator sees it: `dtype` is how its bytes are read or written
// (float32 standing for an f16/bf16 program value is F32 here), the data contiguous.
// `strides` (inputs only; optional): the element strides of the input over the evaluated
// shape (run_program's out_shape, same rank), 0 on broadcast dimensions, for an input
// whose elements are not in the evaluated order (a transposed layout); empty: numpy
// broadcasting of the contiguous `shape`.
struct HostTensor {
  DType dtype = DType::F32;
  void* data = nullptr;
  Shape shape;
  Shape strides;

  HostTensor() = default;
  HostTensor(DType d, void* p, Shape s, Shape st = {})
      : dtype(d), data(p), shape(std::move(s)), strides(std::move(st)) {}
};

// The dtype a tensor is read or written as: the program's, except float32 standing for f16
// or bf16 (bind_io's f32_for_half).
inline DType actual_dtype(ONNXTensorElementDataType t, DType declared) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? DType::F32 : declared;
}

// v rounded to dtype d (f16 / bf16 to nearest even) and widened back: how a value stored in d reads.
inline float round_to(DType d, float v) {
  if (d == DType::F16) return f16_to_f32(f32_to_f16(v));
  if (d == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  return v;
}

// A tensor's elements as fp32 (f16 / bf16 widened; float32 standing for them read as is).
inline std::vector<float> widen(const TensorRef& t, DType declared) {
  const int64_t n = numel(t.shape);
  std::vector<float> out(static_cast<size_t>(n));
  const DType d = actual_dtype(t.type, declared);
  const auto* h = static_cast<const uint16_t*>(t.data);
  for (int64_t i = 0; i < n; ++i)
    out[i] = d == DType::F32 ? static_cast<const float*>(t.data)[i] : d == DType::F16 ? f16_to_f32(h[i])
                                                                                      : bf16_to_f32(h[i]);
  return out;
}

// Evaluates `prog` over `out_shape`: input i (which must broadcast to out_shape; the caller
// checks) is read with numpy broadcasting (or through its `strides`), output j is written
// contiguously with out_shape, rounded as the program declares. Runs on ctx's intra-op
// thread pool.
void run_program(const Program& prog, const std::vector<HostTensor>& in, const std::vector<HostTensor>& out,
                 const Shape& out_shape, OrtKernelContext* ctx);

// Stores len fp32 values at element `start` of `out`: `d` is the program's dtype, `actual`
// the tensor's. A float32 tensor standing for an f16/bf16 value gets it rounded.
void store(DType d, DType actual, const float* src, void* out, int64_t start, size_t len);

// f(i) for i in [0, n), in parallel on ctx's intra-op thread pool (serially without one).
// f must not throw.
template <class F>
void parallel_for(OrtKernelContext* ctx, int64_t n, const F& f) {
  if (n <= 0) return;
  if (n == 1) {
    f(0);
    return;
  }
  void (*cb)(void*, size_t) = [](void* p, size_t i) { (*static_cast<const F*>(p))(static_cast<int64_t>(i)); };
  OrtStatus* st = g_ort->KernelContext_ParallelFor(ctx, cb, static_cast<size_t>(n), 0, const_cast<F*>(&f));
  if (st) {  // no thread pool available: run serially
    g_ort->ReleaseStatus(st);
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

// ---------------------------------------------------------------------------------------
// The layer kinds (cpu_layers.cc)
// ---------------------------------------------------------------------------------------

// Elements (or multiply-adds) per parallel task: enough that scheduling costs nothing.
constexpr int64_t kTaskWork = 1 << 18;

// An uninitialized fp32 buffer from the execution provider's allocator (ORT's CPU arena
// by default, so a large buffer is not page-faulted in again on every run), or from new[]
// when the kernel has no allocator.
class Floats {
 public:
  Floats() = default;
  Floats(OrtAllocator* alloc, int64_t n) : alloc_(alloc) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    if (alloc_) {
      void* p = nullptr;
      check(g_ort->AllocatorAlloc(alloc_, bytes, &p));
      if (!p) throw Error("out of memory (" + std::to_string(bytes) + " bytes of scratch)");
      p_ = static_cast<float*>(p);
    } else {
      p_ = new float[bytes / sizeof(float)];
    }
  }
  Floats(Floats&& o) noexcept : alloc_(o.alloc_), p_(o.p_) { o.p_ = nullptr; }
  Floats& operator=(Floats&& o) noexcept {
    std::swap(alloc_, o.alloc_);
    std::swap(p_, o.p_);
    return *this;
  }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  ~Floats() {
    if (!p_) return;
    if (alloc_) {
      if (OrtStatus* st = g_ort->AllocatorFree(alloc_, p_)) g_ort->ReleaseStatus(st);
    } else {
      delete[] p_;
    }
  }
  float* get() const { return p_; }
  float& operator[](int64_t i) const { return p_[i]; }

 private:
  OrtAllocator* alloc_ = nullptr;
  float* p_ = nullptr;
};

// out [N, C, OH, OW] = MaxPool(z [N, C, H, W]), stored as (declared, actual) dtype.
// Padding never wins; a NaN always does (numpy's and torch's rule).
void max_pool(OrtKernelContext* ctx, const PoolParams& pp, const float* z, const Shape& in, const Shape& out_shape,
              DType declared, DType actual, void* out);

// Program inputs: `first` (the conv result or X), then the extra tensors from `extras`.
std::vector<HostTensor> program_inputs(const Program& prog, HostTensor first, const std::vector<TensorRef>& t,
                                       size_t extras);

// out [N, H, W, C] = src [N, C, H, W] (fp32, `nchw`), stored as (declared, actual) dtype.
void store_nhwc(OrtKernelContext* ctx, const float* src, const Shape& nchw, DType declared, DType actual,
                void* out);

// Runs the program over `shape` into `out` (no pool) or into an fp32 buffer that the pool
// reads (values rounded as the program says), then pools into `out`; with out_nhwc the
// pooled result [N, C, OH, OW] is stored transposed, as [N, OH, OW, C] (pool only).
void program_then_pool(OrtKernelContext* ctx, OrtAllocator* alloc, const Program& prog,
                       const std::vector<HostTensor>& in, const Shape& shape, const PoolParams* pool,
                       const TensorRef& out, bool out_nhwc = false);

// What a layer kernel holds: the program (one output), the node's name (for messages) and
// the EP's allocator (for scratch buffers; null if ORT has none for the kernel). A kind's
// kernel K adds kOp, init(const OrtKernelInfo*) (its attributes) and compute.
struct LayerKernel {
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  Program prog;
  std::string name;
  OrtAllocator* alloc = nullptr;
  LayerKernel() = default;
  LayerKernel(const LayerKernel&) = delete;
  LayerKernel& operator=(const LayerKernel&) = delete;
  ~LayerKernel() {
    if (alloc) g_ort->ReleaseAllocator(alloc);
  }
};

// Builds layer kernel K for a node: its program (which must have one output), K::init's
// attributes, the EP's allocator.
template <class K>
OrtStatus* ORT_API_CALL create_layer_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info,
                                            void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<K>();
    k->prog = read_program(info);
    k->name = name;
    if (k->prog.outputs.size() != 1)
      throw Error("the program has " + std::to_string(k->prog.outputs.size()) + " outputs, expected 1");
    k->init(info);
    if (OrtStatus* st = g_ort->KernelInfoGetAllocator(info, OrtMemTypeDefault, &k->alloc)) {
      g_ort->ReleaseStatus(st);  // scratch from new[] instead
      k->alloc = nullptr;
    }
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(K::kOp, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace onnxfuse
