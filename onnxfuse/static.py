"""Static shapes: fix a model's input dims and fold the shape arithmetic they decide.

Exporters write shape computations into the graph: Shape -> Gather -> Unsqueeze -> Concat ->
Reshape, a Slice whose ends come from a Shape, Range / ConstantOfShape sized by one. ONNX
Runtime runs these small integer nodes on the CPU (their outputs are read by the host), so a
model with them cannot be captured in a CUDA graph ("not all nodes partitioned to the CUDA
EP"), and every run pays for the copies. When the user names the input shapes (`optimize
--shape`), they are constants: `fold_shape_arithmetic` fixes the graph inputs to those dims,
infers every tensor's shape, and replaces each node whose value then follows from constants
alone (Shape and Size of a tensor of static shape, then anything whose inputs are all known
and small) by an initializer, evaluated with ONNX's reference implementation.

Only small values are folded (at most MAX_ELEMENTS per output: shapes, indices, scalars);
nodes that would make large constants (a ConstantOfShape filling an activation-sized
tensor) stay nodes. Subgraphs (If / Loop bodies) are not entered. The model is then valid for
those input shapes only, which its inputs now say: another shape fails in ONNX Runtime's
input check instead of computing with stale shapes.

Without `--shape`, `fold_known_dims` folds what a dynamic model's own static dims decide (a
Shape, or a Gather of one, holding only known dims: the head dim of [batch, heads, seq, 64]),
leaving its symbolic dims symbolic and what an If's condition or a Loop's count depends on
alone. Both folds also drop what the known dims make a no-op (a Slice of a whole axis, a Concat
input empty along its axis) and the shape arithmetic nothing reads any more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import ModelProto, helper, numpy_helper

from onnxfuse import ir
from onnxfuse.dims import factors as dim_factors
from onnxfuse.errors import OnnxfuseError
from onnxfuse.load import default_opset, infer_light, light_copy
from onnxfuse.tools.shapes import input_dims, with_input_dims

MAX_ELEMENTS = 4096
# Ops evaluated when all their inputs are known: integer and shape arithmetic, data movement
# of small tensors. Anything random, stateful or with subgraphs is left alone.
FOLDABLE = frozenset({
    "Shape", "Size", "Gather", "GatherElements", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Reshape",
    "Flatten", "Identity", "Transpose", "Expand", "Tile", "Range", "ConstantOfShape", "Constant", "Add", "Sub",
    "Mul", "Div", "Mod", "Neg", "Abs", "Floor", "Ceil", "Min", "Max", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "Not", "And", "Or", "Where", "ReduceProd", "ReduceSum", "ReduceMin", "ReduceMax",
    "Sqrt", "Split", "Pow",
})


@dataclass
class Folded:
    """What `fold_shape_arithmetic` did: the inputs' dims and the nodes it replaced."""

    inputs: dict[str, tuple[int, ...]]
    nodes: Counter = field(default_factory=Counter)  # op type -> nodes folded
    # what the dims make a no-op: Slices of a whole axis (now Identity), Concat inputs of size 0
    # along its axis (dropped): Phi-3's rotary split q[..., :d], q[..., d:] with every dim rotated
    noops: Counter = field(default_factory=Counter)
    anchored: int = 0  # Shapes of computed tensors that read the graph inputs' named dims instead

    def done(self) -> int:
        return sum(self.nodes.values()) + sum(self.noops.values())

    def noops_text(self) -> str:
        return ", ".join(f"{k} {what}" for what, k in (("Slices of a whole axis", self.noops["Slice"]),
                                                       ("empty Concat inputs", self.noops["Concat"])) if k)

    def summary(self) -> str:
        shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in self.inputs.items())
        noops = f"; dropped {self.noops_text()}" if self.noops_text() else ""
        if not self.nodes:
            return f"static shapes {shapes}: no shape arithmetic to fold{noops}"
        ops = ", ".join(f"{op} {n}" for op, n in self.nodes.most_common())
        return f"static shapes {shapes}: folded {sum(self.nodes.values())} nodes of shape arithmetic ({ops}){noops}"


