"""The maxpool kind: pointwise ops and the 2-D MaxPool that reads their one result (or a
MaxPool alone) become one FusedMaxPool node (docs/format.md, "FusedMaxPool"); its kernels are
codegen_conv's flat, rows and nhwc pool kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
from onnx import ModelProto, NodeProto, helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_conv import MaxPoolSpec, PoolVariant, generate_maxpool
from onnxfuse.expr import Program, evaluate
from onnxfuse.kinds.base import META_VERSION, Kind, env_config, layout_attr
from onnxfuse.layers import pool_from_fused
from onnxfuse.reference import maxpool2d
from onnxfuse.rewrite import FusedNode


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
    env_config("ONNXFUSE_POOL_CONFIG", cfg, ("tile", "block", "block_oh", "block_ow", "block_p", "block_c", "warps"))
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


def pool_candidates(spec: MaxPoolSpec) -> list[tuple[str, tuple]]:
    """(label, variants) per configuration `--tune` times: the kernel the heuristics pick,
    then its sweep's runners-up, each as it ships (`with_size_variants`)."""
    base = pool_variants(spec)[-1]  # the heuristic's tile for any size
    if base.tile == "nhwc":  # pool_nhwc_aot.json
        tiles = [dataclasses.replace(base, block_p=p, block_c=c, num_warps=w)
                 for p, c, w in ((4, 64, 1), (2, 64, 1), (8, 64, 1), (2, 128, 1), (4, 128, 2), (32, 64, 4))]
        label = "tile {0.block_p}x{0.block_c}, {0.num_warps} warps, nhwc"
    elif base.tile == "rows":  # relu_maxpool_tiles.json
        tiles = [dataclasses.replace(base, block_oh=h, block_ow=w, num_warps=nw)
                 for h, w, nw in ((4, 64, 4), (8, 64, 4), (8, 32, 4), (16, 64, 8))]
        label = "tile {0.block_oh}x{0.block_ow}, {0.num_warps} warps, rows"
    else:
        tiles = [dataclasses.replace(base, block=b, num_warps=4) for b in (256, 512, 1024)]
        label = "block {0.block}"
    tiles = [base] + [t for t in tiles if t != base]
    return [(label.format(t), with_size_variants(spec, t)) for t in tiles]  # each as it ships


class MaxPool(Kind):
    name = "maxpool"
    op_type = "FusedMaxPool"

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> MaxPoolSpec:
        return MaxPoolSpec(f.kernel_name, f.program, pool=f.pool, source_nodes=f.source_nodes,
                           x_layout=f.x_layout, y_layout=f.y_layout)

    def variants(self, spec: MaxPoolSpec) -> tuple[PoolVariant, ...]:
        return pool_variants(spec)

    def generate(self, spec: MaxPoolSpec, variant: PoolVariant) -> KernelSource:
        return generate_maxpool(spec, variant)

    def kernel_meta(self, spec: MaxPoolSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION, "kind": "maxpool", "name": spec.name, "n_extras": spec.n_extras,
            **({"x_layout": spec.x_layout, "y_layout": spec.y_layout}
               if (spec.x_layout, spec.y_layout) != ("nchw", "nchw") else {}),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def candidates(self, spec: MaxPoolSpec) -> list[tuple[str, tuple]]:
        return pool_candidates(spec)

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Honours x_layout and y_layout: the program sees NCHW values, extras broadcast to
        X's logical [N, C, H, W]."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        program = Program.from_text(attrs["program"].decode())
        x, *extras = inputs
        if layout_attr(attrs, "x_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC":
            x = x.transpose(0, 3, 1, 2)
        (z,) = evaluate(program, [x, *extras])
        z = maxpool2d(z, pool_from_fused(attrs))
        nhwc = layout_attr(attrs, "y_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC"
        return [np.ascontiguousarray(z.transpose(0, 2, 3, 1)) if nhwc else z]
