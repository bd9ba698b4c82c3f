"""The conv kind: a 2-D Conv (BatchNormalization folded in), the pointwise ops after it and
optionally a MaxPool whose windows tile its output become one FusedConv node (docs/format.md,
"FusedConv"); its kernel is codegen_conv's implicit GEMM (or, grouped, the direct loop or the
block-diagonal GEMM)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, replace

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_conv import (
    ConvSpec,
    ConvVariant,
    conv_steps,
    generate_conv,
    group_gemm_fits,
    group_span,
    next_pow2,
    prerounds_weights,
)
from onnxfuse.codegen_gemm import SMS
from onnxfuse.expr import Program, evaluate
from onnxfuse.graph import GraphView, Shape
from onnxfuse.groups import Accepted, reentering
from onnxfuse.kinds.base import (
    META_VERSION,
    Fields,
    FusedNode,
    Kind,
    Lowering,
    Match,
    MatchResult,
    NodeLayouts,
    Pattern,
    env_config,
    layout_attr,
)
from onnxfuse.layers import ConvAttrs, conv_from_fused, conv_from_node, pool_from_fused, pool_from_node
from onnxfuse.match import DTYPE_IDS, dtype_reason, grow_epilogue, match_anchored, single_result
from onnxfuse.reference import conv2d, maxpool2d
from onnxfuse.rewrite import input_mode, lower_group, unique_name

POOL_MODES = ("none", "tiling")

# A conv whose X arrives NCHW (a graph input, or any other node's output) reads it through a
# Transpose to channels-last when X has at least this many channels: the NHWC kernel with
# [K, R, S, C] weights (sm_90 TF32 wgmma) is 1.8x faster than the NCHW one on 64 channels
# at 112² (0.166 vs 0.303 ms) while the Transpose is one read and one write of X; with 3
# channels (an image) the NCHW kernel is 2.8x faster (0.364 vs 1.017 ms). H200,
# benchmarks/conv_kernels.py, BENCHMARKS.md.
MIN_NHWC_CHANNELS = 16

FLAT_MAX_CHANNELS = 16  # convs with fewer input channels use the flat reduction


def conv_variants(spec: ConvSpec) -> tuple[ConvVariant, ...]:
    """The tile configuration of a conv kernel (one variant), by the heuristics measured with
    benchmarks/conv_kernels.py on the H200 (BENCHMARKS.md): 64x64 tiles of 2 warps with
    BLOCK_K 32 and 3 stages were best or within 5% of the best on every 64-channel VGG layer;
    BLOCK_N 128 with 4 stages for 128 filters or more. (Inputs of fewer than 16 channels
    take the flat reduction below.)

    Channels-last X with [K, R, S, C] weights (the NHWC pass) runs on sm_90's TF32 wgmma,
    which needs 4 warps: 128x64 tiles for up to 64 filters, 64x128 from 128 filters, BLOCK_K
    32, 3 stages were best or within 10% of the best of 15 configurations on every layer of
    the same sweep with 16 or more channels (benchmarks/results/conv_kernels_layouts.json).

    Fewer than 16 input channels (an image): one flat reduction over (tap, channel) in
    128x64x32 tiles, 4 warps, 2 stages, the best of 8 on ResNet's 7x7 stride-2 stem (0.126 ms
    against 0.388 per tap and 0.339 for cuDNN channels-last) and VGG's first layer (0.105
    against 0.362; conv_kernels_flat_*.json).

    A second variant splits the reduction (split K, `split_variant`) for launches whose plain
    tiles would leave most SMs idle; the launcher picks it at run time. Channels-last convs
    without a pool get a last one, a 16-row tile for small outputs (`small_m_variant`), which
    the launcher picks when M = N·P·Q is at most SMALL_M_MAX and split K does not run.

    Grouped convs: the block-diagonal GEMM where it fits (`_grouped_gemm_tile`), else the
    direct loop (`_grouped_tile`).

    ``$ONNXFUSE_CONV_CONFIG`` (``block_m=,block_n=,block_k=,warps=,stages=,flat=,split=,
    group_gemm=,small_m=``) overrides it (``split=0``: no split-K variant; ``small_m=0``: no
    small-M variant)."""
    cfg = {"block_m": 64, "block_n": 64, "block_k": 32, "warps": 2, "stages": 3, "flat": 0, "split": 1,
           "group_gemm": 0, "small_m": 1}
    if spec.conv.group != 1:
        cfg.update(_grouped_gemm_tile(spec) or _grouped_tile(spec))
    elif spec.channels < FLAT_MAX_CHANNELS:
        cfg.update(block_m=128, warps=4, stages=2, flat=1)
    elif spec.x_layout == "nhwc" and spec.w_layout == "krsc":
        cfg.update(block_m=128, warps=4)
        if spec.filters >= 128:
            cfg.update(block_m=64, block_n=128)
        if spec.channels < 32:
            cfg.update(block_k=16)
    else:
        if spec.filters >= 128:
            cfg.update(block_n=128, stages=4)
    if spec.dtype == "f16" and spec.channels >= 64 and spec.conv.group == 1:
        cfg.update(block_k=64)
    env_config("ONNXFUSE_CONV_CONFIG", cfg)
    if spec.pool is not None:  # BLOCK_M holds whole (padded) windows
        win = 1 << (spec.pool.kernel[0] * spec.pool.kernel[1] - 1).bit_length()
        cfg["block_m"] = max(cfg["block_m"], win)
    plain = ConvVariant(0, cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["warps"], cfg["stages"],
                        bool(cfg["flat"]), group_gemm=bool(cfg["group_gemm"]))
    split = split_variant(spec, plain) if cfg["split"] else None
    variants = (plain,) if split is None else (plain, split)
    small = small_m_variant(spec, plain, len(variants)) if cfg["small_m"] else None
    return variants if small is None else (*variants, small)


# The small-M variant (BENCHMARKS.md, Decisions, `conv-small-m`): at batch 1 the deep layers
# of a CNN have M = N·P·Q of 1 (squeeze-excite FCs) to 196 (14² maps) output pixels, and the
# heuristic's 64-128-row tiles give 2-16 programs for 132 SMs. EfficientNet-B0's batch-1 1x1
# layers alone on the H200 (conv_kernels.py --layers 26-31, conv_kernels_b1_1x1.json), the
# heuristic's tile against 16x64x64 with 2 warps: at M = 49, 192 -> 1152 9.8 vs 7.3 µs and
# 1152 -> 192 26.6 vs 17.9; at M = 1, 1152 -> 48 31.4 vs 17.3, 48 -> 1152 6.9 vs 5.2, 144 -> 6
# 7.6 vs 6.7 (1.1-1.8x on every layer up to M = 49); at M = 196 (80 -> 480) it lost, 14.5 vs
# 8.8. So the tile serves M up to 64, the smallest BLOCK_M of the heuristic's tiles: there the
# plain tiles are one row of programs. The cut between 49 and 196 is not measured.
SMALL_M_MAX = 64
SMALL_M_TILE = {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 2, "num_stages": 3}


def small_m_variant(spec: ConvSpec, plain: ConvVariant, index: int) -> ConvVariant | None:
    """The small-M variant (`SMALL_M_TILE`, kernel_meta "max_m": SMALL_M_MAX) of a
    channels-last group-1 conv whose plain variant is `plain`, or None: grouped convs, the
    flat reduction (image inputs: large M), NCHW convs (not measured), and convs with a pool
    in the epilogue, whose BLOCK_M holds whole windows and which sit early in a network, at
    large M (as split K excludes them). BLOCK_K is 64, or C to the next power of two when
    that is smaller (at least 16): no step is mostly masked channels."""
    if (spec.conv.group != 1 or spec.pool is not None or plain.flat or plain.group_gemm
            or (spec.x_layout, spec.w_layout) != ("nhwc", "krsc")):
        return None
    t = SMALL_M_TILE
    block_k = min(t["block_k"], max(16, next_pow2(spec.channels)))
    return ConvVariant(index, t["block_m"], t["block_n"], block_k, t["num_warps"], t["num_stages"],
                       max_m=SMALL_M_MAX)


def launcher_choice(meta: dict, m: int, k: int, sms: int = 132, workspace: bool = True) -> int:
    """The variant csrc/kinds/conv_cuda.cc launches for a FusedConv of kernel_meta `meta`
    at run-time M = N·P·Q output pixels (with a pool: N·OP·OQ·WIN) and K filters, on a GPU of
    `sms` multiprocessors, every variant's requirements holding: the first split-K variant
    ("split") when 2 · its tiles ≤ sms and the CUDA EP lends the workspace; else the first
    small-M variant ("max_m") whose max_m is at least M; else the first other variant. A
    mirror of the C++ rule, for tests and benchmarks."""
    variants = meta["variants"]
    for i, v in enumerate(variants):
        if v.get("split", 0) > 1:
            tiles = -(-m // v["block_m"]) * -(-k // v["block_n"])
            if 2 * tiles <= sms and workspace:
                return i
            break
    for i, v in enumerate(variants):
        if v.get("split", 0) <= 1 and v.get("max_m", 0) >= m:
            return i
    return next(i for i, v in enumerate(variants) if v.get("split", 0) <= 1 and not v.get("max_m"))


# Split K (codegen_conv's module docstring): at most this many slices, each of at least
# SPLIT_MIN_STEPS reduction steps (so that the 3-stage pipeline has steps to overlap).
SPLIT_MAX = 16
SPLIT_MIN_STEPS = 4


def split_variant(spec: ConvSpec, plain: ConvVariant) -> ConvVariant | None:
    """The split-K variant of `plain` (variant index 1), or None where the reduction is too
    short to split or the conv cannot be (grouped, pool in the epilogue). Its tiles are
    plain's with BLOCK_M at most 64: it runs when M is small. Its slice count is the largest
    divisor of the step count up to SPLIT_MAX leaving at least SPLIT_MIN_STEPS per slice."""
    if spec.conv.group != 1 or spec.pool is not None:
        return None
    v = replace(plain, index=1, block_m=min(plain.block_m, 64))
    steps = conv_steps(spec, v)
    best = max((d for d in range(2, SPLIT_MAX + 1) if steps % d == 0 and steps // d >= SPLIT_MIN_STEPS),
               default=0)
    return replace(v, split=best) if best else None


def _grouped_tile(spec: ConvSpec) -> dict[str, int]:
    """Tiles of the direct loop of grouped and depthwise convs, from 10 configurations on
    MobileNetV3-small's six kinds of depthwise layer at batch 32 on the H200
    (conv_kernels_depthwise.json): up to 16 filters 128 pixels x 16 channels with 4 warps,
    otherwise 16 pixels x 64 channels with 2 warps. That was the best on four layers and
    within 35% of the best on the other two (88 channels 3x3 at 28²: 0.0193 ms, best
    0.0147; 240 channels 5x5 at 14²: 0.0220, best 0.0163), and faster than cuDNN's
    channels-last depthwise convs on all six (0.0190-0.0297 ms). Both hold 16 outputs per
    thread. `--tune` measures the runners-up."""
    bm, bn, warps = (128, 16, 4) if spec.filters <= 16 else (16, 64, 2)
    return {"block_m": bm, "block_n": bn, "block_k": 32, "warps": warps, "stages": 1, "flat": 0, "group_gemm": 0}


# Grouped convs with at least this many input channels per group run the block-diagonal
# GEMM (codegen_conv's module docstring) when a tile fits. Measured on the H200
# (benchmarks/conv_kernels.py, conv_kernels_grouped.json): RegNetY-400MF's groups of 8, the
# GEMM 0.0432-0.0103 ms against cuDNN channels-last's 0.0435-0.0242 (1.0-2.4x, its
# error cuDNN's TF32 error) and the direct loop's 0.399-0.0157; ResNeXt-50's groups of 4,
# the GEMM 0.148 ms (four dots per tile), the direct loop 0.499, cuDNN 0.076.
GROUP_GEMM_MIN_CHANNELS = 8


def grouped_gemm_variant(spec: ConvSpec) -> ConvVariant | None:
    """The heuristic's block-diagonal GEMM variant of a grouped conv (also where the
    heuristic picks the direct loop, for tuning to measure), or None where no tile fits."""
    cfg = _grouped_gemm_tile(spec, any_width=True)
    if cfg is None:
        return None
    return ConvVariant(0, cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["warps"], cfg["stages"],
                       group_gemm=True)


def _grouped_gemm_tile(spec: ConvSpec, any_width: bool = False) -> dict[str, int] | None:
    """The block-diagonal GEMM's tile for a grouped conv, or None for the direct loop
    (depthwise and narrow groups, precision "ieee", or no tile fits): BLOCK_N the widest of
    64, 32, 16 that KG is a multiple of, else 16 when KG divides it (KG 2, 4, 8: whole
    groups per tile); BLOCK_K the tile's input span to the next power of two, 16 to 64;
    64 pixels, 4 warps, 3 stages (the best of 8 tiles on all five RegNet layers measured,
    128 pixels within 3-15%)."""
    cg, kg = spec.channels // spec.conv.group, spec.filters // spec.conv.group
    if spec.dtype == "f32" and spec.precision == "ieee":
        return None
    if cg < (2 if any_width else GROUP_GEMM_MIN_CHANNELS):
        return None
    bn = next((b for b in (64, 32, 16) if kg % b == 0), 16)
    if not group_gemm_fits(spec, bn):
        return None
    bk = min(max(next_pow2(group_span(spec, bn)), 16), 64)
    return {"block_m": 64, "block_n": bn, "block_k": bk, "warps": 4, "stages": 3, "flat": 0, "group_gemm": 1}


# Reduction length C·R·S above which the NCHW implicit-GEMM kernel loses to cuDNN, measured
# on the H200 (benchmarks/conv_kernels.py, BENCHMARKS.md): 64 channels 3x3 (576) won at every
# size, 128 channels 3x3 at 28x28 (1152) tied with cuDNN (0.070 vs 0.071 ms), 256 channels
# 3x3 at 14x14 (2304) lost (0.085 vs 0.061 ms).
CONV_MAX_REDUCTION = 1152
DECLINED_REASON = ("conv reduction C*R*S above 1152: cuDNN is faster on the H200 (heuristic; "
                   "--tune measures instead)")
# Grouped convs: depthwise ones run the direct loop (faster than cuDNN on MobileNetV3's
# layers), groups of GROUP_GEMM_MIN_CHANNELS the block-diagonal GEMM; groups of 2 to 7
# channels lost to cuDNN in both loops (ResNeXt's 4: `GROUP_GEMM_MIN_CHANNELS`), and wider
# groups than this were not measured: both stay with cuDNN.
GROUPED_MAX_CHANNELS = 8
GROUPED_REASON = (f"grouped conv with more than {GROUPED_MAX_CHANNELS} input channels per group: not measured "
                  "against cuDNN's grouped GEMM, left to it (heuristic)")
NARROW_GROUP_REASON = (f"grouped conv with 2 to {GROUP_GEMM_MIN_CHANNELS - 1} input channels per group, or "
                       "whose groups fit no block-diagonal GEMM tile, or at conv precision ieee (no GEMM): cuDNN "
                       "is faster than the direct loop (heuristic; --tune measures instead)")


def conv_decline_reason(spec: ConvSpec, layout: str = "nchw") -> str | None:
    """Why the heuristic keeps this conv for ONNX Runtime (cuDNN) rather than fusing it, or
    None: grouped convs with groups of 2 to 7 or more than 8 channels; deep convs on the NCHW path (the
    channels-last kernels matched cuDNN there). ``$ONNXFUSE_CONV_ALL=1`` fuses every conv."""
    if os.environ.get("ONNXFUSE_CONV_ALL") == "1":
        return None
    cg = spec.channels // spec.conv.group
    if spec.conv.group != 1 and cg > GROUPED_MAX_CHANNELS:
        return GROUPED_REASON
    if spec.conv.group != 1 and cg > 1 and _grouped_gemm_tile(spec) is None:
        return NARROW_GROUP_REASON
    r, s = spec.conv.kernel
    if layout == "nchw" and spec.channels // spec.conv.group * r * s > CONV_MAX_REDUCTION:
        return DECLINED_REASON
    return None



def conv_candidates(spec: ConvSpec) -> list[tuple[str, tuple]]:
    """(label, variants) per configuration `--tune` times: the heuristics' tile, then the
    runners-up of the sweep that chose it, each with its split-K variant; the heuristics'
    tile also with its small-M variant, as the node ships it."""
    heuristic = conv_variants(spec)
    base = heuristic[0]
    small = next((v for v in heuristic if v.max_m), None)
    if spec.conv.group != 1:
        # the direct loop: the runners-up of conv_kernels_depthwise.json; the block-diagonal
        # GEMM (where a tile fits): the heuristic's tile at 64 and 128 pixels, BLOCK_N 16/32
        direct = dataclasses.replace(base, group_gemm=False, block_k=32, num_stages=1)
        tiles = [base] + [dataclasses.replace(direct, block_m=bm, block_n=bn, num_warps=w)
                          for bm, bn, w in ((128, 16, 4), (16, 64, 2), (64, 32, 4), (32, 128, 4), (128, 32, 8))]
        gemm = grouped_gemm_variant(spec)
        if gemm is not None:
            tiles += [dataclasses.replace(gemm, block_m=bm, block_n=bn, block_k=max(
                          16, min(64, next_pow2(group_span(spec, bn)))))
                      for bm in (64, 128) for bn in (16, 32) if group_gemm_fits(spec, bn)]
    elif base.flat:  # the runners-up of the flat-reduction sweep (conv_kernels_flat_*.json)
        tiles = [base, dataclasses.replace(base, block_m=256, num_warps=8),
                 dataclasses.replace(base, block_k=16, num_stages=3),
                 dataclasses.replace(base, block_m=64, num_warps=2, num_stages=3)]
    elif base.num_warps >= 4:  # channels-last wgmma tiles: that sweep's runners-up
        tiles = [base, dataclasses.replace(base, num_stages=4),
                 dataclasses.replace(base, block_m=64 if base.block_m == 128 else 128,
                                     block_n=128 if base.block_n == 64 else 64),
                 dataclasses.replace(base, block_m=128, block_n=128),
                 dataclasses.replace(base, block_m=64, block_n=64, block_k=64)]
        if spec.pool is None:
            # small outputs (batch 1 at 7-14 pixels square, squeeze-excite FCs on one pixel):
            # narrow pixel tiles with long reduction steps, up to 2.4x the heuristic's on
            # EfficientNet-B0's 1x1 layers (conv_kernels_b1_1x1.json; BENCHMARKS.md, "Batch 1:
            # where the time goes")
            tiles += [dataclasses.replace(base, block_m=16, block_n=64, block_k=64, num_warps=2, num_stages=3),
                      dataclasses.replace(base, block_m=16, block_n=32, block_k=128, num_warps=1, num_stages=3)]
    else:
        tiles = [base, dataclasses.replace(base, block_m=128, num_warps=4),
                 dataclasses.replace(base, block_m=32, num_stages=4),
                 dataclasses.replace(base, block_k=16, num_stages=4),
                 dataclasses.replace(base, block_n=128 if base.block_n == 64 else 64, num_warps=4)]
    out, seen = [], set()
    win = 1 << (spec.pool.kernel[0] * spec.pool.kernel[1] - 1).bit_length() if spec.pool else 1
    for v in tiles:
        v = ConvVariant(0, max(v.block_m, win), v.block_n, v.block_k, v.num_warps, v.num_stages, v.flat,
                        group_gemm=v.group_gemm)
        key = (v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages, v.group_gemm)
        if key not in seen:
            seen.add(key)
            label = ("tile {}x{}x{}, {} warps, {} stages".format(*key[:5]) + (", flat" if v.flat else "")
                     if spec.conv.group == 1 or v.group_gemm else
                     f"tile {v.block_m}x{v.block_n}, {v.num_warps} warps, direct")
            label += ", block-diagonal GEMM" if v.group_gemm else ""
            # with the candidate's split-K variant, which the launcher takes for small outputs
            split = split_variant(spec, v)
            vs = (v,) if split is None else (v, split)
            if not out and small is not None:
                # the heuristic's tile ships with the small-M variant: timed as it would run
                vs = (*vs, replace(small, index=len(vs)))
                label += (f", small-M {small.block_m}x{small.block_n}x{small.block_k} "
                          f"({small.num_warps} warps) up to M {small.max_m}")
            out.append((label, vs))
    return out


@dataclass(frozen=True)
class ConvParams:
    """Match a 2-D Conv, the largest pointwise group after it with one result, and (pool
    "tiling") the MaxPool that reads that result when its windows tile the conv output."""

    ops: frozenset[str]  # op types allowed in the epilogue
    dtypes: frozenset[str]
    group: int | None  # the only Conv group fused; None: any
    pool: str  # one of POOL_MODES
    alone: bool = False  # a Conv without an epilogue matches too (identity program)

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"Conv"} | ({"MaxPool"} if self.pool != "none" else set())


@dataclass(frozen=True)
class ConvNodeInfo:
    """What the conv kind keeps about a node besides FusedNode's fields (FusedNode.params)."""

    out_pixels: int | None = None  # P·Q of the conv output where the graph fixes them


