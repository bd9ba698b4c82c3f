"""Recognition of row reductions (onnxfuse/kinds/rows.py): each exporter form of LayerNorm, RMSNorm
and softmax fuses into exactly one FusedRows node whose function body computes what the
original did and whose programs (the kind's numpy reference) match the original's tensors; the forms
that must not fuse say why; ONNX Runtime's own normalization fusions keep what they would
fuse whole (leave_to_ort), and the report says which rule applied.

Forms: torch.onnx's TorchScript export of nn.LayerNorm at opsets 13-16 (decomposed) and 17
(LayerNormalization), and of RMSNorm written three ways; hand-built tf2onnx / Keras forms
(Reciprocal-Mul, Mul(d, d), Keras' x * inv + (beta - mean * inv), eps as a Constant node,
ReduceMean's axes as an input from opset 18), SimplifiedLayerNormalization and
RMSNormalization; softmax with a scale and an additive or Where mask, LogSoftmax, and the
coerced 2-D softmax of opsets before 13."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.kinds.rows import (
    EPS_NOT_CONSTANT,
    EXTRA_OUTPUTS,
    LONE,
    MOMENTS_FORM,
    NO_KEEPDIMS,
    NOT_BROADCAST,
    NOT_IN_FUNCTIONS,
    NOT_LAST,
    STAT_OUTSIDE,
)
from tests.util import check_fusion, model, op_types

F, H = TensorProto.FLOAT, TensorProto.FLOAT16
RNG = np.random.default_rng(0)


def _w(*shape, value=None) -> np.ndarray:
    return np.full(shape, value, np.float32) if value is not None else RNG.standard_normal(shape).astype(np.float32)


def _fused(result) -> list[onnx.NodeProto]:
    return [n for n in result.model.graph.node if n.domain == "onnxfuse"]


def _one_node(m: onnx.ModelProto, leave_to_ort: bool = False, rtol: float | None = None, feeds=None):
    """The model fuses into exactly one FusedRows node and nothing else, which computes what
    the original does."""
    r = check_fusion(m, expect_fused=1, leave_to_ort=leave_to_ort, rtol=rtol, feeds=feeds)
    assert op_types(r.model) == ["FusedRows"], r.report.summary()
    return r


def _attr(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


# ---------------------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------------------

def _torch_export(module, args, opset: int) -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    f = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, args, f, opset_version=opset, dynamo=False,
                          input_names=[f"in{i}" for i in range(len(args))])
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("opset", [13, 14, 15, 16])
def test_torch_layernorm_decomposed(opset):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(48)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    m = _torch_export(ln, (torch.randn(2, 5, 48),), opset)
    assert op_types(m).count("ReduceMean") == 2
    r = _one_node(m)
    (node,) = _fused(r)
    assert (_attr(node, "reduction"), _attr(node, "axis")) == (b"layer_norm", 2)
    # by default ONNX Runtime's LayerNormalization fusion takes it whole
    kept = optimize_model(m)
    assert op_types(kept.model) == [op for op in op_types(m) if op != "Constant"]
    assert any("left to ONNX Runtime's LayerNormalization fusion" in k and "every node" in k
               for k in kept.report.not_fused)


def test_torch_layernorm_op_with_epilogue():
    """Opset 17 writes LayerNormalization; alone it stays (nothing to fuse), with an
    activation after it the whole thing is one kernel."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    alone = _torch_export(torch.nn.LayerNorm(32), (torch.randn(3, 32),), 17)
    r = optimize_model(alone, leave_to_ort=False)
    assert op_types(r.model) == ["LayerNormalization"] and r.report.not_fused == {LONE: 1}
    net = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.GELU())
    m = _torch_export(net, (torch.randn(3, 7, 32),), 17)
    assert "LayerNormalization" in op_types(m) and "Erf" in op_types(m)
    _one_node(m)
    # with ONNX Runtime's fusions: its Gelu fusion keeps the erf-GELU, and the norm alone stays too
    kept = optimize_model(m)
    assert "FusedRows" not in op_types(kept.model) and kept.report.not_fused.get(LONE) == 1


