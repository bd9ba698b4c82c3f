"""Hugging Face transformers models, which this repository does not hold: does every attention
fuse, is the optimized model right, and (on a GPU) how fast is it against ONNX Runtime.

Builds BertModel, GPT2Model, ViTModel, LlamaModel (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU) and the decoders built like it (`DECODERS`: Qwen2, Mistral, Phi-3, GPT-NeoX,
Gemma, Qwen3), T5EncoderModel (RMSNorm without the mean, a learned position bias, ReLU)
and DistilBertModel from their configurations with seeded random weights (`seeded`: Hugging
Face's initialization from seed 0, then every bias N(0, 0.1) and every normalization's scale
1 + N(0, 0.1) and shift N(0, 0.1), where Hugging Face would leave zeros and ones that hide a
dropped or misplaced bias; no download; base sizes, or `--small` ones for a CPU), with each
attention implementation (`eager`, `sdpa`), exports
each with torch's TorchScript exporter (opset 17, last hidden state out; `--dtype fp16`: then
converted as `models.fp16` converts the suite's models), runs `onnxfuse optimize --shape ...`
at batch `--batch` and sequence 128 (ViT: 224²), and
`onnxfuse bench` of the pair (`--provider`): both errors against the float64 reference, the gate,
and median ms of both models (`--cuda-graph`: again under CUDA graphs, onnxfuse's model optimized
with `--cuda-graph` for them where its shapes are static; `--tf-optimizer`: ONNX
Runtime's transformers optimizer's model of the same export beside them, the peer a user would
pick instead, with its own error and gate). `--past P` (decoders): a generation step as decoders
are deployed, with a key-value cache of P positions (inputs `position_ids`, `past.L.key` and
`past.L.value`, outputs `present.L.*`; `--new` tokens, 1 by default), every input's batch, new
tokens and cached positions dynamic; optimized without the cache length (`--shape batch=B --shape
new=T`: each step has one more) and benched at P and at a later step (batch + 1, 2P + 3 cached).
`--dynamic`: exported with a dynamic batch and sequence (as deployed models are: no `--shape`),
optimized so, and benched at the export's shape and at another (batch + 1, 2 seq - 3).
Prints a table and writes JSON after every case:

    python benchmarks/hf_attention.py --provider cuda --batch 1 --cuda-graph --tf-optimizer --json hf_b1.json
    python benchmarks/hf_attention.py --small --provider cpu       # CPU (--target none): fusion, accuracy
    python benchmarks/hf_attention.py --archs llama,qwen2 --attn sdpa --past 128 --batch 8 --dtype fp16

Needs `transformers` (the GPU machine has it; here: pip install transformers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEQ = 128
# LLaMA and the decoders built like it (config, model class, config arguments): Qwen2 (biases on
# Q, K and V), Mistral, Phi-3 (one packed QKV projection), GPT-NeoX (partial rotary, packed QKV,
# LayerNorm, GELU), Gemma (head_dim given, RMSNorm's 1 + weight, tanh-GELU gate), Qwen3 (RMSNorm
# on each head's Q and K)
DECODERS = {
    "llama": ("LlamaConfig", "LlamaModel", {}),
    "qwen2": ("Qwen2Config", "Qwen2Model", {}),
    "mistral": ("MistralConfig", "MistralModel", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3Model", {"pad_token_id": 0}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", {"rotary_pct": 0.25}),
    "gemma": ("GemmaConfig", "GemmaModel", {"head_dim": None}),
    "qwen3": ("Qwen3Config", "Qwen3Model", {"head_dim": None}),
}
# More families, built from their configurations as `build` builds the others: (config, model,
# inputs: "text" (input_ids, attention_mask), "image" (pixel_values), "features" (input_features),
# "wave" (input_values), the attention implementation (some have only `eager`), the sizes of
# `--small` and of the full-size run, whether every attention should become one FusedAttention).
# Found by a CPU sweep of these families (twenty-seventh session): Gemma 2's sandwich norms (a
# post-norm's residual add feeding the next norm), fp16 ORT CPU's fp32 chains (`test_hf_families`).
TEXT_SMALL = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=1000)
TEXT_BASE = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072)
IMAGE_SMALL = dict(TEXT_SMALL, image_size=32, patch_size=8)
IMAGE_BASE = dict(TEXT_BASE, image_size=224, patch_size=16)
WHISPER = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128, decoder_layers=2,
               decoder_attention_heads=2, decoder_ffn_dim=128, d_model=64, num_mel_bins=16, max_source_positions=16,
               vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
BART = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000)
# DeBERTa-v3's attention as microsoft/deberta-v3-base configures it: content-to-position and
# position-to-content terms over log-bucketed relative positions, keys shared with the content
DEBERTA_V3 = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                  norm_rel_ebd="layer_norm", share_att_key=True)
MORE = {
    "roberta": ("RobertaConfig", "RobertaModel", "text", "sdpa", TEXT_SMALL, TEXT_BASE, True),
    "albert": ("AlbertConfig", "AlbertModel", "text", "sdpa", dict(TEXT_SMALL, embedding_size=32), TEXT_BASE, True),
    "mpnet": ("MPNetConfig", "MPNetModel", "text", "eager", TEXT_SMALL, TEXT_BASE, True),  # relative position bias
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", "text", "eager",  # disentangled attention over [B * H, S, S]
                   dict(TEXT_SMALL, **DEBERTA_V3, position_buckets=8),
                   dict(TEXT_BASE, **DEBERTA_V3, position_buckets=256), True),
    "clip_text": ("CLIPTextConfig", "CLIPTextModel", "text", "sdpa", TEXT_SMALL, TEXT_BASE, True),  # causal + padding
    "deit": ("DeiTConfig", "DeiTModel", "image", "sdpa", IMAGE_SMALL, IMAGE_BASE, True),
    "beit": ("BeitConfig", "BeitModel", "image", "sdpa", dict(IMAGE_SMALL, use_relative_position_bias=True),
             dict(IMAGE_BASE, use_relative_position_bias=True), True),
    "dinov2": ("Dinov2Config", "Dinov2Model", "image", "sdpa", IMAGE_SMALL, IMAGE_BASE, True),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", "image", "sdpa", IMAGE_SMALL, IMAGE_BASE, True),
    "siglip_vision": ("SiglipVisionConfig", "SiglipVisionModel", "image", "sdpa", IMAGE_SMALL, IMAGE_BASE, True),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", "wave", "sdpa",
                 dict(TEXT_SMALL, conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3],
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2), TEXT_BASE, True),
    "whisper_encoder": ("WhisperConfig", "WhisperModel.encoder", "features", "sdpa", WHISPER,
                        dict(WHISPER, d_model=768, encoder_layers=12, encoder_attention_heads=12,
                             encoder_ffn_dim=3072, num_mel_bins=80, max_source_positions=1500), True),
    "bart": ("BartConfig", "BartModel", "text", "sdpa", BART, {}, True),  # encoder, decoder, cross-attention
    "opt": ("OPTConfig", "OPTModel", "text", "sdpa", dict(TEXT_SMALL, ffn_dim=128, word_embed_proj_dim=64),
            dict(TEXT_BASE, ffn_dim=3072, word_embed_proj_dim=768), True),
    "falcon": ("FalconConfig", "FalconModel", "text", "sdpa", TEXT_SMALL, TEXT_BASE, True),
    "phi": ("PhiConfig", "PhiModel", "text", "sdpa", dict(TEXT_SMALL, partial_rotary_factor=0.5),
            dict(TEXT_BASE, partial_rotary_factor=0.5), True),  # partial rotary
    "stablelm": ("StableLmConfig", "StableLmModel", "text", "sdpa", dict(TEXT_SMALL, num_key_value_heads=2),
                 dict(TEXT_BASE, num_key_value_heads=12), True),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeModel", "text", "sdpa", dict(TEXT_SMALL, multi_query=True),
                    dict(TEXT_BASE, multi_query=True), True),  # one key-value head
    "olmo": ("OlmoConfig", "OlmoModel", "text", "sdpa", TEXT_SMALL, TEXT_BASE, True),
    "granite": ("GraniteConfig", "GraniteModel", "text", "sdpa", TEXT_SMALL, TEXT_BASE, True),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", "text", "sdpa", dict(TEXT_SMALL, num_key_value_heads=1),
                   dict(TEXT_BASE, num_key_value_heads=4), True),
    "gemma2": ("Gemma2Config", "Gemma2Model", "text", "eager", dict(TEXT_SMALL, head_dim=32, num_key_value_heads=1),
               dict(TEXT_BASE, head_dim=64, num_key_value_heads=4), True),  # sandwich norms, soft-capped scores
    "gptj": ("GPTJConfig", "GPTJModel", "text", "sdpa", dict(TEXT_SMALL, rotary_dim=16),
             dict(TEXT_BASE, rotary_dim=32), True),  # interleaved, partial rotary
    "bloom": ("BloomConfig", "BloomModel", "text", "eager", TEXT_SMALL, TEXT_BASE, True),  # ALiBi over [B * H, S, S]
    "cohere": ("CohereConfig", "CohereModel", "text", "sdpa", dict(TEXT_SMALL, num_key_value_heads=1),
               dict(TEXT_BASE, num_key_value_heads=4), True),  # interleaved rotary on every dim, parallel blocks
    "glm": ("GlmConfig", "GlmModel", "text", "sdpa",
            dict(TEXT_SMALL, num_key_value_heads=1, head_dim=32, pad_token_id=0),
            dict(TEXT_BASE, num_key_value_heads=4, head_dim=64, pad_token_id=0), True),  # interleaved, partial rotary
}
# families torch's TorchScript exporter cannot export (GLM: it fails; Cohere: the model it writes
# fails in ONNX Runtime, a Reshape to a traced size): `--exporter dynamo` only
DYNAMO_ONLY = frozenset({"cohere", "glm"})
ARCHS = ("bert", "gpt2", "vit", "t5", "distilbert", *DECODERS)
ALL_ARCHS = (*ARCHS, *MORE)


def build(arch: str, attn: str, small: bool, past: int = 0):
    """(torch module returning the last hidden state, its input names, the model's configuration);
    `past` > 0 (decoders): the module also takes `position_ids` and each layer's cached keys and
    values (`past.L.key`, `past.L.value`, [B, kv heads, past, head dim]) and returns the updated
    caches after the hidden state, as a generation step runs it."""
    import torch
    import transformers as tf

    size = dict(hidden_size=64, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2) if small else {}
    torch.manual_seed(0)  # Hugging Face's initialization draws from torch's global generator
    if arch == "bert":
        cfg = tf.BertConfig(**size, vocab_size=1000 if small else 30522, attn_implementation=attn)
        model, names = tf.BertModel(cfg), ["input_ids", "attention_mask"]
    elif arch == "gpt2":
        g = dict(n_embd=64, n_head=2, n_layer=2, vocab_size=1000) if small else {}
        cfg = tf.GPT2Config(**g, attn_implementation=attn)
        model, names = tf.GPT2Model(cfg), ["input_ids"]
    elif arch == "vit":
        cfg = tf.ViTConfig(**size, **(dict(image_size=32, patch_size=8) if small else {}), attn_implementation=attn)
        model, names = tf.ViTModel(cfg), ["pixel_values"]
    elif arch in DECODERS:  # BERT-base-sized decoders: 12 layers of 768, 4 key-value heads for 12 queries
        shape = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=2, vocab_size=1000) if small else dict(
            hidden_size=768, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048,
            num_hidden_layers=12, vocab_size=32000)
        config, cls, extra = DECODERS[arch]
        if arch == "gpt_neox":  # no grouped-query attention; rotary on a quarter of each head
            shape.pop("num_key_value_heads")
        if "head_dim" in extra:
            extra = dict(extra, head_dim=shape["hidden_size"] // shape["num_attention_heads"])
        cfg = getattr(tf, config)(**shape, **extra, max_position_embeddings=512, use_cache=False,
                                  attn_implementation=attn)
        model, names = getattr(tf, cls)(cfg), ["input_ids", "attention_mask"]  # without a mask: aten::diff
    elif arch == "t5":  # t5-small's encoder
        shape = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=1000) if small else {}
        cfg = tf.T5Config(**shape, use_cache=False, attn_implementation=attn)
        model, names = tf.T5EncoderModel(cfg), ["input_ids", "attention_mask"]
    elif arch == "distilbert":
        shape = dict(dim=64, n_heads=2, hidden_dim=128, n_layers=2, vocab_size=1000) if small else {}
        cfg = tf.DistilBertConfig(**shape, attn_implementation=attn)
        model, names = tf.DistilBertModel(cfg), ["input_ids", "attention_mask"]
    elif arch in MORE:
        config, cls, kind, _, small_size, base_size, _ = MORE[arch]
        cfg = getattr(tf, config)(**(small_size if small else base_size), attn_implementation=attn)
        owner, _, part = cls.partition(".")  # "WhisperModel.encoder": the encoder alone
        model = getattr(tf, owner)(cfg)
        model = getattr(model, part) if part else model
        names = {"text": ["input_ids", "attention_mask"], "image": ["pixel_values"],
                 "features": ["input_features"], "wave": ["input_values"]}[kind]
    else:
        raise ValueError(f"unknown arch {arch!r}: choose from {', '.join(ALL_ARCHS)}")

    seeded(model)
    if past:
        if arch not in DECODERS:
            raise ValueError(f"--past needs a decoder ({', '.join(DECODERS)}), not {arch!r}")
        cfg.use_cache = True
        return _cached_module()(model, cfg).eval(), [*names, "position_ids", *cache_names(cfg)], cfg

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            return self.m(**dict(zip(names, args, strict=True))).last_hidden_state

    return Hidden(model).eval(), names, cfg


def seeded(model, seed: int = 1) -> None:
    """Every bias N(0, 0.1), every normalization's (a module whose class name has "Norm") scale
    1 + N(0, 0.1) and shift N(0, 0.1), from `seed`, in place: Hugging Face initializes biases to
    zeros and scales to ones, and a model whose projections add zeros cannot show a bias the
    optimizer dropped or added twice."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            noise = 0.1 * torch.randn(p.shape, generator=g)
            if "Norm" in type(owner).__name__ and p.dim() == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + noise)
            elif name.endswith("bias"):
                p.copy_(noise)


