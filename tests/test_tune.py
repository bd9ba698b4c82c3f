"""Tuning (onnxfuse/tune.py): the candidate configurations, the shapes it measures at, the
one-node models it times, its decisions (per node and for the whole model, with times
injected so that they are exact), the cache, and the clear errors where it cannot run. The
same code times real models on the CPU execution provider here (provider "cpu"); the GPU
run is tests/test_gpu_conv.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from models.build import conv_relu_maxpool, vgg_stack
from onnxfuse import optimize_model
from onnxfuse import tune as tuning
from onnxfuse.cli import build_parser, main, options_from_args
from onnxfuse.codegen import KernelSpec
from onnxfuse.codegen_conv import ConvSpec, MaxPoolSpec
from onnxfuse.compile import local_gpu_archs
from onnxfuse.errors import OnnxfuseError, OnnxfuseWarning
from onnxfuse.expr import HEADER, parse
from onnxfuse.layers import ConvAttrs, PoolAttrs
from onnxfuse.pipeline import compile_pass
from onnxfuse.runtime import library_path
from onnxfuse.specs import kernel_spec, precision_of
from onnxfuse.tools.feeds import static_feeds
from onnxfuse.tools.session import Run
from onnxfuse.tune import TuneSettings, candidates, input_shapes
from tests.util import kernel_options, model

N = helper.make_node
RELU = parse(HEADER + "\ninput %0 f32\n%1 = max %0 0.0\noutput %1 f32\n")


def test_conv_candidates_are_distinct_and_hold_whole_windows():
    pool = PoolAttrs((4, 4), (4, 4))  # a 16-row window
    spec = ConvSpec("k", RELU, 64, 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), pool)
    cands = candidates(spec)
    configs = [v for _, (v,) in cands]
    assert len(cands) >= 4 and len({(v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages)
                                    for v in configs}) == len(cands)
    assert all(v.block_m % 16 == 0 for v in configs)
    assert cands[0][0].startswith("tile 64x64x32")  # the heuristic default comes first


@pytest.mark.parametrize("channels,x_layout,w_layout,first,flat", [
    (64, "nhwc", "krsc", "tile 128x64x32, 4 warps, 3 stages", False),
    (3, "nchw", "krsc", "tile 128x64x32, 4 warps, 2 stages, flat", True),
])
def test_channels_last_and_flat_candidates(channels, x_layout, w_layout, first, flat):
    """The heuristic's config first, then the runners-up of the H200 sweeps, all distinct and
    of the same kernel kind (flat or not)."""
    spec = ConvSpec("k", RELU, channels, 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout=x_layout,
                    w_layout=w_layout)
    cands = candidates(spec)
    configs = [vs[0] for _, vs in cands]
    assert cands[0][0].startswith(first) and len(cands) >= 4
    # the heuristic's tile ships with its small-M variant (channels last, not flat), as the
    # node does; the runners-up without one
    small_m = [v for _, vs in cands for v in vs if v.max_m]
    assert small_m == ([] if flat else [cands[0][1][-1]])
    assert flat or cands[0][0] == first + ", small-M 16x64x64 (2 warps) up to M 64"
    # each candidate ships with its split-K variant where its reduction splits (64 channels
    # 3x3: 18 steps of 32 channels or 9 of 64); the flat kernel's 1 step does not
    splits = [tuple(v for v in vs[1:] if not v.max_m) for _, vs in cands]
    assert all(len(s) <= 1 for s in splits) and (any(splits) != flat)
    for (_, vs), s in zip(cands, splits, strict=True):
        for sv in s:
            assert (sv.index, sv.block_n, sv.block_k, sv.num_warps) == (1, vs[0].block_n, vs[0].block_k,
                                                                          vs[0].num_warps)
            assert sv.split > 1 and sv.block_m == min(vs[0].block_m, 64)
    assert len({(v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages) for v in configs}) == len(cands)
    assert all(v.flat == flat for v in configs)
    # wgmma needs a warp group over 64 pixel rows; the small-output tiles (16 rows) run
    # mma.sync with fewer warps, and come last
    assert flat or all(v.num_warps >= 4 for v in configs if v.block_m >= 64)
    small = [v for v in configs if v.block_m < 64]
    assert flat or (len(small) == 2 and configs[-2:] == small and all(v.block_k >= 64 for v in small))


@pytest.mark.parametrize("channels,pool", [(72, None), (576, None), (16, PoolAttrs((3, 3), (3, 3)))])
def test_grouped_candidates(channels, pool):
    """Depthwise convs: the direct loop's tiles, the heuristic's first, all distinct, whole
    (padded) windows per program."""
    spec = ConvSpec("k", RELU, channels, channels, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=channels), pool,
                    x_layout="nhwc", y_layout="nhwc", w_layout="krsc")
    cands = candidates(spec)
    configs = [v for _, (v,) in cands]
    assert len(cands) >= 4 and cands[0][0].endswith("direct")
    assert len({(v.block_m, v.block_n, v.num_warps) for v in configs}) == len(cands)
    assert all(v.block_m % (16 if pool else 1) == 0 and not v.flat for v in configs)
    assert (configs[0].block_m, configs[0].block_n) == ((128, 16) if channels <= 16 else (16, 64))


@pytest.mark.parametrize("pool,x_layout,first,tile", [
    (PoolAttrs((2, 2), (2, 2)), "nchw", "tile 4x64, 4 warps, rows", "rows"),
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "nchw", "block 256", "flat"),
    (PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), "nhwc", "tile 4x64, 1 warps, nhwc", "nhwc"),
])
def test_pool_candidates_are_of_the_heuristics_kernel(pool, x_layout, first, tile):
    """The pool kernel the heuristic picks (channels-last X: nhwc; tiling windows: rows;
    else flat), its tile first, then its sweep's runners-up; every candidate generates."""
    from onnxfuse.codegen_conv import generate_maxpool

    spec = MaxPoolSpec("k", RELU, pool, x_layout=x_layout, y_layout=x_layout)
    cands = candidates(spec)
    assert cands[0][0] == first and len(cands) >= 3 and len({label for label, _ in cands}) == len(cands)
    for _, variants in cands:
        assert {v.tile for v in variants} == {tile}
        assert [v.index for v in variants] == list(range(len(variants)))
        for v in variants:
            generate_maxpool(spec, v)
    if tile != "flat":  # as pool_variants ships them: C (nhwc) or W (rows) % 16 == 0 first, then any
        key = "c_multiple" if tile == "nhwc" else "w_multiple"
        assert all([getattr(v, key) for v in variants] == [16, 0] for _, variants in cands)


def test_pointwise_candidates():
    (label, variants), *others = candidates(KernelSpec(RELU, "k", 1, ("full",)))
    assert label == "default" and len(variants) >= 2
    assert others and all(len(vs) == len(variants) for _, vs in others)  # the kind's candidates, as listed


def test_input_shapes():
    m = conv_relu_maxpool(channels=8, size=16)
    assert input_shapes(m, TuneSettings(batch=4)) == {"x": (4, 8, 16, 16)}
    assert input_shapes(m, TuneSettings()) == {"x": (1, 8, 16, 16)}  # batch 1 by default
    assert input_shapes(m, TuneSettings(shapes={"x": (2, 8, 16, 16)})) == {"x": (2, 8, 16, 16)}
    sym = onnx.ModelProto()
    sym.CopyFrom(m)
    sym.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    with pytest.raises(OnnxfuseError, match=r"symbolic dim 2 \(H\).*--shape x="):
        input_shapes(sym, TuneSettings())
    assert input_shapes(sym, TuneSettings(shapes={"H": (12,)}))["x"] == (1, 8, 12, 16)


@pytest.mark.skipif(bool(local_gpu_archs()), reason="checks the error on a machine without a GPU")
def test_tune_without_gpu_is_a_clear_error(tmp_path, capsys):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_relu_maxpool(channels=8, size=16), str(src))
    assert main(["optimize", str(src), str(dst), "--tune", "--batch", "2", "--target", "sm_90"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tune needs an NVIDIA GPU" in err[0]
    assert not dst.exists()


def test_tune_with_target_none_is_a_clear_error(tmp_path, capsys):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_relu_maxpool(channels=8, size=16), str(src))
    assert main(["optimize", str(src), str(dst), "--tune", "--target", "none"]) == 2
    assert "--target none" in capsys.readouterr().err
    assert not dst.exists()


@pytest.mark.parametrize("args,message", [
    (["--tune", "--no-tune"], "contradict"),
    (["--tune-budget", "0"], "--tune-budget must be a positive"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--shape", "x"], "expected NAME=VALUE"),
])
def test_tune_flags_are_checked(tmp_path, capsys, args, message):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(conv_relu_maxpool(channels=8, size=16), str(src))
    assert main(["optimize", str(src), str(dst), "--target", "none", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not dst.exists()


# ---- the tuning step, on the CPU execution provider --------------------------------------

def _optimized(m: onnx.ModelProto):
    r = optimize_model(m)
    assert r.fused
    return r, tuning.snapshot(r)


def _fused_nodes(m: onnx.ModelProto) -> int:
    return sum(n.domain == "onnxfuse" for n in m.graph.node)


def _fake_timer(monkeypatch, node_times: dict[str, float], model_times: Callable[[onnx.ModelProto], float],
                budget_after_one_pair: bool = False):
    """Timer answering from tables: a one-node model by whether it is fused ("fused" /
    "original"), a whole model through model_times(model); it remembers nothing.
    `budget_after_one_pair`: the clock jumps past any budget once one node's pair is timed."""
    timed = []

    def time(self, m, feeds, library, graph=False, cached_only=False):
        if cached_only:
            return None
        self.measured += 1
        timed.append(m)
        return node_times["fused" if _fused_nodes(m) else "original"]

    if budget_after_one_pair:
        monkeypatch.setattr(tuning.time, "perf_counter", lambda: 1e6 if len(timed) >= 2 else 0.0)

    def time_models(self, models, feeds, graph_modes):
        self.measured += len(models) * len(graph_modes)
        return {(label, g): model_times(m) for label, (m, _) in models.items() for g in graph_modes}

    monkeypatch.setattr(tuning.Timer, "time", time)
    monkeypatch.setattr(tuning.Timer, "time_models", time_models)


def _run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


CPU = TuneSettings(provider="cpu", batch=2, cache=False)
NOT_COMPILED = {"summary": "kernels: not compiled"}


def _tune(r, before, settings=CPU) -> dict:
    return tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), settings, [90])


def test_nodes_whose_original_is_faster_are_left_to_ort(monkeypatch):
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    names = {f.node_name for f in r.fused}
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, lambda mm: 1.0 + _fused_nodes(mm))
    out = _tune(r, before)
    rec = out["tune"]
    assert rec["kept"] == "tuned" and rec["shapes"] == {"x": [2, 3, 16, 16]}
    assert {d["node"] for d in rec["nodes"] if d["chosen"] == "original"} == names
    assert not r.fused and _fused_nodes(r.model) == 0 and not r.report.patterns_applied
    (reason,) = [k for k in r.report.not_fused if k.startswith(tuning.REASON)]
    assert all(f"{n} 0.2000 ms vs fused 0.5000 ms" in reason for n in names)
    assert "left to ONNX Runtime (original 0.2000 ms, fused 0.5000 ms, plain)" in out["summary"]
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    for e, a in zip(_run(m, feeds), _run(r.model, feeds), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))


