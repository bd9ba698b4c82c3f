// CUDA kernel of onnxfuse::PointwiseChain: launches the Triton kernels embedded in the
// node (docs/format.md) with the CUDA driver API on ORT's compute stream.
//
// libcuda.so.1 is opened with dlopen on the first Compute, so the library builds and loads
// on machines without CUDA; cuda.h (from the triton wheel) only provides the types.
// Compute allocates no device memory and never synchronizes, so it can be captured into
// a CUDA graph. Modules are loaded once per CUDA context, on the first Compute in it.
#include "common.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "json.h"

namespace onnxfuse {
namespace {

// ---------------------------------------------------------------------------------------
// The driver API, through dlopen
// ---------------------------------------------------------------------------------------

struct Driver {
  std::string error;  // why the driver cannot be used; empty when it can
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxGetDevice)(CUdevice*) = nullptr;
  CUresult (*CtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*CtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned, CUjit_option*, void**) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*ModuleUnload)(CUmodule) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;

  std::string describe(CUresult r) const {
    const char* s = nullptr;
    if (GetErrorString) GetErrorString(r, &s);
    return std::string(s ? s : "unknown CUDA error") + " (CUresult " + std::to_string(static_cast<int>(r)) + ")";
  }
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      d.error = std::string("libcuda.so.1 could not be loaded (") + (e ? e : "unknown reason") +
                "): running onnxfuse kernels on CUDA needs the NVIDIA driver";
      return d;
    }
    auto sym = [&](const char* name, auto* fp) {
      void* p = dlsym(h, name);
      if (!p && d.error.empty()) d.error = std::string("libcuda.so.1 has no symbol ") + name + " (driver too old?)";
      *fp = reinterpret_cast<std::remove_pointer_t<decltype(fp)>>(p);
    };
    sym("cuGetErrorString", &d.GetErrorString);
    sym("cuInit", &d.Init);
    sym("cuCtxGetCurrent", &d.CtxGetCurrent);
    sym("cuCtxGetDevice", &d.CtxGetDevice);
    sym("cuCtxPushCurrent_v2", &d.CtxPushCurrent);
    sym("cuCtxPopCurrent_v2", &d.CtxPopCurrent);
    sym("cuDeviceGetAttribute", &d.DeviceGetAttribute);
    sym("cuModuleLoadDataEx", &d.ModuleLoadDataEx);
    sym("cuModuleGetFunction", &d.ModuleGetFunction);
    sym("cuModuleUnload", &d.ModuleUnload);
    sym("cuFuncSetAttribute", &d.FuncSetAttribute);
    sym("cuLaunchKernel", &d.LaunchKernel);
    if (d.error.empty()) {
      CUresult r = d.Init(0);
      if (r != CUDA_SUCCESS) d.error = "cuInit failed: " + d.describe(r);
    }
    return d;
  }();
  return d;
}

// ---------------------------------------------------------------------------------------
// kernel_meta
// ---------------------------------------------------------------------------------------

enum class Mode { FULL, SCALAR, STRIDED };

struct Binary {
  int index = 0;  // i of kernel_<i>
  int variant = 0;
  int arch = 0;
  bool cubin = true;
  std::string entry;
  int num_warps = 4;
  int shared = 0;
  int64_t global_scratch = 0;
  int64_t profile_scratch = 0;
  std::string code;  // cubin bytes or PTX text (std::string keeps a terminating NUL)
};

struct Variant {
  int64_t n_multiple = 1;
  int64_t ptr_align = 1;
  int64_t max_elements = 0;  // 0: no limit
  int64_t block = 0;
};

struct Meta {
  std::string name;
  int rank = 0;
  std::vector<Mode> modes;
  std::vector<Variant> variants;
  std::vector<Binary> binaries;
  bool any_strided = false;

  // "cubin sm_90 (variant 0), ptx sm_90 (variant 0), ..."
  std::string embedded() const {
    std::string s;
    for (const auto& b : binaries) {
      if (!s.empty()) s += ", ";
      s += std::string(b.cubin ? "cubin" : "ptx") + " sm_" + std::to_string(b.arch) + " (variant " +
           std::to_string(b.variant) + ")";
    }
    return s.empty() ? "none" : s;
  }
};

