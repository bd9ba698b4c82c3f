// What every CUDA kernel of the onnxfuse ops shares (cuda_driver.cc): the driver API
// (libcuda.so.1, opened with dlopen on the first Compute, so the library builds and loads
// on machines without CUDA; cuda.h from the triton wheel only provides the types), the
// common part of kernel_meta (version, name, kind, the variants' requirements, the
// binaries and their kernel_<i> attributes), the choice of a variant and of a binary for
// the device, module loading (once per CUDA context, on the first Compute in it), kernel
// parameters and the launch.
//
// Each kind (csrc/kinds/<kind>_cuda.cc) derives its kernel from CudaKernel: it reads its
// own kernel_meta keys and its variants' block sizes, checks the node against them, and
// in compute() checks its inputs, packs its parameters and picks its grid
// (docs/format.md, "kernel_meta kinds").
//
// Compute allocates no device memory (but split K's workspace, lent by the CUDA EP) and
// never synchronizes, so it can be captured into a CUDA graph.
#pragma once

#include "common.h"

#ifdef ONNXFUSE_WITH_CUDA

#include <cuda.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "json.h"

namespace onnxfuse {
namespace cuda {

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
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;

  std::string describe(CUresult r) const;
};

const Driver& driver();

// ---------------------------------------------------------------------------------------
// kernel_meta: the keys every kind has
// ---------------------------------------------------------------------------------------

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

// A variant's requirements ("requires"; 1 / 0: none), and whether the kind launches it only
// on its own terms (split K: `split` slices, > 1; small M: `max_m`, > 0). Its block sizes
// are the kind's.
struct Variant {
  int64_t n_multiple = 1;
  int64_t c_multiple = 1;    // the channel count C a multiple of this (maxpool)
  int64_t w_multiple = 1;    // the input width W a multiple of this (maxpool)
  int64_t ptr_align = 1;
  int64_t max_elements = 0;  // 0: no limit
  int64_t last_multiple = 1; // the collapsed output's last dim a multiple of this (pointwise row variants)
  int64_t split = 0;         // > 1: a split-K variant (conv: its slices, grid z; gemm: the most slices)
  int64_t max_m = 0;         // > 0: a small-M variant (conv), for M (output pixels) up to it
  bool library = false;      // run by a vendor library, no binary (gemm: cuBLASLt, csrc/cublaslt.h)
};

struct Meta {
  std::string kind;
  std::string name;
  std::vector<Variant> variants;
  std::vector<Binary> binaries;

  // "cubin sm_90 (variant 0), ptx sm_90 (variant 0), ..."
  std::string embedded() const;
};

int64_t meta_int(const Json& o, const char* key, const std::string& where, bool required = true, int64_t dflt = 0);
int64_t meta_positive(const Json& o, const char* key, const std::string& where);
std::string meta_str(const Json& o, const char* key, const std::string& where);
const Json& meta_array(const Json& o, const char* key, const std::string& where);

// "n_extras": the program's inputs but %0 (the layer kinds).
void check_n_extras(const Json& j, size_t n_inputs);
// "x_layout" / "y_layout" ("nchw" or "nhwc"; "nchw" when absent) into *x_nhwc / *y_nhwc.
void read_xy_layouts(const Json& j, bool* x_nhwc, bool* y_nhwc);

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
  void i32(int64_t v, const char* what);
  void scratch() {  // the global and profile scratch pointers Triton appends: none
    ptr(nullptr);
    ptr(nullptr);
  }
  void** finish();
};

Params& thread_params();

// Device memory from the CUDA EP's allocator for one launch (split K's partial tiles),
// freed at the end of Compute: ORT's own CUDA kernels free their scratch buffers the same
// way, after queueing their work; the memory is reused only by work queued later on the
// same stream. data stays null where the EP lends no allocator (the caller falls back).
struct Workspace {
  OrtAllocator* alloc = nullptr;
  void* data = nullptr;
  Workspace(OrtKernelContext* ctx, int device, size_t bytes);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

// Split K's buffers for one launch (FusedConv, GemmEpilogue; docs/format.md): `tiles` int32
// arrival counters (padded to 256 bytes), then split · tiles · tile_elems fp32 partial tiles,
// lent by the CUDA EP for the one Compute (Workspace). ok() is false where the EP lends none:
// the caller launches another variant.
struct SplitBuffers {
  int64_t tiles;
  size_t cnt_bytes;
  Workspace ws;
  SplitBuffers(OrtKernelContext* ctx, int device, int64_t tiles, int64_t split, int64_t tile_elems);
  bool ok() const { return ws.data != nullptr; }
  // Zeroes the counters on the stream (cuMemsetD32Async) and appends the kernel's ws_ptr and
  // cnt_ptr parameters to p. `kernel` names the kernel in the error.
  void pass(CUstream stream, const std::string& kernel, Params& p) const;
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

// ---------------------------------------------------------------------------------------
// The kernel of one node: the shared part, and the hooks a kind implements
// ---------------------------------------------------------------------------------------

struct CudaKernel {
  static constexpr const char* kProvider = "CUDAExecutionProvider";
  static constexpr const char* kWhere = " (CUDA)";
  std::string name;
  Program prog;
  Meta meta;
  std::string meta_error;  // why kernel_meta / kernel_<i> cannot be used (reported by Compute)
  std::mutex mu;
  std::map<CUcontext, std::unique_ptr<Loaded>> loaded;

