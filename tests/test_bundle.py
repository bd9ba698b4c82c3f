"""onnxfuse.bundle: tuning's one-node models side by side in one session, each timed by its
own GPU kernels; and how tuning decides with those times. The CUPTI run itself needs a GPU
(tests/test_bundle_gpu.py); here the bundle runs on the CPU and the attribution is fed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from models.build import vgg_stack
from onnxfuse import bundle
from onnxfuse import tune as tuning
from onnxfuse.errors import OnnxfuseError
from onnxfuse.pipeline import optimize_model
from onnxfuse.runtime import library_path
from onnxfuse.tune import TuneSettings


def one_node_pairs(r, settings: TuneSettings) -> list[tuple[onnx.ModelProto, onnx.ModelProto]]:
    """(original, fused) one-node model per fused node of result r, at the settings' shapes."""
    dims = tuning.input_shapes(r.original, settings)
    feeds = tuning.feeds_for(r.original, dims)
    nodes = {n.name: n for n in r.model.graph.node}
    needed = {x for f in r.fused for x in (*nodes[f.node_name].input, *nodes[f.node_name].output) if x}
    infos = tuning.tensor_infos(r.model, dims, feeds, needed, settings.provider)
    return [(tuning.original_model(r.model, nodes[f.node_name], infos),
             tuning.fused_model(r.model, nodes[f.node_name], infos)) for f in r.fused]


def _one_node_models(m: onnx.ModelProto):
    """(result, its one-node pairs) of m at batch 2."""
    r = optimize_model(m)
    return r, one_node_pairs(r, TuneSettings(provider="cpu", batch=2))


def _run(m: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def test_a_bundle_computes_what_each_model_computes_alone():
    """Every model of a bundle, originals and fused nodes (their functions kept once), gives
    the outputs it gives alone: nothing is shared or renamed into another model's tensors."""
    _, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    models = [m for p in pairs for m in p] + [pairs[0][0]]  # one model twice: its copies stay apart
    b = bundle.bundle(models)
    onnx.checker.check_model(b)
    assert len({t.name for t in b.graph.initializer}) == sum(len(m.graph.initializer) for m in models)
    feeds = bundle.bundle_feeds(models)
    got = _run(b, feeds)
    for i, m in enumerate(models):
        alone = _run(m, {vi.name: feeds[bundle.prefixed(i, vi.name)] for vi in m.graph.input})
        for name, want in alone.items():
            np.testing.assert_allclose(got[bundle.prefixed(i, name)], want, rtol=1e-6, atol=1e-6)
    # functions once per overload, however many models carry them
    keys = [(f.domain, f.name, f.overload) for f in b.functions]
    assert len(keys) == len(set(keys)) == len({k for m in models for k in
                                               ((f.domain, f.name, f.overload) for f in m.functions)})


def test_inputs_of_one_shape_share_their_data():
    _, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    models = [pairs[0][0], pairs[0][0]]
    feeds = bundle.bundle_feeds(models)
    (a, b) = [feeds[bundle.prefixed(i, models[0].graph.input[0].name)] for i in range(2)]
    assert a is b and np.isfinite(a).all() and a.std() > 0


def test_bundles_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ONNXFUSE_TUNE_BUNDLES", "0")
    assert not bundle.available()


def test_a_model_with_a_subgraph_cannot_join():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=then)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
                                        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    m = helper.make_model(g)
    assert not bundle.bundleable(m)
    with pytest.raises(OnnxfuseError, match="subgraphs"):
        bundle.bundle([m])


def test_chunks_keep_bundles_within_their_bytes():
    _, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    models = [m for p in pairs for m in p]
    sizes = [bundle.io_bytes(m) for m in models]
    assert bundle.chunks(models, limit=10**12) == [list(range(len(models)))]
    parts = bundle.chunks(models, limit=max(sizes))
    assert [i for p in parts for i in p] == list(range(len(models)))
    assert all(sum(sizes[i] for i in p) <= max(sizes) for p in parts) and len(parts) > 1


