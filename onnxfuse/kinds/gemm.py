"""The gemm kind (GemmEpilogue): a MatMul or Gemm with the pointwise ops after it (bias add,
GELU in any of its forms, SiLU, Relu, Clip, a residual add, a Cast) becomes one node whose
Triton kernel (onnxfuse/codegen_gemm.py) applies them to the product's tiles before storing
it (docs/format.md, "GemmEpilogue").

A match has two parts:

- the **core**: a MatMul of operands of rank >= 2 (2-D, batched with equal batch dims, or a
  batched A times a 2-D B, which runs as one GEMM of M = batch * rows), or a Gemm (its
  transA / transB, alpha, and beta * C as the epilogue's first instruction); a Transpose of
  the last two dims that feeds the MatMul alone is absorbed into the node's trans_a /
  trans_b (the kernel reads the operand with swapped strides);
- the **epilogue**: the largest group of pointwise ops after it with one result, each
  computing over the product's shape (`onnxfuse.match.grow_epilogue`, `single_result`).

B must be a constant (weights) unless the pattern says `dynamic_b: true`: a product of two
activations (attention's QK^T and PV) is left to ONNX Runtime by default. Float32 constant
weights are packed K-major (B^T, [N, K], trans_b 1) in a new initializer, which the compile
step rounds to TF32 for "tf32" kernels (cuBLAS rounds its operands; the kernel rounds A);
the function body transposes them back.

ONNX Runtime's own fusions (`onnxfuse.ort_fusions`): the gemm kind claims the whole group
ONNX Runtime would fuse around a product (MatMul + Add into Gemm, FusedMatMul, BiasGelu,
Gelu, FastGelu): a match must hold every node of each of those fusions it touches, or it is
left to ONNX Runtime whole ("would split ..."); nodes of ORT's other fusions (the bias and
residual adds of a SkipLayerNormalization, attention) never join an epilogue.

Whether a match is kept is measured, never guessed: cuBLAS is hard to beat on the product
itself, so the kind's patterns are matched only when the tune pass times every fused node
against ONNX Runtime running the original nodes (with its own fusions) and keeps it only
where it is faster (`Gemm.untuned_reason`; ``$ONNXFUSE_GEMM_ALL=1`` matches them regardless,
for tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.bias import SKIP_TAKERS, after_product_in_body
from onnxfuse.codegen import KernelSource
from onnxfuse.codegen_gemm import (
    MAX_ELEMENTS,
    SMS,
    GemmSpec,
    GemmVariant,
    gemm_candidates,
    gemm_variants,
    generate_gemm,
    library_enabled,
    library_epilogue,
)
from onnxfuse.expr import Program, evaluate
from onnxfuse.graph import GraphView, Shape, last_dim_vector, same_shape
from onnxfuse.groups import Accepted, reentering
from onnxfuse.kinds.base import META_VERSION, Fields, FusedNode, Kind, Lowering, Match, MatchResult, NotMine, Pattern
from onnxfuse.match import (
    DTYPE_IDS,
    dtype_reason,
    grow_epilogue,
    match_anchored,
    numel,
    offered_reasons,
    operands,
    single_result,
)
from onnxfuse.ops import FLOAT_TYPES, node_attrs
from onnxfuse.ort_fusions import reason
from onnxfuse.rewrite import ir_dtype, lower_nodes, unique_name

ANCHORS = frozenset({"MatMul", "Gemm"})
# ONNX Runtime's fusions around a product, which a gemm match takes whole (ort_fusions.FUSED_OPS names)
PRODUCT_FUSIONS = ("MatMul + Add into Gemm", "FusedMatMul", "BiasGelu", "Gelu", "FastGelu")

# Reasons in the report (MatMul / Gemm node -> why it did not fuse).
UNTUNED = ("MatMul / Gemm: fused only where --tune or the tune pass measures the fused node faster than "
           "cuBLAS with ONNX Runtime's own fusions (not tuned: no GPU, or --no-tune)")
NO_EPILOGUE = "MatMul / Gemm without a fusible epilogue (cuBLAS runs it alone)"
DYNAMIC_B = ("B is not a constant (a product of two activations, as attention's): left to cuBLAS "
             "(pattern dynamic_b: false)")
OUTPUT_ELSEWHERE = "MatMul / Gemm output is also read elsewhere"
LIBRARY_OFF = "cuBLASLt's variants are off (ONNXFUSE_GEMM_LIBRARY=0)"
NOT_LIBRARY_PRODUCT = ("not a product cuBLASLt runs alone (a MatMul of a constant 2-D B, A 2-D or flattened "
                       "into rows)")
NOT_LIBRARY_EPILOGUE = "an epilogue cuBLASLt does not compute"
PARTIAL_BATCH = "batch dims broadcast partially (only equal batch dims or a 2-D operand are fused)"
LOW_RANK = "a 1-D operand"
UNKNOWN_SHAPE = "unknown shape"
CYCLE = "fusing would create a cycle"
BIAS_TO_TAKER = ("only its bias after it, which ONNX Runtime's SkipLayerNormalization (with the residual add) or a "
                 "pointwise chain (with the GELU, timed against ORT's BiasGelu) takes once the bias runs after the "
                 "product (onnxfuse.bias): cuBLAS runs the product")
EXTRA_LAYOUT = "an epilogue input does not broadcast over the product as [batch, rows, columns]"


def split_reason(fusion: str) -> str:
    return f"left to ONNX Runtime's {fusion} fusion (fusing would split it)"


@dataclass(frozen=True)
class GemmParams:
    """Match a MatMul or Gemm and the pointwise group after it (`ops`)."""

    ops: frozenset[str]
    dtypes: frozenset[str]
    min_nodes: int = 1  # epilogue nodes at least
    dynamic_b: bool = False  # also products of two activations
    library_only: bool = False  # only products cuBLASLt computes with their epilogue (`_not_for_library`)

    @property
    def fused_ops(self) -> frozenset[str]:
        return self.ops | ANCHORS | {"Transpose"}


@dataclass(frozen=True)
class Core:
    """The product: its node, operands as the kernel reads them, and its geometry."""

    node: int
    a: str  # the tensor the kernel reads as A (a Transpose's input when one is absorbed)
    b: str
    c: str | None  # Gemm's C
    trans_a: bool
    trans_b: bool
    alpha: float
    beta: float
    transposes: tuple[int, ...]  # absorbed Transpose nodes
    y_shape: Shape  # the product's shape
    flatten: bool  # a batched A times a 2-D B: one GEMM of M = batch * rows
    b_const: bool
    product: str = ""  # the tensor the epilogue reads: the node's output, or reshape_out's
    # a 2-D Gemm read through the Reshapes around it (`_read_through`): A's rows flattened
    # before it, Y's unflattened after it (GPT-2's Conv1D), as one batched product
    reshape_in: int | None = None
    reshape_out: int | None = None

    @property
    def reshapes(self) -> tuple[int, ...]:
        return tuple(r for r in (self.reshape_in, self.reshape_out) if r is not None)


@dataclass(frozen=True)
class GemmParts:
    """What a match found (Match.params)."""

    core: Core
    epilogue: tuple[int, ...]
    result: str
    modes: tuple[str, ...] = ()  # filled in by the lowering


@dataclass(frozen=True)
class GemmInfo:
    """What a GemmEpilogue node's kernel needs besides its program (FusedNode.params)."""

    trans_a: bool
    trans_b: bool
    alpha: float
    packed: bool  # B is this node's own K-major copy of constant weights (TF32-rounded when compiled)
    m: int | None
    n: int | None
    k: int | None
    batch: int | None


