"""Transformer models for the suite: BERT-base, ViT-S/16 and GPT-2 small written with torch.nn
(no transformers library), seeded, exported with either torch exporter.

    python -m models.transformers                       # export the three (TorchScript), report times
    python -m models.transformers --small --exporter dynamo bert_base

- ``bert_base``: BERT-base-style encoder: word + position embeddings of input_ids (int64
  [N, S]) and an embedding LayerNorm, 12 post-LN layers (d 768, 12 heads, FFN 3072, erf-GELU),
  an attention mask (int64 [N, S], 1 = attend) added to the scores as (1 - mask) * -10000,
  as BERT does; output the last hidden state [N, S, 768].
- ``vit_s16``: ViT-S/16 classifier: 16x16/16 patch Conv, a class token, learned position
  embeddings, 12 pre-LN layers (d 384, 6 heads, MLP 1536, erf-GELU, LayerNorm eps 1e-6), a
  final LayerNorm and a 1000-class head on the class token; x [N, 3, 224, 224] -> logits [N, 1000].
- ``gpt2_small``: GPT-2-small-style decoder stack without KV cache: token + position embeddings,
  12 pre-LN layers (d 768, 12 heads, MLP 3072, tanh-GELU written out as GPT-2 does), a causal
  mask taken from a lower-triangular buffer (HF GPT-2's way), a final LayerNorm and the LM head
  tied to the token embedding (optional); input_ids [N, S] -> logits [N, S, 50257].

The attention is written out as the reference implementations write it (MatMul, scale, mask,
Softmax, MatMul, and the head reshapes), which is also what ONNX Runtime's transformers
optimizer recognizes. ``small=True`` gives each a 2-layer d=64 twin (vocabulary 1000, 32x32
images) for CPU tests.

Weights are seeded: embeddings N(0, 0.02), Linear weights N(0, 1/fan_in) (attention scores of
order 1, so the softmax is not flat), biases N(0, 0.02), LayerNorm scale 1 + N(0, 0.1) and
shift N(0, 0.1). Batch (and sequence) dimensions are dynamic: "N" and "S".

Exporters: ``torchscript`` (torch.onnx.export(dynamo=False), opset 17) and ``dynamo``
(torch.onnx.export(dynamo=True), opset 18; needs the onnxscript package, else
ExporterUnavailable says what to install).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx

from models.build import TorchUnavailable, _import_torch

EXPORTERS = ("torchscript", "dynamo")
OPSETS = {"torchscript": 17, "dynamo": 18}
MASK_VALUE = -10000.0   # BERT's additive mask and GPT-2's masked score: finite in fp16


class ExporterUnavailable(TorchUnavailable):
    """The asked-for torch exporter cannot run here (the dynamo one without onnxscript)."""


@dataclass(frozen=True)
class Config:
    """Sizes of one transformer."""

    layers: int
    dim: int
    heads: int
    ffn: int
    vocab: int = 0          # token models
    positions: int = 0      # token models: the longest sequence
    image: int = 224        # ViT
    patch: int = 16         # ViT
    classes: int = 1000     # ViT
    eps: float = 1e-12
    tied_head: bool = True  # GPT-2: the LM head (tied to the token embedding); False: hidden states out


CONFIGS: dict[str, Config] = {
    "bert_base": Config(12, 768, 12, 3072, vocab=30522, positions=512, eps=1e-12),
    "vit_s16": Config(12, 384, 6, 1536, eps=1e-6),
    "gpt2_small": Config(12, 768, 12, 3072, vocab=50257, positions=1024, eps=1e-5),
}
SMALL_CONFIGS: dict[str, Config] = {
    "bert_base": replace(CONFIGS["bert_base"], layers=2, dim=64, heads=2, ffn=256, vocab=1000, positions=64),
    "vit_s16": replace(CONFIGS["vit_s16"], layers=2, dim=64, heads=2, ffn=256, image=32, classes=10),
    "gpt2_small": replace(CONFIGS["gpt2_small"], layers=2, dim=64, heads=2, ffn=256, vocab=1000, positions=64),
}
# ORT's transformers optimizer: model_type per architecture
ORT_MODEL_TYPES = {"bert_base": "bert", "vit_s16": "vit", "gpt2_small": "gpt2"}
SEQ = 128          # benchmark sequence length
SMALL_SEQ = 16     # tests and dry runs


def config(arch: str, small: bool = False) -> Config:
    return (SMALL_CONFIGS if small else CONFIGS)[arch]


def _modules():
    """The torch.nn classes (torch imported on first use: it is optional)."""
    torch = _import_torch()
    nn = torch.nn
    F = nn.functional

    def heads(x, h: int):
        n, s, d = x.shape
        return x.view(n, s, h, d // h).permute(0, 2, 1, 3)

    def merge(x):
        n, h, s, dh = x.shape
        return x.permute(0, 2, 1, 3).contiguous().view(n, s, h * dh)

    class SelfAttention(nn.Module):
        """BERT's and HF ViT's: separate q, k, v projections, scores / sqrt(dh) (+ additive mask)."""

        def __init__(self, c: Config):
            super().__init__()
            self.h = c.heads
            self.query, self.key, self.value = (nn.Linear(c.dim, c.dim) for _ in range(3))
            self.out = nn.Linear(c.dim, c.dim)

        def forward(self, x, mask_bias=None):
            q, k, v = heads(self.query(x), self.h), heads(self.key(x), self.h), heads(self.value(x), self.h)
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            probs = torch.softmax(scores if mask_bias is None else scores + mask_bias, dim=-1)
            return self.out(merge(torch.matmul(probs, v)))

    class BertLayer(nn.Module):
        def __init__(self, c: Config):
            super().__init__()
            self.attention = SelfAttention(c)
            self.ln1 = nn.LayerNorm(c.dim, eps=c.eps)
            self.fc1, self.fc2 = nn.Linear(c.dim, c.ffn), nn.Linear(c.ffn, c.dim)
            self.ln2 = nn.LayerNorm(c.dim, eps=c.eps)

        def forward(self, x, mask_bias):
            x = self.ln1(x + self.attention(x, mask_bias))                 # post-LN
            return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))

    class Bert(nn.Module):
        """BERT-base-style encoder: (input_ids, attention_mask) -> last hidden state."""

        def __init__(self, c: Config):
            super().__init__()
            self.word_embeddings = nn.Embedding(c.vocab, c.dim)
            self.position_embeddings = nn.Embedding(c.positions, c.dim)
            self.ln = nn.LayerNorm(c.dim, eps=c.eps)
            self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
            self.register_buffer("position_ids", torch.arange(c.positions).unsqueeze(0), persistent=False)

        def forward(self, input_ids, attention_mask):
            pos = self.position_ids[:, : input_ids.shape[1]]
            x = self.ln(self.word_embeddings(input_ids) + self.position_embeddings(pos))
            mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * MASK_VALUE
            for layer in self.layers:
                x = layer(x, mask_bias)
            return x

    class VitBlock(nn.Module):
        def __init__(self, c: Config):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(c.dim, eps=c.eps), nn.LayerNorm(c.dim, eps=c.eps)
            self.attn = SelfAttention(c)
            self.fc1, self.fc2 = nn.Linear(c.dim, c.ffn), nn.Linear(c.ffn, c.dim)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))                                # pre-LN
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class Vit(nn.Module):
        """ViT-S/16-style classifier: images [N, 3, H, W] -> logits [N, classes]."""

        def __init__(self, c: Config):
            super().__init__()
            self.patch_embed = nn.Conv2d(3, c.dim, c.patch, stride=c.patch)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
            self.pos_embed = nn.Parameter(torch.zeros(1, (c.image // c.patch) ** 2 + 1, c.dim))
            self.blocks = nn.ModuleList(VitBlock(c) for _ in range(c.layers))
            self.norm = nn.LayerNorm(c.dim, eps=c.eps)
            self.head = nn.Linear(c.dim, c.classes)

        def forward(self, pixel_values):   # named as the ONNX input (the dynamo exporter's dynamic_shapes)
            x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x)[:, 0])

    class Conv1D(nn.Module):
        """HF GPT-2's projection: x @ weight + bias through addmm on the flattened tokens,
        weight [in, out] (exports as Reshape -> Gemm -> Reshape)."""

        def __init__(self, n_in: int, n_out: int):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_in, n_out))
            self.bias = nn.Parameter(torch.zeros(n_out))

        def forward(self, x):
            size_out = x.size()[:-1] + (self.weight.shape[1],)
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)

    class GptAttention(nn.Module):
        """HF GPT-2's (eager, no past): one c_attn projection split in three, keys permuted
        straight to [N, h, dh, S], scores / sqrt(dh), the causal mask sliced from a
        lower-triangular buffer at [S_k - S_q : S_k, :S_k], masked scores set to MASK_VALUE."""

        def __init__(self, c: Config):
            super().__init__()
            self.h = c.heads
            self.c_attn = Conv1D(c.dim, 3 * c.dim)
            self.c_proj = Conv1D(c.dim, c.dim)
            tril = torch.tril(torch.ones(c.positions, c.positions, dtype=torch.bool))
            self.register_buffer("bias", tril.view(1, 1, c.positions, c.positions), persistent=False)
            self.register_buffer("masked_bias", torch.tensor(MASK_VALUE), persistent=False)

        def split_heads(self, x, key: bool = False):
            x = x.view(x.size()[:-1] + (self.h, x.size(-1) // self.h))
            return x.permute(0, 2, 3, 1) if key else x.permute(0, 2, 1, 3)

        def forward(self, x):
            q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
            q, k, v = self.split_heads(q), self.split_heads(k, key=True), self.split_heads(v)
            w = torch.matmul(q, k) / (float(v.size(-1)) ** 0.5)
            nd, ns = w.size(-2), w.size(-1)
            w = torch.where(self.bias[:, :, ns - nd : ns, :ns], w, self.masked_bias.to(w.dtype))
            return self.c_proj(merge(torch.matmul(torch.softmax(w, dim=-1), v)))

    def gelu_new(x):
        """GPT-2's tanh GELU, written out (ORT's FastGelu fusion looks for this form)."""
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    class GptBlock(nn.Module):
        def __init__(self, c: Config):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(c.dim, eps=c.eps), nn.LayerNorm(c.dim, eps=c.eps)
            self.attn = GptAttention(c)
            self.c_fc, self.mlp_proj = Conv1D(c.dim, c.ffn), Conv1D(c.ffn, c.dim)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))                                 # pre-LN
            return x + self.mlp_proj(gelu_new(self.c_fc(self.ln_2(x))))

    class Gpt2(nn.Module):
        """GPT-2-small-style decoder stack, no KV cache: input_ids [N, S] -> logits [N, S, vocab]
        (hidden states [N, S, d] without the tied head)."""

        def __init__(self, c: Config):
            super().__init__()
            self.tied_head = c.tied_head
            self.wte, self.wpe = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.positions, c.dim)
            self.h = nn.ModuleList(GptBlock(c) for _ in range(c.layers))
            self.ln_f = nn.LayerNorm(c.dim, eps=c.eps)
            self.register_buffer("position_ids", torch.arange(c.positions).unsqueeze(0), persistent=False)

        def forward(self, input_ids):
            x = self.wte(input_ids) + self.wpe(self.position_ids[:, : input_ids.shape[1]])
            for block in self.h:
                x = block(x)
            x = self.ln_f(x)
            return torch.matmul(x, self.wte.weight.t()) if self.tied_head else x

    return {"bert_base": Bert, "vit_s16": Vit, "gpt2_small": Gpt2}


def _init(module, seed: int) -> None:
    """The seeded weights of the module docstring (in place)."""
    torch = _import_torch()
    nn = torch.nn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, nn.LayerNorm):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("weight") and p.dim() >= 2:   # Linear, Conv2d ([out, in, ...]); Conv1D ([in, out])
                fan_in = p.shape[0] if type(owner).__name__ == "Conv1D" else p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            else:   # embeddings, class token, position embeddings, biases
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


def module(arch: str, small: bool = False, seed: int = 0, tied_head: bool = True):
    """The seeded torch module of `arch` (bert_base, vit_s16, gpt2_small), eval mode, CPU, fp32."""
    c = config(arch, small)
    if arch == "gpt2_small" and not tied_head:
        c = replace(c, tied_head=False)
    m = _modules()[arch](c)
    _init(m, seed)
    return m.eval()


@dataclass(frozen=True)
class Signature:
    """An architecture's ONNX inputs (name -> dims after the batch, "S" for the sequence) and outputs."""

    inputs: dict[str, tuple[int | str, ...]]
    outputs: tuple[str, ...]


