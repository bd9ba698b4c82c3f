"""The gemm kind's matcher and lowering (onnxfuse.kinds.gemm) on hand-built graphs in the forms
exporters write: MatMul + bias + erf-GELU (decomposed), tanh-GELU, the Gelu op, SiLU, Relu,
Clip, a residual add, a Cast to float16; Gemm with transB; a batched A times a 2-D weight;
Transposes absorbed; products of two activations (declined unless the pattern allows them).
Each fused model is checked against the original in stock ONNX Runtime (the function bodies)
and each node against the numpy reference of its contract (tests.util.check_fusion); every
MatMul that does not fuse is reported with the reason; without tuning nothing is fused."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from onnx import helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds import gemm as gk
from onnxfuse.pattern import load_patterns
from onnxfuse.pipeline import NHWC_ONLY_PATTERNS
from tests.util import check_fusion, model, op_types, random_feeds, run

N = helper.make_node
# the built-in patterns of the nchw layout; `optimize` matches the gemm kind's only when the tune
# pass will time its nodes, or with $ONNXFUSE_GEMM_ALL=1 (`gemm_all`, below)
PATTERNS = [p for p in load_patterns() if p.name not in NHWC_ONLY_PATTERNS]
GEMM = next(p for p in PATTERNS if p.name == "gemm_epilogue")


@pytest.fixture(autouse=True)
def gemm_all(monkeypatch):
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")


def _w(shape, seed=0, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) / math.sqrt(shape[0] if len(shape) else 1)).astype(dtype)


def erf_gelu(x: str, y: str, p: str = "g") -> list:
    """GELU as torch.onnx.export writes it: x * 0.5 * (1 + erf(x / sqrt 2))."""
    return [N("Div", [x, f"{p}_sqrt2"], [f"{p}_d"]), N("Erf", [f"{p}_d"], [f"{p}_e"]),
            N("Add", [f"{p}_e", f"{p}_one"], [f"{p}_e1"]), N("Mul", [x, f"{p}_e1"], [f"{p}_m"]),
            N("Mul", [f"{p}_m", f"{p}_half"], [y])]


def erf_consts(p: str = "g", dtype=np.float32) -> dict:
    return {f"{p}_sqrt2": np.array(math.sqrt(2.0), dtype), f"{p}_one": np.array(1.0, dtype),
            f"{p}_half": np.array(0.5, dtype)}


def tanh_gelu(x: str, y: str) -> list:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return [N("Pow", [x, "t_three"], ["t_p"]), N("Mul", ["t_p", "t_c"], ["t_pc"]), N("Add", [x, "t_pc"], ["t_in"]),
            N("Mul", ["t_in", "t_s"], ["t_z"]), N("Tanh", ["t_z"], ["t_t"]), N("Add", ["t_t", "t_one"], ["t_t1"]),
            N("Mul", [x, "t_t1"], ["t_m"]), N("Mul", ["t_m", "t_half"], [y])]


TANH_CONSTS = {"t_three": np.array(3.0, np.float32), "t_c": np.array(0.044715, np.float32),
               "t_s": np.array(math.sqrt(2 / math.pi), np.float32), "t_one": np.array(1.0, np.float32),
               "t_half": np.array(0.5, np.float32)}


def ffn1(dtype: str = "float32", s: int = 5, k: int = 32, n: int = 48) -> tuple:
    """BERT's FFN1: x [B, S, K] @ W [K, N] + b, erf-GELU."""
    npd = np.float16 if dtype == "float16" else np.float32
    nodes = [N("MatMul", ["x", "w"], ["h"], name="mm"), N("Add", ["h", "b"], ["hb"], name="bias")]
    nodes += erf_gelu("hb", "y")
    inits = {"w": _w((k, n), 1, npd), "b": _w((n,), 2, npd), **erf_consts(dtype=npd)}
    return model(nodes, {"x": (dtype, ["B", s, k])}, {"y": (dtype, ["B", s, n])}, inits)


def gemm_fused(result) -> list:
    return [n for n in result.model.graph.node if n.op_type == "GemmEpilogue"]


def attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_matmul_bias_erf_gelu_is_one_node():
    r = check_fusion(ffn1(), expect_fused=1, patterns=PATTERNS)
    assert op_types(r.model) == ["GemmEpilogue"]
    (node,) = gemm_fused(r)
    a = attrs(node)
    # float32 constant weights packed K-major ([N, K]), read with trans_b
    assert (a["trans_a"], a["trans_b"]) == (0, 1) and "alpha" not in a
    packed = next(t for t in r.model.graph.initializer if t.name == node.input[1])
    assert tuple(packed.dims) == (48, 32)
    f = r.fused[0]
    assert f.kind == "gemm" and f.input_modes == ("full", "row")
    assert (f.params.m, f.params.n, f.params.k, f.params.batch) == (None, 48, 32, 1)
    assert f.source_nodes[0] == "MatMul mm" and len(f.source_nodes) == 7
    # the function body transposes the packed weights back, then runs the original nodes
    body = next(fn for fn in r.model.functions if fn.overload == f.kernel_name)
    assert [n.op_type for n in body.node][:3] == ["Constant", "Constant", "Constant"]
    assert [n.op_type for n in body.node if n.op_type != "Constant"] == [
        "Transpose", "MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul"]
    prog = a["program"].decode()
    assert "erfc" in prog and "output %" in prog


def test_static_batch_gives_m():
    r = check_fusion(ffn1(), expect_fused=1, patterns=PATTERNS)
    assert r.fused[0].params.m is None  # B symbolic
    m = model([N("MatMul", ["x", "w"], ["h"]), N("Relu", ["h"], ["y"])], {"x": ("float32", [2, 5, 32])},
              {"y": ("float32", [2, 5, 48])}, {"w": _w((32, 48))})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert (r.fused[0].params.m, r.fused[0].params.batch) == (10, 1)


def test_gemm_transb_with_bias_and_relu():
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5, beta=2.0), N("Relu", ["h"], ["y"])]
    m = model(nodes, {"x": ("float32", [6, 24])}, {"y": ("float32", [6, 40])},
              {"w": _w((40, 24), 3), "c": _w((40,), 4)})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    (node,) = gemm_fused(r)
    a = attrs(node)
    assert (a["trans_a"], a["trans_b"], a["alpha"]) == (0, 1, 0.5)
    # beta * C is the epilogue's first instruction; C is the first extra
    assert node.input[2] == "c" and "mul %1 2.0" in a["program"].decode()
    assert r.fused[0].input_modes == ("full", "row")


def test_batched_matmul_broadcast_weight_tanh_gelu():
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), *tanh_gelu("hb", "y")]
    m = model(nodes, {"x": ("float32", [2, 3, 5, 16])}, {"y": ("float32", [2, 3, 5, 24])},
              {"w": _w((16, 24)), "b": _w((24,), 5), **TANH_CONSTS})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    f = r.fused[0]
    assert (f.params.m, f.params.n, f.params.k, f.params.batch) == (30, 24, 16, 1)  # one GEMM of M = 2 * 3 * 5


def test_residual_add_and_gelu_op():
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Gelu", ["hb"], ["g"]),
             N("Add", ["g", "r"], ["y"])]
    m = model(nodes, {"x": ("float32", [4, 7, 32]), "r": ("float32", [4, 7, 16])}, {"y": ("float32", [4, 7, 16])},
              {"w": _w((32, 16)), "b": _w((16,), 6)}, opset=20)
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert r.fused[0].input_modes == ("full", "row", "full")


def test_silu_clip_and_cast_to_fp16():
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Sigmoid", ["h"], ["s"]), N("Mul", ["h", "s"], ["silu"]),
             N("Clip", ["silu", "lo", "hi"], ["c"]), N("Cast", ["c"], ["y"], to=10)]
    m = model(nodes, {"x": ("float32", [9, 32])}, {"y": ("float16", [9, 20])},
              {"w": _w((32, 20)), "lo": np.array(-1.0, np.float32), "hi": np.array(2.0, np.float32)})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS, rtol=1e-2)
    assert r.fused[0].program.outputs[0][1] == "f16"


def test_fp16_model():
    r = check_fusion(ffn1("float16"), expect_fused=1, patterns=PATTERNS, rtol=1e-2)
    (node,) = gemm_fused(r)
    # float16 weights are read as they are (no packed copy): MN-major B is fine for fp16 wgmma
    assert node.input[1] == "w" and attrs(node)["trans_b"] == 0
    assert r.fused[0].program.input_dtypes[0] == "f16"


