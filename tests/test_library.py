"""The custom-op library: build it, run its CPU kernel in onnxruntime, compare with
`onnxfuse.expr.evaluate`.

Every model here is a single PointwiseChain node in the format of docs/format.md, with a
model-local function (same domain, name and overload) whose body computes the same thing
with standard ONNX ops, so each model is valid ONNX (checked with onnx.checker).

Tolerances: fp32 results must match numpy to rel 1e-5 (plus atol 1e-6 for results near
0, where a relative bound means nothing). Rational ops (add, mul, div, max, ...) are exact.
Transcendental ones use glibc's fp32 functions (expf, erff, ...) on one side and numpy's
own fp32 implementations on the other: both are within a few ulp of the true value, far
inside rel 1e-5 (about 80 ulp), so no looser bound is needed. fp16/bf16 outputs: one
rounding of the fp32 value, so they are compared at rel 1e-2 (after the fp32 result
agrees, a tie can round either way).
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse import expr
from onnxfuse.expr import Builder, Program, Ref

ort = pytest.importorskip("onnxruntime")

OPSET = 21
TP_OF = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
         "bool": TensorProto.BOOL}
NP_OF = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "bool": np.bool_}


@pytest.fixture(scope="session")
def lib() -> str:
    from onnxfuse import runtime

    path = runtime.library_path()
    assert os.path.isfile(path)
    return path


# ---------------------------------------------------------------------------------------
# Models: one fused node + a function body lowered from the program with standard ops
# ---------------------------------------------------------------------------------------

def _body(prog: Program, in_names: list[str], out_names: list[str], out_shape: tuple[int, ...]):
    """ONNX nodes computing `prog` (the function body), from in_names to out_names."""
    nodes = []
    n_in = len(prog.input_dtypes)
    names: list[str] = []
    for i in range(len(prog.input_dtypes)):
        names.append(f"v{i}")
        nodes.append(helper.make_node("Cast", [in_names[i]], [f"v{i}"], to=TensorProto.FLOAT))
    consts: dict[str, str] = {}

    def operand(a) -> str:
        if isinstance(a, Ref):
            return names[a.index]
        key = repr(float(a))
        if key not in consts:
            consts[key] = f"c{len(consts)}"
            nodes.append(helper.make_node("Constant", [], [consts[key]], value_float=float(a)))
        return consts[key]

    unary = {"neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
             "erf": "Erf", "cos": "Cos", "sin": "Sin", "sigmoid": "Sigmoid", "softplus": "Softplus"}
    binary = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow", "max": "Max", "min": "Min"}
    compare = {"gt": "Greater", "ge": "GreaterOrEqual", "lt": "Less", "le": "LessOrEqual", "eq": "Equal"}
    for k, ins in enumerate(prog.instrs):
        out = f"v{n_in + k}"
        args = [operand(a) for a in ins.args]
        if ins.op in unary:
            nodes.append(helper.make_node(unary[ins.op], args, [out]))
        elif ins.op == "erfc":  # 1 - Erf(x)
            nodes.append(helper.make_node("Erf", args, [out + "_f"]))
            nodes.append(helper.make_node("Sub", [operand(1.0), out + "_f"], [out]))
        elif ins.op == "expm1":  # Exp(x) - 1
            nodes.append(helper.make_node("Exp", args, [out + "_f"]))
            nodes.append(helper.make_node("Sub", [out + "_f", operand(1.0)], [out]))
        elif ins.op in ("round_f16", "round_bf16"):
            to = TensorProto.FLOAT16 if ins.op == "round_f16" else TensorProto.BFLOAT16
            nodes.append(helper.make_node("Cast", args, [out + "_r"], to=to))
            nodes.append(helper.make_node("Cast", [out + "_r"], [out], to=TensorProto.FLOAT))
        elif ins.op in binary:
            nodes.append(helper.make_node(binary[ins.op], args, [out]))
        elif ins.op in compare:
            nodes.append(helper.make_node(compare[ins.op], args, [out + "_b"]))
            nodes.append(helper.make_node("Cast", [out + "_b"], [out], to=TensorProto.FLOAT))
        elif ins.op == "select":
            zero = operand(0.0)
            nodes.append(helper.make_node("Equal", [args[0], zero], [out + "_z"]))
            nodes.append(helper.make_node("Not", [out + "_z"], [out + "_c"]))
            nodes.append(helper.make_node("Where", [out + "_c", args[1], args[2]], [out]))
        else:
            raise AssertionError(ins.op)
        names.append(out)
    nodes.append(helper.make_node("Constant", [], ["out_shape"],
                                  value=helper.make_tensor("s", TensorProto.INT64, [len(out_shape)], list(out_shape))))
    for j, (v, dt) in enumerate(prog.outputs):
        nodes.append(helper.make_node("Expand", [names[v], "out_shape"], [f"o{j}_x"]))
        nodes.append(helper.make_node("Cast", [f"o{j}_x"], [out_names[j]], to=TP_OF[dt]))
    return nodes


def fused_model(prog: Program, in_shapes: list[tuple[int, ...]], body: Program | None = None,
                dynamic_shapes: bool = False) -> onnx.ModelProto:
    """A model with one PointwiseChain node running `prog`.

    Graph inputs have the program's dtypes. bf16 outputs leave the graph through an exact
    Cast to f32 (onnxruntime's Python API cannot return bfloat16 arrays). The function
    body computes `body` (default: `prog`).
    """
    text = prog.to_text()
    overload = "onnxfuse_pointwise_chain_" + hashlib.sha256(text.encode()).hexdigest()[:12]
    out_shape = tuple(np.broadcast_shapes(*in_shapes))
    in_names = [f"x{i}" for i in range(len(prog.input_dtypes))]
    node_outs = [f"y{j}" for j in range(len(prog.outputs))]
    node = helper.make_node("PointwiseChain", in_names, node_outs, domain="onnxfuse", program=text)
    node.overload = overload
    nodes = [node]
    graph_outs = []
    value_info = []

    def shp(s):
        return [None] * len(s) if dynamic_shapes else list(s)

    for j, (_, dt) in enumerate(prog.outputs):
        if dt == "bf16":
            nodes.append(helper.make_node("Cast", [node_outs[j]], [f"y{j}_f32"], to=TensorProto.FLOAT))
            graph_outs.append(helper.make_tensor_value_info(f"y{j}_f32", TensorProto.FLOAT, shp(out_shape)))
            value_info.append(helper.make_tensor_value_info(node_outs[j], TensorProto.BFLOAT16, shp(out_shape)))
        else:
            graph_outs.append(helper.make_tensor_value_info(node_outs[j], TP_OF[dt], shp(out_shape)))
    graph = helper.make_graph(
        nodes, "fused",
        [helper.make_tensor_value_info(n, TP_OF[dt], shp(s))
         for n, dt, s in zip(in_names, prog.input_dtypes, in_shapes, strict=True)],
        graph_outs, value_info=value_info)
    fn = helper.make_function(
        "onnxfuse", "PointwiseChain", in_names, node_outs,
        _body(body or prog, in_names, node_outs, out_shape),
        [helper.make_opsetid("", OPSET)], attributes=["program"], overload=overload)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("onnxfuse", 1)],
                              functions=[fn], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _feed(dt: str, x: np.ndarray):
    if dt == "bf16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.require(x.astype(ml_dtypes.bfloat16), requirements="C").view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.require(x.astype(NP_OF[dt]), requirements="C"))


def run(model: onnx.ModelProto, prog: Program, inputs: list[np.ndarray], lib: str | None,
        threads: int = 0) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if lib:
        so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {f"x{i}": _feed(dt, x) for i, (dt, x) in enumerate(zip(prog.input_dtypes, inputs, strict=True))}
    return [v.numpy() for v in sess.run_with_ort_values(None, feeds)]


def check(prog: Program, inputs: list[np.ndarray], lib: str, threads: int = 0, rtol: float = 1e-5,
          atol: float = 1e-6) -> list[np.ndarray]:
    """Run the fused node with the library and compare with expr.evaluate."""
    inputs = [np.asarray(x).astype(NP_OF[dt]) for dt, x in zip(prog.input_dtypes, inputs, strict=True)]
    model = fused_model(prog, [x.shape for x in inputs])
    got = run(model, prog, inputs, lib, threads)
    want = expr.evaluate(prog, inputs)
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        dt = prog.outputs[j][1]
        assert g.shape == w.shape, (j, g.shape, w.shape)
        w32 = w.astype(np.float32)
        if dt == "f32":
            np.testing.assert_allclose(g, w32, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"output {j}")
        else:
            np.testing.assert_allclose(g.astype(np.float32), w32, rtol=1e-2, atol=1e-3, equal_nan=True,
                                       err_msg=f"output {j} ({dt})")
    return got


def prog1(op: str, n_args: int, in_dtypes: tuple[str, ...] | None = None, out_dtype: str = "f32") -> Program:
    b = Builder(list(in_dtypes or ("f32",) * n_args))
    r = b.emit(op, *[Ref(i) for i in range(n_args)])
    return b.build([(r, out_dtype)])


RNG = np.random.default_rng(1234)
SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 3.0, 1e-30, -1e-30, 1e30, -1e30, 88.0, -88.0,
                     100.0, -100.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-7, 6e-8, 3.4e38],
                    dtype=np.float32)


def unary_input(op: str) -> np.ndarray:
    x = np.concatenate([SPECIALS, RNG.normal(0, 3, 997).astype(np.float32),
                        RNG.uniform(-20, 20, 500).astype(np.float32)])
    if op in ("cos", "sin"):
        # Large arguments: both libraries reduce exactly, but keep the bulk moderate.
        x = np.concatenate([x, RNG.uniform(-1e4, 1e4, 200).astype(np.float32)])
    return x


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------

def test_library_builds_and_exports_only_registration(lib):
    import ctypes

    from onnxfuse import build, runtime

    assert runtime.library_path() == lib  # cached (the first library this process found, whichever cache root)
    assert os.path.basename(lib) == build.LIB_NAME
    handle = ctypes.CDLL(lib)
    assert hasattr(handle, "RegisterCustomOps")
    for private in ("_ZN8onnxfuse13parse_programERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
                    "append_cpu_ops"):
        assert not hasattr(handle, private)


def test_library_kernel_is_what_runs(lib):
    """Proves which implementation runs: the function body here deliberately computes x*3
    while the program says x*2. Without the library onnxruntime inlines the body (x*3);
    with it, the library's kernel must run the program (x*2). (Only this test-only model has
    a body that differs from its program.)"""
    prog = expr.parse(f"{expr.HEADER}\ninput %0 f32\n%1 = mul %0 2.0\noutput %1 f32\n")
    body = expr.parse(f"{expr.HEADER}\ninput %0 f32\n%1 = mul %0 3.0\noutput %1 f32\n")
    model = fused_model(prog, [(5,)], body=body)
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(run(model, prog, [x], lib=None)[0], x * 3)
    np.testing.assert_array_equal(run(model, prog, [x], lib=lib)[0], x * 2)


def test_function_body_matches_program_without_library():
    """The bodies built by these tests compute the program: cross-check of the test helper."""
    b = Builder(["f32", "f16", "bool"])
    s = b.emit("add", Ref(0), Ref(1))
    t = b.emit("select", Ref(2), s, b.emit("neg", Ref(0)))
    prog = b.build([(t, "f32"), (s, "f16")])
    xs = [RNG.normal(size=(3, 4)).astype(np.float32), RNG.normal(size=(4,)).astype(np.float16),
          RNG.random((3, 1)) > 0.5]
    got = run(fused_model(prog, [x.shape for x in xs]), prog, xs, lib=None)
    want = expr.evaluate(prog, xs)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1].astype(np.float32), want[1].astype(np.float32), rtol=1e-3)


@pytest.mark.parametrize("op", expr.UNARY)
def test_unary(op, lib):
    check(prog1(op, 1), [unary_input(op)], lib)


def _binary_inputs(op: str) -> tuple[np.ndarray, np.ndarray]:
    n = 1500
    a = RNG.normal(0, 4, n).astype(np.float32)
    b = RNG.normal(0, 4, n).astype(np.float32)
    if op == "pow":
        a = np.abs(a) + np.float32(0.01)
        b = RNG.uniform(-4, 4, n).astype(np.float32)
        # negative bases with integral exponents, zeros, infinities
        a[:8] = [-2.0, -2.0, -0.5, 0.0, 0.0, np.inf, -np.inf, 1.0]
        b[:8] = [3.0, 2.0, -3.0, 2.0, -1.0, -2.0, 3.0, np.nan]
    else:
        # equal pairs (for ge/le/eq), signed zeros, infinities, NaNs on each side
        a[:10] = [1.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, np.nan, 3.0, np.inf]
        b[:10] = [1.0, -0.0, 0.0, np.inf, 1.0, 1.0, np.nan, np.nan, 3.0, -np.inf]
        a[10:20] = b[10:20]
    if op == "div":
        b[20:23] = [0.0, -0.0, 0.0]
    return a, b


@pytest.mark.parametrize("op", expr.BINARY)
def test_binary(op, lib):
    check(prog1(op, 2), list(_binary_inputs(op)), lib)


@pytest.mark.parametrize("op", expr.TERNARY)
def test_ternary(op, lib):
    c = RNG.normal(size=1000).astype(np.float32)
    c[:6] = [0.0, -0.0, np.nan, np.inf, 1e-40, 0.0]
    c[6:300] = 0.0
    a = RNG.normal(size=1000).astype(np.float32)
    b = RNG.normal(size=1000).astype(np.float32)
    check(prog1(op, 3), [c, a, b], lib)


def test_literal_operands(lib):
    text = (f"{expr.HEADER}\ninput %0 f32\n%1 = max %0 0.0\n%2 = min 6.0 %1\n%3 = pow %2 2.0\n"
            "%4 = sub 1.0 %3\n%5 = div %4 3.0\n%6 = add inf %5\n%7 = select 1.0 %5 nan\n%8 = add 1.0 2.5\n"
            "%9 = mul %8 %7\noutput %5 f32\noutput %6 f32\noutput %9 f32\n")
    check(expr.parse(text), [RNG.normal(0, 5, 777)], lib)


BROADCAST_CASES = [
    [(2, 3, 4), (4,)],
    [(2, 3, 4), ()],
    [(), (2, 3, 4)],
    [(2, 1, 4), (3, 1)],
    [(1,), (5, 6)],
    [(5, 1, 1, 7), (1, 6, 1, 1)],
    [(3, 1), (1, 4)],
    [(7, 1, 5), (7, 9, 5)],
    [(1, 1, 1), (2, 1, 3)],
    [(4, 5), (4, 5)],
    [(1, 4, 5), (4, 5)],
    [(), ()],
    [(6, 1, 300), (1, 700, 1)],  # > one block, odd inner sizes
]


@pytest.mark.parametrize("shapes", BROADCAST_CASES, ids=[str(s) for s in BROADCAST_CASES])
def test_broadcasting(shapes, lib):
    b = Builder(["f32", "f32"])
    s = b.emit("sub", Ref(0), Ref(1))
    p = b.emit("mul", s, Ref(0))
    prog = b.build([(p, "f32"), (Ref(1), "f32")])
    check(prog, [RNG.normal(size=s).astype(np.float32) for s in shapes], lib)


def test_broadcasting_three_inputs_mixed_dtypes(lib):
    b = Builder(["f16", "bool", "bf16"])
    t = b.emit("select", Ref(1), Ref(0), Ref(2))
    u = b.emit("mul", t, Ref(0))
    prog = b.build([(u, "f32"), (t, "bf16"), (u, "f16")])
    check(prog, [RNG.normal(size=(3, 1, 5)), RNG.random((4, 1)) > 0.5, RNG.normal(size=(1, 4, 5))], lib)


def test_not_broadcastable_is_a_clear_error(lib):
    prog = prog1("add", 2)
    model = fused_model(prog, [(3,), (3,)], dynamic_shapes=True)
    with pytest.raises(Exception, match=r"do not broadcast.*\[3\].*\[4\]"):
        run(model, prog, [np.zeros(3, np.float32), np.zeros(4, np.float32)], lib)


@pytest.mark.parametrize("n", [0, 1, 2, 15, 4097, 1000003])
def test_odd_sizes(n, lib):
    b = Builder(["f32", "f32"])
    t = b.emit("tanh", b.emit("mul", Ref(0), Ref(1)))
    prog = b.build([(t, "f32"), (b.emit("add", t, 1.0), "f16")])
    check(prog, [RNG.normal(size=n), np.float32(1.5)], lib)
    check(prog, [RNG.normal(size=(n, 1)), RNG.normal(size=(1, 3))], lib)


@pytest.mark.parametrize("dt", ["f16", "bf16", "bool"])
def test_input_dtypes(dt, lib):
    b = Builder([dt, dt])
    t = b.emit("add", b.emit("mul", Ref(0), 3.0), Ref(1))
    prog = b.build([(t, "f32")])
    if dt == "bool":
        xs = [RNG.random(2000) > 0.5, RNG.random(2000) > 0.3]
    else:
        xs = [RNG.normal(0, 10, 2000), RNG.normal(0, 10, 2000)]
        xs[0][:4] = [np.inf, -np.inf, np.nan, -0.0]
    check(prog, xs, lib)
    check(prog, [xs[0], xs[1][:1]], lib)  # scalar-like second input


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_output_dtypes(dt, lib):
    b = Builder(["f32"])
    t = b.emit("mul", Ref(0), 1.0)
    prog = b.build([(t, dt)])
    x = np.concatenate([SPECIALS, RNG.normal(0, 1000, 3000).astype(np.float32),
                        RNG.normal(0, 1e-5, 1000).astype(np.float32)])  # f16 subnormals
    got = check(prog, [x], lib)[0]
    # Rounding is exactly numpy's / ml_dtypes' round-to-nearest-even (ties, overflow, NaN).
    want = x.astype(NP_OF[dt]).astype(np.float32)
    np.testing.assert_array_equal(got.astype(np.float32), want)


@pytest.mark.parametrize("op", ["round_f16", "round_bf16"])
def test_round_ops_exact(op, lib):
    # Values at and around ties: round-to-nearest-even must match numpy bit for bit.
    bits = RNG.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.concatenate([x, SPECIALS, np.float32([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 2**-24])])
    got = run(fused_model(prog1(op, 1), [x.shape]), prog1(op, 1), [x], lib)[0]
    want = expr.evaluate(prog1(op, 1), [x])[0]
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()


def test_several_outputs(lib):
    b = Builder(["f32", "f16"])
    e = b.emit("exp", Ref(0))
    s = b.emit("sigmoid", b.emit("add", e, Ref(1)))
    prog = b.build([(s, "f32"), (e, "f16"), (s, "bf16"), (Ref(0), "f32"), (Ref(1), "f32"), (s, "f32")])
    check(prog, [RNG.normal(size=(33, 65)), RNG.normal(size=(65,))], lib)


def test_one_element_inputs_everywhere(lib):
    # One-element inputs become constants: used as scalars by binary ops, through buffers
    # by unary ops, select and stores.
    b = Builder(["f32", "f16", "f32"])
    e = b.emit("exp", Ref(1))
    s = b.emit("select", Ref(1), Ref(0), e)
    m = b.emit("mul", b.emit("add", Ref(0), Ref(1)), Ref(2))
    prog = b.build([(s, "f32"), (e, "f32"), (Ref(1), "bf16"), (m, "f32"), (b.emit("sub", Ref(1), Ref(2)), "f32")])
    check(prog, [RNG.normal(size=(7, 300)), np.float16(0.75), RNG.normal(size=(1, 1))], lib)
    check(prog, [RNG.normal(size=(7, 300)), np.zeros((1, 1), np.float16), np.float32(2.0)], lib)


def test_dead_values_and_reused_slots(lib):
    text = (f"{expr.HEADER}\ninput %0 f32\ninput %1 f32\n%2 = exp %1\n%3 = mul %0 %0\n%4 = add %3 %0\n"
            "%5 = mul %4 %4\n%6 = sub %5 %3\n%7 = neg %6\n%8 = abs %7\n%9 = log %8\noutput %6 f32\noutput %9 f16\n")
    check(expr.parse(text), [RNG.normal(size=5000), RNG.normal(size=5000)], lib)


@pytest.mark.parametrize("threads", [1, 2])
def test_big_tensor_multithreaded(threads, lib):
    b = Builder(["f32", "f16"])
    t = b.emit("mul", Ref(0), Ref(1))
    u = b.emit("softplus", b.emit("sub", t, 0.5))
    prog = b.build([(u, "f32"), (t, "f16")])
    x = RNG.normal(size=(64, 1, 4099)).astype(np.float32)  # ~8.4M outputs with y
    y = RNG.normal(size=(32, 1)).astype(np.float16)
    check(prog, [x, y], lib, threads=threads)


def test_bad_program_fails_at_session_creation(lib):
    prog = prog1("neg", 1)
    model = fused_model(prog, [(3,)])
    model.graph.node[0].attribute[0].s = f"{expr.HEADER}\ninput %0 f32\n%1 = frobnicate %0\noutput %1 f32\n".encode()
    with pytest.raises(Exception, match="unknown op 'frobnicate'"):
        run(model, prog, [np.zeros(3, np.float32)], lib)


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_rotate_half_input(dt, lib):
    """rotate_half [0, 1]: input 1 read as Concat(-x[..., h:], x[..., :h]) (rotary embeddings);
    -0.0 and NaN keep their negation's sign bit, compared bit for bit with numpy."""
    prog = expr.parse(f"{expr.HEADER}\ninput %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}\n"
                      f"output %1 {dt}\n")
    model = fused_model(prog, [(3, 8), (3, 8)])
    model.graph.node[0].attribute.append(helper.make_attribute("rotate_half", [0, 1]))
    x = RNG.normal(0, 2, (3, 8)).astype(np.float32)
    x[0, 5], x[1, 6], x[2, 0] = -0.0, 0.0, np.nan
    zeros = np.zeros((3, 8), np.float32)
    got_sum, got_rot = (np.asarray(g, np.float32) for g in run(model, prog, [zeros, x], lib))  # bf16: through f32
    want = np.concatenate([-x[:, 4:], x[:, :4]], axis=1).astype(NP_OF[dt]).astype(np.float32)
    np.testing.assert_array_equal(got_rot, want)  # NaN where NaN
    assert np.array_equal(np.signbit(got_rot), np.signbit(want))  # -0.0 and the NaN's sign too
    np.testing.assert_array_equal(got_sum, want)


