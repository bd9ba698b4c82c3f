"""Code generation for GemmEpilogue (docs/format.md): a matrix product with a pointwise
epilogue, as Triton source text.

A GemmEpilogue node computes Y = program(alpha * op(A) @ op(B), extras...) where op()
transposes the last two dims when the node's trans_a / trans_b say so. The kernel sees it as
G independent products [M, K] x [K, N] (G = 1 when a batched A meets a 2-D B: its leading dims
are flattened into M, one GEMM of M = batch * rows):

    program ids over (M tiles x N tiles, in groups of GROUP_M tile rows so that neighbouring
    programs share A and B tiles in L2) and G -> an fp32 accumulator over K in BLOCK_K steps
    (`tl.dot`) -> alpha -> rounded to A's dtype (the original's MatMul output, %0) -> the
    epilogue program in fp32 on the tile -> stored, cast to the output dtype.

This is the Triton tutorial's matmul: operand strides are kernel parameters, so a transposed
operand (Gemm's transA / transB, a Transpose of the last two dims before a MatMul, packed
weights) costs nothing; the stride of the contiguous dim is 1 in the generated source (the
node's trans_a / trans_b are compile-time), so the loads vectorize. Rows and columns past
M and N wrap around (`% M`, `% N`, as the tutorial does) rather than being masked in the loop;
the store is masked.

Float32 operands multiply at the node's precision (`PRECISIONS`, `--conv-precision`): "tf32"
rounds them to the nearest TF32 value first (`codegen_conv.ROUND_TO_TF32`, as cuBLAS does;
Triton's tf32 dot would truncate), B being rounded once at compile time when it is a
constant (`GemmSpec.b_rounded`); "tf32x3" and "ieee" are passed to `tl.dot` as they are.
Float16 and bfloat16 operands multiply on the tensor cores with fp32 sums, as cuBLAS does.

A heavy epilogue (a transcendental or a division, `HEAVY_OPS`) on a tile of at least
`PART_VALUES` accumulator values per thread runs on four column quarters of the tile one
after the other (`epilogue_parts`), each loaded, computed and stored by the module's
``epilogue`` function: computed on the whole tile at once, the erf-GELU of BERT's FFN1
(128 x 128, 8 warps) took ptxas to 255 registers with 640 bytes of spills (fp16; fp32 512),
one program per SM where the bias-only kernel of the same tile (122 registers) runs two; in
quarters it needs 117 (fp32 122), no spills; in halves fp32 still needed 154. (ptxas -v on the
sm_90a PTX, on the CPU; not yet timed on a GPU.)

The epilogue's extra inputs are read by mode (`INPUT_MODES`) over Y's [G, M, N] view:
``full`` (Y's shape), ``row`` (varies along N only: a bias), ``scalar``, ``strided`` (any other
shape that broadcasts to Y and collapses to three strides, given at run time).

A 16-bit product whose epilogue cuBLASLt's own can compute (`library_epilogue`: a bias over
N, then nothing, ReLU or GELU, erf's form or tanh's, into a 16-bit Y of A's dtype, one GEMM;
float32 ones at "tf32" or "ieee" with the forms `F32_FORMS` lists, not storing Y rounded)
gets a "library" variant first (`GemmVariant.library`): no Triton source, cuBLASLt runs the
product and applies the bias and the activation to the fp32 accumulator before the one store
(csrc/cublaslt.h). No Triton tile reached cuBLAS's product at BERT-base's fp16 shapes on
the H200 or the H100 (0.62-0.77x, warp-specialized 0.37-0.54x); cuBLASLt's epilogue cost 0.8-1.3
µs over the bare product where ONNX Runtime's BiasGelu after it cost 5-7 (BENCHMARKS.md,
Decisions, `gemm-library`). cuBLASLt's GELU is the tanh form, within 4.7e-4 of erf's (at x =
-2.7), the product unrounded before the bias: the node's error against float64 was half the
exported graph's at FFN1 b8 (0.0019 against 0.0037); so it stands for erf's GELU at 16-bit
outputs only, where fp16 rounds a unit value by 4.9e-4. The heuristic tile's variants follow it, for where cuBLASLt
cannot run (G > 1 at run time, a bias not 16-byte aligned, no algorithm). ``ONNXFUSE_GEMM_LIBRARY=0``
leaves it out.

Split K (GemmVariant.split > 1), FusedConv's design (codegen_conv's module docstring): for
products whose tiles are too few to fill the GPU (BERT-base at batch 1: M = 128 rows make 6
to 24 tiles for 132 SMs, each running the whole K loop), the grid's third axis splits the K
loop. K is a run-time value here, so the slice count is too: the kernel reads it from the
grid (`split = tl.num_programs(2)`) and program `pid_k` of a tile takes the contiguous
K blocks [pid_k * per, min((pid_k + 1) * per, K_BLOCKS)), per = cdiv(K_BLOCKS, split),
K_BLOCKS = cdiv(K, BLOCK_K); the K tail inside the last block is masked as in the plain loop
(a slice left empty, which the launcher never makes, contributes zeros). Grid: (tiles, G,
split), so the batch and the slices both have their own axis and the tile order within a
batch is the plain kernel's. Each program writes its fp32 partial tile to a workspace
[split, G * tiles, BLOCK_M * BLOCK_N] and increments the tile's arrival counter (one int32
per (g, tile)); the program that arrives last sums the partials (`codegen_conv.split_reduce`,
the conv's code) and runs the unchanged epilogue on the sum, so alpha, the rounding to A's
dtype, the bias, the activation, the residual and the cast all see the whole product; the
others' stores are masked off. The variant's "split" in kernel_meta is the most slices the
launcher may use (K_BLOCKS / SPLIT_MIN_BLOCKS, at most SPLIT_MAX, when K is known); the
launcher takes the variant where the plain grid of its tile would leave most SMs idle (tiles
· G at most half the SMs) and runs it with split = min(S, SMs // (tiles · G), K_BLOCKS)
slices, evened out to cdiv(K_BLOCKS, cdiv(K_BLOCKS, split)) so that none is empty
(`GemmVariant.slices`, docs/format.md, kind gemm).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnxfuse.codegen import POINTER_TYPES, TL_DTYPES, KernelSource, _comment_text, check_kernel_name, helper_lines
from onnxfuse.codegen_conv import PRECISIONS, ROUND_TO_TF32, split_reduce
from onnxfuse.codegen_rows import _program_lines
from onnxfuse.expr import Instr, Program, evaluate

INPUT_MODES = ("full", "row", "scalar", "strided")
# Epilogue ops of many instructions per element (libdevice polynomials, IEEE division and its
# slow-path call): with one of them the epilogue is split into column quarters on large tiles.
HEAVY_OPS = frozenset({"exp", "expm1", "log", "sqrt", "tanh", "erf", "erfc", "cos", "sin", "pow", "sigmoid",
                       "softplus", "div"})
PART_VALUES = 64  # accumulator values per thread from which a heavy epilogue is split
INT_TYPE = "i32"  # every integer parameter; each tensor holds fewer than 2**31 elements (max_elements)
MAX_ELEMENTS = 2**31 - 1
# Split K (module docstring): at most this many slices, each of at least SPLIT_MIN_BLOCKS K
# blocks (so that the pipeline has blocks to overlap). The conv's values (kinds.conv.SPLIT_MAX,
# SPLIT_MIN_STEPS), not measured for GEMMs (BENCHMARKS.md, Decisions, `gemm-split-k`).
SPLIT_MAX = 16
SPLIT_MIN_BLOCKS = 4
MAX_GRID_Z = 65535  # CUDA's grid z limit: the most slices a launch can have


LIBRARY_ACTIVATIONS = ("none", "relu", "gelu")  # cuBLASLt's epilogues (GELU: the tanh form)


@dataclass(frozen=True)
class LibraryEpilogue:
    """What cuBLASLt's epilogue computes for a node: Y = activation(product + bias)."""

    activation: str  # one of LIBRARY_ACTIVATIONS
    bias: int  # the extra input (0-based) added as the bias over N; -1: none
    form: str  # what the program computes: "none", "relu", "gelu_erf" or "gelu_tanh"
    precision: str = ""  # float32 products: "tf32" (cuBLAS's TF32, as ONNX Runtime's default) or "ieee"


