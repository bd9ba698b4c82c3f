"""Attentions over merged heads ([B * H, S, D] products, onnxfuse.heads): lifted to [B, H, ...]
so that they fuse, as torch modules written the way Hugging Face transformers 4's encoder-decoder
families (BART, Marian, Whisper) and BLOOM write them, exported by torch's exporters, static and
dynamic; and graphs where the lift must not happen."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.pipeline import build_options
from tests.test_attention_patterns import _run_with_library
from tests.util import model, op_types, run

N = helper.make_node
B, S, H, D = 2, 7, 4, 8
LIFTED = "rewritten over [B, H, S, D]"


def _module(style: str):
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class MergedHeads(nn.Module):
        """One attention block over merged heads. "bart": transformers 4's BartAttention (q
        scaled before the product, the mask added to a [B, H, S, S] view, the softmax over [B * H,
        S, S]); "xsoftmax": transformers 4's DeBERTa-v2 (the masked scores set to the lowest
        float, the softmax, then the masked probabilities set to 0); "alibi": BLOOM's (baddbmm of
        an ALiBi bias [B * H, 1, S] and the scaled product, the causal mask added to the view, the
        softmax in float32 on it)."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v, self.o = (nn.Linear(H * D, H * D) for _ in range(4))
            self.slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])

        def forward(self, x, mask):
            b, s, _ = x.shape

            def heads(t):
                return t.view(b, s, H, D).transpose(1, 2).reshape(b * H, s, D)

            q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
            keep = mask[:, None, None, :].to(x.dtype)
            if style == "bart":
                w = torch.bmm(q * D ** -0.5, k.transpose(1, 2))
                w = w.view(b, H, s, s) + (1.0 - keep) * -10000.0
                p = torch.softmax(w.view(b * H, s, s), dim=-1)
            elif style == "xsoftmax":  # padded queries' rows all masked: their probabilities 0
                rmask = ~(mask[:, None, :, None] * mask[:, None, None, :]).bool()
                w = torch.bmm(q, k.transpose(1, 2) / D ** 0.5).view(b, H, s, s)
                p = torch.softmax(w.masked_fill(rmask, torch.finfo(x.dtype).min), dim=-1)
                p = p.masked_fill(rmask, 0.0).view(b * H, s, s)
            else:
                pos = (torch.cumsum(mask, dim=-1) - 1).to(x.dtype)[:, None, :]  # [b, 1, s]
                alibi = (self.slopes[None, :, None] * pos).reshape(b * H, 1, s)
                w = alibi.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=D ** -0.5)
                causal = torch.ones(s, s, dtype=torch.bool).tril()
                w = w.view(b, H, s, s).masked_fill(~causal, torch.finfo(x.dtype).min)
                p = torch.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype).view(b * H, s, s)
            y = torch.bmm(p, v).view(b, H, s, D).transpose(1, 2).reshape(b, s, H * D)
            return self.o(y)

    return torch, MergedHeads().eval()


def _export(style: str, exporter: str, dynamic: bool) -> onnx.ModelProto:
    torch, mod = _module(style)
    args = (torch.randn(B, S, H * D), torch.ones(B, S, dtype=torch.int64))
    with torch.no_grad():
        if exporter == "dynamo":
            pytest.importorskip("onnxscript")
            dims = None
            if dynamic:
                b, s = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
                dims = {"x": {0: b, 1: s}, "mask": {0: b, 1: s}}
            return torch.onnx.export(mod, args, input_names=["x", "mask"], output_names=["y"], opset_version=18,
                                     dynamo=True, verbose=False, dynamic_shapes=dims).model_proto
        f = io.BytesIO()
        axes = {n: {0: "batch", 1: "seq"} for n in ("x", "mask")} if dynamic else None
        torch.onnx.export(mod, args, f, opset_version=17, dynamo=False, input_names=["x", "mask"],
                          output_names=["y"], dynamic_axes=axes)
    return onnx.load_from_string(f.getvalue())