def test_rotate_half_of_the_wrong_length_is_a_clear_error(lib):
    prog = prog1("neg", 1)
    model = fused_model(prog, [(4,)])
    model.graph.node[0].attribute.append(helper.make_attribute("rotate_half", [1, 0]))
    with pytest.raises(Exception, match="rotate_half has 2 entries, the program 1 inputs"):
        run(model, prog, [np.zeros(4, np.float32)], lib)


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_transposed_inputs(dt, lib):
    """transpose [(0, 2, 1, 3), identity, (0, 2, 1, 3)] with rotate_half [0, 0, 1]: inputs 0 and 2
    (one [2, 5, 3, 8] tensor, as LLaMA's Q before its Transpose) read as [2, 3, 5, 8], input 2
    rotated after the permutation; input 1 broadcast over the permuted shape. Bit for bit with
    the kind's numpy reference (Pointwise.evaluate) and with numpy."""
    from onnxfuse.kinds.pointwise import Pointwise

    prog = expr.parse(f"{expr.HEADER}\ninput %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\n%3 = add %0 %1\n"
                      f"output %0 {dt}\noutput %2 {dt}\noutput %3 {dt}\n")
    model = fused_model(prog, [(2, 3, 5, 8), (5, 8), (2, 3, 5, 8)], dynamic_shapes=True)
    for name in ("x0", "x2"):  # the graph's inputs are the tensors before their permutation
        vi = next(v for v in model.graph.input if v.name == name)
        for d, v in zip(vi.type.tensor_type.shape.dim, (2, 5, 3, 8), strict=True):
            d.Clear()
            d.dim_value = v
    node = model.graph.node[0]
    perm = [0, 2, 1, 3]
    node.attribute.extend([helper.make_attribute("transpose", perm + [0, 1, 2, 3] + perm),
                           helper.make_attribute("rotate_half", [0, 0, 1])])
    q = RNG.normal(0, 2, (2, 5, 3, 8)).astype(NP_OF[dt]).astype(np.float32)
    b = RNG.normal(0, 2, (5, 8)).astype(NP_OF[dt]).astype(np.float32)
    got = [np.asarray(g, np.float32) for g in run(model, prog, [q, b, q], lib)]
    qt = q.transpose(perm)
    rot = np.concatenate([-qt[..., 4:], qt[..., :4]], axis=-1)
    ref = Pointwise().evaluate(node, [q, b, q])
    for g, want, r in zip(got, [qt, rot, (qt + b).astype(NP_OF[dt]).astype(np.float32)], ref, strict=True):
        np.testing.assert_array_equal(g, want)
        np.testing.assert_array_equal(g, np.asarray(r, np.float32))


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_partial_inputs(dt, lib):
    """partial [6, 0] (Phi's partial rotary): the program (q * cos + rotate_half(q) * sin) over the
    first 6 of q's 10 columns, cos and sin of 6 columns, q's own columns beyond; q read through
    its transpose (0, 2, 1, 3). Bit for bit with the kind's numpy reference and with numpy."""
    from onnxfuse.kinds.pointwise import Pointwise

    prog = expr.parse(f"{expr.HEADER}\ninput %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\ninput %3 {dt}\n"
                      f"%4 = mul %0 %1\n%5 = mul %2 %3\n%6 = add %4 %5\noutput %6 {dt}\n")
    model = fused_model(prog, [(2, 3, 5, 10), (5, 1), (2, 3, 5, 10), (5, 1)], dynamic_shapes=True)
    for vi in model.graph.input:  # the graph's q is the tensor before its permutation
        dims = {"x0": (2, 5, 3, 10), "x2": (2, 5, 3, 10)}.get(vi.name, (5, 6))
        for d, v in zip(vi.type.tensor_type.shape.dim, dims, strict=True):
            d.Clear()
            d.dim_value = v
    node = model.graph.node[0]
    perm, same = [0, 2, 1, 3], [0, 1, 2, 3]
    node.attribute.extend([helper.make_attribute("transpose", perm + same + perm + same),
                           helper.make_attribute("rotate_half", [0, 0, 1, 0]),
                           helper.make_attribute("partial", [6, 0])])
    q = RNG.normal(0, 2, (2, 5, 3, 10)).astype(NP_OF[dt])
    cos, sin = (RNG.normal(0, 1, (5, 6)).astype(NP_OF[dt]) for _ in range(2))
    (got,) = run(model, prog, [q, cos, q, sin], lib)
    qt = q.transpose(perm)
    r = qt[..., :6]
    rot = np.concatenate([-r[..., 3:], r[..., :3]], axis=-1)
    want = np.concatenate([(r * cos + rot * sin).astype(NP_OF[dt]), qt[..., 6:]], axis=-1)
    if dt == "f32":  # (numpy computes f16 products in f16; the program rounds once per op too)
        np.testing.assert_array_equal(got, want)
    (ref,) = Pointwise().evaluate(node, [q, cos, q, sin])
    np.testing.assert_array_equal(got, np.asarray(ref).astype(got.dtype))
    np.testing.assert_array_equal(got[..., 6:], qt[..., 6:])
    node.attribute[-1].CopyFrom(helper.make_attribute("partial", [10, 0]))  # q no wider than its columns
    with pytest.raises(Exception, match="copied beyond the first 10 columns it needs more of them"):
        run(model, prog, [q, cos, q, sin], lib)
    node.attribute[-1].CopyFrom(helper.make_attribute("partial", [6, 4]))
    with pytest.raises(Exception, match=r"partial must be \[columns, input\]"):
        run(model, prog, [q, cos, q, sin], lib)


