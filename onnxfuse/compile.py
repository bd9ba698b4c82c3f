"""Ahead-of-time compilation: generated Triton kernels become cubin/PTX per GPU target.

No GPU is needed: `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`
runs Triton's whole pipeline and the bundled ``ptxas`` on the CPU. For each `KernelSpec`
`compile_kernels` produces two variants (docs/format.md):

- variant 0 promises 16-byte aligned pointers and ``n_elements % 16 == 0``; the promises
  reach Triton as ``tt.divisibility`` hints, so loads and stores vectorize;
- variant 1 promises nothing.

Each variant is compiled to a cubin per requested target, and the PTX of the highest
target is kept too (its ``.target`` relaxed from ``sm_XXa`` to ``sm_XX``) so that GPUs
newer than every cubin can JIT it. `attach` writes the result onto a fused node as the
``kernel_meta`` attribute and one string attribute ``kernel_<i>`` per binary.

Launch configuration (`choose_variants`): 4 warps, and a BLOCK giving each thread two
16-byte accesses per tensor: 1024 (8 elements per thread) when some input or output is
fp32, 2048 when all are 16-bit or bool. Long programs keep 4 warps: with 8 warps, x*2
repeated 64-256 times ran 6-16% slower on the H200 (compute-bound there). Measured on the H200
(64M elements, Triton JIT, 2026-11-29): 1024/4 was within about 5% of the best of
512..4096 x 2..16 warps for cos(cos(x)) and x*2 (8x) in fp32; an fp16 GELU ran 116 us at
1024/4 and 110 us at 2048/4. benchmarks/tune_pointwise.py (2026-11-29, H200, 64M
elements, 32 configurations x 5 workloads, BENCHMARKS.md): 1024/4 with int32 offsets was
best by geometric mean and equal to torch.compile's kernels; mask-free (even) kernels and
int64 offsets made no measurable difference, so the mask-free variant is off by default
(ONNXFUSE_POINTWISE_CONFIG=even=1 turns it on).

Targets: triton 3.6 compiles sm_70 ... sm_90 with its bundled ptxas (CUDA 12.8) and
sm_100, sm_101, sm_103, sm_120, sm_121 with its bundled ptxas-blackwell (CUDA 12.9);
sm_110 is not known to either. From sm_90 on, Triton compiles for the arch-specific
``sm_XXa`` target; such a cubin runs on exactly that compute capability.

Misses compile in parallel, in `jobs` worker processes (default: one per CPU core).

Cache: one entry per (kernel source, variant, target) under ``~/.cache/onnxfuse/kernels``
(``$ONNXFUSE_CACHE`` overrides the root), keyed by a hash of the source, signature,
hints, options, target and Triton version. Generated modules are written under the same
root (``src/``), because ``@triton.jit`` reads its function's source file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from onnxfuse.codegen import KernelSource, Variant, generate
from onnxfuse.codegen_conv import (
    ConvSpec,
    ConvVariant,
    MaxPoolSpec,
    PoolVariant,
    conv_steps,
    generate_conv,
    generate_maxpool,
    group_gemm_fits,
    group_span,
    next_pow2,
)
from onnxfuse.codegen_rows import RowsSpec, RowsVariant, generate_rows, rows_variants  # kind rows (issue 17)
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import Program
from onnxfuse.tools.cuda import local_gpu_archs

META_VERSION = 1
CACHE_FORMAT = 1  # bump when the cache entry layout or the compile options change
DEFAULT_TARGETS = (80, 90)  # A100 and H100/H200, when no local GPU reports its arch
SUPPORTED_ARCHS = (70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121)

BLOCK = 1024  # with any fp32 tensor
BLOCK_16BIT = 2048  # when every tensor is f16, bf16 or bool
NUM_WARPS = 4  # 8 warps for long programs was 6-16% slower on the H200 (BENCHMARKS.md)


@dataclass(frozen=True)
class LongProgram:
    """The launch configuration of long programs: those of `min_instrs` instructions or more,
    and fewer than `max_instrs`, get `block` and `warps` instead of BLOCK / NUM_WARPS."""

    min_instrs: int
    block: int
    warps: int
    max_instrs: int = 1 << 30


# Long programs turn compute-bound (x*2 repeated 64 times: the knee of the intensity sweep).
# benchmarks/tune_pointwise.py on the H200 (tune_long.json, 2026-11-29, kernel ms at 64M
# floats): r = 64: 1024/4 0.1636, 1024/2 0.1495, 4096/4 0.1480, torch.compile 0.1577;
# r = 128: 1024/4 0.2812, 1024/2 0.2719, torch.compile 0.2826; r = 32: 1024/4 0.1307,
# 1024/2 0.1325. 1024 x 2 warps had the best geometric mean of the long chains (18
# configurations); 8 warps was worse. Fewer threads per block hold more elements each,
# whose independent multiply chains hide the FMA latency. Fully compute-bound programs do
# not gain: r = 256 took 0.573 ms with 1024/2 against 0.536 with 1024/4 and torch.compile's
# 0.537 (intensity_sweep.json), so from 192 instructions the default launch returns.
# $ONNXFUSE_POINTWISE_CONFIG still overrides it; None turns it off.
LONG_PROGRAM: LongProgram | None = LongProgram(min_instrs=48, block=1024, warps=2, max_instrs=192)

# triton.compile options. enable_reflect_ftz=False keeps subnormals in libdevice math
# (the numpy reference and ONNX Runtime do not flush them).
COMPILE_OPTIONS = {"enable_reflect_ftz": False}


@dataclass(frozen=True)
class KernelSpec:
    """What to compile: a program, its kernel name and the shape facts codegen needs."""

    program: Program
    name: str
    rank: int
    input_modes: tuple[str, ...]
    source_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Binary:
    """One compiled binary (attribute ``kernel_<i>``) and its entry in ``kernel_meta``."""

    variant: int
    arch: int
    format: str  # "cubin" or "ptx"
    entry: str  # symbol of the kernel in the module
    num_warps: int
    shared: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    profile_scratch_align: int
    data: bytes

    def meta(self) -> dict:
        return {
            "variant": self.variant, "arch": self.arch, "format": self.format, "entry": self.entry,
            "num_warps": self.num_warps, "shared": self.shared,
            "global_scratch_size": self.global_scratch_size,
            "global_scratch_align": self.global_scratch_align,
            "profile_scratch_size": self.profile_scratch_size,
            "profile_scratch_align": self.profile_scratch_align,
        }


AnySpec = KernelSpec | ConvSpec | MaxPoolSpec | RowsSpec


@dataclass(frozen=True)
class CompiledKernel:
    """All binaries of one kernel, plus how they were obtained."""

    spec: AnySpec
    variants: tuple[Variant | ConvVariant | PoolVariant | RowsVariant, ...]
    binaries: tuple[Binary, ...]
    compile_seconds: float  # time spent compiling this kernel's misses (0.0 if all hit)
    cache_hits: int  # (variant, target) pairs found in the cache
    compiled: int  # (variant, target) pairs compiled now

    def kernel_meta(self) -> dict:
        """The ``kernel_meta`` object of docs/format.md (kind pointwise, conv or maxpool)."""
        spec, binaries = self.spec, [b.meta() for b in self.binaries]
        if isinstance(spec, ConvSpec):
            return {
                "version": META_VERSION, "kind": "conv", "name": spec.name, "n_extras": spec.n_extras,
                "pool_in_epilogue": list(spec.pool.kernel) if spec.pool else None,
                **({"x_layout": spec.x_layout, "y_layout": spec.y_layout,
                    "extra_layouts": list(spec.extra_layouts) or [0] * spec.n_extras}
                   if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") or any(spec.extra_layouts) else {}),
                **({"w_layout": spec.w_layout} if spec.w_layout != "rsck" else {}),
                "variants": [{"requires": v.requires(), **v.meta()} for v in self.variants],
                "binaries": binaries,
            }
        if isinstance(spec, RowsSpec):  # kind rows (issue 17): docs/format.md, FusedRows
            return {
                "version": META_VERSION, "kind": "rows", "name": spec.name, "reduction": spec.reduction,
                "axis": spec.lead_rank, "n_prologue": spec.n_prologue, "n_extras": spec.n_extras,
                "input_modes": list(spec.input_modes), "x_output": int(spec.x_output),
                "variants": [{"requires": v.requires(), **v.meta()} for v in self.variants],
                "binaries": binaries,
            }
        if isinstance(spec, MaxPoolSpec):
            return {
                "version": META_VERSION, "kind": "maxpool", "name": spec.name, "n_extras": spec.n_extras,
                **({"x_layout": spec.x_layout, "y_layout": spec.y_layout}
                   if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") else {}),
                "variants": [{"requires": v.requires(), **v.meta()} for v in self.variants],
                "binaries": binaries,
            }
        return {
            "version": META_VERSION,
            "name": spec.name,
            "rank": spec.rank,
            "input_modes": list(spec.input_modes),
            "variants": [{"requires": v.requires(), "block": v.block} for v in self.variants],
            "binaries": binaries,
        }

    def kernel_meta_json(self) -> str:
        return json.dumps(self.kernel_meta(), separators=(",", ":"))

    def kernels(self) -> list[bytes]:
        """The code of each binary: attribute ``kernel_<i>`` holds ``kernels()[i]``."""
        return [b.data for b in self.binaries]


@dataclass(frozen=True)
class CompileFailure:
    """A kernel that did not compile (`compile_kernels(..., errors="collect")`)."""

    spec: AnySpec
    targets: tuple[int, ...]  # the archs it failed for
    message: str  # the first failure's error, shortened


def choose_variants(spec: KernelSpec) -> tuple[Variant, ...]:
    """The variants of a kernel, most specialized first (the launcher takes the first whose
    requirements hold): 0: aligned, n a multiple of BLOCK, int32 offsets, no mask;
    1: aligned, n % 16 == 0, int32 offsets; 2: anything, int64 offsets.

    Programs of 48 to 191 instructions take LONG_PROGRAM's block and warps (1024 and 2:
    measured on the long chains, see LONG_PROGRAM).
    ``$ONNXFUSE_POINTWISE_CONFIG`` (e.g. ``block=2048,warps=8,int32=0,even=0``) overrides
    the launch configuration; it is for tuning experiments (benchmarks/tune_pointwise.py)."""
    prog = spec.program
    narrow = "f32" not in prog.input_dtypes and all(dt != "f32" for _, dt in prog.outputs)
    cfg = {"block": BLOCK_16BIT if narrow else BLOCK, "warps": NUM_WARPS,
           "int32": 1, "even": 0}
    if LONG_PROGRAM is not None and LONG_PROGRAM.min_instrs <= len(prog.instrs) < LONG_PROGRAM.max_instrs:
        cfg.update(block=LONG_PROGRAM.block, warps=LONG_PROGRAM.warps)
    _env_config("ONNXFUSE_POINTWISE_CONFIG", cfg)
    block, warps, bits = cfg["block"], cfg["warps"], 32 if cfg["int32"] else 64
    variants = []
    if cfg["even"]:
        variants.append(dict(ptr_align=16, n_multiple=max(block, 16), index_bits=bits))
    variants.append(dict(ptr_align=16, n_multiple=16, index_bits=bits))
    variants.append(dict(index_bits=64))
    return tuple(Variant(k, block=block, num_warps=warps, **v) for k, v in enumerate(variants))


FLAT_MAX_CHANNELS = 16  # convs with fewer input channels use the flat reduction


def conv_variants(spec: ConvSpec) -> tuple[ConvVariant, ...]:
    """The tile configuration of a conv kernel (one variant), by the heuristics measured with
    benchmarks/conv_kernels.py on the H200 (BENCHMARKS.md): 64x64 tiles of 2 warps with
    BLOCK_K 32 and 3 stages were best or within 5% of the best on every 64-channel VGG layer;
    BLOCK_K 16 with 4 stages for inputs of fewer than 16 channels (the image layer: 0.36 ms
    against 0.62 with 32); BLOCK_N 128 with 4 stages for 128 filters or more.

    Channels-last X with [K, R, S, C] weights (the NHWC pass) runs on sm_90's TF32 wgmma,
    which needs 4 warps: 128x64 tiles for up to 64 filters, 64x128 from 128 filters, BLOCK_K
    32, 3 stages were best or within 10% of the best of 15 configurations on every layer of
    the same sweep with 16 or more channels (benchmarks/results/conv_kernels_layouts.json).

    Fewer than 16 input channels (an image): one flat reduction over (tap, channel) in
    128x64x32 tiles, 4 warps, 2 stages, the best of 8 on ResNet's 7x7 stride-2 stem (0.126 ms
    against 0.388 per tap and 0.339 for cuDNN channels-last) and VGG's first layer (0.105
    against 0.362; conv_kernels_flat_*.json).

    A second variant splits the reduction (split K, `split_variant`) for launches whose plain
    tiles would leave most SMs idle; the launcher picks it at run time.

    Grouped convs: the block-diagonal GEMM where it fits (`_grouped_gemm_tile`), else the
    direct loop (`_grouped_tile`).

    ``$ONNXFUSE_CONV_CONFIG`` (``block_m=,block_n=,block_k=,warps=,stages=,flat=,split=,
    group_gemm=``) overrides it (``split=0``: no split-K variant)."""
    cfg = {"block_m": 64, "block_n": 64, "block_k": 32, "warps": 2, "stages": 3, "flat": 0, "split": 1,
           "group_gemm": 0}
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
    _env_config("ONNXFUSE_CONV_CONFIG", cfg)
    if spec.pool is not None:  # BLOCK_M holds whole (padded) windows
        win = 1 << (spec.pool.kernel[0] * spec.pool.kernel[1] - 1).bit_length()
        cfg["block_m"] = max(cfg["block_m"], win)
    plain = ConvVariant(0, cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["warps"], cfg["stages"],
                        bool(cfg["flat"]), group_gemm=bool(cfg["group_gemm"]))
    split = split_variant(spec, plain) if cfg["split"] else None
    return (plain,) if split is None else (plain, split)


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


def pool_variants(spec: MaxPoolSpec) -> tuple[PoolVariant, ...]:
    """The pool kernel, its blocks and its variants (`with_size_variants`):
    - channels-last X: the "nhwc" kernel, 4 pixels x 64 channels, 1 warp. Launched as the
      ahead-of-time kernel runs (C not known to be a multiple of 16, so no vector loads;
      benchmarks/pool_nhwc.py --aot-only, pool_nhwc_aot.json, H200), the best or near it of
      12 tiles on YOLO's SPPF pool 5x5 s1 at 16x256x10² (13.5 µs; 32 x 64 x 4 warps: 32.7)
      and ResNet's stem pool 3x3 s2 at 32x64x112² (52 µs; 32 x 64: 90), not on a 2x2 pool
      (67 µs; best 43 with 8 x 64). With C specialized the 2x2 pool took 37 µs (88% of copy
      bandwidth, relu_maxpool_tiles.json), so the nhwc kernel has two variants: the first
      requires C % 16 == 0 and 16-byte aligned pointers and is compiled knowing C divisible
      by 16 (vector loads along the channels), the second takes any C;
    - NCHW pools whose windows tile the input (2x2 stride 2): the "rows" kernel, 4 x 64
      outputs, 4 warps (the best of 9 there: 0.0370 ms, 89%; 8 x 64 0.0374; launched with
      W = 112 specialized as a multiple of 16), likewise in two variants: for W a multiple
      of 16 (vector loads along the rows), then any W;
    - other NCHW pools: the "flat" kernel, 256 outputs per program, 4 warps: the best of
      256..2048 x 4/8 warps for Relu+MaxPool 2x2 at 32x64x112x112 on the H200 (83-85% of
      copy bandwidth; BENCHMARKS.md).

    ``$ONNXFUSE_POOL_CONFIG`` (``tile=flat|rows|nhwc,block=,block_oh=,block_ow=,block_p=,block_c=,warps=``)
    overrides it."""
    if spec.x_layout == "nhwc":
        cfg: dict = {"tile": "nhwc", "block_p": 4, "block_c": 64, "warps": 1}
    elif spec.pool.tiles:
        cfg = {"tile": "rows", "block_oh": 4, "block_ow": 64, "warps": 4}
    else:
        cfg = {"tile": "flat", "block": 256, "warps": 4}
    _env_config("ONNXFUSE_POOL_CONFIG", cfg, ("tile", "block", "block_oh", "block_ow", "block_p", "block_c", "warps"))
    v = PoolVariant(0, cfg.get("block", 256), cfg["warps"], cfg["tile"], cfg.get("block_oh", 8),
                    cfg.get("block_ow", 64), cfg.get("block_p", 32), cfg.get("block_c", 64))
    return with_size_variants(spec, v)


def with_size_variants(spec: MaxPoolSpec, v: PoolVariant) -> tuple[PoolVariant, ...]:
    """A pool tile as it ships: nhwc and rows (power-of-two window width) kernels first as a
    variant for C (nhwc) or W (rows) a multiple of 16, whose loads vectorize, then as `v`
    for any size; other kernels as `v` alone."""
    v = replace(v, index=0, c_multiple=0, w_multiple=0)
    kw = spec.pool.kernel[1]
    if v.tile == "nhwc":
        return (replace(v, c_multiple=16), replace(v, index=1))
    if v.tile == "rows" and kw & (kw - 1) == 0:  # a window row of KW_P = KW lanes: contiguous spans
        return (replace(v, w_multiple=16), replace(v, index=1))
    return (v,)


def _env_config(var: str, cfg: dict, known: tuple[str, ...] | None = None) -> dict:
    """`cfg` updated from ``$var`` ("key=value,..."; integers, but `tile` a name). An unknown
    key is an error naming the known ones (default: cfg's keys)."""
    known = tuple(cfg) if known is None else known
    for item in filter(None, os.environ.get(var, "").split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise OnnxfuseError(f"{var}: unknown key {key!r} (known: {', '.join(known)})")
        cfg[key] = value if key == "tile" else int(value)
    return cfg


def _variants(spec: AnySpec) -> tuple:
    if isinstance(spec, ConvSpec):
        return conv_variants(spec)
    if isinstance(spec, MaxPoolSpec):
        return pool_variants(spec)
    if isinstance(spec, RowsSpec):
        return rows_variants(spec)
    return choose_variants(spec)


def _generate(spec: AnySpec, variant) -> KernelSource:
    if isinstance(spec, ConvSpec):
        return generate_conv(spec, variant)
    if isinstance(spec, MaxPoolSpec):
        return generate_maxpool(spec, variant)
    if isinstance(spec, RowsSpec):
        return generate_rows(spec, variant)
    return generate(spec.program, spec.name, spec.rank, spec.input_modes, list(spec.source_nodes), variant)


# ---------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------


def parse_targets(text: str) -> list[int]:
    """``"sm_90,sm_80"`` -> ``[90, 80]`` (order kept, duplicates dropped)."""
    archs: list[int] = []
    for tok in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"sm_?(\d+)a?", tok)
        if not m:
            raise OnnxfuseError(
                f"bad GPU target {tok!r}: expected names like sm_80 or sm_90, comma-separated")
        arch = int(m.group(1))
        if arch not in SUPPORTED_ARCHS:
            known = ", ".join(f"sm_{a}" for a in SUPPORTED_ARCHS)
            raise OnnxfuseError(f"GPU target {tok!r} is not supported by triton's ptxas (known: {known})")
        if arch not in archs:
            archs.append(arch)
    return archs


def default_targets() -> list[int]:
    """The local GPUs' archs if the CUDA driver reports any, else `DEFAULT_TARGETS`.

    A local arch newer than every supported one maps to the newest supported arch below
    it (its PTX JITs on the newer GPU).
    """
    archs = []
    for cc in local_gpu_archs():
        usable = [a for a in SUPPORTED_ARCHS if a <= cc]
        if usable and usable[-1] not in archs:
            archs.append(usable[-1] if cc not in SUPPORTED_ARCHS else cc)
    return sorted(archs) or list(DEFAULT_TARGETS)


# ---------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else ``$ONNXFUSE_CACHE``, else ``~/.cache/onnxfuse/kernels``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ONNXFUSE_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "onnxfuse" / "kernels"


@dataclass(frozen=True)
class _Job:
    """One (kernel source, variant, target) to compile; picklable for the worker pool."""

    kernel: KernelSource
    arch: int
    key: str
    root: str


def compile_kernels(
    specs: list[AnySpec],
    targets: list[int],
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    errors: str = "raise",
    variant_override: tuple | None = None,
) -> list[CompiledKernel | CompileFailure]:
    """Compile every spec's variants for every target (cached, in parallel); same order.

    A (variant, target) that fails to compile raises OnnxfuseError, or with
    errors="collect" makes its spec's entry a CompileFailure (the others still compile).
    variant_override: the variants to compile for every spec instead of the defaults (tuning)."""
    if not targets:
        raise OnnxfuseError("no GPU targets to compile for")
    for arch in targets:
        if arch not in SUPPORTED_ARCHS:
            raise OnnxfuseError(f"GPU target sm_{arch} is not supported by triton's ptxas")
    root = cache_root(cache_dir)
    archs = sorted(set(targets))
    plans = []  # per spec: (variants, [(kernel, arch, key)])
    for spec in specs:
        try:
            variants = variant_override if variant_override is not None else _variants(spec)
            kernels = [_generate(spec, v) for v in variants]
        except ValueError as e:  # a kernel this code generator cannot write
            if errors != "collect":
                raise OnnxfuseError(f"kernel {spec.name}: {e}") from None
            plans.append(((), [], str(e)))
            continue
        plans.append((variants, [(k, a, _cache_key(k, a)) for k in kernels for a in archs], None))

    results: dict[str, dict] = {}
    misses: dict[str, _Job] = {}
    for _, entries, _ in plans:
        for kernel, arch, key in entries:
            hit = _cache_get(root, key)
            if hit is not None:
                results[key] = hit
            elif key not in misses:
                misses[key] = _Job(kernel, arch, key, str(root))
    timings, failures = _run_jobs(list(misses.values()), jobs)
    if failures and errors != "collect":
        key, message = next(iter(failures.items()))
        raise OnnxfuseError(f"kernel compilation failed ({misses[key].kernel.name}, sm_{misses[key].arch}):\n"
                            f"{message}")
    for key in misses:
        if key in failures:
            continue
        entry = _cache_get(root, key)
        if entry is None:
            failures[key] = f"compiled kernel {misses[key].kernel.name} is missing from the cache at {root}"
            if errors != "collect":
                raise OnnxfuseError(failures[key])
            continue
        results[key] = entry

    out: list[CompiledKernel | CompileFailure] = []
    for spec, (variants, entries, problem) in zip(specs, plans, strict=True):
        if problem is not None:
            out.append(CompileFailure(spec, tuple(archs), problem))
            continue
        failed = [(a, failures[key]) for _, a, key in entries if key in failures]
        if failed:
            archs = tuple(sorted({a for a, _ in failed}))
            out.append(CompileFailure(spec, archs, failed[0][1]))
            continue
        binaries: list[Binary] = []
        for v in variants:
            mine = [(a, results[key]) for k, a, key in entries if k.variant == v]
            binaries += [_binary(v.index, a, r, "cubin") for a, r in mine]
            binaries.append(_ptx_binary(spec, v.index, mine))
        keys = [key for _, _, key in entries]
        out.append(CompiledKernel(
            spec=spec,
            variants=variants,
            binaries=tuple(binaries),
            compile_seconds=sum(timings.get(k, 0.0) for k in set(keys)),
            cache_hits=sum(k not in misses for k in keys),
            compiled=sum(k in misses for k in keys),
        ))
    return out


def _run_jobs(todo: list[_Job], jobs: int | None) -> tuple[dict[str, float], dict[str, str]]:
    """Compile the jobs, in `jobs` worker processes when there are several. Returns seconds
    per compiled key and an error message per failed key: a job that raises fails alone;
    when a worker process dies, its unfinished jobs run again one per process, so only the
    job that kills its compiler fails.

    Workers are fresh interpreters (``python -c``) fed a pickled list of jobs, rather than
    a multiprocessing pool: "fork" would copy the caller's threads (ONNX Runtime, MLIR),
    and "spawn" re-imports the caller's main script, which breaks unguarded scripts. When
    the caller is interrupted (Ctrl-C) or fails, the workers are killed.
    """
    n = min(len(todo), jobs or os.cpu_count() or 1)
    if n <= 1:
        return _compile_all(todo)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-compile-") as tmp:
        timings, failures, crashed = _run_workers([todo[w::n] for w in range(n)], n, Path(tmp), "w")
        if len(crashed) > 1:
            for j in crashed:
                failures.pop(j.key, None)
            t2, f2, _ = _run_workers([[j] for j in crashed], n, Path(tmp), "r")
            timings.update(t2)
            failures.update(f2)
        return timings, failures


def _run_workers(groups: list[list[_Job]], parallel: int, tmp: Path, tag: str):
    """Run each group of jobs in one worker process, at most `parallel` at a time. Returns
    (timings, failures, jobs of workers that died without a result)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("TRITON_INTERPRET", None)
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    crashed: list[_Job] = []
    for first in range(0, len(groups), parallel):
        procs = []
        try:
            for w, mine in enumerate(groups[first:first + parallel], start=first):
                job_file, log_file = tmp / f"{tag}{w}.pickle", tmp / f"{tag}{w}.log"
                job_file.write_bytes(pickle.dumps(mine))
                with open(log_file, "wb") as log:
                    cmd = [sys.executable, "-c", f"import onnxfuse.compile as c; c._worker_main({str(job_file)!r})"]
                    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL), mine, job_file, log_file))
            for proc, mine, job_file, log_file in procs:
                code = proc.wait()
                out = job_file.with_suffix(".out")
                if code == 0 and out.exists():
                    done, failed = pickle.loads(out.read_bytes())
                    timings.update(done)
                    failures.update(failed)
                    continue
                log = log_file.read_text(errors="replace")[-4000:]
                for j in mine:
                    failures[j.key] = f"compiler process exited with code {code}:\n{log}"
                crashed += mine
        finally:
            alive = [proc for proc, *_ in procs if proc.poll() is None]
            for proc in alive:
                proc.kill()
            for proc in alive:
                proc.wait()
    return timings, failures, crashed


def _compile_all(todo: list[_Job]) -> tuple[dict[str, float], dict[str, str]]:
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    for j in todo:
        try:
            key, seconds = _compile_job(j)
            timings[key] = seconds
        except Exception as e:  # one kernel's failure: reported, the others go on
            failures[j.key] = _error_text(e)
    return timings, failures


def _error_text(e: BaseException) -> str:
    lines = [ln for ln in f"{type(e).__name__}: {e}".strip().splitlines() if ln.strip()]
    return "\n".join(lines[:20])


def _worker_main(job_path: str) -> None:
    """Worker process: compile the pickled jobs, write ({key: seconds}, {key: error}) beside them."""
    todo = pickle.loads(Path(job_path).read_bytes())
    Path(job_path).with_suffix(".out").write_bytes(pickle.dumps(_compile_all(todo)))


def _compile_job(job: _Job) -> tuple[str, float]:
    """Compile one job with triton and store it in the cache; returns (key, seconds)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    root = Path(job.root)
    k = job.kernel
    fn = _load_kernel(root, k)
    with tempfile.TemporaryDirectory() as triton_cache, knobs.cache.scope(), \
            knobs.compilation.scope(), knobs.runtime.scope():
        knobs.cache.dir = triton_cache  # ours is the only persistent cache
        knobs.compilation.disable_line_info = True  # else the cubin embeds the PTX text
        knobs.runtime.override_arch = None
        src = ASTSource(fn, k.signature, dict(k.constexprs), k.attrs)
        options = dict(COMPILE_OPTIONS, num_warps=k.num_warps)
        if k.num_stages is not None:
            options["num_stages"] = k.num_stages
        ck = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=options)
    md = ck.metadata
    meta = {
        "entry": md.name,
        "num_warps": md.num_warps,
        "shared": md.shared,
        "global_scratch_size": md.global_scratch_size or 0,
        "global_scratch_align": md.global_scratch_align or 1,
        "profile_scratch_size": md.profile_scratch_size or 0,
        "profile_scratch_align": md.profile_scratch_align or 1,
        "triton_version": triton.__version__,
    }
    _cache_put(root, job.key, meta, ck.asm["cubin"], ck.asm["ptx"])
    return job.key, time.perf_counter() - start


