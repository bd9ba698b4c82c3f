"""The attention kind's matcher and lowering (onnxfuse.kinds.attention) on hand-built graphs and
on the suite's transformers (models/transformers.py, both torch exporters, at static shapes):
every attention becomes one FusedAttention node with its head Transposes absorbed; the fused
model runs the original's function bodies to the original's outputs, and each node's numpy
reference (its contract in docs/format.md) gives the original's tensors (tests.util.check_fusion);
attention that cannot fuse is reported with the reason; a packed projection's bias Add joins the
node where it can (and stays where it is read elsewhere, is not a constant, broadcasts along more
than the last dim, or its heads are not the attention's H dim)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.inliner import inline_local_functions

from onnxfuse import optimize_model
from onnxfuse.kinds.attention import evaluate_attention
from onnxfuse.pattern import load_patterns
from onnxfuse.pipeline import NHWC_ONLY_PATTERNS, build_options
from tests.util import NP, check_fusion, model, op_types, run

N = helper.make_node
PATTERNS = [p for p in load_patterns() if p.name not in NHWC_ONLY_PATTERNS]
B, S, H, D = 2, 6, 2, 8


def _heads(mask: str | None = "add", scale: str = "div", dtype: str = "float32", out_transpose: bool = True,
           k_twice: bool = False, sk: int = S):
    """BERT's attention as torch.onnx.export writes it: q, k, v [B, S, H, D] made heads by
    Transposes, scores / sqrt(D) (+ mask), Softmax, @ v, back to [B, S, H, D]."""
    k_t = [N("Transpose", ["k"], ["kh"], perm=[0, 2, 1, 3]), N("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2])]
    nodes = [N("Transpose", ["q"], ["qh"], perm=[0, 2, 1, 3]),
             *(k_t if k_twice else [N("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1])]),
             N("Transpose", ["v"], ["vh"], perm=[0, 2, 1, 3]), N("MatMul", ["qh", "kt"], ["s"])]
    inputs = {"q": (dtype, [B, S, H, D]), "k": (dtype, [B, sk, H, D]), "v": (dtype, [B, sk, H, D])}
    inits = {"scale": np.array(np.sqrt(D), dtype)}
    nodes.append(N("Div" if scale == "div" else "Mul", ["s", "scale"], ["t"]))
    if mask == "add":
        inputs["mask"] = (dtype, [B, 1, 1, sk])
        nodes.append(N("Add", ["t", "mask"], ["a"]))
    elif mask == "where":  # GPT-2's causal mask
        inputs["keep"] = ("bool", [1, 1, S, sk])
        inits["masked"] = np.array(-10000.0, inits["scale"].dtype)
        nodes.append(N("Where", ["keep", "t", "masked"], ["a"]))
    else:
        nodes.append(N("Identity", ["t"], ["a"]))
    nodes += [N("Softmax", ["a"], ["p"], axis=-1), N("MatMul", ["p", "vh"], ["o"])]
    if out_transpose:
        nodes.append(N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3]))
        out = {"y": (dtype, [B, S, H, D])}
    else:
        nodes.append(N("Identity", ["o"], ["y"]))
        out = {"y": (dtype, [B, H, S, D])}
    return model(nodes, inputs, out, inits, opset=17)


def _feeds(m, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i in m.graph.input:
        dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
        et = i.type.tensor_type.elem_type
        if et == TensorProto.BOOL:
            out[i.name] = np.tril(np.ones(dims[-2:], bool)).reshape(dims)
        elif i.name == "mask":
            out[i.name] = np.where(rng.random(dims) < 0.3, -10000.0, 0.0).astype(NP[et])
        else:
            out[i.name] = rng.standard_normal(dims).astype(NP[et])
    return out


@pytest.mark.parametrize("mask", ["add", "where", None])
@pytest.mark.parametrize("scale", ["div", "mul"])
def test_attention_becomes_one_node(mask, scale):
    m = _heads(mask, scale)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    assert op_types(r.model).count("FusedAttention") == 1
    assert not {"Softmax", "MatMul", "Transpose"} & set(op_types(r.model)), op_types(r.model)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert list(node.input[:3]) == ["q", "k", "v"]
    assert attrs["perm_q"] == [0, 2, 1, 3] and attrs["perm_k"] == [0, 2, 3, 1] and attrs["perm_y"] == [0, 2, 1, 3]


def test_float16_attention():
    m = _heads("add", dtype="float16")
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS, rtol=1e-2)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    assert "exact_scores" not in {a.name for a in node.attribute}  # off by default (EXACT_SCORES_DTYPES)


def test_float16_attention_with_exact_scores(monkeypatch):
    """Where EXACT_SCORES_DTYPES holds the dtype, the node says exact_scores; its numpy contract
    (check_fusion's program check) and the library's CPU kernel stay within fp16's tolerance of
    the original."""
    from onnxfuse.kinds import attention
    from tests.util import check_library

    monkeypatch.setattr(attention, "EXACT_SCORES_DTYPES", frozenset({"f16"}))
    m = _heads("add", dtype="float16")
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS, rtol=1e-2)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}["exact_scores"] == 1
    check_library(m, r.model, "float16")


def test_keys_transposed_twice_and_output_left_as_heads():
    """K^T as k.transpose(-1, -2) of already-made heads: two Transposes compose into one perm;
    an output read as heads keeps the identity perm_y."""
    m = _heads("add", k_twice=True, out_transpose=False)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["perm_k"] == [0, 2, 3, 1] and attrs["perm_y"] == [0, 1, 2, 3]


def test_reasons_for_softmax_that_is_not_attention():
    """The probabilities also read elsewhere: the rows kind's softmax takes the Softmax with its
    scale and mask; without that pattern the report says why attention did not fuse."""
    m = _heads("add")
    m.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [B, H, S, S]))
    r = check_fusion(m, feeds=_feeds(m), patterns=PATTERNS)
    assert "FusedAttention" not in op_types(r.model) and "FusedRows" in op_types(r.model)
    r = optimize_model(m, [p for p in PATTERNS if p.name != "softmax"])
    assert any("Softmax's output is not read by one MatMul alone" in k for k in r.report.not_fused), \
        r.report.not_fused
    # the masked scores (the Softmax's input) also a graph output: no attention, the graph intact
    m = _heads("add")
    m.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [B, H, S, S]))
    r = check_fusion(m, feeds=_feeds(m), patterns=[p for p in PATTERNS if p.name != "softmax"])
    assert "FusedAttention" not in op_types(r.model)
    m = _heads("add")
    next(n for n in m.graph.node if n.op_type == "Softmax").attribute[0].i = 2
    r = optimize_model(m, [p for p in PATTERNS if p.name != "softmax"])
    assert "FusedAttention" not in op_types(r.model)
    assert r.report.not_fused.get("Softmax not over the last axis") == 1, r.report.not_fused


def test_a_declined_attention_keeps_its_reason():
    """An attention that declines for its own reason is reported with it, not as the lone Softmax
    the rows kind then finds; a Softmax that is no attention's (a classifier's) is reported as
    having nothing to fuse with it, not for its missing MatMuls."""
    nodes = [N("MatMul", ["q", "kt"], ["s"]), N("Softmax", ["s"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["y"])]
    m = model(nodes, {"q": ("float32", [B, H, S, "d"]), "kt": ("float32", [B, H, "d", S]),
                      "v": ("float32", [B, H, S, D])}, {"y": ("float32", [B, H, S, D])}, opset=17)
    r = optimize_model(m, PATTERNS)
    assert "FusedAttention" not in op_types(r.model)
    reasons = r.report.not_fused
    assert reasons.get("the head dims (D, Dv) are not static") == 1, reasons
    assert not any("nothing to fuse" in k for k in reasons), reasons
    m = model([N("Softmax", ["x"], ["y"], axis=-1)], {"x": ("float32", [B, 10])}, {"y": ("float32", [B, 10])})
    r = optimize_model(m, PATTERNS)
    assert r.report.not_fused == {"nothing to fuse with it (ONNX Runtime's own kernel runs it)": 1}, r.report.not_fused


def test_evaluate_follows_the_contract():
    """The numpy reference of the contract against a direct computation in float64."""
    rng = np.random.default_rng(1)
    from onnxfuse.expr import Program
    prog = Program.from_text(optimize_model(_heads(None), PATTERNS).fused[0].program.to_text())
    q, k, v = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(3))
    y = evaluate_attention(prog, q, k, v, [], (0, 2, 1, 3), (0, 2, 3, 1), (0, 2, 1, 3), (0, 2, 1, 3))
    qh, kh, vh = (np.transpose(a, (0, 2, 1, 3)).astype(np.float64) for a in (q, k, v))
    s = qh @ np.swapaxes(kh, -1, -2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.transpose((p / p.sum(-1, keepdims=True)) @ vh, (0, 2, 1, 3))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# the suite's transformers
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("arch", ["bert_base", "vit_s16", "gpt2_small"])
def test_exported_transformers(arch, exporter):
    pytest.importorskip("torch")
    from models import transformers as mt
    if exporter == "dynamo" and mt.dynamo_available():
        pytest.skip(mt.dynamo_available())
    m = mt.export(arch, exporter, small=True)
    shapes = {k: (2, *v) for k, v in mt.input_dims(arch, small=True).items()}
    r = optimize_model(m, options=build_options(target="none", tune="off", shapes=shapes))
    ops = op_types(r.model)
    layers = mt.config(arch, small=True).layers
    assert ops.count("FusedAttention") == layers and "Softmax" not in ops, r.report.summary()
    feeds = mt.feeds(arch, shapes, small=True)
    want = run(m, feeds)
    for got in (run(r.model, feeds), _run_with_library(r.model, feeds)):  # function bodies; the CPU kernels
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))


def _run_with_library(m, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    from onnxfuse import runtime
    so = ort.SessionOptions()
    so.register_custom_ops_library(runtime.library_path())
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("arch", ["bert_base", "gpt2_small"])
def test_float16_twins_of_exported_transformers(arch):
    """The suite's fp16 twins (models/fp16.py): every attention fuses there too, its output
    within fp16's tolerance of the original's through the library's CPU kernels."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxconverter_common")
    from models import transformers as mt
    from models.fp16 import to_fp16
    m = to_fp16(mt.export(arch, "torchscript", small=True))
    shapes = {k: (2, *v) for k, v in mt.input_dims(arch, small=True).items()}
    r = optimize_model(m, options=build_options(target="none", tune="off", shapes=shapes))
    assert op_types(r.model).count("FusedAttention") == mt.config(arch, small=True).layers, r.report.summary()
    feeds = mt.feeds(arch, shapes, small=True)
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        w, g = w.astype(np.float64), g.astype(np.float64)
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * float(np.abs(w).max()))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_operands_scaled_by_constants(dtype):
    """torch's scaled_dot_product_attention as exported: Q and K^T each multiplied by
    sqrt(scale) before the product (K^T's factor written first, Q's divided): the factors move
    onto the product in the score program, so no Mul or Div is left."""
    c = np.array(D ** -0.25, dtype)
    nodes = [N("Transpose", ["q"], ["qh"], perm=[0, 2, 1, 3]), N("Div", ["qh", "inv"], ["qs"]),
             N("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]), N("Mul", ["c", "kt"], ["ks"]),
             N("Transpose", ["v"], ["vh"], perm=[0, 2, 1, 3]), N("MatMul", ["qs", "ks"], ["s"]),
             N("Add", ["s", "mask"], ["a"]), N("Softmax", ["a"], ["p"], axis=-1), N("MatMul", ["p", "vh"], ["o"]),
             N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    io = {x: (dtype, [B, S, H, D]) for x in "qkv"} | {"mask": (dtype, [B, 1, 1, S])}
    m = model(nodes, io, {"y": (dtype, [B, S, H, D])}, {"c": c, "inv": (1 / c).astype(dtype)}, opset=17)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS, rtol=1e-2 if dtype == "float16" else None)
    assert op_types(r.model) == ["FusedAttention"]
    prog = r.fused[0].program.to_text()
    assert "mul" in prog, prog
    feeds = _feeds(m)
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        tol = 1e-2 if dtype == "float16" else 1e-5
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol,
                                   atol=tol * float(np.abs(w.astype(np.float64)).max()))


