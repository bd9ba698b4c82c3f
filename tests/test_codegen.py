"""Generated Triton kernels against the numpy reference, and ahead-of-time compilation.

Numerics run the generated kernels under ``TRITON_INTERPRET=1`` in ONE child process for
all cases (this file run as a script), so the interpreter setting never reaches this
process, where other tests compile kernels ahead of time. The interpreter has no libdevice,
so the child stands in numpy functions for the libdevice calls; the real libdevice numerics
are checked by the ``gpu`` tests, which run the same cases on a CUDA device and launch the
AOT binaries through the driver API with the parameter list of docs/format.md.

    pytest tests/test_codegen.py              # CPU: interpreter + AOT for sm_90
    pytest tests/test_codegen.py -m gpu       # on a machine with an NVIDIA GPU and torch
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest

from onnxfuse.codegen import INPUT_MODES, STRIDED_MODES, KernelSpec, Variant, generate, param_names
from onnxfuse.compile import (
    COMPILE_OPTIONS,
    DEFAULT_TARGETS,
    SUPPORTED_ARCHS,
    attach,
    code_lines,
    compile_kernels,
    default_targets,
    parse_targets,
)
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import BINARY, HEADER, UNARY, evaluate, parse
from onnxfuse.kinds.pointwise import choose_variants, rotate_half, rotate_pairs

REPO = Path(__file__).resolve().parents[1]

NAME = "onnxfuse_pointwise_chain_0123456789ab"
# Per output dtype: (rtol, atol).
TOLERANCE = {"f32": (1e-5, 1e-6), "f16": (1e-2, 1e-3), "bf16": (1e-2, 1e-2)}


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    program: str  # body lines after the header; inputs are declared by `dtypes`
    shapes: tuple[tuple[int, ...], ...]  # one per input
    dtypes: tuple[str, ...]
    modes: tuple[str, ...] | None = None  # default: derived from the shapes
    block: int = 256
    values: tuple[tuple[float, ...], ...] | None = None  # fixed input values (default: random)
    row: bool = False  # launched as a row variant (`last_multiple`: the last dim a multiple of block)
    # per input a permutation it is read through (a PointwiseChain's `transpose`), None for none;
    # `shapes` are then the tensors' own shapes, before the permutation
    perms: tuple[tuple[int, ...] | None, ...] | None = None
    # a PointwiseChain's `partial` (r, k) or (r, k, j): the program over the first r columns, input k
    # (plus input j) beyond; its narrow inputs (mode "narrow") have r columns
    partial: tuple[int, ...] | None = None


def _prog(dtypes: tuple[str, ...], body: str) -> str:
    lines = [HEADER] + [f"input %{i} {dt}" for i, dt in enumerate(dtypes)]
    return "\n".join(lines + [ln.strip() for ln in body.strip().splitlines()]) + "\n"


def _op_cases() -> list[Case]:
    cases = []
    for op in UNARY:
        cases.append(Case(f"unary-{op}", f"%1 = {op} %0\noutput %1 f32", ((1031,),), ("f32",)))
    for op in BINARY:
        cases.append(Case(f"binary-{op}", f"%2 = {op} %0 %1\noutput %2 f32", ((1031,), (1031,)), ("f32", "f32")))
    for op in ("sub", "div", "pow", "max", "min", "gt", "ge", "lt", "le", "eq"):
        cases.append(Case(f"literal-left-{op}", f"%1 = {op} 2.5 %0\noutput %1 f32", ((517,),), ("f32",)))
        cases.append(Case(f"literal-right-{op}", f"%1 = {op} %0 -1.5\noutput %1 f32", ((517,),), ("f32",)))
    cases.append(Case("select", "%3 = select %0 %1 %2\noutput %3 f32", ((1031,),) * 3, ("f32",) * 3))
    cases.append(Case("select-bool", "%3 = select %0 %1 %2\noutput %3 f32", ((1031,),) * 3, ("bool", "f32", "f16")))
    return cases


def _size_cases() -> list[Case]:
    body = "%1 = mul %0 3.0\n%2 = sin %1\noutput %2 f32"
    cases = [Case(f"size-{n}", body, ((n,),), ("f32",)) for n in (1, 17, 255, 256, 257, 1031)]
    cases.append(Case("size-4099-block-1024", body, ((4099,),), ("f32",), block=1024))
    cases.append(Case("size-4096-block-1024", body, ((4096,),), ("f32",), block=1024))
    return cases


def _broadcast_cases() -> list[Case]:
    add3 = "%3 = add %0 %1\n%4 = mul %3 %2\noutput %4 f32"
    return [
        Case("scalar", "%2 = sub %0 %1\noutput %2 f32", ((7, 9), ()), ("f32", "f32")),
        Case("scalar-first", "%2 = div %0 %1\noutput %2 f32", ((), (5, 11)), ("f16", "f32")),
        Case("size1-dims", "%2 = add %0 %1\noutput %2 f32", ((4, 1, 5), (1, 3, 5)), ("f32", "f32")),
        Case("rank-mismatch", add3, ((2, 3, 4, 5), (5,), (3, 1, 1)), ("f32", "bf16", "f16")),
        Case("scalar-as-strided", add3, ((6, 7), (1, 1), (7,)), ("f32", "f32", "f32"),
             modes=("full", "strided", "strided")),
        Case("full-as-strided", "%2 = max %0 %1\noutput %2 f32", ((5, 6, 7), (6, 1)), ("f32", "f32"),
             modes=("strided", "strided")),
        Case("rank1-strided", "%2 = mul %0 %1\noutput %2 f32", ((33,), (1,)), ("f32", "f32"),
             modes=("full", "strided")),
        Case("rank0", "%2 = add %0 %1\noutput %2 f16", ((), ()), ("f32", "f32")),
        Case("rank0-strided", "%2 = add %0 %1\noutput %2 f32", ((), ()), ("f32", "f32"),
             modes=("full", "strided")),
        Case("bool-strided", "%2 = select %0 %1 -7.0\noutput %2 f32", ((3, 1), (3, 40)), ("bool", "f32")),
        Case("big-rank", add3, ((2, 1, 3, 1, 2, 3), (3, 4, 1, 3), (1,)), ("f32", "f32", "f32")),
        # the unravel's shortcuts (codegen._unravel): every strided input a vector along the
        # last dim, along the one before it, or a mix (the full unravel)
        Case("bias-last", "%2 = add %0 %1\n%3 = erf %2\noutput %3 f32", ((4, 3, 8), (8,)), ("f32", "f32")),
        Case("two-along-last", add3, ((4, 6), (6,), (1, 6)), ("f32", "f16", "f32")),
        Case("per-channel", "%2 = mul %0 %1\noutput %2 f32", ((2, 3, 5), (3, 1)), ("f32", "f32")),
        Case("along-mixed", add3, ((2, 3, 5), (5,), (3, 1)), ("f32", "f32", "f32")),
        # the shortcuts' per-program wraps (`pointwise-wraps`): BLOCK 256 against a last dim of
        # 300 / 260 (crossed at most once), 100 / 70 (up to four times), rows before it of 300 /
        # 290 (once); int32 and int64 offsets alternate with the case's index
        Case("bias-last-one-wrap", "%2 = add %0 %1\n%3 = erf %2\noutput %3 f32", ((5, 300), (300,)), ("f32", "f32")),
        Case("bias-last-one-wrap-b", add3, ((7, 260), (260,), (1, 260)), ("f32", "f16", "f32")),
        Case("bias-last-four-wraps", "%2 = add %0 %1\noutput %2 f32", ((9, 100), (100,)), ("f32", "f32")),
        Case("bias-last-four-wraps-b", "%2 = mul %0 %1\noutput %2 f16", ((11, 70), (70,)), ("f16", "f32")),
        Case("per-channel-one-wrap", "%2 = mul %0 %1\noutput %2 f32", ((2, 3, 300), (3, 1)), ("f32", "f32")),
        Case("per-channel-one-wrap-b", "%2 = sub %0 %1\noutput %2 f32", ((3, 2, 290), (2, 1)), ("f32", "f32")),
        # row variants (`row-vector-loads`): the last dim a multiple of BLOCK, every branch
        Case("row-bias-last", "%2 = add %0 %1\n%3 = erf %2\noutput %3 f16", ((6, 512), (512,)), ("f16", "f16"),
             row=True),
        Case("row-two-along-last", add3, ((5, 3, 256), (256,), (1, 256)), ("f32", "f16", "f32"), row=True),
        Case("row-per-channel", "%2 = mul %0 %1\noutput %2 f32", ((3, 4, 256), (4, 1)), ("f32", "bf16"), row=True),
        Case("row-unravel", add3, ((2, 3, 256), (3, 256), (2, 1, 256)), ("f32", "f32", "f32"), row=True),
    ]


def _dtype_cases() -> list[Case]:
    cases = []
    for din in ("f32", "f16", "bf16", "bool"):
        for dout in ("f32", "f16", "bf16"):
            cases.append(Case(f"dtype-{din}-{dout}", f"%1 = mul %0 1.75\n%2 = add %1 0.25\noutput %2 {dout}",
                              ((1031,),), (din,)))
    cases.append(Case("passthrough", "output %0 f16\noutput %1 f32\noutput %0 bf16\noutput %2 f32",
                      ((301,), (301,), (301,)), ("f32", "bf16", "bool")))
    cases.append(Case("scalar-output", "%2 = exp %1\n%3 = add %0 %2\noutput %1 f32\noutput %2 f16\noutput %3 f32",
                      ((3, 37), ()), ("f32", "bf16")))
    cases.append(Case("multi-output", """
        %3 = mul %0 %1
        %4 = tanh %3
        %5 = gt %3 %2
        %6 = select %5 %4 %0
        output %4 f32
        output %6 f16
        output %5 bf16
        output %3 f32""", ((9, 115), (115,), (9, 1)), ("f16", "bf16", "f32")))
    cases.append(Case("round-ties", "%1 = round_f16 %0\n%2 = round_bf16 %0\noutput %1 f32\noutput %2 f32\n"
                      "output %0 f16\noutput %0 bf16", ((1031,),), ("f32",)))
    return cases


def _literal_cases() -> list[Case]:
    return [
        Case("literal-inf", "%1 = min %0 inf\n%2 = max %1 -inf\n%3 = mul %2 nan\n%4 = eq %3 %3\n"
             "output %2 f32\noutput %3 f32\noutput %4 f32", ((129,),), ("f32",)),
        Case("literal-only", "%1 = add 1.0 2.0\n%2 = exp 1.0\n%3 = mul %1 %0\n%4 = neg 0.5\n"
             "output %3 f32\noutput %2 f32\noutput %4 f16", ((33,),), ("f32",)),
        Case("literal-odd", "%1 = mul %0 0.1\n%2 = add %1 1e-40\n%3 = mul %2 -0.0\n%4 = add %1 3.4028234663852886e+38\n"
             "output %2 f32\noutput %3 f32\noutput %4 f32", ((65,),), ("f32",)),
        Case("select-literal-cond", "%1 = select 1.0 %0 2.0\n%2 = select 0.0 %0 2.0\n%3 = select nan %0 2.0\n"
             "output %1 f32\noutput %2 f32\noutput %3 f32", ((40,),), ("f32",)),
        # a division by a power of two is written as a product (codegen.expr_text), exact for
        # every x: subnormal, overflowing, signed zero, inf and NaN inputs; 3.0 and the powers
        # whose reciprocal is not a normal fp32 stay divisions
        Case("div-power-of-two", "%1 = div %0 8.0\n%2 = div %0 0.25\n%3 = div %0 -2.0\n%4 = div %0 3.0\n"
             "%5 = div %0 1.7014118346046923e+38\n%6 = div %0 1.1754943508222875e-38\n"
             "output %1 f32\noutput %2 f32\noutput %3 f32\noutput %4 f32\noutput %5 f32\noutput %6 f32",
             ((12,),), ("f32",),
             values=((1e-40, -1e-45, 3.4e38, float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1.0, 7.0,
                      1.1754944e-38, -6.5e4),)),
        Case("gelu-tanh", """
            %1 = mul %0 %0
            %2 = mul %1 %0
            %3 = mul %2 0.044715
            %4 = add %0 %3
            %5 = mul %4 0.7978845608028654
            %6 = tanh %5
            %7 = add %6 1.0
            %8 = mul %0 0.5
            %9 = mul %8 %7
            output %9 f16""", ((2, 515),), ("f16",)),
    ]


def _sixteen_bit_cases() -> list[Case]:
    """Programs that store 16 bits, so erfc and sigmoid take `SIXTEEN_BIT_FORMS`: GELU and SiLU
    (as `relax_16bit` writes them) over every fp16 value in [-16, 16] and erfc itself over a
    wide range with its specials; `test_sixteen_bit_forms_round_within_an_ulp` checks them."""
    x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    x = x[np.abs(x) <= 16]
    wide = np.concatenate([np.linspace(-12, 12, 4001, dtype=np.float32),
                           np.float32([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 1e-30, 3e38])])
    gelu = "%1 = mul %0 -0.70710677\n%2 = erfc %1\n%3 = mul %0 %2\n%4 = mul %3 0.5"
    tanh_gelu = ("%1 = mul %0 %0\n%2 = mul %1 %0\n%3 = mul %2 0.044715\n%4 = add %0 %3\n%5 = mul %4 1.5957692"
                 "\n%6 = sigmoid %5\n%7 = mul %0 %6")
    return [Case(f"sixteen-{name}-{dt}", f"{body}\noutput %{body.count(chr(10)) + 1} {dt}", ((len(v),),), ("f32",),
                 values=(tuple(v.tolist()),))
            for name, body, v in (("gelu", gelu, x), ("silu", "%1 = sigmoid %0\n%2 = mul %0 %1", x),
                                  ("tanh-gelu", tanh_gelu, x), ("erfc", "%1 = erfc %0", wide),
                                  ("sigmoid", "%1 = sigmoid %0", wide))
            for dt in ("f16", "bf16")]


def _rotate_cases() -> list[Case]:
    """Rotary embeddings as LLaMA-style exports compute them, the rotate_half input read rotated."""
    rotary = "%4 = mul %0 %1\n%5 = mul %2 %3\n%6 = add %4 %5\noutput %6 {dt}"
    head_bias = "%6 = add %0 %1\n%7 = mul %6 %2\n%8 = add %3 %4\n%9 = mul %8 %5\n%10 = add %7 %9\noutput %10 {dt}"
    return [
        Case("rotate-half-f16", rotary.format(dt="f16"), ((2, 3, 5, 8), (5, 8), (2, 3, 5, 8), (5, 8)),
             ("f16", "f16", "f16", "f16"), modes=("full", "strided", "rotate_half", "strided")),
        Case("rotate-half-f32-blocks-cross-rows", rotary.format(dt="f32"), ((3, 7, 64), (7, 64), (3, 7, 64), (7, 64)),
             ("f32", "f32", "f32", "f32"), modes=("full", "strided", "rotate_half", "strided"), block=128),
        Case("rotate-half-bf16-alone", "%1 = add %0 0.0\noutput %1 bf16", ((4, 6),), ("bf16",),
             modes=("rotate_half",), block=8),
        # LLaMA's Q read through its Transpose [B, S, H, D] -> [B, H, S, D], plainly and rotated
        Case("transposed-rotary-f16", rotary.format(dt="f16"), ((2, 5, 3, 8), (5, 8), (2, 5, 3, 8), (5, 8)),
             ("f16", "f16", "f16", "f16"), modes=("strided", "strided", "rotate_half_strided", "strided"),
             perms=((0, 2, 1, 3), None, (0, 2, 1, 3), None)),
        Case("transposed-f32-blocks-cross-rows", "%3 = add %0 %1\n%4 = mul %3 %2\noutput %4 f32",
             ((7, 3, 64), (64,), (3, 7, 64)), ("f32", "f32", "f32"), modes=("strided", "strided", "full"),
             block=128, perms=((1, 0, 2), None, None)),
        Case("transposed-rotated-bf16-alone", "%1 = add %0 0.0\noutput %1 bf16", ((3, 2, 4, 6),), ("bf16",),
             modes=("rotate_half_strided",), block=16, perms=((2, 0, 1, 3),)),
        # Qwen2's Q with its projection bias below the head split (onnxfuse.headbias): (q + b) * cos +
        # (rotate_half(q) + rotate_half(b)) * sin, b and its rotation [1, H, 1, D] constants
        Case("head-bias-transposed-rotary-f16", head_bias.format(dt="f16"),
             ((2, 5, 3, 8), (1, 3, 1, 8), (5, 8), (2, 5, 3, 8), (1, 3, 1, 8), (5, 8)), ("f16",) * 6,
             modes=("strided", "strided", "strided", "rotate_half_strided", "strided", "strided"),
             perms=((0, 2, 1, 3), None, None, (0, 2, 1, 3), None, None)),
        Case("head-bias-rotate-pairs-f32-cross-rows", head_bias.format(dt="f32"),
             ((3, 2, 7, 16), (1, 2, 1, 16), (7, 16), (3, 2, 7, 16), (1, 2, 1, 16), (7, 16)), ("f32",) * 6,
             modes=("full", "strided", "strided", "rotate_pairs", "strided", "strided"), block=64),
    ]


def _partial_cases() -> list[Case]:
    """Partial rotary embeddings (Phi, GPT-NeoX, StableLM): the rotary chain over the first r
    columns of q, q's own beyond; cos and sin of r columns read there alone."""
    rotary = "%4 = mul %0 %1\n%5 = mul %2 %3\n%6 = add %4 %5\noutput %6 {dt}"
    biased = "%7 = add %0 %1\n%8 = mul %7 %2\n%9 = add %3 %4\n%10 = mul %9 %5\n%11 = add %8 %10\noutput %11 {dt}"
    return [
        Case("partial-rotary-f16", rotary.format(dt="f16"), ((2, 3, 5, 16), (5, 8), (2, 3, 5, 16), (5, 8)),
             ("f16",) * 4, modes=("full", "narrow", "rotate_half", "narrow"), partial=(8, 0)),
        Case("partial-transposed-rotary-f32-cross-rows", rotary.format(dt="f32"),
             ((2, 5, 3, 20), (5, 6), (2, 5, 3, 20), (1, 5, 6)), ("f32",) * 4,
             modes=("strided", "narrow", "rotate_half_strided", "narrow"), block=64,
             perms=((0, 2, 1, 3), None, (0, 2, 1, 3), None), partial=(6, 0)),
        Case("partial-bf16-unmasked", "%2 = mul %0 %1\n%3 = add %2 1.0\noutput %3 bf16", ((4, 8, 32), (8, 16)),
             ("bf16", "bf16"), modes=("full", "narrow"), partial=(16, 0)),
        # a projection's bias below the head split (onnxfuse.headbias): the chain adds its first r
        # columns (narrow, and rotated), the columns beyond add x6 (the bias over all D, read there)
        Case("partial-bias-rotary-f16", biased.format(dt="f16"),
             ((2, 3, 5, 16), (3, 1, 8), (5, 8), (2, 3, 5, 16), (3, 1, 8), (5, 8), (1, 3, 1, 16)), ("f16",) * 7,
             modes=("full", "narrow", "narrow", "rotate_half", "narrow", "narrow", "strided"), partial=(8, 0, 6)),
        Case("partial-bias-transposed-rotary-f32", biased.format(dt="f32"),
             ((2, 5, 3, 20), (3, 1, 6), (5, 6), (2, 5, 3, 20), (3, 1, 6), (1, 5, 6), (3, 1, 20)), ("f32",) * 7,
             modes=("strided", "narrow", "narrow", "rotate_half_strided", "narrow", "narrow", "strided"), block=64,
             perms=((0, 2, 1, 3), None, None, (0, 2, 1, 3), None, None, None), partial=(6, 0, 6)),
        # GPT-J's and Cohere's interleaved rotation (rotate_pairs), whole and partial, through a Transpose
        Case("rotate-pairs-f16", rotary.format(dt="f16"), ((2, 3, 5, 8), (5, 8), (2, 3, 5, 8), (5, 8)),
             ("f16",) * 4, modes=("full", "strided", "rotate_pairs", "strided")),
        Case("partial-transposed-rotate-pairs-f32", rotary.format(dt="f32"),
             ((2, 5, 3, 12), (5, 4), (2, 5, 3, 12), (5, 4)), ("f32",) * 4,
             modes=("strided", "narrow", "rotate_pairs_strided", "narrow"), block=32,
             perms=((0, 2, 1, 3), None, (0, 2, 1, 3), None), partial=(4, 0)),
    ]


