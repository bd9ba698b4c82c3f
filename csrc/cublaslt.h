// cuBLASLt for GemmEpilogue's "library" variants (docs/format.md, kind gemm): one product
// Y[M, N] = act(alpha op(A) op(B) + bias) of 16-bit operands (or float32 ones, in TF32 or in
// full fp32) where cuBLASLt's own epilogue applies the bias and the activation (none, ReLU,
// GELU in its tanh form) to the fp32 accumulator before the store, so Y is written once.
//
// libcublasLt is opened with dlopen on first use: the one the CUDA execution provider has
// loaded already when there is one (RTLD_NOLOAD), else the first of the sonames below that
// loads. The types and constants are declared here from the cuBLASLt documentation (its
// header is not needed to build, as cuda.h is only needed for types); the library builds and
// loads on machines without CUDA.
//
// Row-major products as cuBLASLt's column-major ones: Y[M, N] row-major is Y^T[N, M]
// column-major = op(B)^T op(A)^T, so cuBLASLt's "A" is our B, its "B" our A, and its bias
// (one value per row of the column-major D) is our bias over N.
#pragma once

#include "common.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <cuda.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace onnxfuse {
namespace cublaslt {

enum class Activation { NONE, RELU, GELU };

// One product as the node runs it (row-major, one GEMM: G = 1).
struct Problem {
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0;  // the row-major strides of A's and B's non-contiguous dims (GemmGeometry)
  bool trans_a = false, trans_b = false;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;  // A, B, bias and Y
  bool tf32 = false;  // float32: cuBLAS's TF32 tensor-core product (operands rounded), else full fp32
  Activation act = Activation::NONE;
  bool bias = false;
  float alpha = 1.0f;
  // the largest power of two (at most 256) dividing each pointer: cuBLASLt's heuristic
  // assumes 256-byte alignment unless told otherwise
  int align_a = 256, align_b = 256, align_y = 256, align_bias = 256;
  // which of the heuristic's algorithms runs: 0 its first, r its (r + 1)-th (tuning times a
  // few); the first where it ranks r or fewer
  int rank = 0;

  auto key() const {
    return std::make_tuple(m, n, k, lda, ldb, trans_a, trans_b, static_cast<int>(type), tf32, static_cast<int>(act),
                           bias, alpha, std::make_tuple(align_a, align_b, align_y, align_bias), rank);
  }
};

// The alignment Problem records for a pointer.
int alignment(const void* p);

// Why cuBLASLt cannot run here (empty when it can): the library did not load, or lacks a symbol.
const std::string& unavailable();

// The cuBLASLt matmuls of one kernel instance: per problem its descriptors and the algorithm
// cuBLASLt's heuristic ranks first, or at the problem's rank (found on the first run of that
// problem: host work only, no launch, so a CUDA graph capture may include it).
class Matmuls {
 public:
  Matmuls();
  Matmuls(const Matmuls&) = delete;
  Matmuls& operator=(const Matmuls&) = delete;
  ~Matmuls();

  // Whether cuBLASLt has an algorithm for the problem on the current device (cached); false
  // too where cuBLASLt fails to describe it (the launcher then takes the next variant).
  bool supports(const Problem& p);
  // Queues Y = act(alpha op(A) op(B) + bias) on `stream`; workspace, when the algorithm wants
  // some, from the CUDA EP's allocator for this Compute (cuda::Workspace). Throws on failure.
  void run(const Problem& p, const void* a, const void* b, const void* bias, void* y, CUstream stream,
           OrtKernelContext* ctx, int device);

 private:
  struct Plan;
  Plan* plan(const Problem& p);  // null where no algorithm fits; mu held
  std::mutex mu;
  std::map<decltype(Problem{}.key()), std::unique_ptr<Plan>> plans;
};

}  // namespace cublaslt
}  // namespace onnxfuse

#endif  // ONNXFUSE_WITH_CUDA
