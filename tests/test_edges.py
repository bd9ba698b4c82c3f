"""Numerics at the edges: NaN, +-Inf, -0.0, denormals, overflow, division by zero.

Every case is a small model whose elementwise part fuses. It runs three ways on ONNX
Runtime's CPU provider: the original model, the optimized model in stock ONNX Runtime (the
fused node's function body, i.e. the original nodes: must agree bit for bit), and the
optimized model through the onnxfuse library's CPU kernel (the program). The kernel must
give NaN where the original gives NaN, the same infinities, the same sign of zero, and
finite values within rel 1e-5 (fp32) / 1e-3 (fp16).

Known differences, pinned here and documented in README's Reliability section:
- ONNX Runtime's Tanh, Sigmoid and Gelu use fast approximations (MLAS): on denormal inputs
  its Tanh is off by up to 0.1 % (e.g. tanh(1e-40) = 9.9939e-41) and for large negative
  inputs its Sigmoid by up to 6x (sigmoid(-17.6)); the kernel uses the C library's fp32
  functions, so the absolute differences stay below 2e-7. Its Elu computes exp(x) - 1, which
  cancels near 0 (Elu(-1e-7) off by 20 %, Elu(-1e-40) = +0.0); the kernel uses expm1.
- Max/Min of +0.0 and -0.0: ONNX leaves the sign open; ONNX Runtime itself returns one or
  the other depending on the element's position (vectorized loop or scalar tail).
- The GPU (Triton) kernels cannot run here; tests/test_gpu_reliability.py covers them.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxfuse
from onnxfuse import optimize_model
from tests.util import model, run

N = helper.make_node
F32_MAX = float(np.finfo(np.float32).max)
EDGE = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 1e-45, -1e-45, 1.17549435e-38,
                 F32_MAX, -F32_MAX, 88.8, -88.8, -104.0, 1.0, -1.0, 0.5, -2.5, 17.6, -17.6, 3.0, 1e-7, -1e-7],
                np.float32)
F16_EDGE = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 65504, -65504, 60000, 40000, 65519.996, 6e-8, -6e-8,
                     6.1e-5, 1e-4, 1.0, -1.0, 11.1, -11.1, 0.5, 2.0], np.float16)


def lib_session(m: onnx.ModelProto):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return onnxfuse.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"], sess_options=so)


def assert_same(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float = 0.0, signed_zero: bool = True,
                what: str = "") -> None:
    """NaN where expected is NaN, the same infinities, (optionally) the same sign of zero,
    finite values within atol + rtol * |expected|."""
    assert expected.dtype == actual.dtype and expected.shape == actual.shape, what
    e, a = expected.astype(np.float64).ravel(), actual.astype(np.float64).ravel()
    bad = np.isnan(e) != np.isnan(a)
    both = ~np.isnan(e) & ~np.isnan(a)
    inf = both & (np.isinf(e) | np.isinf(a))
    bad |= inf & (e != a)
    fin = both & ~inf
    with np.errstate(invalid="ignore"):
        bad[fin] |= np.abs(a[fin] - e[fin]) > atol + rtol * np.abs(e[fin])
    if signed_zero:
        bad |= (e == 0) & (a == 0) & (np.signbit(e) != np.signbit(a))
    if bad.any():
        idx = np.nonzero(bad)[0][:8]
        pairs = ", ".join(f"[{i}] expected {e[i]!r} got {a[i]!r}" for i in idx)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements differ: {pairs}")


def three_ways(m: onnx.ModelProto, feeds: dict, rtol: float | None = None, atol: float = 0.0,
               signed_zero: bool = True, fused: int = 1) -> onnx.ModelProto:
    """Original vs function bodies (bit for bit) vs the library's CPU kernel."""
    r = optimize_model(m)
    onnx.checker.check_model(r.model, full_check=True)
    assert len(r.fused) == fused, r.report.summary()
    expected = run(m, feeds)
    bodies = run(r.model, feeds)
    kernel = lib_session(r.model).run(None, feeds)
    for o, e, b, k in zip(m.graph.output, expected, bodies, kernel, strict=True):
        assert_same(e, b, rtol=0.0, signed_zero=signed_zero, what=f"{o.name} (function bodies)")
        tol = rtol if rtol is not None else (1e-5 if e.dtype == np.float32 else 1e-3)
        assert_same(e, k, rtol=tol, atol=atol, signed_zero=signed_zero, what=f"{o.name} (library kernel)")
    return r.model


