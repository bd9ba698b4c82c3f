"""pointwise_chain: what fuses, what does not and why, and that results stay the same."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.expr import parse
from onnxfuse.pattern import load_patterns
from tests.util import check_fusion, model, op_types, random_feeds, run

N = helper.make_node
X4 = {"x": ("float32", ["N", 3, 5, 7])}
Y4 = {"y": ("float32", ["N", 3, 5, 7])}


def unary_pair(op: str, **attrs) -> onnx.ModelProto:
    """x -> Mul(0.5) -> op -> y: every unary op fuses with a neighbour."""
    return model([N("Mul", ["x", "half"], ["t"]), N(op, ["t"], ["y"], **attrs)], X4, Y4,
                 {"half": np.array(0.5, np.float32)})


UNARY = [("Neg", {}), ("Abs", {}), ("Relu", {}), ("LeakyRelu", {"alpha": 0.2}), ("Elu", {"alpha": 0.7}),
         ("Sigmoid", {}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("HardSwish", {}), ("Tanh", {}),
         ("Exp", {}), ("Erf", {}), ("Cos", {}), ("Sin", {}), ("Softplus", {}), ("Gelu", {}),
         ("Gelu", {"approximate": "tanh"})]


@pytest.mark.parametrize("op,attrs", UNARY, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_unary_ops_fuse(op, attrs):
    r = check_fusion(unary_pair(op, **attrs), expect_fused=1)
    assert op_types(r.model) == ["PointwiseChain"]


@pytest.mark.parametrize("op", ["Log", "Sqrt", "Reciprocal"])
def test_ops_on_positive_inputs(op):
    m = model([N("Abs", ["x"], ["a"]), N("Add", ["a", "one"], ["t"]), N(op, ["t"], ["y"])], X4, Y4,
              {"one": np.array(1.0, np.float32)})
    check_fusion(m, expect_fused=1)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean"])
def test_binary_ops_with_broadcasting(op):
    # x[N,3,5,7] op b[3,1,7] op c[7]: strided and size-1 broadcasting in one group
    m = model([N(op, ["x", "b"], ["t"]), N(op, ["t", "c"], ["y"])], X4, Y4,
              {"b": np.linspace(0.5, 2, 21, dtype=np.float32).reshape(3, 1, 7),
               "c": np.linspace(1, 2, 7, dtype=np.float32)})
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].input_modes == ("full", "strided", "strided")


def test_pow_with_tensor_and_literal_exponents():
    m = model([N("Abs", ["x"], ["a"]), N("Pow", ["a", "p"], ["t"]), N("Pow", ["t", "two"], ["y"])], X4, Y4,
              {"p": np.array([0.5, 1.5, 3.0, 0.0, 2.0, -1.0, 1.0], np.float32), "two": np.array(2.0, np.float32)})
    check_fusion(m, expect_fused=1)


@pytest.mark.parametrize("opset,bounds", [(13, ("lo", "hi")), (13, ("", "hi")), (13, ("lo",)), (7, None)])
def test_clip_constant_bounds(opset, bounds):
    if bounds is None:
        clip = N("Clip", ["t"], ["y"], min=-0.5, max=0.75)
    else:
        clip = N("Clip", ["t", *bounds], ["y"])
    m = model([N("Mul", ["x", "two"], ["t"]), clip], X4, Y4,
              {"two": np.array(2.0, np.float32), "lo": np.array(-1.0, np.float32),
               "hi": np.array(1.5, np.float32)}, opset=opset)
    r = check_fusion(m, expect_fused=1)
    assert "max" in r.fused[0].program.to_text() or bounds == ("", "hi")


def test_clip_with_variable_bound_is_not_fused_and_says_why():
    m = model([N("Mul", ["x", "x"], ["t"]), N("Clip", ["t", "lo"], ["y"])],
              {**X4, "lo": ("float32", [])}, Y4)
    r = check_fusion(m, expect_fused=0)
    assert "Clip input 1 is not a constant scalar" in r.report.not_fused


def test_where_with_bool_condition():
    m = model([N("Neg", ["x"], ["n"]), N("Where", ["c", "x", "n"], ["w"]), N("Mul", ["w", "x"], ["y"])],
              {**X4, "c": ("bool", ["N", 3, 1, 7])}, Y4)
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].program.input_dtypes == ("f32", "bool")


def test_silu_is_one_group():
    m = model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["y"])], X4, Y4)
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].inputs == ("x",)


def test_hardswish_written_out():
    m = model([N("Add", ["x", "three"], ["a"]), N("Clip", ["a", "zero", "six"], ["c"]),
               N("Div", ["c", "six"], ["d"]), N("Mul", ["x", "d"], ["y"])], X4, Y4,
              {"three": np.array(3.0, np.float32), "zero": np.array(0.0, np.float32),
               "six": np.array(6.0, np.float32)})
    r = check_fusion(m, expect_fused=1)
    assert len(r.fused[0].source_nodes) == 4


def test_gelu_written_out_around_erf():
    m = model([N("Div", ["x", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["a"]),
               N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])], X4, Y4,
              {"sqrt2": np.array(1.4142135, np.float32), "one": np.array(1.0, np.float32),
               "half": np.array(0.5, np.float32)})
    r = check_fusion(m, expect_fused=1, leave_to_ort=False)  # by default left to ORT's Gelu fusion
    assert r.fused[0].inputs == ("x",)
    assert r.report.nodes_after == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_chains(dtype):
    if dtype == "bfloat16":
        # ORT's CPU provider lacks most bf16 kernels: compare the program with an fp32 model.
        m = model([N("Cast", ["x"], ["h"], to=onnx.TensorProto.BFLOAT16), N("Cast", ["h"], ["f"], to=1),
                   N("Mul", ["f", "f"], ["y"])], X4, Y4)
        r = check_fusion(m, expect_fused=1)
        assert "round_bf16" in r.fused[0].program.to_text()
        return
    m = model([N("Mul", ["x", "x"], ["t"]), N("Sigmoid", ["t"], ["s"]), N("Add", ["s", "x"], ["y"])],
              {"x": (dtype, [2, 33])}, {"y": (dtype, [2, 33])})
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].program.outputs[0][1] == "f16"


def test_mixed_dtypes_with_casts():
    m = model([N("Cast", ["x"], ["h"], to=onnx.TensorProto.FLOAT16), N("Mul", ["h", "h"], ["hy"]),
               N("Cast", ["hy"], ["y"], to=onnx.TensorProto.FLOAT), N("Relu", ["h"], ["r"])],
              {"x": ("float32", [4, 9])}, {"y": ("float32", [4, 9]), "r": ("float16", [4, 9])})
    r = check_fusion(m, expect_fused=1, rtol=1e-2)
    assert [dt for _, dt in r.fused[0].program.outputs] == ["f32", "f16"]


def test_graph_output_in_the_middle_becomes_an_extra_output():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("Neg", ["b"], ["y"])], X4,
              {**Y4, "b": ("float32", ["N", 3, 5, 7])})
    r = check_fusion(m, expect_fused=1)
    assert set(r.fused[0].outputs) == {"b", "y"}


def test_intermediate_read_outside_the_group():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("ReduceMax", ["b"], ["r"], keepdims=1),
               N("Neg", ["b"], ["c"]), N("Sub", ["c", "r"], ["y"])], X4, Y4)
    # {Mul, Exp, Neg, Sub} would contain the path Exp -> ReduceMax -> Sub: Sub is split off.
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].outputs == ("b", "c")
    assert op_types(r.model) == ["PointwiseChain", "ReduceMax", "Sub"]


def test_path_leaving_and_reentering_is_split():
    # LayerNorm written out: Sub and Div are connected through elementwise ops but also
    # through ReduceMean; one node for both would make a cycle. (Pointwise chains alone: the
    # layer_norm pattern makes the whole norm one FusedRows, tests/test_rows_patterns.py.)
    m = model([N("ReduceMean", ["x"], ["mu"], axes=[-1]), N("Sub", ["x", "mu"], ["d"]),
               N("Mul", ["d", "d"], ["sq"]), N("ReduceMean", ["sq"], ["var"], axes=[-1]),
               N("Add", ["var", "eps"], ["ve"]), N("Sqrt", ["ve"], ["sd"]), N("Div", ["d", "sd"], ["nrm"]),
               N("Mul", ["nrm", "gamma"], ["g"]), N("Add", ["g", "beta"], ["y"])], X4, Y4,
              {"eps": np.array(1e-5, np.float32), "gamma": np.linspace(0.5, 1.5, 7, dtype=np.float32),
               "beta": np.linspace(-1, 1, 7, dtype=np.float32)}, opset=17)
    r = check_fusion(m, patterns=[p for p in load_patterns() if p.name == "pointwise_chain"])
    assert r.report.nodes_after < r.report.nodes_before
    assert op_types(r.model).count("ReduceMean") == 2


def test_smaller_exposed_intermediate_stops_the_group():
    # v = b*b has shape [7] and is a graph output; the group over [N,3,5,7] cannot write it.
    m = model([N("Mul", ["b", "b"], ["v"]), N("Add", ["x", "v"], ["t"]), N("Exp", ["t"], ["y"])],
              {**X4, "b": ("float32", [7])}, {**Y4, "v": ("float32", [7])})
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].outputs == ("y",)
    assert "output shape differs from the group's" in r.report.not_fused


def test_integer_chain_is_not_fused_and_says_why():
    m = model([N("Add", ["x", "x"], ["t"]), N("Mul", ["t", "t"], ["y"])],
              {"x": ("int64", [3])}, {"y": ("int64", [3])})
    r = optimize_model(m)
    assert op_types(r.model) == ["Add", "Mul"]
    assert r.report.not_fused == {"integer dtype": 2}


def test_double_is_not_fused():
    m = model([N("Add", ["x", "x"], ["t"]), N("Mul", ["t", "t"], ["y"])],
              {"x": ("float64", [3])}, {"y": ("float64", [3])})
    r = optimize_model(m)
    assert r.report.not_fused == {"float64 dtype": 2}


def test_lone_elementwise_node_is_left_alone():
    m = model([N("Relu", ["x"], ["r"]), N("ReduceSum", ["r"], ["y"], keepdims=1)], X4,
              {"y": ("float32", [1, 1, 1, 1])})
    r = optimize_model(m)
    assert op_types(r.model) == ["Relu", "ReduceSum"]
    assert r.report.not_fused == {"no elementwise neighbour to fuse with": 1}


@pytest.mark.parametrize("shape", [[0, 3], [1], [1, 1, 1], []])
def test_degenerate_sizes(shape):
    m = model([N("Mul", ["x", "x"], ["t"]), N("Tanh", ["t"], ["y"])],
              {"x": ("float32", shape)}, {"y": ("float32", shape)})
    check_fusion(m, expect_fused=1)


def test_exporter_habits_do_not_block_fusion():
    two = onnx.numpy_helper.from_array(np.array(2.0, np.float32))
    nodes = [N("Constant", [], ["k"], value=two), N("Mul", ["x", "k"], ["a"]), N("Identity", ["a"], ["ai"]),
             N("Dropout", ["ai"], ["d"]), N("Add", ["d", "w"], ["t"]), N("Sigmoid", ["t"], ["y"])]
    m = model(nodes, {**X4, "w": ("float32", [7])}, Y4, {"w": np.arange(7, dtype=np.float32)}, opset=13,
              ir_version=3)
    m.opset_import[0].version = 13
    r = check_fusion(m, expect_fused=1, feeds=random_feeds(model(
        [N("Relu", ["x"], ["y"])], X4, Y4)))
    assert op_types(r.model) == ["PointwiseChain"]
    assert len(r.fused[0].source_nodes) == 3


def test_identity_feeding_a_graph_output_keeps_the_name():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("Identity", ["b"], ["y"])], X4, Y4)
    r = check_fusion(m, expect_fused=1)
    assert r.model.graph.node[0].output[0] == "y"


def test_training_dropout_is_kept():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Dropout", ["a", "ratio", "train"], ["y"])], X4, Y4,
              {"ratio": np.array(0.5, np.float32), "train": np.array(True)})
    r = optimize_model(m)
    assert "Dropout" in op_types(r.model)


def test_function_bodies_are_the_original_subgraphs():
    m = model([N("Mul", ["x", "three"], ["a"]), N("Erf", ["a"], ["y"])], X4, Y4,
              {"three": np.array(3.0, np.float32)})
    r = check_fusion(m, expect_fused=1)
    (f,) = r.model.functions
    node = r.model.graph.node[0]
    assert (f.domain, f.name, f.overload) == (node.domain, node.op_type, node.overload)
    assert [n.op_type for n in f.node] == ["Constant", "Mul", "Erf"]
    assert r.model.ir_version >= 10


def test_identical_groups_share_one_function():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("ReduceSum", ["b"], ["s"], keepdims=1),
               N("Mul", ["s", "s"], ["c"]), N("Exp", ["c"], ["y"])], X4, {"y": ("float32", [1, 1, 1, 1])})
    r = check_fusion(m, expect_fused=2)
    assert len(r.model.functions) == 1


def test_program_attribute_round_trips():
    m = unary_pair("Gelu")
    r = optimize_model(m)
    text = onnx.helper.get_attribute_value(r.model.graph.node[0].attribute[0]).decode()
    assert parse(text) == r.fused[0].program


def test_idempotent_and_deterministic():
    m = model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["a"]), N("ReduceMax", ["a"], ["r"], keepdims=1),
               N("Sub", ["a", "r"], ["d"]), N("Exp", ["d"], ["y"])], X4, Y4)
    once = optimize_model(m).model
    again = optimize_model(m).model
    twice = optimize_model(once).model
    assert once.SerializeToString(deterministic=True) == again.SerializeToString(deterministic=True)
    assert twice.SerializeToString(deterministic=True) == once.SerializeToString(deterministic=True)


def test_random_dags_keep_results():
    """Seeded random DAGs of elementwise and a few other ops, several consumers and outputs."""
    rng = np.random.default_rng(1234)
    unary = ["Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Cos", "Sin", "Softplus", "Erf"]
    binary = ["Add", "Sub", "Mul", "Max", "Min"]
    for case in range(25):
        names, nodes = ["x", "z"], []
        for k in range(int(rng.integers(3, 14))):
            out = f"v{k}"
            r = rng.random()
            if r < 0.45:
                nodes.append(N(str(rng.choice(unary)), [str(rng.choice(names))], [out]))
            elif r < 0.9:
                nodes.append(N(str(rng.choice(binary)), [str(rng.choice(names)), str(rng.choice(names))], [out]))
            else:
                nodes.append(N("Transpose", [str(rng.choice(names))], [out], perm=[0, 2, 1]))
            names.append(out)
        outs = {names[-1]} | {str(rng.choice(names[2:])) for _ in range(2)}
        # Transpose keeps the cube shape, so every tensor is [4, 4, 4].
        m = model(nodes, {"x": ("float32", [4, 4, 4]), "z": ("float32", [4, 4, 4])},
                  {o: ("float32", [4, 4, 4]) for o in sorted(outs)})
        check_fusion(m)
        assert case >= 0


def test_outputs_equal_on_a_bigger_input():
    m = model([N("Mul", ["x", "x"], ["t"]), N("Sigmoid", ["t"], ["y"])], X4, Y4)
    r = optimize_model(m)
    feeds = random_feeds(m, {"N": 17})
    np.testing.assert_array_equal(run(m, feeds)[0], run(r.model, feeds)[0])


def _gelu_chain(dtype: str, form: str) -> onnx.ModelProto:
    """bias Add + GELU as exporters write it: erf (x * 0.5 * (1 + erf(x / sqrt 2))) or tanh
    (GPT-2's, with Pow(x, 3))."""
    np_dt = np.float16 if dtype == "float16" else np.float32
    c = {"b": (np.arange(64) / 64 - 0.5).astype(np_dt), "half": np.array(0.5, np_dt), "one": np.array(1.0, np_dt)}
    nodes = [helper.make_node("Add", ["x", "b"], ["h"])]
    if form == "erf":
        c["s2"] = np.array(1.4142135, np_dt)
        nodes += [helper.make_node("Div", ["h", "s2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"])]
    else:
        c.update(three=np.array(3.0, np_dt), k=np.array(0.044715, np_dt), s=np.array(0.7978846, np_dt))
        nodes += [helper.make_node("Pow", ["h", "three"], ["h3"]), helper.make_node("Mul", ["h3", "k"], ["h3k"]),
                  helper.make_node("Add", ["h", "h3k"], ["in"]), helper.make_node("Mul", ["in", "s"], ["z"]),
                  helper.make_node("Tanh", ["z"], ["t"]), helper.make_node("Add", ["t", "one"], ["e1"])]
    nodes += [helper.make_node("Mul", ["h", "e1"], ["m"]), helper.make_node("Mul", ["m", "half"], ["y"])]
    return model(nodes, {"x": (dtype, [8, 64])}, {"y": (dtype, [8, 64])}, c, opset=17)


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_sixteen_bit_chains_take_the_cheaper_forms(form):
    """A chain stored as fp16 divides by a constant as the product by its reciprocal and
    writes pow(x, 3) as products (`relax_16bit`), with the accurate tail forms (erfc, sigmoid:
    the code generators' 16-bit forms, `tests/test_codegen.py`); one stored as fp32 keeps the
    IEEE division and pow. Both match the original on ONNX Runtime's CPU, and the fp16 chain's
    outputs match the exact forms' to one fp16 ulp on every fp16 input in [-8, 8)."""
    from onnxfuse.expr import evaluate, rewrite_tails

    progs = {}
    for dtype in ("float16", "float32"):
        r = check_fusion(_gelu_chain(dtype, form), expect_fused=1, leave_to_ort=False,
                         rtol=1e-2 if dtype == "float16" else None)
        node = next(n for n in r.model.graph.node if n.domain == "onnxfuse")
        progs[dtype] = parse(next(a.s for a in node.attribute if a.name == "program").decode())
    ops16 = {i.op for i in progs["float16"].instrs}
    ops32 = {i.op for i in progs["float32"].instrs}
    if form == "erf":
        assert "erfc" in ops16 and not ops16 & {"erf", "div"}, progs["float16"].to_text()
        assert "erfc" in ops32 and "div" in ops32, progs["float32"].to_text()
    else:
        assert "sigmoid" in ops16 and not ops16 & {"tanh", "pow"}, progs["float16"].to_text()
        assert "sigmoid" in ops32 and "pow" in ops32, progs["float32"].to_text()
    # every fp16 value in [-8, 8) against the exact forms of the same fp16 program
    x = np.arange(-8, 8, 2.0**-10, dtype=np.float32).astype(np.float16).reshape(-1, 64)
    b = (np.arange(64) / 64 - 0.5).astype(np.float16)
    relaxed = progs["float16"]
    # (the exact program: the fp32 graph's with the fp16 graph's constants, reading and storing fp16)
    exact = parse(re.sub(r"-?\d+\.\d+(e-?\d+)?", lambda m: repr(float(np.float16(m.group(0)))),
                         progs["float32"].to_text().replace(" f32\n", " f16\n")))
    assert exact.outputs[0][1] == "f16" and exact.instrs == rewrite_tails(exact).instrs
    relaxed_y = evaluate(relaxed, [x, b])[0].astype(np.float32)
    exact_y = evaluate(exact, [x, b])[0].astype(np.float32)
    diff = np.abs(relaxed_y - exact_y)
    ulp = np.spacing(np.abs(exact_y).astype(np.float16)).astype(np.float32)
    big = np.abs(exact_y) >= 2.0**-10
    # outputs of 1e-3 and up: one fp16 ulp at most, on a few in a thousand
    assert np.all(diff[big] <= ulp[big]) and np.mean(diff[big] > 0) < 0.005
    # smaller ones (GELU's negative tail): the same tail forms, so one fp16 ulp too
    assert np.all(diff[~big] <= ulp[~big])