def resolve_dims(model: ModelProto, shapes: dict[str, tuple[int, ...]], batch: int | None
                 ) -> tuple[dict[str, tuple[int, ...]] | None, str | None]:
    """Every input's dims from `--shape` (input names or dim names) and `--batch` (symbolic
    leading dims), as bench and tuning read them; (None, why) when a symbolic dim is left
    open (the model then stays dynamic)."""
    dims, notes = input_dims(model, shapes, batch)
    if notes:
        return None, f"not made static, a symbolic dim is not given: {notes[0]}"
    return dims, None


def fold_shape_arithmetic(model: ModelProto, dims: dict[str, tuple[int, ...]]) -> tuple[ModelProto, Folded]:
    """`model` with its inputs fixed to `dims` (input name -> dims, every non-initializer
    input) and its shape arithmetic folded into initializers (module docstring)."""
    inits = {t.name for t in model.graph.initializer}
    missing = [vi.name for vi in model.graph.input if vi.name not in inits and vi.name not in dims]
    if missing:
        raise OnnxfuseError(f"static shapes need every input's dims; missing: {', '.join(missing)}")
    m = with_input_dims(model, dims)
    report = Folded({vi.name: tuple(dims[vi.name]) for vi in m.graph.input if vi.name not in inits})
    for _ in range(MAX_ROUNDS):  # a folded Reshape target lets inference size what follows
        before = report.done()
        m = _fold_once(m, report)
        if report.done() == before:
            break
    return _fresh_value_info(m), report


def fold_known_dims(model: ModelProto) -> tuple[ModelProto, Folded]:
    """A dynamic model's shape arithmetic on its static dims folded: Shape(x) and the Gather of
    Shape(x) whose selected dims inference knows (a head dim of 64 in [batch, heads, seq, 64])
    become constants, and what follows from constants after them, as `fold_shape_arithmetic`
    folds it. The model keeps its inputs' dims: its symbolic dims stay symbolic. (A decoder with a
    key-value cache changes its shape every step: its rotary embedding's Slice at half the head
    dim, written as x.shape[-1] // 2, then has constant bounds.) Folds `model` in place (an
    Identity where a Slice takes a whole axis: `onnxfuse.load.remove_passthrough` drops them);
    returns it and what was folded (`Folded.inputs` empty)."""
    m = model
    report = Folded({})
    if not any(n.op_type in ("Shape", "Slice", "Concat") and n.domain in ("", "ai.onnx") for n in m.graph.node):
        return m, report  # (nothing to fold, no inference run)
    last: list[ModelProto] = []
    for _ in range(MAX_ROUNDS):
        before = report.done()
        m = _fold_once(m, report, partial=True, inferred_out=last)
        if report.done() == before:  # (then `last` holds this unchanged model's shapes)
            break
    _anchor_shape_reads(m, report, last[-1] if last else None)
    return m, report