@pytest.mark.parametrize("dt", ["f32", "f16"])
def test_partial_adds_an_input_beyond(dt, lib):
    """partial [6, 0, 4] (a projection bias below the head split, onnxfuse.headbias): as
    test_partial_inputs, but the columns beyond 6 are q's plus input 4's (a bias [1, 3, 1, 10]
    broadcast over the batch and the sequence, not read by the program), added in fp32 and rounded
    once. Bit for bit with the kind's numpy reference and with numpy; a j that is k, or no input,
    is refused."""
    from onnxfuse.kinds.pointwise import Pointwise

    prog = expr.parse(f"{expr.HEADER}\ninput %0 {dt}\ninput %1 {dt}\ninput %2 {dt}\ninput %3 {dt}\ninput %4 {dt}\n"
                      f"%5 = mul %0 %1\n%6 = mul %2 %3\n%7 = add %5 %6\noutput %7 {dt}\n")
    model = fused_model(prog, [(2, 3, 5, 10), (5, 1), (2, 3, 5, 10), (5, 1), (1, 3, 1, 10)], dynamic_shapes=True)
    for vi in model.graph.input:
        dims = {"x0": (2, 5, 3, 10), "x2": (2, 5, 3, 10), "x4": (1, 3, 1, 10)}.get(vi.name, (5, 6))
        for d, v in zip(vi.type.tensor_type.shape.dim, dims, strict=True):
            d.Clear()
            d.dim_value = v
    node = model.graph.node[0]
    perm, same = [0, 2, 1, 3], [0, 1, 2, 3]
    node.attribute.extend([helper.make_attribute("transpose", perm + same + perm + same + same),
                           helper.make_attribute("rotate_half", [0, 0, 1, 0, 0]),
                           helper.make_attribute("partial", [6, 0, 4])])
    q = RNG.normal(0, 2, (2, 5, 3, 10)).astype(NP_OF[dt])
    cos, sin = (RNG.normal(0, 1, (5, 6)).astype(NP_OF[dt]) for _ in range(2))
    c = RNG.normal(0, 1, (1, 3, 1, 10)).astype(NP_OF[dt])
    (got,) = run(model, prog, [q, cos, q, sin, c], lib)
    qt = q.transpose(perm)
    r = qt[..., :6]
    rot = np.concatenate([-r[..., 3:], r[..., :3]], axis=-1)
    beyond = (qt[..., 6:].astype(np.float32) + c[..., 6:].astype(np.float32)).astype(NP_OF[dt])
    np.testing.assert_array_equal(got[..., 6:], beyond)
    assert not np.array_equal(got[..., 6:], qt[..., 6:])
    if dt == "f32":
        np.testing.assert_array_equal(got[..., :6], r * cos + rot * sin)
    (ref,) = Pointwise().evaluate(node, [q, cos, q, sin, c])
    np.testing.assert_array_equal(got, np.asarray(ref).astype(got.dtype))
    for bad in ([6, 0, 0], [6, 0, 5]):
        node.attribute[-1].CopyFrom(helper.make_attribute("partial", bad))
        with pytest.raises(Exception, match=r"partial must be \[columns, input\] or \[columns, input, input added\]"):
            run(model, prog, [q, cos, q, sin, c], lib)