def _last_two_swapped(view: GraphView, t: int) -> bool:
    n = view.nodes[t]
    rank = view.rank(n.input[0])
    perm = list(node_attrs(n).get("perm", []))
    if rank is None or rank < 2:
        return False
    if not perm:
        return rank == 2
    return perm == [*range(rank - 2), rank - 1, rank - 2]


def _absorbed(view: GraphView, name: str, user: int, taken: set[int]) -> int | None:
    """The Transpose of the last two dims producing `name` that only node `user` reads."""
    t = view.producer.get(name)
    if not view.is_op(t, "Transpose") or t in taken or name in view.graph_outputs:
        return None
    if view.consumers.get(name, []) != [user] or not _last_two_swapped(view, t):
        return None
    return t


def _dim_product(dims) -> int | str | None:
    if all(isinstance(d, int) for d in dims):
        return int(np.prod(dims, dtype=np.int64)) if dims else 1
    return None


def find_core(view: GraphView, i: int, pattern: Pattern, taken: set[int]) -> Core | str:
    """The product at node i, or why it cannot fuse."""
    m: GemmParams = pattern.match
    n = view.nodes[i]
    gemm = n.op_type == "Gemm"
    if len(n.input) < 2 or len(n.output) != 1:
        return "MatMul without two inputs"
    a, b = n.input[0], n.input[1]
    attrs = node_attrs(n)
    trans_a = bool(attrs.get("transA", 0)) if gemm else False
    trans_b = bool(attrs.get("transB", 0)) if gemm else False
    transposes: list[int] = []
    if not gemm:
        for which, name in ((0, a), (1, b)):
            t = _absorbed(view, name, i, taken)
            if t is not None:
                transposes.append(t)
                if which == 0:
                    a, trans_a = view.nodes[t].input[0], True
                else:
                    b, trans_b = view.nodes[t].input[0], True
    dtype = view.types.get(a)
    if dtype not in {DTYPE_IDS[d] for d in m.dtypes}:
        return dtype_reason(dtype)
    if view.types.get(b) != dtype:
        return "operands of different dtypes"
    a_shape, b_shape, y_shape = view.shapes.get(a), view.shapes.get(b), view.shapes.get(n.output[0])
    if a_shape is None or b_shape is None or y_shape is None:
        return UNKNOWN_SHAPE
    if len(a_shape) < 2 or len(b_shape) < 2:
        return LOW_RANK
    b_const = b in view.constants
    if not b_const and not m.dynamic_b:
        return DYNAMIC_B
    a_batch, b_batch = tuple(a_shape[:-2]), tuple(b_shape[:-2])
    if b_batch and a_batch and not same_shape(a_batch, b_batch):
        return PARTIAL_BATCH
    flatten = not b_batch and not trans_a
    c, beta = None, 1.0
    if gemm:
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        if len(n.input) > 2 and n.input[2]:
            c = n.input[2]
            if view.types.get(c) != dtype or view.shapes.get(c) is None:
                return "Gemm's C has another dtype or an unknown shape"
    else:
        alpha = 1.0
    return Core(i, a, b, c, trans_a, trans_b, alpha, beta, tuple(transposes), tuple(y_shape), flatten, b_const,
                n.output[0])


