"""The attention kind (FusedAttention): scaled dot-product attention as exporters write it,
MatMul(Q, K^T) -> the pointwise ops on the scores (the scale, an additive mask, a Where that
masks, a Cast) -> Softmax over the last axis -> MatMul with V, becomes one node whose Triton
kernel (onnxfuse/codegen_attention.py, flash attention's forward pass) never writes the
scores or the probabilities to memory (docs/format.md, "FusedAttention").

A match is anchored at the Softmax:

- the **score ops**: the chain of pointwise ops from the first MatMul's output to the
  Softmax's input, each read only by the next (their other inputs, a mask, are the node's
  extra inputs and broadcast to the scores);
- the **products**: the first MatMul (Q @ K^T, both activations) and the second (P @ V), the
  Softmax read only by it (through Casts to P's dtype, none narrower: HF's
  `softmax(..., dtype=float32).to(query.dtype)`); rank 3 or 4 operands of one float dtype, the head dims D and Dv
  static;
- the **Transposes** that make the heads: chains of Transposes that produce an operand and that
  only the node reads are absorbed into the operand's `perm_*` (the kernel reads the tensor
  before them through strides), and one Transpose that alone reads the output (directly, or
  through a Reshape to the same static shape that alone reads it) into `perm_y`;
- a **Split** on the last axis whose every output reaches one operand through a Reshape to
  [..., heads, head_dim] (GPT-2's packed c_attn; BERT's three projections after
  `onnxfuse.pack` packs them): the operands are read in place from the Split's input
  (`split_q`, `split_k`, `split_v`: [offset, heads, head_dim]), so the Split never runs;
- the **bias Add** of that Split's input, X = Add(Y, b) with b a constant of X's last dim
  ([N] or [1, ..., 1, N]; the packed projection's bias after `onnxfuse.pack`) and X read by the
  Split alone: the node reads Y and adds b itself as it loads Q, K and V (`bias_q`, `bias_k`,
  `bias_v`), so the Add never runs (where each operand's heads are its H dim and its head_dim
  its D, as every exporter's packed layout has them);
- a **Mul or Div by a one-element constant** on Q's or K^T's way (torch's
  scaled_dot_product_attention export scales both by sqrt(scale)): the score program applies
  the factors to the product instead.

ONNX Runtime's own fusions (`onnxfuse.ort_fusions`): a match holding a node of ONNX
Runtime's Attention fusion is left to it whole; one that takes nodes of its smaller fusions
around attention (FusedMatMul's transposed, scaled product, BiasSoftmax's mask add) fuses work
ONNX Runtime does not (the score tensor never reaches memory), and the report's notes say so.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_attention import (
    MAX_ELEMENTS,
    AttentionSpec,
    AttentionVariant,
    attention_candidates,
    attention_variants,
    generate_attention,
)
from onnxfuse.dims import product
from onnxfuse.expr import Program, evaluate, with_input
from onnxfuse.graph import GraphView, Shape, bias_add, shape_input_spec
from onnxfuse.groups import Accepted, reentering
from onnxfuse.kinds.base import META_VERSION, Fields, FusedNode, Kind, Lowering, Match, MatchResult, NotMine, Pattern
from onnxfuse.match import DTYPE_IDS, dtype_reason, match_anchored, operands, pointwise_candidate
from onnxfuse.ops import FLOAT_TYPES, node_attrs
from onnxfuse.reference import is_float
from onnxfuse.rewrite import ir_dtype, lower_nodes, unique_name
from onnxfuse.static import evaluate_constant

DEFAULT_DOMAINS = ("", "ai.onnx")
ANCHORS = frozenset({"Softmax"})
MAX_SCORE_OPS = 16  # pointwise ops between the first MatMul and the Softmax, at most
# Attentions whose scores stay fp32 from the product to the softmax (the node's exact_scores),
# not rounded to their dtype twice as the original stores them: none by default. Alone, the
# 16-bit kernel's error against the math fell 3x with it (thirty-fourth session, H100, BERT-base
# and ViT-S heads: 0.0014 -> 0.00048, 0.0011 -> 0.0003; cuDNN's 0.00043, 0.00027), but in
# Hugging Face ViT-B/16 b8 fp16 (H100) the model's error against float64 rose (0.0100 -> 0.0121, ORT's
# 0.0100; BERT-base 0.011 -> 0.013, ORT's 0.015) at no gain in time (1.043 -> 1.049 ms under
# graphs): not written until more models show which way it goes (`attention-exact-scores`)
EXACT_SCORES_DTYPES: frozenset[str] = frozenset()

# Reasons in the report (Softmax node -> why it did not fuse as attention); the first three say
# only that the Softmax is not an attention's: the rows kind's reason for it, if any, replaces them.
NOT_LAST_AXIS = NotMine("Softmax not over the last axis")
NO_PRODUCT = NotMine("no MatMul of two activations before the Softmax through fusible pointwise ops")
NO_SECOND = NotMine("the Softmax's output is not read by one MatMul alone (as P in P @ V)")
SCORES_ELSEWHERE = "the scores or probabilities are also read elsewhere"
RANK = "attention operands of rank other than 3 or 4"
UNKNOWN_SHAPE = "unknown shape"
HEAD_DIM = "the head dims (D, Dv) are not static"
DTYPES = "Q, K and V of different dtypes"
BATCH = "the operands' batch dims differ (neither 1)"
CYCLE = "fusing would create a cycle"
P_ROUNDED = "the probabilities pass through a dtype narrower than P's on their way to P @ V"
FLOAT_BITS = {1: 32, 10: 16, 16: 16, 11: 64}  # float, float16, bfloat16, double
# The report's note for a match that absorbed its packed projection's bias Add
BIAS_NOTE = "projection bias added in the attention kernel (its Add absorbed)"


def left_to_ort(reason: str) -> str:
    return f"{reason} (ONNX Runtime fuses the whole attention)"


def taken_from_ort(reason: str) -> str:
    return (reason.replace("left to", "taken from", 1)
            + ": the fused attention also keeps the scores and probabilities out of memory")


@dataclass(frozen=True)
class AttentionParams:
    """Match attention at each Softmax; `ops`: the pointwise ops allowed on the scores."""

    ops: frozenset[str]
    dtypes: frozenset[str]

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | {"MatMul", "Softmax", "Transpose"}


@dataclass(frozen=True)
class Operand:
    """An operand as the kernel reads it: the tensor before the absorbed Transposes and the
    permutation from it to the logical operand."""

    base: str
    perm: tuple[int, ...]
    transposes: tuple[int, ...]
    reader: int = -1  # the node that reads `base` (the last Transpose absorbed, or the MatMul)
    # read in place from a packed tensor (a Split on its last axis, then a Reshape to heads):
    # the node's input is `packed`, and `split` is [offset, heads, head_dim] (docs/format.md)
    packed: str = ""
    split: tuple[int, int, int] | None = None
    split_nodes: tuple[int, ...] = ()  # the Reshape (and, for the first operand of its Split, the Split)
    # the Split's input made by Add(packed, bias) with a constant bias, the Add absorbed: the node
    # reads `packed` and adds `bias` as it loads the operand (the first operand carries the Add)
    bias: str = ""
    bias_add: int = -1
    # Q and K^T scaled by one-element constants on their way (torch's scaled_dot_product_attention
    # export multiplies each by sqrt(scale)): the product of the factors, and the Mul / Div nodes
    scale: float = 1.0
    scale_nodes: tuple[int, ...] = ()

    @property
    def input(self) -> str:
        """The node's input for this operand."""
        return self.packed or self.base


