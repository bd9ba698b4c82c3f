"""`onnxfuse bisect` on the CPU: a miscompiled fused node is named, --write gives a model that
passes bench, a good model exits 0, a failure outside the fused nodes is said to be; bad input
exits 2 with one line; the search itself on fake predicates; the CUDA path with a fake runner;
and the generic inliner behind unfuse_named."""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import bench as ob
from onnxfuse import bisect as obs
from onnxfuse.cli import main
from onnxfuse.outputs import save_model
from onnxfuse.pipeline import optimize_model
from onnxfuse.rewrite import inline_function_node, unfuse, unfuse_all, unfuse_named
from onnxfuse.tools import gate
from tests.util import model as make_model
from tests.util import one_line_error

ort = pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "models" / "example.onnx"
CPU = ["--provider", "cpu", "--batch", "4"]
GELU = "pointwise_chain_fc1/bias"   # the example's fused nodes, in graph order
NODES = ["layer_norm_ln/mean", GELU, "pointwise_chain_fc2/bias"]  # the LayerNorm is one FusedRows


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bisect") / "example.opt.onnx"
    save_model(optimize_model(onnx.load(str(EXAMPLE)), leave_to_ort=False).model, out)  # 3 fused nodes, GELU too
    return out


def tampered(src: Path, dst: Path, edits: dict[str, tuple[bytes, bytes]]) -> Path:
    """A copy of src where each named fused node's program has one text replaced: the
    library's kernel computes something else, the function body stays right."""
    m = onnx.load(str(src))
    for n in m.graph.node:
        if n.name in edits:
            prog = next(a for a in n.attribute if a.name == "program")
            old, new = edits.pop(n.name)
            assert old in prog.s
            prog.s = prog.s.replace(old, new)
    assert not edits
    onnx.save(m, str(dst))
    return dst


def culprits(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    k = next(i for i, line in enumerate(lines) if "fused nodes to blame" in line)
    return [line.split()[0] for line in lines[k + 1:] if line.startswith("  ")]


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------

def test_names_the_miscompiled_node_and_writes_a_model_that_passes(tmp_path, optimized, capsys):
    bad = tampered(optimized, tmp_path / "bad.onnx", {GELU: (b"mul %5 0.5", b"mul %5 0.6")})
    fixed = tmp_path / "fixed.onnx"
    before = sha(bad), sha(EXAMPLE)
    assert main(["bisect", str(EXAMPLE), str(bad), *CPU, "--write", str(fixed)]) == 1
    out, err = capsys.readouterr()
    assert "fails the gate" in out and "1 of 3 fused nodes to blame" in out
    assert culprits(out) == [GELU]
    line = next(line for line in out.splitlines() if line.startswith(f"  {GELU}"))
    assert "PointwiseChain, pattern pointwise_chain (Add Div Erf Add Mul Mul)" in line and line.endswith("FAIL")
    assert "with those unfused it passes" in out and f"wrote {fixed}" in out
    assert "bisect: run 1: 0 of 3 fused nodes unfused: FAIL" in err
    assert (sha(bad), sha(EXAMPLE)) == before                    # inputs untouched
    m = onnx.load(str(fixed))
    assert [n.name for n in m.graph.node if n.domain == "onnxfuse"] == [n for n in NODES if n != GELU]
    assert ob.count_onnxfuse_nodes(m) == 2 and "Erf" in {n.op_type for n in m.graph.node}
    onnx.checker.check_model(m, full_check=True)
    assert main(["bench", str(EXAMPLE), str(fixed), *CPU, "--warmup", "0", "--iters", "2"]) == 0
    assert main(["bench", str(EXAMPLE), str(bad), *CPU, "--warmup", "0", "--iters", "2"]) == 1
    capsys.readouterr()


def test_two_miscompiled_nodes(tmp_path, optimized):
    bad = tampered(optimized, tmp_path / "bad2.onnx", {GELU: (b"mul %5 0.5", b"mul %5 0.6"),
                                                       NODES[0]: (b"sub %0 %1", b"add %0 %1")})
    r = obs.bisect(str(EXAMPLE), str(bad), ob.BenchSettings(provider="cpu", batch=2), log=sys.stderr)
    assert r.status == "culprits" and [c.node.name for c in r.culprits] == [NODES[0], GELU]
    assert all(not c.passed and c.alone[0].max_abs_err > 1e-2 for c in r.culprits)
    assert r.after[0].passed and r.runs == r.search_runs + 2 and r.search_runs <= 2 + 2 * 3
    assert ob.count_onnxfuse_nodes(r.model) == 1


def test_a_model_that_passes_exits_0(tmp_path, optimized, capsys):
    out_path = tmp_path / "same.onnx"
    assert main(["bisect", str(EXAMPLE), str(optimized), *CPU, "--write", str(out_path)]) == 0
    out, err = capsys.readouterr()
    assert "passes the gate" in out and "nothing to bisect" in out
    assert err.count("bisect: run") == 1
    assert ob.count_onnxfuse_nodes(onnx.load(str(out_path))) == 3


def test_a_failure_outside_the_fused_nodes(tmp_path, optimized, capsys):
    m = onnx.load(str(optimized))
    w = next(t for t in m.graph.initializer if t.name == "fc1.weight")
    a = numpy_helper.to_array(w).copy()
    a.flat[0] += 1.0
    w.CopyFrom(numpy_helper.from_array(a, w.name))
    bad = tmp_path / "bad_weight.onnx"
    onnx.save(m, str(bad))
    fixed = tmp_path / "fixed.onnx"
    assert main(["bisect", str(EXAMPLE), str(bad), *CPU, "--write", str(fixed)]) == 1
    out = capsys.readouterr().out
    assert "the failure is outside the fused nodes: with all 3 fused nodes unfused it still fails" in out
    assert not fixed.exists()
    # a model without fused nodes at all
    plain = tmp_path / "plain.onnx"
    m = onnx.load(str(EXAMPLE))
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(m.graph.initializer[0]) + 1,
                                                            m.graph.initializer[0].name))
    onnx.save(m, str(plain))
    assert main(["bisect", str(EXAMPLE), str(plain), *CPU]) == 1
    assert "it has no fused nodes" in capsys.readouterr().out


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxfuse.cli", "bisect", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def bad_input(*args: str) -> str:
    return one_line_error(cli(*args))


