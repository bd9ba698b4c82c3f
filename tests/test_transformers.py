"""models/transformers.py and the suite's transformer group, on the small (2-layer, d=64) twins:
each model exports with the TorchScript exporter with dynamic batch and sequence, runs in ONNX
Runtime CPU as torch computes it, its fp16 twin runs, onnxfuse's fused model computes the
same, ONNX Runtime's transformers optimizer fuses it and onnxfuse on top of its output still
computes the same; the dynamo exporter exports where onnxscript is installed and says what to
install where it is not.

Tolerances: fp32 exports and fusions |y - y_ref| <= 1e-5 max|y_ref| + 1e-5 (seen: 2e-6 on
outputs of scale 1-4); fp16 twins as tests/test_suite.py: 0.1 max|y| + 1e-3 (seen: 1e-3).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from models import suite
from models import transformers as mt

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

ARCHS = list(mt.CONFIGS)
RTOL, ATOL = 1e-5, 1e-5
RTOL16, ATOL16 = 0.1, 1e-3
# the fused operators ONNX Runtime's transformers optimizer (1.32) writes into each small model
ORT_FUSED = {
    "bert_base": {"EmbedLayerNormalization": 1, "Attention": 2, "BiasGelu": 2, "SkipLayerNormalization": 4},
    "vit_s16": {"Attention": 1, "BiasGelu": 2, "LayerNormalization": 1, "SkipLayerNormalization": 4},
    "gpt2_small": {"EmbedLayerNormalization": 1, "Attention": 2, "FastGelu": 2, "SkipLayerNormalization": 4},
}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _feeds(arch: str, batch: int = 3, seq: int = 12, dtype=np.float32, seed: int = 1) -> dict[str, np.ndarray]:
    dims = mt.input_dims(arch, small=True, seq=seq)
    return mt.feeds(arch, {k: (batch, *d) for k, d in dims.items()}, dtype, small=True, seed=seed)


def _assert_close(got: np.ndarray, want: np.ndarray, rtol: float = RTOL, atol: float = ATOL, what: str = ""):
    assert got.shape == want.shape, what
    scale = float(np.abs(want).max())
    err = float(np.abs(got.astype(np.float64) - want).max())
    assert err <= rtol * scale + atol, f"{what}: max|err| {err:.3g}, max|y| {scale:.3g}"


@pytest.fixture(scope="module", params=ARCHS)
def exported(request):
    """(arch, the small TorchScript export)."""
    return request.param, mt.export(request.param, "torchscript", small=True)


def test_signature_and_dynamic_dims(exported):
    arch, m = exported
    assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 17
    sig = mt.signature(arch, small=True)
    inits = {t.name for t in m.graph.initializer}
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in m.graph.input if i.name not in inits}
    assert list(inputs) == list(sig.inputs)
    for name, dims in inputs.items():
        assert dims[0] == "N", (name, dims)
        if sig.inputs[name] == ("S",):
            assert dims == ["N", "S"] and m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [o.name for o in m.graph.output] == list(sig.outputs)


@pytest.mark.parametrize("seq", [12, 5])
def test_ort_matches_torch(exported, seq):
    arch, m = exported
    feeds = _feeds(arch, seq=seq)
    with torch.no_grad():
        want = mt.module(arch, small=True)(*(torch.from_numpy(v) for v in feeds.values())).numpy()
    got = _run(m, feeds)
    _assert_close(got, want, what=arch)
    c = mt.config(arch, small=True)
    shape = {"bert_base": (3, seq, c.dim), "vit_s16": (3, c.classes), "gpt2_small": (3, seq, c.vocab)}[arch]
    assert got.shape == shape and np.abs(want).max() > 0.1


def test_the_mask_masks():
    """BERT: a padded position's token changes nothing that attends only to unpadded ones;
    GPT-2: a later token changes no earlier position's logits."""
    bert = mt.module("bert_base", small=True)
    feeds = _feeds("bert_base", batch=2, seq=8)
    feeds["attention_mask"][:, 6:] = 0
    other = {k: v.copy() for k, v in feeds.items()}
    other["input_ids"][:, 7] = (other["input_ids"][:, 7] + 1) % mt.config("bert_base", True).vocab
    with torch.no_grad():
        a, b = (bert(*(torch.from_numpy(v) for v in f.values())).numpy() for f in (feeds, other))
    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-6)
    gpt = mt.module("gpt2_small", small=True)
    ids = _feeds("gpt2_small", batch=2, seq=8)["input_ids"]
    later = ids.copy()
    later[:, 5:] = (later[:, 5:] + 1) % mt.config("gpt2_small", True).vocab
    with torch.no_grad():
        a, b = (gpt(torch.from_numpy(x)).numpy() for x in (ids, later))
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-6)
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3


