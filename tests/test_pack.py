"""Packing an attention's Q, K and V projections (onnxfuse.pack): three MatMuls of one input
(with their bias Adds) become one over the concatenated weights, one Add of the concatenated
bias and a Split, which the attention absorbs with the Add (its split_q / split_k / split_v and
bias_q / bias_k / bias_v): no Split, no Add, no Transpose and one MatMul left; the fused model
computes what the original does (function bodies in stock ONNX Runtime, each node's numpy
reference: tests.util.check_fusion; the library's CPU kernel, float32 and float16)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.kinds.attention import BIAS_NOTE
from onnxfuse.pipeline import PACKED
from tests.test_attention_patterns import PATTERNS
from tests.util import check_fusion, check_library, model, op_types, random_feeds, run

N = helper.make_node
B, S, H, D = 2, 6, 2, 8
E = H * D


def _bert_attention(bias: bool = True, cross: bool = False, opset: int = 17, dtype: str = "float32"):
    """x [B, S, E] -> q, k, v projections (k and v of `mem` when cross) -> heads -> attention."""
    rng = np.random.default_rng(3)
    inits = {"shape": np.array([B, S, H, D], np.int64), "scale": np.array(np.sqrt(D), dtype)}
    nodes = []
    for w in "qkv":
        src = "mem" if cross and w != "q" else "x"
        inits[f"w{w}"] = (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype)
        nodes.append(N("MatMul", [src, f"w{w}"], [f"{w}p" if bias else f"{w}b"]))
        if bias:
            inits[f"b{w}"] = (0.1 * rng.standard_normal(E)).astype(dtype)
            nodes.append(N("Add", [f"b{w}", f"{w}p"], [f"{w}b"]))  # torch writes the bias first
        nodes.append(N("Reshape", [f"{w}b", "shape"], [f"{w}4"]))
    nodes += [N("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]), N("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              N("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]), N("MatMul", ["qh", "kt"], ["s"]),
              N("Div", ["s", "scale"], ["t"]), N("Softmax", ["t"], ["p"], axis=-1), N("MatMul", ["p", "vh"], ["o"]),
              N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    inputs = {"x": (dtype, [B, S, E])}
    if cross:
        inputs["mem"] = (dtype, [B, S, E])
    return model(nodes, inputs, {"y": (dtype, [B, S, H, D])}, inits, opset=opset)


def test_projections_packed_and_read_in_place():
    m = _bert_attention()
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    ops = op_types(r.model)
    assert ops == ["MatMul", "FusedAttention"], ops  # no Split, Reshape, Transpose; the bias Add absorbed
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    product = r.model.graph.node[0].output[0]
    assert list(node.input[:3]) == [product] * 3  # Q, K and V: one packed product, before its bias
    assert [attrs[f"split_{w}"] for w in "qkv"] == [[0, H, D], [E, H, D], [2 * E, H, D]]
    assert [attrs[f"bias_{w}"] for w in "qkv"] == [3, 3, 3] and len(node.input) == 4  # no extras: one bias
    assert r.report.notes.get(PACKED) == 1
    assert any(note.startswith(BIAS_NOTE) for note in r.report.notes), r.report.notes
    # the three weights and biases are gone; one packed copy of each is there
    inits = {t.name: t for t in r.model.graph.initializer}
    assert not {"wq", "wk", "wv", "bq", "bk", "bv"} & set(inits)
    assert sorted(tuple(t.dims) for t in inits.values() if len(t.dims) == 2) == [(E, 3 * E)]
    assert tuple(inits[node.input[3]].dims) == (3 * E,)
    # the function body is the original subgraph, the Add included
    body = next(f for f in r.model.functions if f.overload == node.overload)
    assert [n.op_type for n in body.node].count("Add") == 1


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_packed_bias_in_the_library_cpu_kernel(dtype):
    """The fused model through the custom-op library's CPU kernel (the bias added as it reads
    Q, K and V) gives the original model's output."""
    from tests.test_attention_patterns import _run_with_library

    m = _bert_attention(dtype=dtype)
    r = optimize_model(m, PATTERNS)
    assert op_types(r.model) == ["MatMul", "FusedAttention"], r.report.summary()
    feeds = random_feeds(m)
    (want,), (got,) = run(m, feeds), _run_with_library(r.model, feeds)
    assert got.dtype == want.dtype
    tol = 1e-5 if dtype == "float32" else 1e-2
    w64 = want.astype(np.float64)
    np.testing.assert_allclose(got.astype(np.float64), w64, rtol=tol, atol=tol * float(np.abs(w64).max()))