def _ln_graph(x_shape=(2, 6, 24), opset=13, square="pow", inv="div", eps="init", axes=(-1,), keepdims=1,
              affine=True, dtype=F, extra=(), more_inits=None):
    """A hand-built decomposed LayerNorm, as tf2onnx and other exporters write it:
    square "pow" (Pow(d, 2)) or "mul" (Mul(d, d)); inv "div" (Div(d, Sqrt)), "reciprocal"
    (Mul(d, Reciprocal(Sqrt))), "rsqrt_pow" (Mul(d, Pow(var + eps, -0.5))) or "keras"
    (x * inv + (beta - mean * inv), inv = Reciprocal(Sqrt(var + eps)) * gamma); eps an
    initializer, a Constant node ("node") or a graph input ("input")."""
    d = x_shape[-1] if len(axes) == 1 else int(np.prod([x_shape[a] for a in axes]))
    dt = "float32" if dtype == F else "float16"
    np_dt = np.float32 if dtype == F else np.float16
    inits = {"two": np.array(2.0, np_dt), "one": np.array(1.0, np_dt), "mhalf": np.array(-0.5, np_dt)}
    norm_shape = [x_shape[a] for a in axes] if len(axes) > 1 else [d]
    inits["gamma"] = _w(*norm_shape).astype(np_dt)
    inits["beta"] = _w(*norm_shape).astype(np_dt)
    nodes = []
    inputs = {"x": (dt, list(x_shape))}

    def reduce_mean(src, dst):
        if not keepdims:  # keepdims=0, then an Unsqueeze back
            inits["ax"] = np.array(axes, np.int64)
            nodes.append(helper.make_node("ReduceMean", [src], [dst + "_r"], axes=list(axes), keepdims=0))
            return helper.make_node("Unsqueeze", [dst + "_r", "ax"], [dst])
        if opset >= 18:
            return helper.make_node("ReduceMean", [src, "axes"], [dst], keepdims=keepdims)
        return helper.make_node("ReduceMean", [src], [dst], axes=list(axes), keepdims=keepdims)

    if opset >= 18:
        inits["axes"] = np.array(axes, np.int64)
    if eps == "init":
        inits["eps"] = np.array(1e-5, np_dt)
    elif eps == "node":
        nodes.append(helper.make_node("Constant", [], ["eps"], value=numpy_helper.from_array(np.array(1e-5, np_dt))))
    else:
        inputs["eps"] = (dt, [])
    nodes.append(reduce_mean("x", "mean"))
    nodes.append(helper.make_node("Sub", ["x", "mean"], ["d"]))
    nodes.append(helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow"
                 else helper.make_node("Mul", ["d", "d"], ["sq"]))
    nodes.append(reduce_mean("sq", "var"))
    nodes.append(helper.make_node("Add", ["var", "eps"], ["ve"]))
    out = "n"
    if inv == "div":
        nodes += [helper.make_node("Sqrt", ["ve"], ["s"]), helper.make_node("Div", ["d", "s"], ["n"])]
    elif inv == "reciprocal":
        nodes += [helper.make_node("Sqrt", ["ve"], ["s"]), helper.make_node("Reciprocal", ["s"], ["r"]),
                  helper.make_node("Mul", ["d", "r"], ["n"])]
    elif inv == "rsqrt_pow":
        nodes += [helper.make_node("Pow", ["ve", "mhalf"], ["r"]), helper.make_node("Mul", ["d", "r"], ["n"])]
    elif inv == "keras":
        nodes += [helper.make_node("Sqrt", ["ve"], ["s"]), helper.make_node("Reciprocal", ["s"], ["r"]),
                  helper.make_node("Mul", ["r", "gamma"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["xi"]),
                  helper.make_node("Mul", ["mean", "inv"], ["mi"]), helper.make_node("Sub", ["beta", "mi"], ["bm"]),
                  helper.make_node("Add", ["xi", "bm"], ["y"])]
        out = "y"
        affine = False
    if affine:
        nodes += [helper.make_node("Mul", [out, "gamma"], ["g"]), helper.make_node("Add", ["g", "beta"], ["y"])]
        out = "y"
    nodes += list(extra)
    inits.update(more_inits or {})
    last = extra[-1].output[0] if extra else out
    return model(nodes, inputs, {last: (dt, list(x_shape))}, inits, opset=opset)


@pytest.mark.parametrize("opset,square,inv,eps", [
    (13, "mul", "reciprocal", "init"),  # tf2onnx: SquaredDifference as Sub, Mul; Rsqrt as Sqrt, Reciprocal
    (13, "pow", "div", "node"),  # eps as a Constant node
    (17, "mul", "rsqrt_pow", "init"),  # rsqrt as Pow(-0.5)
    (13, "mul", "keras", "init"),  # Keras: tf.nn.batch_normalization's x * inv + (beta - mean * inv)
    (18, "pow", "div", "init"),  # ReduceMean's axes as an input
    (18, "mul", "keras", "node"),
])
def test_hand_built_layernorm_forms(opset, square, inv, eps):
    r = _one_node(_ln_graph(opset=opset, square=square, inv=inv, eps=eps))
    assert _attr(_fused(r)[0], "reduction") == b"layer_norm"


def test_layernorm_over_two_trailing_dims():
    r = _one_node(_ln_graph(x_shape=(3, 4, 10), axes=(1, 2)))
    assert _attr(_fused(r)[0], "axis") == 1


def test_layernorm_fp16_large_magnitude():
    """fp16 rows of magnitude 1e4, whose squares overflow fp16: the fused node's statistics are
    fp32, its result the float64 LayerNorm's to fp16 precision."""
    m = _ln_graph(dtype=H, x_shape=(2, 3, 64))
    r = optimize_model(m, leave_to_ort=False)
    assert op_types(r.model) == ["FusedRows"]
    x = (RNG.standard_normal((2, 3, 64)) * 1e4).astype(np.float16)
    from onnxfuse.kinds.rows import Rows

    node = _fused(r)[0]
    inits = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    (y,) = Rows().evaluate(node, [x if n == "x" else inits[n] for n in node.input])
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    want = want * inits["gamma"].astype(np.float64) + inits["beta"].astype(np.float64)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_prenorm_residual_exposes_x():
    """h = a + b feeds the LayerNorm and, after a MatMul, the next residual Add: the node
    stores h too (x_output)."""
    m = _ln_graph(extra=[helper.make_node("Relu", ["y"], ["z"]), helper.make_node("MatMul", ["z", "wmm"], ["mm"]),
                         helper.make_node("Add", ["x", "mm"], ["out"])], more_inits={"wmm": _w(24, 24)})
    g = m.graph
    g.input[0].name = "a"
    g.input.append(helper.make_tensor_value_info("b", F, [2, 6, 24]))
    g.node.insert(0, helper.make_node("Add", ["a", "b"], ["x"]))
    r = check_fusion(m, expect_fused=1, leave_to_ort=True)
    assert op_types(r.model) == ["FusedRows", "MatMul", "Add"]
    node = _fused(r)[0]
    assert list(node.output) == ["z", "x"] and _attr(node, "x_output") == 1 and list(node.input)[:2] == ["a", "b"]
    assert r.fused[0].input_modes == ("full", "full", "last", "last")


def test_two_post_norm_layers():
    """LN1 -> MatMul -> + LN1 output -> LN2: the residual Add joins LN2's prologue (it would
    make a cycle in LN1's epilogue)."""
    m = _ln_graph(x_shape=(2, 5, 16))
    g = m.graph
    g.initializer.append(numpy_helper.from_array(_w(16, 16), "wmm"))
    ln2 = _ln_graph(x_shape=(2, 5, 16))
    rename = {t: f"{t}2" for n in ln2.graph.node for t in [*n.input, *n.output] if t != "x"}
    rename.update({t.name: f"{t.name}2" for t in ln2.graph.initializer})
    for n in ln2.graph.node:
        n.input[:] = [rename.get(t, t) for t in n.input]
        n.output[:] = [rename.get(t, t) for t in n.output]
    for t in ln2.graph.initializer:
        if t.name in rename:
            t.name = rename[t.name]
        g.initializer.append(t)
    g.node.extend([helper.make_node("MatMul", ["y", "wmm"], ["mm"]), helper.make_node("Add", ["mm", "y"], ["h"])])
    for n in ln2.graph.node:
        n.input[:] = ["h" if t == "x" else t for t in n.input]
        g.node.append(n)
    g.output[0].name = "y2"
    r = check_fusion(m, expect_fused=2, leave_to_ort=False)
    assert op_types(r.model) == ["FusedRows", "MatMul", "FusedRows"]
    first, second = _fused(r)
    assert list(first.output) == ["y"] and "mm" in second.input and "y" in second.input


# ---------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------

class _RMSNorm:
    @staticmethod
    def module(form: str, d: int):
        torch = pytest.importorskip("torch")

        class RMSNorm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(d))

            def forward(self, x):
                if form == "rsqrt":
                    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
                if form == "div":
                    return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
                h = x.to(torch.float32)  # LlamaRMSNorm
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                return self.weight * h.to(x.dtype)

        return RMSNorm()


