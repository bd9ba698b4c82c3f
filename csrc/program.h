// The pointwise program (text format of onnxfuse/expr.py) and its block evaluator.
//
// A Program is parsed once per kernel instance. For each Compute the caller builds an
// ExecPlan: where every value of the program lives while a block of elements is evaluated
// (a scratch slot, a constant buffer, the input tensor itself, or the output tensor
// itself). eval_block then runs the instruction list over one block, one instruction at a
// time over the whole block, so every inner loop is a simple vectorizable loop over
// cache-resident buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace onnxfuse {

// An error whose message is meant for the user (turned into an OrtStatus).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class DType : uint8_t { F32, F16, BF16, BOOL };

enum class Op : uint8_t {
  // unary
  NEG, ABS, EXP, LOG, SQRT, TANH, ERF, COS, SIN, SIGMOID, SOFTPLUS, ROUND_F16, ROUND_BF16, ERFC, EXPM1,
  // binary
  ADD, SUB, MUL, DIV, POW, MAX, MIN, GT, GE, LT, LE, EQ,
  // ternary
  SELECT,
};

const char* dtype_name(DType d);
const char* op_name(Op op);
int op_arity(Op op);

struct Operand {
  int32_t ref = -1;  // value index, or -1 for a literal
  float lit = 0.0f;  // the literal, rounded to fp32 (as numpy's np.float32(literal))
  bool is_ref() const { return ref >= 0; }
};

struct Instr {
  Op op;
  int arity;
  Operand args[3];
};

struct Program {
  std::vector<DType> inputs;                    // value i < inputs.size() is input i
  std::vector<Instr> instrs;                    // instruction k defines value inputs.size()+k
  std::vector<std::pair<int, DType>> outputs;   // (value, dtype), in node-output order
  int n_values() const { return static_cast<int>(inputs.size() + instrs.size()); }
};

// Parses and validates the text format; throws Error naming the offending line.
Program parse_program(const std::string& text);

// ---------------------------------------------------------------------------------------
// Execution plan
// ---------------------------------------------------------------------------------------

// Where a value lives while a block is evaluated.
struct Loc {
  enum Kind : uint8_t {
    SLOT,    // scratch buffer `index` (block-sized, per thread)
    CONST,   // constant buffer `index` (block-sized, filled once per thread)
    INPUT,   // input tensor `index` read in place (fp32, output-shaped, contiguous)
    OUTPUT,  // output tensor `index` written in place (fp32)
    NONE,    // dead value, never computed
  };
  Kind kind = NONE;
  int32_t index = 0;
};

// How the caller provides each input.
enum class InputKind : uint8_t {
  DIRECT,  // fp32 with the output's shape: read in place
  GATHER,  // gathered per block into a slot by the caller (conversion and/or broadcast)
  SCALAR,  // one element: its fp32 value goes into a constant buffer
};

// One instruction over table entries (see ExecPlan::table_size).
struct CInstr {
  Op op;
  int32_t dst;
  int32_t src[3];
  // Operands known to be the same for every element (literals, one-element inputs):
  // binary ops use a scalar instead of reading a constant buffer.
  bool is_const[3];
  float cval[3];
};

struct ExecPlan {
  int n_values = 0;
  std::vector<Loc> loc;          // per value
  std::vector<CInstr> code;      // live instructions, in order
  std::vector<float> consts;     // value of constant buffer c
  std::vector<char> const_read;  // whether buffer c is read through its pointer (else the
                                 // instructions use the value as a scalar: no need to fill it)
  int n_slots = 0;
  // The pointer table used by eval_block has n_values + consts.size() entries: values
  // first, then one entry per constant buffer (literals refer to those).
  size_t table_size() const { return static_cast<size_t>(n_values) + consts.size(); }
};

// scalar_values[i] is used for inputs whose kind is SCALAR. An fp32 output whose value is
// computed by an instruction is written in place (Loc::OUTPUT) when allow_output_direct.
ExecPlan make_plan(const Program& p, const std::vector<InputKind>& kinds,
                   const std::vector<float>& scalar_values, bool allow_output_direct);

// Runs plan.code over `len` elements. table[v] points at the block of value v (for values
// with a location), table[n_values + c] at constant buffer c.
void eval_block(const ExecPlan& plan, float* const* table, size_t len);

// ---------------------------------------------------------------------------------------
// Element conversions (round-to-nearest-even, NaN stays NaN, overflow goes to inf)
// ---------------------------------------------------------------------------------------

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t out;
  if (em >= 0x7c00u) {  // inf / nan
    out = 0x7f800000u | ((em & 0x03ffu) << 13);
  } else if (em >= 0x0400u) {  // normal
    out = (em << 13) + ((127u - 15u) << 23);
  } else {  // zero / subnormal: em * 2^-24, exact in fp32
    out = f32_bits(static_cast<float>(em) * 5.9604644775390625e-08f);
  }
  return bits_f32(out | sign);
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t o;
  if (x >= 0x47800000u) {  // |f| >= 65536, inf or nan
    o = x > 0x7f800000u ? (0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u;
  } else if (x < 0x38800000u) {  // |f| < 2^-14: subnormal half (or zero)
    // Adding 0.5 aligns the mantissa so that the fp32 adder rounds to nearest even at
    // the half-subnormal ulp (2^-24); the low bits are then the half's mantissa.
    const float t = bits_f32(x) + 0.5f;
    o = f32_bits(t) - 0x3f000000u;
  } else {
    const uint32_t odd = (x >> 13) & 1u;
    x += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round to nearest even
    o = x >> 13;             // overflow past the largest half carries into inf
  }
  return static_cast<uint16_t>(o | sign);
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

}  // namespace onnxfuse
