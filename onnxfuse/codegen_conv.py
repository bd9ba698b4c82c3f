"""Code generation for FusedConv and FusedMaxPool (docs/format.md): Triton source text.

FusedConv is a 2-D convolution written as an implicit GEMM over NCHW tensors:

    M = output pixels (n, p, q)     N = output channels k     K = (r, s, c) reduction

Each program computes a BLOCK_M x BLOCK_N tile of the output. One flat loop walks the
reduction in steps of BLOCK_K input channels for each kernel tap (r, s): the A tile is the
[BLOCK_M pixels, BLOCK_K channels] slice of X that the tap reads (masked where the tap
falls into the padding), the B tile the [BLOCK_K, BLOCK_N] slice of the packed weights
[R, S, C, K] (contiguous along K). One flat loop lets Triton pipeline the loads
(`num_stages`) even when C is small. The epilogue adds the bias, rounds to the conv's
dtype (fp16), loads the extra inputs through broadcast strides and evaluates the pointwise
program on the tile; then either stores the tile or, when a tiling MaxPool is fused, takes
the max over each window before the store, so the full-size activation never reaches DRAM.

Every max of a pool propagates NaN (`MAX_NAN`, PTX max.NaN.f32), as numpy and torch do: a
window that holds a NaN gives NaN, wherever it lies; padding, masked to -inf, never wins.

With a pool in the epilogue, the M index enumerates (n, op, oq, window position) with the
window position fastest; windows whose size is not a power of two are padded to the next
power of two with masked rows (tensors in Triton have power-of-two shapes).

FusedMaxPool has three kernels, picked by the variant's `tile` (PoolVariant):
- "flat": each program computes BLOCK pooled outputs of one flat NCHW index; each tap of
  the window is loaded, run through the prologue program, masked to -inf in the padding,
  and max-reduced. Any pool attributes.
- "rows": pools whose windows tile the input (PoolAttrs.tiles, e.g. 2x2 stride 2), NCHW.
  Each program takes a [BLOCK_OH, BLOCK_OW] tile of one (n, c) plane; for each window row
  it loads the contiguous input span under the tile's columns as [BLOCK_OH, BLOCK_OW * KW]
  and reduces each window's KW neighbours with a reshape + max. No per-element division.
- "nhwc": channels-last X. Each program takes [BLOCK_P output pixels, BLOCK_C channels];
  a tap's load reads BLOCK_C contiguous channels per pixel, and the pixel's (n, oh, ow)
  is computed once per row of the tile, not per element. Any pool attributes.

Grouped and depthwise convs (group > 1) have two loops:
- the direct loop (depthwise convs, narrow groups): per tap and input channel of the group,
  a [pixels, channels] tile of X times one weight per output channel, in fp32 on CUDA cores.
  A depthwise conv reduces over one channel per tap: there is no GEMM to feed tensor cores.
- the block-diagonal GEMM (ConvVariant.group_gemm; groups of CG >= 2 channels): a tile's
  BLOCK_N output channels cover whole groups (or lie in one), whose input channels are one
  contiguous span of CI_SPAN channels; per tap, the [pixels, span] tile of X times the
  [span, BLOCK_N] matrix that holds each group's weights on its diagonal block and zeros
  elsewhere runs on the tensor cores. The zeros cost tensor-core FLOPs (BLOCK_N / KG times
  the conv's), which a grouped conv has to spare: it is bound by moving X. A tile of
  several groups takes one dot per group, its X tile masked to the group's channels and the
  product kept in the group's columns only: a NaN or Inf in one group's input times another
  group's zero weights would otherwise make NaN in that group's outputs. Float32 follows the
  spec's precision as the group-1 kernels do ("tf32": both operands rounded to TF32 here);
  `group_gemm_fits` says which tiles can.
The tile, the masks and the epilogue are the GEMM kernel's.

Split K (ConvVariant.split > 1; group 1, no pool in the epilogue): for outputs too small
to fill the GPU (a deep layer at batch 1: 100 pixels x 64 filters is one or two tiles, each
with a 72-step reduction), the grid's third axis splits the reduction steps into SPLIT
slices of SPLIT_STEPS (SPLIT divides the step count; both are compile-time constants).
Each program writes its partial tile (fp32) to a workspace and increments the tile's
arrival counter; the program that arrives last sums the SPLIT partials and runs the
epilogue, so the bias and the pointwise program see the whole sum. The launcher allocates
the workspace, zeroes the counters before each launch and picks the split kernel only when
the plain one would leave most SMs idle (docs/format.md, kind conv).

Precision of float32 convs (ConvSpec.precision, `--conv-precision`): the tensor-core
kernels pass it to `tl.dot` as `input_precision`. Triton's "tf32" truncates the fp32
operands to TF32 (a bias of about -7e-4 of the result on positive data), where cuBLAS and
cuDNN round them to nearest; so a "tf32" kernel rounds its activation operand first, with
the `round_to_tf32` helper defined in its module (ROUND_TO_TF32), and reads weights that
the compile step rounded the same way when it packed them (`prerounds_weights`): its error
is cuDNN's TF32 error. "tf32x3" and "ieee" are used as they are. Grouped convs (the direct loop)
multiply in fp32 whatever the precision, fp16 convs in fp16.

The program text is evaluated with the expression table of `onnxfuse.codegen`, so the
numerics of the epilogue are exactly those of PointwiseChain kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from onnxfuse.codegen import (
    POINTER_TYPES,
    TL_DTYPES,
    KernelSource,
    _comment_text,
    _expr,
    _operand_text,
    _value_name,
    check_kernel_name,
    helper_lines,
    stores_16bit,
)
from onnxfuse.expr import Program
from onnxfuse.layers import ConvAttrs, PoolAttrs

PRECISIONS = ("tf32", "tf32x3", "ieee")  # tl.dot input_precision for float32 convolutions
# "tf32" kernels round their activation operand to the nearest TF32 value (`ROUND_TO_TF32`)
# before each tl.dot, whose tf32 mode would truncate it; their weights are rounded once, when
# the compile step packs them (`onnxfuse.kernels.compile_fused`, `prerounds_weights`), so
# they reach the tensor cores straight from memory. Rounding both operands in the kernel
# ("ab") gave the same error and ran 1.1-3.9x slower than the truncating kernel on the H200
# (BENCHMARKS.md, "Conv precision"): the weight tile then goes through registers instead of
# the asynchronous copy into shared memory. Private switch, for benchmarks/conv_precision.py
# only: "a" (shipped), "ab", or "" (Triton's truncation). Nothing in the package changes it.
_ROUND_TF32 = "a"
# The helper a rounding kernel's module defines once, above the kernel. TF32 keeps fp32's
# sign and 8 exponent bits and the top 10 of its 23 mantissa bits.
ROUND_TO_TF32 = [
    "@triton.jit",
    "def round_to_tf32(x):",
    '    """Float32 x rounded to the nearest TF32 value (10-bit mantissa), ties away from zero."""',
    "    # tl.dot(..., input_precision=\"tf32\") truncates float32 operands to TF32: it drops the",
    "    # low 13 mantissa bits, a bias of about -7e-4 of the result on positive operands.",
    "    # cuBLAS and cuDNN round them instead, as PTX cvt.rna.tf32.f32 does; rounded here, the",
    "    # dot's truncation only drops zeros. Add half of the lowest kept bit to the bit",
    "    # pattern and clear the dropped bits (a carry out of the mantissa steps the exponent",
    "    # up, as rounding should). Inf and NaN (exponent bits all ones) stay as they are: a",
    "    # NaN whose payload lies in the low bits only would otherwise become Inf. Integer",
    "    # operations only, so that Triton's CPU interpreter runs it too.",
    "    bits = x.to(tl.uint32, bitcast=True)",
    "    rounded = (bits + 0x1000) & 0xFFFFE000",
    "    finite = (bits & 0x7F800000) != 0x7F800000",
    "    return tl.where(finite, rounded, bits).to(tl.float32, bitcast=True)",
]
# The max of every pool (FusedMaxPool's kernels, a pool in FusedConv's epilogue), defined
# once in the module above the kernel: the running max over a window's taps and, as the
# combine function of tl.reduce, the max over a window's elements. tl.max, and tl.maximum
# at its default, compile to PTX max.f32, which returns the operand that is not NaN: a window
# holding a NaN gave the max of its other elements (-inf when all were NaN).
MAX_NAN = [
    "@triton.jit",
    "def max_nan(a, b):",
    '    """max(a, b), NaN when either is NaN (PTX max.NaN.f32), as numpy\'s maximum and torch\'s',
    "    max pool: a window that holds a NaN gives NaN wherever the NaN lies. tl.max and",
    '    tl.maximum at its default would drop the NaN (max.f32)."""',
    "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)",
]
INT_TYPE = "i32"  # every integer parameter of conv and maxpool kernels (docs/format.md)
MAX_ELEMENTS = 2**31 - 1


