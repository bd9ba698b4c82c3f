"""Packing an attention's Q, K and V projections into one product.

BERT- and ViT-style exports project Q, K and V with three MatMuls of the same input (each
with its bias Add), then split each into heads (Reshape, Transpose). Where one attention
(`onnxfuse.kinds.attention`) reads all three that way, `pack_qkv` replaces the three products
by one over the concatenated weights, MatMul(x, [Wq | Wk | Wv]) + [bq | bk | bv], and a Split
on the last axis whose outputs keep the three biased products' names: one GEMM of three times
the columns instead of three (at BERT-base batch 1, 128 rows, three 768 -> 768 products fill few
of the GPU's SMs each), the same sums of the same products per output element. The attention
then reads Q, K and V in place from the packed product (its `split_q`, `split_k`, `split_v`,
docs/format.md) and adds the packed bias itself as it loads them (`bias_q`, `bias_k`, `bias_v`),
so neither the Split nor the Add runs; where the attention does not fuse after all, they run as
ONNX Runtime's kernels (the Split a copy of the packed output) and tuning's whole-model check
compares the model with the original. GPT-2 exports one packed projection already.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from onnxfuse.graph import GraphView
from onnxfuse.groups import Accepted
from onnxfuse.kinds.attention import AttentionParts, find_attention
from onnxfuse.kinds.base import Pattern


@dataclass(frozen=True)
class Projection:
    """One of the three: x @ w (+ b), reshaped to heads."""

    matmul: int
    add: int | None
    weight: str
    bias: str | None
    out: str  # the biased product (what the Reshape reads)
    width: int  # N


def _projection(view: GraphView, base: str) -> Projection | None:
    """The projection whose Reshape to heads makes `base` (each step read only by the next)."""
    r = view.producer.get(base)
    if r is None or view.nodes[r].op_type != "Reshape":
        return None
    out = view.nodes[r].input[0]
    p = view.producer.get(out)
    if p is None or out in view.graph_outputs or len(view.consumers.get(out, ())) != 1:
        return None
    add, bias = None, None
    if view.nodes[p].op_type == "Add":
        add = p
        a, b = view.nodes[p].input[:2]
        bias, prod = (b, a) if b in view.constants else (a, b) if a in view.constants else (None, None)
        if bias is None or len(view.consumers.get(prod, ())) != 1 or prod in view.graph_outputs:
            return None
        p = view.producer.get(prod)
        if p is None:
            return None
    n = view.nodes[p]
    if n.op_type != "MatMul" or n.input[1] not in view.constants:
        return None
    w = view.constants[n.input[1]]
    if len(w.dims) != 2:
        return None
    width = int(w.dims[1])
    if bias is not None and (list(view.constants[bias].dims) not in ([width], [1, width])):
        return None
    return Projection(p, add, n.input[1], bias, out, width)


def _trio(view: GraphView, parts: AttentionParts) -> tuple[Projection, ...] | None:
    """The three projections of one attention, when they read the same input with weights of
    one dtype and K, all biased or none."""
    projs = [_projection(view, o.base) for o in (parts.q, parts.k, parts.v)]
    if any(p is None for p in projs) or len({p.matmul for p in projs}) != 3:
        return None
    xs = {view.nodes[p.matmul].input[0] for p in projs}
    ws = [view.constants[p.weight] for p in projs]
    if len(xs) != 1 or len({(w.data_type, w.dims[0]) for w in ws}) != 1:
        return None
    if len({p.bias is None for p in projs}) != 1:
        return None
    if any(p.bias is not None and view.constants[p.bias].data_type != ws[0].data_type for p in projs):
        return None
    return tuple(projs)


def pack_qkv(model: ModelProto, view: GraphView, pattern: Pattern) -> tuple[ModelProto, int]:
    """`model` with every attention's Q, K and V projections packed into one (module
    docstring), and how many attentions were packed. `pattern` is the attention pattern (what
    the attention kind would match); `view` describes `model`."""
    trios = []
    used: set[int] = set()
    for i, n in enumerate(view.nodes):
        if n.op_type != "Softmax":
            continue
        found = find_attention(view, i, pattern, set(), Accepted(len(view.nodes)), {})
        if isinstance(found, str):
            continue
        trio = _trio(view, found.params)
        if trio is None or used & {j for p in trio for j in (p.matmul, p.add) if j is not None}:
            continue
        used |= {j for p in trio for j in (p.matmul, p.add) if j is not None}
        trios.append(trio)
    if not trios:
        return model, 0
    out = ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = {t for n in g.node for t in (*n.input, *n.output)} | {t.name for t in g.initializer} \
        | {i.name for i in g.input}
    inits = {t.name: t for t in g.initializer}

    def fresh(base: str) -> str:
        k, name = 0, base
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.add(name)
        return name

    replace: dict[int, list] = {}  # first node of a trio -> the nodes that take its place
    drop: set[int] = set()
    for trio in trios:
        first = min(j for p in trio for j in (p.matmul, p.add) if j is not None)
        mm = view.nodes[trio[0].matmul]
        stem = mm.name or "qkv"
        w = np.concatenate([numpy_helper.to_array(view.constants[p.weight]) for p in trio], axis=1)
        w_name = fresh(f"{stem}.qkv_weight")
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        prod = fresh(f"{stem}.qkv")
        nodes = [helper.make_node("MatMul", [mm.input[0], w_name], [prod], name=fresh(f"{stem}.qkv_matmul"))]
        if trio[0].bias is not None:
            b = np.concatenate([numpy_helper.to_array(view.constants[p.bias]).reshape(-1) for p in trio])
            b_name = fresh(f"{stem}.qkv_bias")
            g.initializer.append(numpy_helper.from_array(b, b_name))
            biased = fresh(f"{stem}.qkv_biased")
            nodes.append(helper.make_node("Add", [prod, b_name], [biased], name=fresh(f"{stem}.qkv_add")))
            prod = biased
        widths = [p.width for p in trio]
        if view.opset >= 13:  # the sizes as an input
            sizes = fresh(f"{stem}.qkv_sizes")
            g.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), sizes))
            split = helper.make_node("Split", [prod, sizes], [p.out for p in trio], axis=-1)
        else:
            split = helper.make_node("Split", [prod], [p.out for p in trio], axis=-1, split=widths)
        split.name = fresh(f"{stem}.qkv_split")
        nodes.append(split)
        replace[first] = nodes
        drop |= {j for p in trio for j in (p.matmul, p.add) if j is not None}
    kept = []
    for j, n in enumerate(g.node):
        if j in replace:
            kept += replace[j]
        if j not in drop:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    # weights and biases no node reads any more
    read = {t for n in g.node for t in n.input}
    alive = [t for t in g.initializer if t.name in read or t.name not in inits]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, len(trios)
