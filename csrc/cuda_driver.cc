// What every CUDA kernel of the onnxfuse ops shares: the driver, kernel_meta's common keys,
// modules, the choice of a variant and the launch (cuda_driver.h).
#include "cuda_driver.h"

#ifdef ONNXFUSE_WITH_CUDA

#include "conv.h"  // layout_name

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace onnxfuse {
namespace cuda {

// ---------------------------------------------------------------------------------------
// The driver API, through dlopen
// ---------------------------------------------------------------------------------------

std::string Driver::describe(CUresult r) const {
  const char* s = nullptr;
  if (GetErrorString) GetErrorString(r, &s);
  return std::string(s ? s : "unknown CUDA error") + " (CUresult " + std::to_string(static_cast<int>(r)) + ")";
}

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
    sym("cuMemsetD32Async", &d.MemsetD32Async);
    sym("cuMemsetD8Async", &d.MemsetD8Async);
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

std::string Meta::embedded() const {
  std::string s;
  for (const auto& b : binaries) {
    if (!s.empty()) s += ", ";
    s += std::string(b.cubin ? "cubin" : "ptx") + " sm_" + std::to_string(b.arch) + " (variant " +
         std::to_string(b.variant) + ")";
  }
  for (size_t v = 0; v < variants.size(); ++v)
    if (variants[v].library)
      s += (s.empty() ? "" : ", ") + std::string("cuBLASLt (variant ") + std::to_string(v) + ")";
  return s.empty() ? "none" : s;
}

int64_t meta_int(const Json& o, const char* key, const std::string& where, bool required, int64_t dflt) {
  const Json* v = o.get(key);
  if (!v) {
    if (required) throw Error("kernel_meta: " + where + " has no \"" + key + "\"");
    return dflt;
  }
  if (v->kind != Json::NUMBER || v->num != std::floor(v->num) || std::fabs(v->num) > 9e15)
    throw Error("kernel_meta: " + where + "." + key + " is not an integer");
  return static_cast<int64_t>(v->num);
}

int64_t meta_positive(const Json& o, const char* key, const std::string& where) {
  const int64_t v = meta_int(o, key, where);
  if (v <= 0) throw Error("kernel_meta: " + where + "." + key + " must be positive");
  return v;
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

void check_n_extras(const Json& j, size_t n_inputs) {
  const int64_t n_extras = meta_int(j, "n_extras", "kernel_meta");
  if (n_extras != static_cast<int64_t>(n_inputs) - 1)
    throw Error("kernel_meta has n_extras " + std::to_string(n_extras) + ", the program has " +
                std::to_string(n_inputs - 1) + " extra inputs");
}

void read_xy_layouts(const Json& j, bool* x_nhwc, bool* y_nhwc) {
  for (const char* key : {"x_layout", "y_layout"}) {
    const Json* v = j.get(key);
    if (!v) continue;
    if (v->kind != Json::STRING || (v->str != "nchw" && v->str != "nhwc"))
      throw Error(std::string("kernel_meta: ") + key + " must be \"nchw\" or \"nhwc\"");
    *(key[0] == 'x' ? x_nhwc : y_nhwc) = v->str == "nhwc";
  }
}

// The kernel_meta of this node: the common keys here, the kind's own through read_meta and
// read_variant (docs/format.md).
void CudaKernel::parse_meta(const std::string& text, const OrtKernelInfo* info) {
  Json j = Json::parse(text);
  if (j.kind != Json::OBJECT) throw Error("kernel_meta is not a JSON object");
  Meta& m = meta;
  const int64_t version = meta_int(j, "version", "kernel_meta");
  if (version != 1)
    throw Error("kernel_meta version " + std::to_string(version) + " is not supported by this library (it reads 1)");
  m.name = meta_str(j, "name", "kernel_meta");
  m.kind = j.get("kind") ? meta_str(j, "kind", "kernel_meta") : "pointwise";
  if (m.kind != kind())
    throw Error("kernel_meta describes a kernel of kind \"" + m.kind + "\", this op launches kind \"" + kind() + "\"");
  read_meta(j, prog.inputs.size());

  const Json& variants = meta_array(j, "variants", "kernel_meta");
  if (variants.arr.empty()) throw Error("kernel_meta has no variants");
  for (size_t v = 0; v < variants.arr.size(); ++v) {
    const std::string where = "variants[" + std::to_string(v) + "]";
    const Json& vj = variants.arr[v];
    if (vj.kind != Json::OBJECT) throw Error("kernel_meta: " + where + " is not an object");
    Variant var;
    read_variant(vj, where, &var);
    if (const Json* req = vj.get("requires")) {
      if (req->kind != Json::OBJECT) throw Error("kernel_meta: " + where + ".requires is not an object");
      for (const auto& kv : req->obj) {
        if (kv.first != "n_multiple" && kv.first != "c_multiple" && kv.first != "w_multiple" &&
            kv.first != "ptr_align" && kv.first != "max_elements" && kv.first != "last_multiple")
          throw Error("kernel_meta: " + where + " requires \"" + kv.first + "\", which this library does not know");
      }
      // 0 (or absent) means no requirement.
      var.n_multiple = std::max<int64_t>(1, meta_int(*req, "n_multiple", where + ".requires", false, 1));
      var.c_multiple = std::max<int64_t>(1, meta_int(*req, "c_multiple", where + ".requires", false, 1));
      var.w_multiple = std::max<int64_t>(1, meta_int(*req, "w_multiple", where + ".requires", false, 1));
      var.ptr_align = std::max<int64_t>(1, meta_int(*req, "ptr_align", where + ".requires", false, 1));
      var.max_elements = std::max<int64_t>(0, meta_int(*req, "max_elements", where + ".requires", false, 0));
      var.last_multiple = std::max<int64_t>(1, meta_int(*req, "last_multiple", where + ".requires", false, 1));
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
  bool library = false;
  for (const Variant& v : m.variants) library |= v.library;
  if (m.binaries.empty() && !library) throw Error("kernel_meta lists no binaries");
}

// ---------------------------------------------------------------------------------------
// Kernel parameters
// ---------------------------------------------------------------------------------------

void Params::i32(int64_t v, const char* what) {
  if (v < INT32_MIN || v > INT32_MAX)
    throw Error(std::string(what) + " = " + std::to_string(v) + " does not fit the kernel's 32-bit parameter");
  const int32_t x = static_cast<int32_t>(v);
  uint64_t s = 0;
  std::memcpy(&s, &x, sizeof x);
  slots.push_back(s);
}

void** Params::finish() {
  ptrs.resize(slots.size());
  for (size_t k = 0; k < slots.size(); ++k) ptrs[k] = &slots[k];
  return ptrs.data();
}

Params& thread_params() {
  thread_local Params p;
  p.clear();
  return p;
}

Workspace::Workspace(OrtKernelContext* ctx, int device, size_t bytes) {
  OrtMemoryInfo* info = nullptr;
  if (OrtStatus* st = g_ort->CreateMemoryInfo("Cuda", OrtArenaAllocator, device, OrtMemTypeDefault, &info)) {
    g_ort->ReleaseStatus(st);
    return;
  }
  OrtStatus* st = g_ort->KernelContext_GetAllocator(ctx, info, &alloc);
  g_ort->ReleaseMemoryInfo(info);
  if (st) {
    g_ort->ReleaseStatus(st);
    alloc = nullptr;
    return;
  }
  data = alloc->Alloc(alloc, bytes);
}

Workspace::~Workspace() {
  if (!alloc) return;
  if (data) alloc->Free(alloc, data);
  g_ort->ReleaseAllocator(alloc);
}

SplitBuffers::SplitBuffers(OrtKernelContext* ctx, int device, int64_t tiles, int64_t split, int64_t tile_elems)
    : tiles(tiles),
      cnt_bytes((static_cast<size_t>(tiles) * 4 + 255) / 256 * 256),
      ws(ctx, device, cnt_bytes + static_cast<size_t>(split * tiles * tile_elems) * 4) {}

void SplitBuffers::pass(CUstream stream, const std::string& kernel, Params& p) const {
  const Driver& d = driver();
  CUresult r = d.MemsetD32Async(reinterpret_cast<CUdeviceptr>(ws.data), 0, static_cast<size_t>(tiles), stream);
  if (r != CUDA_SUCCESS) throw Error("cuMemsetD32Async for " + kernel + " failed: " + d.describe(r));
  p.ptr(static_cast<char*>(ws.data) + cnt_bytes);  // ws_ptr
  p.ptr(ws.data);                                 // cnt_ptr
}

// ---------------------------------------------------------------------------------------
// Modules per context, variant choice, launch
// ---------------------------------------------------------------------------------------

CudaKernel::~CudaKernel() {
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

const Loaded& CudaKernel::modules_for(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(ctx);
  if (it != loaded.end()) return *it->second;
  auto l = load(ctx);
  const Loaded& ref = *l;
  loaded.emplace(ctx, std::move(l));
  return ref;
}

std::unique_ptr<Loaded> CudaKernel::load(CUcontext ctx) {
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
  l->device = static_cast<int>(dev);
  d.DeviceGetAttribute(&l->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
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
                    "." + std::to_string(minor) + " failed: " + d.describe(r) +
                    (log[0] ? std::string(": ") + log : ""));
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
    for (const Variant& var : meta.variants) any |= var.library;
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

Target CudaKernel::target(OrtKernelContext* ctx) {
  const Driver& d = driver();
  if (!d.error.empty()) throw Error(d.error);
  void* stream = nullptr;
  check(g_ort->KernelContext_GetGPUComputeStream(ctx, &stream));
  CUcontext cu = nullptr;
  CUresult r = d.CtxGetCurrent(&cu);
  if (r != CUDA_SUCCESS || cu == nullptr)
    throw Error("no current CUDA context in Compute" + (r != CUDA_SUCCESS ? ": " + d.describe(r) : std::string()));
  return Target{&modules_for(cu), static_cast<CUstream>(stream)};
}

int CudaKernel::choose_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest,
                               int64_t c, int64_t w, int64_t last) const {
  const int v = find_variant(t, ptrs, n, largest, c, w, /*split=*/false, 0, last);
  if (v >= 0) return v;
  std::string limits;
  for (const Variant& var : meta.variants)
    limits += (limits.empty() ? "" : ", ") +
              (var.max_elements > 0 ? std::to_string(var.max_elements) : std::string("no limit"));
  throw Error("kernel " + meta.name + ": no variant with a binary for this GPU accepts these tensors (n = " +
              std::to_string(n) + ", largest tensor " + std::to_string(largest) +
              " elements; max_elements per variant: " + limits + "); embedded: " + meta.embedded());
}

int CudaKernel::find_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest,
                             int64_t c, int64_t w, bool split, int64_t m, int64_t last) const {
  for (size_t v = 0; v < meta.variants.size(); ++v) {
    if (!t.L->fn[v]) continue;
    const Variant& var = meta.variants[v];
    if ((var.split > 1) != split) continue;
    if (m > 0 ? var.max_m < m : var.max_m > 0) continue;
    if (n % var.n_multiple != 0) continue;
    if (var.c_multiple > 1 && (c <= 0 || c % var.c_multiple != 0)) continue;
    if (var.w_multiple > 1 && (w <= 0 || w % var.w_multiple != 0)) continue;
    if (var.last_multiple > 1 && (last <= 0 || last % var.last_multiple != 0)) continue;
    if (var.max_elements > 0 && largest > var.max_elements) continue;
    if (int32_params() && largest > INT32_MAX) continue;
    bool aligned = true;
    for (const void* p : ptrs) aligned &= reinterpret_cast<uintptr_t>(p) % static_cast<uint64_t>(var.ptr_align) == 0;
    if (aligned) return static_cast<int>(v);
  }
  return -1;
}

void CudaKernel::launch(const Target& t, int v, int64_t grid_x, int64_t grid_y, Params& params,
                        int64_t grid_z) const {
  if (grid_x > 0x7fffffffLL || grid_y > 65535 || grid_z > 65535)
    throw Error("tensor too large for one launch of " + meta.name + ": grid (" + std::to_string(grid_x) + ", " +
                std::to_string(grid_y) + ", " + std::to_string(grid_z) + ")");
  const Driver& d = driver();
  const Binary& b = *t.L->bin[v];
  CUresult r = d.LaunchKernel(t.L->fn[v], static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y),
                              static_cast<unsigned>(grid_z),
                              static_cast<unsigned>(32 * b.num_warps), 1, 1, static_cast<unsigned>(b.shared),
                              t.stream, params.finish(), nullptr);
  if (r != CUDA_SUCCESS) throw Error("cuLaunchKernel of " + meta.name + " failed: " + d.describe(r));
}

// The pointers of a layer's inputs and its output, in launch order; *largest becomes at
// least the element count of each (for the variants' max_elements).
std::vector<const void*> layer_pointers(const std::vector<TensorRef>& t, const TensorRef& y, int64_t* largest) {
  std::vector<const void*> ptrs;
  for (const TensorRef& x : t) {
    ptrs.push_back(x.data);
    *largest = std::max(*largest, numel(x.shape));
  }
  ptrs.push_back(y.data);
  return ptrs;
}

// The error when a node's x_layout / y_layout differ from its kernel_meta's (FusedConv,
// FusedMaxPool: the kernel addresses X and Y in the layouts it was compiled for).
std::string xy_layout_mismatch(bool node_x_nhwc, bool node_y_nhwc, bool meta_x_nhwc, bool meta_y_nhwc) {
  return std::string("the node has x_layout ") + layout_name(node_x_nhwc) + " and y_layout " +
         layout_name(node_y_nhwc) + ", its kernel_meta has x_layout \"" + (meta_x_nhwc ? "nhwc" : "nchw") +
         "\" and y_layout \"" + (meta_y_nhwc ? "nhwc" : "nchw") + "\" (absent: \"nchw\")";
}

}  // namespace cuda
}  // namespace onnxfuse

#endif  // ONNXFUSE_WITH_CUDA
