// CUDA kernels of the onnxfuse ops (PointwiseChain, FusedConv, FusedMaxPool, FusedRows): launch the
// Triton kernels embedded in each node (docs/format.md) with the CUDA driver API on ORT's
// compute stream.
//
// Shared by the three ops: the driver (libcuda.so.1, opened with dlopen on the first
// Compute, so the library builds and loads on machines without CUDA; cuda.h from the
// triton wheel only provides the types), kernel_meta parsing, the choice of a variant and
// of a binary for the device, and module loading (once per CUDA context, on the first
// Compute in it). Per op: the checks of the inputs, the kernel parameters and the grid of
// its kernel_meta "kind" (pointwise, conv, maxpool; rows in rows_cuda.h).
//
// Compute allocates no device memory and never synchronizes, so it can be captured into a
// CUDA graph.
#include "common.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "conv.h"
#include "json.h"
#include "rows.h"  // kind rows (issue 17)

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
  CUresult (*MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream) = nullptr;
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
    sym("cuMemsetD32Async", &d.MemsetD32Async);
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

// What a kernel computes, and so its parameter list and grid (docs/format.md).
enum class Kind { POINTWISE, CONV, MAXPOOL, ROWS };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::POINTWISE: return "pointwise";
    case Kind::CONV: return "conv";
    case Kind::MAXPOOL: return "maxpool";
    case Kind::ROWS: return "rows";
  }
  return "?";
}

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

// The grid of a maxpool kernel, by the block keys of its variant (docs/format.md, kind
// maxpool): "block" (flat), "block_oh" + "block_ow" (rows), "block_p" + "block_c" (nhwc).
enum class PoolGrid { FLAT, ROWS, PIXELS };

struct Variant {
  int64_t n_multiple = 1;
  int64_t c_multiple = 1;    // maxpool: the channel count C a multiple of this
  int64_t w_multiple = 1;    // maxpool: the input width W a multiple of this
  int64_t ptr_align = 1;
  int64_t max_elements = 0;  // 0: no limit
  int64_t block = 0;         // pointwise, maxpool flat
  int64_t block_m = 0;       // conv
  int64_t block_n = 0;       // conv
  int64_t split = 0;         // conv: split K into this many slices (> 1), grid z; 0: plain
  PoolGrid pool_grid = PoolGrid::FLAT;  // maxpool
  int64_t block_oh = 0, block_ow = 0;   // maxpool rows
  int64_t block_p = 0, block_c = 0;     // maxpool nhwc
  int64_t cols = 0, max_cols = 0;       // rows: N exactly / at most (0: any); rows_cuda.h chooses
  bool looped = false;                  // rows: BLOCK_N chunks (block_m, block_n: the tile)
};

