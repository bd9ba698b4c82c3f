"""onnxfuse.bundle on an NVIDIA GPU (``pytest -m gpu`` on the device machine; needs
onnxruntime-gpu and torch with CUDA, whose profiler reads CUPTI): the attribution of every
kernel to its one-node model, against each model timed alone; the graph gap of this device;
tuning's nodes all timed in one bundle."""

from __future__ import annotations

import pytest

from models.build import vgg_stack
from onnxfuse import bundle
from onnxfuse import tune as tuning
from onnxfuse.pipeline import compile_pass, optimize_model
from onnxfuse.tune import TuneSettings
from tests.test_bundle import one_node_pairs
from tests.test_squeeze_gpu import _arch
from tests.util import kernel_options

pytestmark = pytest.mark.gpu
CUDA = TuneSettings(provider="cuda", batch=4, cache=False)


def _compiled(monkeypatch, tmp_path, layout: str):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(vgg_stack(3, 32, 3, 64))
    compile_pass(r, kernel_options(f"sm_{_arch()}", layout))
    assert not r.report.compile["failed"] and r.fused
    return r


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_model_times_the_same_in_a_bundle_as_alone(monkeypatch, tmp_path, layout):
    """Every one-node model of a bundle, originals (cuDNN) and fused nodes (the library's
    Triton kernels), gets its own kernels: the same count, and within a quarter (plus a
    microsecond) of its time in a bundle of its own."""
    models = [m for p in one_node_pairs(_compiled(monkeypatch, tmp_path, layout), CUDA) for m in p]
    together = bundle.run_bundle(bundle.bundle(models), bundle.bundle_feeds(models), library=True)
    assert sorted(together.times) == list(range(len(models)))
    for i, m in enumerate(models):
        alone = bundle.run_bundle(bundle.bundle([m]), bundle.bundle_feeds([m]), library=True).times[0]
        t = together.times[i]
        assert t.kernels == alone.kernels >= 1, i
        assert abs(t.us - alone.us) <= 0.25 * alone.us + 1.0, (i, t, alone)


def test_the_graph_gap_of_this_gpu(tmp_path):
    gap = tuning.graph_gap(tuning.Timer(CUDA, tmp_path))
    assert 0.0 <= gap < 0.005 and gap != tuning.GRAPH_GAP_MS  # measured, not the fallback


def test_tuning_times_every_node_in_one_bundle(monkeypatch, tmp_path):
    r = _compiled(monkeypatch, tmp_path, "nhwc")
    timer = tuning.Timer(CUDA, tmp_path)
    dims = tuning.input_shapes(r.original, CUDA)
    decisions = tuning.time_nodes(r, tuning.feeds_for(r.original, dims), dims, timer, CUDA, [_arch()], "tf32", None,
                                  tuning.time.perf_counter())
    assert {d.mode for d in decisions} == {tuning.BUNDLED}, [d.chosen for d in decisions]
    # the nodes' pairs, and the two chains that measured the graph gap
    assert timer.bundled["models"] == 2 * len(decisions) + len(tuning.GAP_CHAINS) and not timer.bundled["errors"]
    assert all(d.original_ms > 0 and d.fused_ms > 0 and d.fused_kernels >= 1 for d in decisions)


def test_bundles_profile_in_a_worker_and_cupti_stays_out_of_this_process(monkeypatch, tmp_path):
    """A bundle runs in the worker process (`onnxfuse.tools.worker`), and the process that asked
    never loads CUPTI (it stays attached once loaded and slows every later launch: forty-first
    session); with ONNXFUSE_BUNDLE_WORKER=0 it runs here, and CUPTI is loaded here. Each checked
    in a fresh interpreter, since other tests in this one may have profiled."""
    import os
    import subprocess
    import sys

    import onnx

    r = _compiled(monkeypatch, tmp_path, "nchw")
    paths = [str(tmp_path / f"{k}.onnx") for k in ("original", "fused")]
    for m, path in zip(one_node_pairs(r, CUDA)[0], paths, strict=True):
        onnx.save(m, path)
    script = (
        "import os, onnx\n"
        "from onnxfuse import bundle\n"
        f"ms = [onnx.load(p) for p in {paths!r}]\n"
        "run = bundle.run_bundle(bundle.bundle(ms), bundle.bundle_feeds(ms), library=True)\n"
        "cupti = 'libcupti' in open('/proc/self/maps').read()\n"
        "print(run.pid != os.getpid(), cupti, len(run.times))\n")
    for flag, want in (("1", "True False 2"), ("0", "False True 2")):
        env = {**os.environ, "ONNXFUSE_BUNDLE_WORKER": flag}
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().splitlines()[-1] == want, (flag, p.stdout, p.stderr[-2000:])
