"""onnxfuse.align: products of unaligned output rows padded for cuBLAS and sliced back. The
outputs are the original's (ONNX Runtime on the CPU, seeded inputs); what is not padded stays
as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxfuse import align
from onnxfuse.graph import GraphView
from onnxfuse.load import infer_shapes
from onnxfuse.pipeline import PADDED, build_options, optimize_model
from tests.util import model, op_types, random_feeds, run

N = helper.make_node


def _w(shape, dtype=np.float32, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)


def head(dtype: str = "float16", rows: int = 256, k: int = 64, vocab: int = 1001, then=None) -> onnx.ModelProto:
    """x [2, rows, K] @ W [K, vocab]: a language model's head (GPT-2's vocabulary is 50257)."""
    npd = np.float16 if dtype == "float16" else np.float32
    nodes = [N("MatMul", ["x", "w"], ["logits" if then is None else "h"], name="lm_head")]
    if then is not None:
        nodes.append(N(then, ["h"], ["logits"], **({"axis": -1} if then == "Softmax" else {})))
    return model(nodes, {"x": (dtype, [2, rows, k])}, {"logits": (dtype, [2, rows, vocab])}, {"w": _w((k, vocab), npd)})


def padded(m: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    return align.pad_columns(m, GraphView.build(m, infer_shapes(m)))


def same_outputs(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    onnx.checker.check_model(b, full_check=True)
    feeds = random_feeds(a)
    for x, y in zip(run(a, feeds), run(b, feeds), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64), rtol=1e-6, atol=1e-6)


@pytest.fixture
def small_products(monkeypatch):
    monkeypatch.setattr(align, "MIN_FLOPS", 1e6)  # the test's products are small


@pytest.mark.parametrize("dtype,width", [("float16", 1008), ("float32", 1004)])
def test_an_unaligned_head_is_padded_and_sliced_back(small_products, dtype, width):
    m = head(dtype)
    out, names = padded(m)
    assert names == ["lm_head"] and op_types(out) == ["MatMul", "Slice"]
    w = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[out.graph.node[0].input[1]]
    assert w.shape == (64, width) and not w[:, 1001:].any()  # 16 bytes: 8 fp16 / 4 fp32 values
    assert "w" not in {t.name for t in out.graph.initializer}  # the original weights, read by nothing else
    same_outputs(m, out)


def test_a_gemm_with_trans_b_pads_rows(small_products):
    m = model([N("Gemm", ["x", "w"], ["y"], transB=1)], {"x": ("float16", [512, 64])}, {"y": ("float16", [512, 1001])},
              {"w": _w((1001, 64), np.float16)})
    out, names = padded(m)
    assert len(names) == 1 and op_types(out) == ["Gemm", "Slice"]
    assert tuple(next(t for t in out.graph.initializer if t.name == out.graph.node[0].input[1]).dims) == (1008, 64)
    same_outputs(m, out)


def test_what_is_not_padded(small_products):
    assert padded(head(vocab=1024))[1] == []  # aligned already
    assert padded(head(then="Softmax"))[1] == ["lm_head"]  # a reduction reads it: padded
    assert padded(head(then="Relu"))[1] == []  # a pointwise reader (an epilogue, ORT's fusions)
    bias = model([N("Gemm", ["x", "w", "c"], ["y"])], {"x": ("float16", [512, 64])}, {"y": ("float16", [512, 1001])},
                 {"w": _w((64, 1001), np.float16), "c": _w((1001,), np.float16)})
    assert padded(bias)[1] == []  # a Gemm with C
    dynamic = model([N("MatMul", ["x", "w"], ["y"])], {"x": ("float16", ["B", 256, 64])},
                    {"y": ("float16", ["B", 256, 1001])}, {"w": _w((64, 1001), np.float16)})
    assert padded(dynamic)[1] == []  # rows unknown: the copy may not be repaid


def test_small_products_are_not_padded():
    """At MIN_FLOPS (1 GFLOP) a single decode step's head (M = 1) stays as it is; a prompt's does not."""
    assert padded(head(rows=1, k=768, vocab=50257))[1] == []
    assert padded(head(rows=64, k=768, vocab=50257))[1] == ["lm_head"]


def test_the_pass_runs_for_a_gpu_target_only(small_products):
    m = head()
    r = optimize_model(m, options=build_options(target="sm_90", tune="off"))
    assert r.report.notes.get(PADDED) == 1 and "Slice" in op_types(r.model)
    same_outputs(m, r.model)
    assert optimize_model(m).report.notes.get(PADDED) is None  # target "none": a CPU model


def test_analyze_names_the_unaligned_products(small_products):
    """`onnxfuse analyze` of the original says which products cuBLAS runs without its
    tensor-core kernels (the ones optimize pads); an aligned head gets no such warning."""
    from onnxfuse.cost import model_cost

    (w,) = [w for w in model_cost(head()).warnings if "16 bytes" in w]
    assert w.startswith("1 product(s)") and w.endswith("lm_head")
    assert not [w for w in model_cost(head(vocab=1024)).warnings if "16 bytes" in w]