def test_bad_input_exits_2(tmp_path, optimized):
    before = sha(optimized)
    assert "no such file" in bad_input(str(tmp_path / "nope.onnx"), str(optimized))
    assert "no such file" in bad_input(str(EXAMPLE), str(tmp_path / "nope.onnx"))
    junk = tmp_path / "junk.onnx"
    junk.write_text("not a model\n" * 20)
    assert "not a valid ONNX model" in bad_input(str(EXAMPLE), str(junk))
    assert "would overwrite the input" in bad_input(str(EXAMPLE), str(optimized), "--write", str(optimized))
    assert "would overwrite the input" in bad_input(str(EXAMPLE), str(optimized), "--write", str(EXAMPLE))
    assert sha(optimized) == before
    assert "no input or dimension named 'z'" in bad_input(str(EXAMPLE), str(optimized), "--shape", "z=3")
    assert "--rtol must be 0 or more" in bad_input(str(EXAMPLE), str(optimized), "--rtol", "-1")
    other = tmp_path / "other.onnx"
    onnx.save(make_model([helper.make_node("Relu", ["z"], ["y"])], {"z": ("float32", [3])},
                         {"y": ("float32", [3])}), str(other))
    assert "has input 'z'" in bad_input(str(EXAMPLE), str(other))
    # a fused node whose function is gone cannot be put back
    m = onnx.load(str(optimized))
    del m.functions[0]
    headless = tmp_path / "headless.onnx"
    headless.write_bytes(m.SerializeToString())
    assert "has no function body" in bad_input(str(EXAMPLE), str(headless))
    assert not list(tmp_path.glob(".*.tmp"))


# ---------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------

def counting(predicate):
    seen: list[frozenset] = []

    def passes(s: frozenset) -> bool:
        seen.append(s)
        return predicate(s)

    return passes, seen


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_find_culprits_finds_exactly_the_culprits(n):
    names = [f"n{i}" for i in range(n)]
    for k in range(1, min(n, 3) + 1):
        for bad in itertools.combinations(names, k):
            passes, seen = counting(lambda s, bad=bad: set(bad) <= s)
            assert obs.find_culprits(names, passes) == list(bad)
            # each culprit: a binary search over what is left, then one check
            assert len(seen) <= k * (int(np.ceil(np.log2(n))) + 1), (bad, len(seen))


