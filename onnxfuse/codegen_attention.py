"""Code generation for FusedAttention (docs/format.md): scaled dot-product attention with its
score program (scale, mask), as Triton source text.

A FusedAttention node computes Y = softmax(program(Q @ K^T, extras...)) @ V over the last
axis, the operands read through strides (the Transposes that made the heads are absorbed).
The kernel is the Triton tutorial's fused attention (flash attention's forward pass): program
(i, j) holds BLOCK_M query rows of batch-head j, loops over the keys in blocks of BLOCK_N,
computes the score tile with one `tl.dot`, runs the score program on it, and keeps a running
max and sum (the online softmax) with the fp32 accumulator of P @ V.

With a projection bias (the node's `bias_q`, `bias_k`, `bias_v`: the packed projection's Add,
absorbed), the head's slice of the bias, a [HEAD_D] (or [HEAD_DV]) vector loaded once, is added
to each Q, K^T and V tile in fp32 and the sum rounded to the operand's dtype, as the original's
Add stores it, before anything else reads the tile (the TF32 rounding, `tl.dot`). The masked
rows and columns of a tile then hold the bias instead of 0: keys past Sk are masked to -inf in
the scores (their p is 0), and query rows past Sq are never stored; padded head dims stay 0.

Per key block: the K^T tile [HEAD_D, BLOCK_N] and `tl.dot` with the Q tile (loaded once), fp32
sums; %0 is that product rounded to Q's dtype, as the original's MatMul stores it (kept fp32
with the node's `exact_scores`, and so is the program's output below: the two roundings make
most of a 16-bit kernel's error against the math; not written by default,
`kinds.attention.EXACT_SCORES_DTYPES`); the score
program on the [BLOCK_M, BLOCK_N] tile in fp32, its extras read through their four strides over
[B, H, Sq, Sk] (0 on a broadcast dim; a bool extra as int8, != 0; one whose static shape has 1
on the query or key dim loaded as the vector over the keys or queries it is, then broadcast:
BERT's key mask [B, 1, 1, Sk] read as a tile made BERT-base b8's fp16 kernel 2504 SASS
instructions, 28 of them barriers; read as a row, 1816 and 5; and as a [1, BLOCK_N] row rather
than a vector, the 64 x 128 tile spilled (341 local loads and stores, 19.2 µs on the H200
against 6.3: `attention-extra-loads`)); its output
rounded to its dtype, as the original stores the Softmax's input; keys past Sk set to -inf.
Then the online
softmax in fp32 (m_i, l_i, acc rescaled by exp(m_old - m_new)), and acc += P @ V with P in V's
dtype. At the end Y = acc / l_i, cast to Y's dtype (round to nearest even). Head dims are
constexprs (D, Dv), the tiles' HEAD_D, HEAD_DV the next powers of two >= max(16, D), the padding
masked to 0.

Rounding of the probabilities: the original stores softmax's normalized P in V's dtype and
multiplies that; here P is unnormalized while the keys are swept (exp(s - running max)), so it
is P * l (l the row's sum so far, over the max so far) that is rounded to V's dtype (float16,
bfloat16; TF32 for float32 at precision tf32) before `tl.dot`, and the division by l comes
after the product. The two differ by at most one rounding step of that dtype per probability
(relative), which is what flash attention does; the fp32 sums and the single rounding of Y are
as the contract says. Float32 at precision tf32 rounds Q, K^T, P and V to the nearest TF32
value in the kernel (`codegen_conv.ROUND_TO_TF32`: Triton's tf32 dot would truncate).

Causal masks (`extras_broadcast` "causal", "causal_add": a constant mask, lower-triangular
with offset Sk - Sq) are computed from the indices, not loaded. With `causal_fill` (the score
program's value c where a bool causal mask is false, one value whatever the scores), the key
loop runs in two parts: first the blocks up to the program's last row's diagonal, then the
blocks past it only where some valid row's running max is not above c + CAUSAL_MARGIN. Past
the diagonal every score is c, and exp(c - max) is 0 in fp32 once max > c + 103.3 (the
smallest subnormal is e^-103.3), in the kernel and in the original's Softmax alike, so
skipping those blocks changes nothing; a row that is itself all masked (Sk < Sq) or whose
scores lie below c keeps every block. An additive causal mask gets no skipping: a NaN or inf
score stays what it is under the addition.

With `zero_where` (the original's Where(m, 0, P) after its Softmax, m a bool extra: DeBERTa's
XSoftmax in Hugging Face transformers 4), each key block's p are added to the row's sum first
and then set to 0 where m is true, before P @ V: the softmax's denominator holds every key, the
product only the kept ones; a row whose keys are all so masked gives Y = acc (the sum of 0 * V),
not acc / l (0 / 0 where its scores were all -inf), as the original's zeroed P gives.

Special values as ONNX's Softmax: a row whose scores are all -inf gives 0 / 0 = NaN (its
running max stays -inf: the shift is 0 then, so that exp gives 0, not exp(-inf + inf)); a NaN
score makes its exp NaN and so its row's sum and Y (tl.max may drop the NaN from the running
max, but the NaN reaches the sum through p); a +inf score makes the max +inf and its own
exp(inf - inf) NaN, so the row is NaN, as numpy's and ONNX Runtime's softmax give.

The exps are `tl.exp` (ex2.approx of x * log2(e) on the GPU: a few ulp where the probability
matters, the arguments being <= 0); for 16-bit Q, exp2 of s * log2(e) - m * log2(e), one FMA
(`AttentionVariant.exp2`). With `peel`, the key blocks wholly inside Sk run without key masks
and the partial one after them (in blocks of `tail_n` keys where set). Compiled for sm_90 on
the CPU (ptxas -v on the PTX, the heuristic's tiles, an additive mask): both products on wgmma, no
spills; float16 D 64 (128 x 64, 8 warps) 209 registers, float32 tf32 D 64 (64 x 32, 4 warps)
205, D 128 254 and 255. Every stride is a run-time value (the ABI), so a unit stride along D is
not known to the compiler: float16 / bfloat16 tiles are loaded element by element (ld.global.b16,
no cp.async pipelining; float32's go through 4-byte cp.async). A variant that assumes
stride_qd = stride_kd = stride_vd = stride_yd = 1 (checked by the launcher) is the obvious next
step once a GPU times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from onnxfuse.codegen import (
    POINTER_TYPES,
    TL_DTYPES,
    KernelSource,
    _comment_text,
    _literal,
    check_kernel_name,
    helper_lines,
)
from onnxfuse.codegen_conv import PRECISIONS, ROUND_TO_TF32
from onnxfuse.codegen_gemm import SMS
from onnxfuse.codegen_rows import _program_lines
from onnxfuse.expr import Program

INT_TYPE = "i32"
MAX_ELEMENTS = 2**31 - 1
# A score this far below its row's max has exp(score - max) = 0 in fp32 (below e^-103.3, the
# smallest subnormal), in the kernel and in the original's Softmax: skipping it changes nothing.
CAUSAL_MARGIN = 128.0
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionSpec:
    """What a FusedAttention kernel computes (docs/format.md, FusedAttention)."""

    kind: ClassVar[str] = "attention"  # the Kind whose kernel it is (onnxfuse.kinds.attention)
    name: str
    program: Program  # %0: the scores Q @ K^T (Q's dtype), then the extras -> one output
    head_d: int  # D, Q's and K^T's contracted dim (a constexpr)
    head_dv: int  # Dv, V's and Y's last dim (a constexpr)
    precision: str = "tf32"  # float32 operands: tl.dot's input_precision (TF32 rounded to nearest)
    # sizes when static, for the tile heuristic: B * H, Sq, Sk
    batch_heads: int | None = None
    sq: int | None = None
    sk: int | None = None
    source_nodes: tuple[str, ...] = ()
    # the node's rank and perm_q, perm_k, perm_v, perm_y (kernel_meta repeats them)
    rank: int = 4
    perms: tuple[tuple[int, ...], ...] = ()
    nan_to_zero: bool = False  # NaN probabilities read as 0 (a row of them: Y = 0)
    # Q, K^T, V each read with its projection's bias added (the node's bias_q, bias_k, bias_v)
    bias: tuple[bool, bool, bool] = (False, False, False)
    # per extra, how the kernel reads it: "m" one row for every query (its static dim there is 1:
    # a key mask [B, 1, 1, Sk]), "n" one column for every key, "mn" one element per batch and
    # head, "" a full tile (or unknown); "row" its first query row for every query (its rows
    # are equal: a key mask expanded to [B, 1, Sq, Sk]); "causal" not read but computed from the
    # indices (a constant bool mask, key j kept where j <= i + Sk - Sq, the same for every batch
    # and head), "causal_add" likewise for an additive one (0 kept, `causal_masked` elsewhere)
    extras_broadcast: tuple[str, ...] = ()
    # with a causal extra: the score program's output where that mask is false, whatever the
    # scores (GPT-2's Where: -10000), when it is one value; key blocks wholly past a program's
    # diagonal are then skipped while every row's max is CAUSAL_MARGIN above it. None: no skipping
    causal_fill: float | None = None
    # the value of a "causal_add" extra (an additive causal mask: 0 where kept) past the diagonal
    causal_masked: float | None = None
    # grouped-query attention: K and V have H / kv_group heads, query head h reads head h // kv_group
    kv_group: int = 1
    # the extra m of a Where(m, 0, P) after the softmax (a bool mask the score program need not
    # read): each p where m is true set to 0 after its row's sum took it (None: no such Where)
    zero_where: int | None = None
    # the node's exact_scores: the scores kept in fp32 from the product through the score program
    # to the softmax, not rounded to Q's dtype after the product and at the program's output as
    # the original stores them (`attention-exact-scores`)
    exact_scores: bool = False

    @property
    def dtype(self) -> str:
        """Q's, K's and V's dtype (and Y's)."""
        return self.program.input_dtypes[0]

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - 1

    @property
    def tf32(self) -> bool:
        """Float32 operands multiplied at precision "tf32" (rounded to nearest first)."""
        return self.dtype == "f32" and self.precision == "tf32"

    def broadcast(self, i: int) -> str:
        """How extra i is read (one of EXTRA_READS; `extras_broadcast`)."""
        return self.extras_broadcast[i] if i < len(self.extras_broadcast) else ""

    @property
    def biased(self) -> tuple[str, ...]:
        """The operands read with a bias added, of "q", "k", "v" in that order."""
        return tuple(w for w, b in zip("qkv", self.bias, strict=True) if b)


@dataclass(frozen=True)
class AttentionVariant:
    """One binary of a FusedAttention kernel: its tile, and what the launcher checks.

    aligned: the head dims of Q, K^T, V and Y are contiguous (stride 1: the kernel's loads along
    them vectorize) and their other strides multiples of 16 elements, the pointers 16-byte
    aligned (`requires` ptr_align, the launcher's own `stride_multiple`); the variant after it,
    the same tile unaligned, takes any strides."""

    index: int = 0
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    aligned: bool = False
    # V's tile loaded with K^T's, before the scores (`attention-v-first`), not after the softmax
    v_first: bool = False
    # the key blocks wholly inside Sk swept without key masks, the last partial one after them
    # (`attention-peel`)
    peel: bool = False
    # p = exp2(s * log2(e) - m * log2(e)): one FMA and the ex2 an element, for 16-bit Q only
    # (float32 keeps exp(s - m): `attention-exp2`)
    exp2: bool = True
    # with peel: the partial key block swept in blocks of this many keys (16, 32, ...; below
    # BLOCK_N), not one of BLOCK_N: ViT's 197 keys as 128 + 5 x 16, not 2 x 128 (`attention-peel`)
    tail_n: int = 0

    def requires(self) -> dict[str, int]:
        return {"max_elements": MAX_ELEMENTS, **({"ptr_align": 16} if self.aligned else {})}

    def meta(self) -> dict[str, int]:
        return {"block_m": self.block_m, "block_n": self.block_n, "stride_multiple": 16 if self.aligned else 1}

    def grid(self, sq: int, batch_heads: int) -> tuple[int, int]:
        """The launch grid, as the C++ launcher computes it."""
        return -(-sq // self.block_m), batch_heads

    @property
    def label(self) -> str:
        opts = ["peel"] if self.peel else []
        opts += [f"tail {self.tail_n}"] if self.tail_n else []
        opts += [] if self.exp2 else ["exp"]
        return (f"tile {self.block_m}x{self.block_n}, {self.num_warps} warps, {self.num_stages} stages"
                + "".join(f", {n}" for n in opts))


def attention_param_names(spec: AttentionSpec) -> list[str]:
    """Kernel parameters in launch order (docs/format.md, kind attention), without constexprs."""
    names = ["q_ptr", "k_ptr", "v_ptr", *(f"e{i}_ptr" for i in range(spec.n_extras)),
             *(f"b{w}_ptr" for w in spec.biased), "y_ptr", "H", "SQ", "SK"]
    names += ["stride_qb", "stride_qh", "stride_qm", "stride_qd", "stride_kb", "stride_kh", "stride_kd", "stride_kn",
              "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_yb", "stride_yh", "stride_ym", "stride_yd"]
    for i in range(spec.n_extras):
        names += [f"stride_e{i}_b", f"stride_e{i}_h", f"stride_e{i}_m", f"stride_e{i}_n"]
    names += [f"stride_b{w}h" for w in spec.biased]
    return names


# ---------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------

def padded(n: int) -> int:
    """A head dim as the kernel's tiles hold it: the next power of two >= max(16, n)."""
    p = 16
    while p < n:
        p *= 2
    return p


# Tiles (block_m, block_n, num_warps, num_stages), measured on the H200 (fourteenth session,
# `attention_roofline.py`; BENCHMARKS.md, Decisions, `attention-tiles`): BERT-, GPT-2- and
# ViT-shaped heads (D 64, 128 or 197 tokens) at batch 1 and 8, fp16 and fp32, eleven tiles each.
# - float16 / bfloat16 start from the Triton tutorial's Hopper tile (128 x 64, 8 warps, 3
#   stages), half of it for heads wider than 128; a static grid cdiv(Sq, BLOCK_M) * B * H of
#   fewer than SMS programs halves BLOCK_M (to 16 at least, at most 4 warps below 128 rows).
#   At 16 rows the key blocks widen to 128 (2 stages) for heads up to 64: batch 1 ran 3.5-4.3 µs
#   against 3.9-4.8 at 16 x 64.
# - float32 holds its tiles in registers at twice the bytes: 32 query rows (16 where that grid
#   leaves SMs idle), K and V blocks of at most 8192 elements (BLOCK_N * D). 16 rows take key
#   blocks of 128 (16 x 128: batch 1 ran 4.4-6.4 µs against 5.6-9.0 at 16 x 32, fourteenth
#   session). 32 rows took 64 keys (10.3-14.6 µs at batch 8 against 15.3-21.6 at 64 x 32, the
#   fourteenth session's kernel); since the kernel adds the projections' biases and rounds Q,
#   K^T, P and V to nearest TF32 in registers, 32 x 32 has been the fastest in the models
#   (thirty-sixth session, H100, tuning's bundled CUPTI times: BERT-base b8 14.3 µs against
#   22.6 at 32 x 64, ViT-S/16 b8 17.4 against 25.6; twenty-first session, H200: 40% faster).
# Where Sq or B * H is not static the grid is unknown and BLOCK_M is not halved.
PEEL = "peel"  # a tile's fifth field: the full key blocks without key masks (`AttentionVariant.peel`)
HALF_TILE = {"narrow": (128, 64, 8, 3), "wide": (64, 64, 4, 2)}  # head_d, head_dv <= 128, else
HALF_SMALL_M = (16, 128, 4, 2)  # 16 query rows, heads up to 64
# Thirty-fifth session (H100, tuning's bundled CUPTI times of the kernel in the model, fp16): where
# the halving gives 64 query rows of a narrow head, the tile that took them, 64 x 64 on 3 stages,
# ran 10.3 µs a layer at BERT-base b8 and 10.7 at ViT-S b8 against 6.9 and 7.9 for 64 x 64 on one
# stage with the full key blocks unmasked (`attention-peel`; the best of five: 6.5 and 7.9); alone
# (thirty-fourth session) GPT-2's causal 64 x 64 5.92 µs on one stage against 6.50 on three.
HALF_64 = (64, 64, 4, 1, PEEL)
F32_BLOCK_M, F32_KV = 32, 8192
F32_BLOCK_N = {32: 32, 16: 128}  # key block by query rows, before the K / V bound
# the tiles tuning times besides the heuristic's, in this order (up to CANDIDATES in all).
# fp16, twenty-third session (`benchmarks/attention_tiles.py`, H200, alone, L2 warm, the key mask
# loaded as a vector): at b8 32 x 128 (2 stages), 64 x 128 and 128 x 128 (8 warps) on 1 stage
# were the fastest (BERT-base 6.08, 6.27 and 6.24 µs, ViT-S 8.54, 8.58 and 8.64, against the
# heuristic's 64 x 64's 7.62 and 9.22); at b1 the heuristic's 16 x 128 (3.36, 4.26), then 32 x
# 128 (3.97, 5.47). cuDNN's 64 x 128 (4 warps) had spilled where a key mask was read as a
# [1, BLOCK_N] tile (19.2 µs at BERT b8: `attention-extra-loads`), hence its earlier absence.
# Thirty-fourth session (H100, `attention_tiles.py --options`, exp2 in every tile): the 1-stage
# tiles with the full key blocks unmasked and the partial one in blocks of BLOCK_N / 4
# (`attention-peel`: "peel" below) were the fastest at b8: BERT-base 64 x 128 5.63 µs against
# 6.05 for the best unpeeled tile (cuDNN 5.10), ViT-S 64 x 64 7.20 against 8.38 (cuDNN 5.76);
# at b1 16 x 128 peeled 3.20 against 3.26 at BERT-base, but 6.14 against 4.10 at ViT-S (its 69
# keys past 128 in five blocks), so both stay candidates. Errors as unpeeled (max against the
# math 0.0014 at BERT-base b8, 0.0011 at ViT-S b8; cuDNN's 0.00043, 0.00027).
# float32 (thirty-seventh session, H100, `attention_tiles.py --dtype fp32`, alone, L2 warm): BERT-base
# b8 32 x 64 10.3 µs (32 x 32 11.1), ViT-S b8 32 x 64 peeled 15.8 (unpeeled 23.3, 32 x 32 16.5), b1
# 16 x 128 4.4 / 6.7 (16 x 64 5.5 / 7.2); in the models tuning's times differ (32 x 64 took 20.9
# µs at BERT-base b8, 32 x 32 15.8; GPT-2 b8 32 x 64 13.2, 32 x 32 14.9), so these are timed there:
ALTERNATIVES = {
    "f32": ((32, 64, 4, 2), (32, 64, 4, 2, PEEL), (16, 128, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2),
            (16, 64, 4, 2, PEEL), (16, 128, 4, 2, PEEL), (32, 32, 4, 2, PEEL)),
    "f16": ((64, 128, 4, 1, PEEL), (64, 64, 4, 1, PEEL), (32, 128, 4, 2), (16, 128, 4, 2, PEEL),
            (128, 128, 8, 1, PEEL), (32, 64, 4, 2), (64, 64, 4, 1), (128, 128, 8, 1), (64, 128, 4, 1),
            (16, 128, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3)),
}
CANDIDATES = {"f16": 5, "f32": 8}  # the heuristic's tile and four (seven) others


def _variants(tile: tuple) -> tuple[AttentionVariant, AttentionVariant]:
    """The tile (block_m, block_n, num_warps, num_stages[, PEEL]) aligned (index 0), then
    unaligned (index 1); V loaded after the softmax (no shipped variant sets `v_first`:
    `attention-v-first`); peeled, the partial key block in blocks of BLOCK_N / 4 (16 at least)."""
    bm, bn, w, s, *opt = tile
    peel = {"peel": True, "tail_n": max(16, bn // 4)} if opt == [PEEL] and bn > 16 else {}
    return tuple(AttentionVariant(index=i, block_m=bm, block_n=bn, num_warps=w, num_stages=s, aligned=i == 0,
                                  **peel) for i in range(2))


def _block_m(spec: AttentionSpec, bm: int) -> int:
    """bm halved (to 16 at least) while a static grid leaves SMs idle."""
    if spec.sq is not None and spec.batch_heads is not None:
        while bm > 16 and -(-spec.sq // bm) * spec.batch_heads < SMS:
            bm //= 2
    return bm


def _heuristic_tile(spec: AttentionSpec) -> tuple:
    d = padded(max(spec.head_d, spec.head_dv))
    if spec.dtype == "f32":
        bm = _block_m(spec, F32_BLOCK_M)
        bn = max(16, min(F32_BLOCK_N[bm], F32_KV // d))
        return bm, bn, 4, 2
    bm, bn, w, s = HALF_TILE["narrow" if d <= 128 else "wide"]
    bm = _block_m(spec, bm)
    if bm == 16 and d <= 64:
        return HALF_SMALL_M
    if bm == 64 and d <= 128:
        return HALF_64
    return bm, bn, (w if bm >= 128 else min(w, 4)), s


def attention_variants(spec: AttentionSpec) -> tuple[AttentionVariant, ...]:
    """The variants of a FusedAttention kernel: one tile, by the measured heuristic above
    (`HALF_TILE`, `F32_BLOCK_M`: BLOCK_M halved while a static grid leaves SMs idle), aligned
    then not."""
    return _variants(_heuristic_tile(spec))


def attention_candidates(spec: AttentionSpec) -> list[tuple[str, tuple[AttentionVariant, ...]]]:
    """(label, variants) per configuration `--tune` times: the heuristic's first, then up to
    CANDIDATES - 1 alternative tiles (each aligned then not) other than the heuristic's."""
    out: list[tuple[str, tuple[AttentionVariant, ...]]] = [("default", attention_variants(spec))]
    seen = {_heuristic_tile(spec)}
    kind = "f32" if spec.dtype == "f32" else "f16"
    for tile in ALTERNATIVES[kind]:
        if tile in seen or len(out) == CANDIDATES[kind]:
            continue
        seen.add(tile)
        vs = _variants(tile)
        out.append((vs[0].label, vs))
    return out


# ---------------------------------------------------------------------------------------
# kernel source
# ---------------------------------------------------------------------------------------

EXTRA_READS = ("", "m", "n", "mn", "row", "causal", "causal_add")  # AttentionSpec.extras_broadcast's values


def _check(spec: AttentionSpec, variant: AttentionVariant) -> None:
    check_kernel_name(spec.name)
    spec.program.validate()
    if spec.dtype not in ("f32", "f16", "bf16"):
        raise ValueError(f"{spec.name}: Q's dtype {spec.dtype!r} is not f32, f16 or bf16")
    if len(spec.program.outputs) != 1:
        raise ValueError(f"{spec.name}: the score program must have one output, it has {len(spec.program.outputs)}")
    if spec.precision not in PRECISIONS:
        raise ValueError(f"precision {spec.precision!r} is not one of {PRECISIONS}")
    if spec.head_d < 1 or spec.head_dv < 1:
        raise ValueError(f"{spec.name}: head dims must be at least 1: D {spec.head_d}, Dv {spec.head_dv}")
    for v in (variant.block_m, variant.block_n, variant.num_warps):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"tile sizes and num_warps must be powers of two: {variant}")
    if min(variant.block_m, variant.block_n) < 16:
        raise ValueError(f"tl.dot needs tiles of at least 16: {variant}")
    if variant.tail_n and not (variant.peel and 16 <= variant.tail_n < variant.block_n
                               and not variant.tail_n & (variant.tail_n - 1)):
        raise ValueError(f"tail_n needs peel and a power of two from 16 below BLOCK_N: {variant}")
    if variant.num_stages < 1:
        raise ValueError(f"num_stages must be at least 1: {variant}")
    if len(spec.extras_broadcast) > spec.n_extras or not set(spec.extras_broadcast) <= set(EXTRA_READS):
        raise ValueError(f"{spec.name}: extras_broadcast {spec.extras_broadcast} is not one of {EXTRA_READS} "
                         f"per extra ({spec.n_extras})")
    if spec.zero_where is not None and not (0 <= spec.zero_where < spec.n_extras
                                            and spec.program.input_dtypes[1 + spec.zero_where] == "bool"):
        raise ValueError(f"{spec.name}: zero_where {spec.zero_where} is not one of the {spec.n_extras} extras, "
                         "or not a bool one")
    causal = [i for i, b in enumerate(spec.extras_broadcast) if b == "causal"]
    if causal and spec.program.input_dtypes[1 + causal[0]] != "bool":
        raise ValueError(f"{spec.name}: a causal extra must be bool")
    if ("causal_add" in spec.extras_broadcast) != (spec.causal_masked is not None):
        raise ValueError(f"{spec.name}: a causal_add extra needs causal_masked, and only it")
    if spec.causal_fill is not None and len(causal) != 1:
        raise ValueError(f"{spec.name}: causal_fill needs one causal extra, there are {len(causal)}")


def generate_attention(spec: AttentionSpec, variant: AttentionVariant) -> KernelSource:
    """The Triton kernel of a FusedAttention node for one variant (docs/format.md, kind attention)."""
    _check(spec, variant)
    names = attention_param_names(spec)
    ptr = POINTER_TYPES[spec.dtype]
    types = [ptr] * 3 + [POINTER_TYPES[d] for d in spec.program.input_dtypes[1:]] + [ptr] * len(spec.biased) + [ptr]
    types += [INT_TYPE] * (len(names) - len(types))
    constexprs = (("BLOCK_M", variant.block_m), ("BLOCK_N", variant.block_n), ("HEAD_D", padded(spec.head_d)),
                  ("HEAD_DV", padded(spec.head_dv)), ("D", spec.head_d), ("DV", spec.head_dv))
    source = _module(spec, names, [c for c, _ in constexprs], variant)
    divisible: tuple[int, ...] = ()
    if variant.aligned:  # the pointers and the strides the launcher checked (not the extras')
        divisible = tuple(i for i, p in enumerate(names) if p.endswith("_ptr") or p in ALIGNED_STRIDES)
    return KernelSource(name=spec.name, source=source, params=tuple(zip(names, types, strict=True)),
                        constexprs=constexprs, divisible=divisible, num_warps=variant.num_warps, variant=variant,
                        num_stages=variant.num_stages)


# An aligned variant's strides of Q, K^T, V and Y that are multiples of 16 (their head dims' are 1),
# and the biases' head strides
ALIGNED_STRIDES = frozenset({"stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh", "stride_kn",
                             "stride_vb", "stride_vh", "stride_vn", "stride_yb", "stride_yh", "stride_ym",
                             "stride_bqh", "stride_bkh", "stride_bvh"})


def _precision_text(spec: AttentionSpec) -> str:
    if spec.dtype != "f32":
        return f"{spec.dtype} products on the tensor cores, fp32 sums and softmax"
    if spec.precision == "tf32":
        return "tf32: Q, K^T, the probabilities and V rounded to nearest TF32 as cuBLAS does, fp32 sums"
    return f"fp32 operands, dot precision {spec.precision}"


def _module(spec: AttentionSpec, names: list[str], constexprs: list[str], variant: AttentionVariant) -> str:
    lines = [f"# {spec.name}: generated by onnxfuse.codegen_attention; do not edit.", "#",
             "# Y[B, H, Sq, Dv] = softmax(scores(Q @ K^T, extras...)) @ V over the keys, the online softmax of",
             f"# flash attention; Q [B, H, Sq, {spec.head_d}], K^T [B, H, {spec.head_d}, Sk], "
             f"V [B, H, Sk, {spec.head_dv}], all through strides;",
             f"# {_precision_text(spec)}.", "#", "# Replaces the ONNX nodes:"]
    if spec.biased:
        lines[-1:-1] = [f"# {', '.join(BIASED[w] for w in spec.biased)} read with the projection's bias added "
                        "(the absorbed Add).", "#"]
    lines += [f"#   {_comment_text(s)}" for s in spec.source_nodes] or ["#   (none listed)"]
    lines += ["#", "# Score program (%0 is Q @ K^T, rounded to Q's dtype; then the extra inputs):"]
    lines += [f"#   {ln}" for ln in spec.program.to_text().splitlines()]
    lines += ["", "import triton", "import triton.language as tl", "from triton.language.extra import libdevice"]
    lines += helper_lines(spec.program)
    if spec.tf32:
        lines += ["", "", *ROUND_TO_TF32]
    lines += ["", "", "@triton.jit", f"def {spec.name}("]
    ptrs = [p for p in names if p.endswith("_ptr")]
    lines.append(f"    {', '.join(ptrs)},")
    lines.append(f"    {', '.join(names[len(ptrs):len(ptrs) + 3])},")
    strides = names[len(ptrs) + 3:]
    for i in range(0, len(strides), 4):
        lines.append(f"    {', '.join(strides[i:i + 4])},")
    lines += [f"    {', '.join(f'{c}: tl.constexpr' for c in constexprs)},", "):"]
    lines += ["    " + ln if ln else "" for ln in _body(spec, variant)]
    return "\n".join(lines) + "\n"


BIASED = {"q": "Q", "k": "K^T", "v": "V"}


def _bias_lines(spec: AttentionSpec, w: str, tile: str, axis: str) -> list[str]:
    """`tile` += the head's bias vector b{w} along `axis` ("[None, :]": the tile's columns, "[:, None]":
    its rows), in fp32, rounded to the operand's dtype as the original's Add stores it."""
    if spec.dtype == "f32":
        return [f"{tile} = {tile} + b{w}{axis}"]
    return [f"{tile} = ({tile}.to(tl.float32) + b{w}.to(tl.float32){axis}).to({TL_DTYPES[spec.dtype]}, "
            'fp_downcast_rounding="rtne")']


def _bias_load(spec: AttentionSpec, w: str) -> str:
    """The head's slice of operand w's bias: HEAD_D (HEAD_DV for V) elements from b{w}_ptr."""
    offs, dim, pad = ("offs_dv", "DV", spec.head_dv) if w == "v" else ("offs_d", "D", spec.head_d)
    mask = f", mask={offs} < {dim}, other=0.0" if pad != padded(pad) else ""
    head = "h" if w == "q" else _kv_head(spec)
    return f"b{w} = tl.load(b{w}_ptr + {head} * stride_b{w}h + {offs}{mask})"


def _kv_head(spec: AttentionSpec) -> str:
    """The head of K and V a program reads: its own, or its group's (`kv_group`)."""
    return "h_kv" if spec.kv_group > 1 else "h"


def _dot(spec: AttentionSpec, a: str, b: str, acc: str | None = None) -> str:
    args = f"{a}, {b}" + (f", {acc}" if acc else "")
    if spec.dtype == "f32":
        return f'tl.dot({args}, input_precision="{spec.precision}")'
    return f"tl.dot({args})"


def _body(spec: AttentionSpec, variant: AttentionVariant) -> list[str]:
    dt, aligned = spec.dtype, variant.aligned

    def step(name: str) -> str:  # a head dim's stride: 1 in an aligned variant (checked by the launcher)
        return "" if aligned else f" * {name}"
    d_mask = spec.head_d != padded(spec.head_d)
    dv_mask = spec.head_dv != padded(spec.head_dv)
    q_mask = "row_ok[:, None]" + (" & (offs_d[None, :] < D)" if d_mask else "")
    k_mask = ("(offs_d[:, None] < D) & " if d_mask else "") + "col_ok[None, :]"
    v_mask = "col_ok[:, None]" + (" & (offs_dv[None, :] < DV)" if dv_mask else "")
    y_mask = "row_ok[:, None]" + (" & (offs_dv[None, :] < DV)" if dv_mask else "")
    out = ["# Program (i, j): query rows [i * BLOCK_M, (i + 1) * BLOCK_M) of batch j // H, head j % H.",
           "pid_m = tl.program_id(axis=0)",
           "pid_bh = tl.program_id(axis=1).to(tl.int64)",
           "b = pid_bh // H",
           "h = pid_bh % H",
           *([f"h_kv = h // {spec.kv_group}  # grouped-query attention: {spec.kv_group} query heads share K and V"]
             if spec.kv_group > 1 else []),
           "q_base = q_ptr + b * stride_qb + h * stride_qh",
           f"k_base = k_ptr + b * stride_kb + {_kv_head(spec)} * stride_kh",
           f"v_base = v_ptr + b * stride_vb + {_kv_head(spec)} * stride_vh",
           "y_base = y_ptr + b * stride_yb + h * stride_yh",
           *(f"e{i}_base = e{i}_ptr + b * stride_e{i}_b + h * stride_e{i}_h" for i in range(spec.n_extras)),
           "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
           "offs_d = tl.arange(0, HEAD_D)" + ("  # D padded to a power of two" if d_mask else ""),
           "offs_dv = tl.arange(0, HEAD_DV)" + ("  # Dv padded to a power of two" if dv_mask else ""),
           "row_ok = offs_m < SQ",
           "",
           "# The Q tile, loaded once.",
           *(["# Aligned: the head dims are contiguous (stride 1), so the loads along them vectorize."]
             if aligned else []),
           f"q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :]{step('stride_qd')}, mask={q_mask}, "
           "other=0.0)"]
    if spec.biased:
        out += ["# The projection's bias (the absorbed Add): this head's slice, loaded once, added to each",
                "# tile in fp32 and rounded to the operand's dtype as the Add stores it. Masked rows and keys",
                "# then hold the bias, not 0: keys past SK score -inf (their p are 0), rows past SQ are not stored.",
                *(_bias_load(spec, w) for w in spec.biased)]
    if "q" in spec.biased:
        out += _bias_lines(spec, "q", "q", "[None, :]")
    if spec.tf32:
        out += ["q = round_to_tf32(q)  # to nearest, as cuBLAS does (tl.dot's tf32 would truncate)"]
    out += ["",
            "# The online softmax, in fp32: m_i the running row max, l_i the running sum of",
            "# exp(score - m_i), acc the running P @ V (unnormalized).",
            'm_i = tl.full([BLOCK_M], float("-inf"), tl.float32)',
            "l_i = tl.zeros([BLOCK_M], dtype=tl.float32)",
            "acc = tl.zeros([BLOCK_M, HEAD_DV], dtype=tl.float32)",
            *(["kept_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # keys not zeroed by Where(m, 0, P)"]
              if spec.zero_where is not None else [])]
    loop = _key_block(spec, variant, step, k_mask, v_mask)
    if spec.causal_fill is None and variant.peel:
        full = _key_block(spec, variant, step, "(offs_d[:, None] < D)" if d_mask else None,
                          "(offs_dv[None, :] < DV)" if dv_mask else None, full=True)
        out += ["# The key blocks wholly inside SK without key masks, then the partial one (if any).",
                "full_n = (SK // BLOCK_N) * BLOCK_N",
                "for start_n in range(0, full_n, BLOCK_N):", *_indent(full)]
        # the partial block as a loop (one block of BLOCK_N keys without tail_n), not under an `if`:
        # with the `if`, the 2-stage 32 x 128 tile ran BERT-base b8 in 9.18 µs on the H100, where
        # no key block is partial (neither form runs its tail), against 6.24 / 6.07 with a loop of
        # blocks of 32 / 16; ViT-S b8 12.06 against 9.57 (blocks of 32)
        tail = loop if not variant.tail_n else _key_block(spec, variant, step, k_mask, v_mask,
                                                          block=str(variant.tail_n))
        out += [f"for start_n in range(full_n, SK, {variant.tail_n or 'BLOCK_N'}):", *_indent(tail)]
    elif spec.causal_fill is None:
        out += ["for start_n in range(0, SK, BLOCK_N):", *_indent(loop)]
    else:
        out += ["# Causal (module docstring): the key blocks up to this program's last row's diagonal, then",
                "# the blocks past it only where some row's max is not far enough above the fill value",
                "# (their exps are then not all 0).",
                "hi = tl.maximum(tl.minimum(SK, tl.minimum((pid_m + 1) * BLOCK_M, SQ) + SK - SQ), 0)",
                "for start_n in range(0, hi, BLOCK_N):", *_indent(loop),
                "start_rest = tl.cdiv(hi, BLOCK_N) * BLOCK_N",
                'lowest = tl.min(tl.where(row_ok, m_i, float("inf")), axis=0)',
                f"end_rest = tl.where(lowest > {_literal(spec.causal_fill)} + {CAUSAL_MARGIN}, start_rest, SK)",
                "for start_n in range(start_rest, end_rest, BLOCK_N):", *_indent(loop)]
    y = "y" if dt == "f32" else f'y.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne")'
    out += ["",
            "# Normalize (a row of -inf: 0 / 0 = NaN) and store, cast to Y's dtype.",
            "y = tl.div_rn(acc, l_i[:, None])",
            *(["# Every p of the row zeroed by Where(m, 0, P): Y is the sum of 0 * V (0 where V is finite),",
               "# not 0 / l_i (NaN where the row's scores were all -inf).",
               "y = tl.where((kept_i > 0.0)[:, None], y, acc)"] if spec.zero_where is not None else []),
            *(["# NaN probabilities read as 0 (the original's Where(IsNaN(P), 0, P)): a row's softmax is NaN",
               "# in all its elements or in none, and its sum is then 0 (a row of -inf) or NaN.",
               "y = tl.where(((l_i == 0.0) | (l_i != l_i))[:, None], 0.0, y)"] if spec.nan_to_zero else []),
            f"tl.store(y_base + offs_m[:, None] * stride_ym + offs_dv[None, :]{step('stride_yd')}, {y}, "
            f"mask={y_mask})"]
    return out



def _indent(lines: list[str]) -> list[str]:
    return [f"    {ln}" if ln else ln for ln in lines]


def _masked(mask: str | None) -> str:
    return f", mask={mask}, other=0.0" if mask else ""


def _key_block(spec: AttentionSpec, variant: AttentionVariant, step, k_mask: str | None, v_mask: str | None,
               full: bool = False, block: str = "BLOCK_N") -> list[str]:
    """One key block of the loop (unindented): K^T, the scores, the online softmax, P @ V; with
    v_first, V's tile is loaded with K^T's, so that its latency overlaps the scores. `full`: a
    block wholly inside Sk (`peel`), its keys not masked (the masks given hold the head dims' only);
    `block`: its number of keys (`tail_n`'s blocks)."""
    dt, v_first = spec.dtype, variant.v_first
    v_load = [f"v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :]{step('stride_vd')}"
              f"{_masked(v_mask)})"]
    if "v" in spec.biased:
        v_load += _bias_lines(spec, "v", "v", "[None, :]")
    out = [f"offs_n = start_n + tl.arange(0, {block})",
           *([] if full else ["col_ok = offs_n < SK"]),
           f"kt = tl.load(k_base + offs_d[:, None]{step('stride_kd')} + offs_n[None, :] * stride_kn"
           f"{_masked(k_mask)})"]
    if v_first:
        out += ["# V's tile now, with K^T's: its latency overlaps the scores and the softmax.", *v_load]
    if "k" in spec.biased:
        out += _bias_lines(spec, "k", "kt", "[:, None]")
    if spec.tf32:
        out += ["kt = round_to_tf32(kt)"]
    out += [f"qk = {_dot(spec, 'q', 'kt')}"]
    out += _score_lines(spec, full)
    if not full:
        out += ["s = tl.where(col_ok[None, :], s, float(\"-inf\"))  # keys past SK take no share"]
    out += ["",
            "# A row whose max is still -inf (every score so far -inf) shifts by 0, so that its",
            "# exp(-inf) are 0, not exp(NaN); at the end its sum is 0 and Y = 0 / 0 = NaN, as ONNX's",
            "# Softmax gives for a row of -inf. A NaN score makes its p NaN (exp(NaN)), and so its",
            "# row's sum and Y; a +inf score makes the max +inf and its p exp(inf - inf) = NaN.",
            "m_new = tl.maximum(m_i, tl.max(s, axis=1))",
            'm_shift = tl.where(m_new == float("-inf"), 0.0, m_new)']
    if variant.exp2 and dt != "f32":
        out += ["# exp(x) = 2^(x log2(e)): one FMA and the ex2 an element (16-bit P only: the product",
                "# s log2(e) loses up to |m| log2(e) 2^-24 of p to the subtraction, less than P's rounding",
                "# to fp16 (2^-11) while |m| < 5000).",
                f"alpha = tl.math.exp2((m_i - m_shift) * {LOG2E!r})",
                f"p = tl.math.exp2(tl.fma(s, {LOG2E!r}, -(m_shift * {LOG2E!r})[:, None]))"]
    else:
        out += ["alpha = tl.exp(m_i - m_shift)",
                "p = tl.exp(s - m_shift[:, None])"]
    out += ["l_i = l_i * alpha + tl.sum(p, axis=1)",
            "acc = acc * alpha[:, None]",
            "m_i = m_new"]
    if spec.zero_where is not None:
        z = f"e{spec.zero_where}"
        out += ["# The original's Where(m, 0, P) after its Softmax: those p are 0 in P @ V; the row's sum",
                "# (the softmax's denominator) took them first. kept_i counts the keys left.",
                f"kept_i += tl.sum(tl.where(({z} == 0.0){'' if full else ' & col_ok[None, :]'}, 1.0, 0.0)"
                f" + tl.zeros([BLOCK_M, {block}], dtype=tl.float32), axis=1)",
                f"p = tl.where({z} != 0.0, 0.0, p)"]
    if not v_first:
        out += v_load
    if dt == "f32":
        if spec.tf32:
            out += ["# P and V to nearest TF32 (P unnormalized: module docstring).",
                    "p = round_to_tf32(p)",
                    "v = round_to_tf32(v)"]
        out += [f"acc = {_dot(spec, 'p', 'v', 'acc')}"]
    else:
        out += ["# P in V's dtype, as the original's Softmax stores it (unnormalized here: module docstring).",
                f'acc = tl.dot(p.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne"), v, acc)']
    return out

def _score_lines(spec: AttentionSpec, full: bool = False) -> list[str]:
    """The score program on the tile `qk` (fp32 sums): `s`, fp32, as the original stores the
    Softmax's input (unrounded with `exact_scores`); `full`: a block with no key past SK."""
    prog, exact = spec.program, spec.exact_scores
    out = ["# %0: the product, fp32" if exact else "# %0: the product as the original's MatMul stores it."]
    out.append("s0 = qk" if spec.dtype == "f32" or exact else
               f's0 = qk.to({TL_DTYPES[spec.dtype]}, fp_downcast_rounding="rtne").to(tl.float32)')
    col_ok = "" if full else "col_ok"
    if any(spec.broadcast(i) == "" for i in range(spec.n_extras)):
        out.append("e_mask = row_ok[:, None]" + ("" if full else " & col_ok[None, :]"))
    for i, dt in enumerate(prog.input_dtypes[1:]):
        # an extra that broadcasts over a dim is loaded as the vector (or element) it is, not as
        # a [BLOCK_M, BLOCK_N] tile of repeats (the launcher checks its stride there is 0)
        if spec.broadcast(i) == "causal":
            out.append(f"e{i} = (offs_n[None, :] <= offs_m[:, None] + (SK - SQ)).to(tl.float32)  # causal, not read")
            continue
        if spec.broadcast(i) == "causal_add":
            out.append(f"e{i} = tl.where(offs_n[None, :] <= offs_m[:, None] + (SK - SQ), 0.0, "
                       f"{_literal(spec.causal_masked)})  # additive causal, not read")
            continue
        # a row (column) is loaded as a vector and then broadcast: loaded as a [1, BLOCK_N] tile,
        # BERT's key mask made the 64 x 128 tile spill (module docstring, `attention-extra-loads`)
        row = f"tl.load(e{i}_base + offs_n * stride_e{i}_n" + (f", mask={col_ok}, other=0)" if col_ok else ")")
        col = f"tl.load(e{i}_base + offs_m * stride_e{i}_m, mask=row_ok, other=0)"
        load = {"m": row, "row": row, "n": col, "mn": f"tl.load(e{i}_base)"}.get(spec.broadcast(i), (
                    f"tl.load(e{i}_base + offs_m[:, None] * stride_e{i}_m + offs_n[None, :] * stride_e{i}_n, "
                    "mask=e_mask, other=0)"))
        if dt == "bool":
            load = f"({load} != 0).to(tl.float32)"
        elif dt != "f32":
            load = f"{load}.to(tl.float32)"
        axis = {"m": "[None, :]", "row": "[None, :]", "n": "[:, None]"}.get(spec.broadcast(i), "")
        out.append(f"e{i} = {load}{axis}")

    def value_of(i: int) -> str:
        return "s0" if i == 0 else f"e{i - 1}"

    out += _program_lines(prog, value_of, "t")
    v, dt = prog.outputs[0]
    val = value_of(v) if v < len(prog.input_dtypes) else f"t{v}"
    out.append("# The Softmax's input, fp32." if exact
               else "# The Softmax's input as the original stores it, widened to fp32.")
    if dt == "f32" or exact:
        out.append(f"s = {val}")
    else:
        out.append(f's = {val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne").to(tl.float32)')
    return out