def test_transpose_of_a_is_absorbed():
    nodes = [N("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), N("MatMul", ["xt", "w"], ["h"]),
             N("Relu", ["h"], ["y"])]
    m = model(nodes, {"x": ("float32", [3, 16, 5])}, {"y": ("float32", [3, 5, 8])}, {"w": _w((16, 8))})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert op_types(r.model) == ["GemmEpilogue"]
    a = attrs(gemm_fused(r)[0])
    assert a["trans_a"] == 1
    f = r.fused[0]
    assert (f.params.m, f.params.batch) == (5, 3)  # trans_a: batched, B shared


def _attention_scores(dynamic_b_pattern: bool):
    nodes = [N("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N("MatMul", ["q", "kt"], ["s"], name="qk"),
             N("Mul", ["s", "scale"], ["y"])]
    m = model(nodes, {"q": ("float32", [2, 3, 7, 16]), "k": ("float32", [2, 3, 7, 16])},
              {"y": ("float32", [2, 3, 7, 7])}, {"scale": np.array(0.25, np.float32)})
    pats = [dataclasses.replace(GEMM, match=dataclasses.replace(GEMM.match, dynamic_b=True))] + [
        p for p in PATTERNS if p is not GEMM] if dynamic_b_pattern else PATTERNS
    return m, pats


def test_products_of_two_activations_are_declined_by_default():
    m, pats = _attention_scores(False)
    r = optimize_model(m, pats)
    assert not gemm_fused(r)
    assert r.report.not_fused.get(gk.DYNAMIC_B) == 1, r.report.summary()


def test_attention_scores_with_dynamic_b():
    m, pats = _attention_scores(True)
    r = check_fusion(m, expect_fused=1, patterns=pats)
    a = attrs(gemm_fused(r)[0])
    assert (a["trans_a"], a["trans_b"]) == (0, 1)  # K^T read through the Transpose, absorbed
    assert r.fused[0].params.batch == 6


def test_lone_matmul_is_reported():
    m = model([N("MatMul", ["x", "w"], ["y"])], {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8])},
              {"w": _w((8, 8))})
    r = optimize_model(m, PATTERNS)
    assert not r.fused and r.report.not_fused.get(gk.NO_EPILOGUE) == 1


def test_matmul_output_read_elsewhere():
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Relu", ["h"], ["y"]), N("Sigmoid", ["h"], ["z"]),
             N("Neg", ["h"], ["u"])]
    m = model(nodes, {"x": ("float32", [4, 8])}, {"y": ("float32", [4, 8]), "z": ("float32", [4, 8]),
                                                   "h": ("float32", [4, 8])}, {"w": _w((8, 8))})
    r = optimize_model(m, PATTERNS)
    assert not gemm_fused(r) and r.report.not_fused.get(gk.OUTPUT_ELSEWHERE) == 1


