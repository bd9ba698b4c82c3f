"""Hugging Face transformers' own models, as their exporter writes them (benchmarks/hf_attention.py
at its `--small` sizes, on the CPU with --target none): every attention of BERT, GPT-2, ViT,
the T5 encoder (a learned position bias, RMSNorm without the mean), DistilBERT, LLaMA (RMSNorm,
rotary embeddings, grouped-query attention, SwiGLU) and the decoders built like it (Qwen2 with
biased projections, Mistral, Phi-3's packed QKV, GPT-NeoX's partial rotary, Gemma, Qwen3's
per-head norms) becomes one FusedAttention, the repeat of the key-value heads joins it
(kv_group) in every grouped-query decoder, every rotary embedding's rotate_half is read by its
pointwise chain (rotate_half), and the optimized model passes `onnxfuse bench`'s
gate (its error against the float64 reference within ORT's own error's bound) on seeded inputs."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from benchmarks import hf_attention  # noqa: E402

CASES = [(arch, "sdpa", "fp32") for arch in hf_attention.ARCHS] + [
    ("bert", "eager", "fp32"), ("llama", "eager", "fp32"), ("llama", "sdpa", "fp16"), ("t5", "sdpa", "fp16"),
    ("qwen2", "sdpa", "fp16"), ("gemma", "sdpa", "fp16")]


@pytest.mark.parametrize("arch,attn,dtype", CASES, ids=["-".join(c) for c in CASES])
def test_every_attention_fuses_and_the_model_passes_the_gate(arch, attn, dtype, tmp_path):
    args = argparse.Namespace(small=True, batch=2, dtype=dtype, provider="cpu", iters=3, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None)
    row = hf_attention.run_case(arch, attn, args, tmp_path)
    assert "error" not in row, row
    assert row["softmax_before"] > 0 and row["fused_attention"] == row["softmax_before"], row
    assert row["softmax_left"] == 0, row
    assert row["gate"], row
    assert set(row["stage_s"]) == {"export", "optimize", "bench"} | ({"fp16"} if dtype == "fp16" else set()), row
    if arch in hf_attention.DECODERS and arch != "gpt_neox":  # grouped-query: 2 query heads, 1 key-value head
        assert row["kv_groups"] == [2], row  # repeat_kv joins the kernel
    if arch in hf_attention.DECODERS:  # every rotate_half (its Neg, Slices and Concat) read by the rotary chain
        assert row["negs"][0] > 0 and row["negs"][1] == 0, row
    if arch in hf_attention.DECODERS:  # Q and K read through their Transposes (Phi-3's after its whole-head
        assert row["transposes"][1] == 0, row  # rotary split [..., :d], [..., d:] is dropped; GPT-NeoX's after its
        # per-head interleaved QKV is reordered into a packed one: pack.unpack_interleaved)
    if arch in hf_attention.DECODERS:  # no Concat left: rotate_half's and (GPT-NeoX) the partial rotary's,
        assert row["concats"][1] == 0, row  # Concat(rotary(q[..., :r]), q[..., r:]), join the chain (partial)


@pytest.mark.parametrize("arch,dtype", [("llama", "fp32"), ("qwen2", "fp32"), ("llama", "fp16")])
def test_decoder_step_with_a_key_value_cache_stays_dynamic_and_fuses(arch, dtype, tmp_path):
    """A generation step as decoders are deployed: past keys and values in, present ones out, every
    input's batch, the new tokens and the cached positions dynamic. Optimized without the cache
    length (each step has one more), every attention still fuses (its operands' batch dims are
    symbolic: the library checks them at run time), each rotate_half joins its chain (its Slice
    bounds x.shape[-1] // 2 fold on the static head dim) and so do Q's and K's Transposes, and the
    one optimized model passes the gate at the exported step and at a later one (another batch,
    twice the cache and more). In fp16 too, whose converter leaves value_info that an earlier shape
    inference named dim by dim ("unk__50"): such names are dropped, so the chain's shapes relate."""
    args = argparse.Namespace(small=True, batch=2, dtype=dtype, provider="cpu", iters=3, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None, past=8, new=1)
    row = hf_attention.run_case(arch, "sdpa", args, tmp_path)
    assert "error" not in row, row
    assert row["softmax_before"] > 0 and row["fused_attention"] == row["softmax_before"], row
    assert row["negs"][0] > 0 and row["negs"][1] == 0, row
    # Q's and K's Transposes read by their rotary chains, in both layers (a Shape left reading them,
    # its Gather of the static head dim folded, goes too)
    assert row["transposes"][1] <= row["transposes"][0] - 4, row
    assert row["gate"] and row["later_gate"], row
    assert row["later_step"] == "batch 3, past 19", row


MORE_CASES = ["gemma2", "phi", "stablelm", "bart", "clip_text", "beit", "gpt_bigcode", "whisper_encoder", "deberta_v2",
              "bloom"]


@pytest.mark.parametrize("arch", MORE_CASES)
def test_more_families(arch, tmp_path):
    """More of Hugging Face's families (`hf_attention.MORE`), each with a trait of its own: Gemma 2's
    sandwich norms and soft-capped scores, Phi's partial rotary, BART's cross-attention, CLIP's
    causal text mask with padding, BEiT's relative position bias, GPT-BigCode's one key-value
    head, Whisper's encoder, DeBERTa-v3's disentangled attention and BLOOM's ALiBi (both over merged
    heads, [B * H, S, S]: lifted, `onnxfuse.heads`). Every attention that should fuse does, and the
    gate passes."""
    _, _, _, attn, _, _, fuses = hf_attention.MORE[arch]
    args = argparse.Namespace(small=True, batch=2, dtype="fp32", provider="cpu", iters=2, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None)
    row = hf_attention.run_case(arch, attn, args, tmp_path)
    assert "error" not in row, row
    assert row["fused_attention"] == (row["softmax_before"] if fuses else 0) and row["softmax_before"] > 0, row
    assert row["gate"], row
    if arch == "phi":  # the partial rotary's Slices, Concats and the Transposes before them join the chains
        assert row["concats"][1] == 0 and row["transposes"][1] == 0 and row["negs"][1] == 0, row


@pytest.mark.parametrize("arch,exporter", [("gptj", "torchscript"), ("cohere", "dynamo"), ("glm", "dynamo")])
def test_interleaved_rotary_joins_its_chains(arch, exporter, tmp_path):
    """The interleaved rotation (rotate_pairs: GPT-J's rotate_every_two on the first rotary_dim
    dims, Cohere's on every dim, GLM's on half of them), its Slices of step 2, Neg, Unsqueezes,
    Concat and Reshape, and the partial rotary's Slices and Concat, are read by the rotary chains:
    none is left; every attention fuses and the gate passes (TorchScript cannot export Cohere and
    GLM: `hf_attention.DYNAMO_ONLY`)."""
    args = argparse.Namespace(small=True, batch=2, dtype="fp32", provider="cpu", iters=2, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None, exporter=exporter)
    row = hf_attention.run_case(arch, "sdpa", args, tmp_path)
    assert "error" not in row, row
    assert row["fused_attention"] == row["softmax_before"] > 0 and row["gate"], row
    assert row["negs"][0] > 0 and row["negs"][1] == 0 and row["concats"][1] == 0 and row["transposes"][1] == 0, row


@pytest.mark.parametrize("arch", ["bert", "llama", "vit"])
def test_dynamo_exports_fuse_as_torchscript_ones_do(arch, tmp_path):
    """torch's dynamo exporter (torch.export, its default since torch 2.9, opset 18) writes other
    graphs than TorchScript (K^T as Reshape(Transpose(Reshape(K))), its own Slice and Concat forms):
    every attention still fuses with its head Transposes, LLaMA's rotate_half and key-value repeat
    join their nodes, and the gate passes."""
    args = argparse.Namespace(small=True, batch=2, dtype="fp32", provider="cpu", iters=2, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None, exporter="dynamo")
    row = hf_attention.run_case(arch, "sdpa", args, tmp_path)
    assert "error" not in row, row
    assert row["fused_attention"] == row["softmax_before"] > 0 and row["gate"], row
    assert row["transposes"][1] <= (1 if arch == "vit" else 0), row  # (ViT: its patch embedding's)
    if arch == "llama":
        assert row["negs"][1] == 0 and row["expands"][1] == 0 and row["kv_groups"] == [2], row



@pytest.mark.parametrize("arch,exporter", [("bert", "torchscript"), ("llama", "torchscript"), ("llama", "dynamo"),
                                           ("vit", "dynamo")])
def test_dynamic_exports_fuse_as_static_ones_do(arch, exporter, tmp_path):
    """Exported as deployed models are, with a dynamic batch and sequence, and optimized without
    --shape: the heads' Reshapes to computed shapes ([batch, seq, -1, 32]: ONNX Runtime's symbolic
    inference knows the -1), the Shape reads of intermediates (read from the inputs instead) and
    dynamo's B * H no longer keep the heads' Transposes, repeat_kv or the packed QKV Split out of
    the attention; the one optimized model passes the gate at the export's shape and another."""
    pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    args = argparse.Namespace(small=True, batch=2, dtype="fp32", provider="cpu", iters=2, tf_optimizer=False,
                              cuda_graph=False, tune_budget=None, exporter=exporter, dynamic=True)
    row = hf_attention.run_case(arch, "sdpa", args, tmp_path)
    assert "error" not in row, row
    assert row["fused_attention"] == row["softmax_before"] > 0 and row["gate"] and row["later_gate"], row
    assert row["later_step"] == ("batch 3" if arch == "vit" else "batch 3, seq 29"), row
    assert row["transposes"][1] == (1 if arch == "vit" else 0), row  # (ViT: its patch embedding's)
    assert row["splits"][1] == 0, row  # (BERT, ViT: the packed Q, K, V's Split read in place)
    if arch == "llama":
        assert row["negs"][1] == 0 and row["kv_groups"] == [2], row
        assert row["expands"][1] == row["expands"][0] - 4, row  # both layers' K and V repeats joined


def test_a_family_without_the_asked_attention_runs_eager(monkeypatch, tmp_path):
    """A transformers version with no sdpa for a family (GPT-J in 5.17, the GPU machine's) raises a
    ValueError at the model's construction: the bench runs its eager attention and says so, rather
    than losing the row; any other error, and sdpa where eager runs too, stays an error."""
    calls = []

    def fake(arch, attn, args, tmp):
        calls.append(attn)
        if attn == "sdpa":
            raise ValueError(f"{arch} does not support an attention implementation through sdpa yet")
        return {"case": f"{arch}_{attn}"}

    monkeypatch.setattr(hf_attention, "run_case", fake)
    row = hf_attention.run_or_eager("gptj", "sdpa", None, tmp_path)
    assert calls == ["sdpa", "eager"] and row["case"] == "gptj_eager" and "no sdpa attention" in row["note"], row
    with pytest.raises(ValueError):
        hf_attention.run_or_eager("gptj", "sdpa", None, tmp_path, fallback=False)
    monkeypatch.setattr(hf_attention, "run_case", lambda *a: (_ for _ in ()).throw(ValueError("bad config")))
    with pytest.raises(ValueError, match="bad config"):
        hf_attention.run_or_eager("gptj", "sdpa", None, tmp_path)