@dataclass(frozen=True)
class AttentionParts:
    """What a match found (Match.params)."""

    qk: int  # the first MatMul
    softmax: int
    pv: int  # the second MatMul
    q: Operand
    k: Operand  # K^T, the first MatMul's second operand
    v: Operand
    score_ops: tuple[int, ...]  # topological order
    y_transpose: int | None
    perm_y: tuple[int, ...]
    result: str
    rank: int
    head_d: int
    head_dv: int
    batch_heads: int | None
    sq: int | None
    sk: int | None
    notes: tuple[str, ...] = ()
    nan_to_zero: bool = False
    kv_group: int = 1  # grouped-query attention: query head h reads K and V's head h // kv_group
    zero_where: str = ""  # the bool tensor m of a Where(m, 0, P) between the Softmax and P @ V


@dataclass(frozen=True)
class AttentionInfo:
    """What a FusedAttention node's kernel needs besides its program (FusedNode.params)."""

    rank: int
    perm_q: tuple[int, ...]
    perm_k: tuple[int, ...]
    perm_v: tuple[int, ...]
    perm_y: tuple[int, ...]
    head_d: int
    head_dv: int
    batch_heads: int | None
    sq: int | None
    sk: int | None
    nan_to_zero: bool = False
    bias: tuple[bool, bool, bool] = (False, False, False)  # Q, K^T, V read with a bias added
    extras_broadcast: tuple[str, ...] = ()  # per extra: AttentionSpec.extras_broadcast
    causal_fill: float | None = None  # AttentionSpec.causal_fill
    causal_masked: float | None = None  # AttentionSpec.causal_masked
    kv_group: int = 1  # AttentionParts.kv_group
    zero_where: int | None = None  # the extra that is AttentionParts.zero_where (AttentionSpec.zero_where)
    exact_scores: bool = False  # AttentionSpec.exact_scores: 16-bit attentions' scores unrounded


def _same_known_shape(view: GraphView, a: str, b: str) -> bool:
    """Whether tensors a and b have one known shape, sizes or names (a Reshape between them is a copy)."""
    sa = _known(view, a)
    return sa is not None and view.shapes.get(b) == tuple(sa)


def _perm(view: GraphView, t: int, rank: int) -> tuple[int, ...]:
    p = node_attrs(view.nodes[t]).get("perm")
    return tuple(int(x) for x in p) if p else tuple(reversed(range(rank)))


def operand(view: GraphView, name: str, reader: int, rank: int, taken: set[int], scales: bool = False) -> Operand:
    """`name` read by node `reader`, through the chain of Transposes before it that only the
    chain reads (logical = Transpose(base, perm)); with `scales` (Q and K^T), also through
    Mul and Div by one-element constants, whose factors the score program applies instead."""
    perm = tuple(range(rank))
    transposes: list[int] = []
    scale, scale_nodes = 1.0, []
    while True:
        t = view.producer.get(name)
        if t is None or t in taken or not view.only_reader(name, reader):
            break
        n = view.nodes[t]
        if view.is_op(t, "Transpose"):
            p = _perm(view, t, rank)
            if len(p) != rank:
                break
            perm = tuple(p[i] for i in perm)  # Transpose(Transpose(x, p), perm) = Transpose(x, p o perm)
            transposes.append(t)
            reader, name = t, n.input[0]
            continue
        merged = _merged_heads_transpose(view, name, reader, taken) if rank == 4 else None
        if merged is not None:  # as a Transpose of the last two dims (the nodes absorbed with the Transposes)
            p = (0, 1, 3, 2)
            perm = tuple(p[i] for i in perm)
            transposes += merged[1]
            reader, name = merged[1][-1], merged[0]
            continue
        factor = _scaling(view, t) if scales else None
        if factor is None:
            break
        scale *= factor[0]
        scale_nodes.append(t)
        reader, name = t, factor[1]
    return Operand(name, perm, tuple(transposes), reader, scale=scale, scale_nodes=tuple(scale_nodes))


def _walk_back(view: GraphView, name: str, reader: int, ops: tuple[str, ...],
               taken: set[int]) -> tuple[list[int], str, int] | None:
    """The nodes of types `ops`, in order, that make `name` for `reader`, each read by the one
    after it alone (the last by `reader`), none taken: (the nodes, the last one's first input, the
    last node); None otherwise. Their other inputs (shapes, axes) are constants, or shape
    arithmetic the data input's shape decides (`shape_input_spec`: the function body computes it so)."""
    nodes = []
    for op in ops:
        i = view.producer.get(name)
        if not view.is_op(i, op) or i in taken or not view.only_reader(name, reader):
            return None
        if any(x not in view.constants for x in view.nodes[i].input[1:] if x) \
                and shape_input_spec(view, view.nodes[i]) is None:
            return None
        nodes.append(i)
        reader, name = i, view.nodes[i].input[0]
    return nodes, name, reader


MERGED_SWAP = ("Reshape", "Transpose", "Reshape")  # torch's dynamo exporter's K^T over merged heads


def _merged_heads_transpose(view: GraphView, name: str, reader: int, taken: set[int]) -> tuple[str, tuple] | None:
    """(x, the three nodes) where `name` is Reshape(Transpose(Reshape(x [B, H, M, N], [B * H, M, N]),
    [0, 2, 1]), [B, H, N, M]): x's last two dims swapped, as torch's dynamo exporter writes K^T
    (known shapes, sizes or names: B * H is "12*batch" where the batch is dynamic; `_walk_back`'s
    conditions); None otherwise."""
    walked = _walk_back(view, name, reader, MERGED_SWAP, taken)
    if walked is None or _perm(view, walked[0][1], 3) != (0, 2, 1):
        return None
    (t, tr, r0), x, _ = walked
    xs, ms, ys = _known(view, x), _known(view, view.nodes[r0].output[0]), _known(view, name)
    if xs is None or ms is None or ys is None or len(xs) != 4:
        return None
    b, h, m, n = xs
    if ms != [product(b, h), m, n] or ys != [b, h, n, m]:
        return None
    return x, (t, tr, r0)


def _known(view: GraphView, name: str) -> list[int | str] | None:
    """`name`'s shape when every dim is known, a size or a name ("batch", "12*batch")."""
    shape = view.shapes.get(name)
    return list(shape) if shape is not None and all(e is not None for e in shape) else None