int64_t meta_int(const Json& o, const char* key, const std::string& where, bool required = true, int64_t dflt = 0) {
  const Json* v = o.get(key);
  if (!v) {
    if (required) throw Error("kernel_meta: " + where + " has no \"" + key + "\"");
    return dflt;
  }
  if (v->kind != Json::NUMBER || v->num != std::floor(v->num) || std::fabs(v->num) > 9e15)
    throw Error("kernel_meta: " + where + "." + key + " is not an integer");
  return static_cast<int64_t>(v->num);
}

std::string meta_str(const Json& o, const char* key, const std::string& where) {
  const Json* v = o.get(key);
  if (!v || v->kind != Json::STRING) throw Error("kernel_meta: " + where + " has no string \"" + key + "\"");
  return v->str;
}

const Json& meta_array(const Json& o, const char* key, const std::string& where) {
  const Json* v = o.get(key);
  if (!v || v->kind != Json::ARRAY) throw Error("kernel_meta: " + where + " has no array \"" + key + "\"");
  return *v;
}

Meta parse_meta(const std::string& text, const Program& prog, const OrtKernelInfo* info) {
  Json j = Json::parse(text);
  if (j.kind != Json::OBJECT) throw Error("kernel_meta is not a JSON object");
  Meta m;
  const int64_t version = meta_int(j, "version", "kernel_meta");
  if (version != 1)
    throw Error("kernel_meta version " + std::to_string(version) + " is not supported by this library (it reads 1)");
  m.name = meta_str(j, "name", "kernel_meta");
  const int64_t rank = meta_int(j, "rank", "kernel_meta");
  if (rank < 0 || rank > 64) throw Error("kernel_meta: bad rank " + std::to_string(rank));
  m.rank = static_cast<int>(rank);

  const Json& modes = meta_array(j, "input_modes", "kernel_meta");
  if (modes.arr.size() != prog.inputs.size())
    throw Error("kernel_meta has " + std::to_string(modes.arr.size()) + " input_modes, the program has " +
                std::to_string(prog.inputs.size()) + " inputs");
  for (const Json& md : modes.arr) {
    if (md.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
    if (md.str == "full") m.modes.push_back(Mode::FULL);
    else if (md.str == "scalar") m.modes.push_back(Mode::SCALAR);
    else if (md.str == "strided") m.modes.push_back(Mode::STRIDED), m.any_strided = true;
    else throw Error("kernel_meta: unknown input mode \"" + md.str + "\"");
  }

  const Json& variants = meta_array(j, "variants", "kernel_meta");
  if (variants.arr.empty()) throw Error("kernel_meta has no variants");
  for (size_t v = 0; v < variants.arr.size(); ++v) {
    const std::string where = "variants[" + std::to_string(v) + "]";
    const Json& vj = variants.arr[v];
    if (vj.kind != Json::OBJECT) throw Error("kernel_meta: " + where + " is not an object");
    Variant var;
    var.block = meta_int(vj, "block", where);
    if (var.block <= 0) throw Error("kernel_meta: " + where + ".block must be positive");
    if (const Json* req = vj.get("requires")) {
      if (req->kind != Json::OBJECT) throw Error("kernel_meta: " + where + ".requires is not an object");
      for (const auto& kv : req->obj) {
        if (kv.first != "n_multiple" && kv.first != "ptr_align" && kv.first != "max_elements")
          throw Error("kernel_meta: " + where + " requires \"" + kv.first + "\", which this library does not know");
      }
      // 0 (or absent) means no requirement.
      var.n_multiple = std::max<int64_t>(1, meta_int(*req, "n_multiple", where + ".requires", false, 1));
      var.ptr_align = std::max<int64_t>(1, meta_int(*req, "ptr_align", where + ".requires", false, 1));
      var.max_elements = std::max<int64_t>(0, meta_int(*req, "max_elements", where + ".requires", false, 0));
    }
    m.variants.push_back(var);
  }

  const Json& bins = meta_array(j, "binaries", "kernel_meta");
  for (size_t i = 0; i < bins.arr.size(); ++i) {
    const std::string where = "binaries[" + std::to_string(i) + "]";
    const Json& bj = bins.arr[i];
    if (bj.kind != Json::OBJECT) throw Error("kernel_meta: " + where + " is not an object");
    Binary b;
    b.index = static_cast<int>(i);
    const int64_t var = meta_int(bj, "variant", where);
    if (var < 0 || var >= static_cast<int64_t>(m.variants.size()))
      throw Error("kernel_meta: " + where + ".variant " + std::to_string(var) + " does not exist");
    b.variant = static_cast<int>(var);
    b.arch = static_cast<int>(meta_int(bj, "arch", where));
    const std::string fmt = meta_str(bj, "format", where);
    if (fmt != "cubin" && fmt != "ptx") throw Error("kernel_meta: " + where + ".format \"" + fmt + "\" is unknown");
    b.cubin = fmt == "cubin";
    b.entry = meta_str(bj, "entry", where);
    b.num_warps = static_cast<int>(meta_int(bj, "num_warps", where));
    if (b.num_warps < 1 || b.num_warps > 32) throw Error("kernel_meta: " + where + ".num_warps is out of range");
    b.shared = static_cast<int>(meta_int(bj, "shared", where, false, 0));
    b.global_scratch = meta_int(bj, "global_scratch_size", where, false, 0);
    b.profile_scratch = meta_int(bj, "profile_scratch_size", where, false, 0);
    if (meta_int(bj, "num_ctas", where, false, 1) != 1)
      throw Error("kernel_meta: " + where + " uses thread-block clusters (num_ctas != 1), not supported");
    const std::string attr = "kernel_" + std::to_string(i);
    if (!get_string_attr(info, attr.c_str(), &b.code))
      throw Error("the node has no string attribute '" + attr + "' (the code of kernel_meta's " + where +
                  "; onnxruntime's C API cannot read a STRINGS attribute, so docs/format.md keeps each binary "
                  "in its own attribute kernel_<i>)");
    if (b.code.empty()) throw Error("attribute '" + attr + "' is empty");
    m.binaries.push_back(std::move(b));
  }
  if (m.binaries.empty()) throw Error("kernel_meta lists no binaries");
  return m;
}

// ---------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------

// The modules of one kernel instance in one CUDA context: per variant, the function to
// launch and its binary (null where the device has no binary for that variant).
struct Loaded {
  CUcontext ctx = nullptr;
  std::vector<CUmodule> modules;
  std::vector<CUfunction> fn;
  std::vector<const Binary*> bin;
};

struct CudaKernel {
  Program prog;
  Meta meta;
  std::string meta_error;  // why kernel_meta / kernel_<i> cannot be used (reported by Compute)
  std::string name;
  std::mutex mu;
  std::map<CUcontext, std::unique_ptr<Loaded>> loaded;

  ~CudaKernel() {
    const Driver& d = driver();
    if (!d.error.empty()) return;
    for (auto& kv : loaded) {
      if (kv.second->modules.empty()) continue;
      if (d.CtxPushCurrent(kv.first) != CUDA_SUCCESS) continue;  // context gone: nothing to free
      for (CUmodule mod : kv.second->modules) d.ModuleUnload(mod);
      CUcontext popped;
      d.CtxPopCurrent(&popped);
    }
  }

  const Loaded& modules_for(CUcontext ctx) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = loaded.find(ctx);
    if (it != loaded.end()) return *it->second;
    auto l = load(ctx);
    const Loaded& ref = *l;
    loaded.emplace(ctx, std::move(l));
    return ref;
  }

  std::unique_ptr<Loaded> load(CUcontext ctx) {
    const Driver& d = driver();
    CUdevice dev = 0;
    CUresult r = d.CtxGetDevice(&dev);
    if (r != CUDA_SUCCESS) throw Error("cuCtxGetDevice failed: " + d.describe(r));
    int major = 0, minor = 0;
    d.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
    d.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
    const int cc = major * 10 + minor;

    auto l = std::make_unique<Loaded>();
    l->ctx = ctx;
    l->fn.assign(meta.variants.size(), nullptr);
    l->bin.assign(meta.variants.size(), nullptr);
    try {
      bool any = false;
      for (size_t v = 0; v < meta.variants.size(); ++v) {
        // A cubin built for exactly this compute capability, else the newest PTX not
        // newer than the device (the driver compiles it).
        const Binary* pick = nullptr;
        for (const Binary& b : meta.binaries)
          if (b.variant == static_cast<int>(v) && b.cubin && b.arch == cc) {
            pick = &b;
            break;
          }
        if (!pick)
          for (const Binary& b : meta.binaries)
            if (b.variant == static_cast<int>(v) && !b.cubin && b.arch <= cc && (!pick || b.arch > pick->arch))
              pick = &b;
        if (!pick) continue;
        if (pick->global_scratch != 0 || pick->profile_scratch != 0)
          throw Error("kernel " + meta.name + " (kernel_" + std::to_string(pick->index) +
                      ") needs scratch memory (global " + std::to_string(pick->global_scratch) + " B, profile " +
                      std::to_string(pick->profile_scratch) + " B), which this library does not provide yet");
        char log[8192] = {0};
        CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
        void* vals[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof(log) - 1))};
        CUmodule mod = nullptr;
        r = d.ModuleLoadDataEx(&mod, pick->code.c_str(), 2, opts, vals);
        if (r != CUDA_SUCCESS)
          throw Error("loading kernel " + meta.name + " (" + (pick->cubin ? "cubin" : "ptx") + " sm_" +
                      std::to_string(pick->arch) + ") on a device of compute capability " + std::to_string(major) +
                      "." + std::to_string(minor) + " failed: " + d.describe(r) + (log[0] ? std::string(": ") + log : ""));
        l->modules.push_back(mod);
        CUfunction fn = nullptr;
        r = d.ModuleGetFunction(&fn, mod, pick->entry.c_str());
        if (r != CUDA_SUCCESS)
          throw Error("kernel " + meta.name + ": entry '" + pick->entry + "' not found in kernel_" +
                      std::to_string(pick->index) + ": " + d.describe(r));
        if (pick->shared > 48 * 1024) {
          r = d.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, pick->shared);
          if (r != CUDA_SUCCESS)
            throw Error("kernel " + meta.name + " needs " + std::to_string(pick->shared) +
                        " B of shared memory: " + d.describe(r));
        }
        l->fn[v] = fn;
        l->bin[v] = pick;
        any = true;
      }
      if (!any)
        throw Error("kernel " + meta.name + " has no binary for this GPU: compute capability " +
                    std::to_string(major) + "." + std::to_string(minor) + " (sm_" + std::to_string(cc) +
                    "), embedded: " + meta.embedded() +
                    ". Re-run onnxfuse optimize with --target sm_" + std::to_string(cc) + " (or a PTX target <= sm_" +
                    std::to_string(cc) + ")");
    } catch (...) {
      for (CUmodule mod : l->modules) d.ModuleUnload(mod);
      throw;
    }
    return l;
  }

  void compute(OrtKernelContext* ctx) {
    if (!meta_error.empty()) throw Error(meta_error);
    Io io = bind_io(prog, ctx);
    if (io.n == 0) return;
    const Driver& d = driver();
    if (!d.error.empty()) throw Error(d.error);
    void* stream = nullptr;
    check(g_ort->KernelContext_GetGPUComputeStream(ctx, &stream));
    CUcontext cu = nullptr;
    CUresult r = d.CtxGetCurrent(&cu);
    if (r != CUDA_SUCCESS || cu == nullptr)
      throw Error("no current CUDA context in Compute" + (r != CUDA_SUCCESS ? ": " + d.describe(r) : std::string()));
    const Loaded& L = modules_for(cu);

    const size_t n_in = prog.inputs.size();
    const size_t n_out = prog.outputs.size();
    std::vector<size_t> strided;
    for (size_t i = 0; i < n_in; ++i) {
      const int64_t ni = numel(io.in[i].shape);
      switch (meta.modes[i]) {
        case Mode::FULL:
          if (ni != io.n)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it in mode 'full', which needs the output's shape " +
                        shape_str(io.out_shape) + " (the model's shapes changed since it was optimized?)");
          break;
        case Mode::SCALAR:
          if (ni != 1)
            throw Error("input " + std::to_string(i) + " has shape " + shape_str(io.in[i].shape) +
                        ", its kernel reads it in mode 'scalar', which needs one element");
          break;
        case Mode::STRIDED: strided.push_back(i); break;
      }
    }

    // Kernel parameters (docs/format.md, Launch): every value 64-bit, kept in `args`,
    // `params` pointing at each.
    thread_local std::vector<uint64_t> args;
    thread_local std::vector<void*> params;
    args.clear();
    for (size_t i = 0; i < n_in; ++i) args.push_back(reinterpret_cast<uintptr_t>(io.in[i].data));
    for (size_t j = 0; j < n_out; ++j) args.push_back(reinterpret_cast<uintptr_t>(io.out[j].data));
    args.push_back(static_cast<uint64_t>(io.n));
    if (meta.any_strided) {
      std::vector<Shape> st;
      for (size_t i : strided) st.push_back(broadcast_strides(io.in[i].shape, io.out_shape));
      Collapsed c = collapse(io.out_shape, st);
      if (c.dims.size() > static_cast<size_t>(meta.rank))
        throw Error("output shape " + shape_str(io.out_shape) + " needs rank " + std::to_string(c.dims.size()) +
                    " for its strided inputs, the kernel was compiled for rank " + std::to_string(meta.rank));
      const size_t pad = static_cast<size_t>(meta.rank) - c.dims.size();
      for (size_t k = 0; k < pad; ++k) args.push_back(1);
      for (int64_t dim : c.dims) args.push_back(static_cast<uint64_t>(dim));
      for (size_t s = 0; s < strided.size(); ++s) {
        for (size_t k = 0; k < pad; ++k) args.push_back(0);
        for (int64_t stv : c.strides[s]) args.push_back(static_cast<uint64_t>(stv));
      }
    }
    args.push_back(0);  // global scratch
    args.push_back(0);  // profile scratch
    params.resize(args.size());
    for (size_t k = 0; k < args.size(); ++k) params[k] = &args[k];

    // The first variant whose requirements hold (and that has a binary for this device).
    int chosen = -1;
    for (size_t v = 0; v < meta.variants.size() && chosen < 0; ++v) {
      if (!L.fn[v]) continue;
      const Variant& var = meta.variants[v];
      if (io.n % var.n_multiple != 0) continue;
      if (var.max_elements > 0 && io.n > var.max_elements) continue;
      bool aligned = true;
      for (size_t k = 0; k < n_in + n_out; ++k) aligned &= args[k] % static_cast<uint64_t>(var.ptr_align) == 0;
      if (aligned) chosen = static_cast<int>(v);
    }
    if (chosen < 0)
      throw Error("kernel " + meta.name + ": no variant with a binary for this GPU accepts these tensors (n = " +
                  std::to_string(io.n) + "); embedded: " + meta.embedded());

    const Binary& b = *L.bin[chosen];
    const int64_t block = meta.variants[chosen].block;
    const int64_t grid = (io.n + block - 1) / block;
    if (grid > 0x7fffffffLL)
      throw Error("tensor too large for one launch: " + std::to_string(grid) + " programs of " + std::to_string(block));
    r = d.LaunchKernel(L.fn[chosen], static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(32 * b.num_warps), 1, 1,
                       static_cast<unsigned>(b.shared), static_cast<CUstream>(stream), params.data(), nullptr);
    if (r != CUDA_SUCCESS) throw Error("cuLaunchKernel of " + meta.name + " failed: " + d.describe(r));
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    std::string text;
    if (!get_string_attr(info, "program", &text)) throw Error("the node has no string attribute 'program'");
    auto k = std::make_unique<CudaKernel>();
    k->prog = parse_program(text);
    k->name = name;
    // KernelInfo is only valid here, so the attributes are read now; a problem with them
    // is reported by the first Compute (the session itself can still be created).
    std::string meta;
    if (!get_string_attr(info, "kernel_meta", &meta)) {
      k->meta_error =
          "the model was optimized without compiling GPU kernels (the node has no 'kernel_meta' attribute), so it "
          "cannot run on the CUDA execution provider: re-run `onnxfuse optimize` with --target (e.g. --target "
          "sm_90), or run it on the CPU execution provider";
    } else {
      try {
        k->meta = parse_meta(meta, k->prog, info);
      } catch (const std::exception& e) {
        k->meta_error = e.what();
      }
    }
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kPointwiseChain, name) + " (CUDA): " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

OrtStatus* ORT_API_CALL compute(void* kernel, OrtKernelContext* ctx) {
  CudaKernel* k = static_cast<CudaKernel*>(kernel);
  try {
    k->compute(ctx);
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kPointwiseChain, k->name) + " (CUDA): " + e.what());
  }
}

void ORT_API_CALL destroy(void* kernel) { delete static_cast<CudaKernel*>(kernel); }

OpDef make_cuda_op() {
  OpDef op;
  init_common_op(&op, kPointwiseChain, 1);
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = destroy;
  return op;
}

}  // namespace

void append_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_cuda_op();
  ops->push_back(&op);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