def library_enabled() -> bool:
    return os.environ.get("ONNXFUSE_GEMM_LIBRARY", "1") != "0"


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


# The forms cuBLASLt's epilogue can take, as functions of x = product + bias (float64).
_FORMS = (("none", "none", lambda x: x), ("relu", "relu", lambda x: np.maximum(x, 0.0)),
          ("gelu", "gelu_erf", _gelu_erf), ("gelu", "gelu_tanh", _gelu_tanh))
# Products the forms are told apart on (exact in fp16 and bf16), and the biases over 3 columns.
_PRODUCTS = np.concatenate([np.arange(-1280, 1281) / 128.0, [30.0, -30.0, 100.0, -100.0, 1000.0, -1000.0]])
_BIASES = np.array([0.0, 0.375, -1.25])


# The forms cuBLASLt's epilogue computes for float32 products at each precision: the same
# functions only (its GELU is the tanh form, 4.7e-4 from erf's: a 16-bit unit, not a float32
# one), and at "ieee" none but the exact ones (cuBLASLt's tanh is not documented to an ulp).
F32_FORMS = {"tf32": frozenset({"none", "relu", "gelu_tanh"}), "ieee": frozenset({"none", "relu"})}


def library_epilogue(program: Program, input_modes: tuple[str, ...], precision: str = "tf32"
                     ) -> LibraryEpilogue | None:
    """The cuBLASLt epilogue computing a GemmEpilogue's program, or None: a 16-bit product
    (or a float32 one at a precision of `F32_FORMS`, with a form it lists), Y of its dtype, at
    most one extra input, a bias of the same dtype read by row (over N),
    and the program, its roundings to 16 bits left out, equal in fp32 to one of `_FORMS` of
    product + bias on `_PRODUCTS` x `_BIASES` within 1e-4 (relative and absolute: an fp16
    export's 1 / sqrt(2) is 1 / 1.4140625, 3.2e-5 off at worst; erf's and tanh's GELU differ by
    up to 4.7e-4, x sigmoid(1.702 x) from erf's GELU by 4.5e-3 at x = 1). Told by values, not
    node types, so that every exporter's spelling of GELU (erf, erfc, tanh, sigmoid, the Gelu
    op) is one."""
    dt = program.input_dtypes[0]
    extras = program.input_dtypes[1:]
    f32_forms = F32_FORMS.get(precision, frozenset()) if dt == "f32" else None
    if (dt not in ("f16", "bf16") and not f32_forms) or len(program.outputs) != 1 \
            or program.outputs[0][1] != dt or len(extras) > 1:
        return None
    if extras and (tuple(input_modes) != ("row",) or extras[0] != dt):
        return None
    exact = Program(program.input_dtypes, tuple(Instr("add", (ins.args[0], 0.0)) if ins.op.startswith("round_")
                                                else ins for ins in program.instrs),
                    tuple((v, "f32") for v, _ in program.outputs))
    p = _PRODUCTS[:, None]
    b = _BIASES if extras else np.zeros(1)
    inputs = [p.astype(np.float32), *([b.astype(np.float32)] if extras else [])]
    (y,) = evaluate(exact, inputs)
    x = p + b
    for activation, form, f in _FORMS:
        want = f(x)
        if np.allclose(y.astype(np.float64), want, rtol=1e-4, atol=1e-4):
            if f32_forms is not None:
                return LibraryEpilogue(activation, 0 if extras else -1, form, precision) if form in f32_forms else None
            return LibraryEpilogue(activation, 0 if extras else -1, form)
    return None