def test_torch_sdpa_export():
    """F.scaled_dot_product_attention through torch's TorchScript exporter (its scale computed
    from Shape, folded at --shape): one node."""
    torch = pytest.importorskip("torch")
    import io as _io

    import onnx

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    x = torch.randn(2, 4, 16, 32)
    f = _io.BytesIO()
    torch.onnx.export(Sdpa(), (x, x, x, torch.zeros(2, 1, 1, 16)), f, opset_version=17, dynamo=False,
                      input_names=["q", "k", "v", "mask"])
    m = onnx.load_from_string(f.getvalue())
    shapes = {"q": (2, 4, 16, 32), "k": (2, 4, 16, 32), "v": (2, 4, 16, 32), "mask": (2, 1, 1, 16)}
    r = optimize_model(m, options=build_options(target="none", tune="off", shapes=shapes))
    assert op_types(r.model) == ["FusedAttention"], r.report.summary()
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def _probs_path(p_nodes, mask_value=-10000.0, dtype="float32"):
    """BERT's attention whose probabilities reach P @ V through `p_nodes` (from "p" to "pv")."""
    nodes = [N("Transpose", ["q"], ["qh"], perm=[0, 2, 1, 3]), N("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1]),
             N("Transpose", ["v"], ["vh"], perm=[0, 2, 1, 3]), N("MatMul", ["qh", "kt"], ["s"]),
             N("Add", ["s", "mask"], ["a"]), N("Softmax", ["a"], ["p"], axis=-1), *p_nodes,
             N("MatMul", ["pv", "vh"], ["o"]), N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    io = {x: (dtype, [B, S, H, D]) for x in "qkv"} | {"mask": (dtype, [B, 1, 1, S])}
    return model(nodes, io, {"y": (dtype, [B, S, H, D])}, {"zero": np.array(0.0, dtype)}, opset=17)


def test_probabilities_through_casts_and_a_nan_guard():
    """HF's softmax(..., dtype=float32).to(query.dtype) (Casts) and torch's SDPA export's
    Where(IsNaN(P), 0, P) (nan_to_zero: a fully masked row gives 0, as the original does);
    a Cast through a narrower dtype keeps the attention out."""
    cast = [N("Cast", ["p"], ["pc"], to=1), N("IsNaN", ["pc"], ["isnan"]), N("Where", ["isnan", "zero", "pc"], ["pv"])]
    m = _probs_path(cast)
    feeds = _feeds(m)
    feeds["mask"][0] = -np.inf  # batch 0: every key masked, the softmax NaN, P 0
    r = check_fusion(m, expect_fused=1, feeds=feeds, patterns=PATTERNS)
    assert op_types(r.model) == ["FusedAttention"]
    node = r.model.graph.node[0]
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute}.get("nan_to_zero") == 1
    (want,), (got,) = run(m, feeds), _run_with_library(r.model, feeds)
    assert not np.isnan(want).any() and not want[0].any()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    narrowing = [N("Cast", ["p"], ["ph"], to=10), N("Cast", ["ph"], ["pv"], to=1)]
    r = optimize_model(_probs_path(narrowing), [p for p in PATTERNS if p.name != "softmax"])
    assert "FusedAttention" not in op_types(r.model)
    assert any("narrower than P's" in k for k in r.report.not_fused), r.report.not_fused


def test_one_input_concat_is_removed():
    """A Concat of one input (HF's key/value cache with no past, as exported) is a copy:
    canonicalize drops it, so the attention reads the keys in place."""
    from onnxfuse.load import canonicalize
    m = _probs_path([N("Identity", ["p"], ["pv"])])
    nodes = list(m.graph.node)
    k = next(n for n in nodes if n.output[0] == "kt")
    k.input[0] = "kc"
    nodes.insert(0, N("Concat", ["k"], ["kc"], axis=1))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    assert "Concat" not in op_types(canonicalize(m))
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    assert op_types(r.model) == ["FusedAttention"]


# ---------------------------------------------------------------------------------------
# a packed projection's bias Add (GPT-2's c_attn form, and BERT's after onnxfuse.pack)
# ---------------------------------------------------------------------------------------

def _packed(bias_shape=(3 * H * D,), bias: str = "constant", x_output: bool = False, x_reader: bool = False,
            heads: bool = True, dtype: str = "float32"):
    """x [B, S, E] @ W [E, 3E] + b -> Split on the last axis -> Reshapes to [B, S, H, D] ->
    attention (Transposes to heads, / sqrt(D), Softmax, @ v, back). bias: "constant" (an
    initializer of `bias_shape`) or "input" (a graph input); x_output / x_reader: the biased
    product is also a graph output / also read by a Relu; heads False: no head Transposes, the
    attention runs over [B, S, H, D] as it is (its H dim is S, not the split's heads)."""
    e = H * D
    rng = np.random.default_rng(5)
    inits = {"w": (rng.standard_normal((e, 3 * e)) / np.sqrt(e)).astype(dtype),
             "sizes": np.array([e, e, e], np.int64), "shape": np.array([B, S, H, D], np.int64),
             "scale": np.array(np.sqrt(D), dtype)}
    inputs = {"x": (dtype, [B, S, e])}
    if bias == "constant":
        inits["b"] = (0.5 * rng.standard_normal(bias_shape)).astype(dtype)
    else:
        inputs["b"] = (dtype, list(bias_shape))
    nodes = [N("MatMul", ["x", "w"], ["xw"]), N("Add", ["b", "xw"], ["qkv"]),
             N("Split", ["qkv", "sizes"], ["q2", "k2", "v2"], axis=-1),
             *(N("Reshape", [f"{w}2", "shape"], [f"{w}4"]) for w in "qkv")]
    if heads:
        nodes += [N("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]), N("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
                  N("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3])]
    else:
        nodes += [N("Identity", ["q4"], ["qh"]), N("Transpose", ["k4"], ["kt"], perm=[0, 1, 3, 2]),
                  N("Identity", ["v4"], ["vh"])]
    nodes += [N("MatMul", ["qh", "kt"], ["s"]), N("Div", ["s", "scale"], ["t"]), N("Softmax", ["t"], ["p"], axis=-1),
              N("MatMul", ["p", "vh"], ["o"]), N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    outputs = {"y": (dtype, [B, H, S, D] if not heads else [B, S, H, D])}
    if x_output:
        outputs["qkv"] = (dtype, [B, S, 3 * e])
    if x_reader:
        nodes.append(N("Relu", ["qkv"], ["r"]))
        outputs["r"] = (dtype, [B, S, 3 * e])
    return model(nodes, inputs, outputs, inits, opset=17)


def _node_attrs(r) -> dict:
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    return {a.name: helper.get_attribute_value(a) for a in node.attribute} | {"inputs": list(node.input)}


@pytest.mark.parametrize("bias_shape", [(3 * H * D,), (1, 1, 3 * H * D)])
def test_packed_projection_bias_is_absorbed(bias_shape):
    """The bias Add of the Split's input joins the node (bias_q = bias_k = bias_v, one input after
    the extras): no Add is left, the node reads the product before it; a [1, 1, N] bias is passed
    as a 1-D copy, the function body keeping the original Add."""
    m = _packed(bias_shape)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    assert op_types(r.model) == ["MatMul", "FusedAttention"], r.report.summary()
    a = _node_attrs(r)
    assert a["inputs"][:3] == ["xw"] * 3 and [a[f"bias_{w}"] for w in "qkv"] == [3, 3, 3] and len(a["inputs"]) == 4
    bias = next(t for t in r.model.graph.initializer if t.name == a["inputs"][3])
    assert list(bias.dims) == [3 * H * D]
    feeds = _feeds(m)
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_packed_projection_bias_float16():
    m = _packed(dtype="float16")
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS, rtol=1e-2)
    assert op_types(r.model) == ["MatMul", "FusedAttention"], r.report.summary()


@pytest.mark.parametrize("form", ["graph output", "another reader", "not a constant", "2-D bias",
                                  "heads not the H dim"])
def test_packed_projection_bias_left_alone(form):
    """The Add stays (the attention reads the biased product, split, as before) when the biased
    product is read outside the attention, when the bias is not a constant or varies along more
    than the last dim, or when the split's heads are not the attention's H dim (the kernel adds
    a head's slice of the bias along D)."""
    m = {"graph output": lambda: _packed(x_output=True), "another reader": lambda: _packed(x_reader=True),
         "not a constant": lambda: _packed(bias="input"), "2-D bias": lambda: _packed((S, 3 * H * D)),
         "heads not the H dim": lambda: _packed(heads=False)}[form]()
    r = check_fusion(m, expect_fused=None, feeds=_feeds(m), patterns=PATTERNS)
    # the Add runs as a node, or in a pointwise chain with its other reader (the product's bias
    # then added after it: `bias_after_product`)
    in_chains = sum(s.startswith("Add ") for f in r.fused if f.kind == "pointwise" for s in f.source_nodes)
    assert op_types(r.model).count("Add") + in_chains == 1 and "FusedAttention" in op_types(r.model), \
        r.report.summary()
    a = _node_attrs(r)
    assert a["inputs"][:3] == ["qkv"] * 3 and not {"bias_q", "bias_k", "bias_v"} & set(a), a


def _attention_spec(m):
    """The kernel spec of the model's one FusedAttention node, and the optimize result."""
    from onnxfuse.kinds import KINDS
    r = optimize_model(m, options=build_options(target="none", tune="off"))
    (f,) = [f for f in r.fused if f.kind == "attention"]
    return KINDS[f.kind].spec(r.model, f, "tf32", None), r


def _mask_constant(mask: str, name: str, value: np.ndarray):
    """_heads(mask) with its mask input `name` made the constant `value`."""
    m = _heads(mask)
    m.graph.input.remove(next(i for i in m.graph.input if i.name == name))
    m.graph.initializer.append(numpy_helper.from_array(value, name))
    return m


def _constant_keep(keep: np.ndarray):
    """GPT-2's attention (_heads("where")) with its keep mask a constant."""
    return _mask_constant("where", "keep", keep)


def test_extras_read_as_what_they_broadcast_as():
    """BERT's key mask [B, 1, 1, Sk] is read as a row of keys; a graph-input causal mask as a tile;
    GPT-2's constant causal mask is computed from the indices, with the Where's -10000 as the
    value past the diagonal (key blocks there skipped), also when repeated per batch; a constant
    that is not causal, or that differs per batch, is read as a tile."""
    spec, _ = _attention_spec(_heads("add"))
    assert spec.extras_broadcast == ("m",) and spec.causal_fill is None
    spec, _ = _attention_spec(_heads("where"))
    assert spec.extras_broadcast == ("",) and spec.causal_fill is None
    tri = np.tri(S, S, 0, dtype=bool)[None, None]
    spec, r = _attention_spec(_constant_keep(tri))
    assert spec.extras_broadcast == ("causal",) and spec.causal_fill == -10000.0
    feeds = _feeds(_heads("where"))
    feeds.pop("keep")
    np.testing.assert_allclose(_run_with_library(r.model, feeds)[0], run(_constant_keep(tri), feeds)[0],
                               rtol=1e-5, atol=1e-5)
    not_causal = tri.copy()
    not_causal[..., 0, 1] = True
    assert _attention_spec(_constant_keep(not_causal))[0].extras_broadcast == ("",)
    per_batch = np.broadcast_to(tri, (B, 1, S, S)).copy()  # a copy per batch: still computed
    assert _attention_spec(_constant_keep(per_batch))[0].extras_broadcast == ("causal",)
    per_batch[1, 0, 0, 1] = True  # batches that differ: read
    assert _attention_spec(_constant_keep(per_batch))[0].extras_broadcast == ("",)


def _expanded_mask(rows_equal: bool):
    """BERT's attention with its additive mask Expanded to [B, 1, S, S] first (Hugging Face
    transformers 5's form): from [B, 1, 1, S] (equal rows), or from [B, 1, S, 1] (not)."""
    m = _heads("add")
    g = m.graph
    mask_in = next(i for i in g.input if i.name == "mask")
    dims = mask_in.type.tensor_type.shape.dim
    if not rows_equal:
        dims[2].dim_value, dims[3].dim_value = S, 1
    g.initializer.append(numpy_helper.from_array(np.array([B, 1, S, S], np.int64), "full"))
    add = next(n for n in g.node if n.op_type == "Add")
    add.input[1] = "mask_full"
    g.node.insert(0, N("Expand", ["mask", "full"], ["mask_full"]))
    return m


def test_expanded_key_mask_is_read_as_a_row():
    spec, r = _attention_spec(_expanded_mask(True))
    assert spec.extras_broadcast == ("row",)
    feeds = _feeds(_expanded_mask(True))
    np.testing.assert_allclose(_run_with_library(r.model, feeds)[0], run(_expanded_mask(True), feeds)[0],
                               rtol=1e-5, atol=1e-5)
    assert _attention_spec(_expanded_mask(False))[0].extras_broadcast == ("",)


def _additive_causal(mask: np.ndarray):
    """BERT's attention form with its additive mask a constant [..., S, S] (Hugging Face's GPT-2)."""
    return _mask_constant("add", "mask", mask.astype(np.float32))


def test_additive_causal_constant_is_computed():
    keep = np.tri(S, S, 0, dtype=bool)
    lowest = np.finfo(np.float32).min
    mask = np.broadcast_to(np.where(keep, 0, lowest), (B, 1, S, S)).copy()  # per batch, every slice equal
    spec, r = _attention_spec(_additive_causal(mask))
    assert spec.extras_broadcast == ("causal_add",) and spec.causal_masked == float(lowest)
    assert spec.causal_fill is None  # an additive mask keeps NaN and inf scores: nothing is skipped
    feeds = {k: v for k, v in _feeds(_heads("add")).items() if k != "mask"}
    np.testing.assert_allclose(_run_with_library(r.model, feeds)[0], run(_additive_causal(mask), feeds)[0],
                               rtol=1e-5, atol=1e-5)
    two_values = mask.copy()
    two_values[0, 0, 0, -1] = -1.0
    assert _attention_spec(_additive_causal(two_values))[0].extras_broadcast == ("",)
    unequal = mask.copy()
    unequal[1, 0, 0, -1] = 0.0
    assert _attention_spec(_additive_causal(unequal))[0].extras_broadcast == ("",)


def test_causal_fill_only_where_the_masked_value_is_one_value():
    from onnxfuse.expr import HEADER, parse
    from onnxfuse.kinds.attention import _constant_where_masked

    def fill(body: str, dtypes=("f32", "bool")):
        lines = [HEADER] + [f"input %{i} {dt}" for i, dt in enumerate(dtypes)] + body.splitlines()
        return _constant_where_masked(parse("\n".join(lines) + "\n"), 1)

    assert fill("%2 = div %0 8.0\n%3 = select %1 %2 -10000.0\noutput %3 f32") == -10000.0
    assert fill("%2 = select %1 %0 -inf\noutput %2 f16") == float("-inf")
    assert fill("%2 = select %1 %0 %0\noutput %2 f32") is None  # the scores themselves
    assert fill("%3 = select %1 %0 -10000.0\n%4 = add %3 %2\noutput %4 f32", ("f32", "bool", "f32")) is None
    assert fill("%2 = select %1 %0 nan\noutput %2 f32") is None


def test_output_transpose_after_a_same_shape_reshape():
    """Hugging Face transformers 5.24's sdpa attention reshapes P @ V to its own shape before the
    heads' Transpose: the Reshape and the Transpose join the node (perm_y); a Reshape that
    changes the shape stays, and so does the Transpose after it."""
    def with_reshape(shape):
        m = _heads("add", out_transpose=True)
        g = m.graph
        t = next(n for n in g.node if n.op_type == "Transpose" and n.output[0] == "y")
        t.input[0] = "o_same"
        g.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), "o_shape"))
        g.node.insert(list(g.node).index(t), N("Reshape", ["o", "o_shape"], ["o_same"]))
        return m

    same = with_reshape([B, H, S, D])
    r = check_fusion(same, 1)
    assert op_types(r.model) == ["FusedAttention"], r.report.summary()
    feeds = _feeds(same)
    np.testing.assert_allclose(_run_with_library(r.model, feeds)[0], run(same, feeds)[0], rtol=1e-5, atol=1e-5)
    other = with_reshape([B, H * S, 1, D])  # not the product's shape: left, with the Transpose
    r = optimize_model(other, options=build_options(target="none", tune="off"))
    assert sorted(op_types(r.model)) == ["FusedAttention", "Reshape", "Transpose"], r.report.summary()


def test_causal_mask_computed_from_constants_is_recognized():
    """Hugging Face transformers 5's GPT-2 sdpa export makes its mask in the graph from constants
    alone, Where(Equal(Trilu(Expand(1, [S, S])), 0), -inf, 0), for every layer: evaluated at
    optimize time, it is the additive causal mask, computed by the kernel (nothing read). The
    node takes it as a constant, so the four ops are gone; the function body, inlined, still
    computes the original."""
    m = _heads("add")
    g = m.graph
    g.input.remove(next(i for i in g.input if i.name == "mask"))
    consts = {"one": np.array(1.0, np.float32), "square": np.array([S, S], np.int64),
              "zero": np.array([0.0], np.float32), "neg_inf": np.array([-np.inf], np.float32)}
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    g.node.insert(0, N("Expand", ["one", "square"], ["ones"]))
    g.node.insert(1, N("Trilu", ["ones"], ["tril"], upper=0))
    g.node.insert(2, N("Equal", ["tril", "zero"], ["above"]))
    g.node.insert(3, N("Where", ["above", "neg_inf", "zero"], ["mask"]))
    spec, r = _attention_spec(m)
    assert spec.extras_broadcast == ("causal_add",) and spec.causal_masked == float("-inf")
    assert op_types(r.model) == ["FusedAttention"], r.report.summary()
    (node,) = r.model.graph.node
    (mask,) = [t for t in r.model.graph.initializer if t.name == node.input[3]]
    np.testing.assert_array_equal(numpy_helper.to_array(mask), np.where(np.tri(S, S, 0, dtype=bool), 0, -np.inf))
    feeds = {k: v for k, v in _feeds(_heads("add")).items() if k != "mask"}
    want = run(m, feeds)[0]
    np.testing.assert_allclose(_run_with_library(r.model, feeds)[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(inline_local_functions(r.model), feeds)[0], want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# a per-head interleaved projection (GPT-NeoX's query_key_value)
# ---------------------------------------------------------------------------------------

def _interleaved(cut: str = "slices", bias: bool = True, v_elsewhere: bool = False):
    """x [B, S, E] @ W [E, 3E] (+ b) viewed as [B, S, H, 3D] (each head's q, k, v side by side),
    transposed to [B, H, S, 3D], cut into q, k, v along the last axis (three Slices, as GPT-NeoX's
    chunk exports, or one Split), then the attention; v_elsewhere: v is a graph output too."""
    e = H * D
    rng = np.random.default_rng(7)
    inits = {"w": (rng.standard_normal((e, 3 * e)) / np.sqrt(e)).astype(np.float32),
             "b": (0.5 * rng.standard_normal(3 * e)).astype(np.float32),
             "shape": np.array([0, 0, H, 3 * D], np.int64), "scale": np.array(np.sqrt(D), np.float32),
             "axes": np.array([-1], np.int64), **{f"at{k}": np.array([k * D], np.int64) for k in range(4)}}
    nodes = [N("MatMul", ["x", "w"], ["xw"]), *([N("Add", ["b", "xw"], ["qkv"])] if bias else []),
             N("Reshape", ["qkv" if bias else "xw", "shape"], ["per_head"]),
             N("Transpose", ["per_head"], ["t"], perm=[0, 2, 1, 3])]
    if cut == "slices":
        nodes += [N("Slice", ["t", f"at{k}", f"at{k + 1}", "axes"], [w]) for k, w in enumerate("qkv")]
    else:
        nodes.append(N("Split", ["t"], ["q", "k", "v"], axis=3, num_outputs=3))
    nodes += [N("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N("MatMul", ["q", "kt"], ["s"]),
              N("Div", ["s", "scale"], ["d"]), N("Softmax", ["d"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["o"]),
              N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    outputs = {"y": ("float32", [B, S, H, D]), **({"v": ("float32", [B, H, S, D])} if v_elsewhere else {})}
    return model(nodes, {"x": ("float32", [B, S, e])}, outputs, inits, opset=18)


@pytest.mark.parametrize("cut,bias", [("slices", True), ("split", True), ("slices", False)])
def test_per_head_interleaved_projection_is_read_in_place(cut, bias):
    """The interleaved projection's columns are reordered into a packed [Wq | Wk | Wv] (pack.
    unpack_interleaved): the attention then reads q, k and v in place from one product and adds
    the bias itself; the Reshape, the Transpose and the cuts (copies each) are gone."""
    m = _interleaved(cut, bias)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    assert op_types(r.model) == ["MatMul", "FusedAttention"], r.report.summary()
    assert "interleaved head by head were reordered" in r.report.summary()
    feeds = _feeds(m)
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_per_head_interleaved_projection_read_elsewhere():
    """v also a graph output: the reordered projection's parts still write q, k and v (the Split
    then runs, v keeps its name), and the model computes what it did."""
    m = _interleaved(v_elsewhere=True)
    r = check_fusion(m, expect_fused=1, feeds=_feeds(m), patterns=PATTERNS)
    assert "Transpose" in op_types(r.model) and "Slice" not in op_types(r.model), op_types(r.model)


@pytest.mark.parametrize("dtype,fill", [("float32", "lowest"), ("float16", "lowest"), ("float16", "-inf")])
def test_probabilities_zeroed_where_masked(dtype, fill):
    """DeBERTa's XSoftmax (Hugging Face transformers 4): Where(m, lowest, scores), Softmax,
    Where(m, 0, P) with m true for padded queries and keys. The second Where joins the node
    (attribute zero_where: P zeroed after its row's sum); the padded queries' rows, whose keys
    are all masked, give 0 (with a -inf fill the softmax there is NaN, and still 0 after the
    Where). The library's CPU kernel and the numpy definition against the original."""
    from onnxfuse.kinds.attention import Attention
    b, h, s, d = 2, 2, 6, 4
    low = np.array(np.finfo(dtype).min if fill == "lowest" else -np.inf, dtype)
    nodes = [N("MatMul", ["q", "k"], ["sc"]), N("Where", ["m", "low", "sc"], ["a"]),
             N("Softmax", ["a"], ["p"], axis=-1), N("Where", ["m2", "zero", "p"], ["pz"]),
             N("MatMul", ["pz", "v"], ["y"])]
    m = model(nodes, {"q": (dtype, [b, h, s, d]), "k": (dtype, [b, h, d, s]), "v": (dtype, [b, h, s, d]),
                      "m": ("bool", [b, 1, s, s]), "m2": ("bool", [b, 1, s, s])}, {"y": (dtype, [b, h, s, d])},
              {"low": low, "zero": np.array(0, dtype)}, opset=17)
    r = optimize_model(m, options=build_options(target="none", tune="off"))
    assert op_types(r.model) == ["FusedAttention"], r.report.summary()
    node = r.model.graph.node[0]
    assert any(a.name == "zero_where" for a in node.attribute)
    rng = np.random.default_rng(0)
    keep = np.ones((b, s), bool)
    keep[0, 4:] = False
    mask = ~(keep[:, None, :, None] & keep[:, None, None, :])
    feeds = {"q": rng.standard_normal((b, h, s, d)).astype(dtype), "k": rng.standard_normal((b, h, d, s)).astype(dtype),
             "v": rng.standard_normal((b, h, s, d)).astype(dtype), "m": mask, "m2": mask.copy()}
    (want,) = run(m, feeds)
    assert not want[0, :, 4:].any() and np.isfinite(want).all()
    tol = 1e-5 if dtype == "float32" else 2e-3
    for got in (_run_with_library(r.model, feeds)[0], Attention().evaluate(node, [feeds[i] for i in node.input])[0]):
        assert not got[0, :, 4:].any()
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
