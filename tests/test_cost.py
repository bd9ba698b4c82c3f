"""The cost model: FLOPs and bytes per operator family against hand-computed values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from models.build import cos_cos, mul_chain
from onnxfuse import optimize_model
from onnxfuse.cost import (
    TRANSCENDENTAL_FLOPS as T,
)
from onnxfuse.cost import (
    bind_dims,
    lowered_flops,
    model_cost,
    program_flops,
)
from onnxfuse.errors import OnnxfuseError
from onnxfuse.tools.shapes import parse_shapes
from tests.util import model

N = helper.make_node
W = np.float32


def costs(m: onnx.ModelProto, **kw):
    return model_cost(m, **kw).by_name()


def one(nodes, inputs, outputs, inits=(), opset=20, **kw):
    """The cost of a single-node model's node."""
    (c,) = model_cost(model(nodes, inputs, outputs, inits, opset=opset), **kw).nodes
    assert c.ok, c.note
    return c


# ------------------------------------------------------------------ elementwise

def test_binary_with_broadcasting_reads_each_input_at_its_own_size():
    c = one([N("Add", ["x", "b"], ["y"], name="add")], {"x": ("float32", [2, 3, 4])},
            {"y": ("float32", [2, 3, 4])}, {"b": np.ones(4, W)})
    assert c.flops == 24
    assert (c.bytes_read, c.bytes_written) == (24 * 4 + 4 * 4, 24 * 4)
    assert c.weight_bytes == 16


def test_same_input_twice_is_read_once():
    c = one([N("Mul", ["x", "x"], ["y"])], {"x": ("float32", [10])}, {"y": ("float32", [10])})
    assert (c.flops, c.bytes_read, c.bytes_written) == (10, 40, 40)


def test_relu_is_one_flop_and_eight_bytes_per_element():
    c = one([N("Relu", ["x"], ["y"])], {"x": ("float32", [5, 7])}, {"y": ("float32", [5, 7])})
    assert c.flops == 35 and c.bytes == 35 * 8
    assert c.intensity == pytest.approx(1 / 8)


@pytest.mark.parametrize("op, attrs, per", [
    ("Sigmoid", {}, T + 2), ("Exp", {}, T), ("Erf", {}, T), ("Tanh", {}, T), ("Sqrt", {}, T), ("Neg", {}, 1),
    ("Gelu", {}, 3 + T),  # -x/sqrt(2), erfc, 0.5*x, *
    ("LeakyRelu", {"alpha": 0.1}, 3),  # compare, multiply, select
    ("HardSwish", {}, 5), ("Softplus", {}, 2 * T + 2), ("Floor", {}, 1), ("Atan", {}, T),
])
def test_unary_elementwise(op, attrs, per):
    c = one([N(op, ["x"], ["y"], **attrs)], {"x": ("float32", [3, 4])}, {"y": ("float32", [3, 4])})
    assert c.flops == 12 * per


def test_pow_by_a_constant_two_is_a_multiply_like_in_the_fused_program():
    c = one([N("Pow", ["x", "two"], ["y"])], {"x": ("float32", [8])}, {"y": ("float32", [8])},
            {"two": np.array(2.0, W)})
    assert c.flops == 8
    c = one([N("Pow", ["x", "e"], ["y"])], {"x": ("float32", [8]), "e": ("float32", [8])}, {"y": ("float32", [8])})
    assert c.flops == 8 * T


def test_clip_sum_and_where():
    c = one([N("Clip", ["x", "lo", "hi"], ["y"])], {"x": ("float32", [6])}, {"y": ("float32", [6])},
            {"lo": np.array(0, W), "hi": np.array(6, W)})
    assert c.flops == 12
    c = one([N("Sum", ["a", "b", "c"], ["y"])], {k: ("float32", [4]) for k in "abc"}, {"y": ("float32", [4])})
    assert c.flops == 8 and c.bytes == 16 * 4
    c = one([N("Where", ["m", "a", "b"], ["y"])], {"m": ("bool", [4]), "a": ("float32", [4]), "b": ("float32", [1])},
            {"y": ("float32", [4])})
    assert c.flops == 4 and c.bytes_read == 4 + 16 + 4


