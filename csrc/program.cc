// Parser of the program text and the block evaluator. See program.h.
#include "program.h"

#include <charconv>
#include <cmath>
#include <map>
#include <sstream>

// Vector math: glibc's libmvec has SIMD versions of these functions (SSE/AVX2/AVX-512,
// within 4 ulp). math.h declares them SIMD-callable only under -ffast-math, whose other
// effects (NaN handling) the program semantics cannot take; these declarations make the
// same promise without it, so the vectorizer calls _ZGV*_expf and friends for whole
// registers. The build (onnxfuse/build.py) defines ONNXFUSE_VECTOR_MATH only where
// libmvec has them all (glibc >= 2.35); elsewhere the scalar functions are used.
#if defined(ONNXFUSE_VECTOR_MATH) && defined(__x86_64__)
#define ONNXFUSE_SIMD __attribute__((simd("notinbranch")))
extern "C" {
ONNXFUSE_SIMD float expf(float) noexcept;
ONNXFUSE_SIMD float logf(float) noexcept;
ONNXFUSE_SIMD float log1pf(float) noexcept;
ONNXFUSE_SIMD float tanhf(float) noexcept;
ONNXFUSE_SIMD float erff(float) noexcept;
ONNXFUSE_SIMD float erfcf(float) noexcept;
ONNXFUSE_SIMD float expm1f(float) noexcept;
ONNXFUSE_SIMD float cosf(float) noexcept;
ONNXFUSE_SIMD float sinf(float) noexcept;
ONNXFUSE_SIMD float powf(float, float) noexcept;
}
#endif

