"""Transcendental tails: a fused op is accurate where its value is tiny.

ONNX Runtime's CPU kernels lose some tails (measured with onnxruntime 1.32; README,
Reliability): its Sigmoid is off by up to 5x below x = -15, its Gelu is 0 or 57 % off below
x = -5 (1 + erf(x / sqrt 2) cancels), its Elu computes exp(x) - 1, which cancels near 0. The
lowering writes the accurate forms (`onnxfuse.expr.rewrite_tails`: erfc, expm1, sigmoid)
and every back end computes them without overflow or a flush to zero. Checked here against
exact values (float64) through the CPU library and the numpy evaluator; the Triton kernels
get the same cases in the interpreter (tests/test_codegen.py, `test_interpreted_tails`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse import expr, optimize_model
from onnxfuse.expr import Program, parse, rewrite_tails

N = helper.make_node
DENORMAL_ULP = 2.0**-149


def gelu(x: float) -> float:
    return 0.5 * x * math.erfc(-x / math.sqrt(2.0))


def gelu_tanh(x: float) -> float:
    z = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    return x / (1.0 + math.exp(-2.0 * z)) if z > -300 else 0.0


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def elu(x: float) -> float:
    return x if x > 0 else math.expm1(x)


def _exported_gelu() -> list[onnx.NodeProto]:
    """x * 0.5 * (1 + erf(x / sqrt(2))) as exporters write it."""
    c = helper.make_tensor
    return [N("Constant", [], ["s2"], value=c("s2", TensorProto.FLOAT, [], [1.4142135381698608])),
            N("Constant", [], ["c1"], value=c("c1", TensorProto.FLOAT, [], [1.0])),
            N("Constant", [], ["ch"], value=c("ch", TensorProto.FLOAT, [], [0.5])),
            N("Div", ["x", "s2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "c1"], ["a"]),
            N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "ch"], ["t"])]


@dataclass(frozen=True)
class Tail:
    """A one-op model x -> t, inputs in its tails, the exact values and the relative bound
    (README's measured bound, rounded up: for Gelu the rounding of the fp32 argument
    x / sqrt 2, amplified 2 (x / sqrt 2)^2 times by erfc, dominates)."""

    id: str
    nodes: Callable[[], list[onnx.NodeProto]]
    values: tuple[float, ...]
    exact: Callable[[float], float]
    rtol: float

    def model(self) -> onnx.ModelProto:
        vi = helper.make_tensor_value_info
        g = helper.make_graph(self.nodes() + [N("Mul", ["t", "one"], ["y"])], self.id,
                              [vi("x", TensorProto.FLOAT, [len(self.values)]), vi("one", TensorProto.FLOAT, [])],
                              [vi("y", TensorProto.FLOAT, [len(self.values)])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)

    def fused(self) -> tuple[onnx.ModelProto, Program]:
        r = optimize_model(self.model(), leave_to_ort=False)  # the kernel, not ORT's Gelu fusion
        [node] = [n for n in r.model.graph.node if n.domain == "onnxfuse"]
        assert len(r.model.graph.node) == 1, r.report.summary()
        return r.model, parse(helper.get_attribute_value(next(a for a in node.attribute if a.name == "program"))
                              .decode())

    def x(self) -> np.ndarray:
        return np.array(self.values, np.float32)

    def expected(self) -> np.ndarray:
        return np.array([self.exact(float(v)) for v in self.x()], np.float64)


TAILS = [
    Tail("gelu", lambda: [N("Gelu", ["x"], ["t"])], (-5.5, -3.0, -7.0, -9.0, -11.0, -12.5, 0.5, 4.0), gelu, 2e-5),
    Tail("gelu-exported", _exported_gelu, (-5.5, -3.0, -7.0, -9.0, -11.0, -12.5, 0.5, 4.0), gelu, 2e-5),
    Tail("gelu-tanh", lambda: [N("Gelu", ["x"], ["t"], approximate="tanh")], (-5.0, -6.0, -8.0, -10.0, -12.0, 1.0),
         gelu_tanh, 2e-5),
    Tail("sigmoid", lambda: [N("Sigmoid", ["x"], ["t"])],
         (-17.6, -30.0, -60.0, -87.0, -95.0, -100.0, -103.0, 3.0), sigmoid, 1e-6),
    Tail("elu", lambda: [N("Elu", ["x"], ["t"])], (-1e-7, -1e-20, -1e-40, -3e-3, -0.5, 2.0), elu, 1e-6),
]


def assert_near_exact(got: np.ndarray, tail: Tail, what: str) -> None:
    """|got - exact| <= rtol |exact| + one denormal ulp (results below 1.2e-38 are denormal)."""
    want = tail.expected()
    err = np.abs(got.astype(np.float64) - want)
    bad = ~(err <= tail.rtol * np.abs(want) + DENORMAL_ULP)
    assert not bad.any(), f"{what} {tail.id}: " + ", ".join(
        f"x={x!r}: got {g!r}, exact {w!r}" for x, g, w in zip(tail.x()[bad], got[bad], want[bad], strict=True))


@pytest.mark.parametrize("tail", TAILS, ids=lambda t: t.id)
def test_library_tails(tail):
    """The CPU library's kernel of the fused node, at the tail inputs."""
    import onnxfuse

    model, _ = tail.fused()
    sess = onnxfuse.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": tail.x(), "one": np.array(1.0, np.float32)})[0]
    assert_near_exact(got, tail, "library")