@pytest.mark.parametrize("form", ["rsqrt", "div", "llama"])
def test_torch_rmsnorm(form):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = _torch_export(_RMSNorm.module(form, 40), (torch.randn(2, 3, 40),), 14)
    r = _one_node(m)
    assert _attr(_fused(r)[0], "reduction") == b"rms_norm"
    kept = optimize_model(m)  # ONNX Runtime makes it SimplifiedLayerNormalization
    assert any("SimplifiedLayerNormalization" in k for k in kept.report.not_fused)


def test_rmsnorm_pow_minus_half_with_residual_and_cast():
    """fp16 residual add, Cast up, x * Pow(mean(x^2) + eps, -0.5), Cast down, weight."""
    inits = {"two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32),
             "mh": np.array(-0.5, np.float32), "w": _w(64).astype(np.float16)}
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]), helper.make_node("Cast", ["h"], ["hf"], to=F),
             helper.make_node("Pow", ["hf", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
             helper.make_node("Add", ["ms", "eps"], ["me"]), helper.make_node("Pow", ["me", "mh"], ["r"]),
             helper.make_node("Mul", ["hf", "r"], ["n"]), helper.make_node("Cast", ["n"], ["nh"], to=H),
             helper.make_node("Mul", ["nh", "w"], ["y"])]
    m = model(nodes, {"a": ("float16", [3, 64]), "b": ("float16", [3, 64])}, {"y": ("float16", [3, 64])}, inits,
              opset=13)
    r = _one_node(m, rtol=1e-2)
    node = _fused(r)[0]
    assert list(node.input)[:2] == ["a", "b"]
    assert "%2 = add %0 %1" in _attr(node, "prologue").decode()


def _rms_nodes(x: str, w: str, y: str, tag: str) -> list[onnx.NodeProto]:
    """x * (1 / sqrt(mean(x^2) + eps)) * w as torch writes Gemma 2's norms (node names tagged)."""
    t = lambda s: f"{s}{tag}"  # noqa: E731
    return [helper.make_node("Pow", [x, "two"], [t("sq")]),
            helper.make_node("ReduceMean", [t("sq")], [t("ms")], axes=[-1]),
            helper.make_node("Add", [t("ms"), "eps"], [t("me")]), helper.make_node("Sqrt", [t("me")], [t("s")]),
            helper.make_node("Div", ["one", t("s")], [t("inv")]), helper.make_node("Mul", [x, t("inv")], [t("n")]),
            helper.make_node("Mul", [t("n"), w], [y])]


@pytest.mark.parametrize("leave_to_ort", [False, True])
def test_sandwich_norms_each_keep_their_core(leave_to_ort):
    """Gemma 2's post-attention norm ends in the residual add whose square begins the next
    norm (h = r + norm1(a); y = norm2(h)): the square is the second norm's, not an epilogue node
    of the first, so both norms fuse (with leave_to_ort the second is wholly ONNX Runtime's
    SimplifiedLayerNormalization and left to it, whole). Before, the first norm's epilogue took
    Pow(h, 2) and left the second's ReduceMean, Add, Sqrt, Div and both Muls unfused."""
    inits = {"two": np.array(2.0, np.float32), "eps": np.array(1e-6, np.float32), "one": np.array(1.0, np.float32),
             "w1": _w(32), "w2": _w(32)}
    nodes = [*_rms_nodes("a", "w1", "n1", "_a"), helper.make_node("Add", ["r", "n1"], ["h"]),
             *_rms_nodes("h", "w2", "y", "_b")]
    m = model(nodes, {"a": ("float32", [2, 5, 32]), "r": ("float32", [2, 5, 32])},
              {"y": ("float32", [2, 5, 32]), "h": ("float32", [2, 5, 32])}, inits, opset=17)
    r = check_fusion(m, expect_fused=1 if leave_to_ort else 2, leave_to_ort=leave_to_ort)
    first = _fused(r)[0]
    assert list(first.output) == ["h"], first  # the residual sum, not its square too
    if leave_to_ort:
        assert sorted(op_types(r.model)) == ["Add", "Div", "FusedRows", "Mul", "Mul", "Pow", "ReduceMean", "Sqrt"]
    else:
        assert op_types(r.model) == ["FusedRows", "FusedRows"]
        assert list(_fused(r)[1].input)[0] == "h"


def _rms_op(op: str, domain: str = "", opset: int = 17, dtype=F, scale_shape=(32,), axis=-1,
            out2: bool = False) -> onnx.ModelProto:
    outs = ["y", "inv"] if out2 else ["y"]
    nodes = [helper.make_node("Add", ["a", "b"], ["x"]),
             helper.make_node(op, ["x", "w"], outs, domain=domain, axis=axis, epsilon=1e-6),
             helper.make_node("Relu", ["y"], ["z"])]
    graph_outs = [helper.make_tensor_value_info("z", dtype, [4, 32])]
    if out2:
        graph_outs.append(helper.make_tensor_value_info("inv", F, None))
    g = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info(n, dtype, [4, 32]) for n in "ab"], graph_outs,
                          [numpy_helper.from_array(_w(*scale_shape).astype(np.float32 if dtype == F else np.float16),
                                                   "w")])
    # ONNX's shape inference does not know ONNX Runtime's op: the exporter's value_info types y
    g.value_info.append(helper.make_tensor_value_info("y", dtype, [4, 32]))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 10
    return m


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_simplified_layernorm_op_is_declined(domain):
    """ONNX Runtime registers SimplifiedLayerNormalization in the ONNX domain (some tools write it
    in com.microsoft, which ORT cannot run); 1.32 segfaults running it inside a function body,
    the fused node's fallback: recognized and declined, with the reason."""
    r = optimize_model(_rms_op("SimplifiedLayerNormalization", domain=domain), leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(NOT_IN_FUNCTIONS) == 1


def test_rmsnormalization_op_opset23():
    _one_node(_rms_op("RMSNormalization", opset=23))


# ---------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------

def test_torch_attention_softmax_scale_and_mask():
    torch = pytest.importorskip("torch")

    class Scores(torch.nn.Module):
        def forward(self, q, k, mask):
            return torch.softmax((q @ k.transpose(-1, -2)) / 8.0 + mask, -1)

    m = _torch_export(Scores(), (torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 1, 1, 7)), 14)
    r = check_fusion(m, expect_fused=1, leave_to_ort=False)
    assert op_types(r.model) == ["Transpose", "MatMul", "FusedRows"]
    node = _fused(r)[0]
    assert _attr(node, "reduction") == b"softmax" and r.fused[0].input_modes == ("full", "strided")
    # ONNX Runtime's FusedMatMul takes the scale; the mask Add and the softmax still fuse
    kept = optimize_model(m)
    assert op_types(kept.model) == ["Transpose", "MatMul", "Div", "FusedRows"]