def cache_names(cfg, prefix: str = "past") -> list[str]:
    return [f"{prefix}.{layer}.{kv}" for layer in range(cfg.num_hidden_layers) for kv in ("key", "value")]


def _cached_module():
    import torch

    class Cached(torch.nn.Module):
        """A decoder step with a key-value cache: (input_ids, attention_mask over past + new
        positions, position_ids, each layer's past key and value) -> (hidden state, each layer's
        present key and value)."""

        def __init__(self, m, cfg):
            super().__init__()
            self.m, self.cfg = m, cfg

        def forward(self, input_ids, attention_mask, position_ids, *kv):
            import transformers as tf

            cache = tf.DynamicCache(config=self.cfg)
            for layer in range(self.cfg.num_hidden_layers):
                cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
            o = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True)
            present = [t for layer in o.past_key_values.layers for t in (layer.keys, layer.values)]
            return (o.last_hidden_state, *present)

    return Cached



def tf_optimizer_options(arch: str, cfg) -> dict:
    """onnxruntime.transformers.optimizer.optimize_model's model_type, num_heads, hidden_size."""
    if arch == "gpt2":
        return {"model_type": "gpt2", "num_heads": cfg.n_head, "hidden_size": cfg.n_embd}
    if arch == "t5":
        return {"model_type": "t5", "num_heads": cfg.num_heads, "hidden_size": cfg.d_model}
    if arch == "distilbert":
        return {"model_type": "bert", "num_heads": cfg.n_heads, "hidden_size": cfg.dim}
    if arch in DECODERS:  # no type of their own: "bert" fuses SimplifiedLayerNormalization and RotaryEmbedding
        return {"model_type": "bert", "num_heads": cfg.num_attention_heads, "hidden_size": cfg.hidden_size}
    if arch in MORE:  # (0: the optimizer reads them from the graph)
        kind = {"bart": "bart", "clip_text": "clip", "clip_vision": "clip", "deit": "vit", "beit": "vit",
                "dinov2": "vit"}.get(arch, "bert")
        return {"model_type": kind, "num_heads": getattr(cfg, "num_attention_heads", 0) or 0,
                "hidden_size": getattr(cfg, "hidden_size", 0) or 0}
    return {"model_type": arch, "num_heads": cfg.num_attention_heads, "hidden_size": cfg.hidden_size}


