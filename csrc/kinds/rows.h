// What the CPU and CUDA kernels of onnxfuse::FusedRows share (docs/format.md, FusedRows):
// the node's attributes and the shapes of its inputs and outputs.
//
// A FusedRows node computes, for its row value x (the prologue program of its first inputs),
// a row reduction over the dims from `axis` on (`reduction`: layer_norm, rms_norm, softmax,
// log_softmax; group_norm: x is [N, C, spatial...] or, with x_layout and y_layout NHWC,
// stored [N, spatial..., C], and a row is one (image, group) of C / `groups` channels by every
// pixel), then the epilogue program (attribute `program`) whose first inputs are the
// reduction's row values and whose other inputs are the node's remaining inputs.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace onnxfuse {

constexpr const char* kFusedRows = "FusedRows";

enum class Reduction { LAYER_NORM, RMS_NORM, SOFTMAX, LOG_SOFTMAX, GROUP_NORM };

// The number of row values each reduction gives the epilogue (its %0, %1, ...): layer_norm
// x, mean, variance (group_norm: per image and group); rms_norm x, mean square; softmax /
// log_softmax the result.
inline size_t row_values(Reduction r) {
  switch (r) {
    case Reduction::LAYER_NORM: return 3;
    case Reduction::GROUP_NORM: return 3;
    case Reduction::RMS_NORM: return 2;
    default: return 1;
  }
}

struct RowsAttrs {
  Program prologue;
  Program epilogue;  // attribute "program"
  Reduction reduction = Reduction::LAYER_NORM;
  int64_t axis = 0;
  bool x_output = false;
  int64_t groups = 0;          // group_norm: the number of groups (axis is 1)
  bool channels_last = false;  // group_norm: x (and inputs of its shape) stored [N, spatial..., C]

  size_t n_prologue() const { return prologue.inputs.size(); }
  size_t n_extras() const { return epilogue.inputs.size() - row_values(reduction); }
  size_t n_inputs() const { return n_prologue() + n_extras(); }
  size_t n_outputs() const { return epilogue.outputs.size() + (x_output ? 1 : 0); }
  // The dtype of input i (the prologue's, then the epilogue's extras) and of output j.
  DType input_dtype(size_t i) const {
    return i < n_prologue() ? prologue.inputs[i] : epilogue.inputs[row_values(reduction) + i - n_prologue()];
  }
  DType output_dtype(size_t j) const {
    return j < epilogue.outputs.size() ? epilogue.outputs[j].second : prologue.outputs[0].second;
  }
};

// The node's attributes, checked against each other; throws Error.
inline RowsAttrs read_rows_attrs(const OrtKernelInfo* info) {
  RowsAttrs a;
  std::string text;
  if (!get_string_attr(info, "prologue", &text)) throw Error("the node has no string attribute 'prologue'");
  a.prologue = parse_program(text);
  a.epilogue = read_program(info);
  std::string red;
  if (!get_string_attr(info, "reduction", &red)) throw Error("the node has no string attribute 'reduction'");
  if (red == "layer_norm") a.reduction = Reduction::LAYER_NORM;
  else if (red == "rms_norm") a.reduction = Reduction::RMS_NORM;
  else if (red == "softmax") a.reduction = Reduction::SOFTMAX;
  else if (red == "log_softmax") a.reduction = Reduction::LOG_SOFTMAX;
  else if (red == "group_norm") a.reduction = Reduction::GROUP_NORM;
  else throw Error("reduction '" + red + "' is not one of layer_norm, rms_norm, softmax, log_softmax, group_norm");
  if (!get_int_attr(info, "axis", &a.axis)) throw Error("the node has no int attribute 'axis'");
  if (a.axis < 0) throw Error("axis " + std::to_string(a.axis) + " must be at least 0");
  int64_t xo = 0;
  get_int_attr(info, "x_output", &xo);
  if (xo != 0 && xo != 1) throw Error("x_output must be 0 or 1");
  a.x_output = xo == 1;
  get_int_attr(info, "groups", &a.groups);
  std::string xl = "NCHW", yl = "NCHW";  // group_norm: as the NHWC pass writes a pool's layouts
  get_string_attr(info, "x_layout", &xl);
  get_string_attr(info, "y_layout", &yl);
  if ((xl != "NCHW" && xl != "NHWC") || xl != yl)
    throw Error("x_layout " + xl + " and y_layout " + yl + ": both NCHW or both NHWC");
  a.channels_last = xl == "NHWC";
  if (a.reduction == Reduction::GROUP_NORM && (a.groups <= 0 || a.axis != 1))
    throw Error("group_norm needs a positive int attribute 'groups' and axis 1, got groups " +
                std::to_string(a.groups) + ", axis " + std::to_string(a.axis));
  if (a.reduction != Reduction::GROUP_NORM && (a.groups != 0 || a.channels_last))
    throw Error("attributes 'groups' and x_layout NHWC are group_norm's");
  if (a.prologue.outputs.size() != 1)
    throw Error("the prologue has " + std::to_string(a.prologue.outputs.size()) + " outputs, expected 1 (x)");
  if (a.epilogue.inputs.size() < row_values(a.reduction))
    throw Error("the epilogue has " + std::to_string(a.epilogue.inputs.size()) + " inputs, fewer than the " +
                std::to_string(row_values(a.reduction)) + " row values of " + red);
  for (size_t k = 0; k < row_values(a.reduction); ++k)
    if (a.epilogue.inputs[k] != DType::F32) throw Error("the epilogue's row value %" + std::to_string(k) + " is not f32");
  return a;
}