def test_nodes_are_timed_under_cuda_graphs_where_they_can_be(monkeypatch):
    """On CUDA a node and its original run under CUDA graphs, k copies per run (the time is
    per copy); when either cannot be captured, both are timed plainly, one copy."""
    calls = []

    class FakeTimer:
        def __init__(self, capture: bool):
            self.capture = capture

        def time(self, m, feeds, library, graph=False, cached_only=False):
            if cached_only:  # nothing remembered
                return None
            copies = len(m.graph.node) // (1 if library else 2)
            calls.append((library, graph, copies))
            if graph and not self.capture:
                raise OnnxfuseError("cannot capture")
            return (0.3 if library else 0.2) * copies

    orig = model([N("Sigmoid", ["x"], ["s"]), N("Tanh", ["s"], ["y"])], {"x": ("float32", [4, 8])},
                 {"y": ("float32", [4, 8])})
    mini = model([N("Tanh", ["x"], ["y"])], {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8])})
    k = tuning.replicas(orig, mini)
    assert k == tuning.MAX_REPLICAS
    assert tuning._time_pair(FakeTimer(True), orig, mini, graphs=True) == ("CUDA graph", k, pytest.approx(0.2),
                                                                          pytest.approx(0.3))
    assert calls == [(False, True, k), (True, True, k)]
    calls.clear()
    assert tuning._time_pair(FakeTimer(False), orig, mini, graphs=True) == ("plain", 1, 0.2, 0.3)
    assert calls == [(False, True, k), (False, False, 1), (True, False, 1)]
    calls.clear()
    assert tuning._time_pair(FakeTimer(True), orig, mini, graphs=False) == ("plain", 1, 0.2, 0.3)
    assert calls == [(False, False, 1), (True, False, 1)]


def test_replicated_models_compute_every_copy_on_its_own_inputs():
    """k copies, each on its own inputs (so ORT cannot merge them as common subexpressions),
    sharing initializers; each copy's outputs are the single model's on that copy's inputs.
    The number of copies fits the byte budget."""
    w = np.arange(8, dtype=np.float32).reshape(1, 8)
    m = model([N("Add", ["x", "w"], ["a"]), N("Tanh", ["a"], ["y"])], {"x": ("float32", [4, 8])},
              {"y": ("float32", [4, 8])}, {"w": w})
    rep = tuning.replicated(m, 3)
    onnx.checker.check_model(rep, full_check=True)
    assert [i.name for i in rep.graph.input] == ["x__r0", "x__r1", "x__r2"]
    assert [o.name for o in rep.graph.output] == ["y__r0", "y__r1", "y__r2"] and len(rep.graph.initializer) == 1
    feeds = static_feeds(rep)
    so = ort.SessionOptions()
    got = ort.InferenceSession(rep.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    for r in range(3):
        (want,) = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": feeds[f"x__r{r}"]})
        np.testing.assert_array_equal(got[r], want)
    assert len({a.tobytes() for a in got}) == 3
    assert tuning.replicated(m, 1) is m
    big = model([N("Tanh", ["x"], ["y"])], {"x": ("float32", [64, 2**20])}, {"y": ("float32", [64, 2**20])})
    assert tuning.replicas(big, m) == 1  # 512 MiB of inputs and outputs: one copy


def test_convs_are_timed_before_the_budget_runs_out(monkeypatch):
    """With a budget for one node, the conv is measured and the pointwise chain is not."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    m = model([N("Sigmoid", ["x"], ["s"]), N("Tanh", ["s"], ["t"]),  # a pointwise chain first
               N("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3]), N("Relu", ["c"], ["y"])],
              {"x": ("float32", ["N", 3, 8, 8])}, {"t": ("float32", ["N", 3, 8, 8]), "y": ("float32", ["N", 4, 6, 6])},
              {"w": w})
    r, before = _optimized(m)
    kinds = {f.node_name: f.kind for f in r.fused}
    assert list(kinds.values()) == ["pointwise", "conv"]
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0, budget_after_one_pair=True)
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, budget_s=1.5))["tune"]
    measured = {d["node"]: not d["chosen"].startswith("not measured") for d in rec["nodes"]}
    assert [kinds[n] for n, ok in measured.items() if ok] == ["conv"]



def test_the_largest_convs_are_timed_first(monkeypatch):
    """Two convs in a row, the small one first in the graph: with a budget for one node, the
    one measured is the larger (8 -> 32 channels 3x3 over 6x6, against 3 -> 8 over 8x8)."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((8, 3, 1, 1)).astype(np.float32)
    w2 = rng.standard_normal((32, 8, 3, 3)).astype(np.float32)
    m = model([N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1]), N("Relu", ["c1"], ["r1"]),
               N("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3]), N("Relu", ["c2"], ["y"])],
              {"x": ("float32", ["N", 3, 8, 8])}, {"y": ("float32", ["N", 32, 6, 6])}, {"w1": w1, "w2": w2})
    r, before = _optimized(m)
    assert [f.kind for f in r.fused] == ["conv", "conv"]
    small, large = (f.node_name for f in r.fused)
    assert tuning.measure_order(r, {"x": (2, 3, 8, 8)}) == [1, 0]
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0, budget_after_one_pair=True)
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, budget_s=1.5))["tune"]
    measured = [d["node"] for d in rec["nodes"] if not d["chosen"].startswith("not measured")]
    assert measured == [large]

def test_a_slower_optimized_model_gives_back_the_original(monkeypatch):
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 + _fused_nodes(mm))
    with pytest.warns(OnnxfuseWarning, match="measured slower than the original"):
        out = _tune(r, before)
    assert out["tune"]["kept"] == "original" and all(d["chosen"] == "fused" for d in out["tune"]["nodes"])
    assert r.model.SerializeToString() == m.SerializeToString() and not r.fused
    assert r.report.nodes_after == r.report.nodes_before and not r.report.fused
    assert any(k.startswith(tuning.KEPT_ORIGINAL) for k in r.report.not_fused)


def test_a_library_that_cannot_load_stops_tuning_before_any_timing(monkeypatch, tmp_path):
    """ONNXFUSE_LIBRARY naming no file: tuning fails at once, naming it (`onnxfuse optimize` warns
    "not tuned: ..." and keeps the heuristics' model, or with --tune exits with it), instead of every
    candidate failing to load and the original written as "slower"."""
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 + _fused_nodes(mm))
    monkeypatch.setattr(tuning.Timer, "time", lambda *a, **k: pytest.fail("timed without a library"))
    missing = tmp_path / "libonnxfuse_ops.so"
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(missing))
    with pytest.raises(OnnxfuseError, match=f"custom-op library cannot be used .*ONNXFUSE_LIBRARY={missing} does not"):
        _tune(r, before)
    assert r.fused  # nothing decided


@pytest.mark.parametrize("explicit", [False, True])
def test_a_missing_library_leaves_the_heuristics_model_or_stops_tune(monkeypatch, tmp_path, explicit):
    """Through the tune pass: a warning and the heuristics' fused model (tuning was the default),
    or, asked for with --tune, an error naming the library."""
    from onnxfuse.pipeline import build_options, tune_pass

    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    r.before_compile = before
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(tmp_path / "missing.so"))
    opts = dataclasses.replace(build_options(target="sm_90"), tune=dataclasses.replace(CPU, explicit=explicit))
    if explicit:
        with pytest.raises(OnnxfuseError, match="^--tune: the custom-op library cannot be used"):
            tune_pass(r, opts)
        return
    with pytest.warns(OnnxfuseWarning, match="not tuned: the custom-op library cannot be used"):
        out = tune_pass(r, opts)
    assert out.fused and _fused_nodes(out.model) == len(out.fused)


def test_per_node_decisions_that_slow_the_model_are_dropped(monkeypatch):
    """The model from before the per-node decisions is kept when it is the faster one."""
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    fused = _fused_nodes(r.model)
    # the original 1.0 ms; with every node unfused 1.2 ms (as for the Transposes that
    # unfusing adds around a channels-last node); as optimized 0.8 ms
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2},
                lambda mm: 1.0 if mm is m else {0: 1.2, fused: 0.8}[_fused_nodes(mm)])
    rec = _tune(r, before)["tune"]
    assert rec["kept"] == "heuristic" and set(rec["models"]) == {"tuned", "heuristic"}
    assert all(d["chosen"].startswith("fused (leaving it to ONNX Runtime made the model slower") for d in rec["nodes"])
    assert _fused_nodes(r.model) == fused and len(r.fused) == fused


def test_a_heuristic_model_within_the_noise_keeps_the_tuned_one(monkeypatch):
    """`model-ties-keep-tuned`: the model from before the per-node decisions replaces the tuned
    one only when faster by more than MODEL_NOISE (BERT-base b8 fp16, twenty-fifth session: at
    0.780 against 0.784 ms under graphs the heuristic's was kept, and the suite then timed it at
    0.711 ms where the tuned model of the session before took 0.690)."""
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    fused = _fused_nodes(r.model)
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2},
                lambda mm: 1.0 if mm is m else {0: 0.8, fused: 0.8 * (1 - tuning.MODEL_NOISE / 2)}[_fused_nodes(mm)])
    rec = _tune(r, before)["tune"]
    assert rec["kept"] == "tuned" and set(rec["models"]) == {"tuned", "heuristic"}
    assert all(d["chosen"] == "original" for d in rec["nodes"]) and _fused_nodes(r.model) == 0


# BERT-base fp32 batch 1 on an H100 (thirty-seventh session, ms without / with CUDA graphs): the
# tuned model, the same with K-major weights (faster under graphs, slower without), the original
BERT_B1 = {"tuned": tuning.ModelTimes(0.943, 0.694), "tuned + K-major": tuning.ModelTimes(1.092, 0.661),
           "faster in both": tuning.ModelTimes(0.900, 0.650)}
ORIGINAL_B1 = tuning.ModelTimes(2.457, 1.323)


@pytest.mark.parametrize("later, cuda_graph, kept", [
    ("tuned + K-major", None, "tuned"),  # not said: 5% faster under graphs, 16% slower without
    ("tuned + K-major", True, "tuned + K-major"),
    ("tuned + K-major", False, "tuned"),
    ("faster in both", None, "faster in both"),
    ("faster in both", False, "faster in both"),
])
def test_models_are_compared_in_the_deployments_mode(later, cuda_graph, kept):
    """`model-modes`: a later candidate replaces an earlier one where it is faster in the mode the
    model will run in (`--cuda-graph`, `--no-cuda-graph`), or, not said, where it is faster in its
    faster mode and slower in neither."""
    models = [(label, label, {}) for label in ("tuned", later)]
    gates = {label: {"passed": True} for label in BERT_B1}
    assert tuning._fastest(models, BERT_B1, gates, ORIGINAL_B1, cuda_graph)[0] == kept


@pytest.mark.parametrize("cuda_graph, kept", [(None, None), (True, "graphs only"), (False, None)])
def test_a_model_slower_than_the_original_only_in_the_other_mode(cuda_graph, kept):
    """Against the original too, only the deployment's mode counts where it is given; a mode
    the original cannot run under graphs is compared without them."""
    times = {"graphs only": tuning.ModelTimes(2.6, 1.0)}
    models = [("graphs only", None, {})]
    gates = {"graphs only": {"passed": True}}
    assert (tuning._fastest(models, times, gates, ORIGINAL_B1, cuda_graph) or [None])[0] == kept
    no_graphs = tuning.ModelTimes(2.457, None)
    assert not times["graphs only"].not_slower_than(no_graphs, True)
    assert tuning.ModelTimes(2.4, None).not_slower_than(no_graphs, True)
    assert tuning.ModelTimes(2.4, None).best(True) == 2.4 and BERT_B1["tuned"].best(True) == 0.694


@pytest.mark.parametrize("flags, cuda_graph", [([], None), (["--cuda-graph"], True), (["--no-cuda-graph"], False)])
def test_the_cuda_graph_flag_reaches_tuning(monkeypatch, tmp_path, flags, cuda_graph):
    monkeypatch.setattr(tuning, "available", lambda provider="cuda": True)
    args = build_parser().parse_args(["optimize", "in.onnx", "out.onnx", "--target", "sm_90", *flags])
    assert options_from_args(args).tune.cuda_graph is cuda_graph
    args = build_parser().parse_args(["optimize", "in.onnx", "out.onnx", "--target", "sm_90", "--no-tune", *flags])
    assert options_from_args(args).tune is None  # nothing to compare: the flag changes nothing


def test_the_budget_leaves_nodes_unmeasured(monkeypatch):
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, lambda mm: 1.0)
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, budget_s=1e-9))["tune"]
    assert all(d["chosen"].startswith("not measured (tuning budget") for d in rec["nodes"])
    assert rec["kept"] == "optimized" and _fused_nodes(r.model) == len(rec["nodes"])