def repeated_heads(view: GraphView, o: Operand, taken: set[int], scales: bool) -> tuple[Operand, int, tuple] | None:
    """Grouped-query attention's repeat of the key-value heads, as Hugging Face's repeat_kv
    exports it: o's base (rank 4, [B, H, S, D] with H logical dim 1) is Reshape(Expand(Unsqueeze(x)
    [B, Hkv, 1, S, D], [B, Hkv, G, S, D]), [B, Hkv * G, S, D]), or, as torch's dynamo exporter
    writes K^T, Reshape(Transpose(Reshape(that Expand, [B * H, S, D]), [0, 2, 1]), [B, H, D, S])
    (`_walk_back`'s conditions). Returns the operand over x (through x's own Transposes, and with
    `scales` its constant factors), G, and the nodes; None otherwise."""
    if len(o.perm) != 4 or o.perm[:2] != (0, 1):
        return None
    repeat = ("Expand", "Unsqueeze")
    walked = _walk_back(view, o.base, o.reader, MERGED_SWAP + repeat, taken)
    swap = walked is not None and _perm(view, walked[0][1], 3) == (0, 2, 1)
    if not swap:
        walked = _walk_back(view, o.base, o.reader, ("Reshape", *repeat), taken)
    if walked is None:
        return None
    nodes, name, reader = walked
    xs = _known(view, name)
    es, us = (_known(view, view.nodes[i].output[0]) for i in nodes[-2:])
    outs = [_known(view, view.nodes[i].output[0]) for i in nodes[:-2]]  # the Reshapes (and the Transpose)
    if xs is None or es is None or us is None or None in outs or len(xs) != 4 or len(es) != 5:
        return None
    b, hkv, sx, dx = xs
    g = es[2]
    if not isinstance(g, int) or g < 2:
        return None
    heads, rows = product(hkv, g), product(b, hkv, g)
    want = [[b, heads, dx, sx], [rows, dx, sx], [rows, sx, dx]] if swap else [[b, heads, sx, dx]]
    if us != [b, hkv, 1, sx, dx] or es != [b, hkv, g, sx, dx] or outs != want:
        return None
    inner = operand(view, name, reader, 4, taken, scales=scales)
    p = (0, 1, 3, 2) if swap else (0, 1, 2, 3)
    perm = tuple(inner.perm[p[i]] for i in o.perm)  # Transpose(Transpose(x, q), perm) = Transpose(x, q o perm)
    return (Operand(inner.base, perm, o.transposes + inner.transposes, inner.reader, scale=o.scale * inner.scale,
                    scale_nodes=o.scale_nodes + inner.scale_nodes), g, tuple(nodes))


def _scaling(view: GraphView, t: int) -> tuple[float, str] | None:
    """(factor, the scaled tensor) when node t multiplies a tensor by a one-element constant
    (Mul, either order) or divides it by one (Div), keeping its shape."""
    n = view.nodes[t]
    if n.op_type not in ("Mul", "Div") or n.domain not in DEFAULT_DOMAINS or len(n.input) != 2:
        return None
    for k in ((0, 1) if n.op_type == "Mul" else (1,)):
        c, x = view.scalar_constant(n.input[k]), n.input[1 - k]
        if c is None or not c or x in view.constants or view.shapes.get(x) is None:
            continue
        if view.shapes.get(x) != view.shapes.get(n.output[0]):
            continue
        return (c if n.op_type == "Mul" else 1.0 / c), x
    return None


def _head_reshape(view: GraphView, o: Operand, taken: set[int]) -> int | None:
    """The Reshape making operand `o`'s base, read by the chain alone, its shape a constant or one
    its input's shape decides (the function body computes it from that input); None otherwise."""
    r = view.producer.get(o.base)
    if not view.is_op(r, "Reshape") or r in taken or not view.only_reader(o.base, o.reader):
        return None
    if len(view.nodes[r].input) < 2 or (view.nodes[r].input[1] not in view.constants
                                         and shape_input_spec(view, view.nodes[r]) is None):
        return None  # a shape computed at run time that the function body cannot compute from its input
    return r


def _split_view(view: GraphView, o: Operand, taken: set[int]) -> tuple[int, int, str, tuple[int, int, int]] | None:
    """(the Reshape, the Split, the packed tensor, [offset, heads, head_dim]) when operand `o`'s
    base is a Reshape to [..., heads, head_dim] of one output of a Split on the last axis,
    each read only by the chain; None otherwise."""
    r = _head_reshape(view, o, taken)
    if r is None:
        return None
    part = view.nodes[r].input[0]
    sp = view.producer.get(part)
    if not view.is_op(sp, "Split") or sp in taken or not view.only_reader(part, r):
        return None
    x = view.nodes[sp].input[0]
    xs, ps, bs = view.shapes.get(x), view.shapes.get(part), view.shapes.get(o.base)
    if xs is None or ps is None or bs is None or len(ps) != len(xs) or len(bs) != len(xs) + 1:
        return None
    axis = int(node_attrs(view.nodes[sp]).get("axis", 0))
    if axis % len(xs) != len(xs) - 1 or list(bs[:-2]) != list(ps[:-1]):
        return None
    heads, head_dim, width = bs[-2], bs[-1], ps[-1]
    if not all(isinstance(v, int) for v in (heads, head_dim, width)) or heads * head_dim != width:
        return None
    offset = 0
    for out in view.nodes[sp].output:
        if out == part:
            return r, sp, x, (offset, heads, head_dim)
        width = (view.shapes.get(out) or (None,))[-1]
        if not isinstance(width, int):
            return None
        offset += width
    return None


def _biased_heads(view: GraphView, o: Operand, which: int, taken: set[int]) -> Operand | None:
    """Operand `o` read from the product before its bias where its base is a Reshape to [...,
    heads, head_dim] of Add(y, bias), y [..., heads * head_dim] with the same leading dims, each
    read only by the chain: as the one part of a split [0, heads, head_dim] of y, the node adding
    the bias as it loads the operand (the Add and the Reshape among the operand's nodes; BART's,
    OPT's, Whisper's and DeBERTa's per-operand projections, Qwen2's V); None otherwise."""
    r = _head_reshape(view, o, taken)
    if r is None:
        return None
    x = view.nodes[r].input[0]
    add = bias_add(view, x, r, taken)
    xs, bs = view.shapes.get(x), view.shapes.get(o.base)
    if add is None or xs is None or bs is None or len(bs) != len(xs) + 1 or list(bs[:-2]) != list(xs[:-1]):
        return None
    heads, head_dim = bs[-2], bs[-1]
    if not all(isinstance(v, int) for v in (heads, head_dim)) or heads * head_dim != xs[-1]:
        return None
    out = dataclasses.replace(o, packed=add[1], split=(0, heads, head_dim), split_nodes=(r, add[0]),
                              bias=add[2], bias_add=add[0])
    return out if _bias_fits(out, which) else None