def _load_kernel(root: Path, kernel: KernelSource):
    """Write the kernel module under ``root/src`` and import it; returns the JITFunction."""
    import triton
    from triton import knobs

    digest = hashlib.sha256(kernel.source.encode()).hexdigest()[:16]
    modname = f"_onnxfuse_kernel_{kernel.name}_{digest}"
    path = root / "src" / f"{kernel.name}_{digest}.py"
    if not path.exists() or path.read_text() != kernel.source:
        _atomic_write(path, kernel.source.encode())
    mod = sys.modules.get(modname)
    if mod is None or not isinstance(getattr(mod, kernel.name, None), triton.runtime.JITFunction):
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        with knobs.runtime.scope():
            knobs.runtime.interpret = False  # an interpreted function cannot be compiled
            spec.loader.exec_module(mod)
        sys.modules[modname] = mod
    return getattr(mod, kernel.name)


def _cache_key(kernel: KernelSource, arch: int) -> str:
    import triton

    desc = {
        "format": CACHE_FORMAT,
        "triton": triton.__version__,
        "ptxas": [os.environ.get(v, "") for v in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")],
        "arch": arch,
        "name": kernel.name,
        "source": kernel.source,
        "params": kernel.params,
        "constexprs": kernel.constexprs,
        "divisible": kernel.divisible,
        "num_warps": kernel.num_warps,
        "num_stages": kernel.num_stages,
        "options": COMPILE_OPTIONS,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _entry_paths(root: Path, key: str) -> tuple[Path, Path, Path]:
    d = root / key[:2]
    return d / f"{key}.json", d / f"{key}.cubin", d / f"{key}.ptx"


def _cache_get(root: Path, key: str) -> dict | None:
    """The cached entry (metadata plus ``cubin`` and ``ptx``), or None."""
    meta_path, cubin_path, ptx_path = _entry_paths(root, key)
    try:
        meta = json.loads(meta_path.read_text())
        return dict(meta, cubin=cubin_path.read_bytes(), ptx=ptx_path.read_text())
    except (OSError, ValueError):
        return None


def _cache_put(root: Path, key: str, meta: dict, cubin: bytes, ptx: str) -> None:
    meta_path, cubin_path, ptx_path = _entry_paths(root, key)
    _atomic_write(cubin_path, cubin)
    _atomic_write(ptx_path, ptx.encode())
    _atomic_write(meta_path, json.dumps(meta, sort_keys=True).encode())  # last: marks complete


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _binary(variant: int, arch: int, entry: dict, fmt: str, relax: bool = True) -> Binary:
    ptx = entry["ptx"]
    data = entry["cubin"] if fmt == "cubin" else (portable_ptx(ptx) if relax else ptx).encode()
    return Binary(
        variant=variant, arch=arch, format=fmt, entry=entry["entry"], num_warps=entry["num_warps"],
        shared=entry["shared"], global_scratch_size=entry["global_scratch_size"],
        global_scratch_align=entry["global_scratch_align"],
        profile_scratch_size=entry["profile_scratch_size"],
        profile_scratch_align=entry["profile_scratch_align"], data=data,
    )


def _ptx_binary(spec: AnySpec, variant: int, mine: list[tuple[int, dict]]) -> Binary:
    """The PTX to embed beside the cubins. Pointwise and maxpool kernels: the highest
    target's, relaxed to run on newer GPUs (`portable_ptx`). Conv kernels use tensor-core
    instructions that are specific to sm_90a (wgmma), so their sm_90a+ PTX cannot be
    relaxed: the PTX of the highest target below sm_90 is embedded when there is one (it
    JITs on any newer GPU), else the highest target's PTX as it is."""
    if not isinstance(spec, ConvSpec):
        return _binary(variant, mine[-1][0], mine[-1][1], "ptx")
    below = [(a, r) for a, r in mine if a < 90]
    arch, entry = below[-1] if below else mine[-1]
    return _binary(variant, arch, entry, "ptx", relax=False)


def portable_ptx(ptx: str) -> str:
    """Relax ``.target sm_90a`` to ``sm_90`` so newer GPUs can JIT the PTX.

    Triton targets the arch-specific ``sm_XXa`` from sm_90 on; PTX for it only loads on
    exactly that arch. Pointwise kernels use no arch-specific instructions (the tests
    assemble the relaxed PTX for a newer arch with ptxas).
    """
    return re.sub(r"^(\s*\.target\s+sm_\d+)a\b", r"\1", ptx, flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------
# the fused node
# ---------------------------------------------------------------------------------------

_KERNEL_ATTR = re.compile(r"kernel_meta|kernel_\d+|kernels")  # "kernels": the format before kernel_<i>


def attach(node: onnx.NodeProto, compiled: CompiledKernel) -> None:
    """Set ``kernel_meta`` and ``kernel_0``, ``kernel_1``, ... on a fused node (docs/format.md),
    replacing any kernel attributes it had."""
    if node.overload and node.overload != compiled.spec.name:
        raise ValueError(f"node overload {node.overload!r} is not kernel {compiled.spec.name!r}")
    program = next((a.s.decode() for a in node.attribute if a.name == "program"), None)
    if program is not None and program != compiled.spec.program.to_text():
        raise ValueError(f"node {node.name!r}: its program is not the compiled kernel's")
    for attr in [a for a in node.attribute if _KERNEL_ATTR.fullmatch(a.name)]:
        node.attribute.remove(attr)
    node.attribute.append(onnx.helper.make_attribute("kernel_meta", compiled.kernel_meta_json()))
    for i, blob in enumerate(compiled.kernels()):
        node.attribute.append(onnx.helper.make_attribute(f"kernel_{i}", blob))