@dataclass(frozen=True)
class GemmSpec:
    """What a GemmEpilogue kernel computes (docs/format.md, GemmEpilogue)."""

    kind: ClassVar[str] = "gemm"  # the Kind whose kernel it is (onnxfuse.kinds.gemm)
    name: str
    program: Program  # %0: the product (A's dtype), then the extras -> one output
    input_modes: tuple[str, ...]  # per extra input (program inputs %1, %2, ...)
    trans_a: bool = False
    trans_b: bool = False
    alpha: float = 1.0
    precision: str = "tf32"  # float32 operands: tl.dot's input_precision (TF32 rounded to nearest)
    b_rounded: bool = False  # float32 "tf32": B holds TF32 values already (a constant, rounded when compiled)
    # TF32 rounding at the producer (`onnxfuse.rounding`), float32 "tf32" only: x_rounded, A
    # holds TF32 values already (its producer stored them rounded), so the kernel feeds A to
    # tl.dot as loaded; round_y, the kernel stores Y rounded, as every reader would round it
    m: int | None = None  # rows of the GEMM the kernel runs (batch folded in), when static
    n: int | None = None
    k: int | None = None
    batch: int | None = None  # G, when static
    source_nodes: tuple[str, ...] = ()
    x_rounded: bool = False
    round_y: bool = False
    library: LibraryEpilogue | None = None  # cuBLASLt's epilogue computes the program (`library_epilogue`)

    @property
    def dtype(self) -> str:
        return self.program.input_dtypes[0]

    @property
    def tf32(self) -> bool:
        """Float32 operands multiplied at precision "tf32" (rounded to nearest first)."""
        return self.dtype == "f32" and self.precision == "tf32"

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - 1

    @property
    def rounds_a(self) -> bool:
        return self.tf32 and not self.x_rounded

    @property
    def rounds_b(self) -> bool:
        return self.tf32 and not self.b_rounded

    @property
    def stores_rounded(self) -> bool:
        return self.round_y and self.tf32 and self.program.outputs[0][1] == "f32"