def test_skip_layer_norm_adds_stay_with_onnx_runtime():
    """MatMul + bias + residual + LayerNormalization: ONNX Runtime fuses the residual add with
    the norm into SkipLayerNormalization, and once the bias runs after the product (the bias
    pass, onnxfuse.bias) the bias too. A GemmEpilogue of the product and its bias alone would
    only put a Triton GEMM where cuBLAS runs, so the gemm kind declines it, and nothing is
    half-fused."""
    from onnxfuse.graph import GraphView
    from onnxfuse.groups import Accepted
    from onnxfuse.load import infer_shapes
    from onnxfuse.ort_fusions import ort_fusions

    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Add", ["hb", "r"], ["s"]),
             N("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1)]
    m = model(nodes, {"x": ("float32", [2, 5, 32]), "r": ("float32", [2, 5, 16])}, {"y": ("float32", [2, 5, 16])},
              {"w": _w((32, 16)), "b": _w((16,), 1), "gamma": np.ones(16, np.float32),
               "beta": np.zeros(16, np.float32)}, opset=17)
    view = GraphView.build(m, infer_shapes(m))
    r = gk.match_gemm(view, GEMM, set(), Accepted(len(view.nodes)), ort_fusions(m).absorbed)
    assert not r.matches and r.anchors == {0: gk.BIAS_TO_TAKER}
    # without ORT's fusion to take it, the bias is an epilogue as any other
    r = gk.match_gemm(view, GEMM, set(), Accepted(len(view.nodes)), {})
    assert len(r.matches) == 1
    r = check_fusion(m, expect_fused=0, patterns=PATTERNS)
    assert op_types(r.model) == ["Reshape", "Gemm", "Reshape", "Add", "Add", "LayerNormalization"]


def test_the_body_runs_the_bias_after_the_product():
    """With static shapes, a GemmEpilogue's function body (what tuning times the node against,
    and what it goes back to where slower) runs the product without its bias and the bias Add
    after it, as ORT's transformers optimizer writes a layer: unfused, ONNX Runtime's BiasGelu
    and SkipLayerNormalization take the Adds, not a Gemm with the bias inside (its MatMul + Add
    fusion, two kernels). Equal layers keep one body (one function, one kernel); the outputs
    are the original's, fused and unfused. (FFN2's bias the bias pass moves in the graph:
    test_skip_layer_norm_adds_stay_with_onnx_runtime.)"""
    from onnxfuse import tune as tuning
    from onnxfuse.ort_fusions import ort_fusions

    def layer(p: str, x: str) -> list:  # FFN1 + GELU, FFN2 + bias + residual, LayerNorm
        return [N("MatMul", [x, "w1"], [f"{p}h"]), N("Add", [f"{p}h", "b1"], [f"{p}hb"]),
                *erf_gelu(f"{p}hb", f"{p}g", p), N("MatMul", [f"{p}g", "w2"], [f"{p}o"]),
                N("Add", [f"{p}o", "b2"], [f"{p}ob"]), N("Add", [f"{p}ob", x], [f"{p}s"]),
                N("LayerNormalization", [f"{p}s", "gamma", "beta"], [f"{p}y"], axis=-1)]

    m = model([*layer("a", "x"), *layer("b", "ay")], {"x": ("float32", [2, 5, 16])},
              {"by": ("float32", [2, 5, 16])},
              {"w1": _w((16, 48)), "b1": _w((48,), 1), "w2": _w((48, 16), 2), "b2": _w((16,), 3),
               "gamma": np.ones(16, np.float32), "beta": np.zeros(16, np.float32), **erf_consts("a"),
               **erf_consts("b")}, opset=17)
    r = check_fusion(m, expect_fused=2, patterns=PATTERNS)  # FFN2's bias is SkipLayerNormalization's
    bodies = {f.kernel_name: [n.op_type for n in fn.node if n.op_type != "Constant"]
              for f in r.fused for fn in r.model.functions if fn.overload == f.kernel_name}
    assert list(bodies.values()) == [  # the two layers share one body
        ["Transpose", "Reshape", "Gemm", "Reshape", "Add", "Div", "Erf", "Add", "Mul", "Mul"]]
    tuning.unfuse_nodes(r, {f.node_name for f in r.fused})
    assert not r.fused and "MatMul" not in op_types(r.model)
    absorbed = ort_fusions(r.model).absorbed
    takers = {absorbed.get(i) for i, n in enumerate(r.model.graph.node) if n.op_type == "Add"}
    assert takers == {"left to ONNX Runtime's BiasGelu fusion", "left to ONNX Runtime's SkipLayerNormalization fusion"}
    feeds = random_feeds(m)
    for e, a in zip(run(m, feeds), run(r.model, feeds), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_a_float16_body_runs_the_bias_after_the_product():
    """float16 weights are not packed: the body's Gemm reads them as the MatMul did."""
    npd = np.float16
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), *erf_gelu("hb", "y")]
    m = model(nodes, {"x": ("float16", [2, 5, 32])}, {"y": ("float16", [2, 5, 48])},
              {"w": _w((32, 48), 1, npd), "b": _w((48,), 2, npd), **erf_consts(dtype=npd)})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS, rtol=1e-2)
    fn = next(fn for fn in r.model.functions if fn.overload == r.fused[0].kernel_name)
    assert [n.op_type for n in fn.node if n.op_type != "Constant"] == [
        "Reshape", "Gemm", "Reshape", "Add", "Div", "Erf", "Add", "Mul", "Mul"]
    assert next(n for n in fn.node if n.op_type == "Gemm").input[1] == "x1"  # the weights, as given


def test_a_gemm_with_c_runs_it_after_the_product():
    """Gemm(A, B, C) with a 1-D C and alpha = beta = 1: the body is Gemm(A, B) + Add(C); with
    alpha or beta not 1 it stays as the export wrote it (test_gemm_transb_with_bias_and_relu)."""
    nodes = [N("Gemm", ["x", "w", "c"], ["h"], transB=1), N("Relu", ["h"], ["y"])]
    m = model(nodes, {"x": ("float32", [6, 24])}, {"y": ("float32", [6, 40])},
              {"w": _w((40, 24), 3), "c": _w((40,), 4)})
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    fn = next(fn for fn in r.model.functions if fn.overload == r.fused[0].kernel_name)
    gemm = next(n for n in fn.node if n.op_type == "Gemm")
    assert [n.op_type for n in fn.node] == ["Transpose", "Gemm", "Add", "Relu"] and len(gemm.input) == 2