# One-pixel convs (P·Q = 1: squeeze-excite FCs, M = N) compile at this precision when the
# model's is "tf32" (BENCHMARKS.md, Decisions, `conv-one-pixel-ieee`): cuDNN ran
# EfficientNet-B0's batch-1 SE FCs in fp32 even with TF32 allowed (max relative error 1.1e-7
# to 6.8e-7, against 3.3e-4 for our TF32 tiles), so at "tf32" they would be ~500x less
# accurate than ONNX Runtime there. Their GEMMs are N x C x K with C, K of at most a few
# thousand: fp32 FMA costs little at any batch. None: they stay at the model's precision.
ONE_PIXEL_PRECISION: str | None = "ieee"


def layer_precision(precision: str, dtype: str, group: int, out_pixels: int | None) -> str:
    """The precision a conv layer compiles at when the model's conv precision is `precision`:
    ONE_PIXEL_PRECISION for float32 group-1 convs of one output pixel at "tf32", else
    `precision`."""
    if ONE_PIXEL_PRECISION is not None and precision == "tf32" and dtype == "f32" and group == 1 \
            and out_pixels == 1:
        return ONE_PIXEL_PRECISION
    return precision


def node_precision(f: FusedNode, precision: str) -> str:
    """The precision FusedConv `f` compiles at (`layer_precision`). The whole node's, not a
    variant's: its packed weights are rounded to TF32 (or not) once, and the producers of
    its X round their stores for it (or not)."""
    info = f.params
    pixels = info.out_pixels if isinstance(info, ConvNodeInfo) else None
    return layer_precision(precision, f.program.input_dtypes[0], f.conv.group if f.conv else 1, pixels)