def _anchor_shape_reads(m: ModelProto, report: Folded, inferred: ModelProto | None = None) -> None:
    """Shape reads of computed tensors whose dims the graph inputs name ("batch", "seq") read
    them from the graph inputs instead. A dynamic export's shape arithmetic reads its
    intermediates' shapes (the attention output's Reshape to [batch, seq, 768] takes batch and
    seq from Shape(q)): such a reader alone keeps a Transpose that a fused node would read
    through (the Transpose must then run). Gather(Shape(t), i) of named dims becomes a Gather of
    one Shape of the input (per input); a Shape whose other readers take it whole reads the input
    (Shape with start and end, or a Concat of such reads and sizes), unless a Reshape or Expand
    takes it as its shape (to t's shape: torch's GroupNorm export, which the rows kind reads so)
    or it is a graph output. In place; counts the rewritten reads in `report.anchored`.
    `inferred`: `m`'s shapes, when inferred already."""
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    inputs = {vi.name for vi in g.input}
    source: dict[str, tuple[str, int]] = {}  # a named input dim -> (the first graph input naming it, its axis)
    for vi in g.input:
        if vi.name not in inits and vi.type.tensor_type.HasField("shape"):
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                name = ir.dim_symbol(d)
                if name is not None and ir.known_dim(d) is None:
                    source.setdefault(name, (vi.name, axis))
    shapes = {i: n for i, n in enumerate(g.node) if n.op_type == "Shape" and n.domain in ("", "ai.onnx")
              and n.input[0] not in inits and n.input[0] not in inputs}
    if not source or not shapes:
        return
    if inferred is None:
        bare = light_copy(m)
        del bare.graph.value_info[:]
        inferred = infer_light(bare)
    dims = {vi.name: [ir.known_dim(d) if ir.known_dim(d) is not None else ir.dim_symbol(d)
                      for d in vi.type.tensor_type.shape.dim]
            for vi in [*inferred.graph.value_info, *inferred.graph.output]
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}
    names = {o for n in g.node for o in n.output} | inputs | set(inits) | {n.name for n in g.node}
    opset = default_opset(m) or 1
    held = {n.output[0]: _shape_slice(n, dims.get(n.input[0], [None])) for n in shapes.values()}
    whole: dict[str, str] = {}  # graph input -> the output of the one Shape of it the Gathers read
    first_nodes: list[onnx.NodeProto] = []
    moved: set[int] = set()

    def shape_of(x: str) -> str:  # the graph's own Shape(x) where it has one (moved first), else a new one
        if x not in whole:
            own = next((i for i, n in enumerate(g.node) if n.op_type == "Shape" and n.domain in ("", "ai.onnx")
                        and n.input[0] == x and not n.attribute), None)
            if own is not None:
                whole[x] = g.node[own].output[0]
                moved.add(own)
                first_nodes.append(g.node[own])
            else:
                whole[x] = _fresh(f"{x}_shape", names)
                first_nodes.append(helper.make_node("Shape", [x], [whole[x]], _fresh(f"{x}_Shape", names)))
        return whole[x]

    anchored = 0
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            if x in held:
                readers.setdefault(x, []).append(n)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for j, n in enumerate(g.node):  # Gather(Shape(t), constant indices), Slice(Shape(t), constant bounds)
        if n.domain not in ("", "ai.onnx") or not n.input or n.input[0] not in held:
            continue
        dims_held = held[n.input[0]]
        idx = _dims_taken(n, len(dims_held), lambda x: numpy_helper.to_array(inits[x]) if x in inits else None)
        if idx is None:
            continue
        picked = [dims_held[int(i)] for i in idx.reshape(-1)]
        factors = dim_factors(picked[0]) if len(picked) == 1 and isinstance(picked[0], str) else None
        if factors is not None and len(factors[1]) + (factors[0] != 1) > 1 and all(f in source for f in factors[1]):
            # one product of named dims and a size (B * H of merged heads): read each name, multiply
            replaced[j] = _product_read(n, idx.shape, factors, source, shape_of, names, g)
            anchored += 1
            continue
        reads = [source.get(d) if isinstance(d, str) else None for d in picked]
        if not reads or None in reads or len({r[0] for r in reads}) != 1:
            continue
        axes = _fresh(f"{n.name or n.output[0]}_axes", names)
        g.initializer.append(numpy_helper.from_array(
            np.array([r[1] for r in reads], np.int64).reshape(idx.shape), axes))
        if n.op_type == "Gather":
            n.input[0], n.input[1] = shape_of(reads[0][0]), axes
        else:
            replaced[j] = [helper.make_node("Gather", [shape_of(reads[0][0]), axes], [n.output[0]], n.name)]
        anchored += 1
    for i, n in shapes.items():  # a Shape something else still reads whole
        out = n.output[0]
        if not any(out in r.input for r in readers.get(out, ())) or out in {o.name for o in g.output}:
            continue  # (read by the Gathers alone, or a graph output: what the user reads stays as it is)
        if any(r.op_type in ("Reshape", "Expand") and r.input[1] == out for r in readers.get(out, ())):
            continue  # Reshape(y, Shape(t)), "as t": an idiom matchers read (torch's GroupNorm export)
        picked = held[out]
        if not picked or any(d is None or (isinstance(d, str) and d not in source) for d in picked) \
                or all(isinstance(d, int) for d in picked):
            continue
        reads = [source[d] if isinstance(d, str) else d for d in picked]
        first = reads[0]
        if all(isinstance(r, tuple) and r == (first[0], first[1] + k) for k, r in enumerate(reads)):
            # one input's consecutive dims: the Shape reads that input
            replaced[i] = _read_dims(first[0], first[1], len(reads), out, n.name, opset, names, g)
            anchored += 1
            continue
        parts, nodes = [], []
        for k, r in enumerate(reads):
            part = _fresh(f"{out}_dim{k}", names)
            if isinstance(r, int):
                g.initializer.append(numpy_helper.from_array(np.array([r], np.int64), part))
            else:
                nodes += _read_dims(r[0], r[1], 1, part, _fresh(f"{n.name}_dim{k}", names), opset, names, g)
            parts.append(part)
        nodes.append(helper.make_node("Concat", parts, [out], n.name, axis=0))
        replaced[i] = nodes
        anchored += 1
    if not anchored:
        return
    kept = [onnx.NodeProto() for _ in first_nodes]
    for k, n in zip(kept, first_nodes, strict=True):
        k.CopyFrom(n)
    for i, n in enumerate(g.node):
        if i not in moved:
            kept += replaced.get(i, [n])
    del g.node[:]
    g.node.extend(kept)
    dead = _unread(g, set())
    if dead:
        kept = [n for i, n in enumerate(g.node) if i not in dead]
        del g.node[:]
        g.node.extend(kept)
    report.anchored += anchored