def _read_through(view: GraphView, core: Core, taken: set[int]) -> Core | None:
    """A 2-D Gemm (no C, no transA) between a Reshape that flattens x [..., K] into its rows
    and one that gives them back [..., N], each read by the other alone (GPT-2's Conv1D, its
    bias moved after the second Reshape by the bias pass), as the batched product of x that
    it computes: the core with A = x, Y of the second Reshape's shape. None otherwise."""
    n = view.nodes[core.node]
    if n.op_type != "Gemm" or core.c is not None or core.trans_a or core.transposes:
        return None
    r_in, r_out = view.producer.get(n.input[0]), view.consumers.get(n.output[0], [])
    if not view.is_op(r_in, "Reshape") or len(r_out) != 1 or not view.is_op(r_out[0], "Reshape") \
            or r_in in taken or r_out[0] in taken or n.output[0] in view.graph_outputs \
            or n.input[0] in view.graph_outputs or view.consumers.get(n.input[0], []) != [core.node]:
        return None
    x = view.nodes[r_in].input[0]
    out = view.nodes[r_out[0]].output[0]
    xs, ys, rows = view.shapes.get(x), view.shapes.get(out), view.shapes.get(n.input[0])
    if xs is None or ys is None or rows is None or len(xs) < 2 or view.types.get(x) != view.types.get(n.input[0]):
        return None
    if not same_shape(tuple(xs[-1:]), tuple(rows[-1:])) or not same_shape(tuple(ys), (*xs[:-1], core.y_shape[-1])):
        return None
    return dataclasses.replace(core, a=x, y_shape=tuple(ys), flatten=True, product=out, reshape_in=r_in,
                               reshape_out=r_out[0])


def _groups(core: Core) -> tuple[range, range]:
    """Y's dims forming the kernel's G and M (N is the last dim)."""
    r = len(core.y_shape)
    return (range(0, 0), range(0, r - 1)) if core.flatten else (range(0, r - 2), range(r - 2, r - 1))


def extra_mode(shape: Shape | None, core: Core) -> str | None:
    """How the kernel reads an epilogue input of this shape over Y's [G, M, N] view
    (codegen_gemm.INPUT_MODES), or None when it cannot."""
    y = core.y_shape
    if shape is None or len(shape) > len(y):
        return None
    if same_shape(shape, y):
        return "full"
    if numel(shape) == 1:
        return "scalar"
    padded = (1,) * (len(y) - len(shape)) + tuple(shape)
    if all(d == 1 for d in padded[:-1]) and padded[-1] == y[-1]:
        return "row"
    if not all(isinstance(d, int) for d in padded) or not all(isinstance(d, int) for d in y):
        return None
    # strided: each group of Y's dims must collapse to one stride over the input's contiguous layout
    strides, s = [0] * len(padded), 1
    for d in range(len(padded) - 1, -1, -1):
        strides[d] = 0 if padded[d] == 1 else s
        s *= padded[d]
    for group in _groups(core):
        live = [d for d in group if y[d] != 1]
        if any(strides[d] != 0 for d in live) and not all(
                strides[d] != 0 and (k == len(live) - 1 or strides[d] == strides[live[k + 1]] * y[live[k + 1]])
                for k, d in enumerate(live)):
            return None
    return "strided"


