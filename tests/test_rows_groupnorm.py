"""GroupNorm in the rows kind (FusedRows, reduction group_norm): the forms recognized (torch's
TorchScript export of nn.GroupNorm at opsets 13 to 21, the GroupNormalization op of opsets
18 and 21), with their prologue (residual / time-embedding adds) and epilogue (gamma, beta,
SiLU); the optimized models against the originals on ONNX Runtime CPU (function bodies) and
with the custom-op library's CPU kernel, in fp32 and fp16 at magnitude 1e4; the reasons
given when a GroupNorm does not fuse; `analyze`'s costs.

torch's dynamo exporter where onnxscript is installed (the test extras install it). The
kernels themselves are tests/test_rows_groupnorm_codegen.py's."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds.rows import GN_RESHAPE, Rows
from tests.util import check_fusion, op_types, run

ort = pytest.importorskip("onnxruntime")
F, H = TensorProto.FLOAT, TensorProto.FLOAT16


@pytest.fixture(scope="module")
def lib() -> str:
    from onnxfuse import runtime

    return runtime.library_path()


def run_lib(lib: str, m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    assert got.shape == want.shape, what
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.abs(w).max(initial=1.0))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=what)


def torch_group_norm(opset: int, dynamic: bool = False, shape=(2, 16, 5, 6), groups: int = 4,
                     dynamo: bool = False) -> onnx.ModelProto:
    """nn.GroupNorm with a residual add before it and SiLU after it, as torch.onnx.export
    (TorchScript) writes it: Reshape -> InstanceNormalization -> Reshape(Shape(x)) -> Mul -> Add;
    `dynamo`: as the dynamo exporter writes it (static shapes)."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.GroupNorm(groups, shape[1])
            with torch.no_grad():
                self.norm.weight.copy_(torch.randn(shape[1]))
                self.norm.bias.copy_(torch.randn(shape[1]))

        def forward(self, x, r):
            return torch.nn.functional.silu(self.norm(x + r))

    torch.manual_seed(0)
    f = io.BytesIO()
    axes = {"x": {0: "N", 2: "H", 3: "W"}, "r": {0: "N", 2: "H", 3: "W"}} if dynamic else None
    if dynamo:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(Block(), (torch.randn(shape), torch.randn(shape)), dynamo=True,
                                     opset_version=opset, input_names=["x", "r"], output_names=["y"])
        return prog.model_proto
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Block(), (torch.randn(shape), torch.randn(shape)), f, opset_version=opset, dynamo=False,
                          input_names=["x", "r"], output_names=["y"], dynamic_axes=axes)
    return onnx.load_from_string(f.getvalue())


def _feeds(shape, scale=1.0, dtype=np.float32, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(shape) * scale + 0.5).astype(dtype) for k in ("x", "r")}


@pytest.mark.parametrize("opset", [18, 21])
def test_dynamo_export_fuses_whole(lib, opset):
    """The dynamo exporter's GroupNorm + SiLU after a residual add: one node too, equal to the
    original through the library's kernel."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    m = torch_group_norm(opset, dynamo=True)
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    feeds = _feeds((2, 16, 5, 6))
    _close(run_lib(lib, r.model, feeds)[0], run(m, feeds)[0], 1e-5, "dynamo export: library kernel")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_torch_export_fuses_whole(lib, opset, dynamic):
    """The residual Add, the GroupNorm (5 nodes with Shape), gamma, beta and SiLU: one node,
    equal to the original on ONNX Runtime as a function body and as the library's kernel."""
    m = torch_group_norm(opset, dynamic)
    assert "InstanceNormalization" in op_types(m)
    feeds = _feeds((2, 16, 5, 6))
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    node = r.model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["reduction"], attrs["groups"], attrs["axis"]) == (b"group_norm", 4, 1)
    assert {f.name for f in r.model.functions} == {"FusedRows"}  # the original subgraph kept
    (want,) = run(m, feeds)
    (got,) = run_lib(lib, r.model, feeds)
    _close(got, want, 1e-5, "library kernel against the original")
    if dynamic:  # another batch and image size, same model
        feeds = _feeds((3, 16, 7, 4), seed=1)
        _close(run_lib(lib, r.model, feeds)[0], run(m, feeds)[0], 1e-5, "other shape")


