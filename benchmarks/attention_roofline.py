"""Attention at BERT-base, GPT-2 and ViT-S/16 shapes on the GPU: where the FusedAttention kernel
stands against its roofline bound, against ONNX Runtime (its unfused nodes, and its contrib
MultiHeadAttention, the op ORT's transformers optimizer puts there) and torch's
scaled_dot_product_attention, and which tile is fastest.

Workloads (fp32 and fp16; batch 1 and 8), each one self-attention as torch.onnx.export writes
it after onnxfuse's pack pass, the projections left out (their inputs are graph inputs):
- ``bert``: x [B, 128, 3 * 768] Split on the last axis, each part Reshaped to [B, 128, 12, 64]
  and Transposed to heads (K to [B, 12, 64, 128]), MatMul, Div by 8, Add an additive mask
  m [B, 1, 1, 128] (0 or -10000), Softmax, MatMul with V, Transpose back, Reshape to [B, 128, 768]
- ``gpt2``: the causal form of tests/test_attention_patterns.py ``_heads("where")``: q, k, v
  [B, 128, 12, 64], Where(keep, scores / 8, -10000) with a constant bool keep [1, 1, 128, 128]
  (lower triangle, as an export at static shapes has it: onnxfuse computes it from the indices
  and skips the key blocks past the diagonal), then as bert (no packed input)
- ``vit``: ViT-S/16, as bert with 6 heads and seq 197 (not a multiple of 16: the masked tile
  edges) and no mask

Per case, in one process of its own (`--case`; a crash or a timeout loses that case alone):
1. **onnxfuse**: the model optimized as `onnxfuse optimize --no-tune` does (the heuristic's
   tile), its FusedAttention node timed by `onnxfuse profile --provider cuda --device h200`
   (CUPTI kernel µs per node, 50 runs), the original's nodes the same way ("ORT unfused": their
   sum, under ORT's own fusions).
2. **Tiles**: every configuration `--tune configs` times (`codegen_attention.attention_candidates`)
   and the extra tiles below (`--tiles`), each compiled for the node (`compile.compile_kernels`
   with the tile as the variant, as onnxfuse.tune's `_search_configs` does), attached to it and
   profiled the same way. Every operand here is aligned (strides multiples of 16 elements,
   16-byte pointers), so a tile is compiled as its aligned variant alone (half the compiles);
   the default model keeps both. `onnxfuse bench` then gives every tile's max abs error against
   the float64 reference (the original in float64, on the case's inputs) beside ORT's own
   under its defaults (TF32 for fp32), and the gate.
3. **ORT's contrib attention**: one com.microsoft MultiHeadAttention node on separate query,
   key and value [B, S, 768] (no projection GEMM), in each form that expresses the mask:
   bert: ``bias`` (attention_bias [B, 1, S, S], the mask broadcast) and ``padding``
   (key_padding_mask int32 [B, S], mask_filter_value -10000); gpt2: ``causal``
   (unidirectional=1) and ``bias`` ([1, 1, S, S]); vit: ``plain``. Profiled the same way; its
   error against the reference and its CUDA kernels' names (which of flash, memory-efficient
   or unfused attention ORT chose) from a run in the process.
4. **torch**: F.scaled_dot_product_attention on the same data (Q, K, V strided views of the
   packed x; bert's mask as attn_mask; gpt2 is_causal=True), TF32 allowed for fp32 as ORT's
   default; with torch's choice ("auto") and each backend alone (flash, efficient, cudnn,
   math): CUDA-event µs over 100 calls queued back to back, CUPTI kernel µs per call, the
   kernels' names, the error against the reference, or why the backend refused.
5. **Roofline**: FLOPs = 4 B H S^2 D (the softmax not counted), bytes = the operands read once
   and the output written once (packed x or q, k, v; the mask; y); bound = max(FLOPs / peak,
   bytes / bandwidth) with the H200 datasheet's numbers (onnxfuse/analyze.py: fp16 989.5 and
   TF32 494.5 TFLOP/s, 4.8 TB/s); % of bound per variant.

Times come from `onnxfuse profile`'s own seeded random inputs (the kernels' work does not
depend on the data, save perhaps ORT's padding mask); every error is on the case's inputs
(N(0, 1) activations, the masks above), against the one float64 reference. Prints one table
(and one of every tile), and writes the JSON after every case (a run cut short keeps what
finished; each case's own log goes beside the JSON):

    python benchmarks/attention_roofline.py --json attention_roofline.json
    python benchmarks/attention_roofline.py --workloads bert --dtypes fp16 --batches 8 --tiles 64x128x4x2,128x128x8x2
    python benchmarks/attention_roofline.py --dry-run   # CPU, < 1 min: builds, fuses and checks every case, no timing
    python benchmarks/attention_roofline.py --provider cpu --target sm_90 --workloads bert --dtypes fp16 --batches 1
        # the whole measurement rehearsed on the CPU (the library's CPU kernel; kernels still compiled)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import roofline_runs as runs  # noqa: E402


@dataclass(frozen=True)
class Workload:
    """One self-attention: its heads, head dim, sequence, mask and whether Q, K, V come packed."""

    heads: int
    head_dim: int
    seq: int
    mask: str | None  # "add": additive [B, 1, 1, S] input; "where": bool keep [1, 1, S, S] constant; None
    packed: bool  # x [B, S, 3E] split in place; else q, k, v [B, S, H, D] inputs

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


WORKLOADS = {"bert": Workload(12, 64, 128, "add", True), "gpt2": Workload(12, 64, 128, "where", False),
             "vit": Workload(6, 64, 197, None, True)}
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}
MASKED = -10000.0  # the mask's value (BERT's additive mask, GPT-2's Where, ORT's mask_filter_value)
# ORT MultiHeadAttention forms per mask kind (module docstring, 3)
MHA_FORMS = {"add": ("bias", "padding"), "where": ("causal", "bias"), None: ("plain",)}
# Tiles (block_m, block_n, num_warps, num_stages) tried beside attention_candidates': BLOCK_N 128
# (seq 128 in one key block), 16- to 64-row tiles in 4 warps (batch 1 fills 132 SMs only with
# small tiles), fewer stages (one or two key blocks leave little to pipeline).
EXTRA_TILES = {
    "f16": ((64, 128, 4, 2), (128, 128, 8, 2), (64, 128, 4, 1), (32, 128, 4, 2), (16, 128, 4, 2), (32, 64, 4, 2),
            (64, 64, 4, 1)),
    "f32": ((64, 128, 8, 2), (32, 128, 4, 2), (16, 128, 4, 2), (32, 64, 4, 2), (16, 64, 4, 2), (64, 64, 4, 1)),
}
TORCH_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
PROFILE_ITERS = 50
PROVIDER = "cuda"
MAX_SHARED = 232448  # bytes of shared memory one block may have on the H100 / H200 (227 KiB)


# ---------------------------------------------------------------------------------------
# Models and inputs
# ---------------------------------------------------------------------------------------

def _model(nodes, inputs, outputs, inits, name: str, domains: tuple[str, ...] = ()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            *(helper.make_opsetid(d, 1) for d in domains)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def build(name: str, dtype: str, batch: int) -> onnx.ModelProto:
    """The workload's attention (module docstring); output y [B, S, hidden]."""
    w = WORKLOADS[name]
    t, np_t = DTYPES[dtype]
    b, s, h, d, e = batch, w.seq, w.heads, w.head_dim, w.hidden
    N = helper.make_node
    inits = [numpy_helper.from_array(np.array([b, s, h, d], np.int64), "heads"),
             numpy_helper.from_array(np.array([b, s, e], np.int64), "merged"),
             numpy_helper.from_array(np.array(np.sqrt(d), np_t), "scale")]
    if w.packed:
        inits.append(numpy_helper.from_array(np.array([e, e, e], np.int64), "split"))
        inputs = [helper.make_tensor_value_info("x", t, [b, s, 3 * e])]
        nodes = [N("Split", ["x", "split"], ["q2", "k2", "v2"], axis=-1, name="split")]
        nodes += [N("Reshape", [f"{x}2", "heads"], [x], name=f"reshape_{x}") for x in "qkv"]
    else:
        inputs = [helper.make_tensor_value_info(x, t, [b, s, h, d]) for x in "qkv"]
        nodes = []
    nodes += [N("Transpose", ["q"], ["qh"], perm=[0, 2, 1, 3], name="transpose_q"),
              N("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1], name="transpose_k"),
              N("Transpose", ["v"], ["vh"], perm=[0, 2, 1, 3], name="transpose_v"),
              N("MatMul", ["qh", "kt"], ["scores"], name="qk"), N("Div", ["scores", "scale"], ["scaled"], name="scale")]
    logits = "scaled"
    if w.mask == "add":
        inputs.append(helper.make_tensor_value_info("mask", t, [b, 1, 1, s]))
        nodes.append(N("Add", ["scaled", "mask"], ["masked"], name="mask"))
        logits = "masked"
    elif w.mask == "where":
        # a constant, as an export at static shapes has it (onnxfuse computes it from the indices)
        inits.append(numpy_helper.from_array(causal_keep(s), "keep"))
        inits.append(numpy_helper.from_array(np.array(MASKED, np_t), "masked_value"))
        nodes.append(N("Where", ["keep", "scaled", "masked_value"], ["masked"], name="causal"))
        logits = "masked"
    nodes += [N("Softmax", [logits], ["probs"], axis=-1, name="softmax"),
              N("MatMul", ["probs", "vh"], ["o"], name="pv"),
              N("Transpose", ["o"], ["oh"], perm=[0, 2, 1, 3], name="transpose_y"),
              N("Reshape", ["oh", "merged"], ["y"], name="merge")]
    return _model(nodes, inputs, [helper.make_tensor_value_info("y", t, [b, s, e])], inits, name)


def make_feeds(name: str, dtype: str, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The case's inputs, the same for every variant: N(0, 1) activations; bert's mask 0 or
    -10000 (30% of the keys masked, the first never); gpt2's keep is the model's constant."""
    w = WORKLOADS[name]
    np_t = DTYPES[dtype][1]
    rng = np.random.default_rng(seed)
    b, s = batch, w.seq
    if w.packed:
        out = {"x": rng.standard_normal((b, s, 3 * w.hidden)).astype(np_t)}
    else:
        out = {x: rng.standard_normal((b, s, w.heads, w.head_dim)).astype(np_t) for x in "qkv"}
    if w.mask == "add":
        mask = np.where(rng.random((b, 1, 1, s)) < 0.3, MASKED, 0.0)
        mask[..., 0] = 0.0
        out["mask"] = mask.astype(np_t)
    return out


def causal_keep(s: int) -> np.ndarray:
    """GPT-2's keep mask [1, 1, S, S]: the lower triangle."""
    return np.tril(np.ones((s, s), bool)).reshape(1, 1, s, s)


def qkv(name: str, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q, K and V as [B, S, hidden] (views of the packed x)."""
    w = WORKLOADS[name]
    e = w.hidden
    if w.packed:
        x = feeds["x"]
        return x[..., :e], x[..., e:2 * e], x[..., 2 * e:]
    return tuple(feeds[n].reshape(*feeds[n].shape[:2], e) for n in "qkv")


def additive_mask(name: str, feeds: dict[str, np.ndarray]) -> np.ndarray | None:
    """The mask as a float64 addend of the scores, broadcastable to [B, H, S, S] (gpt2's Where
    replaces the masked scores by -10000 rather than adding it: either way exp gives 0)."""
    w = WORKLOADS[name]
    if w.mask == "add":
        return feeds["mask"].astype(np.float64)
    if w.mask == "where":
        return np.where(causal_keep(w.seq), 0.0, MASKED)
    return None


def exact(name: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """softmax(Q K^T / sqrt(D) + mask) V in float64, [B, S, hidden]: the workload's math written
    independently of its graph (the dry run checks the graph against it)."""
    w = WORKLOADS[name]
    q, k, v = (a.astype(np.float64).reshape(*a.shape[:2], w.heads, w.head_dim).transpose(0, 2, 1, 3)
               for a in qkv(name, feeds))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(w.head_dim)
    if w.mask == "where":
        s = np.where(causal_keep(w.seq), s, MASKED)
    elif w.mask == "add":
        s = s + feeds["mask"].astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = p @ v
    return y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], w.hidden)


def mha_model(name: str, dtype: str, batch: int, form: str) -> onnx.ModelProto:
    """One com.microsoft MultiHeadAttention node: query, key, value [B, S, hidden] and the
    form's mask input (MHA_FORMS); output [B, S, hidden]; the default scale 1 / sqrt(D)."""
    w = WORKLOADS[name]
    t = DTYPES[dtype][0]
    b, s, e = batch, w.seq, w.hidden
    inputs = [helper.make_tensor_value_info(x, t, [b, s, e]) for x in ("query", "key", "value")]
    names = ["query", "key", "value"]
    attrs = {"num_heads": w.heads}
    if form == "bias":
        inputs.append(helper.make_tensor_value_info("attention_bias", t, [b if w.mask == "add" else 1, 1, s, s]))
        names += ["", "", "attention_bias"]
    elif form == "padding":
        inputs.append(helper.make_tensor_value_info("key_padding_mask", TensorProto.INT32, [b, s]))
        names += ["", "key_padding_mask"]
        attrs["mask_filter_value"] = MASKED
    elif form == "causal":
        attrs["unidirectional"] = 1
    elif form != "plain":
        raise ValueError(f"MultiHeadAttention form {form!r}")
    node = helper.make_node("MultiHeadAttention", names, ["y"], name="mha", domain="com.microsoft", **attrs)
    return _model([node], inputs, [helper.make_tensor_value_info("y", t, [b, s, e])], [], f"{name}_mha_{form}",
                  ("com.microsoft",))


def mha_feeds(name: str, feeds: dict[str, np.ndarray], form: str) -> dict[str, np.ndarray]:
    """The MultiHeadAttention model's inputs holding the case's data."""
    q, k, v = (np.ascontiguousarray(a) for a in qkv(name, feeds))
    out = {"query": q, "key": k, "value": v}
    w = WORKLOADS[name]
    if form == "bias":
        add = additive_mask(name, feeds)
        shape = (q.shape[0] if w.mask == "add" else 1, 1, w.seq, w.seq)
        out["attention_bias"] = np.ascontiguousarray(np.broadcast_to(add, shape)).astype(q.dtype)
    elif form == "padding":
        out["key_padding_mask"] = (feeds["mask"].reshape(q.shape[0], w.seq) == 0).astype(np.int32)
    return out


def roofline(name: str, dtype: str, batch: int) -> dict:
    """FLOPs, bytes and the H200 bound (module docstring, 5)."""
    from onnxfuse.analyze import DEVICES

    w = WORKLOADS[name]
    dev = DEVICES["h200"]
    es = np.dtype(DTYPES[dtype][1]).itemsize
    b, s, e = batch, w.seq, w.hidden
    flops = 4 * b * w.heads * s * s * w.head_dim
    mask_bytes = {"add": b * s * es, "where": s * s, None: 0}[w.mask]
    nbytes = 4 * b * s * e * es + mask_bytes  # Q, K, V read, Y written
    peak = dev.peak_tflops["fp16" if dtype == "fp16" else "tf32"]
    compute_us, memory_us = flops / (peak * 1e12) * 1e6, nbytes / (dev.bandwidth_tbps * 1e12) * 1e6
    return {"flops": flops, "bytes": nbytes, "peak_tflops": peak, "bandwidth_tbps": dev.bandwidth_tbps,
            "compute_us": compute_us, "memory_us": memory_us, "bound_us": max(compute_us, memory_us)}


# ---------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------

def parse_tile(text: str) -> tuple[int, int, int, int]:
    """"64x128x4x2" -> (block_m, block_n, num_warps, num_stages)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 64x128x4x2")
    return tuple(int(p) for p in parts)


def short(tile) -> str:
    bm, bn, w, s = tile
    return f"{bm}x{bn} {w}w {s}s"


def tile_list(spec, which: str) -> list[dict]:
    """The tiles to time for `spec`: `which` is a comma list of "candidates" (what `--tune
    configs` times, the heuristic's "default" first), "extra" (EXTRA_TILES) and tiles
    BMxBNxWxS; each once. A tile's variants: the aligned one (module docstring, 2)."""
    from onnxfuse.codegen_attention import AttentionVariant, attention_candidates

    out: list[dict] = []
    seen: set[tuple] = set()

    def add(config: str, tile: tuple, source: str) -> None:
        if tile in seen:
            return
        seen.add(tile)
        bm, bn, w, s = tile
        variant = AttentionVariant(index=0, block_m=bm, block_n=bn, num_warps=w, num_stages=s, aligned=True)
        out.append({"config": config, "tile": list(tile), "label": short(tile), "source": source,
                    "variants": (variant,)})

    for item in (x.strip() for x in which.split(",") if x.strip()):
        if item == "candidates":
            for label, variants in attention_candidates(spec):
                v = variants[0]
                add(label, (v.block_m, v.block_n, v.num_warps, v.num_stages), "candidate")
        elif item == "extra":
            for tile in EXTRA_TILES["f32" if spec.dtype == "f32" else "f16"]:
                add(f"tile {tile[0]}x{tile[1]}, {tile[2]} warps, {tile[3]} stages", tile, "extra")
        else:
            tile = parse_tile(item)
            add(f"tile {tile[0]}x{tile[1]}, {tile[2]} warps, {tile[3]} stages", tile, "given")
    return out


def tile_models(result, spec, tiles: list[dict], targets: list[int], tmp: Path, tag: str) -> None:
    """Compile each tile for the node (the cache filled first, in parallel), attach it to a copy
    of the optimized model and save it: tile["path"], or tile["error"]."""
    from onnxfuse import compile as aot
    from onnxfuse.codegen_attention import generate_attention

    index = next(i for i, n in enumerate(result.model.graph.node) if n.op_type == "FusedAttention")
    good = []
    for t in tiles:
        try:
            for v in t["variants"]:
                generate_attention(spec, v)
            good.append(t)
        except ValueError as e:
            t["error"] = str(e)
    if good:
        aot.compile_kernels([spec], targets, variant_override=tuple(v for t in good for v in t["variants"]),
                            errors="collect")
    for i, t in enumerate(good):
        try:
            (ck,) = aot.compile_kernels([spec], targets, variant_override=t["variants"])
            m = onnx.ModelProto()
            m.CopyFrom(result.model)
            aot.attach(m.graph.node[index], ck)
            path = tmp / f"{tag}.tile{i}.onnx"
            onnx.save(m, path)
            t["path"] = str(path)
            t["shared"] = max(b.shared for b in ck.binaries)
            if t["shared"] > MAX_SHARED:
                t["note"] = f"{t['shared']} bytes of shared memory: more than an H200 block may have"
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded and skipped
            t["error"] = _first_line(e)


# ---------------------------------------------------------------------------------------
# Measuring (the onnxfuse CLI in this process, as `python -m onnxfuse.cli` would run it)
# ---------------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def cli(*args: str) -> str:
    """`onnxfuse ARGS` in this process (onnxfuse.cli.main); its stdout, or RuntimeError with the
    last line it printed."""
    from onnxfuse.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    if code != 0:
        raise RuntimeError(f"onnxfuse {args[0]} failed: {(err.getvalue() or out.getvalue()).strip().splitlines()[-1:]}")
    return out.getvalue()


def profile(path: Path, provider: str) -> dict:
    """`onnxfuse profile` of a model: its nodes (roofline_runs.profile_nodes, each with the
    provider ORT placed it on), their summed µs and where the times came from."""
    js = path.with_suffix(".profile.json")
    cli("profile", str(path), "--provider", provider, "--device", "h200", "--iters", str(PROFILE_ITERS),
        "--json", str(js))
    d = json.loads(js.read_text())
    nodes = runs.profile_nodes(js, "tflops")
    for n, raw in zip(nodes, d["nodes"], strict=True):
        n["provider"] = raw["provider"]
    return {"nodes": nodes, "us": sum(n["us"] for n in nodes), "time_source": d["time_source"],
            "warnings": d["warnings"]}


def fused_us(prof: dict) -> float | None:
    """The FusedAttention node's µs in a profile."""
    times = [n["us"] for n in prof["nodes"] if n["op"] == "FusedAttention"]
    return sum(times) if times else None


def _max_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max())


def gpu_kernels(torch, fn, tmp: Path, calls: int = 20) -> dict:
    """CUPTI (through torch's profiler, as `onnxfuse profile` does) over `calls` calls of fn:
    the GPU kernels' µs per call and their names."""
    from onnxfuse.trace import run_under_cupti

    trace = run_under_cupti(torch, fn, calls, tmp) or {}
    ev = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"]
    return {"us_cupti": sum(float(e.get("dur", 0.0)) for e in ev) / calls if ev else None,
            "kernels": sorted({str(e.get("name", ""))[:120] for e in ev})}


def ort_mha(name: str, dtype: str, batch: int, feeds: dict[str, np.ndarray], ref: np.ndarray, tmp: Path,
            tag: str, provider: str) -> dict[str, dict]:
    """Each MultiHeadAttention form (MHA_FORMS): its profile, and from a run here its error
    against the reference and (CUDA) its kernels; or the error that stopped it."""
    import onnxruntime as ort

    out: dict[str, dict] = {}
    for form in MHA_FORMS[WORKLOADS[name].mask]:
        entry: dict = {}
        out[form] = entry
        try:
            m = mha_model(name, dtype, batch, form)
        except Exception as e:  # noqa: BLE001
            entry["error"] = _first_line(e)
            continue
        path = tmp / f"{tag}.mha_{form}.onnx"
        onnx.save(m, path)
        try:
            prof = profile(path, provider)
            entry.update(us=prof["us"], nodes=prof["nodes"], time_source=prof["time_source"],
                         providers=sorted({n["provider"] for n in prof["nodes"]}))
        except Exception as e:  # noqa: BLE001 - ORT's errors: recorded, the case goes on
            entry["error"] = _first_line(e)
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            providers = [("CUDAExecutionProvider", {}), "CPUExecutionProvider"] if provider == "cuda" else \
                ["CPUExecutionProvider"]
            sess = ort.InferenceSession(m.SerializeToString(), so, providers=providers)
            f = mha_feeds(name, feeds, form)
            (y,) = sess.run(None, f)
            entry["err"] = _max_err(y, ref)
            if provider == "cuda":
                import torch

                entry["kernels"] = gpu_kernels(torch, lambda s=sess, f=f: s.run(None, f), tmp, calls=3)["kernels"]
        except Exception as e:  # noqa: BLE001
            entry["run_error"] = _first_line(e)
    return out


def torch_peer(name: str, dtype: str, feeds: dict[str, np.ndarray], ref: np.ndarray, device: str,
               tmp: Path | None = None) -> dict:
    """torch's scaled_dot_product_attention on the case's data (module docstring, 4): per
    backend its error against the reference and, on CUDA, its times and kernels."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = True  # ORT's CUDA default (use_tf32)
    torch.backends.cudnn.allow_tf32 = True
    w = WORKLOADS[name]
    b, e = ref.shape[0], w.hidden
    if w.packed:
        x = torch.from_numpy(feeds["x"]).to(device)
        q, k, v = (x[..., i * e:(i + 1) * e].unflatten(-1, (w.heads, w.head_dim)).transpose(1, 2) for i in range(3))
    else:
        q, k, v = (torch.from_numpy(feeds[n]).to(device).transpose(1, 2) for n in "qkv")
    mask = torch.from_numpy(feeds["mask"]).to(device) if w.mask == "add" else None
    causal = w.mask == "where"

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    backends = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    out = {"allowed": {k_: bool(getattr(torch.backends.cuda, f"{k_}_sdp_enabled")())
                       for k_ in ("flash", "mem_efficient", "math", "cudnn")},
           "tf32": torch.backends.cuda.matmul.allow_tf32, "torch": torch.__version__, "backends": {}}
    for label, backend in backends.items():
        entry: dict = {}
        ctx = contextlib.nullcontext() if backend is None else sdpa_kernel([backend])
        with ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                y = sdpa()
                entry["err"] = _max_err(y.transpose(1, 2).reshape(b, w.seq, e).cpu().numpy(), ref)
                if device == "cuda":
                    from benchmarks.gpu_timing import time_queued

                    entry["us_events"] = time_queued(sdpa, iters=100, warmup=20).median_ms * 1e3
                    entry.update(gpu_kernels(torch, sdpa, tmp))
            except Exception as err:  # noqa: BLE001 - a backend that refuses (or fails) is recorded
                entry["error"] = _first_line(err)
                entry["why"] = [str(c.message).strip().splitlines()[0][:200] for c in caught][:4]
        out["backends"][label] = entry
    auto = out["backends"]["auto"]
    if "kernels" in auto:  # which backend torch's own choice ran: the one with the same kernels
        auto["same_as"] = next((k_ for k_, x in out["backends"].items()
                                if k_ != "auto" and x.get("kernels") == auto["kernels"]), None)
    return out


# ---------------------------------------------------------------------------------------
# One case (a process of its own)
# ---------------------------------------------------------------------------------------

def measure(name: str, dtype: str, batch: int, args, tmp: Path, save) -> dict:
    """Everything the module docstring lists for one case; `save(row)` after each step."""
    from onnxfuse.codegen_attention import attention_variants
    from onnxfuse.pipeline import build_options, optimize_model
    from onnxfuse.reference import evaluate
    from onnxfuse.specs import kernel_spec

    w = WORKLOADS[name]
    tag = f"{name}_{dtype}_b{batch}"
    row = {"workload": name, "dtype": dtype, "batch": batch, "heads": w.heads, "head_dim": w.head_dim,
           "seq": w.seq, "provider": args.provider, "roofline": roofline(name, dtype, batch)}
    save(row)

    def step(key: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            row[key] = fn()
        except Exception as e:  # noqa: BLE001 - a step that fails is recorded; the others still run
            row[key] = {"error": _first_line(e)}
            traceback.print_exc()
        print(f"{tag}: {key} {time.perf_counter() - t0:.1f} s", flush=True)
        save(row)

    model = build(name, dtype, batch)
    src, opt = tmp / f"{tag}.onnx", tmp / f"{tag}.opt.onnx"
    onnx.save(model, src)
    feeds = make_feeds(name, dtype, batch)
    inputs = {}
    for k, a in feeds.items():
        inputs[k] = tmp / f"{tag}.{k}.npy"
        np.save(inputs[k], a)
    ref = evaluate(model, feeds)["y"]  # the float64 reference, as `onnxfuse bench` computes it

    result = optimize_model(model, options=build_options(target=args.target, tune="off"))
    ops = [n.op_type for n in result.model.graph.node]
    if ops.count("FusedAttention") != 1:
        row["error"] = f"not one FusedAttention node: {ops}"
        save(row)
        return row
    onnx.save(result.model, opt)
    spec = kernel_spec(result.model, result.fused[0], "tf32")
    v0 = attention_variants(spec)[0]
    row["default_tile"] = short((v0.block_m, v0.block_n, v0.num_warps, v0.num_stages))

    step("ort", lambda: profile(src, args.provider))
    step("onnxfuse", lambda: profile(opt, args.provider))
    if not args.no_mha:
        step("mha", lambda: ort_mha(name, dtype, batch, feeds, ref, tmp, tag, args.provider))
    if not args.no_torch:
        step("torch", lambda: torch_peer(name, dtype, feeds, ref, "cuda" if args.provider == "cuda" else "cpu",
                                         tmp))

    tiles = tile_list(spec, args.tiles)
    from onnxfuse import compile as aot

    targets = aot.targets(args.target)

    def time_tiles() -> list[dict]:
        tile_models(result, spec, tiles, targets, tmp, tag)
        for t in tiles:
            if "path" in t:
                try:
                    t["us"] = fused_us(profile(Path(t["path"]), args.provider))
                except Exception as e:  # noqa: BLE001 - a tile that does not run is recorded
                    t["error"] = _first_line(e)
        return [{k: v for k, v in t.items() if k != "variants"} for t in tiles]
    step("tiles", time_tiles)

    def bench() -> dict:
        timed = [t for t in row["tiles"] if t.get("us") is not None] if isinstance(row["tiles"], list) else []
        res = runs.accuracy_models(src, [opt, *(Path(t["path"]) for t in timed)], tmp / f"{tag}.bench.json",
                                   args.provider, inputs)
        for t, r in zip(timed, res[1:], strict=True):
            t.update(r)
        return res[0]
    step("accuracy", bench)
    return row




def run_case_process(case: tuple[str, str, int], args, tmp: Path) -> dict:
    """One case in a child process (`--case`), its row read back; a timeout, a crash or an
    interrupt keeps the steps it finished."""
    name, dtype, batch = case
    tag = f"{name}_{dtype}_b{batch}"
    row_path = tmp / f"{tag}.row.json"
    log_dir = args.json.parent if args.json else tmp
    log = log_dir / f"{args.json.stem if args.json else 'attention_roofline'}.{tag}.log"
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--case", f"{name},{dtype},{batch}",
           "--case-json", str(row_path), "--tmp", str(tmp), "--tiles", args.tiles, "--provider", args.provider,
           "--target", args.target, *(["--no-torch"] if args.no_torch else []), *(["--no-mha"] if args.no_mha else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    problem, interrupted = None, False
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.case_timeout)
            if r.returncode != 0:
                problem = f"case process exited {r.returncode}"
        except subprocess.TimeoutExpired:
            problem = f"case timed out after {args.case_timeout} s"
        except KeyboardInterrupt:
            problem, interrupted = "interrupted", True
    row = json.loads(row_path.read_text()) if row_path.exists() else {"workload": name, "dtype": dtype,
                                                                      "batch": batch}
    row["seconds"] = time.perf_counter() - t0
    if problem:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        row["error"] = f"{problem}: {' | '.join(tail)[-400:]}"
    if interrupted:
        row["interrupted"] = True
    return row


def case_main(args) -> None:
    """`--case NAME,DTYPE,BATCH`: measure one case, its row written to --case-json after each step."""
    name, dtype, batch = args.case.split(",")
    path = args.case_json

    def save(row: dict) -> None:
        tmp = path.with_suffix(".part")
        tmp.write_text(json.dumps(row, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    measure(name, dtype, int(batch), args, args.tmp, save)


# ---------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------

def summary(row: dict) -> dict:
    """The numbers of the table for one row (None where a step did not give them)."""
    def ok(key):
        v = row.get(key)
        return v if isinstance(v, dict) and "error" not in v else None
    bound = row.get("roofline", {}).get("bound_us")
    ort, fused, acc = ok("ort"), ok("onnxfuse"), ok("accuracy")
    mha = {f: e for f, e in (ok("mha") or {}).items() if e.get("us") is not None}
    mha_best = min(mha, key=lambda f: mha[f]["us"], default=None)
    if mha_best and row.get("provider") == "cuda" and "CPUExecutionProvider" in mha[mha_best].get("providers", ()):
        mha_best_label = f"{mha_best}, on the CPU"  # ORT placed it on its CPU EP: no CUDA kernel for it
    else:
        mha_best_label = mha_best
    auto = ((ok("torch") or {}).get("backends") or {}).get("auto") or {}
    tiles = [t for t in (row["tiles"] if isinstance(row.get("tiles"), list) else []) if t.get("us") is not None]
    best = min(tiles, key=lambda t: t["us"], default=None)
    s = {"ort_us": ort["us"] if ort else None, "mha_us": mha[mha_best]["us"] if mha_best else None,
         "mha_form": mha_best_label, "torch_us": auto.get("us_cupti"), "torch_backend": auto.get("same_as"),
         "default_us": fused_us(fused) if fused else None, "default_tile": row.get("default_tile"),
         "best_us": best["us"] if best else None, "best_tile": best["label"] if best else None,
         "bound_us": bound, "default_err": acc.get("err") if acc else None,
         "ort_err": acc.get("ort_err") if acc else None, "default_gate": acc.get("gate_passed") if acc else None,
         "best_err": best.get("err") if best else None, "best_gate": best.get("gate_passed") if best else None}
    for k in ("ort", "mha", "torch", "default", "best"):
        us = s[f"{k}_us"]
        s[f"{k}_pct_bound"] = 100.0 * bound / us if bound and us else None
    return s


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _gate(v) -> str:
    return "-" if v is None else ("pass" if v else "FAIL")


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (module docstring)."""
    lines = ["| case | ORT unfused µs | ORT MHA µs (form) | torch SDPA µs (backend) | onnxfuse default µs (tile) "
             "| best tile µs (tile) | bound µs | % of bound default / best | err default / best / ORT | gate "
             "default / best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = summary(r)
        case = f"{r['workload']} {r['dtype']} b{r['batch']}"
        if r.get("error") and s["default_us"] is None:
            lines.append(f"| {case} | error: {str(r['error'])[:100]} | | | | | {_f(s['bound_us'], '.2f')} | | | |")
            continue
        lines.append(
            f"| {case} | {_f(s['ort_us'])} | {_f(s['mha_us'])} ({s['mha_form'] or '-'}) | "
            f"{_f(s['torch_us'])} ({s['torch_backend'] or '-'}) | {_f(s['default_us'])} ({s['default_tile'] or '-'}) | "
            f"{_f(s['best_us'])} ({s['best_tile'] or '-'}) | {_f(s['bound_us'], '.2f')} | "
            f"{_f(s['default_pct_bound'], '.0f')}% / {_f(s['best_pct_bound'], '.0f')}% | "
            f"{_f(s['default_err'], '.2g')} / {_f(s['best_err'], '.2g')} / {_f(s['ort_err'], '.2g')} | "
            f"{_gate(s['default_gate'])} / {_gate(s['best_gate'])} |"
            + (f" {str(r['error'])[:80]}" if r.get("error") else ""))
    return "\n".join(lines)


def tile_table(rows: list[dict]) -> str:
    """Every tile of every case: µs, % of bound, error and gate (or why it did not run)."""
    lines = ["| case | tile | from | µs | % of bound | shared KiB | err | gate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = r.get("roofline", {}).get("bound_us")
        for t in r["tiles"] if isinstance(r.get("tiles"), list) else []:
            us = t.get("us")
            pct = 100.0 * bound / us if bound and us else None
            shared = t["shared"] / 1024 if t.get("shared") is not None else None
            lines.append(f"| {r['workload']} {r['dtype']} b{r['batch']} | {t['label']} | {t.get('source', '-')} | "
                         f"{_f(us)} | {_f(pct, '.0f')}% | {_f(shared, '.0f')} | {_f(t.get('err'), '.2g')} | "
                         f"{_gate(t.get('gate_passed'))} |" + (f" {t['error'][:80]}" if t.get("error") else ""))
    return "\n".join(lines)


def keep(rows: list[dict], row: dict, json_path: Path | None) -> None:
    """Add a case's row, write the JSON (every row so far) and print the row's summary on one line."""
    rows.append(row)
    if json_path:
        json_path.write_text(json.dumps({"rows": rows}, indent=1, default=str) + "\n")
    print(json.dumps({"case": f"{row['workload']} {row['dtype']} b{row['batch']}", **summary(row),
                      **({"error": row["error"]} if row.get("error") else {})}, default=str), flush=True)


# ---------------------------------------------------------------------------------------
# Dry run
# ---------------------------------------------------------------------------------------

DRY_TOL = {"fp32": 1e-5, "fp16": 5e-3}  # max abs error vs float64 on the CPU (N(0, 1) inputs: |y| < 3)


def dry_run(cases: list[tuple[str, str, int]], tiles: str) -> list[dict]:
    """CPU: each case built, optimized without kernels (exactly one FusedAttention, no Softmax or
    Transpose left), its graph checked against the independent float64 formula, the original
    and the fused model's function body run in ORT against it, each MultiHeadAttention form
    built (onnx.checker) and run on ORT's CPU kernel against it, torch's CPU SDPA against it,
    and its tiles listed. No timing."""
    import onnxruntime as ort

    from onnxfuse.pipeline import build_options, optimize_model
    from onnxfuse.reference import evaluate
    from onnxfuse.specs import kernel_spec

    so = ort.SessionOptions()
    so.log_severity_level = 3

    def cpu_run(m: onnx.ModelProto, feeds: dict) -> np.ndarray:
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    rows = []
    for name, dtype, batch in cases:
        m = build(name, dtype, batch)
        r = optimize_model(m, options=build_options(target="none", tune="off"))
        ops = [n.op_type for n in r.model.graph.node]
        assert ops.count("FusedAttention") == 1 and not {"Softmax", "Transpose"} & set(ops), (name, dtype, ops)
        feeds = make_feeds(name, dtype, batch)
        ref = evaluate(m, feeds)["y"]
        graph_err = float(np.abs(ref - exact(name, feeds)).max())
        assert graph_err < 1e-9, (name, dtype, batch, "the graph is not the workload's math", graph_err)
        tol = DRY_TOL[dtype]
        row = {"workload": name, "dtype": dtype, "batch": batch, "nodes": ops, "graph_vs_formula": graph_err,
               "ort_cpu_err": _max_err(cpu_run(m, feeds), ref),
               "function_body_err": _max_err(cpu_run(r.model, feeds), ref),  # no library: the node's function
               "mha_cpu_err": {}}
        for form in MHA_FORMS[WORKLOADS[name].mask]:
            mm = mha_model(name, dtype, batch, form)  # onnx.checker.check_model(full_check=True) inside
            row["mha_cpu_err"][form] = _max_err(cpu_run(mm, mha_feeds(name, feeds, form)), ref)
        peer = torch_peer(name, dtype, feeds, ref, "cpu")
        row["torch_cpu_err"] = {k: x.get("err", x.get("error")) for k, x in peer["backends"].items()}
        checks = {"ORT": row["ort_cpu_err"], "function body": row["function_body_err"],
                  "torch": peer["backends"]["auto"].get("err", np.inf),
                  **{f"MultiHeadAttention {f}": e for f, e in row["mha_cpu_err"].items()}}
        bad = {k: v for k, v in checks.items() if not v < tol}
        assert not bad, (name, dtype, batch, f"errors against float64 above {tol}", bad)
        spec = kernel_spec(r.model, r.fused[0], "tf32")
        row["tiles"] = [f"{t['label']} ({t['source']})" for t in tile_list(spec, tiles)]
        row["roofline"] = roofline(name, dtype, batch)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
    return rows


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every row here after each case (each case's log beside it)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tiles", default="candidates,extra",
                    help="tiles to time: candidates (what --tune configs times), extra (EXTRA_TILES) and/or "
                         "BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated")
    ap.add_argument("--provider", choices=("cuda", "cpu"), default=PROVIDER,
                    help="cpu: rehearse the measurement on the CPU (the library's CPU kernel; times mean nothing)")
    ap.add_argument("--target", default="auto", help="GPU targets the kernels are compiled for (auto: the local GPU)")
    ap.add_argument("--case-timeout", type=float, default=240.0, help="seconds one case may take")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch peer")
    ap.add_argument("--no-mha", action="store_true", help="skip ORT's MultiHeadAttention")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build, fuse and check every case, no timing")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--case-json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        case_main(args)
        return
    cases = [(wl, dt, int(b)) for wl in args.workloads.split(",") for dt in args.dtypes.split(",")
             for b in args.batches.split(",")]
    for wl, dt, _ in cases:
        if wl not in WORKLOADS or dt not in DTYPES:
            ap.error(f"unknown workload or dtype: {wl}, {dt}")
    if args.dry_run:
        t0 = time.perf_counter()
        rows = dry_run(cases, args.tiles)
        if args.json:
            args.json.write_text(json.dumps({"dry_run": True, "rows": rows}, indent=1, default=str) + "\n")
        print("\n| case | nodes | tiles to time | bound µs |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} {r['dtype']} b{r['batch']} | {', '.join(r['nodes'])} | {'; '.join(r['tiles'])} "
                  f"| {r['roofline']['bound_us']:.2f} |")
        print(f"\ndry run: {len(rows)} cases in {time.perf_counter() - t0:.0f} s")
        return
    rows: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="attention_roofline_"))
    try:
        for case in cases:
            row = run_case_process(case, args, tmp)
            keep(rows, row, args.json)
            if row.get("interrupted"):
                print("interrupted: the cases after this one were not run", flush=True)
                break
    except KeyboardInterrupt:
        print("interrupted: the cases after this one were not run", flush=True)
    print()
    print(table(rows))
    print()
    print(tile_table(rows))


if __name__ == "__main__":
    from onnxfuse.cli import end_process

    end_process(main() or 0)
