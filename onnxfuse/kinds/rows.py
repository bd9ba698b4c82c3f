"""The rows kind (FusedRows): normalizations and softmaxes with the pointwise ops before and
after them, recognized, lowered to the node's two programs (docs/format.md, "FusedRows") and
compiled by onnxfuse/codegen_rows.py.

A match has three parts (docs/format.md, FusedRows):

- the **core**: the reduction as the graph writes it, over the trailing dims of its input
  x (`Core`):
  - ``layer_norm``: the LayerNormalization op, or the decomposed form exporters write,
    ReduceMean(x) -> Sub(x, mean) -> [Cast] -> Pow(d, 2) or Mul(d, d) -> ReduceMean: its
    nodes are the two ReduceMeans and the square; what follows (eps, Sqrt, Div or
    Reciprocal-Mul, Pow(-0.5), the scale and shift, Keras' x * inv + (beta - mean * inv))
    is epilogue arithmetic on x and the two statistics, whatever its form;
  - ``rms_norm``: the ONNX RMSNormalization op (opset 23), or ReduceMean(Pow(x, 2)) /
    ReduceMean(Mul(x, x)); ONNX Runtime's SimplifiedLayerNormalization is recognized and
    declined (`NOT_IN_FUNCTIONS`);
  - ``softmax`` / ``log_softmax``: the op, over the last axis (opset >= 13), or over the
    trailing dims from `axis` on (opset < 13 flattens them: its coerced 2-D semantics);
  - ``group_norm``: torch.onnx.export's nn.GroupNorm (Reshape(x, [0, G, -1]) ->
    InstanceNormalization -> Reshape(Shape(x)); its gamma and beta are epilogue nodes) or
    the GroupNormalization op (opset 18's scale per group, 21's per channel); x is
    [N, C, spatial...] and a row one (image, group). Not recognized: the decomposed form
    over Reshape(x, [N, G, -1]) (ReduceMean...): it fuses as a LayerNorm of the reshaped
    tensor, and what follows the Reshape back (gamma, beta, SiLU) as a separate group;
- the **prologue**: the pointwise nodes that compute x (a residual add, a bias add, a scale
  and an attention mask before a softmax, a Cast to float32), each of x's shape, read only
  inside the match (x itself may be read outside: the node then stores it too);
- the **epilogue**: the pointwise nodes that depend on the core's values (x, the statistics,
  the op's output) and compute over x's shape or once per row, up to the tensors read
  outside the match (the node's outputs, each of x's shape).

Every part lowers to the expression IR of the pointwise kind (`onnxfuse.expr`), and the
kernel (`onnxfuse.codegen_rows`) computes the statistics in fp32. A normalization or
softmax that does not fuse is reported with the reason.

ONNX Runtime's own fusions (`leave_to_ort`, `onnxfuse.ort_fusions`): a match whose every
node ONNX Runtime would fuse into one of its normalizations (LayerNormalization,
SkipLayerNormalization, ...) or softmaxes (BiasSoftmax) is left to it, unless the tune pass
will time it against that fusion (`onnxfuse.pipeline.TIMED_AGAINST_ORT`: the layer
normalizations; `Match.measured_only`, kept only where faster); a match that also
fuses work ONNX Runtime does not (an activation, a Cast, a prologue it leaves alone) takes
its nodes, and the report's notes say so. Nodes ONNX Runtime takes into other fusions
(FusedMatMul's scale, BiasGelu...) join no prologue or epilogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_rows import (
    REDUCTIONS,
    ROW_VALUES,
    RowsSpec,
    RowsVariant,
    generate_rows,
    rows_candidates,
    rows_variants,
)
from onnxfuse.expr import Builder, Operand, Program, evaluate
from onnxfuse.graph import GraphView, Shape, same_shape
from onnxfuse.groups import Accepted, reentering
from onnxfuse.kinds.base import (
    META_VERSION,
    Alone,
    Fields,
    FusedNode,
    Kind,
    Lowering,
    Match,
    MatchResult,
    NodeLayouts,
    Pattern,
)
from onnxfuse.match import DTYPE_IDS, broadcasts_to, check_node, dtype_reason, offered_reasons, operands
from onnxfuse.ops import FLOAT_TYPES, node_attrs
from onnxfuse.rewrite import ir_dtype, lower_nodes, unique_name

DEFAULT_DOMAINS = ("", "ai.onnx")
MS_DOMAIN = "com.microsoft"

# Reasons in the report (node -> why its normalization or softmax did not fuse).
NOT_LAST = "reduction axis is not the last"
NO_KEEPDIMS = "ReduceMean without keepdims"
EPS_NOT_CONSTANT = "eps is not a constant"
STAT_OUTSIDE = "a row statistic (mean, variance, max) is read outside the normalization"
EXTRA_OUTPUTS = "its Mean / InvStdDev output is used"
LONE = Alone("nothing to fuse with it (ONNX Runtime's own kernel runs it)")
CYCLE = "fusing would create a cycle"
UNKNOWN_SHAPE = "unknown shape"
# ONNX Runtime 1.32 segfaults creating a session for a model whose model-local function holds its
# SimplifiedLayerNormalization (registered in the ONNX domain by ORT, not by ONNX); the original
# model runs. A fused node's function body must run anywhere, so it is not fused.
NOT_IN_FUNCTIONS = ("SimplifiedLayerNormalization is ONNX Runtime's own op: ONNX Runtime 1.32 crashes running it "
                    "in a function body, the fused node's fallback")
NOT_BROADCAST = "an input does not broadcast to the rows (it varies within the normalized dims, or enlarges them)"
# flax's LayerNorm (use_fast_variance) through jax2tf and tf2onnx, or a hand-written one: the
# sums (or means) of x and of x * x over the same axes, the variance E[x^2] - E[x]^2; fused with
# keepdims (`_moments_layer_norm`), reported without (Google's Magika file-type model on PyPI
# writes it with ReduceSum, keepdims 0, over a middle axis)
MOMENTS_FORM = ("a LayerNorm written as E[x^2] - E[x]^2 with keepdims 0 (the sums of x and of x * x reshaped "
                "back, as jax2tf writes it): not fused yet")


def left_to_ort(reason: str) -> str:
    """The report's reason for a match ONNX Runtime fuses whole (`reason`: `ort_fusions.reason`)."""
    return f"{reason} (it fuses every node of this normalization or softmax)"


def taken_from_ort(reason: str) -> str:
    """The report's note for a match that takes nodes from one of ONNX Runtime's fusions."""
    return (reason.replace("left to", "taken from", 1) + ": the fused kernel also fuses work ONNX Runtime does not"
            " (prologue or epilogue)")


@dataclass(frozen=True)
class Core:
    """A recognized reduction: its nodes, its input x, where the rows start, and the names
    the epilogue reads its values by."""

    reduction: str
    nodes: tuple[int, ...]
    x: str
    axis: int  # the first normalized dim of x (positive)
    # tensors the core defines that epilogue nodes may read: the statistics (decomposed
    # forms) or the op's output
    seeds: tuple[str, ...]
    # the epilogue program's first inputs, ROW_VALUES[reduction] (x, then statistics; the
    # op forms' statistics have names no graph tensor has)
    row_values: tuple[str, ...]
    # the op forms: its extra inputs (scale, bias) and the instructions computing its output
    # from the row values and those (env: name -> operand)
    op_inputs: tuple[str, ...] = ()
    prelude: Callable[[Builder, dict[str, Operand]], None] | None = None
    exposable: frozenset[str] = frozenset()  # core tensors that may be read outside (the op's output)
    constants: tuple[str, ...] = ()  # constants the core's nodes read (axes, the exponent 2)
    # group_norm: the number of groups (x is [N, C, spatial...], axis 1); op inputs read in a
    # mode their own shape does not say (GroupNormalization's scale: "channel"); constant
    # scales and biases the node reads as a [C, 1, ...] copy (opset 18's [G] repeated per
    # channel, opset 21's [C] reshaped)
    groups: int = 0
    op_modes: tuple[tuple[str, str], ...] = ()
    expand: tuple[str, ...] = ()
    # the decomposed group norm: the shape of x reshaped to [N, G, L] (its epilogue begins
    # there, per-row values [N, G, 1]), and the Reshape back to x's shape, a core node, as
    # (its input, its output): the same elements in the same order, one value in the kernel
    inner_shape: Shape | None = None
    bridges: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class RowsParts:
    """What a match found (Match.params): its core, prologue and epilogue nodes
    (topological order), whether x leaves the node too; Match's nodes are all of them and
    its outputs the epilogue's, then x when `x_output`."""

    core: Core
    prologue: tuple[int, ...] = ()
    epilogue: tuple[int, ...] = ()
    x_output: bool = False
    note: str = ""  # the rule of ONNX Runtime's fusions that applied, if any (the report's notes)