def test_split_of_an_ort_fusion_is_declined():
    """A match that would hold only part of one of ONNX Runtime's fusions (here the GELU's last
    Mul is not available to it) is left to ONNX Runtime whole, with the reason."""
    from onnxfuse.graph import GraphView
    from onnxfuse.groups import Accepted
    from onnxfuse.load import infer_shapes

    m = ffn1()
    view = GraphView.build(m, infer_shapes(m))
    bias_gelu = "left to ONNX Runtime's BiasGelu fusion"
    reserved = {i: bias_gelu for i in range(1, len(view.nodes))}
    last = len(view.nodes) - 1
    r = gk.match_gemm(view, GEMM, {last}, Accepted(len(view.nodes)), reserved)
    assert not r.matches and r.anchors == {0: gk.split_reason("BiasGelu")}
    # with every node available, the match holds the whole fusion
    r = gk.match_gemm(view, GEMM, set(), Accepted(len(view.nodes)), reserved)
    assert len(r.matches) == 1 and len(r.matches[0].nodes) == len(view.nodes)


def test_an_offered_fusion_joins_a_chain_only_whole():
    """A pointwise chain takes the nodes of an offered ORT fusion (BiasGelu, where tuning times
    the chain against it) only when it holds all of them: with the GELU's last Mul out of its
    reach, none of the fusion's nodes join (ORT keeps its fusion whole) and the report says so."""
    from onnxfuse.graph import GraphView
    from onnxfuse.groups import Accepted
    from onnxfuse.load import infer_shapes
    from onnxfuse.match import Reserved, find_matches
    from onnxfuse.pipeline import TIMED_AGAINST_ORT

    m = ffn1()
    view = GraphView.build(m, infer_shapes(m))
    bias_gelu = "left to ONNX Runtime's BiasGelu fusion"
    reserved = {i: bias_gelu for i in range(1, len(view.nodes))}
    chains = [p for p in PATTERNS if p.kind.name == "pointwise"]
    whole = find_matches(view, chains, reserved, TIMED_AGAINST_ORT)
    assert [m_.nodes for m_ in whole.matches] == [tuple(range(1, len(view.nodes)))]
    last = len(view.nodes) - 1  # taken by something else
    r = chains[0].kind.match(view, chains[0], {0, last}, Accepted(len(view.nodes)),
                             Reserved(reserved, TIMED_AGAINST_ORT["pointwise"]))
    assert not r.matches and r.rejected[bias_gelu] == len(view.nodes) - 2
    assert not find_matches(view, chains, reserved).matches  # not offered: ORT's


def test_untuned_optimize_fuses_no_matmul(monkeypatch):
    """Without tuning (no GPU, --no-tune) the gemm patterns are not matched: each MatMul is
    reported with the reason, and the other patterns fuse as before."""
    monkeypatch.delenv("ONNXFUSE_GEMM_ALL", raising=False)
    r = optimize_model(ffn1())
    assert not gemm_fused(r)
    assert r.report.not_fused.get(gk.UNTUNED) == 1, r.report.summary()
    monkeypatch.setenv("ONNXFUSE_GEMM_ALL", "1")
    assert len(gemm_fused(optimize_model(ffn1()))) == 1


def test_packed_weights_are_the_nodes_own():
    """Two MatMuls sharing one float32 weight: each node packs its own copy (rounding one to
    TF32 at compile time changes no other reader); the original weight is gone."""
    nodes = [N("MatMul", ["x", "w"], ["h1"]), N("Relu", ["h1"], ["y1"]), N("MatMul", ["x", "w"], ["h2"]),
             N("Sigmoid", ["h2"], ["y2"])]
    m = model(nodes, {"x": ("float32", [4, 8])}, {"y1": ("float32", [4, 6]), "y2": ("float32", [4, 6])},
              {"w": _w((8, 6))})
    r = check_fusion(m, expect_fused=2, patterns=PATTERNS)
    names = [n.input[1] for n in gemm_fused(r)]
    assert len(set(names)) == 2 and "w" not in {t.name for t in r.model.graph.initializer}
    w = numpy_helper.to_array(next(t for t in r.model.graph.initializer if t.name == names[0]))
    np.testing.assert_array_equal(w, _w((8, 6)).T)