@pytest.mark.parametrize("dt", ["f32", "f16", "bf16"])
def test_rotate_pairs_input(dt, lib):
    """rotate_pairs [0, 1] (GPT-J's rotate_every_two, Cohere's rotate_half): input 1 read with each
    pair (x[2j], x[2j+1]) as (-x[2j+1], x[2j]), the sign flipped bit for bit (-0.0 and NaN too); an
    input in both rotate_half and rotate_pairs is refused."""
    from onnxfuse.kinds.pointwise import Pointwise

    prog = expr.parse(f"{expr.HEADER}\ninput %0 {dt}\ninput %1 {dt}\n%2 = mul %1 1.0\n%3 = add %0 %2\n"
                      f"output %2 {dt}\noutput %3 {dt}\n")
    model = fused_model(prog, [(3, 4, 6), (3, 4, 6)])
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("rotate_pairs", [0, 1]))
    x = RNG.normal(0, 2, (3, 4, 6)).astype(np.float32)
    x[0, 0, :4] = [0.0, -0.0, np.nan, 1.5]
    x = x.astype(NP_OF[dt]).astype(np.float32)
    b = RNG.normal(0, 2, (3, 4, 6)).astype(NP_OF[dt]).astype(np.float32)
    got = [np.asarray(g, np.float32) for g in run(model, prog, [b, x], lib)]
    want = np.empty_like(x)
    want[..., 0::2], want[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    np.testing.assert_array_equal(got[0].view(np.uint32), want.view(np.uint32))
    ref = Pointwise().evaluate(node, [b, x])
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(g, np.asarray(r, np.float32))
    node.attribute.append(helper.make_attribute("rotate_half", [0, 1]))
    with pytest.raises(Exception, match="input 1 is in both rotate_half and rotate_pairs"):
        run(model, prog, [b, x], lib)


@pytest.mark.parametrize("attr,message", [
    ([0, 1], "transpose has 2 entries, not a multiple of the program's 3 inputs"),
    ([0, 0, 1, 0, 1, 0], "transpose of input 0 is not a permutation of 2 dims"),
    ([0, 1, 2, 2, 2, 0, 0, 1, 2], "transpose of input 1 is not a permutation of 3 dims")])
def test_transpose_attribute_errors_are_clear(attr, message, lib):
    prog = expr.parse(f"{expr.HEADER}\ninput %0 f32\ninput %1 f32\ninput %2 f32\n%3 = add %0 %1\n"
                      "%4 = add %3 %2\noutput %4 f32\n")
    model = fused_model(prog, [(2, 2), (2, 2), (2, 2)])
    model.graph.node[0].attribute.append(helper.make_attribute("transpose", attr))
    with pytest.raises(Exception, match=message):
        run(model, prog, [np.zeros((2, 2), np.float32)] * 3, lib)


def test_dtype_mismatch_is_a_clear_error(lib):
    prog = prog1("neg", 1)  # declares an f32 input
    model = fused_model(prog, [(3,)])
    text = model.graph.node[0].attribute[0].s.decode().replace("input %0 f32", "input %0 bool")
    model.graph.node[0].attribute[0].s = text.encode()
    with pytest.raises(Exception, match="input 0 is float32, the program declares bool"):
        run(model, prog, [np.zeros(3, np.float32)], lib)


def test_float32_tensors_may_stand_for_half_values(lib):
    """ONNX Runtime's CPU provider runs an fp16 node whose neighbours it casts to fp32 in
    fp32 too, rewiring its inputs and outputs to float32 ("isolated fp16 node"): the CPU
    kernel reads and writes float32 there, rounding outputs as the program says."""
    prog = expr.parse(f"{expr.HEADER}\ninput %0 f16\n%1 = mul %0 3.0\noutput %1 f16\noutput %0 f16\n")
    as_f32 = prog_with_dtypes(prog, "f32")
    model = fused_model(as_f32, [(5,)])
    model.graph.node[0].attribute[0].s = prog.to_text().encode()
    x = np.array([1.0, 1e-3, 70000.0, -0.1, 1 / 3], np.float32)
    out = run(model, as_f32, [x], lib)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out[0], (x * 3).astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(out[1], x.astype(np.float16).astype(np.float32))


def prog_with_dtypes(prog: Program, dtype: str) -> Program:
    return Program(tuple(dtype for _ in prog.input_dtypes), prog.instrs, tuple((v, dtype) for v, _ in prog.outputs))


def test_erf_reference_is_exact_enough():
    # The reference erf is math.erf in double rounded to fp32: a correctly rounded baseline.
    assert abs(expr.evaluate(prog1("erf", 1), [np.float32([0.5])])[0][0] - math.erf(0.5)) < 1e-7


# ---------------------------------------------------------------------------------------
# CUDA kernel (the launcher): run where onnxruntime has the CUDA execution provider
# ---------------------------------------------------------------------------------------

def _modes(in_shapes: list[tuple[int, ...]], force: str | None = None) -> tuple[str, ...]:
    out = tuple(np.broadcast_shapes(*in_shapes))
    if force:
        return (force,) * len(in_shapes)
    return tuple("full" if tuple(s) == out else "scalar" if math.prod(s) == 1 else "strided" for s in in_shapes)


def with_kernels(model: onnx.ModelProto, prog: Program, in_shapes: list[tuple[int, ...]],
                 modes: tuple[str, ...] | None = None, ptx_only: bool = False, rank: int | None = None,
                 archs: list[int] | None = None) -> onnx.ModelProto:
    """Compile the node's kernels (onnxfuse.compile) and attach them as docs/format.md says."""
    import json

    from onnxfuse.codegen import KernelSpec
    from onnxfuse.compile import compile_kernels, local_gpu_archs

    node = model.graph.node[0]
    out_rank = len(np.broadcast_shapes(*in_shapes)) if rank is None else rank
    spec = KernelSpec(prog, node.overload, out_rank, modes or _modes(in_shapes))
    ck = compile_kernels([spec], archs or local_gpu_archs())[0]
    meta = ck.kernel_meta()
    blobs = ck.kernels()
    if ptx_only:
        keep = [i for i, b in enumerate(meta["binaries"]) if b["format"] == "ptx"]
        meta["binaries"] = [meta["binaries"][i] for i in keep]
        blobs = [blobs[i] for i in keep]
    node.attribute.append(helper.make_attribute("kernel_meta", json.dumps(meta)))
    for i, blob in enumerate(blobs):
        node.attribute.append(helper.make_attribute(f"kernel_{i}", blob))
    return model


def run_cuda(model: onnx.ModelProto, prog: Program, inputs: list[np.ndarray], lib: str,
             cuda_graph: bool = False) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the node must run on CUDA
    opts = {"enable_cuda_graph": "1"} if cuda_graph else {}
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])
    feeds = {f"x{i}": _feed(dt, x) for i, (dt, x) in enumerate(zip(prog.input_dtypes, inputs, strict=True))}
    if not cuda_graph:
        return [v.numpy() for v in sess.run_with_ort_values(None, feeds)]
    binding = sess.io_binding()
    dev_in = {k: ort.OrtValue.ortvalue_from_numpy(v.numpy(), "cuda", 0) for k, v in feeds.items()}
    for k, v in dev_in.items():
        binding.bind_ortvalue_input(k, v)
    outs = []
    for o in sess.get_outputs():
        shape = tuple(np.broadcast_shapes(*[x.shape for x in inputs]))
        dt = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[o.type]
        outs.append(ort.OrtValue.ortvalue_from_numpy(np.full(shape, np.nan, dt), "cuda", 0))
        binding.bind_ortvalue_output(o.name, outs[-1])
    for _ in range(3):  # warm-up runs, capture, replay
        sess.run_with_iobinding(binding)
    return [o.numpy() for o in outs]


