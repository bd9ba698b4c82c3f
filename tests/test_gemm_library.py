"""GemmEpilogue in the custom-op library's CPU kernel (csrc/kinds/gemm_cpu.cc): optimized models
run with the library against the original in ONNX Runtime and against the numpy reference of
the node contract (onnxfuse.kinds.gemm.evaluate_gemm), at sizes that are not multiples of any
tile, in fp32, fp16 and bf16, 2-D, flattened-batch and batched, transposed operands; the
kernel, not the function body, is what runs; a compiled model keeps its contract; `analyze`
counts the node's FLOPs (2 M N K plus the epilogue's) and its bytes as one kernel's.

Tolerances: against the numpy reference (float64 sums on both sides, one rounding of the
product and one at the store) fp32 1e-5 of the output's scale, fp16 / bf16 one rounding
(1e-2 / 2e-2); against ONNX Runtime running the original, the same per-dtype bounds."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds.gemm import Gemm
from tests.test_gemm_patterns import (
    PATTERNS,
    _w,
    erf_consts,
    erf_gelu,
    ffn1,
    gemm_all,  # noqa: F401 -- autouse: the gemm patterns are matched
)
from tests.util import model, run

ort = pytest.importorskip("onnxruntime")
N = helper.make_node
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
    scale = float(np.abs(w).max(initial=1.0))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=what)


def _check(lib: str, m: onnx.ModelProto, feeds: dict, against_ort: bool = True, tol: float | None = None):
    """Optimize with the gemm patterns, run with the library; compare with the numpy reference of
    the fused node on its actual inputs, and with the original in ONNX Runtime."""
    r = optimize_model(m, PATTERNS)
    assert "GemmEpilogue" in [n.op_type for n in r.model.graph.node], r.report.summary()
    got = run_lib(lib, r.model, feeds)
    node = next(n for n in r.model.graph.node if n.op_type == "GemmEpilogue")
    values = {**feeds, **{t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}}
    (ref,) = Gemm().evaluate(node, [values[x] for x in node.input])
    if node.output[0] in [o.name for o in r.model.graph.output]:
        k = [o.name for o in r.model.graph.output].index(node.output[0])
        _close(got[k], ref, "library against the numpy reference", tol)
    if against_ort:
        for g, w in zip(got, run(m, feeds), strict=True):
            _close(g, w, "library against the original in ONNX Runtime", tol)
    return r


def _x(shape, dtype=np.float32, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("s,k,n", [(5, 32, 48), (37, 70, 45), (1, 768, 3072)])
def test_ffn1_bias_erf_gelu(lib, s, k, n):
    _check(lib, ffn1(s=s, k=k, n=n), {"x": _x((2, s, k))})


def test_ffn1_fp16(lib):
    _check(lib, ffn1("float16", s=7, k=40, n=24), {"x": _x((3, 7, 40), np.float16)})


def test_bf16_relu(lib):
    """bf16 (x rounded to bf16 by a Cast; ONNX Runtime's Python API has no bf16 arrays and its CPU
    provider no bf16 MatMul: against the reference only); the Cast back to float32 is fused."""
    nodes = [N("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16), N("MatMul", ["xb", "w"], ["h"]),
             N("Relu", ["h"], ["r"]), N("Cast", ["r"], ["y"], to=TensorProto.FLOAT)]
    m = model(nodes, {"x": ("float32", [6, 33])}, {"y": ("float32", [6, 17])},
              {"w": _w((33, 17), 2, ml_dtypes.bfloat16)})
    r = optimize_model(m, PATTERNS)
    assert [n.op_type for n in r.model.graph.node] == ["Cast", "GemmEpilogue"], r.report.summary()
    x = _x((6, 33))
    (got,) = run_lib(lib, r.model, {"x": x})
    node = r.model.graph.node[1]
    w = numpy_helper.to_array(next(t for t in r.model.graph.initializer if t.name == node.input[1]))
    (ref,) = Gemm().evaluate(node, [x.astype(ml_dtypes.bfloat16), w])
    _close(got, ref, "bf16 against the reference", tol=2e-2)


def test_gemm_transb_alpha_beta(lib):
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5, beta=2.0), N("Relu", ["h"], ["y"])]
    m = model(nodes, {"x": ("float32", [9, 24])}, {"y": ("float32", [9, 40])},
              {"w": _w((40, 24), 3), "c": _w((40,), 4)})
    _check(lib, m, {"x": _x((9, 24))})


def test_gemm_trans_a_with_full_c(lib):
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transA=1), N("Sigmoid", ["h"], ["y"])]
    m = model(nodes, {"x": ("float32", [24, 9]), "c": ("float32", [9, 40])}, {"y": ("float32", [9, 40])},
              {"w": _w((24, 40), 3)})
    _check(lib, m, {"x": _x((24, 9)), "c": _x((9, 40), seed=2)})


def test_batched_both_dynamic_with_transpose_and_mask(lib):
    """Attention scores (pattern with dynamic_b): q @ k^T * scale + a bias [B, H, 1, S] (strided: it
    collapses over the batch dims; a mask [B, 1, 1, S] does not, and stays out of the epilogue)."""
    import dataclasses

    from tests.test_gemm_patterns import GEMM

    nodes = [N("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N("MatMul", ["q", "kt"], ["s"]),
             N("Mul", ["s", "scale"], ["ss"]), N("Add", ["ss", "mask"], ["y"])]
    m = model(nodes, {"q": ("float32", [2, 3, 7, 16]), "k": ("float32", [2, 3, 9, 16]),
                      "mask": ("float32", [2, 3, 1, 9])}, {"y": ("float32", [2, 3, 7, 9])},
              {"scale": np.array(0.25, np.float32)})
    pats = [dataclasses.replace(GEMM, match=dataclasses.replace(GEMM.match, dynamic_b=True))]
    r = optimize_model(m, pats)
    assert r.fused and r.fused[0].input_modes == ("full", "strided")
    feeds = {"q": _x((2, 3, 7, 16)), "k": _x((2, 3, 9, 16), seed=2), "mask": _x((2, 3, 1, 9), seed=3)}
    (got,) = run_lib(lib, r.model, feeds)
    (want,) = run(m, feeds)
    _close(got, want, "attention scores")


def test_residual_and_cast(lib):
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Add", ["hb", "r"], ["s"]),
             N("Cast", ["s"], ["y"], to=TensorProto.FLOAT16)]
    m = model(nodes, {"x": ("float32", [2, 5, 64]), "r": ("float32", [2, 5, 30])}, {"y": ("float16", [2, 5, 30])},
              {"w": _w((64, 30)), "b": _w((30,), 4)})
    _check(lib, m, {"x": _x((2, 5, 64)), "r": _x((2, 5, 30), seed=5)})


def test_the_kernel_runs_not_the_function_body(lib):
    """With the library, ONNX Runtime runs the node's kernel: an epilogue changed to add 1
    (its function body left as it was) shows in the output."""
    r = optimize_model(ffn1(), PATTERNS)
    node = next(n for n in r.model.graph.node if n.op_type == "GemmEpilogue")
    attr = next(a for a in node.attribute if a.name == "program")
    text = attr.s.decode()
    last = text.strip().splitlines()[-1]  # output %k f32
    k = int(last.split()[1][1:])
    attr.s = text.replace(last, f"%{k + 1} = add %{k} 1.0\noutput %{k + 1} f32").encode()
    feeds = {"x": _x((2, 5, 32))}
    (body,) = run(r.model, feeds)
    (kernel,) = run_lib(lib, r.model, feeds)
    np.testing.assert_allclose(kernel, body + 1, rtol=1e-5, atol=1e-5)


def test_bad_shapes_fail_with_a_clear_error(lib):
    r = optimize_model(ffn1(), PATTERNS)
    node = next(n for n in r.model.graph.node if n.op_type == "GemmEpilogue")
    next(a for a in node.attribute if a.name == "trans_b").i = 0  # B [N, K] read as [K, N]
    with pytest.raises(Exception, match="do not agree on K"):
        run_lib(lib, r.model, {"x": _x((2, 5, 32))})


def test_analyze_costs_the_fused_node():
    """`analyze` counts a GemmEpilogue node's FLOPs from its function body (2 M N K for the
    product, plus the epilogue's) and its bytes as one kernel's: A, B and the bias read once,
    Y written once (the packed weights' Transpose is a layout, not work)."""
    from onnxfuse.cost import model_cost

    m = ffn1(s=128, k=768, n=3072)
    shapes = {"x": (8, 128, 768)}
    r = optimize_model(m, PATTERNS)
    before, after = model_cost(m, shapes), model_cost(r.model, shapes)
    (fused,) = [c for c in after.nodes if c.op_type == "GemmEpilogue"]
    mm = next(c for c in before.nodes if c.op_type == "MatMul")
    m_rows, k, n = 8 * 128, 768, 3072
    assert fused.ok and mm.flops == 2 * m_rows * n * k
    assert fused.flops == before.flops and fused.flops >= 2 * m_rows * n * k
    assert fused.bytes_read == (m_rows * k + k * n + n) * 4 and fused.bytes_written == m_rows * n * 4
    assert after.bytes < before.bytes / 2


def test_compiled_model_keeps_its_contract(tmp_path, monkeypatch, lib):
    """Compiled for sm_90 (no GPU needed) at the default precision: the node carries kernel_meta
    of kind gemm for its attributes and binaries, its packed weights rounded to TF32 (the
    kernel rounds A), and it still runs on the CPU with the library."""
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import round_array_to_tf32
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    m = ffn1(s=5, k=32, n=48)
    r = compile_pass(optimize_model(m), kernel_options("sm_90"))
    (node,) = [n for n in r.model.graph.node if n.op_type == "GemmEpilogue"]
    attrs = {a.name: a for a in node.attribute}
    meta = json.loads(attrs["kernel_meta"].s)
    assert (meta["kind"], meta["n_extras"], meta["trans_a"], meta["trans_b"], meta["input_modes"]) == (
        "gemm", 1, 0, 1, ["row"])
    assert meta["variants"][0]["requires"] == {"max_elements": 2**31 - 1, "ptr_align": 16}
    assert all(f"kernel_{i}" in attrs for i in range(len(meta["binaries"])))
    assert meta["name"] == node.overload and node.overload.startswith("onnxfuse_gemm_epilogue_")
    w = numpy_helper.to_array(next(t for t in r.model.graph.initializer if t.name == node.input[1]))
    np.testing.assert_array_equal(w, round_array_to_tf32(_w((32, 48), 1).T))
    x = _x((2, 5, 32))
    (want,) = run(m, {"x": x})
    (got,) = run_lib(lib, r.model, {"x": x})
    _close(got, want, "compiled model on the CPU (weights rounded to TF32)", tol=2e-3)
    # the CPU kernel reads no kernel_meta: variants it could not launch (a split-K one with a
    # "split" the CUDA kernel rejects) change nothing on the CPU
    meta["variants"][0]["split"] = 70000
    attrs["kernel_meta"].s = json.dumps(meta).encode()
    (again,) = run_lib(lib, r.model, {"x": x})
    np.testing.assert_array_equal(again, got)


def test_erf_consts_helpers_are_exporter_like():
    nodes = erf_gelu("a", "b")
    assert [n.op_type for n in nodes] == ["Div", "Erf", "Add", "Mul", "Mul"] and len(erf_consts()) == 3