def test_unfused_nodes_share_their_weights_again():
    """What tuning leaves to ONNX Runtime is unfused: the two MatMuls read one weight tensor
    again, as in the original (torch exports a deep-copied block's identical layers with
    shared initializers; a copy per node multiplied a 4-layer encoder's weights by 4)."""
    from onnxfuse import tune as tuning

    nodes = [N("MatMul", ["x", "w"], ["h1"]), N("Relu", ["h1"], ["y1"]), N("MatMul", ["x", "w"], ["h2"]),
             N("Sigmoid", ["h2"], ["y2"])]
    m = model(nodes, {"x": ("float32", [4, 8])}, {"y1": ("float32", [4, 6]), "y2": ("float32", [4, 6])},
              {"w": _w((8, 6))})
    r = optimize_model(m, patterns=PATTERNS)
    assert len(r.fused) == 2
    tuning.unfuse_nodes(r, {f.node_name for f in r.fused})
    matmuls = [n for n in r.model.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == 2 and matmuls[0].input[1] == matmuls[1].input[1]
    [w] = [t for t in r.model.graph.initializer if t.name == matmuls[0].input[1]]
    np.testing.assert_array_equal(numpy_helper.to_array(w), _w((8, 6)))
    assert len(r.model.graph.initializer) == 1


def test_extra_modes():
    core = gk.Core(0, "a", "b", None, False, False, 1.0, 1.0, (), (2, 3, 4, 5), False, True)
    assert gk.extra_mode((2, 3, 4, 5), core) == "full"
    assert gk.extra_mode((5,), core) == "row" and gk.extra_mode((1, 1, 5), core) == "row"
    assert gk.extra_mode((1,), core) == "scalar"
    assert gk.extra_mode((2, 3, 1, 5), core) == "strided"  # per batch: collapses over (2, 3)
    assert gk.extra_mode((4, 1), core) == "strided"
    assert gk.extra_mode((2, 1, 4, 5), core) is None  # the batch group does not collapse to one stride
    flat = dataclasses.replace(core, flatten=True)
    assert gk.extra_mode((2, 3, 4, 1), flat) == "strided"  # M = 2 * 3 * 4 rows, contiguous
    assert gk.extra_mode((2, 1, 4, 5), flat) is None


def test_pattern_parameters():
    from onnxfuse.errors import PatternError
    from onnxfuse.kinds.base import Fields

    kind = GEMM.kind
    p = kind.parse(Fields({"min_nodes": 0, "dynamic_b": True}, "x.yaml", "match."), frozenset({"Relu"}),
                   frozenset({"float32"}))
    assert (p.min_nodes, p.dynamic_b) == (0, True) and {"MatMul", "Gemm", "Relu"} <= p.fused_ops
    with pytest.raises(PatternError, match="min_nodes"):
        kind.parse(Fields({"min_nodes": -1}, "x.yaml", "match."), frozenset(), frozenset({"float32"}))


def test_tuned_pipeline_matches_the_gemm_kind_and_never_keeps_it_unmeasured(tmp_path, monkeypatch):
    """With tuning on (as on a GPU), the gemm patterns are matched and compiled, and a chain may
    take the nodes of ORT's GELU fusions (`pipeline.TIMED_AGAINST_ORT`); when the tuning itself
    fails, both go back to ONNX Runtime (the heuristics never keep one)."""
    pytest.importorskip("triton")
    from onnxfuse import tune as tuning
    from onnxfuse.pipeline import build_options

    monkeypatch.delenv("ONNXFUSE_GEMM_ALL", raising=False)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    options = dataclasses.replace(build_options(target="sm_90", layout="nchw", tune="off"),
                                  tune=tuning.TuneSettings(budget_s=1.0))

    def fail(*args, **kwargs):
        raise RuntimeError("no GPU in this test")

    monkeypatch.setattr(tuning, "tune", fail)
    relu = model([N("MatMul", ["x", "w"], ["h"]), N("Add", ["h", "b"], ["hb"]), N("Relu", ["hb"], ["y"])],
                 {"x": ("float32", ["B", 5, 32])}, {"y": ("float32", ["B", 5, 48])},
                 {"w": _w((32, 48)), "b": _w((48,), 1)})
    with pytest.warns(Warning, match="not tuned"):
        r = optimize_model(relu, options=options)
    assert op_types(r.model) == ["MatMul", "Add", "Relu"]  # the GemmEpilogue's body, unfused
    assert r.report.not_fused.get(gk.UNTUNED) == 3, r.report.summary()
    # FFN1's bias + GELU: ORT's BiasGelu, offered to a chain that only tuning may keep
    from onnxfuse.pipeline import UNTUNED_OFFERED

    with pytest.warns(Warning, match="not tuned"):
        r = optimize_model(ffn1(s=5, k=32, n=48), options=options)
    assert not r.fused and "MatMul" in op_types(r.model) and "Transpose" not in op_types(r.model)
    assert r.report.not_fused.get(UNTUNED_OFFERED) == 6, r.report.summary()


def _torch_export(module, args, **kw):
    import io

    import onnx

    torch = pytest.importorskip("torch")
    f = io.BytesIO()
    # (with grad enabled: torch's encoder layer then exports its ops, not its fused fast path)
    torch.onnx.export(module.eval(), args, f, opset_version=17, dynamo=False, input_names=["x"], output_names=["y"],
                      **kw)
    return onnx.load_from_string(f.getvalue())


def test_torch_exported_mlp():
    """torch's Linear -> GELU -> Linear (+ the input: a residual) as torch.onnx.export writes it:
    two GemmEpilogue nodes (bias + erf-GELU; bias + residual), nothing left over."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    m = _torch_export(Mlp(), (torch.randn(2, 7, 32),), dynamic_axes={"x": {0: "batch"}})
    r = check_fusion(m, expect_fused=2, patterns=PATTERNS)
    assert op_types(r.model) == ["GemmEpilogue", "GemmEpilogue"], r.report.summary()
    assert [f.input_modes for f in r.fused] == [("full", "row"), ("full", "row", "full")]


def test_torch_encoder_layer():
    """torch's TransformerEncoderLayer (GELU, post-norm): each FFN1 fuses with its bias and GELU;
    attention's products of two activations are the attention kind's (one FusedAttention per
    layer), not the gemm kind's, and no fusion of ONNX Runtime's is split; the optimized model
    computes what the original does."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, activation="gelu", batch_first=True)
    m = _torch_export(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(2, 16, 64),))
    r = check_fusion(m, patterns=PATTERNS, output_rtol=1e-5)  # the moved biases: another rounding order
    ffn1 = [f for f in r.fused if f.kind == "gemm" and any(s.startswith("Erf") for s in f.source_nodes)]
    assert len(ffn1) == 2, r.report.summary()
    assert [f.kind for f in r.fused].count("attention") == 2, r.report.summary()
    assert r.report.not_fused.get(gk.DYNAMIC_B) is None  # QK^T and PV are in the attention nodes
    assert not [k for k in r.report.not_fused if "would split" in k], r.report.summary()