def channels(f: FusedNode, weight_dims: dict[str, tuple[int, ...]]) -> int:
    """C of a FusedConv, from its packed weights ([R, S, C/group, K] or [K, R, S, C/group])."""
    dims = weight_dims[f.inputs[1]]
    return int(dims[2] if f.w_layout == "rsck" else dims[3]) * f.conv.group


# ---------------------------------------------------------------------------------------
# matching: a Conv, its epilogue, a tiling MaxPool
# ---------------------------------------------------------------------------------------

def _conv_output_shape(view: GraphView, x_shape: Shape, k: int, attrs: ConvAttrs, out: str) -> Shape:
    """[N, K, P, Q]: P, Q by ONNX's rule where H, W are known, else as inferred."""
    h, w = x_shape[2], x_shape[3]
    inferred = view.shapes.get(out)
    if isinstance(h, int) and isinstance(w, int):
        p, q = attrs.out_size(h, w)
    else:
        p, q = (inferred[2], inferred[3]) if inferred is not None and len(inferred) == 4 else (None, None)
    return (x_shape[0], k, p, q)


def _conv_layer(view: GraphView, ci: int, pattern: Pattern) -> tuple[ConvAttrs, Shape] | str:
    """The conv's parameters and output shape, or why this pattern cannot fuse it."""
    m: ConvParams = pattern.match
    n = view.nodes[ci]
    if len(n.input) < 2 or len(n.output) != 1:
        return "Conv without weights"
    x, w = n.input[0], n.input[1]
    b = n.input[2] if len(n.input) > 2 and n.input[2] else None
    x_shape = view.shapes.get(x)
    if x_shape is None:
        return "unknown shape"
    if len(x_shape) != 4:
        return f"{len(x_shape) - 2}-D convolution"
    dtype = view.types.get(x)
    if dtype not in {DTYPE_IDS[d] for d in m.dtypes}:
        return dtype_reason(dtype)
    wt = view.constants.get(w)
    if wt is None:
        return "conv weights are not a constant"
    if wt.data_type != dtype or (b is not None and view.types.get(b) != dtype):
        return "conv weights' dtype differs from the input's"
    if b is not None and (b not in view.constants or tuple(view.constants[b].dims) != (wt.dims[0],)):
        return "conv bias is not a constant of K numbers"
    if not isinstance(x_shape[1], int):
        return "unknown number of input channels"
    spatial = x_shape[2:] if all(isinstance(d, int) for d in x_shape[2:]) else None
    attrs = conv_from_node(n, tuple(wt.dims), spatial)
    if isinstance(attrs, str):
        return attrs
    if m.group is not None and attrs.group != m.group:
        return "grouped convolution"
    if wt.dims[1] * attrs.group != x_shape[1] or wt.dims[0] % attrs.group:
        return "conv weights do not match the input channels"
    return attrs, _conv_output_shape(view, x_shape, wt.dims[0], attrs, n.output[0])


