"""Transformer blocks of families the suite does not hold, exported by torch (TorchScript, opset
17) and optimized at static shapes: what fuses, and that the fused model, run by the custom-op
library's CPU kernels, computes what the original computes under ONNX Runtime.

- a LLaMA-style decoder: RMSNorm as LlamaRMSNorm writes it (fp32 cast, pow, mean, rsqrt,
  weight), rotary embeddings (rotate_half: two Slices, Neg, Concat) on Q and K, causal
  attention (scaled_dot_product_attention with is_causal, and written out with a -inf upper
  triangle), a SwiGLU MLP (silu(x W1) * x W3);
- a T5-style encoder: RMSNorm without the mean subtraction, unscaled scores plus a learned
  position bias [1, H, S, S] and a padding mask, a softmax in fp32.

Tolerance: |y - y_ort| <= 1e-5 max|y_ort| + 1e-5 (seen: 7e-7 to 1.2e-6 on outputs of scale 4-5).
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

D, H, S, B = 128, 2, 24, 2
HD = D // H


class RMSNorm(torch.nn.Module):
    def __init__(self, llama: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(D) + 0.5)
        self.llama = llama

    def forward(self, x):
        if self.llama:  # LlamaRMSNorm
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.w * h.to(x.dtype)
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)  # T5LayerNorm
        return self.w * (x * torch.rsqrt(var + 1e-6))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_every_two(x):  # GPT-J's (Cohere's and GLM's rotate_half): the pairs' interleaved form
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class LlamaBlock(torch.nn.Module):
    def __init__(self, attention: str, kv_heads: int = H, rotary: int = HD, interleaved: bool = False):
        super().__init__()
        self.attention, self.kv_heads, self.rotary = attention, kv_heads, rotary
        self.rotate = _rotate_every_two if interleaved else _rotate_half
        self.n1, self.n2 = RMSNorm(True), RMSNorm(True)
        self.q, self.o = (torch.nn.Linear(D, D, bias=False) for _ in range(2))
        self.k, self.v = (torch.nn.Linear(D, kv_heads * HD, bias=False) for _ in range(2))
        self.gate, self.up = torch.nn.Linear(D, 3 * D, bias=False), torch.nn.Linear(D, 3 * D, bias=False)
        self.down = torch.nn.Linear(3 * D, D, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
        t = torch.arange(S).float()[:, None] * inv[None]
        angles = t.repeat_interleave(2, -1) if interleaved else torch.cat((t, t), -1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        h = self.n1(x)
        b, t, _ = h.shape
        q = self.q(h).view(b, t, H, HD).transpose(1, 2)
        k, v = (p(h).view(b, t, self.kv_heads, HD).transpose(1, 2) for p in (self.k, self.v))
        if self.rotary == HD:
            q = q * self.cos + self.rotate(q) * self.sin
            k = k * self.cos + self.rotate(k) * self.sin
        else:  # partial rotary (GPT-NeoX, Phi, StableLM): the first `rotary` dims of each head
            r = self.rotary
            q, k = (torch.cat((x[..., :r] * self.cos + self.rotate(x[..., :r]) * self.sin, x[..., r:]), dim=-1)
                    for x in (q, k))
        if self.kv_heads != H:  # grouped-query attention: Hugging Face's repeat_kv
            rep = H // self.kv_heads
            k, v = (x[:, :, None].expand(b, self.kv_heads, rep, t, HD).reshape(b, H, t, HD) for x in (k, v))
        if self.attention == "sdpa":
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-1, -2) / HD ** 0.5 + torch.full((t, t), float("-inf")).triu(1)
            a = torch.softmax(scores, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, D))
        h = self.n2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class T5Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMSNorm(False), RMSNorm(False)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D, bias=False) for _ in range(4))
        self.wi, self.wo = torch.nn.Linear(D, 2 * D, bias=False), torch.nn.Linear(2 * D, D, bias=False)
        self.register_buffer("position_bias", torch.randn(1, H, S, S))

    def forward(self, x, mask):
        h = self.n1(x)
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2)
        padding = (1.0 - mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        scores = scores + (self.position_bias + padding)
        a = torch.softmax(scores.float(), -1).type_as(scores) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, D))
        return x + self.wo(torch.relu(self.wi(self.n2(x))))


class Stack(torch.nn.Module):
    def __init__(self, blocks, final=None):
        super().__init__()
        self.blocks, self.final = torch.nn.ModuleList(blocks), final

    def forward(self, x, *rest):
        for blk in self.blocks:
            x = blk(x, *rest)
        return x if self.final is None else self.final(x)


def _export(module, args, names) -> onnx.ModelProto:
    f = io.BytesIO()
    torch.onnx.export(module, args, f, input_names=names, output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={n: {0: "batch"} for n in names})
    return onnx.load_from_string(f.getvalue())


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[Counter, onnx.ModelProto]:
    """Optimizes at the feeds' shapes; the fused model under the library's CPU kernels against
    the original under ONNX Runtime. Returns the fused kinds and the fused model."""
    from onnxfuse import optimize_model
    from onnxfuse.runtime import library_path

    r = optimize_model(model, static_shapes={k: v.shape for k, v in feeds.items()})
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    so.register_custom_ops_library(library_path())
    got = ort.InferenceSession(r.model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    err, scale = float(np.abs(got.astype(np.float64) - want).max()), float(np.abs(want).max())
    assert err <= 1e-5 * scale + 1e-5, f"max|err| {err:.3g}, max|y| {scale:.3g}"
    return Counter(f.kind for f in r.fused), r.model


def _export_dynamo(module, args, names) -> onnx.ModelProto:
    program = torch.onnx.export(module, args, input_names=names, output_names=["y"], dynamo=True, verbose=False)
    return program.model_proto


@pytest.mark.parametrize("attention,kv_heads,exporter", [
    ("sdpa", H, "torchscript"), ("written-out", H, "torchscript"), ("sdpa", 1, "torchscript"),
    ("written-out", 1, "torchscript"), ("sdpa", H, "dynamo"), ("sdpa", 1, "dynamo")])
def test_llama_style_decoder(attention, kv_heads, exporter):
    """Both layers' causal attentions fuse (the rotary products feed them), every RMSNorm that
    ORT does not take whole fuses, and the SiLU-gated product is a pointwise chain. With one
    key-value head for the two query heads (grouped-query attention) the repeat of K and V
    (Unsqueeze, Expand, Reshape) joins the attention as its kv_group. The dynamo exporter
    writes K^T as Reshape(Transpose(Reshape(K, [B * H, S, D]), [0, 2, 1]), [B, H, D, S]) (after
    the Expand, with grouped queries): the attention reads it as K's transpose. The rotary
    chains read rotate_half(Q) and rotate_half(K) from Q and K themselves (rotate_half), and Q
    and K through their Transposes to [B, H, S, D] (transpose)."""
    torch.manual_seed(0)
    module = Stack([LlamaBlock(attention, kv_heads), LlamaBlock(attention, kv_heads)], RMSNorm(True)).eval()
    x = torch.randn(B, S, D)
    model = (_export if exporter == "torchscript" else _export_dynamo)(module, (x,), ["x"])
    kinds, fused = _check(model, {"x": x.numpy()})
    assert kinds["attention"] == 2, kinds
    producers = {o: n.op_type for n in fused.graph.node for o in n.output}
    assert all(producers.get(n.input[1]) != "Reshape" for n in fused.graph.node if n.op_type == "FusedAttention")
    # rotate_half's Slices, Neg and Concat read by the rotary chains of Q and K
    assert not any(n.op_type in ("Neg", "Concat") for n in fused.graph.node)
    assert sum(list(a.ints) == [0, 0, 1, 0] for n in fused.graph.node for a in n.attribute
               if a.name == "rotate_half") == 4
    # ... and read Q and K through their Transposes [B, S, H, D] -> [B, H, S, D] (transpose)
    chains = [n for n in fused.graph.node if any(a.name == "rotate_half" for a in n.attribute)]
    assert all(producers.get(x) != "Transpose" for n in chains for x in n.input), producers
    assert all(list(next(a.ints for a in n.attribute if a.name == "transpose")) == [0, 2, 1, 3, 0, 1, 2, 3] * 2
               for n in chains)
    if kv_heads != H:
        groups = [a.i for n in fused.graph.node if n.op_type == "FusedAttention" for a in n.attribute
                  if a.name == "kv_group"]
        assert groups == [H // kv_heads] * 2, groups
        assert not any(n.op_type == "Expand" for n in fused.graph.node)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        run = lambda m: ort.InferenceSession(m.SerializeToString(), so,  # noqa: E731
                                             providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
        np.testing.assert_allclose(run(fused), run(model), rtol=1e-6, atol=1e-6)  # no library: the bodies run
    assert kinds["rows"] >= 4, kinds
    assert kinds["pointwise"] >= 2, kinds


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_partial_rotary_decoder(exporter, interleaved):
    """Rotary embeddings on the first 16 of each head's 64 dims (GPT-NeoX's rotary_pct, Phi's
    partial_rotary_factor; interleaved, GPT-J's rotary_dim): Concat(rotary(q[..., :16]), q[..., 16:])
    becomes one chain over q's shape that computes the first 16 columns and copies the rest
    (partial [16, k]), reading Q and K through their Transposes and rotate_half(Q) (or the pairs'
    rotation, rotate_pairs) from Q itself: no Slice, Neg, Concat, Unsqueeze or Transpose of Q or K
    is left."""
    torch.manual_seed(0)
    blocks = [LlamaBlock("sdpa", rotary=16, interleaved=interleaved) for _ in range(2)]
    module = Stack(blocks, RMSNorm(True)).eval()
    x = torch.randn(B, S, D)
    model = (_export if exporter == "torchscript" else _export_dynamo)(module, (x,), ["x"])
    kinds, fused = _check(model, {"x": x.numpy()})
    assert kinds["attention"] == 2, kinds
    assert not any(n.op_type in ("Neg", "Concat", "Slice", "Unsqueeze") for n in fused.graph.node), Counter(
        n.op_type for n in fused.graph.node)
    chains = [n for n in fused.graph.node if any(a.name == "partial" for a in n.attribute)]
    assert len(chains) == 4, Counter(n.op_type for n in fused.graph.node)
    rotation = "rotate_pairs" if interleaved else "rotate_half"
    for n in chains:
        attrs = {a.name: list(a.ints) for a in n.attribute}
        assert attrs["partial"][0] == 16 and attrs[rotation][attrs["partial"][1]] == 0 and sum(attrs[rotation]) == 1
        assert "transpose" in attrs and ("rotate_half" in attrs) != interleaved, attrs


def test_t5_style_encoder():
    """Unscaled scores plus a position bias and a padding mask: both attentions fuse, the
    summed bias read as the score program's extra; the T5 RMSNorms fuse."""
    torch.manual_seed(0)
    module = Stack([T5Block(), T5Block()]).eval()
    x, mask = torch.randn(B, S, D), torch.ones(B, S, dtype=torch.int64)
    mask[1, S // 2:] = 0
    kinds, _ = _check(_export(module, (x, mask), ["x", "mask"]), {"x": x.numpy(), "mask": mask.numpy()})
    assert kinds["attention"] == 2, kinds
    assert kinds["rows"] >= 2, kinds
