"""A projection's bias moved below its head split, into the rotary embedding's pointwise chain.

Qwen2-style decoders add a bias to the query and key projections before splitting heads and
rotating them (rotary embeddings):

    q = Add(MatMul(x, Wq), b)  ->  Reshape [..., H, D]  ->  Transpose (keeps the last axis)
    out = q * cos + rotate_half(q) * sin

The rotary chain (`onnxfuse.kinds.pointwise`) reads the head split's output twice, once as it
is and once rotated (its rotate_half is a read of the chain's input at a rotated index), so the
Add before the view stays a kernel of its own: a read and a write of the projection's output.
Here the Add goes below the view, where the chain takes it in:

    q0 = Transpose(Reshape(MatMul(x, Wq)))
    out = (q0 + b') * cos + (rotate_half(q0) + rotate_half(b')) * sin

b' is b laid out as the view lays out the last axis ([H, D], then the Transpose's permutation,
broadcast over the other axes); rotate_half(q0 + b') = rotate_half(q0) + rotate_half(b'), as
rotate_half only negates and moves elements along the last axis, so its constant is computed
here and the rotation reads q0. The interleaved rotation (GPT-J's rotate_every_two) alike. The
values are the same up to rounding: the chain adds the bias in float32, where the original
rounds q + b to the model's type first.

A partial rotation (Phi, StableLM, GPT-NeoX: the first r of D columns, Slices of the split's
last axis put back together by a Concat) alike, the bias cut with the columns: each Slice of the
split reads the unbiased split and adds its columns of b' after it,

    out = Concat((q0[..., :r] + b'[..., :r]) * cos + (rotate_half(q0[..., :r]) + rotate_half(b'[..., :r])) * sin,
                 q0[..., r:] + b'[..., r:])

and the partial chain takes the columns beyond r with their Add (`Partial.addend`).

A bias added to a packed product before its Split into Q, K and V (GPT-NeoX's query_key_value,
packed and reordered by `onnxfuse.pack`) is first cut with the Split (`split_head_biases`): each
part adds its columns after the Split, so Q's and K's move as above and V's joins the attention
(its per-operand bias); only where every part but one at most is rotated, so no more Adds are left
than before.

Only where the head split's output is rotated (the chain then takes the Adds in), and, for a
partial rotation, where every reader of the split is a Slice of its last axis; other readers of
the bias are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from onnxfuse.graph import GraphView, bias_add
from onnxfuse.ir import copy_and_namer, graph_reads
from onnxfuse.kinds.pointwise import Rotation, last_axis_slice, pairs_at, rotate_half, rotate_pairs, rotation_at
from onnxfuse.ops import node_attrs

NOTE = ("projection biases moved below their head split into the rotary embedding's chain (q + b rotated "
        "as rotate_half(q) + rotate_half(b): onnxfuse.headbias)")


@dataclass(frozen=True)
class HeadBias:
    """One move: the bias Add before a head split whose output a rotation reads."""

    add: int  # Add(p, b) before the view
    product: str  # p
    bias_name: str  # b
    view: int  # the Reshape reading the Add's output
    last: int  # the Transpose after it, or the Reshape itself: makes `split`
    split: str  # the head split's output (the rotation's x, and the chain's input)
    bias: np.ndarray  # b laid out over `split`'s axes ([1, ..., H, ..., D], broadcast elsewhere)
    rotation: Rotation
    # a partial rotation: every reader of `split`, a Slice of its last axis (node, start, end),
    # the rotation's x the output of one of them; () for a full rotation (its x is `split`)
    cuts: tuple[tuple[int, int, int], ...] = ()


def _cuts(view: GraphView, rot: Rotation) -> tuple[str, tuple[tuple[int, int, int], ...]] | None:
    """(the tensor split into heads, its Slices) for a rotation of its x: (x, ()) where x is not a
    Slice; where it is Slice(s, 0, r) of s's last axis, (s, every reader of s, each such a Slice);
    None where a reader of s is not."""
    i = view.producer.get(rot.x)
    if not view.is_op(i, "Slice"):
        return rot.x, ()
    s = view.nodes[i].input[0]
    shape = view.shapes.get(s)
    if not shape or not isinstance(shape[-1], int) or s in view.graph_outputs:
        return None
    cuts = []
    for j in dict.fromkeys(view.consumers.get(s, ())):
        cut = last_axis_slice(view, j, len(shape), shape[-1])
        if cut is None or cut[0] != s or cut[1] >= cut[2]:
            return None
        cuts.append((j, cut[1], cut[2]))
    return s, tuple(cuts)


def _head_reshape(view: GraphView, split: str) -> tuple[int, int, list[int] | None] | None:
    """(the Reshape, the node making `split`, the Transpose's perm or None) where `split` is
    [Transpose of] Reshape(x), the Reshape read by the Transpose alone; None otherwise."""
    last = view.producer.get(split)
    if view.is_op(last, "Reshape"):
        return last, last, None
    if not view.is_op(last, "Transpose"):
        return None
    r = view.producer.get(view.nodes[last].input[0])
    if not view.is_op(r, "Reshape") or not view.only_reader(view.nodes[r].output[0], last):
        return None
    return r, last, [int(a) for a in node_attrs(view.nodes[last]).get("perm", ())]


def _heads(view: GraphView, r: int, perm: list[int] | None) -> tuple[int, int, int] | None:
    """(rank, H, D) where Reshape r makes [..., H, D] of its input [..., N] (the same leading
    dims, H * D = N, all static) and `perm` (if any) keeps the last axis; None otherwise."""
    p_shape, s_shape = view.shapes.get(view.nodes[r].input[0]), view.shapes.get(view.nodes[r].output[0])
    if not p_shape or not s_shape or len(s_shape) != len(p_shape) + 1 or any(d is None for d in (*p_shape, *s_shape)):
        return None
    n, (h, d) = p_shape[-1], s_shape[-2:]
    if not all(isinstance(v, int) for v in (n, h, d)) or h * d != n or list(p_shape[:-1]) != list(s_shape[:-2]):
        return None
    rank = len(s_shape)
    if perm is not None and (sorted(perm) != list(range(rank)) or perm[-1] != rank - 1):
        return None
    return rank, h, d


def head_bias_at(view: GraphView, rot: Rotation) -> HeadBias | None:
    """The move for rotation `rot` when its x is a head split of a biased product, or a Slice of
    one's last axis whose every reader is such a Slice (`_cuts`): the split = [Transpose keeping
    the last axis of] Reshape(Add(p, b)) of p [..., N] to [..., H, D] (the same leading dims,
    H * D = N, D static), b a constant [N] vector, each node read by the next alone; None
    otherwise."""
    found = _cuts(view, rot)
    if found is None:
        return None
    split, cuts = found
    head = _head_reshape(view, split)
    if head is None:
        return None
    r, last, perm = head
    add = bias_add(view, view.nodes[r].input[0], r)
    if add is None:
        return None
    a, product, bias_name = add
    heads = _heads(view, r, perm)
    if heads is None:
        return None
    rank, h, d = heads
    b = numpy_helper.to_array(view.constants[bias_name]).reshape([1] * (rank - 2) + [h, d])
    if perm is not None:
        b = b.transpose(perm)
    return HeadBias(a, product, bias_name, r, last, split, b, rot, cuts)


def _rotations(view: GraphView) -> list[Rotation]:
    """Every full rotation (rotate_half or its interleaved form) of the graph, once per x."""
    found: dict[str, Rotation] = {}
    for node in view.nodes:
        for y in node.output:
            readers = set(view.consumers.get(y, ()))
            if not y or not readers:
                continue
            rot = rotation_at(view, y, readers, set(), {}) or pairs_at(view, y, readers, set(), {})
            if rot is not None:
                found.setdefault(rot.x, rot)
    return list(found.values())


def _split_sizes(view: GraphView, i: int, n: int) -> list[int] | None:
    """The sizes of Split node i over the last axis of its input (last dim n), every output
    named: from its second input or its `split` attribute, else equal parts; None otherwise."""
    node = view.nodes[i]
    shape = view.shapes.get(node.input[0])
    if not shape or int(node_attrs(node).get("axis", 0)) % len(shape) != len(shape) - 1 or not all(node.output):
        return None
    if len(node.input) > 1 and node.input[1]:
        c = view.constants.get(node.input[1])
        sizes = [int(v) for v in numpy_helper.to_array(c).reshape(-1)] if c is not None else None
    else:
        sizes = [int(v) for v in node_attrs(node).get("split", ())] or (
            [n // len(node.output)] * len(node.output) if n % len(node.output) == 0 else None)
    return sizes if sizes and len(sizes) == len(node.output) and sum(sizes) == n else None


def split_head_biases(model: ModelProto, view: GraphView) -> tuple[ModelProto, int]:
    """`model` with each bias Add before a Split of its last axis (graph.bias_add, the Split its
    one reader) cut with the Split, every part but one at most the input of a rotated head split
    that `head_bias_at` would take (each part's Add then moves below its heads or joins the
    attention): each part adds its columns of the bias after the Split; how many were cut; `model`
    itself where none was."""
    rotated = set()
    for rot in _rotations(view):
        found = _cuts(view, rot)
        head = _head_reshape(view, found[0]) if found is not None else None
        if head is not None and _heads(view, head[0], head[2]) is not None:
            rotated.add(view.nodes[head[0]].input[0])
    cuts = []
    for i, node in enumerate(view.nodes):
        if not view.is_op(i, "Split") or not node.input:
            continue
        add = bias_add(view, node.input[0], i)
        shape = view.shapes.get(node.input[0])
        sizes = _split_sizes(view, i, shape[-1]) if add is not None else None
        turned = sum(y in rotated for y in node.output)
        if sizes is None or turned == 0 or turned < len(sizes) - 1:
            continue
        cuts.append((i, add, sizes))
    if not cuts:
        return model, 0
    out, fresh = copy_and_namer(model)
    g = out.graph
    nodes = list(g.node)
    after: dict[int, list] = {}
    drop: set[int] = set()  # the Adds before the Splits
    for i, (a, product, bias_name), sizes in cuts:
        bias = numpy_helper.to_array(view.constants[bias_name]).reshape(-1)
        nodes[i].input[0] = product
        for k, (y, lo) in enumerate(zip(list(nodes[i].output), np.cumsum([0, *sizes[:-1]]), strict=True)):
            nodes[i].output[k] = part = fresh(f"{y}.unbiased")
            name = fresh(f"{y}.bias")
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(bias[lo:lo + sizes[k]]), name))
            after.setdefault(i, []).append(helper.make_node("Add", [part, name], [y], name=fresh(f"{y}.below_split")))
        drop.add(a)
    _rebuild(g, nodes, after, drop, {bias_name for _, (_, _, bias_name), _ in cuts})
    return out, len(cuts)


def sink_head_biases(model: ModelProto, view: GraphView) -> tuple[ModelProto, int]:
    """`model` with each projection bias before a rotated head split moved below it (module
    notes), and how many moved; `model` itself where none did."""
    found = [m for rot in _rotations(view) if (m := head_bias_at(view, rot)) is not None]
    moves = list({m.add: m for m in reversed(found)}.values())  # one move a bias (the first rotation's)
    if not moves:
        return model, 0
    out, fresh = copy_and_namer(model)
    g = out.graph
    nodes = list(g.node)
    after: dict[int, list] = {}
    drop: set[int] = set()

    def add_after(i: int, x: str, bias: np.ndarray, y: str, stem: str, what: str) -> None:
        """y = Add(x, bias) after node i, the bias a new constant."""
        name = fresh(f"{stem}.{what}")
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(bias), name))
        after.setdefault(i, []).append(helper.make_node("Add", [x, name], [y], name=fresh(f"{stem}.below_{what}")))
    for mv in moves:
        stem = nodes[mv.add].name or mv.split
        bare = fresh(f"{mv.split}.unbiased")
        # every tensor whose value changes gets a name of its own (bisect and the tests compare
        # tensors by name with the original's)
        nodes[mv.view].input[0] = mv.product
        drop.add(mv.add)
        if mv.last != mv.view:
            heads = fresh(f"{nodes[mv.view].output[0]}.unbiased")
            nodes[mv.view].output[0] = heads
            nodes[mv.last].input[0] = heads
        nodes[mv.last].output[0] = bare

        # each part of the split (the whole, or each Slice's columns) adds its columns of the bias
        # after it; `plain` is the unbiased part the rotation reads
        if not mv.cuts:
            add_after(mv.last, bare, mv.bias, mv.split, stem, "head_bias")
            plain, cut = bare, mv.bias
        for j, a, e in mv.cuts:
            y = nodes[j].output[0]
            nodes[j].input[0] = bare
            nodes[j].output[0] = part = fresh(f"{y}.unbiased")
            add_after(j, part, mv.bias[..., a:e], y, stem, "head_bias")
            if y == mv.rotation.x:
                plain, cut = part, mv.bias[..., a:e]
        # the rotation reads the unbiased part; its constant is added where it ends
        for i in mv.rotation.nodes:
            nodes[i].input[:] = [plain if x == mv.rotation.x else x for x in nodes[i].input]
        end = view.producer[mv.rotation.tensor]
        turned = fresh(f"{mv.rotation.tensor}.unbiased")
        nodes[end].output[0] = turned
        add_after(end, turned, rotate_pairs(cut) if mv.rotation.pairs else rotate_half(cut), mv.rotation.tensor,
                  stem, "head_bias_rotated")
    _rebuild(g, nodes, after, drop, {mv.bias_name for mv in moves})
    return out, len(moves)


def _rebuild(g, nodes: list, after: dict[int, list], drop: set[int], gone: set[str]) -> None:
    """g's nodes as `nodes` without those in `drop`, each followed by its `after` nodes; the
    initializers named in `gone` that nothing reads any more swept."""
    kept = [m for j, n in enumerate(nodes) if j not in drop for m in (n, *after.get(j, ()))]
    del g.node[:]
    g.node.extend(kept)
    read = graph_reads(g)
    alive = [t for t in g.initializer if t.name not in gone or t.name in read]
    del g.initializer[:]
    g.initializer.extend(alive)
