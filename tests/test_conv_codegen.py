"""Generated FusedConv / FusedMaxPool Triton kernels against the numpy references of
tests/layer_ref.py, under ``TRITON_INTERPRET=1`` in one child process (this file run as a
script, so the interpreter setting never reaches the process where other tests compile
kernels), and their ahead-of-time compilation for sm_80 / sm_90 with no GPU.

The interpreter evaluates ``tl.dot`` in fp32, so the kernels' indexing, masking, epilogue
and pooling are checked to fp32 accuracy here (the cases use precision ieee); the TF32
rounding of tf32 kernels is checked in tests/test_conv_precision.py, TF32 numerics on the
GPU in tests/test_gpu_conv.py."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxfuse.codegen_conv import (
    ConvSpec,
    ConvVariant,
    MaxPoolSpec,
    PoolVariant,
    conv_param_names,
    generate_conv,
    generate_maxpool,
)
from onnxfuse.compile import compile_kernels
from onnxfuse.expr import HEADER, evaluate, parse
from onnxfuse.kinds.conv import conv_variants
from onnxfuse.kinds.maxpool import pool_variants
from onnxfuse.layers import ConvAttrs, PoolAttrs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from layer_ref import conv2d, maxpool2d  # noqa: E402

from tests.util import interpreted_run  # noqa: E402

RELU = "%1 = max %0 0.0\noutput %1 {dt}"
RESIDUAL_RELU = "%2 = add %0 %1\n%3 = max %2 0.0\noutput %3 {dt}"
SILU = "%1 = sigmoid %0\n%2 = mul %0 %1\noutput %2 {dt}"
AFFINE = "%2 = mul %0 %1\n%3 = add %2 %1\n%4 = min %3 6.0\noutput %4 {dt}"


@dataclasses.dataclass(frozen=True)
class ConvCase:
    id: str
    n: int
    c: int
    hw: tuple[int, int]
    k: int
    conv: ConvAttrs
    pool: PoolAttrs | None = None
    body: str = RELU
    extras: tuple[str, ...] = ()  # "full", "channel" [1,K,1,1], "scalar" [1]
    dtype: str = "f32"
    tile: tuple[int, int, int] = (32, 16, 16)  # small tiles: many programs, ragged edges
    layouts: tuple[str, str] = ("nchw", "nchw")  # X, Y
    w_layout: str = "rsck"  # packed weights [R, S, C, K] or [K, R, S, C]
    flat: bool = False  # one flat reduction over (tap, channel)
    split: int = 0  # split K into this many slices (grid z; codegen_conv's module docstring)
    gemm: bool = False  # grouped convs: the block-diagonal GEMM instead of the direct loop


CONV_CASES = [
    ConvCase("3x3-pad1", 2, 3, (9, 11), 5, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1))),
    ConvCase("even-channels", 1, 32, (7, 6), 20, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1))),
    ConvCase("stride2-asym-dilated", 1, 20, (10, 7), 17, ConvAttrs((3, 2), (2, 1), (0, 1, 2, 0), (2, 1))),
    ConvCase("1x1", 3, 16, (5, 5), 8, ConvAttrs((1, 1))),
    ConvCase("7x7-s2-p3", 1, 3, (17, 15), 16, ConvAttrs((7, 7), (2, 2), (3, 3, 3, 3))),
    ConvCase("batch1-no-pad", 1, 5, (6, 9), 3, ConvAttrs((3, 3))),
    ConvCase("pool2x2", 2, 4, (8, 8), 6, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2))),
    ConvCase("pool2x2-odd", 2, 4, (9, 7), 6, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2))),
    ConvCase("pool3x3-padded-window", 1, 4, (9, 9), 6, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
             PoolAttrs((3, 3), (3, 3))),
    ConvCase("residual", 2, 4, (6, 5), 6, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=RESIDUAL_RELU,
             extras=("full",)),
    ConvCase("per-channel", 2, 4, (6, 5), 6, ConvAttrs((1, 1)), body=AFFINE, extras=("channel",)),
    ConvCase("scalar-extra", 1, 4, (6, 5), 6, ConvAttrs((1, 1)), body=RESIDUAL_RELU, extras=("scalar",)),
    ConvCase("silu", 2, 8, (7, 7), 12, ConvAttrs((3, 3), (2, 2), (1, 1, 1, 1)), body=SILU),
    ConvCase("fp16", 2, 16, (7, 7), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), dtype="f16",
             pool=PoolAttrs((2, 2), (2, 2))),
    ConvCase("default-tiles", 2, 64, (12, 12), 64, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
             PoolAttrs((2, 2), (2, 2)), tile=(0, 0, 0)),
    ConvCase("nhwc", 2, 32, (9, 7), 24, ConvAttrs((3, 3), (2, 1), (1, 0, 1, 2)), body=RESIDUAL_RELU,
             extras=("full",), layouts=("nhwc", "nhwc")),
    ConvCase("nhwc-pool", 2, 16, (8, 9), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             layouts=("nhwc", "nhwc")),
    ConvCase("nchw-to-nhwc", 1, 3, (11, 10), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), layouts=("nchw", "nhwc")),
    ConvCase("nhwc-to-nchw", 1, 16, (6, 6), 8, ConvAttrs((1, 1)), body=AFFINE, extras=("channel",),
             layouts=("nhwc", "nchw")),
    ConvCase("nhwc-krsc-ragged-channels", 2, 20, (9, 7), 24, ConvAttrs((3, 3), (2, 1), (1, 0, 1, 2)),
             body=RESIDUAL_RELU, extras=("full",), layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("nhwc-krsc-pool", 2, 32, (8, 9), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("nchw-krsc-dilated", 1, 5, (10, 7), 17, ConvAttrs((3, 2), (2, 1), (0, 1, 2, 0), (2, 1)),
             w_layout="krsc"),
    ConvCase("flat-rgb-pool", 2, 3, (9, 10), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             flat=True),
    ConvCase("flat-7x7-s2-p3", 1, 3, (17, 15), 16, ConvAttrs((7, 7), (2, 2), (3, 3, 3, 3)), flat=True),
    ConvCase("flat-dilated-asym", 1, 5, (10, 7), 17, ConvAttrs((3, 2), (2, 1), (0, 1, 2, 0), (2, 1)), flat=True),
    ConvCase("flat-nhwc-krsc-residual", 2, 4, (6, 5), 6, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), body=RESIDUAL_RELU,
             extras=("full",), layouts=("nhwc", "nhwc"), w_layout="krsc", flat=True),
    ConvCase("flat-nchw-to-nhwc-krsc", 1, 3, (11, 10), 16, ConvAttrs((3, 3), (2, 2), (1, 1, 1, 1)),
             layouts=("nchw", "nhwc"), w_layout="krsc", flat=True),
    ConvCase("flat-fp16", 2, 3, (7, 7), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), dtype="f16", flat=True),
    ConvCase("nhwc-krsc-fp16-pool", 2, 32, (8, 6), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
             PoolAttrs((2, 2), (2, 2)), dtype="f16", layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("nhwc-krsc-fp16-residual", 1, 16, (5, 7), 24, ConvAttrs((1, 1)), body=RESIDUAL_RELU, extras=("full",),
             dtype="f16", layouts=("nhwc", "nchw"), w_layout="krsc"),
    # grouped and depthwise convs: the direct loop
    ConvCase("depthwise-nhwc-krsc", 2, 24, (9, 7), 24, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=24),
             layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("depthwise-5x5-s2-asym-silu", 1, 20, (11, 10), 20, ConvAttrs((5, 5), (2, 2), (2, 1, 2, 2), group=20),
             body=SILU, layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("depthwise-nchw-rsck-dilated", 2, 6, (10, 9), 6, ConvAttrs((3, 3), (1, 2), (2, 2, 2, 2), (2, 2), group=6)),
    ConvCase("depthwise-multiplier3-residual", 1, 5, (8, 7), 15, ConvAttrs((3, 3), (2, 1), (1, 1, 1, 1), group=5),
             body=RESIDUAL_RELU, extras=("full",), layouts=("nhwc", "nchw"), w_layout="krsc"),
    ConvCase("grouped-cg3-kg2-pool", 2, 12, (8, 9), 8, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=4),
             PoolAttrs((2, 2), (2, 2)), layouts=("nhwc", "nhwc"), w_layout="krsc"),
    ConvCase("grouped-cg8-nchw-channel-extra", 1, 16, (6, 7), 8, ConvAttrs((3, 3), group=2), body=AFFINE,
             extras=("channel",), layouts=("nchw", "nhwc"), w_layout="rsck"),
    ConvCase("depthwise-fp16-nhwc", 2, 16, (7, 6), 16, ConvAttrs((3, 3), (2, 2), (1, 1, 1, 1), group=16),
             dtype="f16", layouts=("nhwc", "nhwc"), w_layout="krsc"),
    # split K: the reduction in slices, the last program to arrive runs the epilogue
    ConvCase("split3-nhwc-krsc-residual", 1, 40, (5, 6), 24, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
             body=RESIDUAL_RELU, extras=("full",), layouts=("nhwc", "nhwc"), w_layout="krsc", split=3),
    ConvCase("split9-nchw-rsck-silu-stride2", 2, 20, (9, 8), 17, ConvAttrs((3, 3), (2, 2), (1, 0, 1, 1)), body=SILU,
             split=9),
    ConvCase("split2-1x1-nhwc-to-nchw-channel-extra", 1, 64, (4, 5), 40, ConvAttrs((1, 1)), body=AFFINE,
             extras=("channel",), layouts=("nhwc", "nchw"), w_layout="krsc", split=2),
    ConvCase("split3-fp16-nhwc", 1, 48, (3, 3), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), dtype="f16",
             layouts=("nhwc", "nhwc"), w_layout="krsc", split=3),
    ConvCase("split2-flat", 1, 3, (6, 7), 16, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)), flat=True, split=2),
    ConvCase("depthwise-default-tiles", 2, 72, (9, 9), 72, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=72),
             layouts=("nhwc", "nhwc"), w_layout="krsc", tile=(0, 0, 0)),
    # grouped convs on the tensor cores: the block-diagonal GEMM
    ConvCase("group-gemm-two-groups-per-tile", 2, 32, (9, 7), 32, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=4),
             layouts=("nhwc", "nhwc"), w_layout="krsc", tile=(32, 16, 16), gemm=True),
    ConvCase("group-gemm-tile-inside-group-nchw-residual", 1, 64, (8, 9), 64,
             ConvAttrs((3, 3), (2, 2), (1, 0, 1, 1), group=2), body=RESIDUAL_RELU, extras=("full",),
             tile=(32, 16, 16), gemm=True),
    ConvCase("group-gemm-cg4-kg8-silu-pool", 2, 24, (8, 10), 48, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=6),
             PoolAttrs((2, 2), (2, 2)), body=SILU, layouts=("nhwc", "nhwc"), w_layout="krsc", tile=(32, 16, 16),
             gemm=True),
    ConvCase("group-gemm-partial-last-tile-dilated", 1, 12, (10, 9), 12,
             ConvAttrs((3, 3), (1, 2), (2, 2, 2, 2), (2, 2), group=3), layouts=("nhwc", "nchw"), w_layout="rsck",
             tile=(16, 16, 16), gemm=True),
    ConvCase("group-gemm-fp16-channel-extra", 2, 32, (7, 6), 32, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1), group=2),
             body=AFFINE, extras=("channel",), dtype="f16", layouts=("nhwc", "nhwc"), w_layout="krsc",
             tile=(32, 16, 16), gemm=True),
]


@dataclasses.dataclass(frozen=True)
class PoolCase:
    id: str
    shape: tuple[int, int, int, int]
    pool: PoolAttrs
    body: str = RELU
    extras: tuple[str, ...] = ()
    dtype: str = "f32"
    # the kernel: "flat", "rows" (tiling pools), "nhwc" (channels-last X) with small blocks
    # (many programs, ragged edges), or "default" (kinds.maxpool.pool_variants' choice)
    tile: str = "flat"
    layouts: tuple[str, str] = ("nchw", "nchw")  # X, Y


POOL_CASES = [
    PoolCase("2x2", (2, 3, 8, 8), PoolAttrs((2, 2), (2, 2))),
    PoolCase("2x2-odd", (2, 3, 9, 7), PoolAttrs((2, 2), (2, 2))),
    PoolCase("3x3-s2-p1", (2, 3, 9, 9), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1))),
    PoolCase("ceil-padded", (1, 2, 10, 9), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True)),
    PoolCase("asym-pads-dilated-ceil", (1, 3, 11, 9), PoolAttrs((2, 3), (2, 2), (0, 1, 1, 0), (2, 1), True)),
    PoolCase("residual-prologue", (2, 3, 6, 6), PoolAttrs((2, 2), (2, 2)), RESIDUAL_RELU, ("full",)),
    PoolCase("fp16", (2, 3, 8, 8), PoolAttrs((2, 2), (2, 2)), dtype="f16"),
    # the "rows" kernel: N*C = 15 planes, H and W not multiples of the windows or blocks
    PoolCase("rows-2x2-odd", (3, 5, 13, 11), PoolAttrs((2, 2), (2, 2)), tile="rows"),
    PoolCase("rows-3x3-s3-padded-columns", (2, 3, 11, 14), PoolAttrs((3, 3), (3, 3)), tile="rows"),
    PoolCase("rows-2x3-s2x3", (1, 7, 9, 17), PoolAttrs((2, 3), (2, 3)), tile="rows"),
    PoolCase("rows-fp16-prologue", (2, 5, 9, 10), PoolAttrs((2, 2), (2, 2)), AFFINE, ("channel",), "f16", "rows"),
    PoolCase("rows-residual-prologue", (3, 3, 7, 9), PoolAttrs((2, 2), (2, 2)), RESIDUAL_RELU, ("full",),
             tile="rows"),
    PoolCase("rows-default-blocks", (2, 3, 20, 150), PoolAttrs((2, 2), (2, 2)), tile="default"),
    # the "nhwc" kernel: C = 5 or 6 against BLOCK_C 4
    PoolCase("nhwc-3x3-s2-p1", (2, 6, 9, 11), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), tile="nhwc",
             layouts=("nhwc", "nhwc")),
    PoolCase("nhwc-5x5-s1-p2", (1, 5, 8, 7), PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), tile="nhwc",
             layouts=("nhwc", "nhwc")),
    PoolCase("nhwc-ceil-padded", (1, 5, 10, 9), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True), tile="nhwc",
             layouts=("nhwc", "nhwc")),
    PoolCase("nhwc-asym-pads-dilated-ceil", (2, 6, 11, 9), PoolAttrs((2, 3), (2, 2), (0, 1, 1, 0), (2, 1), True),
             tile="nhwc", layouts=("nhwc", "nhwc")),
    PoolCase("nhwc-to-nchw-residual", (2, 5, 7, 6), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), RESIDUAL_RELU,
             ("full",), tile="nhwc", layouts=("nhwc", "nchw")),
    PoolCase("nhwc-fp16-channel-extra", (2, 6, 8, 9), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), AFFINE, ("channel",),
             "f16", "nhwc", ("nhwc", "nhwc")),
    PoolCase("nhwc-default-blocks", (2, 70, 9, 9), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), tile="default",
             layouts=("nhwc", "nhwc")),
]


def _pool_spec(i: int, case: PoolCase) -> tuple[MaxPoolSpec, PoolVariant]:
    prog = _program(case.body, case.dtype, len(case.extras))
    spec = MaxPoolSpec(f"k_pool_{i}", prog, case.pool, x_layout=case.layouts[0], y_layout=case.layouts[1])
    variant = {"flat": PoolVariant(0, 64, 4), "rows": PoolVariant(0, 0, 4, "rows", block_oh=2, block_ow=4),
               "nhwc": PoolVariant(0, 0, 4, "nhwc", block_p=8, block_c=4)}.get(case.tile)
    return spec, variant or pool_variants(spec)[0]


def _program(body: str, dtype: str, n_extras: int):
    lines = [HEADER, f"input %0 {dtype}"] + [f"input %{i + 1} f32" for i in range(n_extras)]
    text = "\n".join(lines) + "\n" + body.replace("{dt}", dtype)
    return parse(text + "\n")


def _conv_program(case: ConvCase):
    return _program(case.body, case.dtype, len(case.extras))


def _extra_shape(kind: str, full: tuple[int, ...]) -> tuple[int, ...]:
    return {"full": full, "channel": (1, full[1], 1, 1), "scalar": (1,)}[kind]


def _np_dtype(dt: str):
    return np.float16 if dt == "f16" else np.float32


def _conv_inputs(i: int, case: ConvCase):
    rng = np.random.default_rng(1000 + i)
    h, w = case.hw
    x = rng.standard_normal((case.n, case.c, h, w)).astype(_np_dtype(case.dtype))
    cg = case.c // case.conv.group
    wt = (rng.standard_normal((case.k, cg) + case.conv.kernel) / np.sqrt(cg * 9)).astype(x.dtype)
    b = rng.standard_normal(case.k).astype(x.dtype)
    p, q = case.conv.out_size(h, w)
    extras = [rng.standard_normal(_extra_shape(e, (case.n, case.k, p, q))).astype(np.float32) for e in case.extras]
    return x, wt, b, extras


def _conv_spec(i: int, case: ConvCase) -> tuple[ConvSpec, ConvVariant]:
    spec = ConvSpec(f"k_conv_{i}", _conv_program(case), case.c, case.k, case.conv, case.pool, "ieee",
                    x_layout=case.layouts[0], y_layout=case.layouts[1], w_layout=case.w_layout)
    if case.tile == (0, 0, 0):
        return spec, conv_variants(spec)[0]
    bm, bn, bk = case.tile
    if case.pool is not None:
        bm = max(bm, 16)
    return spec, ConvVariant(0, bm, bn, bk, 2, 2, flat=case.flat, split=case.split, group_gemm=case.gemm)


def _conv_reference(case: ConvCase, x, wt, b, extras) -> np.ndarray:
    y = conv2d(x, wt, b, case.conv).astype(x.dtype)
    (z,) = evaluate(_conv_program(case), [y, *extras])
    return z if case.pool is None else maxpool2d(z, case.pool)


def _pool_inputs(i: int, case: PoolCase):
    rng = np.random.default_rng(2000 + i)
    x = rng.standard_normal(case.shape).astype(_np_dtype(case.dtype))
    return x, [rng.standard_normal(_extra_shape(e, case.shape)).astype(np.float32) for e in case.extras]


def _pool_reference(case: PoolCase, x, extras) -> np.ndarray:
    (z,) = evaluate(_program(case.body, case.dtype, len(case.extras)), [x, *extras])
    return maxpool2d(z, case.pool)


# ---------------------------------------------------------------------------------------
# the child process: run every kernel under the interpreter
# ---------------------------------------------------------------------------------------


def _broadcast_strides(shape: tuple[int, ...], full: tuple[int, ...]) -> list[int]:
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc if d != 1 else 0)
        acc *= d
    return list(reversed(strides))


def _load_kernel(workdir: Path, source: str, name: str):
    """The jit function `name` of a generated module, written under workdir and imported
    (as benchmarks/conv_kernels.py loads its kernels)."""
    from benchmarks.conv_kernels import _load

    return _load(source, name, workdir)


def _launch_conv(fn, ks, v: ConvVariant, case: ConvCase, x, wt, b, extras) -> np.ndarray:
    """Run a generated conv kernel on numpy inputs (wt [K, C/group, R, S], packed here) with
    the grid, strides and split-K buffers the C++ launcher would pass; returns Y as NCHW fp32."""
    import torch

    n, _, h, w = x.shape
    p, q = case.conv.out_size(h, w)
    op, oq = case.pool.out_size(p, q) if case.pool else (p, q)
    y = torch.empty((n, case.k, op, oq), dtype=torch.float16 if case.dtype == "f16" else torch.float32)
    if case.layouts[1] == "nhwc":  # the same logical tensor, stored channels last
        y = y.to(memory_format=torch.channels_last)
    strides = [s for e in extras for s in _broadcast_strides(e.shape, (n, case.k, p, q))]
    win = 1 << (case.pool.kernel[0] * case.pool.kernel[1] - 1).bit_length() if case.pool else 1
    m = n * op * oq * win if case.pool else n * p * q
    grid = (-(-m // v.block_m), -(-case.k // v.block_n))
    split = []  # split K: the workspace and zeroed counters the launcher provides
    if v.split > 1:
        tiles = grid[0] * grid[1]
        split = [torch.full((v.split * tiles * v.block_m * v.block_n,), float("nan")),
                 torch.zeros(tiles, dtype=torch.int32)]
        grid = (*grid, v.split)
    packed = torch.from_numpy(np.ascontiguousarray(
        wt.transpose(2, 3, 1, 0) if case.w_layout == "rsck" else wt.transpose(0, 2, 3, 1)))
    xt = torch.from_numpy(x)
    if case.layouts[0] == "nhwc":
        xt = xt.to(memory_format=torch.channels_last)
    fn[grid](xt, packed, torch.from_numpy(b), *map(torch.from_numpy, extras), y,
             n, h, w, p, q, op, oq, *strides, *split, **dict(ks.constexprs))
    return y.float().numpy()


def _launch_pool(fn, ks, v: PoolVariant, case: PoolCase, x, extras) -> np.ndarray:
    """Run a generated pool kernel on numpy inputs (x NCHW) with the grid and strides the C++
    launcher would pass; returns Y as NCHW fp32."""
    import torch

    n, c, h, w = x.shape
    oh, ow = case.pool.out_size(h, w)
    y = torch.empty((n, c, oh, ow), dtype=torch.float16 if case.dtype == "f16" else torch.float32)
    xt = torch.from_numpy(x)
    if case.layouts[0] == "nhwc":  # the same logical tensors, stored channels last
        xt = xt.to(memory_format=torch.channels_last)
    if case.layouts[1] == "nhwc":
        y = y.to(memory_format=torch.channels_last)
    strides = [s for e in extras for s in _broadcast_strides(e.shape, x.shape)]
    # the grid the C++ launcher computes for the variant (PoolVariant.grid)
    fn[v.grid(n, c, oh, ow)](xt, *map(torch.from_numpy, extras), y, n, c, h, w, oh, ow, *strides,
                             **dict(ks.constexprs))
    return y.float().numpy()


def _run_all(workdir: Path) -> None:
    results = {}
    for i, case in enumerate(CONV_CASES):
        try:
            spec, v = _conv_spec(i, case)
            ks = generate_conv(spec, v)
            fn = _load_kernel(workdir, ks.source, spec.name)
            x, wt, b, extras = _conv_inputs(i, case)
            results[f"conv{i}"] = _launch_conv(fn, ks, v, case, x, wt, b, extras)
        except Exception as e:  # reported by the case's test
            (workdir / f"conv{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    for i, case in enumerate(POOL_CASES):
        try:
            spec, v = _pool_spec(i, case)
            ks = generate_maxpool(spec, v)
            fn = _load_kernel(workdir, ks.source, spec.name)
            x, extras = _pool_inputs(i, case)
            results[f"pool{i}"] = _launch_pool(fn, ks, v, case, x, extras)
        except Exception as e:
            (workdir / f"pool{i}_error.txt").write_text(f"{type(e).__name__}: {e}")
    np.savez(workdir / "out.npz", **results)


@pytest.fixture(scope="module")
def interpreted():
    with interpreted_run(__file__, "onnxfuse-conv-interp-") as workdir:
        yield workdir


def _check(workdir: Path, key: str, want: np.ndarray, dtype: str) -> None:
    err = workdir / f"{key}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    got = np.load(workdir / "out.npz")[key]
    want = want.astype(np.float32)
    assert got.shape == want.shape
    scale = float(np.abs(want).max()) or 1.0
    # fp32: the kernel sums in another order than the float64 reference
    rtol, atol = (1e-2, 1e-2 * scale) if dtype == "f16" else (1e-5, 1e-5 * scale)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("index", range(len(CONV_CASES)), ids=[c.id for c in CONV_CASES])
def test_conv_kernel_matches_reference(interpreted, index):
    case = CONV_CASES[index]
    x, wt, b, extras = _conv_inputs(index, case)
    _check(interpreted, f"conv{index}", _conv_reference(case, x, wt, b, extras), case.dtype)


@pytest.mark.parametrize("index", range(len(POOL_CASES)), ids=[c.id for c in POOL_CASES])
def test_maxpool_kernel_matches_reference(interpreted, index):
    case = POOL_CASES[index]
    x, extras = _pool_inputs(index, case)
    _check(interpreted, f"pool{index}", _pool_reference(case, x, extras), case.dtype)


# ---------------------------------------------------------------------------------------
# source and compile-time checks
# ---------------------------------------------------------------------------------------


def test_source_is_deterministic_and_names_its_nodes():
    spec, v = _conv_spec(0, CONV_CASES[0])
    spec = dataclasses.replace(spec, source_nodes=("Conv conv1", "Relu relu1"))
    a, b = generate_conv(spec, v), generate_conv(spec, v)
    assert a.source == b.source
    assert "#   Conv conv1" in a.source and "#   Relu relu1" in a.source
    assert [p for p, _ in a.params] == conv_param_names(0)


def test_rejected_specs():
    spec, v = _conv_spec(0, CONV_CASES[0])
    with pytest.raises(ValueError, match="does not divide"):
        generate_conv(dataclasses.replace(spec, conv=ConvAttrs((3, 3), group=2)), v)  # C = 3
    with pytest.raises(ValueError, match="flat reduction is for group 1"):
        generate_conv(dataclasses.replace(spec, channels=5, filters=5, conv=ConvAttrs((3, 3), group=5)),
                      dataclasses.replace(v, flat=True))
    with pytest.raises(ValueError, match="tile"):
        generate_conv(dataclasses.replace(spec, pool=PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1))), v)
    with pytest.raises(ValueError, match="precision"):
        generate_conv(dataclasses.replace(spec, precision="fast"), v)


def test_aot_compile_for_sm80_and_sm90(tmp_path):
    pytest.importorskip("triton")
    case = next(c for c in CONV_CASES if c.id == "default-tiles")
    conv = ConvSpec("onnxfuse_conv_relu_maxpool_0123456789ab", _conv_program(case), 64, 64, case.conv, case.pool)
    pool = MaxPoolSpec("onnxfuse_relu_maxpool_0123456789ab", _program(RELU, "f32", 0), PoolAttrs((3, 3), (2, 2)))
    out = compile_kernels([conv, pool], [80, 90], cache_dir=tmp_path, jobs=2)
    meta = out[0].kernel_meta()
    assert meta["kind"] == "conv" and meta["pool_in_epilogue"] == [2, 2] and meta["n_extras"] == 0
    assert meta["variants"][0]["requires"] == {"max_elements": 2**31 - 1, "ptr_align": 16}
    formats = [(b["arch"], b["format"]) for b in meta["binaries"]]
    # the conv's sm_90a PTX uses wgmma, so the portable PTX is sm_80's
    assert formats == [(80, "cubin"), (90, "cubin"), (80, "ptx")]
    assert all(b["global_scratch_size"] == 0 and b["shared"] <= 227 * 1024 for b in meta["binaries"])
    ptx = out[0].kernels()[2].decode()
    assert ".target sm_80" in ptx
    pmeta = out[1].kernel_meta()
    assert pmeta["kind"] == "maxpool" and [b["format"] for b in pmeta["binaries"]] == ["cubin", "cubin", "ptx"]
    again = compile_kernels([conv, pool], [80, 90], cache_dir=tmp_path)
    assert again[0].cache_hits == 2 and again[0].compiled == 0
    assert json.dumps(again[0].kernel_meta()) == json.dumps(meta)


def _split_spec(c: int, k: int, kernel: int, pool: PoolAttrs | None = None, group: int = 1) -> ConvSpec:
    pad = (kernel // 2,) * 4
    return ConvSpec("onnxfuse_conv_relu_0123456789ab", _program(SILU, "f32", 0), c, k,
                    ConvAttrs((kernel, kernel), (1, 1), pad, group=group), pool, "tf32",
                    x_layout="nhwc", y_layout="nhwc", w_layout="krsc")


def test_split_k_variant_choice():
    # YOLOv8n's head at 320²: 256 -> 64 channels 3x3, 72 steps of 32 channels: 12 slices of 6
    plain, split, _small = conv_variants(_split_spec(256, 64, 3))
    assert (plain.index, plain.split, split.index, split.split) == (0, 0, 1, 12)
    assert split.block_m == 64 and (split.block_n, split.block_k) == (plain.block_n, plain.block_k)
    # 1x1 over 512 channels: 16 steps, 4 slices of 4; over 64 channels: 2 steps, no split
    assert conv_variants(_split_spec(512, 256, 1))[1].split == 4
    assert [v.split for v in conv_variants(_split_spec(64, 64, 1))] == [0, 0]  # plain, small-M
    # no split (nor small-M variant) with a pool in the epilogue or for grouped convs
    assert len(conv_variants(_split_spec(256, 64, 3, PoolAttrs((2, 2), (2, 2))))) == 1
    assert len(conv_variants(_split_spec(256, 256, 3, group=256))) == 1
    spec = _split_spec(256, 64, 3)
    with pytest.raises(ValueError, match="does not divide"):
        generate_conv(spec, dataclasses.replace(split, split=5))
    with pytest.raises(ValueError, match="split K is for"):
        generate_conv(dataclasses.replace(spec, pool=PoolAttrs((2, 2), (2, 2))), split)
    ks = generate_conv(spec, split)
    names = [p for p, _ in ks.params]
    assert names[-2:] == ["ws_ptr", "cnt_ptr"] and names.index("ws_ptr") in ks.divisible
    assert dict(ks.constexprs)["SPLIT"] == 12 and dict(ks.constexprs)["SPLIT_STEPS"] == 6
    assert "ws_ptr" not in [p for p, _ in generate_conv(spec, plain).params]


def test_grouped_loop_choice():
    """Grouped convs take the block-diagonal GEMM where a tile fits and the group is at least
    4 channels wide; depthwise convs, narrow or odd groups and "ieee" keep the direct loop."""
    def plain(c, k, group, precision="tf32", dtype="f32"):
        spec = dataclasses.replace(_split_spec(c, k, 3, group=group), precision=precision)
        if dtype == "f16":
            spec = dataclasses.replace(spec, program=_program(SILU, "f16", 0))
        return conv_variants(spec)[0]

    v = plain(48, 48, 6)  # RegNetY-400MF: groups of 8: two groups per 16-column tile
    assert v.group_gemm and (v.block_n, v.block_k, v.num_warps) == (16, 16, 4)
    v = plain(256, 256, 4)  # groups of 64: 64-column tiles inside a group
    assert v.group_gemm and (v.block_n, v.block_k) == (64, 64)
    assert plain(96, 96, 2, dtype="f16").group_gemm  # 48 filters per group: 16-column tiles
    assert not plain(96, 96, 96).group_gemm  # depthwise
    assert not plain(48, 48, 24).group_gemm  # 2 channels per group
    assert not plain(72, 72, 3).group_gemm  # 24 filters per group: no tile of 16, 32 or 64 fits
    assert not plain(48, 48, 6, precision="ieee").group_gemm
    spec = _split_spec(48, 48, 3, group=6)
    src = generate_conv(spec, v := plain(48, 48, 6)).source
    assert 'input_precision="tf32"' in src and "b = round_to_tf32(b)" in src and "block-diagonal GEMM" in src
    assert "tl.static_range(GROUPS_PER_TILE)" in src  # two groups per tile: a dot each
    assert dict(generate_conv(spec, v).constexprs)["CI_SPAN"] == 16
    assert dict(generate_conv(spec, dataclasses.replace(v, block_n=64)).constexprs)["CI_SPAN"] == 64
    with pytest.raises(ValueError, match="block-diagonal GEMM needs"):
        generate_conv(_split_spec(72, 72, 3, group=3), dataclasses.replace(v, block_n=16))  # KG 24


def test_aot_compile_split_k_for_sm90(tmp_path):
    """The split-K kernel compiles ahead of time: its counter is one acquire-release atomic
    after a CTA barrier, and kernel_meta carries the slice count."""
    pytest.importorskip("triton")
    (out,) = compile_kernels([_split_spec(256, 64, 3)], [90], cache_dir=tmp_path, jobs=2)
    meta = out.kernel_meta()
    assert [v.get("split") for v in meta["variants"]] == [None, 12, None]  # then the small-M variant
    assert {(b["variant"], b["format"]) for b in meta["binaries"]} >= {(0, "cubin"), (1, "cubin")}
    ptx = next(d.decode() for b, d in zip(meta["binaries"], out.kernels(), strict=True)
               if b["variant"] == 1 and b["format"] == "ptx")
    assert "atom.global.gpu.acq_rel.add" in ptx and "bar.sync" in ptx and "ld.global.cg" in ptx


@pytest.mark.parametrize("pool,x_layout,tile", [
    (PoolAttrs((2, 2), (2, 2)), "nchw", "rows"),  # windows tile the input
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "nchw", "flat"),
    (PoolAttrs((2, 2), (2, 2), ceil_mode=True), "nchw", "flat"),  # ceil mode: not a tiling
    (PoolAttrs((2, 2), (2, 2)), "nhwc", "nhwc"),
])
def test_pool_kernel_choice(pool, x_layout, tile):
    spec = MaxPoolSpec("k", _program(RELU, "f32", 0), pool, x_layout=x_layout, y_layout=x_layout)
    variants = pool_variants(spec)
    v = variants[0]
    assert {u.tile for u in variants} == {tile}
    src = generate_maxpool(spec, v).source
    assert f"{tile} kernel" in src
    if tile == "rows":  # the per-element unravel is gone: divisions only of program ids
        assert "offs //" not in src and "offs %" not in src and "cols // KW_P" in src
    if tile in ("nhwc", "rows"):
        # first a binary for C (nhwc) or W (rows) % 16 == 0, compiled knowing it (and aligned
        # pointers), then any size
        dim = "C" if tile == "nhwc" else "W"
        assert [u.requires().get(f"{dim.lower()}_multiple") for u in variants] == [16, None]
        assert [u.index for u in variants] == [0, 1]
        ks = generate_maxpool(spec, v)
        names = [p for p, _ in ks.params]
        assert sorted(names[i] for i in ks.divisible) == [dim, "x_ptr", "y_ptr"]
        assert generate_maxpool(spec, variants[1]).divisible == ()
    else:
        assert len(variants) == 1 and v.requires() == {"max_elements": 2**31 - 1}


def test_rejected_pool_specs():
    spec = MaxPoolSpec("k", _program(RELU, "f32", 0), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)))
    with pytest.raises(ValueError, match="tile the input"):
        generate_maxpool(spec, PoolVariant(0, 0, 4, "rows", 4, 32))
    with pytest.raises(ValueError, match="channels-last X"):
        generate_maxpool(spec, PoolVariant(0, 0, 4, "nhwc", block_p=32, block_c=32))
    with pytest.raises(ValueError, match="reads and writes NCHW"):
        generate_maxpool(dataclasses.replace(spec, x_layout="nhwc", y_layout="nhwc"), PoolVariant(0, 256, 4))
    with pytest.raises(ValueError, match="powers of two"):
        generate_maxpool(dataclasses.replace(spec, pool=PoolAttrs((2, 2), (2, 2))), PoolVariant(0, 0, 4, "rows", 3, 32))
    with pytest.raises(ValueError, match="c_multiple"):
        generate_maxpool(spec, PoolVariant(0, 256, 4, c_multiple=16))
    with pytest.raises(ValueError, match="w_multiple"):
        generate_maxpool(spec, PoolVariant(0, 256, 4, w_multiple=16))


def test_aot_compile_pool_kernels_for_sm90(tmp_path):
    """The rows kernel (fp32 and fp16) and the channels-last kernel compile ahead of time;
    kernel_meta lists the variant's block keys and the layouts."""
    pytest.importorskip("triton")
    specs = [MaxPoolSpec(f"onnxfuse_relu_maxpool_{dt}0123456789", _program(RELU, dt, 0), PoolAttrs((2, 2), (2, 2)))
             for dt in ("f32", "f16")]
    specs.append(MaxPoolSpec("onnxfuse_maxpool_0123456789ab", _program(AFFINE, "f16", 1),
                             PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), x_layout="nhwc", y_layout="nhwc"))
    out = compile_kernels(specs, [90], cache_dir=tmp_path, jobs=2)
    metas = [o.kernel_meta() for o in out]
    assert [set(m["variants"][0]) for m in metas] == [{"requires", "block_oh", "block_ow"}] * 2 + [
        {"requires", "block_p", "block_c"}]
    assert "x_layout" not in metas[0] and (metas[2]["x_layout"], metas[2]["y_layout"]) == ("nhwc", "nhwc")
    assert all(m["binaries"] and all(b["global_scratch_size"] == 0 for b in m["binaries"]) for m in metas)
    # the channels-last pool: a variant for C % 16 == 0 whose loads along C vectorize, then
    # one for any C with scalar loads (4x the load instructions: pool_nhwc.json's 2.4x)
    assert [v["requires"].get("c_multiple") for v in metas[2]["variants"]] == [16, None]
    ptx = {b["variant"]: out[2].kernels()[i].decode() for i, b in enumerate(metas[2]["binaries"])
           if b["format"] == "ptx"}
    assert ptx[0].count("ld.global.v") > 0 and ptx[1].count("ld.global.v") == 0
    # the rows kernel (fp32 2x2): a variant for W % 16 == 0 whose window rows load 2 floats
    # at a time, then one for any W
    assert [v["requires"].get("w_multiple") for v in metas[0]["variants"]] == [16, None]
    ptx = {b["variant"]: out[0].kernels()[i].decode() for i, b in enumerate(metas[0]["binaries"])
           if b["format"] == "ptx"}
    assert ptx[0].count("ld.global.v") > 0 and ptx[1].count("ld.global.v") == 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_gpu_max_semantics, _install_libdevice_shims

        _install_libdevice_shims()  # the interpreter has no libdevice (sigmoid uses exp)
        _install_gpu_max_semantics()  # max/min that drop NaN on the GPU drop it here too
        _run_all(Path(sys.argv[2]))