def test_when_the_budget_runs_out_only_measured_winners_may_be_kept(monkeypatch):
    """Nodes left unmeasured by the budget go back to ONNX Runtime when the model fusing only
    the measured winners is the fastest; the report says why for each."""
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    m = model([N("Sigmoid", ["x"], ["s"]), N("Tanh", ["s"], ["t"]),
               N("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3]), N("Relu", ["c"], ["y"])],
              {"x": ("float32", ["N", 3, 8, 8])}, {"t": ("float32", ["N", 3, 8, 8]), "y": ("float32", ["N", 4, 6, 6])},
              {"w": w})
    r, before = _optimized(m)
    # the original 1.0 ms; the conv alone fused 0.7; both fused 0.9 (the unmeasured chain loses)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2},
                lambda mm: 1.0 if mm is m else {1: 0.7, 2: 0.9}[_fused_nodes(mm)], budget_after_one_pair=True)
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, budget_s=1.5))["tune"]
    assert rec["kept"] == "measured only" and set(rec["models"]) == {"measured only", "optimized"}
    chosen = {d["kind"]: d["chosen"] for d in rec["nodes"]}
    assert chosen["conv"] == "fused" and chosen["pointwise"].startswith("left to ONNX Runtime (not measured")
    assert [f.kind for f in r.fused] == ["conv"]
    assert any(k == tuning.UNMEASURED_REASON for k in r.report.not_fused)
    # when fusing everything is faster, the unmeasured chain stays fused
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2},
                lambda mm: 1.0 if mm is m else {1: 0.7, 2: 0.6}[_fused_nodes(mm)], budget_after_one_pair=True)
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, budget_s=1.5))["tune"]
    assert rec["kept"] == "optimized" and len(r.fused) == 2


def test_only_real_capture_failures_are_cached(tmp_path, monkeypatch):
    """A model that graphs cannot capture but that runs plainly is remembered as such; one
    that does not run at all (on the H200 a missing custom-op library) is not: the next
    tuning, with the library back, must time it under graphs."""
    m = model([N("Tanh", ["x"], ["y"])], {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8])})
    feeds = static_feeds(m)
    works = {"plain": True}

    def fake_run(path, feeds, settings, library=False, collect=True):
        if settings.cuda_graph or not works["plain"]:
            raise OnnxfuseError("it failed")
        return Run(5.0, 2.0, [1.0], {}, None)

    monkeypatch.setattr(tuning, "run_model", fake_run)
    for plain, cached in ((False, False), (True, True)):
        works["plain"] = plain
        timer = tuning.Timer(TuneSettings(provider="cpu", cache=False), tmp_path)
        with pytest.raises(OnnxfuseError):
            timer.time(m, feeds, library=True, graph=True)
        assert any("error" in e for e in timer.entries.values()) == cached


def test_real_timings_are_cached(tmp_path, monkeypatch):
    """Timed for real on the CPU provider; the second run at the same shapes times nothing."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = vgg_stack(2, 8, 3, 16)
    settings = TuneSettings(provider="cpu", batch=2, iters=3, warmup=1, model_iters=3, model_warmup=1)
    records = []
    for _ in range(2):
        r, before = _optimized(m)
        records.append(_tune(r, before, settings)["tune"])
    first, second = records
    assert first["measured"] > 0 and first["cache_hits"] == 0
    assert second["measured"] == 0 and second["cache_hits"] == first["measured"]
    assert second["nodes"] == first["nodes"] and second["kept"] == first["kept"]
    assert all(d["original_ms"] > 0 and d["fused_ms"] > 0 for d in first["nodes"])
    assert len(list((tmp_path / "tune").glob("*.json"))) == 1


def test_shapes_inference_cannot_give_are_learned_by_running():
    """A Reshape to a shape that arrives as an input: the chain after it, and its output that
    a Softmax reads, have no inferred shape; one run of the model gives them (the fused
    node's output typed, as ONNX Runtime cannot infer a custom op's output type)."""
    m = model([N("Reshape", ["x", "s"], ["r"]), N("Sigmoid", ["r"], ["a"]), N("Tanh", ["a"], ["t"]),
               N("Softmax", ["t"], ["y"])],
              {"x": ("float32", [4, 6]), "s": ("int64", [2])}, {"y": ("float32", ["a", "b"])})
    r = optimize_model(m)
    (f,) = r.fused
    assert f.outputs == ("t",)
    dims = {"x": (4, 6), "s": (2,)}
    feeds = {"x": np.ones((4, 6), np.float32), "s": np.array([3, 8], np.int64)}
    infos = tuning.tensor_infos(r.model, dims, feeds, {*f.inputs, *f.outputs}, "cpu")
    for name in ("r", "t"):
        assert [d.dim_value for d in infos[name].type.tensor_type.shape.dim] == [3, 8]
    node = next(n for n in r.model.graph.node if n.domain == "onnxfuse")
    mini = tuning.fused_model(r.model, node, infos)
    assert [i.name for i in mini.graph.input] == ["i0"] and mini.graph.node[0].name == "n"
    onnx.checker.check_model(mini, full_check=True)
    orig = tuning.original_model(r.model, node, infos)
    x = static_feeds(mini)
    (a,), (e,) = _run(mini, x), _run(orig, {orig.graph.input[0].name: x["i0"]})
    np.testing.assert_allclose(a, e, rtol=1e-6)


def test_original_model_of_a_channels_last_node_is_nchw(tmp_path, monkeypatch):
    """The NHWC body's layout Transposes are not timed: the original runs NCHW, and it
    computes what the fused node computes (transposed)."""
    pytest.importorskip("triton")
    from onnxfuse.layout import BODY_TRANSPOSE_PREFIX, TO_NCHW

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(vgg_stack(3, 8, 8, 16), layout="nhwc")
    compile_pass(r, kernel_options("sm_90", layout="nhwc"))
    dims = {"x": (2, 8, 16, 16)}
    feeds = {"x": np.random.default_rng(1).standard_normal(dims["x"]).astype(np.float32)}
    node = next(n for n in r.model.graph.node if n.name == r.fused[1].node_name)  # NHWC in and out
    infos = tuning.tensor_infos(r.model, dims, feeds, {*node.input, *node.output}, "cpu")
    fused, orig = tuning.fused_model(r.model, node, infos), tuning.original_model(r.model, node, infos)
    assert not any(n.name.startswith(BODY_TRANSPOSE_PREFIX) for n in orig.graph.node)
    assert any(n.name.startswith(BODY_TRANSPOSE_PREFIX) for f in r.model.functions for n in f.node)
    dims_of = [[d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] for m in (fused, orig)]
    assert dims_of == [[2, 8, 8, 8], [2, 8, 8, 8]]  # [N, H, W, C] and [N, C, H, W] of a 2x8x8x8 tensor
    x = np.random.default_rng(2).standard_normal((2, 8, 8, 8)).astype(np.float32)  # NHWC
    (a,) = _run(fused, {"i0": x})
    (e,) = _run(orig, {orig.graph.input[0].name: np.ascontiguousarray(x.transpose(TO_NCHW))})
    np.testing.assert_allclose(np.ascontiguousarray(a.transpose(TO_NCHW)), e, rtol=1e-5,
                               atol=1e-5 * float(np.abs(e).max()))


def test_layers_of_equal_shapes_are_timed_once(tmp_path, monkeypatch):
    """Two convs with the same shapes and other weights: one measurement serves both."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal((8, 4, 3, 3)).astype(np.float32) for _ in range(2))
    m = model([N("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["y1"]),
               N("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1]), N("Relu", ["c2"], ["y2"])],
              {"x": ("float32", [2, 4, 8, 8])}, {"y1": ("float32", [2, 8, 8, 8]), "y2": ("float32", [2, 8, 8, 8])},
              {"w1": w1, "w2": w2})
    r, before = _optimized(m)
    assert len(r.fused) == 2
    n_candidates = len(candidates(kernel_spec(r.model, r.fused[1], "tf32")))
    rec = _tune(r, before, TuneSettings(provider="cpu", iters=2, warmup=1, model_iters=2, model_warmup=1))["tune"]
    a, b = rec["nodes"]
    assert (a["original_ms"], a["fused_ms"]) == (b["original_ms"], b["fused_ms"])
    # the second node's two one-node models, and its candidate tiles: these convs run on fewer
    # programs than SMs, so their tiles are searched (`conv-under-one-wave`), the second's from the first's
    assert rec["cache_hits"] == 2 + n_candidates


def _two_convs(k2: int) -> onnx.ModelProto:
    """Two 3x3 convs (+ Relu) of the same input, 8 and k2 output channels: layers of the same
    shapes where k2 is 8."""
    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((8, 4, 3, 3)).astype(np.float32), rng.standard_normal((k2, 4, 3, 3)).astype(np.float32)
    return model([N("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["y1"]),
                  N("Conv", ["x", "w2"], ["c2"], pads=[1, 1, 1, 1]), N("Relu", ["c2"], ["y2"])],
                 {"x": ("float32", [2, 4, 8, 8])}, {"y1": ("float32", [2, 8, 8, 8]), "y2": ("float32", [2, k2, 8, 8])},
                 {"w1": w1, "w2": w2})


@pytest.mark.parametrize("same_shapes", [True, False])
def test_past_the_budget_layers_timed_before_are_still_decided(tmp_path, monkeypatch, same_shapes):
    """The budget runs out after the first conv. A second conv of the same shapes is decided
    from the first one's timings (nothing more is run); one of other shapes is not measured.
    (On the H200, BERT-base at batch 8 left 10 of its 12 identical softmax nodes unmeasured
    with their times already known.)"""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m = _two_convs(8 if same_shapes else 6)
    r, before = _optimized(m)
    assert len(r.fused) == 2
    runs = []

    def fake_run(path, feeds, settings, library=False, collect=True):
        assert not collect  # no full garbage collection per session: 0.1 s each with torch imported
        runs.append(library)
        return Run(5.0, 2.0, [0.1 if library else 0.3], {}, None, 3.0, 4.0)

    monkeypatch.setattr(tuning, "run_model", fake_run)
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: 100.0 if runs else 0.0)  # spent after a run
    monkeypatch.setattr(tuning.Timer, "time_models",
                        lambda self, models, feeds, modes: {(lb, g): 1.0 for lb in models for g in modes})
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, budget_s=1.0))["tune"]
    first, second = rec["nodes"]
    assert first["chosen"] == "fused" and runs == [False, True]  # one pair timed
    spent = rec["node_runs"]  # where the timings' seconds went: two runs' loads, first runs, warm-ups, closes
    assert spent["runs"] == 2 and spent["load_s"] == 0.01 and spent["first_run_s"] == 0.004
    assert spent["warmup_s"] == 0.006 and spent["close_s"] == 0.008
    if same_shapes:
        assert second["chosen"] == "fused" and (second["original_ms"], second["fused_ms"]) == (0.3, 0.1)
        assert rec["cache_hits"] == 2
    else:
        assert second["chosen"] == "not measured (tuning budget of 1 s spent)" and rec["cache_hits"] == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
def test_a_lookup_keys_the_model_as_a_timing_does(tmp_path, dtype):
    """Past the budget nodes are looked up with dtype-and-shape stand-ins for their inputs
    (16 copies' random data would be 50 MB at BERT-base's FFN): the key is the same."""
    m = model([N("Identity", ["x"], ["y"])], {"x": (dtype, [8, 128, 768])}, {"y": (dtype, [8, 128, 768])})
    timer = tuning.Timer(TuneSettings(provider="cpu", cache=False), tmp_path)
    stand_ins = tuning._shape_only_feeds(m)
    assert all(a.nbytes == 0 or a.strides == (0, 0, 0) for a in stand_ins.values())
    assert timer._key(m, stand_ins, True, True) == timer._key(m, static_feeds(m), True, True)


def test_the_node_margin_shrinks_with_the_copies_timed_per_run():
    """A fused node 25% slower than its original is a tie at 2 µs of noise when timed one copy
    per run, and a loss when 16 copies per run divide the noise by 16."""
    orig, fused = 0.00268, 0.00334  # ms: the BERT-base softmax on the H200
    assert fused - orig <= tuning.node_margin(orig, 1)
    assert fused - orig > tuning.node_margin(orig, 16)
    assert tuning.node_margin(10.0, 16) == pytest.approx(0.2)  # 2% of a long node


@pytest.mark.parametrize("orig_us, fused_us, offered, goes_back", [
    (3.50, 3.55, False, False),  # a matched node within the margin stays fused (it saves a kernel's traffic)
    (3.50, 3.55, True, True),    # an offered one goes back: ORT fuses these nodes itself
    (1.78, 1.89, True, True),
    (3.50, 3.45, True, True),    # faster, but within the margin (0.3 µs bundled): still a tie
    (12.54, 3.30, True, False),  # faster by more than the margin: kept
    (6.37, 8.13, False, True),   # slower by more than the margin: back either way
])
def test_offered_nodes_are_kept_only_where_faster(orig_us, fused_us, offered, goes_back):
    """`offered-ties-to-ort`: on the H200 (twenty-first session, BERT-base fp16) every
    SkipLayerNormalization offered to FusedRows timed a tie (3.50 against 3.55 µs at b8, 1.78
    against 1.89 at b1) and the ties were kept: 25 FusedRows took 78 µs in the model where ORT's
    24 SkipLayerNormalization took 66. An offered node now needs a lead beyond the margin."""
    d = tuning.NodeDecision("n", "rows", original_ms=orig_us / 1e3, fused_ms=fused_us / 1e3, mode=tuning.BUNDLED,
                            original_kernels=1, fused_kernels=1, offered=offered)
    assert d.loses() is goes_back


def test_the_record_says_where_the_seconds_went(monkeypatch):
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, lambda mm: 1.0 + _fused_nodes(mm))
    out = _tune(r, before)
    phases = out["tune"]["phases"]
    assert set(phases) == {"nodes", "recompile", "models", "accuracy"} and all(v >= 0 for v in phases.values())
    assert "(nodes " in out["summary"] and "models " in out["summary"]
    # and the nodes phase's own steps: the shapes, the one-node models and their pairs' timings
    steps = out["tune"]["node_steps"]
    assert {"shapes", "one-node models", "pairs"} <= set(steps) and all(v >= 0 for v in steps.values())
    assert sum(steps.values()) <= phases["nodes"] + 0.01
    assert "\n  nodes: shapes " in out["summary"]


