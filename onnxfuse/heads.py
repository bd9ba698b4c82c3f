"""Attentions over merged heads, lifted to one rank.

Several exporters compute attention over heads merged into the batch: torch.bmm of Q as
[B * H, Sq, D] by K^T as [B * H, D, Sk], then P @ V by V as [B * H, Sk, D], with a Reshape of
the scores to [B, H, Sq, Sk] for the mask add and (where the softmax runs in 3-D) back again.
BLOOM writes it so (its baddbmm adds the ALiBi bias, [B * H, 1, Sk], before the Reshape), so
do DeBERTa-v2 and the encoder-decoder families of Hugging Face transformers 4 (BART, Marian,
Whisper, M2M100, ...), which many deployed ONNX models were exported with. The attention kind
(`onnxfuse.kinds.attention`) matches one rank from the scores to P @ V, and a Reshape on that
path is not pointwise: such an attention kept its scores, softmax and probabilities in memory.

`lift_merged_heads` rewrites each such attention in [B, H, ...] (`Merged`): the products read
Q, K^T and V as the [B, H, S, D] tensors they were merged from (through the Transposes and
scalings on the way: K^T's Transpose of the last two dims becomes one of the last two of four),
the score ops compute over [B, H, Sq, Sk] (an extra [B * H, ...] input viewed as [B, H, ...],
a [1, ...] one unsqueezed), the Reshapes between them go, and P @ V's output is merged back
(or written straight to the [B, H, Sq, D] Reshape that read it). Reshapes that merge or split
the leading dim are views (no copy in ONNX Runtime), the products the same sums per element,
the pointwise ops the same ops on the same elements: the lifted model computes what the
original did. The attention then matches as it matches BERT's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.dims import canonical, product
from onnxfuse.graph import Dim, GraphView, Shape
from onnxfuse.ir import copy_and_namer, graph_reads
from onnxfuse.kinds.base import Pattern
from onnxfuse.match import pointwise_candidate

MAX_PATH = 24  # nodes between the two products, at most


@dataclass(frozen=True)
class Merged:
    """One attention over merged heads: its products, the nodes between them in order
    (pointwise score ops, Reshapes between [B * H, ...] and [B, H, ...], the Softmax, Casts and
    Wheres of P), and the heads' split."""

    qk: int
    pv: int
    path: tuple[int, ...]
    reshapes: frozenset[int]  # the path's Reshapes (each a view between the two ranks)
    batch: Dim  # B
    heads: int  # H
    merged: Dim  # B * H


def _same(a: Dim, b: Dim) -> bool:
    return a is not None and b is not None and canonical(a) == canonical(b)


def head_split(view: GraphView, i: int) -> tuple[Dim, int, Dim] | None:
    """(B, H, B * H) when node i is a Reshape between [B * H, a, b] and [B, H, a, b] (either
    way) with H a size: a view of the same elements that splits or merges the leading dim."""
    if not view.is_op(i, "Reshape"):
        return None
    x, y = view.shapes.get(view.nodes[i].input[0]), view.shapes.get(view.nodes[i].output[0])
    if x is None or y is None or {len(x), len(y)} != {3, 4}:
        return None
    three, four = (x, y) if len(x) == 3 else (y, x)
    if not all(_same(a, b) for a, b in zip(three[1:], four[2:], strict=True)):
        return None
    batch, heads = four[0], four[1]
    if not isinstance(heads, int) or heads < 1 or not _same(product(batch, heads), three[0]):
        return None
    return batch, heads, three[0]


def _splits_as(split: tuple[Dim, int, Dim] | None, m: Merged) -> bool:
    return split is not None and _same(split[0], m.batch) and split[1] == m.heads and _same(split[2], m.merged)


