"""The squeeze_excite kind: the squeeze path of a squeeze-and-excitation block,
GlobalAveragePool → 1x1 Conv → activation → 1x1 Conv → gate, becomes one FusedSqueezeExcite
node (docs/format.md, "FusedSqueezeExcite"); its kernel is codegen_squeeze's.

Exporters write the block the same way (torchvision's SqueezeExcitation in EfficientNet,
MobileNetV3 and RegNetY; timm; Paddle's PP-LCNet): the pool, a Conv with bias to C / r
channels, an activation (Relu, SiLU as x·Sigmoid(x), HardSwish), a Conv back to C channels,
a gate (Sigmoid, HardSigmoid, or Clip / Div forms), then Mul(X, gate), which stays outside:
it is a pointwise op over X that other fusions may take. At batch 1 the original's five or
more kernels cost 15-40 µs per block on the H200, the pool alone 3-29 µs (BENCHMARKS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_squeeze import (
    SqueezeSpec,
    SqueezeVariant,
    generate_squeeze,
    squeeze_candidates,
    squeeze_variants,
)
from onnxfuse.expr import Program, evaluate
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
    layout_attr,
    xy_layout_meta,
)
from onnxfuse.layers import conv_from_node
from onnxfuse.match import DTYPE_IDS, dtype_reason, grow_epilogue, match_anchored, operands, single_result
from onnxfuse.rewrite import lower_group, unique_name

# Fused only where tuning measures the node faster than the original's kernels: on the H200
# (sixteenth session, batch 1) it beat them on MobileNetV3-small's small blocks (4-6 µs against
# 10 or more) and lost on wide ones (576 -> 144 -> 576: 53 µs against 17.6) and at large images
# (PP-OCRv4 det's: up to 62 µs). $ONNXFUSE_SQUEEZE_ALL=1 fuses every block (tests).
UNTUNED = ("squeeze-excite blocks: fused only where tuning measures the fused node faster than ONNX Runtime's "
           "kernels for them (not tuned: no GPU, or --no-tune)")


@dataclass(frozen=True)
class SqueezeParams:
    """Match a GlobalAveragePool whose one reader is the first of two 1x1 Convs, with the
    pointwise ops between them (the activation) and after the second (the gate)."""

    ops: frozenset[str]  # op types allowed in the activation and the gate
    dtypes: frozenset[str]

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"GlobalAveragePool", "Conv"}


@dataclass(frozen=True)
class SqueezeParts:
    """What a match hands its lowering (Match.params)."""

    pool: int
    fc1: int
    bias1: int | None  # an Add of a per-channel constant right after FC1: its bias, as Paddle writes it
    act: tuple[int, ...]  # the activation's nodes, topological order
    hidden: str  # the activation's result: FC2's input
    fc2: int
    bias2: int | None
    gate: tuple[int, ...]
    result: str  # the gate's result: the node's output


def _fc(view: GraphView, ci: int, x: str, c_in: int, dtype: int) -> int | str:
    """The output channels of Conv node ci as a fully connected layer on one pixel (1x1,
    group 1, no padding, constant weights [K, c_in, 1, 1] and bias of x's dtype), or why not."""
    n = view.nodes[ci]
    if n.op_type != "Conv" or n.domain not in ("", "ai.onnx") or n.input[0] != x:
        return "the pool's reader is not a Conv"
    w = view.constants.get(n.input[1])
    if w is None or w.data_type != dtype:
        return "squeeze-excite weights are not a constant of the input's dtype"
    b = n.input[2] if len(n.input) > 2 and n.input[2] else None
    if len(w.dims) != 4 or tuple(w.dims[1:]) != (c_in, 1, 1):
        return "not a 1x1 conv over every channel"
    if b is not None and (b not in view.constants or tuple(view.constants[b].dims) != (w.dims[0],)
                          or view.constants[b].data_type != dtype):
        return "squeeze-excite bias is not a constant of K numbers"
    attrs = conv_from_node(n, tuple(w.dims), (1, 1))
    if isinstance(attrs, str):
        return attrs
    if attrs.group != 1 or attrs.pads != (0, 0, 0, 0) or attrs.strides != (1, 1):
        return "not a 1x1 conv over every channel"
    return int(w.dims[0])


def _bias_add(view: GraphView, ci: int, k: int, taken: set[int]) -> int | None:
    """The Add that alone reads Conv ci's output and adds a constant of K values, one per
    channel ([K], [K, 1, 1] or [1, K, 1, 1]): the conv's bias as Paddle's exporter writes it
    (Conv without a bias, then Add of Reshape(bias), folded to a constant at --shape)."""
    out = view.nodes[ci].output[0]
    readers = view.consumers.get(out, ())
    if out in view.graph_outputs or len(readers) != 1 or readers[0] in taken:
        return None
    n = view.nodes[readers[0]]
    if n.op_type != "Add" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
        return None
    other = n.input[1] if n.input[0] == out else n.input[0]
    t = view.constants.get(other)
    if t is None or t.data_type != view.constants[view.nodes[ci].input[1]].data_type:
        return None
    dims = tuple(t.dims)
    return readers[0] if dims in ((k,), (k, 1, 1), (1, k, 1, 1)) else None


def _chain(view: GraphView, ci: int, target, pattern: Pattern, taken: set[int], accepted: Accepted,
           ) -> tuple[tuple[int, ...], str] | str:
    """The pointwise nodes after node ci (a Conv, or its bias Add) that compute over its output
    alone (their program's one input: constants other than scalars would be inputs too), and
    their one result; ci's output itself when there are none."""
    out = view.nodes[ci].output[0]
    group = grow_epilogue(view, ci, target, pattern, taken)
    group, result = single_result(view, ci, out, group, accepted)
    if not group:
        return (), out
    members = set(group)
    for i in group:
        for _, name in operands(view, i):  # what the program reads (folded scalars are not)
            if name != out and view.producer.get(name) not in members:
                return "an activation or gate reads another tensor"
    return tuple(sorted(group)), result


def _layer(view: GraphView, x: str, c_in: int, dtype: int, n, pattern: Pattern, taken: set[int],
           accepted: Accepted, what: str) -> tuple[int, int, int | None, tuple[int, ...], str] | str:
    """The 1x1 conv that alone reads `x` (`what`), its bias Add if any, and the pointwise nodes
    after them: (conv, its channels, bias Add, those nodes, their result), or why not."""
    readers = view.consumers.get(x, ())
    if x in view.graph_outputs or len(readers) != 1 or readers[0] in taken:
        return f"{what} is not read by one conv alone"
    fc = readers[0]
    k = _fc(view, fc, x, c_in, dtype)
    if isinstance(k, str):
        return k
    bias = _bias_add(view, fc, k, taken)
    chain = _chain(view, fc if bias is None else bias, (n, k, 1, 1), pattern, taken, accepted)
    if isinstance(chain, str):
        return chain
    return fc, k, bias, *chain


def _squeeze_match(view: GraphView, pi: int, pattern: Pattern, taken: set[int], accepted: Accepted) -> Match | str:
    """The squeeze_excite match anchored at GlobalAveragePool node pi, or why there is none."""
    m: SqueezeParams = pattern.match
    pool = view.nodes[pi]
    x, a = pool.input[0], pool.output[0]
    shape = view.shapes.get(x)
    if shape is None or len(shape) != 4:
        return "not a 4-D global average pool"
    dtype = view.types.get(x)
    if dtype not in {DTYPE_IDS[d] for d in m.dtypes}:  # float32 / float16: `parse` allows no others
        return dtype_reason(dtype)
    c = shape[1]
    if not isinstance(c, int):
        return "unknown number of channels"
    first = _layer(view, a, c, dtype, shape[0], pattern, taken, accepted, "the pool")
    if isinstance(first, str):
        return first
    fc1, cr, bias1, act_nodes, hidden = first
    second = _layer(view, hidden, cr, dtype, shape[0], pattern, taken, accepted, "the activation")
    if isinstance(second, str):
        return second
    fc2, k, bias2, gate_nodes, result = second
    if k != c:
        return "the second conv does not give back every channel"
    nodes = tuple(sorted({pi, fc1, fc2, *act_nodes, *gate_nodes} | {i for i in (bias1, bias2) if i is not None}))
    if reentering(view, list(nodes), accepted):
        return "fusing would create a cycle"
    if view.types.get(result) != dtype:
        return "the gate's result is not of the input's dtype"
    parts = SqueezeParts(pi, fc1, bias1, act_nodes, hidden, fc2, bias2, gate_nodes, result)
    return Match(pattern, nodes, (result,), pointwise=tuple(sorted(act_nodes + gate_nodes)), first_input=x,
                 result=result, params=parts)


def _weights_2d(view: GraphView, conv: NodeProto, add: int | None, node_name: str, what: str, names: set[str],
                graph: GraphProto) -> tuple[str, str, np.ndarray]:
    """A new initializer of the conv's weights [K, C] (the node's input) and its bias: the
    conv's own, plus the per-channel constant of its bias Add (`add`), or zeros where it has
    neither: (weights' name, bias's name, weights)."""
    w = numpy_helper.to_array(view.constants[conv.input[1]])
    w2d = np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]))
    name = unique_name(f"{node_name}.{what}_weight", names)
    graph.initializer.append(numpy_helper.from_array(w2d, name))
    bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else ""
    if bias and add is None:
        return name, bias, w2d
    total = numpy_helper.to_array(view.constants[bias]) if bias else np.zeros(w.shape[0], w.dtype)
    if add is not None:
        n = view.nodes[add]
        other = n.input[1] if n.input[0] == conv.output[0] else n.input[0]
        total = (total.astype(np.float32) + numpy_helper.to_array(view.constants[other]).reshape(-1)).astype(w.dtype)
    bias = unique_name(f"{node_name}.{what}_bias", names)
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(total), bias))
    return name, bias, w2d