def test_find_culprits_returns_a_passing_set_when_errors_interact():
    rng = random.Random(0)
    names = [f"n{i}" for i in range(12)]
    for _ in range(200):
        table: dict[frozenset, bool] = {}

        def passes(s: frozenset, table=table) -> bool:  # anything, but none unfused fails, all passes
            if s not in table:
                table[s] = len(s) == len(names) or (bool(s) and rng.random() < 0.3)
            return table[s]

        found = obs.find_culprits(names, passes)
        assert len(set(found)) == len(found) and passes(frozenset(found))


# ---------------------------------------------------------------------------------------
# The CUDA path, with a fake runner (there is no GPU here)
# ---------------------------------------------------------------------------------------

REAL_EVALUATE = ob.evaluate_model


@pytest.fixture
def fake_cuda(monkeypatch):
    """ORT's CUDA EP stood in for by the CPU, plus an error like TF32's (1e-3 x max|y| x
    sin(i)) in every run that allows TF32; records (model, tf32) per run."""
    calls: list[tuple[str, bool]] = []

    def evaluate(model, feeds, settings, library):
        assert settings.provider == "cuda" and not settings.cuda_graph
        calls.append((Path(model).stem if isinstance(model, str) else "candidate", settings.tf32))
        outs = REAL_EVALUATE(model, feeds, replace(settings, provider="cpu"), library)
        if settings.tf32:
            outs = {n: (a + 1e-3 * np.abs(a).max() * np.sin(np.arange(a.size)).reshape(a.shape)).astype(a.dtype)
                    for n, a in outs.items()}
        return outs

    monkeypatch.setattr(gate, "evaluate_model", evaluate)    # the reference and baseline runs
    monkeypatch.setattr(obs, "evaluate_model", evaluate)     # the candidates' runs
    monkeypatch.setattr(obs, "require_cuda", lambda: None)
    return calls


@pytest.mark.parametrize("reference", ["float64", "fp32"])
def test_cuda_gates_candidates_against_the_reference(tmp_path, optimized, fake_cuda, capsys, reference):
    # Under TF32 the optimized model is as far from the reference as the original: it passes
    # (a plain isclose would fail it). float64: the original evaluated in float64 (no GPU
    # run); fp32: the original run with TF32 off.
    flags = ["--provider", "cuda", "--batch", "2", "--reference", reference]
    assert main(["bisect", str(EXAMPLE), str(optimized), *flags]) == 0
    out = capsys.readouterr().out
    assert "passes the gate" in out and ("TF32 off" if reference == "fp32" else "evaluated in float64") in out
    assert float(re.search(r"ORT's own ([0-9.e+-]+)\)", out).group(1)) > 1e-4
    first = [("example", False)] if reference == "fp32" else []
    assert fake_cuda == [*first, ("example", True), ("candidate", True)]
    bad = tampered(optimized, tmp_path / "bad.onnx", {GELU: (b"mul %5 0.5", b"mul %5 0.6")})
    fake_cuda.clear()
    assert main(["bisect", str(EXAMPLE), str(bad), *flags]) == 1
    assert culprits(capsys.readouterr().out) == [GELU]
    assert fake_cuda[:len(first) + 1] == [*first, ("example", True)]
    assert all(tf32 for _, tf32 in fake_cuda[len(first):]) and len(fake_cuda) > 3 + len(first)


@pytest.mark.parametrize("reference", ["float64", "fp32"])
def test_cuda_no_tf32(optimized, fake_cuda, capsys, reference):
    assert main(["bisect", str(EXAMPLE), str(optimized), "--provider", "cuda", "--no-tf32",
                 "--reference", reference]) == 0
    assert fake_cuda == [("example", False), ("candidate", False)]
    out = capsys.readouterr().out
    assert ("TF32 off (--no-tf32)" if reference == "fp32" else "evaluated in float64") in out


# ---------------------------------------------------------------------------------------
# The inliner
# ---------------------------------------------------------------------------------------