def vec(dtype: str, n: int) -> dict:
    return {"x": (dtype, [n])}


ONE = {"one": np.array(1.0, np.float32)}

# op, attributes, atol for the library kernel (see the module docstring)
UNARY = [
    ("Relu", {}, 0), ("Neg", {}, 0), ("Abs", {}, 0), ("Sigmoid", {}, 2e-7), ("Tanh", {}, 1e-37), ("Exp", {}, 0),
    ("Log", {}, 0), ("Sqrt", {}, 0), ("Reciprocal", {}, 0), ("Erf", {}, 0), ("Cos", {}, 0), ("Sin", {}, 0),
    ("Softplus", {}, 0), ("LeakyRelu", {"alpha": 0.1}, 0), ("Elu", {"alpha": 0.5}, 1e-7),
    ("HardSigmoid", {}, 0), ("HardSwish", {}, 0), ("Gelu", {}, 2e-7), ("Gelu", {"approximate": "tanh"}, 2e-7),
]


@pytest.mark.parametrize("op,attrs,atol", UNARY, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("position", ["after", "first"])
def test_unary_edges(op, attrs, atol, position):
    """op after another fused op (its input computed in the kernel) and op first (reading the
    graph input directly)."""
    if position == "after":
        nodes = [N("Mul", ["x", "one"], ["t"]), N(op, ["t"], ["y"], **attrs)]
    else:
        nodes = [N(op, ["x"], ["t"], **attrs), N("Mul", ["t", "one"], ["y"])]
    m = model(nodes, vec("float32", len(EDGE)), {"y": ("float32", [len(EDGE)])}, ONE)
    # Elu of a tiny negative x: ORT computes exp(x) - 1, which cancels to +0.0 (x = -1e-40,
    # exact -5e-41) or is off by 20 % (x = -1e-7); the kernel's expm1 gives the exact value,
    # -0.0 where it rounds to zero
    three_ways(m, {"x": EDGE}, atol=atol, signed_zero=op != "Elu")


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean"])
def test_binary_edges_every_pair(op):
    """x[K,1] op z[1,K] through broadcasting: every pair of edge values, including x/0,
    0/0, inf-inf, 0*inf, pow(-1, inf), pow(nan, 0), max(nan, x)."""
    k = len(EDGE)
    m = model([N("Mul", ["x", "one"], ["t"]), N(op, ["t", "z"], ["y"])],
              {"x": ("float32", [k, 1]), "z": ("float32", [1, k])}, {"y": ("float32", [k, k])}, ONE)
    # Max/Min of +0 and -0: ONNX Runtime's own sign depends on the position (module docstring)
    three_ways(m, {"x": EDGE.reshape(k, 1), "z": EDGE.reshape(1, k)}, signed_zero=op not in ("Max", "Min"))


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, F32_MAX, 2.0])
@pytest.mark.parametrize("side", ["right", "left"])
def test_edge_literals(op, value, side):
    """Edge values as one-element constants become literals in the program text (nan, inf,
    -0.0, denormal): parsed the same by the library as written by the optimizer."""
    ins = ["t", "c"] if side == "right" else ["c", "t"]
    m = model([N("Mul", ["x", "one"], ["t"]), N(op, ins, ["y"])], vec("float32", len(EDGE)),
              {"y": ("float32", [len(EDGE)])}, {**ONE, "c": np.array(value, np.float32)})
    three_ways(m, {"x": EDGE}, signed_zero=op not in ("Max", "Min"))


@pytest.mark.parametrize("bounds", [("lo", "hi"), ("lo",), ("", "hi"), ()])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_clip_edges(bounds, dtype):
    """Clip propagates NaN, and an absent bound is the type's finite limit: Clip(inf) without
    max is FLT_MAX (65504 in fp16), as the ONNX definition and ONNX Runtime say.
    Regression: the lowering left +-inf alone when a bound was absent."""
    x = EDGE if dtype == "float32" else F16_EDGE
    m = model([N("Mul", ["x", "one"], ["t"]), N("Clip", ["t", *bounds], ["y"])], vec(dtype, len(x)),
              {"y": (dtype, [len(x)])}, {"one": np.array(1.0, dtype), "lo": np.array(-1.5, dtype),
                                         "hi": np.array(2.0, dtype)}, opset=13)
    three_ways(m, {"x": x})


