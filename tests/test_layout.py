"""The NHWC layout pass (`optimize --layout nhwc`, onnxfuse/layout.py): which tensors turn
channels-last, the node attributes and functions it writes, and that the model computes the
same: through its function bodies in plain ONNX Runtime and through the library's CPU
kernels. Kernels are compiled for sm_90 (no GPU needed); the GPU run is tests/test_gpu_conv.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from models.build import vgg_stack
from onnxfuse import layout as layout_pass
from onnxfuse import optimize_model
from onnxfuse.cli import main
from onnxfuse.pipeline import compile_pass
from onnxfuse.runtime import library_path
from tests.util import kernel_options, random_feeds

pytest.importorskip("triton")
N = helper.make_node


@pytest.fixture(autouse=True)
def weights_as_they_are(monkeypatch):
    """These tests compare the library's CPU kernels and the function bodies with the original
    at fp32 tolerance. The shipped "tf32" kernels read weights that the compile step rounds to
    TF32 (tests/test_conv_precision.py checks that): here the kernels round both operands
    themselves (the benchmark's "ab" mode), so the weights stay as they are and the layouts
    are compared exactly."""
    from onnxfuse import codegen_conv

    monkeypatch.setattr(codegen_conv, "_ROUND_TF32", "ab")


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute if not a.name.startswith("kernel")}


def nhwc_model(m: onnx.ModelProto, tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(m)
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    return r


def run(m: onnx.ModelProto, feeds, library: bool):
    so = ort.SessionOptions()
    if library:
        so.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def check_same(m, fused, library: bool):
    feeds = random_feeds(m, {"N": 2}, seed=5)
    for e, a in zip(run(m, feeds, False), run(fused, feeds, library), strict=True):
        assert e.shape == a.shape
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


def test_vgg_stack_runs_channels_last_between_its_convs(tmp_path, monkeypatch):
    m = vgg_stack(blocks=4, channels=8, size=32)
    r = nhwc_model(m, tmp_path, monkeypatch)
    nodes = [n for n in r.model.graph.node]
    assert [n.op_type for n in nodes] == ["FusedConv"] * 4
    got = [(attrs(n).get("x_layout", b"NCHW"), attrs(n).get("y_layout", b"NCHW")) for n in nodes]
    assert got == [(b"NCHW", b"NHWC"), (b"NHWC", b"NHWC"), (b"NHWC", b"NHWC"), (b"NHWC", b"NCHW")]
    shapes = value_shapes(r.model)
    assert shapes["p0"][1:] == [16, 16, 8] and shapes["p2"][1:] == [4, 4, 8]  # [N, H, W, C]
    # each layout combination is its own kernel and function
    overloads = [n.overload for n in nodes]
    assert overloads[0].endswith("_nchw_nhwc_krsc") and overloads[3].endswith("_nhwc_nchw_krsc")
    # every conv of the pass takes [K, R, S, C] weights
    assert [attrs(n).get("w_layout", b"RSCK") for n in nodes] == [b"KRSC"] * 4
    inits = {t.name: tuple(t.dims) for t in r.model.graph.initializer}
    assert inits[nodes[0].input[1]] == (8, 3, 3, 3) and inits[nodes[1].input[1]] == (8, 3, 3, 8)
    assert {f.overload for f in r.model.functions} == set(overloads)
    assert [f.kernel_name for f in r.fused] == overloads
    assert [rec.kernel for rec in r.report.fused] == overloads
    meta = json.loads(attrs_all(nodes[1])["kernel_meta"])
    assert (meta["x_layout"], meta["y_layout"], meta["w_layout"]) == ("nhwc", "nhwc", "krsc")
    assert json.loads(attrs_all(nodes[0])["kernel_meta"])["w_layout"] == "krsc"
    check_same(m, r.model, library=False)  # the function bodies: Transposes around the originals


def value_shapes(m: onnx.ModelProto) -> dict[str, list]:
    """The graph's value_info dims (a dim_value, else its dim_param)."""
    return {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in m.graph.value_info}


def attrs_all(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def residual(c: int = 8, size: int = 9) -> onnx.ModelProto:
    """conv1 -> Relu = r1; conv2(r1) + r1 -> Relu = y: r1 is conv2's X and its epilogue extra."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) / (3 * c)).astype(np.float32), f"w{i}")
             for i in (1, 2)]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),
             N("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Add", ["c2", "r1"], ["a"], name="add"),
             N("Relu", ["a"], ["y"], name="relu2")]
    return image_model(nodes, "residual", c, size, [("y", c)], inits)


def image_model(nodes, name: str, c: int, size: int, outputs: list[tuple[str, int]], inits) -> onnx.ModelProto:
    """Opset 17, IR 10: input x [N, c, size, size], outputs [N, channels, size, size]."""
    g = helper.make_graph(nodes, name,
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, ["N", k, size, size])
                           for o, k in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def test_a_tensor_read_as_x_and_as_an_extra_turns_nhwc_for_both(tmp_path, monkeypatch):
    m = residual()
    r = nhwc_model(m, tmp_path, monkeypatch)
    first, second = r.model.graph.node
    assert attrs(first)["y_layout"] == b"NHWC"
    assert attrs(second)["x_layout"] == b"NHWC" and attrs(second)["extra_layouts"] == [1]
    assert attrs(second)["y_layout"] == b"NCHW"  # a graph output stays NCHW
    assert r.fused[1].extra_layouts == (1,)
    meta = json.loads(attrs_all(second)["kernel_meta"])
    assert meta["extra_layouts"] == [1]
    check_same(m, r.model, library=False)


def test_library_cpu_kernels_honour_the_layouts(tmp_path, monkeypatch):
    for m in (vgg_stack(blocks=3, channels=8, size=16), residual()):
        r = nhwc_model(m, tmp_path, monkeypatch)
        check_same(m, r.model, library=True)
    # The channels-last tensor itself, exposed as an extra output after the pass: a kernel
    # that ignored the layouts would still give the right final output (it would write and
    # read NCHW consistently), but not this.
    m = residual()
    r = nhwc_model(m, tmp_path, monkeypatch)
    r.model.graph.output.append(helper.make_tensor_value_info("r1", onnx.TensorProto.FLOAT, None))
    m.graph.output.append(helper.make_tensor_value_info("r1", onnx.TensorProto.FLOAT, None))
    feeds = random_feeds(m, {"N": 2}, seed=6)
    want = run(m, feeds, False)[1].transpose(0, 2, 3, 1)
    for library in (False, True):
        got = run(r.model, feeds, library)[1]
        assert got.shape == want.shape, library
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_conv_read_by_other_ops_stays_nchw(tmp_path, monkeypatch):
    m = residual()
    # the first conv's result is also read by a Sigmoid that is not a conv
    m.graph.node.append(N("Sigmoid", ["r1"], ["s"], name="sig"))
    m.graph.output.append(helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, None))
    r = optimize_model(m)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    compile_pass(r, kernel_options("sm_90", layout="nhwc"))
    convs = [n for n in r.model.graph.node if n.op_type == "FusedConv"]
    assert len(convs) == 2
    assert all(attrs(n).get(k, b"NCHW") == b"NCHW" for n in convs for k in ("x_layout", "y_layout"))


def test_cli_layout_needs_gpu_kernels(tmp_path, capsys):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(residual(), str(src))
    assert main(["optimize", str(src), str(dst), "--layout", "nhwc", "--target", "none"]) == 2
    assert "--target none" in capsys.readouterr().err and not dst.exists()


def test_convs_reading_nchw_tensors_get_a_transpose_at_the_boundary(tmp_path, monkeypatch):
    # 16 channels: the graph input and r1 (also read by a Sigmoid, so conv1 writes NCHW) are
    # read by the convs through one Transpose each; the residual extra stays NCHW.
    m = residual(c=16)
    m.graph.node.append(N("Sigmoid", ["r1"], ["s"], name="sig"))
    m.graph.output.append(helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["N", 16, 9, 9]))
    r = nhwc_model(m, tmp_path, monkeypatch)
    ops = [(n.op_type, list(n.input)[:1]) for n in r.model.graph.node]
    assert ops == [("Transpose", ["x"]), ("FusedConv", ["x_nhwc"]), ("Transpose", ["r1"]),
                   ("FusedConv", ["r1_nhwc"]), ("Sigmoid", ["r1"])]
    t1, c1, t2, c2, _ = r.model.graph.node
    assert attrs(t1)["perm"] == [0, 2, 3, 1] == attrs(t2)["perm"]
    assert (attrs(c1)["x_layout"], attrs(c1)["y_layout"], attrs(c1)["w_layout"]) == (b"NHWC", b"NCHW", b"KRSC")
    assert attrs(c2)["x_layout"] == b"NHWC" and attrs(c2).get("extra_layouts", [0]) == [0]
    assert list(c2.input)[3] == "r1"
    assert [f.inputs[0] for f in r.fused] == ["x_nhwc", "r1_nhwc"]
    shapes = value_shapes(r.model)
    assert shapes["x_nhwc"] == ["N", 9, 9, 16]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_narrow_inputs_stay_nchw(tmp_path, monkeypatch):
    # 8 channels from the graph input: below MIN_NHWC_CHANNELS, no Transpose
    r = nhwc_model(residual(c=8), tmp_path, monkeypatch)
    assert [n.op_type for n in r.model.graph.node] == ["FusedConv", "FusedConv"]
    assert attrs(r.model.graph.node[0])["x_layout"] == b"NCHW"


def c2f(extra_reader: bool = False) -> onnx.ModelProto:
    """YOLOv8's C2f shape: conv1 -> Split(axis 1) -> a, b; conv2(b) = c; Concat(a, b, c) ->
    conv3. With extra_reader, a Sigmoid also reads the Concat (so it must stay NCHW)."""
    rng = np.random.default_rng(2)

    def w(k, c, r):
        return (rng.standard_normal((k, c, r, r)) / (3 * c)).astype(np.float32)

    inits = [numpy_helper.from_array(w(32, 16, 1), "w1"), numpy_helper.from_array(w(16, 16, 3), "w2"),
             numpy_helper.from_array(w(16, 48, 1), "w3"),
             numpy_helper.from_array(np.array([16, 16], np.int64), "split")]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),
             N("Split", ["r1", "split"], ["a", "b"], axis=1, name="split"),
             N("Conv", ["b", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Relu", ["c2"], ["r2"], name="relu2"),
             N("Concat", ["a", "b", "r2"], ["cat"], axis=1, name="concat"),
             N("Conv", ["cat", "w3"], ["c3"], kernel_shape=[1, 1], name="conv3"),
             N("Relu", ["c3"], ["y"], name="relu3")]
    outs = [("y", 16)]
    if extra_reader:
        nodes.append(N("Sigmoid", ["cat"], ["s"], name="sig"))
        outs.append(("s", 48))
    return image_model(nodes, "c2f", 16, 8, outs, inits)


def test_split_and_concat_between_fused_convs_work_channels_last(tmp_path, monkeypatch):
    m = c2f()
    r = nhwc_model(m, tmp_path, monkeypatch)
    nodes = list(r.model.graph.node)
    assert [n.op_type for n in nodes] == ["Transpose", "FusedConv", "Split", "FusedConv", "Concat", "FusedConv"]
    _, c1, split, c2, cat, c3 = nodes
    assert attrs(split)["axis"] == 3 and attrs(cat)["axis"] == 3
    assert attrs(c1)["y_layout"] == b"NHWC" and attrs(c2)["x_layout"] == b"NHWC" == attrs(c2)["y_layout"]
    assert attrs(c3)["x_layout"] == b"NHWC" and attrs(c3)["y_layout"] == b"NCHW"  # a graph output
    # the value infos say NHWC where they exist, so inference carries it through Split and Concat
    inferred = onnx.shape_inference.infer_shapes(r.model, strict_mode=True)
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in inferred.graph.value_info}
    assert shapes["r1"] == ["N", 8, 8, 32] and shapes["a"] == ["N", 8, 8, 16] and shapes["cat"] == ["N", 8, 8, 48]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_a_concat_read_by_another_op_keeps_its_component_nchw(tmp_path, monkeypatch):
    m = c2f(extra_reader=True)
    r = nhwc_model(m, tmp_path, monkeypatch)
    ops = [n.op_type for n in r.model.graph.node]
    assert ops.count("Transpose") == 3  # x, b (conv2's X) and cat (conv3's X) are read through one each
    split = next(n for n in r.model.graph.node if n.op_type == "Split")
    assert attrs(split)["axis"] == 1
    check_same(m, r.model, library=False)


def test_unnamed_nodes(tmp_path, monkeypatch):
    """Exporters may leave node names empty: the pass must not key nodes by name (it once
    put Concat's axis on a Conv and read the wrong readers; found by
    tests/test_properties.py::test_random_cnns_keep_their_results_channels_last)."""
    m = c2f()
    for n in m.graph.node:
        n.name = ""
    r = nhwc_model(m, tmp_path, monkeypatch)
    assert [n.op_type for n in r.model.graph.node] == ["Transpose", "FusedConv", "Split", "FusedConv", "Concat",
                                                       "FusedConv"]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_analyze_sees_the_same_work_in_either_layout(tmp_path, monkeypatch):
    """onnxfuse analyze costs a channels-last node like its NCHW twin: the Transposes its
    function body has for the NHWC storage are not work of the original model."""
    from onnxfuse.analyze import analyze

    m = vgg_stack(blocks=2, channels=32, size=32)
    costs = {}
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    for layout in ("nchw", "nhwc"):
        r = optimize_model(m, layout=layout)
        compile_pass(r, kernel_options("sm_90", layout=layout))
        onnx.save(r.model, str(tmp_path / f"{layout}.onnx"))
        a = analyze(str(tmp_path / f"{layout}.onnx"), "h200", batch=8)
        costs[layout] = ([(row.cost.flops, row.cost.bytes) for row in a.rows], a.unfused_totals.bytes,
                         [(g.chain, g.round_trips_before, g.bytes_before) for g in a.groups])
    assert any(attrs(n).get("x_layout") == b"NHWC" for n in onnx.load(str(tmp_path / "nhwc.onnx")).graph.node)
    assert costs["nhwc"] == costs["nchw"]


def test_unfusing_channels_last_nodes_keeps_the_results(tmp_path, monkeypatch):
    """What happens to a node whose kernel fails to compile, or that --tune finds slower: its
    function body (layout Transposes, [K, R, S, C] weights unpacked) replaces it."""
    from onnxfuse.rewrite import unfuse

    m = c2f()
    r = nhwc_model(m, tmp_path, monkeypatch)
    for f in list(r.fused)[::2]:  # the first and the last conv
        unfuse(r.model, f)
    onnx.checker.check_model(r.model, full_check=True)
    ops = [n.op_type for n in r.model.graph.node]
    assert ops.count("FusedConv") == 1 and ops.count("Conv") == 2
    # the unfused convs read ONNX weights again (initializers, no Transpose of packed ones)
    convs = [n for n in r.model.graph.node if n.op_type == "Conv"]
    inits = {t.name: tuple(t.dims) for t in r.model.graph.initializer}
    assert [inits[c.input[1]] for c in convs] == [(32, 16, 1, 1), (16, 48, 1, 1)]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_boundary_transpose_names_avoid_the_names_of_subgraphs(tmp_path, monkeypatch):
    """The NHWC copy of a boundary tensor gets a name no subgraph uses either: an If branch
    that computes its own `x_nhwc` would otherwise make the model break SSA (invalid ONNX)."""
    m = residual(c=16)

    def branch(name: str) -> onnx.GraphProto:
        return helper.make_graph([N("Neg", ["x"], ["x_nhwc"]), N("Identity", ["x_nhwc"], [f"o_{name}"])], name, [],
                                 [helper.make_tensor_value_info(f"o_{name}", onnx.TensorProto.FLOAT, ["N", 16, 9, 9])])

    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    m.graph.node.append(N("If", ["cond"], ["z"], then_branch=branch("then"), else_branch=branch("else"), name="if"))
    m.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["N", 16, 9, 9]))
    onnx.checker.check_model(m, full_check=True)
    r = nhwc_model(m, tmp_path, monkeypatch)
    transpose = next(n for n in r.model.graph.node if n.op_type == "Transpose")  # (the If may come first)
    assert transpose.op_type == "Transpose" and transpose.output[0] != "x_nhwc"
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_the_report_counts_the_boundary_transposes(tmp_path, monkeypatch):
    """The report's node count after optimizing is the written model's: the NHWC pass (in the
    compile step, after fusion) adds a Transpose where a conv reads an NCHW tensor."""
    r = nhwc_model(c2f(), tmp_path, monkeypatch)
    assert [n.op_type for n in r.model.graph.node].count("Transpose") == 1
    assert r.report.nodes_after == len(r.model.graph.node) == 6
    assert r.report.summary().startswith("nodes: 8 -> 6")


def test_cli_auto_layout_is_nchw_when_no_kernels_are_compiled(tmp_path, monkeypatch):
    """--layout auto means nhwc only when kernels are compiled: without Triton the compile
    step (and with it the NHWC pass) does not run, so neither a Conv alone nor a MaxPool
    alone is fused (patterns conv_alone and maxpool are for the GPU path only; the library's
    CPU conv and max pool are slower than ORT's)."""
    monkeypatch.setattr("onnxfuse.kernels.triton_available", lambda: False)
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((8, 16, 1, 1)) / 4).astype(np.float32), "w")
    m = image_model([N("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"),
                     N("Conv", ["p", "w"], ["y"], kernel_shape=[1, 1], name="conv")], "lone", 16, 9, [("y", 8)], [w])
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(m, str(src))
    assert main(["optimize", str(src), str(dst)]) == 0
    assert [n.op_type for n in onnx.load(str(dst)).graph.node] == ["MaxPool", "Conv"]


def test_cli_explicit_nhwc_needs_triton(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("onnxfuse.kernels.triton_available", lambda: False)
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(residual(), str(src))
    assert main(["optimize", str(src), str(dst), "--layout", "nhwc"]) == 2
    assert "needs Triton" in capsys.readouterr().err and not dst.exists()


def test_the_models_own_functions_stay(tmp_path, monkeypatch):
    """The pass drops only the functions of the nodes it renamed: a model-local function
    called only from another function (or a subgraph) stays, or the model would not load."""
    m = residual()
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    inner = helper.make_function("local", "Inner", ["a"], ["b"], [N("Neg", ["a"], ["b"])], opsets[:1])
    outer = helper.make_function("local", "Outer", ["a"], ["b"],
                                 [N("Inner", ["a"], ["t"], domain="local"), N("Abs", ["t"], ["b"])], opsets)
    m.functions.extend([inner, outer])
    m.opset_import.append(opsets[1])
    m.graph.node.append(N("Outer", ["x"], ["z"], domain="local", name="outer"))
    m.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["N", 8, 9, 9]))
    r = nhwc_model(m, tmp_path, monkeypatch)
    names = [f.name for f in r.model.functions]
    assert names.count("FusedConv") == 2 and {"Inner", "Outer"} <= set(names)
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def inverted_residual(c: int = 8, e: int = 24, size: int = 9, group: int | None = None) -> onnx.ModelProto:
    """MobileNet's block: 1x1 expand + HardSwish -> 3x3 depthwise (or `group`) + Relu -> 1x1
    project, + x."""
    rng = np.random.default_rng(2)
    g = group or e
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32), n)
             for n, s in (("w1", (e, c, 1, 1)), ("w2", (e, e // g, 3, 3)), ("w3", (c, e, 1, 1)))]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1], name="expand"),
             N("HardSwish", ["c1"], ["h1"], name="hswish"),
             N("Conv", ["h1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=g, name="dw"),
             N("Relu", ["c2"], ["r2"], name="relu"),
             N("Conv", ["r2", "w3"], ["c3"], kernel_shape=[1, 1], name="project"),
             N("Add", ["c3", "x"], ["y"], name="add")]
    return image_model(nodes, "inverted_residual", c, size, [("y", c)], inits)


def test_depthwise_convs_run_channels_last_between_fused_convs(tmp_path, monkeypatch):
    m = inverted_residual()
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    nodes = list(r.model.graph.node)
    assert [n.op_type for n in nodes] == ["FusedConv"] * 3  # no Transposes
    got = [(attrs(n).get("x_layout", b"NCHW"), attrs(n).get("y_layout", b"NCHW")) for n in nodes]
    assert got == [(b"NCHW", b"NHWC"), (b"NHWC", b"NHWC"), (b"NHWC", b"NCHW")]
    assert attrs(nodes[1])["group"] == 24 and attrs(nodes[1])["w_layout"] == b"KRSC"
    inits = {t.name: tuple(t.dims) for t in r.model.graph.initializer}
    assert inits[nodes[1].input[1]] == (24, 3, 3, 1)  # [K, R, S, C/group]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_a_depthwise_conv_reads_an_nchw_input_without_a_transpose(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((32, 1, 3, 3)) / 3).astype(np.float32), "w")
    m = image_model([N("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=32),
                     N("Relu", ["c"], ["y"])], "dw", 32, 7, [("y", 32)], [w])
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    assert [n.op_type for n in r.model.graph.node] == ["FusedConv"]
    check_same(m, r.model, library=True)


def test_wide_groups_are_left_to_cudnn(tmp_path, monkeypatch):
    from onnxfuse.kinds.conv import GROUPED_REASON

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m = inverted_residual(c=8, e=32, group=2)  # 16 channels per group
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert [d["reason"] for d in info["declined"]] == [GROUPED_REASON]
    assert r.report.not_fused[GROUPED_REASON] == 2  # the Conv and its Relu
    assert [n.op_type for n in r.model.graph.node].count("Conv") == 1
    check_same(m, r.model, library=True)


# ---------------------------------------------------------------------------------------
# FusedMaxPool in the NHWC plan
# ---------------------------------------------------------------------------------------


def pool_model(nodes, name: str, c: int, size: int, out: tuple[str, list], weights: dict) -> onnx.ModelProto:
    """Opset 17, IR 10: input x [N, c, size, size], one output `out` = (name, dims after N);
    weights: name -> (K, C, R) random conv weights [K, C, R, R]."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((k, ci, r, r)) / (r * ci ** 0.5)).astype(np.float32), w)
             for w, (k, ci, r) in weights.items()]
    g = helper.make_graph(nodes, name,
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info(out[0], onnx.TensorProto.FLOAT, ["N", *out[1]])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def nhwc_pools_model(m: onnx.ModelProto, tmp_path, monkeypatch):
    """`m` optimized for the GPU path: the NHWC-only patterns (a lone MaxPool) too."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    return r


def resnet_stem(pool_out: bool = False) -> onnx.ModelProto:
    """conv1 3->16 3x3 s2 + Relu -> MaxPool 3x3 s2 p1 -> conv2 16->16 3x3 + Relu (ResNet's
    stem, smaller); with pool_out the pool's output is the graph output instead."""
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),
             N("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="pool")]
    if pool_out:
        return pool_model(nodes, "stem_pool_out", 3, 17, ("p", [16, 5, 5]), {"w1": (16, 3, 3)})
    nodes += [N("Conv", ["p", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
              N("Relu", ["c2"], ["y"], name="relu2")]
    return pool_model(nodes, "stem", 3, 17, ("y", [16, 5, 5]), {"w1": (16, 3, 3), "w2": (16, 16, 3)})


def sppf() -> onnx.ModelProto:
    """YOLOv8's SPPF: conv1 -> three chained MaxPool 5x5 s1 p2 -> Concat(conv1, p1, p2, p3)
    -> conv2."""
    pool = dict(kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2])
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),
             N("MaxPool", ["r1"], ["p1"], name="pool1", **pool),
             N("MaxPool", ["p1"], ["p2"], name="pool2", **pool),
             N("MaxPool", ["p2"], ["p3"], name="pool3", **pool),
             N("Concat", ["r1", "p1", "p2", "p3"], ["cat"], axis=1, name="concat"),
             N("Conv", ["cat", "w2"], ["c2"], kernel_shape=[1, 1], name="conv2"),
             N("Relu", ["c2"], ["y"], name="relu2")]
    return pool_model(nodes, "sppf", 8, 9, ("y", [16, 9, 9]), {"w1": (16, 8, 1), "w2": (16, 64, 1)})


def layouts(node) -> tuple[bytes, bytes]:
    return attrs(node).get("x_layout", b"NCHW"), attrs(node).get("y_layout", b"NCHW")


def test_resnet_stem_pool_runs_channels_last_without_transposes(tmp_path, monkeypatch):
    m = resnet_stem()
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    nodes = list(r.model.graph.node)
    assert [n.op_type for n in nodes] == ["FusedConv", "FusedMaxPool", "FusedConv"]
    assert [layouts(n) for n in nodes] == [(b"NCHW", b"NHWC"), (b"NHWC", b"NHWC"), (b"NHWC", b"NCHW")]
    pool = nodes[1]
    assert pool.overload.endswith("_nhwc_nhwc") and r.fused[1].x_layout == "nhwc" == r.fused[1].y_layout
    meta = json.loads(attrs_all(pool)["kernel_meta"])
    assert (meta["x_layout"], meta["y_layout"]) == ("nhwc", "nhwc") and "block_p" in meta["variants"][0]
    body = next(f for f in r.model.functions if f.overload == pool.overload)
    assert [n.op_type for n in body.node] == ["Transpose", "MaxPool", "Transpose"]
    shapes = value_shapes(r.model)
    assert shapes["p"] == ["N", 5, 5, 16]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_sppf_pools_and_concat_run_channels_last_without_transposes(tmp_path, monkeypatch):
    m = sppf()
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    nodes = list(r.model.graph.node)
    assert [n.op_type for n in nodes] == ["FusedConv"] + ["FusedMaxPool"] * 3 + ["Concat", "FusedConv"]
    assert [layouts(n) for n in nodes if n.domain == "onnxfuse"] == [
        (b"NCHW", b"NHWC"), *[(b"NHWC", b"NHWC")] * 3, (b"NHWC", b"NCHW")]
    assert attrs(nodes[4])["axis"] == 3
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_a_pool_whose_output_is_a_graph_output_stays_nchw(tmp_path, monkeypatch):
    m = resnet_stem(pool_out=True)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    nodes = list(r.model.graph.node)
    assert [n.op_type for n in nodes] == ["FusedConv", "FusedMaxPool"]
    assert [layouts(n) for n in nodes] == [(b"NCHW", b"NCHW")] * 2
    check_same(m, r.model, library=True)


def test_a_pool_with_a_prologue_joins_the_plan(tmp_path, monkeypatch):
    """conv1 -> c1, read by Add(per-channel constant) -> Relu -> MaxPool -> conv2 and by
    conv3 (so neither conv absorbs the pointwise ops: they are the pool's prologue), then
    conv2 + conv3. The pool's X and Y turn NHWC, its extra (the [1, C, 1, 1] constant) stays
    as is."""
    pool = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="conv1"),
             N("Add", ["c1", "bias"], ["a"], name="add"),
             N("Relu", ["a"], ["r"], name="relu"),
             N("MaxPool", ["r"], ["p"], name="pool", **pool),
             N("Conv", ["p", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Conv", ["c1", "w3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], name="conv3"),
             N("Add", ["c2", "c3"], ["y"], name="sum")]
    m = pool_model(nodes, "stem_prologue", 3, 17, ("y", [16, 5, 5]),
                   {"w1": (16, 3, 3), "w2": (16, 16, 3), "w3": (16, 16, 3)})
    m.graph.initializer.append(
        numpy_helper.from_array(np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16, 1, 1), "bias"))
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    assert "Transpose" not in [n.op_type for n in r.model.graph.node]
    (pool,) = [n for n in r.model.graph.node if n.op_type == "FusedMaxPool"]
    assert layouts(pool) == (b"NHWC", b"NHWC") and len(pool.input) == 2 and pool.input[1] == "bias"
    assert "%1" in attrs(pool)["program"].decode()
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


# ---------------------------------------------------------------------------------------
# layout-free nodes: elementwise ops, global pools, Resize
# ---------------------------------------------------------------------------------------


def squeeze_excite(opset: int = 17) -> onnx.ModelProto:
    """MobileNetV3's squeeze-excite between a depthwise conv and the project conv:
    dw + Relu = r; GlobalAveragePool(r) -> 1x1 + Relu -> 1x1 + HardSigmoid = s; r * s ->
    project 1x1; then a PointwiseChain (Sigmoid, Mul with a scalar) feeding the last conv."""
    rng = np.random.default_rng(7)
    c, e = 8, 16
    inits = [numpy_helper.from_array((rng.standard_normal(sh) / np.sqrt(np.prod(sh[1:]))).astype(np.float32), n)
             for n, sh in (("w1", (e, c, 1, 1)), ("w2", (e, 1, 3, 3)), ("w3", (4, e, 1, 1)), ("w4", (e, 4, 1, 1)),
                           ("w5", (c, e, 1, 1)), ("w6", (c, c, 3, 3)))]
    inits.append(numpy_helper.from_array(np.array(1.5, np.float32), "half3"))
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1], name="expand"),
             N("HardSwish", ["c1"], ["h1"], name="hswish"),
             N("Conv", ["h1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=e, name="dw"),
             N("Relu", ["c2"], ["r"], name="relu"),
             N("GlobalAveragePool", ["r"], ["g"], name="gap"),
             N("Conv", ["g", "w3"], ["s1"], kernel_shape=[1, 1], name="se1"),
             N("Relu", ["s1"], ["s2"], name="se_relu"),
             N("Conv", ["s2", "w4"], ["s3"], kernel_shape=[1, 1], name="se2"),
             N("HardSigmoid", ["s3"], ["s"], alpha=1 / 6, name="se_hsig"),
             N("Mul", ["r", "s"], ["se"], name="se_mul"),
             N("Conv", ["se", "w5"], ["p"], kernel_shape=[1, 1], name="project"),
             N("Conv", ["p", "w6"], ["q"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="last_conv_in"),
             N("Shape", ["q"], ["q_shape"], name="shape_of_q"),  # q stays NCHW: a Shape reads it
             N("Sigmoid", ["q"], ["t1"], name="sig"),
             N("Mul", ["t1", "half3"], ["t2"], name="mul_scalar"),
             N("Add", ["t2", "p"], ["y"], name="add_p")]
    g = helper.make_graph(nodes, "squeeze_excite",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, 9, 9])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", c, 9, 9]),
                           helper.make_tensor_value_info("q_shape", onnx.TensorProto.INT64, [4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_squeeze_excite_runs_channels_last(dtype, tmp_path, monkeypatch):
    m = squeeze_excite()
    if dtype == "float16":
        m = to_fp16(m)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    ops = [n.op_type for n in r.model.graph.node]
    assert "Transpose" not in ops and "GlobalAveragePool" not in ops
    # the average over H, W of the NHWC tensor: Reshape [N, 81, 16], MatMul by a row of 1/81
    (mean,) = [n for n in r.model.graph.node if n.op_type == "MatMul"]
    inits = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    row = inits[mean.input[0]]
    assert row.shape == (1, 81) and row.dtype == np.dtype(dtype) and np.allclose(row, 1 / 81, rtol=1e-3)
    by_name = {n.name: n for n in r.model.graph.node}
    got = {name: layouts(by_name[name]) for name in ("conv_grouped_dw", "conv_relu_se1", "conv_relu_se2")}
    assert got == {name: (b"NHWC", b"NHWC") for name in got}
    shapes = value_shapes(r.model)
    assert shapes["g"] == ["N", 1, 1, 16] and shapes["se"] == ["N", 9, 9, 16]
    # p is read by an Add with q's PointwiseChain, whose input q a Shape reads: that
    # component stays NCHW, and so the project conv writes NCHW
    assert layouts(next(n for n in r.model.graph.node if n.op_type == "FusedConv" and n.output[0] == "p")) == \
        (b"NHWC", b"NCHW")
    if dtype == "float32":
        check_same(m, r.model, library=False)
        check_same(m, r.model, library=True)
    else:
        feeds = random_feeds(m, {"N": 2}, seed=5)
        for e, a in zip(run(m, feeds, False), run(r.model, feeds, True), strict=True):
            np.testing.assert_allclose(a.astype(np.float32), e.astype(np.float32), rtol=1e-2,
                                       atol=1e-2 * float(np.abs(e.astype(np.float32)).max()))


def test_large_global_pool_splits_its_matmul(tmp_path, monkeypatch):
    """Above layout.SPLIT_AVERAGE_MIN_PIXELS the average is two MatMuls (cuBLAS's GEMV over
    H·W rows parallel over C only is slow): 81 pixels as 9 slices of 9, a row of 1/81 over
    each slice, then a row of nine ones; the outputs stay the original's."""
    monkeypatch.setattr(layout_pass, "SPLIT_AVERAGE_MIN_PIXELS", 64)
    m = squeeze_excite()
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    inits = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    partial, mean = [n for n in r.model.graph.node if n.op_type == "MatMul"]
    assert inits[partial.input[0]].shape == (1, 9) and np.allclose(inits[partial.input[0]], 1 / 81)
    assert inits[mean.input[0]].shape == (1, 9) and np.all(inits[mean.input[0]] == 1)
    assert "GlobalAveragePool" not in [n.op_type for n in r.model.graph.node]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_exact_conv_precisions_keep_the_global_pool(tmp_path, monkeypatch):
    """ONNX Runtime's CUDA EP would run the channels-last pool's MatMul in TF32: with
    --conv-precision ieee (through the compile hook) or tf32x3 the pool stays a
    GlobalAveragePool of the NCHW tensor, whose result enters the channels-last SE conv
    through a Reshape; with tf32 it is the MatMul."""
    from onnxfuse.layout import apply_layouts

    m = squeeze_excite()
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc", conv_precision="ieee")).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    ops = [n.op_type for n in r.model.graph.node]
    assert "GlobalAveragePool" in ops and "MatMul" not in ops
    by_name = {n.name: n for n in r.model.graph.node}
    assert layouts(by_name["conv_grouped_dw"]) == (b"NHWC", b"NCHW")  # the pool reads NCHW
    (boundary,) = [n for n in r.model.graph.node if n.input and n.input[0] == "g"]
    assert boundary.op_type == "Reshape" and layouts(by_name["conv_relu_se1"])[0] == b"NHWC"
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)
    # the pass alone (no kernels): tf32x3 keeps the pool too, tf32 makes it the MatMul
    for precision, pooled, gone in (("tf32x3", "GlobalAveragePool", "MatMul"), ("tf32", "MatMul", "GlobalAveragePool")):
        r = optimize_model(m, layout="nhwc")
        r.fused = apply_layouts(r.model, r.fused, r.shapes, conv_precision=precision)
        ops = [n.op_type for n in r.model.graph.node]
        assert pooled in ops and gone not in ops
        check_same(m, r.model, library=False)


def test_a_global_pool_of_unknown_size_keeps_its_input_nchw(tmp_path, monkeypatch):
    m = squeeze_excite()
    del m.graph.value_info[:]
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"  # H unknown: no MatMul row
    m = onnx.shape_inference.infer_shapes(m)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    ops = [n.op_type for n in r.model.graph.node]
    assert "GlobalAveragePool" in ops and "MatMul" not in ops
    by_name = {n.name: n for n in r.model.graph.node}
    assert layouts(by_name["conv_grouped_dw"]) == (b"NHWC", b"NCHW")
    feeds = random_feeds(m, {"N": 2, "H": 9}, seed=5)
    for e, a in zip(run(m, feeds, False), run(r.model, feeds, True), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


def to_fp16(m: onnx.ModelProto) -> onnx.ModelProto:
    """The float32 model with float16 inputs, outputs, weights and value_infos."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for vi in [*out.graph.input, *out.graph.output, *out.graph.value_info]:
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    for t in out.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    return out


def test_a_pointwise_chain_between_convs_runs_channels_last(tmp_path, monkeypatch):
    """conv1 -> Shape-free chain (Sigmoid, Mul by a scalar, Add of conv2's output) -> conv3:
    the PointwiseChain node carries the layout; its kernel reads any layout alike."""
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32), f"w{i}")
             for i in (1, 2, 3)]
    inits.append(numpy_helper.from_array(np.full((1, 1, 1, 1), 0.5, np.float32), "half"))
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
             N("Conv", ["x", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Concat", ["c1", "c2"], ["both"], axis=1, name="cat"),  # c1, c2 are also read below
             N("Sigmoid", ["c1"], ["t1"], name="sig"),
             N("Mul", ["t1", "half"], ["t2"], name="mul"),
             N("Sub", ["t2", "c2"], ["t3"], name="sub"),
             N("Conv", ["t3", "w3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv3"),
             N("ReduceSum", ["both"], ["y2"], keepdims=1, name="sum_both")]
    m = image_model(nodes, "chain", 16, 7, [("c3", 16)], inits)
    m.graph.output.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [1, 1, 1, 1]))
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    chains = [n for n in r.model.graph.node if n.op_type == "PointwiseChain"]
    assert len(chains) == 1
    # cat is read by a ReduceSum: c1, c2 (joined to it) stay NCHW, and the chain with them
    assert "Transpose" in [n.op_type for n in r.model.graph.node]
    check_same(m, r.model, library=True)
    m.graph.node.remove(next(n for n in m.graph.node if n.name == "sum_both"))
    m.graph.node.remove(next(n for n in m.graph.node if n.name == "cat"))
    del m.graph.output[1:]
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    ops = [n.op_type for n in r.model.graph.node]
    assert ops.count("Transpose") == 1  # x, into conv1 and conv2 (16 channels)
    assert all(layouts(n)[1] == b"NHWC" for n in r.model.graph.node if n.name in ("conv1", "conv2")
               or n.op_type == "FusedConv" and n.output[0] in ("c1", "c2"))
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_resize_with_constant_scales_runs_channels_last(tmp_path, monkeypatch):
    """YOLO's neck: conv -> Resize x2 (nearest) -> Concat with another conv's output -> conv."""
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array((rng.standard_normal(sh) / np.sqrt(np.prod(sh[1:]))).astype(np.float32), n)
             for n, sh in (("w1", (8, 8, 3, 3)), ("w2", (8, 8, 1, 1)), ("w3", (8, 16, 3, 3)))]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="down"),
             N("Resize", ["c1", "", "scales"], ["up"], mode="nearest", name="resize"),
             N("Conv", ["x", "w2"], ["c2"], kernel_shape=[1, 1], name="side"),
             N("Concat", ["up", "c2"], ["cat"], axis=1, name="cat"),
             N("Conv", ["cat", "w3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="fuse"),
             N("Relu", ["c3"], ["y"], name="relu")]
    m = image_model(nodes, "neck", 8, 10, [("y", 8)], inits)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    assert "Transpose" not in [n.op_type for n in r.model.graph.node]
    (resize,) = [n for n in r.model.graph.node if n.op_type == "Resize"]
    inits_after = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    assert inits_after[resize.input[2]].tolist() == [1, 2, 2, 1]
    # the original is never changed in place (other nodes may read it); the cleanup drops it
    # when none does, as here
    assert inits_after.get("scales", np.array([1, 1, 2, 2])).tolist() == [1, 1, 2, 2]
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def _neck(resize: list[onnx.NodeProto], inits: list, opset: int = 17) -> onnx.ModelProto:
    """conv down (stride 2) -> `resize` nodes producing "up" -> Concat with a side conv -> conv."""
    rng = np.random.default_rng(10)
    inits = inits + [numpy_helper.from_array((rng.standard_normal(sh) / np.sqrt(np.prod(sh[1:]))).astype(np.float32),
                                             n) for n, sh in (("w1", (8, 8, 3, 3)), ("w2", (8, 8, 1, 1)),
                                                              ("w3", (8, 16, 3, 3)))]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], name="down"),
             *resize,
             N("Conv", ["x", "w2"], ["c2"], kernel_shape=[1, 1], name="side"),
             N("Concat", ["up", "c2"], ["cat"], axis=1, name="cat"),
             N("Conv", ["cat", "w3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="fuse"),
             N("Relu", ["c3"], ["y"], name="relu")]
    m = image_model(nodes, "neck", 8, 10, [("y", 8)], inits)
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("", opset))
    return m


@pytest.mark.parametrize("case", ["sizes", "constant_node_scales", "opset10", "roi"])
def test_resize_forms(case, tmp_path, monkeypatch):
    """Resize carries the layout with constant scales or sizes (an initializer or a Constant
    node; permuted into a new initializer), not in opset 10 (X, scales only) or with a roi."""
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    if case == "sizes":
        sizes = numpy_helper.from_array(np.array([2, 8, 10, 10], np.int64), "sizes")
        m = _neck([N("Resize", ["c1", "", "", "sizes"], ["up"], mode="nearest", name="resize")], [sizes])
    elif case == "constant_node_scales":
        m = _neck([N("Constant", [], ["k"], value=scales, name="k"),
                   N("Resize", ["c1", "", "k"], ["up"], mode="nearest", name="resize")], [])
    elif case == "opset10":
        m = _neck([N("Resize", ["c1", "scales"], ["up"], mode="nearest", name="resize")], [scales], opset=10)
    else:
        roi = numpy_helper.from_array(np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32), "roi")
        m = _neck([N("Resize", ["c1", "roi", "scales"], ["up"], mode="nearest", name="resize",
                     coordinate_transformation_mode="tf_crop_and_resize")], [roi, scales])
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    transposes = [n for n in r.model.graph.node if n.op_type == "Transpose"]
    carried = case in ("sizes", "constant_node_scales")
    assert (not transposes) == carried
    if carried:
        (resize,) = [n for n in r.model.graph.node if n.op_type == "Resize"]
        k = 3 if case == "sizes" else 2
        value = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}[resize.input[k]]
        assert value.tolist() == ([2, 10, 10, 8] if case == "sizes" else [1, 2, 2, 1])
    feeds = random_feeds(m, {"N": 2}, seed=5)
    for library in (False, True):
        for e, a in zip(run(m, feeds, False), run(r.model, feeds, library), strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


@pytest.mark.parametrize("case", ["channel_constant", "chain_output_is_graph_output"])
def test_elementwise_nodes_that_keep_their_component_nchw(case, tmp_path, monkeypatch):
    """A Mul by a [1, C, 1, 1] constant (not a scalar: it would need permuting) and a
    PointwiseChain one of whose outputs is a graph output keep the tensors they join NCHW."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32), f"w{i}")
             for i in (1, 2)]
    inits.append(numpy_helper.from_array(rng.standard_normal((1, 16, 1, 1)).astype(np.float32), "scale"))
    if case == "channel_constant":
        mid = [N("Mul", ["c1", "scale"], ["t"], name="mul")]
        outs = [("y", 16)]
    else:
        mid = [N("Sigmoid", ["c1"], ["s"], name="sig"), N("Mul", ["s", "c1"], ["t"], name="mul"),
               N("Neg", ["s"], ["z"], name="neg")]
        outs = [("y", 16), ("z", 16)]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
             N("Relu", ["c1"], ["r1"], name="relu1"),  # c1 is also read below: not in conv1's epilogue
             *mid,
             N("Conv", ["t", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Add", ["c2", "r1"], ["y"], name="add")]
    m = image_model(nodes, "keep_nchw", 16, 7, outs, inits)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    (conv1,) = [n for n in r.model.graph.node if n.op_type == "FusedConv" and "c1" in n.output]
    assert layouts(conv1)[1] == b"NCHW"
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


@pytest.mark.parametrize("which", ["pool", "depthwise"])
def test_unfusing_channels_last_pools_and_depthwise_convs_keeps_the_results(which, tmp_path, monkeypatch):
    """A channels-last FusedMaxPool or depthwise FusedConv turned back into its function
    body (Transposes around the NCHW original) computes the same."""
    from onnxfuse.rewrite import unfuse

    m = sppf() if which == "pool" else inverted_residual()
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    kind = "maxpool" if which == "pool" else "conv"
    victims = [f for f in r.fused if f.kind == kind and (which == "pool" or f.conv.group > 1)]
    assert victims and all(f.x_layout == "nhwc" for f in victims)
    unfuse(r.model, victims[0])
    onnx.checker.check_model(r.model, full_check=True)
    ops = [n.op_type for n in r.model.graph.node]
    assert ("MaxPool" if which == "pool" else "Conv") in ops and "Transpose" in ops
    check_same(m, r.model, library=False)
    check_same(m, r.model, library=True)


def test_a_pooled_vector_enters_channels_last_through_a_reshape(tmp_path, monkeypatch):
    """A GlobalAveragePool of unknown H (it stays NCHW) feeding a channels-last 1x1 conv: its
    [N, C, 1, 1] output has the same bytes in either layout, so the boundary is a Reshape to
    [N, 1, 1, C], not a Transpose."""
    m = squeeze_excite()
    del m.graph.value_info[:]
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    m = onnx.shape_inference.infer_shapes(m)
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    by_name = {n.name: n for n in r.model.graph.node}
    (boundary,) = [n for n in r.model.graph.node if n.input and n.input[0] == "g"]
    assert boundary.op_type == "Reshape" and layouts(by_name["conv_relu_se1"])[0] == b"NHWC"
    shape = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}[boundary.input[1]]
    assert shape.tolist() == [0, 1, 1, -1]
    feeds = random_feeds(m, {"N": 2, "H": 9}, seed=6)
    for library in (False, True):
        for e, a in zip(run(m, feeds, False), run(r.model, feeds, library), strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


def test_the_pass_uses_the_shapes_inferred_while_optimizing(tmp_path, monkeypatch):
    """A model without value_info (PP-OCR's export has none): the optimizer's inferred shapes
    still let the pass rewrite the squeeze-excite's pool for channels-last."""
    m = squeeze_excite()
    del m.graph.value_info[:]
    r = nhwc_pools_model(m, tmp_path, monkeypatch)
    assert "g" in r.shapes and r.shapes["g"][0][1:] == (16, 1, 1)
    ops = [n.op_type for n in r.model.graph.node]
    assert "MatMul" in ops and "GlobalAveragePool" not in ops and "Transpose" not in ops
    check_same(m, r.model, library=True)


def test_a_chain_reading_a_rotated_transposed_or_partial_input_does_not_carry_nhwc():
    """A PointwiseChain with `rotate_half` rotates along the last axis: on a channels-last
    tensor that axis is another one, so the NHWC pass must not pass the layout through it."""
    plain = helper.make_node("PointwiseChain", ["a", "b"], ["y"], domain="onnxfuse", program="")
    rotated = helper.make_node("PointwiseChain", ["a", "b"], ["y"], domain="onnxfuse", program="", rotate_half=[0, 1])
    args = (lambda t: None, 17, lambda t: None)
    assert layout_pass._layout_free_inputs(plain, *args) == [0, 1]
    assert layout_pass._layout_free_inputs(rotated, *args) is None
    # one reading an input through a permutation (`transpose`) reads other elements of a permuted tensor
    permuted = helper.make_node("PointwiseChain", ["a", "b"], ["y"], domain="onnxfuse", program="",
                                transpose=[0, 2, 1, 3, 0, 1, 2, 3])
    assert layout_pass._layout_free_inputs(permuted, *args) is None
    # one computing only the first columns (`partial`) would compute others of a permuted tensor
    partial = helper.make_node("PointwiseChain", ["a", "b"], ["y"], domain="onnxfuse", program="", partial=[4, 0])
    assert layout_pass._layout_free_inputs(partial, *args) is None
