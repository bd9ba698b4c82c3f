"""On an NVIDIA GPU: fused models on ONNX Runtime's CUDA execution provider give the same
outputs as the originals, with and without CUDA graphs, across batch sizes, and the fused
nodes really run as Triton kernels on the GPU (checked in ORT's profile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from models.build import cos_cos, example, gelu_erf, mul_chain  # noqa: E402
from onnxfuse import library_path, optimize_model  # noqa: E402
from onnxfuse.compile import local_gpu_archs  # noqa: E402
from onnxfuse.kernels import compile_fused  # noqa: E402
from tests.util import model, random_feeds  # noqa: E402

pytestmark = pytest.mark.gpu(torch=True)  # skipped without them: tests/conftest.py
N = helper.make_node
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2}


def fused_model(m: onnx.ModelProto) -> onnx.ModelProto:
    # leave_to_ort off: these tests check the kernels, and ORT's own Gelu fusion would
    # otherwise keep gelu_erf's chain (the policy has its own tests, test_ort_fusions.py)
    r = optimize_model(m, leave_to_ort=False)
    assert r.fused, r.report.summary()
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs())
    assert not info["failed"], info["failed"]
    return r.model


def session(m: onnx.ModelProto, library: bool, cuda_graph: bool = False, profile: str | None = None,
            cpu: bool = False):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        so.register_custom_ops_library(library_path())
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    if cpu:
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    # TF32 off: the MatMuls around the fused nodes would otherwise differ by ~1e-3 between
    # the two graphs (ORT picks algorithms per graph), which is not what is tested here.
    opts = {"use_tf32": "0"}
    if cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return ort.InferenceSession(m.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])


def compare(expected: list[np.ndarray], actual: list[np.ndarray], what: str = "") -> None:
    for e, a in zip(expected, actual, strict=True):
        assert e.dtype == a.dtype and e.shape == a.shape, what
        rtol = RTOL[e.dtype]
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=rtol * 0.1,
                                   err_msg=what)


CASES = {
    "mul_chain_8": lambda: mul_chain(8, 1000),
    "cos_cos": lambda: cos_cos(777),
    "gelu_erf": lambda: gelu_erf(1024),
    "mlp_block": example,
    "broadcast": lambda: model(
        [N("Mul", ["x", "b"], ["t"]), N("Add", ["t", "c"], ["u"]), N("Sigmoid", ["u"], ["s"]),
         N("Mul", ["u", "s"], ["y"])],
        {"x": ("float32", ["N", 3, 17, 19]), "b": ("float32", [3, 1, 19]), "c": ("float32", [1])},
        {"y": ("float32", ["N", 3, 17, 19])}),
    "fp16_multi_output": lambda: model(
        [N("Mul", ["x", "x"], ["a"]), N("Tanh", ["a"], ["b"]), N("Sub", ["b", "x"], ["y"])],
        {"x": ("float16", ["N", 1001])}, {"y": ("float16", ["N", 1001]), "b": ("float16", ["N", 1001])}),
    # row variants (`row-vector-loads`): the last dim a multiple of their block: a bias along
    # it (BERT's FFN, fp16), a value per row (the along-the-dim-before branch), a table over
    # the last two dims (collapsed into one)
    "bias_gelu_fp16_rows": lambda: model(
        [N("Add", ["x", "b"], ["h"]), N("Div", ["h", "s"], ["d"]), N("Erf", ["d"], ["e"]),
         N("Add", ["e", "one"], ["a"]), N("Mul", ["h", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])],
        {"x": ("float16", ["N", 3072]), "b": ("float16", [3072])}, {"y": ("float16", ["N", 3072])},
        {"s": np.float16(1.4142), "one": np.float16(1), "half": np.float16(0.5)}),
    "per_row_rows": lambda: model(
        [N("Mul", ["x", "r"], ["t"]), N("Tanh", ["t"], ["y"])],
        {"x": ("float32", ["N", 4, 1024]), "r": ("float32", [4, 1])}, {"y": ("float32", ["N", 4, 1024])}),
    "table_rows": lambda: model(
        [N("Add", ["x", "p"], ["t"]), N("Relu", ["t"], ["y"])],
        {"x": ("float16", ["N", 3, 1536]), "p": ("float16", [3, 1536])}, {"y": ("float16", ["N", 3, 1536])}),
    "where_bool": lambda: model(
        [N("Neg", ["x"], ["n"]), N("Where", ["c", "x", "n"], ["w"]), N("Exp", ["w"], ["y"])],
        {"x": ("float32", ["N", 64]), "c": ("bool", ["N", 64])}, {"y": ("float32", ["N", 64])}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_matches_original_on_cuda(name, tmp_path):
    m = CASES[name]()
    f = fused_model(m)
    original = session(m, library=False)
    fused = session(f, library=True, profile=str(tmp_path / "prof"))
    for batch in (3, 64, 1):  # a new batch size needs no recompilation
        feeds = random_feeds(m, {"N": batch}, seed=batch)
        compare(original.run(None, feeds), fused.run(None, feeds))
    events = json.loads(Path(fused.end_profiling()).read_text())
    ran = {(e["args"].get("op_name"), e["args"].get("provider")) for e in events if e.get("cat") == "Node"}
    assert ("PointwiseChain", "CUDAExecutionProvider") in ran, sorted(ran)


@pytest.mark.parametrize("name", ["mul_chain_8", "mlp_block", "broadcast"])
def test_cuda_graph_replay(name):
    m = CASES[name]()
    f = fused_model(m)
    feeds = random_feeds(m, {"N": 8}, seed=1)
    expected = session(m, library=False).run(None, feeds)
    sess = session(f, library=True, cuda_graph=True)
    binding = sess.io_binding()
    inputs = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
    outputs = {o.name: ort.OrtValue.ortvalue_from_numpy(np.zeros_like(e), "cuda", 0)
               for o, e in zip(sess.get_outputs(), expected, strict=True)}
    for k, v in inputs.items():
        binding.bind_ortvalue_input(k, v)
    for k, v in outputs.items():
        binding.bind_ortvalue_output(k, v)
    for _ in range(3):  # capture, then replays
        sess.run_with_iobinding(binding)
    compare(expected, [outputs[o.name].numpy() for o in sess.get_outputs()])
    # new values in the same buffers: the replayed graph reads them
    feeds2 = random_feeds(m, {"N": 8}, seed=2)
    for k, v in feeds2.items():
        inputs[k].update_inplace(v)
    sess.run_with_iobinding(binding)
    compare(session(m, library=False).run(None, feeds2), [outputs[o.name].numpy() for o in sess.get_outputs()])


def test_no_kernels_gives_a_clear_error():
    m = CASES["cos_cos"]()
    r = optimize_model(m)  # kernels not compiled
    sess = session(r.model, library=True)
    with pytest.raises(Exception, match="(?i)kernel"):
        sess.run(None, random_feeds(m, {"N": 2}))
