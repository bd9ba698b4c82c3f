// Helpers shared by the CPU and CUDA kernels: ORT C API access, errors, attributes,
// tensors, and the parts of the OrtCustomOp that both registrations share.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "program.h"
#include "shape.h"

namespace onnxfuse {

// Set by RegisterCustomOps before any op is used.
extern const OrtApi* g_ort;

constexpr const char* kDomain = "onnxfuse";  // its ops: one per kind (csrc/kinds/, docs/format.md)

// Throws Error with the status' message (releasing the status).
inline void check(OrtStatus* st) {
  if (!st) return;
  std::string msg = g_ort->GetErrorMessage(st);
  g_ort->ReleaseStatus(st);
  throw Error(msg);
}

inline OrtStatus* make_status(const std::string& msg, OrtErrorCode code = ORT_FAIL) {
  return g_ort->CreateStatus(code, msg.c_str());
}

// A string attribute's bytes (binary-safe: ORT copies the attribute with memcpy and adds a
// terminating NUL). Returns false if the node has no such string attribute.
inline bool get_string_attr(const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  OrtStatus* st = g_ort->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    g_ort->ReleaseStatus(st);
    return false;
  }
  std::string buf(size, '\0');
  check(g_ort->KernelInfoGetAttribute_string(info, name, &buf[0], &size));
  buf.resize(size > 0 ? size - 1 : 0);
  *out = std::move(buf);
  return true;
}

// An int attribute; false if the node has no such attribute.
inline bool get_int_attr(const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* st = g_ort->KernelInfoGetAttribute_int64(info, name, out);
  if (st) {
    g_ort->ReleaseStatus(st);
    return false;
  }
  return true;
}

// A float attribute; false if the node has no such attribute.
inline bool get_float_attr(const OrtKernelInfo* info, const char* name, float* out) {
  OrtStatus* st = g_ort->KernelInfoGetAttribute_float(info, name, out);
  if (st) {
    g_ort->ReleaseStatus(st);
    return false;
  }
  return true;
}

// An ints attribute; false if the node has no such attribute.
inline bool get_ints_attr(const OrtKernelInfo* info, const char* name, std::vector<int64_t>* out) {
  size_t size = 0;
  OrtStatus* st = g_ort->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (st) {
    g_ort->ReleaseStatus(st);
    return false;
  }
  out->assign(size, 0);
  if (size > 0) check(g_ort->KernelInfoGetAttributeArray_int64(info, name, out->data(), &size));
  return true;
}

// A PointwiseChain's rotate_half (or, `attr`, rotate_pairs; docs/format.md): per program input 0 or 1 (absent: all 0); an
// input with 1 is read as Concat(-x[..., h:], x[..., :h]) along its last dim, h half of it.
// Throws Error for a wrong length or value.
inline std::vector<int64_t> read_rotate_half(const OrtKernelInfo* info, size_t n_inputs,
                                             const char* attr = "rotate_half") {
  std::vector<int64_t> flags;
  if (!get_ints_attr(info, attr, &flags)) return std::vector<int64_t>(n_inputs, 0);
  if (flags.size() != n_inputs)
    throw Error(std::string(attr) + " has " + std::to_string(flags.size()) + " entries, the program " +
                std::to_string(n_inputs) + " inputs");
  for (int64_t f : flags)
    if (f != 0 && f != 1) throw Error(std::string(attr) + " entries must be 0 or 1");
  return flags;
}

// A PointwiseChain's rotate_half and rotate_pairs together: per program input 0 (as it is),
// 1 (rotate_half) or 2 (rotate_pairs); an input may not be in both.
inline std::vector<int64_t> read_rotations(const OrtKernelInfo* info, size_t n_inputs) {
  std::vector<int64_t> kinds = read_rotate_half(info, n_inputs);
  const std::vector<int64_t> pairs = read_rotate_half(info, n_inputs, "rotate_pairs");
  for (size_t i = 0; i < n_inputs; ++i) {
    if (pairs[i] && kinds[i]) throw Error("input " + std::to_string(i) + " is in both rotate_half and rotate_pairs");
    if (pairs[i]) kinds[i] = 2;
  }
  return kinds;
}