@dataclass(frozen=True)
class RowsParams:
    """Match a normalization or softmax over the last dims (`reductions`), the pointwise
    group before it (the prologue: what computes its input) and after it (the epilogue)."""

    reductions: frozenset[str]
    ops: frozenset[str]  # op types allowed in the prologue and the epilogue
    dtypes: frozenset[str]
    min_nodes: int = 1  # prologue and epilogue nodes besides the reduction's own, at least

    @property
    def anchors(self) -> frozenset[str]:
        return frozenset().union(*(REDUCTION_ANCHORS[r] for r in self.reductions))

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | self.anchors


# The ONNX ops each reduction is recognized from (the decomposed forms start at ReduceMean).
REDUCTION_ANCHORS = {
    "layer_norm": frozenset({"ReduceMean", "ReduceSum", "LayerNormalization"}),
    "rms_norm": frozenset({"ReduceMean", "SimplifiedLayerNormalization", "RMSNormalization"}),
    "softmax": frozenset({"Softmax", "ReduceMax"}),
    "log_softmax": frozenset({"LogSoftmax"}),
    "group_norm": frozenset({"InstanceNormalization", "GroupNormalization", "ReduceMean"}),
}


# ---------------------------------------------------------------------------------------
# Recognizing the core
# ---------------------------------------------------------------------------------------

def _single_reader(view: GraphView, name: str) -> int | None:
    readers = view.consumers.get(name, [])
    return readers[0] if len(readers) == 1 and name not in view.graph_outputs else None


def _square_base(view: GraphView, i: int) -> str | None:
    """z when node i is Pow(z, 2) or Mul(z, z)."""
    n = view.nodes[i]
    if n.domain not in DEFAULT_DOMAINS or len(n.input) != 2:
        return None
    if n.op_type == "Mul" and n.input[0] == n.input[1]:
        return n.input[0]
    if n.op_type == "Pow" and view.scalar_constant(n.input[1]) == 2.0:
        return n.input[0]
    return None


# Float types a Cast inside a decomposed norm may go through (float64: torch's fp16 LayerNorm at
# opsets below 17 squares in float64; recognized, then declined with that reason).
_CAST_TYPES = (*FLOAT_TYPES, onnx.TensorProto.DOUBLE)


def _through_cast(view: GraphView, name: str) -> str:
    """The tensor a Cast between float types reads, else `name`."""
    p = view.producer.get(name)
    if p is not None and view.nodes[p].op_type == "Cast" and view.nodes[p].domain in DEFAULT_DOMAINS:
        src = view.nodes[p].input[0]
        if view.types.get(src) in _CAST_TYPES and view.types.get(name) in _CAST_TYPES:
            return src
    return name


def _is_reduce_mean(view: GraphView, i: int | None) -> bool:
    return i is not None and view.nodes[i].op_type == "ReduceMean" and view.nodes[i].domain in DEFAULT_DOMAINS


def _layer_norm_parts(view: GraphView, r1: int) -> tuple[int, int, int] | None:
    """(sub, square, r2) when ReduceMean r1 is the mean of a decomposed LayerNorm: a
    Sub(x, mean) whose square (possibly through a Cast) only ReduceMean r2 reads."""
    x, mean = view.nodes[r1].input[0], view.nodes[r1].output[0]
    for s, kept in [(s, k) for k in _kept_dims(view, mean) for s in view.consumers.get(k, [])]:
        sub = view.nodes[s]
        if sub.op_type != "Sub" or sub.domain not in DEFAULT_DOMAINS or sorted(sub.input) != sorted([x, kept]):
            continue
        d = sub.output[0]
        bases = [d] + [view.nodes[c].output[0] for c in view.consumers.get(d, [])
                       if view.nodes[c].op_type == "Cast" and _through_cast(view, view.nodes[c].output[0]) == d]
        for base in bases:
            for q in view.consumers.get(base, []):
                if _square_base(view, q) != base:
                    continue
                r2 = _single_reader(view, view.nodes[q].output[0])
                if _is_reduce_mean(view, r2):
                    return s, q, r2
    return None


_MOMENT_REDUCTIONS = ("ReduceMean", "ReduceSum")


def _moments_of(view: GraphView, r1: int) -> int | None:
    """The reduction of x * x (Mul(x, x) or Pow(x, 2)) over the same axes with the same
    keepdims when ReduceSum / ReduceMean r1 reduces x and something reads both results:
    the E[x^2] - E[x]^2 form of a LayerNorm (MOMENTS_FORM); else None."""
    n1 = view.nodes[r1]
    if n1.op_type not in _MOMENT_REDUCTIONS or n1.domain not in DEFAULT_DOMAINS:
        return None
    x = n1.input[0]
    for q in view.consumers.get(x, []):
        if q == r1 or _square_base(view, q) != x:
            continue
        for r2 in view.consumers.get(view.nodes[q].output[0], []):
            n2 = view.nodes[r2]
            same = (n2.op_type == n1.op_type and n2.domain in DEFAULT_DOMAINS
                    and _reduce_axes(view, r2) == _reduce_axes(view, r1)
                    and node_attrs(n2).get("keepdims", 1) == node_attrs(n1).get("keepdims", 1))
            if not same:
                continue
            if _meet(view, n1.output[0], n2.output[0]):
                return r2
    return None


def _meet(view: GraphView, a: str, b: str, depth: int = 4) -> bool:
    """Some node reads (through at most `depth` nodes after each) both a and b."""
    def reach(t: str) -> set[int]:
        seen: set[int] = set()
        frontier = [t]
        for _ in range(depth):
            nxt = []
            for name in frontier:
                for c in view.consumers.get(name, []):
                    if c not in seen:
                        seen.add(c)
                        nxt += list(view.nodes[c].output)
            frontier = nxt
        return seen
    return bool(reach(a) & reach(b))


def _kept_dims(view: GraphView, stat: str) -> list[str]:
    """A statistic and, after a ReduceMean with keepdims=0, the Unsqueeze that puts the dims
    back (recognized as a LayerNorm; declined for its keepdims)."""
    return [stat] + [view.nodes[c].output[0] for c in view.consumers.get(stat, [])
                     if view.nodes[c].op_type == "Unsqueeze" and view.nodes[c].domain in DEFAULT_DOMAINS]


def _reduce_mean_of(view: GraphView, name: str) -> int | None:
    """The ReduceMean that computes `name`, directly or through an Unsqueeze."""
    p = view.producer.get(name)
    if p is not None and view.nodes[p].op_type == "Unsqueeze":
        p = view.producer.get(view.nodes[p].input[0])
    return p if _is_reduce_mean(view, p) else None


def _variance_of(view: GraphView, r: int) -> bool:
    """ReduceMean r reduces the square of x - mean(x): the variance of a decomposed
    LayerNorm (recognized from its mean, not here)."""
    q = view.producer.get(view.nodes[r].input[0])
    base = _square_base(view, q) if q is not None else None
    if base is None:
        return False
    s = view.producer.get(_through_cast(view, base))
    if s is None or view.nodes[s].op_type != "Sub":
        return False
    sub = view.nodes[s]
    return any((p := _reduce_mean_of(view, t)) is not None and view.nodes[p].input[0] in sub.input for t in sub.input)


def _reduce_axes(view: GraphView, i: int) -> tuple[int, ...] | str | None:
    """The axes of ReduceMean node i (attribute before opset 18, input from 18), None for all
    dims, or why they cannot be read."""
    n = view.nodes[i]
    attrs = node_attrs(n)
    if len(n.input) > 1 and n.input[1]:
        t = view.constants.get(n.input[1])
        if t is None:
            return "ReduceMean axes are not a constant"
        return tuple(int(a) for a in numpy_helper.to_array(t).reshape(-1))
    if "axes" in attrs:
        return tuple(attrs["axes"])
    if attrs.get("noop_with_empty_axes", 0):
        return "ReduceMean with no axes and noop_with_empty_axes"
    return None


def _trailing_axis(view: GraphView, i: int, rank: int) -> int | str:
    """The first of ReduceMean i's axes when they are the trailing dims of its input (rank
    `rank`), with keepdims; else why not."""
    axes = _reduce_axes(view, i)
    if isinstance(axes, str):
        return axes
    if not node_attrs(view.nodes[i]).get("keepdims", 1):
        return NO_KEEPDIMS
    axes = tuple(range(rank)) if axes is None or not axes else tuple(sorted(a % rank for a in axes))
    if axes != tuple(range(rank - len(axes), rank)):
        return NOT_LAST
    return axes[0]