def test_shapes_learned_by_running_a_model_with_fused_convs(tmp_path, monkeypatch):
    """Fused convs, then a Reshape to a shape that arrives as an input and a fused chain after
    it (YOLOv8n's head slices by computed indices): inference cannot size the chain, so the
    model runs once. ONNX Runtime types a custom op's output from the model's value_info,
    which inference drops to start from the given shapes: the run must keep it. It did not,
    and every model with fused convs and such a gap failed here ("type inference failed")."""
    pytest.importorskip("triton")
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    inits = {f"w{i}": (rng.standard_normal((8, c, 3, 3)) / 9).astype(np.float32) for i, c in ((1, 4), (2, 8))}
    m = model([N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["a1"]),
               N("Conv", ["a1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), N("Relu", ["c2"], ["a2"]),
               N("Reshape", ["a2", "s"], ["r"]), N("Sigmoid", ["r"], ["g"]), N("Tanh", ["g"], ["y"])],
              {"x": ("float32", [1, 4, 8, 8]), "s": ("int64", [2])}, {"y": ("float32", ["a", "b"])}, inits)
    r = optimize_model(m, layout="nhwc")
    compile_pass(r, kernel_options("sm_90", layout="nhwc"))
    assert [f.kind for f in r.fused] == ["conv", "conv", "pointwise"]
    dims = {"x": (1, 4, 8, 8), "s": (2,)}
    feeds = {"x": np.ones((1, 4, 8, 8), np.float32), "s": np.array([8, 64], np.int64)}
    needed = {x for n in r.model.graph.node if n.domain == "onnxfuse" for x in (*n.input, *n.output)}
    infos = tuning.tensor_infos(r.model, dims, feeds, needed, "cpu")
    for name in ("r", "y"):
        assert [d.dim_value for d in infos[name].type.tensor_type.shape.dim] == [8, 64]
        assert infos[name].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


# ---- the accuracy gate at optimize time ---------------------------------------------------

def _fake_outputs(monkeypatch, errors: dict[str, float]):
    """Timer.outputs answering from a table, on every input set alike: the reference (float64)
    is ones, ORT's default run is off by errors["ort"], a candidate by errors[its label]
    (default: ORT's error)."""
    def outputs(self, models, feed_sets):
        out = {}
        for label in models:
            err = 0.0 if label == "reference" else errors.get(label, errors["ort"])
            out[label] = dict.fromkeys(feed_sets, {"y": np.full((2, 3), 1.0 + err, np.float32)})
        return out

    monkeypatch.setattr(tuning.Timer, "outputs", outputs)
    monkeypatch.setattr(tuning.Timer, "float64_reference", lambda self, m, f: ({"y": np.ones((2, 3))}, None))


def _tune_precise(r, before, recompiled: list):
    def precise(res):
        recompiled.append(res)
        # other kernels, as a real recompile at tf32x3 attaches: other bytes (the gate's cache key)
        onnx.helper.set_model_props(res.model, {"kernels": "tf32x3"})
        return dict(NOT_COMPILED, summary="kernels: precise")

    return tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), CPU, [90],
                       recompile_precise=precise)


def test_a_candidate_as_accurate_as_ort_is_kept(monkeypatch):
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    _fake_outputs(monkeypatch, {"ort": 1e-3, "optimized": 1.5e-3})
    recompiled = []
    rec = _tune_precise(r, before, recompiled)["tune"]
    assert rec["kept"] == "optimized" and not recompiled
    assert rec["accuracy"]["optimized"]["passed"] and rec["accuracy"]["optimized"]["ort_max_abs_err"] == \
        pytest.approx(1e-3, rel=1e-3)
    # every element off by the same amount: the RMS errors are the max ones, reported beside them
    g = rec["accuracy"]["optimized"]
    assert g["rms_err"] == pytest.approx(1.5e-3, rel=1e-3) and g["ort_rms_err"] == pytest.approx(1e-3, rel=1e-3)
    assert "max abs err 0.0015 vs ORT's own 0.001, RMS 0.0015 vs 0.001" in tuning.summary(rec)
    assert "accurate <- kept" in tuning.summary(rec)


def test_a_fast_but_less_accurate_model_is_recompiled_precise(monkeypatch):
    """Faster than the original but 10x ORT's own error (ppocr_cls at batch 1 on the H200: ORT's
    cuDNN picked fp32 algorithms, 2.2e-5, the tf32 kernels 1.2e-3): the same fusions are
    compiled at tf32x3 and kept when those pass the gate and are still not slower."""
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    _fake_outputs(monkeypatch, {"ort": 1e-4, "optimized": 1e-3, "precise (tf32x3)": 1e-5})
    recompiled = []
    with pytest.warns(OnnxfuseWarning, match="less accurate than ONNX Runtime's own default.*tf32x3 instead"):
        out = _tune_precise(r, before, recompiled)
    rec = out["tune"]
    assert len(recompiled) == 1 and recompiled[0] is not before and rec["kept"] == "precise (tf32x3)"
    assert not rec["accuracy"]["optimized"]["passed"] and "output 'y'" in rec["accuracy"]["optimized"]["failure"]
    assert out["summary"].startswith("kernels: precise") and "LESS ACCURATE than ORT" in out["summary"]
    assert r.model is recompiled[0].model and r.fused


def _conv_then_chain() -> onnx.ModelProto:
    """A conv + ReLU, a Reshape, then Sigmoid -> Tanh: one conv node and one pointwise node."""
    w = (np.random.default_rng(0).standard_normal((8, 4, 3, 3)) / 6).astype(np.float32)
    return model([N("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["a"]),
                  N("Reshape", ["a", "s"], ["r"]), N("Sigmoid", ["r"], ["g"]), N("Tanh", ["g"], ["y"])],
                 {"x": ("float32", [2, 4, 8, 8])}, {"y": ("float32", [2, 512])},
                 {"w": w, "s": np.array([2, 512], np.int64)})


def test_the_precise_model_leaves_ort_no_node_it_may_run_in_tf32(monkeypatch):
    """Every node timed faster in ONNX Runtime, but the tuned model less accurate than ORT's
    own default: in the precise model the conv stays fused (ORT may run it in TF32 or fp32
    from one session to the next: PP-OCR cls b1 on the H200, eighteenth session) and the
    pointwise chain, which ORT computes in fp32, goes back to it. The record and the report
    say which."""
    r, before = _optimized(_conv_then_chain())
    assert sorted(f.kind for f in r.fused) == ["conv", "pointwise"]
    assert [tuning.ort_may_use_tf32(f) for f in sorted(r.fused, key=lambda f: f.kind)] == [True, False]
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, lambda mm: 1.0 - 0.1 * _fused_nodes(mm))
    _fake_outputs(monkeypatch, {"ort": 1e-4, "tuned": 1e-3, "heuristic": 1e-3, "precise (tf32x3)": 1e-5})
    recompiled = []
    with pytest.warns(OnnxfuseWarning, match="tf32x3 instead"):
        out = _tune_precise(r, before, recompiled)
    rec = out["tune"]
    assert rec["kept"] == "precise (tf32x3)" and [f.kind for f in recompiled[0].fused] == ["conv"]
    assert [f.kind for f in r.fused] == ["conv"]
    conv = next(d for d in rec["nodes"] if d["node"].startswith("conv"))
    chain = next(d for d in rec["nodes"] if not d["node"].startswith("conv"))
    assert conv["chosen"].startswith("fused at tf32x3") and chain["chosen"] == "original"
    assert f"{conv['node']}: fused at tf32x3" in out["summary"]
    reasons = list(r.report.not_fused)
    assert any(chain["node"] in k for k in reasons) and not any(conv["node"] in k for k in reasons)


def test_the_gate_checks_image_like_inputs_too(monkeypatch):
    """PP-OCR's direction classifier at batch 1 on the H200: on N(0, 1) inputs ORT's own error
    was 1.8e-4 and the tf32 model's 2.3e-4 (a pass); on images in [0, 1) 2.2e-5 against 6.7e-4,
    and `bench` failed it. The gate checks both sets: the model fails on the second and is
    compiled at tf32x3."""
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    errors = {"N(0, 1)": {"ort": 1.8e-4, "optimized": 2.3e-4, "precise (tf32x3)": 1e-5},
              "uniform [0, 1)": {"ort": 2.2e-5, "optimized": 6.7e-4, "precise (tf32x3)": 1e-5}}

    def outputs(self, models, feed_sets):
        def run(label, feeds):
            images = all(v.min() >= 0 and v.max() < 1 for v in feeds.values())
            table = errors["uniform [0, 1)" if images else "N(0, 1)"]
            err = 0.0 if label == "reference" else table.get(label, table["ort"])
            return {"y": np.full((2, 3), 1.0 + err, np.float32)}

        assert list(feed_sets) == ["N(0, 1)", "uniform [0, 1)"]  # both sets in one session per model
        return {label: {name: run(label, feeds) for name, feeds in feed_sets.items()} for label in models}

    monkeypatch.setattr(tuning.Timer, "outputs", outputs)
    monkeypatch.setattr(tuning.Timer, "float64_reference", lambda self, m, f: ({"y": np.ones((2, 3))}, None))
    recompiled = []
    with pytest.warns(OnnxfuseWarning, match="tf32x3 instead"):
        rec = _tune_precise(r, before, recompiled)["tune"]
    gate = rec["accuracy"]["optimized"]
    assert not gate["passed"] and gate["inputs"] == "uniform [0, 1)"
    assert gate["max_abs_err"] == pytest.approx(6.7e-4, rel=1e-2)
    assert gate["ort_max_abs_err"] == pytest.approx(2.2e-5, rel=1e-2)
    assert rec["kept"] == "precise (tf32x3)" and rec["accuracy"]["precise (tf32x3)"]["passed"]