@pytest.mark.parametrize("tail", TAILS, ids=lambda t: t.id)
def test_numpy_evaluator_tails(tail):
    _, prog = tail.fused()
    got = expr.evaluate(prog, [tail.x(), np.array(1.0, np.float32)])[0]
    assert_near_exact(got, tail, "numpy evaluator")


@pytest.mark.gpu
@pytest.mark.parametrize("tail", TAILS, ids=lambda t: t.id)
def test_cuda_tails(tail, tmp_path, monkeypatch):
    """The Triton kernel of the fused node compiled for the local GPU (libdevice's erfc,
    expm1, exp), run by the library on ONNX Runtime's CUDA provider: as near the exact
    values as on the CPU."""
    import onnxruntime as ort

    import onnxfuse
    from onnxfuse.compile import default_targets
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    r = optimize_model(tail.model(), leave_to_ort=False)  # the kernel, not ORT's Gelu fusion
    info = compile_pass(r, kernel_options(",".join(f"sm_{a}" for a in default_targets()))).report.compile
    assert not info["failed"], info
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the fused node runs on the GPU
    sess = onnxfuse.InferenceSession(r.model.SerializeToString(), providers=["CUDAExecutionProvider"],
                                     sess_options=so)
    got = sess.run(None, {"x": tail.x(), "one": np.array(1.0, np.float32)})[0]
    assert_near_exact(got, tail, "CUDA kernel")


def test_gelu_at_minus_5_5_is_not_zero():
    """Issue 15's example: Gelu(-5.5) = -1.0444e-7. 1 + erf(-3.889) in fp32 is 0 or 6e-8
    (ONNX Runtime: -1.64e-7); erfc(3.889) keeps it."""
    import onnxfuse

    tail = TAILS[0]
    model, prog = tail.fused()
    assert [i.op for i in prog.instrs].count("erfc") == 1 and "erf" not in [i.op for i in prog.instrs]
    sess = onnxfuse.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": np.full(len(tail.values), -5.5, np.float32), "one": np.array(1.0, np.float32)})[0]
    assert got[0] == pytest.approx(-1.0444259e-07, rel=1e-5)


def _body(text: str, dtypes: str = "f32") -> Program:
    inputs = [f"input %{i} {dt}" for i, dt in enumerate(dtypes.split())]
    return parse("\n".join([expr.HEADER, *inputs, *(ln.strip() for ln in text.strip().splitlines())]) + "\n")


def _ops(prog: Program) -> list[str]:
    return [f"{i.op} " + " ".join(f"%{a.index}" if isinstance(a, expr.Ref) else repr(a) for a in i.args)
            for i in prog.instrs]