def _dims_taken(n: onnx.NodeProto, rank: int, value: Callable[[str], np.ndarray | None]) -> np.ndarray | None:
    """The indices of a shape's dims (of `rank`) that node n reads from it: a Gather on axis 0
    with constant indices (`value` of a name: the constant, else None; its shape kept), a Slice
    with constant bounds and step 1 (1-D); None for other nodes."""
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "Gather":
        idx = value(n.input[1]) if len(n.input) > 1 else None
        if idx is None or attrs.get("axis", 0) != 0:
            return None
        if idx.dtype.kind not in "iu" or np.any(idx < -rank) or np.any(idx >= rank):
            return None
        return np.where(idx < 0, idx + rank, idx).astype(np.int64)
    if n.op_type != "Slice":
        return None
    if "starts" in attrs:  # opset 1-9
        bounds = [attrs["starts"], attrs["ends"], attrs.get("axes", [0]), [1]]
    else:
        bounds = [None if (c := value(x) if x else None) is None else c.reshape(-1).tolist()
                  for x in (*n.input[1:5], *[""] * (5 - len(n.input)))]
        if bounds[0] is None or bounds[1] is None or (len(n.input) > 3 and n.input[3] and bounds[2] is None) \
                or (len(n.input) > 4 and n.input[4] and bounds[3] is None):
            return None
        bounds[2] = bounds[2] if len(n.input) > 3 and n.input[3] else [0]
        bounds[3] = bounds[3] if len(n.input) > 4 and n.input[4] else [1]
    starts, ends, axes, steps = bounds
    if len(starts) != 1 or len(ends) != 1 or axes not in ([0], [-1]) or steps != [1]:
        return None
    lo, hi = (min(max(v + rank if v < 0 else v, 0), rank) for v in (starts[0], ends[0]))
    return np.arange(lo, hi, dtype=np.int64) if hi > lo else None