def _body_conv(conv: NodeProto, w2d_name: str, bias: str, k: int, c: int, tag: str, out: str) -> list[NodeProto]:
    """The body's copy of a conv reading the node's [K, C] weights through a Reshape to
    [K, C, 1, 1] (internal names the graph cannot have: renamed in the body), with the node's
    bias, writing `out` (the conv's output, or its bias Add's, which the bias then holds)."""
    shape, w4d = f"{w2d_name}\0{tag}_shape", f"{w2d_name}\0{tag}_4d"
    const = helper.make_node("Constant", [], [shape], value=numpy_helper.from_array(
        np.array([k, c, 1, 1], np.int64), "shape"))
    reshape = helper.make_node("Reshape", [w2d_name, shape], [w4d])
    copy = NodeProto()
    copy.CopyFrom(conv)
    del copy.input[:]
    copy.input.extend([conv.input[0], w4d, bias])
    del copy.output[:]
    copy.output.append(out)
    return [const, reshape, copy]


class SqueezeExcite(Kind):
    """A match is a GlobalAveragePool of a 4-D float32 or float16 tensor read only by a 1x1
    Conv with constant weights (FC1), the pointwise nodes after it that compute over its
    output alone (the activation, possibly none), read only by a second 1x1 Conv back to the
    pool's channels (FC2), and the pointwise nodes after that (the gate). Each pool that
    does not match is reported with the reason."""

    name = "squeeze_excite"
    op_type = "FusedSqueezeExcite"
    match_kind = "squeeze_excite"
    params = frozenset()
    # X channels-last with its output (the same bytes either way): a squeeze-excite block
    # between channels-last convs needs no Transpose
    layouts = NodeLayouts(y_follows_x=True)
    measure_first = True  # it replaces cuDNN convs: timed against them early
    # its configurations are timed too (`squeeze_candidates`), with the budget left after every
    # node's own kernel: the heuristic's tile is measured on one model's blocks only
    search_configs = True
    anchor_ops = frozenset({"GlobalAveragePool"})

    def untuned_reason(self) -> str | None:
        return None if os.environ.get("ONNXFUSE_SQUEEZE_ALL") == "1" else UNTUNED

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> SqueezeParams:
        for dt in sorted(dtypes):
            if dt not in ("float32", "float16"):
                m.fail("match.dtypes", f"{dt!r}: squeeze-excite blocks are fused for float32 and float16 only")
        return SqueezeParams(ops, dtypes)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_anchored(view, pattern, taken, accepted, "GlobalAveragePool", _squeeze_match)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        """Inputs [X, W1, B1, W2, B2] (new initializers of the weights as [K, C]); the body is
        the pool, the convs (through Reshapes of the node's weights) and the pointwise nodes."""
        p: SqueezeParts = match.params
        fc1, fc2 = view.nodes[p.fc1], view.nodes[p.fc2]
        # a bias Add is the conv's bias in the node (and in the body's conv, whose output then
        # takes the Add's name: the activation reads it)
        z1 = view.nodes[p.bias1].output[0] if p.bias1 is not None else fc1.output[0]
        z2 = view.nodes[p.bias2].output[0] if p.bias2 is not None else fc2.output[0]
        act, _, folded = lower_group(view, p.act, (p.hidden,), first=z1)
        gate, _, folded2 = lower_group(view, p.gate, (p.result,), first=z2)
        w1, b1, w1_2d = _weights_2d(view, fc1, p.bias1, node_name, "fc1", names, graph)
        w2, b2, w2_2d = _weights_2d(view, fc2, p.bias2, node_name, "fc2", names, graph)
        c, cr = w1_2d.shape[1], w1_2d.shape[0]
        body = ([view.nodes[p.pool]] + _body_conv(fc1, w1, b1, cr, c, "fc1", z1) + [view.nodes[i] for i in p.act]
                + _body_conv(fc2, w2, b2, c, cr, "fc2", z2) + [view.nodes[i] for i in p.gate])
        x = match.first_input
        return Lowering(act, {**folded, **folded2}, [x, w1, b1, w2, b2], body, {"gate": gate.to_text()},
                        f"squeeze_excite C={c} CR={cr} gate {gate.to_text()}", 4, ("full",),
                        {"params": gate})

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> SqueezeSpec:
        """C and CR from W1 [CR, C]; the gate program is the node's FusedNode.params."""
        dims = (weight_dims[f.inputs[1]] if weight_dims is not None else
                tuple(next(t.dims for t in model.graph.initializer if t.name == f.inputs[1])))
        return SqueezeSpec(f.kernel_name, f.program, f.params, channels=int(dims[1]), hidden=int(dims[0]),
                           dtype=f.program.input_dtypes[0], source_nodes=f.source_nodes,
                           x_layout=f.x_layout, y_layout=f.y_layout)

    def variants(self, spec: SqueezeSpec) -> tuple[SqueezeVariant, ...]:
        return squeeze_variants(spec)

    def generate(self, spec: SqueezeSpec, variant: SqueezeVariant) -> KernelSource:
        return generate_squeeze(spec, variant)

    def kernel_meta(self, spec: SqueezeSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION, "kind": "squeeze_excite", "name": spec.name,
            "channels": spec.channels, "hidden": spec.hidden,
            **xy_layout_meta(spec.x_layout, spec.y_layout),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def candidates(self, spec: SqueezeSpec) -> list[tuple[str, tuple]]:
        return squeeze_candidates(spec)

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """docs/format.md's values, in numpy: fp32 sums, rounded to the dtype between steps."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        act, gate = Program.from_text(attrs["program"].decode()), Program.from_text(attrs["gate"].decode())
        x, w1, b1, w2, b2 = inputs
        dt = x.dtype
        if layout_attr(attrs, "x_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC":
            x = x.transpose(0, 3, 1, 2)
        m = x.astype(np.float32).mean(axis=(2, 3), dtype=np.float32).astype(dt)
        z1 = (m.astype(np.float32) @ w1.astype(np.float32).T + b1.astype(np.float32)).astype(dt)
        (h,) = evaluate(act, [z1])
        z2 = (h.astype(np.float32) @ w2.astype(np.float32).T + b2.astype(np.float32)).astype(dt)
        (y,) = evaluate(gate, [z2])
        n, c = y.shape
        nhwc = layout_attr(attrs, "y_layout", "NCHW", ("NCHW", "NHWC")) == "NHWC"
        return [y.reshape(n, 1, 1, c) if nhwc else y.reshape(n, c, 1, 1)]