@pytest.mark.parametrize("text, want", [
    # 1 + erf(x * c): the literal negated into the mul, the erf dropped
    ("%1 = mul %0 0.7\n%2 = erf %1\n%3 = add %2 1.0\noutput %3 f32", ["mul %0 -0.7", "erfc %1"]),
    ("%1 = div %0 1.5\n%2 = erf %1\n%3 = add 1.0 %2\noutput %3 f32", ["div %0 -1.5", "erfc %1"]),
    ("%1 = erf %0\n%2 = add %1 1.0\noutput %2 f32", ["neg %0", "erfc %1"]),
    ("%1 = erf %0\n%2 = sub 1.0 %1\noutput %2 f32", ["erfc %0"]),
    ("%1 = erf %0\n%2 = sub %1 1.0\noutput %2 f32", ["erfc %0", "neg %1"]),
    ("%1 = erf %0\n%2 = add -1.0 %1\noutput %2 f32", ["erfc %0", "neg %1"]),
    ("%1 = tanh %0\n%2 = add %1 1.0\noutput %2 f32", ["mul %0 2.0", "sigmoid %1", "mul %2 2.0"]),
    ("%1 = tanh %0\n%2 = sub 1.0 %1\noutput %2 f32", ["mul %0 -2.0", "sigmoid %1", "mul %2 2.0"]),
    ("%1 = tanh %0\n%2 = sub %1 1.0\noutput %2 f32", ["mul %0 -2.0", "sigmoid %1", "mul %2 -2.0"]),
    ("%1 = exp %0\n%2 = sub %1 1.0\noutput %2 f32", ["expm1 %0"]),
    ("%1 = exp %0\n%2 = add %1 -1.0\noutput %2 f32", ["expm1 %0"]),
    ("%1 = exp %0\n%2 = sub 1.0 %1\noutput %2 f32", ["expm1 %0", "neg %1"]),
    # the erf is kept where something else reads it; other literals are left alone
    ("%1 = erf %0\n%2 = add %1 1.0\n%3 = mul %1 %2\noutput %3 f32", ["erf %0", "neg %0", "erfc %2", "mul %1 %3"]),
    ("%1 = erf %0\n%2 = add %1 2.0\noutput %2 f32", ["erf %0", "add %1 2.0"]),
    ("%1 = exp %0\n%2 = sub %1 1.5\noutput %2 f32", ["exp %0", "sub %1 1.5"]),
    ("%1 = sigmoid %0\n%2 = sub 1.0 %1\noutput %2 f32", ["sigmoid %0", "sub 1.0 %1"]),
    # an input that is 1 - erf's operand: a value, not a literal
    ("%2 = erf %0\n%3 = add %2 %1\noutput %3 f32", ["erf %0", "add %2 %1"]),
])
def test_rewrite_tails_forms(text, want):
    dtypes = "f32 f32" if text.startswith("%2") else "f32"
    assert _ops(rewrite_tails(_body(text, dtypes))) == want


def test_rewrite_tails_keeps_outputs_and_drops_dead_values():
    prog = _body("""
        %2 = erf %0
        %3 = add %2 1.0
        %4 = exp %1
        %5 = sub %4 1.0
        %6 = mul %3 %5
        output %6 f16
        output %2 f32
        output %0 bf16""", "f32 f16")
    got = rewrite_tails(prog)
    assert _ops(got) == ["erf %0", "neg %0", "erfc %3", "expm1 %1", "mul %4 %5"]
    assert got.outputs == ((6, "f16"), (2, "f32"), (0, "bf16")) and got.input_dtypes == ("f32", "f16")


def test_rewrite_tails_same_values_in_the_bulk():
    """Equal in exact arithmetic: in the bulk, where nothing cancels, both forms agree to a few
    ulp; in the tails the rewritten form is the exact value and the original is not."""
    prog = _body("""
        %1 = mul %0 0.7071067690849304
        %2 = erf %1
        %3 = add %2 1.0
        %4 = tanh %0
        %5 = add 1.0 %4
        %6 = exp %0
        %7 = sub %6 1.0
        %8 = mul %0 0.5
        %9 = mul %8 %3
        output %9 f32
        output %5 f32
        output %7 f32""")
    x = np.random.default_rng(0).uniform(-2.5, 2.5, 20000).astype(np.float32)
    for a, b in zip(expr.evaluate(prog, [x]), expr.evaluate(rewrite_tails(prog), [x]), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=3e-7)
    tail = np.array([-6.0], np.float32)
    before, after = expr.evaluate(prog, [tail])[0], expr.evaluate(rewrite_tails(prog), [tail])[0]
    assert before[0] == 0.0 and after[0] == pytest.approx(gelu(-6.0), rel=1e-5)