def test_an_epilogue_along_a_residual_stream_is_bounded():
    """A MatMul whose output joins a residual stream of 300 same-shaped Adds: its epilogue
    grows over the nearest MAX_EPILOGUE_NODES of them only (each anchor's work is bounded, so
    matching stays linear in the graph), and the fused node is still right."""
    from onnxfuse.graph import GraphView
    from onnxfuse.load import canonicalize, infer_shapes
    from onnxfuse.match import MAX_EPILOGUE_NODES, grow_epilogue

    nodes = [N("MatMul", ["x", "w"], ["h0"])]
    inits = {"w": _w((16, 16))}
    for k in range(300):
        nodes.append(N("Add", [f"h{k}", f"r{k}"], [f"h{k + 1}"]))
    inputs = {"x": ("float32", [4, 16])} | {f"r{k}": ("float32", [4, 16]) for k in range(300)}
    m = model(nodes, inputs, {"h300": ("float32", [4, 16])}, inits)
    canonical = canonicalize(m)
    view = GraphView.build(canonical, infer_shapes(canonical))
    grown = grow_epilogue(view, 0, (4, 16), GEMM, set())
    assert grown == set(range(1, MAX_EPILOGUE_NODES + 1))  # the nearest, in order
    r = check_fusion(m, expect_fused=2, patterns=PATTERNS)  # the rest of the stream: a pointwise chain
    (f,) = [f for f in r.fused if f.kind == "gemm"]
    assert len(f.source_nodes) == 1 + MAX_EPILOGUE_NODES


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_bare_16_bit_product_is_offered_to_cublaslt(dtype):
    """A MatMul with nothing after it to fuse (`gemm_library`, `library_only`): in 16 bits one
    GemmEpilogue whose first variant is cuBLASLt's with no epilogue (tuning times its ranked
    algorithms against ORT's MatMul), computing what the MatMul did; in float32 it stays ORT's,
    reported as before (the library pattern's own reasons do not replace the general one's)."""
    from onnxfuse.codegen_gemm import library_epilogue

    m = model([N("MatMul", ["x", "w"], ["y"])], {"x": (dtype, [2, 16, 32])}, {"y": (dtype, [2, 16, 24])},
              {"w": _w((32, 24), 0, np.float16 if dtype == "float16" else np.float32)})
    if dtype == "float32":
        r = optimize_model(m, PATTERNS)
        assert not r.fused and r.report.not_fused.get(gk.NO_EPILOGUE) == 1, r.report.not_fused
        return
    r = check_fusion(m, 1)
    (f,) = r.fused
    assert f.kind == "gemm" and not f.program.instrs and op_types(r.model) == ["GemmEpilogue"]
    lib = library_epilogue(f.program, tuple(f.input_modes[1:]))
    assert lib is not None and lib.activation == "none" and lib.bias == -1