def packed_operands(view: GraphView, ops: tuple[Operand, ...], taken: set[int]) -> tuple[Operand, ...]:
    """The operands, each read in place from its Split's input where the Splits they come from
    are absorbed whole: every output of each such Split is the base of one of them (through
    its Reshape). The first operand of a Split carries the Split among its nodes, and the
    Split input's bias Add when that is absorbed too (`graph.bias_add`, `_bias_fits`: the operands
    then read the Add's tensor input and carry its bias). An operand from no Split whose head
    Reshape reads a biased product reads the product and adds the bias (`_biased_heads`)."""
    views = [_split_view(view, o, taken) for o in ops]
    by_split: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        if v is not None:
            by_split.setdefault(v[1], []).append(i)
    out = list(ops)
    for sp, members in by_split.items():
        if len(members) != len(view.nodes[sp].output):
            continue
        x = views[members[0]][2]
        add = bias_add(view, x, sp, taken)
        if add is not None and not all(_bias_fits(ops[i], i) for i in members):
            add = None
        for k, i in enumerate(members):
            r, _, _, split = views[i]
            nodes = ((r, sp) + ((add[0],) if add else ())) if k == 0 else (r,)
            o = dataclasses.replace(ops[i], packed=x, split=split, split_nodes=nodes)
            if add is not None:
                o = dataclasses.replace(o, packed=add[1], bias=add[2], bias_add=add[0])
            out[i] = o
    for i, o in enumerate(ops):
        if views[i] is None and (biased := _biased_heads(view, o, i, taken)) is not None:
            out[i] = biased
    return tuple(out)


def _bias_fits(o: Operand, which: int) -> bool:
    """Whether operand `o` (0 Q, 1 K^T, 2 V), read from a split, has the split's heads as its
    logical H dim (r - 3) and the split's head_dim as its D (the kernel loads a head's bias
    slice as a vector along D, docs/format.md)."""
    r = len(o.perm)
    d_dim = r - 2 if which == 1 else r - 1  # K^T is [..., D, Sk]
    return o.perm[r - 3] == r - 2 and o.perm[d_dim] == r - 1


def _score_path(view: GraphView, x: str, sm: int, target: Shape, pattern: Pattern, taken: set[int]
                ) -> tuple[int, list[int]] | None:
    """(the first MatMul, the pointwise nodes from its output to `x`, topological order): a
    chain in which each node's output is read only by the next (the last one's by the
    Softmax `sm`), found depth first through the operands of the scores' shape."""
    def walk(name: str, reader: int, path: list[int]) -> tuple[int, list[int]] | None:
        p = view.producer.get(name)
        if p is None or p in taken or not view.only_reader(name, reader):
            return None
        if view.is_op(p, "MatMul"):
            return p, path[::-1]
        if len(path) >= MAX_SCORE_OPS or not pointwise_candidate(view, p, pattern, taken):
            return None
        for name_in in dict.fromkeys(view.nodes[p].input):
            shape = view.shapes.get(name_in)
            if name_in and name_in not in view.constants and shape is not None and len(shape) == len(target) \
                    and fits(shape, target):
                found = walk(name_in, p, [*path, p])
                if found is not None:
                    return found
        return None
    return walk(x, sm, [])


def _nan_guard(view: GraphView, probs: str, readers: list[int]) -> tuple[int, int] | None:
    """(IsNaN, Where) when `probs` is read only by IsNaN(probs) and Where(that, 0, probs), the
    Where's output NaN probabilities set to 0; None otherwise."""
    if len(readers) != 2:
        return None
    isnan = next((r for r in readers if view.is_op(r, "IsNaN")), None)
    where = next((r for r in readers if view.is_op(r, "Where")), None)
    if isnan is None or where is None:
        return None
    flag = view.nodes[isnan].output[0]
    w = view.nodes[where]
    if list(w.input) != [flag, w.input[1], probs] or view.scalar_constant(w.input[1]) != 0.0:
        return None
    if not view.only_reader(flag, where) or view.shapes.get(w.output[0]) != view.shapes.get(probs):
        return None
    return isnan, where


def _zeroing_where(view: GraphView, probs: str, readers: list[int], target: Shape) -> int | None:
    """The Where when `probs` is read only by Where(m, 0, probs), m a bool tensor that
    broadcasts to the scores (DeBERTa's XSoftmax in Hugging Face transformers 4: the masked
    probabilities set to 0 after the softmax, a fully masked row's too); None otherwise."""
    if len(readers) != 1 or not view.is_op(readers[0], "Where"):
        return None
    w = view.nodes[readers[0]]
    if len(w.input) != 3 or w.input[2] != probs or view.scalar_constant(w.input[1]) != 0.0:
        return None
    if view.types.get(w.input[0]) != TensorProto.BOOL or not fits(view.shapes.get(w.input[0]), target):
        return None
    if view.types.get(w.output[0]) != view.types.get(probs) or view.shapes.get(w.output[0]) != view.shapes.get(probs):
        return None
    return readers[0]


def fits(shape: Shape | None, target: Shape) -> bool:
    """A tensor of `shape` may broadcast to `target` without enlarging it: each of its dims
    (right-aligned) is 1, equal to target's, or symbolic where target's is not 1 (dynamic
    exports: the library checks the run-time shapes)."""
    if shape is None or len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape):]
    return all(d == 1 or d == t or (not isinstance(d, int) and t != 1)
               or (isinstance(d, int) and not isinstance(t, int)) for d, t in zip(shape, tail, strict=True))


def _dim(v) -> int | None:
    return v if isinstance(v, int) else None