def _conv_match(view: GraphView, ci: int, pattern: Pattern, taken: set[int], accepted: Accepted) -> Match | str:
    """The conv_epilogue match anchored at Conv node ci, or why there is none."""
    m: ConvParams = pattern.match
    layer = _conv_layer(view, ci, pattern)
    if isinstance(layer, str):
        return layer
    attrs, target = layer
    out = view.nodes[ci].output[0]
    epilogue = grow_epilogue(view, ci, target, pattern, taken)
    if not epilogue and m.pool == "none" and not m.alone:
        return "conv without a fusible epilogue"
    direct = [c for c in view.consumers.get(out, ()) if c not in epilogue]
    if (out in view.graph_outputs or direct) and not (m.alone and not epilogue):
        pool_only = (m.pool != "none" and not epilogue and len(direct) == 1
                     and view.nodes[direct[0]].op_type == "MaxPool" and out not in view.graph_outputs)
        if not pool_only:
            if not m.alone:
                return "conv output is also read elsewhere"
            epilogue = set()  # the conv alone: its output goes to every reader
    grown = bool(epilogue)
    epilogue, result = single_result(view, ci, out, epilogue, accepted)
    if grown and not epilogue and not m.alone:  # every smaller group leaves the conv output to others
        return "conv output is also read elsewhere"
    result = result or out
    pool = pool_attrs = None
    if m.pool != "none":
        readers = view.consumers.get(result, ())
        pi = readers[0] if len(readers) == 1 else None
        if pi is None or result in view.graph_outputs or pi in taken or view.nodes[pi].op_type != "MaxPool" \
                or view.nodes[pi].domain not in ("", "ai.onnx"):
            return "no max pool reads the conv's result alone"
        pool_attrs = pool_from_node(view.nodes[pi], target[2:] if all(isinstance(d, int) for d in target[2:])
                                    else None)
        if isinstance(pool_attrs, str):
            return pool_attrs
        if m.pool == "tiling" and not pool_attrs.tiles:
            return "max pool windows do not tile the conv output"
        pool = pi
    nodes = sorted(epilogue | {ci} | ({pool} if pool is not None else set()))
    if reentering(view, nodes, accepted):
        return "fusing would create a cycle"
    final = view.nodes[pool].output[0] if pool is not None else result
    if view.types.get(final) is None:
        return "unknown dtype"
    return Match(pattern, tuple(nodes), (final,), conv=ci, pool=pool, pointwise=tuple(sorted(epilogue)),
                 conv_attrs=attrs, pool_attrs=pool_attrs, first_input=out, result=result)