def _check_x(view: GraphView, x: str, pattern: Pattern) -> Shape | str:
    shape = view.shapes.get(x)
    if shape is None:
        return UNKNOWN_SHAPE
    if not shape:
        return "a scalar input"
    m: RowsParams = pattern.match
    if view.types.get(x) not in {DTYPE_IDS[d] for d in m.dtypes}:
        return dtype_reason(view.types.get(x))
    return shape


def _constants_of(view: GraphView, nodes) -> tuple[str, ...]:
    return tuple(sorted({x for i in nodes for x in view.nodes[i].input if x in view.constants}))


def find_core(view: GraphView, i: int, pattern: Pattern) -> Core | str | None:
    """The reduction anchored at node i, why it cannot fuse, or None when node i anchors no
    reduction of this pattern (a ReduceMean that is a LayerNorm's variance, or no
    normalization at all)."""
    m: RowsParams = pattern.match
    n = view.nodes[i]
    if n.op_type in _MOMENT_REDUCTIONS and n.domain in DEFAULT_DOMAINS and "layer_norm" in m.reductions:
        r2 = _moments_of(view, i)
        if r2 is not None:
            return _moments_layer_norm(view, i, r2, pattern)
    if n.op_type == "ReduceSum":
        return None
    if n.op_type == "ReduceMean" and n.domain in DEFAULT_DOMAINS:
        parts = _layer_norm_parts(view, i)
        if parts is not None:
            group = _decomposed_group_norm(view, i, parts, pattern)
            if group is not None:  # a GroupNorm's (the group_norm pattern's, not a LayerNorm of the groups)
                return group if "group_norm" in m.reductions else None
            return _decomposed_layer_norm(view, i, parts, pattern) if "layer_norm" in m.reductions else None
        if _variance_of(view, i):
            return None
        q = view.producer.get(n.input[0])
        z = _square_base(view, q) if q is not None else None
        if z is None or _single_reader(view, n.input[0]) != i or "rms_norm" not in m.reductions:
            return None
        if any(_moments_of(view, r1) == i for r1 in view.consumers.get(z, [])):
            return MOMENTS_FORM  # the E[x^2] of a LayerNorm's moments, not an RMSNorm's mean square
        return _decomposed_rms_norm(view, i, q, z, pattern)
    if n.op_type == "LayerNormalization" and n.domain in DEFAULT_DOMAINS and "layer_norm" in m.reductions:
        return _layer_norm_op(view, i, pattern)
    if n.op_type == "SimplifiedLayerNormalization" and "rms_norm" in m.reductions \
            and n.domain in (*DEFAULT_DOMAINS, MS_DOMAIN):
        return NOT_IN_FUNCTIONS
    if n.op_type == "RMSNormalization" and n.domain in DEFAULT_DOMAINS and "rms_norm" in m.reductions:
        return _layer_norm_op(view, i, pattern, rms=True)
    if n.op_type == "GroupNormalization" and n.domain in DEFAULT_DOMAINS and "group_norm" in m.reductions:
        return _group_norm_op(view, i, pattern)
    if n.op_type == "InstanceNormalization" and n.domain in DEFAULT_DOMAINS and "group_norm" in m.reductions:
        return _instance_group_norm(view, i, pattern)
    if n.op_type == "ReduceMax" and n.domain in DEFAULT_DOMAINS:
        return _decomposed_softmax(view, i, pattern) if "softmax" in m.reductions else None
    if n.op_type in ("Softmax", "LogSoftmax") and n.domain in DEFAULT_DOMAINS:
        reduction = "softmax" if n.op_type == "Softmax" else "log_softmax"
        return _softmax_op(view, i, pattern, reduction) if reduction in m.reductions else None
    return None


def _decomposed_layer_norm(view: GraphView, r1: int, parts: tuple[int, int, int], pattern: Pattern) -> Core | str:
    _, square, r2 = parts
    x = view.nodes[r1].input[0]
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    axis = _trailing_axis(view, r1, len(shape))
    axis2 = _trailing_axis(view, r2, len(shape))
    if isinstance(axis, str) or isinstance(axis2, str):
        return axis if isinstance(axis, str) else axis2
    if axis != axis2:
        return "the mean and the variance reduce different axes"
    if view.types.get(view.nodes[r2].output[0]) not in FLOAT_TYPES:
        return f"its variance is {dtype_reason(view.types.get(view.nodes[r2].output[0]))} (a Cast before the square)"
    eps = _eps_reason(view, view.nodes[r2].output[0])
    if eps:
        return eps
    nodes = (r1, square, r2)
    mean, var = view.nodes[r1].output[0], view.nodes[r2].output[0]
    return Core("layer_norm", nodes, x, axis, (mean, var), (x, mean, var), constants=_constants_of(view, nodes))


def _moments_layer_norm(view: GraphView, r1: int, r2: int, pattern: Pattern) -> Core | str:
    """The E[x^2] - E[x]^2 form (`_moments_of`): ReduceMean or ReduceSum r1 of x and r2 of
    x * x, keepdims, over the trailing dims. The kernel computes mean and var as for any
    LayerNorm (var of x - mean, in fp32); the prelude gives back what the graph's reductions
    define, s1 = mean (times n for a sum) and s2 = (var + mean^2) (times n), and the
    epilogue computes from them as the graph does (its E[x^2] - E[x]^2 included, so the
    result is the graph's, cancellation and all). With keepdims 0 (jax2tf's Reshape back) or
    over other dims it is reported (MOMENTS_FORM, NOT_LAST)."""
    x = view.nodes[r1].input[0]
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    if not node_attrs(view.nodes[r1]).get("keepdims", 1):
        return MOMENTS_FORM
    axis = _trailing_axis(view, r1, len(shape))
    if isinstance(axis, str):
        return axis.replace("ReduceMean", view.nodes[r1].op_type)
    n = 1
    for d in shape[axis:]:
        if not isinstance(d, int):
            return "a LayerNorm written as E[x^2] - E[x]^2 over rows of a length not known"
        n *= d
    square = view.producer[view.nodes[r2].input[0]]
    s1, s2 = view.nodes[r1].output[0], view.nodes[r2].output[0]
    stats = (f"{s1}\0mean", f"{s1}\0var")
    scale = float(n) if view.nodes[r1].op_type == "ReduceSum" else 1.0

    def prelude(b: Builder, env: dict[str, Operand]) -> None:
        mean, var = env[stats[0]], env[stats[1]]
        e1, e2 = mean, b.emit("add", var, b.emit("mul", mean, mean))
        env[s1] = b.emit("mul", e1, scale) if scale != 1.0 else e1
        env[s2] = b.emit("mul", e2, scale) if scale != 1.0 else e2

    nodes = (r1, square, r2)
    return Core("layer_norm", nodes, x, axis, (s1, s2), (x, *stats), prelude=prelude,
                constants=_constants_of(view, nodes))


def _decomposed_rms_norm(view: GraphView, r: int, square: int, z: str, pattern: Pattern) -> Core | str:
    shape = _check_x(view, z, pattern)
    if isinstance(shape, str):
        return shape
    axis = _trailing_axis(view, r, len(shape))
    if isinstance(axis, str):
        return axis
    ms = view.nodes[r].output[0]
    eps = _eps_reason(view, ms)
    if eps:
        return eps
    nodes = (square, r)
    return Core("rms_norm", nodes, z, axis, (ms,), (z, ms), constants=_constants_of(view, nodes))


def _eps_reason(view: GraphView, stat: str) -> str | None:
    """A statistic's epsilon: where an Add reads the variance (mean square), its other
    operand must be a constant."""
    for c in view.consumers.get(stat, []):
        n = view.nodes[c]
        if n.op_type == "Add" and n.domain in DEFAULT_DOMAINS:
            other = next((t for t in n.input if t != stat), stat)
            if other not in view.constants:
                return EPS_NOT_CONSTANT
    return None


def _used(view: GraphView, name: str) -> bool:
    return bool(name) and (name in view.graph_outputs or bool(view.consumers.get(name)))


