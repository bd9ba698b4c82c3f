"""The kmajor pass (onnxfuse/kmajor.py): the float32 products ONNX Runtime runs itself get their
constant weights K-major (Gemm, transB 1), and compute what they computed; products whose
neighbours ORT fuses with them, shared weights, 16-bit weights and symbolic batched inputs are
left as they are, and products under MIN_FLOPS unless `$ONNXFUSE_KMAJOR=all` (the tests' models are
small). Its speed is measured on the GPU (BENCHMARKS.md, `kmajor-weights`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.graph import GraphView
from onnxfuse.kmajor import kmajor_weights
from onnxfuse.load import infer_shapes


def _shapes(m: onnx.ModelProto) -> dict:
    v = GraphView.build(m, infer_shapes(m))
    return {k: (s, v.types.get(k, 0)) for k, s in v.shapes.items()}


def _run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _model(x_dims=(2, 3, 16), dtype=TensorProto.FLOAT):
    """x -> MatMul W1 (3-D A) -> Relu -> Reshape [-1, 32] -> Gemm W2 (+ C) -> MatMul W3 -> Add (read by an
    Add: left) ; x -> Transpose -> MatMul W4 (A a Transpose: left); W5 read by two MatMuls (left)."""
    npdt = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)

    def w(name, *dims):
        return numpy_helper.from_array((rng.standard_normal(dims) * 0.3).astype(npdt), name)
    inits = [w("W1", 16, 32), w("W2", 32, 8), w("C2", 8), w("W3", 8, 8), w("W4", 3, 5), w("W5", 8, 4),
             numpy_helper.from_array(np.array([-1, 32], np.int64), "rows")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm1"),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Reshape", ["b", "rows"], ["b2"]),
             helper.make_node("Gemm", ["b2", "W2", "C2"], ["c"], name="gemm2", alpha=0.5),
             helper.make_node("MatMul", ["c", "W3"], ["d"], name="mm3_read_by_add"),
             helper.make_node("Add", ["d", "c"], ["y"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["xt", "W4"], ["y2"], name="mm4_after_transpose"),
             helper.make_node("MatMul", ["c", "W5"], ["y3"], name="mm5_shared"),
             helper.make_node("MatMul", ["d", "W5"], ["y4"], name="mm5_shared_too")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, list(x_dims))],
                          [helper.make_tensor_value_info(n, dtype, d) for n, d in
                           (("y", [None, 8]), ("y2", [None, 16, 5]), ("y3", [None, 4]), ("y4", [None, 4]))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@pytest.fixture
def small_too(monkeypatch):
    monkeypatch.setenv("ONNXFUSE_KMAJOR", "all")


def test_float32_products_get_kmajor_weights_and_compute_the_same(small_too):
    m = _model()
    before = m.SerializeToString()
    out, done = kmajor_weights(m, _shapes(m))
    assert m.SerializeToString() == before  # the input is not changed
    assert done == ["mm1", "gemm2"]
    onnx.checker.check_model(out)
    by_name = {n.name: n for n in out.graph.node}
    for name in ("mm1", "gemm2"):
        n = by_name[name]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert n.op_type == "Gemm" and attrs["transB"] == 1
    assert {a.name: helper.get_attribute_value(a) for a in by_name["gemm2"].attribute}["alpha"] == 0.5
    assert by_name["gemm2"].input[2] == "C2"
    # the left ones: read by an Add, A a Transpose, a weight two nodes read
    for name in ("mm3_read_by_add", "mm4_after_transpose", "mm5_shared", "mm5_shared_too"):
        assert by_name[name].op_type == "MatMul"
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert "W1" not in inits and "W2" not in inits  # replaced, not kept beside their copies
    w1 = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "W1"))
    assert np.array_equal(inits[by_name["mm1"].input[1]], w1.T)
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    for want, got in zip(_run(m, {"x": x}), _run(out, {"x": x}), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _transposed_weight_model(shared: str = ""):
    """x [2, 3, 16] -> MatMul(x, Transpose(Wt)), Wt [32, 16] stored K-major (a dynamo export's
    Linear, a packed weight given back by tuning); `shared`: "weight" (Wt read by another
    node too) or "transpose" (its output read by another node too)."""
    wt = numpy_helper.from_array((np.random.default_rng(0).standard_normal((32, 16)) * 0.3).astype(np.float32), "Wt")
    nodes = [helper.make_node("Transpose", ["Wt"], ["W"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 32])]
    if shared:
        nodes.append(helper.make_node("Relu", ["Wt" if shared == "weight" else "W"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16])],
                          outputs, [wt])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_weight_stored_kmajor_behind_a_transpose_is_read_as_it_is(small_too):
    """MatMul(x, Transpose(Wt)): ORT would fold the Transpose into an N-major copy; the Gemm
    reads Wt itself with transB 1 (no copy, the Transpose gone) and computes the same. Where Wt
    or the Transpose's output is read elsewhere, the product is left as it is."""
    m = _transposed_weight_model()
    out, done = kmajor_weights(m, _shapes(m))
    assert done == ["mm"]
    onnx.checker.check_model(out)
    gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
    assert gemm.input[1] == "Wt" and {a.name: a.i for a in gemm.attribute} == {"transB": 1}
    assert [t.name for t in out.graph.initializer if t.data_type == TensorProto.FLOAT] == ["Wt"]
    assert "Transpose" not in {n.op_type for n in out.graph.node}
    x = np.random.default_rng(1).standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(out, {"x": x})[0], _run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)
    for shared in ("weight", "transpose"):
        m = _transposed_weight_model(shared)
        assert kmajor_weights(m, _shapes(m)) == (m, [])