def test_nodes_are_traced_to_their_models_by_name_or_tensors():
    """ONNX Runtime names its own fused nodes as it likes: a node without the prefix in its
    name is traced by its tensors in ORT's optimized graph; one traced nowhere is nobody's."""
    opt = helper.make_model(helper.make_graph(
        [helper.make_node("FusedConv", ["b3~x", "b3~w"], ["b3~y"], name="ConvRelu_fusion_7", domain="com.microsoft")],
        "opt", [], []))
    got = bundle.owners(["b1~n", "b12~/conv/Conv", "ConvRelu_fusion_7", "Memcpy_token_1"], opt)
    assert got == {"b1~n": 1, "b12~/conv/Conv": 12, "ConvRelu_fusion_7": 3}


def test_group_times_are_medians_of_per_run_sums():
    """A model's time in a run is the sum of its nodes' activities; its time is the median over
    runs. A model with a node on the CPU, or with no activity, is not timed this way."""
    owner = {"b0~a": 0, "b0~b": 0, "b1~a": 1, "b2~a": 2, "b2~cpu": 2, "b3~alias": 3}
    us = {(0, "b0~a"): 2.0, (0, "b0~b"): 1.0, (1, "b0~a"): 2.5, (1, "b0~b"): 1.0, (2, "b0~a"): 9.0,
          (2, "b0~b"): 1.0, (0, "b1~a"): 4.0, (1, "b1~a"): 4.0, (2, "b1~a"): 4.0, (0, "b2~a"): 1.0}
    counts = {k: 1 for k in us}
    counts[(0, "b1~a")] = counts[(1, "b1~a")] = counts[(2, "b1~a")] = 2
    got = bundle.group_times(us, counts, 3, owner, host={"b2~cpu"})
    assert got == {0: bundle.Timed(3.5, 2), 1: bundle.Timed(4.0, 2)}


# ------------------------------------------------------------------ tuning with bundles

def _fake_bundles(monkeypatch, us: dict[bool, float], kernels: dict[bool, int], fail: bool = False) -> list:
    """bundle.run_bundle answering from tables by whether each bundled model is fused; the
    bundles it was given are returned (appended as they run)."""
    ran = []

    def run_bundle(m, feeds, library, iters=bundle.ITERS, warmup=bundle.WARMUP):
        ran.append(m)
        if fail:
            raise OnnxfuseError("a bundle of one-node models did not run: boom")
        groups = sorted({int(bundle.PREFIX.match(n.name).group(1)) for n in m.graph.node})
        fused = {g: any(n.domain == "onnxfuse" and n.name.startswith(f"b{g}~") for n in m.graph.node)
                 for g in groups}
        return bundle.BundleRun({g: bundle.Timed(us[fused[g]], kernels[fused[g]]) for g in groups})

    monkeypatch.setattr(bundle, "available", lambda: True)
    monkeypatch.setattr(bundle, "run_bundle", run_bundle)
    monkeypatch.setattr(tuning, "graph_gap", lambda timer: 0.001)
    return ran


def _time_nodes(r, timer, settings):
    dims = tuning.input_shapes(r.original, settings)
    feeds = tuning.feeds_for(r.original, dims)
    return tuning.time_nodes(r, feeds, dims, timer, settings, [90], "tf32", 1, tuning.time.perf_counter())


CUDA = TuneSettings(provider="cuda", batch=2, cache=False)


@pytest.mark.parametrize("fused_us,chosen", [(4.0, "fused"), (9.0, "original")])
def test_every_node_is_timed_in_one_bundle(monkeypatch, tmp_path, fused_us, chosen):
    """On CUDA every node's pair goes into one bundle; no node is timed a pair at a time. The
    launch gaps count: 3 kernels of 5 µs in all against one of 4 or 9 µs."""
    r, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    ran = _fake_bundles(monkeypatch, {False: 5.0, True: fused_us}, {False: 3, True: 1})
    monkeypatch.setattr(tuning, "_time_pair", lambda *a, **k: pytest.fail("timed as a pair"))
    timer = tuning.Timer(CUDA, tmp_path)
    decisions = _time_nodes(r, timer, CUDA)
    assert len(ran) == 1 and len(ran[0].graph.output) == sum(len(m.graph.output) for p in pairs for m in p)
    assert {d.mode for d in decisions} == {tuning.BUNDLED}
    assert {d.chosen for d in decisions} == {chosen}
    d = decisions[0]
    assert (d.original_ms, d.fused_ms, d.original_kernels, d.fused_kernels) == (0.005, fused_us / 1e3, 3, 1)
    assert timer.bundled["sessions"] == 1 and timer.bundled["models"] == 2 * len(pairs)