def test_gate_draws_grow_as_outputs_shrink():
    """One draw per distribution once the smallest output has GATE_ELEMENTS elements; more
    (at most GATE_MAX_DRAWS) below that; one where the size is unknown."""
    assert [tuning.gate_draws(n) for n in (None, 0, 1, 2, 32, 64, 100, 256, 1000)] == [1, 1, 8, 8, 8, 4, 3, 1, 1]


def test_more_draws_keep_the_first_sets_and_add_fresh_ones():
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32),
             "k": np.array([3], np.int64)}
    one, three = tuning.accuracy_feeds(feeds), tuning.accuracy_feeds(feeds, draws=3)
    assert list(one) == ["N(0, 1)", "uniform [0, 1)"]
    assert list(three) == ["N(0, 1)", "N(0, 1) #2", "N(0, 1) #3", "uniform [0, 1)", "uniform [0, 1) #2",
                           "uniform [0, 1) #3"]
    for name in one:  # the one-draw sets are the first of each distribution
        np.testing.assert_array_equal(one[name]["x"], three[name]["x"])
    xs = [f["x"] for f in three.values()]
    assert len({x.tobytes() for x in xs}) == 6 and all(x.dtype == np.float32 for x in xs)
    assert all(0 <= f["x"].min() and f["x"].max() < 1 for k, f in three.items() if k.startswith("uniform"))
    assert min(three["N(0, 1) #2"]["x"].min(), three["N(0, 1) #3"]["x"].min()) < 0
    assert all(f["k"] is feeds["k"] for f in three.values())  # integers stay as given


def test_smallest_output_counts_elements_at_the_tuning_shapes():
    """A classifier head of two probabilities beside a feature map: the smallest float output
    at the given batch. Real shape inference on the CPU."""
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
             "fc": rng.standard_normal((8, 2)).astype(np.float32)}
    m = model([N("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
               N("GlobalAveragePool", ["c"], ["p"]), N("Flatten", ["p"], ["f"]), N("MatMul", ["f", "fc"], ["l"]),
               N("Softmax", ["l"], ["y"], axis=-1)],
              {"x": ("float32", ["N", 3, 8, 8])}, {"y": ("float32", ["N", 2]), "c": ("float32", ["N", 8, 8, 8])},
              inits)
    for batch in (1, 16):
        dims = {"x": (batch, 3, 8, 8)}
        assert tuning.smallest_output(m, dims, tuning.feeds_for(m, dims), "cpu") == 2 * batch


def test_draws_stay_within_the_float64_reference_budget(monkeypatch):
    """Each set's float64 reference costs the model's FLOPs on the CPU: the draws of both
    distributions together stay within FLOAT64_MAX_FLOPS; past it the reference is a GPU run
    and the draws are not limited by it."""
    m = vgg_stack(2, 8, 3, 16)
    feeds = tuning.feeds_for(m, {"x": (2, 3, 16, 16)})
    flops = tuning.model_cost(m, {"x": (2, 3, 16, 16)}).flops
    assert tuning.affordable_draws(m, feeds) == tuning.FLOAT64_MAX_FLOPS // (2 * flops) >= tuning.GATE_MAX_DRAWS
    monkeypatch.setattr(tuning, "FLOAT64_MAX_FLOPS", 6 * flops)
    assert tuning.affordable_draws(m, feeds) == 3
    monkeypatch.setattr(tuning, "FLOAT64_MAX_FLOPS", flops)
    assert tuning.affordable_draws(m, feeds) == 1
    monkeypatch.setattr(tuning, "FLOAT64_MAX_FLOPS", flops / 2)
    assert tuning.affordable_draws(m, feeds) == tuning.GATE_MAX_DRAWS


def test_a_small_output_is_gated_on_more_inputs(monkeypatch):
    """Two output elements: one input's max error is noise (PP-OCR's direction classifier at
    batch 1: the tuning's two sets passed, the suite's image failed). With a small output the
    gate checks GATE_MAX_DRAWS sets of each distribution and fails a model that one of them
    catches; with a large one it checks one set of each, as before."""
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    seen = []

    def outputs(self, models, feed_sets):
        seen.append(list(feed_sets))

        def run(label, name):
            err = 0.0 if label == "reference" else 6.7e-4 if (label, name) == ("optimized", "uniform [0, 1) #5") \
                else 1e-5 if label.startswith("precise") else 1.8e-4 if label == "optimized" else 2e-4
            return {"y": np.full((1, 2), 0.5 + err, np.float32)}

        return {label: {name: run(label, name) for name in feed_sets} for label in models}

    monkeypatch.setattr(tuning.Timer, "outputs", outputs)
    monkeypatch.setattr(tuning.Timer, "float64_reference", lambda self, m, f: ({"y": np.full((1, 2), 0.5)}, None))
    monkeypatch.setattr(tuning, "smallest_output", lambda *a: 2)
    recompiled = []
    with pytest.warns(OnnxfuseWarning, match="tf32x3 instead"):
        out = _tune_precise(r, before, recompiled)
    rec = out["tune"]
    assert len(rec["gate_inputs"]) == 2 * tuning.GATE_MAX_DRAWS and all(s == rec["gate_inputs"] for s in seen)
    gate = rec["accuracy"]["optimized"]
    assert not gate["passed"] and gate["inputs"] == "uniform [0, 1) #5"
    assert rec["kept"] == "precise (tf32x3)" and "on 16 input sets" in out["summary"]

    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    monkeypatch.setattr(tuning, "smallest_output", lambda *a: 10_000)
    rec = _tune_precise(r, before, [])["tune"]
    assert rec["gate_inputs"] == ["N(0, 1)", "uniform [0, 1)"] and rec["kept"] == "optimized"


@pytest.mark.parametrize("precise_error", [1e-3, None], ids=["precise-fails-too", "no-precise-build"])
def test_a_model_less_accurate_than_ort_is_not_written(monkeypatch, precise_error):
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    _fake_outputs(monkeypatch, {"ort": 1e-4, "optimized": 1e-3, "precise (tf32x3)": precise_error or 0.0})
    recompiled = []
    with pytest.warns(OnnxfuseWarning, match="less accurate than ONNX Runtime's own default"):
        if precise_error is None:
            rec = _tune(r, before)["tune"]
        else:
            rec = _tune_precise(r, before, recompiled)["tune"]
    assert rec["kept"] == "original" and len(recompiled) == (precise_error is not None)
    assert r.model.SerializeToString() == m.SerializeToString() and not r.fused
    assert any(k.startswith(tuning.KEPT_INACCURATE) for k in r.report.not_fused)


def test_accuracy_runs_the_reference_with_tf32_off(monkeypatch):
    """Without a float64 reference (here: no inputs to evaluate it on) the reference is the
    original with TF32 off, ORT's default run has it on, and every candidate runs with the
    library and TF32 allowed (as users run it)."""
    seen = {}

    def outputs(self, models, feed_sets):
        seen.update({k: (lib, tf32) for k, (_, lib, tf32) in models.items()})
        return {k: dict.fromkeys(feed_sets, {"y": np.ones(3, np.float32)}) for k in models}

    monkeypatch.setattr(tuning.Timer, "outputs", outputs)
    m = vgg_stack(2, 8, 3, 16)
    gates = tuning.accuracy(tuning.Timer(CPU, None), m, {"optimized": m}, {})
    assert seen == {"reference": (False, False), "ort": (False, True), "optimized": (True, True)}
    assert gates["optimized"] == {"passed": True, "max_abs_err": 0.0, "ort_max_abs_err": 0.0, "failure": None,
                                  "reference": "TF32 off (input 'x' has no value)", "rms_err": 0.0,
                                  "ort_rms_err": 0.0}


def test_accuracy_against_the_float64_reference_where_it_is_cheap(monkeypatch, tmp_path):
    """The reference is the original in float64 (no TF32-off run): the candidate, here the
    original itself, is off by ORT's own error exactly. Above FLOAT64_MAX_FLOPS the TF32-off
    run again, with the reason."""
    m = vgg_stack(2, 8, 3, 16)
    feeds = tuning.feeds_for(m, {"x": (2, 3, 16, 16)})
    real = tuning.Timer.outputs
    seen = []
    monkeypatch.setattr(tuning.Timer, "outputs", lambda self, models, f: seen.extend(models) or real(self, models, f))
    timer = tuning.Timer(CPU, tmp_path)
    gate = tuning.accuracy(timer, m, {"optimized": m}, feeds)["optimized"]
    assert seen == ["ort", "optimized"] and gate["reference"] == "float64" and gate["passed"]
    assert 0 < gate["ort_max_abs_err"] == gate["max_abs_err"] < 1e-4
    tuning.accuracy(timer, m, {"again": m}, feeds)
    assert timer._float64 and len(timer._float64) == 1  # evaluated once per tuning
    monkeypatch.setattr(tuning, "FLOAT64_MAX_FLOPS", 1e3)
    seen.clear()
    gate = tuning.accuracy(tuning.Timer(CPU, tmp_path), m, {"optimized": m}, feeds)["optimized"]
    assert "reference" in seen and gate["reference"].startswith("TF32 off (0 GFLOPs at these shapes, more than 0 G")


def test_both_input_sets_run_in_one_session_per_model(monkeypatch, tmp_path):
    """The gate's two input sets (`accuracy_feeds`) go through one session per model: on CUDA a
    session's first run searches cuDNN's algorithms, and the accuracy step was the longest of
    tuning's phases on the H200 (up to 16 s for RegNetY). Real runs on the CPU provider."""
    m = vgg_stack(2, 8, 3, 16)
    sets = tuning.accuracy_feeds(tuning.feeds_for(m, {"x": (2, 3, 16, 16)}))
    real = tuning.evaluate_model_on
    sessions = []

    def counted(path, feed_list, *a, **k):
        sessions.append(len(feed_list))
        return real(path, feed_list, *a, **k)

    monkeypatch.setattr(tuning, "evaluate_model_on", counted)
    gates = tuning.accuracy_on(tuning.Timer(CPU, tmp_path), m, {"optimized": m}, sets)
    assert sessions == [2, 2]  # the original under ORT's defaults, the candidate
    g = gates["optimized"]
    assert g["passed"] and g["reference"] == "float64" and g["inputs"] in sets


def test_gates_are_remembered_for_the_same_bytes_and_inputs(monkeypatch, tmp_path):
    """A gate is cached as a timing is: the same original, candidate and input sets (optimize
    again, or the suite's second tuning for --cuda-graph) give the remembered record with no
    session; other weights, other inputs or another library are gated anew, and a candidate
    that could not run is not remembered. Real runs on the CPU provider."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    settings = TuneSettings(provider="cpu", batch=2, cache=True)
    m = vgg_stack(2, 8, 3, 16)
    sets = tuning.accuracy_feeds(tuning.feeds_for(m, {"x": (2, 3, 16, 16)}))
    real = tuning.evaluate_model_on
    sessions = []
    monkeypatch.setattr(tuning, "evaluate_model_on", lambda *a, **k: sessions.append(1) or real(*a, **k))
    first = tuning.Timer(settings, tmp_path / "a")
    (tmp_path / "a").mkdir()
    gates = tuning.accuracy_on(first, m, {"optimized": m}, sets)
    assert len(sessions) == 2 and first.measured == 1 and gates["optimized"]["passed"]
    first.save()
    again = tuning.Timer(settings, tmp_path / "a")  # a later process: from the cache file
    sessions.clear()
    assert tuning.accuracy_on(again, m, {"optimized": m}, sets) == gates
    assert sessions == [] and again.hits == 1
    other = onnx.ModelProto()
    other.CopyFrom(m)
    w = other.graph.initializer[0]
    w.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w) * 1.001, w.name))
    tuning.accuracy_on(again, m, {"optimized": other}, sets)
    assert len(sessions) == 2  # the original under ORT's defaults, then the candidate
    sessions.clear()
    tuning.accuracy_on(again, m, {"optimized": m}, tuning.accuracy_feeds(tuning.feeds_for(m, {"x": (2, 3, 16, 16)}),
                                                                           seed=7))
    assert len(sessions) == 2
    monkeypatch.setattr(tuning, "_library_digest", lambda: "another build of the library")
    sessions.clear()
    tuning.accuracy_on(again, m, {"optimized": m}, sets)
    assert len(sessions) == 1  # gated anew (the original's ORT runs are this Timer's already)
    broken = onnx.ModelProto()
    broken.CopyFrom(m)
    broken.graph.node[0].op_type = "NoSuchOp"
    before = dict(again.entries)
    assert not tuning.accuracy_on(again, m, {"broken": broken}, sets)["broken"]["passed"]
    assert again.entries == before


def test_accuracy_is_gated_only_where_tf32_was_chosen(monkeypatch):
    """The gate guards the TF32 choice: with exact conv precisions (and for float16 convs)
    no candidate is run for it, and the record says it was not checked."""
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))

    def outputs(self, models, feed_sets):
        raise AssertionError("no accuracy run expected")

    monkeypatch.setattr(tuning.Timer, "outputs", outputs)
    rec = tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), CPU, [90],
                      conv_precision="ieee")["tune"]
    assert rec["kept"] == "optimized" and rec["accuracy"] is None


def _reshape_matmul() -> onnx.ModelProto:
    """Shape arithmetic (Shape -> Gather -> Concat -> Reshape) before a MatMul: nothing fuses,
    but --shape folds the arithmetic, and ONNX Runtime may then fuse the graph differently."""
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    nodes = [N("Shape", ["x"], ["s"]), N("Gather", ["s", "i0"], ["n"], axis=0),
             N("Unsqueeze", ["n", "ax"], ["n1"]), N("Concat", ["n1", "minus1"], ["shape"], axis=0),
             N("Reshape", ["x", "shape"], ["r"]), N("MatMul", ["r", "w"], ["y"])]
    inits = {"w": w, "i0": np.array(0, np.int64), "ax": np.array([0], np.int64),
             "minus1": np.array([16], np.int64)}
    return model(nodes, {"x": ("float32", ["N", 4, 4])}, {"y": ("float32", ["N", 8])}, inits, opset=17)


@pytest.mark.parametrize("folded_ms,kept", [(1.2, "original"), (0.8, "optimized")])
def test_a_model_only_folded_is_still_checked_against_the_original(monkeypatch, folded_ms, kept):
    """Issue 17: a 4-layer torch encoder with nothing fused, its shape arithmetic folded at
    --shape, ran 0.92x the original at batch 8 on the H200 (ORT fused the static graph
    differently) and was written without a check. The tune pass now measures a model that
    the passes changed even when no node is fused, and writes the original when it is slower."""
    import dataclasses

    from onnxfuse.pipeline import build_options

    m = _reshape_matmul()
    opts = dataclasses.replace(build_options(target="sm_90", layout="nchw", tune="off", shapes={"N": (2,)}),
                               tune=TuneSettings(provider="cpu", batch=2, cache=False))
    _fake_timer(monkeypatch, {}, lambda mm: 1.0 if mm is m else folded_ms)
    if kept == "original":
        with pytest.warns(OnnxfuseWarning, match="measured slower than the original"):
            r = optimize_model(m, options=opts)
    else:
        r = optimize_model(m, options=opts)
    assert not r.fused and r.report.static_shapes.startswith("static shapes")
    rec = r.report.compile["tune"]
    assert rec["kept"] == kept and set(rec["models"]) == {"optimized"} and rec["nodes"] == []
    if kept == "original":
        assert r.model.SerializeToString() == m.SerializeToString()
    else:
        assert not [n for n in r.model.graph.node if n.op_type == "Shape"]


def _attention_then_pointwise():
    from tests.test_attention_patterns import _heads

    m = _heads("add")
    m.graph.node.append(helper.make_node("Relu", ["y"], ["y_relu"]))
    m.graph.node.append(helper.make_node("Sigmoid", ["y_relu"], ["y_out"]))
    m.graph.output[0].name = "y_out"
    return m


def test_attention_tiles_are_searched_without_tune_configs(monkeypatch):
    """FusedAttention's tile heuristic is measured on few shapes (Kind.search_configs): tuning
    times its candidate configurations even without `--tune`, and only its (a pointwise chain's are
    not); the fastest configuration's time is the node's."""
    r, before = _optimized(_attention_then_pointwise())
    assert sorted(f.kind for f in r.fused) == ["attention", "pointwise"]
    searched = []

    def search(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=False, steps=None):
        searched.append(f.kind)
        return 0.05, "tile 16x16"

    monkeypatch.setattr(tuning, "_search_configs", search)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    rec = _tune(r, before)["tune"]
    assert searched == ["attention"]
    (att,) = [d for d in rec["nodes"] if d["kind"] == "attention"]
    assert att["chosen"] == "tile 16x16" and att["fused_ms"] == 0.05


def test_configurations_are_timed_after_every_nodes_own_kernel(monkeypatch):
    """A search (one compile per tile) comes after every node's own pair of timings, so it
    cannot spend the budget that a later node needed; a search that finds a slower tile than
    the original turns the node back."""
    r, before = _optimized(_attention_then_pointwise())
    events = []
    time_pair = tuning._time_pair

    def pair(timer, orig, mini, graphs, cached_only=False):
        events.append("pair")
        return time_pair(timer, orig, mini, graphs, cached_only)

    def search(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=False, steps=None):
        events.append("search")
        return 0.3, "tile 16x16"  # slower than the original's 0.2

    monkeypatch.setattr(tuning, "_time_pair", pair)
    monkeypatch.setattr(tuning, "_search_configs", search)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    rec = _tune(r, before)["tune"]
    assert events == ["pair", "pair", "search"]
    (att,) = [d for d in rec["nodes"] if d["kind"] == "attention"]
    assert att["chosen"] == "original" and att["fused_ms"] == 0.3
    (pw,) = [d for d in rec["nodes"] if d["kind"] == "pointwise"]
    assert pw["chosen"] == "fused"


def test_no_configuration_is_timed_past_the_budget(monkeypatch):
    r, before = _optimized(_attention_then_pointwise())
    searched = []
    monkeypatch.setattr(tuning, "_search_configs", lambda *a, **k: searched.append(a) or (0.05, "tile 16x16"))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)),
                budget_after_one_pair=True)
    rec = _tune(r, before)["tune"]
    assert not searched
    chosen = {d["kind"]: d["chosen"] for d in rec["nodes"]}
    assert chosen["attention"] == "fused" and chosen["pointwise"].startswith("not measured (tuning budget")


@pytest.mark.parametrize("same_shapes", [True, False])
def test_past_the_budget_a_layer_like_a_searched_one_is_searched_from_the_cache(monkeypatch, same_shapes):
    """The budget runs out during the first conv's search. A second conv of the same shapes is
    still searched, from remembered timings alone (cached_only: its tiles are compile-cache hits
    and their times known); one of other shapes is not. (On the H200, BERT-base b8 fp16: two of
    twelve identical attention layers got the searched 7.1 µs tile, ten the default's 10.3.)"""
    m = _two_convs(8 if same_shapes else 6)
    r, before = _optimized(m)
    assert [f.kind for f in r.fused] == ["conv", "conv"]
    searched = []

    def search(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=False, steps=None):
        searched.append((f.node_name, cached_only))
        return (0.04, "tile 16x16") if not cached_only or same_shapes else None

    monkeypatch.setattr(tuning, "_search_configs", search)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.1 * _fused_nodes(mm))
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: 1e6 if searched else 0.0)  # spent by the first search
    rec = _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, configs=True, budget_s=1.0))["tune"]
    first, second = (f.node_name for f in r.fused)
    if same_shapes:
        assert searched == [(first, False), (second, True)]
        assert [d["chosen"] for d in rec["nodes"]] == ["tile 16x16", "tile 16x16"]
    else:
        assert searched == [(first, False)]
        assert [d["chosen"] for d in rec["nodes"]] == ["tile 16x16", "fused"]