def check_cuda(prog: Program, inputs: list[np.ndarray], lib: str, modes=None, ptx_only=False, rank=None,
               cuda_graph=False, rtol=1e-5, atol=1e-6) -> None:
    inputs = [np.asarray(x).astype(NP_OF[dt]) for dt, x in zip(prog.input_dtypes, inputs, strict=True)]
    shapes = [x.shape for x in inputs]
    model = with_kernels(fused_model(prog, shapes), prog, shapes, modes, ptx_only, rank)
    got = run_cuda(model, prog, inputs, lib, cuda_graph)
    want = expr.evaluate(prog, inputs)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, (j, g.shape, w.shape)
        if prog.outputs[j][1] == "f32":
            np.testing.assert_allclose(g, w.astype(np.float32), rtol=rtol, atol=atol, equal_nan=True)
        else:
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-2, atol=1e-3,
                                       equal_nan=True)


def _all_ops_program() -> Program:
    b = Builder(["f32", "f32", "f32"])
    outs = []
    for op in expr.UNARY:
        outs.append((b.emit(op, Ref(0)), "f32"))
    for op in expr.BINARY:
        outs.append((b.emit(op, Ref(0), Ref(1)), "f32"))
    outs.append((b.emit("select", Ref(2), Ref(0), Ref(1)), "f32"))
    return b.build(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 1001])  # variant 0 (n % 16 == 0) and variant 1