@dataclass(frozen=True)
class ConvVariant:
    """Tile sizes and pipeline depth of one conv binary."""

    index: int = 0
    block_m: int = 128
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    # One flat reduction over (tap, channel) instead of BLOCK_K channels per tap: for convs
    # with few input channels (an RGB image: 3 channels would fill 3 of every BLOCK_K).
    flat: bool = False
    # Split K (module docstring): the number of slices the reduction is split into; 0 or 1
    # for the plain kernel. Must divide the step count (`conv_steps`).
    split: int = 0
    # Grouped convs only: the block-diagonal GEMM on the tensor cores (module docstring)
    # instead of the direct loop on CUDA cores. Needs `group_gemm_fits`.
    group_gemm: bool = False
    # A small-M variant (group 1, no pool; `onnxfuse.kinds.conv.small_m_variant`): the
    # launcher picks it only when the run-time M = N·P·Q is at most this (and no split-K
    # variant runs); 0: no such limit. Its kernel is the same implicit GEMM in a 16-row tile:
    # any M would run right, only slower.
    max_m: int = 0

    @property
    def split_k(self) -> bool:
        return self.split > 1

    def requires(self) -> dict[str, int]:
        # ptr_align: the weight and bias pointers carry 16-byte divisibility hints (vector
        # loads); the launcher checks every pointer before it launches.
        return {"max_elements": MAX_ELEMENTS, "ptr_align": 16}

    def meta(self) -> dict[str, int]:
        """The block sizes (and slices) as kernel_meta's variant lists them (docs/format.md,
        kind conv): a "split" key makes it a split-K kernel, launched over a 3-D grid; a
        "max_m" key a small-M kernel, launched only for M up to it."""
        return {"block_m": self.block_m, "block_n": self.block_n, **({"split": self.split} if self.split_k else {}),
                **({"max_m": self.max_m} if self.max_m else {})}


POOL_TILES = ("flat", "rows", "nhwc")


