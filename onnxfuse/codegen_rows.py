"""Code generation for FusedRows (docs/format.md): row reductions with a pointwise prologue
and epilogue, as Triton source text.

A FusedRows node views its row value x as [rows, N]: the dims before the node's `axis` are
the rows, the dims from `axis` on (flattened) one row of N contiguous elements. For each
row the kernel

1. evaluates the **prologue** program on the node's first inputs: x (a residual add, a bias
   add, a scale and a mask before a softmax, a Cast...), rounded to the prologue's output
   dtype as the original stores it (and stored, when the node exposes x: `x_output`);
2. reduces the row in fp32 (`REDUCTIONS`):
   - ``layer_norm``: mean(x), then the mean of (x - mean)^2: the mean is subtracted before
     squaring, so there is no E[x^2] - E[x]^2 cancellation, and fp16 rows of magnitude 1e4
     (squares 1e8, beyond fp16) are summed in fp32 without overflow;
   - ``rms_norm``: mean(x^2);
   - ``group_norm``: as layer_norm over one (image, group) of x [N, C, spatial...]: C / G
     channels by every pixel, contiguous in NCHW, strided in channels-last x (each pixel's
     C / G channels of the group); the statistics are per row, inputs read per channel
     (gamma, beta: `GROUP_INPUT_MODES`) through each element's channel;
   - ``softmax`` / ``log_softmax``: the row's max (NaN-propagating), then the sum of
     exp(x - max): x - max is never positive, so exp never overflows; softmax multiplies
     by the row's reciprocal of the sum (one IEEE division per row, not one per element);
3. evaluates the **epilogue** program, whose first inputs are the row values the reduction
   provides (`ROW_VALUES`; the statistics are one value per row, [BLOCK_M, 1] in the kernel,
   so what the program computes from them alone, eps added, a square root, a reciprocal,
   is computed once per row, not per element), then the node's other inputs (gamma, beta, a
   residual...), and stores each output rounded to its dtype.

Two kernels, by the variant (`RowsVariant`):
- single pass (the row fits: BLOCK_N >= N): a [BLOCK_M rows, BLOCK_N columns] tile per
  program, each row read once and kept in registers; mean and variance are two passes over
  the registers. Small rows take several rows per program (BLOCK_M > 1).
- looped (any N): one pass over the row in BLOCK_N chunks for the statistics, a second one
  that recomputes the prologue, normalizes and stores. LayerNorm merges each chunk's mean
  and sum of squared deviations into the running ones (Chan, Golub and LeVeque's pairwise
  update), so the variance is still of deviations from a mean; softmax keeps a running max
  and a running sum rescaled to it per lane (the "online softmax").

Inputs are read by mode (`INPUT_MODES`), decided when fusing from the tensor's shape
against x's: ``full`` (x's shape: element (row, col) at row * N + col), ``last`` (varies
along the normalized dims only, as gamma and beta: at col), ``scalar`` (one element) and
``strided`` (anything else that broadcasts to x, such as an attention mask [B, 1, 1, S]
over scores [B, H, S, S]: its element strides over the leading dims, and 0 or 1 along the
row, are kernel parameters). Row offsets are 64-bit; sizes and strides 32-bit parameters.

The expressions are those of PointwiseChain kernels (`onnxfuse.codegen.OP_TABLE`), so the
numerics of the prologue and epilogue are exactly theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from onnxfuse.codegen import (
    POINTER_TYPES,
    TL_DTYPES,
    KernelSource,
    _comment_text,
    _operand_text,
    check_kernel_name,
    expr_text,
    helper_lines,
    param_groups,
    stores_16bit,
)
from onnxfuse.codegen_conv import ROUND_TO_TF32
from onnxfuse.expr import Program

# The row values each reduction gives the epilogue, in program input order (%0, %1, ...).
ROW_VALUES: dict[str, tuple[str, ...]] = {
    "layer_norm": ("x", "mean", "var"),  # var: mean((x - mean)^2), the biased variance
    "rms_norm": ("x", "mean_square"),
    "softmax": ("softmax",),
    "log_softmax": ("log_softmax",),
    "group_norm": ("x", "mean", "var"),  # per (n, group): over the group's channels and every pixel
}
REDUCTIONS = tuple(ROW_VALUES)
INPUT_MODES = ("full", "last", "scalar", "strided")
# How a group_norm kernel reads its inputs (docs/format.md, FusedRows "group_norm"): as x,
# one element, per channel ([C, 1, 1] gamma), per image and channel ([N, C, 1, 1]: a time
# embedding added before the norm), per image ([N, 1, 1, 1]).
GROUP_INPUT_MODES = ("full", "scalar", "channel", "batch_channel", "batch")
INT_TYPE = "i32"

# Rows up to this many columns are read once, into registers (single pass); longer rows loop.
MAX_SINGLE_PASS = 8192
# group_norm rows of at least SPLIT_MIN_COLS columns get, first, a variant of SPLIT programs
# per row for launches of at most SPLIT_MAX_ROWS rows (N * G: batch 1 or 2 at 32 groups; the
# H200 has 132 SMs). Untuned: chosen for SD-UNet's 40960-column rows, not measured yet.
SPLIT, SPLIT_MIN_COLS, SPLIT_MAX_ROWS = 4, 16384, 64


@dataclass(frozen=True)
class RowsSpec:
    """What a FusedRows kernel computes (docs/format.md, FusedRows)."""

    kind: ClassVar[str] = "rows"  # the Kind whose kernel it is (onnxfuse.kinds.rows)
    name: str
    reduction: str
    prologue: Program  # the node's first inputs -> x (one output)
    program: Program  # the epilogue: ROW_VALUES[reduction], then the extras -> the node's outputs
    input_modes: tuple[str, ...]  # per node input: the prologue's, then the epilogue's extras
    lead_rank: int  # dims before the normalized ones (the node's axis)
    n_cols: int | None = None  # N, when the optimizer knows it: compiled in
    x_output: bool = False  # the node's last output is x
    source_nodes: tuple[str, ...] = ()
    # group_norm: x is [N, C, spatial...] (channels_last: stored [N, spatial..., C]); a row
    # is one (n, group) of C / groups channels by every pixel; C and groups compiled in
    groups: int = 0
    channels: int = 0
    channels_last: bool = False
    # TF32 rounding at the producer (`onnxfuse.rounding`): store output 0 rounded to TF32,
    # because every reader (a "tf32" GEMM or conv) would round it anyway (kernel suffix _ry)
    round_y: bool = False

    @property
    def stores_rounded(self) -> bool:
        return self.round_y and self.program.outputs[0][1] == "f32"

    @property
    def group_channels(self) -> int:
        """group_norm: the channels of one group (C / groups)."""
        return self.channels // self.groups

    @property
    def n_prologue(self) -> int:
        return len(self.prologue.input_dtypes)

    @property
    def n_row_values(self) -> int:
        return len(ROW_VALUES[self.reduction])

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - self.n_row_values

    @property
    def x_dtype(self) -> str:
        return self.prologue.outputs[0][1]

    @property
    def narrow(self) -> bool:
        """Every tensor 16-bit (or bool): twice the elements per 16-byte access."""
        dts = [*self.prologue.input_dtypes, *self.program.input_dtypes[self.n_row_values:],
               *(dt for _, dt in self.program.outputs), self.x_dtype]
        return "f32" not in dts


@dataclass(frozen=True)
class RowsVariant:
    """One binary of a FusedRows kernel: its tile, and what the launcher must check.

    cols: the kernel was compiled for rows of exactly this many columns (0: any, given at
    run time); looped: the row is walked in chunks of BLOCK_N (else BLOCK_N >= N, and
    without `cols` the variant takes N <= BLOCK_N: max_cols); aligned: the pointers are
    16-byte aligned (hinted to the compiler; `requires` ptr_align). `cols` and `max_cols` are
    the rows launcher's own keys beside the block sizes (docs/format.md, kind rows), not
    `requires` entries, which the shared driver checks."""

    index: int = 0
    block_m: int = 1
    block_n: int = 1024
    num_warps: int = 4
    looped: bool = False
    cols: int = 0
    aligned: bool = False
    # group_norm, looped: SPLIT programs per row, each computing the row's statistics (the
    # row read SPLIT times, from L2 after the first) and normalizing its 1/SPLIT of the row;
    # taken for at most max_rows rows (batch 1: G programs alone would leave most SMs idle)
    split: int = 1
    max_rows: int = 0
    # single pass: the epilogue's other inputs (a LayerNorm's gamma and beta) loaded before the
    # row, so their latency overlaps the row's instead of following the reductions (in the SASS
    # of sm_90, loaded after them, they waited for every shuffle and barrier of both sums).
    # `rows_variants` sets it for every single-pass kernel (`rows-early-loads`)
    early_loads: bool = False

    def requires(self) -> dict[str, int]:
        return {"ptr_align": 16} if self.aligned else {}

    @property
    def max_cols(self) -> int:
        """The longest row the variant takes (0: any): a single-pass kernel's BLOCK_N."""
        return self.cols or (0 if self.looped else self.block_n)

    def meta(self) -> dict[str, int]:
        """Its kernel_meta entry besides `requires`: the tile and the row lengths it takes
        (and, split variants only, the programs per row and the most rows it takes)."""
        return {"block_m": self.block_m, "block_n": self.block_n, "looped": int(self.looped), "cols": self.cols,
                "max_cols": self.max_cols, **({"split": self.split, "max_rows": self.max_rows} if self.split > 1
                                              else {})}

    def grid(self, n_rows: int) -> tuple[int, int]:
        """The launch grid for `n_rows` rows, as the C++ launcher computes it."""
        return (-(-n_rows // self.block_m) * self.split, 1)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def rows_variants(spec: RowsSpec) -> tuple[RowsVariant, ...]:
    """The variants of a FusedRows kernel, most specialized first (the launcher takes the
    first whose requirements hold).

    N known (the normalized dims are static, as a hidden size is): one kernel compiled for
    exactly N, single pass when next_pow2(N) <= MAX_SINGLE_PASS (BLOCK_N = next_pow2(N); rows
    shorter than 1024 columns take several rows per program, so that a tile holds 1024
    elements), else looped; 16-byte aligned pointers hinted. N unknown (a softmax over a
    dynamic sequence): single-pass kernels for N up to 128, 512, 2048 and 8192. Every
    kernel ends with the looped kernel for any N, unaligned. num_warps: a tile's elements
    / 256, 1 to 8, as the Triton tutorials' LayerNorm and softmax (4 warps for a 1024-element
    tile, 8 from 2048). Single-pass kernels load the epilogue's other inputs (gamma, beta)
    before the row (`early_loads`). `--tune` also times the tiles of `rows_candidates`."""
    chunk = 2048 if spec.narrow else 1024
    out: list[RowsVariant] = []

    def add(**kw) -> None:  # single-pass kernels load the epilogue's inputs first (`rows-early-loads`)
        out.append(RowsVariant(index=len(out), early_loads=not kw.get("looped", False), **kw))

    def warps(elements: int) -> int:
        return min(max(elements // 256, 1), 8)

    n = spec.n_cols
    if spec.reduction == "group_norm" and n is not None and n >= SPLIT_MIN_COLS and not spec.x_output:
        add(block_n=chunk, num_warps=4, looped=True, cols=n, aligned=True, split=SPLIT, max_rows=SPLIT_MAX_ROWS)
    if n is not None and n > 0:
        block_n = next_pow2(n)
        if block_n <= MAX_SINGLE_PASS:
            block_m = max(1, 1024 // block_n)
            add(block_m=block_m, block_n=block_n, num_warps=warps(block_m * block_n), cols=n, aligned=True)
        else:
            add(block_n=chunk, num_warps=4, looped=True, cols=n, aligned=True)
    else:
        for block_n in (128, 512, 2048, 8192):
            block_m = max(1, 1024 // block_n)
            add(block_m=block_m, block_n=block_n, num_warps=warps(block_m * block_n))
    add(block_n=chunk, num_warps=4, looped=True)
    return tuple(out)


# Tiles tuning times besides the heuristic's (`rows-candidates`), for a single-pass kernel
# compiled for a static row length: the same rows per program on 1, 2 or 8 warps (a row on one
# warp is reduced by shuffles alone, no shared memory or barrier), twice the rows on twice the
# warps, and half. At most ROW_CANDIDATES of them, each holding at most ROW_VALUES_PER_THREAD
# fp32 values a thread. Why: at BERT-base's rows (768 wide, fp16, 1024 rows) the heuristic's
# one row per 4-warp program timed 3.55 µs against ORT's SkipLayerNormalization's 3.50 on the
# H200 (twenty-first session), 2.53 µs against a 1.0 µs memory bound in the ninth: a latency-
# bound kernel, whose warps per row were never measured. Timed with `--tune` only: in the
# twenty-second session one warp a row won alone (2.56 µs) and not in the model (3.15, the
# heuristic's 3.13): `kinds.rows.Rows.search_configs`.
ROW_CANDIDATES = 4
ROW_VALUES_PER_THREAD = 64


def rows_candidates(spec: RowsSpec) -> list[tuple[str, tuple[RowsVariant, ...]]]:
    """(label, variants) per configuration `--tune` times: the heuristic's first; then, where
    its first variant is a single-pass kernel for a static row length (not group_norm's), that
    kernel at the other tiles above, each followed by the heuristic's fallbacks."""
    base = rows_variants(spec)
    out = [("default", base)]
    first = base[0]
    if spec.reduction == "group_norm" or first.looped or not first.cols:
        return out
    bm, bn, w = first.block_m, first.block_n, first.num_warps
    tiles = [(bm, 1), (bm, 2), (bm, 8), (2 * bm, min(8, 2 * w)), (max(1, bm // 2), max(1, w // 2))]
    seen = {(bm, w)}
    for m, warps in tiles:
        if (m, warps) in seen or len(out) > ROW_CANDIDATES or m * bn > ROW_VALUES_PER_THREAD * 32 * warps:
            continue
        seen.add((m, warps))
        alt = RowsVariant(**{**first.__dict__, "block_m": m, "num_warps": warps})
        variants = tuple(RowsVariant(**{**v.__dict__, "index": i}) for i, v in enumerate((alt, *base[1:])))
        out.append((f"tile {m}x{bn}, {warps} warps", variants))
    return out


def rows_param_names(spec: RowsSpec) -> list[str]:
    """Kernel parameters in launch order (docs/format.md, kind rows), without constexprs."""
    names = [f"x{i}_ptr" for i in range(spec.n_prologue)] + [f"e{j}_ptr" for j in range(spec.n_extras)]
    names += [f"y{k}_ptr" for k in range(len(spec.program.outputs))]
    if spec.x_output:
        names.append("x_out_ptr")
    names += ["n_rows", "n_cols"]
    strided = _strided(spec)
    if strided:
        names += [f"size{d}" for d in range(spec.lead_rank)]
        for p in strided:
            names += [f"stride_{p}_{d}" for d in range(spec.lead_rank)] + [f"stride_{p}_col"]
    return names


def _input_names(spec: RowsSpec) -> list[str]:
    """The pointer prefix of each node input: x<i> (prologue), e<j> (epilogue extras)."""
    return [f"x{i}" for i in range(spec.n_prologue)] + [f"e{j}" for j in range(spec.n_extras)]


def _strided(spec: RowsSpec) -> list[str]:
    return [p for p, m in zip(_input_names(spec), spec.input_modes, strict=True) if m == "strided"]


def _check(spec: RowsSpec, variant: RowsVariant) -> None:
    check_kernel_name(spec.name)
    spec.prologue.validate()
    spec.program.validate()
    if spec.reduction not in REDUCTIONS:
        raise ValueError(f"{spec.name}: unknown reduction {spec.reduction!r} (known: {', '.join(REDUCTIONS)})")
    if len(spec.prologue.outputs) != 1:
        raise ValueError(f"{spec.name}: the prologue must have one output (x), it has {len(spec.prologue.outputs)}")
    if spec.n_extras < 0:
        raise ValueError(f"{spec.name}: the epilogue has fewer inputs than the {spec.n_row_values} row values of "
                         f"{spec.reduction}")
    if len(spec.input_modes) != spec.n_prologue + spec.n_extras:
        raise ValueError(f"{spec.name}: {len(spec.input_modes)} input modes for "
                         f"{spec.n_prologue + spec.n_extras} inputs")
    modes = GROUP_INPUT_MODES if spec.reduction == "group_norm" else INPUT_MODES
    for m in spec.input_modes:
        if m not in modes:
            raise ValueError(f"{spec.name}: input mode {m!r} is not one of {modes}")
    if spec.reduction == "group_norm" and (spec.groups <= 0 or spec.channels <= 0 or spec.channels % spec.groups):
        raise ValueError(f"{spec.name}: group_norm needs C ({spec.channels}) a positive multiple of groups "
                         f"({spec.groups})")
    if spec.reduction != "group_norm" and (spec.groups or spec.channels_last):
        raise ValueError(f"{spec.name}: groups and channels_last are group_norm's")
    if spec.prologue.input_dtypes and "full" not in spec.input_modes[:spec.n_prologue] \
            and "strided" not in spec.input_modes[:spec.n_prologue]:
        raise ValueError(f"{spec.name}: no prologue input has x's shape")
    if spec.lead_rank < 0:
        raise ValueError(f"{spec.name}: lead_rank must be >= 0")
    for v in (variant.block_m, variant.block_n, variant.num_warps):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"row tile sizes and num_warps must be powers of two: {variant}")
    if variant.cols and not variant.looped and variant.cols > variant.block_n:
        raise ValueError(f"{spec.name}: a single-pass kernel for {variant.cols} columns needs BLOCK_N >= it")
    if variant.cols and spec.n_cols not in (None, variant.cols):
        raise ValueError(f"{spec.name}: variant compiled for {variant.cols} columns, the spec has {spec.n_cols}")
    if variant.looped and variant.block_m != 1:
        raise ValueError(f"{spec.name}: the looped kernel takes one row per program (BLOCK_M 1)")
    if variant.split > 1 and (not variant.looped or spec.reduction != "group_norm" or spec.x_output):
        raise ValueError(f"{spec.name}: only a looped group_norm kernel without x_output splits its rows")
    if variant.early_loads and variant.looped:
        raise ValueError(f"{spec.name}: only a single-pass kernel loads the epilogue's inputs with the row")


def generate_rows(spec: RowsSpec, variant: RowsVariant) -> KernelSource:
    """The Triton kernel of a FusedRows node, single pass or looped (`RowsVariant`)."""
    _check(spec, variant)
    names = rows_param_names(spec)
    out_dtypes = [dt for _, dt in spec.program.outputs] + ([spec.x_dtype] if spec.x_output else [])
    in_dtypes = list(spec.prologue.input_dtypes) + list(spec.program.input_dtypes[spec.n_row_values:])
    types = [POINTER_TYPES[d] for d in in_dtypes + out_dtypes]
    types += [INT_TYPE] * (len(names) - len(types))
    constexprs = [("BLOCK_M", variant.block_m), ("BLOCK_N", variant.block_n)]
    if variant.cols:
        constexprs.append(("N_COLS", variant.cols))
    if spec.reduction == "group_norm":
        constexprs += [("GROUPS", spec.groups), ("GROUP_CHANNELS", spec.group_channels), ("CHANNELS", spec.channels)]
    if variant.split > 1:
        constexprs.append(("SPLIT", variant.split))
    source = _module(spec, variant, names, [c for c, _ in constexprs])
    divisible: tuple[int, ...] = tuple(range(len(in_dtypes) + len(out_dtypes))) if variant.aligned else ()
    return KernelSource(name=spec.name, source=source, params=tuple(zip(names, types, strict=True)),
                        constexprs=tuple(constexprs), divisible=divisible, num_warps=variant.num_warps,
                        variant=variant, num_stages=None)


# ---------------------------------------------------------------------------------------
# module text
# ---------------------------------------------------------------------------------------

MAX_NAN = [
    "@triton.jit",
    "def max_nan(a, b):",
    '    """max(a, b), NaN when either is NaN: a row that holds a NaN has a NaN max, as numpy\'s',
    '    and ONNX Runtime\'s softmax (tl.max would drop it: PTX max.f32)."""',
    "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)",
]


def _module(spec: RowsSpec, variant: RowsVariant, names: list[str], constexprs: list[str]) -> str:
    kind = "looped over BLOCK_N chunks" if variant.looped else "single pass, the row in registers"
    if variant.split > 1:
        kind += f", {variant.split} programs per row"
    n = f"{variant.cols} columns" if variant.cols else "N columns given at run time"
    lines = [f"# {spec.name}: generated by onnxfuse.codegen_rows; do not edit.", "#",
             f"# {spec.reduction} over rows of {n} ({kind}); row values for the epilogue: "
             f"{', '.join(ROW_VALUES[spec.reduction])}.", "#"]
    if spec.reduction == "group_norm":
        layout = "NHWC (channels last)" if spec.channels_last else "NCHW"
        lines += [f"# Group norm: {spec.channels} channels in {spec.groups} groups, x stored {layout}; a row is one",
                  "# (image, group): GROUP_CHANNELS channels by every pixel.", "#"]
    lines += ["# Replaces the ONNX nodes:"]
    lines += [f"#   {_comment_text(s)}" for s in spec.source_nodes] or ["#   (none listed)"]
    lines += ["#", "# Prologue (inputs: the node's first inputs; output: x):"]
    lines += [f"#   {ln}" for ln in spec.prologue.to_text().splitlines()]
    lines += ["#", f"# Epilogue (inputs: {', '.join(ROW_VALUES[spec.reduction])}, then the node's other inputs):"]
    lines += [f"#   {ln}" for ln in spec.program.to_text().splitlines()]
    lines += ["", "import triton", "import triton.language as tl", "from triton.language.extra import libdevice"]
    lines += helper_lines(spec.prologue, spec.program)
    if spec.reduction in ("softmax", "log_softmax"):
        lines += ["", "", *MAX_NAN]
    if spec.stores_rounded:
        lines += ["", "", *ROUND_TO_TF32]
    lines += ["", "", "@triton.jit", f"def {spec.name}("]
    groups = param_groups(names, lambda p: "size" if p.startswith("size") else "n")  # n_rows, n_cols together
    lines += [f"    {', '.join(group)}," for group in groups]
    lines += [f"    {', '.join(f'{c}: tl.constexpr' for c in constexprs)},", "):"]
    body = _looped_body(spec, variant) if variant.looped else _single_body(spec, variant)
    lines += ["    " + ln if ln else "" for ln in body]
    return "\n".join(lines) + "\n"


def _n(variant: RowsVariant) -> str:
    """The row length as the kernel knows it: the constexpr or the run-time parameter."""
    return "N_COLS" if variant.cols else "n_cols"


def _n_float(variant: RowsVariant) -> str:
    """The row length as an fp32 value (a literal when compiled in)."""
    return f"tl.full([], {float(variant.cols)!r}, tl.float32)" if variant.cols else "n_cols.to(tl.float32)"


def _row_setup(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    """Program id -> the tile's rows, their 64-bit start offsets, and (strided inputs) each
    row's offset in every strided input: the row index unravelled once per row."""
    if spec.reduction == "group_norm":
        return _group_row_setup(spec, variant)
    out = ["pid = tl.program_id(axis=0)",
           "rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)",
           "row_mask = rows < n_rows",
           f"row_start = rows.to(tl.int64) * {_n(variant)}  # 64-bit: rows * N may pass 2**31"]
    strided = _strided(spec)
    if strided:
        out.append("# Each row's coordinates over the leading dims, for the strided inputs.")
        if spec.lead_rank == 0:
            out += [f"{p}_row = rows.to(tl.int64) * 0" for p in strided]
        else:
            out.append("rem = rows")
            for d in range(spec.lead_rank - 1, 0, -1):
                out += [f"idx{d} = rem % size{d}", f"rem = rem // size{d}"]
            out.append("idx0 = rem")
            for p in strided:
                terms = " + ".join(f"idx{d}.to(tl.int64) * stride_{p}_{d}" for d in range(spec.lead_rank))
                out.append(f"{p}_row = {terms}")
        out += _strided_setup(strided, variant)
    return out


def _strided_setup(strided: list[str], variant: RowsVariant) -> list[str]:
    """A strided input's stride along the row is 1 (it spans the row) or 0 (one value per
    row; docs/format.md): `<p>_along`, a scalar. Spanning the row, its leading strides are 0
    or multiples of N (its dims after each include the row's), so with N compiled in its row
    offset is hinted a multiple of N's largest power-of-two divisor (0 when it does not span
    the row: still a multiple). Read as a row of x is, with vector loads, instead of with a
    column stride unknown to the compiler: that would make the compiler lay the whole tile
    out for this small input (each row spread over the warps, x and y staged through shared
    memory, the row reductions through shared memory and barriers)."""
    out = []
    for p in strided:
        out.append(f"{p}_along = stride_{p}_col != 0  # 1: {p} spans the row; 0: one value per row")
        if variant.cols:
            pow2 = variant.cols & -variant.cols
            out.append(f"{p}_span_row = tl.multiple_of(tl.where({p}_along, {p}_row, 0), {pow2})"
                       "  # a multiple of N when spanning")
        else:
            out.append(f"{p}_span_row = {p}_row")
    return out


def _group_row_setup(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    """group_norm: row = n * GROUPS + g; the row's first element, 64-bit. NCHW: a group's
    channels are contiguous planes, so the row is n_cols contiguous elements; NHWC: it starts
    at channel g * GROUP_CHANNELS of image n's first pixel."""
    out = ["pid = tl.program_id(axis=0)"]
    if variant.split > 1:
        out += ["part = pid % SPLIT  # this program's share of the row in pass 2", "pid = pid // SPLIT"]
    out += ["rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)",
            "row_mask = rows < n_rows",
            "batch = rows // GROUPS",
           "group = rows % GROUPS",
           f"hw = {_n(variant)} // GROUP_CHANNELS  # pixels per image"]
    if spec.channels_last:
        out.append(f"row_start = batch.to(tl.int64) * {_n(variant)} * GROUPS + group * GROUP_CHANNELS"
                   "  # n * HW * C + g * C/G")
    else:
        out.append(f"row_start = rows.to(tl.int64) * {_n(variant)}  # the group's planes, contiguous")
    return out


def _group_col_setup(spec: RowsSpec, variant: RowsVariant, start: str | None) -> list[str]:
    """group_norm: column j of a row -> its element's offset and its channel (`chan`).
    NCHW: j = channel-in-group * HW + pixel; NHWC: j = pixel * (C / G) + channel-in-group."""
    cols = "tl.arange(0, BLOCK_N)" if start is None else f"{start} + tl.arange(0, BLOCK_N)"
    out = [f"cols = {cols}",
           f"col_mask = cols < {_n(variant)}",
           "mask = row_mask[:, None] & col_mask[None, :]"]
    if spec.channels_last:
        out += ["pix = cols // GROUP_CHANNELS",
                "chan = group[:, None] * GROUP_CHANNELS + (cols % GROUP_CHANNELS)[None, :]",
                "offsets = row_start[:, None] + (pix.to(tl.int64) * CHANNELS + cols % GROUP_CHANNELS)[None, :]"]
    else:
        out += ["chan = group[:, None] * GROUP_CHANNELS + (cols // hw)[None, :]",
                "offsets = row_start[:, None] + cols[None, :]"]
    return out


def _col_setup(variant: RowsVariant, start: str | None, spec: RowsSpec | None = None) -> list[str]:
    if spec is not None and spec.reduction == "group_norm":
        return _group_col_setup(spec, variant, start)
    cols = "tl.arange(0, BLOCK_N)" if start is None else f"{start} + tl.arange(0, BLOCK_N)"
    return [f"cols = {cols}",
            f"col_mask = cols < {_n(variant)}",
            "mask = row_mask[:, None] & col_mask[None, :]",
            "offsets = row_start[:, None] + cols[None, :]"]


def _load(ptr: str, mode: str, dtype: str, block_m: int = 1) -> list[str]:
    """Lines that load input `ptr` in its mode as fp32, assigned to `ptr` (x<i>, e<j>)."""
    pre: list[str] = []
    if mode == "full":
        load = f"tl.load({ptr}_ptr + offsets, mask=mask, other=0)"
    elif mode == "last":
        if block_m > 1:  # the tile's shape, as x's: a [1, BLOCK_N] load would set the tile's layout
            load = (f"tl.load({ptr}_ptr + tl.broadcast_to(cols[None, :], BLOCK_M, BLOCK_N), "
                    "mask=col_mask[None, :], other=0)")
        else:
            load = f"tl.load({ptr}_ptr + cols[None, :], mask=col_mask[None, :], other=0)"
    elif mode == "scalar":
        load = f"tl.load({ptr}_ptr)"
    elif mode == "channel":
        load = f"tl.load({ptr}_ptr + chan, mask=mask, other=0)"
    elif mode == "batch_channel":
        load = f"tl.load({ptr}_ptr + (batch[:, None] * CHANNELS + chan), mask=mask, other=0)"
    elif mode == "batch":
        load = f"tl.load({ptr}_ptr + batch, mask=row_mask, other=0)[:, None]"
    else:  # strided: a span of the row (stride 1) or one value per row (stride 0), whichever it is
        pre = [f"{ptr}_span = tl.load({ptr}_ptr + ({ptr}_span_row[:, None] + cols[None, :]), "
               f"mask=mask & {ptr}_along, other=0)",
               f"{ptr}_one = tl.load({ptr}_ptr + {ptr}_row, mask=row_mask & (stride_{ptr}_col == 0), other=0)"]
        load = f"tl.where({ptr}_along, {ptr}_span, {ptr}_one[:, None])"
    if dtype == "bool":
        return [*pre, f"{ptr} = ({load} != 0).to(tl.float32)"]
    return [*pre, f"{ptr} = {load if dtype == 'f32' else f'{load}.to(tl.float32)'}"]


def _program_lines(prog: Program, value_of: Callable[[int], str], prefix: str) -> list[str]:
    """One line per instruction, `prefix<n>` for value %n; `value_of(i)` names input i."""
    base = len(prog.input_dtypes)

    def name(v: int) -> str:
        return value_of(v) if v < base else f"{prefix}{v}"

    out, sixteen_bit = [], stores_16bit(prog)
    for k, ins in enumerate(prog.instrs):
        out.append(f"# %{base + k} = {ins.op} {' '.join(_operand_text(a) for a in ins.args)}")
        out.append(f"{prefix}{base + k} = {expr_text(ins, name, sixteen_bit)}")
    return out


def _prologue(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    """Load the prologue's inputs, evaluate it, and round x to its dtype: `x`."""
    prog = spec.prologue
    out = ["# Prologue: x from the node's first inputs (fp32), rounded as the original stores it."]
    for i, (dt, mode) in enumerate(zip(prog.input_dtypes, spec.input_modes, strict=False)):
        out += _load(f"x{i}", mode, dt, variant.block_m)
    out += _program_lines(prog, lambda i: f"x{i}", "p")
    v, dt = prog.outputs[0]
    val = f"x{v}" if v < len(prog.input_dtypes) else f"p{v}"
    if dt != "f32":
        val = f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne").to(tl.float32)'
    return out + [f"x = {val}"]


def _store_x(spec: RowsSpec) -> list[str]:
    if not spec.x_output:
        return []
    return [f"tl.store(x_out_ptr + offsets, {_cast('x', spec.x_dtype)}, mask=mask)  # x, read outside the node"]


def _cast(val: str, dt: str) -> str:
    return val if dt == "f32" else f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne")'


def _extras(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    """Load the epilogue's other inputs: e<j>."""
    k = spec.n_row_values
    out = []
    for j, (dt, mode) in enumerate(zip(spec.program.input_dtypes[k:], spec.input_modes[spec.n_prologue:],
                                       strict=True)):
        out += _load(f"e{j}", mode, dt, variant.block_m)
    return out


def _epilogue(spec: RowsSpec, variant: RowsVariant, row_values: list[str], loaded: bool = False) -> list[str]:
    """Load the extras (unless `loaded` already), evaluate the epilogue on the row values,
    store every output."""
    prog = spec.program
    k = spec.n_row_values
    out = [f"# Epilogue: {', '.join(f'%{i} = {v}' for i, v in enumerate(ROW_VALUES[spec.reduction]))}, "
           "then the node's other inputs" + (" (loaded first)." if loaded else ".")]
    if not loaded:
        out += _extras(spec, variant)

    def value_of(i: int) -> str:
        return row_values[i] if i < k else f"e{i - k}"

    out += _program_lines(prog, value_of, "t")
    out.append("# Store, cast to the output dtypes.")
    for j, (v, dt) in enumerate(prog.outputs):
        val = value_of(v) if v < len(prog.input_dtypes) else f"t{v}"
        if j == 0 and spec.stores_rounded:
            out += ["# y0 rounded to TF32 as the GEMMs and convs that read it would round it: they skip that step.",
                    f"y0_rounded = round_to_tf32({val})"]
            val = "y0_rounded"
        out.append(f"tl.store(y{j}_ptr + offsets, {_cast(val, dt)}, mask=mask)")
    return out


def _single_body(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    nf = _n_float(variant)
    out = _row_setup(spec, variant) + _col_setup(variant, None, spec)
    early = variant.early_loads and spec.n_extras > 0
    if early:  # issued before the row's loads: all in flight at once
        out += ["# The epilogue's other inputs, loaded first: their latency overlaps the row's.",
                *_extras(spec, variant)]
    out += _prologue(spec, variant) + _store_x(spec)
    red = spec.reduction
    if red in ("layer_norm", "group_norm"):
        out += ["# Row statistics in fp32, two passes over the registers: the mean, then the mean of",
                "# the squared deviations from it (no E[x^2] - E[x]^2: no cancellation, no fp16 overflow).",
                "x = tl.where(mask, x, 0.0)",
                f"mean = tl.div_rn(tl.sum(x, axis=1), {nf})",
                "diff = tl.where(mask, x - mean[:, None], 0.0)",
                f"var = tl.div_rn(tl.sum(diff * diff, axis=1), {nf})"]
        values = ["x", "mean[:, None]", "var[:, None]"]
    elif red == "rms_norm":
        out += ["# The mean of the squares, in fp32.",
                "x = tl.where(mask, x, 0.0)",
                f"mean_square = tl.div_rn(tl.sum(x * x, axis=1), {nf})"]
        values = ["x", "mean_square[:, None]"]
    else:
        out += ["# The row's max (a NaN wins), then the sum of exp(x - max) <= 1 per element: no overflow.",
                'x = tl.where(mask, x, float("-inf"))',
                "row_max = tl.reduce(x, 1, max_nan)",
                "shifted = x - row_max[:, None]",
                "e = tl.where(mask, libdevice.exp(shifted), 0.0)",
                "denom = tl.sum(e, axis=1)"]
        if red == "softmax":
            out += ["# One IEEE reciprocal per row, a multiply per element (within an ulp of dividing each).",
                    "y = e * tl.div_rn(1.0, denom)[:, None]"]
        else:
            out.append("y = shifted - libdevice.log(denom)[:, None]")
        values = ["y"]
    return out + _epilogue(spec, variant, values, loaded=early)


def _looped_body(spec: RowsSpec, variant: RowsVariant) -> list[str]:
    n, nf = _n(variant), _n_float(variant)
    red = spec.reduction
    out = _row_setup(spec, variant)
    loop = f"for start in range(0, {n}, BLOCK_N):"
    first = _col_setup(variant, "start", spec) + _prologue(spec, variant) + _store_x(spec)
    if red in ("layer_norm", "group_norm"):
        out += ["# Pass 1: mean and variance, chunk by chunk: each chunk's mean and sum of squared",
                "# deviations (in registers), merged into the running ones (Chan et al.'s pairwise update):",
                "# deviations from a mean throughout, no E[x^2] - E[x]^2.",
                "count = tl.zeros([BLOCK_M], tl.float32)",
                "mean = tl.zeros([BLOCK_M], tl.float32)",
                "m2 = tl.zeros([BLOCK_M], tl.float32)", loop]
        step = first + [
            "x = tl.where(mask, x, 0.0)",
            f"n_chunk = tl.minimum({n} - start, BLOCK_N).to(tl.float32)",
            "chunk_mean = tl.div_rn(tl.sum(x, axis=1), n_chunk)",
            "chunk_diff = tl.where(mask, x - chunk_mean[:, None], 0.0)",
            "chunk_m2 = tl.sum(chunk_diff * chunk_diff, axis=1)",
            "total = count + n_chunk",
            "delta = chunk_mean - mean",
            "mean = mean + delta * tl.div_rn(n_chunk, total)",
            "m2 = m2 + chunk_m2 + delta * delta * tl.div_rn(count * n_chunk, total)",
            "count = total"]
        out += ["    " + s for s in step]
        out.append(f"var = tl.div_rn(m2, {nf})")
        values = ["x", "mean[:, None]", "var[:, None]"]
        second: list[str] = []
    elif red == "rms_norm":
        out += ["# Pass 1: the sum of the squares, per lane, then over the lanes.",
                "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)", loop]
        out += ["    " + s for s in first + ["x = tl.where(mask, x, 0.0)", "acc += x * x"]]
        out.append(f"mean_square = tl.div_rn(tl.sum(acc, axis=1), {nf})")
        values = ["x", "mean_square[:, None]"]
        second = []
    else:
        out += ["# Pass 1, per lane: a running max m and a running sum s of exp(x - m), rescaled when m",
                "# grows (a lane still at -inf adds 0, never exp(-inf - -inf)). Then over the lanes.",
                'm_run = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)',
                "s_run = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)", loop]
        step = first + [
            'x = tl.where(mask, x, float("-inf"))',
            "m_new = max_nan(m_run, x)",
            'empty = m_new == float("-inf")',
            "s_run = s_run * tl.where(empty, 0.0, libdevice.exp(m_run - m_new)) + "
            "tl.where(empty, 0.0, libdevice.exp(x - m_new))",
            "m_run = m_new"]
        out += ["    " + s for s in step]
        out += ["row_max = tl.reduce(m_run, 1, max_nan)",
                'scale = tl.where(m_run == float("-inf"), 0.0, libdevice.exp(m_run - row_max[:, None]))',
                "denom = tl.sum(s_run * scale, axis=1)"]
        if red == "softmax":
            out.append("inv_denom = tl.div_rn(1.0, denom)  # once per row; pass 2 multiplies")
            second = ["shifted = x - row_max[:, None]", "y = libdevice.exp(shifted) * inv_denom[:, None]"]
        else:
            second = ["y = (x - row_max[:, None]) - libdevice.log(denom)[:, None]"]
        values = ["y"]
    if variant.split > 1:
        out += ["# Pass 2, this program's share: SPLIT spans of whole chunks.",
                f"span = tl.cdiv(tl.cdiv({n}, SPLIT), BLOCK_N) * BLOCK_N",
                f"for start in range(part * span, tl.minimum({n}, part * span + span), BLOCK_N):"]
    else:
        out += ["# Pass 2: the prologue again, then the epilogue, chunk by chunk.", loop]
    step = _col_setup(variant, "start", spec) + _prologue(spec, variant) + second + _epilogue(spec, variant, values)
    out += ["    " + s for s in step]
    return out