def test_fp16_twin_runs(exported):
    pytest.importorskip("onnxconverter_common")
    from models.fp16 import to_fp16

    arch, m = exported
    m16 = to_fp16(m)
    want = _run(m, _feeds(arch))
    got = _run(m16, _feeds(arch, dtype=np.float16))
    assert got.dtype == np.float16 and np.isfinite(got).all()
    _assert_close(got, want, RTOL16, ATOL16, f"{arch} fp16")


def test_onnxfuse_computes_the_same(exported):
    """With its defaults onnxfuse leaves ORT's own fusions' nodes alone (the GELUs, the
    LayerNorms: GPT-2's tanh-GELU and LayerNorms leave no chain); forced to fuse them, it
    fuses the chains. Either way the outputs are the original's."""
    from onnxfuse import optimize_model

    arch, m = exported
    feeds = _feeds(arch)
    want = _run(m, feeds)
    default = optimize_model(m)
    assert any(k.startswith("left to ONNX Runtime's") for k in default.report.not_fused), default.report.not_fused
    _assert_close(_run(default.model, feeds), want, what=f"{arch} onnxfuse")
    forced = optimize_model(m, leave_to_ort=False)
    assert forced.report.patterns_applied.get("pointwise_chain", 0) >= 2, forced.report.patterns_applied
    _assert_close(_run(forced.model, feeds), want, what=f"{arch} onnxfuse, ORT's fusions taken")


def test_gelu_chains_are_offered_where_tuning_times_them():
    """GPT-2's bias Add + tanh-GELU, which ONNX Runtime fuses into FastGelu once the bias pass
    has put the bias after the product: left to ORT by default; where the tune pass will time
    them (`pipeline.TIMED_AGAINST_ORT`), a pointwise chain takes each FastGelu's nodes whole
    (one chain of 9 nodes a layer), and tuning keeps it only where faster."""
    from onnxfuse.graph import GraphView
    from onnxfuse.load import infer_shapes
    from onnxfuse.match import find_matches
    from onnxfuse.ort_fusions import ort_fusions
    from onnxfuse.pattern import load_patterns
    from onnxfuse.pipeline import TIMED_AGAINST_ORT, optimize_model

    m = mt.export("gpt2_small", small=True)
    dims = {k: (2, *v) for k, v in mt.input_dims("gpt2_small", small=True).items()}
    moved = optimize_model(m, patterns=[], static_shapes=dims).model  # canonical, biases after their products
    absorbed = ort_fusions(moved).absorbed
    fast_gelu = {i for i, r in absorbed.items() if r == "left to ONNX Runtime's FastGelu fusion"}
    assert len(fast_gelu) == 18
    view = GraphView.build(moved, infer_shapes(moved))
    chains = [p for p in load_patterns() if p.kind.name == "pointwise"]
    assert not find_matches(view, chains, absorbed).matches
    offered = find_matches(view, chains, absorbed, TIMED_AGAINST_ORT).matches
    assert sorted(len(x.nodes) for x in offered) == [9, 9] and {i for x in offered for i in x.nodes} == fast_gelu