def test_configurations_of_the_longest_nodes_are_searched_first(monkeypatch):
    """The budget may end before the last search: the node with the most fused time at stake
    goes first (an 8-channel conv timed 0.8 ms before a 16-channel one at 0.4, which the
    measuring order, largest roofline time first, puts first)."""
    m = _two_convs(16)
    r, before = _optimized(m)
    searched = []

    def time(self, mm, feeds, library, graph=False, cached_only=False):
        if not _fused_nodes(mm):
            return 2.0
        ch = max(d.dim_value for o in mm.graph.output for d in o.type.tensor_type.shape.dim[1:2])
        return 0.05 * (24 - ch)

    def search(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=False, steps=None):
        searched.append(d.fused_ms)
        return None

    monkeypatch.setattr(tuning.Timer, "time", time)
    monkeypatch.setattr(tuning.Timer, "time_models",
                        lambda self, models, feeds, modes: {(lb, g): 1.0 for lb in models for g in modes})
    monkeypatch.setattr(tuning, "_search_configs", search)
    _tune(r, before, TuneSettings(provider="cpu", batch=2, cache=False, configs=True))
    assert len(searched) == 2 and searched[0] > searched[1]


def _recorded_searches(monkeypatch) -> list[str]:
    """The node names tuning searches the configurations of, in order (the searches not run),
    under a fake timer that finds every fused node faster."""
    searched: list[str] = []

    def search(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=False, steps=None):
        searched.append(f.node_name)
        return None

    monkeypatch.setattr(tuning, "_search_configs", search)
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.1 * _fused_nodes(mm))
    return searched


def test_offered_chains_are_searched_in_every_tuning(monkeypatch):
    """`offered-chains-searched`: a chain offered to tuning against one of ORT's fused kernels
    (Match.measured_only) has its launch configurations searched without `--tune configs`; a
    chain fused outright does not, and neither does an offered row reduction (`rows-candidates`:
    a row tile that won alone lost in the model on the H200); `--tune configs` searches all."""
    m = model([N("Sigmoid", ["x"], ["a"]), N("Mul", ["a", "x"], ["b"]), N("Transpose", ["b"], ["t"], perm=[1, 0]),
               N("Tanh", ["t"], ["c"]), N("Exp", ["c"], ["y"]),
               N("Add", ["p", "r"], ["s"]), N("LayerNormalization", ["s", "g", "be"], ["z"], axis=-1, epsilon=1e-5)],
              {"x": ("float32", [4, 6]), "p": ("float32", [6, 4]), "r": ("float32", [6, 4])},
              {"y": ("float32", [6, 4]), "z": ("float32", [6, 4])},
              {"g": np.ones(4, np.float32), "be": np.zeros(4, np.float32)}, opset=17)
    r, before = _optimized(m)
    assert sorted(f.kind for f in r.fused) == ["pointwise", "pointwise", "rows"]
    first = next(i for i, f in enumerate(r.fused) if f.kind == "pointwise")
    offered = {first} | {i for i, f in enumerate(r.fused) if f.kind == "rows"}
    for i in offered:
        r.fused[i] = dataclasses.replace(r.fused[i], measured_only=True)
    searched = _recorded_searches(monkeypatch)
    _tune(r, before)
    assert searched == [r.fused[first].node_name]
    searched.clear()
    _tune(r, before, dataclasses.replace(CPU, configs=True))
    assert sorted(searched) == sorted(f.node_name for f in r.fused)


