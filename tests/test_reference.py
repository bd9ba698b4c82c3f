"""onnxfuse.reference: the float64 copy of a model and its evaluation, the gate's reference.

The fast float64 kernels are checked against ONNX Runtime's float32 kernels (onnx's own
reference implementations of MaxPool with asymmetric pads and of grouped ConvTranspose give
other shapes or values than ONNX Runtime and the ONNX spec, so they are no yardstick);
conversions of types, constants, casts, subgraphs and functions; the ops the reference
evaluator computed wrongly or in float32 (BatchNormalization-9 with `momentum`, Erf); the
plausibility check.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import reference

ort = pytest.importorskip("onnxruntime")
N = helper.make_node


def one_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], opset: int = 19) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    g = helper.make_graph([node], "t", [vi(k, TensorProto.FLOAT, v.shape) for k, v in feeds.items()],
                          [vi(o, TensorProto.FLOAT, None) for o in node.output])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def ort_run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})


RNG = np.random.default_rng(7)
# ONNX Runtime refuses dilations with SAME padding for Conv and pads MaxPool as if there were
# none (the spec counts them): those are left out
CONV_CASES = [c for c in itertools.product(
    [(4, 6, 1), (4, 4, 4), (6, 4, 2)],                # C, M, group (depthwise in the middle)
    [(3, 3), (1, 1), (2, 3)],                         # kernel
    [(1, 1), (2, 2), (1, 2)],                         # strides
    [(1, 1), (2, 1)],                                 # dilations
    [[0, 0, 0, 0], [1, 2, 1, 0], "SAME_UPPER", "SAME_LOWER", "VALID"],
) if not (str(c[4]).startswith("SAME") and c[3] != (1, 1))]


@pytest.mark.parametrize("case", range(0, len(CONV_CASES), 5))
def test_fast_conv_and_pools_match_onnxruntime(case):
    (c, m, g), k, s, d, pads = CONV_CASES[case]
    x = RNG.standard_normal((2, c, 9, 8))
    w = RNG.standard_normal((m, c // g, *k))
    b = RNG.standard_normal(m)
    pad_attr = {"auto_pad": pads} if isinstance(pads, str) else {"pads": pads}
    checks = [(N("Conv", ["x", "w", "b"], ["y"], group=g, strides=list(s), dilations=list(d), **pad_attr),
               {"x": x, "w": w, "b": b})]
    if not isinstance(pads, str):
        wt = RNG.standard_normal((c, m // g, *k))
        checks.append((N("ConvTranspose", ["x", "w", "b"], ["y"], group=g, strides=list(s), dilations=list(d),
                         pads=pads, output_padding=[s[0] - 1, 0]), {"x": x, "w": wt, "b": b}))
    # pools: pads below the kernel; no 1x1 window (ORT's SAME pads go negative there)
    if k != (1, 1) and (isinstance(pads, str) or (max(pads[0], pads[2]) < k[0] and max(pads[1], pads[3]) < k[1])):
        checks.append((N("MaxPool", ["x"], ["y"], kernel_shape=list(k), strides=list(s), dilations=list(d),
                         **pad_attr), {"x": x}))
        for cip in (0, 1):
            checks.append((N("AveragePool", ["x"], ["y"], kernel_shape=list(k), strides=list(s),
                             count_include_pad=cip, **pad_attr), {"x": x}))
    for node, feeds in checks:
        m_ = one_node(node, feeds)
        want = ort_run(m_, feeds)[0]
        got = reference.evaluate(m_, feeds)["y"]
        assert got.dtype == np.float64 and got.shape == want.shape, node.op_type
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(node))


def test_fast_conv_1d_and_3d():
    for nd in (1, 3):
        x = RNG.standard_normal((2, 3) + (7,) * nd)
        w = RNG.standard_normal((4, 3) + (3,) * nd)
        node = N("Conv", ["x", "w"], ["y"], pads=[1] * nd + [0] * nd, strides=[2] * nd)
        m = one_node(node, {"x": x, "w": w})
        np.testing.assert_allclose(reference.evaluate(m, {"x": x, "w": w})["y"], ort_run(m, {"x": x, "w": w})[0],
                                   rtol=1e-5, atol=1e-5)


def test_conv_is_float64():
    """A sum whose float32 rounding is visible: 1 + 1e-9 * many terms."""
    x = np.full((1, 1, 1, 1000), 1e-9)
    x[0, 0, 0, 0] = 1.0
    w = np.ones((1, 1, 1, 1000))
    m = one_node(N("Conv", ["x", "w"], ["y"]), {"x": x, "w": w})
    assert reference.evaluate(m, {"x": x, "w": w})["y"].item() == pytest.approx(1.0 + 999e-9, rel=1e-15)


def test_erf_and_gelu_in_float64():
    """The evaluator's own Erf rounds to float32 (1 + erf(-3.9) would be 0): ours does not."""
    x = np.array([-5.5, -3.0, 0.5], np.float64)
    m = one_node(N("Gelu", ["x"], ["y"]), {"x": x}, opset=20)
    got = reference.evaluate(m, {"x": x.astype(np.float32)})["y"]
    want = [0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_batchnorm_with_momentum_is_inference():
    """PaddlePaddle's exports set `momentum` on BatchNormalization-9; onnx's evaluator then
    took batch statistics (0.22 off on PP-OCR's recognizer)."""
    x = RNG.standard_normal((2, 3, 4, 4))
    consts = [numpy_helper.from_array(v, n) for n, v in
              (("s", RNG.random(3) + 0.5), ("b", RNG.random(3)), ("mu", RNG.random(3)), ("var", RNG.random(3) + 0.1))]
    node = N("BatchNormalization", ["x", "s", "b", "mu", "var"], ["y"], epsilon=1e-5, momentum=0.9)
    vi = helper.make_tensor_value_info
    g = helper.make_graph([node], "bn", [vi("x", TensorProto.FLOAT, x.shape)], [vi("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(numpy_helper.to_array(c).astype(np.float32), c.name)
                           for c in consts])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)
    np.testing.assert_allclose(reference.evaluate(m, {"x": x})["y"], ort_run(m, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_float64_model_converts_types_constants_casts_subgraphs_and_functions():
    vi = helper.make_tensor_value_info
    then = helper.make_graph([N("Cast", ["x"], ["t"], to=TensorProto.FLOAT16),
                              N("Constant", [], ["k"], value_float=1.5), N("Mul", ["t", "k"], ["o"])],
                             "then", [], [vi("o", TensorProto.FLOAT16, None)])
    other = helper.make_graph([N("Constant", [], ["o2"], value=numpy_helper.from_array(np.float16([2.0, 3.0])))],
                              "else", [], [vi("o2", TensorProto.FLOAT16, None)])
    nodes = [N("ConstantOfShape", ["shape"], ["z"]), N("Add", ["x", "z"], ["a"]),
             N("If", ["c"], ["i"], then_branch=then, else_branch=other),
             N("Twice", ["a"], ["f"], domain="local"), N("Cast", ["x"], ["n"], to=TensorProto.INT64)]
    fn = helper.make_function("local", "Twice", ["u"], ["v"], [N("Constant", [], ["two"], value_floats=[2.0]),
                                                              N("Mul", ["u", "two"], ["v"])],
                              [helper.make_opsetid("", 19)])
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [2]), vi("c", TensorProto.BOOL, [])],
                          [vi("i", TensorProto.FLOAT16, None), vi("f", TensorProto.FLOAT, [2]),
                           vi("n", TensorProto.INT64, [2])],
                          [numpy_helper.from_array(np.array([2], np.int64), "shape")],
                          value_info=[vi("a", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19), helper.make_opsetid("local", 1)],
                          functions=[fn], ir_version=9)
    m64 = reference.float64_model(m)
    assert [o.type.tensor_type.elem_type for o in m64.graph.output] == [TensorProto.DOUBLE] * 2 + [TensorProto.INT64]
    assert m64.graph.input[0].type.tensor_type.elem_type == TensorProto.DOUBLE and not m64.graph.value_info
    assert m.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16  # the original is left alone
    x = np.array([0.1, 7.3], np.float32)
    out = reference.evaluate(m, {"x": x, "c": np.array(True)})
    x64 = x.astype(np.float64)
    assert out["i"].dtype == np.float64 and out["i"].tolist() == (1.5 * x64).tolist()  # no float16 rounding
    assert out["f"].tolist() == (2 * x64).tolist() and out["n"].tolist() == [0, 7]
    assert reference.evaluate(m, {"x": x, "c": np.array(False)})["i"].tolist() == [2.0, 3.0]


