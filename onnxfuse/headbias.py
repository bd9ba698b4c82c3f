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
    last = view.producer.get(split)
    if not (view.is_op(last, "Transpose") or view.is_op(last, "Reshape")):
        return None
    perm, r = None, last
    if view.nodes[last].op_type == "Transpose":
        perm = [int(a) for a in node_attrs(view.nodes[last]).get("perm", ())]
        r = view.producer.get(view.nodes[last].input[0])
        if not view.is_op(r, "Reshape") or not view.only_reader(view.nodes[r].output[0], last):
            return None
    add = bias_add(view, view.nodes[r].input[0], r)
    if add is None:
        return None
    a, product, bias_name = add
    p_shape, s_shape = view.shapes.get(view.nodes[a].output[0]), view.shapes.get(view.nodes[r].output[0])
    if not p_shape or not s_shape or len(s_shape) != len(p_shape) + 1 or any(d is None for d in (*p_shape, *s_shape)):
        return None
    n, (h, d) = p_shape[-1], s_shape[-2:]
    if not all(isinstance(v, int) for v in (n, h, d)) or h * d != n or list(p_shape[:-1]) != list(s_shape[:-2]):
        return None
    rank = len(s_shape)
    if perm is not None and (sorted(perm) != list(range(rank)) or perm[-1] != rank - 1):
        return None
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
    kept = [m for j, n in enumerate(nodes) if j not in drop for m in (n, *after.get(j, ()))]
    del g.node[:]
    g.node.extend(kept)
    gone = {mv.bias_name for mv in moves}
    read = graph_reads(g)
    alive = [t for t in g.initializer if t.name not in gone or t.name in read]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, len(moves)