def test_launch_gaps_decide_a_close_call():
    """Kernel time alone would leave this node to ORT (6 against 5 µs); under a CUDA graph the
    original's two extra launches cost more than the microsecond."""
    d = tuning.NodeDecision("n", "conv", original_ms=0.005, fused_ms=0.006, mode=tuning.BUNDLED,
                            original_kernels=3, fused_kernels=1, gap_ms=0.001)
    assert not d.loses()
    d.original_kernels = 1
    assert d.loses()
    timed_as_pair = tuning.NodeDecision("n", "conv", original_ms=0.005, fused_ms=0.006, mode="CUDA graph",
                                        replicas=16, original_kernels=3, fused_kernels=1, gap_ms=0.001)
    assert timed_as_pair.loses()  # kernel counts are a bundle's


def test_bundled_times_are_remembered(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "cache_path", lambda provider: tmp_path / "cache" / "tune.json")
    r, _ = _one_node_models(vgg_stack(2, 8, 3, 16))
    settings = TuneSettings(provider="cuda", batch=2)
    ran = _fake_bundles(monkeypatch, {False: 5.0, True: 4.0}, {False: 2, True: 1})
    timer = tuning.Timer(settings, tmp_path)
    _time_nodes(r, timer, settings)
    timer.save()
    again = tuning.Timer(settings, tmp_path)
    decisions = _time_nodes(r, again, settings)
    assert len(ran) == 1 and again.hits == 2 * len(decisions) and again.measured == 0
    assert {(d.mode, d.fused_ms) for d in decisions} == {(tuning.BUNDLED, 0.004)}


def test_a_failed_bundle_falls_back_to_pairs(monkeypatch, tmp_path):
    r, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    _fake_bundles(monkeypatch, {False: 5.0, True: 4.0}, {False: 2, True: 1}, fail=True)
    timed = []

    def pair(timer, orig, mini, graphs, cached_only=False):
        timed.append(mini)
        return ("CUDA graph", 16, 0.002, 0.001)

    monkeypatch.setattr(tuning, "_time_pair", pair)
    timer = tuning.Timer(CUDA, tmp_path)
    decisions = _time_nodes(r, timer, CUDA)
    assert len(timed) == len(pairs) and {d.mode for d in decisions} == {"CUDA graph"}
    assert timer.bundled["errors"] == ["a bundle of one-node models did not run: boom"]


def test_the_graph_gap_is_a_slope_measured_once(monkeypatch, tmp_path):
    """Chains of 32 and 160 small nodes: 0.200 and 0.520 ms under CUDA graphs, kernels of 2 µs
    each in a bundle. Per node more, the graph adds 2.5 µs, the kernel 2 of them: the gap is
    0.5 µs, the fixed cost of a replay cancelled. Remembered: measured once."""
    kernel_us = {32: 64.0, 160: 320.0}

    def graph_time(self, m, feeds, library, graph=False, cached_only=False):
        return {32: 0.200, 160: 0.520}[len(m.graph.node)]

    def time_bundled(self, models, deadline=None):
        return [bundle.Timed(kernel_us[len(m.graph.node)], len(m.graph.node)) for m, _ in models]

    monkeypatch.setattr(tuning.Timer, "time", graph_time)
    monkeypatch.setattr(tuning.Timer, "time_bundled", time_bundled)
    timer = tuning.Timer(CUDA, tmp_path)
    assert tuning.graph_gap(timer) == pytest.approx(0.0005)
    monkeypatch.setattr(tuning.Timer, "time", lambda *a, **k: pytest.fail("measured twice"))
    assert tuning.graph_gap(timer) == pytest.approx(0.0005) and timer.hits == 1
    monkeypatch.setattr(tuning.Timer, "time", graph_time)
    kernel_us.update({32: 80.0, 160: 400.0})  # kernels slower than the graph's slope: no gap, not a negative one
    assert tuning.graph_gap(tuning.Timer(CUDA, tmp_path / "other")) == 0.0