def test_clip_opset6_attributes():
    m = model([N("Mul", ["x", "one"], ["t"]), N("Clip", ["t"], ["y"], min=-1.0)], vec("float32", len(EDGE)),
              {"y": ("float32", [len(EDGE)])}, ONE, opset=7)
    three_ways(m, {"x": EDGE})


def test_elu_negative_zero():
    """Regression: Elu(-0.0) was +0.0 (lowered with x > 0); ONNX Runtime gives -0.0. Elu of
    the smallest denormal is itself (expm1(x) = x there); ONNX Runtime's exp(x) - 1 gives +0.0."""
    m = model([N("Elu", ["x"], ["t"]), N("Mul", ["t", "one"], ["y"])], vec("float32", 2),
              {"y": ("float32", [2])}, ONE)
    opt = three_ways(m, {"x": np.array([-0.0, 0.0], np.float32)})
    tiny = np.array([-1e-45, -1e-40], np.float32)
    got = lib_session(opt).run(None, {"x": tiny[:1].repeat(2)})[0]
    assert got.tobytes() == tiny[:1].repeat(2).tobytes()
    assert run(m, {"x": tiny[:1].repeat(2)})[0].tolist() == [0.0, 0.0]


def test_where_passes_nan_and_inf_through():
    k = len(EDGE)
    cond = np.arange(k) % 3 == 0
    m = model([N("Neg", ["x"], ["n"]), N("Where", ["c", "x", "n"], ["w"]), N("Mul", ["w", "x"], ["y"])],
              {"x": ("float32", [k]), "c": ("bool", [k])}, {"y": ("float32", [k])})
    three_ways(m, {"x": EDGE, "c": cond})