def _candidate_taken(view: GraphView, taken: set[int], reserved: dict[int, str]) -> set[int]:
    """Nodes no epilogue may take: those taken already, those ONNX Runtime fuses into
    something other than a product (a SkipLayerNormalization's adds), and those of the fusions
    offered to pointwise chains (`onnxfuse.match.Reserved`: a GELU, which a chain then takes
    with the bias, timed against ORT's BiasGelu)."""
    offered = offered_reasons(reserved)
    return taken | {j for j, r in reserved.items()
                    if r in offered or not any(r.endswith(f"{f} fusion") for f in PRODUCT_FUSIONS)}



def _split_fusion(view: GraphView, members: set[int], reserved: dict[int, str], ops: frozenset[str]) -> str | None:
    """The ONNX Runtime fusion a group of these members would split (a node of it inside, a
    neighbour of the same fusion outside), or None. Only neighbours of the op types a product's
    fusion is made of (`ops`) count: `ort_fusions` also attributes to a fusion the shape
    arithmetic that ONNX Runtime folds away beside it (Shape, Slice, Concat on the bias add's
    output), which no fusion holds."""
    for i in members:
        r = reserved.get(i)
        if r is None:
            continue
        n = view.nodes[i]
        near = [view.producer.get(x) for x in n.input if x] + [c for o in n.output for c in view.consumers.get(o, ())]
        if any(j is not None and j not in members and reserved.get(j) == r and view.nodes[j].op_type in ops
               for j in near):
            return r
    return None


def _bias_for_a_taker(view: GraphView, core: Core, epilogue: set[int], result: str | None,
                      reserved: dict[int, str]) -> bool:
    """Whether the epilogue is only the product's bias Add and every reader of its result is
    either a residual add that ONNX Runtime fuses into a SkipLayerNormalization, or a node of a
    fusion offered to pointwise chains (a GELU; `onnxfuse.match.Reserved`): with the bias after
    the product (`onnxfuse.bias`) that fusion, or the chain, takes the bias too, so the fused
    node would only put a Triton GEMM where cuBLAS runs (BERT's out-projection and FFN2; its
    FFN1 where tuning times a chain of bias + GELU against ORT's BiasGelu)."""
    if len(epilogue) != 1 or result is None:
        return False
    add = view.nodes[next(iter(epilogue))]
    bias = next((x for x in add.input if x != core.product), None)
    if add.op_type != "Add" or bias not in view.constants or not isinstance(core.y_shape[-1], int) \
            or not last_dim_vector(view.constants[bias], core.y_shape[-1]):
        return False
    readers = view.consumers.get(result, [])
    takers = {reason(f) for f in SKIP_TAKERS} | offered_reasons(reserved)
    return bool(readers) and result not in view.graph_outputs and all(reserved.get(j) in takers for j in readers)


def _library_core(view: GraphView, core: Core) -> bool:
    """A product cuBLASLt's epilogue may take: a MatMul of float operands (or a Gemm read
    through its Reshapes), B constant 2-D, one GEMM (A 2-D, or batched and flattened into M)."""
    b_shape, a_shape = view.shapes.get(core.b), view.shapes.get(core.a)
    return ((view.nodes[core.node].op_type == "MatMul" or core.reshape_out is not None) and core.b_const
            and core.c is None
            and view.types.get(core.a) in (DTYPE_IDS["float16"], DTYPE_IDS["bfloat16"], DTYPE_IDS["float32"])
            and b_shape is not None and len(b_shape) == 2 and a_shape is not None
            and (core.flatten or len(a_shape) == 2))