def test_convs_under_one_wave_are_searched_in_every_tuning(monkeypatch):
    """`conv-under-one-wave`: a conv whose launch is the heuristic's plain tiles, fewer than
    the 132 SMs (ViT-S/16's 16 x 16 patch embedding at batch 8: 78 programs), has its tiles
    searched without `--tune configs`; a conv with a full wave, or one the launcher splits,
    does not."""
    from onnxfuse.kinds.conv import under_one_wave

    rng = np.random.default_rng(0)
    w_patch = (rng.standard_normal((384, 3, 16, 16)) * 0.05).astype(np.float32)
    w_wide = (rng.standard_normal((64, 3, 3, 3)) * 0.1).astype(np.float32)
    m = model([N("Conv", ["x", "wp"], ["p"], kernel_shape=[16, 16], strides=[16, 16]), N("Relu", ["p"], ["yp"]),
               N("Conv", ["v", "ww"], ["q"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), N("Relu", ["q"], ["yq"])],
              {"x": ("float32", [8, 3, 224, 224]), "v": ("float32", [8, 3, 128, 128])},
              {"yp": ("float32", [8, 384, 14, 14]), "yq": ("float32", [8, 64, 128, 128])},
              {"wp": w_patch, "ww": w_wide}, opset=17)
    r, before = _optimized(m)
    assert [f.kind for f in r.fused] == ["conv", "conv"]
    searched = _recorded_searches(monkeypatch)
    _tune(r, before)
    specs = {f.node_name: kernel_spec(r.model, f, "tf32") for f in r.fused}
    assert [specs[n].conv.kernel for n in searched] == [(16, 16)]  # the patch embedding alone
    spec = specs[searched[0]]
    assert under_one_wave(spec, (8, 384, 14, 14))
    assert not under_one_wave(spec, (1, 384, 14, 14)) and not under_one_wave(spec, (16, 384, 14, 14))
    assert not under_one_wave(spec, None) and not under_one_wave(spec, (-1, 384, 14, 14))


def test_pointwise_candidates_vary_the_block_and_warps():
    from onnxfuse.kinds.pointwise import choose_variants, pointwise_candidates

    prog = parse(f"{HEADER}\ninput %0 f16\ninput %1 f16\n%2 = add %0 %1\n%3 = erf %2\noutput %3 f16\n")
    spec = KernelSpec(prog, "k", 2, ("full", "strided"))
    cands = pointwise_candidates(spec)
    assert cands[0] == ("default", choose_variants(spec))
    assert [label for label, _ in cands[1:]] == ["block 1024, 4 warps", "block 512, 4 warps", "block 4096, 4 warps",
                                                 "block 2048, 8 warps", "block 2048, 2 warps"]
    for _, vs in cands:
        assert [(v.index, v.ptr_align, v.index_bits) for v in vs] == [(v.index, v.ptr_align, v.index_bits)
                                                                       for v in choose_variants(spec)]
        assert len({(v.block, v.num_warps) for v in vs}) == 1


def test_ort_default_error_is_the_most_accurate_session_output_by_output():
    """cuDNN may pick fp32 algorithms in one session and TF32 ones in the next: the gate's
    baseline takes each output from the session closest to the reference; a NaN the reference
    does not have counts as the worst error, a NaN it has too as none."""
    ref = {"a": np.array([1.0, 2.0]), "b": np.array([0.0, np.nan])}
    s1 = {"a": np.array([1.1, 2.0]), "b": np.array([0.0, np.nan])}
    s2 = {"a": np.array([1.0, 2.01]), "b": np.array([np.nan, np.nan])}
    best = tuning.most_accurate([s1, "cannot run", s2], ref)
    assert best["a"] is s2["a"] and best["b"] is s1["b"]


def test_several_ort_sessions_only_where_cudnn_searches_per_session(monkeypatch, tmp_path):
    """ORT's own error takes three fresh sessions where cuDNN picks a conv's algorithm in each
    (a Conv in the graph, a branch or a function), one where cuBLAS's heuristics decide alone."""
    mm = model([N("MatMul", ["x", "w"], ["y"])], {"x": ("float32", [2, 4])}, {"y": ("float32", [2, 3])},
               {"w": np.ones((4, 3), np.float32)})
    conv = model([N("Conv", ["x", "w"], ["y"])], {"x": ("float32", [1, 2, 4, 4])}, {"y": ("float32", [1, 3, 4, 4])},
                 {"w": np.ones((3, 2, 1, 1), np.float32)})
    branch = onnx.ModelProto()
    branch.CopyFrom(mm)
    inner = helper.make_graph([N("Conv", ["x", "w"], ["c"])], "then", [],
                              [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, None)])
    branch.graph.node.append(N("If", ["flag"], ["z"], then_branch=inner, else_branch=inner))
    in_function = onnx.ModelProto()
    in_function.CopyFrom(mm)
    body = [N("ConvTranspose", ["a", "b"], ["c"])]
    in_function.functions.append(helper.make_function("local", "F", ["a", "b"], ["c"], body,
                                                      [helper.make_opsetid("", 17)]))
    assert [tuning.ort_default_sessions(m) for m in (mm, conv, branch, in_function)] == [
        1, tuning.ORT_DEFAULT_SESSIONS, tuning.ORT_DEFAULT_SESSIONS, tuning.ORT_DEFAULT_SESSIONS]
    # and accuracy_on opens that many for the original on CUDA
    opened = []
    monkeypatch.setattr(tuning.Timer, "outputs", lambda self, models, sets: opened.extend(models) or {
        label: {name: {"y": np.zeros((2, 3), np.float32)} for name in sets} for label in models})
    monkeypatch.setattr(tuning.Timer, "float64_reference", lambda self, m, feeds: (None, "not here"))
    timer = tuning.Timer(TuneSettings(provider="cuda", cache=False), tmp_path)
    tuning.accuracy_on(timer, mm, {"optimized": mm}, {"": {"x": np.ones((2, 4), np.float32)}})
    assert opened.count("ort") == 1


def test_the_original_is_timed_without_the_views_that_write_its_outputs():
    """ONNX Runtime copies a Reshape (Squeeze, Identity, ...) that writes a graph output, where
    inside the model the same view aliases its input: a one-node original ending in one would
    be timed a copy kernel slower than it runs. Such views go and the output is the view's
    input (its shape inferred), computing the same values; a view of a graph input, a view
    another body node reads, and an output the model itself returns (copied there too) stay."""
    n = helper.make_node
    w = np.random.RandomState(0).randn(32, 24).astype(np.float32)
    m = model([n("MatMul", ["x", "w"], ["p"]), n("Reshape", ["p", "s"], ["q"]), n("Squeeze", ["q"], ["y"]),
               n("Reshape", ["x", "s2"], ["v"]), n("Identity", ["p"], ["u"]), n("Relu", ["u"], ["r"]),
               n("Identity", ["p"], ["k"])],
              {"x": ("float32", [32, 32])},
              {"y": ("float32", [2, 16, 24]), "v": ("float32", [1024]), "u": ("float32", [32, 24]),
               "r": ("float32", [32, 24]), "k": ("float32", [32, 24])},
              {"w": w, "s": np.array([1, 2, 16, 24], np.int64), "s2": np.array([1024], np.int64)})
    before = _run(m, {"x": np.random.RandomState(1).randn(32, 32).astype(np.float32)})
    stripped = tuning._without_output_views(onnx.ModelProto.FromString(m.SerializeToString()), {"k"})
    # y's Squeeze and Reshape went (a chain of views); v (a view of x), u (read by Relu), k (kept) stayed
    assert [x.op_type for x in stripped.graph.node] == ["MatMul", "Reshape", "Identity", "Relu", "Identity"]
    assert [o.name for o in stripped.graph.output] == ["p", "v", "u", "r", "k"]
    assert [d.dim_value for d in stripped.graph.output[0].type.tensor_type.shape.dim] == [32, 24]
    after = _run(stripped, {"x": np.random.RandomState(1).randn(32, 32).astype(np.float32)})
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a.reshape(-1), b.reshape(-1))


def test_a_views_output_of_unknown_shape_stays():
    """Without an inferable shape for the view's input the original is timed as it is."""
    n = helper.make_node
    m = model([n("Reshape", ["x", "s"], ["p"]), n("Relu", ["p"], ["q"]), n("Reshape", ["q", "t"], ["y"])],
              {"x": ("float32", [4, 6]), "s": ("int64", [2]), "t": ("int64", [1])}, {"y": ("float32", [24])})
    stripped = tuning._without_output_views(onnx.ModelProto.FromString(m.SerializeToString()), set())
    assert [x.op_type for x in stripped.graph.node] == ["Reshape", "Relu", "Reshape"]


def test_only_candidates_that_could_be_kept_are_gated():
    """`lazy-gates`: `_fastest` with a gate on demand keeps the model that gating every
    candidate first keeps, and gates no candidate whose times could not make it the one kept
    (slower than the original, or not faster than the one kept by MODEL_NOISE): 2000 seeded
    draws of four candidates' times and gates, in each deployment mode."""
    rng = np.random.default_rng(17)
    orig = tuning.ModelTimes(1.0, 0.8)
    labels = ("tuned", "heuristic", "measured only", "tuned + K-major")
    for _ in range(2000):
        times = {k: tuning.ModelTimes(float(rng.uniform(0.5, 1.2)), float(rng.uniform(0.4, 1.0))) for k in labels}
        passed = {k: bool(rng.random() < 0.7) for k in labels}
        models = [(k, k, {}) for k in labels]
        for cuda_graph in (None, True, False):
            every = tuning._fastest(models, times, {k: {"passed": passed[k]} for k in labels}, orig, cuda_graph)
            asked: list[str] = []

            def gate(label, asked=asked, passed=passed):
                asked.append(label)
                return {"passed": passed[label]}
            gates: dict = {}
            lazy = tuning._fastest(models, times, gates, orig, cuda_graph, gate)
            assert (lazy or [None])[0] == (every or [None])[0]
            assert set(gates) == set(asked) and len(asked) == len(set(asked))
            assert all(times[k].not_slower_than(orig, cuda_graph) for k in asked)


def test_a_candidate_slower_than_the_one_kept_is_not_gated(monkeypatch):
    """In a tuning whose gate runs (a float32 conv in TF32): the tuned model is kept, and the
    heuristic's, slower, is timed but never gated, and the summary says so."""
    m = vgg_stack(2, 8, 3, 16)
    r, before = _optimized(m)
    fused = _fused_nodes(r.model)
    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2},
                lambda mm: 1.0 if mm is m else {0: 0.8, fused: 0.9}[_fused_nodes(mm)])
    _fake_outputs(monkeypatch, {"ort": 1e-3, "tuned": 1.5e-3, "heuristic": 1.5e-3})
    rec = _tune_precise(r, before, [])["tune"]
    assert rec["kept"] == "tuned" and set(rec["models"]) == {"tuned", "heuristic"}
    assert set(rec["accuracy"]) == {"tuned"} and rec["accuracy"]["tuned"]["passed"]
    assert "heuristic: " in tuning.summary(rec) and "not gated (its times could not make it" in tuning.summary(rec)


# ---- a losing product epilogue: its epilogue as a chain, its product to ORT ------------------

def _ffn1_dynamo_gelu(k: int = 32, n: int = 48) -> onnx.ModelProto:
    """FFN1 as torch's dynamo exporter writes it: x @ w + b, then erf's GELU in the order
    hb * ((erf(hb / sqrt 2) + 1) * 0.5), a form ONNX Runtime does not fuse (BiasGelu)."""
    rng = np.random.default_rng(3)
    f = np.float32
    return model([N("MatMul", ["x", "w"], ["h"], name="mm"), N("Add", ["h", "b"], ["hb"], name="bias"),
                  N("Div", ["hb", "s2"], ["s"], name="div"), N("Erf", ["s"], ["e"], name="erf"),
                  N("Add", ["e", "one"], ["e1"], name="add1"), N("Mul", ["e1", "half"], ["e2"], name="halve"),
                  N("Mul", ["hb", "e2"], ["y"], name="gelu")],
                 {"x": ("float32", [2, 5, k])}, {"y": ("float32", [2, 5, n])},
                 {"w": (rng.standard_normal((k, n)) / k ** 0.5).astype(f), "b": rng.standard_normal(n).astype(f),
                  "s2": f(2 ** 0.5), "one": f(1.0), "half": f(0.5)})