// A PointwiseChain's transpose (docs/format.md): absent, or per program input `rank` entries (the
// output's rank), a permutation: the input is read as Transpose(x, perm). Returns one perm per
// input (identity where absent); throws Error for a wrong length or a non-permutation.
inline std::vector<std::vector<int64_t>> read_transpose(const OrtKernelInfo* info, size_t n_inputs) {
  std::vector<int64_t> flat;
  std::vector<std::vector<int64_t>> perms(n_inputs);
  if (!get_ints_attr(info, "transpose", &flat)) return perms;
  if (n_inputs == 0 || flat.size() % n_inputs)
    throw Error("transpose has " + std::to_string(flat.size()) + " entries, not a multiple of the program's " +
                std::to_string(n_inputs) + " inputs");
  const size_t r = flat.size() / n_inputs;
  for (size_t i = 0; i < n_inputs; ++i) {
    std::vector<int64_t> p(flat.begin() + i * r, flat.begin() + (i + 1) * r), seen(r, 0);
    for (int64_t a : p) {
      if (a < 0 || a >= static_cast<int64_t>(r) || seen[a]++)
        throw Error("transpose of input " + std::to_string(i) + " is not a permutation of " + std::to_string(r) +
                    " dims");
    }
    bool identity = true;
    for (size_t k = 0; k < r; ++k) identity = identity && p[k] == static_cast<int64_t>(k);
    if (!identity) perms[i] = std::move(p);
  }
  return perms;
}

// The shape Transpose(x, perm) has (x's shape when perm is empty) and the element strides of x
// over it (x contiguous); throws Error when the ranks differ.
inline std::pair<Shape, Shape> transposed_view(const Shape& x, const std::vector<int64_t>& perm) {
  const Shape st = contiguous_strides(x);
  if (perm.empty()) return {x, st};
  if (perm.size() != x.size())
    throw Error("an input of shape " + shape_str(x) + " read through a transpose of " + std::to_string(perm.size()) +
                " dims");
  Shape shape(perm.size()), strides(perm.size());
  for (size_t k = 0; k < perm.size(); ++k) shape[k] = x[perm[k]], strides[k] = st[perm[k]];
  return {shape, strides};
}

inline std::string node_name(const OrtKernelInfo* info) {
  size_t size = 0;
  OrtStatus* st = g_ort->KernelInfo_GetNodeName(info, nullptr, &size);
  if (st) {
    g_ort->ReleaseStatus(st);
    return std::string();
  }
  std::string buf(size, '\0');
  st = g_ort->KernelInfo_GetNodeName(info, &buf[0], &size);
  if (st) {
    g_ort->ReleaseStatus(st);
    return std::string();
  }
  buf.resize(size > 0 ? size - 1 : 0);
  return buf;
}

// The node's 'program' attribute, parsed (every onnxfuse op has one); throws Error.
inline Program read_program(const OrtKernelInfo* info) {
  std::string text;
  if (!get_string_attr(info, "program", &text)) throw Error("the node has no string attribute 'program'");
  return parse_program(text);
}

// "onnxfuse FusedConv node 'conv1'": the prefix of every error message of a node.
inline std::string describe_node(const char* op, const std::string& name) {
  return std::string("onnxfuse ") + op + (name.empty() ? "" : " node '" + name + "'");
}

inline const char* elem_type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    default: return "another type";
  }
}

inline ONNXTensorElementDataType ort_type(DType d) {
  switch (d) {
    case DType::F32: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case DType::F16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    case DType::BF16: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
    case DType::BOOL: return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  }
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

inline size_t elem_size(DType d) { return d == DType::F32 ? 4 : d == DType::BOOL ? 1 : 2; }

struct TensorRef {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  Shape shape;
  void* data = nullptr;
};

inline void read_tensor(const OrtValue* v, TensorRef* t) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  check(g_ort->GetTensorTypeAndShape(v, &info));
  size_t rank = 0;
  OrtStatus* st = g_ort->GetTensorElementType(info, &t->type);
  if (!st) st = g_ort->GetDimensionsCount(info, &rank);
  if (!st) {
    t->shape.assign(rank, 0);
    st = g_ort->GetDimensions(info, t->shape.data(), rank);
  }
  g_ort->ReleaseTensorTypeAndShapeInfo(info);
  check(st);
  check(g_ort->GetTensorMutableData(const_cast<OrtValue*>(v), &t->data));
}

// Inputs checked against the program, the broadcast output shape, and the outputs
// allocated with that shape and checked against the program.
struct Io {
  std::vector<TensorRef> in, out;
  Shape out_shape;
  int64_t n = 0;
};

