"""Code generation for FusedSqueezeExcite (docs/format.md): the squeeze path of a
squeeze-and-excitation block as one Triton kernel.

The original runs five or more kernels per block (GlobalAveragePool, two 1x1 convs on one
pixel, the activation and the gate); at batch 1 each is a few microseconds of launch and
tail for very little work. This kernel does it in one launch, over a grid of
(N images, SPLIT parts of each image's pixels):

1. each program sums its CHUNK pixels of image n for every channel, BLOCK_C channels at a
   time over [BLOCK_P pixels, BLOCK_C channels] tiles (channels-last X: the channels are
   contiguous; NCHW X: the pixels are, and the tile is [BLOCK_C, BLOCK_P]), in fp32, and
   writes the C sums to its row of the workspace;
2. it counts itself in on image n's arrival counter; the program that arrives last reads the
   SPLIT rows back (from L2), divides by H·W (the mean, rounded to the dtype as the pool's
   output is), and computes FC1 as a [BLOCK_R, BLOCK_F] tile product over the channels, the
   activation, then FC2 and the gate BLOCK_F channels at a time, and stores Y.

The products run in fp32 on CUDA cores: one pixel makes them matrix-vector products, bound
by reading the weights, and fp32 keeps them at least as accurate as the original (cuDNN
runs these convs in fp32 on the H200). The activation and the gate are the node's two
programs, each generated as a jit function of one value (`act`, `gate`) with the expression
table of `onnxfuse.codegen`, so their numerics are those of PointwiseChain kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from onnxfuse.codegen import (
    POINTER_TYPES,
    TL_DTYPES,
    KernelSource,
    _comment_text,
    check_kernel_name,
    expr_text,
    helper_lines,
    stores_16bit,
)
from onnxfuse.codegen_conv import INT_TYPE, MAX_ELEMENTS, next_pow2
from onnxfuse.expr import Program

PARAM_NAMES = ["x_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "N", "HW", "CHUNK"]
# FC1's tile [BLOCK_R hidden units, BLOCK_F channels] holds at most this many fp32 values
# (16 per thread at 8 warps: the first kernel's 8192 with a [BLOCK_R, BLOCK_F] accumulator
# spilled, 45 µs for RegNetY's 440 -> 110 -> 440 block at batch 1 on the H200); BLOCK_F is FC2's
# channel block too
FC_TILE = 4096
# The most programs that share one image (the launcher's split is capped at a variant's
# max_split): the last reads their partial sums as one [MAX_SPLIT, BLOCK_F] tile per channel
# block, not one load after another
MAX_SPLIT = 32
# A variant with stages > 1 software-pipelines the loops that stream X and the weights
# (`tl.range(num_stages=)`): one program reads every weight of both products, at batch 1
# hundreds of KB. Measured on the H200 (sixteenth session) together with 8 warps, it was
# slower on all seven of MobileNetV3-small's blocks (4.1-17.8 µs against 4.5-11.9 without),
# so the heuristic's variant does not, and tuning times it as a candidate


@dataclass(frozen=True)
class SqueezeSpec:
    """What to compile for one FusedSqueezeExcite node."""

    kind: ClassVar[str] = "squeeze_excite"
    name: str
    program: Program  # the activation: %0 is FC1's output
    gate: Program  # %0 is FC2's output; its one output is Y
    channels: int  # C
    hidden: int  # CR
    dtype: str  # "f32" or "f16": X, the weights and Y
    source_nodes: tuple[str, ...] = ()
    x_layout: str = "nchw"
    y_layout: str = "nchw"


@dataclass(frozen=True)
class SqueezeVariant:
    """The pixel-sum tile, the smallest pixel count a program takes (the launcher's split,
    docs/format.md kind squeeze_excite) and the warps."""

    index: int = 0
    block_p: int = 32
    block_c: int = 64
    min_chunk: int = 128
    num_warps: int = 4
    max_split: int = MAX_SPLIT
    stages: int = 1

    def requires(self) -> dict[str, int]:
        return {"max_elements": MAX_ELEMENTS, "ptr_align": 16}

    def meta(self) -> dict[str, int]:
        return {"block_p": self.block_p, "block_c": self.block_c, "min_chunk": self.min_chunk,
                "max_split": self.max_split}


def squeeze_variants(spec: SqueezeSpec) -> tuple[SqueezeVariant, ...]:
    """The heuristic's one variant (not yet measured against alternatives on a GPU; `--tune`
    times `squeeze_candidates`): 2048-element pixel tiles, channels-last 64 channels wide
    (256 contiguous bytes per pixel row in fp32), NCHW 16 channels by 128 pixels; at least
    4 tiles of pixels per program and at most MAX_SPLIT programs per image, so a 7x7 image
    runs in one program and a 112x112 one in 32; 4 warps, loops not pipelined."""
    if spec.x_layout == "nhwc":
        bc = min(next_pow2(spec.channels), 64)
        return (SqueezeVariant(0, max(8, 2048 // bc), bc, 4 * max(8, 2048 // bc)),)
    return (SqueezeVariant(0, 128, 16, 512),)


def squeeze_candidates(spec: SqueezeSpec) -> list[tuple[str, tuple]]:
    """(label, variants) per configuration tuning times (the kind's `search_configs`): the
    heuristic's, then smaller and larger parts per program, 8 warps, and pipelined loops."""
    (base,) = squeeze_variants(spec)
    tiles = [base,
             replace(base, min_chunk=base.block_p),
             replace(base, min_chunk=16 * base.block_p),
             replace(base, num_warps=8),
             replace(base, num_warps=8, stages=3)]
    return [(f"tile {v.block_p}x{v.block_c}, parts of at least {v.min_chunk} pixels, {v.num_warps} warps"
             + (f", {v.stages} stages" if v.stages > 1 else ""), (v,)) for v in dict.fromkeys(tiles)]


def _function(name: str, program: Program, what: str) -> list[str]:
    """A jit function of one value computing `program` (its %0) in fp32: its one output."""
    if len(program.input_dtypes) != 1 or len(program.outputs) != 1:
        raise ValueError(f"the {what} program must have one input and one output")
    lines = ["@triton.jit", f"def {name}(x0):", f'    """The {what}: {_one_line(program)}"""']
    sixteen_bit = stores_16bit(program)
    for k, ins in enumerate(program.instrs):
        n = 1 + k
        lines.append(f"    tmp{n} = {expr_text(ins, lambda v: f'x{v}' if v < 1 else f'tmp{v}', sixteen_bit)}")
    v, _ = program.outputs[0]
    return lines + [f"    return {'x0' if v == 0 else f'tmp{v}'}"]


def _one_line(program: Program) -> str:
    body = "; ".join(line for line in program.to_text().splitlines()[1:])
    return body.replace('"', "'")


def _round(val: str, dt: str) -> str:
    """`val` (fp32) rounded to dtype `dt` and back: what the original stores between its nodes."""
    if dt == "f32":
        return val
    val = val if val.isidentifier() else f"({val})"
    return f'{val}.to({TL_DTYPES[dt]}, fp_downcast_rounding="rtne").to(tl.float32)'


def generate_squeeze(spec: SqueezeSpec, variant: SqueezeVariant) -> KernelSource:
    """The Triton kernel of a FusedSqueezeExcite node."""
    check_kernel_name(spec.name)
    if spec.dtype not in ("f32", "f16"):
        raise ValueError(f"{spec.name}: dtype {spec.dtype!r} is not f32 or f16")
    if spec.x_layout not in ("nchw", "nhwc") or spec.y_layout not in ("nchw", "nhwc"):
        raise ValueError(f"layouts must be nchw or nhwc, not {spec.x_layout!r}/{spec.y_layout!r}")
    for v in (variant.block_p, variant.block_c, variant.num_warps):
        if v <= 0 or v & (v - 1):
            raise ValueError(f"block sizes and num_warps must be powers of two: {variant}")
    if variant.min_chunk < variant.block_p:
        raise ValueError(f"min_chunk {variant.min_chunk} is below block_p {variant.block_p}")
    if not 1 <= variant.max_split <= MAX_SPLIT:
        raise ValueError(f"max_split {variant.max_split} is not in 1..{MAX_SPLIT}")
    dt = spec.dtype
    for what, prog in (("activation", spec.program), ("gate", spec.gate)):
        if prog.input_dtypes != (dt,):
            raise ValueError(f"{spec.name}: the {what} program reads {prog.input_dtypes}, expected ({dt!r},)")
    block_r = next_pow2(spec.hidden)
    block_f = max(16, min(128, FC_TILE // block_r))
    out_dt = spec.gate.outputs[0][1]
    act_dt = spec.program.outputs[0][1]
    nhwc = spec.x_layout == "nhwc"
    types = [POINTER_TYPES[dt]] * 5 + [POINTER_TYPES[out_dt], "*fp32", "*i32"] + [INT_TYPE] * 3
    constexprs = [("C", spec.channels), ("CR", spec.hidden), ("BLOCK_P", variant.block_p),
                  ("BLOCK_C", variant.block_c), ("BLOCK_R", block_r), ("BLOCK_F", block_f),
                  ("MAX_SPLIT", next_pow2(variant.max_split))]
    if variant.stages < 1:
        raise ValueError(f"stages {variant.stages} must be at least 1")
    loop = (f"tl.range({{}}, num_stages={variant.stages})" if variant.stages > 1 else "range({})").format

    lines = [f"# {spec.name}: generated by onnxfuse.codegen_squeeze; do not edit.", "#",
             f"# Squeeze-and-excitation, C = {spec.channels} channels, {spec.hidden} hidden units, {dt}, "
             f"X {spec.x_layout.upper()}: the mean of each channel over the pixels, FC1, the activation, FC2 "
             "and the gate, in one launch (onnxfuse.codegen_squeeze's docstring).", "#",
             "# Replaces the ONNX nodes:"]
    lines += [f"#   {_comment_text(n)}" for n in spec.source_nodes] or ["#   (none listed)"]
    lines += ["", "import triton", "import triton.language as tl", "from triton.language.extra import libdevice"]
    lines += [*helper_lines(spec.program, spec.gate), "", ""]
    lines += _function("act", spec.program, "activation") + ["", ""]
    lines += _function("gate", spec.gate, "gate") + ["", ""]
    lines += ["@triton.jit",
              f"def {spec.name}(",
              "    x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, y_ptr, ws_ptr, cnt_ptr,",
              "    N, HW, CHUNK,",
              f"    {', '.join(f'{c}: tl.constexpr' for c, _ in constexprs)},",
              "):"]
    body = ["n = tl.program_id(axis=0)",
            "part = tl.program_id(axis=1)",
            "split = tl.num_programs(axis=1)",
            "# 1. The sum of each channel over this program's pixels p_lo .. p_lo + CHUNK - 1, in fp32.",
            "p_lo = part * CHUNK",
            "offs_p = tl.arange(0, BLOCK_P)",
            "offs_c = tl.arange(0, BLOCK_C)",
            "x_img = x_ptr + n.to(tl.int64) * HW * C",
            "for c0 in range(0, C, BLOCK_C):",
            "    cs = c0 + offs_c",
            "    mask_c = cs < C"]
    if nhwc:
        body += ["    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)",
                 f"    for p0 in {loop('0, CHUNK, BLOCK_P')}:",
                 "        ps = p_lo + p0 + offs_p",
                 "        mask = (ps < HW)[:, None] & mask_c[None, :]",
                 "        # channels last: each pixel's BLOCK_C channels are contiguous",
                 "        acc += tl.load(x_img + ps[:, None] * C + cs[None, :], mask=mask, other=0.0).to(tl.float32)",
                 "    sums = tl.sum(acc, axis=0)"]
    else:
        body += ["    acc = tl.zeros((BLOCK_C, BLOCK_P), dtype=tl.float32)",
                 f"    for p0 in {loop('0, CHUNK, BLOCK_P')}:",
                 "        ps = p_lo + p0 + offs_p",
                 "        mask = mask_c[:, None] & (ps < HW)[None, :]",
                 "        # NCHW: each channel's pixels are contiguous",
                 "        acc += tl.load(x_img + cs[:, None] * HW + ps[None, :], mask=mask, other=0.0).to(tl.float32)",
                 "    sums = tl.sum(acc, axis=1)"]
    body += ["    tl.store(ws_ptr + (part * N + n) * C + cs, sums, mask=mask_c)",
             "# 2. Count this program in; the last of image n's programs reads every part back (from L2:",
             "# .cg) and computes the rest.",
             "tl.debug_barrier()  # every thread's sums are written before the count",
             'arrived = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel")',
             "if arrived == split - 1:",
             "    offs_r = tl.arange(0, BLOCK_R)",
             "    mask_r = offs_r < CR",
             "    offs_f = tl.arange(0, BLOCK_F)",
             "    parts = tl.arange(0, MAX_SPLIT)",
             "    # FC1: z1[j] = sum over c of W1[j, c] * mean[c], BLOCK_F channels at a time.",
             "    z1 = tl.load(b1_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)",
             f"    for c0 in {loop('0, C, BLOCK_F')}:",
             "        cs = c0 + offs_f",
             "        mask_f = cs < C",
             "        # every part's sums of these channels, one tile",
             "        ws = tl.load(ws_ptr + ((parts * N + n) * C)[:, None] + cs[None, :],",
             '                     mask=(parts < split)[:, None] & mask_f[None, :], other=0.0, cache_modifier=".cg")',
             f"        mean = {_round('tl.sum(ws, axis=0) / HW', dt)}  # the pool's output",
             "        w1 = tl.load(w1_ptr + offs_r[:, None] * C + cs[None, :], mask=mask_r[:, None] & mask_f[None, :],",
             "                     other=0.0).to(tl.float32)",
             "        z1 += tl.sum(w1 * mean[None, :], axis=1)",
             f"    h = {_round('act(' + _round('z1', dt) + ')', act_dt)}",
             "    # hidden units past CR must add nothing to FC2 (an activation of 0 need not be 0)",
             "    h = tl.where(mask_r, h, 0.0)",
             "    # FC2 and the gate, BLOCK_F channels at a time.",
             f"    for c0 in {loop('0, C, BLOCK_F')}:",
             "        cs = c0 + offs_f",
             "        mask_f = cs < C",
             "        w2 = tl.load(w2_ptr + cs[:, None] * CR + offs_r[None, :],",
             "                     mask=mask_f[:, None] & mask_r[None, :],",
             "                     other=0.0).to(tl.float32)",
             "        b2 = tl.load(b2_ptr + cs, mask=mask_f, other=0.0).to(tl.float32)",
             "        z2 = tl.sum(w2 * h[None, :], axis=1) + b2",
             f"        y = gate({_round('z2', dt)})",
             "        # Y [N, C, 1, 1] and [N, 1, 1, C] are the same bytes",
             "        tl.store(y_ptr + n * C + cs, "
             + ("y" if out_dt == "f32" else f'y.to({TL_DTYPES[out_dt]}, fp_downcast_rounding="rtne")')
             + ", mask=mask_f)"]
    lines += ["    " + ln for ln in body]
    source = "\n".join(lines) + "\n"
    return KernelSource(name=spec.name, source=source, params=tuple(zip(PARAM_NAMES, types, strict=True)),
                        constexprs=tuple(constexprs), divisible=(0, 1, 2, 3, 4, 5, 6), num_warps=variant.num_warps,
                        variant=variant, num_stages=variant.stages)