def test_with_tuning_a_gelu_after_a_product_is_a_chain_timed_against_bias_gelu():
    """BERT's FFN1 (MatMul + bias + erf-GELU) where the tune pass will run: the gemm kind
    leaves the GELU to a chain (`gemm.BIAS_TO_TAKER`), the bias pass puts the bias after the
    product, and one chain per layer takes the bias Add with the GELU, marked to be kept only
    where tuning measures it faster than ORT's BiasGelu (the passes up to matching, on the CPU)."""

    from onnxfuse.pipeline import match_pass
    from tests.util import passes_upto, tuned_options

    m = mt.export("bert_base", small=True)
    dims = {k: (2, *v) for k, v in mt.input_dims("bert_base", small=True).items()}
    r = passes_upto(m, tuned_options("none", dims), match_pass)
    gelu = [x for x in r.found.matches if x.kind == "pointwise" and x.measured_only]
    assert len(gelu) == 2, r.report.summary()
    for x in gelu:
        assert [r.view.nodes[i].op_type for i in x.nodes] == ["Add", "Div", "Erf", "Add", "Mul", "Mul"]
        assert r.view.nodes[r.view.producer[r.view.nodes[x.nodes[0]].input[0]]].op_type == "Reshape"  # Gemm, Reshape
    assert not [x for x in r.found.matches if x.kind == "gemm"]
    assert r.biased_after == 6  # two layers' out-projection, FFN1 and FFN2


def test_ort_transformers_optimizer_and_onnxfuse_on_top(exported):
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from benchmarks.compare import ort_transformers_optimize
    from onnxfuse import optimize_model

    arch, m = exported
    before = m.SerializeToString()
    opt, fused = ort_transformers_optimize(m, None, suite.entry(arch).ort_optimizer(True), dry=True)
    assert m.SerializeToString() == before   # the input is not edited
    assert fused == ORT_FUSED[arch]
    assert {n.domain for n in opt.graph.node} >= {"com.microsoft"}
    feeds = _feeds(arch)
    want = _run(m, feeds)
    ort_opt = _run(opt, feeds)
    _assert_close(ort_opt, want, what=f"{arch} ORT optimizer")
    on_top = optimize_model(opt, static_shapes={k: v.shape for k, v in feeds.items()})
    _assert_close(_run(on_top.model, feeds), ort_opt, what=f"{arch} onnxfuse on the ORT-optimized model")


def test_ort_transformers_optimizer_fp16():
    """An fp16 case: the fp32 twin optimized, then converted by the optimizer."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    pytest.importorskip("onnxconverter_common")
    from benchmarks.compare import ort_transformers_optimize
    from models.fp16 import to_fp16

    m = mt.export("bert_base", small=True)
    opt, fused = ort_transformers_optimize(to_fp16(m), m, suite.entry("bert_base").ort_optimizer(True), dry=True)
    assert fused["Attention"] == 2
    feeds = _feeds("bert_base")
    got = _run(opt, feeds)
    assert got.dtype == np.float16
    _assert_close(got, _run(m, feeds), RTOL16, ATOL16, "bert_base ORT optimizer fp16")


def test_dynamo_exporter():
    why = mt.dynamo_available()
    if why is not None:
        with pytest.raises(mt.ExporterUnavailable, match="pip install onnxscript"):
            mt.export("bert_base", "dynamo", small=True)
        assert "\n" not in why
        pytest.skip(why)
    for arch in ARCHS:
        m = mt.export(arch, "dynamo", small=True)
        feeds = _feeds(arch)
        with torch.no_grad():
            want = mt.module(arch, small=True)(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        _assert_close(_run(m, feeds), want, what=f"{arch} dynamo")


@pytest.fixture(scope="module")
def dynamo_exports() -> dict[str, onnx.ModelProto]:
    why = mt.dynamo_available()
    if why is not None:
        pytest.skip(why)
    return {arch: mt.export(arch, "dynamo", small=True) for arch in ARCHS}


def _ort_cpu_ops(m: onnx.ModelProto, tmp_path) -> dict[str, int]:
    """Op types of the graph ONNX Runtime's CPU provider runs after its own fusions."""
    from collections import Counter

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(tmp_path / "ort_optimized.onnx")).graph.node)


