"""Pointwise expression IR: a straight-line program over broadcast tensors.

A fused pointwise node carries its computation as a `Program`, serialized to text in the
node attribute ``program``. Three back ends read it: the numpy evaluator below (tests and
reference), the Triton code generator (`onnxfuse.codegen`) and the C++ CPU kernel in
``csrc/``. The text format is the contract between them:

    onnxfuse.pointwise v1
    input %0 f32
    input %1 bool
    %2 = mul %0 2.0
    %3 = sigmoid %2
    %4 = select %1 %3 %2
    output %4 f16

Rules:
- One statement per line, single spaces between tokens, no comments, ``\\n`` line ends.
- ``input %i DTYPE`` lines come first, numbered 0..k-1 in node-input order. DTYPE is one
  of f32, f16, bf16 (values are upcast to fp32) or bool (read as 1.0 / 0.0).
- ``%n = OP ARG...`` defines value n (numbered consecutively after the inputs). Every
  value is an fp32 scalar per element; all math is fp32. An ARG is ``%m`` (m < n) or a
  float literal as written by Python's ``repr(float)`` (``inf``, ``-inf``, ``nan`` too).
- ``output %n DTYPE`` lines come last, in node-output order; the value is cast to DTYPE
  (f32, f16 or bf16, round-to-nearest-even) when stored.
- Broadcasting follows numpy: each input is broadcast to the node's output shape, which
  is the broadcast of all input shapes. All outputs have that shape.

Ops (see `UNARY`, `BINARY`, `TERNARY`):
- unary: neg abs exp expm1 log sqrt tanh erf erfc cos sin sigmoid softplus round_f16
  round_bf16 (``round_f16 x`` rounds x to the nearest float16 and widens back: an ONNX Cast)
- binary: add sub mul div pow max min gt ge lt le eq
  (max/min propagate NaN like numpy's maximum/minimum; comparisons give 1.0 or 0.0)
- ternary: ``select c a b`` is ``a`` where ``c != 0`` else ``b``
- ``softplus x`` is log(1 + exp(x)) computed without overflow: x + log1p(exp(-x)) for
  x > 0, log1p(exp(x)) otherwise.
- ``erfc x`` is 1 - erf(x) and ``expm1 x`` is exp(x) - 1, each computed without the
  cancellation of the subtraction (erfc(5) = 1.5e-12, where 1 - erf(5) is 0 in fp32);
  ``sigmoid x`` is 1 / (1 + exp(-x)), computed as t / (1 + t) with t = exp(x) for x < 0, so
  that it neither overflows nor flushes a representable result to 0. Every transcendental op
  is the exact value within a few ulp over the whole fp32 range, tails included (the README
  lists the measured bounds; ``benchmarks/tails.py`` measures them).

The lowering writes the accurate op where a model spells out a cancelling form
(`rewrite_tails`): 1 + erf(y) is erfc(-y) (Gelu), 1 + tanh(z) is 2 sigmoid(2z) (tanh
Gelu), exp(x) - 1 is expm1(x) (Elu). A program whose every output is stored as fp16 or
bf16 also divides by a constant as the product by its reciprocal and writes small powers as
products (`relax_16bit`), and the GPU code generators compute its erfc and sigmoid by
cheaper forms (`onnxfuse.codegen.SIXTEEN_BIT_FORMS`, relative errors of a few 1e-6): its fp32
arithmetic stays 2^7 or more times finer than the 16-bit rounding after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HEADER = "onnxfuse.pointwise v1"

UNARY = (
    "neg", "abs", "exp", "log", "sqrt", "tanh", "erf", "cos", "sin", "sigmoid", "softplus",
    "round_f16", "round_bf16", "erfc", "expm1",
)
BINARY = ("add", "sub", "mul", "div", "pow", "max", "min", "gt", "ge", "lt", "le", "eq")
TERNARY = ("select",)
ARITY = {**{op: 1 for op in UNARY}, **{op: 2 for op in BINARY}, **{op: 3 for op in TERNARY}}

INPUT_DTYPES = ("f32", "f16", "bf16", "bool")
OUTPUT_DTYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Ref:
    """A reference to value %index (an input or an earlier instruction)."""

    index: int


Operand = Ref | float


@dataclass(frozen=True)
class Instr:
    op: str
    args: tuple[Operand, ...]


@dataclass(frozen=True)
class Program:
    """Inputs (dtypes), instructions defining values len(inputs)..., outputs (value, dtype)."""

    input_dtypes: tuple[str, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[tuple[int, str], ...]

    @property
    def n_values(self) -> int:
        return len(self.input_dtypes) + len(self.instrs)

    def to_text(self) -> str:
        lines = [HEADER]
        lines += [f"input %{i} {dt}" for i, dt in enumerate(self.input_dtypes)]
        base = len(self.input_dtypes)
        for k, ins in enumerate(self.instrs):
            args = " ".join(_fmt_operand(a) for a in ins.args)
            lines.append(f"%{base + k} = {ins.op} {args}")
        lines += [f"output %{v} {dt}" for v, dt in self.outputs]
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> Program:
        return parse(text)

    def validate(self) -> None:
        """Raise ValueError if the program breaks the rules in the module docstring."""
        for dt in self.input_dtypes:
            if dt not in INPUT_DTYPES:
                raise ValueError(f"bad input dtype {dt!r}")
        base = len(self.input_dtypes)
        for k, ins in enumerate(self.instrs):
            if ins.op not in ARITY:
                raise ValueError(f"unknown op {ins.op!r}")
            if len(ins.args) != ARITY[ins.op]:
                raise ValueError(f"{ins.op} takes {ARITY[ins.op]} operands, got {len(ins.args)}")
            for a in ins.args:
                if isinstance(a, Ref) and not 0 <= a.index < base + k:
                    raise ValueError(f"%{base + k} uses undefined %{a.index}")
        if not self.outputs:
            raise ValueError("program has no outputs")
        for v, dt in self.outputs:
            if not 0 <= v < self.n_values:
                raise ValueError(f"output %{v} is undefined")
            if dt not in OUTPUT_DTYPES:
                raise ValueError(f"bad output dtype {dt!r}")


def with_input(prog: Program, dtype: str) -> Program:
    """`prog` with one more input of `dtype` after its others, which it does not read (its
    instructions' values renumbered after it)."""
    n = len(prog.input_dtypes)

    def shifted(a: Operand) -> Operand:
        return Ref(a.index + 1) if isinstance(a, Ref) and a.index >= n else a
    return Program((*prog.input_dtypes, dtype), tuple(Instr(i.op, tuple(shifted(a) for a in i.args))
                                                      for i in prog.instrs),
                   tuple((v + 1 if v >= n else v, dt) for v, dt in prog.outputs))


def _fmt_operand(a: Operand) -> str:
    if isinstance(a, Ref):
        return f"%{a.index}"
    return repr(float(a))


def _parse_operand(tok: str) -> Operand:
    if tok.startswith("%"):
        return Ref(int(tok[1:]))
    return float(tok)


def parse(text: str) -> Program:
    """Parse the text format into a validated Program."""
    lines = text.strip("\n").split("\n")
    if not lines or lines[0] != HEADER:
        raise ValueError(f"program must start with {HEADER!r}")
    inputs: list[str] = []
    instrs: list[Instr] = []
    outputs: list[tuple[int, str]] = []
    for line in lines[1:]:
        tok = line.split(" ")
        if tok[0] == "input":
            if instrs or outputs or tok[1] != f"%{len(inputs)}":
                raise ValueError(f"misplaced input line: {line!r}")
            inputs.append(tok[2])
        elif tok[0] == "output":
            outputs.append((int(tok[1][1:]), tok[2]))
        elif len(tok) >= 3 and tok[1] == "=":
            if outputs or tok[0] != f"%{len(inputs) + len(instrs)}":
                raise ValueError(f"misplaced instruction: {line!r}")
            instrs.append(Instr(tok[2], tuple(_parse_operand(t) for t in tok[3:])))
        else:
            raise ValueError(f"cannot parse line: {line!r}")
    prog = Program(tuple(inputs), tuple(instrs), tuple(outputs))
    prog.validate()
    return prog


class Builder:
    """Appends instructions; used by the ONNX-to-program lowering in `onnxfuse.ops`."""

    def __init__(self, input_dtypes: list[str]):
        self.input_dtypes = list(input_dtypes)
        self.instrs: list[Instr] = []

    def emit(self, op: str, *args: Operand) -> Ref:
        self.instrs.append(Instr(op, tuple(args)))
        return Ref(len(self.input_dtypes) + len(self.instrs) - 1)

    def build(self, outputs: list[tuple[Ref, str]]) -> Program:
        prog = Program(tuple(self.input_dtypes), tuple(self.instrs),
                       tuple((r.index, dt) for r, dt in outputs))
        prog.validate()
        return prog


# ---------------------------------------------------------------------------------------
# numpy reference evaluator
# ---------------------------------------------------------------------------------------

NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "bool": np.bool_}