def _back(view: GraphView, name: str, reader: int, pattern: Pattern, path: list[int]) -> tuple[int, list[int]] | None:
    """(the first product, the nodes from it to `reader`): each node read by the next alone,
    pointwise ops of the attention pattern or head Reshapes, through operands of the
    node's own element count (the scores, not a mask)."""
    p = view.producer.get(name)
    if p is None or not view.only_reader(name, reader) or len(path) > MAX_PATH:
        return None
    if view.is_op(p, "MatMul"):
        return p, path[::-1]
    if head_split(view, p) is not None:
        return _back(view, view.nodes[p].input[0], p, pattern, [*path, p])
    if not pointwise_candidate(view, p, pattern, set()):
        return None
    out = view.shapes.get(view.nodes[p].output[0])
    for x in dict.fromkeys(view.nodes[p].input):
        s = view.shapes.get(x)
        if x and x not in view.constants and s is not None and out is not None and len(s) == len(out) \
                and all(_same(a, b) for a, b in zip(s, out, strict=True)):
            found = _back(view, x, p, pattern, [*path, p])
            if found is not None:
                return found
    return None


def find_merged(view: GraphView, sm: int, pattern: Pattern) -> Merged | None:
    """The attention over merged heads around Softmax node `sm` (module docstring), else None."""
    node = view.nodes[sm]
    x_shape = view.shapes.get(node.input[0])
    if x_shape is None or len(x_shape) not in (3, 4):
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1 if (view.opset or 13) >= 13 else 1)
    if axis % len(x_shape) != len(x_shape) - 1:
        return None
    found = _back(view, node.input[0], sm, pattern, [])
    if found is None:
        return None
    qk, before = found
    path, probs = [*before, sm], node.output[0]
    while True:  # Casts and head Reshapes to P @ V
        readers = list(view.consumers.get(probs, ()))
        if len(readers) != 1 or probs in view.graph_outputs or len(path) > MAX_PATH:
            return None
        r = readers[0]
        if view.is_op(r, "MatMul") and view.nodes[r].input[0] == probs:
            break
        zeroing = view.is_op(r, "Where") and list(view.nodes[r].input[2:]) == [probs]  # Where(m, 0, P)
        if not (view.is_op(r, "Cast") or zeroing or head_split(view, r) is not None):
            return None
        path.append(r)
        probs = view.nodes[r].output[0]
    pv = r
    reshapes = frozenset(i for i in path if view.is_op(i, "Reshape"))
    splits = {(canonical(b), h, canonical(bh)) for i in reshapes for b, h, bh in [head_split(view, i)]}
    if len(splits) != 1:  # no Reshape (nothing to lift), or two that split differently
        return None
    batch, heads, merged = next(iter(splits))
    for i in (qk, pv):  # each product's operands and output in one rank, [B * H, ...] where 3-D
        ranks = {len(s) if s is not None else 0 for s in (view.shapes.get(t) for t in
                                                          (*view.nodes[i].input, view.nodes[i].output[0]))}
        if len(ranks) != 1 or not ranks <= {3, 4}:
            return None
    if len(view.shapes[view.nodes[qk].output[0]]) == 4 and len(view.shapes[view.nodes[pv].output[0]]) == 4:
        return None
    return Merged(qk, pv, tuple(path), reshapes, batch, heads, merged)