def test_an_unmeasurable_graph_gap_falls_back(monkeypatch, tmp_path):
    def fail(self, m, feeds, library, graph=False, cached_only=False):
        raise OnnxfuseError("graphs cannot capture it")

    monkeypatch.setattr(tuning.Timer, "time", fail)
    assert tuning.graph_gap(tuning.Timer(CUDA, tmp_path)) == tuning.GRAPH_GAP_MS


def test_a_search_compiles_every_configuration_at_once_and_times_them_in_one_bundle(monkeypatch, tmp_path):
    """--tune on a bundled node: all candidate configurations in one compile call (in parallel),
    those that compile timed together in one bundle; one that fails to compile is recorded, the
    fastest (launch gaps counted) is attached and returned."""
    from onnxfuse import compile as aot

    r, pairs = _one_node_models(vgg_stack(2, 8, 3, 16))
    f, node = r.fused[0], next(n for n in r.model.graph.node if n.name == r.fused[0].node_name)
    configs = [("a", ("va",)), ("b", ("vb",)), ("c", ("vc",))]
    monkeypatch.setattr(tuning, "candidates", lambda spec: configs)
    monkeypatch.setattr(tuning, "kernel_spec", lambda *a: "spec")
    calls = []

    def compile_kernels(specs, targets, jobs=None, errors="raise", variant_overrides=None, **kw):
        calls.append(variant_overrides)
        return [aot.CompileFailure(s, (90,), "ptxas: out of registers") if v == ("vb",) else
                aot.CompiledKernel(s, v, (), 0.0, 0, 1) for s, v in zip(specs, variant_overrides, strict=True)]

    attached = []
    monkeypatch.setattr(aot, "compile_kernels", compile_kernels)
    monkeypatch.setattr(aot, "attach", lambda n, ck: attached.append((n.name, ck.variants)))
    bundles = []

    def time_bundled(self, models, deadline=None):
        bundles.append(len(models))
        return [bundle.Timed(5.0, 3), bundle.Timed(5.5, 1)]  # a: 5 µs in 3 kernels, c: 5.5 in 1

    monkeypatch.setattr(tuning.Timer, "time_bundled", time_bundled)
    d = tuning.NodeDecision(f.node_name, f.kind, mode=tuning.BUNDLED, gap_ms=0.001)
    got = tuning._search_configs(r, f, node, pairs[0][1], d, tuning.Timer(CUDA, tmp_path), [90], "tf32", 2)
    assert calls == [[("va",), ("vb",), ("vc",)]] and bundles == [2]
    assert got == (0.0055, "c") and d.fused_kernels == 1 and attached[-1] == (node.name, ("vc",))
    assert [c.get("error") for c in d.candidates] == ["ptxas: out of registers", None, None]


def test_compile_kernels_takes_variants_per_spec(tmp_path):
    """`variant_overrides`: one tuple of variants per spec, compiled in the same call."""
    pytest.importorskip("triton")
    from onnxfuse import compile as aot
    from onnxfuse.kinds import KINDS
    from onnxfuse.specs import kernel_spec

    r = optimize_model(vgg_stack(1, 8, 3, 16))
    f = r.fused[0]
    spec = kernel_spec(r.model, f, "tf32")
    (_, first), (_, second) = KINDS[spec.kind].candidates(spec)[:2]  # two tile configurations
    assert first != second
    with pytest.raises(ValueError, match="one tuple of variants per spec"):
        aot.compile_kernels([spec, spec], [90], cache_dir=tmp_path, variant_overrides=[first])
    a, b = aot.compile_kernels([spec, spec], [90], cache_dir=tmp_path, variant_overrides=[first, second])
    assert a.variants == first and b.variants == second and a.kernels() != b.kernels()