  CudaKernel() = default;
  CudaKernel(const CudaKernel&) = delete;
  CudaKernel& operator=(const CudaKernel&) = delete;
  virtual ~CudaKernel();

  // ---- the kind's hooks ----
  // kernel_meta's "kind" of the kernels this op launches.
  virtual const char* kind() const = 0;
  // Reads the node's attributes besides the program (before kernel_meta).
  virtual void init(const OrtKernelInfo*) {}
  // Reads the kind's own kernel_meta keys; n_inputs: the program's inputs.
  virtual void read_meta(const Json& j, size_t n_inputs) = 0;
  // Reads variant `where`'s block keys (its requirements are read after it); may set
  // var->split. Called once per variant, in order.
  virtual void read_variant(const Json& vj, const std::string& where, Variant* var) = 0;
  // Checks the node's attributes against the kernel_meta read: sets meta_error (unless set).
  virtual void check_meta() {}
  // Whether every integer parameter is 32-bit: a variant then also needs each tensor it
  // touches to hold at most 2^31 - 1 elements.
  virtual bool int32_params() const { return true; }
  // Checks the inputs, packs the parameters, picks a variant and launches it.
  virtual void compute(OrtKernelContext* ctx) = 0;

  // ---- shared ----
  // Parses kernel_meta (its common keys; the kind's through the hooks) into `meta`.
  void parse_meta(const std::string& text, const OrtKernelInfo* info);
  // The driver, ORT's stream and the current context's modules (loaded on first use).
  Target target(OrtKernelContext* ctx);
  // The first variant with a binary for this device whose requirements hold: every pointer
  // a multiple of ptr_align, n a multiple of n_multiple, the channel count c and the input
  // width w (0 where the kind has none) multiples of c_multiple and w_multiple, the last dim
  // (pointwise: of the output collapsed for its strided inputs; 0 where none) a multiple of
  // last_multiple, each tensor touched at most max_elements elements (`largest`; with
  // int32_params also at most 2^31 - 1). Throws when there is none.
  int choose_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest,
                     int64_t c = 0, int64_t w = 0, int64_t last = 0) const;
  // choose_variant's search among the split-K variants (split), the small-M variants whose
  // max_m is at least m (m > 0), or the others (neither split K nor small M); -1 if none.
  int find_variant(const Target& t, const std::vector<const void*>& ptrs, int64_t n, int64_t largest, int64_t c,
                   int64_t w, bool split, int64_t m = 0, int64_t last = 0) const;
  void launch(const Target& t, int v, int64_t grid_x, int64_t grid_y, Params& params, int64_t grid_z = 1) const;

 private:
  const Loaded& modules_for(CUcontext ctx);
  std::unique_ptr<Loaded> load(CUcontext ctx);
};

// The pointers of a layer's inputs and its output, in launch order; *largest becomes at
// least the element count of each (for the variants' max_elements).
std::vector<const void*> layer_pointers(const std::vector<TensorRef>& t, const TensorRef& y, int64_t* largest);

// The error when a node's x_layout / y_layout differ from its kernel_meta's (FusedConv,
// FusedMaxPool: the kernel addresses X and Y in the layouts it was compiled for).
std::string xy_layout_mismatch(bool node_x_nhwc, bool node_y_nhwc, bool meta_x_nhwc, bool meta_y_nhwc);

// Builds kernel K for a node: its program and attributes, then its kernel_meta and
// kernel_<i> attributes (KernelInfo is only valid here). A problem with those is reported
// by the first Compute, so the session itself can still be created.
template <class K>
OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<K>();
    k->prog = read_program(info);
    k->name = name;
    k->init(info);
    std::string meta;
    if (!get_string_attr(info, "kernel_meta", &meta)) {
      k->meta_error =
          "the model was optimized without compiling GPU kernels (the node has no 'kernel_meta' attribute), so it "
          "cannot run on the CUDA execution provider: re-run `onnxfuse optimize` with --target (e.g. --target "
          "sm_90), or run it on the CPU execution provider";
    } else {
      try {
        k->parse_meta(meta, info);
      } catch (const std::exception& e) {
        k->meta_error = e.what();
      }
    }
    k->check_meta();
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(K::kOp, name) + " (CUDA): " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace cuda
}  // namespace onnxfuse

#endif  // ONNXFUSE_WITH_CUDA
