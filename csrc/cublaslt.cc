// cuBLASLt through dlopen, and the plans of GemmEpilogue's library variants (cublaslt.h).
#include "cublaslt.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <dlfcn.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "cuda_driver.h"

namespace onnxfuse {
namespace cublaslt {
namespace {

// cuBLASLt's types and constants (cublasLt.h, as documented): opaque handles, the algorithm
// as 8 words, and the heuristic's result.
using Status = int;  // cublasStatus_t; 0: success
using Handle = void*;
using MatmulDesc = void*;
using Layout = void*;
using Preference = void*;
struct Algo {
  uint64_t data[8];
};
struct HeuristicResult {
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};

constexpr int kComputeF32 = 68, kComputeTF32 = 77;  // CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
constexpr int kR32F = 0, kR16F = 2, kR16BF = 14;  // cudaDataType_t
constexpr int kOpN = 0, kOpT = 1;                 // cublasOperation_t
// cublasLtMatmulDescAttributes_t
constexpr int kDescTransA = 3, kDescTransB = 4, kDescEpilogue = 7, kDescBiasPointer = 8;
// cublasLtEpilogue_t
constexpr uint32_t kEpiDefault = 1, kEpiRelu = 2, kEpiBias = 4, kEpiReluBias = 6, kEpiGelu = 32, kEpiGeluBias = 36;
// cublasLtMatmulPreferenceAttributes_t
constexpr int kPrefMaxWorkspace = 1, kPrefAlignA = 5, kPrefAlignB = 6, kPrefAlignC = 7, kPrefAlignD = 8;
// The most workspace an algorithm may ask for (lent by the CUDA EP for each Compute).
constexpr uint64_t kMaxWorkspace = 4u << 20;

struct Api {
  std::string error;
  Status (*Create)(Handle*) = nullptr;
  Status (*Destroy)(Handle) = nullptr;
  Status (*MatmulDescCreate)(MatmulDesc*, int, int) = nullptr;
  Status (*MatmulDescDestroy)(MatmulDesc) = nullptr;
  Status (*MatmulDescSetAttribute)(MatmulDesc, int, const void*, size_t) = nullptr;
  Status (*MatrixLayoutCreate)(Layout*, int, uint64_t, uint64_t, int64_t) = nullptr;
  Status (*MatrixLayoutDestroy)(Layout) = nullptr;
  Status (*PreferenceCreate)(Preference*) = nullptr;
  Status (*PreferenceDestroy)(Preference) = nullptr;
  Status (*PreferenceSetAttribute)(Preference, int, const void*, size_t) = nullptr;
  Status (*AlgoGetHeuristic)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, Preference, int, HeuristicResult*,
                             int*) = nullptr;
  Status (*Matmul)(Handle, MatmulDesc, const void*, const void*, Layout, const void*, Layout, const void*,
                   const void*, Layout, void*, Layout, const Algo*, void*, size_t, CUstream) = nullptr;
};

const char* const kSonames[] = {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so"};

const Api& api() {
  static const Api a = [] {
    Api a;
    void* h = nullptr;
    for (int mode : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
      for (const char* name : kSonames)
        if ((h = dlopen(name, mode))) break;
      if (h) break;
    }
    if (!h) {
      a.error = "libcublasLt could not be loaded (tried libcublasLt.so.13, .12, .11 and libcublasLt.so)";
      return a;
    }
    auto sym = [&](const char* name, auto* fp) {
      void* p = dlsym(h, name);
      if (!p && a.error.empty()) a.error = std::string("libcublasLt has no symbol ") + name;
      *fp = reinterpret_cast<std::remove_pointer_t<decltype(fp)>>(p);
    };
    sym("cublasLtCreate", &a.Create);
    sym("cublasLtDestroy", &a.Destroy);
    sym("cublasLtMatmulDescCreate", &a.MatmulDescCreate);
    sym("cublasLtMatmulDescDestroy", &a.MatmulDescDestroy);
    sym("cublasLtMatmulDescSetAttribute", &a.MatmulDescSetAttribute);
    sym("cublasLtMatrixLayoutCreate", &a.MatrixLayoutCreate);
    sym("cublasLtMatrixLayoutDestroy", &a.MatrixLayoutDestroy);
    sym("cublasLtMatmulPreferenceCreate", &a.PreferenceCreate);
    sym("cublasLtMatmulPreferenceDestroy", &a.PreferenceDestroy);
    sym("cublasLtMatmulPreferenceSetAttribute", &a.PreferenceSetAttribute);
    sym("cublasLtMatmulAlgoGetHeuristic", &a.AlgoGetHeuristic);
    sym("cublasLtMatmul", &a.Matmul);
    return a;
  }();
  return a;
}

std::string status_text(Status s) {
  switch (s) {
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cublasStatus_t " + std::to_string(s);
  }
}

void ok(Status s, const char* what) {
  if (s != 0) throw Error(std::string(what) + " failed: " + status_text(s));
}

// One handle per CUDA context, for the life of the process (a handle is host state; ORT's
// own is kept as long).
Handle handle_for_current_context() {
  static std::mutex mu;
  static std::map<CUcontext, Handle> handles;
  CUcontext ctx = nullptr;
  const cuda::Driver& d = cuda::driver();
  if (!d.error.empty()) throw Error(d.error);
  CUresult r = d.CtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS || !ctx) throw Error("no current CUDA context for cuBLASLt");
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(ctx);
  if (it != handles.end()) return it->second;
  Handle h = nullptr;
  ok(api().Create(&h), "cublasLtCreate");
  handles.emplace(ctx, h);
  return h;
}

int data_type(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return kR16F;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return kR16BF;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return kR32F;
    default: throw Error(std::string("cuBLASLt variants run float products, not ") + elem_type_name(t));
  }
}

uint32_t epilogue(Activation act, bool bias) {
  switch (act) {
    case Activation::RELU: return bias ? kEpiReluBias : kEpiRelu;
    case Activation::GELU: return bias ? kEpiGeluBias : kEpiGelu;
    default: return bias ? kEpiBias : kEpiDefault;
  }
}

}  // namespace