def test_cuda_every_op(n, lib):
    a = RNG.normal(0, 3, n).astype(np.float32)
    a[: len(SPECIALS)] = SPECIALS
    b = RNG.normal(0, 3, n).astype(np.float32)
    c = (RNG.random(n) > 0.5).astype(np.float32)
    check_cuda(_all_ops_program(), [a, b, c], lib)


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", BROADCAST_CASES, ids=[str(s) for s in BROADCAST_CASES])
def test_cuda_broadcasting(shapes, lib):
    b = Builder(["f32", "f32"])
    s = b.emit("sub", Ref(0), Ref(1))
    prog = b.build([(b.emit("mul", s, Ref(0)), "f32"), (Ref(1), "f32")])
    check_cuda(prog, [RNG.normal(size=s) for s in shapes], lib)


@pytest.mark.gpu
def test_cuda_all_strided_and_higher_rank(lib):
    b = Builder(["f32", "f16"])
    prog = b.build([(b.emit("add", Ref(0), Ref(1)), "f32")])
    xs = [RNG.normal(size=(2, 3, 4, 5)), RNG.normal(size=(3, 1, 5))]
    check_cuda(prog, xs, lib, modes=("strided", "strided"))  # a 'full' input read through strides
    check_cuda(prog, xs, lib, rank=6)  # kernel compiled for a higher rank: padded dims