def _layer_norm_op(view: GraphView, i: int, pattern: Pattern, rms: bool = False) -> Core | str:
    """LayerNormalization or RMSNormalization:
    Y = (x - mean) / sqrt(var + eps) * scale (+ bias), or x / sqrt(mean(x^2) + eps) * scale."""
    n = view.nodes[i]
    x = n.input[0]
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    if any(_used(view, o) for o in n.output[1:]):
        return EXTRA_OUTPUTS
    attrs = node_attrs(n)
    axis = attrs.get("axis", -1)
    if not -len(shape) <= axis < len(shape):
        return f"axis {axis} is out of range"
    axis %= len(shape)
    eps = float(attrs.get("epsilon", 1e-5))
    y = n.output[0]
    scale = n.input[1] if len(n.input) > 1 else ""
    bias = n.input[2] if len(n.input) > 2 and not rms else ""
    stats = (f"{y}\0mean", f"{y}\0var") if not rms else (f"{y}\0mean_square",)
    op_inputs = tuple(t for t in (scale, bias) if t)

    def prelude(b: Builder, env: dict[str, Operand]) -> None:
        inv = b.emit("div", 1.0, b.emit("sqrt", b.emit("add", env[stats[-1]], eps)))
        centred = env[x] if rms else b.emit("sub", env[x], env[stats[0]])
        v = b.emit("mul", centred, inv)
        if scale:
            v = b.emit("mul", v, env[scale])
        if bias:
            v = b.emit("add", v, env[bias])
        env[y] = v

    return Core("rms_norm" if rms else "layer_norm", (i,), x, axis, (y,), (x, *stats), op_inputs, prelude,
                frozenset({y}))


def _uniform(view: GraphView, name: str) -> float | None:
    """The value of a float constant whose elements are all equal (torch's ones and zeros)."""
    t = view.constants.get(name)
    if t is None:
        return None
    a = numpy_helper.to_array(t)
    if a.size == 0 or a.dtype.kind != "f":
        return None
    v = a.reshape(-1)[0]
    return float(v) if np.all(a == v) else None


def _group_norm_core(view: GraphView, x: str, y: str, groups: int, eps: float, affine: tuple[str, str],
                     per_group: bool, nodes: tuple[int, ...], pattern: Pattern) -> Core | str:
    """A GroupNorm of x ([N, C, spatial...]) in `groups` groups whose output is y (x's shape):
    y = (x - mean) / sqrt(var + eps) * scale + bias, statistics per (n, group); scale and
    bias per group (`per_group`: GroupNormalization-18, InstanceNormalization's) or per
    channel (GroupNormalization-21), "" when absent."""
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    if len(shape) < 2:
        return "x of rank below 2 (no channel dim)"
    c = shape[1]
    if not isinstance(c, int):
        return "the channel count is not known"
    if groups <= 0 or c % groups:
        return f"{c} channels do not split into {groups} groups"
    lits: dict[str, float] = {}
    op_inputs: list[str] = []
    op_modes: list[tuple[str, str]] = []
    expand: list[str] = []
    for name in affine:
        if not name:
            continue
        v = _uniform(view, name)
        if v is not None:
            lits[name] = v
            continue
        size = int(np.prod(view.shapes.get(name) or (0,)))
        want = groups if per_group else c
        if view.shapes.get(name) is None or size != want:
            return f"scale or bias {name!r} has {size} elements, expected {want}"
        if any(r not in nodes for r in view.consumers.get(name, ())):
            return f"its per-group scale or bias {name!r} is read elsewhere too"
        if len(shape) > 2:  # a [G] or [C] vector does not broadcast to [N, C, spatial...]: the node reads a copy
            if name not in view.constants:
                return ("a per-group scale or bias (GroupNormalization before opset 21) that is not a constant"
                        if per_group and groups != c else
                        "a per-channel scale or bias of shape [C] that is not a constant")
            expand.append(name)
        elif per_group and groups != c:
            return "a per-group scale or bias (GroupNormalization before opset 21) that is not a constant"
        op_inputs.append(name)
        op_modes.append((name, "channel"))
    stats = (f"{y}\0mean", f"{y}\0var")
    scale, bias = affine

    def prelude(b: Builder, env: dict[str, Operand]) -> None:
        inv = b.emit("div", 1.0, b.emit("sqrt", b.emit("add", env[stats[1]], eps)))
        v = b.emit("mul", b.emit("sub", env[x], env[stats[0]]), inv)
        if scale and lits.get(scale) != 1.0:
            v = b.emit("mul", v, lits[scale] if scale in lits else env[scale])
        if bias and lits.get(bias) != 0.0:
            v = b.emit("add", v, lits[bias] if bias in lits else env[bias])
        env[y] = v

    # constants as Constant nodes of the body: the reshape shapes, the folded ones, the
    # expanded ones (not a per-channel gamma, a node input)
    constants = tuple(sorted({t for t in _constants_of(view, nodes) if t not in op_inputs} | set(expand)))
    return Core("group_norm", nodes, x, 1, (y,), (x, *stats), tuple(op_inputs), prelude, frozenset({y}),
                constants, groups, tuple(op_modes), tuple(expand))


def _group_norm_op(view: GraphView, i: int, pattern: Pattern) -> Core | str:
    """GroupNormalization: opset 18's scale and bias have one value per group (as its
    function body computes them, and ONNX Runtime runs it), opset 21's one per channel."""
    n = view.nodes[i]
    if any(_used(view, o) for o in n.output[1:]):
        return EXTRA_OUTPUTS
    attrs = node_attrs(n)
    if "num_groups" not in attrs:
        return "GroupNormalization without num_groups"
    affine = (n.input[1] if len(n.input) > 1 else "", n.input[2] if len(n.input) > 2 else "")
    per_group = (view.opset or 21) < 21
    return _group_norm_core(view, n.input[0], n.output[0], int(attrs["num_groups"]),
                            float(attrs.get("epsilon", 1e-5)), affine, per_group, (i,), pattern)


def _reshape_target(view: GraphView, i: int) -> list[int] | None:
    """Reshape node i's shape input when it is a constant, else None."""
    n = view.nodes[i]
    if n.op_type != "Reshape" or n.domain not in DEFAULT_DOMAINS or len(n.input) < 2:
        return None
    t = view.constants.get(n.input[1])
    return None if t is None else [int(d) for d in numpy_helper.to_array(t).reshape(-1)]


def _reshape_back(view: GraphView, n: int, x: str) -> bool:
    """Node n is Reshape(t, Shape(x)) or Reshape(t, x's static shape) (its Shape node read by it alone)."""
    node = view.nodes[n]
    if node.op_type != "Reshape" or node.domain not in DEFAULT_DOMAINS or len(node.input) < 2:
        return False
    sh = view.producer.get(node.input[1])
    if sh is None:
        return _reshape_target(view, n) == list(view.shapes.get(x) or ())
    s = view.nodes[sh]
    return (s.op_type == "Shape" and s.input[0] == x and node_attrs(s).get("start", 0) == 0
            and "end" not in node_attrs(s) and _single_reader(view, node.input[1]) == n)


def _group_split(view: GraphView, r: str) -> tuple[int, str, int] | None:
    """(the Reshape node, x, G) when tensor r is Reshape(x, [0 or N, G, -1 or L]) of an x of rank >= 3."""
    p = view.producer.get(r)
    target = _reshape_target(view, p) if p is not None else None
    if target is None or len(target) != 3:
        return None
    x = view.nodes[p].input[0]
    xs = view.shapes.get(x)
    if xs is None or len(xs) < 3 or target[1] <= 0:
        return None
    trail = xs[1:]
    size = int(np.prod(trail)) // target[1] if all(isinstance(d, int) for d in trail) else None
    if target[0] not in (0, xs[0]) or target[2] not in (-1, size):
        return None
    return p, x, target[1]


