"""The TF32 probe (onnxfuse/tf32probe.py): its in-graph rounding of product operands against
the kernels' own TF32 rounding, and its verdict on the CPU (fp32 sums: "fp32") and against an
ORT side that multiplies in TF32 (here the emulation itself: "tf32"). On the GPU:
tests/test_gpu_conv.py runs it on cuBLAS and cuDNN."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import tf32probe
from onnxfuse.codegen_conv import round_array_to_tf32
from onnxfuse.tools.feeds import static_feeds
from onnxfuse.tools.session import BenchSettings, evaluate_model_on
from tests.util import model

N = helper.make_node
CPU = BenchSettings(provider="cpu", library=False)


def _run(m: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    return evaluate_model_on(m.SerializeToString(), [feeds], CPU, library=False)[0]


def _conv(c: int = 16, k: int = 24, hw: int = 12, dtype: str = "float32") -> onnx.ModelProto:
    w = (np.random.default_rng(1).standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(dtype)
    b = np.random.default_rng(2).standard_normal(k).astype(dtype)
    return model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["y"])],
                 {"x": (dtype, [2, c, hw, hw])}, {"y": (dtype, [2, k, hw, hw])}, {"w": w, "b": b})


def _not_a_tie(a: np.ndarray) -> np.ndarray:
    """Values whose 13 dropped bits are not exactly half an ulp of TF32 (where the in-graph
    split and the kernels' ties-away rounding may differ)."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) & 0x1FFF) != 0x1000


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_operands_are_rounded_as_the_kernels_round_tf32(op):
    """Both operands of a product, a graph input and an initializer, reach it rounded to the
    nearest TF32 value: multiplied by the identity, the output is the rounded input, equal to
    the kernels' rounding (`round_array_to_tf32`) except at exact ties."""
    x = np.random.default_rng(0).standard_normal((4096, 8)).astype(np.float32) * 1e3
    m = model([N(op, ["x", "e"], ["y"])], {"x": ("float32", [4096, 8])}, {"y": ("float32", [4096, 8])},
              {"e": np.eye(8, dtype=np.float32)})
    y = _run(tf32probe.with_tf32_operands(m), {"x": x})["y"]
    expected = round_array_to_tf32(x)
    keep = _not_a_tie(x)
    assert keep.mean() > 0.99 and not np.array_equal(x, expected)
    np.testing.assert_array_equal(y[keep], expected[keep])
    # and the weights: x @ W with W off TF32's grid reads W rounded
    w = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    mw = model([N(op, ["e", "w"], ["y"])], {"e": ("float32", [8, 8])}, {"y": ("float32", [8, 8])}, {"w": w})
    yw = _run(tf32probe.with_tf32_operands(mw), {"e": np.eye(8, dtype=np.float32)})["y"]
    keep = _not_a_tie(w)
    np.testing.assert_array_equal(yw[keep], round_array_to_tf32(w)[keep])


def test_only_float32_products_and_only_their_two_operands_are_rounded():
    """A Gemm's C (bias) is added as it is; float16 products are not TF32's business; the
    nodes after the products are untouched."""
    f16 = _conv(dtype="float16")
    assert tf32probe.float32_products(f16) == []
    assert tf32probe.with_tf32_operands(f16).graph.node[:] == f16.graph.node[:]
    conv = _conv()
    rounded = tf32probe.with_tf32_operands(conv)
    c = next(n for n in rounded.graph.node if n.op_type == "Conv")
    assert [x.endswith(".tf32") for x in c.input] == [True, True, False]
    assert [n.op_type for n in rounded.graph.node] == ["Mul", "Sub", "Sub"] * 2 + ["Conv", "Relu"]
    c_bias = np.full((4, 8), 1.0 + 2 ** -20, np.float32)  # off TF32's grid: would be 1.0 rounded
    g = model([N("Gemm", ["a", "e", "c"], ["y"])], {"a": ("float32", [4, 8])}, {"y": ("float32", [4, 8])},
              {"e": np.eye(8, dtype=np.float32), "c": c_bias})
    y = _run(tf32probe.with_tf32_operands(g), {"a": np.zeros((4, 8), np.float32)})["y"]
    np.testing.assert_array_equal(y, c_bias)


def test_the_cpu_multiplies_in_fp32():
    """ORT's side on the CPU EP: float32 sums, the exact side's own arithmetic, far from the
    TF32 emulation's error (a conv's: ~1e-4 of its outputs' scale)."""
    conv = _conv()
    p = tf32probe.probe(conv, static_feeds(conv), provider="cpu")
    assert p.multiplies == "fp32" and len(p.ratios) == tf32probe.SESSIONS
    assert all(r is not None and r < 0.01 for r in p.ratios) and p.tf32_rms > 1e-5


def test_an_ort_side_that_multiplies_in_tf32_reads_tf32(monkeypatch):
    """ORT's side replaced by the TF32 emulation (what TF32 tensor cores compute): ratio 1."""
    real = tf32probe.evaluate_model_on

    def tf32_on_cuda(data, feed_list, settings, library, collect=True):
        if settings.provider == "cuda":
            data = tf32probe.with_tf32_operands(onnx.load_from_string(data)).SerializeToString()
            settings = CPU
        return real(data, feed_list, settings, library, collect)

    monkeypatch.setattr(tf32probe, "evaluate_model_on", tf32_on_cuda)
    conv = _conv()
    p = tf32probe.probe(conv, static_feeds(conv))
    assert p.multiplies == "tf32" and all(r == pytest.approx(1.0) for r in p.ratios)


def test_operands_already_on_tf32s_grid_cannot_tell_and_read_tf32():
    """Small integers are TF32 values: the emulation is exact, no ratio, and the precision
    makes no difference, so the node keeps the model's."""
    w = np.random.default_rng(0).integers(-3, 4, (8, 8)).astype(np.float32)
    m = model([N("MatMul", ["x", "w"], ["y"])], {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8])}, {"w": w})
    x = np.random.default_rng(1).integers(-3, 4, (4, 8)).astype(np.float32)
    p = tf32probe.probe(m, {"x": x}, provider="cpu")
    assert p.tf32_rms == 0.0 and p.ratios == (None,) * tf32probe.SESSIONS and p.multiplies == "tf32"


@pytest.mark.gpu
def test_cublas_tf32_reads_as_the_emulation_and_tf32_off_reads_fp32():
    """On the GPU: a 1024-cubed float32 MatMul, which cuBLAS runs on TF32 tensor cores when ORT
    allows it, reads "tf32" with ratios near 1 (the emulation rounds as the hardware does); with
    TF32 off (ORT's use_tf32 0) the same product reads "fp32", far below the threshold."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    m = model([N("MatMul", ["x", "w"], ["y"])], {"x": ("float32", [1024, 1024])},
              {"y": ("float32", [1024, 1024])}, {"w": w})
    feeds = {"x": rng.standard_normal((1024, 1024)).astype(np.float32)}
    on = tf32probe.probe(m, feeds)
    assert on.multiplies == "tf32" and all(0.8 <= r <= 1.25 for r in on.ratios), on
    off = tf32probe.probe(m, feeds, tf32=False)
    assert off.multiplies == "fp32" and all(r < 0.05 for r in off.ratios), off