@pytest.mark.gpu
def test_cuda_dtypes_and_outputs(lib):
    b = Builder(["f16", "bool", "bf16"])
    t = b.emit("select", Ref(1), Ref(0), Ref(2))
    u = b.emit("tanh", b.emit("mul", t, Ref(0)))
    prog = b.build([(u, "f32"), (t, "bf16"), (u, "f16"), (Ref(0), "f32")])
    check_cuda(prog, [RNG.normal(size=(64, 33)), RNG.random((64, 1)) > 0.5, RNG.normal(size=(33,))], lib)


@pytest.mark.gpu
def test_cuda_ptx_only(lib):
    check_cuda(prog1("sigmoid", 1), [RNG.normal(size=5000)], lib, ptx_only=True)


@pytest.mark.gpu
def test_cuda_empty_and_single(lib):
    prog = prog1("add", 2)
    check_cuda(prog, [np.zeros((0, 7)), RNG.normal(size=(1, 7))], lib)
    check_cuda(prog, [np.float32(3.0), np.float32(4.0)], lib)


@pytest.mark.gpu
def test_cuda_graph_capture(lib):
    b = Builder(["f32", "f32"])
    prog = b.build([(b.emit("mul", b.emit("cos", Ref(0)), Ref(1)), "f32")])
    check_cuda(prog, [RNG.normal(size=(8, 1000)), RNG.normal(size=(1000,))], lib, cuda_graph=True)