// group_norm with channels_last: an input's shape as it broadcasts to x stored channels-last
// (x's shape `xs` itself, or an NCHW shape, aligned to x's rank, its channel dim moved last).
inline Shape channels_last_shape(const Shape& s, const Shape& xs) {
  if (s == xs || xs.size() < 2) return s;
  Shape a(xs.size() - std::min(s.size(), xs.size()), 1);
  a.insert(a.end(), s.begin(), s.end());
  const int64_t c = a[1];
  a.erase(a.begin() + 1);
  a.push_back(c);
  return a;
}

// The shape the programs read an input of shape s with: its own, or for channels-last
// group_norm the permuted NCHW shape of an input that is not x's (channels_last_shape).
inline Shape program_shape(const RowsAttrs& a, const Shape& s, const Shape& xs) {
  return a.channels_last ? channels_last_shape(s, xs) : s;
}

// x's shape: the prologue inputs' broadcast (channels-last group_norm: the largest of them,
// stored [N, spatial..., C]; the others permuted to it).
inline Shape rows_prologue_shape(const RowsAttrs& a, const std::vector<TensorRef>& t) {
  std::vector<Shape> shapes;
  for (size_t i = 0; i < a.n_prologue(); ++i) shapes.push_back(t[i].shape);
  if (!a.channels_last) return broadcast_shapes(shapes);
  Shape xs;
  for (const Shape& s : shapes)
    if (xs.empty() || numel(s) > numel(xs)) xs = s;
  for (Shape& s : shapes) s = channels_last_shape(s, xs);
  return broadcast_shapes(shapes);
}

// The inputs' shapes checked: x's shape (the prologue inputs' broadcast), of rank at least
// `axis`; every extra broadcasts to it. Returns x's shape.
inline Shape rows_x_shape(const RowsAttrs& a, const std::vector<TensorRef>& t) {
  const Shape xs = rows_prologue_shape(a, t);
  if (a.reduction == Reduction::GROUP_NORM) {
    if (xs.size() < 2) throw Error("x has shape " + shape_str(xs) + ": group_norm needs [N, C, ...]");
    const int64_t c = a.channels_last ? xs.back() : xs[1];
    if (c % a.groups != 0)
      throw Error("x has " + std::to_string(c) + " channels, not a multiple of groups " + std::to_string(a.groups));
  }
  if (static_cast<int64_t>(xs.size()) < a.axis)
    throw Error("x has shape " + shape_str(xs) + ", of rank below the node's axis " + std::to_string(a.axis));
  for (size_t i = a.n_prologue(); i < t.size(); ++i) {
    const Shape e = program_shape(a, t[i].shape, xs);
    bool ok = e.size() <= xs.size();
    for (size_t d = 0; ok && d < e.size(); ++d) {
      const int64_t want = xs[xs.size() - e.size() + d];
      ok = e[d] == 1 || e[d] == want;
    }
    if (!ok)
      throw Error("input " + std::to_string(i) + " has shape " + shape_str(e) + ", which does not broadcast to x's " +
                  shape_str(xs));
  }
  return xs;
}

// Reads the node's inputs and checks their count and types (f32_for_half as in type_fits).
inline std::vector<TensorRef> read_rows_inputs(const RowsAttrs& a, OrtKernelContext* ctx, bool f32_for_half) {
  size_t n_in = 0, n_out = 0;
  check(g_ort->KernelContext_GetInputCount(ctx, &n_in));
  check(g_ort->KernelContext_GetOutputCount(ctx, &n_out));
  if (n_in != a.n_inputs())
    throw Error("the node has " + std::to_string(n_in) + " inputs, its programs read " + std::to_string(a.n_inputs()) +
                " (" + std::to_string(a.n_prologue()) + " for the prologue, " + std::to_string(a.n_extras()) +
                " for the epilogue)");
  if (n_out != a.n_outputs())
    throw Error("the node has " + std::to_string(n_out) + " outputs, expected " + std::to_string(a.n_outputs()));
  std::vector<TensorRef> t(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    t[i] = input_tensor(ctx, i);
    if (!type_fits(t[i].type, a.input_dtype(i), f32_for_half))
      throw Error("input " + std::to_string(i) + " is " + elem_type_name(t[i].type) + ", the program declares " +
                  dtype_name(a.input_dtype(i)));
  }
  return t;
}

// Allocates every output with x's shape and checks its type.
inline std::vector<TensorRef> rows_outputs(const RowsAttrs& a, OrtKernelContext* ctx, const Shape& xs,
                                           bool f32_for_half) {
  std::vector<TensorRef> out(a.n_outputs());
  const int64_t dummy = 0;
  for (size_t j = 0; j < out.size(); ++j) {
    OrtValue* v = nullptr;
    check(g_ort->KernelContext_GetOutput(ctx, j, xs.empty() ? &dummy : xs.data(), xs.size(), &v));
    if (!v) throw Error("could not allocate output " + std::to_string(j));
    read_tensor(v, &out[j]);
    if (!type_fits(out[j].type, a.output_dtype(j), f32_for_half))
      throw Error("output " + std::to_string(j) + " is " + elem_type_name(out[j].type) + " in the graph, the node " +
                  "stores " + dtype_name(a.output_dtype(j)));
  }
  return out;
}

}  // namespace onnxfuse