// Whether a tensor of type `t` may stand for a program value of dtype `d`: the same type;
// with `f32_for_half`, also float32 for f16/bf16. ONNX Runtime's CPU provider runs an
// fp16 node whose neighbours it casts to fp32 in fp32 as well ("isolated fp16 node"),
// assuming every CPU kernel has a float32 version, and rewires its inputs and outputs.
inline bool type_fits(ONNXTensorElementDataType t, DType d, bool f32_for_half) {
  return t == ort_type(d) ||
         (f32_for_half && t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && (d == DType::F16 || d == DType::BF16));
}

// The node's input i (an error when it is missing).
inline TensorRef input_tensor(OrtKernelContext* ctx, size_t i) {
  const OrtValue* v = nullptr;
  check(g_ort->KernelContext_GetInput(ctx, i, &v));
  if (!v) throw Error("input " + std::to_string(i) + " is missing");
  TensorRef t;
  read_tensor(v, &t);
  return t;
}

// A PointwiseChain's partial (docs/format.md): absent (empty), {r, k} or {r, k, j}: the program
// computes the output's columns below r, input k's are copied beyond them (plus input j's).
// Throws Error for a malformed one.
inline std::vector<int64_t> read_partial(const OrtKernelInfo* info, size_t n_inputs) {
  std::vector<int64_t> partial;
  if (!get_ints_attr(info, "partial", &partial)) return {};
  const auto input = [n_inputs](int64_t k) { return k >= 0 && k < static_cast<int64_t>(n_inputs); };
  if ((partial.size() != 2 && partial.size() != 3) || partial[0] < 1 || !input(partial[1]) ||
      (partial.size() == 3 && (!input(partial[2]) || partial[2] == partial[1])))
    throw Error("partial must be [columns, input] or [columns, input, input added], the columns at least 1 and "
                "the inputs two of the program's " + std::to_string(n_inputs));
  return partial;
}

// The node's inputs and its outputs allocated at the inputs' broadcast shape (`perms`: inputs read
// through a transpose count with their transposed shapes, read_transpose; `partial` {r, k}, read_partial:
// inputs of r columns broadcast along the output's last dim, input k's, which must be wider).
inline Io bind_io(const Program& prog, OrtKernelContext* ctx, bool f32_for_half = false,
                  const std::vector<std::vector<int64_t>>* perms = nullptr,
                  const std::vector<int64_t>* partial = nullptr) {
  Io io;
  size_t n_in = 0, n_out = 0;
  check(g_ort->KernelContext_GetInputCount(ctx, &n_in));
  check(g_ort->KernelContext_GetOutputCount(ctx, &n_out));
  if (n_in != prog.inputs.size())
    throw Error("the node has " + std::to_string(n_in) + " inputs, its program declares " +
                std::to_string(prog.inputs.size()));
  if (n_out != prog.outputs.size())
    throw Error("the node has " + std::to_string(n_out) + " outputs, its program declares " +
                std::to_string(prog.outputs.size()));
  io.in.resize(n_in);
  std::vector<Shape> shapes(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    io.in[i] = input_tensor(ctx, i);
    if (!type_fits(io.in[i].type, prog.inputs[i], f32_for_half))
      throw Error("input " + std::to_string(i) + " is " + elem_type_name(io.in[i].type) +
                  ", the program declares " + dtype_name(prog.inputs[i]));
    // (an input read through a transpose counts with its transposed shape)
    shapes[i] = perms && i < perms->size() ? transposed_view(io.in[i].shape, (*perms)[i]).first : io.in[i].shape;
  }
  if (partial && !partial->empty()) {
    const int64_t r = (*partial)[0];
    const Shape& wide = shapes[static_cast<size_t>((*partial)[1])];
    if (wide.empty() || wide.back() <= r)
      throw Error("input " + std::to_string((*partial)[1]) + " has shape " + shape_str(wide) +
                  ", copied beyond the first " + std::to_string(r) + " columns it needs more of them");
    for (Shape& sh : shapes)
      if (!sh.empty() && sh.back() == r) sh.back() = 1;
  }
  io.out_shape = broadcast_shapes(shapes);
  io.n = numel(io.out_shape);
  io.out.resize(n_out);
  for (size_t j = 0; j < n_out; ++j) {
    OrtValue* v = nullptr;
    const int64_t dummy = 0;  // a rank-0 output still needs a valid pointer
    const int64_t* dims = io.out_shape.empty() ? &dummy : io.out_shape.data();
    check(g_ort->KernelContext_GetOutput(ctx, j, dims, io.out_shape.size(), &v));
    if (!v) throw Error("could not allocate output " + std::to_string(j));
    read_tensor(v, &io.out[j]);
    if (!type_fits(io.out[j].type, prog.outputs[j].second, f32_for_half))
      throw Error("output " + std::to_string(j) + " is " + elem_type_name(io.out[j].type) +
                  " in the graph, the program stores " + dtype_name(prog.outputs[j].second));
  }
  return io;
}

