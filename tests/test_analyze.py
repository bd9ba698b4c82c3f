"""`onnxfuse analyze`, `profile` and `calibrate`: the roofline, fusion savings, plots, profile parsing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onnxfuse.analyze import DEVICES, analyze, format_analysis, load_device, make_roof
from onnxfuse.cli import main
from onnxfuse.cost import NodeCost, model_cost
from onnxfuse.errors import OnnxfuseError
from onnxfuse.load import load_model
from onnxfuse.profile import (
    attribute_kernels,
    best_offset,
    format_profile,
    parse_ort_profile,
    plot_profile,
    preset_for,
    profile,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "models" / "example.onnx"


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("opt") / "example.opt.onnx"
    assert main(["optimize", str(EXAMPLE), str(out), "--target", "none"]) == 0
    return out


# ------------------------------------------------------------------ devices and the roofline

def test_h200_preset_is_the_datasheet():
    d = DEVICES["h200"]
    assert d.bandwidth_tbps == 4.8 and d.peak_tflops == {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5}
    for key in ("h100", "a100", "l4", "cpu"):
        assert DEVICES[key].bandwidth_tbps > 0 and DEVICES[key].peak_tflops["fp32"] > 0


def test_roof_ridge_time_and_bound():
    roof = make_roof("h200", dtype_peak="fp32")
    assert roof.ridge() == pytest.approx(67 / 4.8)
    mem = NodeCost("a", "Relu", flops=1000, bytes_read=4000, bytes_written=4000)
    assert roof.time(mem) == pytest.approx(8000 / 4.8e12) and roof.bound(mem) == "memory"
    comp = NodeCost("b", "MatMul", flops=10**12, bytes_read=10**9, bytes_written=0, matrix=True)
    assert roof.time(comp) == pytest.approx(1 / 67) and roof.bound(comp) == "compute"
    tc = make_roof("h200", dtype_peak="fp16")
    assert tc.time(comp) == pytest.approx(1 / 989.5) and tc.time(mem) == roof.time(mem)  # Relu: no tensor cores
    custom = make_roof("h200", peak_tflops=10, bandwidth_tbps=1)
    assert custom.ridge() == 10 and custom.ridge(True) == 10


def test_device_profile_file(tmp_path):
    p = tmp_path / "dev.json"
    p.write_text(json.dumps({"name": "my GPU", "bandwidth_tbps": 2.0, "peak_tflops": {"fp32": 20.0, "fp16": 200.0}}))
    d = load_device(str(p))
    assert d.name == "my GPU" and d.peak_tflops["tf32"] == 20.0
    assert make_roof(str(p), dtype_peak="fp16").matrix_peak == 200e12
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(OnnxfuseError, match="not a device profile"):
        load_device(str(tmp_path / "bad.json"))
    with pytest.raises(OnnxfuseError, match="not a preset"):
        load_device("tpu9")


# ------------------------------------------------------------------ analyze

def test_analyze_example():
    a = analyze(str(EXAMPLE), "h200", batch=64)
    known = [r.cost.intensity for r in a.rows if r.cost.ok and r.cost.bytes]
    assert known == sorted(known) and len(a.rows) == 19
    for r in a.rows:
        assert r.candidate == (r.cost.intensity < 10)
    assert {r.cost.op_type for r in a.rows if not r.candidate} == {"MatMul"}
    mc = model_cost(load_model(EXAMPLE), batch=64)
    assert (a.totals.flops, a.totals.bytes) == (mc.flops, mc.bytes)
    assert sum(r.share for r in a.rows) == pytest.approx(1.0)
    chains = [g.chain for g in a.groups]
    # fc1's bias + erf-GELU is left to ONNX Runtime's BiasGelu (onnxfuse.ort_fusions); the LayerNorm
    # (Mul(d, d): not ONNX Runtime's form) is one FusedRows (onnxfuse/kinds/rows.py)
    assert chains == ["ReduceMean→Sub→Mul→ReduceMean→Add→Sqrt→Div→Mul→Add", "Add→Add"]
    # fc2 bias + residual: h4 no longer written and read back: 2 x 64*16*64 floats
    add_add = a.groups[-1]
    assert add_add.round_trips_before == 2 and add_add.saved_bytes == 2 * 64 * 16 * 64 * 4
    assert all(g.saved_bytes > 0 and not g.existing for g in a.groups)
    assert a.optimized_totals.bytes == a.totals.bytes - sum(g.saved_bytes for g in a.groups)
    text = format_analysis(a)
    assert "Add→Add: 2 round trips → 1, saves 524 kB per inference" in text
    assert "after optimize: 10 nodes" in text and "ridge point 14 FLOP/B" in text


def test_analyze_optimized_model_shows_fused_nodes(optimized):
    a = analyze(str(optimized), "a100", batch=64)
    fused = [r.cost for r in a.rows if r.cost.domain == "onnxfuse"]
    assert sorted(c.op_type for c in fused) == ["FusedRows", "PointwiseChain"] and all(c.ok and c.body for c in fused)
    assert all(g.existing for g in a.groups) and a.optimized_totals is None
    before = analyze(str(EXAMPLE), "a100", batch=64)
    assert a.unfused_totals.bytes == before.totals.bytes
    text = format_analysis(a)
    assert "already fused (2 nodes)" in text and "saved" in text and "nothing more to fuse" in text


def test_plots_png_and_svg(tmp_path, optimized):
    pytest.importorskip("matplotlib")
    from onnxfuse.plot import plot_analysis

    a = analyze(str(EXAMPLE), "h200", batch=64, dtype_peak="tf32")
    png = plot_analysis(a, tmp_path / "roofline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    svg = plot_analysis(analyze(str(optimized), "l4", batch=64), tmp_path / "roofline.svg")
    text = svg.read_text()
    assert "<svg" in text and "arithmetic intensity" in text and "ridge" in text


def test_analyze_cli_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "a.json", tmp_path / "r.png"
    assert main(["analyze", str(EXAMPLE), "--shape", "x=8,16,64", "--device", "l4", "--json", str(js),
                 "--plot", str(png), "--threshold", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "inputs: x=8x16x64" in out and "NVIDIA L4" in out
    d = json.loads(js.read_text())
    assert d["input_shapes"] == {"x": [8, 16, 64]} and len(d["nodes"]) == 19
    assert len(d["fusion"]["groups"]) == 2 and d["threshold"] == 0.2
    # below 0.2 FLOP/B: all but the ReduceMeans (0.25), Erf and Sqrt (0.5) and MatMuls
    assert sum(n["candidate"] for n in d["nodes"]) == 13
    assert png.stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["analyze", "missing.onnx"], "no such file"),
    (["analyze", str(EXAMPLE), "--shape", "y=1,2"], "no input 'y'"),
    (["analyze", str(EXAMPLE), "--shape", "x=1,2"], "rank 3"),
    (["analyze", str(EXAMPLE), "--device", "tpu9"], "not a preset"),
    (["analyze", str(EXAMPLE), "--peak-tflops", "-1"], "positive"),
    (["analyze", str(EXAMPLE), "--plot", "r.jpg"], "must end in"),
    (["profile", "missing.onnx"], "no such file"),
    (["profile", str(EXAMPLE), "--iters", "0"], "--iters"),
])
def test_cli_errors_exit_2_with_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxfuse: error:") and message in err and err.count("\n") == 1


def test_calibrate_without_gpu_exits_2(capsys, tmp_path):
    from onnxfuse.calibrate import _ort_cuda, _torch_cuda

    if _torch_cuda() is not None or _ort_cuda() is not None:
        pytest.skip("a CUDA device is visible")
    assert main(["calibrate", "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1
    assert not (tmp_path / "d.json").exists()


def test_profile_cuda_without_cuda_provider_exits_2(capsys):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime has CUDA")
    assert main(["profile", str(EXAMPLE), "--provider", "cuda"]) == 2
    assert "no CUDA execution provider" in capsys.readouterr().err


def test_profile_failure_names_dimensions_assumed_1(capsys, tmp_path):
    """A run that fails because a dynamic spatial dimension was assumed 1 (a 3x3 conv without
    padding needs at least 3 pixels) says so in its one-line error."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "height", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, "oh", 6])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    path = tmp_path / "conv.onnx"
    path.write_bytes(m.SerializeToString())
    assert main(["profile", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("onnxfuse: error: onnxruntime:") and "height were assumed 1" in err
    assert main(["profile", str(path), "--shape", "height=5"]) == 0


# ------------------------------------------------------------------ profile

def _events():
    """Two runs (the first a warm-up) of a two-node model, as ONNX Runtime writes them."""
    ev = [{"cat": "Session", "name": "model_loading_uri", "ts": 1, "dur": 5}]
    for run, t0 in enumerate((100, 200)):
        for k, (name, op, dur) in enumerate((("a", "Relu", 10 + run), ("b", "MatMul", 20 + run))):
            ev.append({"cat": "Node", "name": f"{name}_kernel_time", "ts": t0 + 2 + 30 * k, "dur": dur,
                       "args": {"op_name": op, "provider": "CPUExecutionProvider",
                                "input_type_shape": [{"float": [4, 8]}], "output_type_shape": [{"float": [4, 8]}]}})
        ev.append({"cat": "Session", "name": "model_run", "ts": t0, "dur": 80})
    return ev


def test_parse_ort_profile_drops_warmup_runs():
    p = parse_ort_profile(_events(), warmup=1)
    assert p.run_us == [80.0] and set(p.nodes) == {"a", "b"}
    assert p.nodes["a"].times_us == [11.0] and p.nodes["b"].times_us == [21.0]
    assert p.nodes["b"].op_type == "MatMul" and p.nodes["a"].inputs == [("float", [4, 8])]
    p = parse_ort_profile(_events(), warmup=0)
    assert p.nodes["a"].times_us == [10.0, 11.0]


def test_cupti_kernels_are_attributed_to_the_launching_node():
    # ORT: nodes a [10, 20) and b [30, 50) µs after profiling start; the trace's clock is 37 µs ahead.
    nodes = [(0, "a", 10.0, 10.0), (0, "b", 30.0, 20.0)]
    start_ns = 1_000_000_000_000
    base_ns = 999_000_000_000
    rel = (start_ns - base_ns) / 1000 + 37  # ORT time 0 on the trace's axis

    def launch(t, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": rel + t, "dur": 2,
                "args": {"correlation": corr}}

    def kernel(t, corr, dur, name="k"):
        args = {} if corr is None else {"correlation": corr}
        return {"cat": "kernel", "name": name, "ts": rel + t, "dur": dur, "args": args}

    trace = {"baseTimeNanoseconds": base_ns, "traceEvents": [
        launch(12, 1), launch(15, 2), launch(35, 3),
        kernel(20, 1, 4.0), kernel(25, 2, 6.0), kernel(40, 3, 30.0),
        kernel(45, None, 7.0, "onnxfuse_pointwise_chain_abc"), kernel(60, 99, 1.0),
    ]}
    att = attribute_kernels(trace, nodes, start_ns, {"onnxfuse_pointwise_chain_abc": ["b"]})
    assert att.offset_us == pytest.approx(37, abs=6)
    assert att.kernel_us == {(0, "a"): 10.0, (0, "b"): 37.0}
    assert att.unattributed_us == 1.0 and att.kernels == 5
    assert att.names == {"a": {"k": 10.0}, "b": {"k": 30.0, "onnxfuse_pointwise_chain_abc": 7.0}}
    # clocks 10 s apart: the run annotations put the search in the right place
    skew = 10e6
    for e in trace["traceEvents"]:
        e["ts"] += skew
    trace["traceEvents"].append({"cat": "user_annotation", "name": "onnxfuse_run_0", "ts": rel + skew - 3, "dur": 70})
    att = attribute_kernels(trace, nodes, start_ns, {"onnxfuse_pointwise_chain_abc": ["b"]}, runs=[(0.0, 60.0)])
    assert att.offset_us == pytest.approx(skew + 37, abs=6)
    assert att.kernel_us == {(0, "a"): 10.0, (0, "b"): 37.0}


def test_gpu_names_map_to_presets():
    assert preset_for("NVIDIA H200") == "h200" and preset_for("NVIDIA H100 80GB HBM3") == "h100"
    assert preset_for("NVIDIA A100-SXM4-80GB") == "a100" and preset_for("NVIDIA L4") == "l4"
    assert preset_for("NVIDIA L40S") is None and preset_for("") is None


def test_best_offset_recovers_a_clock_skew():
    rng = np.random.default_rng(1)
    intervals, launches, t = [], [], 0.0
    for _ in range(200):
        dur = float(rng.uniform(3, 15))
        intervals.append((t, t + dur))
        launches += [float(x) + 123.0 for x in rng.uniform(t + 0.5, t + dur - 0.5, size=int(rng.integers(1, 4)))]
        t += dur + float(rng.uniform(1, 3))
    o = best_offset(launches, intervals, 500.0)
    assert abs(o - 123.0) < 0.5
    assert best_offset([], intervals, 500.0) == 0.0


def test_profile_cpu_run_joins_times_with_costs(tmp_path):
    pytest.importorskip("onnxruntime")
    r = profile(str(EXAMPLE), "cpu", batch=8, iters=2, warmup=1, ort_level="disable",
                keep_trace=str(tmp_path / "trace.json"))
    assert len(r.run_us) == 2 and r.time_source == "ort-node"
    names = {n.name for n in r.nodes}
    assert {"ln/mean", "fc1/matmul", "gelu/erf", "residual"} <= names
    static = model_cost(load_model(EXAMPLE), batch=8).by_name()
    for n in r.nodes:
        assert n.cost.ok, (n.name, n.cost.note)
        assert len(n.times_us) == 2 and n.median_s >= 0
        if n.in_model:
            assert (n.cost.flops, n.cost.bytes) == (static[n.name].flops, static[n.name].bytes), n.name
        if n.median_s > 0:
            assert n.achieved_gbps == pytest.approx(n.cost.bytes / n.median_s / 1e9)
            assert n.pct_of_bound == pytest.approx(100 * n.bound_s / n.median_s)
    lost = [n.lost_s for n in r.nodes]
    assert lost == sorted(lost, reverse=True)
    assert json.loads((tmp_path / "trace.json").read_text())
    text = format_profile(r)
    assert "% bound" in text and "fc1/matmul" in text
    # kernel names come from CUPTI only: on the CPU the table says so
    assert "no kernel names" in format_profile(r, kernels=True) and "TF32 tensor-core" not in text
    # with names (as a CUDA run attributes them): under each node, longest first, and the TF32 share
    conv = next(n for n in r.nodes if n.name == "fc1/matmul")
    conv.kernels = [("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", 3.0), ("memset", 1.0),
                    ("cutlass_simt_sgemm_128x64" * 6, 2.0), ("splitKreduce_kernel", 0.5)]
    conv2 = next(n for n in r.nodes if n.name != "fc1/matmul")
    # CUTLASS's fp32 tensor-op kernel is TF32 too (cuDNN ran it for PP-OCR cls's convs on the
    # H200); its fp16 one and the SIMT one are not
    conv2.kernels = [("cutlass_80_tensorop_s1688gemm_64x64_32x6_nn_align4", 4.0),
                     ("cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_nn_align8", 1.0)]
    text = format_profile(r, top=0, kernels=True)
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.lstrip("+ ").startswith("fc1/matmul"))
    assert "tf32f32" in lines[at + 1] and "memset" in lines[at + 2] and lines[at + 3].endswith("…")
    assert lines[at + 4].strip() == "... 1 more kernels"
    assert "TF32 tensor-core kernels (by name): 7 µs of 11.5 µs" in text
    d = r.to_dict()
    (row,) = [n for n in d["nodes"] if n["name"] == "fc1/matmul"]
    assert row["kernels"][0] == {"name": conv.kernels[0][0], "us_per_run": 3.0}


def test_profile_ort_fused_nodes_are_costed_and_marked():
    pytest.importorskip("onnxruntime")
    r = profile(str(EXAMPLE), "cpu", batch=4, iters=1, warmup=0, ort_level="all")
    created = [n for n in r.nodes if not n.in_model]
    assert created and all(n.cost.ok for n in created)  # e.g. ORT's BiasGelu
    assert any("created by ONNX Runtime" in w for w in r.warnings)


def test_profile_optimized_model_with_the_library(optimized, tmp_path):
    pytest.importorskip("onnxruntime")
    from onnxfuse import runtime

    try:
        runtime.library_path()
    except OnnxfuseError as e:
        pytest.skip(f"custom-op library unavailable: {e}")
    r = profile(str(optimized), "cpu", batch=8, iters=2, warmup=1, ort_level="disable")
    fused = [n for n in r.nodes if n.op_type in ("PointwiseChain", "FusedRows")]
    assert len(fused) == 2 and all(n.cost.ok and n.cost.body and n.median_s > 0 for n in fused)
    pytest.importorskip("matplotlib")
    png = plot_profile(r, str(tmp_path / "measured.png"))
    assert png.stat().st_size > 0


def test_calibrate_times_onnxruntime_with_the_shared_runner():
    """calibrate's ONNX Runtime path times through onnxfuse.tools.session (here on the CPU)."""
    from onnx import TensorProto, helper

    from onnxfuse.calibrate import _ort_time

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    t = _ort_time(m, {"x": np.ones((4, 8), np.float32)}, tf32=False, iters=3, provider="cpu")
    assert 0 < t < 1