def _tail_cases() -> list[Case]:
    """tests/test_tails.py's models as onnxfuse lowers them (the programs of their fused
    nodes), at their tail inputs: `test_interpreted_tails` checks them against the exact values."""
    from tests.test_tails import TAILS

    cases = []
    for t in TAILS:
        _, prog = t.fused()
        body = prog.to_text().splitlines()[1 + len(prog.input_dtypes):]
        cases.append(Case(f"tail-{t.id}", "\n".join(body), ((len(t.values),), ()), prog.input_dtypes,
                          values=(t.values, (1.0,))))
    return cases


CASES = (_op_cases() + _size_cases() + _broadcast_cases() + _dtype_cases() + _literal_cases() + _tail_cases()
         + _sixteen_bit_cases() + _rotate_cases() + _partial_cases())


def _perm(case: Case, k: int) -> tuple[int, ...] | None:
    return case.perms[k] if case.perms else None


def _logical_shapes(case: Case) -> list[tuple[int, ...]]:
    """Each input's shape as the kernel reads it: through its permutation."""
    return [tuple(s[a] for a in p) if (p := _perm(case, k)) else s for k, s in enumerate(case.shapes)]


def _out_shape(case: Case) -> tuple[int, ...]:
    """The inputs' broadcast shape; partial: the narrow inputs' columns broadcast to the others'."""
    shapes = _logical_shapes(case)
    if case.partial:
        shapes = [s[:-1] + (1,) if m == "narrow" else s for s, m in zip(shapes, case.modes, strict=True)]
    return tuple(np.broadcast_shapes(*shapes))