def _softmax_graph(op="Softmax", opset=13, axis=-1, shape=(2, 3, 5, 9), mask="add", cast=False):
    nodes = [helper.make_node("Mul", ["s", "scale"], ["t"])]
    inputs = {"s": ("float32", list(shape))}
    if mask in ("add", "full"):
        nodes.append(helper.make_node("Add", ["t", "mask"], ["a"]))
        inputs["mask"] = ("float32", [shape[0], 1, 1, shape[-1]] if mask == "add" else list(shape))
    else:  # a bool mask as HF exports it: Where(mask, -inf, scores)
        nodes.append(helper.make_node("Where", ["mask", "ninf", "t"], ["a"]))
        inputs["mask"] = ("bool", [shape[0], 1, shape[2], shape[-1]])
    nodes.append(helper.make_node(op, ["a"], ["y"], axis=axis))
    out = "y"
    if cast:
        nodes.append(helper.make_node("Cast", ["y"], ["yh"], to=H))
        out = "yh"
    inits = {"scale": np.array(0.125, np.float32), "ninf": np.array(-np.inf, np.float32)}
    return model(nodes, inputs, {out: ("float16" if cast else "float32", list(shape))}, inits, opset=opset)


@pytest.mark.parametrize("op,mask,cast", [("Softmax", "add", False), ("Softmax", "where", True),
                                          ("LogSoftmax", "add", False)])