def _gn_op(opset: int, scale_len: int, dtype=F, c=12, groups=3, shape=(2, 12, 4, 5), scale_input=False,
           bias_value=None):
    """GroupNormalization(x + t) -> SiLU at `opset`; scale / bias of `scale_len` values."""
    rng = np.random.default_rng(4)
    np_dt = np.float32 if dtype == F else np.float16
    s = (rng.standard_normal(scale_len) + 1).astype(np_dt)
    b = rng.standard_normal(scale_len).astype(np_dt) if bias_value is None else np.full(scale_len, bias_value, np_dt)
    nodes = [helper.make_node("Add", ["x", "t"], ["h"]),
             helper.make_node("GroupNormalization", ["h", "s", "b"], ["n"], num_groups=groups, epsilon=1e-5),
             helper.make_node("Sigmoid", ["n"], ["sg"]), helper.make_node("Mul", ["n", "sg"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", dtype, list(shape)),
              helper.make_tensor_value_info("t", dtype, [shape[0], c, 1, 1])]
    inits = [numpy_helper.from_array(b, "b")]
    if scale_input:
        inputs.append(helper.make_tensor_value_info("s", dtype, [scale_len]))
    else:
        inits.append(numpy_helper.from_array(s, "s"))
    g = helper.make_graph(nodes, "gn", inputs, [helper.make_tensor_value_info("y", dtype, list(shape))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m, s, b


def _gn_feeds(shape=(2, 12, 4, 5), c=12, scale=1.0, dtype=np.float32) -> dict:
    rng = np.random.default_rng(9)
    return {"x": (rng.standard_normal(shape) * scale + scale / 3).astype(dtype),
            "t": rng.standard_normal((shape[0], c, 1, 1)).astype(dtype)}


@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_op(lib, opset):
    """Opset 18 scales per group (the spec's wart: its function body, which ONNX Runtime runs,
    reads scale[g] for every channel of group g), opset 21 per channel; both fuse with the
    prologue and SiLU, and match ONNX Runtime and a float64 reference of the op's meaning."""
    m, s, b = _gn_op(opset, 3 if opset == 18 else 12)
    feeds = _gn_feeds()
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    (want,) = run(m, feeds)
    (body,) = run(r.model, feeds)  # no library: the function body
    (got,) = run_lib(lib, r.model, feeds)
    h = (feeds["x"] + feeds["t"]).astype(np.float64).reshape(2, 3, -1)
    n = ((h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)).reshape(2, 12, 4, 5)
    per_channel = (lambda v: np.repeat(v, 4)) if opset == 18 else (lambda v: v)
    n = n * per_channel(s)[:, None, None] + per_channel(b)[:, None, None]
    ref = n / (1 + np.exp(-n))
    for what, out in (("ORT", want), ("function body", body), ("library", got)):
        _close(out, ref, 1e-5, what)
    if opset == 18:  # the node reads a per-channel copy; the body still the [G] original
        node = r.model.graph.node[0]
        assert any(i.endswith(".per_channel") for i in node.input)


def test_group_norm_op_alone_and_uniform_affine(lib):
    """A GroupNormalization with nothing around it fuses too (ONNX Runtime has no kernel of its
    own for it), and a bias of zeros folds away."""
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)]
    g = helper.make_graph(nodes, "gn", [helper.make_tensor_value_info("x", F, [1, 8, 3, 3])],
                          [helper.make_tensor_value_info("y", F, [1, 8, 3, 3])],
                          [numpy_helper.from_array(np.linspace(0.5, 2, 8).astype(np.float32), "s"),
                           numpy_helper.from_array(np.zeros(8, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    r = check_fusion(m, expect_fused=1)
    node = r.model.graph.node[0]
    assert list(node.input) == ["x", "s.per_channel"]  # [8, 1, 1]; the zeros bias folded away
    x = np.random.default_rng(2).standard_normal((1, 8, 3, 3)).astype(np.float32)
    _close(run_lib(lib, r.model, {"x": x})[0], run(m, {"x": x})[0], 1e-5, "library")


def test_fp16_large_magnitude(lib):
    """fp16 activations of magnitude 1e4 (squares overflow fp16): the fused node's statistics
    are fp32 (the CPU kernel's float64), so it matches a float64 reference to fp16 rounding."""
    m, s, b = _gn_op(21, 12, dtype=H)
    feeds = _gn_feeds(scale=1e4, dtype=np.float16)
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    (got,) = run_lib(lib, r.model, feeds)
    node = r.model.graph.node[0]
    values = {**feeds, **{t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}}
    (want,) = Rows().evaluate(node, [values[x] for x in node.input])
    assert np.isfinite(got).all()
    _close(got, want.astype(np.float16), 1e-2, "fp16 library against the float64 reference")
    h = (feeds["x"].astype(np.float64) + feeds["t"]).reshape(2, 3, -1)
    n = ((h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)).reshape(2, 12, 4, 5)
    n = n * s.astype(np.float64)[:, None, None] + b.astype(np.float64)[:, None, None]
    _close(got, (n / (1 + np.exp(-n))).astype(np.float16), 1e-2, "against float64")


def test_reasons_when_not_fused():
    """Opset 18's per-group scale as a graph input cannot be expanded per channel: reported."""
    m, _, _ = _gn_op(18, 3, scale_input=True)
    r = optimize_model(m)
    assert "FusedRows" not in op_types(r.model)
    assert any("per-group scale or bias" in k for k in r.report.not_fused), r.report.summary()
    # torch's form whose back-reshape is not to x's shape is not a GroupNorm (dynamic dims: with
    # static ones the other tensor's shape folds to x's, a constant, and it is one)
    m = torch_group_norm(17, dynamic=True)
    for n in m.graph.node:
        if n.op_type == "Shape":
            n.input[0] = "r"  # same shape, another tensor: not the GroupNorm's x
    r = optimize_model(m)
    assert any(GN_RESHAPE in k for k in r.report.not_fused), r.report.summary()


def test_analyze_costs_the_fused_node():
    """`analyze` counts a GroupNorm node's FLOPs from its function body and its bytes as one
    kernel's: x and the residual read once, gamma and beta, y written once."""
    from onnxfuse.cost import model_cost

    m = torch_group_norm(17, shape=(2, 16, 8, 8))
    r = optimize_model(m)
    before, after = model_cost(m), model_cost(r.model)
    (fused,) = [c for c in after.nodes if c.op_type == "FusedRows"]
    assert fused.ok and fused.flops == before.flops
    x_bytes = 2 * 16 * 8 * 8 * 4
    assert fused.bytes_read == 2 * x_bytes + 2 * 16 * 4 and fused.bytes_written == x_bytes
    assert after.bytes < before.bytes / 3


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_channels_last_cpu_kernel(lib, dtype):
    """The node contract's x_layout / y_layout NHWC (group_norm): x, the residual and y stored
    [N, H, W, C], gamma and beta [C, 1, 1] as in the graph. The library's CPU kernel on such a
    node equals the NCHW node's output transposed, and the numpy reference. (A residual of
    x's shape keeps the NHWC pass from laying the node out: built here from the NCHW one.)"""
    m = torch_group_norm(17, shape=(2, 16, 5, 6))
    if dtype == "f16":
        from tests.test_layout import to_fp16

        m = to_fp16(m)
    np_dt = np.float32 if dtype == "f32" else np.float16
    r = optimize_model(m)
    (node,) = r.model.graph.node
    feeds = {k: v.astype(np_dt) for k, v in _feeds((2, 16, 5, 6), scale=100.0 if dtype == "f16" else 1.0).items()}
    (want,) = run_lib(lib, r.model, feeds)
    cl = helper.make_node("FusedRows", list(node.input), list(node.output), domain="onnxfuse", x_layout="NHWC",
                          y_layout="NHWC")
    cl.attribute.extend(a for a in node.attribute)
    elem = F if dtype == "f32" else H
    g = helper.make_graph([cl], "cl", [helper.make_tensor_value_info(k, elem, [2, 5, 6, 16]) for k in ("x", "r")],
                          [helper.make_tensor_value_info("y", elem, [2, 5, 6, 16])], list(r.model.graph.initializer))
    mc = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("onnxfuse", 1)])
    mc.ir_version = 10
    nhwc = {k: np.ascontiguousarray(v.transpose(0, 2, 3, 1)) for k, v in feeds.items()}
    (got,) = run_lib(lib, mc, nhwc)
    tol = 1e-6 if dtype == "f32" else 1e-3
    _close(got, want.transpose(0, 2, 3, 1), tol, "channels-last against NCHW")
    values = {**nhwc, **{t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}}
    (ref,) = Rows().evaluate(cl, [values[x] for x in cl.input])
    _close(got, ref.astype(np_dt), 1e-5 if dtype == "f32" else 1e-2, "channels-last against the reference")


def _decomposed(c=16, groups=4, shape=(2, 16, 5, 6), back="shape"):
    """The ReduceMean form over Reshape(x, [0, G, -1]) (tf2onnx, hand-written exports): mean,
    Sub, Pow, mean, eps, Sqrt, Div over [N, G, L], Reshape back (to Shape(x), or x's static
    shape), gamma, beta, SiLU; a residual add before."""
    from tests.util import model

    rng = np.random.default_rng(5)
    N = helper.make_node
    nodes = [N("Add", ["a", "b"], ["x"]), N("Reshape", ["x", "split"], ["r"]), N("ReduceMean", ["r", "axes"], ["mean"]),
             N("Sub", ["r", "mean"], ["d"]), N("Pow", ["d", "two"], ["d2"]), N("ReduceMean", ["d2", "axes"], ["var"]),
             N("Add", ["var", "eps"], ["ve"]), N("Sqrt", ["ve"], ["sd"]), N("Div", ["d", "sd"], ["nr"])]
    inits = {"split": np.array([0, groups, -1], np.int64), "axes": np.array([-1], np.int64),
             "two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
             "gamma": rng.standard_normal((c, 1, 1)).astype(np.float32),
             "beta": rng.standard_normal((c, 1, 1)).astype(np.float32)}
    if back == "shape":
        nodes += [N("Shape", ["x"], ["xs"]), N("Reshape", ["nr", "xs"], ["n0"])]
    else:
        inits["xs"] = np.array(shape, np.int64)
        nodes.append(N("Reshape", ["nr", "xs"], ["n0"]))
    nodes += [N("Mul", ["n0", "gamma"], ["n1"]), N("Add", ["n1", "beta"], ["n"]), N("Sigmoid", ["n"], ["sg"]),
              N("Mul", ["n", "sg"], ["y"])]
    io = {k: ("float32", list(shape)) for k in ("a", "b")}
    return model(nodes, io, {"y": ("float32", list(shape))}, inits, opset=18)


@pytest.mark.parametrize("back", ["shape", "constant"])
def test_decomposed_form(lib, back):
    """The ReduceMean form is a group_norm core too: one node (the Reshape back read as the
    same elements), equal to the original as a function body and as the library's kernel."""
    m = _decomposed(back=back)
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    attrs = {a.name: helper.get_attribute_value(a) for a in r.model.graph.node[0].attribute}
    assert (attrs["reduction"], attrs["groups"]) == (b"group_norm", 4)
    rng = np.random.default_rng(3)
    feeds = {k: (rng.standard_normal((2, 16, 5, 6)) * 3 + 1).astype(np.float32) for k in ("a", "b")}
    _close(run_lib(lib, r.model, feeds)[0], run(m, feeds)[0], 1e-5, "library against the original")


def test_decomposed_form_with_the_groups_read_outside_is_declined():
    """A value of the [N, G, L] part read outside (here the normalized groups, before the
    Reshape back) cannot leave the node (it is not of x's shape): reported."""
    m = _decomposed()
    m.graph.output.append(helper.make_tensor_value_info("nr", TensorProto.FLOAT, None))
    r = optimize_model(m)
    assert "FusedRows" not in op_types(r.model)
    assert any("read outside" in k for k in r.report.not_fused), r.report.summary()


def _convs_around_group_norm(c: int = 32, groups: int = 8, size: int = 10) -> onnx.ModelProto:
    """conv -> Relu -> GroupNorm (torch's form) -> SiLU -> conv -> Relu: SD-UNet's resnet block."""
    from tests.test_layout import image_model

    rng = np.random.default_rng(6)
    N = helper.make_node
    inits = [numpy_helper.from_array((rng.standard_normal((c, 16, 3, 3)) / 12).astype(np.float32), "w0"),
             numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) / 17).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal((c, 1, 1)).astype(np.float32), "beta"),
             numpy_helper.from_array(np.array([0, groups, -1], np.int64), "split"),
             numpy_helper.from_array(np.ones(groups, np.float32), "ones"),
             numpy_helper.from_array(np.zeros(groups, np.float32), "zeros")]
    nodes = [N("Conv", ["x", "w0"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv0"),
             N("Relu", ["c0"], ["h"]), N("Reshape", ["h", "split"], ["r"]),
             N("InstanceNormalization", ["r", "ones", "zeros"], ["i"]), N("Shape", ["h"], ["hs"]),
             N("Reshape", ["i", "hs"], ["n0"]), N("Mul", ["n0", "gamma"], ["n1"]), N("Add", ["n1", "beta"], ["n"]),
             N("Sigmoid", ["n"], ["sg"]), N("Mul", ["n", "sg"], ["a"]),
             N("Conv", ["a", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
             N("Relu", ["c1"], ["y"])]
    return image_model(nodes, "gn_between_convs", 16, size, [("y", c)], inits)


def test_nhwc_pass_lays_out_a_group_norm_between_convs(lib, tmp_path, monkeypatch):
    """The NHWC pass carries channels-last through a GroupNorm (laid out as a pool: X and Y
    together): conv (NHWC out) -> FusedRows (NHWC in and out) -> conv (NHWC in), no Transpose;
    the kernel compiled channels-last; the model equal to the original with the library's CPU
    kernels and as function bodies (which transpose around the original nodes)."""
    import json

    from onnxfuse.pipeline import compile_pass
    from tests.test_layout import attrs, check_same
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m = _convs_around_group_norm()
    r = optimize_model(m)
    # ieee convs: the library's CPU conv kernels emulate "tf32" (3.5e-4 off fp32 here, in
    # NCHW as in NHWC), which would hide the GroupNorm's own error
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc", conv_precision="ieee")).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    # (the image enters through one Transpose: conv0 reads 16 channels channels-last)
    assert op_types(r.model) == ["Transpose", "FusedConv", "FusedRows", "FusedConv"], r.report.summary()
    _, conv0, gn, conv1 = r.model.graph.node
    assert attrs(conv0)["y_layout"] == b"NHWC" and attrs(conv1)["x_layout"] == b"NHWC"
    assert (attrs(gn)["x_layout"], attrs(gn)["y_layout"]) == (b"NHWC", b"NHWC")
    meta = json.loads(next(a.s for a in gn.attribute if a.name == "kernel_meta"))
    assert (meta["reduction"], meta["channels_last"], meta["groups"]) == ("group_norm", 1, 8)
    assert gn.overload.endswith("_nhwc_nhwc")
    check_same(m, r.model, library=True)
    check_same(m, r.model, library=False)


def test_which_group_norms_take_layouts():
    """Only a GroupNorm whose x is its one input of x's shape and y its one output is laid out
    (a residual of x's shape would need its own layout: such a node stays NCHW)."""
    from onnxfuse.kinds.rows import GROUP_NORM_LAYOUTS

    kind = Rows()
    residual = optimize_model(torch_group_norm(17))  # GroupNorm(x + r): two inputs of x's shape
    assert [kind.node_layouts(f) for f in residual.fused] == [None]
    m, _, _ = _gn_op(21, 12)  # GroupNorm(x + temb [N, C, 1, 1])
    assert [kind.node_layouts(f) for f in optimize_model(m).fused] == [GROUP_NORM_LAYOUTS]
    ln = optimize_model(_decomposed()).fused  # a group norm too (the decomposed form), two inputs
    assert [kind.node_layouts(f) for f in ln] == [None]