@pytest.mark.parametrize("data_shape,index_shape,axis", [
    ((2, 3, 40), (2, 2, 5), -1),   # DeBERTa's relative-position gather: fewer rows than the data, > 32 positions
    ((2, 3, 40), (2, 3, 40), 2),   # the same shape (the evaluator's np.choose takes at most 32 choices)
    ((6, 4), (3, 2), 0),           # another axis, indices smaller on both
])
def test_gather_elements_reads_the_leading_part_as_onnxruntime_does(data_shape, index_shape, axis):
    vi = helper.make_tensor_value_info
    size = data_shape[axis]
    data = RNG.standard_normal(data_shape)
    idx = RNG.integers(-size, size, index_shape).astype(np.int64)
    g = helper.make_graph([N("GatherElements", ["x", "i"], ["y"], axis=axis)], "g",
                          [vi("x", TensorProto.FLOAT, data_shape), vi("i", TensorProto.INT64, index_shape)],
                          [vi("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    got = reference.evaluate(m, {"x": data, "i": idx})["y"]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": data.astype(np.float32), "i": idx})[0]
    assert got.dtype == np.float64 and got.shape == index_shape
    np.testing.assert_array_equal(got.astype(np.float32), want)
    bad = idx.copy()
    bad.flat[0] = size
    with pytest.raises(reference.Unavailable, match="out of"):
        reference.evaluate(m, {"x": data, "i": bad})


def test_unavailable_names_the_reason():
    vi = helper.make_tensor_value_info
    g = helper.make_graph([N("Gelu", ["x"], ["y"], domain="com.microsoft")], "g",
                          [vi("x", TensorProto.FLOAT, [3])], [vi("y", TensorProto.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(reference.Unavailable, match="reference evaluator cannot run it"):
        reference.evaluate(m, {"x": np.zeros(3, np.float32)})
    with pytest.raises(reference.Unavailable, match="input 'x' has no value"):
        reference.evaluate(m, {})


def test_disagreement():
    ref = {"y": np.array([1.0, -2.0, 1e-9]), "i": np.array([1, 2])}
    assert reference.disagreement(ref, {"y": np.float32([1.0, -2.0, 0.0]), "i": np.array([5, 5])}) is None
    assert reference.disagreement(ref, {"y": np.float32([1.0, -2.1, 0.0])}) is None     # within 0.1 x 2.0
    assert "differs from the original's own run by 0.3" in reference.disagreement(
        ref, {"y": np.float32([1.0, -2.3, 0.0])})
    assert "NaN or infinite" in reference.disagreement({"y": np.array([np.nan, 1.0])}, {"y": np.float32([0, 1])})
    # ORT's own overflow (float16) is its error, not the reference's
    assert reference.disagreement({"y": np.array([7e4, 1.0])}, {"y": np.float16([np.inf, 1])}) is None


def test_evaluate_remembers_a_model_on_the_same_feeds(monkeypatch):
    """A second evaluation of the same model bytes on the same feed values returns the first
    one's arrays (read-only, so no caller can change what a later one gets); another weight,
    another feed value or another model is evaluated afresh; an evaluation the reference
    cannot do fails again with its reason; past MEMO_BYTES the oldest results go first."""
    monkeypatch.setattr(reference, "_memo", type(reference._memo)())
    calls = []
    real = reference._evaluate
    monkeypatch.setattr(reference, "_evaluate", lambda m, f: calls.append(1) or real(m, f))
    w = RNG.standard_normal((4, 3)).astype(np.float32)
    x = RNG.standard_normal((2, 4)).astype(np.float32)

    def model(weight: np.ndarray) -> onnx.ModelProto:
        g = helper.make_graph([N("MatMul", ["x", "w"], ["y"])], "t",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(weight, "w")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)

    first = reference.evaluate(model(w), {"x": x})
    again = reference.evaluate(model(w), {"x": x.copy()})
    assert len(calls) == 1 and again["y"] is first["y"] and not first["y"].flags.writeable
    np.testing.assert_allclose(first["y"], x.astype(np.float64) @ w.astype(np.float64), rtol=1e-12)
    other_w = reference.evaluate(model(w + 1), {"x": x})
    other_x = reference.evaluate(model(w), {"x": x + 1})
    assert len(calls) == 3
    np.testing.assert_allclose(other_w["y"], x.astype(np.float64) @ (w + 1).astype(np.float64), rtol=1e-12)
    np.testing.assert_allclose(other_x["y"], (x + 1).astype(np.float64) @ w.astype(np.float64), rtol=1e-12)
    bad = one_node(N("Relu", ["x"], ["y"], domain="com.microsoft"), {"x": x})
    for _ in range(2):
        with pytest.raises(reference.Unavailable, match="reference evaluator cannot run it"):
            reference.evaluate(bad, {"x": x})
    assert len(calls) == 4
    monkeypatch.setattr(reference, "MEMO_BYTES", first["y"].nbytes * 2)  # room for two results
    reference.evaluate(model(w + 2), {"x": x})
    reference.evaluate(model(w), {"x": x})  # the oldest result went out: evaluated again
    assert len(calls) == 6


def test_bfloat16_feeds_are_widened_and_gated():
    """bfloat16 inputs (ml_dtypes', numpy kind "V") are widened to float64 like numpy's floats,
    hashed for the memo like them (a bfloat16 buffer is refused by hashlib), and the gate takes
    a bfloat16 output against its float64 reference."""
    import ml_dtypes

    from onnxfuse.tools.gate import gate_output

    bf = ml_dtypes.bfloat16
    w = RNG.standard_normal((8, 5)).astype(bf)
    x = RNG.standard_normal((3, 8)).astype(bf)
    vi = helper.make_tensor_value_info
    g = helper.make_graph([N("MatMul", ["x", "w"], ["y"])], "t", [vi("x", TensorProto.BFLOAT16, [3, 8])],
                          [vi("y", TensorProto.BFLOAT16, [3, 5])], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    assert reference.is_float(bf) and reference.is_float(np.float16) and not reference.is_float(np.int64)
    y = reference.evaluate(m, {"x": x})["y"]
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, want, rtol=1e-12)
    assert reference.evaluate(m, {"x": x})["y"] is y  # remembered by the bfloat16 feed's bytes
    check = gate_output("y", y, want.astype(bf), (want * 1.001).astype(bf))
    assert check.passed and check.ort_max_abs_err is not None
    assert not gate_output("y", y, want.astype(bf), (want + 1.0).astype(bf)).passed