def find_attention(view: GraphView, sm: int, pattern: Pattern, taken: set[int], accepted: Accepted,
                   reserved: dict[int, str]) -> Match | str:
    """The attention around Softmax node `sm`, or why there is none."""
    p: AttentionParams = pattern.match
    node = view.nodes[sm]
    x, probs = node.input[0], node.output[0]
    x_shape = view.shapes.get(x)
    if x_shape is None:
        return UNKNOWN_SHAPE
    rank = len(x_shape)
    axis = int(node_attrs(node).get("axis", -1 if view.opset >= 13 else 1))
    if axis % max(rank, 1) != rank - 1:
        return NOT_LAST_AXIS
    found = _score_path(view, x, sm, tuple(x_shape), pattern, taken)
    if found is None:
        return NO_PRODUCT
    if rank not in (3, 4):
        return RANK
    qk, score_ops = found
    p_casts, p_dtypes = [], [view.types.get(probs)]
    nan_guard: tuple[int, int] | None = None
    zeroing: int | None = None
    while True:  # Casts between the Softmax and P @ V (HF: softmax(..., dtype=float32).to(query.dtype))
        readers = list(view.consumers.get(probs, ()))
        if probs in view.graph_outputs or any(r in taken for r in readers):
            return NO_SECOND
        guard = _nan_guard(view, probs, readers) if nan_guard is None else None
        if guard is not None:  # torch's scaled_dot_product_attention export: Where(IsNaN(P), 0, P)
            nan_guard = guard
            probs = view.nodes[guard[1]].output[0]
            continue
        zero = _zeroing_where(view, probs, readers, tuple(x_shape)) if zeroing is None else None
        if zero is not None:  # Where(m, 0, P): the kernel zeroes those p after their row's sum
            zeroing = zero
            probs = view.nodes[zero].output[0]
            continue
        if len(readers) != 1:
            return NO_SECOND
        if not view.is_op(readers[0], "Cast"):
            break
        p_casts.append(readers[0])
        probs = view.nodes[readers[0]].output[0]
        p_dtypes.append(view.types.get(probs))
    if not view.is_op(readers[0], "MatMul") or view.nodes[readers[0]].input[0] != probs:
        return NO_SECOND
    pv = readers[0]
    scores = view.nodes[qk].output[0]
    if not view.only_reader(scores, score_ops[0] if score_ops else sm):
        return SCORES_ELSEWHERE
    inside = {scores, *(view.nodes[j].output[0] for j in score_ops)}
    for j in score_ops:
        if not all(name in inside or fits(view.shapes.get(name), tuple(x_shape)) for _, name in operands(view, j)):
            return "a score op's other input does not broadcast to the scores"
    q = operand(view, view.nodes[qk].input[0], qk, rank, taken, scales=True)
    k = operand(view, view.nodes[qk].input[1], qk, rank, taken, scales=True)
    v = operand(view, view.nodes[pv].input[1], pv, rank, taken)
    kv_group, repeat_nodes = 1, ()
    rk, rv = repeated_heads(view, k, taken, True), repeated_heads(view, v, taken, False)
    if rk is not None and rv is not None and rk[1] == rv[1]:  # K and V each repeated G times
        k, v, kv_group, repeat_nodes = rk[0], rv[0], rk[1], rk[2] + rv[2]
    q, k, v = packed_operands(view, (q, k, v), taken)
    dtype = view.types.get(q.base)
    if dtype not in {DTYPE_IDS[d] for d in p.dtypes}:
        return dtype_reason(dtype)
    if any(view.types.get(t) != dtype for t in (k.base, v.base, scores, probs, view.nodes[pv].output[0])):
        return DTYPES
    # the probabilities are rounded once, to P's dtype: every dtype before it at least as wide
    if any(FLOAT_BITS.get(t, 0) < FLOAT_BITS[dtype] for t in p_dtypes):
        return P_ROUNDED
    shapes = [view.shapes.get(o.base) for o in (q, k, v)]
    if any(s is None for s in shapes):
        return UNKNOWN_SHAPE
    if any(len(s) != rank for s in shapes):
        return RANK
    lq, lk, lv = ([s[i] for i in o.perm] for s, o in zip(shapes, (q, k, v), strict=True))
    if kv_group > 1:  # K's and V's heads as the queries see them
        lk[1], lv[1] = product(lk[1], kv_group), product(lv[1], kv_group)
    d, dv = _dim(lq[-1]), _dim(lv[-1])
    if d is None or dv is None or _dim(lk[-2]) != d:
        return HEAD_DIM
    # the batch dims: sizes that differ (neither 1) do not broadcast; symbolic or unknown ones (a
    # dynamic export's Reshapes to computed shapes, a KV cache's) broadcast as the library checks
    # them at run time, with numpy's rules, as the products' own broadcasting would
    lead = []
    for dims in zip(*(s[:-2] for s in (lq, lk, lv)), strict=True):
        sizes = {e for e in dims if isinstance(e, int) and e != 1}
        if len(sizes) > 1:
            return BATCH
        symbols = {e for e in dims if not isinstance(e, int)}
        if sizes:
            lead.append(next(iter(sizes)))
        elif symbols:  # one name they share, else unknown
            lead.append(next(iter(symbols)) if len(symbols) == 1 else None)
        else:
            lead.append(1)
    # the output's Transpose, when it alone reads the product (through a Reshape to the same
    # shape, as Hugging Face transformers 5.24's sdpa attention writes it, when that alone does)
    y = view.nodes[pv].output[0]
    y_transpose, perm_y, result, y_reshape = None, tuple(range(rank)), y, None
    t = next(iter(view.consumers.get(y, ())), None)
    if view.is_op(t, "Reshape") and t not in taken and view.only_reader(y, t) and _same_known_shape(
            view, y, view.nodes[t].output[0]):
        after = view.nodes[t].output[0]
        t2 = next(iter(view.consumers.get(after, ())), None)
        if view.is_op(t2, "Transpose") and t2 not in taken and view.only_reader(after, t2):
            y_reshape, y, t = t, after, t2
    if view.is_op(t, "Transpose") and t not in taken and view.only_reader(y, t) and len(_perm(view, t, rank)) == rank:
        y_transpose, perm_y, result = t, _perm(view, t, rank), view.nodes[t].output[0]
    elif y_reshape is not None:
        y_reshape = None
    group = sorted({*q.transposes, *k.transposes, *v.transposes, *q.split_nodes, *k.split_nodes, *v.split_nodes,
                    *q.scale_nodes, *k.scale_nodes, *repeat_nodes, qk, *score_ops, sm, *p_casts, *(nan_guard or ()),
                    *((zeroing,) if zeroing is not None else ()), pv,
                    *(x for x in (y_transpose, y_reshape) if x is not None)})
    if any(i in taken for i in group):
        return "a node is taken by an earlier pattern"
    if reentering(view, group, accepted):
        return CYCLE
    if view.types.get(result) not in FLOAT_TYPES:
        return dtype_reason(view.types.get(result))
    notes: list[str] = []
    own = [reserved[i] for i in group if i in reserved]
    if any("Attention" in r for r in own):
        return left_to_ort(next(r for r in own if "Attention" in r))
    adds = {o.bias_add for o in (q, k, v) if o.bias}
    others = [reserved[i] for i in group if i in reserved and i not in adds]
    if others:
        notes.append(taken_from_ort(others[0]))
    if adds:  # the bias Add, and ONNX Runtime's MatMul + Add into Gemm fusion it may take it from
        from_ort = [reserved[a].replace("left to", "taken from", 1) for a in sorted(adds) if a in reserved]
        notes.append(", ".join([BIAS_NOTE, *from_ort[:1]]))
    bh = None
    if all(isinstance(e, int) for e in lead):
        bh = int(np.prod(lead, dtype=np.int64)) if lead else 1
    parts = AttentionParts(qk, sm, pv, q, k, v, tuple(score_ops), y_transpose, tuple(perm_y), result, rank, d, dv,
                           bh, _dim(lq[-2]), _dim(lk[-1]), tuple(notes), nan_guard is not None, kv_group,
                           view.nodes[zeroing].input[0] if zeroing is not None else "")
    return Match(pattern, tuple(group), (result,), result=result, params=parts)


def match_attention(view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
                    reserved: dict[int, str]) -> MatchResult:
    """Matches at every Softmax not taken yet, in topological order; adds their nodes to
    `taken` and `accepted`. `anchors` say why each other Softmax did not match, `notes` which
    of ONNX Runtime's fusions a match took nodes from and which absorbed a projection's bias."""
    return match_anchored(view, pattern, taken, accepted, ANCHORS,
                          lambda v, i, p, t, a: find_attention(v, i, p, t, a, reserved), lambda m: m.params.notes)


# ---------------------------------------------------------------------------------------
# Lowering
# ---------------------------------------------------------------------------------------

PRODUCT = "\0attention product"  # the program's %0 when Q or K^T carry a factor (no graph tensor has this name)


