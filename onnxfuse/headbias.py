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

Only where the head split's output is rotated (the chain then takes both Adds in); a partial
rotation (Phi, GPT-NeoX: the first r columns) and other readers of the bias are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, helper, numpy_helper

from onnxfuse.graph import GraphView, bias_add
from onnxfuse.ir import copy_and_namer, graph_reads
from onnxfuse.kinds.pointwise import Rotation, pairs_at, rotate_half, rotate_pairs, rotation_at
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


def head_bias_at(view: GraphView, rot: Rotation) -> HeadBias | None:
    """The move for rotation `rot` when its x is a head split of a biased product: x = [Transpose
    keeping the last axis of] Reshape(Add(p, b)) of p [..., N] to [..., H, D] (the same leading
    dims, H * D = N, D static), b a constant [N] vector, each node read by the next alone; None
    otherwise."""
    last = view.producer.get(rot.x)
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
    return HeadBias(a, product, bias_name, r, last, rot.x, b, rot)


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
    moves = [m for rot in _rotations(view) if (m := head_bias_at(view, rot)) is not None]
    if not moves:
        return model, 0
    out, fresh = copy_and_namer(model)
    g = out.graph
    nodes = list(g.node)
    after: dict[int, list] = {}
    drop: set[int] = set()
    for mv in moves:
        stem = nodes[mv.add].name or mv.split
        bare = fresh(f"{mv.split}.unbiased")
        b_name, rb_name = fresh(f"{stem}.head_bias"), fresh(f"{stem}.head_bias_rotated")
        rotated = rotate_pairs(mv.bias) if mv.rotation.pairs else rotate_half(mv.bias)
        g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(mv.bias), b_name),
                              numpy_helper.from_array(np.ascontiguousarray(rotated), rb_name)])
        # every tensor whose value changes gets a name of its own (bisect and the tests compare
        # tensors by name with the original's)
        nodes[mv.view].input[0] = mv.product
        drop.add(mv.add)
        if mv.last != mv.view:
            heads = fresh(f"{nodes[mv.view].output[0]}.unbiased")
            nodes[mv.view].output[0] = heads
            nodes[mv.last].input[0] = heads
        nodes[mv.last].output[0] = bare
        after.setdefault(mv.last, []).append(helper.make_node("Add", [bare, b_name], [mv.split],
                                                              name=fresh(f"{stem}.below_heads")))
        # the rotation reads the unbiased split; its constant is added where it ends
        for i in mv.rotation.nodes:
            nodes[i].input[:] = [bare if x == mv.split else x for x in nodes[i].input]
        end = view.producer[mv.rotation.tensor]
        turned = fresh(f"{mv.rotation.tensor}.unbiased")
        nodes[end].output[0] = turned
        after.setdefault(end, []).append(helper.make_node("Add", [turned, rb_name], [mv.rotation.tensor],
                                                          name=fresh(f"{stem}.below_heads_rotated")))
    kept = [m for j, n in enumerate(nodes) if j not in drop for m in (n, *after.get(j, ()))]
    del g.node[:]
    g.node.extend(kept)
    gone = {mv.bias_name for mv in moves}
    read = graph_reads(g)
    alive = [t for t in g.initializer if t.name not in gone or t.name in read]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, len(moves)
