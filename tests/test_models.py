"""models/: the benchmark models build (opset >= 17, dynamic batch), fuse to the same outputs,
match their PyTorch modules; the torchvision path is guarded; pretrained fetching checks hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from models import build as mb
from models import pretrained
from tests.util import check_fusion, random_feeds, run

ROOT = Path(__file__).resolve().parent.parent

# Small versions (the defaults are 32x64x112x112 activations), and the fused nodes expected.
SMALL_BENCH = {
    "relu_maxpool": (lambda: mb.relu_maxpool(8, 16), 1),  # FusedMaxPool
    "conv_relu": (lambda: mb.conv_relu(8, 16), 1),  # FusedConv
    "conv_relu_maxpool": (lambda: mb.conv_relu_maxpool(8, 16), 1),  # FusedConv with the pool
    "vgg_stack": (lambda: mb.vgg_stack(4, 8, 3, 32), 4),  # a FusedConv with its pool per block
    "mlp_block": (lambda: mb.mlp_block(8, 32, 64), 1),  # bias + erf-GELU: left to ORT's BiasGelu
}


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", list(SMALL_BENCH))
def test_bench_model_is_valid_and_fuses_to_the_same_outputs(name):
    make, fused = SMALL_BENCH[name]
    m = make()
    onnx.checker.check_model(m, full_check=True)
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert _dims(m.graph.input[0])[0] == "N" and _dims(m.graph.output[0])[0] == "N"
    check_fusion(m, expect_fused=fused, feeds=random_feeds(m, {"N": 2}))


def test_default_sizes():
    assert _dims(mb.conv_relu_maxpool().graph.input[0]) == ["N", 64, 112, 112]
    assert _dims(mb.conv_relu_maxpool().graph.output[0]) == ["N", 64, 56, 56]
    assert _dims(mb.vgg_stack().graph.output[0]) == ["N", 64, 14, 14]
    assert {n.op_type for n in mb.mlp_block().graph.node} >= {"LayerNormalization", "Erf", "MatMul"}


@pytest.mark.parametrize("name", list(SMALL_BENCH))
def test_pytorch_module_computes_the_same(name):
    torch = pytest.importorskip("torch")
    m = SMALL_BENCH[name][0]()
    feeds = random_feeds(m, {"N": 2})
    expected = run(m, feeds)[0]
    module = mb.torch_module(name, m)
    with torch.no_grad():
        got = module(torch.from_numpy(feeds["x"])).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_export_torch_gives_a_dynamic_batch_opset_17_model():
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Hardswish()).eval()
    m = mb.export_torch(module, (torch.randn(2, 3, 8, 8),), ["x"], ["y"])
    onnx.checker.check_model(m)
    assert _dims(m.graph.input[0])[0] == "N"
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 17
    x = np.random.default_rng(0).standard_normal((5, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(run(m, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


def test_torchvision_models_are_guarded():
    try:
        import torchvision  # noqa: F401
    except Exception:
        with pytest.raises(mb.TorchUnavailable, match="torchvision"):
            mb.torchvision_model("resnet18")
        return
    m = mb.torchvision_model("mobilenet_v3_small", size=64)
    onnx.checker.check_model(m)
    assert _dims(m.graph.input[0]) == ["N", 3, 64, 64]


def test_resolve_names_and_groups():
    assert [f for f, _ in mb.resolve(None)] == list(mb.SMALL)
    assert [f for f, _ in mb.resolve(["bench"])] == list(mb.BENCH)
    assert mb.resolve(["conv_relu", "vgg_stack.onnx"]) == [("conv_relu.onnx", True), ("vgg_stack.onnx", True)]
    assert [f for f, _ in mb.resolve(["all"])] == list(mb.ALL)
    with pytest.raises(KeyError, match="unknown model"):
        mb.resolve(["nope"])


def test_build_command_bench_group(tmp_path):
    r = subprocess.run([sys.executable, "-m", "models", "--out", str(tmp_path), "bench", "torchvision"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in mb.BENCH) == sorted(mb.BENCH)
    for p in tmp_path.iterdir():
        onnx.checker.check_model(str(p))
    bad = subprocess.run([sys.executable, "-m", "models.build", "--out", str(tmp_path), "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "unknown model 'nope'" in bad.stderr


# ---------------------------------------------------------------------------------------
# Pretrained: the cache and the checksum (no network needed)
# ---------------------------------------------------------------------------------------

def test_fetch_rejects_a_wheel_with_the_wrong_file(tmp_path):
    spec = pretrained.PRETRAINED["silero_vad"]
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / f"silero_vad-{spec.version}-py3-none-any.whl", "w") as z:
        z.writestr(spec.member, b"not the model")
    with pytest.raises(pretrained.ChecksumMismatch, match="sha256"):
        pretrained.fetch("silero_vad", tmp_path)
    assert not (tmp_path / "silero_vad.onnx").exists()


def test_fetch_uses_a_verified_cached_file_without_pip(tmp_path, monkeypatch):
    spec = pretrained.PRETRAINED["silero_vad"]
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / f"silero_vad-{spec.version}-py3-none-any.whl", "w") as z:
        z.writestr(spec.member, b"model bytes")
    digest = hashlib.sha256(b"model bytes").hexdigest()
    monkeypatch.setitem(pretrained.PRETRAINED, "silero_vad", dataclasses.replace(spec, sha256=digest))

    def no_pip(*a, **k):
        raise AssertionError("pip must not run")

    monkeypatch.setattr(subprocess, "run", no_pip)
    path = pretrained.fetch("silero_vad", tmp_path)
    assert path.read_bytes() == b"model bytes"
    (tmp_path / "wheels" / f"silero_vad-{spec.version}-py3-none-any.whl").unlink()
    assert pretrained.fetch("silero_vad", tmp_path) == path       # the cached file alone is enough


def test_pretrained_feeds_are_seeded():
    a = pretrained.feeds("yolov8n_320")
    b = pretrained.feeds("yolov8n_320")
    assert np.array_equal(a["images"], b["images"]) and a["images"].shape == (1, 3, 320, 320)
    s = pretrained.feeds("silero_vad")
    assert s["sr"] == 16000 and s["sr"].dtype == np.int64 and s["state"].shape == (2, 2, 128)