def _product_read(n: onnx.NodeProto, shape: tuple[int, ...], factors: tuple[int, list[str]],
                  source: dict[str, tuple[str, int]], shape_of, names: set[str],
                  g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes writing the output of node n (a Gather or Slice of one dim of a Shape; its
    indices' shape `shape`) as the product of `factors` (size, names): each name's dim read
    from the Shape of the input that names it."""
    nodes, acc = [], None
    for k, name in enumerate(factors[1]):
        x, axis = source[name]
        idx, out = _fresh(f"{n.input[1]}_factor{k}", names), _fresh(f"{n.output[0]}_factor{k}", names)
        g.initializer.append(numpy_helper.from_array(np.full(shape, axis, np.int64), idx))
        nodes.append(helper.make_node("Gather", [shape_of(x), idx], [out], _fresh(f"{n.name}_factor{k}", names)))
        if acc is not None:
            prod = _fresh(f"{n.output[0]}_product{k}", names)
            nodes.append(helper.make_node("Mul", [acc, out], [prod], _fresh(f"{n.name}_product{k}", names)))
            out = prod
        acc = out
    if factors[0] != 1:
        size = _fresh(f"{n.output[0]}_size", names)
        g.initializer.append(numpy_helper.from_array(np.array(factors[0], np.int64), size))
        nodes.append(helper.make_node("Mul", [acc, size], [n.output[0]], _fresh(f"{n.name}_size", names)))
    else:
        nodes[-1].output[0] = n.output[0]
    return nodes


def _read_dims(x: str, start: int, count: int, out: str, name: str, opset: int, names: set[str],
               g: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes writing dims start .. start + count of x's shape to `out`: a Shape with start and end
    (opset 15 on), else a Shape and a Gather of those indices."""
    if opset >= 15:
        return [helper.make_node("Shape", [x], [out], name, start=start, end=start + count)]
    whole, idx = _fresh(f"{out}_shape", names), _fresh(f"{out}_indices", names)
    g.initializer.append(numpy_helper.from_array(np.arange(start, start + count, dtype=np.int64), idx))
    return [helper.make_node("Shape", [x], [whole], _fresh(f"{name}_shape", names)),
            helper.make_node("Gather", [whole, idx], [out], name, axis=0)]


def _fresh(base: str, names: set[str]) -> str:
    name, k = base, 0
    while name in names:
        k += 1
        name = f"{base}_{k}"
    names.add(name)
    return name


def _fresh_value_info(m: ModelProto) -> ModelProto:
    """The exporter's value_info holds symbolic dims that the static inputs now decide: it
    is replaced by what inference gives at those inputs (kept as it is when inference fails)."""
    bare = light_copy(m)
    del bare.graph.value_info[:]
    inferred = infer_light(bare)
    if inferred is bare:  # inference failed
        return m
    del m.graph.value_info[:]
    m.graph.value_info.extend(inferred.graph.value_info)
    return m


# Rounds until nothing more folds. An exported decoder can need one per layer: GPT-2-small's
# TorchScript export at input_ids 1x128 folded one layer's shape arithmetic per round, 13 rounds
# in all (at 8, layers 7-11 kept theirs and their attention did not fuse). A round is shape
# inference on the model without its weights: 0.9 s for all 13 at that size (2-core CPU).
MAX_ROUNDS = 64


def _fold_once(m: ModelProto, report: Folded, partial: bool = False,
               inferred_out: list[ModelProto] | None = None) -> ModelProto:
    """One round: infer shapes, fold what follows from constants, count it in `report`.
    `partial`: also a Shape, or a Gather of a Shape, that reads only dims inference knows of a
    tensor whose other dims it does not (`fold_known_dims`). The shapes inferred are appended
    to `inferred_out` when given."""
    bare = light_copy(m)  # inference reads the weights' shapes, not their values
    del bare.graph.value_info[:]  # the exporter's symbolic dims would stay as they are
    inferred = infer_light(bare)
    if inferred is bare:  # a model ONNX cannot infer folds nothing
        return m
    if inferred_out is not None:
        inferred_out.append(inferred)
    shapes, some = {}, {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(ir.known_dim(d) is not None for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
        elif partial and t.HasField("shape"):
            some[vi.name] = tuple(ir.known_dim(d) for d in t.shape.dim)
    shape_of: dict[str, tuple] = {}  # a Shape node's output -> the dims it holds, None where unknown
    g = m.graph
    known: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in g.initializer
                                    if int(np.prod(t.dims)) <= MAX_ELEMENTS}
    opsets = list(m.opset_import)
    folded: set[int] = set()
    guarded = _control_inputs(g) if partial else set()
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx") or n.op_type not in FOLDABLE or _has_subgraph(n) or i in guarded:
            continue
        values = _evaluate(n, known, shapes, opsets)
        if values is None and partial:
            values = _known_dims(n, known, some, shape_of)
        if values is None:
            continue
        known.update(values)
        folded.add(i)
        report.nodes[n.op_type] += 1
    for i, n in enumerate(g.node):
        if i not in folded:
            _drop_noop(n, known, {**some, **shapes}, report)
    folded |= _unread(g, folded)
    if not folded:
        return m
    kept = [n for i, n in enumerate(g.node) if i not in folded]
    read = ir.graph_reads(g, kept)
    produced = {o for i in folded for o in g.node[i].output if o}
    graph_inputs = {vi.name for vi in g.input}
    for k in reversed(range(len(g.initializer))):  # in place: the weights are not copied again
        if g.initializer[k].name not in read and g.initializer[k].name not in graph_inputs:
            del g.initializer[k]
    g.initializer.extend(numpy_helper.from_array(known[name], name) for name in sorted(produced & read))
    del g.node[:]
    g.node.extend(kept)
    alive = read | {o for n in kept for o in n.output} | graph_inputs
    infos = [v for v in g.value_info if v.name in alive]
    del g.value_info[:]
    g.value_info.extend(infos)
    return m


def _evaluate(n: onnx.NodeProto, known: dict[str, np.ndarray], shapes: dict, opsets,
              max_elements: int = MAX_ELEMENTS) -> dict | None:
    """The node's outputs by name when they follow from known values and hold at most
    `max_elements` each (None otherwise)."""
    if n.op_type in ("Shape", "Size"):
        x = n.input[0]
        if x not in shapes and x not in known:
            return None
        dims = known[x].shape if x in known else shapes[x]
        if n.op_type == "Size":
            return {n.output[0]: np.array(int(np.prod(dims)), np.int64)}
        return {n.output[0]: np.array(_shape_slice(n, dims), np.int64)}
    inputs = [x for x in n.input if x]
    if any(x not in known for x in inputs):
        return None
    from onnx.reference import ReferenceEvaluator

    graph = helper.make_graph([n], "fold", [], [helper.make_tensor_value_info(o, 0, None) for o in n.output if o],
                              [numpy_helper.from_array(known[x], x) for x in dict.fromkeys(inputs)])
    try:
        outs = ReferenceEvaluator(helper.make_model(graph, opset_imports=opsets)).run(None, {})
    except Exception:  # noqa: BLE001  a node the reference cannot run is not folded
        return None
    values = {o: np.asarray(v) for o, v in zip([o for o in n.output if o], outs, strict=True)}
    if any(v.size > max_elements or v.dtype == object for v in values.values()):
        return None
    return values


def _control_inputs(g: onnx.GraphProto) -> set[int]:
    """The nodes an If's condition or a Loop's trip count and condition depend on. A dynamic model
    keeps them (`fold_known_dims`): a constant condition lets ONNX Runtime inline the branch it
    picks, and check that branch's outputs against their readers as it did not before (ONNX's
    AffineGrid function, expanded: its Range then reads a [1] tensor where the spec says a scalar,
    and the model no longer loads)."""
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    work = [x for n in g.node if n.domain in ("", "ai.onnx") and n.op_type in ("If", "Loop")
            for x in (n.input[:1] if n.op_type == "If" else n.input[:2]) if x]
    seen: set[int] = set()
    while work:
        i = producer.get(work.pop())
        if i is not None and i not in seen:
            seen.add(i)
            work += [x for x in g.node[i].input if x]
    return seen


def _unread(g: onnx.GraphProto, gone: set[int]) -> set[int]:
    """The nodes of shape arithmetic (FOLDABLE ops, pure) that nothing reads once the nodes in
    `gone` are gone, to the end: a Shape whose Gather folded, an empty Concat input's Slice. (Their
    readers elsewhere would block fusions: a chain does not take a Transpose whose output a Shape
    still reads.)"""
    dead: set[int] = set()
    while True:
        alive = [n for i, n in enumerate(g.node) if i not in gone and i not in dead]
        read = ir.graph_reads(g, alive)
        more = {i for i, n in enumerate(g.node) if i not in gone and i not in dead and n.domain in ("", "ai.onnx")
                and n.op_type in FOLDABLE and not _has_subgraph(n) and not any(o in read for o in n.output if o)}
        if not more:
            return dead
        dead |= more


def _drop_noop(n: onnx.NodeProto, known: dict[str, np.ndarray], dims: dict[str, tuple], report: Folded) -> None:
    """A Slice taking every element of its input's axes (constant starts, ends and axes, steps 1,
    those dims known) becomes an Identity; a Concat's inputs that have 0 elements along its axis
    (that dim known) are dropped while another remains. Counted in `report.noops`."""
    if n.domain not in ("", "ai.onnx"):
        return
    if n.op_type == "Slice" and len(n.input) >= 3 and n.input[0] in dims:
        x = dims[n.input[0]]
        parts = [known.get(t) if t else None for t in (list(n.input[1:]) + [""] * 4)[:4]]
        starts, ends, axes, steps = parts
        if starts is None or ends is None or (len(n.input) > 3 and n.input[3] and axes is None) or (
                len(n.input) > 4 and n.input[4] and steps is None):
            return
        starts, ends = starts.reshape(-1).tolist(), ends.reshape(-1).tolist()
        axes = axes.reshape(-1).tolist() if axes is not None else list(range(len(starts)))
        steps = steps.reshape(-1).tolist() if steps is not None else [1] * len(starts)
        if not len(starts) == len(ends) == len(axes) == len(steps) or any(s != 1 for s in steps):
            return
        for st, en, ax in zip(starts, ends, axes, strict=True):
            if not -len(x) <= ax < len(x) or not isinstance(d := x[ax], int):
                return
            if min(max(st + d if st < 0 else st, 0), d) != 0 or min(max(en + d if en < 0 else en, 0), d) != d:
                return
        n.op_type = "Identity"
        del n.input[1:]
        report.noops["Slice"] += 1
    elif n.op_type == "Concat" and len(n.input) > 1:
        axis = next((a.i for a in n.attribute if a.name == "axis"), None)
        shapes = [dims.get(t) for t in n.input]
        if axis is None or any(sh is None for sh in shapes):
            return
        empty = [k for k, sh in enumerate(shapes) if -len(sh) <= axis < len(sh) and sh[axis] == 0]
        if empty and len(empty) < len(n.input):
            kept = [t for k, t in enumerate(n.input) if k not in empty]
            del n.input[:]
            n.input.extend(kept)
            report.noops["Concat"] += len(empty)


def _shape_slice(n: onnx.NodeProto, dims) -> list:
    """The dims a Shape node outputs of a tensor with these dims (its start and end attributes)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return list(dims)[attrs.get("start", 0):attrs.get("end", None)]


def _known_dims(n: onnx.NodeProto, known: dict[str, np.ndarray], some: dict[str, tuple], shape_of: dict
                ) -> dict | None:
    """A Shape node's dims, or a Gather's or Slice's from a Shape node's output at constant indices, when every
    dim they hold is known (None otherwise); records what each unfolded Shape holds in `shape_of`."""
    if n.op_type == "Shape" and n.input[0] in some:
        dims = _shape_slice(n, some[n.input[0]])
        if all(d is not None for d in dims):
            return {n.output[0]: np.array(dims, np.int64)}
        shape_of[n.output[0]] = tuple(dims)
        return None
    if n.op_type in ("Gather", "Slice") and n.input[0] in shape_of:
        dims = shape_of[n.input[0]]
        idx = _dims_taken(n, len(dims), known.get)
        if idx is None:
            return None
        picked = [dims[int(i)] for i in idx.reshape(-1)]
        if all(d is not None for d in picked):
            return {n.output[0]: np.array(picked, np.int64).reshape(idx.shape)}
    return None


def evaluate_constant(n: onnx.NodeProto, inputs: dict[str, np.ndarray], opset: int | None,
                      max_elements: int) -> dict | None:
    """One node of FOLDABLE ops (or Trilu) on known inputs, by ONNX's reference implementation, at
    the default domain's `opset` (None: this onnx's); its outputs by name, or None where it
    cannot run or an output holds more than `max_elements`."""
    if n.domain not in ("", "ai.onnx") or n.op_type not in FOLDABLE | {"Trilu"} or _has_subgraph(n):
        return None
    opsets = [helper.make_opsetid("", opset if opset is not None else onnx.defs.onnx_opset_version())]
    return _evaluate(n, inputs, {}, opsets, max_elements)


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)
