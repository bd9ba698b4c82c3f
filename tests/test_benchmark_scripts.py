"""The GPU benchmark scripts' CPU-testable parts: time_cuda's per-call synchronization (with a
fake torch.cuda), tune_pointwise's arguments and Inductor log parsing, the intensity
sweep's reading of an ONNX Runtime profile, and conv_precision's dry run (its whole path on
the CPU, in Triton's interpreter)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("onnxruntime")

from benchmarks import conv_precision, gpu_timing, intensity_sweep, tune_pointwise  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _FakeCuda:
    """Records the order of events, calls and synchronizations."""

    def __init__(self):
        self.log: list[str] = []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                fake.log.append("record")

            def elapsed_time(self, other):
                return 1.0

        self.Event = Event

    def synchronize(self):
        self.log.append("sync")


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(gpu_timing.torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(gpu_timing.torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_time_cuda_waits_for_every_call(fake_cuda):
    t = gpu_timing.time_cuda(lambda: fake_cuda.log.append("call"), iters=3, warmup=1)
    assert t.median_ms == 1.0
    timed = fake_cuda.log[fake_cuda.log.index("record"):]
    assert timed == ["record", "call", "record", "sync"] * 3 + ["sync"]
    assert fake_cuda.log[:2] == ["call", "sync"]  # warm-up calls wait too


def test_time_queued_synchronizes_once(fake_cuda):
    gpu_timing.time_queued(lambda: fake_cuda.log.append("call"), iters=3, warmup=1)
    timed = fake_cuda.log[fake_cuda.log.index("record"):]
    assert timed == ["record", "call", "record"] * 3 + ["sync"]


def test_tune_pointwise_workload_filter():
    assert tune_pointwise.select_workloads(None) == list(tune_pointwise.DEFAULT_WORKLOADS)
    assert tune_pointwise.select_workloads("r=32, r=64,r=128") == ["x*2 r=32", "x*2 r=64", "x*2 r=128"]
    assert tune_pointwise.select_workloads("x*2 r=8") == ["x*2 r=8"]  # exact name: not the fp16 one
    assert tune_pointwise.select_workloads("r=8") == ["x*2 r=8", "x*2 r=8 fp16"]
    assert tune_pointwise.select_workloads("all") == list(tune_pointwise.WORKLOADS)
    with pytest.raises(SystemExit, match="matches none"):
        tune_pointwise.select_workloads("r=7")


def test_tune_pointwise_arguments():
    a = tune_pointwise.parse_args([])
    assert len(a.configs) == 32 and a.workload_names == list(tune_pointwise.DEFAULT_WORKLOADS)
    assert (a.warmup, a.rep) == (50, 300)
    a = tune_pointwise.parse_args(["--workloads", "r=64", "--blocks", "256,512,1024,2048,4096,8192",
                                   "--warps", "2,4,8", "--int32", "1", "--even", "0"])
    assert a.workload_names == ["x*2 r=64"]
    assert len(a.configs) == 18 and (256, 2, 1, 0) in a.configs and (8192, 8, 1, 0) in a.configs
    for bad in (["--blocks", "300"], ["--warps", "3"], ["--even", "2"], ["--blocks", "a"]):
        with pytest.raises(SystemExit):
            tune_pointwise.parse_args(bad)


def test_long_chain_workloads_fuse_to_one_kernel():
    from onnxfuse import optimize_model

    for name, r in (("x*2 r=32", 32), ("x*2 r=64", 64), ("x*2 r=128", 128)):
        (f,) = optimize_model(tune_pointwise.WORKLOADS[name][0]()).fused
        assert len(f.program.instrs) == r


def test_inductor_config_log():
    log = logging.getLogger(tune_pointwise.InductorConfigLog.LOGGER)
    with tune_pointwise.InductorConfigLog() as grab:
        log.debug("CachingAutotuner gets %d configs for %s", 2, "triton_poi_fused_mul_0")
        log.debug("XBLOCK: 1024, num_warps: 4")
        log.debug("XBLOCK: 2048, num_warps: 8")
        log.debug("something else")
    assert grab.configs() == ["CachingAutotuner gets 2 configs for triton_poi_fused_mul_0",
                              "XBLOCK: 1024, num_warps: 4", "XBLOCK: 2048, num_warps: 8"]
    assert not any(h.__class__.__name__ == "Grab" for h in log.handlers) and log.propagate
    with tune_pointwise.InductorConfigLog() as grab:
        log.debug("CachingAutotuner gets %d configs for %s", 2, "k")
        log.debug("Best config for %s: %s: %f", "k", "XBLOCK: 1024, num_warps: 4", 0.1)
    assert grab.configs() == ["Best config for k: XBLOCK: 1024, num_warps: 4: 0.100000"]


def test_profile_medians():
    def node(dur, op="PointwiseChain"):
        return {"cat": "Node", "name": "pointwise_chain_0_kernel_time", "dur": dur, "args": {"op_name": op}}

    events = [{"cat": "Session", "name": "model_run", "dur": 1000}, node(900)]  # warm-up, dropped
    for k in range(3):
        events += [node(10 + k), node(500, op="Mul"),
                   {"cat": "Session", "name": "SequentialExecutor::Execute", "dur": 30},
                   {"cat": "Session", "name": "model_run", "dur": 40 + k}]
    assert intensity_sweep.profile_medians(events, runs=3) == {"model_run_ms": 0.041, "node_ms": 0.011}
    assert intensity_sweep.profile_medians([], runs=3) == {"model_run_ms": None, "node_ms": None}


def test_conv_precision_runs_every_kernel_kind_on_the_gpu_shapes():
    """What the GPU run will launch (H200: 132 multiprocessors): the plain, flat, split-K
    (batch-1 head only: the launcher's rule) and direct kernels, in both layouts."""
    kinds = {layer.name: {lay: [k for k, _ in conv_precision.shipped_kernels(layer, spec, 132)]
                          for lay, spec in conv_precision.layouts(layer).items()}
             for layer in conv_precision.LAYERS}
    assert kinds["resnet50 3x3 64->64 56²"] == {"nchw": ["plain"], "nhwc": ["plain"]}
    assert kinds["resnet50 stem 7x7 s2 3->64 224²"] == {"nchw": ["flat"], "nhwc": ["flat"]}
    assert kinds["yolov8n head 3x3 256->64 10² b1"] == {"nchw": ["plain", "split"], "nhwc": ["plain", "split"]}
    assert kinds["depthwise 3x3 96 28²"] == {"nchw": ["direct"], "nhwc": ["direct"]}
    assert conv_precision.layouts(conv_precision.LAYERS[4])["nhwc"] == ("nchw", "nhwc", "krsc")  # narrow X


def test_conv_precision_dry_run(tmp_path):
    """The benchmark's whole path on the CPU for the plain, flat, split-K and depthwise
    layers. The interpreter's tl.dot is exact fp32: only the rounding tf32 kernels (tf32,
    weights rounded beforehand; tf32-ab, both in the kernel) show TF32's error (and no bias);
    truncated tf32, tf32x3, ieee, the direct loop and torch's CPU conv agree with float64 to
    fp32 accuracy."""
    out = tmp_path / "conv_precision.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conv_precision.py"), "--dry-run",
                           "--layers", "0,5,6,8", "--json", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layer" in proc.stdout and "Rounded tf32 over truncated tf32" in proc.stdout
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["inputs"] == ["relu", "signed", "positive"]
    rows = data["rows"]
    assert not [r for r in rows if "error" in r]
    # the dry run's small shapes also take the small-M kernel (channels last only)
    assert {(r["kernel"], r["layout"]) for r in rows} == {
        (k, lay) for k in ("plain", "flat", "split", "direct", "cudnn") for lay in ("nchw", "nhwc")} | {
        ("small_m", "nhwc")}
    for r in rows:
        assert r["ms"] > 0 and set(r["errors"]) == {"relu", "signed", "positive"}
        worst = max(e["max"] for e in r["errors"].values())
        if r["precision"] in ("tf32", "tf32-ab"):
            # TF32's rounding error (2^-11 per operand), not truncation's bias
            assert 1e-5 < worst < 2e-3, r
            assert abs(r["errors"]["positive"]["bias"]) < 1e-4, r
        else:
            assert worst < 2e-6, r
    by_kernel = {(r["layer"], r["layout"], r["kernel"]) for r in rows if r["kernel"] != "cudnn"}
    for key in by_kernel:  # every precision per tensor-core kernel, one row per direct one
        want = {"fp32"} if key[2] == "direct" else {"tf32", "tf32-ab", "tf32-trunc", "tf32x3", "ieee"}
        assert {r["precision"] for r in rows if (r["layer"], r["layout"], r["kernel"]) == key} == want