def signature(arch: str, small: bool = False) -> Signature:
    c = config(arch, small)
    if arch == "vit_s16":
        return Signature({"pixel_values": (3, c.image, c.image)}, ("logits",))
    if arch == "bert_base":
        return Signature({"input_ids": ("S",), "attention_mask": ("S",)}, ("last_hidden_state",))
    return Signature({"input_ids": ("S",)}, ("logits",))


def input_dims(arch: str, small: bool = False, seq: int | None = None) -> dict[str, tuple[int, ...]]:
    """Per-sample input dims (no batch) at sequence length `seq` (default SEQ, or SMALL_SEQ when small)."""
    seq = seq or (SMALL_SEQ if small else SEQ)
    return {k: tuple(seq if d == "S" else d for d in dims) for k, dims in signature(arch, small).inputs.items()}


def feeds(arch: str, shapes: dict[str, tuple[int, ...]], dtype=np.float32, small: bool = False,
          seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: token ids uniform over the vocabulary; an attention mask of ones with
    a padded tail on every other row (row i keeps S - (i % 4) * S // 8 tokens); images
    uniform in [0, 1) in `dtype`."""
    c = config(arch, small)
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name == "input_ids":
            out[name] = rng.integers(0, c.vocab, size=shape, dtype=np.int64)
        elif name == "attention_mask":
            n, s = shape
            keep = s - (np.arange(n) % 4) * (s // 8)
            out[name] = (np.arange(s)[None, :] < keep[:, None]).astype(np.int64)
        else:
            out[name] = rng.random(shape, dtype=np.float32).astype(dtype, copy=False)
    return out


def _example(arch: str, small: bool):
    """Export-time example inputs: batch 2, sequence 8 (neither 0 nor 1: not specialized)."""
    torch = _import_torch()
    dims = input_dims(arch, small, seq=8)
    return tuple(torch.from_numpy(v) for v in feeds(arch, {k: (2, *d) for k, d in dims.items()}, small=small).values())


def dynamo_available() -> str | None:
    """None when torch's dynamo exporter can run here, else one line saying what to install."""
    if importlib.util.find_spec("onnxscript") is None:
        return "the dynamo exporter (torch.onnx.export(dynamo=True)) needs onnxscript: pip install onnxscript"
    return None


def export(arch: str, exporter: str = "torchscript", small: bool = False, seed: int = 0,
           tied_head: bool = True) -> onnx.ModelProto:
    """`arch`'s seeded module exported by `exporter` ("torchscript", opset 17, or "dynamo",
    opset 18), dynamic "N" (batch) and "S" (sequence) dims, inputs and outputs named as
    `signature` says."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter {exporter!r}: choose from {', '.join(EXPORTERS)}")
    torch = _import_torch()
    if exporter == "dynamo" and (why := dynamo_available()):
        raise ExporterUnavailable(why)
    m = module(arch, small, seed, tied_head)
    sig = signature(arch, small)
    args = _example(arch, small)
    names = list(sig.inputs)
    axes = {k: {0: "N", **({1: "S"} if dims == ("S",) else {})} for k, dims in sig.inputs.items()}
    out_axes = {o: {0: "N", **({1: "S"} if arch != "vit_s16" else {})} for o in sig.outputs}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            f = io.BytesIO()
            torch.onnx.export(m, args, f, dynamo=False, opset_version=OPSETS[exporter], input_names=names,
                              output_names=list(sig.outputs), dynamic_axes={**axes, **out_axes})
            model = onnx.load_from_string(f.getvalue())
        else:
            dim = torch.export.Dim
            batch = dim("N")
            seq = dim("S", min=2, max=config(arch, small).positions or 4096)
            shapes = {k: {0: batch, **({1: seq} if dims == ("S",) else {})} for k, dims in sig.inputs.items()}
            program = torch.onnx.export(m, args, dynamo=True, opset_version=OPSETS[exporter], input_names=names,
                                        output_names=list(sig.outputs), dynamic_shapes=shapes, verbose=False)
            model = program.model_proto
    return model


def model_name(arch: str, exporter: str = "torchscript") -> str:
    """The suite's name for `arch` exported by `exporter`: the TorchScript one is plain."""
    return arch if exporter == "torchscript" else f"{arch}_{exporter}"


BUILDERS: dict[str, Callable[[bool], onnx.ModelProto]] = {
    model_name(a, e): (lambda small, a=a, e=e: export(a, e, small)) for a in CONFIGS for e in EXPORTERS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", help=f"default all: {', '.join(CONFIGS)}")
    ap.add_argument("--exporter", choices=EXPORTERS, default="torchscript")
    ap.add_argument("--small", action="store_true", help="the 2-layer d=64 test configs")
    ap.add_argument("--out", help="folder to write <name>.onnx into (default: export and report only)")
    args = ap.parse_args(argv)
    from pathlib import Path

    for arch in args.archs or CONFIGS:
        if arch not in CONFIGS:
            ap.error(f"unknown architecture {arch!r}; choose from {', '.join(CONFIGS)}")
        t0 = time.perf_counter()
        try:
            m = export(arch, args.exporter, args.small)
        except TorchUnavailable as e:
            print(f"{arch}: {e}", file=sys.stderr)
            return 1
        seconds = time.perf_counter() - t0
        size = m.ByteSize()
        if args.out:
            path = Path(args.out) / f"{model_name(arch, args.exporter)}{'_small' if args.small else ''}.onnx"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(m.SerializeToString())
        print(f"{model_name(arch, args.exporter)}: exported in {seconds:.1f} s, {len(m.graph.node)} nodes, "
              f"{size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