def _library_group(view: GraphView, i: int, core: Core, pattern: Pattern, taken: set[int], accepted: Accepted,
                   reserved: dict[int, str]) -> tuple[set[int], str, Core] | None:
    """The epilogue with the nodes of ONNX Runtime's GELU fusions offered to tuning
    (`onnxfuse.match.Reserved`; a pointwise chain takes them otherwise), and its result, where
    the group is one cuBLASLt's epilogue computes (`codegen_gemm.library_epilogue`: bias +
    GELU after a 16-bit product, BERT's and ViT's FFN1): cuBLASLt's product with its own bias
    + GELU took 11.3 µs at BERT-base b8 fp16 on an H100 (0.0019 from float64's erf-GELU) where
    cuBLAS's product and BiasGelu took 10.0 + 7.0 (the graph's roundings: 0.0037; BENCHMARKS.md,
    Decisions, `gemm-library`); tuning still times the node
    against ONNX Runtime's. A 2-D Gemm is read through the Reshapes around it (`_read_through`:
    GPT-2's Conv1D). None where that does not apply; else the epilogue, its result and the core."""
    offered = offered_reasons(reserved)
    if not offered or not library_enabled():
        return None
    if view.nodes[i].op_type == "Gemm":
        core = _read_through(view, core, taken)
        if core is None:
            return None
    if not _library_core(view, core):
        return None
    blocked = taken | {j for j, r in reserved.items()
                       if r not in offered and not any(r.endswith(f"{f} fusion") for f in PRODUCT_FUSIONS)}
    out, anchor = core.product, core.reshape_out if core.reshape_out is not None else i
    epilogue = grow_epilogue(view, anchor, core.y_shape, pattern, blocked)
    if not any(reserved.get(j) in offered for j in epilogue) or out in view.graph_outputs \
            or any(c not in epilogue for c in view.consumers.get(out, ())):
        return None
    epilogue, result = single_result(view, anchor, out, epilogue, accepted)
    if not any(reserved.get(j) in offered for j in epilogue) or result is None \
            or not _library_computes(view, core, epilogue, result):
        return None
    return epilogue, result, core


def _library_computes(view: GraphView, core: Core, epilogue: set[int], result: str) -> bool:
    """Whether cuBLASLt's epilogue computes the program of `epilogue` (ending at `result`)
    after the product (`codegen_gemm.library_epilogue`; an empty one: the bare product)."""
    program, inputs, _ = lower_nodes(view, tuple(sorted(epilogue)), (result,), [(core.product, ir_dtype(view, core.a))])
    modes = tuple(extra_mode(view.shapes.get(x), core) for x in inputs[1:])
    return None not in modes and library_epilogue(program, modes) is not None


def _not_for_library(view: GraphView, core: Core, epilogue: set[int], result: str) -> str | None:
    """Why cuBLASLt would not compute this product and epilogue (a `library_only` pattern's
    reason), or None: it must be a product `_library_core` takes whose epilogue is one of
    `codegen_gemm.library_epilogue`'s (a bare product included) at ONNX Runtime's default
    precision, cuBLASLt enabled."""
    if not library_enabled():
        return LIBRARY_OFF
    if not _library_core(view, core):
        return NOT_LIBRARY_PRODUCT
    return None if _library_computes(view, core, epilogue, result) else NOT_LIBRARY_EPILOGUE


