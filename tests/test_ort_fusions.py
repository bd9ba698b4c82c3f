"""onnxfuse.ort_fusions: nodes that ONNX Runtime's own fusions take (BiasGelu, Gelu,
LayerNormalization, SkipLayerNormalization, FusedMatMul, MatMul + Add into Gemm) are left to
it, with the reason in the report, while unrelated pointwise chains in the same model still
fuse; `leave_to_ort=False` / `--no-leave-to-ort` fuses them anyway."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.ort_fusions import absorbed_nodes, as_float32, ort_fusions, reason
from onnxfuse.pipeline import BIAS_AFTER
from tests.util import check_fusion, model, random_feeds, run

pytest.importorskip("onnxruntime")

N = helper.make_node
D = 16  # model width
rng = np.random.default_rng(0)


def f32(*shape):
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def scalar(v):
    return np.array(v, np.float32)


def bias_gelu_nodes(x: str, out: str, p: str) -> tuple[list, dict]:
    """torch's nn.Linear + erf-GELU as torch.onnx.export writes them: MatMul, Add bias,
    Div sqrt(2), Erf, Add 1, Mul x, Mul 0.5."""
    nodes = [N("MatMul", [x, f"{p}W"], [f"{p}mm"]), N("Add", [f"{p}mm", f"{p}b"], [f"{p}h"]),
             N("Div", [f"{p}h", "sqrt2"], [f"{p}d"]), N("Erf", [f"{p}d"], [f"{p}e"]),
             N("Add", [f"{p}e", "one"], [f"{p}e1"]), N("Mul", [f"{p}h", f"{p}e1"], [f"{p}m"]),
             N("Mul", [f"{p}m", "half"], [out])]
    return nodes, {f"{p}W": f32(D, D), f"{p}b": f32(D)}


def layernorm_nodes(x: str, out: str, p: str) -> tuple[list, dict]:
    """A LayerNorm written out (opset 17, axes as attributes): ReduceMean, Sub, Pow,
    ReduceMean, Add eps, Sqrt, Div, Mul gamma, Add beta."""
    nodes = [N("ReduceMean", [x], [f"{p}mu"], axes=[-1]), N("Sub", [x, f"{p}mu"], [f"{p}c"]),
             N("Pow", [f"{p}c", "two"], [f"{p}sq"]), N("ReduceMean", [f"{p}sq"], [f"{p}var"], axes=[-1]),
             N("Add", [f"{p}var", "eps"], [f"{p}ve"]), N("Sqrt", [f"{p}ve"], [f"{p}sd"]),
             N("Div", [f"{p}c", f"{p}sd"], [f"{p}n"]), N("Mul", [f"{p}n", f"{p}g"], [f"{p}s"]),
             N("Add", [f"{p}s", f"{p}be"], [out])]
    return nodes, {f"{p}g": 1 + f32(D), f"{p}be": f32(D)}


CONSTS = {"sqrt2": scalar(np.sqrt(2.0)), "one": scalar(1.0), "half": scalar(0.5), "two": scalar(2.0),
          "eps": scalar(1e-5), "three": scalar(3.0)}
UNRELATED = [N("Tanh", ["z"], ["t1"]), N("Mul", ["t1", "three"], ["t2"]), N("Add", ["t2", "z"], ["u"])]


def encoder_block(batch="B", seq=8) -> onnx.ModelProto:
    """x -> Linear + erf-GELU -> decomposed LayerNorm; residual Add + LayerNormalization
    (the SkipLayerNormalization pattern); and an unrelated chain Tanh -> Mul -> Add on z."""
    gelu, w1 = bias_gelu_nodes("x", "g", "l1_")
    ln, w2 = layernorm_nodes("g", "n", "ln_")
    skip = [N("Add", ["n", "x"], ["r"]), N("LayerNormalization", ["r", "g2", "b2"], ["y"], axis=-1, epsilon=1e-5)]
    shape = [batch, seq, D]
    return model(gelu + ln + skip + UNRELATED,
                 {"x": ("float32", shape), "z": ("float32", shape)},
                 {"y": ("float32", shape), "u": ("float32", shape)},
                 {**CONSTS, **w1, **w2, "g2": 1 + f32(D), "b2": f32(D)}, opset=17)


def replaced_ops(result) -> list[list[str]]:
    return [[op.split(" ")[0] for op in rec.replaces] for rec in result.report.fused]


def test_ort_fusions_of_an_encoder_block_are_left_to_ort():
    m = encoder_block()
    r = check_fusion(m, expect_fused=1)
    # before ort_fusions, Add bias + the erf-GELU and the LayerNorm's Sub/Add eps/Div... were pointwise chains
    assert replaced_ops(r) == [["Tanh", "Mul", "Add"]]
    nf = r.report.not_fused
    assert nf[reason("BiasGelu")] == 6  # Add bias, Div, Erf, Add, Mul, Mul
    assert nf[reason("LayerNormalization")] == 7  # Sub, Pow, Add, Sqrt, Div, Mul, Add
    assert nf[reason("SkipLayerNormalization")] == 1  # the residual Add
    assert "left to ONNX Runtime's BiasGelu fusion" in r.report.summary()


def test_ort_fusions_map_back_to_the_nodes():
    m = encoder_block()
    found = ort_fusions(m)
    assert found.problem is None
    by_op = {}
    for i, why in found.absorbed.items():
        by_op.setdefault(why, []).append(m.graph.node[i].op_type)
    assert sorted(by_op[reason("BiasGelu")]) == sorted(["Add", "Div", "Erf", "Add", "Mul", "Mul"])
    assert sorted(by_op[reason("LayerNormalization")]) == sorted(
        ["ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Add"])
    assert sorted(by_op[reason("SkipLayerNormalization")]) == ["Add", "LayerNormalization"]
    assert not any(m.graph.node[i].op_type in ("Tanh", "MatMul") for i in found.absorbed)
    assert ort_fusions(m).absorbed == found.absorbed  # deterministic


def test_leave_to_ort_off_fuses_them_anyway():
    m = encoder_block()
    r = check_fusion(m, leave_to_ort=False)
    ops = replaced_ops(r)
    # the bias + erf-GELU is the LayerNorm's prologue (kind rows), the norm and the residual Add after
    # it one node with it
    assert ["Add", "Div", "Erf", "Add", "Mul", "Mul", "ReduceMean"] == ops[0][:7] and ["Tanh", "Mul", "Add"] in ops
    assert not any(k.startswith("left to ONNX Runtime") for k in r.report.not_fused)


def test_static_shapes_move_the_bias_into_bias_gelu():
    # with every dim known ORT would turn MatMul + Add (3-D, through Reshapes) into a Gemm with
    # the bias (a broadcast kernel first) and the erf-GELU into Gelu; written as Reshape, Gemm
    # without a bias, Reshape, Add (`onnxfuse.pack.bias_after_product`), ORT's BiasGelu fusion
    # takes the Add and the GELU, and the model computes the same
    m = encoder_block(batch=2)
    r = check_fusion(m, expect_fused=1)
    nf = r.report.not_fused
    assert reason("MatMul + Add into Gemm") not in nf and nf[reason("BiasGelu")] == 6
    assert r.report.notes[BIAS_AFTER] == 1
    (gemm,) = [n for n in r.model.graph.node if n.op_type == "Gemm"]
    assert len(gemm.input) == 2


def test_float16_is_probed_as_float32():
    gelu, w = bias_gelu_nodes("x", "y", "")
    m = model(gelu, {"x": ("float16", ["B", 8, D])}, {"y": ("float16", ["B", 8, D])},
              {k: v.astype(np.float16) for k, v in {**CONSTS, **w}.items()}, opset=17)
    probe = as_float32(m)
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in probe.graph.initializer)
    assert probe.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16  # input untouched
    r = optimize_model(m)
    assert r.report.patterns_applied == {}
    assert r.report.not_fused[reason("BiasGelu")] == 6


def test_silu_is_not_reserved():
    # ORT makes QuickGelu of x * Sigmoid(x); a pointwise chain fuses it with its neighbours
    m = model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["t"]), N("Mul", ["t", "three"], ["y"])],
              {"x": ("float32", ["B", D])}, {"y": ("float32", ["B", D])}, {"three": scalar(3.0)}, opset=17)
    check_fusion(m, expect_fused=1)


def test_a_model_ort_cannot_load_reserves_nothing_and_does_not_warn():
    vi = helper.make_tensor_value_info
    g = helper.make_graph(UNRELATED + [N("Foo", ["z"], ["w"], domain="com.example")], "g",
                          [vi("z", onnx.TensorProto.FLOAT, ["B", D])],
                          [vi("u", onnx.TensorProto.FLOAT, ["B", D]), vi("w", onnx.TensorProto.FLOAT, ["B", D])],
                          [onnx.numpy_helper.from_array(CONSTS["three"], "three")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 7)])
    found = ort_fusions(m)
    assert found.absorbed == {} and found.problem and not found.missing_ort
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = optimize_model(m)
    assert r.report.patterns_applied == {"pointwise_chain": 1} and not r.report.warnings


def test_absorbed_nodes_follow_tensor_names():
    # original: a -> Add -> Div -> Erf -> y ; c -> Neg -> z. "optimized": one fused node
    # makes y from a; Neg kept; the Div output gone.
    g = helper.make_graph([N("Add", ["a", "b"], ["s"]), N("Div", ["s", "k"], ["d"]), N("Erf", ["d"], ["y"]),
                           N("Neg", ["c"], ["z"])], "g", [], [])
    opt = helper.make_graph([N("BiasGelu", ["a", "b"], ["y"], domain="com.microsoft"), N("Neg", ["c"], ["z"])],
                            "g", [], [])
    assert absorbed_nodes(g, opt) == {0: "BiasGelu", 1: "BiasGelu", 2: "BiasGelu"}
    # an unknown fused op type (FusedConv: CPU only) reserves nothing
    opt2 = helper.make_graph([N("FusedConv", ["a", "b"], ["y"], domain="com.microsoft"), N("Neg", ["c"], ["z"])],
                             "g", [], [])
    assert absorbed_nodes(g, opt2) == {}


def test_cli_flag(tmp_path):
    src, dst = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(encoder_block(), str(src))
    args = [sys.executable, "-m", "onnxfuse.cli", "optimize", str(src), str(dst), "--target", "none"]
    on = subprocess.run(args, capture_output=True, text=True, timeout=300)
    off = subprocess.run(args + ["--no-leave-to-ort"], capture_output=True, text=True, timeout=300)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "pointwise_chain: 1 fused" in on.stdout and "left to ONNX Runtime's BiasGelu fusion" in on.stdout
    assert "left to ONNX Runtime" not in off.stdout


# ---------------------------------------------------------------------------------------
# A torch.nn.TransformerEncoderLayer exported at opset 17, end to end on the CPU
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_encoder(tmp_path_factory):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, activation="gelu", batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    paths = {}
    for kind, axes in (("dynamic", {"x": {0: "batch", 1: "seq"}}), ("static", None)):
        path = tmp_path_factory.mktemp("enc") / f"{kind}.onnx"
        torch.onnx.export(enc, (torch.randn(2, 16, 64),), str(path), opset_version=17, input_names=["x"],
                          output_names=["y"], dynamic_axes=axes, dynamo=False)
        paths[kind] = path
    return paths


def _check_encoder(path, expect: dict[str, int]):
    m = onnx.load(str(path))
    r = optimize_model(m)
    for fusion, n in expect.items():
        assert r.report.not_fused.get(reason(fusion)) == n, r.report.summary()
    for ops in replaced_ops(r):
        assert "Erf" not in ops, r.report.summary()
    feeds = random_feeds(m, {"batch": 3, "seq": 16} if "dynamic" in path.name else None)
    for a, b in zip(run(m, feeds), run(r.model, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    return r


def test_torch_encoder_dynamic_shapes(torch_encoder):
    # ORT fuses each layer's Linear bias + erf-GELU into BiasGelu; the bias + residual Adds
    # before each LayerNormalization (ORT has no fusion for them here) are its prologue (kinds/rows.py)
    r = _check_encoder(torch_encoder["dynamic"], {"BiasGelu": 12})
    assert ["Add", "Add", "LayerNormalization"] in replaced_ops(r)


def test_torch_encoder_static_shapes(torch_encoder):
    # every dim known: the output projection's and the FFN's biases are added after their
    # products (bias_after_product), so SkipLayerNormalization takes bias and residual Adds and
    # BiasGelu the FFN1 bias with the erf chain, each Gemm without a bias; the input projection
    # (its bias Add feeds the heads' split) stays a Gemm with the bias; nothing is left for a
    # pointwise chain; each layer's attention (whose scale FusedMatMul would take) is one
    # FusedAttention. The export's own static dims fold its shape arithmetic (static.fold_known_dims):
    # the in-projection's bias Add is the one Add left to the Gemm fusion in each layer (the heads'
    # split had a second, of shapes)
    r = _check_encoder(torch_encoder["static"], {"SkipLayerNormalization": 6, "BiasGelu": 12,
                                                 "MatMul + Add into Gemm": 2})
    assert not any(n.op_type in ("Shape", "Slice", "Concat") for n in r.model.graph.node), r.report.summary()
    assert r.report.patterns_applied == {"attention": 2} and r.report.notes[BIAS_AFTER] == 4


def test_a_model_no_fusion_starts_from_is_not_probed(monkeypatch):
    """A CNN's ops (Conv, Relu, Sigmoid, Mul, Add, MaxPool) start none of ORT's transformer
    fusions: ORT is not asked (no session), nothing is reserved."""
    import onnxfuse.ort_fusions as of

    monkeypatch.setattr(of, "_optimize", lambda ort, m: pytest.fail("ORT was asked"))
    m = model([N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["y"])], {"x": ("float32", [2, 8])},
              {"y": ("float32", [2, 8])})
    assert of.ort_fusions(m).absorbed == {}


def test_a_model_over_the_probe_limit_is_not_probed_and_says_so(monkeypatch):
    """ORT's optimizer is superlinear in the graph (17 s at 50,000 nodes): above
    PROBE_MAX_NODES onnxfuse does not ask it, and warns that ORT's fusions may be taken."""
    import onnxfuse.ort_fusions as of
    from onnxfuse.errors import OnnxfuseWarning

    monkeypatch.setattr(of, "PROBE_MAX_NODES", 3)
    monkeypatch.setattr(of, "_optimize", lambda ort, m: pytest.fail("ORT was asked"))
    m = model([N("Tanh", ["x"], ["a"]), N("Mul", ["a", "x"], ["b"]), N("Add", ["b", "x"], ["c"]),
               N("Sigmoid", ["c"], ["y"])], {"x": ("float32", [2, 8])}, {"y": ("float32", [2, 8])})
    found = of.ort_fusions(m)
    assert found.too_large and found.absorbed == {}
    with pytest.warns(OnnxfuseWarning, match="not looked for: 4 nodes"):
        r = optimize_model(m)
    assert r.report.patterns_applied.get("pointwise_chain") == 1


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_stand_in_weights_give_the_same_fusions(torch_encoder, kind, monkeypatch, tmp_path):
    """A large float32 model is probed with its weights read as zeros from a sparse file
    (`ort_fusions._stand_ins`: full-size BLOOM's probe 8.3 s and 4.4 GB peak -> 2.0 s and 2.2 GB):
    ORT absorbs the same nodes as with the real weights. The threshold lowered so that the
    encoder's 2 layers take that path; the model file ORT reads holds no weight (their zeros
    file is as long as they are, written as a hole)."""
    import onnxfuse.ort_fusions as of

    m = onnx.load(str(torch_encoder[kind]))
    real = of.ort_fusions(m).absorbed
    monkeypatch.setattr(of, "STAND_IN_BYTES", 0)
    made = []
    stand_ins = of._stand_ins
    monkeypatch.setattr(of, "_stand_ins", lambda model, folder: made.append(folder) or stand_ins(model, folder))
    assert of.ort_fusions(m).absorbed == real and real and made
    path = of._stand_ins(m, tmp_path)
    assert (tmp_path / "zeros.data").stat().st_size >= sum(of.declared_bytes(t) for t in m.graph.initializer
                                                            if of.declared_bytes(t) > 4096)
    assert onnx.load(path, load_external_data=False).ByteSize() < 100_000


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_large_float16_model_is_retyped_with_stand_in_weights(torch_encoder, kind, monkeypatch):
    """A float16 model whose float32 twin's weights pass STAND_IN_BYTES: the stand-ins are made
    before the float32 conversion (which then converts no weight: a 14 GB float16 model no longer
    makes a 28 GB float32 copy to be probed), and ORT absorbs the same nodes."""
    import onnxfuse.ort_fusions as of
    from models.fp16 import to_fp16
    from onnxfuse.load import PLACEHOLDER

    m = to_fp16(onnx.load(str(torch_encoder[kind])))
    real = of.ort_fusions(m).absorbed
    monkeypatch.setattr(of, "STAND_IN_BYTES", of._weight_bytes(m) - 1)
    probed = []
    retype = of.as_float32
    monkeypatch.setattr(of, "as_float32", lambda model: probed.append(model) or retype(model))
    assert of.ort_fusions(m).absorbed == real and real
    (light,) = probed
    assert any(kv.value == PLACEHOLDER for t in light.graph.initializer for kv in t.external_data)
    assert of._weight_bytes(m) > sum(of.declared_bytes(t) for t in m.graph.initializer)  # float16 ones twice