def test_tails_table(tmp_path):
    """benchmarks/tails.py at a few thousand points: every fused op through the CPU library,
    the numpy evaluator and the Triton formulas (interpreter) within README's measured bounds
    of the exact value, and no result flushed to 0 where the exact one is a normal number;
    ONNX Runtime's own Sigmoid and Gelu are the ones that lose their tails."""
    out, md = tmp_path / "tails.json", tmp_path / "tails.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tails", "--points", "6000", "--json", str(out),
                           "--markdown", str(md)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert md.read_text().startswith("| op | x | points | ONNX Runtime CPU |")
    for r in rows:
        bound = 2e-5 if r["op"].startswith("Gelu") else 5e-7  # Gelu: the rounding of x / sqrt 2 (README)
        for way in ("onnxfuse_cpu", "numpy", "triton_interp"):
            assert isinstance(r[way], dict), (r["op"], r["range"], r[way])
            assert r[way]["max_rel"] < bound and r[way]["zeros"] == 0, (r["op"], r["range"], way, r[way])
    ort = {(r["op"], r["range"]): r["ort"] for r in rows}
    assert ort["Sigmoid", "x < -16"]["max_rel"] > 1 and ort["Gelu", "x < -5"]["zeros"] > 0



def test_rows_roofline_workloads_fuse_to_one_row_kernel():
    """benchmarks/rows_roofline.py's models each become one FusedRows (leave_to_ort off, as the
    script optimizes them), whose function body gives the original's outputs."""
    import numpy as np

    from benchmarks.rows_roofline import WORKLOADS
    from onnxfuse.pipeline import optimize_model
    from tests.util import random_feeds, run

    for name, build in WORKLOADS.items():
        for dtype in ("fp32", "fp16"):
            m = build(1, dtype)
            r = optimize_model(m, leave_to_ort=False)
            assert [n.op_type for n in r.model.graph.node] == ["FusedRows"], (name, dtype, r.report.summary())
            if dtype == "fp32":
                feeds = random_feeds(m, {}, seed=3)
                (want,), (got,) = run(m, feeds), run(r.model, feeds)  # got: the function body
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_rows_roofline_accuracy_reads_both_errors_and_the_gate(tmp_path):
    """rows_roofline's accuracy step: onnxfuse bench's errors against float64 for the fused
    model and the original under ORT, and the gate (run here on the CPU provider)."""
    import onnx

    from benchmarks.rows_roofline import accuracy, skip_ln
    from onnxfuse.cli import main

    src, opt = tmp_path / "ln.onnx", tmp_path / "ln.opt.onnx"
    onnx.save(skip_ln(1, "fp32"), src)
    assert main(["optimize", str(src), str(opt), "--no-tune", "--no-leave-to-ort", "--target", "none"]) == 0
    acc = accuracy(src, opt, tmp_path / "b.json", provider="cpu")
    assert acc["gate_passed"] is True
    assert 0 < acc["ort_err"] < 1e-5 and acc["err"] < 1e-5