def test_softmax_forms(op, mask, cast):
    r = _one_node(_softmax_graph(op, mask=mask, cast=cast), leave_to_ort=True)
    assert _attr(_fused(r)[0], "reduction") == (b"softmax" if op == "Softmax" else b"log_softmax")


def _written_softmax(form="div", opset=13, scale=True, exp_outside=False, stable=True):
    """A softmax over the last axis written out: ReduceMax -> Sub -> Exp -> ReduceSum ->
    Div (or Mul by a Reciprocal), after a scale; as jax2tf writes it (Google's Magika)."""
    shape = (2, 3, 11)
    nodes = [helper.make_node("Mul", ["s", "scale"], ["a"])] if scale else [helper.make_node("Identity", ["s"], ["a"])]
    inits = {"scale": np.array(0.125, np.float32), "axes": np.array([-1], np.int64)}
    if stable:
        nodes += [helper.make_node("ReduceMax", ["a"], ["m"], axes=[-1]),
                  helper.make_node("Sub", ["a", "m"], ["d"])]
    nodes.append(helper.make_node("Exp", ["d" if stable else "a"], ["e"]))
    nodes.append(helper.make_node("ReduceSum", ["e", "axes"], ["t"]))
    if form == "div":
        nodes.append(helper.make_node("Div", ["e", "t"], ["y"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["t"], ["rt"]), helper.make_node("Mul", ["e", "rt"], ["y"])]
    outputs = {"y": ("float32", list(shape))}
    if exp_outside:
        outputs["e"] = ("float32", list(shape))
    return model(nodes, {"s": ("float32", list(shape))}, outputs, inits, opset=opset)


@pytest.mark.parametrize("form", ["div", "reciprocal"])
def test_written_out_softmax_fuses_as_the_softmax(form):
    r = _one_node(_written_softmax(form))
    assert _attr(_fused(r)[0], "reduction") == b"softmax"
    # alone (nothing before or after it) it still fuses: five nodes are worth one kernel
    r = _one_node(_written_softmax(form, scale=False))
    assert _attr(_fused(r)[0], "reduction") == b"softmax"


def test_written_out_softmax_as_jax2tf_writes_it():
    """Google's Magika (jax2tf, tf2onnx): the max and the sum with keepdims 0, the max through
    Max(-inf, .), each back through a Reshape and an Expand; with a bias Add before it."""
    n, k = 4, 13
    inits = {"b": _w(k), "ninf": np.array(-np.inf, np.float32), "kept": np.array([n, 1], np.int64),
             "axes": np.array([1], np.int64)}
    nodes = [helper.make_node("Add", ["s", "b"], ["a"]),
             helper.make_node("ReduceMax", ["a"], ["m0"], axes=[1], keepdims=0),
             helper.make_node("Max", ["ninf", "m0"], ["m1"]),
             helper.make_node("Reshape", ["m1", "kept"], ["m2"]),
             helper.make_node("Expand", ["m2", "kept"], ["m"]),
             helper.make_node("Sub", ["a", "m"], ["d"]),
             helper.make_node("Exp", ["d"], ["e"]),
             helper.make_node("ReduceSum", ["e", "axes"], ["t0"], keepdims=0),
             helper.make_node("Reshape", ["t0", "kept"], ["t1"]),
             helper.make_node("Expand", ["t1", "kept"], ["t"]),
             helper.make_node("Div", ["e", "t"], ["y"])]
    m = model(nodes, {"s": ("float32", [n, k])}, {"y": ("float32", [n, k])}, inits, opset=13)
    r = _one_node(m)
    assert _attr(_fused(r)[0], "reduction") == b"softmax"


def test_written_out_softmax_that_does_not_fuse():
    r = optimize_model(_written_softmax(exp_outside=True), leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(STAT_OUTSIDE) == 1, r.report.summary()
    # without the max subtracted it is not taken for a softmax (its overflow is the graph's)
    r = optimize_model(_written_softmax(stable=False), leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model), r.report.summary()


def test_softmax_before_opset13_over_trailing_dims():
    """Opset 11's Softmax(axis=1) normalizes over all dims from 1 on (coerced to 2-D): rows of
    3 * 5 * 9 elements."""
    r = _one_node(_softmax_graph(opset=11, axis=1, mask="full"))
    assert _attr(_fused(r)[0], "axis") == 1
    # a mask [B, 1, 1, S] varies within those dims without spanning them: only the softmax would fuse
    r = optimize_model(_softmax_graph(opset=11, axis=1), leave_to_ort=False)
    assert op_types(r.model) == ["PointwiseChain", "Softmax"] and r.report.not_fused == {LONE: 1}
    assert _one_node(_softmax_graph(opset=11, axis=-1))


def test_softmax_over_another_axis_does_not_fuse():
    r = optimize_model(_softmax_graph(opset=13, axis=1), leave_to_ort=False)
    assert "Softmax" in op_types(r.model) and r.report.not_fused.get(NOT_LAST) == 1


# ---------------------------------------------------------------------------------------
# What does not fuse, and why
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,reason", [
    ({"axes": (1,), "x_shape": (2, 6, 24)}, NOT_LAST),
    ({"keepdims": 0}, NO_KEEPDIMS),
    ({"eps": "input"}, EPS_NOT_CONSTANT),
])
def test_layernorm_that_does_not_fuse(kwargs, reason):
    r = optimize_model(_ln_graph(**kwargs), leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model), r.report.summary()
    assert r.report.not_fused.get(reason) == 2  # both ReduceMeans


