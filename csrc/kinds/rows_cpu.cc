// The CPU kernel of onnxfuse::FusedRows (docs/format.md): a correctness reference, in three
// passes over fp32 buffers, each parallel on ORT's intra-op thread pool:
//   1. the prologue program over x's shape, into an fp32 buffer rounded as the program
//      declares x (and stored into the x output when the node has one);
//   2. per row, the reduction in double: mean and variance (of x - mean: two passes over
//      the row), mean square, or the max and the sum of exp(x - max), the softmax itself
//      (group_norm: a row is one (image, group), its statistics then given per channel);
//   3. the epilogue program over x's shape, reading the row values (x and per-row
//      statistics broadcast over the row, or the softmax) and the node's other inputs.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "cpu_ops.h"
#include "rows.h"

namespace onnxfuse {
namespace {

constexpr int64_t kTaskWork = 1 << 16;  // elements per parallel task

// An fp32 scratch buffer (std::vector: the kernel is a reference, not tuned).
using Buffer = std::vector<float>;

// max(m, v) where a NaN wins (numpy's maximum; the CUDA kernel's max_nan).
inline double max_nan(double m, double v) { return (v > m || v != v) ? v : m; }

// Pass 2 for rows [r0, r1) of x ([rows, n] contiguous): the row values after x.
void reduce_rows(Reduction red, const float* x, int64_t n, int64_t r0, int64_t r1, float* s0, float* s1,
                 float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * n;
    if (red == Reduction::LAYER_NORM || red == Reduction::RMS_NORM) {
      double sum = 0.0;
      for (int64_t i = 0; i < n; ++i) sum += red == Reduction::RMS_NORM ? double(row[i]) * row[i] : row[i];
      const double mean = sum / static_cast<double>(n);
      s0[r] = static_cast<float>(mean);
      if (red == Reduction::LAYER_NORM) {
        double m2 = 0.0;
        for (int64_t i = 0; i < n; ++i) m2 += (row[i] - mean) * (row[i] - mean);
        s1[r] = static_cast<float>(m2 / static_cast<double>(n));
      }
      continue;
    }
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; ++i) m = max_nan(m, row[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(row[i] - m);
    float* out = y + r * n;
    if (red == Reduction::SOFTMAX) {
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(std::exp(row[i] - m) / sum);
    } else {
      const double log_sum = std::log(sum);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>((row[i] - m) - log_sum);
    }
  }
}

// group_norm on channels-last x ([N, HW, C] as stored): mean and variance (of x - mean) of
// each (image, group) row r in [r0, r1), in double.
void group_stats_nhwc(const float* x, int64_t hw, int64_t c, int64_t groups, int64_t r0, int64_t r1, float* s0,
                      float* s1) {
  const int64_t cg = c / groups;
  for (int64_t r = r0; r < r1; ++r) {
    const float* base = x + (r / groups) * hw * c + (r % groups) * cg;
    double sum = 0.0;
    for (int64_t p = 0; p < hw; ++p)
      for (int64_t k = 0; k < cg; ++k) sum += base[p * c + k];
    const double n = static_cast<double>(hw * cg), mean = sum / n;
    double m2 = 0.0;
    for (int64_t p = 0; p < hw; ++p)
      for (int64_t k = 0; k < cg; ++k) m2 += (base[p * c + k] - mean) * (base[p * c + k] - mean);
    s0[r] = static_cast<float>(mean);
    s1[r] = static_cast<float>(m2 / n);
  }
}

struct RowsKernel {
  static constexpr const char* kOp = kFusedRows;
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  std::string name;
  RowsAttrs a;

  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_rows_inputs(a, ctx, /*f32_for_half=*/true);
    const Shape xs = rows_x_shape(a, t);
    const std::vector<TensorRef> out = rows_outputs(a, ctx, xs, /*f32_for_half=*/true);
    const int64_t total = numel(xs);
    if (total == 0) return;
    const bool group = a.reduction == Reduction::GROUP_NORM;
    int64_t rows = group ? xs[0] * a.groups : 1;  // group_norm: one row per (image, group)
    for (int64_t d = 0; !group && d < a.axis; ++d) rows *= xs[d];
    const int64_t n = total / rows;