def test_session_timing_times_every_model_in_every_mode(tmp_path):
    """benchmarks/session_timing.py on the CPU: each model alone and interleaved, with the
    sessions' thread settings varied; one row per model, one cell per mode, in its JSON."""
    import onnx

    from benchmarks import session_timing
    from models.build import example
    from onnxfuse import optimize

    onnx.save(example(), tmp_path / "ex.onnx")
    optimize(tmp_path / "ex.onnx", tmp_path / "ex.opt.onnx", target="none")
    out = tmp_path / "t.json"
    assert session_timing.main([str(tmp_path / "ex.onnx"), str(tmp_path / "ex.opt.onnx"), "--provider", "cpu",
                                "--batch", "2", "--iters", "5", "--warmup", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"ex.onnx", "ex.opt.onnx"}
    for row in results.values():
        assert set(row) == set(session_timing.MODES)
        assert all(cell["n"] == 5 and 0 < cell["p10"] <= cell["median"] <= cell["p90"] for cell in row.values())


def test_gemm_roofline_dry_run(tmp_path):
    """benchmarks/gemm_roofline.py --dry-run: each BERT-base workload (small sizes) becomes one
    GemmEpilogue whose function body gives the original's outputs; the FFN block becomes two."""
    out = tmp_path / "gemm.json"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "benchmarks/gemm_roofline.py", "--dry-run", "--json", str(out)], cwd=root,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["workload"], x["dtype"]) for x in rows} == {(w, d) for w in ("qkv", "ffn1", "ffn2", "ffn")
                                                            for d in ("fp32", "fp16")}
    assert all(x["nodes"] == ["GemmEpilogue"] * (2 if x["workload"] == "ffn" else 1) for x in rows)
    assert all(x["function_body_err"] < 1e-5 for x in rows)