def _moments_ln(reduce: str, keepdims: int, n: int = 6, d: int = 16) -> onnx.ModelProto:
    """A LayerNorm written as E[x^2] - E[x]^2: the sums (ReduceSum, then a product by 1/n) or
    means of x and x * x, var = max(0, E[x^2] - E[x]^2), and with keepdims 0 a Reshape back,
    as flax's LayerNorm through jax2tf and tf2onnx writes it (Google's Magika on PyPI)."""
    inits = {"inv_n": np.array(1.0 / d if reduce == "ReduceSum" else 1.0, np.float32),
             "zero": np.array(0.0, np.float32), "eps": np.array(1e-6, np.float32),
             "axes": np.array([1], np.int64), "gamma": _w(d), "beta": _w(d)}
    if not keepdims:
        inits["kept"] = np.array([n, 1], np.int64)
    nodes = [
        helper.make_node(reduce, ["x", "axes"], ["s1"], keepdims=keepdims),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node(reduce, ["sq", "axes"], ["s2"], keepdims=keepdims),
        helper.make_node("Mul", ["s1", "inv_n"], ["m1"]),
        helper.make_node("Mul", ["s2", "inv_n"], ["m2"]),
        helper.make_node("Mul", ["m1", "m1"], ["m1sq"]),
        helper.make_node("Sub", ["m2", "m1sq"], ["v0"]),
        helper.make_node("Max", ["zero", "v0"], ["var" if keepdims else "v1"]),
    ]
    if not keepdims:
        nodes += [helper.make_node("Reshape", ["v1", "kept"], ["var"]),
                  helper.make_node("Reshape", ["m1", "kept"], ["mean"])]
    nodes += [
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Reciprocal", ["sd"], ["inv"]),
        helper.make_node("Mul", ["inv", "gamma"], ["scale"]),
        helper.make_node("Sub", ["x", "mean" if not keepdims else "m1"], ["c"]),
        helper.make_node("Mul", ["c", "scale"], ["cs"]),
        helper.make_node("Add", ["cs", "beta"], ["y"]),
    ]
    opset = 13 if reduce == "ReduceSum" else 18  # (both take their axes as an input)
    return model(nodes, {"x": ("float32", [n, d])}, {"y": ("float32", [n, d])}, inits, opset=opset)


