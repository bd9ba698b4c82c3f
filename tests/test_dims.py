"""Symbolic dims (onnxfuse/dims.py) and what a fused node's function body computes for a Reshape's
or an Expand's computed shape input (onnxfuse.graph.shape_input_spec, shape_input_nodes)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnxfuse.dims import canonical, product
from onnxfuse.graph import GraphView, shape_input_nodes, shape_input_spec
from onnxfuse.load import infer_shapes

N = helper.make_node


def test_products_have_one_spelling():
    assert canonical("batch*12") == canonical("12*batch") == "12*batch"
    assert canonical("seq*batch") == "batch*seq" and canonical("1*batch") == "batch"
    assert canonical("Min(512, seq)") == "Min(512, seq)" and canonical(7) == 7 and canonical(None) is None
    assert product("batch", 2, 6) == "12*batch" and product(3, 4) == 12 and product("batch", None) is None
    assert product("2*batch", "seq") == "2*batch*seq" and product("Min(512, seq)", 2) is None
    assert canonical("batch size") == "batch size" and product("batch size", 2) is None  # (names kept as spelled)


def _view(nodes, inputs: dict, outputs: list[str], inits=()) -> GraphView:
    """The model's view (its outputs' shapes left to inference)."""
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(np.dtype(t)), d)
                     for n, (t, d) in inputs.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    return GraphView.build(m, infer_shapes(m))


@pytest.mark.parametrize("allowzero", [0, 1])
def test_a_reshape_to_a_computed_shape_has_a_stand_in(allowzero):
    """[batch, seq, 64] to [batch, seq, 2, 32] (its shape from Shape(x)): 0 keeps a dim (x's own
    dim read at run time where allowzero makes 0 a size); to [2 * batch, seq, 32] from [batch, 2,
    seq, 32]: one -1 and seq read from x. The body's nodes compute what the shape arithmetic did."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    nodes = [N("Shape", ["x"], ["s"]), N("Slice", ["s", "zero", "two"], ["bs"]),
             N("Concat", ["bs", "heads"], ["shape"], axis=0), N("Reshape", ["x", "shape"], ["r"], allowzero=allowzero),
             N("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]), N("Shape", ["t"], ["st"]),
             N("Slice", ["st", "two", "four"], ["sd"]), N("Concat", ["minus1", "sd"], ["merged"], axis=0),
             N("Reshape", ["t", "merged"], ["y"], allowzero=allowzero)]
    inits = {"zero": np.array([0], np.int64), "two": np.array([2], np.int64), "four": np.array([4], np.int64),
             "heads": np.array([2, 32], np.int64), "minus1": np.array([-1], np.int64)}
    view = _view(nodes, {"x": ("float32", ["batch", "seq", 64])}, ["y"], inits.items())
    reshape, merge = view.nodes[3], view.nodes[8]
    assert shape_input_spec(view, reshape) == ([(0,), (1,), 2, 32] if allowzero else [0, 0, 2, 32])
    assert view.shapes["y"] == ("2*batch", "seq", 32)
    assert shape_input_spec(view, merge) == [-1, (2,), 32]
    assert shape_input_spec(view, view.nodes[4]) is None  # (a Transpose)
    # the body's nodes compute the same shape as the graph's arithmetic, at another shape
    body = shape_input_nodes(shape_input_spec(view, merge), "t", "spec", "p")
    g = helper.make_graph(body, "spec", [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("spec", onnx.TensorProto.INT64, None)])
    t = np.zeros((3, 2, 5, 32), np.float32)
    spec = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"t": t})[0]
    assert t.reshape(spec).shape == (6, 5, 32)


def test_an_expand_to_a_computed_shape_has_a_stand_in():
    """repeat_kv: [batch, 1, 1, seq, 32] expanded to [batch, 1, 2, seq, 32] is Expand by [1, 1, 2, 1, 1];
    to a named dim x does not have, none."""
    nodes = [N("Shape", ["x"], ["s"]), N("Concat", ["s", "two"], ["want"], axis=0),
             N("Unsqueeze", ["x", "ax"], ["u"]), N("Slice", ["want", "zero", "five"], ["w5"]),
             N("Expand", ["u", "target"], ["e"]), N("Expand", ["u", "w"], ["f"])]
    inits = {"two": np.array([2], np.int64), "ax": np.array([2], np.int64), "zero": np.array([0], np.int64),
             "five": np.array([5], np.int64), "target": np.array([1, 1, 2, 1, 1], np.int64)}
    view = _view(nodes, {"x": ("float32", ["batch", 1, "seq", 32]), "w": ("int64", [5])},
                 ["e", "f"], inits.items())
    assert view.shapes["e"] == ("batch", 1, 2, "seq", 32)
    assert shape_input_spec(view, view.nodes[4]) == [1, 1, 2, 1, 1]
    assert shape_input_spec(view, view.nodes[5]) is None  # (its output's dims are not known)
