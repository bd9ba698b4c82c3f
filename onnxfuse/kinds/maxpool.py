"""The maxpool kind: pointwise ops and the 2-D MaxPool that reads their one result (or a
MaxPool alone) become one FusedMaxPool node (docs/format.md, "FusedMaxPool"); its kernels are
codegen_conv's flat, rows and nhwc pool kernels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_conv import MaxPoolSpec, PoolVariant, generate_maxpool
from onnxfuse.expr import Program, Ref, evaluate
from onnxfuse.graph import GraphView
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
    xy_layout_meta,
)
from onnxfuse.layers import pool_from_fused, pool_from_node
from onnxfuse.match import (
    DTYPE_IDS,
    broadcasts_to,
    dtype_reason,
    grow_prologue,
    match_anchored,
    operands,
    pointwise_candidate,
    prologue_inputs,
    readers_outside,
)
from onnxfuse.reference import maxpool2d
from onnxfuse.rewrite import input_mode, lower_group


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


@dataclass(frozen=True)
class MaxPoolParams:
    """Match a 2-D MaxPool and the pointwise group whose one result it reads."""

    ops: frozenset[str]  # op types allowed in the prologue
    dtypes: frozenset[str]
    min_nodes: int

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"MaxPool"}


# ---------------------------------------------------------------------------------------
# matching: a MaxPool and its prologue
# ---------------------------------------------------------------------------------------

def _pool_match(view: GraphView, pi: int, pattern: Pattern, taken: set[int], accepted: Accepted) -> Match | str:
    """The pool_prologue match anchored at MaxPool node pi, or why there is none."""
    m: MaxPoolParams = pattern.match
    n = view.nodes[pi]
    x = n.input[0]
    x_shape = view.shapes.get(x)
    if x_shape is None:
        return "unknown shape"
    if len(x_shape) != 4:
        return f"{len(x_shape) - 2}-D max pool"
    if view.types.get(x) not in {DTYPE_IDS[d] for d in m.dtypes}:
        return dtype_reason(view.types.get(x))
    if not isinstance(x_shape[1], int):
        return "unknown number of channels"
    attrs = pool_from_node(n, x_shape[2:] if all(isinstance(d, int) for d in x_shape[2:]) else None)
    if isinstance(attrs, str):
        return attrs
    p = view.producer.get(x)
    prologue = p is not None and p not in accepted.owner and pointwise_candidate(view, p, pattern, taken) \
        and not readers_outside(view, x, {pi})
    if not prologue and m.min_nodes == 0:  # the max pool alone: the identity program on X
        return _lone_pool_match(view, pi, pattern, attrs, x)
    if p is not None and p in accepted.owner:
        return "its input is computed by another fused node"
    if p is None or not pointwise_candidate(view, p, pattern, taken):
        return "no pointwise op before the max pool"
    if readers_outside(view, x, {pi}):
        return "max pool input is also read elsewhere"
    group = grow_prologue(view, p, pattern, taken)
    while True:  # only x may leave: drop members read outside, with their in-group producers
        members = group | {pi}
        leaving = {i for i in group if i != p and readers_outside(view, view.nodes[i].output[0], members)}
        if not leaving:
            break
        stack = list(leaving)
        while stack:
            i = stack.pop()
            if i in group:
                group.discard(i)
                stack += [view.producer[name] for _, name in operands(view, i) if view.producer.get(name) in group]
    if len(group) < m.min_nodes:
        return "too few pointwise ops before the max pool"
    ordered = sorted(group)
    inputs = prologue_inputs(view, ordered)
    first = next((a for a in inputs if view.rank(a) == 4 and view.types.get(a) != 9
                  and all(b == a or broadcasts_to(view.shapes.get(b), view.shapes[a]) for b in inputs)), None)
    if first is None or view.shapes[first][1] != x_shape[1]:
        return "no prologue input has the max pool input's shape"
    nodes = sorted(group | {pi})
    if reentering(view, nodes, accepted):
        return "fusing would create a cycle"
    if view.types.get(n.output[0]) is None:
        return "unknown dtype"
    return Match(pattern, tuple(nodes), (n.output[0],), pool=pi, pointwise=tuple(ordered),
                 pool_attrs=attrs, first_input=first, result=x)


def _lone_pool_match(view: GraphView, pi: int, pattern: Pattern, attrs, x: str) -> Match | str:
    """A MaxPool with no fusible prologue (pattern min_nodes 0): program %0 -> %0."""
    n = view.nodes[pi]
    if view.types.get(n.output[0]) is None:
        return "unknown dtype"
    return Match(pattern, (pi,), (n.output[0],), pool=pi, pointwise=(), pool_attrs=attrs, first_input=x, result=x)


def _relu_at_most(n: NodeProto) -> bool:
    """The FusedMaxPool's prologue program has one float32 input and at most max(x, 0.0) /
    min(x, 0.0) steps, which keep TF32 values TF32 (and NaN NaN), with a float32 output."""
    text = next((a.s.decode() for a in n.attribute if a.name == "program"), None)
    if text is None:
        return False
    prog = Program.from_text(text)
    return (prog.input_dtypes == ("f32",) and all(d == "f32" for _, d in prog.outputs)
            and all(ins.op in ("max", "min") and 0.0 in ins.args and all(
                isinstance(a, Ref) or a == 0.0 for a in ins.args) for ins in prog.instrs))


class MaxPool(Kind):
    """A match is a 2-D MaxPool and the pointwise group whose one result only it reads (with
    min_nodes 0, a MaxPool alone too). Each MaxPool that does not fuse is reported with the
    reason."""

    name = "maxpool"
    op_type = "FusedMaxPool"
    match_kind = "pool_prologue"
    params = frozenset({"min_nodes"})
    # a pool runs NHWC in and out or not at all; its prologue's extras stay NCHW
    layouts = NodeLayouts(y_follows_x=True)

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> MaxPoolParams:
        """min_nodes (default 1; 0: a MaxPool alone matches too)."""
        min_nodes = m.get("min_nodes", int, 1)
        if min_nodes < 0:
            m.fail("match.min_nodes", "must be at least 0")
        for dt in sorted(dtypes):
            if dt not in ("float32", "float16"):
                m.fail("match.dtypes", f"{dt!r}: max pools are fused for float32 and float16 only")
        return MaxPoolParams(ops, dtypes, min_nodes)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_anchored(view, pattern, taken, accepted, "MaxPool", _pool_match)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        """Inputs [X, extras...]; the body is the prologue and the MaxPool (docs/format.md,
        "FusedMaxPool")."""
        program, inputs, folded = lower_group(view, match.pointwise, (match.result,), first=match.first_input)
        shape = view.shapes[match.result]
        modes = ("full", *(input_mode(view, x, shape) for x in inputs[1:]))
        body = [view.nodes[i] for i in match.pointwise] + [view.nodes[match.pool]]
        channels = view.shapes[match.first_input][1]
        return Lowering(program, folded, inputs, body, match.pool_attrs.node_attrs(),
                        f"maxpool C={channels} {match.pool_attrs}", len(shape), modes, {"pool": match.pool_attrs})

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
            **xy_layout_meta(spec.x_layout, spec.y_layout),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def candidates(self, spec: MaxPoolSpec) -> list[tuple[str, tuple]]:
        return pool_candidates(spec)

    def moves_values(self, node: NodeProto, i: int) -> bool:
        """X's values (input 0) when its prologue is at most a Relu (`_relu_at_most`)."""
        return i == 0 and _relu_at_most(node)

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