@pytest.mark.parametrize("arch", ARCHS)
def test_fusions_survive_the_exporter_change(arch, dynamo_exports, tmp_path):
    """Issue 17: torch's two exporters write different graphs (dynamo: LayerNormalization ops,
    no shape arithmetic, its own GELU form). At static shapes onnxfuse fuses the same
    attentions and normalizations in both; a bias + GELU chain is left to ONNX Runtime exactly
    where ORT's BiasGelu fusion fires (TorchScript's form) and fused where it does not (dynamo's
    Erf form stays unfused in ORT); the fused models, run by the library's CPU kernels, compute
    what the originals do."""
    from collections import Counter

    from onnxfuse import optimize_model
    from onnxfuse.runtime import library_path

    feeds = _feeds(arch)
    shapes = {k: v.shape for k, v in feeds.items()}
    kinds = {}
    for exporter, m in (("torchscript", mt.export(arch, "torchscript", small=True)), ("dynamo", dynamo_exports[arch])):
        r = optimize_model(m, static_shapes=shapes)
        kinds[exporter] = Counter(f.kind for f in r.fused)
        left_to_bias_gelu = "left to ONNX Runtime's BiasGelu fusion" in r.report.not_fused
        assert left_to_bias_gelu == bool(_ort_cpu_ops(m, tmp_path)["BiasGelu"]), (exporter, r.report.not_fused)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.register_custom_ops_library(library_path())
        sess = ort.InferenceSession(r.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        _assert_close(sess.run(None, feeds)[0], _run(m, feeds), what=f"{arch} {exporter} onnxfuse")
    assert kinds["dynamo"]["attention"] == kinds["torchscript"]["attention"] == 2  # one per layer
    assert kinds["dynamo"]["rows"] == kinds["torchscript"]["rows"] >= 1


def test_unknown_exporter():
    with pytest.raises(ValueError, match="exporter"):
        mt.export("vit_s16", "tracing", small=True)


def test_suite_group():
    entries = suite.entries("transformer")
    assert [e.name for e in entries] == [*ARCHS, *(f"{a}_dynamo" for a in ARCHS)]
    assert {e.kind for e in entries} == {"transformer"}
    assert not {e.name for e in entries} & {e.name for e in suite.entries()}   # not in the CNN list
    assert len(suite.entries("all")) == len(suite.entries()) + len(entries)
    with pytest.raises(ValueError, match="group"):
        suite.entries("rnn")
    cases = suite.cases(None, names=["bert_base", "resnet18"])
    assert [c.name for c in cases[:4]] == ["bert_base_b1_fp32", "bert_base_b1_fp16", "bert_base_b8_fp32",
                                           "bert_base_b8_fp16"]
    assert {c.batch for c in cases[4:]} == set(suite.BATCHES)
    bert = suite.entry("bert_base")
    assert bert.shapes(8) == {"input_ids": (8, 128), "attention_mask": (8, 128)}
    assert bert.shapes(8, dry=True) == {"input_ids": (2, 16), "attention_mask": (2, 16)}
    f = bert.feeds(bert.shapes(2, dry=True), "fp16", dry=True)
    assert f["input_ids"].dtype == np.int64 and f["input_ids"].max() < mt.config("bert_base", True).vocab
    assert f["attention_mask"].tolist()[1] == [1] * 14 + [0] * 2
    vit = suite.entry("vit_s16")
    assert vit.shapes(1) == {"pixel_values": (1, 3, 224, 224)}
    assert vit.feeds(vit.shapes(1, dry=True), "fp16", dry=True)["pixel_values"].dtype == np.float16
    assert vit.ort_optimizer(False) == {"model_type": "vit", "num_heads": 6, "hidden_size": 384}
    assert suite.entry("gpt2_small").torch_module(dry=True).ln_f.normalized_shape == (64,)


def test_tf_optimizer_model_is_valid_onnx_for_onnxfuse(tmp_path):
    """ORT's transformers optimizer's in-memory model has com.microsoft nodes (Attention,
    SkipLayerNormalization) but, where no ORT session optimized it first (opt_level 0, or
    use_gpu without a CUDA EP), not that domain's opset import, which its save_model_to_file
    adds: `ort_transformers_optimize` gives the model as that file has it,
    which onnxfuse loads (it rejected every suite model's without)."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from benchmarks import compare
    from onnxfuse.load import load_model
    from onnxfuse.outputs import save_model

    (case,) = compare.suite_cases((2,), ("fp32",), ["bert_base"])
    options = {**case.ort_optimizer(True), "opt_level": 0}  # the fusions alone, no ORT session first
    model, stats = compare.ort_transformers_optimize(case.onnx(True), None, options, dry=True)
    assert stats["Attention"] == 2 and {n.domain for n in model.graph.node} >= {"com.microsoft"}
    assert ("com.microsoft", 1) in {(o.domain, o.version) for o in model.opset_import}
    save_model(model, tmp_path / "m.onnx")
    assert len(load_model(tmp_path / "m.onnx").graph.node) == len(model.graph.node)


def test_compare_dry_run_on_a_transformer(tmp_path):
    import json

    from benchmarks import compare

    out = tmp_path / "c.json"
    assert compare.main(["--suite", "--models", "bert_base", "--dry-run", "--batches", "2", "--dtypes", "fp32",
                         "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert set(case["variants"]) == {"ort", "ort_tfopt", "onnxfuse", "onnxfuse_tfopt", "torch_eager"}
    assert all(r["error"] is None for r in case["variants"].values()), case["variants"]
    assert case["gate_passed"] is True and case["tfopt_ops"]["Attention"] == 2
    assert case["variants"]["torch_eager"]["max_abs_err"] < 1e-4


def test_compare_tfopt_graph_variants_run_the_tfopt_models(tmp_path, monkeypatch):
    """ort_tfopt_graph and onnxfuse_tfopt_graph (asked alone) run ort_tfopt's and onnxfuse_tfopt's
    models, onnxfuse_tfopt_graph gated against ort_tfopt's outputs; the original is not
    optimized. No CUDA graphs on the CPU: _ort_variants runs them under other names (cuda_graph
    comes from a name ending in graph)."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from benchmarks import compare

    real_run, real_gate = compare._ort_variants, compare._gate
    seen: dict = {}
    gated: list = []

    def without_graphs(paths, feeds, provider, libraries, *a, **kw):
        seen.update(paths=dict(paths), libraries=dict(libraries))
        ran = real_run({f"{v}:cpu": p for v, p in paths.items()}, feeds, provider,
                       {f"{v}:cpu": lib for v, lib in libraries.items()}, *a, **kw)
        seen["outs"] = {v: ran[f"{v}:cpu"][1] for v in paths}
        return {v: ran[f"{v}:cpu"] for v in paths}

    def spy_gate(ref, ort_outs, outs, r):
        gated.append((ort_outs, r))
        return real_gate(ref, ort_outs, outs, r)

    monkeypatch.setattr(compare, "_ort_variants", without_graphs)
    monkeypatch.setattr(compare, "_gate", spy_gate)
    (case,) = compare.suite_cases((2,), ("fp32",), ["bert_base"])
    variants = compare.resolve_variants(("ort_tfopt_graph", "onnxfuse_tfopt_graph"), False, True)
    assert variants == ("ort", "ort_tfopt", "ort_tfopt_graph", "onnxfuse_tfopt_graph")
    res = compare.run_case(case, tmp_path, True, variants, 0, 2, log=lambda *a: None)
    assert set(res.variants) == set(variants)
    assert all(r.error is None for r in res.variants.values()), res.variants
    paths, libraries = seen["paths"], seen["libraries"]
    assert paths["ort_tfopt_graph"] == paths["ort_tfopt"] == str(tmp_path / f"{case.name}.tfopt.onnx")
    assert paths["onnxfuse_tfopt_graph"] == str(tmp_path / f"{case.name}.tfopt.onnxfuse.onnx")
    assert libraries["onnxfuse_tfopt_graph"] == (res.tfopt_fused_nodes > 0) and not libraries["ort_tfopt_graph"]
    assert not (tmp_path / f"{case.name}.onnxfuse.onnx").exists()  # no variant runs onnxfuse of the original
    ((base, r),) = gated
    assert r is res.variants["onnxfuse_tfopt_graph"] and base is seen["outs"]["ort_tfopt"]
    assert r.gate_passed is True and res.gate_passed is True and res.tfopt_ops["Attention"] == 2


def test_ort_transformers_optimizer_reads_shape_initializers():
    """The dynamo exporter writes a Reshape's shape as an initializer (TorchScript as a Constant
    node). Handed a ModelProto, ORT's transformers optimizer moves every initializer to external
    data for its session, whose shape inference then fails on it; compare.py hands it a file, and
    leaves the caller's model as it was."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from onnx import TensorProto, helper, numpy_helper

    from benchmarks.compare import ort_transformers_optimize

    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([-1, 2], np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    before = m.SerializeToString()
    out, _ = ort_transformers_optimize(m, None, {"model_type": "bert", "num_heads": 0, "hidden_size": 0}, dry=True)
    assert [n.op_type for n in out.graph.node] == ["Reshape", "Relu"]
    assert m.SerializeToString() == before
    (s,) = out.graph.initializer
    assert s.data_location != TensorProto.EXTERNAL and list(numpy_helper.to_array(s)) == [-1, 2]


def test_suite_runs_the_tf_optimizer_once_per_model_and_dtype(monkeypatch, tmp_path):
    """ORT's transformers optimizer does not depend on the batch: a suite case's
    `tf_optimized` runs it once per model and dtype, keeps it in the model cache, and a later
    run (a new process: new cases) loads it from there instead of running it again."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from benchmarks import compare

    calls = []
    real = compare.ort_transformers_optimize

    def counted(model, twin, options, dry):
        calls.append((model.graph.name, options["num_heads"], dry))
        return real(model, twin, options, dry)

    monkeypatch.setattr(compare, "ort_transformers_optimize", counted)
    b1, b2 = compare.suite_cases((1, 2), ("fp32",), ["bert_base"], tmp_path)
    first, second = b1.tf_optimized(True), b2.tf_optimized(True)
    assert len(calls) == 1 and first is second
    assert first[1]["Attention"] == 2
    assert (tmp_path / "bert_base_fp32_dry_tfopt.onnx").is_file()
    (later,) = compare.suite_cases((2,), ("fp32",), ["bert_base"], tmp_path)
    again = later.tf_optimized(True)
    assert len(calls) == 1   # from the cache
    assert again[1] == first[1] and again[0].SerializeToString() == first[0].SerializeToString()
    # and the case runs it through this, not on its own
    (uncached,) = compare.suite_cases((2,), ("fp32",), ["vit_s16"])
    assert uncached.tf_optimized is not None
    cnn = [c for c in compare.suite_cases((1,), ("fp32",), None) if c.ort_optimizer is None]
    assert cnn and all(c.tf_optimized is None for c in cnn)


def test_dynamo_ffn1_split_into_its_product_and_a_gelu_chain():
    """torch's dynamo exporter writes erf's GELU as hb * ((erf(hb / sqrt 2) + 1) * 0.5), which
    ONNX Runtime does not fuse: where tuning follows, the gemm kind takes FFN1's product, bias
    and GELU (7 nodes) into one GemmEpilogue. Where that loses, tuning's split candidate
    (`tune.split_epilogues`) gives the product back to ORT and fuses the bias + GELU as one
    chain; the model computes what the export does."""
    from onnxfuse import tune as tuning
    from onnxfuse.pipeline import rewrite_pass
    from onnxfuse.runtime import library_path
    from tests.util import passes_upto, tuned_options

    if (why := mt.dynamo_available()) is not None:
        pytest.skip(why)
    m = mt.export("vit_s16", small=True, exporter="dynamo")
    dims = {k: (2, *v) for k, v in mt.input_dims("vit_s16", small=True).items()}
    r = passes_upto(m, tuned_options("sm_90", dims, layout="nchw"), rewrite_pass)
    gemm = {f.node_name: len(f.source_nodes) for f in r.fused if f.kind == "gemm"}
    assert sorted(gemm.values()).count(7) == 2, r.report.summary()   # each layer's FFN1 with its GELU
    tuned = tuning.snapshot(r)
    split = tuning.split_epilogues(r, tuned, tuning.unfuse_nodes(tuned, set(gemm)))
    chains = [f for f in split.fused if f.kind == "pointwise"]
    assert [len(f.source_nodes) for f in chains] == [6, 6] and not [f for f in split.fused if f.kind == "gemm"]
    assert {f.kind for f in split.fused} == {"rows", "attention", "pointwise"}
    feeds = _feeds("vit_s16", batch=2)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(library_path())
    session = ort.InferenceSession(split.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    _assert_close(got, _run(m, feeds), what="vit_s16 dynamo, FFN1 split")