def test_small_products_and_the_switch(monkeypatch):
    """By default only products of at least MIN_FLOPS: the small model's are all below it, a
    batch of 4096 rows lifts its 3-D MatMul (2 * 4096 * 16 * 32 = 4.2 MFLOP) over a lowered bar;
    ONNXFUSE_KMAJOR=0 turns the pass off."""
    from onnxfuse import kmajor

    m = _model()
    monkeypatch.delenv("ONNXFUSE_KMAJOR", raising=False)
    assert kmajor_weights(m, _shapes(m)) == (m, [])
    big = _model(x_dims=(2, 2048, 16))
    monkeypatch.setattr(kmajor, "MIN_FLOPS", 2 * 4096 * 16 * 32)
    assert kmajor_weights(big, _shapes(big))[1] == ["mm1"]  # the Gemm's 4096 x 32 x 8 is below
    monkeypatch.setenv("ONNXFUSE_KMAJOR", "0")
    assert kmajor_weights(big, _shapes(big)) == (big, [])


def test_what_is_left_as_it_is(small_too):
    # float16 weights: 16-bit tensor-core products read either layout alike
    m16 = _model(dtype=TensorProto.FLOAT16)
    out, done = kmajor_weights(m16, _shapes(m16))
    assert done == [] and out is m16
    # a symbolic batch: M unknown, neither product is rewritten
    ms = _model(x_dims=("batch", 3, 16))
    _, done = kmajor_weights(ms, _shapes(ms))
    assert done == []
    # a weight that is also a graph input (a default the caller may override)
    mi = _model()
    w1 = next(t for t in mi.graph.initializer if t.name == "W1")
    mi.graph.input.append(helper.make_tensor_value_info("W1", TensorProto.FLOAT, list(w1.dims)))
    _, done = kmajor_weights(mi, _shapes(mi))
    assert done == ["gemm2"]
    # a Gemm already K-major
    mt = _model()
    gemm = next(n for n in mt.graph.node if n.name == "gemm2")
    w2 = next(t for t in mt.graph.initializer if t.name == "W2")
    w2.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w2).T), "W2"))
    gemm.attribute.append(helper.make_attribute("transB", 1))
    _, done = kmajor_weights(mt, _shapes(mt))
    assert done == ["mm1"]


def _passes(arch: str, target: str = "sm_90", **kw):
    pytest.importorskip("torch")
    from models import transformers as mt
    from onnxfuse.pipeline import build_options, kmajor_pass
    from tests.util import passes_upto

    m = mt.export(arch, small=True)
    dims = {k: (2, *v) for k, v in mt.input_dims(arch, small=True).items()}
    return m, dims, passes_upto(m, build_options(target=target, tune="off", shapes=dims, **kw), kmajor_pass)


@pytest.mark.parametrize("arch", ["bert_base", "gpt2_small"])
def test_a_transformers_products_left_to_onnx_runtime(arch, small_too):
    """BERT's and GPT-2's small float32 twins at a static batch, untuned (every product left to
    ONNX Runtime): each projection's weight K-major (BERT's packed QKV MatMul between Reshapes,
    the Gemms the bias pass made, GPT-2's Conv1D Gemms), the report says how many, and ORT on the
    CPU (the fused nodes through their function bodies) computes what the original does."""
    from models import transformers as mt
    from onnxfuse.kmajor import NOTE as KMAJOR

    m, dims, r = _passes(arch)
    products = [n for n in r.model.graph.node if n.op_type in ("MatMul", "Gemm")]
    kmajor = [n for n in products if n.op_type == "Gemm"
              and any(a.name == "transB" and a.i == 1 for a in n.attribute)]
    assert r.report.notes[KMAJOR] == len(kmajor) >= 4 * 2  # four products a layer, two layers
    left = [n.name for n in products if n not in kmajor]
    assert all(n.op_type == "MatMul" for n in products if n not in kmajor), left
    feeds = mt.feeds(arch, dims, np.float32, small=True, seed=1)
    want = _run(m, feeds)[0]
    got = _run(r.model, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))