def test_maxpool_with_nan_between_fused_groups():
    """Mul -> Relu -> MaxPool fuse into a FusedMaxPool, Neg -> Relu into a chain. The function
    bodies give the original's results bit for bit. The library's kernels give NaN for every
    window that holds a NaN, as numpy and torch do, where ONNX Runtime's CPU MaxPool mostly
    drops it (README, Reliability; tests/test_nan.py): there they differ, and everywhere else
    NaN, -0.0 and all come out as the original's."""
    x = np.resize(EDGE, (1, 1, 5, 5))
    m = model([N("Mul", ["x", "one"], ["t"]), N("Relu", ["t"], ["r"]),
               N("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[1, 1]),
               N("Neg", ["p"], ["q"]), N("Relu", ["q"], ["y"])],
              {"x": ("float32", [1, 1, 5, 5])}, {"y": ("float32", [1, 1, 4, 4])}, ONE)
    r = optimize_model(m)
    assert len(r.fused) == 2, r.report.summary()
    expected = run(m, {"x": x})[0]
    assert_same(expected, run(r.model, {"x": x})[0], rtol=0.0, what="y (function bodies)")
    nan_window = np.zeros((4, 4), bool)
    for i in range(2):
        for j in range(2):
            nan_window |= np.isnan(x[0, 0, i:i + 4, j:j + 4])
    assert (nan_window & ~np.isnan(expected[0, 0])).any()  # ONNX Runtime dropped a NaN
    want = expected.copy()
    want[0, 0][nan_window] = np.nan
    assert_same(want, lib_session(r.model).run(None, {"x": x})[0], rtol=1e-5, what="y (library kernel)")


@pytest.mark.parametrize("op", ["Relu", "Max", "Min", "Clip", "Where", "Sigmoid", "Exp", "Tanh", "Softplus"])
def test_fp16_overflow(op):
    """fp16 inputs near 65504: x*2 overflows fp16. The kernel computes in fp32 and rounds once
    when storing; ONNX Runtime's CPU provider computes fp16 math in fp32 too, so they agree
    (on CUDA the original rounds each intermediate: see README, Reliability)."""
    k = len(F16_EDGE)
    nodes = [N("Mul", ["x", "two"], ["t"])]
    extra_inputs = {}
    if op == "Max" or op == "Min":
        nodes.append(N(op, ["t", "x"], ["y"]))
    elif op == "Clip":
        nodes.append(N(op, ["t", "lo"], ["y"]))
    elif op == "Where":
        nodes += [N("Neg", ["t"], ["n"]), N("Where", ["c", "t", "n"], ["y"])]
        extra_inputs = {"c": ("bool", [k])}
    else:
        nodes.append(N(op, ["t"], ["y"]))
    m = model(nodes, {"x": ("float16", [k]), **extra_inputs}, {"y": ("float16", [k])},
              {"two": np.array(2.0, np.float16), "lo": np.array(-1.0, np.float16)})
    feeds = {"x": F16_EDGE}
    if extra_inputs:
        feeds["c"] = np.arange(k) % 2 == 0
    three_ways(m, feeds, signed_zero=op not in ("Max", "Min"))


def test_fp16_intermediate_overflow_comes_back_into_range():
    """(x * 2) * 0.5 in fp16: a rounding original gives inf for x > 32752; the kernel (fp32
    math) gives x back. ONNX Runtime's CPU provider also gives x back (it computes fp16 Mul
    in fp32 and drops the intermediate casts), so on CPU the three ways agree."""
    k = len(F16_EDGE)
    m = model([N("Mul", ["x", "two"], ["t"]), N("Mul", ["t", "half"], ["y"])], vec("float16", k),
              {"y": ("float16", [k])}, {"two": np.array(2.0, np.float16), "half": np.array(0.5, np.float16)})
    out = three_ways(m, {"x": F16_EDGE})
    assert np.isfinite(run(out, {"x": F16_EDGE})[0][F16_EDGE == 60000]).all()


@pytest.mark.parametrize("to", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_cast_overflow_underflow_and_ties(to):
    """Cast fp32 -> fp16/bf16 inside a group: round to nearest even, overflow to inf
    (65520 -> inf, 65519.996 -> 65504), underflow to denormals and zero, NaN stays NaN."""
    x = np.array([np.nan, np.inf, -np.inf, -0.0, 65504, 65519.996, 65520, 1e5, -1e5, 6e-8, 2.9e-8, 3e-8, 1e-8,
                  1.0009765625, 1.00048828125, 1.00146484375, F32_MAX, 1e-40, 3.3961776e38, 3.3895314e38],
                 np.float32)
    m = model([N("Mul", ["x", "one"], ["t"]), N("Cast", ["t"], ["h"], to=to), N("Cast", ["h"], ["y"], to=1)],
              vec("float32", len(x)), {"y": ("float32", [len(x)])}, ONE)
    three_ways(m, {"x": x})


def test_denormals_are_not_flushed():
    """Denormal inputs, results and literals survive (no flush-to-zero in the CPU kernel)."""
    x = np.array([1e-40, -1e-40, 1e-45, 1.1754942e-38, 3e-39], np.float32)
    m = model([N("Mul", ["x", "tiny"], ["t"]), N("Add", ["t", "x"], ["u"]), N("Div", ["u", "two"], ["y"])],
              vec("float32", len(x)), {"y": ("float32", [len(x)])},
              {"tiny": np.array(0.5, np.float32), "two": np.array(2.0, np.float32)})
    three_ways(m, {"x": x})
    out = lib_session(optimize_model(m).model).run(None, {"x": x})[0]
    assert (out[[0, 1, 3, 4]] != 0).all()  # 1e-45 * 0.75 rounds to 0 (or 1e-45): true underflow


@pytest.mark.parametrize("value", [F32_MAX, -F32_MAX, 65504.0, 3.3895314e38, 1.17549435e-38, 1e-40, -0.0, 0.1,
                                   np.nan, np.inf, -np.inf])
def test_gpu_literals_stay_fp32(value):
    """The Triton source spells every literal so that Triton types it fp32 (its rule: a Python
    float is fp32 when 0, inf, nan or 2**-126 <= |x| <= FLT_MAX, else fp64) and it is the
    same fp32 value. Regression: FLT_MAX (Clip's default bound) was written 3.4028235e+38,
    which is above FLT_MAX as a double, so the min ran in fp64."""
    from onnxfuse.codegen import _literal

    text = _literal(value)
    if text.startswith(("tl.full(", 'float("')):
        return
    v = float(text)
    assert v == 0 or 2.0**-126 <= abs(v) <= F32_MAX, text
    assert np.float32(v).tobytes() == np.float32(value).tobytes()