struct Meta {
  Kind kind = Kind::POINTWISE;
  std::string name;
  std::vector<Variant> variants;
  std::vector<Binary> binaries;
  // pointwise
  int rank = 0;
  std::vector<Mode> modes;
  bool any_strided = false;
  // conv: the pool window (PH, PW) when the max pool runs in the epilogue
  bool pool_in_epilogue = false;
  int64_t pool_window[2] = {1, 1};
  // conv and maxpool: the layouts the kernel was compiled for ("x_layout", "y_layout": "nchw"
  // when absent); conv: "w_layout" ("rsck" when absent) and "extra_layouts" (all 0 when
  // absent), as the node's attributes must say
  bool x_nhwc = false;
  bool y_nhwc = false;
  bool w_krsc = false;
  std::vector<int64_t> extra_layouts;

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

// The kernel_meta of a node whose op launches kernels of kind `expected`; n_inputs: the
// program's inputs (the node's, for pointwise).
Meta parse_meta(const std::string& text, Kind expected, size_t n_inputs, const OrtKernelInfo* info) {
  Json j = Json::parse(text);
  if (j.kind != Json::OBJECT) throw Error("kernel_meta is not a JSON object");
  Meta m;
  const int64_t version = meta_int(j, "version", "kernel_meta");
  if (version != 1)
    throw Error("kernel_meta version " + std::to_string(version) + " is not supported by this library (it reads 1)");
  m.name = meta_str(j, "name", "kernel_meta");
  const std::string kind = j.get("kind") ? meta_str(j, "kind", "kernel_meta") : "pointwise";
  if (kind == "pointwise") m.kind = Kind::POINTWISE;
  else if (kind == "conv") m.kind = Kind::CONV;
  else if (kind == "maxpool") m.kind = Kind::MAXPOOL;
  else if (kind == "rows") m.kind = Kind::ROWS;
  else throw Error("kernel_meta: unknown kind \"" + kind + "\"");
  if (m.kind != expected)
    throw Error("kernel_meta describes a kernel of kind \"" + kind + "\", this op launches kind \"" +
                kind_name(expected) + "\"");

  if (m.kind == Kind::POINTWISE) {
    const int64_t rank = meta_int(j, "rank", "kernel_meta");
    if (rank < 0 || rank > 64) throw Error("kernel_meta: bad rank " + std::to_string(rank));
    m.rank = static_cast<int>(rank);
    const Json& modes = meta_array(j, "input_modes", "kernel_meta");
    if (modes.arr.size() != n_inputs)
      throw Error("kernel_meta has " + std::to_string(modes.arr.size()) + " input_modes, the program has " +
                  std::to_string(n_inputs) + " inputs");
    for (const Json& md : modes.arr) {
      if (md.kind != Json::STRING) throw Error("kernel_meta: input_modes must be strings");
      if (md.str == "full") m.modes.push_back(Mode::FULL);
      else if (md.str == "scalar") m.modes.push_back(Mode::SCALAR);
      else if (md.str == "strided") m.modes.push_back(Mode::STRIDED), m.any_strided = true;
      else throw Error("kernel_meta: unknown input mode \"" + md.str + "\"");
    }
  } else if (m.kind != Kind::ROWS) {  // rows: RowsCudaKernel::init checks its own fields
    const int64_t n_extras = meta_int(j, "n_extras", "kernel_meta");
    if (n_extras != static_cast<int64_t>(n_inputs) - 1)
      throw Error("kernel_meta has n_extras " + std::to_string(n_extras) + ", the program has " +
                  std::to_string(n_inputs - 1) + " extra inputs");
  }
  if (m.kind == Kind::CONV || m.kind == Kind::MAXPOOL) {
    for (const char* key : {"x_layout", "y_layout"}) {
      const Json* v = j.get(key);
      if (!v) continue;
      if (v->kind != Json::STRING || (v->str != "nchw" && v->str != "nhwc"))
        throw Error(std::string("kernel_meta: ") + key + " must be \"nchw\" or \"nhwc\"");
      (key[0] == 'x' ? m.x_nhwc : m.y_nhwc) = v->str == "nhwc";
    }
  }
  if (m.kind == Kind::CONV) {
    const Json* pool = j.get("pool_in_epilogue");
    if (pool && pool->kind != Json::NUL) {
      if (pool->kind != Json::ARRAY || pool->arr.size() != 2)
        throw Error("kernel_meta: pool_in_epilogue must be null or [PH, PW]");
      for (int d = 0; d < 2; ++d) {
        const Json& v = pool->arr[d];
        if (v.kind != Json::NUMBER || v.num != std::floor(v.num) || v.num < 1 || v.num > 65536)
          throw Error("kernel_meta: pool_in_epilogue must be null or [PH, PW] of positive integers");
        m.pool_window[d] = static_cast<int64_t>(v.num);
      }
      m.pool_in_epilogue = true;
    }
    if (const Json* v = j.get("w_layout")) {
      if (v->kind != Json::STRING || (v->str != "rsck" && v->str != "krsc"))
        throw Error("kernel_meta: w_layout must be \"rsck\" or \"krsc\"");
      m.w_krsc = v->str == "krsc";
    }
    m.extra_layouts.assign(n_inputs - 1, 0);
    if (const Json* el = j.get("extra_layouts")) {
      if (el->kind != Json::ARRAY || el->arr.size() != n_inputs - 1)
        throw Error("kernel_meta: extra_layouts must be a list of " + std::to_string(n_inputs - 1) +
                    " numbers (one per extra input)");
      for (size_t e = 0; e < el->arr.size(); ++e) {
        const Json& v = el->arr[e];
        if (v.kind != Json::NUMBER || (v.num != 0 && v.num != 1))
          throw Error("kernel_meta: extra_layouts must hold 0 (as is) or 1 (NHWC)");
        m.extra_layouts[e] = static_cast<int64_t>(v.num);
      }
    }
  }

  const Json& variants = meta_array(j, "variants", "kernel_meta");
  if (variants.arr.empty()) throw Error("kernel_meta has no variants");
  for (size_t v = 0; v < variants.arr.size(); ++v) {
    const std::string where = "variants[" + std::to_string(v) + "]";
    const Json& vj = variants.arr[v];
    if (vj.kind != Json::OBJECT) throw Error("kernel_meta: " + where + " is not an object");
    Variant var;
    if (m.kind == Kind::CONV) {
      var.block_m = meta_positive(vj, "block_m", where);
      var.block_n = meta_positive(vj, "block_n", where);
      if (vj.get("split")) var.split = meta_positive(vj, "split", where);
    } else if (m.kind == Kind::ROWS) {
      var.block_m = meta_positive(vj, "block_m", where);
      var.block_n = meta_positive(vj, "block_n", where);
      var.looped = meta_int(vj, "looped", where, false, 0) != 0;
    } else if (m.kind == Kind::MAXPOOL && vj.get("block_oh")) {
      var.pool_grid = PoolGrid::ROWS;
      var.block_oh = meta_positive(vj, "block_oh", where);
      var.block_ow = meta_positive(vj, "block_ow", where);
    } else if (m.kind == Kind::MAXPOOL && vj.get("block_p")) {
      var.pool_grid = PoolGrid::PIXELS;
      var.block_p = meta_positive(vj, "block_p", where);
      var.block_c = meta_positive(vj, "block_c", where);
    } else {
      var.block = meta_positive(vj, "block", where);
    }
    if (const Json* req = vj.get("requires")) {
      if (req->kind != Json::OBJECT) throw Error("kernel_meta: " + where + ".requires is not an object");
      for (const auto& kv : req->obj) {
        if (kv.first != "n_multiple" && kv.first != "c_multiple" && kv.first != "w_multiple" &&
            kv.first != "ptr_align" && kv.first != "max_elements" && kv.first != "cols" && kv.first != "max_cols")
          throw Error("kernel_meta: " + where + " requires \"" + kv.first + "\", which this library does not know");
      }
      // 0 (or absent) means no requirement.
      var.n_multiple = std::max<int64_t>(1, meta_int(*req, "n_multiple", where + ".requires", false, 1));
      var.c_multiple = std::max<int64_t>(1, meta_int(*req, "c_multiple", where + ".requires", false, 1));
      var.w_multiple = std::max<int64_t>(1, meta_int(*req, "w_multiple", where + ".requires", false, 1));
      var.ptr_align = std::max<int64_t>(1, meta_int(*req, "ptr_align", where + ".requires", false, 1));
      var.max_elements = std::max<int64_t>(0, meta_int(*req, "max_elements", where + ".requires", false, 0));
      var.cols = std::max<int64_t>(0, meta_int(*req, "cols", where + ".requires", false, 0));
      var.max_cols = std::max<int64_t>(0, meta_int(*req, "max_cols", where + ".requires", false, 0));
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
// Kernel parameters
// ---------------------------------------------------------------------------------------

// The parameters of one launch: one 8-byte slot per parameter holding its value in its
// first bytes (little endian: an int32 parameter is read from the slot's first 4 bytes),
// and the pointer to each slot that cuLaunchKernel takes. Reused per thread, so a launch
// allocates nothing once warm.
struct Params {
  std::vector<uint64_t> slots;
  std::vector<void*> ptrs;

  void clear() { slots.clear(); }
  void ptr(const void* p) { slots.push_back(reinterpret_cast<uintptr_t>(p)); }
  void i64(int64_t v) { slots.push_back(static_cast<uint64_t>(v)); }
  void i32(int64_t v, const char* what) {
    if (v < INT32_MIN || v > INT32_MAX)
      throw Error(std::string(what) + " = " + std::to_string(v) + " does not fit the kernel's 32-bit parameter");
    const int32_t x = static_cast<int32_t>(v);
    uint64_t s = 0;
    std::memcpy(&s, &x, sizeof x);
    slots.push_back(s);
  }
  void scratch() {  // the global and profile scratch pointers Triton appends: none
    ptr(nullptr);
    ptr(nullptr);
  }
  void** finish() {
    ptrs.resize(slots.size());
    for (size_t k = 0; k < slots.size(); ++k) ptrs[k] = &slots[k];
    return ptrs.data();
  }
};

Params& thread_params() {
  thread_local Params p;
  p.clear();
  return p;
}

// ---------------------------------------------------------------------------------------
// What every CUDA kernel shares: kernel_meta, modules per context, variant choice, launch
// ---------------------------------------------------------------------------------------

// Device memory from the CUDA EP's allocator for one launch (split K's partial tiles),
// freed at the end of Compute: ORT's own CUDA kernels free their scratch buffers the same
// way, after queueing their work; the memory is reused only by work queued later on the
// same stream. data stays null where the EP lends no allocator (the caller falls back).
struct Workspace {
  OrtAllocator* alloc = nullptr;
  void* data = nullptr;
  Workspace(OrtKernelContext* ctx, int device, size_t bytes) {
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
  ~Workspace() {
    if (!alloc) return;
    if (data) alloc->Free(alloc, data);
    g_ort->ReleaseAllocator(alloc);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

// The modules of one kernel instance in one CUDA context: per variant, the function to
// launch and its binary (null where the device has no binary for that variant).
struct Loaded {
  CUcontext ctx = nullptr;
  int device = 0;  // the context's device ordinal
  int sms = 0;     // its multiprocessor count
  std::vector<CUmodule> modules;
  std::vector<CUfunction> fn;
  std::vector<const Binary*> bin;
};

// Where a Compute launches: the current context's modules and ORT's stream.
struct Target {
  const Loaded* L = nullptr;
  CUstream stream = nullptr;
};

struct CudaKernelBase {
  static constexpr const char* kProvider = "CUDAExecutionProvider";
  static constexpr const char* kWhere = " (CUDA)";
  std::string name;
  Program prog;
  Meta meta;
  std::string meta_error;  // why kernel_meta / kernel_<i> cannot be used (reported by Compute)
  std::mutex mu;
  std::map<CUcontext, std::unique_ptr<Loaded>> loaded;

  CudaKernelBase() = default;
  CudaKernelBase(const CudaKernelBase&) = delete;
  CudaKernelBase& operator=(const CudaKernelBase&) = delete;

  ~CudaKernelBase() {
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

  // The driver, ORT's stream and the current context's modules (loaded on first use).
  Target target(OrtKernelContext* ctx) {
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

  // The first variant with a binary for this device whose requirements hold: every pointer
  // a multiple of ptr_align, n a multiple of n_multiple, the channel count c and the input
  // width w (maxpool; 0 elsewhere) multiples of c_multiple and w_multiple, each tensor
  // touched at most max_elements elements (`largest`; kinds with 32-bit parameters: also at
  // most 2^31 - 1).
  int choose_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest,
                     int64_t c = 0, int64_t w = 0) const {
    const int v = find_variant(t, ptrs, n, largest, c, w, /*split=*/false);
    if (v >= 0) return v;
    std::string limits;
    for (const Variant& var : meta.variants)
      limits += (limits.empty() ? "" : ", ") +
                (var.max_elements > 0 ? std::to_string(var.max_elements) : std::string("no limit"));
    throw Error("kernel " + meta.name + ": no variant with a binary for this GPU accepts these tensors (n = " +
                std::to_string(n) + ", largest tensor " + std::to_string(largest) +
                " elements; max_elements per variant: " + limits + "); embedded: " + meta.embedded());
  }

  // choose_variant's search among the split-K variants (split) or the others; -1 if none.
  int find_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest, int64_t c,
                   int64_t w, bool split) const {
    for (size_t v = 0; v < meta.variants.size(); ++v) {
      if (!t.L->fn[v]) continue;
      const Variant& var = meta.variants[v];
      if ((var.split > 1) != split) continue;
      if (n % var.n_multiple != 0) continue;
      if (var.c_multiple > 1 && (c <= 0 || c % var.c_multiple != 0)) continue;
      if (var.w_multiple > 1 && (w <= 0 || w % var.w_multiple != 0)) continue;
      if (var.max_elements > 0 && largest > var.max_elements) continue;
      if (meta.kind != Kind::POINTWISE && largest > INT32_MAX) continue;
      bool aligned = true;
      for (const void* p : ptrs) aligned &= reinterpret_cast<uintptr_t>(p) % static_cast<uint64_t>(var.ptr_align) == 0;
      if (aligned) return static_cast<int>(v);
    }
    return -1;
  }

  void launch(const Target& t, int v, int64_t grid_x, int64_t grid_y, Params& params, int64_t grid_z = 1) const {
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
};

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

// Each extra input's 4 element strides over `over` (FusedMaxPool: X's [N, C, H, W]):
// right-aligned, 0 on broadcast dimensions. (FusedConv: conv_extra_strides, by layout.)
void push_extra_strides(Params& p, const std::vector<TensorRef>& t, size_t first_extra, const Shape& over) {
  for (size_t i = first_extra; i < t.size(); ++i)
    for (int64_t s : broadcast_strides(t[i].shape, over)) p.i32(s, "an extra input's stride");
}

// ---------------------------------------------------------------------------------------
// Kind "pointwise": PointwiseChain
// ---------------------------------------------------------------------------------------

struct PointwiseKernel : CudaKernelBase {
  static constexpr Kind kKind = Kind::POINTWISE;
  static constexpr const char* kOp = kPointwiseChain;
  void init(const OrtKernelInfo*) {}

  void compute(OrtKernelContext* ctx) {
    if (!meta_error.empty()) throw Error(meta_error);
    Io io = bind_io(prog, ctx);
    if (io.n == 0) return;
    const Target t = target(ctx);

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

    // docs/format.md, Launch: every integer 64-bit.
    Params& p = thread_params();
    std::vector<const void*> ptrs;
    for (size_t i = 0; i < n_in; ++i) ptrs.push_back(io.in[i].data);
    for (size_t j = 0; j < n_out; ++j) ptrs.push_back(io.out[j].data);
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i64(io.n);
    if (meta.any_strided) {
      std::vector<Shape> st;
      for (size_t i : strided) st.push_back(broadcast_strides(io.in[i].shape, io.out_shape));
      Collapsed c = collapse(io.out_shape, st);
      if (c.dims.size() > static_cast<size_t>(meta.rank))
        throw Error("output shape " + shape_str(io.out_shape) + " needs rank " + std::to_string(c.dims.size()) +
                    " for its strided inputs, the kernel was compiled for rank " + std::to_string(meta.rank));
      const size_t pad = static_cast<size_t>(meta.rank) - c.dims.size();
      for (size_t k = 0; k < pad; ++k) p.i64(1);
      for (int64_t dim : c.dims) p.i64(dim);
      for (size_t s = 0; s < strided.size(); ++s) {
        for (size_t k = 0; k < pad; ++k) p.i64(0);
        for (int64_t stv : c.strides[s]) p.i64(stv);
      }
    }
    p.scratch();

    const int v = choose_variant(t, ptrs, io.n, io.n);
    const int64_t block = meta.variants[v].block;
    launch(t, v, (io.n + block - 1) / block, 1, p);
  }
};

// The error when a node's x_layout / y_layout differ from its kernel_meta's (FusedConv,
// FusedMaxPool: the kernel addresses X and Y in the layouts it was compiled for).
std::string xy_layout_mismatch(bool node_x_nhwc, bool node_y_nhwc, bool meta_x_nhwc, bool meta_y_nhwc) {
  return std::string("the node has x_layout ") + layout_name(node_x_nhwc) + " and y_layout " +
         layout_name(node_y_nhwc) + ", its kernel_meta has x_layout \"" + (meta_x_nhwc ? "nhwc" : "nchw") +
         "\" and y_layout \"" + (meta_y_nhwc ? "nhwc" : "nchw") + "\" (absent: \"nchw\")";
}

// ---------------------------------------------------------------------------------------
// Kind "conv": FusedConv
// ---------------------------------------------------------------------------------------

struct ConvKernel : CudaKernelBase {
  static constexpr Kind kKind = Kind::CONV;
  static constexpr const char* kOp = kFusedConv;
  ConvParams conv;
  bool has_pool = false;
  PoolParams pool;
  ConvLayouts lay;

  void init(const OrtKernelInfo* info) {
    if (prog.outputs.size() != 1)
      throw Error("the program has " + std::to_string(prog.outputs.size()) + " outputs, expected 1");
    if (prog.inputs.empty()) throw Error("the program has no inputs (its %0 is the conv output)");
    conv = read_conv_params(info);
    has_pool = read_pool_params(info, /*required=*/false, &pool);
    lay = read_conv_layouts(info, prog.inputs.size() - 1);
  }

  // The node's layouts and the kernel's must agree: the kernel addresses X, W and Y in the
  // layouts it was compiled for (docs/format.md, FusedConv, Layouts).
  void check_layout_meta() {
    if (!meta_error.empty()) return;
    if (lay.x_nhwc != meta.x_nhwc || lay.y_nhwc != meta.y_nhwc)
      meta_error = xy_layout_mismatch(lay.x_nhwc, lay.y_nhwc, meta.x_nhwc, meta.y_nhwc);
    else if (lay.extra != meta.extra_layouts)
      meta_error = "the node has extra_layouts " + ints_str(lay.extra.data(), lay.extra.size()) +
                   ", its kernel_meta has extra_layouts " +
                   ints_str(meta.extra_layouts.data(), meta.extra_layouts.size()) + " (absent: all 0)";
    else if (lay.w_krsc != meta.w_krsc)
      meta_error = std::string("the node has w_layout ") + w_layout_name(lay.w_krsc) +
                   ", its kernel_meta has w_layout \"" + (meta.w_krsc ? "krsc" : "rsck") + "\" (absent: \"rsck\")";
  }

  // The node's pool and the kernel's must agree: the kernel pools in its epilogue, which
  // needs windows that tile the conv output (docs/format.md, FusedConv).
  void check_pool_meta() {
    if (!meta_error.empty()) return;
    if (has_pool != meta.pool_in_epilogue) {
      meta_error = has_pool ? "the node has pool_* attributes, its kernel_meta has no pool_in_epilogue"
                            : "the node has no pool_* attributes, its kernel_meta has pool_in_epilogue";
      return;
    }
    if (!has_pool) return;
    const bool tiles = pool.kernel[0] == pool.strides[0] && pool.kernel[1] == pool.strides[1] &&
                       pool.pads[0] == 0 && pool.pads[1] == 0 && pool.pads[2] == 0 && pool.pads[3] == 0 &&
                       pool.dilations[0] == 1 && pool.dilations[1] == 1 && !pool.ceil_mode;
    if (!tiles || pool.kernel[0] != meta.pool_window[0] || pool.kernel[1] != meta.pool_window[1])
      meta_error = "the node's max pool (pool_kernel " + ints_str(pool.kernel, 2) + ", pool_strides " +
                   ints_str(pool.strides, 2) + ", pool_pads " + ints_str(pool.pads, 4) + ", pool_dilations " +
                   ints_str(pool.dilations, 2) + ", pool_ceil_mode " + std::to_string(pool.ceil_mode ? 1 : 0) +
                   ") is not the kernel's pool_in_epilogue " + ints_str(meta.pool_window, 2) +
                   " with windows that tile the conv output";
  }

  void compute(OrtKernelContext* ctx) {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 3, /*f32_for_half=*/false);
    const ConvShapes s =
        conv_shapes(conv, has_pool ? &pool : nullptr, t[0].shape, t[1].shape, t[2].shape, lay.x_nhwc, lay.w_krsc);
    const Shape conv_out = s.conv_out();
    for (size_t i = 3; i < t.size(); ++i)
      check_conv_extra(i, static_cast<int>(i - 2), t[i].shape, lay.extra_nhwc(i - 3), conv_out);
    const TensorRef y = layer_output(prog, ctx, /*f32_for_half=*/false, s.y_shape(lay.y_nhwc));
    const int64_t n_out = numel(s.out());
    // M: the output positions the kernel computes (with the pool: the windows' positions,
    // each window padded to a power of two of rows)
    int64_t win = 1;
    while (win < meta.pool_window[0] * meta.pool_window[1]) win *= 2;
    const int64_t m = meta.pool_in_epilogue ? s.N * s.OP * s.OQ * win : s.N * s.P * s.Q;
    if (n_out == 0 || m == 0) return;
    const Target tg = target(ctx);

    int64_t largest = std::max(numel(conv_out), n_out);
    const std::vector<const void*> ptrs = layer_pointers(t, y, &largest);

    // docs/format.md, kind conv: pointers, int32 N H W P Q OP OQ (whatever the layouts:
    // the kernel addresses X, W and Y in its compiled layouts), then each extra input's 4
    // strides over [N, K, P, Q] (an NHWC extra's permuted).
    Params& p = thread_params();
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(s.N, "N");
    p.i32(s.H, "H");
    p.i32(s.W, "W");
    p.i32(s.P, "P");
    p.i32(s.Q, "Q");
    p.i32(s.OP, "OP");
    p.i32(s.OQ, "OQ");
    for (size_t i = 3; i < t.size(); ++i)
      for (int64_t st : conv_extra_strides(t[i].shape, lay.extra_nhwc(i - 3), conv_out))
        p.i32(st, "an extra input's stride");

    // Split K where the split variant's tiles number at most half the SMs (codegen_conv: a
    // small M, typically a deep layer at batch 1) and the EP lends a workspace; otherwise
    // the plain variant.
    const int sv = find_variant(tg, ptrs, n_out, largest, 0, 0, /*split=*/true);
    if (sv >= 0) {
      const Variant& var = meta.variants[sv];
      const int64_t gx = (m + var.block_m - 1) / var.block_m, gy = (s.K + var.block_n - 1) / var.block_n;
      if (2 * gx * gy <= tg.L->sms) {
        // [tiles] int32 arrival counters (zeroed here), then [split, tiles, BLOCK_M * BLOCK_N] fp32 partials
        const size_t cnt_bytes = (static_cast<size_t>(gx * gy) * 4 + 255) / 256 * 256;
        const size_t bytes = cnt_bytes + static_cast<size_t>(var.split * gx * gy * var.block_m * var.block_n) * 4;
        Workspace ws(ctx, tg.L->device, bytes);
        if (ws.data) {
          const Driver& d = driver();
          CUresult r = d.MemsetD32Async(reinterpret_cast<CUdeviceptr>(ws.data), 0, static_cast<size_t>(gx * gy),
                                        tg.stream);
          if (r != CUDA_SUCCESS) throw Error("cuMemsetD32Async for " + meta.name + " failed: " + d.describe(r));
          p.ptr(static_cast<char*>(ws.data) + cnt_bytes);  // ws_ptr
          p.ptr(ws.data);                                 // cnt_ptr
          p.scratch();
          launch(tg, sv, gx, gy, p, var.split);
          return;  // ws goes back to the EP's arena: later work on this stream reuses it in order
        }
      }
    }
    p.scratch();
    const int v = choose_variant(tg, ptrs, n_out, largest);
    const Variant& var = meta.variants[v];
    launch(tg, v, (m + var.block_m - 1) / var.block_m, (s.K + var.block_n - 1) / var.block_n, p);
  }
};

// ---------------------------------------------------------------------------------------
// Kind "maxpool": FusedMaxPool
// ---------------------------------------------------------------------------------------

struct MaxPoolKernel : CudaKernelBase {
  static constexpr Kind kKind = Kind::MAXPOOL;
  static constexpr const char* kOp = kFusedMaxPool;
  PoolParams pool;
  PoolLayouts lay;

  void init(const OrtKernelInfo* info) {
    if (prog.outputs.size() != 1)
      throw Error("the program has " + std::to_string(prog.outputs.size()) + " outputs, expected 1");
    read_pool_params(info, /*required=*/true, &pool);
    lay = read_pool_layouts(info);
  }

  // The node's layouts and the kernel's must agree (docs/format.md, FusedMaxPool).
  void check_layout_meta() {
    if (!meta_error.empty()) return;
    if (lay.x_nhwc != meta.x_nhwc || lay.y_nhwc != meta.y_nhwc)
      meta_error = xy_layout_mismatch(lay.x_nhwc, lay.y_nhwc, meta.x_nhwc, meta.y_nhwc);
  }

  void compute(OrtKernelContext* ctx) {
    if (!meta_error.empty()) throw Error(meta_error);
    const std::vector<TensorRef> t = read_layer_inputs(prog, ctx, 1, /*f32_for_half=*/false);
    const Shape xs = pool_input_shape(t[0].shape, lay.x_nhwc);  // logical [N, C, H, W]
    for (size_t i = 1; i < t.size(); ++i)
      check_extra(i, static_cast<int>(i), t[i].shape, xs,
                  lay.x_nhwc ? "X's logical shape (x_layout NHWC) [N, C, H, W] =" : "X's shape");
    const Shape out_shape = pool_shape(pool, xs);
    const TensorRef y = layer_output(prog, ctx, /*f32_for_half=*/false, pool_y_shape(out_shape, lay.y_nhwc));
    const int64_t n_out = numel(out_shape);
    if (n_out == 0) return;
    const Target tg = target(ctx);

    int64_t largest = n_out;
    const std::vector<const void*> ptrs = layer_pointers(t, y, &largest);

    // docs/format.md, kind maxpool: pointers, int32 N C H W OH OW (the logical sizes in any
    // layout), 4 strides per extra over [N, C, H, W].
    Params& p = thread_params();
    for (const void* ptr : ptrs) p.ptr(ptr);
    p.i32(xs[0], "N");
    p.i32(xs[1], "C");
    p.i32(xs[2], "H");
    p.i32(xs[3], "W");
    p.i32(out_shape[2], "OH");
    p.i32(out_shape[3], "OW");
    push_extra_strides(p, t, 1, xs);
    p.scratch();

    const int v = choose_variant(tg, ptrs, n_out, largest, xs[1], xs[3]);
    const Variant& var = meta.variants[v];
    const int64_t n = xs[0], c = xs[1], oh = out_shape[2], ow = out_shape[3];
    switch (var.pool_grid) {
      case PoolGrid::FLAT: launch(tg, v, ceil_div(n_out, var.block), 1, p); break;
      case PoolGrid::ROWS:
        launch(tg, v, n * c * ceil_div(oh, var.block_oh) * ceil_div(ow, var.block_ow), 1, p);
        break;
      case PoolGrid::PIXELS: launch(tg, v, ceil_div(n * oh * ow, var.block_p), ceil_div(c, var.block_c), p); break;
    }
  }
};

// ---------------------------------------------------------------------------------------
// Kind "rows": FusedRows (issue 17)
// ---------------------------------------------------------------------------------------

#include "rows_cuda.h"

// ---------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------

void after_meta(CudaKernelBase*) {}
void after_meta(ConvKernel* k) {
  k->check_pool_meta();
  k->check_layout_meta();
}
void after_meta(MaxPoolKernel* k) { k->check_layout_meta(); }

template <class K>
OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<K>();
    k->prog = read_program(info);
    k->name = name;
    k->init(info);
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
        k->meta = parse_meta(meta, K::kKind, k->prog.inputs.size(), info);
      } catch (const std::exception& e) {
        k->meta_error = e.what();
      }
    }
    after_meta(k.get());
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(K::kOp, name) + " (CUDA): " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_cuda_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef pointwise = make_op<PointwiseKernel>(1, create_kernel<PointwiseKernel>);
  static OpDef conv = make_op<ConvKernel>(3, create_kernel<ConvKernel>);
  static OpDef pool = make_op<MaxPoolKernel>(1, create_kernel<MaxPoolKernel>);
  static OpDef rows = make_op<RowsCudaKernel>(1, create_kernel<RowsCudaKernel>);  // kind rows (issue 17)
  ops->push_back(&pointwise);
  ops->push_back(&conv);
  ops->push_back(&pool);
  ops->push_back(&rows);
}

}  // namespace onnxfuse

#else  // built without cuda.h: CPU only

namespace onnxfuse {
void append_cuda_ops(std::vector<OrtCustomOp*>*) {}
}  // namespace onnxfuse

#endif