def test_without_bias_and_at_opset_11():
    for bias, opset in ((False, 17), (True, 11)):
        m = _bert_attention(bias=bias, opset=opset)
        r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
        assert op_types(r.model).count("MatMul") == 1 and "Split" not in op_types(r.model), (bias, opset)


def test_cross_attention_is_not_packed():
    """Q from one input, K and V from another: nothing to pack; the attention still fuses."""
    m = _bert_attention(cross=True)
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert op_types(r.model).count("MatMul") == 3 and PACKED not in r.report.notes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_cross_attentions_biases_are_added_in_the_kernel(dtype):
    """Nothing to pack, but each projection's bias Add before its head Reshape is absorbed: the
    attention reads each product as a split [0, H, D] of it and adds the bias as it loads the
    operand (BART's and OPT's per-operand projections, Qwen2's V); the same values in the
    function bodies, the numpy reference and the library's CPU kernel."""
    m = _bert_attention(cross=True, dtype=dtype)
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert op_types(r.model) == ["MatMul", "MatMul", "MatMul", "FusedAttention"], op_types(r.model)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert [attrs[f"split_{w}"] for w in "qkv"] == [[0, H, D]] * 3
    assert [attrs[f"bias_{w}"] for w in "qkv"] == [3, 4, 5]
    assert list(node.input[:3]) == [n.output[0] for n in r.model.graph.node[:3]]  # the products, before their bias
    assert any(note.startswith(BIAS_NOTE) for note in r.report.notes), r.report.notes
    check_library(m, r.model, dtype)


def test_nothing_packed_without_the_attention_pattern():
    m = _bert_attention()
    r = optimize_model(m, [p for p in PATTERNS if p.name != "attention"])
    assert op_types(r.model).count("MatMul") == 5 and PACKED not in r.report.notes


# ---------------------------------------------------------------------------------------
# The bias after the product (bias_after_product)
# ---------------------------------------------------------------------------------------

def _ort_ops(m, tmp_path) -> list[tuple[str, int]]:
    """(op type, inputs given) of each node ONNX Runtime runs after its own fusions (CPU EP,
    ORT_ENABLE_EXTENDED, as the CUDA EP has them: onnxfuse.ort_fusions)."""
    import onnx
    import onnxruntime as ort

    from onnxfuse.runtime import library_path

    so = ort.SessionOptions()
    so.register_custom_ops_library(library_path())
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "ort.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [(n.op_type, sum(1 for i in n.input if i)) for n in onnx.load(str(tmp_path / "ort.onnx")).graph.node]