def _decomposed_group_norm(view: GraphView, r1: int, parts: tuple[int, int, int], pattern: Pattern
                           ) -> Core | str | None:
    """The ReduceMean form of a GroupNorm (tf2onnx and hand-written exports): a decomposed
    LayerNorm (`_layer_norm_parts`) of r = Reshape(x, [0, G, -1]) whose normalized result,
    through pointwise nodes over [N, G, L] or [N, G, 1], reaches one Reshape back to x's
    shape; None when it is not one (a LayerNorm of something else)."""
    _, square, r2 = parts
    r = view.nodes[r1].input[0]
    split = _group_split(view, r)
    if split is None:
        return None
    p, x, groups = split
    inner = view.shapes.get(r)
    if inner is None:
        return None
    m: RowsParams = pattern.match
    # the Reshape back: reached from the statistics through pointwise nodes of the groups' shapes
    seen: set[str] = set()
    work = [view.nodes[r1].output[0], view.nodes[r2].output[0], r]
    backs: set[int] = set()
    while work:
        t = work.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in view.consumers.get(t, ()):
            n = view.nodes[c]
            if c in (r1, r2, square):
                continue
            if _reshape_back(view, c, x):
                backs.add(c)
            elif n.op_type in m.ops and n.domain in DEFAULT_DOMAINS and len(n.output) == 1 and (
                    same_shape(view.shapes.get(n.output[0]), inner)
                    or same_shape(view.shapes.get(n.output[0]), (*inner[:2], 1))):
                work.append(n.output[0])
    if len(backs) != 1:
        return None
    (back,) = backs
    core = _decomposed_layer_norm(view, r1, parts, pattern)
    if isinstance(core, str):
        return core
    if core.axis != 2:
        return NOT_LAST
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    c = shape[1]
    if not isinstance(c, int) or c % groups:
        return f"{c} channels do not split into {groups} groups"
    nodes = {p, *core.nodes, back}
    sh = view.producer.get(view.nodes[back].input[1])
    if sh is not None:
        nodes.add(sh)
    nodes_t = tuple(sorted(nodes))
    src, dst = view.nodes[back].input[0], view.nodes[back].output[0]
    return Core("group_norm", nodes_t, x, 1, core.seeds, (r, *core.row_values[1:]), exposable=frozenset({dst}),
                constants=_constants_of(view, nodes_t), groups=groups, inner_shape=tuple(inner),
                bridges=((src, dst),))


GN_RESHAPE = "InstanceNormalization not of x reshaped to [N, groups, -1] and back (a GroupNorm as torch exports it)"


def _instance_group_norm(view: GraphView, i: int, pattern: Pattern) -> Core | str | None:
    """torch.onnx.export's nn.GroupNorm (opsets 13 to 21): Reshape(x, [0, G, -1]) ->
    InstanceNormalization(ones[G], zeros[G]) -> Reshape(to Shape(x) or x's constant shape);
    its gamma and beta, a Mul and an Add of [C, 1, 1], are epilogue nodes. An
    InstanceNormalization of anything else is not a GroupNorm: None (not reported: the
    rows kind does not fuse instance norms)."""
    n = view.nodes[i]
    r1 = view.producer.get(n.input[0])
    if r1 is None or _single_reader(view, n.input[0]) != i:
        return None
    x = view.nodes[r1].input[0]
    x_shape = view.shapes.get(x)
    target = _reshape_target(view, r1)
    if target is None or x_shape is None or len(x_shape) < 2 or len(target) != 3:
        return None
    groups = target[1]
    trail = x_shape[1:]
    size = int(np.prod(trail)) // groups if groups > 0 and all(isinstance(d, int) for d in trail) else None
    if target[0] not in (0, x_shape[0]) or target[2] not in (-1, size) or groups <= 0:
        return None
    r2 = _single_reader(view, n.output[0])
    if r2 is None or view.nodes[r2].op_type != "Reshape" or view.nodes[r2].domain not in DEFAULT_DOMAINS:
        return None
    y = view.nodes[r2].output[0]
    if not same_shape(view.shapes.get(y), x_shape):
        return GN_RESHAPE
    nodes = [r1, i, r2]
    back = view.nodes[r2].input[1]
    sh = view.producer.get(back)
    if sh is not None:  # Shape(x), read by this Reshape only
        s = view.nodes[sh]
        if (s.op_type != "Shape" or s.input[0] != x or node_attrs(s).get("start", 0) != 0 or "end" in node_attrs(s)
                or _single_reader(view, back) != r2):
            return GN_RESHAPE
        nodes.append(sh)
    elif _reshape_target(view, r2) != list(x_shape):
        return GN_RESHAPE
    affine = (n.input[1], n.input[2])
    eps = float(node_attrs(n).get("epsilon", 1e-5))
    return _group_norm_core(view, x, y, groups, eps, affine, True, tuple(sorted(nodes)), pattern)


def _softmax_op(view: GraphView, i: int, pattern: Pattern, reduction: str) -> Core | str:
    """Softmax / LogSoftmax: from opset 13 over one axis, which must be the last; before 13
    over the dims from `axis` on, flattened (the coerced 2-D semantics): rows of the same
    kind either way."""
    n = view.nodes[i]
    x, y = n.input[0], n.output[0]
    shape = _check_x(view, x, pattern)
    if isinstance(shape, str):
        return shape
    opset = view.opset or 13
    axis = node_attrs(n).get("axis", -1 if opset >= 13 else 1)
    if not -len(shape) <= axis < len(shape):
        return f"axis {axis} is out of range"
    axis %= len(shape)
    if opset >= 13 and axis != len(shape) - 1:
        return NOT_LAST
    return Core(reduction, (i,), x, axis, (y,), (y,), exposable=frozenset({y}))


def _row_stat(view: GraphView, r: int, x_shape: Shape) -> tuple[str, list[int]] | None:
    """The tensor the rest of a written-out softmax reads for reduction r's per-row value,
    and the nodes between: r's output itself (keepdims 1), or after keepdims 0 the Reshape to
    x's shape with the last dim 1 and an Expand to that shape or x's (jax2tf's way back), and
    for the max a Max with -inf (or the lowest float: it changes nothing but an all -inf row,
    NaN either way) before them. None when it goes another way."""
    t, nodes = view.nodes[r].output[0], []

    def only(name: str) -> int | None:
        c = view.consumers.get(name, [])
        return c[0] if len(c) == 1 and name not in view.graph_outputs else None

    kept = (*x_shape[:-1], 1)
    c = only(t)
    if c is not None and view.nodes[c].op_type == "Max" and len(view.nodes[c].input) == 2:
        other = next(a for a in view.nodes[c].input if a != t) if t in view.nodes[c].input else None
        low = view.scalar_constant(other) if other else None
        if low is not None and low <= -3.0e38:
            t, nodes = view.nodes[c].output[0], [c]
            c = only(t)
    if node_attrs(view.nodes[r]).get("keepdims", 1):
        return t, nodes
    if c is None or view.nodes[c].op_type != "Reshape":
        return None
    if not same_shape(view.shapes.get(view.nodes[c].output[0]), kept):
        return None
    t, nodes = view.nodes[c].output[0], nodes + [c]
    c = only(t)
    if c is not None and view.nodes[c].op_type == "Expand":
        out = view.shapes.get(view.nodes[c].output[0])
        if same_shape(out, kept) or same_shape(out, x_shape):
            t, nodes = view.nodes[c].output[0], nodes + [c]
    return t, nodes


def _only_readers(view: GraphView, name: str, allowed: set[int]) -> bool:
    return name not in view.graph_outputs and set(view.consumers.get(name, [])) <= allowed


def _decomposed_softmax(view: GraphView, r_max: int, pattern: Pattern) -> Core | str | None:
    """A softmax written out, as jax2tf and hand-written code write it: ReduceMax(x) ->
    Sub(x, max) -> Exp -> ReduceSum over the same axes -> Div(exp, sum) or Mul(exp,
    Reciprocal(sum)); with keepdims 0 each statistic goes back through a Reshape (and an
    Expand), the max through a Max with -inf (`_row_stat`; Google's Magika on PyPI). The
    same rows as the Softmax op: the kernel's softmax is the row value, the nodes are the
    body. None when ReduceMax r_max starts no such chain (an exp without the max subtracted
    is not taken: its overflow is the graph's own)."""
    n = view.nodes[r_max]
    x = n.input[0]
    shape = view.shapes.get(x)
    if not shape:
        return None
    got = _row_stat(view, r_max, shape)
    if got is None:
        return None
    mx, nodes = got
    nodes = [r_max, *nodes]
    subs = [c for c in view.consumers.get(mx, []) if view.nodes[c].op_type == "Sub"
            and list(view.nodes[c].input) == [x, mx] and view.nodes[c].domain in DEFAULT_DOMAINS]
    if len(subs) != 1:
        return None
    exps = [c for c in view.consumers.get(view.nodes[subs[0]].output[0], []) if view.nodes[c].op_type == "Exp"]
    if len(exps) != 1:
        return None
    e = view.nodes[exps[0]].output[0]
    sums = [c for c in view.consumers.get(e, []) if view.nodes[c].op_type == "ReduceSum"
            and view.nodes[c].domain in DEFAULT_DOMAINS]
    if len(sums) != 1:
        return None
    got = _row_stat(view, sums[0], shape)
    if got is None:
        return None
    total, between = got
    nodes += [subs[0], exps[0], sums[0], *between]
    outs = []
    for c in view.consumers.get(e, []):
        cn = view.nodes[c]
        if c == sums[0]:
            continue
        if cn.op_type == "Div" and list(cn.input) == [e, total]:
            nodes.append(c)
            outs.append(cn.output[0])
        elif cn.op_type == "Mul" and e in cn.input:
            other = cn.input[1] if cn.input[0] == e else cn.input[0]
            p = view.producer.get(other)
            if p is not None and view.nodes[p].op_type == "Reciprocal" and view.nodes[p].input[0] == total:
                nodes += [p, c]
                outs.append(cn.output[0])
    if len(outs) != 1:
        return None
    y = outs[0]
    checked = _check_x(view, x, pattern)
    if isinstance(checked, str):
        return checked
    last = (len(shape) - 1,)
    for r in (r_max, sums[0]):
        axes = _reduce_axes(view, r)
        if isinstance(axes, str):
            return axes.replace("ReduceMean", view.nodes[r].op_type)
        if tuple(sorted(a % len(shape) for a in (axes or range(len(shape))))) != last:
            return NOT_LAST
    inside = set(nodes)
    if any(not _only_readers(view, o, inside) for k in inside for o in view.nodes[k].output if o != y):
        return STAT_OUTSIDE
    nodes = sorted(inside)
    return Core("softmax", tuple(nodes), x, len(shape) - 1, (y,), (y,), exposable=frozenset({y}),
                constants=_constants_of(view, nodes))