def match_one(view: GraphView, i: int, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> Match | str:
    m: GemmParams = pattern.match
    core = find_core(view, i, pattern, taken)
    if isinstance(core, str):
        return core
    library = _library_group(view, i, core, pattern, taken, accepted, reserved)
    if library is not None:
        epilogue, result, core = library
    elif m.library_only and view.nodes[i].op_type == "Gemm":
        core = _read_through(view, core, taken)  # a bare product the bias pass made a Gemm between Reshapes
        if core is None:
            return NOT_LIBRARY_PRODUCT
    out = core.product
    anchor_group = {i, *core.transposes, *core.reshapes}
    if library is None:
        anchor = core.reshape_out if core.reshape_out is not None else i
        blocked = _candidate_taken(view, taken, reserved)
        epilogue = grow_epilogue(view, anchor, core.y_shape, pattern, blocked)
        direct = [c for c in view.consumers.get(out, ()) if c not in epilogue]
        if epilogue and (out in view.graph_outputs or direct):
            return OUTPUT_ELSEWHERE
        grown = bool(epilogue)
        epilogue, result = single_result(view, anchor, out, epilogue, accepted)
        if grown and not epilogue:
            return OUTPUT_ELSEWHERE
    if len(epilogue) < m.min_nodes:
        return NO_EPILOGUE
    result = result or out
    nodes = sorted(epilogue | anchor_group)
    if reentering(view, nodes, accepted):
        return CYCLE
    split = _split_fusion(view, set(nodes), reserved, m.fused_ops)
    if split is not None:
        return split_reason(split.removeprefix("left to ONNX Runtime's ").removesuffix(" fusion"))
    if view.types.get(result) not in FLOAT_TYPES:
        return dtype_reason(view.types.get(result))
    if _bias_for_a_taker(view, core, epilogue, result, reserved):
        return BIAS_TO_TAKER
    members = set(nodes)
    for j in epilogue:
        for _, x in operands(view, j):
            if view.producer.get(x) not in members and extra_mode(view.shapes.get(x), core) is None:
                return EXTRA_LAYOUT
    if core.c is not None and extra_mode(view.shapes.get(core.c), core) is None:
        return EXTRA_LAYOUT
    if m.library_only and library is None and (why := _not_for_library(view, core, epilogue, result)):
        return why
    return Match(pattern, tuple(nodes), (result,), pointwise=tuple(sorted(epilogue)), first_input=out,
                 result=result, params=GemmParts(core, tuple(sorted(epilogue)), result))


def match_gemm(view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
               reserved: dict[int, str]) -> MatchResult:
    """Matches at every MatMul / Gemm not taken yet, in topological order; the result's
    `anchors` say why each other one did not match (a `library_only` pattern's reasons as
    `NotMine`: the report keeps the general pattern's, "without a fusible epilogue" rather than
    "float32 dtype")."""
    r = match_anchored(view, pattern, taken, accepted, ANCHORS,
                       lambda v, i, p, t, a: match_one(v, i, p, t, a, reserved))
    if pattern.match.library_only:
        r.anchors = {i: NotMine(why) for i, why in r.anchors.items()}
    return r


# ---------------------------------------------------------------------------------------
# Lowering
# ---------------------------------------------------------------------------------------

PRODUCT = "\0gemm product"  # the program's %0 for a Gemm (no graph tensor has this name)


def _static(v) -> int | None:
    return v if isinstance(v, int) else None


def geometry(core: Core, a_shape: Shape) -> tuple[int | None, int | None, int | None, int | None]:
    """(M, N, K, G) of the GEMM the kernel runs, where static."""
    y = core.y_shape
    n = _static(y[-1])
    k = _static(a_shape[-2] if core.trans_a else a_shape[-1])
    if core.flatten:
        return _dim_product(y[:-1]), n, k, 1
    return _static(y[-2]), n, k, _dim_product(y[:-2])


def lower_gemm(view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
    """The GemmEpilogue node (docs/format.md): inputs A, B (or its packed copy), the
    epilogue's extras; the body the absorbed Transposes, the product, the epilogue."""
    parts: GemmParts = match.params
    core = parts.core
    node = view.nodes[core.node]
    dt = ir_dtype(view, core.a)
    if node.op_type == "Gemm":
        fixed = [(PRODUCT, dt)] + ([(core.c, ir_dtype(view, core.c))] if core.c is not None else [])

        def prelude(b, env):  # Gemm's output: alpha A B (%0) + beta C
            v = env[PRODUCT]
            if core.c is not None:
                cv = env[core.c]
                if core.beta != 1.0:
                    cv = b.emit("mul", cv, core.beta)
                v = b.emit("add", v, cv)
                if dt != "f32":  # the original stores Gemm's output in its dtype
                    v = b.emit(f"round_{dt}", v)
            env[core.product] = v  # a Reshape between (`_read_through`) moves no value
        program, inputs, folded = lower_nodes(view, parts.epilogue, (parts.result,), fixed, prelude,
                                              {core.product})
    else:
        program, inputs, folded = lower_nodes(view, parts.epilogue, (parts.result,), [(core.product, dt)])
    extras = inputs[1:]
    modes = tuple(extra_mode(view.shapes.get(x), core) or "strided" for x in extras)
    a_shape = view.shapes[core.a]
    b_dims = view.shapes[core.b]
    body: list[NodeProto] = [view.nodes[t] for t in (*core.transposes, *core.reshapes[:1])]
    b_input, trans_b, packed = core.b, core.trans_b, False
    if core.b_const and dt == "f32" and len(b_dims) == 2:
        # float32 weights packed K-major ([N, K]): TF32 tensor cores read B K-major; this copy
        # is the node's own, so rounding it to TF32 changes no other reader
        w = numpy_helper.to_array(view.constants[core.b])
        op_b = w.T if core.trans_b else w  # [K, N]
        b_input = unique_name(f"{node_name}.weight_packed", names)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(op_b.T), b_input))
        trans_b, packed = True, True
        unpacked = f"{b_input}\0onnx_weights"
        body = [view.nodes[t] for t in (*core.transposes, *core.reshapes[:1])
                if view.nodes[t].output[0] != node.input[1]]
        body.append(helper.make_node("Transpose", [b_input], [unpacked], perm=[1, 0]))
        copy = NodeProto()
        copy.CopyFrom(node)
        copy.input[1] = unpacked
        if node.op_type == "Gemm":
            for att in copy.attribute:
                if att.name == "transB":
                    att.i = 0
        body.append(copy)
    else:
        body.append(node)
    if all(r in parts.epilogue for r in view.consumers.get(node.output[0], [])):
        # the body ORT runs (when tuning times the node, and where it goes back) with the bias
        # after the product, so that ORT's BiasGelu or SkipLayerNormalization takes it
        moved = after_product_in_body(view, core.node, body[-1], names)
        if moved is not None:
            body[-1:] = moved
    if core.reshape_out is not None:
        body.append(view.nodes[core.reshape_out])
    body += [view.nodes[j] for j in parts.epilogue]
    m, n, k, g = geometry(core, a_shape)
    attrs = {"trans_a": int(core.trans_a), "trans_b": int(trans_b)}
    if core.alpha != 1.0:
        attrs["alpha"] = core.alpha
    key = (f"gemm trans_a={int(core.trans_a)} trans_b={int(trans_b)} alpha={core.alpha!r} packed={packed} "
           f"M={m} N={n} K={k} G={g} flatten={core.flatten} modes={','.join(modes)}")
    info = GemmInfo(core.trans_a, trans_b, core.alpha, packed, m, n, k, g)
    return Lowering(program, folded, [core.a, b_input, *extras], body, attrs, key, len(core.y_shape),
                    ("full", *modes), {"params": info})


