"""Static shapes (onnxfuse/static.py): inputs fixed to the given dims, shape arithmetic folded
into constants, the model computing what it computed at those shapes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.errors import OnnxfuseError
from onnxfuse.static import MAX_ELEMENTS, fold_shape_arithmetic
from tests.util import model

N = helper.make_node


def flatten_head(big_fill: bool = False) -> onnx.ModelProto:
    """What exporters write for `x.view(x.shape[0], -1, x.shape[3])` and a sigmoid: Shape,
    Gather, Unsqueeze, Concat, Reshape; with big_fill also a ConstantOfShape of x's shape
    (an activation-sized tensor) added to x."""
    nodes = [N("Shape", ["x"], ["s"]),
             N("Gather", ["s", "i0"], ["n"], axis=0), N("Gather", ["s", "i3"], ["w"], axis=0),
             N("Unsqueeze", ["n", "ax"], ["n1"]), N("Unsqueeze", ["w", "ax"], ["w1"]),
             N("Concat", ["n1", "minus1", "w1"], ["shape"], axis=0),
             N("Reshape", ["x", "shape"], ["r"]), N("Sigmoid", ["r"], ["y"])]
    inits = {"i0": np.array(0, np.int64), "i3": np.array(3, np.int64), "ax": np.array([0], np.int64),
             "minus1": np.array([-1], np.int64)}
    outputs = {"y": ("float32", ["N", None, "W"])}
    if big_fill:
        nodes += [N("ConstantOfShape", ["s"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
                  N("Add", ["x", "ones"], ["z"])]
        outputs["z"] = ("float32", ["N", 4, "H", "W"])
    return model(nodes, {"x": ("float32", ["N", 4, "H", "W"])}, outputs, inits, opset=17)


def run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_shape_arithmetic_becomes_constants():
    m = flatten_head()
    folded, report = fold_shape_arithmetic(m, {"x": (2, 4, 8, 16)})
    onnx.checker.check_model(folded, full_check=True)
    assert [n.op_type for n in folded.graph.node] == ["Reshape", "Sigmoid"]
    shape = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}[folded.graph.node[0].input[1]]
    np.testing.assert_array_equal(shape, [2, -1, 16])
    assert [d.dim_value for d in folded.graph.input[0].type.tensor_type.shape.dim] == [2, 4, 8, 16]
    assert sum(report.nodes.values()) == 6 and report.nodes["Gather"] == 2
    assert report.summary().startswith("static shapes x=2x4x8x16: folded 6 nodes of shape arithmetic (")
    assert {t.name for t in folded.graph.initializer} == {folded.graph.node[0].input[1]}  # the rest unread
    x = np.random.default_rng(0).standard_normal((2, 4, 8, 16)).astype(np.float32)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], run(m, {"x": x})[0])
    with pytest.raises(Exception, match="(?i)dimension|shape"):  # the inputs say which shapes it takes
        run(folded, {"x": np.zeros((3, 4, 8, 16), np.float32)})
    assert m.graph.node[0].op_type == "Shape"  # the input model is not changed


def test_large_values_stay_nodes():
    """A ConstantOfShape as large as an activation is not made a constant."""
    folded, report = fold_shape_arithmetic(flatten_head(big_fill=True), {"x": (2, 4, 32, 64)})
    assert 2 * 4 * 32 * 64 > MAX_ELEMENTS
    assert "ConstantOfShape" in [n.op_type for n in folded.graph.node] and "ConstantOfShape" not in report.nodes
    assert "Shape" not in report.nodes or [n.op_type for n in folded.graph.node].count("Shape") == 0


def test_every_input_needs_its_dims_and_fixed_dims_must_agree():
    m = model([N("Add", ["a", "b"], ["y"])], {"a": ("float32", ["N", 3]), "b": ("float32", [1, 3])},
              {"y": ("float32", ["N", 3])})
    with pytest.raises(OnnxfuseError, match="missing: b"):
        fold_shape_arithmetic(m, {"a": (2, 3)})
    with pytest.raises(OnnxfuseError, match="fixes that dim to 3"):
        fold_shape_arithmetic(m, {"a": (2, 4), "b": (1, 3)})
    with pytest.raises(OnnxfuseError, match="2 dims given, the input has 4"):
        fold_shape_arithmetic(flatten_head(), {"x": (2, 4)})


def test_optimize_with_static_shapes_reports_the_fold_and_keeps_the_results():
    m = flatten_head()
    r = optimize_model(m, static_shapes={"x": (2, 4, 8, 16)})
    assert r.report.static_shapes.startswith("static shapes x=2x4x8x16: folded 6 nodes")
    assert r.report.summary().splitlines()[1] == r.report.static_shapes
    assert not any(n.op_type in ("Shape", "Gather", "Concat") for n in r.model.graph.node)
    x = np.random.default_rng(1).standard_normal((2, 4, 8, 16)).astype(np.float32)
    np.testing.assert_allclose(run(r.model, {"x": x})[0], run(m, {"x": x})[0], rtol=1e-6)
    assert optimize_model(m).report.static_shapes is None


def test_cli_shape_makes_the_written_model_static(tmp_path, capsys):
    from onnxfuse.cli import main

    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(flatten_head(), src)
    assert main(["optimize", str(src), str(dst), "--target", "none", "--shape", "x=2,4,8,16"]) == 0
    out = capsys.readouterr().out
    assert "static shapes x=2x4x8x16: folded 6 nodes of shape arithmetic" in out
    written = onnx.load(str(dst))
    assert [d.dim_value for d in written.graph.input[0].type.tensor_type.shape.dim] == [2, 4, 8, 16]
    # a dim left open: the model stays dynamic and the report says why
    assert main(["optimize", str(src), str(dst), "--target", "none", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "not made static, a symbolic dim is not given: input 'x': dim 2 (H) set to 1" in out
    assert onnx.load(str(dst)).graph.input[0].type.tensor_type.shape.dim[2].dim_param == "H"


def _head_split_chain(layers: int) -> onnx.ModelProto:
    """`layers` times: x [B, 64] -> Reshape to [B, heads, -1] -> Reshape back, with heads computed
    from x's shape through ops onnx's data propagation does not follow (Cast, Div), as exported
    decoders compute their head splits: each layer's shapes are known only once the layer before
    it is folded (GPT-2-small: one layer per round)."""
    nodes, x = [], "x"
    inits = {"zero": np.array(0, np.int64), "eight": np.array(8.0, np.float32), "minus1": np.array([-1], np.int64),
             "axes": np.array([0], np.int64), "flat": np.array([0, -1], np.int64)}
    for k in range(layers):
        nodes += [helper.make_node("Shape", [x], [f"s{k}"]),
                  helper.make_node("Gather", [f"s{k}", "zero"], [f"b{k}"]),
                  helper.make_node("Cast", [f"b{k}"], [f"bf{k}"], to=onnx.TensorProto.FLOAT),
                  helper.make_node("Div", [f"bf{k}", "eight"], [f"q{k}"]),
                  helper.make_node("Cast", [f"q{k}"], [f"qi{k}"], to=onnx.TensorProto.INT64),
                  helper.make_node("Unsqueeze", [f"b{k}", "axes"], [f"bu{k}"]),
                  helper.make_node("Unsqueeze", [f"qi{k}", "axes"], [f"qu{k}"]),
                  helper.make_node("Concat", [f"bu{k}", f"qu{k}", "minus1"], [f"t{k}"], axis=0),
                  helper.make_node("Reshape", [x, f"t{k}"], [f"r{k}"]),
                  helper.make_node("Reshape", [f"r{k}", "flat"], [f"y{k}"]),
                  helper.make_node("Relu", [f"y{k}"], [f"x{k + 1}"])]
        x = f"x{k + 1}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return model(nodes, {"x": ("float32", ["B", 64])}, {"y": ("float32", ["B", 64])}, inits, opset=17)


def test_shape_arithmetic_folds_layer_after_layer():
    """Folding repeats until nothing more folds: every layer of a 12-layer chain is folded (at
    the former 8 rounds the last layers kept their Shape nodes), and the outputs stay the same."""
    m = _head_split_chain(12)
    folded, report = fold_shape_arithmetic(m, {"x": (16, 64)})
    assert not [n for n in folded.graph.node if n.op_type in ("Shape", "Cast", "Div", "Concat")]
    assert report.nodes["Shape"] == 12
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    run = [ort.InferenceSession(mm.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
           for mm in (m, folded)]
    np.testing.assert_array_equal(run[0], run[1])


def test_light_copy_keeps_everything_but_large_weights():
    """load.light_copy: the model field by field, small initializers with their values, large
    ones as stand-ins of the same name, type and dims (what shape inference reads), none read."""
    from onnxfuse.load import light_copy

    m = _head_split_chain(2)
    m.graph.initializer.append(numpy_helper.from_array(np.ones((64, 64), np.float32), "big"))
    m.graph.value_info.append(helper.make_tensor_value_info("r0", onnx.TensorProto.FLOAT, None))
    m.doc_string = "kept"
    light = light_copy(m)
    assert light.doc_string == "kept" and light.opset_import == m.opset_import
    assert light.graph.node == m.graph.node and light.graph.value_info == m.graph.value_info
    assert light.graph.input == m.graph.input and light.graph.output == m.graph.output
    by = {t.name: t for t in light.graph.initializer}
    assert set(by) == {t.name for t in m.graph.initializer}
    assert by["eight"] == next(t for t in m.graph.initializer if t.name == "eight")
    big = by["big"]
    assert list(big.dims) == [64, 64] and big.data_type == onnx.TensorProto.FLOAT and not big.raw_data
    assert big.data_location == onnx.TensorProto.EXTERNAL
    assert len(m.graph.initializer[-1].raw_data) == 64 * 64 * 4  # the model itself is untouched


def test_dynamic_model_folds_what_its_static_dims_decide():
    """flatten_head with a static channel dim: `x.view(N, -1, W)` keeps its N and W, read at run
    time, but a reshape by the channels (Gather(Shape(x), 1), a static 4) folds, and the model
    stays dynamic: it runs at two batch sizes and equals the original at both."""
    m = flatten_head()
    g = m.graph
    g.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "i1"))
    g.node.extend([N("Gather", ["s", "i1"], ["c"], axis=0), N("Unsqueeze", ["c", "ax"], ["c1"]),
                   N("Concat", ["minus1", "c1"], ["shape2"], axis=0), N("Reshape", ["x", "shape2"], ["z"])])
    g.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None))
    before = m.SerializeToString()
    r = optimize_model(m)
    assert m.SerializeToString() == before  # the input model is not changed
    ops = [n.op_type for n in r.model.graph.node]
    # folded: the channel's Gather, Unsqueeze and Concat; kept: Shape, N's and W's Gathers and theirs
    assert ops.count("Gather") == 2 and ops.count("Concat") == 1 and ops.count("Shape") == 1, ops
    assert "folded 3 nodes of shape arithmetic on static dims (" in r.report.summary()
    for n in (2, 5):
        x = np.random.default_rng(n).standard_normal((n, 4, 3, 6)).astype(np.float32)
        for a, b in zip(run(r.model, {"x": x}), run(m, {"x": x}), strict=True):
            np.testing.assert_array_equal(a, b)


def test_dynamic_model_without_shape_nodes_is_not_folded():
    m = model([N("Sigmoid", ["x"], ["y"]), N("Exp", ["y"], ["z"])], {"x": ("float32", ["N", 4])},
              {"z": ("float32", ["N", 4])}, opset=17)
    r = optimize_model(m)
    assert r.report.static_shapes is None or "folded" not in r.report.static_shapes


def test_slices_of_a_whole_axis_and_empty_concat_inputs_go():
    """Phi-3's rotary split with every dim rotated: q[..., :d] (the whole axis) and q[..., d:] (empty),
    concatenated back: once the dims are known the Slice is the tensor itself and the empty part
    adds nothing, so both go with the Concat (which then has one input) and the dead Slice,
    leaving the Sigmoid; the model computes the same, dynamic batch and all."""
    inits = {"zero": np.array([0], np.int64), "d": np.array([8], np.int64), "big": np.array([2**62], np.int64),
             "last": np.array([-1], np.int64)}
    nodes = [N("Slice", ["x", "zero", "d", "last"], ["rot"]), N("Slice", ["x", "d", "big", "last"], ["pass"]),
             N("Sigmoid", ["rot"], ["s"]), N("Concat", ["s", "pass"], ["y"], axis=-1)]
    m = model(nodes, {"x": ("float32", ["N", 3, 8])}, {"y": ("float32", ["N", 3, 8])}, inits, opset=17)
    r = optimize_model(m, leave_to_ort=False)
    assert [n.op_type for n in r.model.graph.node] == ["Sigmoid"], r.report.summary()
    assert "dropped 1 Slices of a whole axis, 1 empty Concat inputs" in r.report.summary()
    x = np.random.default_rng(3).standard_normal((5, 3, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(r.model, {"x": x})[0], run(m, {"x": x})[0])
    # a Slice of part of the axis stays
    part = model([N("Slice", ["x", "zero", "d", "last"], ["y"])], {"x": ("float32", ["N", 3, 9])},
                 {"y": ("float32", ["N", 3, 8])}, inits, opset=17)
    assert [n.op_type for n in optimize_model(part).model.graph.node] == ["Slice"]


def head_split(opset: int = 17) -> onnx.ModelProto:
    """A dynamic export's attention heads without the attention: x [batch, seq, 64] viewed as
    [batch, seq, -1, 32] (a shape computed from Shape(x)), transposed to the heads, a sigmoid,
    transposed back and merged to [batch, seq, -1] with batch and seq read from Shape(t), the
    transposed tensor, as the exporters write `t.size()`."""
    nodes = [N("Shape", ["x"], ["s"]), N("Gather", ["s", "i0"], ["b"], axis=0), N("Gather", ["s", "i1"], ["q"], axis=0),
             N("Unsqueeze", ["b", "ax"], ["b1"]), N("Unsqueeze", ["q", "ax"], ["q1"]),
             N("Concat", ["b1", "q1", "minus1", "d"], ["split"], axis=0), N("Reshape", ["x", "split"], ["r"]),
             N("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
             N("Shape", ["t"], ["st"]), N("Gather", ["st", "i0"], ["tb"], axis=0),
             N("Gather", ["st", "i2"], ["ts"], axis=0), N("Unsqueeze", ["tb", "ax"], ["tb1"]),
             N("Unsqueeze", ["ts", "ax"], ["ts1"]), N("Concat", ["tb1", "ts1", "minus1"], ["merge"], axis=0),
             N("Sigmoid", ["t"], ["u"]), N("Transpose", ["u"], ["v"], perm=[0, 2, 1, 3]),
             N("Reshape", ["v", "merge"], ["y"])]
    inits = {"i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "i2": np.array(2, np.int64),
             "ax": np.array([0], np.int64), "minus1": np.array([-1], np.int64), "d": np.array([32], np.int64)}
    if opset < 13:  # Unsqueeze's axes an attribute
        nodes = [N("Unsqueeze", [n.input[0]], n.output, axes=[0]) if n.op_type == "Unsqueeze" else n for n in nodes]
    return model(nodes, {"x": ("float32", ["batch", "seq", 64])}, {"y": ("float32", ["batch", "seq", 64])}, inits,
                 opset=opset)


def test_symbolic_inference_knows_the_heads_of_a_dynamic_reshape():
    """ONNX's shape inference cannot divide symbolic dims: Reshape([batch, seq, 64], [batch, seq,
    -1, 32]) leaves it the heads unknown; ONNX Runtime's symbolic inference fills them in (2)."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    from onnxfuse.graph import GraphView
    from onnxfuse.load import infer_shapes

    m = head_split()
    onnx_only = onnx.shape_inference.infer_shapes(m, data_prop=True)
    dims = {vi.name: [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
            for vi in onnx_only.graph.value_info}
    assert dims["r"][2] != 2  # (what this fills in)
    view = GraphView.build(m, infer_shapes(m))
    assert view.shapes["r"] == ("batch", "seq", 2, 32) and view.shapes["t"] == ("batch", 2, "seq", 32)


def test_symbolic_inference_does_not_import_torch():
    """ONNX Runtime's symbolic inference is loaded from its file: the package onnxruntime.tools
    imports torch wherever it is installed (about 240 MB of memory for an optimize that needs
    none of it); shapes as through the package."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from onnxfuse.load import _symbolic_shape_infer; m = _symbolic_shape_infer(); "
            "print(hasattr(m, 'SymbolicShapeInference'), 'torch' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    assert out == ["True", "False"]


@pytest.mark.parametrize("opset", [11, 17])
def test_shape_reads_of_intermediates_read_the_graph_inputs(opset):
    """Gather(Shape(t), 0) and Gather(Shape(t), 2) of the transposed heads are the input's batch and
    seq: after the fold they read one Shape of x, nothing reads t's shape (which would keep its
    Transpose out of a fused node), and the model computes what it did at two shapes."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    from onnxfuse.static import fold_known_dims

    m = head_split(opset)
    folded, report = fold_known_dims(onnx.load_from_string(m.SerializeToString()))
    readers = [n for n in folded.graph.node if n.op_type == "Shape"]
    assert [n.input[0] for n in readers] == ["x"], [(n.input, n.output) for n in readers]
    assert report.anchored == 2
    for shape in ((2, 5, 64), (1, 3, 64)):
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        for a, b in zip(run(folded, {"x": x}), run(m, {"x": x}), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_whole_shape_read_reads_the_inputs_dims():
    """Shape(t) read whole (by a ConstantOfShape) of t [batch, 2, seq, 32]: a Concat of the input's dims
    and the sizes, or one Shape of the input with start and end where its dims are consecutive."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    from onnxfuse.static import fold_known_dims

    m = head_split()
    g = m.graph
    g.node.extend([N("Shape", ["t"], ["whole"]), N("ConstantOfShape", ["whole"], ["e"]),
                   N("Shape", ["t"], ["lead"], start=0, end=1), N("ConstantOfShape", ["lead"], ["f"]),
                   N("Shape", ["t"], ["as_t"]), N("Reshape", ["t", "as_t"], ["z"]), N("Shape", ["t"], ["seen"])])
    g.output.extend([helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in ("e", "f", "z")]
                    + [helper.make_tensor_value_info("seen", onnx.TensorProto.INT64, None)])
    folded, report = fold_known_dims(onnx.load_from_string(m.SerializeToString()))
    # kept: Reshape(t, Shape(t)), "as t" (torch's GroupNorm export: the rows kind reads the idiom),
    # and a Shape the user reads (a graph output)
    assert sorted(n.output[0] for n in folded.graph.node if n.op_type == "Shape" and n.input[0] == "t") == \
        ["as_t", "seen"]
    assert report.anchored == 4
    x = np.zeros((3, 7, 64), np.float32)
    for a, b in zip(run(folded, {"x": x}), run(m, {"x": x}), strict=True):
        np.testing.assert_array_equal(a, b)


def test_slices_and_products_of_shape_reads():
    """torch's exporter reads t.size(-1) as Slice(Shape(t)) + Squeeze, and a view over merged
    heads has a leading dim 2 * batch: the Slices of t's named dims read the input's Shape, the
    product is Gather(Shape(x), 0) * 2, the static dim folds; nothing reads the merged tensor's
    Shape and the model computes what it did at two shapes."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    from onnxfuse.static import fold_known_dims

    m = head_split()
    g = m.graph
    g.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
                         {"k0": [0], "k1": [1], "k2": [2], "kend": [2 ** 62], "kneg": [-1]}.items())
    g.node.extend([N("Concat", ["minus1", "ts1", "d"], ["merge3"], axis=0), N("Reshape", ["t", "merge3"], ["m3"]),
                   N("Shape", ["m3"], ["sm"]), N("Slice", ["sm", "k0", "k1"], ["lead"]),
                   N("Slice", ["sm", "k1", "k2"], ["rows"]), N("Slice", ["sm", "kneg", "kend"], ["last"]),
                   N("Concat", ["lead", "rows", "last"], ["back"], axis=0), N("Sigmoid", ["m3"], ["u3"]),
                   N("Reshape", ["u3", "back"], ["y3"])])
    g.output.append(helper.make_tensor_value_info("y3", onnx.TensorProto.FLOAT, None))
    folded, report = fold_known_dims(onnx.load_from_string(m.SerializeToString()))
    assert [n.input[0] for n in folded.graph.node if n.op_type == "Shape"] == ["x"]
    assert report.anchored == 4 and report.nodes["Slice"] >= 1, (report.anchored, report.nodes)
    for shape in ((2, 5, 64), (3, 4, 64)):
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        for a, b in zip(run(folded, {"x": x}), run(m, {"x": x}), strict=True):
            np.testing.assert_array_equal(a, b)