def lower_attention(view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
    """The FusedAttention node (docs/format.md): inputs Q, K^T, V (the tensors before their
    absorbed Transposes), the score ops' extras; the body the original nodes."""
    parts: AttentionParts = match.params
    scores = view.nodes[parts.qk].output[0]
    x = view.nodes[parts.softmax].input[0]
    dt = ir_dtype(view, scores)
    scale = parts.q.scale * parts.k.scale
    if scale == 1.0:
        program, inputs, folded = lower_nodes(view, parts.score_ops, (x,), [(scores, dt)])
    else:  # Q's and K^T's constant factors on the product (%0), stored in its dtype as the MatMul's output

        def prelude(b, env):
            v = b.emit("mul", env[PRODUCT], scale)
            env[scores] = v if dt == "f32" else b.emit(f"round_{dt}", v)
        program, inputs, folded = lower_nodes(view, parts.score_ops, (x,), [(PRODUCT, dt)], prelude, {scores})
    extras = inputs[1:]
    body = [view.nodes[i] for i in match.nodes]
    qkv = (parts.q, parts.k, parts.v)
    values: dict = {}  # the extras' values that follow from constants, evaluated once (`_constant_value`)
    reads, fill, masked = _extra_reads(view, program, extras, parts.sq, parts.sk, values)
    zero = None
    if parts.zero_where:  # Where(m, 0, P)'s m: an extra the score program does not read (unless it is one)
        if parts.zero_where in extras:
            zero = extras.index(parts.zero_where)
        else:
            zero = len(extras)
            extras = [*extras, parts.zero_where]
            program = with_input(program, "bool")
            reads = (*reads, _read_of(view, parts.zero_where))
    info = AttentionInfo(parts.rank, parts.q.perm, parts.k.perm, parts.v.perm, parts.perm_y, parts.head_d,
                         parts.head_dv, parts.batch_heads, parts.sq, parts.sk, parts.nan_to_zero,
                         tuple(bool(o.bias) for o in qkv), reads, fill, masked, parts.kv_group, zero,
                         exact_scores=dt in EXACT_SCORES_DTYPES)
    attrs = {"perm_q": list(info.perm_q), "perm_k": list(info.perm_k), "perm_v": list(info.perm_v),
             "perm_y": list(info.perm_y), **({"nan_to_zero": 1} if info.nan_to_zero else {}),
             **({"kv_group": info.kv_group} if info.kv_group > 1 else {}),
             **({"zero_where": info.zero_where} if info.zero_where is not None else {}),
             **({"exact_scores": 1} if info.exact_scores else {})}
    key = (f"attention rank={info.rank} perm_q={info.perm_q} perm_k={info.perm_k} perm_v={info.perm_v} "
           f"perm_y={info.perm_y} D={info.head_d} Dv={info.head_dv} BH={info.batch_heads} Sq={info.sq} "
           f"Sk={info.sk}")
    if info.nan_to_zero:
        key += " nan_to_zero"
    if info.kv_group > 1:
        key += f" kv_group={info.kv_group}"
    if info.zero_where is not None:
        key += f" zero_where={info.zero_where}"
    if info.exact_scores:
        key += " exact_scores"
    if any(info.extras_broadcast):
        key += f" extras_broadcast={info.extras_broadcast}"
    if info.causal_fill is not None:
        key += f" causal_fill={info.causal_fill!r}"
    if info.causal_masked is not None:
        key += f" causal_masked={info.causal_masked!r}"
    for w, o in zip("qkv", qkv, strict=True):
        if o.split is not None:
            attrs[f"split_{w}"] = list(o.split)
            key += f" split_{w}={o.split}"
    # the biases after the extras, each input once (Q, K and V usually share the packed one)
    biases: list[str] = []
    for w, o in zip("qkv", qkv, strict=True):
        if o.bias:
            if o.bias not in biases:
                biases.append(o.bias)
            attrs[f"bias_{w}"] = 3 + len(extras) + biases.index(o.bias)
            key += f" bias_{w}"
    bias_inputs = [_bias_vector(view, b, node_name, names, graph) for b in biases]
    stored = [_computed_extra(view, e, r, names, graph, values)
              for e, r in zip(extras, info.extras_broadcast, strict=True)]
    inputs = [*(o.input for o in qkv), *stored, *bias_inputs]
    return Lowering(program, folded, inputs, body, attrs, key, parts.rank, ("full",) + ("strided",) * len(extras),
                    {"params": info}, None if stored == extras else [*(o.input for o in qkv), *extras, *bias_inputs])


def _extra_reads(view: GraphView, program, extras: list[str], sq: int | None, sk: int | None,
                 values: dict) -> tuple[tuple[str, ...], float | None, float | None]:
    """How the kernel reads each extra (AttentionSpec.extras_broadcast); with one bool causal
    mask among them, the score program's value where it is false (causal_fill) when that is
    one value whatever the scores and the other extras; the masked value of the additive causal
    masks (causal_masked: one value for all of them, else only the first is computed). `values`
    memoizes `_constant_value`."""
    reads = []
    masked: float | None = None
    for e in extras:
        kind, value = _causal(view, e, sq, sk, values)
        if kind and (kind == "causal" or masked in (None, value)):
            reads.append(kind)
            masked = value if kind == "causal_add" else masked
        else:
            reads.append(_read_of(view, e))
    causal = [i for i, r in enumerate(reads) if r == "causal"]
    fill = _constant_where_masked(program, 1 + causal[0]) if len(causal) == 1 else None
    return tuple(reads), fill, masked


def _read_of(view: GraphView, extra: str) -> str:
    """How the kernel reads an extra that is not computed as a causal mask: as what its shape
    broadcasts as, or as its first row where its rows are shown equal (`_rows_equal`)."""
    r = _broadcast_dims(view.shapes.get(extra))
    return "row" if r == "" and _rows_equal(view, extra, {}) else r


# the most elements a mask may have to be evaluated at optimize time (`_constant_value`): 2048^2,
# 0.27 s per layer for the four ops of GPT-2 sdpa's mask at 2048 (this 2-core CPU)
MASK_EVAL_MAX = 1 << 22


def _constant_value(view: GraphView, name: str, memo: dict, depth: int = 0) -> np.ndarray | None:
    """The value of a tensor that follows from constants alone: a constant, or a node of
    constant-foldable ops (onnxfuse.static.FOLDABLE, Trilu) of such tensors, evaluated with
    ONNX's reference implementation (Hugging Face transformers 5's GPT-2 sdpa mask:
    Where(Equal(Trilu(Expand(1)), 0), -inf, 0) per layer, which ONNX Runtime folds when the
    session starts); None otherwise, or where a value holds more than MASK_EVAL_MAX elements."""
    if name in memo:
        return memo[name]
    memo[name] = None
    if name in view.constants:
        c = view.constants[name]
        if int(np.prod(c.dims)) <= MASK_EVAL_MAX:
            memo[name] = numpy_helper.to_array(c)
        return memo[name]
    i = view.producer.get(name)
    if i is None or depth > 32:
        return None
    n = view.nodes[i]
    inputs = {x: _constant_value(view, x, memo, depth + 1) for x in n.input if x}
    if any(v is None for v in inputs.values()):
        return None
    values = evaluate_constant(n, inputs, view.opset, MASK_EVAL_MAX)
    if values is not None:
        memo.update(values)
    return memo[name] if values is not None else None


def _causal(view: GraphView, name: str, sq: int | None, sk: int | None, memo: dict) -> tuple[str, float | None]:
    """("causal", None) for a constant bool mask [..., Sq, Sk] (a constant, or a value that follows
    from constants alone: `_constant_value`) that keeps key j for query i where
    j <= i + Sk - Sq (GPT-2's, exported at static shapes, with or without a cache offset), the
    same for every leading index; ("causal_add", c) for an additive float one: 0 where kept, one
    value c < 0 elsewhere (Hugging Face transformers 5's GPT-2, eager: c = the dtype's lowest);
    ("", None) otherwise."""
    if sq is None or sk is None:
        return "", None
    a = _constant_value(view, name, memo)
    if a is None or a.ndim < 2 or a.shape[-2:] != (sq, sk) or a.size == 0:
        return "", None
    slices = a.reshape(-1, sq, sk)
    if not (slices == slices[:1]).all():
        return "", None
    keep = np.tri(sq, sk, sk - sq, dtype=bool)
    first = slices[0]
    if a.dtype == np.bool_:
        return ("causal", None) if np.array_equal(first, keep) else ("", None)
    if a.dtype.kind != "f" or keep.all() or not (first[keep] == 0).all():
        return "", None
    values = np.unique(first[~keep])
    if len(values) != 1 or not values[0] < 0:
        return "", None
    return "causal_add", float(values[0])


# Ops whose output element is a function of their inputs' elements at the same (broadcast)
# index: a tensor made by them of tensors whose rows are equal has equal rows too
ROW_WISE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Where", "Cast", "Not", "And", "Or", "Xor",
                          "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf", "Identity",
                          "Max", "Min", "Sign", "Floor", "Ceil", "Clip", "Exp", "Log", "Sqrt", "Reciprocal"})