namespace onnxfuse {

namespace {

struct OpInfo {
  const char* name;
  Op op;
  int arity;
};

constexpr OpInfo kOps[] = {
    {"neg", Op::NEG, 1},           {"abs", Op::ABS, 1},
    {"exp", Op::EXP, 1},           {"log", Op::LOG, 1},
    {"sqrt", Op::SQRT, 1},         {"tanh", Op::TANH, 1},
    {"erf", Op::ERF, 1},           {"cos", Op::COS, 1},
    {"sin", Op::SIN, 1},           {"sigmoid", Op::SIGMOID, 1},
    {"softplus", Op::SOFTPLUS, 1}, {"round_f16", Op::ROUND_F16, 1},
    {"round_bf16", Op::ROUND_BF16, 1}, {"erfc", Op::ERFC, 1},
    {"expm1", Op::EXPM1, 1},
    {"add", Op::ADD, 2},           {"sub", Op::SUB, 2},
    {"mul", Op::MUL, 2},           {"div", Op::DIV, 2},
    {"pow", Op::POW, 2},           {"max", Op::MAX, 2},
    {"min", Op::MIN, 2},           {"gt", Op::GT, 2},
    {"ge", Op::GE, 2},             {"lt", Op::LT, 2},
    {"le", Op::LE, 2},             {"eq", Op::EQ, 2},
    {"select", Op::SELECT, 3},
};

const OpInfo* find_op(const std::string& name) {
  for (const auto& o : kOps)
    if (name == o.name) return &o;
  return nullptr;
}

const OpInfo& op_info(Op op) {
  for (const auto& o : kOps)
    if (o.op == op) return o;
  throw Error("internal error: unknown op code");
}

bool parse_dtype(const std::string& s, DType* out) {
  if (s == "f32") *out = DType::F32;
  else if (s == "f16") *out = DType::F16;
  else if (s == "bf16") *out = DType::BF16;
  else if (s == "bool") *out = DType::BOOL;
  else return false;
  return true;
}

std::vector<std::string> split_spaces(const std::string& line) {
  std::vector<std::string> tok;
  size_t i = 0;
  while (i <= line.size()) {
    size_t j = line.find(' ', i);
    if (j == std::string::npos) j = line.size();
    tok.push_back(line.substr(i, j - i));
    i = j + 1;
  }
  return tok;
}

// "%12" -> 12; -1 if not a value reference.
int parse_ref(const std::string& t) {
  if (t.size() < 2 || t[0] != '%') return -1;
  int v = 0;
  auto r = std::from_chars(t.data() + 1, t.data() + t.size(), v);
  if (r.ec != std::errc() || r.ptr != t.data() + t.size() || v < 0) return -1;
  return v;
}

bool parse_float(const std::string& t, float* out) {
  // Python's repr(float): "2.0", "1e-05", "-1.5e+300", "inf", "-inf", "nan".
  double d = 0;
  const char* b = t.data();
  const char* e = t.data() + t.size();
  auto r = std::from_chars(b, e, d);
  if (r.ec == std::errc::result_out_of_range) {
    // from_chars refuses subnormal/overflowing doubles; Python's repr never writes those
    // beyond what strtod handles, so fall back to it (locale does not matter for these).
    d = std::strtod(t.c_str(), nullptr);
  } else if (r.ec != std::errc() || r.ptr != e) {
    return false;
  }
  *out = static_cast<float>(d);  // like np.float32(python_float)
  return true;
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::BOOL: return "bool";
  }
  return "?";
}

const char* op_name(Op op) { return op_info(op).name; }
int op_arity(Op op) { return op_info(op).arity; }

Program parse_program(const std::string& text_in) {
  static const char kHeader[] = "onnxfuse.pointwise v1";
  // Like expr.parse: strip leading/trailing newlines, split on '\n'.
  size_t b = text_in.find_first_not_of('\n');
  size_t e = text_in.find_last_not_of('\n');
  std::string text = b == std::string::npos ? std::string() : text_in.substr(b, e - b + 1);
  std::vector<std::string> lines;
  {
    size_t i = 0;
    while (i <= text.size()) {
      size_t j = text.find('\n', i);
      if (j == std::string::npos) j = text.size();
      lines.push_back(text.substr(i, j - i));
      i = j + 1;
    }
  }
  if (lines.empty() || lines[0] != kHeader)
    throw Error(std::string("program must start with '") + kHeader + "'");

  Program p;
  auto bad = [](const std::string& what, const std::string& line) {
    return Error("program: " + what + ": '" + line + "'");
  };
  for (size_t li = 1; li < lines.size(); ++li) {
    const std::string& line = lines[li];
    std::vector<std::string> tok = split_spaces(line);
    if (tok[0] == "input") {
      if (tok.size() != 3) throw bad("cannot parse line", line);
      if (!p.instrs.empty() || !p.outputs.empty() || parse_ref(tok[1]) != static_cast<int>(p.inputs.size()))
        throw bad("misplaced input line", line);
      DType d;
      if (!parse_dtype(tok[2], &d)) throw bad("bad input dtype", line);
      p.inputs.push_back(d);
    } else if (tok[0] == "output") {
      if (tok.size() != 3) throw bad("cannot parse line", line);
      int v = parse_ref(tok[1]);
      if (v < 0) throw bad("bad output value", line);
      DType d;
      if (!parse_dtype(tok[2], &d) || d == DType::BOOL) throw bad("bad output dtype", line);
      p.outputs.emplace_back(v, d);
    } else if (tok.size() >= 3 && tok[1] == "=") {
      const int self = p.n_values();
      if (!p.outputs.empty() || parse_ref(tok[0]) != self) throw bad("misplaced instruction", line);
      const OpInfo* oi = find_op(tok[2]);
      if (!oi) throw bad("unknown op '" + tok[2] + "'", line);
      if (static_cast<int>(tok.size()) - 3 != oi->arity)
        throw bad(std::string(oi->name) + " takes " + std::to_string(oi->arity) + " operands", line);
      Instr ins{};
      ins.op = oi->op;
      ins.arity = oi->arity;
      for (int a = 0; a < oi->arity; ++a) {
        const std::string& t = tok[3 + a];
        if (!t.empty() && t[0] == '%') {
          int v = parse_ref(t);
          if (v < 0 || v >= self) throw bad("use of undefined value " + t, line);
          ins.args[a].ref = v;
        } else if (!parse_float(t, &ins.args[a].lit)) {
          throw bad("bad operand '" + t + "'", line);
        }
      }
      p.instrs.push_back(ins);
    } else {
      throw bad("cannot parse line", line);
    }
  }
  if (p.outputs.empty()) throw Error("program has no outputs");
  for (const auto& o : p.outputs)
    if (o.first >= p.n_values()) throw Error("program: output %" + std::to_string(o.first) + " is undefined");
  return p;
}

// ---------------------------------------------------------------------------------------
// Plan
// ---------------------------------------------------------------------------------------

ExecPlan make_plan(const Program& p, const std::vector<InputKind>& kinds,
                   const std::vector<float>& scalar_values, bool allow_output_direct) {
  const int n_in = static_cast<int>(p.inputs.size());
  const int nv = p.n_values();
  const int n_ins = static_cast<int>(p.instrs.size());
  ExecPlan plan;
  plan.n_values = nv;
  plan.loc.assign(nv, Loc{});

  // Liveness: which values reach an output, and the last instruction reading each value.
  std::vector<char> live(nv, 0);
  for (const auto& o : p.outputs) live[o.first] = 1;
  for (int k = n_ins - 1; k >= 0; --k) {
    if (!live[n_in + k]) continue;
    const Instr& ins = p.instrs[k];
    for (int a = 0; a < ins.arity; ++a)
      if (ins.args[a].is_ref()) live[ins.args[a].ref] = 1;
  }
  const int kForever = n_ins + 1;
  std::vector<int> last_use(nv, -1);
  for (int k = 0; k < n_ins; ++k) {
    if (!live[n_in + k]) continue;
    const Instr& ins = p.instrs[k];
    for (int a = 0; a < ins.arity; ++a)
      if (ins.args[a].is_ref()) last_use[ins.args[a].ref] = k;
  }
  for (const auto& o : p.outputs) last_use[o.first] = kForever;

  // Constants, deduplicated by bit pattern.
  std::map<uint32_t, int> const_index;
  auto constant = [&](float f) {
    auto it = const_index.find(f32_bits(f));
    if (it != const_index.end()) return it->second;
    int c = static_cast<int>(plan.consts.size());
    plan.consts.push_back(f);
    const_index.emplace(f32_bits(f), c);
    return c;
  };

  std::vector<int> free_slots;
  auto alloc_slot = [&]() {
    if (!free_slots.empty()) {
      int s = free_slots.back();
      free_slots.pop_back();
      return s;
    }
    return plan.n_slots++;
  };

  for (int i = 0; i < n_in; ++i) {
    if (!live[i]) continue;
    switch (kinds.at(i)) {
      case InputKind::DIRECT: plan.loc[i] = Loc{Loc::INPUT, i}; break;
      case InputKind::GATHER: plan.loc[i] = Loc{Loc::SLOT, alloc_slot()}; break;
      case InputKind::SCALAR: plan.loc[i] = Loc{Loc::CONST, constant(scalar_values.at(i))}; break;
    }
  }

  // Which instruction results are written straight into an fp32 output.
  std::vector<int> direct_output(nv, -1);
  if (allow_output_direct) {
    for (size_t j = 0; j < p.outputs.size(); ++j) {
      const int v = p.outputs[j].first;
      if (v >= n_in && p.outputs[j].second == DType::F32 && direct_output[v] < 0)
        direct_output[v] = static_cast<int>(j);
    }
  }

  auto table_ref = [&](const Operand& o) -> int32_t {
    if (o.is_ref()) return o.ref;
    return nv + constant(o.lit);
  };

  for (int k = 0; k < n_ins; ++k) {
    const int v = n_in + k;
    if (!live[v]) continue;
    const Instr& ins = p.instrs[k];
    CInstr ci{};
    ci.op = ins.op;
    ci.dst = v;
    for (int a = 0; a < ins.arity; ++a) {
      const Operand& o = ins.args[a];
      ci.src[a] = table_ref(o);
      if (!o.is_ref()) {
        ci.is_const[a] = true;
        ci.cval[a] = o.lit;
      } else if (plan.loc[o.ref].kind == Loc::CONST) {
        ci.is_const[a] = true;
        ci.cval[a] = plan.consts[plan.loc[o.ref].index];
      }
    }
    // The destination is allocated before the operands' slots are released, so a
    // destination never aliases an operand (the loops use __restrict).
    if (direct_output[v] >= 0) plan.loc[v] = Loc{Loc::OUTPUT, direct_output[v]};
    else plan.loc[v] = Loc{Loc::SLOT, alloc_slot()};
    for (int a = 0; a < ins.arity; ++a) {
      const Operand& o = ins.args[a];
      if (!o.is_ref() || last_use[o.ref] != k) continue;
      bool seen = false;  // the same value used twice by this instruction: free once
      for (int b = 0; b < a; ++b) seen |= ins.args[b].is_ref() && ins.args[b].ref == o.ref;
      if (!seen && plan.loc[o.ref].kind == Loc::SLOT) free_slots.push_back(plan.loc[o.ref].index);
    }
    if (last_use[v] < 0 && plan.loc[v].kind == Loc::SLOT) free_slots.push_back(plan.loc[v].index);
    plan.code.push_back(ci);
  }

  plan.const_read.assign(plan.consts.size(), 0);
  auto const_of = [&](int32_t t) -> int {  // constant buffer behind table entry t, or -1
    if (t >= nv) return t - nv;
    return plan.loc[t].kind == Loc::CONST ? plan.loc[t].index : -1;
  };
  for (const CInstr& ci : plan.code) {
    const int arity = op_arity(ci.op);
    const bool scalar_side = arity == 2 && ci.is_const[0] != ci.is_const[1];  // see eval_block
    for (int a = 0; a < arity; ++a) {
      const int c = const_of(ci.src[a]);
      if (c >= 0 && !scalar_side) plan.const_read[c] = 1;
    }
  }
  for (const auto& o : p.outputs) {
    const int c = const_of(o.first);
    if (c >= 0) plan.const_read[c] = 1;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------
// Block evaluator
// ---------------------------------------------------------------------------------------

namespace {

template <class F>
inline void loop1(float* __restrict d, const float* __restrict a, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) d[i] = f(a[i]);
}

// Binary op with a scalar on either side when that operand is a constant.
template <class F>
inline void loop2(float* __restrict d, const float* __restrict a, const float* __restrict b, const CInstr& c,
                  size_t n, F f) {
  if (c.is_const[1] && !c.is_const[0]) {
    const float y = c.cval[1];
    for (size_t i = 0; i < n; ++i) d[i] = f(a[i], y);
  } else if (c.is_const[0] && !c.is_const[1]) {
    const float x = c.cval[0];
    for (size_t i = 0; i < n; ++i) d[i] = f(x, b[i]);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = f(a[i], b[i]);
  }
}

inline float softplus(float x) {
  return x > 0.0f ? x + ::log1pf(::expf(-x)) : ::log1pf(::expf(x));
}

// t / (1 + t) with t = exp(-|x|) (1 for x >= 0): one exp that never overflows, so a tiny
// result (a denormal below x = -87.3) is not flushed to 0 as 1 / (1 + exp(-x)) does once
// exp(-x) overflows; NaN stays NaN.
inline float sigmoid(float x) {
  const float t = ::expf(-std::fabs(x));
  return (x >= 0.0f ? 1.0f : t) / (1.0f + t);
}

}  // namespace

// Compiled for several instruction sets; the loader picks the best one for the CPU.
__attribute__((target_clones("avx512f", "avx2", "default")))
void eval_block(const ExecPlan& plan, float* const* t, size_t n) {
  for (const CInstr& c : plan.code) {
    float* __restrict d = t[c.dst];
    const float* a = t[c.src[0]];
    const float* b = t[c.src[1]];
    switch (c.op) {
      case Op::NEG: loop1(d, a, n, [](float x) { return -x; }); break;
      case Op::ABS: loop1(d, a, n, [](float x) { return std::fabs(x); }); break;
      case Op::EXP: loop1(d, a, n, [](float x) { return ::expf(x); }); break;
      case Op::LOG: loop1(d, a, n, [](float x) { return ::logf(x); }); break;
      case Op::SQRT: loop1(d, a, n, [](float x) { return std::sqrt(x); }); break;
      case Op::TANH: loop1(d, a, n, [](float x) { return ::tanhf(x); }); break;
      case Op::ERF: loop1(d, a, n, [](float x) { return ::erff(x); }); break;
      case Op::COS: loop1(d, a, n, [](float x) { return ::cosf(x); }); break;
      case Op::SIN: loop1(d, a, n, [](float x) { return ::sinf(x); }); break;
      case Op::SIGMOID: loop1(d, a, n, sigmoid); break;
      case Op::ERFC: loop1(d, a, n, [](float x) { return ::erfcf(x); }); break;
      case Op::EXPM1: loop1(d, a, n, [](float x) { return ::expm1f(x); }); break;
      case Op::SOFTPLUS: loop1(d, a, n, softplus); break;
      case Op::ROUND_F16: loop1(d, a, n, [](float x) { return f16_to_f32(f32_to_f16(x)); }); break;
      case Op::ROUND_BF16: loop1(d, a, n, [](float x) { return bf16_to_f32(f32_to_bf16(x)); }); break;
      case Op::ADD: loop2(d, a, b, c, n, [](float x, float y) { return x + y; }); break;
      case Op::SUB: loop2(d, a, b, c, n, [](float x, float y) { return x - y; }); break;
      case Op::MUL: loop2(d, a, b, c, n, [](float x, float y) { return x * y; }); break;
      case Op::DIV: loop2(d, a, b, c, n, [](float x, float y) { return x / y; }); break;
      case Op::POW: loop2(d, a, b, c, n, [](float x, float y) { return ::powf(x, y); }); break;
      // numpy's maximum/minimum: NaN in either operand gives NaN.
      case Op::MAX: loop2(d, a, b, c, n, [](float x, float y) { return (x >= y || x != x) ? x : y; }); break;
      case Op::MIN: loop2(d, a, b, c, n, [](float x, float y) { return (x <= y || x != x) ? x : y; }); break;
      case Op::GT: loop2(d, a, b, c, n, [](float x, float y) { return x > y ? 1.0f : 0.0f; }); break;
      case Op::GE: loop2(d, a, b, c, n, [](float x, float y) { return x >= y ? 1.0f : 0.0f; }); break;
      case Op::LT: loop2(d, a, b, c, n, [](float x, float y) { return x < y ? 1.0f : 0.0f; }); break;
      case Op::LE: loop2(d, a, b, c, n, [](float x, float y) { return x <= y ? 1.0f : 0.0f; }); break;
      case Op::EQ: loop2(d, a, b, c, n, [](float x, float y) { return x == y ? 1.0f : 0.0f; }); break;
      case Op::SELECT: {
        const float* __restrict cnd = a;
        const float* __restrict x = b;
        const float* __restrict y = t[c.src[2]];
        for (size_t i = 0; i < n; ++i) d[i] = cnd[i] != 0.0f ? x[i] : y[i];
        break;
      }
    }
  }
}

}  // namespace onnxfuse