    // 1. x, rounded as the prologue declares it
    std::vector<HostTensor> pin;
    for (size_t i = 0; i < a.n_prologue(); ++i)
      pin.push_back({actual_dtype(t[i].type, a.prologue.inputs[i]), t[i].data, program_shape(a, t[i].shape, xs)});
    Buffer x(static_cast<size_t>(total));
    run_program(a.prologue, pin, {{DType::F32, x.data(), xs}}, xs, ctx);
    if (a.x_output) {
      const TensorRef& xo = out.back();
      const DType declared = a.prologue.outputs[0].second;
      parallel_for(ctx, (total + kTaskWork - 1) / kTaskWork, [&](int64_t task) {
        const int64_t start = task * kTaskWork, len = std::min(kTaskWork, total - start);
        store(declared, actual_dtype(xo.type, declared), x.data() + start, xo.data, start, static_cast<size_t>(len));
      });
    }

    // 2. the row values
    const bool norm = a.reduction == Reduction::LAYER_NORM || a.reduction == Reduction::RMS_NORM || group;
    const bool two = a.reduction == Reduction::LAYER_NORM || group;
    Buffer s0(norm ? rows : 0), s1(two ? rows : 0), y(norm ? 0 : total);
    const int64_t rows_per_task = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, n));
    parallel_for(ctx, (rows + rows_per_task - 1) / rows_per_task, [&](int64_t task) {
      const int64_t r0 = task * rows_per_task, r1 = std::min(rows, r0 + rows_per_task);
      if (group && a.channels_last)
        group_stats_nhwc(x.data(), n * a.groups / xs.back(), xs.back(), a.groups, r0, r1, s0.data(), s1.data());
      else  // (NCHW group_norm: a group's channels are contiguous planes, a row of n elements)
        reduce_rows(group ? Reduction::LAYER_NORM : a.reduction, x.data(), n, r0, r1, s0.data(), s1.data(),
                    y.data());
    });

    // 3. the epilogue: statistics as [lead..., 1, ...] tensors broadcast over each row
    Shape stat_shape(xs.begin(), xs.begin() + a.axis);
    stat_shape.resize(xs.size(), 1);
    if (group) {  // one value per channel: [N, C, 1, ...] or channels-last [N, 1, ..., C]
      const int64_t c = a.channels_last ? xs.back() : xs[1], cg = c / a.groups;
      stat_shape.assign(xs.size(), 1);
      stat_shape[0] = xs[0];
      stat_shape[a.channels_last ? xs.size() - 1 : 1] = c;
      Buffer c0(static_cast<size_t>(xs[0] * c)), c1(c0.size());
      for (size_t k = 0; k < c0.size(); ++k) {
        const int64_t r = static_cast<int64_t>(k) / c * a.groups + static_cast<int64_t>(k) % c / cg;
        c0[k] = s0[r];
        c1[k] = s1[r];
      }
      s0.swap(c0);
      s1.swap(c1);
    }
    std::vector<HostTensor> ein;
    if (norm) {
      ein.push_back({DType::F32, x.data(), xs});
      ein.push_back({DType::F32, s0.data(), stat_shape});
      if (two) ein.push_back({DType::F32, s1.data(), stat_shape});
    } else {
      ein.push_back({DType::F32, y.data(), xs});
    }
    const size_t k = row_values(a.reduction);
    for (size_t i = a.n_prologue(); i < t.size(); ++i)
      ein.push_back({actual_dtype(t[i].type, a.epilogue.inputs[k + i - a.n_prologue()]), t[i].data,
                     program_shape(a, t[i].shape, xs)});
    std::vector<HostTensor> eout;
    for (size_t j = 0; j < a.epilogue.outputs.size(); ++j)
      eout.push_back({actual_dtype(out[j].type, a.epilogue.outputs[j].second), out[j].data, xs});
    run_program(a.epilogue, ein, eout, xs, ctx);
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<RowsKernel>();
    k->name = name;
    k->a = read_rows_attrs(info);
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kFusedRows, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_rows_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<RowsKernel>(1, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