def _rows_equal(view: GraphView, name: str, memo: dict[str, bool], depth: int = 0) -> bool:
    """Whether tensor `name` holds the same values in every row of its second-to-last axis (the
    queries, for an extra of the scores): its dim there is 1 or it has fewer than two, it is a
    constant whose rows are equal, or it is an Expand or a row-wise op (ROW_WISE_OPS) of such
    tensors. A padding mask [B, S] made [B, 1, 1, S], then And-ed with an all-true [1, 1, S, S]
    and Expanded to [B, 1, S, S] (Hugging Face transformers 5's BERT) is one."""
    if name in memo:
        return memo[name]
    memo[name] = False  # a cycle or a path too deep: not shown equal
    shape = view.shapes.get(name)
    if shape is not None and (len(shape) < 2 or shape[-2] == 1):
        memo[name] = True
    elif name in view.constants:
        a = numpy_helper.to_array(view.constants[name])
        first = a[..., :1, :] if a.ndim >= 2 else a
        same = a == first
        if is_float(a.dtype):
            same |= np.isnan(a) & np.isnan(first)
        memo[name] = a.ndim < 2 or bool(same.all())
    elif (i := view.producer.get(name)) is not None and depth < 32:
        n = view.nodes[i]
        if n.domain in DEFAULT_DOMAINS and n.op_type == "Expand":
            memo[name] = _rows_equal(view, n.input[0], memo, depth + 1)
        elif n.domain in DEFAULT_DOMAINS and n.op_type in ROW_WISE_OPS:
            memo[name] = all(_rows_equal(view, x, memo, depth + 1) for x in n.input if x)
    return memo[name]


# scores at which the program's value where the mask is false is checked to be one value
_PROBE_SCORES = (0.0, 1.0, -1.0, 3.25, 1e4, -1e4, 6e4, -6e4, np.inf, -np.inf, np.nan)


def _constant_where_masked(program, mask_input: int) -> float | None:
    """The program's output where input `mask_input` (a bool) is false, if it is one value (not
    NaN) for every probed score and two draws of the other extras; else None."""
    n = len(_PROBE_SCORES)
    outs = []
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        inputs = []
        for j, dt in enumerate(program.input_dtypes):
            if j == 0:
                inputs.append(np.array(_PROBE_SCORES, np.float32))
            elif j == mask_input:
                inputs.append(np.zeros(n, bool))
            elif dt == "bool":
                inputs.append(rng.random(n) < 0.5)
            else:
                inputs.append(rng.standard_normal(n).astype(np.float32) * 100)
        (out,) = evaluate(program, inputs)
        outs.append(np.broadcast_to(np.asarray(out, np.float32), (n,)))
    values = np.concatenate(outs)
    if np.isnan(values).any() or not (values == values[0]).all():
        return None
    return float(values[0])


def _broadcast_dims(shape) -> str:
    """The score dims an extra of this static shape broadcasts over: "m" (queries) where its
    second-to-last dim is 1 or absent, "n" (keys) where its last is; "" where unknown."""
    if shape is None:
        return ""
    dims = (1, 1, *shape)[-2:]
    return ("m" if dims[0] == 1 else "") + ("n" if dims[1] == 1 else "")


def _bias_vector(view: GraphView, bias: str, node_name: str, names: set[str], graph: GraphProto) -> str:
    """The node's input for a bias constant: the constant itself when it is 1-D, else a 1-D
    copy of it (a [1, ..., 1, N] bias) added to `graph`; the function body reads the original."""
    c = view.constants[bias]
    if len(c.dims) == 1:
        return bias
    name = unique_name(f"{node_name}.bias", names)
    graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(c).reshape(-1), name))
    return name


# the most bytes of a causal mask that the graph computes from constants and that is stored as a
# constant instead (`_computed_extra`): 1024^2 float32 values
FOLD_MASK_MAX_BYTES = 1 << 22


def _computed_extra(view: GraphView, extra: str, read: str, names: set[str], graph: GraphProto, memo: dict) -> str:
    """The node's input for an extra: for a causal mask the kernel computes from the indices
    ("causal", "causal_add") that the graph computes from constants (GPT-2's Slices of its
    lower-triangular buffer, two per layer; Hugging Face 5's sdpa mask, four ops per layer), the
    value as one constant shared by every layer that computes the same, so those nodes are left
    without consumers and removed: the kernel does not read it, the function body does. Other
    extras, constants, and masks over FOLD_MASK_MAX_BYTES stay as they are."""
    if read not in ("causal", "causal_add") or extra in view.constants:
        return extra
    value = _constant_value(view, extra, memo)  # evaluated by `_causal` already
    if value is None or value.nbytes > FOLD_MASK_MAX_BYTES:
        return extra
    digest = hashlib.sha1(value.tobytes() + str((value.dtype, value.shape)).encode()).hexdigest()[:12]
    name = f"onnxfuse_causal_mask_{digest}"
    if name not in names:
        names.add(name)
        graph.initializer.append(numpy_helper.from_array(value, name))
    return name


# ---------------------------------------------------------------------------------------
# The kind
# ---------------------------------------------------------------------------------------