def _np_out_dtype(dt: str):
    if dt == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return NUMPY_DTYPES[dt]


def _round_bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > 0, x + np.log1p(np.exp(-np.abs(x))), np.log1p(np.exp(np.minimum(x, 0))))


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x).astype(np.float32)


def _erfc(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erfc, otypes=[np.float64])(x).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """In float64, rounded once: t / (1 + t) with t = exp(-|x|) (never overflows)."""
    x64 = np.asarray(x, np.float64)
    t = np.exp(-np.abs(x64))
    return (np.where(x64 >= 0, 1.0, t) / (1.0 + t)).astype(np.float32)


_NP_UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "tanh": np.tanh, "erf": _erf, "cos": np.cos, "sin": np.sin,
    "sigmoid": _sigmoid,
    "softplus": _softplus,
    "erfc": _erfc, "expm1": np.expm1,
    "round_f16": lambda x: x.astype(np.float16).astype(np.float32),
    "round_bf16": _round_bf16,
}
_NP_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "max": np.maximum, "min": np.minimum,
    "gt": lambda a, b: (a > b).astype(np.float32), "ge": lambda a, b: (a >= b).astype(np.float32),
    "lt": lambda a, b: (a < b).astype(np.float32), "le": lambda a, b: (a <= b).astype(np.float32),
    "eq": lambda a, b: (a == b).astype(np.float32),
}