def _deep_conv_model(channels: int):
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((channels, channels, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "deep",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", channels, 14, 14])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", channels, 14, 14])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("channels,fuse_all,kept", [(256, False, False), (128, False, True), (256, True, True)])
def test_heuristic_leaves_deep_convs_to_cudnn(channels, fuse_all, kept, tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from onnxfuse.kinds.conv import DECLINED_REASON
    from onnxfuse.pipeline import compile_pass, optimize_model
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    if fuse_all:
        monkeypatch.setenv("ONNXFUSE_CONV_ALL", "1")
    r = optimize_model(_deep_conv_model(channels))
    assert len(r.fused) == 1
    info = compile_pass(r, kernel_options("sm_90")).report.compile
    ops = [n.op_type for n in r.model.graph.node]
    if kept:
        assert ops == ["FusedConv"] and not info["declined"]
    else:
        assert ops == ["Conv", "Relu"] and len(info["declined"]) == 1
        assert r.report.not_fused == {DECLINED_REASON: 2} and r.report.patterns_applied == {}
        assert "left to cuDNN" in info["summary"]


def test_heuristic_deep_convs_stay_fused_under_nhwc(tmp_path, monkeypatch):
    """The channels-last kernels matched cuDNN's channels-last convs on deep layers: the NHWC
    path declines nothing."""
    pytest.importorskip("triton")
    from onnxfuse.pipeline import compile_pass, optimize_model
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    r = optimize_model(_deep_conv_model(256))
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert [n.op_type for n in r.model.graph.node] == ["Transpose", "FusedConv"] and not info["declined"]


@pytest.mark.parametrize("channels,x_layout,w_layout,want", [
    (3, "nchw", "rsck", (128, 64, 32, 4, 2, True)),  # an image: the flat reduction
    (3, "nchw", "krsc", (128, 64, 32, 4, 2, True)),
    (64, "nhwc", "krsc", (128, 64, 32, 4, 3, False)),  # channels last: wgmma tiles
    (64, "nchw", "rsck", (64, 64, 32, 2, 3, False)),  # NCHW: 2-warp mma tiles
])
def test_conv_tile_heuristic(channels, x_layout, w_layout, want):
    spec = ConvSpec("k", _program(RELU, "f32", 0), channels, 64, ConvAttrs((3, 3), (1, 1), (1, 1, 1, 1)),
                    x_layout=x_layout, w_layout=w_layout)
    v = conv_variants(spec)[0]
    assert (v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages, v.flat) == want