@pytest.mark.parametrize("script", ["gemm_tiles", "gemm_structures", "rows_context", "attention_tiles", "bias_gelu",
                                    "gemm_layouts", "gemm_ranks"])
def test_gemm_tile_and_structure_sweeps_dry_run(script):
    """benchmarks/gemm_tiles.py, gemm_structures.py, rows_context.py, attention_tiles.py and
    bias_gelu.py --dry-run: every kernel they time (the generated GemmEpilogue for each BERT-base
    workload, plain and split K; the TMA-descriptor and persistent structures, warp-specialized
    or not, descriptors made on the device or on the host; the residual +
    LayerNorm row kernel at each tile tuning can time, fp16 and fp32; FusedAttention with BERT's
    key mask, GPT-2's causal one and ViT's odd sequence, V loaded after the softmax and first, and
    with the inner-loop options peel, exact scores and a tail together and with tl.exp, and the
    float32 kernel at TF32 unpeeled and peeled; the
    FFN bias + GELU chains in their row and plain launches; the three product forms of
    gemm_layouts.py, MatMul, Gemm and Gemm over K-major weights, on ORT's CPU provider; the
    GemmEpilogue of each BERT-base product + bias that gemm_ranks.py times, in onnxfuse's reference) runs small
    under Triton's interpreter within the output dtype's rounding of the float64 result (the
    scripts raise otherwise)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--dry-run"], cwd=root, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if " err " in ln]
    assert len(lines) == {"gemm_tiles": 10, "gemm_structures": 7, "rows_context": 20, "attention_tiles": 36,
                          "bias_gelu": 40, "gemm_layouts": 6,
                          "gemm_ranks": 8}[script]


def test_gemm_tiles_sweeps_the_shipped_tiles_and_splits_only_small_grids():
    from benchmarks.gemm_tiles import TILES, program, variants

    shipped = [t["f16"] for t in TILES.values()]
    vs = variants("f16", 1024, 768, 3072)  # FFN2 at batch 8: 48 tiles of 128 x 128
    plain = [(v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages) for v in vs if not v.split_k]
    assert plain[:len(shipped)] == shipped and len(set(plain)) == len(plain)
    assert all(2 * v.tiles(1024, 768) <= 132 for v in vs if v.split_k)
    assert any(v.split_k for v in vs) and not any(v.split_k for v in variants("f16", 1024, 3072, 768)
                                                  if v.block_m * v.block_n >= 128 * 128)
    text = program("ffn1", "f16").to_text()  # the 16-bit form: a product by RN(1/c), not a division
    assert "erf" in text and "div" not in text
    assert "div" in program("ffn1", "f32").to_text()


def test_gemm_roofline_accuracy_reads_both_errors_and_the_gate(tmp_path, monkeypatch):
    """gemm_roofline's accuracy step: onnxfuse bench's errors against float64 for the fused
    model and the original under ORT, and the gate (run here on the CPU provider, where the
    library's CPU kernel runs the node)."""
    import onnx

    from benchmarks.gemm_roofline import accuracy, build
    from onnxfuse.cli import main

    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    src, opt = tmp_path / "ffn.onnx", tmp_path / "ffn.opt.onnx"
    onnx.save(build("ffn1", "fp32", batch=2, seq=8, scale=16), src)
    assert main(["optimize", str(src), str(opt), "--no-tune", "--target", "none"]) == 0
    assert "GemmEpilogue" in [n.op_type for n in onnx.load(str(opt)).graph.node]
    acc = accuracy(src, opt, tmp_path / "b.json", provider="cpu")
    assert acc["gate_passed"] is True
    assert 0 < acc["ort_err"] < 1e-5 and acc["err"] < 1e-5


def test_roofline_runs_reads_profile_nodes(tmp_path):
    """The roofline benchmarks' shared reader of `onnxfuse profile --json`: µs, the bound (0
    for a node without one) and the achieved rate each script reports."""
    from benchmarks.roofline_runs import profile_nodes

    p = tmp_path / "p.json"
    p.write_text(json.dumps({"nodes": [
        {"name": "mm", "op_type": "Gemm", "median_s": 3.2e-5, "bound_s": 8e-6, "pct_of_bound": 25.0,
         "achieved_gbps": 900.0, "achieved_tflops": 110.0},
        {"name": "r", "op_type": "Reshape", "median_s": 0.0, "bound_s": None, "pct_of_bound": None,
         "achieved_gbps": None, "achieved_tflops": None}]}))
    mm, r = profile_nodes(p, "tflops")
    assert mm == {"node": "mm", "op": "Gemm", "us": pytest.approx(32.0), "bound_us": pytest.approx(8.0),
                  "pct_bound": 25.0, "tflops": 110.0}
    assert r["bound_us"] == 0.0 and profile_nodes(p, "gbps")[0]["gbps"] == 900.0


def test_attention_roofline_dry_run(tmp_path):
    """benchmarks/attention_roofline.py --dry-run: every workload, dtype and batch becomes one
    FusedAttention (and the merging Reshape), its graph computes the workload's formula, and the
    original, the fused node's function body, each MultiHeadAttention form and torch's SDPA meet
    the float64 reference on the CPU; each case lists the heuristic's tile first, then the others."""
    out = tmp_path / "attention.json"
    r = subprocess.run([sys.executable, "benchmarks/attention_roofline.py", "--dry-run", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["workload"], x["dtype"], x["batch"]) for x in rows} == {
        (w, d, b) for w in ("bert", "gpt2", "vit") for d in ("fp32", "fp16") for b in (1, 8)}
    assert all(x["nodes"] == ["FusedAttention", "Reshape"] for x in rows)
    assert all(x["tiles"][0].endswith("(candidate)") and x["tiles"][-1].endswith("(extra)") for x in rows)
    assert {f for x in rows for f in x["mha_cpu_err"]} == {"bias", "padding", "causal", "plain"}


def test_attention_roofline_table_reads_a_measured_row():
    """attention_roofline's summary of a measured row (the fused node's µs, the fastest tile, ORT's
    fastest MultiHeadAttention form, torch's own choice, % of bound) and a row cut short."""
    from benchmarks.attention_roofline import roofline, summary, table, tile_table

    rl = roofline("bert", "fp16", 8)
    row = {"workload": "bert", "dtype": "fp16", "batch": 8, "roofline": rl, "default_tile": "64x64 4w 3s",
           "ort": {"us": 28.6, "nodes": []},
           "onnxfuse": {"us": 16.6, "nodes": [{"op": "FusedAttention", "us": 16.5}, {"op": "Reshape", "us": 0.1}]},
           "mha": {"bias": {"us": 9.0}, "padding": {"error": "RuntimeError: not supported"}},
           "torch": {"backends": {"auto": {"us_cupti": 5.0, "same_as": "efficient"}}},
           "tiles": [{"label": "64x64 4w 3s", "us": 16.4, "err": 1e-3, "gate_passed": True},
                     {"label": "64x128 4w 2s", "us": 9.8, "err": 2e-3, "gate_passed": False},
                     {"label": "16x128 4w 2s", "error": "RuntimeError: out of resources"}],
           "accuracy": {"err": 1e-3, "ort_err": 5e-4, "gate_passed": True}}
    s = summary(row)
    assert (s["default_us"], s["best_us"], s["best_tile"], s["mha_form"]) == (16.5, 9.8, "64x128 4w 2s", "bias")
    assert s["default_pct_bound"] == pytest.approx(100 * rl["bound_us"] / 16.5)
    cut = {"workload": "vit", "dtype": "fp32", "batch": 1, "roofline": roofline("vit", "fp32", 1),
           "error": "case timed out after 240 s", "tiles": {"error": "RuntimeError: x"}}
    text = table([row, cut])
    assert ("| bert fp16 b8 | 28.6 | 9.0 (bias) | 5.0 (efficient) | 16.5 (64x64 4w 3s) | 9.8 (64x128 4w 2s) | 1.31 "
            "| 8% / 13% |") in text
    assert "0.001 / 0.002 / 0.0005 | pass / FAIL |" in text
    assert "| vit fp32 b1 | error: case timed out after 240 s |" in text
    tiles = tile_table([row, cut]).splitlines()
    assert len(tiles) == 5 and tiles[3].startswith("| bert fp16 b8 | 64x128 4w 2s |") and "| 13% |" in tiles[3]
    assert tiles[4].endswith("| - | - | RuntimeError: out of resources")


def test_unaligned_head_dry_run(tmp_path):
    """Every formulation of an unaligned head (plain, padded + Slice / Split, the padded
    product alone, Gemm with transB) computes X W on the CPU as the plain MatMul does."""
    from benchmarks import unaligned_head

    out = tmp_path / "uh.json"
    assert unaligned_head.main(["--dry-run", "--shapes", "16:32:1001", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"][:1]
    errs = [row[f"{n}_max_abs_err"] for n in ("plain", "padded_slice", "padded_split", "padded_only", "trans_b")]
    assert max(errs) < 2e-3 and max(errs) - min(errs) < 1e-3, row


def test_tf32_emulation_rounds_convs_and_products(tmp_path):
    """benchmarks/tf32_emulation.py: a conv's TF32-emulated output differs from the exact one
    by TF32's rounding (about 2**-11 of |X| |W| per product) where convs are emulated and not
    where only the products are, a MatMul's the other way round, a model with neither not at
    all; its CLI writes one row per input set, the suite's image first."""
    import numpy as np
    import onnx
    from onnx import helper

    from benchmarks import tf32_emulation
    from tests.util import model

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    conv = model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], {"x": ("float32", [1, 4, 8, 8])},
                 {"y": ("float32", [1, 8, 8, 8])}, {"w": w})
    relu = model([helper.make_node("Relu", ["x"], ["y"])], {"x": ("float32", [1, 4, 8, 8])},
                 {"y": ("float32", [1, 4, 8, 8])})
    feeds = {"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)}
    row = tf32_emulation.emulate(conv, {"n": feeds})[0]
    bound = 36 * 2.0 ** -10 * float(np.abs(feeds["x"]).max() * np.abs(w).max())
    assert 0 < row["group-1 convs"] == row["every conv"] == row["matmuls + every conv"] < bound
    assert row["matmuls"] == row["matmuls rms"] == 0.0
    assert 0 < row["every conv rms"] < row["every conv"]
    mm = model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": ("float32", [2, 16])},
               {"y": ("float32", [2, 8])}, {"b": rng.standard_normal((16, 8)).astype(np.float32)})
    row = tf32_emulation.emulate(mm, {"n": {"a": rng.standard_normal((2, 16)).astype(np.float32)}})[0]
    assert row["every conv"] == 0.0 and 0 < row["matmuls"] == row["matmuls + every conv"]
    none = tf32_emulation.emulate(relu, {"n": feeds})[0]
    assert set(none) == {"inputs", *tf32_emulation.EMULATIONS, *(f"{k} rms" for k in tf32_emulation.EMULATIONS)}
    assert not any(v for k, v in none.items() if k != "inputs")
    path = tmp_path / "conv.onnx"
    onnx.save(conv, str(path))
    out = tmp_path / "rows.json"
    assert tf32_emulation.main([str(path), "--shape", "x=1,4,8,8", "--draws", "2", "--emulate", "MatMul",
                                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["inputs"] for r in rows] == ["suite image (seed 0)", "N(0, 1)", "N(0, 1) #2", "uniform [0, 1)",
                                          "uniform [0, 1) #2"]
    assert all(r["group-1 convs"] > 0 and r["MatMul"] == 0.0 for r in rows)
    with pytest.raises(SystemExit):
        tf32_emulation.main([str(path), "--shape", "x=1,4,8,8", "--emulate", "Matmul"])


def test_ort_precision_tells_tf32_products_from_fp32_ones(tmp_path, monkeypatch):
    """benchmarks/ort_precision.py: each Conv, MatMul and Gemm alone against float64 and the
    TF32 emulation. On the CPU EP every product is fp32 (error ~1000x below TF32's); an ORT
    whose Conv rounds its operands to TF32 reads "tf32" for the Conv alone."""
    import numpy as np
    import onnx
    from onnx import helper

    from benchmarks import ort_precision
    from benchmarks.tf32_emulation import tf32_ops
    from tests.util import model

    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
             "m": rng.standard_normal((8, 16)).astype(np.float32), "g": rng.standard_normal((16, 5)).astype(np.float32)}
    m = model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
               helper.make_node("Relu", ["c"], ["r"]),
               helper.make_node("Reshape", ["r", "s"], ["r2"]),
               helper.make_node("MatMul", ["r2", "m"], ["p"]),
               helper.make_node("Gemm", ["p", "g"], ["y"])],
              {"x": ("float32", ["N", 4, 8, 8])}, {"y": ("float32", ["M", 5])},
              inits | {"s": np.array([-1, 8], np.int64)})
    rows = ort_precision.probe(m, {"x": (2, 4, 8, 8)}, "cpu")
    assert [(r["op"], r["inputs"][0]) for r in rows] == [("Conv", [2, 4, 8, 8]), ("MatMul", [128, 8]),
                                                         ("Gemm", [128, 16])]
    assert all(r["multiplies"] == "fp32" and r["tf32_rms_err"] > 0 and r["ratio"] < 0.01 for r in rows), rows

    real = ort_precision.run

    def tf32_conv(one, feeds, names, provider):  # an ORT whose Conv multiplies in TF32
        if [n.op_type for n in one.graph.node] != ["Conv"]:
            return real(one, feeds, names, provider)
        from onnx.reference import ReferenceEvaluator
        return dict(zip(names, ReferenceEvaluator(one, new_ops=tf32_ops(("Conv",))).run(names, feeds), strict=True))

    monkeypatch.setattr(ort_precision, "run", tf32_conv)
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    out = tmp_path / "p.json"
    assert ort_precision.main([str(path), "--shape", "x=2,4,8,8", "--provider", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["multiplies"] for r in rows] == ["tf32", "fp32", "fp32"] and rows[0]["ratio"] > 0.5, rows


def test_tune_fidelity_pairs_one_node_and_in_model_times(tmp_path, capsys):
    """tune_fidelity: each fused node's one-node time (tuning's record) beside its CUPTI time in
    the model (the suite's profile), grouped by kind and configuration; nodes left to ORT and
    nodes missing from the profile are not rows; a file without either is a clear error."""
    import gzip

    from benchmarks import tune_fidelity

    def node(name, kind, chosen, ms, candidates=()):
        return {"node": name, "kind": kind, "chosen": chosen, "fused_ms": ms, "candidates": list(candidates)}

    case = {"model": "m_b8_fp16",
            "tune": {"nodes": [node("ln0", "rows", "tile 1x1024, 1 warps", 0.0025, [{"config": "default"}]),
                               node("ln1", "rows", "tile 1x1024, 1 warps", 0.0027, [{"config": "default"}]),
                               node("gelu", "pointwise", "original", 0.0075),
                               node("att", "attention", "fused", 0.0066),
                               node("gone", "rows", "fused", 0.001)]},
            "profile": {"onnxfuse": {"top": [{"node": "ln0", "us": 3.1}, {"node": "ln1", "us": 3.3},
                                             {"node": "gelu", "us": 6.0}, {"node": "att", "us": 6.6}]}}}
    path = tmp_path / "suite.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"cases": [case, {"model": "untuned"}]}).encode()))
    assert tune_fidelity.main([str(path), "--json", str(tmp_path / "f.json")]) == 0
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert [(r["kind"], r["config"], r["nodes"]) for r in rows] == [
        ("attention", "not searched", 1), ("rows", "tile 1x1024, 1 warps", 2)]
    assert rows[1]["alone_us"] == pytest.approx(2.6) and rows[1]["in_model_us"] == pytest.approx(3.2)
    assert rows[1]["ratio"] == pytest.approx(3.2 / 2.6, abs=1e-3) and rows[0]["ratio"] == pytest.approx(1.0)
    assert "| m_b8_fp16 | rows | tile 1x1024, 1 warps | 2 | 2.60 | 3.20 | 1.23 |" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text(json.dumps({"cases": [{"model": "untuned"}]}))
    with pytest.raises(SystemExit) as e:
        tune_fidelity.main([str(tmp_path / "empty.json")])
    assert e.value.code == 2