def export(arch: str, attn: str, small: bool, batch: int, path: Path, past: int = 0, new: int = 1
           ) -> dict[str, tuple[int, ...]]:
    """The model exported to `path`; its inputs' dims at this batch."""
    return _export(arch, attn, small, batch, path, past, new)[0]


def _export(arch: str, attn: str, small: bool, batch: int, path: Path, past: int = 0, new: int = 1,
            exporter: str = "torchscript", dynamic: bool = False):
    """(the inputs' dims, the model's configuration) of `export`. With a cache (`past` > 0) every
    input's batch, the new tokens and the cached positions are dynamic axes, as a generation
    loop feeds them (the dims returned are the export's: `new` tokens after `past`). `exporter`
    "dynamo": torch's torch.export-based exporter (its default since torch 2.9), opset 18 (no
    cache). `dynamic`: the batch and the sequence (tokens; audio samples) are dynamic axes named
    "batch" and "seq" (torch.export.Dim for dynamo), as deployed models are exported; otherwise
    only TorchScript's batch is (dynamo's export is static)."""
    import torch

    module, names, cfg = build(arch, attn, small, past)
    seq = 16 if small else SEQ
    axes = {n: {0: "batch", **({1: "seq"} if dynamic and names not in (["pixel_values"], ["input_features"]) else {})}
            for n in names}
    if names == ["pixel_values"]:
        dims = {"pixel_values": (batch, getattr(cfg, "num_channels", 3), cfg.image_size, cfg.image_size)}
        args = (torch.randn(*dims["pixel_values"]),)
    elif names == ["input_features"]:  # log-mel frames: twice the encoder's positions (its conv halves them)
        dims = {"input_features": (batch, cfg.num_mel_bins, 2 * cfg.max_source_positions)}
        args = (torch.randn(*dims["input_features"]),)
    elif names == ["input_values"]:  # raw audio
        dims = {"input_values": (batch, 800 if small else 16000)}
        args = (torch.randn(*dims["input_values"]),)
    elif past:
        dims = cache_dims(cfg, batch, past, new)
        args = (torch.ones(*dims["input_ids"], dtype=torch.int64),
                torch.ones(*dims["attention_mask"], dtype=torch.int64),
                torch.arange(past, past + new).expand(batch, new),
                *(torch.randn(*dims[n]) for n in names[3:]))
        axes = {"input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
                "position_ids": {0: "batch", 1: "new"}, **{n: {0: "batch", 2: "past"} for n in names[3:]}}
    else:
        dims = {n: (batch, seq) for n in names}
        args = tuple(torch.ones(batch, seq, dtype=torch.int64) for _ in names)
    outputs = ["hidden", *cache_names(cfg, "present")] if past else ["hidden"]
    with torch.no_grad():
        if exporter == "dynamo":  # (its conversion of TorchScript's dynamic axes fails for most families)
            if past:
                raise ValueError("--exporter dynamo: no --past")
            dims_of = None
            if dynamic:  # torch.export's own dims, per input of the module's *args
                b, s = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=4096)
                dims_of = {"args": tuple({k: (b if v == "batch" else s) for k, v in axes[n].items()} for n in names)}
            program = torch.onnx.export(module, args, input_names=names, output_names=outputs, opset_version=18,
                                        dynamo=True, verbose=False, dynamic_shapes=dims_of)
            program.save(str(path))
        else:
            torch.onnx.export(module, args, str(path), opset_version=17, dynamo=False, input_names=names,
                              output_names=outputs, dynamic_axes=axes)
    return dims, cfg