def _layer(form: str, tail: str):
    """A projection x [B, S, E] -> [B, S, F] with a bias, as exporters write it ("matmul":
    MatMul + Add, static shapes; "gemm": GPT-2's Conv1D, Reshape -> Gemm with C -> Reshape),
    then `tail`: "residual" (+ r, LayerNormalization), "gelu" (erf-GELU), "relu", "output"."""
    rng = np.random.default_rng(5)
    f = 3 * E
    inits = {"w": rng.standard_normal((E, f)).astype(np.float32) / 4, "b": rng.standard_normal(f).astype(np.float32),
             "g": np.ones(f, np.float32), "beta": np.zeros(f, np.float32), "rows": np.array([-1, E], np.int64),
             "back": np.array([B, S, f], np.int64), "half": np.array(0.5, np.float32),
             "sqrt2": np.array(np.sqrt(2.0), np.float32), "one": np.array(1.0, np.float32)}
    if form == "matmul":
        nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["h"])]
    else:
        nodes = [N("Reshape", ["x", "rows"], ["x2"]), N("Gemm", ["x2", "w", "b"], ["p2"]),
                 N("Reshape", ["p2", "back"], ["h"])]
    inputs = {"x": ("float32", [B, S, E])}
    if tail == "residual":
        nodes += [N("Add", ["h", "r"], ["s"]), N("LayerNormalization", ["s", "g", "beta"], ["y"], epsilon=1e-5)]
        inputs["r"] = ("float32", [B, S, f])
    elif tail == "gelu":
        nodes += [N("Div", ["h", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["e1"]),
                  N("Mul", ["h", "e1"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    elif tail == "relu":
        nodes += [N("Relu", ["h"], ["y"])]
    else:
        nodes += [N("Identity", ["h"], ["y"])]
    return model(nodes, inputs, {"y": ("float32", [B, S, f])}, inits, opset=17)


@pytest.mark.parametrize("form", ["matmul", "gemm"])
@pytest.mark.parametrize("tail, taker", [("residual", ("SkipLayerNormalization", 5)), ("gelu", ("BiasGelu", 2))])
def test_bias_moves_where_an_ort_fusion_takes_it(form, tail, taker, tmp_path):
    """Where ONNX Runtime would run the bias inside its Gemm (MatMulAddFusion before its
    SkipLayerNormalization and BiasGelu fusions), the bias is added after the product and ORT
    then runs a Gemm without C and the fused node with the bias; the same values."""
    from onnxfuse.pipeline import BIAS_AFTER

    m = _layer(form, tail)
    before = _ort_ops(m, tmp_path)
    assert ("Gemm", 3) in before and taker not in before
    r = check_fusion(m, expect_fused=0)
    assert r.report.notes[BIAS_AFTER] == 1
    after = _ort_ops(r.model, tmp_path)
    assert ("Gemm", 2) in after and taker in after and ("Gemm", 3) not in after, after


def test_bias_stays_where_nothing_takes_it():
    """A bias that neither ORT's fusions nor a fused node would take (the product is the graph's
    output) stays in the Gemm."""
    from onnxfuse.pipeline import BIAS_AFTER

    r = optimize_model(_layer("gemm", "output"))
    assert BIAS_AFTER not in r.report.notes
    (gemm,) = [n for n in r.model.graph.node if n.op_type == "Gemm"]
    assert len(gemm.input) == 3


def test_bias_moves_into_a_pointwise_chain(tmp_path):
    """A bias whose Add a pointwise chain takes moves there: the Gemm without C and one kernel
    for bias and Relu, where ORT's CUDA EP would run the Gemm's two and a Relu."""
    from onnxfuse.pipeline import BIAS_AFTER

    r = check_fusion(_layer("gemm", "relu"), expect_fused=1)
    assert r.report.notes[BIAS_AFTER] == 1
    (f,) = r.fused
    assert f.kind == "pointwise" and [s.split()[0] for s in f.source_nodes] == ["Add", "Relu"]
    assert [op for op, _ in _ort_ops(r.model, tmp_path) if op not in ("Reshape",)] == ["Gemm", "PointwiseChain"]
    (gemm,) = [n for n in r.model.graph.node if n.op_type == "Gemm"]
    assert len(gemm.input) == 2


def test_a_bias_move_keeps_what_a_subgraph_reads(tmp_path):
    """An initializer that only an If's branch reads (DeBERTa's relative positions as
    transformers 5.17 exports them, once --shape has folded their main-graph readers) stays
    when the bias moves: the model ONNX Runtime loads computes what the original does. (It
    was dropped, and ORT refused the model: "Nodes in a graph must be topologically sorted".)"""
    from onnxfuse.ir import unproduced_reads
    from onnxfuse.pipeline import BIAS_AFTER

    m = _layer("matmul", "residual")
    g = m.graph
    k = np.arange(4, dtype=np.float32)
    g.initializer.extend([helper.make_tensor("k", 1, [4], k), helper.make_tensor("k2", 1, [4], -k)])
    branch = lambda name: helper.make_graph([N("Identity", [name], [f"{name}_out"])], f"{name}_branch", [],  # noqa: E731
                                           [helper.make_tensor_value_info(f"{name}_out", 1, [4])])
    g.input.append(helper.make_tensor_value_info("c", 9, []))
    g.node.append(N("If", ["c"], ["z"], then_branch=branch("k"), else_branch=branch("k2")))
    g.output.append(helper.make_tensor_value_info("z", 1, [4]))
    for c in (True, False):
        feeds = random_feeds(m) | {"c": np.array(c)}
        r = check_fusion(m, expect_fused=0, feeds=feeds)
        assert r.report.notes[BIAS_AFTER] == 1
        assert not unproduced_reads(r.model.graph)
        np.testing.assert_array_equal(run(r.model, feeds)[1], k if c else -k)
