"""Graph features real models have: If/Loop/Scan subgraphs, model-local functions, several
opset imports, external data, unused initializers, overridable initializers, odd names,
partly unknown shapes. None may crash the optimizer; each either fuses correctly (the
optimized model passes the full ONNX check and gives the original's results with stock ONNX
Runtime and with the library's CPU kernel) or is reported as not fused with a reason.

Subgraphs (If/Loop/Scan bodies) and the model's own functions are left as they are and
counted under their own reason in Report.not_fused; tensors they read from the main graph
stay available (a fused group exposes them as extra outputs).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxfuse
from onnxfuse import optimize_model, pipeline
from onnxfuse.codegen import KernelSpec, generate
from onnxfuse.kinds.pointwise import choose_variants
from onnxfuse.pipeline import FUNCTION_REASON, SUBGRAPH_REASON
from onnxfuse.rewrite import DOMAIN
from tests.util import model, op_types, random_feeds

N = helper.make_node
F = TensorProto.FLOAT


def session(m: onnx.ModelProto, library: bool):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        return onnxfuse.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"], sess_options=so)
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def check(m: onnx.ModelProto, feeds: dict | None = None, fused: int | None = None,
          run_original: bool = True) -> onnxfuse.Result:
    """Optimize (input untouched), full check, and compare original vs optimized both ways."""
    before = m.SerializeToString()
    r = optimize_model(m)
    assert m.SerializeToString() == before
    onnx.checker.check_model(r.model, full_check=True)
    if fused is not None:
        assert len(r.fused) == fused, r.report.summary()
    assert r.report.nodes_after == len(r.model.graph.node)
    if run_original:
        feeds = random_feeds(m) if feeds is None else feeds
        expected = session(m, False).run(None, feeds)
        for library in (False, True):
            got = session(r.model, library).run(None, feeds)
            for o, e, a in zip(m.graph.output, expected, got, strict=True):
                assert e.shape == a.shape and e.dtype == a.dtype, o.name
                np.testing.assert_allclose(a, e, rtol=1e-5 if library else 1e-6, atol=1e-6, err_msg=o.name)
    return r


def vi(name: str, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def make(nodes, inputs, outputs, inits=None, opsets=(("", 17),), functions=()) -> onnx.ModelProto:
    """A model with several opset imports and functions (tests.util.model has one opset)."""
    g = helper.make_graph(nodes, "g", inputs, outputs,
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], functions=list(functions))
    m.ir_version = 10
    return m


# ---------------------------------------------------------------------------------------
# subgraphs
# ---------------------------------------------------------------------------------------

def test_if_branches_are_left_alone_and_reported():
    """Each branch reads `t`, an intermediate of a fusible chain: the fused node exposes it."""
    then_g = helper.make_graph([N("Mul", ["t", "t"], ["a"]), N("Exp", ["a"], ["o"])], "then", [], [vi("o", [4, 3])])
    else_g = helper.make_graph([N("Neg", ["t"], ["n"]), N("Relu", ["n"], ["o2"]), N("Sin", ["o2"], ["o3"])],
                               "else", [], [vi("o3", [4, 3])])
    m = model([N("Mul", ["x", "x"], ["t"]), N("Sigmoid", ["t"], ["s"]), N("Add", ["s", "x"], ["u"]),
               N("ReduceSum", ["u"], ["r"], keepdims=0), N("Greater", ["r", "six"], ["c"]),
               N("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g), N("Tanh", ["u"], ["z"])],
              {"x": ("float32", [4, 3])}, {"y": ("float32", [4, 3]), "z": ("float32", [4, 3])},
              {"six": np.array(7.0, np.float32)})
    for scale in (0.1, 3.0):  # both branches
        r = check(m, {"x": (np.linspace(-1, 1, 12, dtype=np.float32) * scale).reshape(4, 3)}, fused=1)
    assert set(r.fused[0].outputs) == {"t", "u", "z"}
    assert r.report.not_fused[SUBGRAPH_REASON] == 5
    assert "If" in op_types(r.model)


def test_loop_body_reads_a_fused_intermediate():
    body = helper.make_graph(
        [N("Mul", ["acc_in", "w"], ["m"]), N("Tanh", ["m"], ["acc_out"]), N("Identity", ["cond_in"], ["cond_out"])],
        "body", [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL), vi("acc_in", [2, 5])],
        [vi("cond_out", [], TensorProto.BOOL), vi("acc_out", [2, 5])])
    m = model([N("Mul", ["x", "x"], ["w"]), N("Sigmoid", ["w"], ["s"]), N("Add", ["s", "x"], ["a0"]),
               N("Loop", ["trips", "", "a0"], ["acc"], body=body), N("Exp", ["acc"], ["e"]), N("Neg", ["e"], ["y"])],
              {"x": ("float32", [2, 5])}, {"y": ("float32", [2, 5])}, {"trips": np.array(3, np.int64)})
    r = check(m, fused=1)
    assert "w" in r.fused[0].outputs  # read inside the loop body
    assert r.report.not_fused[SUBGRAPH_REASON] == 2
    # onnx infers no shape for the Loop's output: Exp and Neg after it stay, with the reason
    assert r.report.not_fused["unknown shape"] == 1


def test_scan_body_and_nested_if():
    inner_then = helper.make_graph([N("Abs", ["xs"], ["o"])], "t", [], [vi("o", [3])])
    inner_else = helper.make_graph([N("Neg", ["bias"], ["o2"])], "e", [], [vi("o2", [3])])
    body = helper.make_graph(
        [N("Add", ["st_in", "xs"], ["s1"]), N("Relu", ["s1"], ["st_out"]),
         N("ReduceSum", ["s1"], ["rs"], keepdims=0), N("Greater", ["rs", "zero"], ["c"]),
         N("If", ["c"], ["out"], then_branch=inner_then, else_branch=inner_else)],
        "body", [vi("st_in", [3]), vi("xs", [3])], [vi("st_out", [3]), vi("out", [3])],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    m = model([N("Mul", ["x", "x"], ["q"]), N("Sub", ["q", "bias"], ["seq"]), N("Cos", ["x0"], ["c0"]),
               N("Mul", ["c0", "x0"], ["init"]),
               N("Scan", ["init", "seq"], ["final", "outs"], body=body, num_scan_inputs=1),
               N("Sigmoid", ["outs"], ["so"]), N("Mul", ["so", "outs"], ["y"])],
              {"x": ("float32", [4, 3]), "x0": ("float32", [3])}, {"y": ("float32", [4, 3]),
                                                                    "final": ("float32", [3])},
              {"bias": np.array([0.5, -1.0, 2.0], np.float32)})
    r = check(m, fused=3)
    assert "bias" in {t.name for t in r.model.graph.initializer}  # read by the nested If
    # Add, Relu and the ReduceSum of the body (a ReduceSum may start a LayerNorm's moments or
    # a written-out softmax), Abs and Neg of the nested If
    assert r.report.not_fused[SUBGRAPH_REASON] == 5


# ---------------------------------------------------------------------------------------
# functions and opset imports
# ---------------------------------------------------------------------------------------

def _swish_function() -> onnx.FunctionProto:
    return helper.make_function("local", "Swish", ["X"], ["Y"],
                                [N("Sigmoid", ["X"], ["S"]), N("Mul", ["X", "S"], ["Y"])],
                                [helper.make_opsetid("", 17)])


def test_model_local_functions_are_kept_and_reported():
    m = make([N("Mul", ["x", "two"], ["a"]), N("Exp", ["a"], ["b"]), N("Swish", ["b"], ["c"], domain="local"),
              N("Add", ["c", "x"], ["d"]), N("Tanh", ["d"], ["y"])], [vi("x", [3, 4])], [vi("y", [3, 4])],
             {"two": np.array(0.5, np.float32)}, opsets=(("", 17), ("local", 1)), functions=[_swish_function()])
    onnx.checker.check_model(m, full_check=True)
    r = check(m, fused=2)
    assert op_types(r.model) == ["PointwiseChain", "Swish", "PointwiseChain"]
    assert [(f.domain, f.name) for f in r.model.functions if f.domain != DOMAIN] == [("local", "Swish")]
    assert r.report.not_fused[FUNCTION_REASON] == 2


def test_optimizing_an_optimized_model_with_new_identical_groups():
    """A model that already has onnxfuse functions gets a new group identical to one of them:
    it reuses the function (no duplicate function, which the checker rejects)."""
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["y"])], {"x": ("float32", [3])},
              {"y": ("float32", [3])})
    once = optimize_model(m).model
    once.graph.node.extend([N("Mul", ["x2", "x2"], ["a2"]), N("Exp", ["a2"], ["y2"])])
    once.graph.input.append(vi("x2", [3]))
    once.graph.output.append(vi("y2", [3]))
    onnx.checker.check_model(once, full_check=True)
    r = check(once, fused=1)
    assert len(r.model.functions) == 1
    assert op_types(r.model) == ["PointwiseChain", "PointwiseChain"]


def test_several_opset_imports_and_a_contrib_op():
    m = make([N("Mul", ["x", "x"], ["a"]), N("Add", ["a", "x"], ["b"]), N("Gelu", ["b"], ["g"], domain="com.microsoft"),
              N("Neg", ["g"], ["n"]), N("Exp", ["n"], ["y"])], [vi("x", [2, 8])], [vi("y", [2, 8])],
             opsets=(("", 17), ("com.microsoft", 1), ("ai.onnx.ml", 3)))
    r = check(m, fused=2)
    # onnx's shape inference does not know ONNX Runtime's contrib ops; ONNX Runtime's symbolic
    # shape inference (onnxfuse.load._fill_symbolic_dims) does: what follows is typed and fuses
    assert op_types(r.model) == ["PointwiseChain", "Gelu", "PointwiseChain"]
    assert {(i.domain, i.version) for i in r.model.opset_import} == {("", 17), ("com.microsoft", 1), ("ai.onnx.ml", 3),
                                                                     (DOMAIN, 1)}


def test_unknown_custom_domain_node_is_left_alone():
    """A node of a domain nothing here implements: the model cannot run, but it optimizes."""
    m = make([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("Frob", ["b"], ["c"], domain="acme.ops"),
              N("Neg", ["b"], ["n"]), N("Relu", ["n"], ["y"])], [vi("x", [3])], [vi("y", [3]), vi("c", [3])],
             opsets=(("", 17), ("acme.ops", 4)))
    r = check(m, fused=1, run_original=False)
    assert op_types(r.model) == ["PointwiseChain", "Frob"]
    assert r.fused[0].outputs == ("b", "y")


# ---------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------

def test_external_data_in_a_subfolder(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.2
    m = model([N("Mul", ["x", "scale"], ["a"]), N("Relu", ["a"], ["b"]), N("Conv", ["b", "w"], ["c"], pads=[1] * 4),
               N("Add", ["c", "bias"], ["d"]), N("Sigmoid", ["d"], ["y"])],
              {"x": ("float32", [1, 4, 6, 6])}, {"y": ("float32", [1, 4, 6, 6])},
              {"scale": np.array(1.5, np.float32), "w": w, "bias": rng.standard_normal((4, 1, 1)).astype(np.float32)})
    src_dir, out_dir = tmp_path / "src", tmp_path / "out"
    (src_dir / "weights").mkdir(parents=True)
    out_dir.mkdir()
    ext = onnx.ModelProto()
    ext.CopyFrom(m)
    onnx.save_model(ext, str(src_dir / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights/m.bin", size_threshold=0)
    assert (src_dir / "weights" / "m.bin").exists()
    report = pipeline.optimize(src_dir / "m.onnx", out_dir / "o.onnx", target="none")
    assert report.patterns_applied == {"pointwise_chain": 1, "conv_relu": 1}  # Mul+Relu; Conv+Add+Sigmoid
    assert sorted(p.name for p in out_dir.iterdir()) == ["o.onnx"]  # self-contained under 2 GB
    o = onnx.load(str(out_dir / "o.onnx"))
    onnx.checker.check_model(o, full_check=True)
    feeds = random_feeds(m)
    for library in (False, True):
        np.testing.assert_allclose(session(o, library).run(None, feeds)[0], session(m, False).run(None, feeds)[0],
                                   rtol=1e-5, atol=1e-6)


def test_unused_initializers_and_inputs_are_kept():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["y"])],
              {"x": ("float32", [3]), "unused_in": ("float32", [2])}, {"y": ("float32", [3])},
              {"unused_w": np.ones((5, 5), np.float32), "unused_s": np.array(2.0, np.float32)})
    r = check(m, {"x": np.ones(3, np.float32), "unused_in": np.zeros(2, np.float32)}, fused=1)
    assert {t.name for t in r.model.graph.initializer} == {"unused_w", "unused_s"}
    assert [i.name for i in r.model.graph.input] == ["x", "unused_in"]


def test_initializer_that_is_also_an_input_stays_overridable():
    """IR >= 4: an initializer listed as a graph input is a default the caller may override.
    Regression: it was folded into the program as a literal and the input dropped."""
    g = helper.make_graph([N("Mul", ["x", "scale"], ["t"]), N("Exp", ["t"], ["y"])], "g",
                          [vi("x", [3]), vi("scale", [])], [vi("y", [3])],
                          [numpy_helper.from_array(np.array(0.5, np.float32), "scale")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    x = np.array([1.0, -2.0, 0.5], np.float32)
    r = check(m, {"x": x, "scale": np.array(2.0, np.float32)}, fused=1)
    assert [i.name for i in r.model.graph.input] == ["x", "scale"]
    check(m, {"x": x})  # the default


# ---------------------------------------------------------------------------------------
# names
# ---------------------------------------------------------------------------------------

ODD = ["a b", "a/b:0", "ünï/çødé", "x0", "t0", "y0", "c0", "n0", "%1", "line\nbreak", "'\"\\", "pointwise_chain_x0"]


def test_odd_tensor_and_node_names():
    """Spaces, slashes, unicode, quotes, newlines, our own function-body names (x0, t0, y0,
    c0, n0), a node already named like a fused node, empty node names."""
    nodes = [N("Mul", ["x0", "c0"], ["t0"], name="x0"), N("Sigmoid", ["t0"], ["y0"], name="pointwise_chain_x0"),
             N("Add", ["y0", "x0"], ["a b"], name="line\nbreak"), N("Exp", ["a b"], ["a/b:0"], name="'\"\\"),
             N("ReduceMax", ["a/b:0"], ["%1"], keepdims=1, name="same"),
             N("Sub", ["a/b:0", "%1"], ["n0"], name="same "),
             N("Neg", ["n0"], ["ünï/çødé"], name=""), N("Relu", ["ünï/çødé"], ["line\nbreak"], name="")]
    nodes.append(N("Identity", ["a b"], ["'\"\\"]))
    m = make(nodes, [vi("x0", [2, 3])], [vi("line\nbreak", [2, 3]), vi("t0", [2, 3]), vi("'\"\\", [2, 3])],
             {"c0": np.array(2.0, np.float32)})
    onnx.checker.check_model(m, full_check=True)
    r = check(m, fused=2)
    names = [n.name for n in r.model.graph.node]
    assert len(set(n for n in names if n)) == len([n for n in names if n])  # fused names are unique
    for f in r.fused:  # the Triton source for these names is valid Python (no GPU needed)
        for v in choose_variants(KernelSpec(f.program, f.kernel_name, f.rank, f.input_modes, f.source_nodes)):
            src = generate(f.program, f.kernel_name, f.rank, f.input_modes, list(f.source_nodes), v).source
            compile(src, "kernel.py", "exec")


# ---------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 5])
def test_symbolic_dims(n):
    m = model([N("Mul", ["x", "b"], ["a"]), N("Tanh", ["a"], ["t"]), N("Add", ["t", "x"], ["y"])],
              {"x": ("float32", ["batch", "seq", 8]), "b": ("float32", ["seq", 1])},
              {"y": ("float32", ["batch", "seq", 8])})
    r = check(m, {"x": np.ones((n, 3, 8), np.float32), "b": np.linspace(0, 1, 3, dtype=np.float32).reshape(3, 1)},
              fused=1)
    assert r.fused[0].input_modes == ("full", "strided")


def test_missing_dims_fuse():
    """Dims with neither a size nor a name: each graph input's gets its own name for the
    analysis, so tensors computed from the same input are known to have equal shapes."""
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["b"]), N("Neg", ["b"], ["y"])],
              {"x": ("float32", [None, 3])}, {"y": ("float32", [None, 3]), "b": ("float32", [None, 3])})
    r = check(m, {"x": np.ones((4, 3), np.float32)}, fused=1)
    assert set(r.fused[0].outputs) == {"b", "y"} and r.fused[0].input_modes == ("full",)
    assert all("onnxfuse_unknown" not in str(v) for v in r.model.graph.value_info)


def test_different_missing_dims_are_not_assumed_equal():
    m = model([N("Add", ["x", "z"], ["a"]), N("Exp", ["a"], ["y"])],
              {"x": ("float32", [None, 3]), "z": ("float32", [None, 3])}, {"y": ("float32", [None, 3])})
    r = check(m, {"x": np.ones((4, 3), np.float32), "z": np.ones((1, 3), np.float32)}, fused=1)
    assert r.fused[0].input_modes == ("strided", "strided")
    check(m, {"x": np.ones((1, 3), np.float32), "z": np.full((4, 3), 2, np.float32)})


def test_unknown_rank_is_reported():
    """A Reshape to a shape given at run time: the rank of what follows is unknown; those
    nodes are not fused, with the reason."""
    m = make([N("Reshape", ["x", "s"], ["r"]), N("Mul", ["r", "r"], ["a"]), N("Exp", ["a"], ["b"]),
              N("Neg", ["b"], ["y"])],
             [vi("x", [2, 3]), vi("s", [None], TensorProto.INT64)], [vi("y", [None, None])])
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) / 6, "s": np.array([3, 2], np.int64)}
    r = check(m, feeds)
    assert r.report.not_fused["unknown shape"] == 2, r.report.summary()


def test_graph_input_that_is_also_an_output_and_an_empty_graph():
    m = model([N("Mul", ["x", "x"], ["a"]), N("Exp", ["a"], ["y"])], {"x": ("float32", [3])},
              {"y": ("float32", [3]), "x": ("float32", [3])})
    check(m, fused=1)
    empty = model([], {"x": ("float32", [3])}, {"x": ("float32", [3])})
    r = check(empty, fused=0)
    assert r.report.summary().splitlines()[1] == "nothing fused"
