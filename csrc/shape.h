// numpy broadcasting of input shapes, and collapsing of the broadcast iteration space.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "program.h"

namespace onnxfuse {

using Shape = std::vector<int64_t>;

inline std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// numpy.broadcast_shapes; throws Error naming the shapes when they do not broadcast.
inline Shape broadcast_shapes(const std::vector<Shape>& shapes) {
  size_t rank = 0;
  for (const auto& s : shapes) rank = s.size() > rank ? s.size() : rank;
  Shape out(rank, 1);
  for (size_t k = 0; k < shapes.size(); ++k) {
    const Shape& s = shapes[k];
    for (size_t i = 0; i < s.size(); ++i) {
      const int64_t d = s[i];
      int64_t& o = out[rank - s.size() + i];
      if (d < 0) throw Error("input " + std::to_string(k) + " has a negative dimension");
      if (d == 1) continue;
      if (o == 1) {
        o = d;
      } else if (o != d) {
        std::string msg = "input shapes do not broadcast:";
        for (size_t j = 0; j < shapes.size(); ++j) msg += " " + shape_str(shapes[j]);
        throw Error(msg);
      }
    }
  }
  return out;
}

// Row-major element strides of a contiguous tensor of shape s.
inline Shape contiguous_strides(const Shape& s) {
  Shape st(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

// Element strides of `in` (a shape that broadcasts to `out`) in the output's index space:
// contiguous strides of `in`, left-padded to out's rank, 0 on broadcast dimensions.
inline Shape broadcast_strides(const Shape& in, const Shape& out) {
  Shape st(out.size(), 0);
  int64_t s = 1;
  for (size_t i = 0; i < in.size(); ++i) {
    const size_t ii = in.size() - 1 - i;
    const size_t oi = out.size() - 1 - i;
    st[oi] = in[ii] == 1 ? 0 : s;
    s *= in[ii];
  }
  return st;
}

// The output index space with size-1 dimensions dropped and adjacent dimensions merged
// where every operand is contiguous across them. Element i of the output (row-major) is
// element sum(idx[d] * strides[k][d]) of operand k, idx being i unraveled over dims.
struct Collapsed {
  Shape dims;
  std::vector<Shape> strides;  // per operand
};

inline Collapsed collapse(const Shape& out, const std::vector<Shape>& strides) {
  Collapsed c;
  c.strides.resize(strides.size());
  for (size_t d = 0; d < out.size(); ++d) {
    if (out[d] == 1) continue;
    bool merge = !c.dims.empty();
    for (size_t k = 0; k < strides.size() && merge; ++k)
      merge = c.strides[k].back() == strides[k][d] * out[d];
    if (merge) {
      c.dims.back() *= out[d];
      for (size_t k = 0; k < strides.size(); ++k) c.strides[k].back() = strides[k][d];
    } else {
      c.dims.push_back(out[d]);
      for (size_t k = 0; k < strides.size(); ++k) c.strides[k].push_back(strides[k][d]);
    }
  }
  return c;
}

}  // namespace onnxfuse