# Tuning times the candidate tiles of a conv whose heuristic tiles make less than one wave of
# programs on the H200's 132 SMs, where neither split K nor the small-M tile runs
# (`conv-under-one-wave`): ViT-S/16's 16 x 16 patch embedding at batch 8 (M = 1568, 3 -> 384
# channels) ran on 78 programs of 24 reduction steps each, 35.8 µs alone and 36.0 in the model,
# the largest fused node of that model, with no tile but the heuristic's timed (twenty-third
# session). Other convs keep their heuristic tile unless `--tune configs`. (SMS: the H200's
# multiprocessors, as the GEMM kind counts them.)


def under_one_wave(spec: ConvSpec, output_shape: tuple[int, ...] | None) -> bool:
    """A group-1 conv without a pool at a static output shape whose launch (`launcher_choice`:
    neither split K nor the small-M tile) is the heuristic's plain tiles, fewer than SMS."""
    if spec.conv.group != 1 or spec.pool is not None or not output_shape or min(output_shape) <= 0:
        return False
    m = math.prod(output_shape) // spec.filters
    variants = conv_variants(spec)
    meta = {"variants": [{"block_m": v.block_m, "block_n": v.block_n, "split": v.split, "max_m": v.max_m}
                         for v in variants]}
    plain = variants[launcher_choice(meta, m, spec.filters, SMS)]
    return plain.split <= 1 and not plain.max_m and -(-m // plain.block_m) * -(-spec.filters // plain.block_n) < SMS


class Conv(Kind):
    """A match is a 2-D Conv with constant weights, the largest group of pointwise nodes
    after it with exactly one result (the conv output itself read only inside the group),
    and for pool "tiling" the MaxPool that alone reads that result when its windows tile it.
    Each Conv that does not fuse is reported with the reason."""

    name = "conv"
    op_type = "FusedConv"
    match_kind = "conv_epilogue"
    params = frozenset({"group", "pool", "alone"})
    # X (input 0) and Y channels-last on their own, each extra (inputs 3, ...) too; the
    # channels-last kernels want [K, R, S, C] weights (input 1) for sm_90's TF32 wgmma
    layouts = NodeLayouts(extras=3, wants_nhwc=True, weights=1)
    measure_first = True  # cuDNN may be faster

    def searches(self, spec, output_shape: tuple[int, ...] | None) -> bool:
        """Also a conv whose launch is under one wave of the heuristic's tiles (`under_one_wave`)."""
        return self.search_configs or under_one_wave(spec, output_shape)

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> ConvParams:
        """group: 1 or "any"; pool: "none" (no MaxPool after the epilogue) or "tiling" (a
        MaxPool whose windows tile its input must follow); alone (default false): a Conv with
        no fusible epilogue matches too, its program the identity."""
        group = m.get("group", (int, str), 1)
        if group != "any" and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
            m.fail("match.group", f"{group!r} must be a positive number or 'any'")
        pool = m.get("pool", str, "none")
        if pool not in POOL_MODES:
            m.fail("match.pool", f"{pool!r} is not one of {', '.join(POOL_MODES)}")
        for dt in sorted(dtypes):
            if dt not in ("float32", "float16"):
                m.fail("match.dtypes", f"{dt!r}: convolutions are fused for float32 and float16 only")
        alone = m.get("alone", bool, False)
        return ConvParams(ops, dtypes, None if group == "any" else group, pool, alone)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_anchored(view, pattern, taken, accepted, "Conv", _conv_match)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        """Inputs [X, packed W, B, extras...] (new initializers for the packed weights and,
        without a bias, zeros); the body is a Transpose that unpacks the weights, the Conv,
        the epilogue and the MaxPool (docs/format.md, "FusedConv")."""
        program, prog_inputs, folded = lower_group(view, match.pointwise, (match.result,), first=match.first_input)
        shape = view.shapes[match.result]
        modes = ("full", *(input_mode(view, x, shape) for x in prog_inputs[1:]))
        pool = [view.nodes[match.pool]] if match.pool is not None else []
        pointwise = [view.nodes[i] for i in match.pointwise]
        conv = view.nodes[match.conv]
        x, w = conv.input[0], conv.input[1]
        weights = numpy_helper.to_array(view.constants[w])
        k, c = weights.shape[0], view.shapes[x][1]
        packed = unique_name(f"{node_name}.weight_packed", names)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weights.transpose(2, 3, 1, 0)),
                                                         packed))
        bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else ""
        if not bias:
            bias = unique_name(f"{node_name}.bias", names)
            graph.initializer.append(numpy_helper.from_array(np.zeros(k, weights.dtype), bias))
        unpacked = f"{packed}\0onnx_weights"  # any name the graph cannot have: renamed in the body
        unpack = helper.make_node("Transpose", [packed], [unpacked], perm=[3, 2, 0, 1])
        body_conv = NodeProto()
        body_conv.CopyFrom(conv)
        del body_conv.input[:]
        body_conv.input.extend([x, unpacked, bias])
        attrs = {**match.conv_attrs.node_attrs(),
                 **(match.pool_attrs.node_attrs() if match.pool_attrs is not None else {})}
        key = f"conv C={c} K={k} {match.conv_attrs} pool {match.pool_attrs}"
        p, q = shape[2], shape[3]
        info = ConvNodeInfo(out_pixels=p * q if isinstance(p, int) and isinstance(q, int) else None)
        return Lowering(program, folded, [x, packed, bias, *prog_inputs[1:]], [unpack, body_conv, *pointwise, *pool],
                        attrs, key, len(shape), modes, {"conv": match.conv_attrs, "pool": match.pool_attrs,
                                                        "params": info})

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> ConvSpec:
        """C and K come from the packed weights ([R, S, C/group, K], or [K, R, S, C/group]
        with w_layout krsc); the precision is the node's (`node_precision`)."""
        dims = (weight_dims[f.inputs[1]] if weight_dims is not None else
                tuple(next(t.dims for t in model.graph.initializer if t.name == f.inputs[1])))
        c, k = (dims[2], dims[3]) if f.w_layout == "rsck" else (dims[3], dims[0])
        return ConvSpec(f.kernel_name, f.program, channels=int(c) * f.conv.group,
                        filters=int(k), conv=f.conv, pool=f.pool, precision=node_precision(f, precision),
                        source_nodes=f.source_nodes, x_layout=f.x_layout, y_layout=f.y_layout,
                        extra_layouts=f.extra_layouts, w_layout=f.w_layout,
                        x_rounded=f.x_rounded, round_y=f.round_y)

    def decline_reason(self, spec: ConvSpec, layout: str) -> str | None:
        return conv_decline_reason(spec, layout)

    def variants(self, spec: ConvSpec) -> tuple[ConvVariant, ...]:
        return conv_variants(spec)

    def generate(self, spec: ConvSpec, variant: ConvVariant) -> KernelSource:
        return generate_conv(spec, variant)

    def kernel_meta(self, spec: ConvSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION, "kind": "conv", "name": spec.name, "n_extras": spec.n_extras,
            "pool_in_epilogue": list(spec.pool.kernel) if spec.pool else None,
            **({"x_layout": spec.x_layout, "y_layout": spec.y_layout,
                "extra_layouts": list(spec.extra_layouts) or [0] * spec.n_extras}
               if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") or any(spec.extra_layouts) else {}),
            **({"w_layout": spec.w_layout} if spec.w_layout != "rsck" else {}),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def ptx_arch(self, archs: list[int]) -> tuple[int, bool]:
        """Conv kernels use tensor-core instructions specific to sm_90a (wgmma), so their
        sm_90a+ PTX cannot be relaxed: the PTX of the highest target below sm_90 is embedded
        when there is one (it JITs on any newer GPU), else the highest target's as it is."""
        below = [a for a in archs if a < 90]
        return (below[-1] if below else archs[-1]), False

    def candidates(self, spec: ConvSpec) -> list[tuple[str, tuple]]:
        return conv_candidates(spec)

    def multiplies_in_tf32(self, f: FusedNode, precision: str) -> bool:
        """Float32 convs at "tf32" (one-pixel convs compile at ONE_PIXEL_PRECISION). Float16
        convs multiply as cuDNN's do (fp16 products, fp32 sums)."""
        return node_precision(f, precision) == "tf32" and f.program.input_dtypes[0] == "f32"

    def reads_tf32(self, spec: ConvSpec) -> bool:
        return prerounds_weights(spec)

    def may_store_tf32(self, spec: ConvSpec) -> bool:
        return spec.dtype == "f32" and spec.precision == "tf32" and spec.program.outputs[0][1] == "f32"

    def tf32_initializers(self, f: FusedNode, spec: ConvSpec) -> tuple[str, ...]:
        return (f.inputs[1],) if prerounds_weights(spec) else ()

    def transposes_x(self, f: FusedNode, weight_dims: dict) -> bool:
        """Group-1 convs of at least MIN_NHWC_CHANNELS channels. Grouped convs read NCHW X
        as it is: they are memory-bound, a Transpose would double their traffic, and their
        direct kernel has no wgmma operand layout to satisfy."""
        return f.conv.group == 1 and channels(f, weight_dims) >= MIN_NHWC_CHANNELS

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Honours the layout attributes: NHWC tensors are transposed to NCHW before, an NHWC
        output from NCHW after; the weights are unpacked from w_layout."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        program = Program.from_text(attrs["program"].decode())
        x, packed, b, *extras = inputs
        if layout_attr(attrs, "x_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC":
            x = x.transpose(0, 3, 1, 2)
        y_nhwc = layout_attr(attrs, "y_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC"
        layouts = list(attrs.get("extra_layouts", [0] * len(extras)))
        if len(layouts) != len(extras) or any(v not in (0, 1) for v in layouts):
            raise ValueError(f"extra_layouts {layouts} for {len(extras)} extra inputs")
        extras = [e.transpose(0, 3, 1, 2) if v == 1 else e for e, v in zip(extras, layouts, strict=True)]
        # [R, S, C/group, K] or [K, R, S, C/group] -> ONNX's [K, C/group, R, S]
        w_layout = layout_attr(attrs, "w_layout", "RSCK", ("RSCK", "KRSC"))
        w = packed.transpose(3, 2, 0, 1) if w_layout == "RSCK" else packed.transpose(0, 3, 1, 2)
        y = conv2d(x, w, b, conv_from_fused(attrs)).astype(x.dtype)  # rounded to X's dtype
        (z,) = evaluate(program, [y, *extras])
        pool = pool_from_fused(attrs)
        z = z if pool is None else maxpool2d(z, pool)
        return [np.ascontiguousarray(z.transpose(0, 2, 3, 1)) if y_nhwc else z]