def _feeds(b: int, s: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.ones((b, s), np.int64)
    mask[0, s - 2:] = 0  # padding in the first sequence (xsoftmax: its last two rows all masked)
    return {"x": rng.standard_normal((b, s, H * D)).astype(np.float32), "mask": mask}


@pytest.mark.parametrize("style", ["bart", "xsoftmax", "alibi"])
@pytest.mark.parametrize("exporter,dynamic", [("torchscript", False), ("torchscript", True), ("dynamo", False)])
def test_merged_heads_fuse_as_one_attention(style, exporter, dynamic):
    """The block's attention becomes one FusedAttention: no Softmax, no product of the scores,
    no Transpose of the heads left; the ALiBi bias is the node's extra input (viewed, not copied).
    The optimized model, through the library's CPU kernels, computes what the original does (at
    the export's shape, and a dynamic export at another)."""
    m = _export(style, exporter, dynamic)
    shapes = None if dynamic else {"x": (B, S, H * D), "mask": (B, S)}
    r = optimize_model(m, options=build_options(target="none", tune="off", shapes=shapes))
    ops = op_types(r.model)
    assert ops.count("FusedAttention") == 1 and "Softmax" not in ops, r.report.summary()
    assert "Transpose" not in ops and ops.count("MatMul") <= 2, ops  # the projections (packed: two)
    assert LIFTED in r.report.summary()
    for b, s in ((B, S), (3, 5)) if dynamic else ((B, S),):
        feeds = _feeds(b, s)
        for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def _bmm_attention(p_nodes=(), scores_out: bool = False, extra_shape=(B * H, 1, S)) -> onnx.ModelProto:
    """q, k, v [B * H, S, D]: Q @ K^T, an extra added, viewed as [B, H, S, S] for a mask, softmax
    there, viewed back, `p_nodes` from "p3" to "pv", P @ V, viewed as [B, H, S, D]."""
    nodes = [N("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), N("MatMul", ["q", "kt"], ["s"]),
             N("Add", ["s", "extra"], ["a"]), N("Reshape", ["a", "four"], ["a4"]), N("Add", ["a4", "mask"], ["m4"]),
             N("Softmax", ["m4"], ["p4"], axis=-1), N("Reshape", ["p4", "three"], ["p3"]), *p_nodes,
             N("MatMul", ["pv", "v"], ["o"]), N("Reshape", ["o", "out"], ["y"])]
    if not p_nodes:
        nodes = [n if n.op_type != "MatMul" or n.input[0] != "pv" else N("MatMul", ["p3", "v"], ["o"]) for n in nodes]
    inits = {"four": np.array([B, H, S, S], np.int64), "three": np.array([B * H, S, S], np.int64),
             "out": np.array([B, H, S, D], np.int64)}
    outputs = {"y": ("float32", [B, H, S, D])} | ({"s": ("float32", [B * H, S, S])} if scores_out else {})
    return model(nodes, {"q": ("float32", [B * H, S, D]), "k": ("float32", [B * H, S, D]),
                         "v": ("float32", [B * H, S, D]), "extra": ("float32", list(extra_shape)),
                         "mask": ("float32", [B, 1, 1, S])}, outputs, inits, opset=17)


def _random(m, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


@pytest.mark.parametrize("extra_shape", [(B * H, 1, S), (1, S, S), (S,)])
def test_a_graph_over_merged_heads_fuses(extra_shape):
    """The extra [B * H, 1, S] is viewed as [B, H, 1, S], a [1, S, S] one unsqueezed, a [S] one
    read as it is; the Reshapes go, the output view writes y directly."""
    m = _bmm_attention(extra_shape=extra_shape)
    r = optimize_model(m, options=build_options(target="none", tune="off"))
    ops = op_types(r.model)
    assert "FusedAttention" in ops and not {"Softmax", "MatMul", "Transpose"} & set(ops), ops
    feeds = _random(m)
    for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["scores read elsewhere", "probabilities rounded"])
def test_no_lift_where_the_attention_would_not_fuse(case):
    """The scores a graph output (not lifted); P rounded to float16 before P @ V (lifted, but the
    attention declines it, so the lift is given back): the model keeps its nodes as they were
    and computes what it did."""
    if case == "scores read elsewhere":
        m = _bmm_attention(scores_out=True)
    else:
        m = _bmm_attention(p_nodes=[N("Cast", ["p3"], ["p16"], to=onnx.TensorProto.FLOAT16),
                                    N("Cast", ["p16"], ["pv"], to=onnx.TensorProto.FLOAT)])
    r = optimize_model(m, options=build_options(target="none", tune="off"))
    assert LIFTED not in r.report.summary()
    ops = op_types(r.model)
    assert "FusedAttention" not in ops and ops.count("Reshape") == 3, ops
    feeds = _random(m)
    for w, g in zip(run(m, feeds), run(r.model, feeds), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_a_cached_decoder_step_over_merged_heads_fuses(masked):
    """transformers 4's BART decoder step with a key-value cache (as optimum exported
    decoder_model_merged / with_past): the cached keys and values [B, H, P, D] concatenated with
    the new ones, merged to [B * H, P + 1, D] for the products; batch and cache length dynamic.
    Without a mask no Reshape sits between the products: the attention fuses over [B * H, ...]
    as it is (rank 3), and one optimized model computes what the original does at two cache
    lengths and batches. With a mask (added to the [B, H, 1, P + 1] view, its length an input dim
    of its own) the attention is lifted first, at given shapes (`--shape`): dynamic, the mask's
    length and P + 1 meet in the Add, ONNX Runtime's symbolic inference merges them, that merge
    is refused (`load._merge_holds`: two inputs' dims), and B * H stays unknown."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.q, self.k, self.v, self.o = (nn.Linear(H * D, H * D) for _ in range(4))

        def forward(self, x, past_k, past_v, mask):
            b, s, _ = x.shape

            def split(t):
                return t.view(b, s, H, D).transpose(1, 2)

            k = torch.cat([past_k, split(self.k(x))], dim=2)  # [b, H, P + s, D]
            v = torch.cat([past_v, split(self.v(x))], dim=2)
            total = k.shape[2]
            q = (split(self.q(x)) * D ** -0.5).reshape(b * H, s, D)
            w = torch.bmm(q, k.reshape(b * H, total, D).transpose(1, 2))
            if masked:
                w = (w.view(b, H, s, total) + mask).view(b * H, s, total)
            p = torch.softmax(w, dim=-1)
            y = torch.bmm(p, v.reshape(b * H, total, D)).view(b, H, s, D).transpose(1, 2).reshape(b, s, H * D)
            return self.o(y), k, v

    mod = Step().eval()
    args = (torch.randn(B, 1, H * D), torch.randn(B, H, 5, D), torch.randn(B, H, 5, D), torch.zeros(B, 1, 1, 6))
    f = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(mod, args, f, opset_version=17, dynamo=False,
                          input_names=["x", "past_k", "past_v", "mask"], output_names=["y", "k", "v"],
                          dynamic_axes={"x": {0: "batch"}, "past_k": {0: "batch", 2: "past"},
                                        "past_v": {0: "batch", 2: "past"}, "mask": {0: "batch", 3: "total"}})
    m = onnx.load_from_string(f.getvalue())
    shapes = {"x": (B, 1, H * D), "past_k": (B, H, 5, D), "past_v": (B, H, 5, D), "mask": (B, 1, 1, 6)}
    r = optimize_model(m, options=build_options(target="none", tune="off", shapes=shapes if masked else None))
    ops = op_types(r.model)
    assert ops.count("FusedAttention") == 1 and "Softmax" not in ops and ops.count("MatMul") <= 4, r.report.summary()
    assert (LIFTED in r.report.summary()) == masked
    rng = np.random.default_rng(2)
    for b, past in ((B, 5),) if masked else ((B, 5), (3, 11)):
        feeds = {"x": rng.standard_normal((b, 1, H * D)).astype(np.float32),
                 "past_k": rng.standard_normal((b, H, past, D)).astype(np.float32),
                 "past_v": rng.standard_normal((b, H, past, D)).astype(np.float32)}
        if masked:  # the first sequence's oldest two positions masked
            feeds["mask"] = np.zeros((b, 1, 1, past + 1), np.float32)
            feeds["mask"][0, ..., :2] = -10000.0
        else:
            feeds = {k: v for k, v in feeds.items() if k in {i.name for i in m.graph.input}}
        for w, g in zip(run(m, feeds), _run_with_library(r.model, feeds), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))
