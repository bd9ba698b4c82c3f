// The CPU kernel of onnxfuse::FusedAttention (docs/format.md): a correctness reference.
// Q, K^T and V are read through their strides from their first elements (a split's offset into
// the packed input, attention.h; inputs 0, 1, 2 may be one tensor, widened once); an input with
// a bias (bias_q, bias_k, bias_v) is widened with the bias added along its last dim, each sum
// rounded to Q's dtype as the original's Add stores it.
//   1. the scores Q @ K^T per (batch, head, query row), summed in double (parallel over the
//      rows on ORT's intra-op thread pool), rounded to Q's dtype as the original's MatMul
//      stores them, into a [B, H, Sq, Sk] buffer (the logical [batch..., Sq, Sk]);
//   2. the score program over the scores with the cpu_program.cc evaluator, reading the
//      extras with numpy broadcasting, its output rounded to the program's output dtype;
//   3. per row, ONNX's softmax in double (a row of -inf gives NaN; NaN propagates), the
//      probabilities rounded to V's dtype, P @ V summed in double, rounded to Y's dtype and
//      written to Y's base tensor through its strides (Transpose(logical Y, perm_y)).
// Sk = 0 gives Y = 0. Float32 tensors may stand for f16 / bf16 ones (docs/format.md).
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention.h"
#include "cpu_ops.h"

namespace onnxfuse {
namespace {

// Writes v (already rounded to the declared dtype) as element `at` of a tensor stored as `actual`.
void put(DType actual, void* data, int64_t at, float v) {
  switch (actual) {
    case DType::F32: static_cast<float*>(data)[at] = v; break;
    case DType::F16: static_cast<uint16_t*>(data)[at] = f32_to_f16(v); break;
    case DType::BF16: static_cast<uint16_t*>(data)[at] = f32_to_bf16(v); break;
    case DType::BOOL: break;
  }
}

struct AttentionKernel {
  static constexpr const char* kOp = kFusedAttention;
  static constexpr const char* kProvider = "CPUExecutionProvider";
  static constexpr const char* kWhere = "";
  std::string name;
  Program prog;
  AttentionPerms perms;
  AttentionSplits splits;
  AttentionBiases biases;
  bool nan_to_zero = false;  // attribute nan_to_zero: NaN probabilities read as 0
  int64_t zero_where = -1;   // attribute zero_where: the bool extra whose true elements zero P's
  int64_t kv_group = 1;      // attribute kv_group: query head h reads K's and V's head h / kv_group
  bool exact_scores = false;  // attribute exact_scores: the scores kept in fp32 up to the softmax