# ---------------------------------------------------------------------------------------
# The kind
# ---------------------------------------------------------------------------------------

class Gemm(Kind):
    """A match is a MatMul or Gemm (with the Transposes of the last two dims it absorbs) and
    the largest pointwise group after it with one result; each MatMul or Gemm that does not
    fuse is reported with the reason."""

    name = "gemm"
    op_type = "GemmEpilogue"
    match_kind = "gemm_epilogue"
    params = frozenset({"min_nodes", "dynamic_b", "library_only"})
    # timed after the other kinds: on the H200 every GemmEpilogue of a 4-layer encoder lost to
    # cuBLAS (1.7-5.5x), and timed first they spent the budget that the row kernels, which win,
    # then lacked; one not reached is unfused in the "measured only" candidate (BENCHMARKS.md,
    # Decisions, gemm-measured-only)
    measure_first = False
    anchor_ops = ANCHORS

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> GemmParams:
        """min_nodes (default 1: epilogue nodes at least), dynamic_b (default false: B must
        be a constant), library_only (default false: also products whose kernel would be a
        Triton GEMM)."""
        min_nodes = m.get("min_nodes", int, 1)
        if min_nodes < 0:
            m.fail("match.min_nodes", "must be at least 0")
        return GemmParams(ops, dtypes, min_nodes, m.get("dynamic_b", bool, False),
                          m.get("library_only", bool, False))

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_gemm(view, pattern, taken, accepted, reserved)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        return lower_gemm(view, match, node_name, names, graph)

    def searches(self, spec: GemmSpec, output_shape: tuple[int, ...] | None) -> bool:
        """cuBLASLt's variant: the algorithms its heuristic ranks after the first are timed in
        every tuning (`gemm_candidates`, `gemm-library-ranks`); Triton tiles only with --tune."""
        return spec.library is not None and library_enabled()

    def untuned_reason(self) -> str | None:
        return None if os.environ.get("ONNXFUSE_GEMM_ALL") == "1" else UNTUNED

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> GemmSpec:
        g: GemmInfo = f.params
        modes = tuple(f.input_modes[1:])
        # cuBLASLt runs one GEMM: a static G above 1 never takes its variant; nor does a float32
        # product that stores Y rounded to TF32 for its readers (`gemm-tf32-at-producer`)
        library = (library_epilogue(f.program, modes, precision) if g.batch in (1, None) and not f.round_y
                   else None)
        return GemmSpec(f.kernel_name, f.program, modes, g.trans_a, g.trans_b, g.alpha,
                        precision, g.packed and precision == "tf32" and f.program.input_dtypes[0] == "f32",
                        g.m, g.n, g.k, g.batch, f.source_nodes, x_rounded=f.x_rounded, round_y=f.round_y,
                        library=library)

    def decline_reason(self, spec: GemmSpec, layout: str) -> str | None:
        """A GEMM with a tensor of more than 2**31 - 1 elements (32-bit index parameters)."""
        sizes = [spec.m, spec.n, spec.k, spec.batch or 1]
        if all(s is not None for s in sizes):
            m, n, k, g = sizes
            if max(g * m * k, g * k * n, g * m * n) > MAX_ELEMENTS:
                return "GEMM operand of more than 2**31 - 1 elements (the kernel indexes in 32 bits)"
        return None

    def variants(self, spec: GemmSpec) -> tuple[GemmVariant, ...]:
        return gemm_variants(spec)

    def generate(self, spec: GemmSpec, variant: GemmVariant) -> KernelSource:
        return generate_gemm(spec, variant)

    def kernel_meta(self, spec: GemmSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION, "kind": "gemm", "name": spec.name, "n_extras": spec.n_extras,
            "trans_a": int(spec.trans_a), "trans_b": int(spec.trans_b), "input_modes": list(spec.input_modes),
            "variants": [{"requires": v.requires(), **v.meta()} for v in variants],
            "binaries": binaries,
        }

    def ptx_arch(self, archs: list[int]) -> tuple[int, bool]:
        """As conv: sm_90a's wgmma PTX cannot be relaxed; the highest target below sm_90's PTX
        is embedded when there is one."""
        below = [a for a in archs if a < 90]
        return (below[-1] if below else archs[-1]), False

    def candidates(self, spec: GemmSpec) -> list[tuple[str, tuple]]:
        return gemm_candidates(spec)

    def multiplies_in_tf32(self, f: FusedNode, precision: str) -> bool:
        return precision == "tf32" and f.program.input_dtypes[0] == "f32"

    def tf32_initializers(self, f: FusedNode, spec: GemmSpec) -> tuple[str, ...]:
        return (f.inputs[1],) if spec.b_rounded else ()

    # TF32 rounding at the producer (onnxfuse.rounding): a "tf32" float32 GEMM rounds its A
    # (input 0) in the K loop, which makes ptxas serialize the fp32 wgmma (C7515; BENCHMARKS.md,
    # Decisions, `gemm-tf32-at-producer`); where A's producer stores it rounded it need not.

    def reads_tf32(self, spec: GemmSpec) -> bool:
        return spec.tf32

    def may_store_tf32(self, spec: GemmSpec) -> bool:
        # cuBLASLt's variant stores Y as it is
        return spec.tf32 and spec.program.outputs[0][1] == "f32" and spec.library is None

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """alpha * op(A) @ op(B) in float64, rounded to A's dtype, then the program."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        program = Program.from_text(attrs["program"].decode())
        a, b, *extras = inputs
        return evaluate_gemm(program, a, b, extras, bool(attrs.get("trans_a", 0)), bool(attrs.get("trans_b", 0)),
                             float(attrs.get("alpha", 1.0)))


def evaluate_gemm(program: Program, a: np.ndarray, b: np.ndarray, extras: list[np.ndarray], trans_a: bool,
                  trans_b: bool, alpha: float = 1.0) -> list[np.ndarray]:
    """A GemmEpilogue node's output (docs/format.md) in numpy."""
    a64 = np.swapaxes(a, -1, -2) if trans_a else a
    b64 = np.swapaxes(b, -1, -2) if trans_b else b
    p = alpha * np.matmul(a64.astype(np.float64), b64.astype(np.float64))
    (y,) = evaluate(program, [p.astype(a.dtype), *extras])
    return [np.broadcast_to(y, p.shape).copy()]