def test_inline_function_node_binds_inputs_outputs_and_attributes():
    # f(a, lo?) -> (y, z): y = LeakyRelu(Clip(a, lo), alpha=@alpha), z = Neg(a); the caller
    # omits lo (Clip's optional min stays absent) and does not read z
    leaky = helper.make_node("LeakyRelu", ["c"], ["y"])
    leaky.attribute.append(onnx.AttributeProto(name="alpha", ref_attr_name="alpha", type=onnx.AttributeProto.FLOAT))
    body = [helper.make_node("Clip", ["a", "lo"], ["c"]), leaky, helper.make_node("Neg", ["a"], ["z"])]
    f = helper.make_function("custom", "F", ["a", "lo"], ["y", "z"], body, [helper.make_opsetid("", 17)], ["alpha"])
    node = helper.make_node("F", ["x"], ["out", ""], name="call", domain="custom", alpha=0.5)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)],
                          functions=[f])
    x = np.array([-2.0, -1.0, 0.0, 3.0], np.float32)
    want = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    body = inline_function_node(m, "call")
    assert [n.op_type for n in body] == ["Clip", "LeakyRelu", "Neg"]
    assert list(body[0].input) == ["x", ""] and list(body[1].output) == ["out"]
    assert body[2].output[0] == "call/z" and body[1].input[0] == "call/c"
    assert [n.name for n in body] == ["call/clip", "call/leakyrelu", "call/neg"]
    assert helper.get_attribute_value(body[1].attribute[0]) == 0.5
    del m.functions[:]
    got = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.where(x > 0, x, 0.5 * x))


def test_unfuse_named_from_the_saved_model_matches_unfuse(tmp_path):
    from models import build as mb

    r = optimize_model(mb.conv_relu_maxpool(8, 16))
    path = tmp_path / "conv.onnx"
    save_model(r.model, path)
    saved = onnx.load(str(path))
    (f,) = r.fused
    unfuse(r.model, f)
    unfuse_named(saved, [(f.node_name, ())])
    assert [n.op_type for n in saved.graph.node] == [n.op_type for n in r.model.graph.node]
    assert "Transpose" not in {n.op_type for n in saved.graph.node}          # ONNX weights again
    assert saved.graph.initializer == r.model.graph.initializer
    assert not saved.functions and all(i.domain != "onnxfuse" for i in saved.opset_import)
    with pytest.raises(ob.OnnxfuseError, match="no nodes named"):
        unfuse_named(saved, [(f.node_name, ())])


def test_unfuse_all_at_once_matches_one_at_a_time():
    """unfuse_all (tuning's losers, one import and export of the graph) gives the model that
    unfusing the same nodes one by one gives, and names the nodes each became; a function
    two fused nodes share goes only with the last of them."""
    from onnx import TensorProto, numpy_helper

    nodes, prev = [], "x"
    for i in range(3):  # Mul + Relu, three times, square Transposes between (not fused)
        nodes += [helper.make_node("Mul", [prev, "two"], [f"a{i}"], name=f"mul{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"b{i}"], name=f"relu{i}")]
        prev = f"b{i}"
        if i < 2:
            nodes.append(helper.make_node("Transpose", [prev], [f"t{i}"], name=f"t{i}", perm=[1, 0]))
            prev = f"t{i}"
    nodes[-1].output[0] = "y"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])],
                          [numpy_helper.from_array(np.float32(2.0), "two")])
    r = optimize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert len(r.fused) == 3 and len(r.model.functions) == 1  # one kernel for the three chains
    one, many = onnx.ModelProto(), onnx.ModelProto()
    one.CopyFrom(r.model)
    many.CopyFrom(r.model)
    picked = r.fused[:2]
    for f in picked:
        unfuse(one, f)
    bodies = unfuse_all(many, picked)
    assert many == one and len(many.functions) == 1  # the third node still calls it
    assert list(bodies) == [f.node_name for f in picked]
    names = {n.name for n in many.graph.node}
    for f in picked:
        assert {"Mul", "Relu"} <= {n.op_type for n in many.graph.node if n.name in bodies[f.node_name]}
        assert f.node_name not in names
    assert unfuse_all(many, []) == {} and many == one
    unfuse_all(many, r.fused[2:])
    assert not many.functions and all(i.domain != "onnxfuse" for i in many.opset_import)
    x = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    want = ort.InferenceSession(r.original.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort.InferenceSession(many.SerializeToString()).run(None, {"x": x})[0], want, rtol=1e-6)