  void compute(OrtKernelContext* ctx) const {
    const std::vector<TensorRef> t = read_attention_inputs(ctx, prog, /*f32_for_half=*/true, biases.count);
    const size_t n_in = t.size() - biases.count;  // Q, K^T, V and the extras
    std::vector<Shape> extra_shapes, shapes;
    for (size_t i = 3; i < n_in; ++i) extra_shapes.push_back(t[i].shape);
    for (const TensorRef& x : t) shapes.push_back(x.shape);
    AttentionGeometry g =
        attention_geometry(t[0].shape, t[1].shape, t[2].shape, extra_shapes, perms, splits, kv_group);
    attention_bias_geometry(shapes, perms, splits, biases, &g);
    OrtValue* yv = nullptr;
    check(g_ort->KernelContext_GetOutput(ctx, 0, g.y_base.data(), g.y_base.size(), &yv));
    TensorRef y;
    read_tensor(yv, &y);
    const DType dt = prog.inputs[0];  // Q's, K^T's, V's and Y's
    if (!type_fits(y.type, dt, true))
      throw Error("output 0 is " + std::string(elem_type_name(y.type)) + " in the graph, Q is " + dtype_name(dt));
    const DType y_actual = actual_dtype(y.type, dt);
    if (numel(g.y_base) == 0) return;

    // inputs 0, 1, 2 widened once each (with their bias added), or once in all when they are one
    // tensor with one bias (packed QKV)
    std::vector<float> wide[3];
    const float* base[3];
    for (int i = 0; i < 3; ++i) {
      int same = -1;
      for (int j = 0; j < i && same < 0; ++j)
        if (t[j].data == t[i].data && t[j].type == t[i].type && t[j].shape == t[i].shape &&
            biases.get(j) == biases.get(i))
          same = j;
      if (same < 0) {
        wide[i] = widen(t[i], dt);
        if (biases.get(i) >= 0) {
          const std::vector<float> bias = widen(t[static_cast<size_t>(biases.get(i))], dt);
          const size_t n = bias.size();
          for (size_t e = 0; e < wide[i].size(); ++e)
            wide[i][e] = round_to(dt, static_cast<float>(static_cast<double>(wide[i][e]) + bias[e % n]));
        }
      }
      base[i] = same < 0 ? wide[i].data() : base[same];
    }
    const float* q = base[0] + g.q_off;
    const float* k = base[1] + g.k_off;
    const float* v = base[2] + g.v_off;
    const int64_t rows = g.b * g.h * g.sq, sk = g.sk, sq = g.sq, d = g.d, dv = g.dv;
    auto bh_of = [&](int64_t row, int64_t* b, int64_t* h, int64_t* i) {
      *i = row % sq;
      *h = (row / sq) % g.h;
      *b = row / (sq * g.h);
    };

    // 1. the scores [B, H, Sq, Sk], rounded to Q's dtype (fp32 with exact_scores)
    std::vector<float> s(static_cast<size_t>(rows * sk));
    if (sk > 0)
      parallel_for(ctx, rows, [&](int64_t row) {
        int64_t b, h, i;
        bh_of(row, &b, &h, &i);
        const float* qr = q + b * g.q[0] + h * g.q[1] + i * g.q[2];
        const float* kh = k + b * g.k[0] + (h / g.kv_group) * g.k[1];
        float* out = s.data() + row * sk;
        for (int64_t j = 0; j < sk; ++j) {
          double acc = 0.0;
          for (int64_t c = 0; c < d; ++c) acc += static_cast<double>(qr[c * g.q[3]]) * kh[c * g.k[2] + j * g.k[3]];
          out[j] = exact_scores ? static_cast<float>(acc) : round_to(dt, static_cast<float>(acc));
        }
      });

    // 2. the score program over [batch..., Sq, Sk], rounded as it stores its output (its output
    //    declared fp32 at creation with exact_scores)
    std::vector<float> z(s.size()), zeroed;
    if (!s.empty()) {
      std::vector<HostTensor> in;
      in.push_back({DType::F32, s.data(), g.scores});
      for (size_t i = 3; i < n_in; ++i) in.push_back({actual_dtype(t[i].type, prog.inputs[i - 2]), t[i].data, t[i].shape});
      run_program(prog, in, {{DType::F32, z.data(), g.scores}}, g.scores, ctx);
      if (zero_where >= 0) {  // the extra broadcast to the scores: 1 where P is zeroed (Where(m, 0, P))
        Program pick;
        pick.inputs = prog.inputs;
        Instr sel{Op::SELECT, 3, {}};
        sel.args[0].ref = static_cast<int32_t>(1 + zero_where);
        sel.args[1].lit = 1.0f;
        sel.args[2].lit = 0.0f;
        pick.instrs.push_back(sel);
        pick.outputs.push_back({pick.n_values() - 1, DType::F32});
        zeroed.resize(s.size());
        run_program(pick, in, {{DType::F32, zeroed.data(), g.scores}}, g.scores, ctx);
      }
    }

    // 3. softmax, P @ V, the store through Y's strides
    parallel_for(ctx, rows, [&](int64_t row) {
      int64_t b, h, i;
      bh_of(row, &b, &h, &i);
      const float* zr = z.data() + row * sk;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < sk; ++j) m = zr[j] > m ? zr[j] : m;
      std::vector<double> p(static_cast<size_t>(sk));
      double sum = 0.0;
      for (int64_t j = 0; j < sk; ++j) {
        p[j] = std::exp(static_cast<double>(zr[j]) - m);  // NaN for a row of -inf, as ONNX's
        sum += p[j];
      }
      for (int64_t j = 0; j < sk; ++j) {
        p[j] = round_to(dt, static_cast<float>(p[j] / sum));
        if (nan_to_zero && std::isnan(p[j])) p[j] = 0.0;  // the original's Where(IsNaN(P), 0, P)
        if (!zeroed.empty() && zeroed[row * sk + j] != 0.0f) p[j] = 0.0;  // its Where(m, 0, P)
      }
      const float* vh = v + b * g.v[0] + (h / g.kv_group) * g.v[1];
      const int64_t yo = b * g.y[0] + h * g.y[1] + i * g.y[2];
      for (int64_t c = 0; c < dv; ++c) {
        double acc = 0.0;
        for (int64_t j = 0; j < sk; ++j) acc += p[j] * vh[j * g.v[2] + c * g.v[3]];
        put(y_actual, y.data, yo + c * g.y[3], round_to(dt, static_cast<float>(acc)));
      }
    });
  }
};

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  std::string name;
  try {
    name = node_name(info);
    auto k = std::make_unique<AttentionKernel>();
    k->name = name;
    k->prog = read_program(info);
    check_attention_program(k->prog);
    k->perms = read_attention_perms(info);
    k->splits = read_attention_splits(info);
    k->biases = read_attention_biases(info, k->splits, k->prog.inputs.size() - 1);
    int64_t v = 0;
    k->nan_to_zero = get_int_attr(info, "nan_to_zero", &v) && v != 0;
    if (get_int_attr(info, "zero_where", &v)) {
      const int64_t n_extras = static_cast<int64_t>(k->prog.inputs.size()) - 1;
      if (v < 0 || v >= n_extras || k->prog.inputs[static_cast<size_t>(1 + v)] != DType::BOOL)
        throw Error("zero_where " + std::to_string(v) + " is not the index of one of the " +
                    std::to_string(n_extras) + " extras, or not of a bool one");
      k->zero_where = v;
    }
    k->kv_group = read_attention_kv_group(info);
    k->exact_scores = get_int_attr(info, "exact_scores", &v) && v != 0;
    if (k->exact_scores)
      for (auto& out : k->prog.outputs) out.second = DType::F32;  // the Softmax's input unrounded
    *kernel = k.release();
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(describe_node(kFusedAttention, name) + ": " + e.what(), ORT_INVALID_ARGUMENT);
  }
}

}  // namespace

void append_attention_cpu_ops(std::vector<OrtCustomOp*>* ops) {
  static OpDef op = make_op<AttentionKernel>(3, create_kernel);
  ops->push_back(&op);
}

}  // namespace onnxfuse