# ---------------------------------------------------------------------------------------
# Growing the prologue and the epilogue
# ---------------------------------------------------------------------------------------

def input_mode(view: GraphView, name: str, x_shape: Shape, axis: int) -> str | None:
    """How the kernel reads tensor `name` against x's shape (codegen_rows.INPUT_MODES), or
    None when it cannot: it enlarges x, or varies within the normalized dims without
    spanning them."""
    shape = view.shapes.get(name)
    if shape is None:
        return None
    if same_shape(shape, x_shape):
        return "full"
    if all(d == 1 for d in shape):
        return "scalar"
    if not broadcasts_to(shape, x_shape):
        return None
    aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
    lead, trail = aligned[:axis], aligned[axis:]
    spans = all(d is not None and d == t for d, t in zip(trail, x_shape[axis:], strict=True))
    if not spans and not all(d == 1 for d in trail):
        return None
    return "last" if spans and all(d == 1 for d in lead) else "strided"


def group_input_mode(view: GraphView, name: str, x_shape: Shape) -> str | None:
    """How a group_norm kernel reads tensor `name` against x's shape [N, C, spatial...]
    (codegen_rows.GROUP_INPUT_MODES), or None: anything that varies along the spatial dims
    without being x's shape."""
    shape = view.shapes.get(name)
    if shape is None:
        return None
    if same_shape(shape, x_shape):
        return "full"
    if all(d == 1 for d in shape):
        return "scalar"
    if not broadcasts_to(shape, x_shape):
        return None
    aligned = (1,) * (len(x_shape) - len(shape)) + tuple(shape)
    if any(d != 1 for d in aligned[2:]):
        return None
    per_image, per_channel = aligned[0] != 1, aligned[1] != 1
    return "batch_channel" if per_image and per_channel else "channel" if per_channel else "batch"


def x_shaped(view: GraphView, core: Core, name: str, x_shape: Shape) -> bool:
    """Tensor `name` (an epilogue node's output) has x's shape. For a group norm also when its
    symbolic dims are named apart from x's (a graph output of torch's dynamic export: the
    node's operands broadcast to x, so its output is x's shape whatever the name)."""
    shape = view.shapes.get(name)
    if same_shape(shape, x_shape):
        return True
    if not core.groups or shape is None or len(shape) != len(x_shape):
        return False
    return all(d == t or (isinstance(d, str) and isinstance(t, str)) for d, t in zip(shape, x_shape, strict=True))


def core_input_mode(view: GraphView, core: Core, name: str, x_shape: Shape) -> str | None:
    """How the core's kernel reads tensor `name` (the op's own inputs as the core says)."""
    if core.reduction == "group_norm":
        return dict(core.op_modes).get(name) or group_input_mode(view, name, x_shape)
    return input_mode(view, name, x_shape, core.axis)


@dataclass
class _Growth:
    view: GraphView
    pattern: Pattern
    core: Core
    x_shape: Shape
    row_shape: Shape
    taken: set[int]
    allowed_reserved: str | None  # the ORT fusion whose nodes may join (the core's own)
    reserved: dict[int, str]
    others: frozenset[int] = frozenset()  # the nodes of every reduction's core in the graph
    prologue: set[int] = field(default_factory=set)
    epilogue: set[int] = field(default_factory=set)

    def candidate(self, i: int) -> bool:
        v, m = self.view, self.pattern.match
        n = v.nodes[i]
        if i in self.taken or i in self.core.nodes or n.domain not in DEFAULT_DOMAINS or n.op_type not in m.ops:
            return False
        if i in self.others:  # (an RMSNorm's square after a residual add: the next norm's, not this epilogue's)
            return False
        if i in self.reserved and self.reserved[i] != self.allowed_reserved:
            return False
        return check_node(v, i, self.pattern) is None

    def mode(self, name: str) -> str | None:
        return core_input_mode(self.view, self.core, name, self.x_shape)

    def x_shaped(self, name: str) -> bool:
        return x_shaped(self.view, self.core, name, self.x_shape)

    def grow_epilogue(self) -> None:
        """Every pointwise node reachable from the core's seeds whose operands are the
        core's values, epilogue values or tensors the kernel can read, and whose output
        has x's shape or one value per row."""
        v, core = self.view, self.core
        inside = set(core.seeds)
        readable = inside | set(core.row_values)
        work = list(core.seeds)
        while work:
            t = work.pop()
            for c in v.consumers.get(t, ()):
                if c in self.epilogue or not self.candidate(c):
                    continue
                out = v.nodes[c].output[0]
                if not (self.x_shaped(out) or same_shape(v.shapes.get(out), self.row_shape)
                        or same_shape(v.shapes.get(out), core.inner_shape)):
                    continue
                if all(name in readable or self.mode(name) is not None for _, name in operands(v, c)):
                    self.epilogue.add(c)
                    readable.add(out)
                    work.append(out)
                    for src, dst in core.bridges:  # through the Reshape back to x's shape
                        if src == out:
                            readable.add(dst)
                            work.append(dst)

    def grow_prologue(self) -> None:
        """The pointwise nodes of x's shape that compute x (through their producers), minus
        those whose results are read elsewhere than in the prologue (x itself may be)."""
        v, x = self.view, self.core.x
        p = v.producer.get(x)
        if p is None or not self.candidate(p):
            return
        group = {p}
        work = [p]
        while work:
            i = work.pop()
            for _, name in operands(v, i):
                q = v.producer.get(name)
                if q is None or q in group or not self.candidate(q) or q in self.epilogue:
                    continue
                if same_shape(v.shapes.get(v.nodes[q].output[0]), self.x_shape):
                    group.add(q)
                    work.append(q)
        while True:  # only x may leave the prologue: drop the others read outside, with their producers
            leaving = {i for i in group if v.nodes[i].output[0] != x
                       and (v.nodes[i].output[0] in v.graph_outputs
                            or any(c not in group for c in v.consumers.get(v.nodes[i].output[0], ())))}
            if not leaving:
                break
            stack = list(leaving)
            while stack:
                i = stack.pop()
                if i in group:
                    group.discard(i)
                    stack += [v.producer[name] for _, name in operands(v, i) if v.producer.get(name) in group]
        # every operand read where the kernel can read it
        if all(self.mode(name) is not None for i in group for _, name in operands(v, i)
               if v.producer.get(name) not in group):
            self.prologue = group


def _members(g: _Growth) -> list[int]:
    return sorted(set(g.core.nodes) | g.prologue | g.epilogue)


def match_rows(view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
               reserved: dict[int, str]) -> MatchResult:
    """Matches of a rows pattern in topological order of their anchors; adds their nodes to
    `taken` and `accepted`. The result's `anchors` say why each other anchor (normalization
    or softmax node not already taken) did not match, its `notes` which rule of ONNX
    Runtime's fusions a match followed. `reserved` (node -> reason, from
    `onnxfuse.ort_fusions`; empty without leave_to_ort) says what ONNX Runtime fuses itself."""
    m: RowsParams = pattern.match
    result = MatchResult()
    reasons = result.anchors
    others = frozenset().union(*(c.nodes for c in reduction_cores(view, pattern, taken)))
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type not in m.anchors:
            continue
        core = find_core(view, i, pattern)
        if core is None:
            continue
        if isinstance(core, Core) and any(c in taken for c in core.nodes):
            continue
        found = core if isinstance(core, str) else _match(view, pattern, core, taken, accepted, reserved, others)
        if isinstance(found, str):
            anchors = _anchor_nodes(view, i) if isinstance(core, str) else core.nodes
            for c in anchors:
                if view.nodes[c].op_type in m.anchors:
                    reasons[c] = found
            continue
        result.matches.append(found)
        if found.params.note:
            result.notes[found.params.note] += len(found.nodes)
        taken.update(found.nodes)
        accepted.add(list(found.nodes))
    return result