@pytest.mark.parametrize("reduce", ["ReduceSum", "ReduceMean"])
def test_layernorm_in_the_moments_form_fuses(reduce):
    """keepdims 1 over the last dim: one FusedRows node whose kernel's mean and var give the
    graph's sums (or means) of x and x * x back, the epilogue computing E[x^2] - E[x]^2 as
    the graph does; the same outputs as the original."""
    r = _one_node(_moments_ln(reduce, 1))
    assert _attr(_fused(r)[0], "reduction") == b"layer_norm"


def test_layernorm_in_the_moments_form_with_keepdims_0_is_reported():
    r = check_fusion(_moments_ln("ReduceSum", 0), leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model), r.report.summary()
    assert r.report.not_fused.get(MOMENTS_FORM) == 2, r.report.summary()


def test_layernorm_op_with_mean_output_used():
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean"], axis=-1),
             helper.make_node("Relu", ["y"], ["z"])]
    m = model(nodes, {"x": ("float32", [4, 16])}, {"z": ("float32", [4, 16]), "mean": ("float32", [4, 1])},
              {"g": _w(16), "b": _w(16)}, opset=17)
    r = optimize_model(m, leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(EXTRA_OUTPUTS) == 1


def test_layernorm_op_scale_varying_within_the_normalized_dims():
    """axis 1 of [4, 6, 5] with a scale of shape [6, 1]: it varies along the normalized dims
    without spanning them, which the kernel cannot read per element."""
    nodes = [helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=1),
             helper.make_node("Relu", ["y"], ["z"])]
    m = model(nodes, {"x": ("float32", [4, 6, 5])}, {"z": ("float32", [4, 6, 5])}, {"g": _w(6, 1)}, opset=17)
    r = optimize_model(m, leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(NOT_BROADCAST) == 1


def test_gamma_varying_within_the_normalized_dims_stays_outside():
    """A decomposed LayerNorm over [6, 5] whose gamma is [6, 1]: the norm fuses, the Mul by
    gamma does not join its epilogue."""
    m = _ln_graph(x_shape=(4, 6, 5), axes=(1, 2), affine=False,
                  extra=[helper.make_node("Mul", ["n", "g61"], ["y"])], more_inits={"g61": _w(6, 1)})
    r = check_fusion(m, expect_fused=1, leave_to_ort=False)
    assert op_types(r.model) == ["FusedRows", "Mul"]


def test_statistic_read_outside():
    m = _ln_graph(extra=[helper.make_node("Add", ["y", "mean"], ["z"])])
    m.graph.node.insert(0, helper.make_node("Identity", ["x"], ["x_copy"]))
    m.graph.output.append(helper.make_tensor_value_info("var", F, [2, 6, 1]))
    r = optimize_model(m, leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(STAT_OUTSIDE) == 2


def test_float64_variance_does_not_fuse():
    """torch's fp16 LayerNorm at opsets below 17 squares in float64: recognized, declined."""
    torch = pytest.importorskip("torch")
    m = _torch_export(torch.nn.LayerNorm(16).half(), (torch.randn(2, 16).half(),), 13)
    r = optimize_model(m, leave_to_ort=False)
    assert "FusedRows" not in op_types(r.model)
    assert r.report.not_fused.get("its variance is float64 dtype (a Cast before the square)") == 2


# ---------------------------------------------------------------------------------------
# ONNX Runtime's fusions (leave_to_ort, the default)
# ---------------------------------------------------------------------------------------

def test_ort_rules():
    # everything ONNX Runtime fuses itself (LayerNormalization): left to it
    plain = optimize_model(_ln_graph())
    assert "FusedRows" not in op_types(plain.model)
    left = [k for k in plain.report.not_fused if "(it fuses every node" in k]
    assert left == ["left to ONNX Runtime's LayerNormalization fusion (it fuses every node of this normalization "
                    "or softmax)"] and plain.report.not_fused[left[0]] == 2
    # a Relu after it, which ONNX Runtime does not fuse: the kernel takes the norm's nodes too
    more = check_fusion(_ln_graph(extra=[helper.make_node("Relu", ["y"], ["z"])]), expect_fused=1)
    assert op_types(more.model) == ["FusedRows"]
    assert more.report.notes == {"taken from ONNX Runtime's LayerNormalization fusion: the fused kernel also fuses "
                                 "work ONNX Runtime does not (prologue or epilogue)": 10}
    assert "notes:" in more.report.summary()
    # LayerNormalization after a residual Add: SkipLayerNormalization, ONNX Runtime's
    nodes = [helper.make_node("Add", ["a", "b"], ["x"]),
             helper.make_node("LayerNormalization", ["x", "g", "be"], ["y"], axis=-1, epsilon=1e-5)]
    m = model(nodes, {"a": ("float32", [2, 4, 32]), "b": ("float32", [2, 4, 32])}, {"y": ("float32", [2, 4, 32])},
              {"g": _w(32), "be": _w(32)}, opset=17)
    skip = optimize_model(m)
    assert op_types(skip.model) == ["Add", "LayerNormalization"]
    assert any("SkipLayerNormalization fusion (it fuses every node" in k for k in skip.report.not_fused)
    assert op_types(optimize_model(m, leave_to_ort=False).model) == ["FusedRows"]


def test_ort_normalizations_are_offered_to_tuning(tmp_path, monkeypatch):
    """Where the tune pass runs (a GPU), a LayerNorm that ONNX Runtime fuses whole (its
    LayerNormalization, the residual Add's SkipLayerNormalization) becomes a FusedRows node
    that tuning times against ORT's fusion and keeps only where faster (`Match.measured_only`,
    `pipeline.TIMED_AGAINST_ORT`); when the tuning fails, it goes back to ONNX Runtime."""
    pytest.importorskip("triton")
    import dataclasses

    from onnxfuse import tune as tuning
    from onnxfuse.pipeline import UNTUNED_OFFERED, build_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path))
    options = dataclasses.replace(build_options(target="sm_90", layout="nchw", tune="off"),
                                  tune=tuning.TuneSettings(budget_s=1.0))
    nodes = [helper.make_node("Add", ["a", "b"], ["x"]),
             helper.make_node("LayerNormalization", ["x", "g", "be"], ["y"], axis=-1, epsilon=1e-5)]
    skip = model(nodes, {"a": ("float32", [2, 4, 32]), "b": ("float32", [2, 4, 32])}, {"y": ("float32", [2, 4, 32])},
                 {"g": _w(32), "be": _w(32)}, opset=17)
    kept = []

    def keep_all(result, before, info, *args, **kwargs):  # a tuning that measured every node faster
        kept.extend((f.kind, f.measured_only) for f in result.fused)
        return info

    monkeypatch.setattr(tuning, "tune", keep_all)
    for m in (_ln_graph(), skip):
        kept.clear()
        r = optimize_model(m, options=options)
        assert op_types(r.model) == ["FusedRows"] and kept == [("rows", True)], r.report.summary()

    def fail(*args, **kwargs):
        raise RuntimeError("no GPU in this test")

    monkeypatch.setattr(tuning, "tune", fail)
    for m, ops, count in ((_ln_graph(), None, 9), (skip, ["Add", "LayerNormalization"], 2)):
        with pytest.warns(Warning, match="not tuned"):
            r = optimize_model(m, options=options)
        assert "FusedRows" not in op_types(r.model) and r.report.not_fused.get(UNTUNED_OFFERED) == count, \
            r.report.summary()
        if ops:
            assert op_types(r.model) == ops
