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
from onnxfuse.ir import copy_and_namer, graph_reads
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
    read = graph_reads(g)
    alive = [t for t in g.initializer if t.name in read or t.name not in inits]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, len(trios)


# ---------------------------------------------------------------------------------------
# Per-head interleaved projections
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Interleaved:
    """A packed projection whose columns interleave Q, K and V head by head, as GPT-NeoX's
    query_key_value: x @ w (+ b) viewed as [B, S, H, 3D], transposed to [B, H, S, 3D] and cut
    along the last axis into its 3 parts of D (Slices, or one Split), the third read as P @ V's
    V."""

    proj: Projection
    reshape: int
    transpose: int
    cuts: tuple[int, ...]  # the Slices in the order of their columns, or the one Split
    outputs: tuple[str, ...]  # the parts, in that order
    heads: int
    head_dim: int


def _ints(view: GraphView, name: str | None) -> list[int] | None:
    if not name:
        return None
    t = view.constants.get(name)
    return None if t is None else [int(v) for v in numpy_helper.to_array(t).reshape(-1)]


def _cut_bounds(view: GraphView, i: int, width: int) -> list[tuple[int, int, str]] | None:
    """(start, end, output) of each part node i cuts from the last axis (of `width`): a Slice with
    constant bounds, or a Split with constant or equal sizes; None for anything else."""
    n = view.nodes[i]
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    if n.op_type == "Slice" and n.domain in ("", "ai.onnx") and view.opset >= 10:
        starts, ends = _ints(view, n.input[1]), _ints(view, n.input[2])
        axes = _ints(view, n.input[3]) if len(n.input) > 3 and n.input[3] else [0]
        steps = _ints(view, n.input[4]) if len(n.input) > 4 and n.input[4] else [1]
        if None in (starts, ends, axes, steps) or len(starts) != 1 or axes[0] % 4 != 3 or steps != [1]:
            return None
        lo, hi = (min(max(v + width if v < 0 else v, 0), width) for v in (starts[0], ends[0]))
        return [(lo, hi, n.output[0])]
    if n.op_type == "Split" and n.domain in ("", "ai.onnx") and int(attrs.get("axis", 0)) % 4 == 3:
        sizes = _ints(view, n.input[1]) if len(n.input) > 1 and n.input[1] else attrs.get("split")
        if sizes is None:
            if width % len(n.output):
                return None
            sizes = [width // len(n.output)] * len(n.output)
        starts = np.cumsum([0, *sizes])
        return [(int(a), int(b), o) for a, b, o in zip(starts[:-1], starts[1:], n.output, strict=True)]
    return None


def _interleaved(view: GraphView, t: int) -> Interleaved | None:
    """The interleaved projection whose Transpose is node t (each node read by the next alone)."""
    n = view.nodes[t]
    if n.op_type != "Transpose" or n.domain not in ("", "ai.onnx"):
        return None
    perm = [int(v) for a in n.attribute if a.name == "perm" for v in a.ints]
    r_out, t_out = n.input[0], n.output[0]
    if perm != [0, 2, 1, 3] or list(view.consumers.get(r_out, ())) != [t] or r_out in view.graph_outputs \
            or t_out in view.graph_outputs:
        return None
    proj = _projection(view, r_out)
    rs, ps = view.shapes.get(r_out), view.shapes.get(proj.out) if proj else None
    if proj is None or rs is None or ps is None or len(rs) != 4 or len(ps) != 3 or list(rs[:2]) != list(ps[:2]) \
            or any(d is None for d in rs[:2]) or not all(isinstance(d, int) for d in rs[2:]):
        return None
    heads, packed = rs[2], rs[3]
    readers = list(view.consumers.get(t_out, ()))
    if heads * packed != proj.width or not readers:
        return None
    cuts = [_cut_bounds(view, i, packed) for i in readers]
    if any(c is None for c in cuts) or (len(readers) > 1 and any(view.nodes[i].op_type != "Slice" for i in readers)):
        return None
    parts = sorted((lo, hi, out, i) for c, i in zip(cuts, readers, strict=True) for lo, hi, out in c)
    d = packed // 3
    if len(parts) != 3 or any((lo, hi) != (k * d, (k + 1) * d) for k, (lo, hi, _, _) in enumerate(parts)):
        return None
    v = parts[2][2]  # V: read as P @ V's second operand (not a rotary embedding's halves, as GLM's q is cut)
    if not any(view.nodes[j].op_type == "MatMul" and view.nodes[j].input[1] == v for j in view.consumers.get(v, ())):
        return None
    order = tuple(dict.fromkeys(i for *_, i in parts))
    return Interleaved(proj, view.producer[r_out], t, order, tuple(out for _, _, out, _ in parts), heads, d)


def unpack_interleaved(model: ModelProto, view: GraphView) -> tuple[ModelProto, int]:
    """`model` with each per-head interleaved projection (`Interleaved`) made a packed one as
    pack_qkv writes it: its weight's (and bias's) columns reordered part by part, [Wq | Wk | Wv]
    over all heads (the same sums of the same products per output element, exactly), a Split
    into the parts and each part's own Reshape to [B, S, H, D] and Transpose, which write the
    cuts' outputs. The attention then reads the parts in place from the product as it reads
    BERT's packed projection (the Reshape to [B, S, H, 3D], its Transpose and the Slices, a copy
    each, are gone), and the rotary chains read Q and K through their Transposes. Returns how
    many projections were reordered."""
    found = [f for f in (_interleaved(view, i) for i, n in enumerate(view.nodes) if n.op_type == "Transpose") if f]
    if not found:
        return model, 0
    out, fresh = copy_and_namer(model)
    g = out.graph
    replace: dict[int, list[NodeProto]] = {}
    drop: set[int] = set()
    for f in found:
        p, k = f.proj, len(f.outputs)
        mm = view.nodes[p.matmul]
        stem = mm.name or "qkv"
        # new column j * H * D + h * D + c is old column h * k * D + j * D + c
        order = np.arange(p.width).reshape(f.heads, k, f.head_dim).transpose(1, 0, 2).reshape(-1)
        w = numpy_helper.to_array(view.constants[p.weight])[:, order]
        w_name = fresh(f"{stem}.parts_weight")
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        prod = fresh(f"{stem}.parts")
        nodes = [helper.make_node("MatMul", [mm.input[0], w_name], [prod], name=fresh(f"{stem}.parts_matmul"))]
        if p.bias is not None:
            c = view.constants[p.bias]
            b = numpy_helper.to_array(c).reshape(-1)[order].reshape(tuple(c.dims))
            b_name = fresh(f"{stem}.parts_bias")
            g.initializer.append(numpy_helper.from_array(b, b_name))
            biased = fresh(f"{stem}.parts_biased")
            nodes.append(helper.make_node("Add", [prod, b_name], [biased], name=fresh(f"{stem}.parts_add")))
            prod = biased
        parts = [fresh(f"{stem}.part{j}") for j in range(k)]
        if view.opset >= 13:
            sizes = fresh(f"{stem}.parts_sizes")
            g.initializer.append(numpy_helper.from_array(np.full(k, f.heads * f.head_dim, np.int64), sizes))
            nodes.append(helper.make_node("Split", [prod, sizes], parts, name=fresh(f"{stem}.parts_split"), axis=-1))
        else:
            nodes.append(helper.make_node("Split", [prod], parts, name=fresh(f"{stem}.parts_split"), axis=-1,
                                          split=[f.heads * f.head_dim] * k))
        heads = fresh(f"{stem}.heads_shape")
        g.initializer.append(numpy_helper.from_array(np.array([0, 0, f.heads, f.head_dim], np.int64), heads))
        for j, (part, cut_out) in enumerate(zip(parts, f.outputs, strict=True)):
            viewed = fresh(f"{part}_heads")
            nodes.append(helper.make_node("Reshape", [part, heads], [viewed], name=fresh(f"{stem}.part{j}_reshape")))
            nodes.append(helper.make_node("Transpose", [viewed], [cut_out], name=fresh(f"{stem}.part{j}_transpose"),
                                          perm=[0, 2, 1, 3]))
        replace[min(j for j in (p.matmul, p.add) if j is not None)] = nodes
        drop |= {j for j in (p.matmul, p.add, f.reshape, f.transpose, *f.cuts) if j is not None}
    kept = []
    for j, n in enumerate(g.node):
        kept += replace.get(j, [])
        if j not in drop:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    read = graph_reads(g)
    gone = {x for f in found for x in (f.proj.weight, f.proj.bias) if x} - read
    alive = [t for t in g.initializer if t.name not in gone]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, len(found)


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
    read = graph_reads(g)
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