def evaluate(prog: Program, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate the program with numpy in fp32; returns outputs at their dtypes."""
    if len(inputs) != len(prog.input_dtypes):
        raise ValueError(f"expected {len(prog.input_dtypes)} inputs, got {len(inputs)}")
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    vals: list[np.ndarray] = [np.asarray(x).astype(np.float32) for x in inputs]

    def get(a: Operand) -> np.ndarray:
        return vals[a.index] if isinstance(a, Ref) else np.float32(a)

    with np.errstate(all="ignore"):
        for ins in prog.instrs:
            args = [get(a) for a in ins.args]
            if ins.op in _NP_UNARY:
                r = _NP_UNARY[ins.op](np.asarray(args[0], np.float32))
            elif ins.op in _NP_BINARY:
                r = _NP_BINARY[ins.op](args[0], args[1])
            else:
                r = np.where(args[0] != 0, args[1], args[2])
            vals.append(np.asarray(r, dtype=np.float32))
        return [np.broadcast_to(vals[v], shape).astype(_np_out_dtype(dt)) for v, dt in prog.outputs]


# ---------------------------------------------------------------------------------------
# accurate tails
# ---------------------------------------------------------------------------------------

def rewrite_tails(prog: Program) -> Program:
    """`prog` with the forms that cancel in fp32 written as the accurate ops, then the
    instructions no output needs dropped:

        1 + erf(y) -> erfc(-y)      1 - erf(y) -> erfc(y)        erf(y) - 1 -> -erfc(y)
        1 + tanh(z) -> 2 sigmoid(2z)   1 - tanh(z) -> 2 sigmoid(-2z)   tanh(z) - 1 -> -2 sigmoid(-2z)
        exp(x) - 1 -> expm1(x)      1 - exp(x) -> -expm1(x)

    (``a - 1`` also as ``a + -1``, either operand order for add). Each pair is equal in
    exact arithmetic, so the program means the same; only its rounding shrinks where the
    left side cancels: 1 + erf(-3.9) is 0 or 6e-8 in fp32 (erf rounds to -1 or the fp32
    next to it), erfc(3.9) is 3.5e-8 to an ulp, so Gelu(-5.5) is -1.04e-7, not 0."""
    base = len(prog.input_dtypes)
    b = Builder(list(prog.input_dtypes))
    new: list[Operand] = [Ref(i) for i in range(base)]

    def defined(a: Operand) -> Instr | None:
        """The instruction of the original program that defines operand a."""
        return prog.instrs[a.index - base] if isinstance(a, Ref) and a.index >= base else None

    def mapped(a: Operand) -> Operand:
        return new[a.index] if isinstance(a, Ref) else a

    for ins in prog.instrs:
        form = _cancelling_form(ins, defined)
        if form is None:
            new.append(b.emit(ins.op, *(mapped(a) for a in ins.args)))
            continue
        f, kind, arg = form
        new.append(_ACCURATE[f, kind](b, mapped(arg)))
    outs = [(new[v], dt) for v, dt in prog.outputs]
    return _drop_dead(b.build(outs))


SIXTEEN_BIT = ("f16", "bf16")


def relax_16bit(prog: Program) -> Program:
    """`prog`, every output of which is stored as fp16 or bf16, in forms of fewer instructions
    where the program is issue-bound (a bias + erf-GELU chain in fp16: 34 SASS instructions an
    element with erf + 1 against 69 for libdevice's erfc and an IEEE division, sm_90, compiled
    on the CPU; BERT-base b8 fp16 on the H200, twentieth session: 13.4 µs against ORT's
    BiasGelu's 6.4):

        x / c -> x * RN(1/c)    (c a literal whose fp32 reciprocal is normal: within 1.5 ulp
                                 of fp32, where the exact quotient is within 0.5)
        pow(x, 3) -> x * x * x, pow(x, 4) -> (x * x) * (x * x)
        then `rewrite_tails`    (1 + erf(y) -> erfc(-y), 1 + tanh(z) -> 2 sigmoid(2z): the
                                 code generators compute erfc and sigmoid in a program that
                                 stores 16 bits by forms of their own, relative errors of a
                                 few 1e-6 (`onnxfuse.codegen.SIXTEEN_BIT_FORMS`), in fewer
                                 instructions than erf + 1 and with GELU's far negative tail
                                 to the same relative accuracy)

    Each changes the fp32 value by a few fp32 ulps (2^-22 relative; the 16-bit forms by up to
    2^-18), which the rounding to 16 bits (2^-11 for fp16) hides but for the elements within
    that distance of a rounding boundary, which move by one 16-bit ulp (0.2% of the fp16
    GELUs, `benchmarks/fit_erfc16.py`); the original graph rounds every intermediate to 16
    bits."""
    base = len(prog.input_dtypes)
    b = Builder(list(prog.input_dtypes))
    new: list[Operand] = [Ref(i) for i in range(base)]

    def mapped(a: Operand) -> Operand:
        return new[a.index] if isinstance(a, Ref) else a

    for ins in prog.instrs:
        args = [mapped(a) for a in ins.args]
        x, k = args[0], args[1] if len(args) > 1 else None
        literal = isinstance(x, Ref) and k is not None and not isinstance(k, Ref)
        if ins.op == "div" and literal and (r := _fp32_reciprocal(k)) is not None:
            new.append(b.emit("mul", x, r))
        elif ins.op == "pow" and literal and float(k) in (3.0, 4.0):
            sq = b.emit("mul", x, x)
            new.append(b.emit("mul", sq, x) if float(k) == 3.0 else b.emit("mul", sq, sq))
        else:
            new.append(b.emit(ins.op, *args))
    return rewrite_tails(b.build([(new[v], dt) for v, dt in prog.outputs]))


def _fp32_reciprocal(value: float) -> float | None:
    """RN(1/c) for the fp32 value c of `value` where it is a normal fp32 number, else None."""
    c = float(np.float32(value))
    if c == 0 or not math.isfinite(c):
        return None
    if not 2.0**-126 <= abs(1.0 / c) < float(np.finfo(np.float32).max):
        return None
    return float(np.float32(1.0 / c))


def _cancelling_form(ins: Instr, defined) -> tuple[str, str, Operand] | None:
    """(f, form, y) when ins is ``1 + f(y)`` (form "1+"), ``1 - f(y)`` ("1-") or ``f(y) - 1``
    ("-1") for f in erf, tanh, exp; else None."""
    if ins.op not in ("add", "sub") or len(ins.args) != 2:
        return None
    a, c = ins.args

    def one(v: Operand) -> bool:
        return not isinstance(v, Ref) and float(v) == 1.0

    def minus_one(v: Operand) -> bool:
        return not isinstance(v, Ref) and float(v) == -1.0

    candidates: list[tuple[Operand, str]] = []
    if ins.op == "add":
        for x, k in ((a, c), (c, a)):
            if one(k):
                candidates.append((x, "1+"))
            elif minus_one(k):
                candidates.append((x, "-1"))
    else:
        if one(a):
            candidates.append((c, "1-"))
        if one(c):
            candidates.append((a, "-1"))
    for x, form in candidates:
        d = defined(x)
        if d is not None and d.op in ("erf", "tanh", "exp") and (d.op, form) in _ACCURATE:
            return d.op, form, d.args[0]
    return None


def _negated(b: Builder, y: Operand) -> Operand:
    """-y: a literal negated, mul/div by a literal with the literal negated (exact), else neg."""
    if not isinstance(y, Ref):
        return -float(y)
    base = len(b.input_dtypes)
    if y.index >= base:
        d = b.instrs[y.index - base]
        if d.op in ("mul", "div") and isinstance(d.args[0], Ref) and not isinstance(d.args[1], Ref):
            return b.emit(d.op, d.args[0], -float(d.args[1]))
        if d.op == "mul" and not isinstance(d.args[0], Ref) and isinstance(d.args[1], Ref):
            return b.emit("mul", d.args[1], -float(d.args[0]))
    return b.emit("neg", y)


_ACCURATE = {
    ("erf", "1+"): lambda b, y: b.emit("erfc", _negated(b, y)),
    ("erf", "1-"): lambda b, y: b.emit("erfc", y),
    ("erf", "-1"): lambda b, y: b.emit("neg", b.emit("erfc", y)),
    ("tanh", "1+"): lambda b, z: b.emit("mul", b.emit("sigmoid", b.emit("mul", z, 2.0)), 2.0),
    ("tanh", "1-"): lambda b, z: b.emit("mul", b.emit("sigmoid", b.emit("mul", z, -2.0)), 2.0),
    ("tanh", "-1"): lambda b, z: b.emit("mul", b.emit("sigmoid", b.emit("mul", z, -2.0)), -2.0),
    ("exp", "-1"): lambda b, x: b.emit("expm1", x),
    ("exp", "1-"): lambda b, x: b.emit("neg", b.emit("expm1", x)),
}


def _drop_dead(prog: Program) -> Program:
    """prog without the instructions no output depends on (values renumbered)."""
    base = len(prog.input_dtypes)
    live = [False] * prog.n_values
    for v, _ in prog.outputs:
        live[v] = True
    for k in range(len(prog.instrs) - 1, -1, -1):
        if live[base + k]:
            for a in prog.instrs[k].args:
                if isinstance(a, Ref):
                    live[a.index] = True
    if all(live[base:]):
        return prog
    b = Builder(list(prog.input_dtypes))
    new: dict[int, Ref] = {i: Ref(i) for i in range(base)}
    for k, ins in enumerate(prog.instrs):
        if live[base + k]:
            new[base + k] = b.emit(ins.op, *(new[a.index] if isinstance(a, Ref) else a for a in ins.args))
    return b.build([(new[v], dt) for v, dt in prog.outputs])