def reduction_cores(view: GraphView, pattern: Pattern, taken: set[int]) -> list[Core]:
    """Every normalization and softmax core in the graph, of any rows pattern's reductions, whose
    nodes are not taken: no match's prologue or epilogue takes another's core nodes (Gemma 2's
    post-attention norm ends in a residual add whose square, Pow(h, 2), begins the next norm: in
    the first norm's epilogue it would leave the second one's mean unfusable)."""
    every = dataclasses.replace(pattern, match=dataclasses.replace(pattern.match,
                                                                   reductions=frozenset(REDUCTION_ANCHORS)))
    anchors = every.match.anchors
    cores = [find_core(view, i, every) for i, n in enumerate(view.nodes) if i not in taken and n.op_type in anchors]
    return [c for c in cores if isinstance(c, Core) and not any(i in taken for i in c.nodes)]


def _anchor_nodes(view: GraphView, i: int) -> tuple[int, ...]:
    """Node i, and the variance's ReduceMean when node i is a decomposed LayerNorm's mean (the
    reduction of x * x in the moments form)."""
    moments = _moments_of(view, i)
    if moments is not None:
        return (i, moments)
    parts = _layer_norm_parts(view, i) if _is_reduce_mean(view, i) else None
    return (i,) if parts is None else (i, parts[2])


def _match(view: GraphView, pattern: Pattern, core: Core, taken: set[int], accepted: Accepted,
           reserved: dict[int, str], others: frozenset[int] = frozenset()) -> Match | str:
    x_shape = view.shapes[core.x]
    # (a group norm's statistics have no shape of x's rank: no epilogue node is per row, but in
    # the decomposed form's [N, G, L] part, per [N, G, 1])
    if core.groups:
        row_shape = (*core.inner_shape[:2], 1) if core.inner_shape else x_shape
    else:
        row_shape = tuple(x_shape[:core.axis]) + (1,) * (len(x_shape) - core.axis)
    for name in core.op_inputs:
        if core_input_mode(view, core, name, x_shape) is None:
            return NOT_BROADCAST
    ort = reserved
    own = next((ort[c] for c in core.nodes if c in ort), None)
    g = _Growth(view, pattern, core, x_shape, row_shape, taken, own, ort, others)
    g.grow_epilogue()
    g.grow_prologue()
    while True:
        group = _members(g)
        tainted = reentering(view, group, accepted)
        if not tainted:
            break
        if tainted & set(core.nodes):
            return CYCLE
        g.epilogue -= tainted
        if tainted & g.prologue:  # a prologue without its producer of x is none
            g.prologue = set()
    members = set(group)
    # what leaves: the epilogue's tensors of x's shape, x itself; never a statistic
    outputs: list[str] = []
    x_output = False
    for i in group:
        for o in view.nodes[i].output:
            if not o or not (o in view.graph_outputs or any(c not in members for c in view.consumers.get(o, ()))):
                continue
            if i in g.prologue:
                x_output = True  # (grow_prologue leaves only x readable outside)
            elif i in core.nodes and o not in core.exposable:
                return STAT_OUTSIDE
            elif not x_shaped(view, core, o, x_shape):
                return STAT_OUTSIDE
            else:
                outputs.append(o)
    if not outputs:
        return "its result is never used"
    for o in outputs:
        if view.types.get(o) not in FLOAT_TYPES:
            return dtype_reason(view.types.get(o))
    if len(core.nodes) == 1 and len(g.prologue) + len(g.epilogue) < pattern.match.min_nodes:
        return LONE  # (a written-out norm or softmax is worth one kernel on its own)
    note, measured_only = "", False
    if own is not None:  # (reserved is empty without leave_to_ort)
        if not all(i in ort for i in group):
            note = taken_from_ort(own)
        elif own in offered_reasons(reserved):
            measured_only = True  # the tune pass times it against ORT's fusion; kept only if faster
        else:
            return left_to_ort(own)
    parts = RowsParts(core, tuple(sorted(g.prologue)), tuple(sorted(g.epilogue)), x_output, note)
    return Match(pattern, tuple(group), tuple(outputs) + ((core.x,) if x_output else ()), params=parts,
                 measured_only=measured_only)


# ---------------------------------------------------------------------------------------
# Lowering: the node's parts
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowsInfo:
    """What a FusedRows node's kernel needs besides the epilogue program (FusedNode.rows)."""

    reduction: str
    prologue: Program
    axis: int
    n_cols: int | None
    x_output: bool
    groups: int = 0  # group_norm: the groups, x's channels and rank
    channels: int = 0
    x_rank: int = 0


def lower_rows(view: GraphView, m: Match, names: set[str] | None = None, graph: GraphProto | None = None
               ) -> Lowering:
    """The FusedRows node of a match (docs/format.md): inputs the prologue's, then the
    epilogue's extras; attribute `program` the epilogue; the body every node of the match."""
    parts: RowsParts = m.params
    core = parts.core
    x_shape = view.shapes[core.x]
    fixed_x = [] if parts.prologue else [(core.x, ir_dtype(view, core.x))]
    prologue, p_inputs, folded = lower_nodes(view, parts.prologue, (core.x,), fixed_x, store_pass_through=False)
    fixed = [(name, "f32") for name in core.row_values]
    fixed += [(name, ir_dtype(view, name)) for name in core.op_inputs]
    epi_outputs = m.outputs[:-1] if parts.x_output else m.outputs
    epi_view = view
    if core.bridges:  # the epilogue reads the Reshape back's input where the graph reads its output
        back = {dst: src for src, dst in core.bridges}
        epi_view = dataclasses.replace(view, nodes=list(view.nodes))
        for i in parts.epilogue:
            n = NodeProto()
            n.CopyFrom(view.nodes[i])
            for k, name in enumerate(n.input):
                n.input[k] = back.get(name, name)
            epi_view.nodes[i] = n
        epi_outputs = tuple(back.get(o, o) for o in epi_outputs)
    epilogue, e_inputs, folded2 = lower_nodes(epi_view, parts.epilogue, epi_outputs, fixed, core.prelude,
                                              set(core.seeds), store_pass_through=False)
    extras = e_inputs[len(core.row_values):]
    folded = {**folded, **folded2, **dict.fromkeys(core.constants)}
    inputs = [*p_inputs, *extras]
    modes = tuple(core_input_mode(view, core, name, x_shape) for name in inputs)
    trail = x_shape[core.axis:]
    n_cols = int(np.prod(trail, dtype=np.int64)) if all(isinstance(d, int) for d in trail) else None
    channels = 0
    if core.groups:
        channels = int(x_shape[1])
        n_cols = n_cols // core.groups if n_cols is not None else None
        inputs = _expand_per_group(view, core, inputs, channels, names, graph)
    info = RowsInfo(core.reduction, prologue, core.axis, n_cols, parts.x_output, core.groups, channels, len(x_shape))
    attrs = {"prologue": prologue.to_text(), "reduction": core.reduction, "axis": core.axis,
             "x_output": int(parts.x_output)}
    if core.groups:
        attrs["groups"] = core.groups
    key = f"rows {prologue.to_text()} N={n_cols} modes={','.join(modes)}"  # besides the programs and the body
    return Lowering(epilogue, folded, inputs, [view.nodes[i] for i in m.nodes], attrs, key, core.axis, modes,
                    {"params": info})


