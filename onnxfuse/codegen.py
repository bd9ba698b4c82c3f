"""Code generation: a pointwise `Program` becomes the source of one Triton kernel.

`generate` turns (program, kernel name, output rank, input modes, source node names,
variant) into a `KernelSource`: the text of a Python module holding one ``@triton.jit``
function plus what `triton.compile` needs beside it (signature, constexprs, divisibility
attributes, num_warps). The module text does not depend on the variant, so both variants
of a kernel share one file; the variant only changes the compile-time hints.

The kernel reads like the Triton tutorials:

    program id -> int64 offsets -> mask -> loads (upcast to fp32) -> one ``tmpN`` per
    instruction (``tmpN`` is value ``%N`` of the program) -> stores cast to the output
    dtype (round-to-nearest-even for f16 / bf16).

Its parameters follow the launch ABI of docs/format.md: input pointers, output pointers,
``n_elements``, then (only when some input is read by strides: STRIDED_MODES) the
output's ``rank`` sizes and each such input's ``rank`` strides, all integers 64-bit; Triton
appends the two scratch pointers itself. ``BLOCK`` is a constexpr and takes no parameter slot.

Math semantics are those of `onnxfuse.expr`: fp32 throughout, IEEE division and square
root (``tl.div_rn``, ``tl.sqrt_rn``; a division by a power of two is the equal product),
libdevice for transcendental functions (accurate to a few ulp, unlike the fast ``tl.exp`` /
``tl.log`` approximations), NaN-propagating max/min, comparisons that give 1.0 / 0.0, and
``select`` on ``c != 0``. A program whose every output is stored in 16 bits computes erfc and
sigmoid with the module's own ``erfc_16bit`` / ``sigmoid_16bit`` (`SIXTEEN_BIT_FORMS`):
relative errors of a few 1e-6, far below the 16-bit rounding, in fewer instructions.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnxfuse.expr import BINARY, SIXTEEN_BIT, TERNARY, UNARY, Instr, Operand, Program, Ref

INPUT_MODES = ("full", "scalar", "strided", "rotate_half", "rotate_half_strided", "rotate_pairs",
               "rotate_pairs_strided", "narrow")
# inputs read at offsets from their strides ("narrow": a partial node's inputs of r columns)
STRIDED_MODES = ("strided", "rotate_half_strided", "rotate_pairs_strided", "narrow")
ROTATED_MODES = ("rotate_half", "rotate_half_strided", "rotate_pairs", "rotate_pairs_strided")

# Pointer element types in Triton's signature notation. Bool tensors are bytes (0 or 1):
# they are read as int8 and compared with 0, so any nonzero byte counts as true.
POINTER_TYPES = {"f32": "*fp32", "f16": "*fp16", "bf16": "*bf16", "bool": "*i8"}
TL_DTYPES = {"f32": "tl.float32", "f16": "tl.float16", "bf16": "tl.bfloat16"}
INT_TYPE = "i64"  # every integer parameter: n_elements, sizes, strides
# imported by the generated module, or defined in it (`SIXTEEN_BIT_FORMS`)
_MODULE_NAMES = ("triton", "tl", "libdevice", "erfc_16bit", "sigmoid_16bit")


@dataclass(frozen=True)
class Variant:
    """Compile-time choices for one binary of a kernel.

    ``ptr_align`` (bytes) and ``n_multiple`` are promises the launcher checks before it
    picks this variant (0 means no promise); they become ``tt.divisibility`` hints on
    the pointer parameters and on ``n_elements`` so that loads and stores vectorize.
    ``last_multiple`` (a multiple of BLOCK) promises that the last of the sizes the launcher
    passes (the output's dims collapsed for the strided inputs) is a multiple of it: a
    program's elements then lie in one row of that dim, so an input read along it (a bias)
    is read at contiguous, 16-element-aligned offsets, in vector loads (`row-vector-loads`).
    """

    index: int
    block: int = 1024
    num_warps: int = 4
    ptr_align: int = 0
    n_multiple: int = 0
    index_bits: int = 64  # 32: int32 offsets, for tensors of fewer than 2**31 - BLOCK elements
    last_multiple: int = 0

    @property
    def even(self) -> bool:
        """n_elements is a multiple of BLOCK: every program is full and needs no mask."""
        return self.n_multiple > 0 and self.n_multiple % self.block == 0

    @property
    def max_elements(self) -> int:
        return 2**31 - 1 - self.block if self.index_bits == 32 else 0

    def requires(self) -> dict[str, int]:
        """The variant's ``requires`` object in ``kernel_meta`` (docs/format.md)."""
        req = {}
        if self.n_multiple:
            req["n_multiple"] = self.n_multiple
        if self.ptr_align:
            req["ptr_align"] = self.ptr_align
        if self.max_elements:
            req["max_elements"] = self.max_elements
        if self.last_multiple:
            req["last_multiple"] = self.last_multiple
        return req


@dataclass(frozen=True)
class KernelSource:
    """A generated kernel: module source plus the arguments of `triton.compile`."""

    name: str
    source: str
    params: tuple[tuple[str, str], ...]  # launch parameters in order: (name, Triton type)
    constexprs: tuple[tuple[str, int], ...]  # (("BLOCK", 1024),)
    divisible: tuple[int, ...]  # indices of parameters hinted divisible by 16
    num_warps: int
    variant: Variant  # or codegen_conv.ConvVariant / PoolVariant
    num_stages: int | None = None  # software pipelining depth; None: Triton's default

    @property
    def signature(self) -> dict[str, str]:
        """Triton's signature dict: every parameter, constexprs marked ``constexpr``."""
        sig = dict(self.params)
        sig.update((name, "constexpr") for name, _ in self.constexprs)
        return sig

    @property
    def attrs(self) -> dict[tuple[int, ...], list[list]]:
        """Triton's per-parameter attributes (divisibility hints)."""
        return {(i,): [["tt.divisibility", 16]] for i in self.divisible}


@dataclass(frozen=True)
class KernelSpec:
    """What to compile for a PointwiseChain node: a program, its kernel name and the shape
    facts codegen needs."""

    kind: ClassVar[str] = "pointwise"
    program: Program
    name: str
    rank: int
    input_modes: tuple[str, ...]
    source_nodes: tuple[str, ...] = ()
    last_dim: int = 0  # the output's last dim where static, else 0 (`row-vector-loads`)
    partial: tuple[int, ...] = ()  # (r, k[, j]): columns below r computed, input k's (+ j's) beyond


def param_names(n_inputs: int, n_outputs: int, rank: int, input_modes: tuple[str, ...]) -> list[str]:
    """Kernel parameter names in launch order (docs/format.md), without constexprs."""
    names = [f"x{i}_ptr" for i in range(n_inputs)] + [f"out{j}_ptr" for j in range(n_outputs)]
    names.append("n_elements")
    strided = [i for i, m in enumerate(input_modes) if m in STRIDED_MODES]
    if strided:
        names += [f"size{d}" for d in range(rank)]
        for i in strided:
            names += [f"stride_x{i}_{d}" for d in range(rank)]
    return names


def generate(
    program: Program,
    name: str,
    rank: int,
    input_modes: tuple[str, ...],
    source_nodes: list[str] | tuple[str, ...],
    variant: Variant,
    last_dim: int = 0,
    partial: tuple[int, ...] = (),
) -> KernelSource:
    """Generate the Triton kernel `name` computing `program` over an output of `rank` dims.
    `last_dim`: the output's last dim, needed (even, static) by "rotate_half" inputs, which are
    read at the element half the last dim away along it, the first half negated
    ("rotate_half_strided": at its strided offsets moved by as much, its last dim's stride 1).
    `partial` (r, k) or (r, k, j): the program only where the output's column (of `last_dim`,
    static) is below r, input k (a full or strided one) stored beyond, or x_k + x_j (j another
    full or strided input, read at the same element: a bias the columns beyond r add); "narrow"
    inputs, of r columns, are read there alone, and a rotate_half input rotates within the r
    columns."""
    program.validate()
    input_modes = tuple(input_modes)
    _check_args(program, name, rank, input_modes, variant)
    rotate_width = partial[0] if partial else last_dim
    if any(m in ROTATED_MODES for m in input_modes) and (rotate_width <= 0 or rotate_width % 2 or rank < 1):
        raise ValueError(f"a rotated input needs a static, even last dim (got {rotate_width}, rank {rank})")
    if partial and (len(partial) not in (2, 3) or not 0 < partial[0] < last_dim or last_dim % 2
                    or len(program.outputs) != 1 or len(set(partial[1:])) != len(partial) - 1
                    or any(not 0 <= k < len(input_modes) or input_modes[k] not in ("full", "strided")
                           for k in partial[1:])
                    or variant.last_multiple):
        raise ValueError(f"partial {list(partial)} needs 0 < r < last_dim ({last_dim}, even), one output, a full or "
                         "strided input k (and j, another) and no row variant")
    if "narrow" in input_modes and not partial:
        raise ValueError("a narrow input needs partial")
    n_in, n_out = len(program.input_dtypes), len(program.outputs)
    names = param_names(n_in, n_out, rank, input_modes)
    types = [POINTER_TYPES[dt] for dt in program.input_dtypes]
    types += [POINTER_TYPES[dt] for _, dt in program.outputs]
    # Variants with int32 offsets take their integers as int32 too: the index arithmetic
    # (unravelling the element index by the sizes for strided inputs) then stays 32-bit.
    # With int64 sizes every `%` and `//` was a 64-bit division, emulated in software: a
    # bias + GELU over 4096 x 3072 ran at 1.2 TB/s on the H200 (BENCHMARKS.md). The launcher
    # passes 64-bit slots; a 32-bit parameter reads the low half (little-endian), and the
    # variant's max_elements bounds every size and stride below 2**31.
    int_type = "i32" if variant.index_bits == 32 else INT_TYPE
    types += [int_type] * (len(names) - n_in - n_out)
    params = tuple(zip(names, types, strict=True))
    divisible: tuple[int, ...] = ()
    if variant.ptr_align or variant.n_multiple:
        if variant.ptr_align not in (0, 16) or variant.n_multiple % 16:
            raise ValueError("divisibility hints are 16 (bytes for pointers, a multiple of 16 elements for n)")
        pointers = tuple(range(n_in + n_out)) if variant.ptr_align else ()
        divisible = pointers + ((n_in + n_out,) if variant.n_multiple else ())
    source = _module_source(program, name, rank, input_modes, source_nodes, names, variant, last_dim, partial)
    return KernelSource(
        name=name,
        source=source,
        params=params,
        constexprs=(("BLOCK", variant.block),),
        divisible=divisible,
        num_warps=variant.num_warps,
        variant=variant,
    )


def check_kernel_name(name: str) -> None:
    """The kernel's name must be a Python identifier the generated module does not use."""
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii() or name in _MODULE_NAMES:
        raise ValueError(f"kernel name {name!r} is not an identifier free to use in the module")


def _check_args(program: Program, name: str, rank: int, modes: tuple[str, ...], variant: Variant) -> None:
    check_kernel_name(name)
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if len(modes) != len(program.input_dtypes):
        raise ValueError(f"{len(program.input_dtypes)} inputs but {len(modes)} input modes")
    for m in modes:
        if m not in INPUT_MODES:
            raise ValueError(f"input mode {m!r} is not one of {INPUT_MODES}")
    if variant.block <= 0 or variant.block & (variant.block - 1):
        raise ValueError(f"BLOCK must be a power of two, got {variant.block}")
    if variant.num_warps <= 0 or variant.num_warps & (variant.num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {variant.num_warps}")
    if variant.last_multiple and (variant.last_multiple % variant.block or variant.last_multiple % 16 or rank < 1):
        raise ValueError(f"last_multiple {variant.last_multiple} must be a multiple of BLOCK ({variant.block}) "
                         "and of 16, at rank 1 or more")


# ---------------------------------------------------------------------------------------
# module text
# ---------------------------------------------------------------------------------------


def _module_source(
    program: Program,
    name: str,
    rank: int,
    modes: tuple[str, ...],
    source_nodes: list[str] | tuple[str, ...],
    names: list[str],
    variant: Variant,
    last_dim: int = 0,
    partial: tuple[int, ...] = (),
) -> str:
    lines = [f"# {name}: generated by onnxfuse.codegen; do not edit.", "#"]
    lines.append("# Replaces the ONNX nodes:")
    lines += [f"#   {_comment_text(n)}" for n in source_nodes] or ["#   (none listed)"]
    lines.append("#")
    lines.append(f"# Program (output rank {rank}):")
    lines += [f"#   {line}" for line in program.to_text().splitlines()]
    lines += [
        "",
        "import triton",
        "import triton.language as tl",
        "from triton.language.extra import libdevice",
        *helper_lines(program),
        "",
        "",
        "@triton.jit",
        f"def {name}(",
    ]
    lines += [f"    {', '.join(group)}," for group in param_groups(names)]
    lines += ["    BLOCK: tl.constexpr,", "):"]
    lines += ["    " + s for s in _body(program, rank, modes, variant, last_dim, partial)]
    return "\n".join(lines) + "\n"


def param_groups(names: list[str], role=lambda p: p.rstrip("0123456789")) -> list[list[str]]:
    """Parameters grouped one line per role, in order of first appearance: pointers, each
    input's strides, and the others by `role(name)` (default: the name without its trailing
    digits, so n_elements alone and size0, size1, ... together)."""
    groups: dict[str, list[str]] = {}
    for p in names:
        if p.endswith("_ptr"):
            key = "ptr"
        elif p.startswith("stride_"):
            key = p.rsplit("_", 1)[0]
        else:
            key = role(p)
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def _comment_text(text: str) -> str:
    """One printable ASCII line, safe inside a ``#`` comment."""
    return " ".join(str(text).split()).encode("ascii", "backslashreplace").decode("ascii")


def _body(program: Program, rank: int, modes: tuple[str, ...], variant: Variant, last_dim: int = 0,
          partial: tuple[int, ...] = ()) -> list[str]:
    out = ["pid = tl.program_id(axis=0)"]
    strided = [i for i, m in enumerate(modes) if m in STRIDED_MODES]
    if variant.index_bits == 32:
        out += ["# int32 offsets: the launcher picks this variant for fewer than 2**31 - BLOCK elements.",
                "offsets = pid * BLOCK + tl.arange(0, BLOCK)"]
    else:
        out += ["# int64 offsets: tensors may hold more than 2**31 elements.",
                "offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)"]
    if variant.even:
        out.append("# n_elements is a multiple of BLOCK (the launcher checks): no mask.")
        out.append("mask = None")
    else:
        out.append("mask = offsets < n_elements")
    in_row = bool(variant.last_multiple) and rank >= 2
    rotated = [i for i, m in enumerate(modes) if m in ROTATED_MODES]
    if partial:
        beyond = " + ".join(f"x{k}" for k in partial[1:])
        out += [f"# Partial: the program where the column is below {partial[0]} (of {last_dim}), {beyond} beyond;",
                "# the narrow inputs, of as many columns, are read there alone.",
                f"col = offsets % {last_dim}",
                f"inside = col < {partial[0]}"]
    narrow_mask = "inside" if variant.even else "mask & inside"
    loads = {i: f"x{i} = {_load(i, dt, mode, narrow_mask=narrow_mask)}"
             for i, (dt, mode) in enumerate(zip(program.input_dtypes, modes, strict=True)) if i not in rotated}
    if strided:
        # in_row: each branch loads the strided inputs itself, where Triton still knows their
        # offsets' contiguity (a value merged after an if has none)
        out += _unravel(rank, strided, "pid * BLOCK" if variant.index_bits == 32 else "pid.to(tl.int64) * BLOCK",
                        in_row=in_row, loads=[loads.pop(i) for i in strided if i in loads] if in_row else None)
    out.append("# Load the inputs and upcast to fp32.")
    out += loads.values()
    for i in rotated:
        # (a strided one: its own offsets, the launcher checks its last dim's stride is 1)
        at = "offsets" if modes[i] in ("rotate_half", "rotate_pairs") else f"x{i}_offsets"
        if modes[i].startswith("rotate_pairs"):
            out += [f"# x{i} read rotated in pairs (rotate_pairs): (x[2j], x[2j+1]) -> (-x[2j+1], x[2j]) along",
                    f"# the last dim ({last_dim})",
                    f"x{i}_even = (offsets % {last_dim}) % 2 == 0",
                    f"x{i} = {_load(i, program.input_dtypes[i], 'full', f'tl.where(x{i}_even, {at} + 1, {at} - 1)')}",
                    f"x{i} = tl.where(x{i}_even, x{i} * -1.0, x{i})"]
            continue
        half = (partial[0] if partial else last_dim) // 2
        moved = f"tl.where(x{i}_col < {half}, {at} + {half}, {at} - {half})"
        out += [f"# x{i} read rotated (rotate_half): the element {half} away along the last dim ({last_dim}),",
                "# the first half negated",
                f"x{i}_col = offsets % {last_dim}",
                f"x{i} = {_load(i, program.input_dtypes[i], 'full', moved)}",
                f"x{i} = tl.where(x{i}_col < {half}, x{i} * -1.0, x{i})"]
    base, sixteen_bit = len(program.input_dtypes), stores_16bit(program)
    for k, ins in enumerate(program.instrs):
        n = base + k
        out.append(f"# %{n} = {ins.op} {' '.join(_operand_text(a) for a in ins.args)}")
        out.append(f"tmp{n} = {_expr(ins, base, sixteen_bit)}")
    out.append("# Store, cast to the output dtypes.")
    for j, (v, dt) in enumerate(program.outputs):
        val = _value_name(v, base)
        if partial:
            val = f"tl.where(inside, {val}, {' + '.join(f'x{k}' for k in partial[1:])})"
        if dt != "f32":
            val = f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne")'
        out.append(f"tl.store(out{j}_ptr + offsets, {val}, mask=mask)")
    return out


def _unravel(rank: int, strided: list[int], start: str = "pid * BLOCK", in_row: bool = False,
             loads: list[str] | None = None) -> list[str]:
    """Each strided input's element offsets: an unrolled row-major unravel of `offsets` over
    the output's dims, and, from rank 2, two shortcuts taken at run time for a whole launch
    when every strided input reads along one contiguous dim of the output and broadcasts
    over the others (its strides are 0 but for a 1 there): a vector along the last dim (a
    bias over the channels or the hidden size: `offsets % size[-1]`) or along the one before
    it (a per-channel value over NCHW's H*W, a per-row value: `(offsets // size[-1]) %
    size[-2]`). The unravel costs an integer division and a remainder per dim on run-time
    sizes: in the sm_90 binary of a fp32 bias + erf-GELU chain of rank 3, 43 of its 124 SASS
    instructions an element (nvdisasm, static counts), the shortcut's remainder 17; on the H200
    that chain over [1024, 3072] ran at 14.6 µs against a 5.2 µs memory floor, 11.2 with the
    shortcuts (nineteenth and twentieth sessions, tuning's CUPTI timings).

    Within a shortcut, where a program's BLOCK consecutive elements (from `start`, the first)
    cross the last dim's end at most once (BLOCK <= size[-1]; along the last dim also up to
    four times), the remainders are its first element's, one scalar remainder per program,
    plus the lane, less size[-1] past each crossing: a compare and a select an element for
    each possible crossing instead of a remainder (`pointwise-wraps`: BERT-base's fp16 bias +
    GELU over [1024, 3072] at BLOCK 2048, which still lost to BiasGelu, 8.1 against 6.4 µs on
    the H200 in the twenty-first session).

    `in_row` (a variant whose launcher checks that the last dim is a multiple of BLOCK): a
    program's elements never cross the last dim's end, so the column is the first element's
    (a multiple of BLOCK, said with `tl.multiple_of`: Triton infers no divisibility for a
    remainder) plus the lane, contiguous and aligned: a bias is read in 16-byte vectors, not
    one element a load (`row-vector-loads`; sm_90 SASS of BERT's fp16 bias + GELU: LDG.E.128
    against 8 LDG.E.U16 a thread).
    `loads` (rank 2 and up): lines that each branch runs after its offsets (the strided inputs'
    loads)."""
    out = ["# Unravel the linear index into output coordinates for the strided inputs."]
    if rank == 0:
        return out + [f"x{i}_offsets = offsets * 0" for i in strided]
    if rank == 1:
        return out + ["idx0 = offsets"] + [f"x{i}_offsets = idx0 * stride_x{i}_0" for i in strided]
    last, before = rank - 1, rank - 2
    n = f"size{last}"

    def along(d: int) -> str:
        conds = [f"(stride_x{i}_{k} == {1 if k == d else 0})" for i in strided for k in range(rank)]
        return " & ".join(conds)

    def wrapped(times: int) -> list[str]:
        return ([f"        col = ({start}) % {n} + tl.arange(0, BLOCK)"]
                + [f"        col = tl.where(col >= {n}, col - {n}, col)"] * times)

    out.append("# Every strided input a vector along the last dim: the column, from the program's first")
    out.append("# element's and the lane where the block crosses the last dim's end at most four times,")
    out.append("# else one remainder an element.")
    out.append(f"if {along(last)}:")
    if in_row:
        out += ["    # The last dim is a multiple of BLOCK (the launcher checks): no program crosses its end,",
                "    # and each starts at a multiple of BLOCK within its row.",
                f"    col = tl.multiple_of(({start}) % {n}, BLOCK) + tl.arange(0, BLOCK)"]
    else:
        out += [f"    if BLOCK <= {n}:", *wrapped(1), f"    elif BLOCK <= 4 * {n}:", *wrapped(4),
                "    else:", f"        col = offsets % {n}"]
    out += [f"    x{i}_offsets = col" for i in strided] + [f"    {ln}" for ln in loads or ()]
    out.append("# ... or along the dim before it: the row, from the program's first element's where the")
    out.append("# block crosses the last dim's end at most once, else one division and one remainder.")
    out.append(f"elif {along(before)}:")
    out += [f"    if BLOCK <= {n}:",
            f"        lane = ({start}) % {n} + tl.arange(0, BLOCK)",
            f"        row = (({start}) // {n}) % size{before} + tl.where(lane >= {n}, 1, 0)",
            f"        row = tl.where(row >= size{before}, row - size{before}, row)",
            "    else:",
            f"        row = (offsets // {n}) % size{before}"]
    out += [f"    x{i}_offsets = row" for i in strided] + [f"    {ln}" for ln in loads or ()]
    out.append("else:")
    out.append("    rem = offsets")
    for d in range(rank - 1, 0, -1):
        out.append(f"    idx{d} = rem % size{d}")
        out.append(f"    rem = rem // size{d}")
    out.append("    idx0 = rem")
    for i in strided:
        terms = " + ".join(f"idx{d} * stride_x{i}_{d}" for d in range(rank))
        out.append(f"    x{i}_offsets = {terms}")
    return out + [f"    {ln}" for ln in loads or ()]


def _load(i: int, dtype: str, mode: str, at: str = "offsets", narrow_mask: str = "mask & inside") -> str:
    """Input i's load, upcast to fp32; `at`: a full input's element offsets (`_body` moves them
    for a rotate_half input); `narrow_mask`: a narrow input's (its columns alone)."""
    if mode == "scalar":
        load = f"tl.load(x{i}_ptr)"
    elif mode == "full":
        load = f"tl.load(x{i}_ptr + {at}, mask=mask)"
    elif mode == "narrow":
        load = f"tl.load(x{i}_ptr + x{i}_offsets, mask={narrow_mask}, other=0)"
    else:
        load = f"tl.load(x{i}_ptr + x{i}_offsets, mask=mask)"
    if dtype == "bool":
        return f"({load} != 0).to(tl.float32)"
    if dtype == "f32":
        return load
    return f"{load}.to(tl.float32)"


# One Triton expression per op; {0}, {1}, {2} are the operands.
OP_TABLE: dict[str, str] = {
    # Triton's unary minus is 0 - x, which turns -(+0.0) into +0.0; multiplying by -1 is
    # IEEE negation (seen on the H200: Neg(+0.0) gave +0.0 where ORT gives -0.0).
    "neg": "{0} * -1.0",
    "abs": "tl.abs({0})",
    "exp": "libdevice.exp({0})",
    "log": "libdevice.log({0})",
    "sqrt": "tl.sqrt_rn({0})",
    "tanh": "libdevice.tanh({0})",
    "erf": "libdevice.erf({0})",
    "cos": "libdevice.cos({0})",
    "sin": "libdevice.sin({0})",
    # t / (1 + t), t = exp(-|x|) (1 for x >= 0): never exp of a large positive number, so a
    # tiny result is not flushed to 0 by an overflowing exp(-x) (the compiler shares the exp)
    "sigmoid": "tl.div_rn(tl.where({0} >= 0, 1.0, libdevice.exp(-tl.abs({0}))), 1.0 + libdevice.exp(-tl.abs({0})))",
    "erfc": "libdevice.erfc({0})",
    "expm1": "libdevice.expm1({0})",
    # Both branches are finite where selected: exp(-x) <= 1 for x > 0, exp(x) <= 1 else.
    "softplus": "tl.where({0} > 0, {0} + libdevice.log1p(libdevice.exp(-{0})), libdevice.log1p(libdevice.exp({0})))",
    "round_f16": '{0}.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)',
    "round_bf16": '{0}.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)',
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "tl.div_rn({0}, {1})",
    "pow": "libdevice.pow({0}, {1})",
    "max": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "min": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "gt": "({0} > {1}).to(tl.float32)",
    "ge": "({0} >= {1}).to(tl.float32)",
    "lt": "({0} < {1}).to(tl.float32)",
    "le": "({0} <= {1}).to(tl.float32)",
    "eq": "({0} == {1}).to(tl.float32)",
    "select": "tl.where({0} != 0, {1}, {2})",
}
assert set(OP_TABLE) == set(UNARY) | set(BINARY) | set(TERNARY)

# erfc_16bit's Q: erfc(z) = t * 2^(Q(t) - z^2 log2(e)), t = 1 / (1 + z / 2), for z >= 0; fitted
# to log2(erfcx(z) / t) over t in (0, 1] by `benchmarks/fit_erfc16.py` (the form of the
# Chebyshev-fitted erfc of Press et al.'s Numerical Recipes, with coefficients of our own)
ERFC16_Q = (-1.82574462890625, 1.4422024488449097, 0.5527306795120239, 0.014989995397627354,
            0.32992950081825256, -1.2150795459747314, 0.9304348230361938, -0.22945979237556458)


def _erfc16_lines() -> list[str]:
    q = repr(ERFC16_Q[-1])
    for c in reversed(ERFC16_Q[:-1]):
        q = f"({q} * t + {c!r})"
    return [
        "@triton.jit",
        "def erfc_16bit(x):",
        '    """erfc(x) to a relative 4e-6 for |x| <= 4 (1e-5 down to where fp32 underflows), for',
        "    outputs stored in 16 bits: t exp(Q(t) - x^2) with t = 1 / (1 + |x| / 2), one polynomial",
        '    with a fast reciprocal and a fast exp2 (libdevice: two polynomials and an accurate exp)."""',
        "    z = tl.abs(x)",
        "    t = libdevice.fast_dividef(1.0, 1.0 + 0.5 * z)",
        f"    q = {q}",
        "    e = t * tl.exp2(q - z * (z * 1.4426950408889634))",
        "    return tl.where(x < 0, 2.0 - e, e)",
    ]


def _sigmoid16_lines() -> list[str]:
    return [
        "@triton.jit",
        "def sigmoid_16bit(x):",
        '    """1 / (1 + exp(-x)) to a relative 1.1e-6 for |x| <= 16 (4e-6 at |x| = 80), for outputs',
        "    stored in 16 bits: t / (1 + t) with t = exp(-|x|) (1 for x >= 0) by the fast exp2 and",
        '    division, so that it neither overflows nor flushes a representable result to 0."""',
        "    t = tl.exp2(tl.abs(x) * -1.4426950408889634)",
        "    return libdevice.fast_dividef(tl.where(x >= 0, 1.0, t), 1.0 + t)",
    ]


# op -> (its expression, the helper's module lines) in a program whose every output is stored
# as fp16 or bf16 (`onnxfuse.expr.relax_16bit` writes 1 + erf(y) as erfc(-y) and 1 + tanh(z) as
# 2 sigmoid(2z) there too): libdevice's erfc takes two polynomials, an accurate exp and their
# select (sm_90 SASS, the fp16 bias + GELU chain: 34 instructions an element with erf + 1)
SIXTEEN_BIT_FORMS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "erfc": ("erfc_16bit({0})", _erfc16_lines),
    "sigmoid": ("sigmoid_16bit({0})", _sigmoid16_lines),
}


def stores_16bit(program: Program) -> bool:
    """Whether every output of `program` is stored as fp16 or bf16 (its math may then take
    `SIXTEEN_BIT_FORMS`)."""
    return all(dt in SIXTEEN_BIT for _, dt in program.outputs)


def helper_lines(*programs: Program) -> list[str]:
    """The module-level helpers the programs' 16-bit forms call, each after two blank lines;
    nothing where none is used."""
    ops = {ins.op for p in programs if stores_16bit(p) for ins in p.instrs}
    out: list[str] = []
    for op, (_, lines) in SIXTEEN_BIT_FORMS.items():
        if op in ops:
            out += ["", "", *lines()]
    return out

# A comparison whose left operand is a literal is written mirrored (x < 2.0, not 2.0 > x).
_MIRROR = {"gt": "lt", "ge": "le", "lt": "gt", "le": "ge", "eq": "eq"}


def _expr(ins: Instr, base: int, sixteen_bit: bool = False) -> str:
    return expr_text(ins, lambda v: _value_name(v, base), sixteen_bit)


def expr_text(ins: Instr, name: Callable[[int], str], sixteen_bit: bool = False) -> str:
    """The Triton expression of one instruction, value %v named `name(v)`; shared by every
    kind's generator. `sixteen_bit`: the program stores every output in 16 bits
    (`stores_16bit`), so erfc and sigmoid take `SIXTEEN_BIT_FORMS` (`helper_lines`)."""
    op, args = ins.op, list(ins.args)
    if op in _MIRROR and not isinstance(args[0], Ref) and isinstance(args[1], Ref):
        op, args = _MIRROR[op], [args[1], args[0]]
    if op == "div" and isinstance(args[0], Ref) and (r := _exact_reciprocal(args[1])) is not None:
        # x / 2^k is x * 2^-k exactly (both round the same real number), in one instruction
        # rather than div_rn's sequence (the attention's / 8 at head dim 64)
        op, args = "mul", [args[0], r]
    texts = [name(a.index) if isinstance(a, Ref) else _literal(a) for a in args]
    if not any(isinstance(a, Ref) for a in args):
        # Only literals: make the first one an fp32 tensor so the math stays in Triton.
        texts[0] = f"tl.full([], {_literal(args[0])}, tl.float32)"
    table = OP_TABLE[op] if not (sixteen_bit and op in SIXTEEN_BIT_FORMS) else SIXTEEN_BIT_FORMS[op][0]
    return table.format(*texts)


def _exact_reciprocal(value: Operand) -> float | None:
    """1 / value where value is a literal power of two whose reciprocal is a normal fp32
    (so that multiplying by it equals dividing, for every x); else None."""
    if isinstance(value, Ref):
        return None
    v = float(np.float32(value))
    if v == 0 or not math.isfinite(v):
        return None
    mantissa, exponent = math.frexp(abs(v))  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    if mantissa != 0.5 or not -126 <= 1 - exponent <= 127:
        return None
    return 1.0 / v


def _value_name(v: int, base: int) -> str:
    return f"x{v}" if v < base else f"tmp{v}"


def _operand_text(a: Operand) -> str:
    return f"%{a.index}" if isinstance(a, Ref) else repr(float(a))


_FP32_MAX = float(np.finfo(np.float32).max)


def _literal(value: float) -> str:
    """A Python expression for the fp32 value of `value` that Triton types as fp32.

    The shortest decimal is used when Triton's double -> fp32 rounding gives back the same
    fp32 (always, in practice); inf and nan are spelled ``float("inf")`` etc. Subnormal fp32
    values would be typed fp64 by Triton, so they become explicit fp32 tensors.
    """
    v32 = np.float32(value)
    if math.isnan(v32):
        return 'float("nan")'
    if math.isinf(v32):
        return 'float("inf")' if v32 > 0 else 'float("-inf")'
    text = str(v32)
    if np.float32(float(text)).tobytes() != v32.tobytes() or abs(float(text)) > _FP32_MAX:
        # the shortest decimal of FLT_MAX (3.4028235e+38) is above it as a double: Triton
        # would type it fp64; the exact value is not
        text = repr(float(v32))
    if v32 != 0 and abs(float(v32)) < 2.0**-126:
        return f"tl.full([], {text}, tl.float32)"
    return text