class Attention(Kind):
    """A match is one attention (two MatMuls, the score ops and the Softmax between them, the
    Transposes around them); each Softmax that does not fuse is reported with the reason."""

    name = "attention"
    op_type = "FusedAttention"
    match_kind = "attention"
    params = frozenset()
    anchor_ops = ANCHORS
    # the tile heuristic (`attention-tiles`) is measured on three head shapes only, up to 16% off
    # the best tile there: tuning times the candidates with the budget its nodes leave
    search_configs = True

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> AttentionParams:
        return AttentionParams(ops, dtypes)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_attention(view, pattern, taken, accepted, reserved)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        return lower_attention(view, match, node_name, names, graph)

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> AttentionSpec:
        a: AttentionInfo = f.params
        return AttentionSpec(f.kernel_name, f.program, a.head_d, a.head_dv, precision, a.batch_heads, a.sq, a.sk,
                             f.source_nodes, a.rank, (a.perm_q, a.perm_k, a.perm_v, a.perm_y), a.nan_to_zero,
                             a.bias, a.extras_broadcast, a.causal_fill, a.causal_masked, a.kv_group, a.zero_where,
                             a.exact_scores)

    def decline_reason(self, spec: AttentionSpec, layout: str) -> str | None:
        """Tensors of more than 2**31 - 1 elements (32-bit index parameters), where static."""
        sizes = (spec.batch_heads, spec.sq, spec.sk)
        if all(s is not None for s in sizes):
            bh, sq, sk = sizes
            if bh * max(sq, sk) * max(spec.head_d, spec.head_dv, sk) > MAX_ELEMENTS:
                return "attention tensor of more than 2**31 - 1 elements (the kernel indexes in 32 bits)"
        return None

    def variants(self, spec: AttentionSpec) -> tuple[AttentionVariant, ...]:
        return attention_variants(spec)

    def generate(self, spec: AttentionSpec, variant: AttentionVariant) -> KernelSource:
        return generate_attention(spec, variant)

    def kernel_meta(self, spec: AttentionSpec, variants: tuple, binaries: list[dict]) -> dict:
        identity = list(range(spec.rank))
        perms = [list(p) for p in spec.perms] or [identity] * 4
        return {
            "version": META_VERSION, "kind": "attention", "name": spec.name, "n_extras": spec.n_extras,
            "rank": spec.rank, **{f"perm_{w}": p for w, p in zip("qkvy", perms, strict=True)},
            "head_d": spec.head_d, "head_dv": spec.head_dv,
            **({"kv_group": spec.kv_group} if spec.kv_group > 1 else {}),
            **({"bias": [int(b) for b in spec.bias]} if any(spec.bias) else {}),
            **({"extras_broadcast": list(spec.extras_broadcast)} if any(spec.extras_broadcast) else {}),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def ptx_arch(self, archs: list[int]) -> tuple[int, bool]:
        """As gemm: sm_90a's wgmma PTX cannot be relaxed; the highest target below sm_90's
        PTX is embedded when there is one."""
        below = [a for a in archs if a < 90]
        return (below[-1] if below else archs[-1]), False

    def candidates(self, spec: AttentionSpec) -> list[tuple[str, tuple]]:
        return attention_candidates(spec)

    def multiplies_in_tf32(self, f: FusedNode, precision: str) -> bool:
        return precision == "tf32" and f.program.input_dtypes[0] == "f32"

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """docs/format.md's definition in numpy: products in float64, each stored value
        rounded to its dtype as the original stores it."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        program = Program.from_text(attrs["program"].decode())
        q, k, v = (unpack(add_bias(x, inputs[attrs[f"bias_{w}"]] if f"bias_{w}" in attrs else None),
                          attrs.get(f"split_{w}")) for w, x in zip("qkv", inputs[:3], strict=True))
        extras = inputs[3:3 + len(program.input_dtypes) - 1]
        rank = q.ndim
        perms = [tuple(attrs.get(f"perm_{w}", range(rank))) for w in "qkvy"]
        return [evaluate_attention(program, q, k, v, extras, *perms, nan_to_zero=bool(attrs.get("nan_to_zero", 0)),
                                   kv_group=int(attrs.get("kv_group", 1)), zero_where=attrs.get("zero_where"),
                                   exact_scores=bool(attrs.get("exact_scores", 0)))]


def add_bias(x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x + bias along x's last dim, rounded to x's dtype as the original's Add stores it
    (docs/format.md, FusedAttention's `bias_*`); x itself without a bias."""
    if bias is None:
        return x
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"a bias of shape {list(bias.shape)} for an input of shape {list(x.shape)}: "
                         "it must be 1-D of the input's last dim")
    return (x.astype(np.float64) + bias.astype(np.float64)).astype(x.dtype)


def unpack(x: np.ndarray, split) -> np.ndarray:
    """An operand's base tensor: x itself, or with split = [offset, heads, head_dim] the part of
    the packed x it reads (docs/format.md, FusedAttention)."""
    if split is None:
        return x
    offset, heads, head_dim = (int(v) for v in split)
    if offset + heads * head_dim > x.shape[-1]:
        raise ValueError(f"split {list(split)} reaches past the packed tensor's last dim {x.shape[-1]}")
    return x[..., offset:offset + heads * head_dim].reshape(*x.shape[:-1], heads, head_dim)


def evaluate_attention(program: Program, q: np.ndarray, k: np.ndarray, v: np.ndarray, extras: list[np.ndarray],
                       perm_q=None, perm_k=None, perm_v=None, perm_y=None, nan_to_zero: bool = False,
                       kv_group: int = 1, zero_where: int | None = None, exact_scores: bool = False) -> np.ndarray:
    """A FusedAttention node's output (docs/format.md) in numpy; `exact_scores`: the product
    and the program's output not rounded to their dtypes (fp32)."""
    lq, lk, lv = (a if p is None else np.transpose(a, p) for a, p in ((q, perm_q), (k, perm_k), (v, perm_v)))
    if kv_group > 1:  # query head h reads key-value head h // kv_group
        lk, lv = np.repeat(lk, kv_group, axis=1), np.repeat(lv, kv_group, axis=1)
    dt = q.dtype
    if lk.shape[-1] == 0:  # Sk = 0: Y = 0
        shape = np.broadcast_shapes(lq.shape[:-2], lv.shape[:-2]) + (lq.shape[-2], lv.shape[-1])
        y0 = np.zeros(shape, dt)
        return y0 if perm_y is None else np.ascontiguousarray(np.transpose(y0, perm_y))
    s = np.matmul(lq.astype(np.float64), lk.astype(np.float64)).astype(np.float32 if exact_scores else dt)
    if exact_scores:
        program = dataclasses.replace(program, outputs=tuple((v, "f32") for v, _ in program.outputs))
    (x,) = evaluate(program, [s, *extras])
    x = np.broadcast_to(x, s.shape).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        probs = (e / e.sum(axis=-1, keepdims=True)).astype(lv.dtype)
    if nan_to_zero:
        probs = np.where(np.isnan(probs), 0, probs).astype(lv.dtype)
    if zero_where is not None:  # Where(m, 0, P)
        probs = np.where(np.broadcast_to(extras[int(zero_where)] != 0, probs.shape), 0, probs).astype(lv.dtype)
    y = np.matmul(probs.astype(np.float64), lv.astype(np.float64)).astype(dt)
    return np.ascontiguousarray(y if perm_y is None else np.transpose(y, perm_y))
