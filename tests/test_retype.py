"""onnxfuse.retype: one walk that changes a model's float types (the float64 reference and
the float32 probe of ONNX Runtime's fusions use it)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.retype import Retype, holds

N = helper.make_node


def _model():
    """float16 everywhere a type can hide: inputs, value_info, an initializer, a Cast's `to`,
    a Constant tensor, a subgraph, a model-local function."""
    vi = helper.make_tensor_value_info
    then = helper.make_graph([N("Identity", ["c"], ["t_out"])], "then", [], [vi("t_out", TensorProto.FLOAT16, [2])])
    g = helper.make_graph(
        [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array([0.5, 2.0], np.float16), "c")),
         N("Cast", ["x"], ["xc"], to=TensorProto.FLOAT16), N("Add", ["xc", "w"], ["a"]),
         N("If", ["cond"], ["b"], then_branch=then, else_branch=then), N("Mul", ["a", "b"], ["y"])],
        "g", [vi("x", TensorProto.FLOAT, [2]), vi("cond", TensorProto.BOOL, [])],
        [vi("y", TensorProto.FLOAT16, [2])], [numpy_helper.from_array(np.array([1, 3], np.float16), "w")],
        value_info=[vi("a", TensorProto.FLOAT16, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_float16_to_float32_everywhere_and_the_input_kept():
    m = _model()
    before = m.SerializeToString()
    assert holds(m, frozenset({TensorProto.FLOAT16}))
    out = Retype(frozenset({TensorProto.FLOAT16}), TensorProto.FLOAT).model(m)
    assert m.SerializeToString() == before  # a copy
    assert not holds(out, frozenset({TensorProto.FLOAT16}))
    assert out.graph.value_info[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.node[1].attribute[0].i == TensorProto.FLOAT
    assert numpy_helper.to_array(out.graph.initializer[0]).dtype == np.float32
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # float32 stays float32


def test_stand_ins_are_retyped_without_values():
    """A weight's stand-in (`load.light_copy`: no values) changes its type only."""
    from onnxfuse.load import PLACEHOLDER, light_copy

    w = numpy_helper.from_array(np.ones((64, 64), np.float16), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 64])], [w])
    light = light_copy(helper.make_model(g))
    (t,) = Retype(frozenset({TensorProto.FLOAT16}), TensorProto.FLOAT).model(light).graph.initializer
    assert t.data_type == TensorProto.FLOAT and list(t.dims) == [64, 64] and not t.raw_data
    assert [(kv.key, kv.value) for kv in t.external_data] == [("location", PLACEHOLDER)]


def test_float64_drops_value_info_and_types_float32_defaults():
    """With float32 a source type, Constant value_float and ConstantOfShape's default 0 (both
    float32 by definition) become the target type; value_info can be dropped."""
    g = helper.make_graph([N("Constant", [], ["k"], value_float=0.25), N("ConstantOfShape", ["s"], ["z"]),
                           N("Add", ["k", "z"], ["y"])], "g",
                          [helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                          value_info=[helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    floats = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
    out = Retype(floats, TensorProto.DOUBLE, keep_value_info=False).model(m)
    assert not out.graph.value_info and out.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    const = {a.name: a for a in out.graph.node[0].attribute}
    assert numpy_helper.to_array(const["value"].t).dtype == np.float64 and "value_float" not in const
    assert numpy_helper.to_array(out.graph.node[1].attribute[0].t).dtype == np.float64


def test_holds_looks_into_functions():
    f = helper.make_function("local", "f", ["x"], ["y"], [N("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)],
                             [helper.make_opsetid("", 17)])
    g = helper.make_graph([N("f", ["x"], ["y"], domain="local")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                          functions=[f])
    assert holds(m, frozenset({TensorProto.FLOAT16}))
    out = Retype(frozenset({TensorProto.FLOAT16}), TensorProto.FLOAT).model(m)
    assert out.functions[0].node[0].attribute[0].i == TensorProto.FLOAT