class _Lifter:
    """Writes the lifted nodes of one model (`lift_merged_heads`)."""

    def __init__(self, view: GraphView, model: ModelProto):
        self.view = view
        self.out, self.fresh = copy_and_namer(model)
        self.nodes: list[NodeProto] = []  # the current attention's new nodes, in order
        self.bypassed: set[int] = set()  # old nodes an operand was read through (dead if unread now)

    def const(self, values, stem: str) -> str:
        name = self.fresh(stem)
        self.out.graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def node(self, op: str, inputs: list[str], stem: str, **attrs) -> str:
        y = self.fresh(stem)
        self.nodes.append(helper.make_node(op, inputs, [y], name=self.fresh(f"{stem}_node"), **attrs))
        return y

    def target(self, name: str, s: Shape, lead: list[int], keep_from: int, stem: str) -> str:
        """A shape input: `lead`, then the dims of `name` (of shape `s`) from keep_from on
        (constants where sizes, else read from its Shape at run time)."""
        rest = list(s[keep_from:])
        if all(isinstance(d, int) for d in rest):
            return self.const([*lead, *rest], f"{stem}_shape")
        dims = self.node("Shape", [name], f"{stem}_dims")
        tail = self.node("Slice", [dims, self.const([keep_from], f"{stem}_from"),
                                   self.const([len(s)], f"{stem}_to")], f"{stem}_tail")
        return self.node("Concat", [self.const(lead, f"{stem}_lead"), tail], f"{stem}_shape", axis=0)

    def to_heads(self, name: str, m: Merged) -> str:
        """[B * H, a, b] `name` viewed as [B, H, a, b]."""
        lead = [m.batch if isinstance(m.batch, int) else -1, m.heads]
        return self.node("Reshape", [name, self.target(name, self.view.shapes[name], lead, 1, f"{name}_heads")],
                         f"{name}_heads")

    def operand(self, name: str, m: Merged) -> str:
        """A product's 3-D operand as [B, H, ...]: the tensor a head Reshape merged it from,
        through a Transpose of its last two dims or a scaling by a one-element constant;
        else viewed so."""
        v = self.view
        s = v.shapes.get(name)
        if s is None or len(s) == 4:
            return name
        p = v.producer.get(name)
        if p is not None and _splits_as(head_split(v, p), m) and len(v.shapes[v.nodes[p].input[0]]) == 4:
            self.bypassed.add(p)
            return v.nodes[p].input[0]
        if v.is_op(p, "Transpose") and [int(x) for a in v.nodes[p].attribute if a.name == "perm" for x in a.ints] \
                == [0, 2, 1]:
            self.bypassed.add(p)
            return self.node("Transpose", [self.operand(v.nodes[p].input[0], m)], f"{name}_heads", perm=[0, 1, 3, 2])
        if (v.is_op(p, "Mul") or v.is_op(p, "Div")) and v.scalar_constant(v.nodes[p].input[1]) is not None:
            self.bypassed.add(p)
            n = v.nodes[p]
            return self.node(n.op_type, [self.operand(n.input[0], m), n.input[1]], f"{name}_heads")
        return self.to_heads(name, m)

    def extra(self, name: str, m: Merged) -> str | None:
        """A score op's other input, for the op computing over [B, H, Sq, Sk]; None where it
        does not broadcast so."""
        s = self.view.shapes.get(name)
        if s is None:
            return None
        if len(s) < 3:
            return name
        if len(s) != 3:
            return None
        if s[0] == 1:
            if (self.view.opset or 13) >= 13:
                return self.node("Unsqueeze", [name, self.const([0], f"{name}_axis")], f"{name}_heads")
            return self.node("Unsqueeze", [name], f"{name}_heads", axes=[0])
        if _same(s[0], m.merged):
            return self.to_heads(name, m)
        return None

    def lift(self, m: Merged) -> tuple[list[NodeProto], dict[int, str]] | None:  # noqa: C901 -- one walk
        """The nodes that replace m's products and path, and the renames of the original
        output's readers (a head Reshape after P @ V whose output it now writes); None where an
        extra does not broadcast."""
        v = self.view
        self.nodes = []
        lifted: dict[str, str] = {}
        q, kt = (self.operand(t, m) for t in v.nodes[m.qk].input[:2])
        lifted[v.nodes[m.qk].output[0]] = self.node("MatMul", [q, kt], "scores_heads")
        for i in m.path:
            n = v.nodes[i]
            if i in m.reshapes:
                lifted[n.output[0]] = lifted[n.input[0]]
                continue
            inputs = []
            for x in n.input:
                if not x or x in lifted:
                    inputs.append(lifted.get(x, x))
                    continue
                s = v.shapes.get(n.output[0])
                if s is not None and len(s) == 4:  # the op already computes over [B, H, ...]
                    inputs.append(x)
                    continue
                e = self.extra(x, m)
                if e is None:
                    return None
                inputs.append(e)
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if n.op_type == "Softmax":
                attrs["axis"] = -1
            y = self.fresh(f"{n.output[0]}_heads")
            self.nodes.append(helper.make_node(n.op_type, inputs, [y], name=self.fresh(f"{n.name or n.op_type}_heads"),
                                               **attrs))
            lifted[n.output[0]] = y
        pn = v.nodes[m.pv]
        y_old = pn.output[0]
        probs = lifted[pn.input[0]]
        vv = self.operand(pn.input[1], m)
        renames: dict[int, str] = {}
        readers = list(v.consumers.get(y_old, ()))
        y_shape = v.shapes[y_old]
        if len(y_shape) == 4:
            self.nodes.append(helper.make_node("MatMul", [probs, vv], [y_old], name=self.fresh("context_heads_node")))
            return self.nodes, renames
        if len(readers) == 1 and y_old not in v.graph_outputs and _splits_as(head_split(v, readers[0]), m) \
                and len(v.shapes[v.nodes[readers[0]].output[0]]) == 4:
            # P @ V then its split: the product writes the split's output (the same [B, H, Sq, D])
            after = v.nodes[readers[0]].output[0]
            self.nodes.append(helper.make_node("MatMul", [probs, vv], [after], name=self.fresh("context_heads_node")))
            renames[readers[0]] = ""
            return self.nodes, renames
        y4 = self.node("MatMul", [probs, vv], "context_heads")
        merged = m.merged if isinstance(m.merged, int) else -1
        shape = self.target(y4, (m.batch, m.heads, *y_shape[1:]), [merged], 2, "context_merge")
        self.nodes.append(helper.make_node("Reshape", [y4, shape], [y_old], name=self.fresh("context_merge")))
        return self.nodes, renames