def launcher_choice(meta: dict, m: int, n: int, k: int, g: int = 1, sms: int = SMS, aligned: bool = True,
                    workspace: bool = True, library: bool = True) -> tuple[int, int]:
    """(variant, K slices) that csrc/kinds/gemm_cuda.cc launches for a GemmEpilogue of
    kernel_meta `meta` running G products [M, K] x [K, N] on a GPU of `sms` multiprocessors,
    every variant having a binary: the first variant in order that takes M rows (max_m), whose
    stride_multiple holds (`aligned`: the strides, N and K multiples of 16 and the pointers
    16-byte aligned), and, for a split-K variant, that gets at least two slices
    (`GemmVariant.slices`: its tiles · G at most half the SMs) and its workspace from the EP
    (`workspace`). Slices are 0 for the other variants. A cuBLASLt variant is taken for one
    GEMM (G = 1) where cuBLASLt runs (`library`: it loaded and has an algorithm for the
    product). A mirror of the C++ rule, for tests and benchmarks."""
    for i, v in enumerate(meta["variants"]):
        if v.get("library"):
            if library and g == 1:
                return i, 0
            continue
        if v.get("max_m", 0) and m > v["max_m"]:
            continue
        if v.get("stride_multiple", 1) > 1 and (not aligned or n % v["stride_multiple"] or k % v["stride_multiple"]):
            continue
        slices = 0
        if v.get("split", 0) > 1:
            tile = GemmVariant(block_m=v["block_m"], block_n=v["block_n"], block_k=v["block_k"], split=v["split"])
            slices = tile.slices(m, n, k, g, sms)
            if slices < 2 or not workspace:
                continue
        return i, slices
    raise ValueError(f"no variant of {meta.get('name')} takes M {m}, N {n}, K {k}")