@dataclass(frozen=True)
class GemmVariant:
    """One binary of a GemmEpilogue kernel: its tile, and what the launcher checks.

    aligned: the pointers are 16-byte aligned and the strides, N and K given at run time
    multiples of 16 elements (hinted to the compiler; `requires` ptr_align and the launcher's own
    `stride_multiple`); max_m > 0: the variant is for GEMMs of at most this many rows (the
    small-M tiles), the launcher's own key like rows' max_cols; split > 1: a split-K kernel
    (module docstring) that the launcher runs with at most this many K slices, only where the
    plain grid of its tile would leave most SMs idle (`slices`)."""

    index: int = 0
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    aligned: bool = False
    max_m: int = 0
    split: int = 0  # 0 / 1: no split K
    library: LibraryEpilogue | None = None  # cuBLASLt runs it (no Triton source, no binary)
    rank: int = 0  # library: the algorithm cuBLASLt's heuristic ranks here (0: its first)

    @property
    def split_k(self) -> bool:
        return self.split > 1

    def requires(self) -> dict[str, int]:
        if self.library is not None:  # the launcher checks what cuBLASLt takes
            return {}
        req = {"max_elements": MAX_ELEMENTS}
        if self.aligned:
            req["ptr_align"] = 16
        return req

    def meta(self) -> dict:
        if self.library is not None:
            return {"library": "cublaslt", "activation": self.library.activation, "bias": self.library.bias,
                    **({"precision": self.library.precision} if self.library.precision else {}),
                    **({"rank": self.rank} if self.rank else {})}
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k,
                "stride_multiple": 16 if self.aligned else 1, "max_m": self.max_m,
                **({"split": self.split} if self.split_k else {})}

    def tiles(self, m: int, n: int) -> int:
        return (-(-m // self.block_m)) * (-(-n // self.block_n))

    def slices(self, m: int, n: int, k: int, g: int, sms: int = 0) -> int:
        """The K slices the C++ launcher runs this split-K variant with for a product of this
        size on a GPU of `sms` multiprocessors (default SMS), or 0 where it does not run it:
        its grid of tiles · G would fill more than half the SMs, or fewer than two slices
        result (module docstring)."""
        sms = sms or SMS
        tiles = self.tiles(m, n) * g
        if not self.split_k or tiles == 0 or 2 * tiles > sms:
            return 0
        blocks = -(-k // self.block_k)
        s = min(self.split, sms // tiles, blocks, MAX_GRID_Z)
        if s < 2:
            return 0
        return -(-blocks // -(-blocks // s))  # every slice non-empty

    def grid(self, m: int, n: int, g: int, split: int = 0) -> tuple[int, ...]:
        """The launch grid, as the C++ launcher computes it: (tiles, G), or (tiles, G, split)
        for a split-K variant run with `split` slices."""
        if split > 1:
            return self.tiles(m, n), g, split
        return self.tiles(m, n), g

    @property
    def label(self) -> str:
        if self.library is not None:
            return (f"cuBLASLt, epilogue {self.library.form}" + (" + bias" if self.library.bias >= 0 else "")
                    + (f", algorithm ranked {self.rank + 1}" if self.rank else ""))
        return (f"tile {self.block_m}x{self.block_n}x{self.block_k}, {self.num_warps} warps, "
                f"{self.num_stages} stages" + (f", split K up to {self.split}" if self.split_k else ""))


# Tiles (block_m, block_n, block_k, warps, stages) by dtype. The large tile is the Triton
# tutorial's Hopper configuration for its dtype; the medium one for products of too few
# large tiles to fill the GPU (132 SMs on the H200), the small-M one for a handful of rows
# (batch-1 decoding, pooled heads). Untimed: `--tune` times every one of them per node
# (`gemm_candidates`) and keeps the node only where it beats ONNX Runtime.
TILES = {
    "large": {"f32": (128, 128, 32, 8, 3), "f16": (128, 128, 64, 8, 3)},
    "medium": {"f32": (64, 128, 32, 4, 4), "f16": (64, 128, 64, 4, 4)},
    "square": {"f32": (64, 64, 64, 4, 3), "f16": (64, 64, 64, 4, 4)},
    "small_m": {"f32": (16, 64, 64, 4, 4), "f16": (16, 64, 128, 4, 4)},
    "small_m32": {"f32": (32, 64, 64, 4, 4), "f16": (32, 128, 64, 4, 4)},
}
SMALL_M = 32  # GEMMs of at most this many rows take the small-M tiles
SMS = 132  # multiprocessors of the H100 / H200: fewer large tiles than this leave SMs idle


def _tile(spec: GemmSpec, name: str, **kw) -> GemmVariant:
    bm, bn, bk, w, s = TILES[name]["f32" if spec.dtype == "f32" else "f16"]
    return GemmVariant(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, **kw)


def _heuristic_tile(spec: GemmSpec) -> str:
    """The tile for a GEMM of known size: the small-M tile for at most SMALL_M rows, else
    the large tile unless it makes fewer tiles than the GPU has SMs (then the medium one)."""
    m, n, g = spec.m, spec.n, spec.batch or 1
    if m is not None and m <= SMALL_M:
        return "small_m" if m <= 16 else "small_m32"
    if m is not None and n is not None and -(-m // 128) * -(-n // 128) * g < SMS:
        return "medium"
    return "large"


def _numbered(variants: list[GemmVariant]) -> tuple[GemmVariant, ...]:
    return tuple(GemmVariant(**{**v.__dict__, "index": i}) for i, v in enumerate(variants))


def split_variant(spec: GemmSpec, tile: str) -> GemmVariant | None:
    """The split-K variant of a tile (aligned; module docstring), or None where it cannot
    help: K known and too short for two slices of SPLIT_MIN_BLOCKS blocks, or the fewest
    tiles the product can have (M, N and G where known, else one tile each) more than half
    of SMS, so the launcher would never take it. Its "split" is the most slices: K_BLOCKS //
    SPLIT_MIN_BLOCKS up to SPLIT_MAX (SPLIT_MAX for a run-time K); the launcher picks the
    slice count from the run-time tiles and the SMs (`GemmVariant.slices`)."""
    v = _tile(spec, tile, aligned=True)
    most = SPLIT_MAX if spec.k is None else min(SPLIT_MAX, -(-spec.k // v.block_k) // SPLIT_MIN_BLOCKS)
    fewest = v.tiles(spec.m or 1, spec.n or 1) * (spec.batch or 1)
    if most < 2 or 2 * fewest > SMS:
        return None
    return GemmVariant(**{**v.__dict__, "split": most})


# cuBLASLt's algorithms tuning times for a library variant: its heuristic's first this many
LIBRARY_RANKS = 4


def gemm_variants(spec: GemmSpec) -> tuple[GemmVariant, ...]:
    """The variants of a GemmEpilogue kernel, most specialized first (the launcher takes the
    first whose requirements hold): cuBLASLt's where it computes the epilogue (`library`,
    module docstring), then the heuristic tile aligned and not; else M known, the split-K
    variant of the heuristic's tile
    (where it can help: `split_variant`), then the tile aligned, then not; M unknown (a
    dynamic batch), the small-M tile for M <= SMALL_M, the split-K variant of the medium
    tile, then the large tile, each aligned, and the large tile unaligned last. A split-K
    variant's requirements include the launcher's own: its tiles at most half the SMs."""
    if spec.library is not None and library_enabled():
        tile = _heuristic_tile(spec)
        return _numbered([GemmVariant(library=spec.library), _tile(spec, tile, aligned=True), _tile(spec, tile)])
    if spec.m is not None:
        tile = _heuristic_tile(spec)
        split = split_variant(spec, tile)
        return _numbered([*([split] if split else []), _tile(spec, tile, aligned=True), _tile(spec, tile)])
    split = split_variant(spec, "medium")
    return _numbered([_tile(spec, "small_m", aligned=True, max_m=16), _tile(spec, "small_m32", aligned=True,
                                                                             max_m=SMALL_M),
                      *([split] if split else []), _tile(spec, "large", aligned=True), _tile(spec, "large")])


def gemm_candidates(spec: GemmSpec) -> list[tuple[str, tuple]]:
    """(label, variants) per configuration tuning times: the heuristic's variants first, then
    each tile of `TILES` (aligned, with its unaligned fallback); where the heuristic's
    variants start with cuBLASLt's, its algorithms ranked 2 to LIBRARY_RANKS by its own
    heuristic instead (no Triton tile came near cuBLAS's product, `gemm-tiles`; the first
    ranked is not always the fastest at a few rows, `gemm-library-ranks`)."""
    out = [("default", gemm_variants(spec))]
    first, *rest = out[0][1]
    if first.library is not None:
        for rank in range(1, LIBRARY_RANKS):
            v = GemmVariant(library=first.library, rank=rank)
            out.append((v.label, _numbered([v, *rest])))
        return out
    for name in TILES:
        v = _tile(spec, name, aligned=True)
        out.append((v.label, _numbered([v, _tile(spec, name)])))
    return out


def epilogue_parts(spec: GemmSpec, variant: GemmVariant) -> int:
    """Column parts the epilogue runs on one after the other: 4 for a heavy epilogue on a tile
    of at least PART_VALUES accumulator values per thread (and 64 or more columns), else 1
    (the whole tile)."""
    heavy = any(ins.op in HEAVY_OPS for ins in spec.program.instrs)
    values = variant.block_m * variant.block_n // (32 * variant.num_warps)
    return 4 if heavy and values >= PART_VALUES and variant.block_n >= 64 else 1


def gemm_param_names(spec: GemmSpec, split: bool = False) -> list[str]:
    """Kernel parameters in launch order (docs/format.md, kind gemm), without constexprs; a
    split-K kernel's end with its workspace and arrival counters."""
    names = ["a_ptr", "b_ptr", *(f"e{i}_ptr" for i in range(spec.n_extras)), "y_ptr",
             "M", "N", "K", "stride_ag", "stride_a", "stride_bg", "stride_b"]
    for i, mode in enumerate(spec.input_modes):
        if mode == "strided":
            names += [f"stride_e{i}_g", f"stride_e{i}_m", f"stride_e{i}_n"]
    if split:
        names += ["ws_ptr", "cnt_ptr"]
    return names


def _check(spec: GemmSpec, variant: GemmVariant) -> None:
    check_kernel_name(spec.name)
    spec.program.validate()
    if spec.dtype not in ("f32", "f16", "bf16"):
        raise ValueError(f"{spec.name}: the product's dtype {spec.dtype!r} is not f32, f16 or bf16")
    if len(spec.program.outputs) != 1:
        raise ValueError(f"{spec.name}: the epilogue must have one output, it has {len(spec.program.outputs)}")
    if len(spec.input_modes) != spec.n_extras:
        raise ValueError(f"{spec.name}: {len(spec.input_modes)} input modes for {spec.n_extras} extras")
    for m in spec.input_modes:
        if m not in INPUT_MODES:
            raise ValueError(f"{spec.name}: input mode {m!r} is not one of {INPUT_MODES}")
    if spec.precision not in PRECISIONS:
        raise ValueError(f"precision {spec.precision!r} is not one of {PRECISIONS}")
    for v in (variant.block_m, variant.block_n, variant.block_k, variant.num_warps):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"tile sizes and num_warps must be powers of two: {variant}")
    if min(variant.block_m, variant.block_n, variant.block_k) < 16:
        raise ValueError(f"tl.dot needs tiles of at least 16: {variant}")
    if not 0 <= variant.split <= MAX_GRID_Z:
        raise ValueError(f"split is the most K slices, 0 or 1 (none) to {MAX_GRID_Z}: {variant}")
    if variant.split_k and variant.max_m:
        raise ValueError(f"a split-K variant has no M limit (max_m): {variant}")


def generate_gemm(spec: GemmSpec, variant: GemmVariant) -> KernelSource:
    """The Triton kernel of a GemmEpilogue node for one variant (not a library one)."""
    if variant.library is not None:
        raise ValueError(f"{spec.name}: variant {variant.index} is cuBLASLt's, it has no Triton source")
    _check(spec, variant)
    split = variant.split_k
    names = gemm_param_names(spec, split)
    n_ptrs = 3 + spec.n_extras
    types = [POINTER_TYPES[spec.dtype]] * 2 + [POINTER_TYPES[d] for d in spec.program.input_dtypes[1:]]
    types += [POINTER_TYPES[spec.program.outputs[0][1]]]
    types += [INT_TYPE] * (len(names) - n_ptrs - (2 if split else 0))
    if split:  # the workspace and the arrival counters
        types += ["*fp32", "*i32"]
    constexprs = (("BLOCK_M", variant.block_m), ("BLOCK_N", variant.block_n), ("BLOCK_K", variant.block_k),
                  ("GROUP_M", variant.group_m))
    divisible: tuple[int, ...] = ()
    if variant.aligned:  # the pointers, N, K and the strides the launcher checked (not M)
        # N and K too: without them the B tile's `% N` and the K mask hide the contiguity of
        # its rows, and Triton loads fp16 B element by element, unpipelined (the H200: 25 TFLOP/s)
        hinted = [i for i, p in enumerate(names) if p in ("N", "K") or
                  (p.startswith("stride_") and not p.endswith(("_g", "_m", "_n")))]
        divisible = tuple(range(n_ptrs)) + tuple(hinted)
    if split:  # the launcher's workspace: 256-byte aligned
        divisible += (names.index("ws_ptr"),)
    source = _module(spec, variant, names, [c for c, _ in constexprs], epilogue_parts(spec, variant))
    return KernelSource(name=spec.name, source=source, params=tuple(zip(names, types, strict=True)),
                        constexprs=constexprs, divisible=divisible, num_warps=variant.num_warps,
                        variant=variant, num_stages=variant.num_stages)


# ---------------------------------------------------------------------------------------
# module text
# ---------------------------------------------------------------------------------------

def _precision_text(spec: GemmSpec) -> str:
    if spec.dtype != "f32":
        return f"{spec.dtype} products, fp32 sums"
    if spec.precision != "tf32":
        return f"fp32 operands, dot precision {spec.precision}"
    if spec.x_rounded:  # TF32 rounding at the producer (onnxfuse.rounding)
        return ("tf32, operands rounded to nearest as cuBLAS does (A by its producer, B "
                + ("when compiled)" if spec.b_rounded else "here)"))
    return ("tf32, operands rounded to nearest as cuBLAS does ("
            + ("A here, B when compiled)" if spec.b_rounded else "both here)"))


def _module(spec: GemmSpec, variant: GemmVariant, names: list[str], constexprs: list[str], parts: int) -> str:
    a_shape = "[G, K, M] (trans_a)" if spec.trans_a else "[G, M, K]"
    b_shape = "[G, N, K] (trans_b)" if spec.trans_b else "[G, K, N]"
    lines = [f"# {spec.name}: generated by onnxfuse.codegen_gemm; do not edit.", "#",
             f"# Y[G, M, N] = epilogue(alpha * A @ B); A {a_shape}, B {b_shape}; {_precision_text(spec)}"
             + ("; split K over the grid's third axis." if variant.split_k else "."),
             "#", "# Replaces the ONNX nodes:"]
    lines += [f"#   {_comment_text(s)}" for s in spec.source_nodes] or ["#   (none listed)"]
    lines += ["#", "# Epilogue (%0 is the product, rounded to A's dtype; then the extra inputs):"]
    lines += [f"#   {ln}" for ln in spec.program.to_text().splitlines()]
    lines += ["", "import triton", "import triton.language as tl", "from triton.language.extra import libdevice"]
    lines += helper_lines(spec.program)
    if spec.rounds_a or spec.rounds_b or spec.stores_rounded:
        lines += ["", "", *ROUND_TO_TF32]
    if parts > 1:
        lines += ["", "", *_epilogue_function(spec, variant.split_k)]
    lines += ["", "", "@triton.jit", f"def {spec.name}("]
    ptrs = [p for p in names if p.endswith("_ptr") and p not in ("ws_ptr", "cnt_ptr")]
    lines.append(f"    {', '.join(ptrs)},")
    lines.append("    M, N, K,")
    lines.append("    stride_ag, stride_a, stride_bg, stride_b,")
    for i, mode in enumerate(spec.input_modes):
        if mode == "strided":
            lines.append(f"    stride_e{i}_g, stride_e{i}_m, stride_e{i}_n,")
    if variant.split_k:
        lines.append("    ws_ptr, cnt_ptr,")
    lines += [f"    {', '.join(f'{c}: tl.constexpr' for c in constexprs)},", "):"]
    lines += ["    " + ln if ln else "" for ln in _body(spec, variant.split_k, parts)]
    return "\n".join(lines) + "\n"


def _body(spec: GemmSpec, split: bool = False, parts: int = 1) -> list[str]:
    a_off = ("offs_am[:, None] + offs_k[None, :] * stride_a" if spec.trans_a else
             "offs_am[:, None] * stride_a + offs_k[None, :]")
    b_off = ("offs_k[:, None] + offs_bn[None, :] * stride_b" if spec.trans_b else
             "offs_k[:, None] * stride_b + offs_bn[None, :]")
    a_step = "BLOCK_K * stride_a" if spec.trans_a else "BLOCK_K"
    b_step = "BLOCK_K" if spec.trans_b else "BLOCK_K * stride_b"
    out = ["# Tiles in groups of GROUP_M tile rows, so that neighbouring programs share A and B in L2.",
           "pid = tl.program_id(axis=0)",
           "pid_g = tl.program_id(axis=1).to(tl.int64)",
           "num_pid_m = tl.cdiv(M, BLOCK_M)",
           "num_pid_n = tl.cdiv(N, BLOCK_N)",
           "num_pid_in_group = GROUP_M * num_pid_n",
           "group_id = pid // num_pid_in_group",
           "first_pid_m = group_id * GROUP_M",
           "group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)",
           "pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)",
           "pid_n = (pid % num_pid_in_group) // group_size_m",
           *(_SPLIT_RANGE if split else ()),
           "",
           "# Rows and columns past M and N wrap around (their results are not stored).",
           "offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M",
           "offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N",
           "offs_k = tl.arange(0, BLOCK_K)",
           f"a_ptrs = a_ptr + pid_g * stride_ag + ({a_off})",
           f"b_ptrs = b_ptr + pid_g * stride_bg + ({b_off})",
           *([f"a_ptrs += k_lo * ({a_step})", f"b_ptrs += k_lo * ({b_step})"] if split else ()),
           "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
           "for k in range(k_lo, k_hi):" if split else "for k in range(0, tl.cdiv(K, BLOCK_K)):",
           "    k_left = K - k * BLOCK_K",
           "    a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)",
           "    b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)"]
    if spec.rounds_a:
        out.append("    # To the nearest TF32 value, as cuBLAS does (tl.dot's tf32 would truncate)"
                   + ("; B was rounded when compiled." if spec.b_rounded else "."))
        out.append("    a = round_to_tf32(a)")
        if spec.rounds_b:
            out.append("    b = round_to_tf32(b)")
    elif spec.rounds_b:  # A was stored rounded by its producer (x_rounded)
        out += ["    # To the nearest TF32 value, as cuBLAS does; A holds TF32 values already.",
                "    b = round_to_tf32(b)"]
    if spec.dtype == "f32":
        out.append(f'    acc = tl.dot(a, b, acc, input_precision="{spec.precision}")')
    else:
        out.append("    acc = tl.dot(a, b, acc)")
    out += [f"    a_ptrs += {a_step}", f"    b_ptrs += {b_step}", ""]
    if split:
        # one counter per (g, tile): the tiles of batch g follow those of batch g - 1
        out += [*split_reduce("tl.num_programs(axis=0) * tl.num_programs(axis=1)",
                              "pid_g * tl.num_programs(axis=0) + pid", "split"), ""]
    if parts > 1:
        args = ", ".join(_epilogue_args(spec, split))
        out += [f"# The epilogue on {parts} parts of the tile's columns, one after the other: on the whole tile",
                "# at once its fp32 temporaries would not fit in the registers beside the accumulator.",
                "left, right = column_halves(acc)"]
        pieces = ["left", "right"]
        if parts == 4:
            out += ["part_0, part_1 = column_halves(left)", "part_2, part_3 = column_halves(right)"]
            pieces = [f"part_{i}" for i in range(4)]
        out += ["offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                f"offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // {parts})"]
        for i, part in enumerate(pieces):
            shift = "" if i == 0 else f" + {'' if i == 1 else f'{i} * '}(BLOCK_N // {parts})"
            out.append(f"epilogue({part}, offs_m, offs_n{shift}, {args})")
        return out
    out += ["# Epilogue on the tile, in fp32: %0 is the product as the original stores it."]
    return out + _epilogue_lines(spec, ["offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                                        "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"], split)


def _epilogue_args(spec: GemmSpec, split: bool = False) -> list[str]:
    """The `epilogue` function's parameters after (acc, offs_m, offs_n); a split-K kernel's
    end with `last` (whether this program sums the partials and stores)."""
    names = ["pid_g", "M", "N", *(f"e{i}_ptr" for i in range(spec.n_extras)), "y_ptr"]
    for i, mode in enumerate(spec.input_modes):
        if mode == "strided":
            names += [f"stride_e{i}_g", f"stride_e{i}_m", f"stride_e{i}_n"]
    return names + (["last"] if split else [])


COLUMN_HALVES = [
    "@triton.jit",
    "def column_halves(x):",
    '    """The left and right halves of the columns of the 2-D x."""',
    "    return tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))",
]


def _epilogue_function(spec: GemmSpec, split: bool = False) -> list[str]:
    """The epilogue as a function of a part of the tile (the kernel calls it per column part)."""
    params = ", ".join(_epilogue_args(spec, split))
    return (COLUMN_HALVES + ["", "", "@triton.jit", f"def epilogue(acc, offs_m, offs_n, {params}):",
             '    """The epilogue on acc, the part of the tile at rows offs_m and columns offs_n, '
             'in fp32: %0 is the', '    product as the original stores it; stored to Y."""']
            + ["    " + ln for ln in _epilogue_lines(spec, [], split)])


def _epilogue_lines(spec: GemmSpec, offsets: list[str], split: bool = False) -> list[str]:
    """The epilogue on `acc` at rows offs_m and columns offs_n (defined by `offsets`, after the
    product): loads, program, masked store (split K: by the program that arrived last only)."""
    out = []
    alpha = "" if spec.alpha == 1.0 else f" * {float(spec.alpha)!r}"
    if spec.dtype == "f32":
        out.append(f"p = acc{alpha}")
    else:
        out.append(f'p = (acc{alpha}).to({TL_DTYPES[spec.dtype]}, fp_downcast_rounding="rtne").to(tl.float32)')
    out += offsets
    out += ["mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)" + (" & last" if split else ""),
            "y_offs = pid_g * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]"]
    for i, (dt, mode) in enumerate(zip(spec.program.input_dtypes[1:], spec.input_modes, strict=True)):
        out.append(f"e{i} = {_load(i, dt, mode)}")
    prog = spec.program

    def value_of(i: int) -> str:
        return "p" if i == 0 else f"e{i - 1}"

    out += _program_lines(prog, value_of, "t")
    v, dt = prog.outputs[0]
    val = value_of(v) if v < len(prog.input_dtypes) else f"t{v}"
    if spec.stores_rounded:
        out += ["# Y rounded to TF32 as the GEMMs and convs that read it would round it: they skip that step.",
                f"y_rounded = round_to_tf32({val})"]
        val = "y_rounded"
    if dt != "f32":
        val = f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne")'
    out += ["# Store, cast to the output dtype.", f"tl.store(y_ptr + y_offs, {val}, mask=mask)"]
    return out


# Split K: the K blocks of this program's slice (module docstring).
_SPLIT_RANGE = (
    "",
    "# Split K: this program sums K blocks k_lo .. k_hi - 1 of the tile, one contiguous share",
    "# of the cdiv(K, BLOCK_K) blocks per program along the grid's third axis.",
    "pid_k = tl.program_id(axis=2)",
    "split = tl.num_programs(axis=2)",
    "k_blocks = tl.cdiv(K, BLOCK_K)",
    "k_per = tl.cdiv(k_blocks, split)",
    "k_lo = pid_k * k_per",
    "k_hi = tl.minimum(k_lo + k_per, k_blocks)",
)


def _load(i: int, dtype: str, mode: str) -> str:
    if mode == "full":
        load = f"tl.load(e{i}_ptr + y_offs, mask=mask, other=0)"
    elif mode == "row":
        load = f"tl.load(e{i}_ptr + offs_n[None, :], mask=offs_n[None, :] < N, other=0)"
    elif mode == "scalar":
        load = f"tl.load(e{i}_ptr)"
    else:
        load = (f"tl.load(e{i}_ptr + (pid_g * stride_e{i}_g + offs_m[:, None].to(tl.int64) * stride_e{i}_m"
                f" + offs_n[None, :] * stride_e{i}_n), mask=mask, other=0)")
    if dtype == "bool":
        return f"({load} != 0).to(tl.float32)"
    return load if dtype == "f32" else f"{load}.to(tl.float32)"
