// The layer parameters of FusedConv and FusedMaxPool (docs/format.md): reading them from a
// node's attributes, ONNX's output-size rules (onnxfuse/layers.py in Python), and the
// run-time shape checks, shared by the CPU and CUDA kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace onnxfuse {

// A 2-D convolution; pads are (top, left, bottom, right).
struct ConvParams {
  int64_t kernel[2] = {1, 1};  // R, S
  int64_t strides[2] = {1, 1};
  int64_t dilations[2] = {1, 1};
  int64_t pads[4] = {0, 0, 0, 0};
  int64_t group = 1;
};

// A 2-D max pool; pads are (top, left, bottom, right).
struct PoolParams {
  int64_t kernel[2] = {1, 1};
  int64_t strides[2] = {1, 1};
  int64_t dilations[2] = {1, 1};
  int64_t pads[4] = {0, 0, 0, 0};
  bool ceil_mode = false;
};

inline std::string ints_str(const int64_t* v, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Reads ints attribute `name` of exactly n values, each >= min_value; throws Error when it is
// missing, has another length or a value below min_value.
inline void read_ints(const OrtKernelInfo* info, const char* name, size_t n, int64_t min_value, int64_t* out) {
  std::vector<int64_t> v;
  if (!get_ints_attr(info, name, &v)) throw Error(std::string("the node has no ints attribute '") + name + "'");
  if (v.size() != n)
    throw Error(std::string("attribute '") + name + "' is " + ints_str(v.data(), v.size()) + ", expected " +
                std::to_string(n) + " numbers");
  for (size_t i = 0; i < n; ++i) {
    if (v[i] < min_value)
      throw Error(std::string("attribute '") + name + "' is " + ints_str(v.data(), n) + ", values must be >= " +
                  std::to_string(min_value));
    out[i] = v[i];
  }
}

inline ConvParams read_conv_params(const OrtKernelInfo* info) {
  ConvParams c;
  read_ints(info, "kernel_shape", 2, 1, c.kernel);
  read_ints(info, "strides", 2, 1, c.strides);
  read_ints(info, "dilations", 2, 1, c.dilations);
  read_ints(info, "pads", 4, 0, c.pads);
  if (!get_int_attr(info, "group", &c.group)) throw Error("the node has no int attribute 'group'");
  if (c.group < 1) throw Error("attribute 'group' is " + std::to_string(c.group) + ", must be >= 1");
  return c;
}

// The pool_* attributes: all five, or none (false; only when !required).
inline bool read_pool_params(const OrtKernelInfo* info, bool required, PoolParams* p) {
  static const char* const kNames[] = {"pool_kernel", "pool_strides", "pool_dilations", "pool_pads"};
  std::vector<int64_t> tmp;
  int64_t ceil_mode = 0;
  int present = get_int_attr(info, "pool_ceil_mode", &ceil_mode) ? 1 : 0;
  for (const char* n : kNames) present += get_ints_attr(info, n, &tmp) ? 1 : 0;
  if (present == 0 && !required) return false;
  if (present != 5)
    throw Error(required ? "the node needs the five attributes pool_kernel, pool_strides, pool_dilations, pool_pads "
                           "and pool_ceil_mode"
                         : "the node has some of the pool_* attributes but not all five (pool_kernel, pool_strides, "
                           "pool_dilations, pool_pads, pool_ceil_mode)");
  read_ints(info, "pool_kernel", 2, 1, p->kernel);
  read_ints(info, "pool_strides", 2, 1, p->strides);
  read_ints(info, "pool_dilations", 2, 1, p->dilations);
  read_ints(info, "pool_pads", 4, 0, p->pads);
  if (ceil_mode != 0 && ceil_mode != 1)
    throw Error("attribute 'pool_ceil_mode' is " + std::to_string(ceil_mode) + ", must be 0 or 1");
  p->ceil_mode = ceil_mode == 1;
  return true;
}

// ONNX Conv's output size along one axis; <= 0 when the input is too small.
inline int64_t conv_out_dim(int64_t n, int64_t k, int64_t s, int64_t p0, int64_t p1, int64_t d) {
  const int64_t span = n + p0 + p1 - d * (k - 1) - 1;
  return span < 0 ? 0 : span / s + 1;
}

// ONNX MaxPool's output size along one axis; with ceil_mode a window that would start in
// the end padding is dropped (as ONNX Runtime and PyTorch do). <= 0: input too small.
inline int64_t pool_out_dim(int64_t n, int64_t k, int64_t s, int64_t p0, int64_t p1, int64_t d, bool ceil_mode) {
  const int64_t span = n + p0 + p1 - d * (k - 1) - 1;
  if (span < 0) return 0;
  if (!ceil_mode) return span / s + 1;
  int64_t out = (span + s - 1) / s + 1;
  if ((out - 1) * s >= n + p0) --out;
  return out;
}

// The optional layout attributes of FusedConv (docs/format.md, FusedConv, Layouts):
// x_layout / y_layout "NCHW" (default) or "NHWC"; extra_layouts, one per extra input,
// 0 = as is (numpy broadcast to [N, K, P, Q]), 1 = a 4-D NHWC tensor; w_layout, the packed
// weights' order, "RSCK" (default: [R, S, C/group, K]) or "KRSC" ([K, R, S, C/group]).
struct ConvLayouts {
  bool x_nhwc = false;
  bool y_nhwc = false;
  bool w_krsc = false;
  std::vector<int64_t> extra;  // per extra input; all 0 when the attribute is absent

  bool extra_nhwc(size_t e) const { return e < extra.size() && extra[e] == 1; }
  // Whether X, Y or an extra input is not NCHW (the weights' order is not counted).
  bool any() const {
    if (x_nhwc || y_nhwc) return true;
    for (int64_t v : extra)
      if (v != 0) return true;
    return false;
  }
};

inline const char* layout_name(bool nhwc) { return nhwc ? "NHWC" : "NCHW"; }
inline const char* w_layout_name(bool krsc) { return krsc ? "KRSC" : "RSCK"; }

// Reads the optional string attribute `name`, one of `a` (the default when absent) and `b`:
// true when it is `b`. Throws Error on another value or an attribute of another type.
inline bool read_choice_attr(const OrtKernelInfo* info, const char* name, const char* a, const char* b) {
  const std::string expected = std::string("\"") + a + "\" or \"" + b + "\"";
  std::string v;
  if (!get_string_attr(info, name, &v)) {
    int64_t dummy = 0;
    std::vector<int64_t> dummies;
    if (get_int_attr(info, name, &dummy) || get_ints_attr(info, name, &dummies))
      throw Error(std::string("attribute '") + name + "' must be a string, " + expected);
    return false;  // absent: a
  }
  if (v != a && v != b) throw Error(std::string("attribute '") + name + "' is \"" + v + "\", expected " + expected);
  return v == b;
}

// Reads x_layout, y_layout, w_layout and extra_layouts (n_extras: the program's extra
// inputs); throws Error on an unknown value or a wrong count.
inline ConvLayouts read_conv_layouts(const OrtKernelInfo* info, size_t n_extras) {
  ConvLayouts l;
  l.x_nhwc = read_choice_attr(info, "x_layout", "NCHW", "NHWC");
  l.y_nhwc = read_choice_attr(info, "y_layout", "NCHW", "NHWC");
  l.w_krsc = read_choice_attr(info, "w_layout", "RSCK", "KRSC");
  if (get_ints_attr(info, "extra_layouts", &l.extra)) {
    if (l.extra.size() != n_extras)
      throw Error("attribute 'extra_layouts' is " + ints_str(l.extra.data(), l.extra.size()) + ", " +
                  std::to_string(l.extra.size()) + " values for " + std::to_string(n_extras) +
                  " extra inputs (expected one per extra input)");
    for (int64_t v : l.extra)
      if (v != 0 && v != 1)
        throw Error("attribute 'extra_layouts' is " + ints_str(l.extra.data(), l.extra.size()) +
                    ", values must be 0 (as is) or 1 (NHWC)");
  } else {
    l.extra.assign(n_extras, 0);
  }
  return l;
}

// The optional layout attributes of FusedMaxPool (docs/format.md, FusedMaxPool): x_layout /
// y_layout "NCHW" (default) or "NHWC". Extra inputs broadcast to X's logical [N, C, H, W].
struct PoolLayouts {
  bool x_nhwc = false;
  bool y_nhwc = false;
};

inline PoolLayouts read_pool_layouts(const OrtKernelInfo* info) {
  PoolLayouts l;
  l.x_nhwc = read_choice_attr(info, "x_layout", "NCHW", "NHWC");
  l.y_nhwc = read_choice_attr(info, "y_layout", "NCHW", "NHWC");
  return l;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The sizes of one FusedConv run, checked.
struct ConvShapes {
  int64_t N = 0, C = 0, H = 0, W = 0, K = 0;
  int64_t P = 0, Q = 0;    // conv output
  int64_t OP = 0, OQ = 0;  // node output: pooled, or P, Q without a pool
  Shape conv_out() const { return {N, K, P, Q}; }
  Shape out() const { return {N, K, OP, OQ}; }
  // The node's output tensor: [N, K, OP, OQ], or [N, OP, OQ, K] with y_layout NHWC.
  Shape y_shape(bool nhwc) const { return nhwc ? Shape{N, OP, OQ, K} : out(); }
};

inline Shape pool_shape(const PoolParams& p, const Shape& in) {
  const int64_t oh = pool_out_dim(in[2], p.kernel[0], p.strides[0], p.pads[0], p.pads[2], p.dilations[0], p.ceil_mode);
  const int64_t ow = pool_out_dim(in[3], p.kernel[1], p.strides[1], p.pads[1], p.pads[3], p.dilations[1], p.ceil_mode);
  if (oh <= 0 || ow <= 0)
    throw Error("the max pool's input " + shape_str(in) + " is too small for pool_kernel " + ints_str(p.kernel, 2) +
                ", pool_dilations " + ints_str(p.dilations, 2) + " and pool_pads " + ints_str(p.pads, 4));
  return {in[0], in[1], oh, ow};
}

inline void check_rank4(const Shape& x, const char* what, bool nhwc = false) {
  if (x.size() != 4)
    throw Error(std::string("input 0 (") + what + ") has shape " + shape_str(x) + ", expected rank 4 " +
                (nhwc ? "[N, H, W, C] (x_layout NHWC)" : "[N, C, H, W]"));
}

// A FusedMaxPool's X checked for rank 4; its logical shape [N, C, H, W] (X is [N, H, W, C]
// with x_layout NHWC).
inline Shape pool_input_shape(const Shape& x, bool x_nhwc) {
  check_rank4(x, x_nhwc ? "X, x_layout NHWC" : "X", x_nhwc);
  return x_nhwc ? Shape{x[0], x[3], x[1], x[2]} : x;
}

// A FusedMaxPool's output tensor for the pooled [N, C, OH, OW]: [N, OH, OW, C] with y_layout NHWC.
inline Shape pool_y_shape(const Shape& pooled, bool y_nhwc) {
  return y_nhwc ? Shape{pooled[0], pooled[2], pooled[3], pooled[1]} : pooled;
}

// Checks X ([N, C, H, W], or [N, H, W, C] with x_nhwc), the packed weights
// ([R, S, C/group, K], or [K, R, S, C/group] with w_krsc) and the bias [K] against each
// other and the attributes; returns the sizes.
inline ConvShapes conv_shapes(const ConvParams& c, const PoolParams* pool, const Shape& x, const Shape& w,
                              const Shape& b, bool x_nhwc = false, bool w_krsc = false) {
  const char* xname = x_nhwc ? "X, x_layout NHWC" : "X";
  check_rank4(x, xname, x_nhwc);
  ConvShapes s;
  if (x_nhwc)
    s.N = x[0], s.H = x[1], s.W = x[2], s.C = x[3];
  else
    s.N = x[0], s.C = x[1], s.H = x[2], s.W = x[3];
  if (s.C % c.group != 0)
    throw Error(std::string("input 0 (") + xname + ") has " + std::to_string(s.C) +
                " channels, not a multiple of group " + std::to_string(c.group));
  const int64_t cg = s.C / c.group;
  const std::string r = std::to_string(c.kernel[0]), sz = std::to_string(c.kernel[1]), cgs = std::to_string(cg);
  const bool w_ok = w.size() == 4 && (w_krsc ? w[1] == c.kernel[0] && w[2] == c.kernel[1] && w[3] == cg
                                             : w[0] == c.kernel[0] && w[1] == c.kernel[1] && w[2] == cg);
  if (!w_ok)
    throw Error("input 1 (W) has shape " + shape_str(w) + ", expected the packed weights " +
                (w_krsc ? "[K, R, S, C/group] = [K, " + r + ", " + sz + ", " + cgs + "] (w_layout KRSC, "
                        : "[R, S, C/group, K] = [" + r + ", " + sz + ", " + cgs + ", K] (") +
                "kernel_shape " + ints_str(c.kernel, 2) + ", X's C = " + std::to_string(s.C) +
                (x_nhwc ? " from its last dimension (x_layout NHWC: X is [N, H, W, C])" : "") + ", group " +
                std::to_string(c.group) + ")");
  s.K = w_krsc ? w[0] : w[3];
  if (s.K % c.group != 0)
    throw Error("input 1 (W) has K = " + std::to_string(s.K) + " output channels, not a multiple of group " +
                std::to_string(c.group));
  if (b.size() != 1 || b[0] != s.K)
    throw Error("input 2 (B) has shape " + shape_str(b) + ", expected the bias [K] = [" + std::to_string(s.K) + "]");
  s.P = conv_out_dim(s.H, c.kernel[0], c.strides[0], c.pads[0], c.pads[2], c.dilations[0]);
  s.Q = conv_out_dim(s.W, c.kernel[1], c.strides[1], c.pads[1], c.pads[3], c.dilations[1]);
  if (s.P <= 0 || s.Q <= 0)
    throw Error(std::string("input 0 (") + xname + ") " + shape_str(x) + " is too small for kernel_shape " +
                ints_str(c.kernel, 2) + ", dilations " + ints_str(c.dilations, 2) + " and pads " +
                ints_str(c.pads, 4));
  s.OP = s.P, s.OQ = s.Q;
  if (pool) {
    const Shape o = pool_shape(*pool, s.conv_out());
    s.OP = o[2], s.OQ = o[3];
  }
  return s;
}

// An extra (epilogue / prologue) input must broadcast to `to` ([N, K, P, Q] or X's shape),
// rank <= 4, right-aligned.
inline void check_extra(size_t input, int program_input, const Shape& e, const Shape& to, const char* to_what) {
  bool ok = e.size() <= to.size();
  for (size_t i = 0; ok && i < e.size(); ++i) {
    const int64_t d = e[e.size() - 1 - i];
    ok = d == 1 || d == to[to.size() - 1 - i];
  }
  if (!ok)
    throw Error("input " + std::to_string(input) + " (program input %" + std::to_string(program_input) +
                ") has shape " + shape_str(e) + ", which does not broadcast to " + to_what + " " + shape_str(to));
}

// An extra input of FusedConv: as is (check_extra against the conv output [N, K, P, Q]),
// or with extra_layouts 1 a 4-D NHWC tensor [N', P', Q', K'] whose NCHW transpose
// [N', K', P', Q'] broadcasts to it.
inline void check_conv_extra(size_t input, int program_input, const Shape& e, bool nhwc, const Shape& conv_out) {
  if (!nhwc) {
    check_extra(input, program_input, e, conv_out, "the conv output [N, K, P, Q] =");
    return;
  }
  const std::string what =
      "input " + std::to_string(input) + " (program input %" + std::to_string(program_input) + ", extra_layouts 1: NHWC)";
  if (e.size() != 4)
    throw Error(what + " has shape " + shape_str(e) + ", expected a rank-4 NHWC tensor [N, P, Q, K]");
  const Shape t{e[0], e[3], e[1], e[2]};
  for (size_t d = 0; d < 4; ++d)
    if (t[d] != 1 && t[d] != conv_out[d])
      throw Error(what + " has shape " + shape_str(e) + ", whose NCHW transpose " + shape_str(t) +
                  " does not broadcast to the conv output [N, K, P, Q] = " + shape_str(conv_out));
}

// An extra input's element strides over the conv output [N, K, P, Q], 0 on broadcast
// dimensions: as is, numpy broadcasting (right-aligned); NHWC [n, p, q, k] (checked by
// check_conv_extra), its permuted strides (p*q*k, 1, q*k, k).
inline Shape conv_extra_strides(const Shape& e, bool nhwc, const Shape& conv_out) {
  if (!nhwc) return broadcast_strides(e, conv_out);
  const int64_t p = e[1], q = e[2], k = e[3];
  return {e[0] == 1 ? 0 : p * q * k, k == 1 ? 0 : 1, p == 1 ? 0 : q * k, q == 1 ? 0 : k};
}

// Reads a FusedConv / FusedMaxPool node's inputs and checks their count and types: the
// first `n_fixed` inputs (X, W, B or X), then the program's extra inputs %1, %2, ... X is
// program input %0, W and B have X's type. f32_for_half as in type_fits (the CPU kernels
// accept what ONNX Runtime's CPU provider rewires to float32; CUDA kernels take exactly the
// types they were compiled for).
inline std::vector<TensorRef> read_layer_inputs(const Program& prog, OrtKernelContext* ctx, size_t n_fixed,
                                                bool f32_for_half) {
  static const char* const kInputNames[] = {"X", "W", "B"};
  size_t n_in = 0, n_out = 0;
  check(g_ort->KernelContext_GetInputCount(ctx, &n_in));
  check(g_ort->KernelContext_GetOutputCount(ctx, &n_out));
  const size_t want = n_fixed + prog.inputs.size() - 1;
  if (n_in != want)
    throw Error("the node has " + std::to_string(n_in) + " inputs, expected " + std::to_string(want) + " (" +
                (n_fixed == 3 ? "X, W, B" : "X") + " and the program's " + std::to_string(prog.inputs.size() - 1) +
                " extra inputs)");
  if (n_out != 1) throw Error("the node has " + std::to_string(n_out) + " outputs, expected 1");
  std::vector<TensorRef> t(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    t[i] = input_tensor(ctx, i);
    const size_t pi = i < n_fixed ? 0 : i - n_fixed + 1;
    const std::string what = i < n_fixed ? std::string(" (") + kInputNames[i] + ")"
                                         : " (program input %" + std::to_string(pi) + ")";
    if (i > 0 && i < n_fixed) {
      if (t[i].type != t[0].type)
        throw Error("input " + std::to_string(i) + what + " is " + elem_type_name(t[i].type) + ", X is " +
                    elem_type_name(t[0].type));
    } else if (!type_fits(t[i].type, prog.inputs[pi], f32_for_half)) {
      throw Error("input " + std::to_string(i) + what + " is " + elem_type_name(t[i].type) +
                  ", the program declares " + dtype_name(prog.inputs[pi]));
    }
  }
  return t;
}

// Allocates output 0 with `shape` and checks its type against the program's output.
inline TensorRef layer_output(const Program& prog, OrtKernelContext* ctx, bool f32_for_half, const Shape& shape) {
  OrtValue* v = nullptr;
  check(g_ort->KernelContext_GetOutput(ctx, 0, shape.data(), shape.size(), &v));
  if (!v) throw Error("could not allocate the output");
  TensorRef t;
  read_tensor(v, &t);
  if (!type_fits(t.type, prog.outputs[0].second, f32_for_half))
    throw Error(std::string("the output is ") + elem_type_name(t.type) + " in the graph, the program stores " +
                dtype_name(prog.outputs[0].second));
  return t;
}

}  // namespace onnxfuse