struct Matmuls::Plan {
  Handle handle = nullptr;
  MatmulDesc desc = nullptr;
  Layout a = nullptr, b = nullptr, d = nullptr;  // cuBLASLt's A (our B), B (our A), C and D (Y^T)
  Algo algo{};
  size_t workspace = 0;
  bool found = false;

  ~Plan() {
    const Api& x = api();
    if (desc) x.MatmulDescDestroy(desc);
    for (Layout l : {a, b, d})
      if (l) x.MatrixLayoutDestroy(l);
  }
};

int alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * static_cast<uintptr_t>(a)) == 0) a *= 2;
  return a;
}

const std::string& unavailable() { return api().error; }

Matmuls::Matmuls() = default;
Matmuls::~Matmuls() = default;

Matmuls::Plan* Matmuls::plan(const Problem& p) {
  auto it = plans.find(p.key());
  if (it != plans.end()) return it->second->found ? it->second.get() : nullptr;
  const Api& x = api();
  if (!x.error.empty()) throw Error(x.error);
  // kept when no algorithm fits (or cuBLASLt fails to describe the problem), so the search runs once
  Plan* pl = plans.emplace(p.key(), std::make_unique<Plan>()).first->second.get();
  pl->handle = handle_for_current_context();
  const int type = data_type(p.type);
  ok(x.MatmulDescCreate(&pl->desc, p.tf32 ? kComputeTF32 : kComputeF32, kR32F), "cublasLtMatmulDescCreate");
  const int32_t op_a = p.trans_b ? kOpT : kOpN, op_b = p.trans_a ? kOpT : kOpN;
  ok(x.MatmulDescSetAttribute(pl->desc, kDescTransA, &op_a, sizeof op_a), "setting TRANSA");
  ok(x.MatmulDescSetAttribute(pl->desc, kDescTransB, &op_b, sizeof op_b), "setting TRANSB");
  const uint32_t epi = epilogue(p.act, p.bias);
  ok(x.MatmulDescSetAttribute(pl->desc, kDescEpilogue, &epi, sizeof epi), "setting the epilogue");
  // column-major: our B stored [K, N] is N x K (ld N), stored [N, K] (trans_b) K x N (ld K);
  // our A stored [M, K] is K x M (ld K), stored [K, M] (trans_a) M x K (ld M); Y^T is N x M
  ok(p.trans_b ? x.MatrixLayoutCreate(&pl->a, type, p.k, p.n, p.ldb)
                : x.MatrixLayoutCreate(&pl->a, type, p.n, p.k, p.ldb),
     "cublasLtMatrixLayoutCreate (B)");
  ok(p.trans_a ? x.MatrixLayoutCreate(&pl->b, type, p.m, p.k, p.lda)
                : x.MatrixLayoutCreate(&pl->b, type, p.k, p.m, p.lda),
     "cublasLtMatrixLayoutCreate (A)");
  ok(x.MatrixLayoutCreate(&pl->d, type, p.n, p.m, p.n), "cublasLtMatrixLayoutCreate (Y)");
  Preference pref = nullptr;
  ok(x.PreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = kMaxWorkspace;
  const uint32_t al_a = static_cast<uint32_t>(p.align_b), al_b = static_cast<uint32_t>(p.align_a),
                 al_d = static_cast<uint32_t>(p.align_y);
  Status s = x.PreferenceSetAttribute(pref, kPrefMaxWorkspace, &ws, sizeof ws);
  if (s == 0) s = x.PreferenceSetAttribute(pref, kPrefAlignA, &al_a, sizeof al_a);
  if (s == 0) s = x.PreferenceSetAttribute(pref, kPrefAlignB, &al_b, sizeof al_b);
  if (s == 0) s = x.PreferenceSetAttribute(pref, kPrefAlignC, &al_d, sizeof al_d);
  if (s == 0) s = x.PreferenceSetAttribute(pref, kPrefAlignD, &al_d, sizeof al_d);
  // the heuristic's ranking down to the rank asked for (the first where it ranks fewer)
  std::vector<HeuristicResult> ranked(static_cast<size_t>(p.rank) + 1);
  int found = 0;
  if (s == 0)
    s = x.AlgoGetHeuristic(pl->handle, pl->desc, pl->a, pl->b, pl->d, pl->d, pref, static_cast<int>(ranked.size()),
                           ranked.data(), &found);
  x.PreferenceDestroy(pref);
  // NOT_SUPPORTED: no algorithm for this problem (a bias or pointer alignment it cannot take)
  if (s != 0 && s != 15) ok(s, "cublasLtMatmulAlgoGetHeuristic");
  const HeuristicResult& pick = ranked[found > p.rank ? p.rank : 0];
  if (s == 0 && found > 0 && pick.state == 0) {
    pl->algo = pick.algo;
    pl->workspace = pick.workspace_size;
    pl->found = true;
  }
  return pl->found ? pl : nullptr;
}

bool Matmuls::supports(const Problem& p) {
  if (!unavailable().empty()) return false;
  if (p.bias && p.align_bias < 16) return false;
  std::lock_guard<std::mutex> lock(mu);
  try {
    return plan(p) != nullptr;
  } catch (const std::exception&) {
    return false;  // kept as a plan without an algorithm: the next variant runs
  }
}

void Matmuls::run(const Problem& p, const void* a, const void* b, const void* bias, void* y, CUstream stream,
                  OrtKernelContext* ctx, int device) {
  std::lock_guard<std::mutex> lock(mu);  // the bias pointer is the shared descriptor's
  Plan* pl = plan(p);
  if (!pl) throw Error("cuBLASLt has no algorithm for this product");
  const Api& x = api();
  if (p.bias) ok(x.MatmulDescSetAttribute(pl->desc, kDescBiasPointer, &bias, sizeof bias), "setting the bias");
  std::unique_ptr<cuda::Workspace> ws;
  if (pl->workspace) {
    ws = std::make_unique<cuda::Workspace>(ctx, device, pl->workspace);
    if (!ws->data)
      throw Error("cuBLASLt's algorithm needs " + std::to_string(pl->workspace) +
                  " bytes of workspace and the CUDA EP lent none");
  }
  const float alpha = p.alpha, beta = 0.0f;
  // the workspace goes back to the EP's arena at the end of Compute: later work on this
  // stream reuses it in order (as split K's)
  ok(x.Matmul(pl->handle, pl->desc, &alpha, b, pl->a, a, pl->b, &beta, y, pl->d, y, pl->d, &pl->algo,
              ws ? ws->data : nullptr, pl->workspace, stream),
     "cublasLtMatmul");
}

}  // namespace cublaslt
}  // namespace onnxfuse

#endif  // ONNXFUSE_WITH_CUDA