def test_not_where_products_multiply_in_full_float32_or_no_kernels_are_built(small_too):
    from onnxfuse.kmajor import NOTE as KMAJOR

    for kw in ({"conv_precision": "ieee"}, {"target": "none"}):
        _, _, r = _passes("bert_base", **kw)
        assert KMAJOR not in r.report.notes
        assert not any(".kmajor" in t.name for t in r.model.graph.initializer)


def _matmul_silu():
    """x [2, 64, 16] -> MatMul W [16, 32] -> SiLU (a pointwise chain): the product stays ONNX
    Runtime's (untuned, the gemm kind matches nothing), a candidate for K-major weights."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="mm"), helper.make_node("Sigmoid", ["a"], ["s"]),
             helper.make_node("Mul", ["a", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64, 32])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _has_kmajor(m: onnx.ModelProto) -> bool:
    return any(t.name.endswith(".kmajor") for t in m.graph.initializer)


@pytest.mark.parametrize("kmajor_ms, kept", [(0.2, "optimized + K-major"), (0.6, "optimized"),
                                             (0.495, "optimized")])
def test_tuning_keeps_kmajor_weights_only_where_measured_faster(monkeypatch, kmajor_ms, kept):
    """Where the tune pass runs, the K-major rewrite (products from MEASURED_MIN_FLOPS) is one more candidate, after
    the others: kept where its model is faster than the optimized one by more than the noise
    (0.2 against 0.5 ms), not where slower or within 2% (0.495), and gated like the others where
    its times would keep it (`lazy-gates`); the kept model computes what the original does."""
    from onnxfuse import kmajor
    from onnxfuse import tune as tuning
    from onnxfuse.kmajor import NOTE
    from tests.test_tune import CPU, NOT_COMPILED, _fake_outputs, _fake_timer, _fused_nodes, _optimized

    m = _matmul_silu()
    r, before = _optimized(m)
    assert not _has_kmajor(r.model)  # untuned, the 131-kFLOP product is under the floor
    monkeypatch.setattr(kmajor, "MEASURED_MIN_FLOPS", 0.0)  # and under the candidate's
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2},
                lambda mm: (kmajor_ms if _has_kmajor(mm) else 0.5) if _fused_nodes(mm) else 1.0)
    _fake_outputs(monkeypatch, {"ort": 1e-3})
    rec = tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), CPU, [90])["tune"]
    assert set(rec["models"]) == {"optimized", "optimized + K-major"}
    assert rec["accuracy"]["optimized"]["passed"]
    # the gate ran on it where its times would keep it, and only there
    assert ("optimized + K-major" in rec["accuracy"]) == (kept != "optimized")
    assert all(g["passed"] for g in rec["accuracy"].values())
    assert rec["kept"] == kept
    assert _has_kmajor(r.model) == (kept != "optimized")
    assert (NOTE in r.report.notes) == (kept != "optimized")
    x = np.random.default_rng(1).standard_normal((2, 64, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(r.model, {"x": x})[0], _run(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_tuning_without_the_switch_adds_no_kmajor_candidate(monkeypatch):
    """ONNXFUSE_KMAJOR=0: no candidate; nor one for products under MEASURED_MIN_FLOPS."""
    from onnxfuse import kmajor
    from onnxfuse import tune as tuning
    from tests.test_tune import CPU, NOT_COMPILED, _fake_outputs, _fake_timer, _fused_nodes, _optimized

    monkeypatch.setattr(kmajor, "MEASURED_MIN_FLOPS", 0.0)
    monkeypatch.setenv("ONNXFUSE_KMAJOR", "0")
    r, before = _optimized(_matmul_silu())
    _fake_timer(monkeypatch, {"fused": 0.1, "original": 0.2}, lambda mm: 0.5 if _fused_nodes(mm) else 1.0)
    _fake_outputs(monkeypatch, {"ort": 1e-3})
    rec = tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), CPU, [90])["tune"]
    assert set(rec["models"]) == {"optimized"} and not _has_kmajor(r.model)
    monkeypatch.delenv("ONNXFUSE_KMAJOR")
    monkeypatch.setattr(kmajor, "MEASURED_MIN_FLOPS", 2 * 128 * 16 * 32 + 1)
    r, before = _optimized(_matmul_silu())
    rec = tuning.tune(r, before, dict(NOT_COMPILED), lambda res: dict(NOT_COMPILED), CPU, [90])["tune"]
    assert set(rec["models"]) == {"optimized"}