@dataclass(frozen=True)
class PoolVariant:
    """Which FusedMaxPool kernel (`tile`, see the module docstring) and its block sizes:
    "flat" uses `block`, "rows" `block_oh` x `block_ow`, "nhwc" `block_p` x `block_c`."""

    index: int = 0
    block: int = 512
    num_warps: int = 4
    tile: str = "flat"
    block_oh: int = 0
    block_ow: int = 0
    block_p: int = 0
    block_c: int = 0
    # nhwc: C a multiple of this (and the pointers 16-byte aligned): the kernel is compiled
    # with C divisible by 16, so its loads along the channels vectorize; 0: no requirement
    c_multiple: int = 0
    # rows: the input width W a multiple of this (and the pointers aligned): loads along the
    # rows vectorize; 0: no requirement
    w_multiple: int = 0

    def requires(self) -> dict[str, int]:
        req = {"max_elements": MAX_ELEMENTS}
        if self.c_multiple:
            req.update(c_multiple=self.c_multiple, ptr_align=16)
        if self.w_multiple:
            req.update(w_multiple=self.w_multiple, ptr_align=16)
        return req

    def meta(self) -> dict[str, int]:
        """The block sizes as kernel_meta's variant lists them (docs/format.md, kind maxpool):
        which keys are present says which grid the launcher uses."""
        if self.tile == "rows":
            return {"block_oh": self.block_oh, "block_ow": self.block_ow}
        if self.tile == "nhwc":
            return {"block_p": self.block_p, "block_c": self.block_c}
        return {"block": self.block}

    def grid(self, n: int, c: int, oh: int, ow: int) -> tuple[int, int]:
        """The launch grid for output [N, C, OH, OW] (logical sizes, any layout), as the C++
        launcher computes it."""
        if self.tile == "rows":
            return (n * c * -(-oh // self.block_oh) * -(-ow // self.block_ow), 1)
        if self.tile == "nhwc":
            return (-(-(n * oh * ow) // self.block_p), -(-c // self.block_c))
        return (-(-(n * c * oh * ow) // self.block), 1)


@dataclass(frozen=True)
class ConvSpec:
    """What a FusedConv kernel computes: channels, layer parameters, dtype, epilogue."""

    kind: ClassVar[str] = "conv"
    name: str
    program: Program  # %0: conv output incl. bias; %1...: the extras; one output
    channels: int  # C
    filters: int  # K
    conv: ConvAttrs
    pool: PoolAttrs | None = None  # only tiling pools (PoolAttrs.tiles)
    precision: str = "tf32"
    source_nodes: tuple[str, ...] = ()
    # Memory layout of X and Y: "nchw" (ONNX's) or "nhwc" (channels last: a tile's channels
    # are contiguous, so loads and stores vectorize). Extra inputs are read through strides
    # in any layout. benchmarks/conv_kernels.py --layouts measures both; the optimizer emits
    # nhwc where `optimize --layout nhwc` (onnxfuse.layout) asks for it.
    x_layout: str = "nchw"
    y_layout: str = "nchw"
    extra_layouts: tuple[int, ...] = ()  # for kernel_meta only: extras are read through strides
    # Packed weight layout: "rsck" ([R, S, C, K], filters contiguous) or "krsc" ([K, R, S, C],
    # channels contiguous: the B tile is K-major, which sm_90's TF32 wgmma needs).
    w_layout: str = "rsck"
    # TF32 rounding at the producer (`onnxfuse.rounding`), float32 "tf32" convs only:
    # x_rounded: X holds TF32 values already (every tensor it is made of was stored rounded),
    # so the kernel feeds it to tl.dot as loaded, on the asynchronous-copy path; round_y: the
    # kernel stores Y rounded to TF32, because every reader of Y would round it anyway.
    x_rounded: bool = False
    round_y: bool = False

    @property
    def dtype(self) -> str:
        return self.program.input_dtypes[0]

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - 1

    @property
    def window(self) -> tuple[int, int] | None:
        return None if self.pool is None else self.pool.kernel


@dataclass(frozen=True)
class MaxPoolSpec:
    """What a FusedMaxPool kernel computes: the prologue program, the pool, the layouts."""

    kind: ClassVar[str] = "maxpool"
    name: str
    program: Program  # %0: X; %1...: the extras; one output
    pool: PoolAttrs
    source_nodes: tuple[str, ...] = ()
    # Memory layout of X and Y, "nchw" or "nhwc" (docs/format.md, FusedMaxPool); extras are
    # read through strides over the logical [N, C, H, W] in any layout.
    x_layout: str = "nchw"
    y_layout: str = "nchw"

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - 1


def conv_param_names(n_extras: int, split: bool = False) -> list[str]:
    """Kernel parameters in launch order (docs/format.md, kind conv), without constexprs."""
    names = ["x_ptr", "w_ptr", "b_ptr"] + [f"e{i}_ptr" for i in range(n_extras)] + ["y_ptr"]
    names += ["N", "H", "W", "P", "Q", "OP", "OQ"]
    for i in range(n_extras):
        names += [f"stride_e{i}_n", f"stride_e{i}_k", f"stride_e{i}_p", f"stride_e{i}_q"]
    if split:
        names += ["ws_ptr", "cnt_ptr"]
    return names


def conv_steps(spec: ConvSpec, variant: ConvVariant) -> int:
    """Steps of the reduction loop: BLOCK_K channels per tap, or cdiv(R * S * C, BLOCK_K) flat."""
    r, s = spec.conv.kernel
    if variant.flat:
        return -(-(r * s * spec.channels) // variant.block_k)
    if variant.group_gemm:
        return r * s * -(-group_span(spec, variant.block_n) // variant.block_k)
    return r * s * -(-spec.channels // variant.block_k)


def maxpool_param_names(n_extras: int) -> list[str]:
    names = ["x_ptr"] + [f"e{i}_ptr" for i in range(n_extras)] + ["y_ptr"]
    names += ["N", "C", "H", "W", "OH", "OW"]
    for i in range(n_extras):
        names += [f"stride_e{i}_n", f"stride_e{i}_c", f"stride_e{i}_h", f"stride_e{i}_w"]
    return names


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def group_span(spec: ConvSpec, block_n: int) -> int:
    """Input channels one BLOCK_N tile of a grouped conv's block-diagonal GEMM reads: whole
    groups' CG channels for the BLOCK_N // KG groups the tile covers, or one group's CG when
    the tile lies inside a group."""
    cg, kg = spec.channels // spec.conv.group, spec.filters // spec.conv.group
    return max(block_n // kg, 1) * cg


def group_gemm_fits(spec: ConvSpec, block_n: int) -> bool:
    """Whether a grouped conv can run the block-diagonal GEMM with BLOCK_N columns: every
    tile holds whole groups (KG divides BLOCK_N) or lies inside one (BLOCK_N divides KG), so
    its input channels are one span, and the dot's N is at least 16."""
    kg = spec.filters // spec.conv.group
    return spec.conv.group != 1 and block_n >= 16 and (block_n % kg == 0 or kg % block_n == 0)




def _check_program(program: Program, name: str) -> None:
    program.validate()
    check_kernel_name(name)
    if len(program.outputs) != 1:
        raise ValueError(f"{name}: the program must have exactly one output, it has {len(program.outputs)}")
    if program.input_dtypes[0] not in ("f32", "f16"):
        raise ValueError(f"{name}: conv/pool input dtype {program.input_dtypes[0]} is not f32 or f16")


def generate_conv(spec: ConvSpec, variant: ConvVariant) -> KernelSource:
    """The Triton kernel of a FusedConv node."""
    _check_program(spec.program, spec.name)
    if spec.precision not in PRECISIONS:
        raise ValueError(f"precision {spec.precision!r} is not one of {PRECISIONS}")
    if spec.x_layout not in ("nchw", "nhwc") or spec.y_layout not in ("nchw", "nhwc"):
        raise ValueError(f"layouts must be nchw or nhwc, not {spec.x_layout!r}/{spec.y_layout!r}")
    if spec.w_layout not in ("rsck", "krsc"):
        raise ValueError(f"weight layout must be rsck or krsc, not {spec.w_layout!r}")
    group = spec.conv.group
    if group < 1 or spec.channels % group or spec.filters % group:
        raise ValueError(f"{spec.name}: group {group} does not divide C = {spec.channels} and K = {spec.filters}")
    if group != 1 and variant.flat:
        raise ValueError(f"{spec.name}: the flat reduction is for group 1; grouped convs use the direct loop")
    if spec.pool is not None and not spec.pool.tiles:
        raise ValueError(f"{spec.name}: only a pool whose windows tile the input runs in the conv epilogue")
    for v in (variant.block_m, variant.block_n, variant.block_k, variant.num_warps):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"conv tile sizes and num_warps must be powers of two: {variant}")
    if variant.group_gemm and not group_gemm_fits(spec, variant.block_n):
        raise ValueError(f"{spec.name}: the block-diagonal GEMM needs a grouped conv whose KG = "
                         f"{spec.filters // group} divides BLOCK_N = {variant.block_n} or is a multiple of it")
    if (group == 1 or variant.group_gemm) and (variant.block_k < 16 or variant.block_n < 16 or variant.block_m < 16):
        raise ValueError("tl.dot needs tiles of at least 16")
    split = variant.split_k
    if split and (group != 1 or spec.pool is not None):
        raise ValueError(f"{spec.name}: split K is for group-1 convs without a pool in the epilogue")
    if variant.max_m and (group != 1 or spec.pool is not None or split or variant.max_m < 0):
        raise ValueError(f"{spec.name}: a small-M variant is for group-1 convs without a pool, not split")
    if split and conv_steps(spec, variant) % variant.split:
        raise ValueError(f"{spec.name}: split {variant.split} does not divide the {conv_steps(spec, variant)} steps")
    win = 1
    if spec.pool is not None:
        win = next_pow2(spec.pool.kernel[0] * spec.pool.kernel[1])
        if variant.block_m % win or variant.block_m // win < 1:
            raise ValueError(f"BLOCK_M {variant.block_m} is not a multiple of the padded window {win}")
    names = conv_param_names(spec.n_extras, split)
    dt = spec.dtype
    types = [POINTER_TYPES[dt]] * 3 + [POINTER_TYPES[d] for d in spec.program.input_dtypes[1:]]
    types += [POINTER_TYPES[spec.program.outputs[0][1]]]
    types += [INT_TYPE] * (len(names) - len(types) - (2 if split else 0))
    if split:  # the workspace and the arrival counters
        types += ["*fp32", "*i32"]
    conv = spec.conv
    (r, s), (sh, sw), (pt, pl, _, _), (dh, dw) = conv.kernel, conv.strides, conv.pads, conv.dilations
    constexprs = [
        ("C", spec.channels), ("K", spec.filters), ("R", r), ("S", s), ("STRIDE_H", sh), ("STRIDE_W", sw),
        ("PAD_H", pt), ("PAD_W", pl), ("DIL_H", dh), ("DIL_W", dw),
        ("PH", spec.pool.kernel[0] if spec.pool else 1), ("PW", spec.pool.kernel[1] if spec.pool else 1),
        ("WIN", win),
        ("BLOCK_M", variant.block_m), ("BLOCK_N", variant.block_n), ("BLOCK_K", variant.block_k),
        ("C_BLOCKS", -(-spec.channels // variant.block_k)),
        ("STEPS", conv_steps(spec, variant)),
    ]
    if split:
        constexprs += [("SPLIT", variant.split), ("SPLIT_STEPS", conv_steps(spec, variant) // variant.split)]
    if group != 1:  # channels per group, in and out
        constexprs += [("CG", spec.channels // group), ("KG", spec.filters // group)]
    if variant.group_gemm:  # the input channels a tile reads, in blocks of BLOCK_K; its groups
        span = group_span(spec, variant.block_n)
        constexprs += [("CI_SPAN", span), ("CI_BLOCKS", -(-span // variant.block_k)),
                       ("GROUPS_PER_TILE", max(variant.block_n * group // spec.filters, 1))]
    source = _conv_module(spec, variant, names, [c for c, _ in constexprs])
    # 16-byte alignment of the pointers is always true for ORT's allocations (the launcher
    # checks it: ptr_align); it lets Triton vectorize the contiguous weight loads and, channels
    # last, the activation loads and stores.
    divisible = (0, 1, 2, 3 + spec.n_extras) + ((names.index("ws_ptr"),) if split else ())
    return KernelSource(name=spec.name, source=source, params=tuple(zip(names, types, strict=True)),
                        constexprs=tuple(constexprs), divisible=divisible, num_warps=variant.num_warps,
                        variant=variant, num_stages=variant.num_stages)


def generate_maxpool(spec: MaxPoolSpec, variant: PoolVariant) -> KernelSource:
    """The Triton kernel of a FusedMaxPool node, of the variant's `tile` kind."""
    _check_program(spec.program, spec.name)
    p = spec.pool
    layouts = (spec.x_layout, spec.y_layout)
    if not set(layouts) <= {"nchw", "nhwc"}:
        raise ValueError(f"layouts must be nchw or nhwc, not {spec.x_layout!r}/{spec.y_layout!r}")
    if variant.tile not in POOL_TILES:
        raise ValueError(f"pool tile {variant.tile!r} is not one of {POOL_TILES}")
    if variant.tile in ("flat", "rows") and layouts != ("nchw", "nchw"):
        raise ValueError(f"{spec.name}: the {variant.tile!r} pool kernel reads and writes NCHW, not {layouts}")
    if variant.tile == "nhwc" and spec.x_layout != "nhwc":
        raise ValueError(f"{spec.name}: the 'nhwc' pool kernel reads a channels-last X")
    if variant.tile == "rows" and not p.tiles:
        raise ValueError(f"{spec.name}: the 'rows' pool kernel needs windows that tile the input")
    if variant.c_multiple not in (0, 16) or variant.c_multiple and variant.tile != "nhwc":
        raise ValueError(f"{spec.name}: c_multiple is 16 (nhwc pools) or 0, not {variant.c_multiple}")
    if variant.w_multiple not in (0, 16) or variant.w_multiple and variant.tile != "rows":
        raise ValueError(f"{spec.name}: w_multiple is 16 (rows pools) or 0, not {variant.w_multiple}")
    blocks = {"flat": ("BLOCK",), "rows": ("BLOCK_OH", "BLOCK_OW"), "nhwc": ("BLOCK_P", "BLOCK_C")}[variant.tile]
    sizes = {"BLOCK": variant.block, "BLOCK_OH": variant.block_oh, "BLOCK_OW": variant.block_ow,
             "BLOCK_P": variant.block_p, "BLOCK_C": variant.block_c}
    for v in [sizes[b] for b in blocks] + [variant.num_warps]:
        if v <= 0 or v & (v - 1):
            raise ValueError(f"pool block sizes and num_warps must be powers of two: {variant}")
    names = maxpool_param_names(spec.n_extras)
    types = [POINTER_TYPES[d] for d in spec.program.input_dtypes] + [POINTER_TYPES[spec.program.outputs[0][1]]]
    types += [INT_TYPE] * (len(names) - len(types))
    constexprs = [
        ("KH", p.kernel[0]), ("KW", p.kernel[1]), ("SH", p.strides[0]), ("SW", p.strides[1]),
        ("PAD_H", p.pads[0]), ("PAD_W", p.pads[1]), ("DH", p.dilations[0]), ("DW", p.dilations[1]),
    ]
    if variant.tile == "rows":
        constexprs.append(("KW_P", next_pow2(p.kernel[1])))
    constexprs += [(b, sizes[b]) for b in blocks]
    body = {"flat": _pool_flat_body, "rows": _pool_rows_body, "nhwc": _pool_nhwc_body}[variant.tile](spec)
    source = _maxpool_module(spec, variant, names, [c for c, _ in constexprs], body)
    # c_multiple / w_multiple: the pointers 16-byte aligned and C / W a multiple of 16 (the
    # launcher checks both)
    divisible: tuple[int, ...] = ()
    if variant.c_multiple or variant.w_multiple:
        divisible = (*range(spec.n_extras + 2), names.index("C" if variant.c_multiple else "W"))
    return KernelSource(name=spec.name, source=source, params=tuple(zip(names, types, strict=True)),
                        constexprs=tuple(constexprs), divisible=divisible, num_warps=variant.num_warps,
                        variant=variant, num_stages=None)


# ---------------------------------------------------------------------------------------
# module text
# ---------------------------------------------------------------------------------------


def _header(name: str, what: str, program: Program, source_nodes, helpers: Sequence[str] = ()) -> list[str]:
    """The module's comment block and imports, then `helpers` (jit functions the kernel
    calls), then the kernel's decorator."""
    lines = [f"# {name}: generated by onnxfuse.codegen_conv; do not edit.", "#", f"# {what}", "#",
             "# Replaces the ONNX nodes:"]
    lines += [f"#   {_comment_text(n)}" for n in source_nodes] or ["#   (none listed)"]
    lines += ["#", "# Program (%0 is the value the pointwise part starts from):"]
    lines += [f"#   {line}" for line in program.to_text().splitlines()]
    lines += ["", "import triton", "import triton.language as tl", "from triton.language.extra import libdevice"]
    lines += helper_lines(program)
    if helpers:
        lines += ["", "", *helpers]
    return lines + ["", "", "@triton.jit"]


def _signature(name: str, names: list[str], constexprs: list[str]) -> list[str]:
    """The def line: the parameters in launch order, one line per run of pointers, sizes or
    one extra input's strides, then the constexprs."""
    def kind(n: str) -> str:
        return "ptr" if n.endswith("_ptr") else n.rsplit("_", 1)[0] if n.startswith("stride_") else "int"

    out, run = [f"def {name}("], []
    for n in names:
        if run and kind(run[-1]) != kind(n):
            out.append(f"    {', '.join(run)},")
            run = []
        run.append(n)
    out.append(f"    {', '.join(run)},")
    out.append(f"    {', '.join(f'{c}: tl.constexpr' for c in constexprs)},")
    return out + ["):"]


def _program_lines(program: Program) -> list[str]:
    base, sixteen_bit = len(program.input_dtypes), stores_16bit(program)
    out = []
    for k, ins in enumerate(program.instrs):
        n = base + k
        out.append(f"# %{n} = {ins.op} {' '.join(_operand_text(a) for a in ins.args)}")
        out.append(f"tmp{n} = {_expr(ins, base, sixteen_bit)}")
    return out


def _extra_loads(program: Program, coords: tuple[str, str, str, str], mask: str, dims: str) -> list[str]:
    lines = []
    for i, dt in enumerate(program.input_dtypes[1:]):
        a, b, c, d = coords
        off = (f"{a} * stride_e{i}_{dims[0]} + {b} * stride_e{i}_{dims[1]} + "
               f"{c} * stride_e{i}_{dims[2]} + {d} * stride_e{i}_{dims[3]}")
        load = f"tl.load(e{i}_ptr + ({off}), mask={mask}, other=0)"
        if dt == "bool":
            load = f"({load} != 0).to(tl.float32)"
        elif dt != "f32":
            load += ".to(tl.float32)"
        lines.append(f"x{i + 1} = {load}")
    return lines


def _out_value(program: Program) -> tuple[str, str]:
    v, dt = program.outputs[0]
    return _value_name(v, len(program.input_dtypes)), dt


def _store_cast(val: str, dt: str) -> str:
    return val if dt == "f32" else f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne")'


def rounds_to_tf32(spec: ConvSpec) -> bool:
    """Whether the dot operands of `spec` are rounded to TF32 (`ROUND_TO_TF32`) before the
    tensor cores see them: float32 tensor-core convs (group 1) at precision "tf32". Grouped
    convs multiply in fp32 on CUDA cores; tf32x3 and ieee are as precise as fp32; fp16
    operands are exact already. Where the activations are rounded (in this kernel, or by
    their producers: `x_rounded`) is `rounds_activations`."""
    return bool(_ROUND_TF32) and spec.dtype == "f32" and spec.precision == "tf32" and spec.conv.group == 1


def rounds_activations(spec: ConvSpec) -> bool:
    """Whether the kernel itself rounds its A (activation) tiles before the dot: it rounds
    to TF32 and its X was not stored rounded by its producers (`ConvSpec.x_rounded`)."""
    return rounds_to_tf32(spec) and not (spec.x_rounded and _ROUND_TF32 == "a")


def stores_rounded(spec: ConvSpec) -> bool:
    """Whether the kernel rounds Y to TF32 when it stores it (`ConvSpec.round_y`): float32
    convs at precision "tf32" whose readers all round their activations."""
    return (spec.round_y and bool(_ROUND_TF32) and spec.dtype == "f32" and spec.precision == "tf32"
            and spec.program.outputs[0][1] == "f32")


def prerounds_weights(spec: ConvSpec) -> bool:
    """Whether the kernel of `spec` expects its packed weights rounded to TF32 already (it
    rounds only the activations): the compile step rounds them when it attaches the kernel."""
    return rounds_to_tf32(spec) and _ROUND_TF32 == "a"


def round_array_to_tf32(a: np.ndarray) -> np.ndarray:
    """Float32 values rounded to the nearest TF32 value as `ROUND_TO_TF32` rounds them (ties
    away from zero, Inf and NaN kept): how the compile step rounds the weights of a kernel
    that `prerounds_weights`."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where((bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000), rounded, bits).view(np.float32)


def _conv_module(spec: ConvSpec, variant: ConvVariant, names: list[str], constexprs: list[str]) -> str:
    c, k, pool = spec.channels, spec.filters, spec.pool
    rounds = rounds_activations(spec)
    precision = "fp16" if spec.dtype == "f16" else spec.precision
    if spec.dtype == "f32" and spec.precision == "tf32" and variant.group_gemm:
        precision += " (operands rounded to nearest here)"
    elif spec.dtype == "f32" and spec.precision == "tf32" and spec.conv.group == 1:
        precision += (" (operands truncated)" if not rounds_to_tf32(spec) else " (operands rounded to nearest)"
                      if _ROUND_TF32 == "ab" else " (activations rounded to nearest here, weights when packed)"
                      if rounds else " (activations stored rounded to nearest by their producers, weights "
                      "when packed)")
    what = (f"Conv {c}->{k} {spec.conv.kernel[0]}x{spec.conv.kernel[1]} stride {spec.conv.strides} "
            f"pads {spec.conv.pads} dilations {spec.conv.dilations}, {spec.dtype}, dot precision "
            f"{precision}"
            + (f"; max pool {pool.kernel[0]}x{pool.kernel[1]} in the epilogue" if pool else "")
            + (f"; X {spec.x_layout.upper()}, Y {spec.y_layout.upper()}"
               if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") else "")
            + ("; weights [K, R, S, C]" if spec.w_layout == "krsc" else "")
            + ("; one flat reduction over (tap, channel)" if variant.flat else "")
            + (f"; group {spec.conv.group}" + (" (depthwise)" if spec.channels == spec.conv.group else "")
               + (", block-diagonal GEMM on the tensor cores" if variant.group_gemm else
                  ", direct loop on CUDA cores (fp32)") if spec.conv.group != 1 else "")
            + ("; Y stored rounded to TF32 (its readers would round it)" if stores_rounded(spec) else ""))
    gemm_rounds = variant.group_gemm and spec.dtype == "f32" and spec.precision == "tf32" and bool(_ROUND_TF32)
    helpers = ROUND_TO_TF32 if rounds or stores_rounded(spec) or gemm_rounds else []
    if pool is not None:
        helpers = [*helpers, "", "", *MAX_NAN] if helpers else MAX_NAN
    lines = _header(spec.name, what, spec.program, spec.source_nodes, helpers)
    lines += _signature(spec.name, names, constexprs)
    body = ["pid_m = tl.program_id(axis=0)", "pid_n = tl.program_id(axis=1)"]
    split = variant.split_k
    if split:
        body += ["# Split K: this program sums the reduction steps k_lo .. k_lo + SPLIT_STEPS - 1.",
                 "pid_k = tl.program_id(axis=2)",
                 "k_lo = pid_k * SPLIT_STEPS"]
    body += ["# Rows of the tile: output pixels. Columns: output channels."]
    body += ["offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
             "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
             "mask_n = offs_n < K"]
    if pool is None:
        body += ["mask_m = offs_m < N * P * Q",
                 "q = offs_m % Q", "p = (offs_m // Q) % P", "n = offs_m // (P * Q)"]
    else:
        body += ["# Pooled pixel (n, op, oq) and window position, the window position fastest.",
                 "win = offs_m % WIN", "pooled = offs_m // WIN",
                 "mask_m = (pooled < N * OP * OQ) & (win < PH * PW)",
                 "oq = pooled % OQ", "op = (pooled // OQ) % OP", "n = pooled // (OP * OQ)",
                 "p = op * PH + win // PW", "q = oq * PW + win % PW"]
    body += ["ih0 = p * STRIDE_H - PAD_H", "iw0 = q * STRIDE_W - PAD_W"]
    if variant.group_gemm:
        body += _group_gemm_loop(spec, variant, gemm_rounds)
    elif spec.conv.group != 1:
        body += _grouped_loop(spec)
    else:
        loop = _flat_loop(spec) if variant.flat else _tap_loop(spec, variant)
        if split:  # the same loop body over this program's slice of the steps
            at = next(i for i, ln in enumerate(loop) if ln.startswith("for step in range(0, STEPS):"))
            loop[at:at + 1] = ["for i in range(0, SPLIT_STEPS):", "    step = k_lo + i"]
        body += loop
        if rounds:
            body += ["    # To the nearest TF32 value, as cuDNN does (tl.dot's tf32 would truncate)"
                     + ("." if _ROUND_TF32 == "ab" else "; the weights were rounded when packed."),
                     "    a = round_to_tf32(a)"]
            if _ROUND_TF32 == "ab":
                body.append("    b = round_to_tf32(b)")
        if spec.dtype == "f32":
            body.append(f'    acc = tl.dot(a, b, acc, input_precision="{spec.precision}")')
        else:
            body.append("    acc = tl.dot(a, b, acc)")
    if split:
        body += split_reduce("tl.num_programs(axis=0) * tl.num_programs(axis=1)",
                             "pid_m * tl.num_programs(axis=1) + pid_n", "SPLIT")
    body += ["# Epilogue: bias, then the pointwise program on the tile.",
             "x0 = acc + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]"]
    if spec.dtype == "f16":
        body.append('x0 = x0.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)  # the conv output is fp16')
    body.append("mask = mask_m[:, None] & mask_n[None, :]" + (" & last" if split else ""))
    body += _extra_loads(spec.program, ("n[:, None]", "offs_n[None, :]", "p[:, None]", "q[:, None]"), "mask", "nkpq")
    body += _program_lines(spec.program)
    val, dt = _out_value(spec.program)
    if stores_rounded(spec):
        body += ["# Y rounded to TF32 as the convs that read it would round it: they skip that step.",
                 f"y_rounded = round_to_tf32({val})"]
        val = "y_rounded"
    if pool is None:
        body += [("y_offs = n[:, None] * (K * P * Q) + offs_n[None, :] * (P * Q) + (p * Q + q)[:, None]"
                  if spec.y_layout == "nchw" else
                  "y_offs = ((n * P + p) * Q + q)[:, None] * K + offs_n[None, :]  # NHWC"),
                 f"tl.store(y_ptr + y_offs, {_store_cast(val, dt)}, mask=mask)"]
    else:
        body += ["# Max over each window (rows outside the window or the image hold -inf; a NaN wins),",
                 "# then store.",
                 f'pooled_val = tl.where(mask, {val}, float("-inf"))',
                 "pooled_val = tl.reduce(tl.reshape(pooled_val, (BLOCK_M // WIN, WIN, BLOCK_N)), 1, max_nan)",
                 "offs_pm = pid_m * (BLOCK_M // WIN) + tl.arange(0, BLOCK_M // WIN)",
                 "pq_ = offs_pm % (OP * OQ)", "pn = offs_pm // (OP * OQ)",
                 ("y_offs = pn[:, None] * (K * OP * OQ) + offs_n[None, :] * (OP * OQ) + pq_[:, None]"
                  if spec.y_layout == "nchw" else
                  "y_offs = (pn * (OP * OQ) + pq_)[:, None] * K + offs_n[None, :]  # NHWC"),
                 "pmask = (offs_pm < N * OP * OQ)[:, None] & mask_n[None, :]",
                 f"tl.store(y_ptr + y_offs, {_store_cast('pooled_val', dt)}, mask=pmask)"]
    lines += ["    " + ln for ln in body]
    return "\n".join(lines) + "\n"


def split_reduce(tiles: str, tile: str, split: str) -> list[str]:
    """Split K (FusedConv, GemmEpilogue): publish this program's partial tile `acc`; the last
    of the tile's `split` programs to arrive sums them all (the others' epilogue is masked
    off by `last`). `tiles`: the count of output tiles (one arrival counter each), `tile`:
    this program's, `split`: the slice count (expressions of the kernel); the slice is
    `pid_k`, the workspace `ws_ptr` ([split, tiles, BLOCK_M * BLOCK_N] fp32) and the
    counters `cnt_ptr` (zeroed by the launcher)."""
    return ["# Split K: write the partial tile, then count this program in; the last to arrive",
            "# reads every partial back (from L2: .cg) and runs the epilogue on the sum.",
            f"tiles = {tiles}",
            f"tile = {tile}",
            "offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
            "tl.store(ws_ptr + (pid_k * tiles + tile) * (BLOCK_M * BLOCK_N) + offs_t, acc)",
            "tl.debug_barrier()  # every thread's part of the tile is written before the count",
            'arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")',
            f"last = arrived == {split} - 1",
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            f"for part in range(0, {split}):",
            "    acc += tl.load(ws_ptr + (part * tiles + tile) * (BLOCK_M * BLOCK_N) + offs_t,",
            '                   mask=(offs_t >= 0) & last, other=0.0, cache_modifier=".cg")']


def _tap_loop(spec: ConvSpec, variant: ConvVariant) -> list[str]:
    """The main loop: for each kernel tap, BLOCK_K channels at a time."""
    body = ["offs_c = tl.arange(0, BLOCK_K)",
            "# Pointers of the first tap's A tile [pixels, channels] and B tile [channels, filters];",
            "# every later step only adds a scalar offset to them.",
            ("a_ptrs = x_ptr + (n * (C * H * W) + ih0 * W + iw0)[:, None] + offs_c[None, :] * (H * W)"
             if spec.x_layout == "nchw" else
             "a_ptrs = x_ptr + ((n * H + ih0) * W + iw0)[:, None] * C + offs_c[None, :]  # NHWC"),
            ("b_ptrs = w_ptr + offs_c[:, None] * K + offs_n[None, :]" if spec.w_layout == "rsck" else
             "b_ptrs = w_ptr + offs_n[None, :] * (R * S * C) + offs_c[:, None]  # weights [K, R, S, C]"),
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            "# One flat loop over (tap, channel block) so that Triton can pipeline it.",
            "for step in range(0, STEPS):  # STEPS = R * S * C_BLOCKS",
            "    tap = step // C_BLOCKS",
            "    c0 = (step % C_BLOCKS) * BLOCK_K",
            "    dh = (tap // S) * DIL_H",
            "    dw = (tap % S) * DIL_W",
            "    in_image = mask_m & (ih0 + dh >= 0) & (ih0 + dh < H) & (iw0 + dw >= 0) & (iw0 + dw < W)",
            ("    a_step = a_ptrs + (dh * W + dw + c0 * (H * W))" if spec.x_layout == "nchw" else
             "    a_step = a_ptrs + ((dh * W + dw) * C + c0)"),
            ("    b_step = b_ptrs + (tap * C + c0) * K" if spec.w_layout == "rsck" else
             "    b_step = b_ptrs + (tap * C + c0)")]
    if spec.channels % variant.block_k == 0:
        body += ["    # C is a multiple of BLOCK_K: no channel mask.",
                "    a = tl.load(a_step, mask=in_image[:, None], other=0.0)",
                "    b = tl.load(b_step, mask=mask_n[None, :], other=0.0)"]
    else:
        body += ["    mask_c = c0 + offs_c < C",
                "    a = tl.load(a_step, mask=in_image[:, None] & mask_c[None, :], other=0.0)",
                "    b = tl.load(b_step, mask=mask_c[:, None] & mask_n[None, :], other=0.0)"]
    return body


def _flat_loop(spec: ConvSpec) -> list[str]:
    """The main loop over the flattened reduction index kk = (r * S + s) * C + c, BLOCK_K at a
    time (both packed weight layouts store this order contiguously): each A element is
    gathered with its own tap and padding mask."""
    x_off = ("n[:, None] * (C * H * W) + c[None, :] * (H * W) + ih * W + iw" if spec.x_layout == "nchw" else
             "((n[:, None] * H + ih) * W + iw) * C + c[None, :]")
    b_off = ("kk[:, None] * K + offs_n[None, :]" if spec.w_layout == "rsck" else
             "offs_n[None, :] * (R * S * C) + kk[:, None]")
    return ["offs_k = tl.arange(0, BLOCK_K)",
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            "# One loop over the flattened reduction (tap, channel), channels fastest.",
            "for step in range(0, STEPS):  # STEPS = cdiv(R * S * C, BLOCK_K)",
            "    kk = step * BLOCK_K + offs_k",
            "    c = kk % C",
            "    tap = kk // C",
            "    ih = ih0[:, None] + ((tap // S) * DIL_H)[None, :]",
            "    iw = iw0[:, None] + ((tap % S) * DIL_W)[None, :]",
            "    in_k = kk < R * S * C",
            "    a_mask = mask_m[:, None] & in_k[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
            f"    a = tl.load(x_ptr + ({x_off}), mask=a_mask, other=0.0)",
            f"    b = tl.load(w_ptr + ({b_off}), mask=in_k[:, None] & mask_n[None, :], other=0.0)"]


def _grouped_loop(spec: ConvSpec) -> list[str]:
    """Grouped and depthwise convs: a direct loop on CUDA cores. Output channel k belongs to
    group k // KG and reads the CG input channels from (k // KG) * CG on; each tap and input
    channel adds a [pixels, channels] tile of X times one weight per column. There is no
    GEMM to feed the tensor cores (CG is 1 for depthwise), and the kernel is bound by
    reading X: channels last, a row of the tile is BLOCK_N contiguous channels."""
    cg, kg = spec.channels // spec.conv.group, spec.filters // spec.conv.group
    first = ("offs_n" if (cg, kg) == (1, 1) else
             "offs_n // KG" if cg == 1 else "(offs_n // KG) * CG")
    x_off = ("(n * (C * H * W) + ih * W + iw)[:, None] + c_in[None, :] * (H * W)" if spec.x_layout == "nchw" else
             "((n * H + ih) * W + iw)[:, None] * C + c_in[None, :]")
    w_off = ("(tap * CG + ci) * K + offs_n" if spec.w_layout == "rsck" else
             "offs_n * (R * S * CG) + (tap * CG + ci)")
    loop = "tl.static_range(CG)" if cg <= 4 else "range(0, CG)"
    return [f"c_first = {first}  # the first input channel of each column's group",
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            "for tap in tl.static_range(R * S):",
            "    ih = ih0 + (tap // S) * DIL_H",
            "    iw = iw0 + (tap % S) * DIL_W",
            "    in_image = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
            "    a_mask = in_image[:, None] & mask_n[None, :]",
            f"    for ci in {loop}:",
            "        c_in = c_first + ci",
            f"        a = tl.load(x_ptr + ({x_off}), mask=a_mask, other=0.0).to(tl.float32)",
            f"        b = tl.load(w_ptr + ({w_off}), mask=mask_n, other=0.0).to(tl.float32)",
            "        acc += a * b[None, :]"]


def _group_gemm_loop(spec: ConvSpec, variant: ConvVariant, rounds: bool) -> list[str]:
    """Grouped convs on the tensor cores: per tap, the tile's span of input channels times the
    block-diagonal [span, BLOCK_N] weight matrix, built from the packed grouped weights with
    a mask (a weight of another group loads as 0); one dot per group of the tile."""
    x_off = ("(n * (C * H * W) + ih * W + iw)[:, None] + c_in[None, :] * (H * W)" if spec.x_layout == "nchw" else
             "((n * H + ih) * W + iw)[:, None] * C + c_in[None, :]")
    w_off = ("(tap * CG + ci) * K + offs_n[None, :]" if spec.w_layout == "rsck" else
             "offs_n[None, :] * (R * S * CG) + (tap * CG + ci)")
    dot = (f'tl.dot({{a}}, b, {{acc}}input_precision="{spec.precision}")' if spec.dtype == "f32" else
           "tl.dot({a}, b{acc})")
    lines = ["# The groups of this tile's columns read input channels c_lo .. c_lo + CI_SPAN - 1.",
             "g_lo = (pid_n * BLOCK_N) // KG  # the tile's first group",
             "c_lo = g_lo * CG",
             "g_n = offs_n // KG  # each column's group",
             "offs_c = tl.arange(0, BLOCK_K)",
             "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
             "for step in range(0, STEPS):  # STEPS = R * S * CI_BLOCKS",
             "    tap = step // CI_BLOCKS",
             "    c0 = (step % CI_BLOCKS) * BLOCK_K",
             "    ih = ih0 + (tap // S) * DIL_H",
             "    iw = iw0 + (tap % S) * DIL_W",
             "    in_image = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
             "    c_in = c_lo + c0 + offs_c",
             "    mask_c = (c0 + offs_c < CI_SPAN) & (c_in < C)",
             f"    a = tl.load(x_ptr + ({x_off}), mask=in_image[:, None] & mask_c[None, :], other=0.0)",
             "    # B: column n's weight for input channel c_in where both are in one group, else 0.",
             "    same = ((c_in // CG)[:, None] == g_n[None, :]) & mask_c[:, None] & mask_n[None, :]",
             "    ci = c_in[:, None] - g_n[None, :] * CG  # the channel within the column's group",
             f"    b = tl.load(w_ptr + ({w_off}), mask=same, other=0.0)"]
    if rounds:
        lines += ["    # To the nearest TF32 value, as cuDNN does (tl.dot's tf32 would truncate).",
                  "    a = round_to_tf32(a)",
                  "    b = round_to_tf32(b)"]
    if max(variant.block_n * spec.conv.group // spec.filters, 1) == 1:
        return lines + [f"    acc = {dot.format(a='a', acc='acc, ' if spec.dtype == 'f32' else ', acc')}"]
    return lines + [
        "    # One dot per group: X masked to the group's channels, the product kept in its columns",
        "    # (a NaN or Inf times another group's zero weights must not reach that group).",
        "    for j in tl.static_range(GROUPS_PER_TILE):",
        "        a_j = tl.where(((c_in // CG) == g_lo + j)[None, :], a, 0.0)",
        f"        acc += tl.where((g_n == g_lo + j)[None, :], {dot.format(a='a_j', acc='')}, 0.0)"]


def _maxpool_module(spec: MaxPoolSpec, variant: PoolVariant, names: list[str], constexprs: list[str],
                    body: list[str]) -> str:
    p = spec.pool
    what = (f"MaxPool {p.kernel[0]}x{p.kernel[1]} stride {p.strides} pads {p.pads} dilations {p.dilations} "
            f"ceil_mode {int(p.ceil_mode)} after the pointwise prologue; {variant.tile} kernel"
            + (f"; X {spec.x_layout.upper()}, Y {spec.y_layout.upper()}"
               if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") else ""))
    lines = _header(spec.name, what, spec.program, spec.source_nodes, MAX_NAN)
    lines += _signature(spec.name, names, constexprs)
    lines += ["    " + ln for ln in body]
    return "\n".join(lines) + "\n"


def _pool_tap(spec: MaxPoolSpec, ptrs: str, mask: str, coords: tuple[str, str, str, str]) -> tuple[list[str], str, str]:
    """One window tap of a pool kernel: X loaded at `ptrs` (fp32), the prologue's extras at
    `coords` (n, c, h, w) through their strides, the prologue program; returns the lines and
    the prologue's result (its value name and output dtype)."""
    load = f"tl.load({ptrs}, mask={mask}, other=0)"
    lines = [f"x0 = {load if spec.program.input_dtypes[0] == 'f32' else load + '.to(tl.float32)'}"]
    lines += _extra_loads(spec.program, coords, mask, "nchw")
    lines += _program_lines(spec.program)
    val, dt = _out_value(spec.program)
    return lines, val, dt


def _pool_flat_body(spec: MaxPoolSpec) -> list[str]:
    """One flat NCHW output index per lane: any pool attributes."""
    body = ["pid = tl.program_id(axis=0)",
            "offs = pid * BLOCK + tl.arange(0, BLOCK)",
            "mask = offs < N * C * OH * OW",
            "ow = offs % OW", "oh = (offs // OW) % OH", "nc = offs // (OH * OW)",
            "n = nc // C", "c = nc % C",
            'best = tl.full((BLOCK,), float("-inf"), tl.float32)',
            "for kh in tl.static_range(KH):",
            "    for kw in tl.static_range(KW):",
            "        ih = oh * SH - PAD_H + kh * DH",
            "        iw = ow * SW - PAD_W + kw * DW",
            "        inside = mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)"]
    inner, val, dt = _pool_tap(spec, "x_ptr + nc * (H * W) + ih * W + iw", "inside", ("n", "c", "ih", "iw"))
    inner += ['best = max_nan(best, tl.where(inside, ' + val + ', float("-inf")))  # a NaN wins']
    body += ["        " + ln for ln in inner]
    body.append(f"tl.store(y_ptr + offs, {_store_cast('best', dt)}, mask=mask)")
    return body


def _pool_rows_body(spec: MaxPoolSpec) -> list[str]:
    """Windows that tile the input (KH == SH, KW == SW, no padding): a [BLOCK_OH, BLOCK_OW]
    tile of one plane per program, reading whole input spans."""
    body = ["# Program -> (plane nc = n * C + c, block of output rows, block of output columns):",
            "# the kernel's only divisions, once per program.",
            "pid = tl.program_id(axis=0)",
            "col_blocks = tl.cdiv(OW, BLOCK_OW)",
            "row_blocks = tl.cdiv(OH, BLOCK_OH)",
            "pid_ow = pid % col_blocks",
            "pid_oh = (pid // col_blocks) % row_blocks",
            "nc = pid // (col_blocks * row_blocks)",
            "n = nc // C",
            "c = nc % C",
            "# Rows of the tile: output rows. Columns: the input columns under BLOCK_OW outputs,",
            "# each window's KW columns side by side (padded to KW_P, a power of two, with masked",
            "# columns). With KW == KW_P a row of the tile is one contiguous span of the input.",
            "oh = pid_oh * BLOCK_OH + tl.arange(0, BLOCK_OH)",
            "cols = tl.arange(0, BLOCK_OW * KW_P)",
            "ow = pid_ow * BLOCK_OW + cols // KW_P  # KW_P is a power of two: a shift",
            "kw = cols % KW_P",
            "iw = ow * SW + kw",
            "# Floor mode without padding: a valid output row or column reads only inside the image.",
            "mask = (oh < OH)[:, None] & ((ow < OW) & (kw < KW))[None, :]",
            "x_plane = x_ptr + nc * (H * W)",
            'best = tl.full((BLOCK_OH, BLOCK_OW), float("-inf"), tl.float32)',
            "# One window row at a time: load the row's spans, then max over each window's columns.",
            "for kh in tl.static_range(KH):",
            "    ih = oh * SH + kh"]
    inner, val, dt = _pool_tap(spec, "x_plane + ih[:, None] * W + iw[None, :]", "mask",
                               ("n", "c", "ih[:, None]", "iw[None, :]"))
    inner += [f'val = tl.where(mask, {val}, float("-inf"))',
              "# the max over each window's KW columns, then over its rows; a NaN wins",
              "best = max_nan(best, tl.reduce(tl.reshape(val, (BLOCK_OH, BLOCK_OW, KW_P)), 2, max_nan))"]
    body += ["    " + ln for ln in inner]
    body += ["out_ow = pid_ow * BLOCK_OW + tl.arange(0, BLOCK_OW)",
             "y_offs = nc * (OH * OW) + oh[:, None] * OW + out_ow[None, :]",
             f"tl.store(y_ptr + y_offs, {_store_cast('best', dt)}, mask=(oh < OH)[:, None] & (out_ow < OW)[None, :])"]
    return body


def _pool_nhwc_body(spec: MaxPoolSpec) -> list[str]:
    """Channels-last X: [BLOCK_P output pixels, BLOCK_C channels] per program, any pool."""
    body = ["pid_p = tl.program_id(axis=0)",
            "pid_c = tl.program_id(axis=1)",
            "# Rows of the tile: output pixels (n, oh, ow), unravelled once per row. Columns:",
            "# channels, contiguous in X (and in Y when it is NHWC).",
            "offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)",
            "offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)",
            "mask_p = offs_p < N * OH * OW",
            "mask_c = offs_c < C",
            "ow = offs_p % OW", "oh = (offs_p // OW) % OH", "n = offs_p // (OH * OW)",
            'best = tl.full((BLOCK_P, BLOCK_C), float("-inf"), tl.float32)',
            "for kh in tl.static_range(KH):",
            "    for kw in tl.static_range(KW):",
            "        ih = oh * SH - PAD_H + kh * DH",
            "        iw = ow * SW - PAD_W + kw * DW",
            "        in_image = mask_p & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)",
            "        inside = in_image[:, None] & mask_c[None, :]"]
    inner, val, dt = _pool_tap(spec, "x_ptr + ((n * H + ih) * W + iw)[:, None] * C + offs_c[None, :]", "inside",
                               ("n[:, None]", "offs_c[None, :]", "ih[:, None]", "iw[:, None]"))
    inner += ['best = max_nan(best, tl.where(inside, ' + val + ', float("-inf")))  # a NaN wins']
    body += ["        " + ln for ln in inner]
    body += [("y_offs = offs_p[:, None] * C + offs_c[None, :]  # NHWC" if spec.y_layout == "nhwc" else
              "y_offs = (n[:, None] * C + offs_c[None, :]) * (OH * OW) + (oh * OW + ow)[:, None]  # NCHW"),
             f"tl.store(y_ptr + y_offs, {_store_cast('best', dt)}, mask=mask_p[:, None] & mask_c[None, :])"]
    return body