def cache_dims(cfg, batch: int, past: int, new: int) -> dict[str, tuple[int, ...]]:
    """A decoder step's input dims: `new` tokens after `past` cached positions."""
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (batch, heads, past, head_dim)
    return {"input_ids": (batch, new), "attention_mask": (batch, past + new), "position_ids": (batch, new),
            **dict.fromkeys(cache_names(cfg), kv)}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxfuse.cli", *args], capture_output=True, text=True)


class _Clock:
    """The seconds each stage of a case took, kept in its row (`stage_s`) and printed to stderr as the
    stage ends: a run its time limit cuts off still says where its time went."""

    def __init__(self, row: dict):
        self.row, self.t = row, time.perf_counter()
        row["stage_s"] = {}

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.row["stage_s"][stage] = round(now - self.t, 1)
        self.t = now
        print(f"{self.row['case']}: {stage} {self.row['stage_s'][stage]} s", file=sys.stderr, flush=True)


def run_case(arch: str, attn: str, args, tmp: Path) -> dict:
    tag = case_name(arch, attn, args)
    src, opt, js = tmp / f"{tag}.onnx", tmp / f"{tag}.opt.onnx", tmp / f"{tag}.bench.json"
    row: dict = {"case": tag}
    clock = _Clock(row)
    past, new_tokens = getattr(args, "past", 0), getattr(args, "new", 1)
    exporter = getattr(args, "exporter", "torchscript")
    if arch in DYNAMO_ONLY and exporter != "dynamo":
        return row | {"error": f"TorchScript cannot export {arch}: use --exporter dynamo"}
    dynamic = getattr(args, "dynamic", False)
    dims, cfg = _export(arch, attn, args.small, args.batch, src, past, new_tokens, exporter, dynamic)
    clock.done("export")
    fp32_twin = None
    if args.dtype == "fp16":  # converted as the suite converts its fp16 models
        from models.fp16 import to_fp16

        fp32_twin = onnx.load(str(src))
        onnx.save(to_fp16(fp32_twin), str(src))
        clock.done("fp16")
    shapes = [f"{n}={'x'.join(map(str, d))}" for n, d in dims.items()]
    models = [src, opt]
    if args.tf_optimizer:  # the peer a user would pick instead: ORT's transformers optimizer
        from benchmarks.compare import ort_transformers_optimize

        tfo = tmp / f"{tag}.tfopt.onnx"
        try:
            m, stats = ort_transformers_optimize(onnx.load(str(src)), fp32_twin, tf_optimizer_options(arch, cfg),
                                                 dry=args.provider == "cpu")
            onnx.save(m, str(tfo))
            row["tfopt_fused"] = stats
            models.append(tfo)
        except Exception as e:  # noqa: BLE001 -- the optimizer raises its own types: say so, go on
            row["tfopt_error"] = f"{type(e).__name__}: {e}"[:300]
        clock.done("tf-optimizer")
    # on the CPU no kernels (their TF32-rounded packed weights are for the GPU's tensor cores)
    target = ["--target", "none"] if args.provider == "cpu" else []
    budget = ["--tune-budget", str(args.tune_budget)] if args.tune_budget else []
    # a cached step's model stays dynamic in the cached positions (each step has one more): only the
    # batch and the new tokens are given; --dynamic: nothing is
    given = [] if dynamic else [f"batch={args.batch}", f"new={new_tokens}"] if past else shapes
    r = cli("optimize", str(src), str(opt), *target, *budget, *sum((["--shape", s] for s in given), []))
    clock.done("optimize")
    if r.returncode != 0:
        return row | {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    fused = onnx.load(str(opt)).graph.node
    ops = Counter(n.op_type for n in fused)
    original = Counter(n.op_type for n in onnx.load(str(src)).graph.node)
    groups = {a.i for n in fused if n.op_type == "FusedAttention" for a in n.attribute if a.name == "kv_group"}
    row |= {"softmax_before": original["Softmax"], "fused_attention": ops["FusedAttention"],
            "softmax_left": ops["Softmax"], "transposes": [original["Transpose"], ops["Transpose"]],
            "expands": [original["Expand"], ops["Expand"]], "negs": [original["Neg"], ops["Neg"]],
            "concats": [original["Concat"], ops["Concat"]], "splits": [original["Split"], ops["Split"]],
            "kv_groups": sorted(groups), "nodes": [
                sum(original.values()), sum(ops.values())]}
    found, error = bench_models(models, shapes, args, js)
    clock.done("bench")
    if error:
        return row | {"error": error}
    ref, new, *peer = found
    row |= timings(ref, new)
    if peer:
        row |= {"tfopt_ms": peer[0]["latency_ms"]["median"],
                "tfopt_err": max(o["max_abs_err"] for o in peer[0]["outputs"]),
                "tfopt_gate": all(o["passed"] for o in peer[0]["outputs"])}
    if past:  # the same models at a later step: more cached positions, another batch
        later = cache_dims(cfg, args.batch + 1, 2 * past + 3, new_tokens)
        found, error = bench_models([src, opt], [f"{n}={'x'.join(map(str, d))}" for n, d in later.items()], args, js)
        if error:
            return row | {"error": error}
        row |= {"later_step": f"batch {args.batch + 1}, past {2 * past + 3}", **timings(*found, "later_")}
    elif dynamic:  # the same models at another batch and sequence
        later = {n: (args.batch + 1, *d[1:]) if axes_of(n, d) == 1 else (args.batch + 1, 2 * d[1] - 3, *d[2:])
                 for n, d in dims.items()}
        found, error = bench_models([src, opt], [f"{n}={'x'.join(map(str, d))}" for n, d in later.items()], args, js)
        if error:
            return row | {"error": error}
        row |= {"later_step": f"batch {args.batch + 1}" + ("" if all(axes_of(n, d) == 1 for n, d in dims.items())
                                                            else f", seq {2 * next(iter(dims.values()))[1] - 3}"),
                **timings(*found, "later_")}
    if args.cuda_graph and args.provider == "cuda":  # every model again, each replayed as one CUDA graph
        if not (past or dynamic):  # onnxfuse's as `optimize --cuda-graph` writes it for graphs (`model-modes`)
            graph_opt = tmp / f"{tag}.graph.opt.onnx"
            r = cli("optimize", str(src), str(graph_opt), *budget, "--cuda-graph",
                    *sum((["--shape", s] for s in given), []))
            clock.done("optimize --cuda-graph")
            if r.returncode != 0:
                return row | {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
            models = [src, graph_opt, *models[2:]]
        found, _ = bench_models(models, shapes, args, js, "--cuda-graph")
        clock.done("bench --cuda-graph")
        if found:
            ref, new, *peer = found
            # "captured": false where ONNX Runtime could not capture the model (bench then times it
            # without graphs, with a note): HF's exports compute their masks with shape arithmetic
            row |= {"ort_graph_ms": ref["latency_ms"]["median"], "onnxfuse_graph_ms": new["latency_ms"]["median"],
                    "ort_captured": ref.get("cuda_graph"), "onnxfuse_captured": new.get("cuda_graph")}
            if peer:
                row |= {"tfopt_graph_ms": peer[0]["latency_ms"]["median"], "tfopt_captured": peer[0].get("cuda_graph")}
    return row


def axes_of(name: str, dims: tuple[int, ...]) -> int:
    """How many leading axes of input `name` `--dynamic` exports make dynamic (batch; and seq)."""
    return 1 if name in ("pixel_values", "input_features") or len(dims) < 2 else 2


def bench_models(models: list[Path], shapes: list[str], args, js: Path, *flags: str) -> tuple[list | None, list]:
    """`onnxfuse bench` of the models at `shapes`: its models' entries, or the error's last line."""
    js.unlink(missing_ok=True)
    r = cli("bench", *map(str, models), "--provider", args.provider, *flags, "--iters", str(args.iters),
            *sum((["--shape", s] for s in shapes), []), "--json", str(js))
    if not js.exists():
        return None, (r.stderr or r.stdout).strip().splitlines()[-1:]
    return json.loads(js.read_text())["models"], []


def timings(ref: dict, new: dict, prefix: str = "") -> dict:
    """The original's and onnxfuse's medians, both errors against the reference and the gate."""
    outs = new["outputs"]
    return {f"{prefix}ort_ms": ref["latency_ms"]["median"], f"{prefix}onnxfuse_ms": new["latency_ms"]["median"],
            f"{prefix}ort_err": max(o["ort_max_abs_err"] for o in outs),
            f"{prefix}err": max(o["max_abs_err"] for o in outs), f"{prefix}gate": all(o["passed"] for o in outs)}


def case_name(arch: str, attn: str, args) -> str:
    past = getattr(args, "past", 0)
    return (f"{arch}_{attn}_b{args.batch}" + (f"_past{past}_new{args.new}" if past else "")
            + ("_dynamic" if getattr(args, "dynamic", False) else "")
            + ("_fp16" if args.dtype == "fp16" else "")
            + ("_dynamo" if getattr(args, "exporter", "") == "dynamo" else ""))


def run_or_eager(arch: str, attn: str, args, tmp: Path, fallback: bool = True) -> dict:
    """run_case; where the installed transformers has no `attn` implementation for the family (GPT-J's
    sdpa in 5.17, the GPU machine's), its eager attention instead, said in the row's `note`."""
    try:
        return run_case(arch, attn, args, tmp)
    except ValueError as e:
        if not fallback or attn == "eager" or "does not support an attention implementation" not in str(e):
            raise
    import transformers

    return run_case(arch, "eager", args, tmp) | {
        "note": f"transformers {transformers.__version__} has no {attn} attention for {arch}: eager"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--exporter", default="torchscript", choices=("torchscript", "dynamo"),
                    help="torch's exporter: TorchScript (opset 17) or dynamo (torch.export, opset 18)")
    ap.add_argument("--small", action="store_true", help="2-layer, width-64 configs (a CPU check)")
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"of {', '.join(ALL_ARCHS)}")
    ap.add_argument("--attn", default="eager,sdpa")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp16"),
                    help="fp16: the export converted to float16 (weights, activations, inputs)")
    ap.add_argument("--past", type=int, default=0,
                    help="decoders: export a generation step with a key-value cache of this many positions "
                         "(dynamic: optimized for any cache length, benched at this one and at a later step)")
    ap.add_argument("--new", type=int, default=1, help="with --past: the step's new tokens (1: decoding)")
    ap.add_argument("--dynamic", action="store_true",
                    help="export with a dynamic batch and sequence, optimize without --shape, bench at the "
                         "export's shape and at another (batch + 1, 2 seq - 3)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tune-budget", type=float, help="onnxfuse optimize's --tune-budget (seconds; its default: 60)")
    ap.add_argument("--cuda-graph", action="store_true", help="also time the models under CUDA graphs")
    ap.add_argument("--tf-optimizer", action="store_true",
                    help="also time ONNX Runtime's transformers optimizer's model of the export (the peer)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_attention_") as tmp:
        for arch in args.archs.split(","):
            # (a family with only eager attention runs it alone)
            attns = ["eager"] if arch in MORE and MORE[arch][3] == "eager" else args.attn.split(",")
            for attn in attns:
                try:
                    row = run_or_eager(arch, attn, args, Path(tmp), fallback="eager" not in attns)
                except Exception as e:  # a model that cannot be built or exported: say so, go on
                    row = {"case": case_name(arch, attn, args), "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    run = {"provider": args.provider, "dtype": args.dtype, "batch": args.batch, "rows": rows}
                    args.json.write_text(json.dumps(run, indent=1) + "\n")
    print("\n| case | Softmax before | FusedAttention | Softmax left | Transposes before → after | ORT ms | "
          "onnxfuse ms | ORT + graph ms | onnxfuse + graph ms | tf-opt. ms | tf-opt. + graph ms | ORT err | "
          "onnxfuse err | tf-opt. err | gate (onnxfuse, tf-opt.) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {str(r['error'])[:80]} |" + " |" * 13)
            continue
        fmt = lambda v, captured=None: "-" if v is None else f"{v:.3f}" + (" (no graph)" if captured is False else "")  # noqa: E731
        err = lambda v: "-" if v is None else f"{v:.2g}"  # noqa: E731
        print(f"| {r['case']} | {r['softmax_before']} | {r['fused_attention']} | {r['softmax_left']} | "
              f"{r['transposes'][0]} → {r['transposes'][1]} | {fmt(r.get('ort_ms'))} | {fmt(r.get('onnxfuse_ms'))} | "
              f"{fmt(r.get('ort_graph_ms'), r.get('ort_captured'))} | "
              f"{fmt(r.get('onnxfuse_graph_ms'), r.get('onnxfuse_captured'))} | {fmt(r.get('tfopt_ms'))} | "
              f"{fmt(r.get('tfopt_graph_ms'), r.get('tfopt_captured'))} | {err(r.get('ort_err'))} | "
              f"{err(r.get('err'))} | "
              f"{err(r.get('tfopt_err'))} | {'pass' if r.get('gate') else 'FAIL'}"
              + (f", {'pass' if r['tfopt_gate'] else 'FAIL'}" if "tfopt_gate" in r else "") + " |")

if __name__ == "__main__":
    from onnxfuse.cli import end_process

    end_process(main() or 0)
