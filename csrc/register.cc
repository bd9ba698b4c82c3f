// Entry point of libonnxfuse_ops.so: registers the op of every fusion kind (csrc/kinds/:
// PointwiseChain, FusedConv, FusedMaxPool, FusedRows, GemmEpilogue, FusedAttention,
// FusedSqueezeExcite) for the CPU and CUDA execution providers. This is the only exported symbol.
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace onnxfuse {
const OrtApi* g_ort = nullptr;

// The kinds' registrations, one per kind and execution provider (csrc/kinds/<kind>_<ep>.cc;
// the CUDA ones add nothing in a build without cuda.h).
void append_pointwise_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_conv_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_maxpool_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_rows_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_gemm_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_attention_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_squeeze_cpu_ops(std::vector<OrtCustomOp*>* ops);
void append_pointwise_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_conv_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_maxpool_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_rows_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_gemm_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_attention_cuda_ops(std::vector<OrtCustomOp*>* ops);
void append_squeeze_cuda_ops(std::vector<OrtCustomOp*>* ops);
constexpr void (*kRegistrations[])(std::vector<OrtCustomOp*>*) = {
    append_pointwise_cpu_ops,  append_conv_cpu_ops,  append_maxpool_cpu_ops,  append_rows_cpu_ops,
    append_gemm_cpu_ops,       append_attention_cpu_ops, append_squeeze_cpu_ops,
    append_pointwise_cuda_ops, append_conv_cuda_ops, append_maxpool_cuda_ops, append_rows_cuda_ops,
    append_gemm_cuda_ops,      append_attention_cuda_ops, append_squeeze_cuda_ops,
};
}  // namespace onnxfuse

using namespace onnxfuse;

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) {
    // Any ORT has API version 1, which is enough to report the problem.
    const OrtApi* old = api_base->GetApi(1);
    std::string msg = std::string("onnxfuse: the custom-op library needs onnxruntime >= 1.") +
                      std::to_string(ORT_API_VERSION) + ", this is " + api_base->GetVersionString();
    return old ? old->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  static std::once_flag once;
  std::call_once(once, [api] { g_ort = api; });
  try {
    static std::vector<OrtCustomOp*> ops;
    static std::once_flag ops_once;
    std::call_once(ops_once, [] {
      for (auto append : kRegistrations) append(&ops);
    });
    // The domain must outlive every session that uses these options; it is small and
    // created once per registration, so it is kept for the life of the process.
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* st = api->CreateCustomOpDomain(kDomain, &domain)) return st;
    for (OrtCustomOp* op : ops) {
      if (OrtStatus* st = api->CustomOpDomain_Add(domain, op)) {
        api->ReleaseCustomOpDomain(domain);
        return st;
      }
    }
    if (OrtStatus* st = api->AddCustomOpDomain(options, domain)) {
      api->ReleaseCustomOpDomain(domain);
      return st;
    }
    return nullptr;
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, (std::string("onnxfuse: registration failed: ") + e.what()).c_str());
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "onnxfuse: registration failed");
  }
}
