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

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.bias import BIAS_TAKERS, BiasMove, gemm_move, gemm_without_c, matmul_move
from onnxfuse.graph import GraphView
from onnxfuse.groups import Accepted
from onnxfuse.ir import copy_and_namer
from onnxfuse.kinds.attention import AttentionParts, find_attention
from onnxfuse.kinds.base import Pattern
from onnxfuse.load import infer_shapes
from onnxfuse.match import find_matches
from onnxfuse.ort_fusions import OrtFusions, ort_fusions, reason


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
    out, fresh = copy_and_namer(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}

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


# ---------------------------------------------------------------------------------------
# The bias after the product
# ---------------------------------------------------------------------------------------

def _moved(model: ModelProto, view: GraphView, moves: list[BiasMove]) -> tuple[ModelProto, dict[int, int]]:
    """`model` with each move applied, and where each move's bias Add is in the new node list."""
    out, fresh = copy_and_namer(model)
    g = out.graph
    after: dict[int, tuple[int, list]] = {}  # node -> (move, nodes that take its place)
    for k, mv in enumerate(moves):
        n = view.nodes[mv.node]
        stem = n.name or n.output[0]
        b_name = fresh(f"{stem}.bias")
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(mv.bias), b_name))
        if mv.add is None:  # Gemm(A, W, C) [-> Reshape]  =>  Gemm(A, W) [-> Reshape] -> Add(C)
            product = fresh(f"{stem}.product")
            gemm = gemm_without_c(n, product)
            after[mv.node] = (k, [gemm])
            nodes = []
            if mv.reshape is not None:  # the Add where the Reshape is (its shape may be made after the Gemm)
                r = NodeProto()
                r.CopyFrom(view.nodes[mv.reshape])
                r.input[0] = product
                product = fresh(f"{stem}.product_rows")
                r.output[0] = product
                nodes.append(r)
            nodes.append(helper.make_node("Add", [product, b_name], [mv.out], name=fresh(f"{stem}.bias_add")))
            if mv.reshape is None:
                after[mv.node] = (k, [gemm, *nodes])
            else:
                after[mv.reshape] = (k, nodes)
        else:  # MatMul(X, W) -> Add(b)  =>  Reshape(X, [M, K]) -> Gemm(., W) -> Reshape(., [..., N]) -> Add(b)
            xs = view.shapes[n.input[0]]
            width = len(mv.bias)
            rows = fresh(f"{stem}.rows")
            shape_in, shape_out = fresh(f"{stem}.rows_shape"), fresh(f"{stem}.out_shape")
            g.initializer.append(numpy_helper.from_array(np.array([-1, xs[-1]], np.int64), shape_in))
            g.initializer.append(numpy_helper.from_array(np.array([*xs[:-1], width], np.int64), shape_out))
            product, unflat = fresh(f"{stem}.product"), fresh(f"{stem}.product_rows")
            nodes = [helper.make_node("Reshape", [n.input[0], shape_in], [rows], name=fresh(f"{stem}.flatten")),
                     helper.make_node("Gemm", [rows, n.input[1]], [product], name=fresh(f"{stem}.gemm")),
                     helper.make_node("Reshape", [product, shape_out], [unflat], name=fresh(f"{stem}.unflatten")),
                     helper.make_node("Add", [unflat, b_name], [mv.out], name=view.nodes[mv.add].name
                                      or fresh(f"{stem}.bias_add"))]
            after[mv.node] = (k, nodes[:3])
            after[mv.add] = (k, nodes[3:])
    kept, where = [], {}
    for j, n in enumerate(g.node):
        if j in after:
            k, nodes = after[j]
            for m in nodes:
                if m.op_type == "Add" and m.output[0] == moves[k].out:
                    where[k] = len(kept)
                kept.append(m)
        else:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    read = {t for n in g.node for t in n.input}
    inits = {t.name for t in model.graph.initializer}
    alive = [t for t in g.initializer if t.name in read or t.name not in inits]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, where


def bias_after_product(model: ModelProto, view: GraphView, patterns: list[Pattern],
                       offered: Mapping[str, frozenset[str]] | None = None
                       ) -> tuple[ModelProto, int, OrtFusions | None, GraphView | None]:
    """`model` with the bias of each product that ONNX Runtime would otherwise run inside its Gemm
    added after the product instead, where one of ORT's own fusions then takes that Add in
    (BIAS_TAKERS: a residual add and LayerNorm into SkipLayerNormalization, a GELU into BiasGelu or
    FastGelu), as ORT's transformers optimizer writes those layers; how many moved; and ORT's
    fusions of the model returned and its GraphView where they were made here (else None: the
    pipeline makes them).

    Why (`onnxfuse.bias`): ORT's CUDA Gemm with a bias runs a second kernel for it, and ORT makes
    such a Gemm of every MatMul + bias Add before its fusions of BIAS_TAKERS look for the Add;
    GPT-2's TorchScript export writes it so already (Conv1D: Reshape, Gemm with C, Reshape).
    Here the product becomes Reshape, Gemm without C, Reshape (or stays a Gemm without C) and
    the bias an Add after it.

    Which moves are kept is measured on the graph, not guessed: every candidate is moved in a
    trial model, ORT optimizes it (`onnxfuse.ort_fusions`) and `patterns` are matched on it; a move
    stays where ORT's fusions took its Add into one of BIAS_TAKERS or one of onnxfuse's fused nodes
    takes it (a normalization's prologue, the attention's packed bias, a pointwise chain), and the
    others are left as they were. Static input shapes are needed for a MatMul (the Reshapes'
    shapes); a Gemm's Reshapes are its own. `offered`: as the match pass will match
    (`onnxfuse.match.Reserved`)."""
    moves = []
    for i, n in enumerate(view.nodes):
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("Gemm", "MatMul"):
            continue
        mv = gemm_move(view, i) if n.op_type == "Gemm" else matmul_move(view, i)
        if mv is not None and view.consumers.get(mv.out):  # a graph output alone: nothing takes the Add
            moves.append(mv)
    if not moves:
        return model, 0, None, None
    # a product or bias Add that one of the patterns fuses already (a GemmEpilogue with the bias
    # in its epilogue, the attention's packed bias) stays as it is
    probe = ort_fusions(model)
    taken = {i for m in find_matches(view, patterns, probe.absorbed, offered).matches for i in m.nodes}
    moves = [mv for mv in moves if mv.node not in taken and mv.add not in taken]
    if not moves:
        return model, 0, probe, None
    trial, where = _moved(model, view, moves)
    trial_probe = ort_fusions(trial)
    takers = {reason(f) for f in BIAS_TAKERS}
    absorbed = trial_probe.absorbed
    trial_view = GraphView.build(trial, infer_shapes(trial))
    ours = {i for m in find_matches(trial_view, patterns, absorbed, offered).matches
            for i in m.nodes}
    kept = [mv for k, mv in enumerate(moves) if where.get(k, -1) in ours or absorbed.get(where.get(k, -1)) in takers]
    if not kept:
        return model, 0, probe, None
    if len(kept) == len(moves):
        return trial, len(kept), trial_probe, trial_view
    return _moved(model, view, kept)[0], len(kept), None, None