def _modes(case: Case) -> tuple[str, ...]:
    if case.modes is not None:
        return case.modes
    out = _out_shape(case)
    return tuple("full" if s == out else "scalar" if math.prod(s) == 1 else "strided" for s in _logical_shapes(case))


def _rotates(case: Case) -> bool:
    return any(m.startswith("rotate_") for m in _modes(case))


SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -2.0, 3.0, 1e-3, 20.0, -20.0,
                     50.0, -50.0, 88.0, -100.0, 1e-30, 65504.0, 70000.0, 1 + 2**-11, 1 + 3 * 2**-11,
                     1 + 2**-8, 1 + 3 * 2**-8, 2049.0, 2051.0], dtype=np.float32)


def _random_input(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    n = math.prod(shape)
    if dtype == "bool":
        return rng.random(n).reshape(shape) < 0.5
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    pick = rng.random(n)
    x = np.where(pick < 0.15, rng.choice(SPECIALS, n), x)
    x = np.where((pick >= 0.15) & (pick < 0.25), rng.integers(-3, 4, n).astype(np.float32), x)
    x = x.reshape(shape).astype(np.float32)
    if dtype == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    if dtype == "bf16":
        return x.astype(ml_dtypes.bfloat16)
    return x


def _case_inputs(index: int, case: Case) -> list[np.ndarray]:
    if case.values is not None:
        return [np.array(v, np.float32).reshape(s) for v, s in zip(case.values, case.shapes, strict=True)]
    rng = np.random.default_rng(1000 + index)
    return [_random_input(rng, s, dt) for s, dt in zip(case.shapes, case.dtypes, strict=True)]


def _launch_ints(case: Case) -> list[int]:
    """n_elements, then (if some input is strided) the output dims and strided inputs' strides."""
    out = _out_shape(case)
    ints = [math.prod(out)]
    modes = _modes(case)
    if set(modes) & set(STRIDED_MODES):
        ints += list(out)
        for st in _input_strides(case):
            ints += st
    return ints


def _input_strides(case: Case) -> list[list[int]]:
    """Each strided input's strides over the output, as the launcher computes them: 0 on
    broadcast dims; read through a permutation, the permuted strides of the tensor's own."""
    out, strides = _out_shape(case), []
    for k, (shape, mode) in enumerate(zip(_logical_shapes(case), _modes(case), strict=True)):
        if mode in STRIDED_MODES:  # (a narrow input over the first r columns)
            st = _broadcast_strides(shape, out[:-1] + (case.partial[0],) if mode == "narrow" else out)
            if p := _perm(case, k):
                own = _broadcast_strides(case.shapes[k], case.shapes[k])
                st = [own[p[d]] if v else 0 for d, v in enumerate(st)]
            strides.append(st)
    return strides


def _broadcast_strides(shape: tuple[int, ...], out: tuple[int, ...]) -> list[int]:
    padded = (1,) * (len(out) - len(shape)) + tuple(shape)
    strides, step = [], 1
    for d in reversed(padded):
        strides.append(step if d != 1 else 0)
        step *= d
    return strides[::-1]


def _write_workdir(workdir: Path, cases: list[Case]) -> list[dict]:
    """Generate every case's kernel module and inputs; returns the manifest."""
    manifest = []
    for i, case in enumerate(cases):
        prog = parse(_prog(case.dtypes, case.program))
        # Every variant kind the compiler emits: no mask when n is a multiple of the block,
        # int32 offsets on odd cases, int64 on even ones.
        n = int(np.prod(_out_shape(case), dtype=np.int64))
        if case.row:
            assert _out_shape(case)[-1] % case.block == 0, case.id
            variant = Variant(1, block=case.block, index_bits=32, last_multiple=case.block)
        elif n and n % case.block == 0 and case.block % 16 == 0:
            variant = Variant(1, block=case.block, n_multiple=case.block, index_bits=32)
        else:
            variant = Variant(1, block=case.block, index_bits=32 if i % 2 else 64)
        ks = generate(prog, NAME, len(_out_shape(case)), _modes(case), [f"case {case.id}"], variant,
                      _out_shape(case)[-1] if _rotates(case) or case.partial else 0, case.partial or ())
        (workdir / f"case{i}.py").write_text(ks.source)
        arrays = {f"in{j}": _to_storage(a) for j, a in enumerate(_case_inputs(i, case))}
        np.savez(workdir / f"case{i}_in.npz", **arrays)
        manifest.append({
            "id": case.id, "name": NAME, "block": case.block, "ints": _launch_ints(case),
            "input_dtypes": list(case.dtypes), "output_dtypes": [dt for _, dt in prog.outputs],
        })
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _to_storage(a: np.ndarray) -> np.ndarray:
    """Arrays as the kernel reads them: bf16 as its bits, bool as int8 bytes."""
    if a.dtype == ml_dtypes.bfloat16:
        return a.view(np.int16)
    if a.dtype == np.bool_:
        return a.astype(np.int8)
    return a


def _from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.view(ml_dtypes.bfloat16) if dtype == "bf16" else a


# ---------------------------------------------------------------------------------------
# running kernels (child process under TRITON_INTERPRET=1, or in-process on a GPU)
# ---------------------------------------------------------------------------------------


def _install_libdevice_shims() -> None:
    """The interpreter has no libdevice: stand numpy in for the functions codegen uses."""
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import TensorHandle

    def shim(np_fn):
        def fn(*args, **_):
            tensors = [a for a in args if isinstance(a, tl.tensor)]
            arrays = [a.handle.data if isinstance(a, tl.tensor) else np.float32(a) for a in args]
            with np.errstate(all="ignore"):
                data = np.asarray(np_fn(*arrays), dtype=np.float32)
            ty = max(tensors, key=lambda t: len(t.shape)).type
            return tl.tensor(TensorHandle(data, tl.float32), ty)
        return fn

    erf = np.vectorize(math.erf, otypes=[np.float64])
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    table = {"exp": np.exp, "log": np.log, "tanh": np.tanh, "cos": np.cos, "sin": np.sin, "pow": np.power,
             "log1p": np.log1p, "sqrt": np.sqrt, "erf": lambda x: erf(x).astype(np.float32),
             "erfc": lambda x: erfc(x).astype(np.float32), "expm1": np.expm1, "fast_dividef": np.divide}
    for name, np_fn in table.items():
        setattr(libdevice, name, shim(np_fn))


def _install_bf16_rounding_fix() -> None:
    """The interpreter truncates fp32 -> bf16; the GPU (cvt.rn.bf16.f32) rounds to nearest
    even. Give the interpreter the GPU's rounding so the reference comparison is exact."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle

    builder = interpreter.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def rne(src, dst_type):
        bits = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        return TensorHandle(bits.view(interpreter._get_np_dtype(dst_type)), dst_type.scalar)

    def new_cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return rne(src, dst_type)
        return cast_impl(self, src, dst_type)

    def new_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16 and rounding_mode is not None \
                and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE:
            return rne(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl, builder.create_fp_to_fp = new_cast_impl, new_fp_to_fp


def _install_gpu_max_semantics() -> None:
    """Float max/min without NaN propagation (tl.maximum / tl.minimum at their default, and
    the combine of tl.max / tl.min) compile to PTX max.f32 / min.f32, which return the
    operand that is not NaN; the interpreter computes them with numpy's maximum / minimum,
    which propagate it. Give the interpreter the GPU's rule (np.fmax / np.fmin), so that a
    kernel that would drop a NaN on the GPU drops it here too. (tl.max / tl.min reductions
    already run as np.nanmax / np.nanmin; max/min with propagate_nan=ALL stay numpy's.)"""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    builder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    builder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)


def _run_cases(workdir: Path, device: str) -> None:
    """Launch every case's kernel on `device`; writes case{i}_out.npz or case{i}_error.txt."""
    import importlib.util

    import torch

    torch_dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    manifest = json.loads((workdir / "manifest.json").read_text())
    for i, c in enumerate(manifest):
        try:
            spec = importlib.util.spec_from_file_location(f"case{i}", workdir / f"case{i}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            data = np.load(workdir / f"case{i}_in.npz")
            ins = []
            for j, dt in enumerate(c["input_dtypes"]):
                t = torch.from_numpy(np.ascontiguousarray(data[f"in{j}"])).to(device)
                ins.append(t.view(torch.bfloat16) if dt == "bf16" else t)
            n = c["ints"][0]
            outs = [torch.empty(n, dtype=torch_dtypes[dt], device=device) for dt in c["output_dtypes"]]
            grid = ((n + c["block"] - 1) // c["block"],)
            # on the GPU, the options onnxfuse compiles with (subnormals kept, as in its binaries)
            options = COMPILE_OPTIONS if device == "cuda" else {}
            getattr(mod, c["name"])[grid](*ins, *outs, *c["ints"], BLOCK=c["block"], **options)
            arrays = {f"out{j}": (o.view(torch.int16) if o.dtype == torch.bfloat16 else o).cpu().numpy()
                      for j, o in enumerate(outs)}
            np.savez(workdir / f"case{i}_out.npz", **arrays)
        except Exception as e:  # reported by the case's test in the parent
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")


def _check_case(workdir: Path, index: int, case: Case, label: str) -> None:
    err = workdir / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(f"{label}: kernel failed: {err.read_text()}")
    prog = parse(_prog(case.dtypes, case.program))
    inputs = [np.transpose(x, p) if (p := _perm(case, k)) else x for k, x in enumerate(_case_inputs(index, case))]
    wide = [inputs[k] for k in case.partial[1:]] if case.partial else []
    if case.partial:  # the inputs as wide as the output cut to the first r columns
        inputs = [x if m == "narrow" else x[..., :case.partial[0]] for x, m in zip(inputs, case.modes, strict=True)]
    inputs = [rotate_half(x) if m.startswith("rotate_half") else rotate_pairs(x) if m.startswith("rotate_pairs") else x
              for x, m in zip(inputs, _modes(case), strict=True)]
    expected = evaluate(prog, inputs)
    if case.partial:  # input k beyond r, plus input j (in float32, rounded once to the output's type)
        beyond = sum(x[..., case.partial[0]:].astype(np.float32) for x in wide)
        expected = [np.concatenate([y, np.broadcast_to(beyond, y.shape[:-1] + beyond.shape[-1:]).astype(y.dtype)],
                                   axis=-1) for y in expected]
    got = np.load(workdir / f"case{index}_out.npz")
    for j, ((_, dt), want) in enumerate(zip(prog.outputs, expected, strict=True)):
        out = _from_storage(got[f"out{j}"], dt).reshape(want.shape).astype(np.float32)
        rtol, atol = TOLERANCE[dt]
        np.testing.assert_allclose(out, want.astype(np.float32), rtol=rtol, atol=atol, equal_nan=True,
                                   err_msg=f"{label} case {case.id}, output {j} ({dt})")


@pytest.fixture(scope="module")
def interpreted():
    """Run all cases in one child process with TRITON_INTERPRET=1; yields its work dir."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-interp-") as tmp:
        workdir = Path(tmp)
        _write_workdir(workdir, CASES)
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, __file__, "--interpret", str(workdir)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield workdir


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_interpreted_kernel_matches_reference(interpreted, index):
    _check_case(interpreted, index, CASES[index], "interpreter")


@pytest.mark.parametrize("tail", [c.id for c in CASES if c.id.startswith("tail-")])
def test_interpreted_tails(interpreted, tail):
    """The generated kernels of tests/test_tails.py's models in their tails: within the
    measured bound of the exact value (numpy in place of libdevice: the formulas, not
    libdevice's accuracy), no flush to zero (Gelu(-5.5) is -1.04e-7, sigmoid(-100) 3.7e-44)."""
    from tests.test_tails import TAILS, assert_near_exact

    index = next(i for i, c in enumerate(CASES) if c.id == tail)
    err = interpreted / f"case{index}_error.txt"
    assert not err.exists(), err.read_text() if err.exists() else ""
    got = np.load(interpreted / f"case{index}_out.npz")["out0"]
    assert_near_exact(got, next(t for t in TAILS if f"tail-{t.id}" == tail), "Triton kernel (interpreter)")


def _check_sixteen(workdir: Path, index: int, case: Case) -> None:
    """A `_sixteen_bit_cases` output within one 16-bit ulp of the exact program's (numpy's
    fp32 evaluation, erfc and sigmoid exact), NaN where it is NaN, and at most 1% of them
    differing (the forms' few-1e-6 relative errors move only values that close to a rounding
    boundary)."""
    from benchmarks.fit_erfc16 import ulps_apart

    prog = parse(_prog(case.dtypes, case.program))
    assert any(ins.op in ("erfc", "sigmoid") for ins in prog.instrs)
    dt = prog.outputs[0][1]
    storage = np.float16 if dt == "f16" else ml_dtypes.bfloat16
    want = evaluate(prog, _case_inputs(index, case))[0].astype(np.float32).astype(storage)
    got = _from_storage(np.load(workdir / f"case{index}_out.npz")["out0"], dt).astype(storage)
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(nan, np.isnan(got.astype(np.float32))), case.id
    d = ulps_apart(got[~nan], want[~nan])
    assert d.max() <= 1 and np.mean(d > 0) < 0.01, (case.id, int(d.max()), float(np.mean(d > 0)))


@pytest.mark.parametrize("case_id", [c.id for c in CASES if c.id.startswith("sixteen-")])
def test_sixteen_bit_forms_round_within_an_ulp(interpreted, case_id):
    """erfc_16bit and sigmoid_16bit in kernels that store 16 bits (`_check_sixteen`), under
    the interpreter (numpy's reciprocal and exp2); `test_gpu_kernels_match_reference` runs the
    same check with the GPU's fast ones."""
    index = next(i for i, c in enumerate(CASES) if c.id == case_id)
    err = interpreted / f"case{index}_error.txt"
    assert not err.exists(), err.read_text() if err.exists() else ""
    _check_sixteen(interpreted, index, CASES[index])


def test_erfc16_polynomial_is_the_fit_and_within_its_bounds():
    """`ERFC16_Q` is what benchmarks/fit_erfc16.py fits (to fp32), and the form it computes, in
    fp32 arithmetic, is within the relative error its docstring states (4e-6 for |x| <= 4, 1e-5
    to fp32's underflow), every fp16 and bf16 GELU within one ulp of the exactly rounded one."""
    from benchmarks.fit_erfc16 import fit, measure
    from onnxfuse.codegen import ERFC16_Q

    c, _ = fit()
    assert tuple(float(v) for v in np.float32(c)) == ERFC16_Q
    m = measure()
    assert m["max_rel_err_abs_x_le_4"] < 4e-6 and m["max_rel_err_to_underflow"] < 1e-5, m
    assert m["gelu_f16_max_ulps"] <= 1 and m["gelu_bf16_max_ulps"] <= 1, m
    assert m["gelu_f16_share_differing"] < 0.005 and m["gelu_bf16_share_differing"] < 0.005, m


def test_cases_cover_every_op_dtype_and_mode():
    text = " ".join(_prog(c.dtypes, c.program) for c in CASES)
    for op in (*UNARY, *BINARY, "select"):
        assert f"= {op} " in text, op
    assert {dt for c in CASES for dt in c.dtypes} == {"f32", "f16", "bf16", "bool"}
    assert {m for c in CASES for m in _modes(c)} == set(INPUT_MODES)


# ---------------------------------------------------------------------------------------
# source
# ---------------------------------------------------------------------------------------

GOLDEN_PROGRAM = _prog(("f32", "bool", "f16"), """
    %3 = mul %0 2.0
    %4 = sigmoid %3
    %5 = select %1 %4 %2
    %6 = max %5 0.0
    %7 = min %6 %0
    output %7 f16
    output %3 f32""")


def _golden(variant_index: int = 0):
    return generate(parse(GOLDEN_PROGRAM), NAME, 2, ("full", "strided", "scalar"),
                    ["Mul /block/mul", "Sigmoid /block/sigmoid", "Where /block/where", "Relu /block/relu"],
                    Variant(variant_index, ptr_align=16 if variant_index == 0 else 0,
                            n_multiple=16 if variant_index == 0 else 0))


def _unravel_path(case: Case) -> str:
    """Which of the generated unravel's branches a case's launch takes (codegen._unravel):
    a shortcut with the block's wraps (1 or 4) or a remainder an element ("mod"), or the unravel."""
    out = _out_shape(case)
    strides = _input_strides(case)
    if len(out) < 2 or not strides:
        return "none"
    last = out[-1]
    for path, d in (("last", len(out) - 1), ("before", len(out) - 2)):
        if all(st == [1 if k == d else 0 for k in range(len(out))] for st in strides):
            if case.block <= last:
                return f"{path}-1"
            return f"{path}-4" if path == "last" and case.block <= 4 * last else f"{path}-mod"
    return "unravel"


def test_cases_take_every_unravel_path():
    paths = {c.id: _unravel_path(c) for c in CASES}
    assert paths["transposed-rotary-f16"] == paths["transposed-f32-blocks-cross-rows"] == "unravel"
    assert paths["bias-last"] == paths["two-along-last"] == "last-mod"
    assert paths["bias-last-one-wrap"] == paths["bias-last-one-wrap-b"] == "last-1"
    assert paths["bias-last-four-wraps"] == paths["bias-last-four-wraps-b"] == "last-4"
    assert paths["per-channel"] == "before-mod"
    assert paths["per-channel-one-wrap"] == paths["per-channel-one-wrap-b"] == "before-1"
    assert paths["full-as-strided"] == paths["along-mixed"] == paths["big-rank"] == "unravel"
    assert (paths["row-bias-last"], paths["row-per-channel"], paths["row-unravel"]) == ("last-1", "before-1", "unravel")
    program = parse(_prog(("f32", "f32", "f32"), "%3 = add %0 %1\n%4 = mul %3 %2\noutput %4 f32"))
    src = generate(program, NAME, 2, ("full", "strided", "strided"), [], Variant(0)).source
    assert "if (stride_x1_0 == 0) & (stride_x1_1 == 1) & (stride_x2_0 == 0) & (stride_x2_1 == 1):" in src
    assert "row = (offsets // size1) % size0" in src and "x2_offsets = row" in src
    assert "col = (pid.to(tl.int64) * BLOCK) % size1 + tl.arange(0, BLOCK)" in src  # Variant(0): int64 offsets


def test_source_is_deterministic_and_documented():
    a, b = _golden(), _golden()
    assert a.source == b.source
    assert a.source == _golden(1).source  # the variant changes hints, not the text
    assert a.source.startswith(f"# {NAME}: generated by onnxfuse.codegen")
    assert "#   Mul /block/mul\n" in a.source and "#   Relu /block/relu\n" in a.source
    assert "#   %4 = sigmoid %3\n" in a.source
    assert f"def {NAME}(\n" in a.source
    assert "offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)" in a.source
    assert "x1_offsets = idx0 * stride_x1_0 + idx1 * stride_x1_1" in a.source
    assert "x2 = tl.load(x2_ptr).to(tl.float32)" in a.source
    assert "propagate_nan=tl.PropagateNan.ALL" in a.source
    assert "tmp7 = tl.minimum(tmp6, x0, propagate_nan=tl.PropagateNan.ALL)" in a.source
    assert 'tmp7.to(tl.float16, fp_downcast_rounding="rtne")' in a.source
    compile(a.source, "golden.py", "exec")


def test_signature_follows_the_launch_abi():
    k = _golden()
    assert [n for n, _ in k.params] == ["x0_ptr", "x1_ptr", "x2_ptr", "out0_ptr", "out1_ptr", "n_elements",
                                        "size0", "size1", "stride_x1_0", "stride_x1_1"]
    assert dict(k.params)["x1_ptr"] == "*i8" and dict(k.params)["out0_ptr"] == "*fp16"
    assert all(t == "i64" for n, t in k.params if not n.endswith("_ptr"))
    assert k.signature["BLOCK"] == "constexpr"
    assert sorted(i for (i,) in k.attrs) == [0, 1, 2, 3, 4, 5]  # pointers and n_elements
    assert _golden(1).attrs == {}


def test_launch_configuration_heuristic():
    def spec(text):
        return KernelSpec(parse(text), NAME, 1, ("full",))

    v1, v2 = choose_variants(spec(_prog(("f32",), "%1 = neg %0\noutput %1 f16")))
    limit = 2**31 - 1 - 1024
    assert (v1.block, v1.num_warps, v1.requires(), v1.even) == (
        1024, 4, {"n_multiple": 16, "ptr_align": 16, "max_elements": limit}, False)
    assert (v2.block, v2.num_warps, v2.requires(), v2.index_bits) == (1024, 4, {}, 64)
    v0, *_ = choose_variants(spec(_prog(("f16",), "%1 = neg %0\noutput %1 bf16")))
    assert (v0.block, v0.num_warps) == (2048, 4)
    long = "\n".join(f"%{i + 1} = mul %{i} 2.0" for i in range(40)) + "\noutput %40 f32"
    v0, *_ = choose_variants(spec(_prog(("f32",), long)))
    assert (v0.block, v0.num_warps) == (1024, 4)  # long programs too: 8 warps measured slower


def test_long_program_hook(monkeypatch):
    from onnxfuse.kinds import pointwise

    def spec(n):
        body = "\n".join(f"%{i + 1} = mul %{i} 2.0" for i in range(n)) + f"\noutput %{n} f32"
        return KernelSpec(parse(_prog(("f32",), body)), NAME, 1, ("full",))

    # measured (tune_long.json, intensity_sweep.json)
    assert pointwise.LONG_PROGRAM == pointwise.LongProgram(min_instrs=48, block=1024, warps=2, max_instrs=192)
    assert {(v.block, v.num_warps) for v in choose_variants(spec(64))} == {(1024, 2)}
    assert {(v.block, v.num_warps) for v in choose_variants(spec(191))} == {(1024, 2)}
    assert {(v.block, v.num_warps) for v in choose_variants(spec(47))} == {(1024, 4)}
    assert {(v.block, v.num_warps) for v in choose_variants(spec(192))} == {(1024, 4)}
    monkeypatch.setattr(pointwise, "LONG_PROGRAM", None)  # off: the default launch
    assert {(v.block, v.num_warps) for v in choose_variants(spec(64))} == {(1024, 4)}
    monkeypatch.setattr(pointwise, "LONG_PROGRAM", pointwise.LongProgram(min_instrs=48, block=2048, warps=8))
    long_variants = choose_variants(spec(48))
    assert {(v.block, v.num_warps) for v in long_variants} == {(2048, 8)}
    assert [v.index_bits for v in long_variants] == [32, 64]  # only block and warps change
    assert {(v.block, v.num_warps) for v in choose_variants(spec(47))} == {(1024, 4)}
    monkeypatch.setenv("ONNXFUSE_POINTWISE_CONFIG", "warps=2")  # the environment still wins
    assert {(v.block, v.num_warps) for v in choose_variants(spec(64))} == {(2048, 2)}


def test_launch_configuration_override(monkeypatch):
    spec = KernelSpec(parse(_prog(("f32",), "%1 = neg %0\noutput %1 f32")), NAME, 1, ("full",))
    monkeypatch.setenv("ONNXFUSE_POINTWISE_CONFIG", "block=2048,warps=8,even=1")
    v0, v1, v2 = choose_variants(spec)
    assert (v0.block, v0.num_warps, v0.even, v0.index_bits) == (2048, 8, True, 32)
    assert (v1.even, v2.index_bits) == (False, 64)
    monkeypatch.setenv("ONNXFUSE_POINTWISE_CONFIG", "blok=1")
    with pytest.raises(OnnxfuseError, match="unknown key 'blok'"):
        choose_variants(spec)


def test_generate_rejects_bad_arguments():
    prog = parse(GOLDEN_PROGRAM)
    for bad in ("not-a-name", "tl", "class"):
        with pytest.raises(ValueError, match="identifier"):
            generate(prog, bad, 2, ("full",) * 3, [], Variant(1))
    with pytest.raises(ValueError, match="input modes"):
        generate(prog, NAME, 2, ("full",), [], Variant(1))
    with pytest.raises(ValueError, match="input mode"):
        generate(prog, NAME, 2, ("full", "full", "diagonal"), [], Variant(1))
    with pytest.raises(ValueError, match="power of two"):
        generate(prog, NAME, 2, ("full",) * 3, [], Variant(1, block=1000))


def test_comment_lines_stay_comments():
    k = generate(parse(GOLDEN_PROGRAM), NAME, 2, ("full",) * 3, ["Mul a\nimport os", "Relu \u00e9"], Variant(1))
    assert "#   Mul a import os\n" in k.source and "#   Relu \\xe9\n" in k.source


def test_division_by_a_power_of_two_is_a_product():
    prog = parse(_prog(("f32",), "%1 = div %0 8.0\n%2 = div %1 3.0\n%3 = div %2 -0.5\n%4 = div 2.0 %3\n"
                                 "%5 = div %4 1.1754943508222875e-38\noutput %5 f32"))
    src = generate(prog, NAME, 1, ("full",), [], Variant(1)).source
    assert "tmp1 = x0 * 0.125" in src and "tmp3 = tmp2 * -2.0" in src
    # not a power of two; a literal dividend; a reciprocal (2^126) that is normal but whose
    # divisor (2^-126) is the smallest normal: still exact, so a product
    assert "tmp2 = tl.div_rn(tmp1, 3.0)" in src and "tmp4 = tl.div_rn(2.0, tmp3)" in src
    assert "tmp5 = tmp4 * 8.507059e+37" in src


# ---------------------------------------------------------------------------------------
# ahead-of-time compilation
# ---------------------------------------------------------------------------------------


def _entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(rf"\.entry\s+{name}\s*\(([^)]*)\)", ptx)
    assert m, f"no .entry {name} in the PTX"
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip().startswith(".param")]


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    """Golden program compiled for sm_90 (two worker processes), then again from the cache."""
    cache = tmp_path_factory.mktemp("kernels")
    spec = KernelSpec(parse(GOLDEN_PROGRAM), NAME, 2, ("full", "strided", "scalar"), ("Mul /block/mul",))
    [first] = compile_kernels([spec], [90], cache_dir=cache, jobs=2)
    [second] = compile_kernels([spec], [90], cache_dir=cache)
    return first, second, cache


def test_aot_binaries_for_sm90(aot):
    ck, *_ = aot
    meta = ck.kernel_meta()
    assert meta["version"] == 1 and meta["name"] == NAME and meta["rank"] == 2
    assert meta["input_modes"] == ["full", "strided", "scalar"]
    limit = 2**31 - 1 - 1024
    assert meta["variants"] == [
        {"requires": {"n_multiple": 16, "ptr_align": 16, "max_elements": limit}, "block": 1024},
        {"requires": {}, "block": 1024}]
    assert [(b["variant"], b["arch"], b["format"]) for b in meta["binaries"]] == [
        (v, 90, fmt) for v in range(2) for fmt in ("cubin", "ptx")]
    blobs = ck.kernels()
    assert len(blobs) == len(meta["binaries"])
    for b, blob in zip(meta["binaries"], blobs, strict=True):
        assert b["entry"] == NAME and b["num_warps"] == 4
        for field in ("shared", "global_scratch_size", "profile_scratch_size"):
            assert isinstance(b[field], int) and b[field] >= 0
        if b["format"] == "cubin":
            assert blob[:4] == b"\x7fELF"
            assert len(blob) < 64 * 1024  # no line info / embedded PTX
        else:
            ptx = blob.decode()
            assert f".entry {NAME}(" in ptx and ".target sm_90\n" in ptx
            assert "max.NaN.f32" in ptx and "min.NaN.f32" in ptx  # max/min propagate NaN


def test_aot_parameter_count_is_the_launch_abi(aot):
    """docs/format.md: inputs, outputs, n_elements, [rank dims, rank strides per strided
    input], then the two scratch pointers; pointers are 64-bit, integers 32-bit in the
    variants with int32 offsets and 64-bit in the int64 one."""
    ck, *_ = aot
    n_in, n_out, rank, n_strided = 3, 2, 2, 1
    expected = n_in + n_out + 1 + (rank + rank * n_strided) + 2
    bits = set()
    for b in ck.binaries:
        if b.format == "ptx":
            params = _entry_params(b.data.decode(), NAME)
            assert len(params) == expected
            width = ck.variants[b.variant].index_bits
            bits.add(width)
            ints = params[n_in + n_out:-2]
            assert all(p.startswith(".param .u64 .ptr") for p in params[:n_in + n_out]), params
            assert all(p.startswith(f".param .u{width} ") for p in ints), params
            assert all(p.startswith(".param .u64 .ptr") for p in params[-2:]), params
    assert bits == {32, 64}
    assert len(param_names(n_in, n_out, rank, ("full", "strided", "scalar"))) + 2 == expected


def test_aot_second_compile_is_a_cache_hit(aot):
    first, second, _ = aot
    assert (first.compiled, first.cache_hits) == (2, 0) and first.compile_seconds > 0
    assert (second.compiled, second.cache_hits) == (0, 2) and second.compile_seconds == 0
    assert second.kernels() == first.kernels()
    assert second.kernel_meta_json() == first.kernel_meta_json()


def test_aot_cache_lives_under_kernels_of_the_cache_root(aot, tmp_path, monkeypatch):
    """$ONNXFUSE_CACHE is the root of every cache (tune/, lib/, ...): the kernels go under its
    kernels/, where the GPU session's cache-save packs them from and cache-load unpacks them to,
    and a compile there after one into that layout is a hit."""
    _, _, cache = aot
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    (tmp_path / "kernels").symlink_to(cache)
    spec = KernelSpec(parse(GOLDEN_PROGRAM), NAME, 2, ("full", "strided", "scalar"), ("Mul /block/mul",))
    [ck] = compile_kernels([spec], [90])
    assert (ck.compiled, ck.cache_hits) == (0, 2)
    assert not any(p.name != "kernels" for p in tmp_path.iterdir())


def test_ptx_assembles_for_newer_archs(aot, tmp_path):
    """The embedded PTX (relaxed to sm_90) is what a newer driver JITs: ptxas must take it."""
    from triton import knobs

    ck, *_ = aot
    ptx = next(b.data for b in ck.binaries if b.format == "ptx")
    path = tmp_path / "k.ptx"
    path.write_bytes(ptx)
    for tool, arch in ((knobs.nvidia.ptxas, "sm_90"), (knobs.nvidia.ptxas_blackwell, "sm_100"),
                       (knobs.nvidia.ptxas_blackwell, "sm_120")):
        proc = subprocess.run([tool.path, f"--gpu-name={arch}", str(path), "-o", str(tmp_path / "k.o")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{arch}: {proc.stderr}"


def test_attach_sets_one_attribute_per_binary(aot):
    ck, *_ = aot
    node = onnx.helper.make_node("PointwiseChain", ["a", "b", "c"], ["y", "z"], domain="onnxfuse",
                                 program=GOLDEN_PROGRAM, kernels=[b"old format"], kernel_meta="{}", kernel_9=b"x")
    node.overload = NAME
    attach(node, ck)
    attach(node, ck)
    attrs = {a.name: a for a in node.attribute}
    n = len(ck.binaries)
    assert sorted(attrs) == sorted(["program", "kernel_meta"] + [f"kernel_{i}" for i in range(n)])
    assert len(node.attribute) == n + 2
    assert all(a.type == onnx.AttributeProto.STRING for a in attrs.values())
    assert json.loads(attrs["kernel_meta"].s) == ck.kernel_meta()
    assert [attrs[f"kernel_{i}"].s for i in range(n)] == ck.kernels()
    other = onnx.helper.make_node("PointwiseChain", ["a"], ["y"], domain="onnxfuse", program="x")
    with pytest.raises(ValueError, match="program"):
        attach(other, ck)


def test_parse_targets():
    assert parse_targets("sm_90,sm_80") == [90, 80]
    assert parse_targets(" sm_90 , sm90a, sm_90") == [90]
    for bad in ("", "sm_", "compute_90", "90", "sm_90,,sm_80"):
        with pytest.raises(OnnxfuseError, match="bad GPU target"):
            parse_targets(bad)
    with pytest.raises(OnnxfuseError, match="not supported"):
        parse_targets("sm_110")


def test_default_targets_are_supported():
    targets = default_targets()
    assert targets and all(t in SUPPORTED_ARCHS for t in targets)
    assert set(DEFAULT_TARGETS) <= set(SUPPORTED_ARCHS)


# ---------------------------------------------------------------------------------------
# on a GPU: libdevice numerics, and the AOT binaries launched through the driver API
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu(ort=False, torch=True)
def test_gpu_kernels_match_reference(tmp_path):
    """Every case, JIT-compiled by Triton on the device: the real libdevice numerics; the
    tail cases also against the exact values, as `test_interpreted_tails`, and the 16-bit forms
    within an ulp (`_check_sixteen`, with the GPU's fast reciprocal and exp2)."""
    from tests.test_tails import TAILS, assert_near_exact

    _write_workdir(tmp_path, CASES)
    _run_cases(tmp_path, "cuda")
    failures = []
    tails = {f"tail-{t.id}": t for t in TAILS}
    for i, case in enumerate(CASES):
        try:
            _check_case(tmp_path, i, case, "cuda")
            if case.id in tails:
                got = np.load(tmp_path / f"case{i}_out.npz")["out0"]
                assert_near_exact(got, tails[case.id], "Triton kernel (libdevice)")
            if case.id.startswith("sixteen-"):
                _check_sixteen(tmp_path, i, case)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(str(e)[:1500])
    assert not failures, "\n\n".join(failures)


class _Driver:
    """Just enough of the CUDA driver API (ctypes) to launch a binary the way the C++
    launcher does: cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel."""

    def __init__(self):
        import ctypes

        self.ct = ctypes
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, rc, what):
        assert rc == 0, f"{what} failed with CUresult {rc}"

    def launch(self, image: bytes, entry: str, grid: int, num_warps: int, shared: int, args: list[int],
               stream: int):
        ct = self.ct
        mod, fn = ct.c_void_p(), ct.c_void_p()
        self.check(self.lib.cuModuleLoadData(ct.byref(mod), ct.c_char_p(image)), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ct.byref(fn), mod, entry.encode()), "cuModuleGetFunction")
        values = [ct.c_uint64(a & (2**64 - 1)) for a in args] + [ct.c_uint64(0), ct.c_uint64(0)]
        params = (ct.c_void_p * len(values))(*[ct.cast(ct.byref(v), ct.c_void_p) for v in values])
        if shared > 48 * 1024:
            self.check(self.lib.cuFuncSetAttribute(fn, 8, shared), "cuFuncSetAttribute")
        self.check(self.lib.cuLaunchKernel(fn, grid, 1, 1, 32 * num_warps, 1, 1, shared, ct.c_void_p(stream),
                                           params, None), "cuLaunchKernel")
        return mod


@pytest.mark.gpu(ort=False, torch=True)
def test_gpu_aot_binaries_launch_with_the_documented_abi(tmp_path):
    import torch

    cases = [c for c in CASES if c.id in ("rank-mismatch", "multi-output", "scalar", "gelu-tanh", "bool-strided",
                                          "size-4096-block-1024", "dtype-bool-bf16", "select-literal-cond")]
    arch = torch.cuda.get_device_capability()
    arch = arch[0] * 10 + arch[1]
    targets = [arch] if arch in SUPPORTED_ARCHS else [max(a for a in SUPPORTED_ARCHS if a < arch)]
    specs = [KernelSpec(parse(_prog(c.dtypes, c.program)), f"{NAME[:-2]}{k:02d}", len(_out_shape(c)), _modes(c))
             for k, c in enumerate(cases)]
    compiled = compile_kernels(specs, targets, cache_dir=tmp_path / "cache")
    drv = _Driver()
    torch_dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    for case, ck in zip(cases, compiled, strict=True):
        index = CASES.index(case)
        inputs = _case_inputs(index, case)
        expected = evaluate(ck.spec.program, inputs)
        meta = ck.kernel_meta()
        for b, blob in zip(meta["binaries"], ck.kernels(), strict=True):
            if b["format"] == "cubin" and b["arch"] != arch:
                continue
            block = meta["variants"][b["variant"]]["block"]
            ins = [torch.from_numpy(np.ascontiguousarray(_to_storage(a))).cuda() for a in inputs]
            ins = [t.view(torch.bfloat16) if dt == "bf16" else t for t, dt in zip(ins, case.dtypes, strict=True)]
            ints = _launch_ints(case)
            outs = [torch.full((ints[0],), float("nan"), dtype=torch_dtypes[dt], device="cuda")
                    for _, dt in ck.spec.program.outputs]
            req = meta["variants"][b["variant"]]["requires"]
            if req and (ints[0] % req["n_multiple"] or any(t.data_ptr() % req["ptr_align"] for t in ins + outs)):
                continue
            image = blob if b["format"] == "cubin" else blob + b"\0"
            stream = torch.cuda.current_stream().cuda_stream
            drv.launch(image, b["entry"], -(-ints[0] // block), b["num_warps"], b["shared"],
                       [t.data_ptr() for t in ins + outs] + ints, stream)
            torch.cuda.synchronize()
            for j, ((_, dt), want, out) in enumerate(zip(ck.spec.program.outputs, expected, outs, strict=True)):
                got = out.float().cpu().numpy().reshape(want.shape)
                rtol, atol = TOLERANCE[dt]
                np.testing.assert_allclose(got, want.astype(np.float32), rtol=rtol, atol=atol, equal_nan=True,
                                           err_msg=f"{case.id} {b['format']} variant {b['variant']} output {j}")


@pytest.mark.gpu(ort=False, torch=True)
def test_gpu_more_than_2_31_elements(tmp_path):
    import torch

    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    prog = parse(_prog(("f16",), "%1 = neg %0\noutput %1 f16"))
    arch = torch.cuda.get_device_capability()
    arch = arch[0] * 10 + arch[1]
    [ck] = compile_kernels([KernelSpec(prog, NAME, 1, ("full",))], [arch], cache_dir=tmp_path)
    n = 2**31 + 17
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-5:] = 3.0
    y = torch.zeros_like(x)
    b = ck.kernel_meta()["binaries"][-2]  # variant 1 cubin
    blob = ck.kernels()[-2]
    _Driver().launch(blob, b["entry"], -(-n // 1024), b["num_warps"], b["shared"], [x.data_ptr(), y.data_ptr(), n],
                     torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert y[-5:].tolist() == [-3.0] * 5 and y[-6].item() == -1.0 and y[0].item() == -1.0
    assert bool((y == -1.0).sum() == n - 5)


if __name__ == "__main__":
    # Child process of the `interpreted` fixture: TRITON_INTERPRET=1 is set by the parent.
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        _install_libdevice_shims()
        _install_bf16_rounding_fix()
        _install_gpu_max_semantics()
        _run_cases(Path(sys.argv[2]), "cpu")


def test_row_variant_reads_a_bias_in_vectors(tmp_path):
    """BERT-base's fp16 bias + erf-GELU over [M, 3072] (`row-vector-loads`): the row variant
    (block 1024, the last dim a multiple of it) reads the bias where the launch is along the
    last dim as the input, one 16-byte load a thread; the plain variant at the same block, whose
    programs may cross a row's end, reads it one element a load. sm_90, compiled on the CPU."""
    pytest.importorskip("triton")
    from onnxfuse.kinds.pointwise import choose_variants
    from tests.util import compile_sm90, sass_lines

    prog = parse(_prog(("f16", "f16"), """%2 = add %0 %1
        %3 = mul %2 0.70710677
        %4 = erf %3
        %5 = add %4 1.0
        %6 = mul %2 %5
        %7 = mul %6 0.5
        output %7 f16"""))
    row, plain, _ = choose_variants(KernelSpec(prog, NAME, 2, ("full", "strided"), (), 3072))
    assert (row.block, row.num_warps, row.last_multiple, row.requires()["last_multiple"]) == (1024, 4, 1024, 1024)
    assert (plain.block, plain.last_multiple) == (2048, 0)
    loads = {}
    for label, v in (("row", row), ("plain", dataclasses.replace(plain, block=1024))):
        ks = generate(prog, NAME, 2, ("full", "strided"), [], v)
        sass = sass_lines(compile_sm90(ks, tmp_path / label).asm["cubin"], tmp_path / label)
        loads[label] = Counter(re.search(r"LDG\S*", ln).group(0) for ln in sass if "LDG" in ln)
    # the input and, in the along-last branch, the bias: a 16-byte load each; the other
    # branches (a value per row, the full unravel) still gather, 8 halves a thread each
    assert loads["row"] == {"LDG.E.128": 2, "LDG.E.U16": 16}, loads
    assert loads["plain"] == {"LDG.E.128": 1, "LDG.E.U16": 8}, loads


def test_sixteen_bit_gelu_takes_fewer_instructions(tmp_path):
    """`sixteen-bit-forms`: BERT-base's fp16 bias + GELU chain in the form relax_16bit writes
    (0.5 x erfc(-x RN(1/sqrt 2)): erfc_16bit) compiles to fewer sm_90 instructions than with
    libdevice's erf + 1 (864 against 920 static, the GELU 27 an element against 34, when
    measured), and calls no libdevice erf or erfc. Compiled on the CPU."""
    pytest.importorskip("triton")
    from tests.util import compile_sm90, sass_lines

    counts = {}
    for label, body in (("erf", "%3 = mul %2 0.70710677\n%4 = erf %3\n%5 = add %4 1.0\n%6 = mul %2 %5\n"
                                "%7 = mul %6 0.5\noutput %7 f16"),
                        ("erfc", "%3 = mul %2 -0.70710677\n%4 = erfc %3\n%5 = mul %2 %4\n%6 = mul %5 0.5\n"
                                 "output %6 f16")):
        prog = parse(_prog(("f16", "f16"), f"%2 = add %0 %1\n{body}"))
        row = choose_variants(KernelSpec(prog, NAME, 2, ("full", "strided"), (), 3072))[0]
        ks = generate(prog, NAME, 2, ("full", "strided"), [], row)
        assert ("erfc_16bit(" in ks.source) == (label == "erfc") and "libdevice.erfc" not in ks.source
        counts[label] = len(sass_lines(compile_sm90(ks, tmp_path / label).asm["cubin"], tmp_path / label))
    assert counts["erfc"] < counts["erf"] - 32, counts


@pytest.mark.parametrize("transposed", [False, True], ids=["q", "q-through-its-transpose"])
def test_rotate_half_kernel_compiles_for_sm90_without_spills(transposed, tmp_path):
    """LLaMA's fp16 rotary chain (q * cos + rotate_half(q) * sin over [8, 12, 128, 64]) as the
    pointwise kind builds it: every variant compiles for sm_90 on the CPU, the rotated input read
    at the offsets half the last dim away (no Slice, Neg or Concat kernel before it), nothing
    spilled; also with q read through its Transpose (strided: no Transpose kernel before it)."""
    pytest.importorskip("triton")
    from onnxfuse.kinds.pointwise import Pointwise
    from tests.util import compile_sm90, sass_lines

    prog = parse(_prog(("f16",) * 4, "%4 = mul %0 %1\n%5 = mul %2 %3\n%6 = add %4 %5\noutput %6 f16"))
    modes = ("strided", "strided", "rotate_half_strided", "strided") if transposed else (
        "full", "strided", "rotate_half", "strided")
    spec = KernelSpec(prog, NAME, 4, modes, (), 64)
    at = "x2_offsets" if transposed else "offsets"
    for k, v in enumerate(choose_variants(spec)):
        ks = Pointwise().generate(spec, v)
        assert "x2_col = offsets % 64" in ks.source and f"{at} + 32, {at} - 32" in ks.source
        sass = sass_lines(compile_sm90(ks, tmp_path / f"v{k}").asm["cubin"], tmp_path / f"v{k}")
        assert not [ln for ln in sass if "LDL" in ln or "STL" in ln], k


@pytest.mark.parametrize("rotation", ["rotate_half", "rotate_pairs"])
def test_partial_rotary_kernel_compiles_for_sm90_without_spills(rotation, tmp_path):
    """Phi-2's fp16 partial rotary chain (the first 32 of 80 head dims, q read through its
    Transpose; GPT-J's interleaved form too) as the pointwise kind builds it: no row variant, every
    variant compiles for sm_90 on the CPU, cos and sin read under the column mask, q stored
    beyond, nothing spilled."""
    pytest.importorskip("triton")
    from onnxfuse.kinds.pointwise import Pointwise
    from tests.util import compile_sm90, sass_lines

    prog = parse(_prog(("f16",) * 4, "%4 = mul %0 %1\n%5 = mul %2 %3\n%6 = add %4 %5\noutput %6 f16"))
    spec = KernelSpec(prog, NAME, 4, ("strided", "narrow", f"{rotation}_strided", "narrow"), (), 80, (32, 0))
    variants = choose_variants(spec)
    assert not any(v.last_multiple for v in variants)
    moved = "x2_offsets + 16, x2_offsets - 16" if rotation == "rotate_half" else "x2_offsets + 1, x2_offsets - 1"
    for k, v in enumerate(variants):
        ks = Pointwise().generate(spec, v)
        assert "inside = col < 32" in ks.source and moved in ks.source
        assert "tl.where(inside, tmp6, x0)" in ks.source and "x1_offsets, mask=mask & inside, other=0)" in ks.source
        sass = sass_lines(compile_sm90(ks, tmp_path / f"v{k}").asm["cubin"], tmp_path / f"v{k}")
        assert not [ln for ln in sass if "LDL" in ln or "STL" in ln], k


def test_row_variants_follow_the_last_dim():
    """`row-vector-loads`: a chain with a strided input and a static last dim gets a row
    variant first, its block the largest power of two dividing that dim up to the heuristic's
    (fewer warps below 1024), none below 512 or without a strided input; tuning's candidates
    scale it with the others and drop it where its block no longer divides the dim."""
    from onnxfuse.kinds.pointwise import pointwise_candidates

    def spec(last, dtype="f16", modes=("full", "strided")):
        prog = parse(_prog((dtype, dtype), f"%2 = add %0 %1\n%3 = erf %2\noutput %3 {dtype}"))
        return KernelSpec(prog, NAME, 2, modes, (), last)

    def rows(last, **kw):
        return [(v.block, v.num_warps, v.last_multiple) for v in choose_variants(spec(last, **kw)) if v.last_multiple]

    assert rows(3072) == [(1024, 4, 1024)]  # BERT-base's FFN
    assert rows(1536) == [(512, 2, 512)]  # ViT-S/16's
    assert rows(4096) == [(2048, 4, 2048)] and rows(4096, dtype="f32") == [(1024, 4, 1024)]
    assert rows(768) == rows(0) == rows(3072, modes=("full", "full")) == []
    blocks = {label: [(v.block, v.num_warps, v.last_multiple) for v in vs]
              for label, vs in pointwise_candidates(spec(3072))}
    assert blocks["default"] == [(1024, 4, 1024), (2048, 4, 0), (2048, 4, 0)]
    assert blocks["block 1024, 4 warps"] == [(512, 4, 512), (1024, 4, 0), (1024, 4, 0)]
    assert blocks["block 512, 4 warps"] == [(512, 4, 0), (512, 4, 0)]  # a row block of 256 is too small
    assert blocks["block 4096, 4 warps"] == [(4096, 4, 0), (4096, 4, 0)]  # 2048 does not divide 3072
    assert blocks["block 2048, 8 warps"] == [(1024, 8, 1024), (2048, 8, 0), (2048, 8, 0)]
    assert blocks["block 2048, 2 warps"] == [(1024, 2, 1024), (2048, 2, 0), (2048, 2, 0)]  # 16 halves a thread
    for _, vs in pointwise_candidates(spec(3072)):
        assert [v.index for v in vs] == list(range(len(vs)))


def test_the_last_dim_reaches_the_spec_and_names_the_kernel():
    """The pointwise lowering keeps a static last dim for `row_block` (only with a strided
    input), and the power of two dividing it names the kernel: equal programs over [N, 3072]
    and [N, 6144] differ in their row variants (1024 and 2048), so in their names; over 3072
    and 1024 * 5 (both 1024) they share one."""
    from onnx import helper

    from onnxfuse import optimize_model
    from onnxfuse.kinds import KINDS
    from tests.util import model

    def fused(last, bias=True):
        nodes = [helper.make_node("Add", ["x", "b" if bias else "x"], ["t"]), helper.make_node("Erf", ["t"], ["y"])]
        inputs = {"x": ("float16", ["N", last]), **({"b": ("float16", [last])} if bias else {})}
        m = model(nodes, inputs, {"y": ("float16", ["N", last])})
        [f] = optimize_model(m, leave_to_ort=False).fused
        return f, KINDS["pointwise"].spec(m, f, "tf32", None)

    (f1, s1), (f2, s2), (f3, s3) = fused(3072), fused(6144), fused(5120)
    assert (f1.params.last_dim, s1.last_dim, s2.last_dim, s3.last_dim) == (3072, 3072, 6144, 5120)
    assert f1.kernel_name != f2.kernel_name and f1.kernel_name == f3.kernel_name
    f4, s4 = fused(3072, bias=False)
    assert (f4.params.last_dim, s4.last_dim, s4.input_modes) == (0, 0, ("full",))


def test_kernels_that_differ_only_in_their_comments_compile_once(aot):
    """Two layers of one encoder: the same program, other nodes named in the header. The second
    is a cache hit, and the binaries are the first's, under its own source."""
    first, _, cache = aot
    other = KernelSpec(parse(GOLDEN_PROGRAM), NAME, 2, ("full", "strided", "scalar"), ("Mul /block.1/mul",))
    [again] = compile_kernels([other], [90], cache_dir=cache)
    assert (again.compiled, again.cache_hits) == (0, 2)
    assert again.kernels() == first.kernels()
    variant = first.variants[0]
    mine, theirs = (generate(s.program, NAME, 2, s.input_modes, s.source_nodes, variant).source
                    for s in (other, first.spec))
    assert mine != theirs and code_lines(mine) == code_lines(theirs)
