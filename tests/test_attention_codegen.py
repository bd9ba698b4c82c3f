"""Generated FusedAttention Triton kernels (onnxfuse.codegen_attention) against a float64 numpy
reference that follows the node contract (docs/format.md, FusedAttention): scores = Q @ K^T
rounded to Q's dtype, the score program, ONNX's softmax over the keys, the probabilities
rounded to V's dtype, P @ V rounded to Y's dtype. Under ``TRITON_INTERPRET=1`` in one child
process (this file run as a script, so the interpreter setting never reaches the process where
other tests compile kernels), and compiled ahead of time for sm_90 with no GPU.

The cases cover Sq and Sk that are not multiples of the tiles (Sq 20, Sk 37: masked query rows
and key columns, several key blocks), a tile larger than the whole problem, head dims that are
not powers of two (D 40 and Dv 24, 72: padded HEAD_D / HEAD_DV) and Dv != D, float32 at
precisions ieee and tf32, float16 and bfloat16, score programs with a scalar Div, an additive
mask [B, 1, 1, Sk] (broadcast strides 0), GPT-2's causal bool mask through a select, a Cast of
the scores to float32, and none at all; operands read through strides (Q and V from [B, S, H,
D] arrays, K^T from a [B, S, H, D] key array as [B, H, D, S]) and Y written to a [B, Sq, H, Dv]
buffer; rank 3 (B = 1); a packed projection's bias added to Q, K^T and V in the kernel (float32
at tf32 and ieee, float16; padded head dims, rank 3, an aligned variant; each operand's bias
pointer at its offset into one packed bias, as the launcher passes it); and special values: a
row of -inf scores, a +inf score and a NaN score each make exactly their rows NaN, while a row
whose first key block is all -inf (the running max still -inf there: the kernel shifts by 0)
stays finite. The GPU-only test runs the same cases
with Triton's JIT (`-m gpu`).

The kernel rounds the unnormalized probabilities to V's dtype (flash attention's way,
codegen_attention's module docstring) where the reference rounds the normalized ones: the
tolerances allow that one rounding step."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from onnxfuse.codegen_attention import (
    CANDIDATES,
    SMS,
    AttentionSpec,
    AttentionVariant,
    attention_candidates,
    attention_param_names,
    attention_variants,
    generate_attention,
)
from onnxfuse.codegen_conv import round_array_to_tf32
from onnxfuse.expr import HEADER, evaluate, parse
from onnxfuse.kinds.attention import _broadcast_dims, _constant_where_masked

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.util import compile_sm90, interpreted_run, sass_lines  # noqa: E402

NP = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}

# Score programs: {dt} is Q's dtype; the extras follow %0.
SCALE = "input %0 {dt}\n%1 = div %0 8.0\noutput %1 {dt}"
SCALE_MASK = "input %0 {dt}\ninput %1 {dt}\n%2 = div %0 8.0\n%3 = add %2 %1\noutput %3 {dt}"
CAUSAL = "input %0 {dt}\ninput %1 bool\n%2 = div %0 8.0\n%3 = select %1 %2 -10000.0\noutput %3 {dt}"
NONE = "input %0 {dt}\noutput %0 {dt}"
SCALE_TO_F32 = "input %0 {dt}\n%1 = mul %0 0.125\noutput %1 f32"  # a Cast of the scaled scores to float32
MASK_F32 = "input %0 {dt}\ninput %1 f32\n%2 = mul %0 0.125\n%3 = add %2 %1\noutput %3 {dt}"

SMALL = AttentionVariant(block_m=16, block_n=16, num_warps=4, num_stages=1)
SMALL_ALIGNED = AttentionVariant(block_m=16, block_n=16, num_warps=4, num_stages=1, aligned=True)
# The special rows of the "special" mask extra: all -inf, one +inf, one NaN
NEG_INF_ROW, POS_INF_ROW, NAN_ROW = 5, 2, 7
LATE_ROW = 6  # its first 20 keys -inf (a whole key block of 16): finite, not NaN


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    dtype: str
    program: str
    b: int = 2
    h: int = 2
    sq: int = 20
    sk: int = 37
    d: int = 64
    dv: int = 64
    precision: str = "ieee"
    # (kind, shape) per extra: "additive" (0 or -10000, the extra's dtype from the program),
    # "key-rows" (additive, its rows equal: a key mask expanded over the queries), "causal-add"
    # (0 on and below the diagonal, the dtype's lowest above: Hugging Face's GPT-2),
    # "causal" (bool, tril offset Sk - Sq), "special" (additive with the special rows above)
    extras: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # base layouts: "bshd" reads Q / V from [B, S, H, D] (perm 0,2,1,3) and K^T from a [B, S, H, D]
    # key array (perm 0,2,3,1); "bhsd" the logical layout itself; "shd" rank 3 ([S, H, D], B = 1)
    layout: str = "bshd"
    y_layout: str = "bshd"
    variant: AttentionVariant | None = SMALL  # None: attention_variants' heuristic (sq unknown)
    nan_to_zero: bool = False  # the node's nan_to_zero: NaN probabilities read as 0
    # Q, K and V read with a projection bias added (bias_q, bias_k, bias_v): one packed bias
    # [H * D | H * D | H * Dv], each operand's pointer at its offset (layouts "bshd", "shd")
    bias: bool = False
    # the extras read as the rows, columns or elements their shapes say they are
    # (AttentionSpec.extras_broadcast, as onnxfuse.kinds.attention derives it); else as tiles
    broadcast: bool = False
    # the "causal" extras computed from the indices, not read, and key blocks past the diagonal
    # skipped where the program's masked value is one value (AttentionSpec.causal_fill)
    causal: bool = False
    # grouped-query attention: K and V have h / kv_group heads, query head j reads head j // kv_group
    kv_group: int = 1
    # the extra whose true elements zero P after the softmax (AttentionSpec.zero_where; its kind
    # "padding": DeBERTa's mask over padded queries and keys, rows 16.. of batch 0 all masked)
    zero_where: int | None = None
    # the node's exact_scores: the product and the score program's output kept in fp32
    exact: bool = False
    qk_scale: float = 1.0  # Q and K drawn N(0, qk_scale²): large scores, whose rounding shows


# DeBERTa's XSoftmax as transformers 4 exports it: the masked scores set to the dtype's lowest,
# then (the node's zero_where) those probabilities to 0; and the zeroing mask alone
PADDED = "input %0 {dt}\ninput %1 bool\n%2 = div %0 8.0\n%3 = select %1 {lowest} %2\noutput %3 {dt}"
ZERO_ONLY = "input %0 {dt}\ninput %1 bool\n%2 = div %0 8.0\noutput %2 {dt}"

CASES = [
    Case("f32-ieee-scale-odd", "f32", SCALE),
    Case("f32-tf32-mask-d40-dv24", "f32", SCALE_MASK, d=40, dv=24, precision="tf32",
         extras=(("additive", (2, 1, 1, 37)),)),
    Case("f32-ieee-no-program-contiguous", "f32", NONE, sk=70, layout="bhsd", y_layout="bhsd"),
    Case("f16-causal-gpt2", "f16", CAUSAL, extras=(("causal", (1, 1, 20, 37)),)),
    Case("f16-mask-d40-dv72", "f16", SCALE_MASK, d=40, dv=72, extras=(("additive", (2, 1, 1, 37)),)),
    Case("f16-scores-cast-to-f32", "f16", SCALE_TO_F32, sk=50),
    Case("f16-default-tile", "f16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),), variant=None),
    Case("f32-tf32-default-tile-rank3", "f32", SCALE, b=1, h=3, sk=70, precision="tf32", layout="shd",
         variant=None),
    Case("bf16-mask", "bf16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),)),
    Case("f32-ieee-special-rows", "f32", MASK_F32, extras=(("special", (1, 1, 20, 37)),)),
    # aligned variants: the head dims read at stride 1 (every layout here has contiguous heads)
    Case("f16-causal-aligned", "f16", CAUSAL, extras=(("causal", (1, 1, 20, 37)),), variant=SMALL_ALIGNED),
    Case("f32-tf32-mask-d40-aligned", "f32", SCALE_MASK, d=40, dv=24, precision="tf32",
         extras=(("additive", (2, 1, 1, 37)),), variant=SMALL_ALIGNED),
    Case("f16-special-rows", "f16", MASK_F32, extras=(("special", (1, 1, 20, 37)),)),
    # torch's SDPA export: Where(IsNaN(P), 0, P): the special rows give 0
    Case("f32-special-rows-nan-to-zero", "f32", MASK_F32, extras=(("special", (1, 1, 20, 37)),), nan_to_zero=True),
    # a packed projection's bias added in the kernel (padded head dims, rank 3, aligned)
    Case("f32-tf32-bias-mask-d40-dv24", "f32", SCALE_MASK, d=40, dv=24, precision="tf32",
         extras=(("additive", (2, 1, 1, 37)),), bias=True),
    Case("f32-ieee-bias-rank3", "f32", SCALE, b=1, h=3, layout="shd", bias=True),
    Case("f16-bias-causal-d40-dv72", "f16", CAUSAL, d=40, dv=72, extras=(("causal", (1, 1, 20, 37)),), bias=True),
    # a 64 x 128 tile: a partial second key block and a partial query block
    Case("f16-wide-kv-tile", "f16", SCALE_MASK, sq=70, sk=130, extras=(("additive", (2, 1, 1, 130)),),
         variant=AttentionVariant(block_m=64, block_n=128, num_warps=4, num_stages=2, aligned=True)),
    Case("f16-bias-mask-aligned", "f16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),), variant=SMALL_ALIGNED,
         bias=True),
    # extras loaded as what they broadcast as: BERT's key mask as one row of keys, a per-query
    # column, one element per batch and head; beside a full tile (GPT-2's causal mask)
    Case("f16-key-mask-row", "f16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),), broadcast=True),
    Case("f32-tf32-key-mask-row-aligned-bias", "f32", SCALE_MASK, precision="tf32",
         extras=(("additive", (2, 1, 1, 37)),), variant=SMALL_ALIGNED, bias=True, broadcast=True),
    Case("f32-ieee-query-column-and-scalar", "f32", "input %0 {dt}\ninput %1 f32\ninput %2 f32\n%3 = add %0 %1\n"
         "%4 = mul %3 %2\noutput %4 {dt}", extras=(("additive", (2, 2, 20, 1)), ("additive", (2, 2, 1, 1))),
         broadcast=True),
    # an additive causal mask (0 kept, the dtype's lowest elsewhere; Hugging Face's GPT-2): computed
    Case("f16-additive-causal", "f16", SCALE_MASK, extras=(("causal-add", (2, 1, 20, 37)),), causal=True),
    Case("f32-tf32-additive-causal-aligned", "f32", SCALE_MASK, sq=40, sk=40, precision="tf32",
         extras=(("causal-add", (1, 1, 40, 40)),), variant=SMALL_ALIGNED, causal=True),
    # a key mask expanded over the queries ([B, 1, Sq, Sk], equal rows): read as its first row
    Case("f16-expanded-key-mask-row", "f16", SCALE_MASK, extras=(("key-rows", (2, 1, 20, 37)),), broadcast=True),
    Case("bf16-row-mask-and-causal", "bf16", "input %0 {dt}\ninput %1 {dt}\ninput %2 bool\n%3 = add %0 %1\n"
         "%4 = select %2 %3 -10000.0\noutput %4 {dt}", extras=(("additive", (1, 1, 1, 37)), ("causal", (1, 1, 20, 37))),
         broadcast=True),
    # GPT-2's constant causal mask from the indices, the blocks past the diagonal skipped (Sk > Sq:
    # a cache offset), with more queries than keys (rows with every key masked: nothing skipped
    # for them), and scores so low that the masked value (-10000) is the rows' max (the guard
    # keeps every block)
    Case("f16-causal-skip", "f16", CAUSAL, sq=45, sk=45, extras=(("causal", (1, 1, 45, 45)),), causal=True),
    Case("f16-causal-skip-offset", "f16", CAUSAL, extras=(("causal", (1, 1, 20, 37)),), causal=True),
    Case("f32-tf32-causal-skip-more-queries-aligned", "f32", CAUSAL, sq=37, sk=20, precision="tf32",
         extras=(("causal", (1, 1, 37, 20)),), variant=SMALL_ALIGNED, causal=True),
    Case("f32-ieee-causal-masked-value-is-max", "f32",
         "input %0 {dt}\ninput %1 bool\n%2 = sub %0 20000.0\n%3 = select %1 %2 -10000.0\noutput %3 {dt}",
         sq=40, sk=40, extras=(("causal", (1, 1, 40, 40)),), causal=True),
    Case("f16-grouped-query-mask", "f16", SCALE_MASK, h=6, kv_group=3, extras=(("additive", (2, 1, 1, 37)),),
         broadcast=True),
    Case("f32-tf32-grouped-query-contiguous", "f32", SCALE, h=4, kv_group=2, precision="tf32", layout="bhsd",
         y_layout="bhsd"),
    Case("f16-grouped-query-bias-causal", "f16", CAUSAL, h=4, kv_group=2, extras=(("causal", (1, 1, 20, 37)),),
         bias=True),
    Case("bf16-causal-and-key-mask", "bf16", "input %0 {dt}\ninput %1 {dt}\ninput %2 bool\n%3 = add %0 %1\n"
         "%4 = select %2 %3 -10000.0\noutput %4 {dt}", extras=(("additive", (2, 1, 1, 37)), ("causal", (1, 1, 20, 37))),
         broadcast=True, causal=True),
    Case("f32-ieee-zero-where-padded", "f32", PADDED, extras=(("padding", (2, 1, 20, 37)),), zero_where=0),
    Case("f16-zero-where-padded-lowest", "f16", PADDED, extras=(("padding", (2, 1, 20, 37)),), zero_where=0),
    Case("f16-zero-where-padded-inf", "f16", PADDED.replace("{lowest}", "-inf"), extras=(("padding", (2, 1, 20, 37)),),
         zero_where=0),
    Case("bf16-zero-where-unread-key-rows", "bf16", ZERO_ONLY, extras=(("padding", (2, 1, 1, 37)),), zero_where=0,
         broadcast=True),
    # the inner loop's options: full key blocks swept without key masks, then the partial one
    # (`peel`: Sk 37 leaves one of 5 keys, 32 and 130 none and two), exps as exp2 with log2(e)
    # in one FMA (`exp2`); with padded head dims, a key-mask row, special values, zeroing
    Case("f16-peel-exp2-mask-d40-dv72", "f16", SCALE_MASK, d=40, dv=72, extras=(("additive", (2, 1, 1, 37)),),
         broadcast=True, variant=dataclasses.replace(SMALL_ALIGNED, peel=True, exp2=True)),
    Case("f16-peel-wide-kv-tile-bias", "f16", SCALE_MASK, sq=70, sk=130, extras=(("additive", (2, 1, 1, 130)),),
         broadcast=True, bias=True, variant=AttentionVariant(block_m=64, block_n=128, num_warps=4, num_stages=2,
                                                             aligned=True, peel=True)),
    Case("f32-ieee-special-rows-peel-exp2", "f32", MASK_F32, extras=(("special", (1, 1, 20, 37)),),
         variant=dataclasses.replace(SMALL, peel=True, exp2=True)),
    Case("f16-exp2-causal-skip", "f16", CAUSAL, sq=45, sk=45, extras=(("causal", (1, 1, 45, 45)),), causal=True,
         variant=dataclasses.replace(SMALL, peel=True, exp2=True)),
    Case("bf16-peel-exp2-no-tail-zero-where", "bf16", PADDED, sk=32, extras=(("padding", (2, 1, 20, 32)),),
         zero_where=0, variant=dataclasses.replace(SMALL, peel=True, exp2=True)),
    Case("f32-tf32-peel-exp2-tile-mask", "f32", SCALE_MASK, precision="tf32", extras=(("additive", (2, 2, 20, 37)),),
         variant=dataclasses.replace(SMALL_ALIGNED, peel=True, exp2=True)),
    # the partial block in blocks of 16 (`tail_n`): Sk 37 as 32 + 3 x 16, Sk 20 as 4 x 16 after no full block
    Case("f16-peel-tail16-mask-bias-d40", "f16", SCALE_MASK, d=40, extras=(("additive", (2, 1, 1, 37)),),
         broadcast=True, bias=True, variant=AttentionVariant(block_m=16, block_n=32, num_warps=4, num_stages=2,
                                                             aligned=True, peel=True, exp2=True, tail_n=16)),
    Case("f32-ieee-special-rows-tail16-zero-where", "f32", PADDED, sk=20, extras=(("padding", (2, 1, 20, 20)),),
         zero_where=0, variant=AttentionVariant(block_m=16, block_n=32, num_warps=4, num_stages=1, peel=True,
                                                tail_n=16)),
    # exact_scores (16-bit nodes, as onnxfuse writes them): the scores unrounded to the softmax,
    # against a reference without those roundings; special values, causal skipping, zeroing, peeling
    Case("f16-exact-mask-row-bias", "f16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),), broadcast=True,
         bias=True, exact=True),
    Case("f16-exact-large-scores", "f16", SCALE_MASK, extras=(("additive", (2, 1, 1, 37)),), broadcast=True,
         exact=True, qk_scale=4.0),
    # a score program adding a large constant (softmax ignores it): its rounding to 16 bits would
    # quantize the scores to steps of 0.5
    Case("f16-exact-offset-scores", "f16", "input %0 {dt}\n%1 = div %0 8.0\n%2 = add %1 1000.0\noutput %2 {dt}",
         exact=True),
    Case("bf16-exact-offset-scores-peel", "bf16", "input %0 {dt}\n%1 = div %0 8.0\n%2 = add %1 100.0\noutput %2 {dt}",
         exact=True, variant=dataclasses.replace(SMALL_ALIGNED, peel=True, tail_n=0)),
    Case("f16-exact-special-rows", "f16", MASK_F32, extras=(("special", (1, 1, 20, 37)),), exact=True),
    Case("bf16-exact-causal-skip-peel", "bf16", CAUSAL, sq=45, sk=45, extras=(("causal", (1, 1, 45, 45)),),
         causal=True, exact=True, variant=dataclasses.replace(SMALL, peel=True, tail_n=0)),
    Case("f16-exact-zero-where-lowest-tail16", "f16", PADDED, extras=(("padding", (2, 1, 20, 37)),), zero_where=0,
         exact=True, variant=AttentionVariant(block_m=16, block_n=32, num_warps=4, num_stages=2, aligned=True,
                                              peel=True, tail_n=16)),
]


def spec_of(i: int, case: Case) -> tuple[AttentionSpec, AttentionVariant]:
    lowest = float(ml_dtypes.finfo(NP[case.dtype]).min)
    prog = parse(f"{HEADER}\n{case.program.replace('{lowest}', repr(lowest)).format(dt=case.dtype)}\n")
    reads = [("row" if kind == "key-rows" else _broadcast_dims(shape)) if case.broadcast else ""
             for kind, shape in case.extras]
    fill = masked = None
    if case.causal:
        (at,) = [j for j, (kind, _) in enumerate(case.extras) if kind.startswith("causal")]
        if case.extras[at][0] == "causal":
            reads[at] = "causal"
            fill = _constant_where_masked(prog, 1 + at)
        else:
            reads[at] = "causal_add"
            masked = float(np.finfo(NP[prog.input_dtypes[1 + at]]).min)
    spec = AttentionSpec(f"k_attention_{i}", prog, case.d, case.dv, case.precision, nan_to_zero=case.nan_to_zero,
                         bias=(case.bias,) * 3, extras_broadcast=tuple(reads) if any(reads) else (),
                         causal_fill=fill, causal_masked=masked, kv_group=case.kv_group, zero_where=case.zero_where,
                         exact_scores=case.exact)
    return spec, case.variant or attention_variants(spec)[0]


# ---------------------------------------------------------------------------------------
# operands: base arrays, their logical views and strides
# ---------------------------------------------------------------------------------------

PERMS = {  # (base shape of Q as (S, D) -> dims, perm to the logical [B, H, S, D] / K^T [B, H, D, S])
    "bshd": ((0, 2, 1, 3), (0, 2, 3, 1)),
    "bhsd": ((0, 1, 2, 3), (0, 1, 3, 2)),  # K^T from a [B, H, Sk, D] key array too
    "shd": ((1, 0, 2), (1, 2, 0)),
}


def _base_shape(case: Case, s: int, d: int, h: int | None = None) -> tuple[int, ...]:
    h = case.h if h is None else h
    return {"bshd": (case.b, s, h, d), "bhsd": (case.b, h, s, d), "shd": (s, h, d)}[case.layout]


def _logical4(base: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    """The logical operand as a 4-D view of `base` (rank 3: B = 1 in front)."""
    view = np.transpose(base, perm)
    return view[None] if view.ndim == 3 else view


def _strides(view: np.ndarray) -> list[int]:
    """Element strides of a 4-D view, 0 on a dim of size 1 (as the launcher gives a broadcast)."""
    return [0 if n == 1 else s // view.itemsize for n, s in zip(view.shape, view.strides, strict=True)]


def bias_of(i: int, case: Case) -> np.ndarray | None:
    """The packed bias [H * D | H * D | H * Dv] of a case with a bias (Q's, K's, V's slices)."""
    if not case.bias:
        return None
    assert case.layout in ("bshd", "shd")  # the heads, then the head dim, last
    rng = np.random.default_rng(9000 + i)
    hkv = case.h // case.kv_group
    return rng.standard_normal(case.h * case.d + hkv * (case.d + case.dv)).astype(NP[case.dtype])


def biased(i: int, case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
    """The base arrays with their bias slices added along [H, D], each sum rounded to the dtype
    (the original's Add); as they are without a bias."""
    bias = bias_of(i, case)
    if bias is None:
        return q, k, v
    hd, hkv = case.h * case.d, case.h // case.kv_group
    kd = hd + hkv * case.d
    parts = (bias[:hd].reshape(case.h, case.d), bias[hd:kd].reshape(hkv, case.d), bias[kd:].reshape(hkv, case.dv))
    return tuple((x.astype(np.float64) + b.astype(np.float64)).astype(x.dtype) for x, b in zip((q, k, v), parts,
                                                                                              strict=True))


def inputs_of(i: int, case: Case) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(base Q, K, V arrays, extras) as the node gets them."""
    rng = np.random.default_rng(7000 + i)
    dt = NP[case.dtype]
    q = (rng.standard_normal(_base_shape(case, case.sq, case.d)) * case.qk_scale).astype(dt)
    hkv = case.h // case.kv_group
    k = (rng.standard_normal(_base_shape(case, case.sk, case.d, hkv)) * case.qk_scale).astype(dt)
    v = rng.standard_normal(_base_shape(case, case.sk, case.dv, hkv)).astype(dt)
    spec, _ = spec_of(i, case)
    extras = []
    for (kind, shape), edt in zip(case.extras, spec.program.input_dtypes[1:], strict=True):
        if kind == "causal":
            extras.append(np.broadcast_to(np.tri(case.sq, case.sk, case.sk - case.sq, dtype=bool), shape).copy())
            continue
        if kind == "causal-add":
            lowest = np.finfo(NP[edt]).min
            keep = np.tri(case.sq, case.sk, case.sk - case.sq, dtype=bool)
            extras.append(np.broadcast_to(np.where(keep, 0, lowest).astype(NP[edt]), shape).copy())
            continue
        if kind == "padding":  # queries 16.. and keys 30.. of batch 0 padded: true where either is
            keep_q, keep_k = np.ones((shape[0], shape[2]), bool), np.ones((shape[0], shape[3]), bool)
            keep_q[0, 16:], keep_k[0, 30:] = False, False
            extras.append(~(keep_q[:, None, :, None] & keep_k[:, None, None, :]))
            continue
        mask = np.where(rng.random(shape) < 0.25, -10000.0, 0.0)
        if kind == "key-rows":  # one key mask row, the same for every query
            mask = np.broadcast_to(mask[..., :1, :], shape).copy()
        if kind == "special":
            mask = np.where(rng.random(shape) < 0.25, -np.inf, 0.0)
            mask[..., NEG_INF_ROW, :] = -np.inf
            mask[..., LATE_ROW, :20] = -np.inf  # a first key block all -inf, then finite scores
            mask[..., POS_INF_ROW, 3] = np.inf
            mask[..., NAN_ROW, 30] = np.nan
        extras.append(mask.astype(NP[edt]))
    return [q, k, v], extras


def logical_operands(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    pq, pk = PERMS[case.layout]
    return _logical4(q, pq), _logical4(k, pk), _logical4(v, pq)


def reference(i: int, case: Case) -> np.ndarray:
    """Logical Y [B, H, Sq, Dv] (float32) as docs/format.md defines it, in float64."""
    spec, _ = spec_of(i, case)
    (q, k, v), extras = inputs_of(i, case)
    q, k, v = biased(i, case, q, k, v)
    q, kt, v = (x.astype(np.float32) for x in logical_operands(case, q, k, v))
    kt, v = np.repeat(kt, case.kv_group, axis=1), np.repeat(v, case.kv_group, axis=1)  # head j: j // kv_group
    if spec.tf32:
        q, kt, v = round_array_to_tf32(q), round_array_to_tf32(kt), round_array_to_tf32(v)
    dt = NP[case.dtype]
    scores = np.matmul(q.astype(np.float64), kt.astype(np.float64)).astype(np.float32 if case.exact else dt)
    ex = [x.reshape((1,) * (4 - x.ndim) + x.shape) for x in extras]
    prog = spec.program
    if case.exact:  # the program's output unrounded too
        prog = dataclasses.replace(prog, outputs=tuple((v, "f32") for v, _ in prog.outputs))
    (s,) = evaluate(prog, [scores, *ex])
    s = s.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    p = p.astype(dt).astype(np.float32)  # as the original's Softmax stores it (V's dtype)
    if spec.nan_to_zero:
        p = np.where(np.isnan(p), 0, p)
    if spec.zero_where is not None:
        p = np.where(np.broadcast_to(ex[spec.zero_where], p.shape), 0, p)
    if spec.tf32:
        p = round_array_to_tf32(p)
    return np.matmul(p.astype(np.float64), v.astype(np.float64)).astype(dt).astype(np.float32)


# ---------------------------------------------------------------------------------------
# launch (interpreter child process, or a GPU)
# ---------------------------------------------------------------------------------------

def launch(fn, case: Case, spec: AttentionSpec, variant: AttentionVariant, constexprs: dict, device: str):
    """Run a generated kernel with the parameters and grid the C++ launcher passes; returns the
    logical Y [B, H, Sq, Dv] read back from its base buffer."""
    import torch

    def tensor(x: np.ndarray):
        if x.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16).to(device)
        if x.dtype == np.bool_:
            x = x.view(np.int8)
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    i = CASES.index(case)
    (q, k, v), extras = inputs_of(i, case)
    lq, lk, lv = logical_operands(case, q, k, v)
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    # Y's base: [B, Sq, H, Dv] (logical through perm 0,2,1,3) or the logical layout; filled with a
    # sentinel, so that an element the kernel does not write shows
    if case.y_layout == "bshd":
        y = torch.full((case.b, case.sq, case.h, case.dv), 777.0, dtype=tdt, device=device)
        ly = y.permute(0, 2, 1, 3)
    else:
        y = torch.full((case.b, case.h, case.sq, case.dv), 777.0, dtype=tdt, device=device)
        ly = y
    ints = [case.h, case.sq, case.sk, *_strides(lq), *_strides(lk), *_strides(lv),
            *[0 if n == 1 else s for n, s in zip(ly.shape, ly.stride(), strict=True)]]
    scores = (case.b, case.h, case.sq, case.sk)
    for x in extras:
        ints += _strides(np.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), scores))
    biases = []  # as the launcher passes them: the packed bias at each operand's offset, its stride along H
    bias = bias_of(i, case)
    if bias is not None:
        packed, hd = tensor(bias), case.h * case.d
        kd = hd + case.h // case.kv_group * case.d
        biases = [packed[0:], packed[hd:], packed[kd:]]
        ints += [case.d, case.d, case.dv]
    grid = variant.grid(case.sq, case.b * case.h)
    fn[grid](tensor(q), tensor(k), tensor(v), *map(tensor, extras), *biases, y, *ints, **constexprs)
    return ly.float().cpu().numpy()


def run_all(workdir: Path, device: str) -> None:
    from benchmarks.conv_kernels import _load

    results = {}
    for i, case in enumerate(CASES):
        try:
            spec, v = spec_of(i, case)
            ks = generate_attention(spec, v)
            fn = _load(ks.source, spec.name, workdir)
            results[f"case{i}"] = launch(fn, case, spec, v, dict(ks.constexprs), device)
        except Exception as e:  # reported by the case's test
            (workdir / f"case{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


# Tolerances relative to the output's scale (at least 1): fp32 sums against the float64
# reference, the probabilities rounded unnormalized (one rounding step of V's dtype: TF32's is
# 2^-11, float16's 2^-11, bfloat16's 2^-8), then one rounding of Y at the store.
TOL = {("f32", "ieee"): 1e-5, ("f32", "tf32"): 2e-3, ("f16", "ieee"): 2e-3, ("bf16", "ieee"): 1.6e-2}


def check(workdir: Path, index: int) -> np.ndarray:
    case = CASES[index]
    err = workdir / f"case{index}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    got = np.load(workdir / "out.npz")[f"case{index}"]
    want = reference(index, case)
    assert got.shape == want.shape == (case.b, case.h, case.sq, case.dv)
    tol = TOL[(case.dtype, case.precision if case.dtype == "f32" else "ieee")]
    scale = float(np.abs(want[np.isfinite(want)]).max(initial=1.0))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    return got


@pytest.fixture(scope="module")
def interpreted():
    with interpreted_run(__file__, "onnxfuse-attention-interp-") as workdir:
        yield workdir


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_attention_kernel_matches_reference(interpreted, index):
    got = check(interpreted, index)
    case = CASES[index]
    nan_rows = sorted(set(np.nonzero(np.isnan(got))[2].tolist()))
    if case.extras and case.extras[0][0] == "special" and case.nan_to_zero:
        assert nan_rows == [] and not got[:, :, [NEG_INF_ROW, POS_INF_ROW, NAN_ROW]].any()  # rows of 0
    elif case.extras and case.extras[0][0] == "special":
        # a row of -inf (0 / 0), a +inf score (inf - inf) and a NaN score: exactly those rows,
        # every element, in every batch and head
        assert nan_rows == sorted((NEG_INF_ROW, POS_INF_ROW, NAN_ROW))
        assert np.isnan(got[:, :, nan_rows]).all()
    else:
        assert nan_rows == []
    if case.zero_where is not None and case.extras[0][1][2] > 1:  # batch 0's padded queries: Y = 0
        assert not got[0, :, 16:].any() and got[1, :, 16:].any()


@pytest.mark.parametrize("case_id", ["f16-exact-offset-scores", "bf16-exact-offset-scores-peel"])
def test_exact_scores_cases_see_the_roundings(case_id):
    """The offset exact_scores cases test something: their reference (scores unrounded)
    differs from the rounded contract's by more than the tolerance, so a kernel that rounded the
    scores would fail them."""
    i = next(i for i, c in enumerate(CASES) if c.id == case_id)
    case = CASES[i]
    exact, rounded = reference(i, case), reference(i, dataclasses.replace(case, exact=False))
    scale = float(np.abs(exact).max(initial=1.0))
    assert np.abs(exact - rounded).max() > 4 * TOL[(case.dtype, "ieee")] * scale


def test_tolerances_see_the_rounding():
    """The tf32 case tests something: its reference differs from the unrounded one by more than
    the ieee tolerance."""
    i = next(i for i, c in enumerate(CASES) if c.id == "f32-tf32-mask-d40-dv24")
    case = CASES[i]
    ieee = dataclasses.replace(case, precision="ieee")  # the same inputs (seeded by the index)
    diff = float(np.abs(reference(i, case) - reference(i, ieee)).max())
    assert 1e-5 < diff < 1e-2


@pytest.mark.gpu(ort=False, torch=True)
def test_attention_kernels_on_gpu(tmp_path):
    """The same kernels with Triton's JIT on the GPU."""
    run_all(tmp_path, "cuda")
    for i in range(len(CASES)):
        check(tmp_path, i)


# ---------------------------------------------------------------------------------------
# variants, source and compile-time checks
# ---------------------------------------------------------------------------------------

def _spec(dtype: str = "f16", d: int = 64, dv: int = 64, **kw) -> AttentionSpec:
    prog = parse(f"{HEADER}\n{SCALE_MASK.format(dt=dtype)}\n")
    return AttentionSpec("onnxfuse_attention_0123456789ab", prog, d, dv, **kw)


def test_parameters_are_the_abi():
    """The generated kernel's parameters, in order, are docs/format.md's (attention_param_names),
    typed as the launcher passes them; the constexprs carry the padded head dims."""
    spec = _spec("f16", 40, 72)
    ks = generate_attention(spec, attention_variants(spec)[0])
    names = [p for p, _ in ks.params]
    assert names == attention_param_names(spec)
    assert names[:8] == ["q_ptr", "k_ptr", "v_ptr", "e0_ptr", "y_ptr", "H", "SQ", "SK"]
    assert names[-4:] == ["stride_e0_b", "stride_e0_h", "stride_e0_m", "stride_e0_n"]
    types = dict(ks.params)
    assert [types[p] for p in names[:5]] == ["*fp16"] * 5
    assert all(types[p] == "i32" for p in names[5:])
    assert dict(ks.constexprs) == {"BLOCK_M": 128, "BLOCK_N": 64, "HEAD_D": 64, "HEAD_DV": 128, "D": 40, "DV": 72}
    # the source's own signature lists the same names in the same order, then the constexprs
    src = ks.source
    start = src.index(f"def {spec.name}(\n") + len(spec.name) + 5
    sig = src[start:src.index("\n):\n", start)]
    params = [p.strip() for p in sig.replace("\n", " ").split(",") if p.strip()]
    assert params == names + [f"{c}: tl.constexpr" for c, _ in ks.constexprs]
    # bool extras are int8 pointers; no extras
    causal = AttentionSpec("k", parse(f"{HEADER}\n{CAUSAL.format(dt='bf16')}\n"), 64, 64)
    assert dict(generate_attention(causal, SMALL).params)["e0_ptr"] == "*i8"
    plain = AttentionSpec("k", parse(f"{HEADER}\n{NONE.format(dt='f32')}\n"), 64, 64)
    assert [p for p, _ in generate_attention(plain, SMALL).params] == attention_param_names(plain)
    # biases: a pointer per biased operand after the extras, its stride along H after the extras' strides
    kv = dataclasses.replace(spec, bias=(False, True, True))
    ks = generate_attention(kv, SMALL_ALIGNED)
    names = [p for p, _ in ks.params]
    assert names == attention_param_names(kv)
    assert names[:7] == ["q_ptr", "k_ptr", "v_ptr", "e0_ptr", "bk_ptr", "bv_ptr", "y_ptr"]
    assert names[-2:] == ["stride_bkh", "stride_bvh"]
    assert dict(ks.params)["bk_ptr"] == "*fp16"
    assert {names.index(p) for p in ("bk_ptr", "bv_ptr", "stride_bkh", "stride_bvh")} <= set(ks.divisible)


def test_source_is_deterministic_and_names_its_nodes():
    spec = dataclasses.replace(_spec("f32"), source_nodes=("MatMul qk", "Softmax sm"))
    a, b = generate_attention(spec, SMALL), generate_attention(spec, SMALL)
    assert a.source == b.source
    assert "#   MatMul qk" in a.source and "#   Softmax sm" in a.source
    assert "#   %2 = div %0 8.0" in a.source
    # tf32: Q, K^T, P and V rounded to nearest in the kernel
    for line in ("q = round_to_tf32(q)", "kt = round_to_tf32(kt)", "p = round_to_tf32(p)", "v = round_to_tf32(v)",
                 'input_precision="tf32"'):
        assert line in a.source, line
    ieee = generate_attention(dataclasses.replace(spec, precision="ieee"), SMALL).source
    assert "round_to_tf32" not in ieee and 'input_precision="ieee"' in ieee
    half = generate_attention(_spec("f16"), SMALL).source
    assert 's0 = qk.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)' in half
    assert 'acc = tl.dot(p.to(tl.float16, fp_downcast_rounding="rtne"), v, acc)' in half
    assert "offs_d[None, :] < D" not in half  # D = 64 = HEAD_D: no padding mask
    assert "bq_ptr" not in half and "bias" not in half
    # a bias: loaded once per head, added in fp32 and rounded to the operand's dtype (f16), or
    # added in fp32 before the TF32 rounding
    half = generate_attention(dataclasses.replace(_spec("f16", 40), bias=(True, True, True)), SMALL).source
    for line in ("bq = tl.load(bq_ptr + h * stride_bqh + offs_d, mask=offs_d < D, other=0.0)",
                 "bv = tl.load(bv_ptr + h * stride_bvh + offs_dv)",
                 'q = (q.to(tl.float32) + bq.to(tl.float32)[None, :]).to(tl.float16, fp_downcast_rounding="rtne")',
                 'kt = (kt.to(tl.float32) + bk.to(tl.float32)[:, None]).to(tl.float16, fp_downcast_rounding="rtne")',
                 'v = (v.to(tl.float32) + bv.to(tl.float32)[None, :]).to(tl.float16, fp_downcast_rounding="rtne")'):
        assert line in half, line
    tf32 = generate_attention(dataclasses.replace(spec, bias=(True, False, False)), SMALL).source
    assert "q = q + bq[None, :]\n    q = round_to_tf32(q)" in tf32 and "bk" not in tf32


def test_variant_choice():
    # float16, D 64: the tutorial's Hopper tile; a static grid that leaves SMs idle halves BLOCK_M
    # (each tile aligned, then not)
    assert attention_variants(_spec("f16")) == (AttentionVariant(0, 128, 64, 8, 3, aligned=True),
                                                AttentionVariant(1, 128, 64, 8, 3))
    assert attention_variants(_spec("f16", sq=512, batch_heads=96))[0].block_m == 128  # 4 * 96 programs
    bert8 = attention_variants(_spec("f16", sq=128, batch_heads=96))[0]  # BERT-base at batch 8
    # 64 query rows: one stage, the full key blocks unmasked (thirty-fifth session, `HALF_64`)
    assert (bert8.block_m, bert8.block_n, bert8.num_warps, bert8.num_stages, bert8.peel, bert8.tail_n) == (
        64, 64, 4, 1, True, 16)
    assert attention_variants(_spec("f16", sq=128, batch_heads=48))[0].block_m == 32  # 4 * 48 >= SMS
    assert -(-128 // 32) * 48 >= SMS > -(-128 // 64) * 48
    # 16 query rows (BERT-base at batch 1: 96 programs) take 128-wide key blocks, up to D 64
    bert1 = attention_variants(_spec("f16", sq=128, batch_heads=12))[0]
    assert (bert1.block_m, bert1.block_n, bert1.num_warps, bert1.num_stages) == (16, 128, 4, 2)
    assert attention_variants(_spec("f16", 128, 128, sq=128, batch_heads=12))[0].block_n == 64
    # wide heads: the half tile
    assert attention_variants(_spec("bf16", 256, 256))[0] == AttentionVariant(0, 64, 64, 4, 2, aligned=True)
    # float32: 32 query rows and 32 keys (16 rows: 128 keys), K / V blocks of at most 8192 elements
    assert attention_variants(_spec("f32"))[0] == AttentionVariant(0, 32, 32, 4, 2, aligned=True)
    assert attention_variants(_spec("f32", sq=128, batch_heads=96))[0].block_m == 32  # 4 * 96 programs
    f32_b1 = attention_variants(_spec("f32", sq=128, batch_heads=12))[0]
    assert (f32_b1.block_m, f32_b1.block_n) == (16, 128)
    assert attention_variants(_spec("f32", 128, 128, sq=128, batch_heads=12))[0].block_n == 64
    assert attention_variants(_spec("f32", 32, 32))[0].block_n == 32
    assert attention_variants(_spec("f32", 256, 256, sq=128, batch_heads=12))[0].block_n == 32
    for spec in (_spec("f16"), _spec("f32"), _spec("f16", sq=128, batch_heads=12)):
        cands = attention_candidates(spec)
        labels = [label for label, _ in cands]
        n = CANDIDATES["f32" if spec.dtype == "f32" else "f16"]
        assert labels[0] == "default" and len(labels) == len(set(labels)) == n
        assert cands[0][1] == attention_variants(spec)
        assert all([(v.index, v.aligned) for v in vs] == [(0, True), (1, False)] for _, vs in cands)
        assert not any(v.v_first for _, vs in cands for v in vs)  # `attention-v-first`: not shipped
        tiles = [(v.block_m, v.block_n, v.num_warps, v.num_stages, v.peel) for _, (v, _) in cands]
        assert len(set(tiles)) == n
        assert all(v.tail_n == (max(16, v.block_n // 4) if v.peel else 0) for _, vs in cands for v in vs)
    # BERT-base at batch 8: the heuristic's peeled 64 x 64, then the thirty-fourth session's b8 and
    # b1 bests (peeled: the full key blocks without key masks), the heuristic's not twice
    bert8_tiles = [(v.block_m, v.block_n, v.num_warps, v.num_stages, v.peel)
                   for _, (v, _) in attention_candidates(_spec("f16", sq=128, batch_heads=96))]
    assert bert8_tiles == [(64, 64, 4, 1, True), (64, 128, 4, 1, True), (32, 128, 4, 2, False), (16, 128, 4, 2, True),
                           (128, 128, 8, 1, True)]
    # wide heads and 32-row grids keep their tiles (not measured peeled)
    assert attention_variants(_spec("f16", 256, 256, sq=128, batch_heads=96))[0].peel is False
    assert attention_variants(_spec("f16", sq=128, batch_heads=48))[0].num_stages == 3


def test_rejected_specs():
    spec = _spec("f16")
    with pytest.raises(ValueError, match="powers of two"):
        generate_attention(spec, dataclasses.replace(SMALL, block_n=48))
    with pytest.raises(ValueError, match="at least 16"):
        generate_attention(spec, dataclasses.replace(SMALL, block_m=8))
    with pytest.raises(ValueError, match="head dims"):
        generate_attention(dataclasses.replace(spec, head_d=0), SMALL)
    with pytest.raises(ValueError, match="precision"):
        generate_attention(dataclasses.replace(spec, precision="fp64"), SMALL)
    with pytest.raises(ValueError, match="identifier"):
        generate_attention(dataclasses.replace(spec, name="not a name"), SMALL)
    two = parse(f"{HEADER}\ninput %0 f16\n%1 = mul %0 2.0\noutput %1 f16\noutput %0 f16\n")
    with pytest.raises(ValueError, match="one output"):
        generate_attention(dataclasses.replace(spec, program=two), SMALL)
    with pytest.raises(ValueError, match="dtype"):
        generate_attention(dataclasses.replace(spec, program=parse(f"{HEADER}\ninput %0 bool\noutput %0 f32\n")),
                           SMALL)
    with pytest.raises(ValueError, match="extras_broadcast"):
        generate_attention(dataclasses.replace(spec, extras_broadcast=("m", "m")), SMALL)  # one extra
    with pytest.raises(ValueError, match="extras_broadcast"):
        generate_attention(dataclasses.replace(spec, extras_broadcast=("k",)), SMALL)


def test_broadcast_extras_are_loaded_as_vectors():
    """A key mask [B, 1, 1, Sk] is loaded as one row of keys (no [BLOCK_M, BLOCK_N] tile of
    repeats, no tile mask); unknown broadcasting keeps the tile load."""
    spec = _spec("f16")
    tile = generate_attention(spec, SMALL).source
    row = generate_attention(dataclasses.replace(spec, extras_broadcast=("m",)), SMALL).source
    assert "e_mask" in tile and "offs_m[:, None] * stride_e0_m" in tile
    assert "e_mask" not in row and row.count("stride_e0_m") == 1  # the parameter, unread
    # a vector, then broadcast: a [1, BLOCK_N] load made the 64 x 128 tile spill (test below)
    assert "e0 = tl.load(e0_base + offs_n * stride_e0_n, mask=col_ok, other=0).to(tl.float32)[None, :]" in row
    col = generate_attention(dataclasses.replace(spec, extras_broadcast=("n",)), SMALL).source
    assert "e0 = tl.load(e0_base + offs_m * stride_e0_m, mask=row_ok, other=0).to(tl.float32)[:, None]" in col


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("bias", [False, True])
def test_aot_compile_for_sm90(tmp_path, dtype, bias):
    """The heuristic's variant compiles for sm_90 with no GPU (D 64, a mask extra, with and
    without the projection biases): both products on the tensor cores, no global scratch."""
    pytest.importorskip("triton")
    spec = _spec(dtype, precision="tf32", bias=(bias,) * 3)
    ks = generate_attention(spec, attention_variants(spec)[0])
    ck = compile_sm90(ks, tmp_path)
    ptx = ck.asm["ptx"]
    assert f".entry {spec.name}(" in ptx or f".entry {spec.name}" in ptx
    assert "mma" in ptx  # wgmma or mma.sync
    assert (ck.metadata.global_scratch_size or 0) == 0


def test_key_mask_row_does_not_spill(tmp_path):
    """BERT-base's attention (a key mask [B, 1, 1, Sk] read as a row, the packed bias) on the
    64 x 128 tile, 4 warps: with the row loaded as a [1, BLOCK_N] tile ptxas spilled (341 local
    loads and stores in the sm_90 SASS; 19.2 µs on the H200 against 6.3 as a vector, twenty-third
    session); loaded as a vector and broadcast, none."""
    pytest.importorskip("triton")
    spec = _spec("f16", batch_heads=96, sq=128, sk=128, bias=(True,) * 3, extras_broadcast=("m",))
    ks = generate_attention(spec, AttentionVariant(0, 64, 128, 4, 1, aligned=True))
    sass = sass_lines(compile_sm90(ks, tmp_path).asm["cubin"], tmp_path)
    assert any("HGMMA" in ln for ln in sass)
    assert not [ln for ln in sass if re.search(r"\b(LDL|STL)\b", ln)]


def test_peeled_candidates_compile_without_spills(tmp_path):
    """Tuning's first peeled candidate, 64 x 128 (1 stage, the partial block in blocks of 32), at
    ViT-S/16's shape (197 keys, the packed bias) and BERT-base's (the key mask row): wgmma, no
    local loads or stores (peeled with its partial block under an `if` and tl.exp, ViT's spilled
    38 times in the thirty-fourth session's SASS count)."""
    pytest.importorskip("triton")
    from onnxfuse.codegen_attention import ALTERNATIVES, _variants

    tile = ALTERNATIVES["f16"][0]
    for kw in (dict(batch_heads=48, sq=197, sk=197, bias=(True,) * 3),
               dict(batch_heads=96, sq=128, sk=128, bias=(True,) * 3, extras_broadcast=("m",))):
        variant = _variants(tile)[0]
        assert (variant.peel, variant.tail_n) == (True, 32)
        ks = generate_attention(_spec("f16", **kw), variant)
        sass = sass_lines(compile_sm90(ks, tmp_path).asm["cubin"], tmp_path)
        assert any("HGMMA" in ln for ln in sass)
        assert not [ln for ln in sass if re.search(r"\b(LDL|STL)\b", ln)]


def test_zero_where_compiles_for_sm90_without_spills(tmp_path):
    """DeBERTa-v3-base's attention (fp16, 12 heads of 64, a [B, 1, S, S] padding mask read as a
    tile for the score program and again for Where(m, 0, P)) on the b8 heuristic tile: ptxas
    compiles it with tensor-core products and no local loads or stores."""
    pytest.importorskip("triton")
    prog = parse(f"{HEADER}\n{PADDED.replace('{lowest}', '-65504.0').format(dt='f16')}\n")
    spec = AttentionSpec("k_attention_zero", prog, 64, 64, batch_heads=96, sq=128, sk=128, zero_where=0)
    ks = generate_attention(spec, attention_variants(spec)[0])
    sass = sass_lines(compile_sm90(ks, tmp_path).asm["cubin"], tmp_path)
    assert any("HGMMA" in ln or "HMMA" in ln for ln in sass)
    assert not [ln for ln in sass if re.search(r"\b(LDL|STL)\b", ln)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_bf16_rounding_fix, _install_gpu_max_semantics, _install_libdevice_shims
        from tests.test_rows_codegen import install_index_fix

        def install_bf16_dot_fix() -> None:
            """Triton 3.6's interpreter multiplies bfloat16 operands as their uint16 bit patterns
            (it stores bf16 as uint16); widen them to float32 first, as the tensor cores do."""
            import triton.language as tl
            from triton.runtime import interpreter
            from triton.runtime.interpreter import TensorHandle

            builder = interpreter.InterpreterBuilder
            create_dot = builder.create_dot

            def widened(x):
                if x.dtype.scalar == tl.bfloat16:
                    data = (x.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
                    return TensorHandle(data, tl.float32)
                return x

            builder.create_dot = lambda self, a, b, d, *args: create_dot(self, widened(a), widened(b), d, *args)

        _install_libdevice_shims()
        _install_bf16_rounding_fix()
        _install_gpu_max_semantics()
        install_index_fix()  # the key loop's bound is a run-time scalar
        install_bf16_dot_fix()
        run_all(Path(sys.argv[2]), "cpu")