def _expand_per_group(view: GraphView, core: Core, inputs: list[str], channels: int, names: set[str] | None,
                      graph: GraphProto | None) -> list[str]:
    """The node's inputs with each constant GroupNormalization scale or bias replaced by a new
    initializer of one value per channel, [C, 1, ...] (a [G] one repeated per channel of its
    group); the function body still reads the original (a Constant node: `core.constants`)."""
    if not core.expand:
        return inputs
    if graph is None or names is None:
        raise ValueError("a GroupNormalization scale or bias needs the graph to add its per-channel copy to")
    out = list(inputs)
    rank = len(view.shapes[core.x])
    for name in core.expand:
        a = numpy_helper.to_array(view.constants[name]).reshape(-1)
        a = np.repeat(a, channels // a.size).reshape((channels,) + (1,) * (rank - 2))
        new = unique_name(f"{name}.per_channel", names)
        graph.initializer.append(numpy_helper.from_array(a, new))
        out = [new if t == name else t for t in out]
    return out


# ---------------------------------------------------------------------------------------
# The kind
# ---------------------------------------------------------------------------------------

# A GroupNorm node with one input of x's shape (input 0) and one output turns channels-last
# in the NHWC pass as a pool does: X and Y together, its other inputs as they are.
GROUP_NORM_LAYOUTS = NodeLayouts(y_follows_x=True)


class Rows(Kind):
    """A match is a normalization or softmax over the trailing dims of its input x (its
    core), the pointwise ops that compute x (prologue) and those after it (epilogue), as the
    module docstring says; each normalization or softmax that does not fuse is reported with
    the reason."""

    name = "rows"
    op_type = "FusedRows"
    match_kind = "row_reduction"
    params = frozenset({"reductions", "min_nodes"})
    # the candidates (`rows_candidates`) are timed with `--tune` only: on the H200 (twenty-second
    # session, BERT-base b8 fp16) the one warp a row that tuning chose timed 2.56 µs alone and
    # 3.15 in the model, no faster there than the heuristic's 4 warps (FusedRows 78.5 µs for 25
    # against 78.3), while it beat ORT's SkipLayerNormalization alone (3.46) and lost to it in
    # the model (2.75): `rows-candidates`
    search_configs = False

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> RowsParams:
        """reductions (any of layer_norm, rms_norm, softmax, log_softmax), min_nodes (default
        1: prologue and epilogue nodes besides the reduction's own)."""
        reductions = m.get("reductions", list)
        if not reductions:
            m.fail("match.reductions", "must name at least one reduction")
        for r in reductions:
            if r not in REDUCTIONS:
                m.fail("match.reductions", f"{r!r} is not one of {', '.join(REDUCTIONS)}")
        min_nodes = m.get("min_nodes", int, 1)
        if min_nodes < 0:
            m.fail("match.min_nodes", "must be at least 0")
        return RowsParams(frozenset(reductions), ops, dtypes, min_nodes)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_rows(view, pattern, taken, accepted, reserved)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        return lower_rows(view, match, names, graph)

    def node_layouts(self, f: FusedNode) -> NodeLayouts | None:
        """A GroupNorm whose only input of x's shape is input 0 (x, 4-D) and that has one output
        takes the NHWC pass's layouts as a pool (X and Y together); other nodes do not."""
        r: RowsInfo = f.params
        if r.reduction != "group_norm" or r.x_output or len(f.outputs) != 1 or r.x_rank != 4:
            return None
        modes = f.input_modes
        return GROUP_NORM_LAYOUTS if modes[:1] == ("full",) and "full" not in modes[1:] else None

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> RowsSpec:
        r: RowsInfo = f.params
        return RowsSpec(f.kernel_name, r.reduction, r.prologue, f.program, f.input_modes, r.axis, r.n_cols,
                        r.x_output, f.source_nodes, r.groups, r.channels, f.x_layout == "nhwc", f.round_y)

    def may_store_tf32(self, spec: RowsSpec) -> bool:
        """A float32 output 0 (a LayerNorm before Q, K and V) may be stored rounded to TF32 for
        "tf32" GEMMs that read it (onnxfuse.rounding: only where every reader rounds it)."""
        return spec.program.outputs[0][1] == "f32"

    def variants(self, spec: RowsSpec) -> tuple[RowsVariant, ...]:
        return rows_variants(spec)

    def candidates(self, spec: RowsSpec) -> list[tuple[str, tuple]]:
        return rows_candidates(spec)

    def generate(self, spec: RowsSpec, variant: RowsVariant) -> KernelSource:
        return generate_rows(spec, variant)

    def kernel_meta(self, spec: RowsSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION, "kind": "rows", "name": spec.name, "reduction": spec.reduction,
            "axis": spec.lead_rank, "n_prologue": spec.n_prologue, "n_extras": spec.n_extras,
            "input_modes": list(spec.input_modes), "x_output": int(spec.x_output),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
            **({"groups": spec.groups, "channels": spec.channels, "channels_last": int(spec.channels_last)}
               if spec.reduction == "group_norm" else {}),
        }

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Prologue, statistics in float64, epilogue (docs/format.md, "FusedRows")."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        prologue = Program.from_text(attrs["prologue"].decode())
        epilogue = Program.from_text(attrs["program"].decode())
        return evaluate_rows(attrs["reduction"].decode(), prologue, epilogue, inputs, int(attrs["axis"]),
                             bool(attrs.get("x_output", 0)), int(attrs.get("groups", 0)),
                             attrs.get("x_layout", b"NCHW") == b"NHWC")


def group_stats(x: np.ndarray, groups: int, channels_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Mean and biased variance (of x - mean) per (image, group) in float64, one value per
    channel: [N, C, 1, ...] for x [N, C, spatial...], [N, 1, ..., C] for channels-last x
    [N, spatial..., C]."""
    x64 = x.astype(np.float64)
    n = x.shape[0]
    c = x.shape[-1] if channels_last else x.shape[1]
    g = x64.reshape(n, -1, groups, c // groups) if channels_last else x64.reshape(n, groups, -1)
    axes = (1, 3) if channels_last else (2,)
    with np.errstate(all="ignore"):
        mean = g.mean(axis=axes, keepdims=True)
        var = ((g - mean) ** 2).mean(axis=axes, keepdims=True)
    keep = [1] * x.ndim
    keep[0] = n
    keep[-1 if channels_last else 1] = c
    per_channel = [np.repeat(s.reshape(n, groups), c // groups, axis=1).reshape(keep) for s in (mean, var)]
    return per_channel[0], per_channel[1]


def to_channels_last(a: np.ndarray, rank: int) -> np.ndarray:
    """A tensor that broadcasts to [N, C, spatial...] (rank `rank`), with its channel dim
    moved last: how it broadcasts to channels-last x."""
    a = a.reshape((1,) * (rank - a.ndim) + a.shape)
    return np.moveaxis(a, 1, -1)


def row_values(reduction: str, x: np.ndarray, axis: int, groups: int = 0,
               channels_last: bool = False) -> list[np.ndarray]:
    """The values a reduction gives the epilogue (codegen_rows.ROW_VALUES), as float32 arrays
    that broadcast to x: x itself, then per-row statistics (computed in float64) with the
    normalized dims kept as 1 (group_norm: one value per channel); or the softmax."""
    if reduction == "group_norm":
        mean, var = group_stats(x, groups, channels_last)
        return [x.astype(np.float32), mean.astype(np.float32), var.astype(np.float32)]
    trail = tuple(range(axis, x.ndim))
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        if reduction == "layer_norm":
            mean = x64.mean(axis=trail, keepdims=True)
            var = ((x64 - mean) ** 2).mean(axis=trail, keepdims=True)
            return [x.astype(np.float32), mean.astype(np.float32), var.astype(np.float32)]
        if reduction == "rms_norm":
            return [x.astype(np.float32), (x64 * x64).mean(axis=trail, keepdims=True).astype(np.float32)]
        m = np.max(x64, axis=trail, keepdims=True)
        m = np.where(np.isnan(x64).any(axis=trail, keepdims=True), np.nan, m)
        e = np.exp(x64 - m)
        s = e.sum(axis=trail, keepdims=True)
        y = e / s if reduction == "softmax" else (x64 - m) - np.log(s)
        return [y.astype(np.float32)]


def evaluate_rows(reduction: str, prologue: Program, epilogue: Program, inputs: list[np.ndarray], axis: int,
                  x_output: bool = False, groups: int = 0, channels_last: bool = False) -> list[np.ndarray]:
    """A FusedRows node's outputs for `inputs` (the prologue's, then the epilogue's extras).
    channels_last (group_norm): x and the inputs of its shape are stored [N, spatial..., C],
    the other inputs have their NCHW shapes (docs/format.md)."""
    p = len(prologue.input_dtypes)
    if channels_last:
        full = max((a.shape for a in inputs[:p]), key=lambda sh: int(np.prod(sh)))  # x's, stored NHWC
        inputs = [a if a.shape == full else to_channels_last(a, len(full)) for a in inputs]
    (x,) = evaluate(prologue, inputs[:p])
    values = row_values(reduction, x, axis, groups, channels_last)
    outs = [np.broadcast_to(o, x.shape).copy() for o in evaluate(epilogue, [*values, *inputs[p:]])]
    return outs + ([x] if x_output else [])


assert set(ROW_VALUES) == set(REDUCTION_ANCHORS)
