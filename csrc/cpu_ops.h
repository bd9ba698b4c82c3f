// What the PointwiseChain CPU kernel (cpu_ops.cc) offers the other CPU kernels
// (conv_cpu.cc): the program evaluator over broadcast tensors, stores with rounding, and a
// parallel loop on ORT's intra-op thread pool.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"

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

}  // namespace onnxfuse