def _tuned_matched(m: onnx.ModelProto):
    """`m` through the passes up to the rewrite as they run where tuning follows on a GPU (the
    gemm kind matched), and the snapshot tuning starts from."""
    from onnxfuse.pipeline import rewrite_pass
    from tests.util import passes_upto, tuned_options

    r = passes_upto(m, tuned_options("sm_90", None, layout="nchw"), rewrite_pass)
    return r, tuning.snapshot(r)


def _split(before, losers: set[str]):
    """`split_epilogues` as tuning builds it: from `before` with `losers` unfused."""
    tuned = tuning.snapshot(before)
    return tuning.split_epilogues(before, tuned, tuning.unfuse_nodes(tuned, losers))


def test_a_losing_gemm_epilogue_is_split_into_its_product_and_a_chain():
    """`split_epilogues`: the GemmEpilogue that lost goes back to its original nodes, and its
    bias + GELU, matched alone, becomes one pointwise chain; the product stays ONNX Runtime's.
    The model computes what the original does; the report counts the product alone as left to
    ORT; the snapshot tuning started from is not changed."""
    m = _ffn1_dynamo_gelu()
    r, before = _tuned_matched(m)
    assert [(f.kind, len(f.source_nodes)) for f in r.fused] == [("gemm", 7)], r.report.summary()
    (name,) = [f.node_name for f in r.fused]
    assert _split(before, set()) is None
    split = _split(before, {name})
    assert [f.kind for f in split.fused] == ["pointwise"] and len(split.fused[0].source_nodes) == 6
    ops = [n.op_type for n in split.model.graph.node if n.op_type != "Constant"]
    assert "GemmEpilogue" not in ops and ops.count("PointwiseChain") == 1
    assert {"MatMul", "Gemm"} & set(ops) and not {"Erf", "Div"} & set(ops)
    assert split.report.not_fused[tuning.REASON] == 1     # the product
    assert [f.kind for f in before.fused] == ["gemm"] and _fused_nodes(before.model) == 1  # before untouched
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)}
    (want,), (got,) = _run(m, feeds), _run(split.model, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_an_epilogue_of_one_bias_add_is_not_split():
    """A product whose epilogue is its bias alone: no chain of two nodes forms (ORT fuses the
    bias with the product), so there is no split candidate; with a Relu after the bias there is
    one, the product alone left to ORT."""
    rng = np.random.default_rng(4)
    w, b = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    io = {"x": ("float32", [2, 5, 32])}, {"y": ("float32", [2, 5, 48])}
    bias = model([N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["y"])], *io, {"w": w, "b": b})
    r, before = _tuned_matched(bias)
    assert [(f.kind, len(f.source_nodes)) for f in r.fused] == [("gemm", 2)], r.report.summary()
    assert _split(before, {r.fused[0].node_name}) is None
    relu = model([N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Relu", ["hb"], ["y"])], *io,
                 {"w": w, "b": b})
    r, before = _tuned_matched(relu)
    assert [(f.kind, len(f.source_nodes)) for f in r.fused] == [("gemm", 3)], r.report.summary()
    split = _split(before, {r.fused[0].node_name})
    assert [(f.kind, len(f.source_nodes)) for f in split.fused] == [("pointwise", 2)]


def test_tuning_keeps_the_split_model_where_it_is_faster(monkeypatch):
    """The split model is a whole-model candidate after the tuned one: kept where faster than
    it by more than MODEL_NOISE, and the written model is then the product + chain."""
    m = _ffn1_dynamo_gelu()
    r, before = _tuned_matched(m)

    def model_ms(mm):
        ops = {n.op_type for n in mm.graph.node}
        return 0.8 if "PointwiseChain" in ops else 1.1 if "GemmEpilogue" in ops else 1.0

    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, model_ms)
    rec = _tune(r, before)["tune"]
    assert set(rec["models"]) >= {"tuned", "tuned" + tuning.SPLIT_LABEL}, rec["models"]
    assert rec["kept"] == "tuned" + tuning.SPLIT_LABEL
    assert [f.kind for f in r.fused] == ["pointwise"]
    assert "PointwiseChain" in {n.op_type for n in r.model.graph.node}
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 5, 32)).astype(np.float32)}
    (want,), (got,) = _run(m, feeds), _run(r.model, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_tuning_keeps_the_tuned_model_where_the_split_one_is_not_faster(monkeypatch):
    m = _ffn1_dynamo_gelu()
    r, before = _tuned_matched(m)

    def model_ms(mm):
        ops = {n.op_type for n in mm.graph.node}
        return 0.995 if "PointwiseChain" in ops else 1.1 if "GemmEpilogue" in ops else 1.0  # within MODEL_NOISE

    _fake_timer(monkeypatch, {"fused": 0.5, "original": 0.2}, model_ms)
    rec = _tune(r, before)["tune"]
    assert "tuned" + tuning.SPLIT_LABEL in rec["models"] and rec["kept"] == "tuned"
    assert not r.fused and _fused_nodes(r.model) == 0


def test_prepared_search_candidates_are_cache_hits_for_tuning(tmp_path, monkeypatch):
    """`precompile_searches` (compare.py --prepare, without a GPU) compiles what tuning's search
    will: the candidates of every node tuning searches in every tuning (here FFN1's bias + GELU
    chain, offered against ORT's BiasGelu); after it, compiling a searched node's candidates as
    `_search_configs` does compiles nothing."""
    pytest.importorskip("triton")
    from onnxfuse import compile as aot
    from onnxfuse.pipeline import compile_pass
    from tests.test_gemm_patterns import ffn1
    from tests.util import passes_upto, tuned_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    m, dims = ffn1(), {"x": (2, 5, 32)}
    r = passes_upto(m, tuned_options("sm_90", dims, layout="nhwc"), compile_pass)
    offered = [f for f in r.fused if f.measured_only]
    assert [f.kind for f in offered] == ["pointwise"], r.report.summary()
    specs = [kernel_spec(r.model, f, "tf32") for f in offered]
    got = tuning.precompile_searches(r, dims, [90])
    assert got["candidates"] == sum(len(tuning.candidates(s)) for s in specs) > 1
    assert got["compiled"] > 0 and got["failed"] == 0
    for spec in specs:  # as tuning's search compiles them
        configs = tuning.candidates(spec)
        out = aot.compile_kernels([spec] * len(configs), [90], errors="collect",
                                  variant_overrides=[v for _, v in configs])
        assert all(isinstance(c, aot.CompiledKernel) and c.compiled == 0 and c.cache_hits > 0 for c in out)
    assert tuning.precompile_searches(r, dims, [90])["compiled"] == 0


# ---- the TF32 probe (step 0): nodes whose original ORT multiplies in fp32 compile precise ----

def _probed(verdicts: dict[str, str]) -> Callable:
    """probe_precisions answering from a table: node name -> "fp32" / "tf32" / an error."""
    def probe(result, dims, feeds, timer, settings, conv_precision):
        return {name: ({"error": v} if v not in ("fp32", "tf32") else {"multiplies": v, "ratios": [0.5]})
                for name, v in verdicts.items()}
    return probe


def test_a_node_ort_multiplies_in_fp32_compiles_precise_before_it_is_timed(monkeypatch):
    """ViT-S/16's patch conv: ORT's cuDNN ran it in fp32 (forty-sixth session), so its fused node
    compiles at tf32x3 before the per-node timing, and is timed and kept at that precision; the
    node ORT runs in TF32 keeps the model's precision. The record and the summary say which."""
    r, before = _optimized(vgg_stack(2, 8, 3, 16))
    first, second = (f.node_name for f in r.fused)
    monkeypatch.setattr(tuning, "probe_precisions", _probed({first: "fp32", second: "tf32"}))
    compiled, timed = [], []
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    real_time_nodes = tuning.time_nodes

    def time_nodes(result, *args, **kwargs):
        timed.append({f.node_name: f.precision for f in result.fused})
        return real_time_nodes(result, *args, **kwargs)

    monkeypatch.setattr(tuning, "time_nodes", time_nodes)
    _fake_outputs(monkeypatch, {"ort": 1e-3})

    def recompile(res):
        compiled.append({f.node_name: f.precision for f in res.fused})
        return dict(NOT_COMPILED, summary="kernels: recompiled")

    out = tuning.tune(r, before, dict(NOT_COMPILED), recompile, CPU, [90])
    rec = out["tune"]
    assert compiled[0] == {first: "tf32x3", second: None} and timed == [compiled[0]]
    assert {f.node_name: f.precision for f in r.fused} == {first: "tf32x3", second: None}
    assert rec["kept"] == "optimized" and rec["precise"] == [first]
    assert {d["node"]: d["precision"] for d in rec["nodes"]} == {first: "tf32x3", second: ""}
    assert f"1 node(s) multiply at tf32x3, where ONNX Runtime multiplied their originals in fp32 (TF32 probe): " \
           f"{first}" in out["summary"] and out["summary"].startswith("kernels: recompiled")
    # the spec the kernel is compiled from: the node's precision, not the model's
    f = next(f for f in r.fused if f.node_name == first)
    assert kernel_spec(r.model, f, "tf32").precision == "tf32x3" and precision_of(f, "tf32") == "tf32x3"
    assert not tuning.KINDS["conv"].multiplies_in_tf32(f, precision_of(f, "tf32"))


def test_nodes_of_one_kernel_share_the_probes_answer(monkeypatch):
    """Two layers of one kernel name (same shapes, weights aside): one read fp32, both compile
    at tf32x3 (one kernel, one precision); a probe that failed leaves its node as it was."""
    r, before = _optimized(vgg_stack(3, 8, 3, 16))
    first, second, third = (f.node_name for f in r.fused)
    assert r.fused[1].kernel_name == r.fused[2].kernel_name != r.fused[0].kernel_name
    probed = _probed({first: "cannot run", second: "tf32", third: "fp32"})(r, None, None, None, None, "tf32")
    assert tuning.precise_nodes(before, probed) == {second, third}
    monkeypatch.setattr(tuning, "probe_precisions", _probed({first: "cannot run", third: "fp32"}))
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 1.0 - 0.5 * bool(_fused_nodes(mm)))
    _fake_outputs(monkeypatch, {"ort": 1e-3})
    out = _tune(r, before)
    assert out["tune"]["precise"] == [second, third]
    assert f"TF32 probe failed for 1 node(s), which keep the model's precision: {first}: cannot run" in out["summary"]
    assert "precision" in out["tune"]["phases"]


def test_the_probe_runs_on_cuda_only_and_is_remembered(tmp_path, monkeypatch):
    """On the CPU provider nothing multiplies in TF32: nothing is probed. A probe is remembered
    under its one-node model's key, weights aside: a layer of the same shapes is a cache hit."""
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    r, _ = _optimized(vgg_stack(2, 8, 3, 16))
    timer = tuning.Timer(TuneSettings(provider="cpu"), tmp_path)
    feeds = {"x": np.zeros((1, 3, 16, 16), np.float32)}
    assert tuning.probe_precisions(r, {"x": (1, 3, 16, 16)}, feeds, timer, timer.settings, "tf32") == {}
    conv = _conv_then_chain()
    one = model([conv.graph.node[0]], {"x": ("float32", [2, 4, 8, 8])}, {"c": ("float32", [2, 8, 8, 8])},
                {"w": onnx.numpy_helper.to_array(conv.graph.initializer[0])})
    first = timer.tf32_probe(one)
    assert first["multiplies"] == "fp32" and all(r < 0.01 for r in first["ratios"]) and timer.measured == 1
    other = onnx.ModelProto()
    other.CopyFrom(one)
    w = onnx.numpy_helper.to_array(other.graph.initializer[0])
    other.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w * 2, other.graph.initializer[0].name))
    assert timer.tf32_probe(other) == first and timer.hits == 1 and timer.measured == 1
    timer.save()
    again = tuning.Timer(TuneSettings(provider="cpu"), tmp_path)
    assert again.tf32_probe(one) == first and again.hits == 1 and again.measured == 0
