"""A product's bias after it, where ONNX Runtime would run it inside its Gemm.

ONNX Runtime's CUDA Gemm with a bias vector first writes the bias broadcast into Y with a
rank-1 cuBLAS product, then multiplies with beta 1, reading Y back
(core/providers/cuda/math/gemm.cc): a second kernel, and a write and read of the output. ORT
makes such a Gemm of every MatMul + bias Add (MatMulAddFusion, level 1) before its
SkipLayerNormalization, BiasGelu and FastGelu fusions (level 2) can take the Add in; its
transformers optimizer writes those layers with the bias in the fused op and the product alone.

Two places write a product that way:
- the model's own products, where a trial shows that ORT's fusions or a fused node take the Add
  (`onnxfuse.pack.bias_after_product`, the pipeline's bias pass);
- the function body of a GemmEpilogue node (`after_product_in_body`): the nodes tuning times
  the fused node against, and the ones it goes back to where it is slower, so that the fused
  kernel is measured against cuBLAS with ORT's own fusion of the epilogue (BiasGelu, a
  SkipLayerNormalization with the bias), not against ORT's Gemm with the bias inside.

Which products: `gemm_move` (a Gemm with a constant 1-D C) and `matmul_move` (a MatMul of a
static [..., K] input by constant [K, N] weights whose one reader adds a constant [N] bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, helper, numpy_helper

from onnxfuse.graph import GraphView, last_dim_vector
from onnxfuse.rewrite import unique_name

# ONNX Runtime's fusions that take a bias Add in (SkipLayerNormalization's and BiasGelu's,
# FastGelu's bias input): where one of these takes the Add, the GEMM runs without its bias
BIAS_TAKERS = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "BiasGelu", "FastGelu"})
# of those, the ones that take the Add with the next one, a residual add (its skip input)
SKIP_TAKERS = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})


@dataclass(frozen=True)
class BiasMove:
    """A product whose bias moves after it: a Gemm with a 1-D C, or a static MatMul + bias Add."""

    node: int  # the Gemm or MatMul
    add: int | None  # the MatMul's Add
    reshape: int | None  # the Gemm's one consumer, a Reshape (its rows back to the input's dims)
    bias: np.ndarray  # [N]
    out: str  # the biased value's name (the Add's, the Reshape's or the Gemm's output)


def gemm_move(view: GraphView, i: int) -> BiasMove | None:
    """A Gemm (not transA, alpha = beta = 1) with a constant C of one value per column: ONNX
    Runtime runs C with a second kernel. Its one consumer, when it is a Reshape keeping the
    rows, is where the Add goes (GPT-2's Conv1D: Reshape, Gemm, Reshape)."""
    n = view.nodes[i]
    a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
    if len(n.input) < 3 or not n.input[2] or n.input[2] not in view.constants or a.get("transA", 0):
        return None
    if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
        return None
    shape = view.shapes.get(n.output[0])
    if shape is None or not isinstance(shape[-1], int) or not last_dim_vector(view.constants[n.input[2]], shape[-1], 2):
        return None
    c = numpy_helper.to_array(view.constants[n.input[2]])
    out = n.output[0]
    users = view.consumers.get(out, [])
    reshape = None
    if len(users) == 1 and out not in view.graph_outputs and view.nodes[users[0]].op_type == "Reshape":
        rows = view.shapes.get(view.nodes[users[0]].output[0])
        if rows is not None and rows[-1] == shape[-1]:  # the same last dim: each row stays a row
            reshape = users[0]
            out = view.nodes[reshape].output[0]
    return BiasMove(i, None, reshape, c.reshape(-1), out)


def matmul_move(view: GraphView, i: int) -> BiasMove | None:
    """A MatMul of a static [..., K] input by a constant [K, N] whose one consumer adds a constant
    [N] bias: ONNX Runtime fuses the pair into a Gemm with the bias (MatMulAddFusion, before the
    fusions of BIAS_TAKERS), which `bias_after_product` writes as Reshape, Gemm, Reshape, Add."""
    n = view.nodes[i]
    x, w = n.input[0], n.input[1]
    xs = view.shapes.get(x)
    if w not in view.constants or len(view.constants[w].dims) != 2 or xs is None or len(xs) < 2 \
            or not all(isinstance(d, int) for d in xs):
        return None
    users = view.consumers.get(n.output[0], [])
    if len(users) != 1 or n.output[0] in view.graph_outputs or view.nodes[users[0]].op_type != "Add":
        return None
    add = view.nodes[users[0]]
    bias = next((t for t in add.input if t != n.output[0]), None)
    if bias is None or bias not in view.constants:
        return None
    if not last_dim_vector(view.constants[bias], int(view.constants[w].dims[1])):
        return None
    return BiasMove(i, users[0], None, numpy_helper.to_array(view.constants[bias]).reshape(-1), add.output[0])


def gemm_without_c(gemm: NodeProto, output: str) -> NodeProto:
    """A copy of a Gemm without its C (and beta), writing `output`."""
    out = NodeProto()
    out.CopyFrom(gemm)
    del out.input[2:]
    keep = [a for a in out.attribute if a.name != "beta"]
    del out.attribute[:]
    out.attribute.extend(keep)
    out.output[0] = output
    return out


def after_product_in_body(view: GraphView, i: int, product: NodeProto, names: set[str]) -> list[NodeProto] | None:
    """The nodes that take the place of `product` (view.nodes[i], or its copy reading packed
    weights) in a fused node's function body, with the bias after the product: Gemm(A, B, C)
    as Gemm(A, B) -> Add(C); MatMul(X, W) (its bias Add after it, unchanged) as
    Reshape(X, [-1, K]) -> Gemm -> Reshape(., [..., N]). None where nothing moves. New tensors
    are named from `names` (kept unique); shapes are Constant nodes and no layer's weights are
    copied in, so that equal layers keep equal bodies (one function, one kernel)."""
    n = view.nodes[i]
    stem = n.name or n.output[0]
    if n.op_type == "Gemm":
        if gemm_move(view, i) is None:
            return None
        bias = product.input[2]
        gemm = gemm_without_c(product, unique_name(f"{stem}.product", names))
        nodes = [gemm]
        if len(view.constants[n.input[2]].dims) != 1:  # [1, N]: ORT's fusions take a 1-D bias
            flat, shape = unique_name(f"{stem}.bias_1d", names), unique_name(f"{stem}.bias_shape", names)
            nodes += [_shape_constant(shape, [-1]), helper.make_node("Reshape", [bias, shape], [flat])]
            bias = flat
        return [*nodes, helper.make_node("Add", [gemm.output[0], bias], [product.output[0]])]
    mv = matmul_move(view, i)
    if mv is None:
        return None
    xs = view.shapes[n.input[0]]
    rows, flat_shape = unique_name(f"{stem}.rows", names), unique_name(f"{stem}.rows_shape", names)
    out, out_shape = unique_name(f"{stem}.product_rows", names), unique_name(f"{stem}.out_shape", names)
    return [_shape_constant(flat_shape, [-1, xs[-1]]),
            helper.make_node("Reshape", [product.input[0], flat_shape], [rows]),
            helper.make_node("Gemm", [rows, product.input[1]], [out]),
            _shape_constant(out_shape, [*xs[:-1], len(mv.bias)]),
            helper.make_node("Reshape", [out, out_shape], [product.output[0]])]


def _shape_constant(name: str, dims: list[int]) -> NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(dims, np.int64)))