def lift_merged_heads(model: ModelProto, view: GraphView, pattern: Pattern,
                      only: set[int] | None = None) -> tuple[ModelProto, dict[int, str]]:
    """`model` with each attention over merged heads (`find_merged`; with `only`, those whose
    Softmax is in it) computed over [B, H, ...] (module docstring); returns the new model and,
    per Softmax lifted (its index in `view`), the name of the Softmax that replaces it."""
    found = [m for i, n in enumerate(view.nodes) if view.is_op(i, "Softmax") and (only is None or i in only)
             for m in [find_merged(view, i, pattern)] if m is not None]
    if not found:
        return model, {}
    lifter = _Lifter(view, model)
    at: dict[int, list[NodeProto]] = {}  # the new nodes, placed where P @ V was
    drop: set[int] = set()
    lifted: dict[int, str] = {}
    for m in found:
        done = lifter.lift(m)
        if done is None:
            continue
        nodes, renames = done
        at[m.pv] = nodes
        drop |= {m.qk, m.pv, *m.path, *renames}
        sm = next(i for i in m.path if view.nodes[i].op_type == "Softmax")
        lifted[sm] = next(n.name for n in nodes if n.op_type == "Softmax")
    if not lifted:
        return model, {}
    g = lifter.out.graph
    kept: list[tuple[int, NodeProto]] = []  # (old index, -1 for a new node; the node)
    for j, n in enumerate(g.node):
        if j in drop:
            kept += [(-1, x) for x in at.get(j, [])]
        else:
            kept.append((j, n))
    # the old operand nodes read only by the products (a head Reshape, K^T's Transpose): gone
    gone = set(drop)
    while True:
        alive = [n for _, n in kept]
        read = graph_reads(g, alive)
        dead = {j for j, n in kept if j in lifter.bypassed and not any(o in read for o in n.output)}
        if not dead:
            break
        gone |= dead
        kept = [(j, n) for j, n in kept if j not in dead]
    alive = [n for _, n in kept]
    read = graph_reads(g, alive)
    unread = {x for j in gone for x in view.nodes[j].input if x in view.constants} - read
    present = read | {x for n in alive for x in n.output}
    del g.node[:]
    g.node.extend(alive)
    vis = [vi for vi in g.value_info if vi.name in present]
    del g.value_info[:]
    g.value_info.extend(vis)
    inits = [t for t in g.initializer if t.name not in unread]
    del g.initializer[:]
    g.initializer.extend(inits)
    return lifter.out, lifted