// A registered op: ORT hands the OrtCustomOp back to every callback, so the op's name and
// minimum input count live next to it.
struct OpDef : OrtCustomOp {
  const char* op_name = nullptr;
  int min_inputs = 1;
};

// The OrtCustomOp fields shared by every registration: variadic, heterogeneous inputs and
// outputs of any element type, at least `min_inputs` inputs and one output. (The ops check
// their actual counts, types and shapes in Compute, with messages naming the problem.)
inline void init_common_op(OpDef* op, const char* op_name, int min_inputs) {
  static_cast<OrtCustomOp&>(*op) = OrtCustomOp{};
  op->op_name = op_name;
  op->min_inputs = min_inputs;
  op->version = ORT_API_VERSION;
  op->GetName = [](const OrtCustomOp* self) -> const char* { return static_cast<const OpDef*>(self)->op_name; };
  op->GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op->GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op->GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op->GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op->GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op->GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op->GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op->GetVariadicInputMinArity = [](const OrtCustomOp* self) { return static_cast<const OpDef*>(self)->min_inputs; };
  op->GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
  op->GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op->GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
}

// The ORT callbacks every kernel type K shares. K has a `name`, a compute(OrtKernelContext*)
// and static members kOp (the op's name), kProvider (its execution provider) and kWhere
// (what messages add after the node: "" or " (CUDA)"). Exceptions become an OrtStatus
// naming the op and the node.
template <class K>
OrtStatus* ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* ctx) {
  K* k = static_cast<K*>(kernel);
  try {
    k->compute(ctx);
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(K::kOp, k->name) + K::kWhere + ": " + e.what());
  }
}

template <class K>
void ORT_API_CALL destroy_kernel(void* kernel) {
  delete static_cast<K*>(kernel);
}

// The registration of kernel type K; `create` builds a K from the node's attributes.
template <class K>
OpDef make_op(int min_inputs, decltype(OrtCustomOp::CreateKernelV2) create) {
  OpDef op;
  init_common_op(&op, K::kOp, min_inputs);
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return K::kProvider; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute_kernel<K>;
  op.KernelDestroy = destroy_kernel<K>;
  return op;
}

// A fused node's inputs: `operands` tensors of the program's %0 dtype (a product's A and B,
// attention's Q, K^T and V: `names`), then the program's extras %1, %2, ..., then `trailing`
// more of %0's dtype (attention's biases: `trailing_names`); checked against the program (their
// count, one output, each input's element type; f32_for_half: a float32 tensor may stand for a
// half one, as on the CPU).
inline std::vector<TensorRef> read_operand_inputs(OrtKernelContext* ctx, const Program& prog, size_t operands,
                                                  const char* names, bool f32_for_half, size_t trailing = 0,
                                                  const char* trailing_names = "") {
  size_t n_in = 0, n_out = 0;
  check(g_ort->KernelContext_GetInputCount(ctx, &n_in));
  check(g_ort->KernelContext_GetOutputCount(ctx, &n_out));
  const size_t n_extras = prog.inputs.size() - 1;
  if (n_in != operands + n_extras + trailing || n_out != 1)
    throw Error("the node has " + std::to_string(n_in) + " inputs and " + std::to_string(n_out) +
                " outputs, expected " + names + ", " + std::to_string(n_extras) + " extras" +
                (trailing ? ", " + std::to_string(trailing) + " " + trailing_names : std::string()) +
                " and one output");
  std::vector<TensorRef> t(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    t[i] = input_tensor(ctx, i);
    const bool extra = i >= operands && i < operands + n_extras;
    const DType want = prog.inputs[extra ? i - operands + 1 : 0];
    if (!type_fits(t[i].type, want, f32_for_half))
      throw Error("input " + std::to_string(i) + " is " + elem_type_name(t[i].type) + ", the node declares " +
                  dtype_name(want));
  }
  return t;
}

}  // namespace onnxfuse
