"""FusedRows in the custom-op library's CPU kernel (csrc/rows_cpu.cc): optimized models run
with the library against the original in ONNX Runtime and against the numpy reference of
the node contract (onnxfuse.kinds.rows: evaluate), at row lengths that are not multiples of any block
(77, 768, 1000, 4100), in fp32, fp16 (rows of magnitude 1e4 included) and bf16; the kernel,
not the function body, is what runs; and `analyze` costs the fused node.

Tolerances: against the numpy reference (statistics in float64 on both sides, one rounding
at the store) fp32 1e-5 of the output's scale, fp16 / bf16 one rounding (1e-2 / 2e-2);
against ONNX Runtime running the original, which rounds every fp16 intermediate, the same
per-dtype bounds as `onnxfuse bench`'s floor."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds.rows import Rows
from tests.test_rows_patterns import _ln_graph, _softmax_graph, _w
from tests.util import model, run

ort = pytest.importorskip("onnxruntime")
F, H, BF = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, np.dtype(ml_dtypes.bfloat16): 2e-2}


@pytest.fixture(scope="module")
def lib() -> str:
    from onnxfuse import runtime

    return runtime.library_path()


def run_lib(lib: str, m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _close(got: np.ndarray, want: np.ndarray, what: str, tol: float | None = None) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    tol = TOL[want.dtype] if tol is None else tol
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.nanmax(np.abs(w), initial=1.0))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True, err_msg=what)


def _check(lib: str, m: onnx.ModelProto, feeds: dict, against_ort: bool = True, tol: float | None = None):
    """Optimize (leave_to_ort off: the fused node is what is tested), run with the library;
    compare with the numpy reference of each fused node, and with the original in ORT."""
    r = optimize_model(m, leave_to_ort=False)
    assert "FusedRows" in [n.op_type for n in r.model.graph.node], r.report.summary()
    got = run_lib(lib, r.model, feeds)
    # the reference of the first fused node on its actual inputs (graph inputs or initializers here)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedRows")
    values = {**feeds, **{t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}}
    if all(x in values for x in node.input):
        want = dict(zip(node.output, Rows().evaluate(node, [values[x] for x in node.input]), strict=True))
        outs = {o.name: g for o, g in zip(r.model.graph.output, got, strict=True)}
        for name, w in want.items():
            if name in outs:
                _close(outs[name], w.astype(outs[name].dtype), f"{name} against the numpy reference", tol)
    if against_ort:
        for o, e, g in zip(m.graph.output, run(m, feeds), got, strict=True):
            _close(g, e, f"{o.name} against ONNX Runtime", tol)
    return r, got


@pytest.mark.parametrize("d", [77, 768, 1000, 4100])
@pytest.mark.parametrize("inv", ["div", "keras"])
def test_layernorm_row_lengths(lib, d, inv):
    m = _ln_graph(x_shape=(2, 3, d), inv=inv, square="mul",
                  extra=[helper.make_node("Relu", ["y"], ["z"])])
    rng = np.random.default_rng(d)
    _check(lib, m, {"x": (rng.standard_normal((2, 3, d)) * 3 + 5).astype(np.float32)})


def test_layernorm_fp16(lib):
    m = _ln_graph(x_shape=(4, 5, 768), dtype=H)
    rng = np.random.default_rng(1)
    _check(lib, m, {"x": rng.standard_normal((4, 5, 768)).astype(np.float16)})


def test_layernorm_fp16_large_magnitude(lib):
    """Rows of magnitude 1e4: squares beyond fp16's range. ONNX Runtime's CPU provider runs
    the original's fp16 nodes in fp32 (it casts around them), so both agree; the statistics
    never see fp16."""
    m = _ln_graph(x_shape=(3, 1000), dtype=H)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 1000)) * 1e4).astype(np.float16)
    _, (y,) = _check(lib, m, {"x": x})
    assert np.isfinite(y).all()


def test_layernorm_bf16(lib):
    """bfloat16 (gamma and beta bf16 initializers, x rounded to bf16 by the prologue's Cast):
    ONNX Runtime's CPU provider has no bf16 LayerNormalization and its Python API no bf16
    arrays, so against the reference only."""
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=BF),
             helper.make_node("LayerNormalization", ["xb", "g", "b"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("Sigmoid", ["y"], ["s"]), helper.make_node("Cast", ["s"], ["z"], to=F)]
    m = model(nodes, {"x": ("float32", [6, 77])}, {"z": ("float32", [6, 77])},
              {"g": _w(77).astype(ml_dtypes.bfloat16), "b": _w(77).astype(ml_dtypes.bfloat16)}, opset=17)
    rng = np.random.default_rng(3)
    r, _ = _check(lib, m, {"x": rng.standard_normal((6, 77)).astype(np.float32)}, against_ort=False, tol=2e-2)
    assert [n.op_type for n in r.model.graph.node] == ["FusedRows"]
    assert r.fused[0].program.input_dtypes[3:] == ("bf16", "bf16")  # gamma, beta read as bf16


def test_prenorm_residual_with_x_output(lib):
    """Residual add, LayerNormalization, GELU: y and the residual sum both leave the node."""
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "be"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["n"], ["y"]), helper.make_node("Mul", ["h", "two"], ["h2"])]
    m = model(nodes, {"a": ("float32", [3, 7, 96]), "b": ("float32", [3, 7, 96])},
              {"y": ("float32", [3, 7, 96]), "h2": ("float32", [3, 7, 96])},
              {"g": _w(96), "be": _w(96), "two": np.array(2.0, np.float32)}, opset=20)
    rng = np.random.default_rng(4)
    feeds = {k: rng.standard_normal((3, 7, 96)).astype(np.float32) for k in "ab"}
    r, _ = _check(lib, m, feeds)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedRows")
    assert len(node.output) == 2 and node.output[1] == "h"


@pytest.mark.parametrize("d", [77, 1000])
def test_rmsnorm(lib, d):
    inits = {"two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32), "w": _w(d)}
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
             helper.make_node("Add", ["ms", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    m = model(nodes, {"x": ("float32", [4, d])}, {"y": ("float32", [4, d])}, inits, opset=13)
    rng = np.random.default_rng(d)
    _check(lib, m, {"x": rng.standard_normal((4, d)).astype(np.float32)})


@pytest.mark.parametrize("op,mask,cast", [("Softmax", "add", False), ("Softmax", "where", True),
                                          ("LogSoftmax", "add", False)])
def test_softmax(lib, op, mask, cast):
    m = _softmax_graph(op, mask=mask, cast=cast, shape=(2, 3, 5, 77))
    rng = np.random.default_rng(5)
    feeds = {"s": (rng.standard_normal((2, 3, 5, 77)) * 4).astype(np.float32)}
    if mask == "add":
        feeds["mask"] = np.where(rng.random((2, 1, 1, 77)) < 0.2, -1e4, 0.0).astype(np.float32)
    else:
        feeds["mask"] = rng.random((2, 1, 5, 77)) < 0.2
    _check(lib, m, feeds)


def test_softmax_nan_and_masked_rows(lib):
    """A row holding a NaN is NaN, a fully masked (-inf) row is NaN, as in ONNX Runtime."""
    m = _softmax_graph(shape=(1, 1, 3, 9))
    x = np.random.default_rng(6).standard_normal((1, 1, 3, 9)).astype(np.float32)
    x[0, 0, 1, 4] = np.nan
    feeds = {"s": x, "mask": np.zeros((1, 1, 1, 9), np.float32)}
    feeds2 = {"s": np.full((1, 1, 3, 9), -np.inf, np.float32), "mask": np.zeros((1, 1, 1, 9), np.float32)}
    r = optimize_model(m, leave_to_ort=False)
    for f in (feeds, feeds2):
        (want,) = run(m, f)
        (got,) = run_lib(lib, r.model, f)
        assert np.array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-5, atol=1e-7)


def test_the_kernel_runs_not_the_function_body(lib):
    """With the library, ONNX Runtime runs the node's kernel: an epilogue changed to add 1
    (its function body left as it was) shows in the output."""
    r = optimize_model(_softmax_graph(shape=(2, 1, 3, 8)), leave_to_ort=False)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedRows")
    attr = next(a for a in node.attribute if a.name == "program")
    text = attr.s.decode()
    attr.s = text.replace("output %0 f32", "%1 = add %0 1.0\noutput %1 f32").encode()
    rng = np.random.default_rng(7)
    feeds = {"s": rng.standard_normal((2, 1, 3, 8)).astype(np.float32), "mask": np.zeros((2, 1, 1, 8), np.float32)}
    (body,) = run(r.model, feeds)
    (kernel,) = run_lib(lib, r.model, feeds)
    np.testing.assert_allclose(kernel, body + 1, rtol=1e-6)


def test_bad_node_fails_with_a_clear_error(lib):
    r = optimize_model(_softmax_graph(shape=(2, 1, 3, 8)), leave_to_ort=False)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedRows")
    next(a for a in node.attribute if a.name == "reduction").s = b"median"
    with pytest.raises(Exception, match="reduction 'median' is not one of"):
        run_lib(lib, r.model, {"s": np.zeros((2, 1, 3, 8), np.float32), "mask": np.zeros((2, 1, 1, 8), np.float32)})


def test_analyze_costs_the_fused_node():
    """`analyze` counts a FusedRows node's FLOPs from its function body and its bytes as one
    kernel's: each input read once, each output written once."""
    from onnxfuse.cost import model_cost

    m = _ln_graph(x_shape=(8, 16, 256), extra=[helper.make_node("Relu", ["y"], ["z"])])
    r = optimize_model(m, leave_to_ort=False)
    before, after = model_cost(m), model_cost(r.model)
    (fused,) = [c for c in after.nodes if c.op_type == "FusedRows"]
    assert fused.ok and fused.flops == before.flops
    x_bytes = 8 * 16 * 256 * 4
    assert fused.bytes_read == x_bytes + 2 * 256 * 4 and fused.bytes_written == x_bytes
    assert after.bytes < before.bytes / 4


def test_compiled_model_keeps_its_contract(tmp_path, monkeypatch, lib):
    """Compiled for sm_90 (no GPU needed): the FusedRows node carries kernel_meta of kind rows
    for its own attributes and binaries, and still runs on the CPU with the library."""
    pytest.importorskip("triton")
    import json

    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = _ln_graph(x_shape=(2, 3, 96), extra=[helper.make_node("Relu", ["y"], ["z"])])
    r = compile_pass(optimize_model(m, leave_to_ort=False), kernel_options("sm_90", layout="nhwc"))
    (node,) = [n for n in r.model.graph.node if n.op_type == "FusedRows"]
    attrs = {a.name: a for a in node.attribute}
    meta = json.loads(attrs["kernel_meta"].s)
    assert (meta["kind"], meta["reduction"], meta["axis"], meta["input_modes"]) == (
        "rows", "layer_norm", 2, ["full", "last", "last"])
    assert meta["variants"][0]["requires"] == {"ptr_align": 16} and meta["variants"][0]["cols"] == 96
    assert all(f"kernel_{i}" in attrs for i in range(len(meta["binaries"])))
    assert meta["name"] == node.overload and node.overload.startswith("onnxfuse_layer_norm_")
    x = np.random.default_rng(8).standard_normal((2, 3, 96)).astype(np.float32)
    (want,) = run(m, {"x": x})
    (got,) = run_lib(lib, r.model, {"x": x})
    _close(got, want, "compiled model on the CPU")