def _small_bert_fp16_through(last_pass):
    """The small BERT in fp16 through the passes up to `last_pass`, as where the tune pass will
    time its nodes (on the CPU, nothing compiled); the result and the input dims."""
    pytest.importorskip("onnxconverter_common")
    import models.transformers as mt
    from models.fp16 import to_fp16
    from tests.util import passes_upto, tuned_options

    m = to_fp16(mt.export("bert_base", small=True))
    dims = {k: (2, *v) for k, v in mt.input_dims("bert_base", small=True).items()}
    return passes_upto(m, tuned_options("none", dims), last_pass), dims


def test_bert_out_projection_and_ffn2_products_are_offered_bare():
    """BERT's out-projection and FFN2 in fp16 where the tune pass will time them: the bias pass
    makes each a Gemm between Reshapes with its bias after, which ORT's SkipLayerNormalization
    takes with the residual add; the library pattern reads the Gemm through its Reshapes and
    offers the bare product (one node per product, the bias Add left outside), while FFN1 keeps
    its bias + GELU in gemm_epilogue's cuBLASLt node (the passes up to matching, on the CPU)."""
    from onnxfuse.pipeline import match_pass

    r, _ = _small_bert_fp16_through(match_pass)
    nodes = r.model.graph.node
    bare = [x for x in r.found.matches if x.pattern.name == "gemm_library"]
    names = sorted(n.name for x in bare for n in (nodes[i] for i in x.nodes) if n.op_type == "Gemm")
    assert names == [f"/layers.{k}/{p}/MatMul.gemm" for k in (0, 1) for p in ("attention/out", "fc2")], names
    for x in bare:
        assert not x.pointwise and sorted(nodes[i].op_type for i in x.nodes) == ["Gemm", "Reshape", "Reshape"]
    ffn1 = [x for x in r.found.matches if x.pattern.name == "gemm_epilogue"]
    assert len(ffn1) == 2 and all(any(nodes[i].op_type == "Erf" for i in x.nodes) for x in ffn1)


def test_a_bare_products_original_is_timed_without_its_output_reshape():
    """The Gemm between Reshapes that gemm_library takes: cut out alone, its original would end
    in the Reshape back to [B, S, N], which ONNX Runtime copies into the graph output (in the
    model it is an alias): tuning times the Reshape and the Gemm, the output [B*S, N]."""
    from onnxfuse import tune as tuning
    from onnxfuse.pipeline import rewrite_pass

    r, dims = _small_bert_fp16_through(rewrite_pass)
    bare = [f for f in r.fused if f.pattern == "gemm_library"]
    assert len(bare) == 4
    feeds = {k: np.ones(v, np.int64) for k, v in dims.items()}  # token ids and a mask
    infos = tuning.tensor_infos(r.model, dims, feeds, {x for f in bare for x in (*f.inputs, *f.outputs)}, "cpu")
    nodes = {n.name: n for n in r.model.graph.node}
    for f in bare:
        orig = tuning.original_model(r.model, nodes[f.node_name], infos)
        assert [n.op_type for n in orig.graph.node if n.op_type != "Constant"] == ["Reshape", "Gemm"], f.node_name
        assert len(orig.graph.node) <= 3  # the dropped Reshape's shape went with it
        (out,) = orig.graph.output
        a, b = (infos[x].type.tensor_type.shape.dim for x in (f.inputs[0], f.outputs[0]))
        assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [a[0].dim_value * a[1].dim_value,
                                                                          b[-1].dim_value]