@pytest.mark.gpu
def test_cuda_without_kernels_is_a_clear_error(lib):
    prog = prog1("neg", 1)
    model = fused_model(prog, [(4,)])
    with pytest.raises(Exception, match="optimized without compiling GPU kernels.*--target"):
        run_cuda(model, prog, [np.zeros(4, np.float32)], lib)


@pytest.mark.gpu
def test_cuda_no_binary_for_this_gpu(lib):
    import json

    prog = prog1("neg", 1)
    model = with_kernels(fused_model(prog, [(4,)]), prog, [(4,)])
    node = model.graph.node[0]
    meta = json.loads(next(a.s for a in node.attribute if a.name == "kernel_meta"))
    for b in meta["binaries"]:  # pretend everything was built for another GPU
        b["arch"], b["format"] = 70, "cubin"
    next(a for a in node.attribute if a.name == "kernel_meta").s = json.dumps(meta).encode()
    with pytest.raises(Exception, match=r"no binary for this GPU.*sm_\d+.*embedded: cubin sm_70"):
        run_cuda(model, prog, [np.zeros(4, np.float32)], lib)


def test_node_with_compiled_kernels_runs_on_cpu(lib):
    """kernel_meta / kernel_<i> attributes (compiled for sm_90 here, no GPU needed) are
    ignored by the CPU kernel."""
    pytest.importorskip("triton")
    prog = prog1("sigmoid", 1)
    x = RNG.normal(size=(3, 700)).astype(np.float32)
    model = with_kernels(fused_model(prog, [x.shape]), prog, [x.shape], archs=[90])
    onnx.checker.check_model(model)
    np.testing.assert_allclose(run(model, prog, [x], lib)[0], expr.evaluate(prog, [x])[0], rtol=1e-5, atol=1e-6)


def test_missing_library_falls_back_to_function_bodies_with_one_warning(monkeypatch, tmp_path):
    """No library (here: ONNXFUSE_LIBRARY points nowhere): the session still runs, through
    the function bodies, and says so once."""
    import warnings

    import onnxfuse
    from onnxfuse import runtime
    from tests.util import random_feeds, run

    m = onnx.load(str(Path(__file__).resolve().parent.parent / "models" / "example.onnx"))
    opt = onnxfuse.optimize_model(m).model
    monkeypatch.setenv("ONNXFUSE_LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setattr(runtime, "_warned", False)
    feeds = random_feeds(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = onnxfuse.InferenceSession(opt.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        onnxfuse.InferenceSession(opt.SerializeToString(), providers=["CPUExecutionProvider"])
    msgs = [str(w.message) for w in caught if "custom-op library not available" in str(w.message)]
    assert len(msgs) == 1 and "missing.so" in msgs[0]
    np.testing.assert_allclose(out[0], run(m, feeds)[0], rtol=1e-6, atol=1e-6)