def test_dtypes_set_the_bytes():
    c = one([N("Add", ["x", "x"], ["y"])], {"x": ("float16", [100])}, {"y": ("float16", [100])})
    assert c.bytes == 400
    c = one([N("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)], {"x": ("float32", [100])}, {"y": ("float16", [100])})
    assert (c.flops, c.bytes_read, c.bytes_written) == (0, 400, 200)
    c = one([N("Cast", ["x"], ["y"], to=TensorProto.INT64)], {"x": ("float32", [10])}, {"y": ("int64", [10])})
    assert c.bytes == 40 + 80


def test_lowering_matches_the_program_the_optimizer_builds():
    m = mul_chain(8, width=64)
    opt = optimize_model(m).model
    (fused,) = [n for n in opt.graph.node if n.domain == "onnxfuse"]
    prog = next(a.s.decode() for a in fused.attribute if a.name == "program")
    assert program_flops(prog) == 8 == 8 * lowered_flops("Mul", {}, 2)


# ------------------------------------------------------------------ convolutions and matmuls

def _conv(k, c, groups=1, bias=True, strides=(1, 1), hw=10, n=2):
    w = np.zeros((k, c // groups, 3, 3), W)
    inits = {"w": w, **({"b": np.zeros(k, W)} if bias else {})}
    out = (hw + 2 - 3) // strides[0] + 1
    node = N("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], pads=[1, 1, 1, 1], group=groups,
             strides=list(strides), kernel_shape=[3, 3])
    return one([node], {"x": ("float32", [n, c, hw, hw])}, {"y": ("float32", [n, k, out, out])}, inits)


def test_conv_flops_and_bytes():
    c = _conv(16, 8)
    # 2*N*K*C*R*S*P*Q + N*K*P*Q
    assert c.flops == 2 * 2 * 16 * 8 * 9 * 100 + 2 * 16 * 100
    assert c.bytes_read == 2 * 8 * 100 * 4 + 16 * 8 * 9 * 4 + 16 * 4
    assert c.bytes_written == 2 * 16 * 100 * 4
    assert c.weight_bytes == 16 * 8 * 9 * 4 + 16 * 4
    assert c.matrix


def test_grouped_depthwise_and_strided_conv():
    assert _conv(16, 8, groups=4, bias=False).flops == 2 * 2 * 16 * (8 // 4) * 9 * 100
    assert _conv(8, 8, groups=8, bias=False).flops == 2 * 2 * 8 * 1 * 9 * 100
    assert _conv(16, 8, bias=False, strides=(2, 2)).flops == 2 * 2 * 16 * 8 * 9 * 25


def test_conv_transpose():
    node = N("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2])
    c = one([node], {"x": ("float32", [1, 4, 5, 5])}, {"y": ("float32", [1, 2, 11, 11])},
            {"w": np.zeros((4, 2, 3, 3), W)})
    assert c.flops == 2 * (1 * 4 * 25) * (2 * 9)
    assert c.output_shape == (1, 2, 11, 11)


def test_matmul_batched_broadcast_and_vector():
    c = one([N("MatMul", ["a", "b"], ["y"])], {"a": ("float32", [2, 3, 4])}, {"y": ("float32", [2, 3, 5])},
            {"b": np.zeros((4, 5), W)})
    assert c.flops == 2 * 2 * 3 * 5 * 4 and c.bytes == (24 + 20 + 30) * 4
    c = one([N("MatMul", ["a", "b"], ["y"])], {"a": ("float32", [2, 1, 3, 4]), "b": ("float32", [5, 4, 6])},
            {"y": ("float32", [2, 5, 3, 6])})
    assert c.flops == 2 * (2 * 5 * 3 * 6) * 4
    c = one([N("MatMul", ["a", "b"], ["y"])], {"a": ("float32", [4]), "b": ("float32", [4, 5])},
            {"y": ("float32", [5])})
    assert c.flops == 2 * 5 * 4


def test_gemm_with_transpose_and_bias():
    c = one([N("Gemm", ["a", "b", "c"], ["y"], transA=1)], {"a": ("float32", [4, 3])}, {"y": ("float32", [3, 5])},
            {"b": np.zeros((4, 5), W), "c": np.zeros(5, W)})
    assert c.flops == 2 * 3 * 5 * 4 + 15


def test_einsum():
    c = one([N("Einsum", ["a", "b"], ["y"], equation="bij,bjk->bik")],
            {"a": ("float32", [2, 3, 4]), "b": ("float32", [2, 4, 5])}, {"y": ("float32", [2, 3, 5])})
    assert c.flops == 2 * 2 * 3 * 4 * 5


# ------------------------------------------------------------------ pooling, reductions, normalizations

def test_pooling():
    x = {"x": ("float32", [1, 2, 8, 8])}
    y = {"y": ("float32", [1, 2, 4, 4])}
    assert one([N("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], x, y).flops == 32 * 4
    assert one([N("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], x, y).flops == 32 * 4 + 32
    c = one([N("GlobalAveragePool", ["x"], ["y"])], x, {"y": ("float32", [1, 2, 1, 1])})
    assert c.flops == 128 + 2 and c.bytes == 128 * 4 + 2 * 4


def test_reductions():
    x = {"x": ("float32", [4, 6])}
    y = {"y": ("float32", [4, 1])}
    axes = {"a": np.array([1], np.int64)}
    assert one([N("ReduceSum", ["x", "a"], ["y"])], x, y, axes).flops == 24
    assert one([N("ReduceMean", ["x", "a"], ["y"])], x, y, axes).flops == 24 + 4
    assert one([N("ReduceL2", ["x", "a"], ["y"])], x, y, axes).flops == 48 + 4 * T
    c = one([N("ArgMax", ["x"], ["y"], axis=1)], x, {"y": ("int64", [4, 1])})
    assert c.flops == 24 and c.bytes_written == 4 * 8


def test_softmax_layernorm_batchnorm():
    x = {"x": ("float32", [4, 6])}
    y = {"y": ("float32", [4, 6])}
    assert one([N("Softmax", ["x"], ["y"], axis=-1)], x, y).flops == (4 + T) * 24
    c = one([N("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1)], x, y, {"s": np.ones(6, W), "b": np.zeros(6, W)})
    assert c.flops == 7 * 24 + (T + 2) * 4
    assert c.bytes == 24 * 4 + 6 * 4 * 2 + 24 * 4
    c = one([N("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])], {"x": ("float32", [2, 3, 4, 4])},
            {"y": ("float32", [2, 3, 4, 4])}, {k: np.ones(3, W) for k in "sbmv"})
    assert c.flops == 2 * 96 + (T + 3) * 3
    assert c.bytes == 96 * 4 + 4 * 12 + 96 * 4


def test_resize_nearest_and_linear():
    scales = {"s": np.array([1, 1, 2, 2], W)}
    x, y = {"x": ("float32", [1, 1, 2, 2])}, {"y": ("float32", [1, 1, 4, 4])}
    c = one([N("Resize", ["x", "", "s"], ["y"], mode="nearest")], x, y, scales)
    assert c.flops == 0 and c.bytes == 16 + 16 + 64
    c = one([N("Resize", ["x", "", "s"], ["y"], mode="linear")], x, y, scales)
    assert c.flops == 3 * 3 * 16  # 2 resized dims: 3 lerps of 3 FLOPs per output element


# ------------------------------------------------------------------ data movement

def test_data_movement():
    x = {"x": ("float32", [2, 3, 4])}
    c = one([N("Transpose", ["x"], ["y"], perm=[2, 1, 0])], x, {"y": ("float32", [4, 3, 2])})
    assert (c.flops, c.bytes) == (0, 192)
    c = one([N("Concat", ["x", "x"], ["y"], axis=0)], x, {"y": ("float32", [4, 3, 4])})
    assert (c.flops, c.bytes_read, c.bytes_written) == (0, 96, 192)
    c = one([N("Reshape", ["x", "s"], ["y"])], x, {"y": ("float32", [6, 4])}, {"s": np.array([6, 4], np.int64)})
    assert (c.flops, c.bytes) == (0, 0) and "view" in c.note
    c = one([N("Gather", ["t", "i"], ["y"], axis=0)], {"i": ("int64", [3])}, {"y": ("float32", [3, 8])},
            {"t": np.zeros((1000, 8), W)})
    assert (c.bytes_read, c.bytes_written) == (3 * 8 * 4 + 3 * 8, 96)  # the rows it gathers, not the table
    c = one([N("Shape", ["x"], ["y"])], x, {"y": ("int64", [3])})
    assert (c.bytes_read, c.bytes_written) == (0, 24)


# ------------------------------------------------------------------ unknowns

def _raw(nodes, x_shape, domains=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]
                          + [helper.make_opsetid(d, 1) for d in domains])
    m.ir_version = 10
    return m


def test_unknown_ops_are_listed_not_zero():
    m = _raw([N("Relu", ["x"], ["r"]), N("Frobnicate", ["r"], ["y"], domain="acme")], [4], ["acme"])
    mc = model_cost(m)
    c = mc.by_name()["Frobnicate_1"]
    assert c.status == "unknown-op" and c.flops is None and c.bytes is None and c.intensity is None
    assert [n.op_type for n in mc.unknown] == ["Frobnicate"]
    assert mc.flops == 4  # the Relu only


def test_data_dependent_shapes_are_unknown_not_zero():
    m = _raw([N("NonZero", ["x"], ["nz"]), N("Transpose", ["nz"], ["t"]), N("Cast", ["t"], ["y"], to=1)], [4, 4])
    by = costs(m)
    assert by["Cast_2"].status == "unknown-shape" and by["Cast_2"].flops is None


# ------------------------------------------------------------------ fused nodes and the design notes

def test_pointwise_chain_counts_its_program_and_reads_once():
    m = cos_cos(width=1024)
    opt = optimize_model(m).model
    mc = model_cost(opt, batch=8)
    (c,) = mc.nodes
    n = 8 * 1024
    assert c.op_type == "PointwiseChain" and c.flops == 2 * T * n
    assert (c.bytes_read, c.bytes_written) == (4 * n, 4 * n)
    assert [b.op_type for b in c.body] == ["Cos", "Cos"] and c.label == "Cos→Cos"
    assert sum(b.bytes for b in c.body) == 16 * n  # unfused: four tensors' worth of bytes
    before = model_cost(m, batch=8)
    assert before.flops == mc.flops and before.bytes == 2 * mc.bytes


def test_mul_chain_intensity_grows_with_r_when_fused():
    for r in (1, 8, 64):
        opt = optimize_model(mul_chain(max(r, 2), width=256)).model
        (c,) = model_cost(opt, batch=4).nodes
        assert c.intensity == pytest.approx(max(r, 2) / 8)


def _design_note_models(hw: int = 1000):
    """Conv with 100 FLOP and 12 bytes per output element (2 input channels, 5x5 kernel,
    one output channel), then Relu: unfused, and as one onnxfuse node with a function body."""
    nodes = [N("Conv", ["x", "w"], ["c"], pads=[2, 2, 2, 2], kernel_shape=[5, 5], name="conv"),
             N("Relu", ["c"], ["y"], name="relu")]
    io = ({"x": ("float32", [1, 2, hw, hw])}, {"y": ("float32", [1, 1, hw, hw])})
    inits = {"w": np.zeros((1, 2, 5, 5), W)}
    unfused = model(nodes, *io, inits)
    fn = helper.make_function("onnxfuse", "ConvRelu", ["x0", "x1"], ["y0"],
                              [N("Conv", ["x0", "x1"], ["t0"], pads=[2, 2, 2, 2], kernel_shape=[5, 5], name="n0"),
                               N("Relu", ["t0"], ["y0"], name="n1")], [helper.make_opsetid("", 20)])
    g = helper.make_graph([N("ConvRelu", ["x", "w"], ["y"], domain="onnxfuse", name="conv_relu")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, hw, hw])],
                          [onnx.numpy_helper.from_array(inits["w"], "w")])
    fused = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("onnxfuse", 1)],
                              functions=[fn])
    fused.ir_version = 10
    onnx.checker.check_model(fused)
    return unfused, fused


def test_design_note_conv_relu_intensity_5_05_to_8_42():
    unfused, fused = _design_note_models()
    before = model_cost(unfused)
    conv, relu = before.by_name()["conv"], before.by_name()["relu"]
    elems = 1000 * 1000
    assert conv.flops == 100 * elems
    assert conv.bytes == 12 * elems + 200  # + the 5x5x2 weights
    assert relu.flops == elems and relu.bytes == 8 * elems
    assert round(before.flops / before.bytes, 2) == 5.05
    after = model_cost(fused)
    (c,) = after.nodes
    assert c.flops == 101 * elems and c.bytes == 12 * elems + 200
    assert round(c.intensity, 2) == 8.42
    assert [b.op_type for b in c.body] == ["Conv", "Relu"]


# ------------------------------------------------------------------ dynamic dims

def _dyn():
    return model([N("Relu", ["x"], ["y"])], {"x": ("float32", ["N", "S", 8])}, {"y": ("float32", ["N", "S", 8])})


def test_dims_from_shape_batch_and_default():
    mc = model_cost(_dyn(), shapes={"x": (2, 3, 8)})
    assert mc.dims == {"N": 2, "S": 3} and not mc.warnings and mc.nodes[0].flops == 48
    mc = model_cost(_dyn(), batch=4)
    assert mc.dims == {"N": 4, "S": 1} and mc.nodes[0].flops == 32
    assert len(mc.warnings) == 1 and "'S'" in mc.warnings[0] and "assumed 1" in mc.warnings[0]
    mc = model_cost(_dyn())
    assert mc.nodes[0].flops == 8 and len(mc.warnings) == 2
    mc = model_cost(_dyn(), shapes={"S": (5,)}, batch=2)  # a named dimension
    assert mc.dims == {"N": 2, "S": 5} and not mc.warnings


@pytest.mark.parametrize("shapes, message", [
    ({"y": (1, 1, 8)}, "no input 'y'"),
    ({"x": (1, 8)}, "rank 3"),
    ({"x": (1, 1, 9)}, "dimension 2 is 8"),
])
def test_bad_shapes(shapes, message):
    with pytest.raises(OnnxfuseError, match=message):
        bind_dims(_dyn(), shapes)



def test_paddle_dynamic_dims():
    """Paddle's exporter writes -1 for a dynamic dim and "?" for every unknown one (PP-OCR's
    direction classifier: x [-1, 3, ?, ?]): -1 is dynamic, and the "?"s are not one shared
    dimension, so x=1,3,48,192 binds (the fifteenth session's tuning lost its float64
    reference to this, and `profile` of the original stopped)."""
    m = model([N("Relu", ["x"], ["y"])], {"x": ("float32", [-1, 3, "?", "?"])}, {"y": ("float32", [-1, 3, "?", "?"])})
    mc = model_cost(m, shapes={"x": (1, 3, 48, 192)})
    assert mc.nodes[0].flops == 3 * 48 * 192 and not mc.warnings
    mc = model_cost(m)  # unbound: each unknown dim assumed 1, each with its warning
    assert mc.nodes[0].flops == 3 and len(mc.warnings) == 3

def test_parse_shape_args():
    assert parse_shapes(["x=1,3,224,224", "m=2x5"]) == {"x": (1, 3, 224, 224), "m": (2, 5)}
    for bad in ("x", "x=", "x=a,b", "=3"):
        with pytest.raises(OnnxfuseError, match="--shape"):
            parse_shapes([bad])


def test_fused_conv_body_costs_leave_out_the_weight_layout():
    """The unfused equivalent of a FusedConv is Conv -> Relu -> MaxPool: the Transpose of its
    packed (constant) weights in the function body is not a per-run round trip."""
    from models.build import conv_relu_maxpool
    from onnxfuse import optimize_model
    from onnxfuse.cost import model_cost

    r = optimize_model(conv_relu_maxpool(channels=8, size=16))
    (node,) = model_cost(r.model, {}, 2).known
    assert node.op_type == "FusedConv"
    assert [b.op_type for b in node.body] == ["Conv", "Relu", "MaxPool"]
    x, out = 2 * 8 * 16 * 16 * 4, 2 * 8 * 8 * 8 * 4
    weights = (8 * 8 * 9 + 8) * 4
    assert node.bytes_read == x + weights and node.bytes_written == out
    assert node.flops == sum(b.flops for b in node.body)
