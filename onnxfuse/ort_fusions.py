"""Which nodes ONNX Runtime's own graph fusions will absorb, so that onnxfuse leaves them alone.

ONNX Runtime fuses transformer subgraphs itself (erf-GELU after a bias Add into BiasGelu,
decomposed or residual LayerNorms into (Skip)LayerNormalization, MatMul + scale into
FusedMatMul, ...). A pointwise chain that takes some of those nodes first breaks the
fusion and can lose to it (a torch TransformerEncoderLayer on the H200: 0.95x at batch 8).

Rather than re-implement ORT's matchers, `ort_fusions` asks ORT: it optimizes the model on
the CPU EP at ORT_ENABLE_EXTENDED (which includes BASIC) without running it, reads the
model ORT writes (`SessionOptions.optimized_model_filepath`) and maps every fused node of
`FUSED_OPS` back to the original nodes it replaced (`absorbed_nodes`).

- One ORT run, not a BASIC/EXTENDED pair: BASIC (ORT's level 1) fuses too (MatMul + Add into
  Gemm, erf-GELU into the ONNX Gelu from opset 20, LayerNorm into LayerNormalization from
  opset 17), so "gone only at EXTENDED" would miss those. Nodes that only constant folding,
  common-subexpression elimination or no-op removal drop are not attributed to any fused
  node, so they are never reserved.
- The CPU EP stands for CUDA: every fusion in `FUSED_OPS` is registered for both EPs
  (onnxruntime/core/optimizer/graph_transformer_utils.cc). The CUDA-only ones cannot be
  seen here: GroupQueryAttentionFusion starts from com.microsoft attention nodes (no
  pointwise node of an exported graph), BiasDropoutFusion from Dropout nodes (removed by
  `onnxfuse.load.canonicalize`). Fusions registered for the CPU EP but not CUDA
  (Conv + activation into FusedConv, Gemm + activation into FusedGemm, the quantization
  ones) are not in `FUSED_OPS`, so they reserve nothing.
- Float16 models are probed as float32 (`as_float32`): ORT's CPU EP runs float16 through
  inserted Casts, and fuses nothing there, while its CUDA EP fuses them. ORT compares a
  float16 constant with the float16 rounding of the value it expects (sqrt 2, 0.5, ...;
  optimizer/utils.cc, IsInitializerWithExpectedValue), a float32 one within 1e-5: so a
  one-element float16 constant that rounds like one of `_EXPECTED` becomes that value.
  Bfloat16 models are probed as they are: ORT's fusions check for float16, float and double
  (and its constant check has no bfloat16), so they fuse little of them on any EP.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto

from onnxfuse.ir import serialized_bytes
from onnxfuse.load import declared_bytes, light_copy
from onnxfuse.retype import Retype, holds

MS = "com.microsoft"

# The fused nodes whose source nodes are left to ONNX Runtime: (domain, op_type) -> the
# name the report gives the fusion. All are registered for the CUDA EP (and the CPU EP).
# Not QuickGelu: ORT makes it of every x * Sigmoid(x) (SiLU), two nodes that a pointwise
# chain fuses as well, and with their neighbours (CNNs' SiLU chains, measured faster fused).
FUSED_OPS: dict[tuple[str, str], str] = {
    (MS, "BiasGelu"): "BiasGelu",
    (MS, "Gelu"): "Gelu",
    ("", "Gelu"): "Gelu",
    (MS, "FastGelu"): "FastGelu",
    ("", "LayerNormalization"): "LayerNormalization",
    (MS, "SkipLayerNormalization"): "SkipLayerNormalization",
    ("", "SimplifiedLayerNormalization"): "SimplifiedLayerNormalization",
    (MS, "SkipSimplifiedLayerNormalization"): "SkipSimplifiedLayerNormalization",
    (MS, "EmbedLayerNormalization"): "EmbedLayerNormalization",
    (MS, "Attention"): "Attention",
    (MS, "MultiHeadAttention"): "Attention",
    (MS, "BiasSoftmax"): "BiasSoftmax",
    (MS, "FusedMatMul"): "FusedMatMul",  # MatMul with a scalar scale or a transposed operand
    ("", "Gemm"): "MatMul + Add into Gemm",
}
# Ops ORT puts around a fused node without a name of the original graph (MatMul + Add of
# 3-D tensors becomes Reshape -> Gemm -> Reshape): followed to the fused node.
_WRAPPERS = frozenset({"Reshape", "Squeeze", "Unsqueeze"})

_LOW_FLOATS = frozenset({TensorProto.FLOAT16})
# Constants ORT's GELU, LayerNorm and attention fusions look for, in float32.
_EXPECTED = np.array([0.5, 1.0, 2.0, 3.0, np.sqrt(2.0), 1 / np.sqrt(2.0), np.sqrt(2 / np.pi), 0.044715,
                      0.044715 * np.sqrt(2 / np.pi)], np.float32)


def reason(fusion: str) -> str:
    """The report's reason for nodes left to one of ORT's fusions."""
    return f"left to ONNX Runtime's {fusion} fusion"


@dataclass(frozen=True)
class OrtFusions:
    """What `ort_fusions` found: node index (in the model given) -> the report's reason."""

    absorbed: dict[int, str] = field(default_factory=dict)
    # why ORT could not be asked (nothing absorbed): a model ORT cannot load gets none of its
    # fusions anyway, but without onnxruntime the model may still run in ORT elsewhere
    problem: str | None = None
    missing_ort: bool = False
    # not asked: the model is larger than PROBE_MAX_NODES (the report says so)
    too_large: bool = False
    seconds: float = 0.0


# Every fusion of FUSED_OPS holds one of these ops (GELU: Erf, Tanh or Gelu; the LayerNorms,
# EmbedLayerNormalization too: ReduceMean, Pow, Sqrt or a LayerNormalization; Gemm,
# FusedMatMul and attention: MatMul; BiasSoftmax: Softmax). A model with none of them (most
# CNNs) is not probed: the probe is a whole ORT session, 4.6-7.4 s at 50,000 nodes.
_SEEDS = frozenset({"Erf", "Tanh", "Gelu", "FastGelu", "BiasGelu", "ReduceMean", "Pow", "Sqrt",
                    "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                    "MatMul", "Softmax"})


# ORT's graph optimizer grows faster than linearly with the graph: on this project's 2-core
# CPU, optimizer_speed.py's synthetic graphs took 1.45 s at 15,000 nodes and 17.4 s at 50,000
# (ORT_ENABLE_EXTENDED; 1.5 s with every optimization off; 12 s of it ORT's TransposeOptimizer
# at level BASIC). Above this size the probe is skipped, with a warning, to keep `optimize`
# within its 10 s at 50,000 nodes; probing in overlapping windows of the graph would lift it.
PROBE_MAX_NODES = 20_000


def ort_fusions(model: ModelProto) -> OrtFusions:
    """The nodes of `model` that ONNX Runtime's own fusions replace (see the module notes).
    ORT optimizes but never runs the model; a model ORT cannot load gives `problem`. A model
    without any op a fusion starts from (`_SEEDS`) is not given to ORT at all."""
    t0 = time.perf_counter()
    if not any(n.op_type in _SEEDS for n in model.graph.node):
        return OrtFusions(seconds=time.perf_counter() - t0)
    if len(model.graph.node) > PROBE_MAX_NODES:
        return OrtFusions(problem=f"ONNX Runtime's own fusions were not looked for: {len(model.graph.node)} nodes, "
                                  f"more than {PROBE_MAX_NODES} (its optimizer takes 17 s at 50,000)",
                          too_large=True)
    try:
        import onnxruntime as ort  # optional dependency: only the probe needs it
    except ImportError:
        return OrtFusions(problem="onnxruntime is not installed", missing_ort=True)
    try:
        # a large model's weights are stand-ins from here on: the float32 copy holds none of them
        big = _weight_bytes(model) > STAND_IN_BYTES
        optimized = _optimize(ort, as_float32(light_copy(model) if big else model), stand_ins=big)
    except Exception as e:  # noqa: BLE001 -- ORT raises its own types (Fail, InvalidGraph, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return OrtFusions(problem=f"ONNX Runtime could not optimize the model ({first[:200]})",
                          seconds=time.perf_counter() - t0)
    found = {i: reason(f) for i, f in absorbed_nodes(model.graph, optimized.graph).items()}
    return OrtFusions(found, seconds=time.perf_counter() - t0)


# A model whose weights exceed this many bytes as float32 is probed with stand-in weights: its
# initializers over 4096 bytes read as zeros from a sparse file (`_stand_ins`), so that the probe
# copies no weight (full-size BLOOM, 1.1 GB: the probe took 2.9 GB and 21.6 s with its copies,
# thirtieth session), nor converts a float16 one to float32 (a 2x copy). ORT's fusions read the
# weights' shapes and small constants' values only.
STAND_IN_BYTES = 256 << 20


def _weight_bytes(model: ModelProto) -> int:
    """The initializers' bytes after `as_float32` (float16 ones twice theirs)."""
    return sum(declared_bytes(t) * (2 if t.data_type in _LOW_FLOATS else 1) for t in model.graph.initializer)


def _stand_ins(model: ModelProto, folder: Path) -> str:
    """`model` saved in `folder` with each initializer over 4096 bytes an external tensor of
    zeros in one sparse file (its bytes never written): the path of the model file."""
    light = light_copy(model)
    offset = 0
    for t in light.graph.initializer:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        size = declared_bytes(t)
        del t.external_data[:]
        for k, v in (("location", "zeros.data"), ("offset", str(offset)), ("length", str(size))):
            kv = t.external_data.add()
            kv.key, kv.value = k, v
        offset += -(-size // 4096) * 4096  # page-aligned, as ORT maps them
    with open(folder / "zeros.data", "wb") as f:
        f.truncate(max(offset, 1))
    path = folder / "model.onnx"
    path.write_bytes(light.SerializeToString())
    return str(path)


def _optimize(ort, model: ModelProto, stand_ins: bool = False) -> ModelProto:
    """`model` as ORT's CPU EP optimizes it at ORT_ENABLE_EXTENDED (initializers left in a
    file that is not read back); with `stand_ins`, its weights read as zeros (`_stand_ins`)."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-ort-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.disable_prepacking", "1")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "256")
        if stand_ins:
            source: str | bytes = _stand_ins(model, Path(tmp))
        elif serialized_bytes(model) < 2**31 - 1:
            source = model.SerializeToString()
        else:
            source = str(Path(tmp) / "model.onnx")
            onnx.save(model, source, save_as_external_data=True, location="model.data", size_threshold=1024)
        ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        return onnx.load(so.optimized_model_filepath, load_external_data=False)


def absorbed_nodes(original: GraphProto, optimized: GraphProto) -> dict[int, str]:
    """Original node index -> fusion name (`FUSED_OPS`) for the nodes a fused node of
    `optimized` replaces. Tensor names tie the graphs: a fused node produces the last
    replaced node's output under its name; the other replaced nodes' outputs are gone
    (nothing in `optimized` produces them, no initializer or input carries them)."""
    made_by = {o: n for n in optimized.node for o in n.output if o}
    present = set(made_by) | {t.name for t in optimized.initializer} | {i.name for i in optimized.input}
    known = {o for n in original.node for o in n.output} | {t.name for t in original.initializer} \
        | {i.name for i in original.input}

    def fused_maker(tensor: str) -> onnx.NodeProto | None:
        n = made_by.get(tensor)
        while n is not None and n.op_type in _WRAPPERS and n.domain in ("", "ai.onnx") \
                and n.input and n.input[0] not in known:
            n = made_by.get(n.input[0])
        return n

    found: dict[int, str] = {}
    nodes = list(original.node)
    for i, n in enumerate(nodes):  # the last node of each fused group: its output lives on
        outs = [o for o in n.output if o]
        f = fused_maker(outs[0]) if outs else None
        if f is None:
            continue
        key = (_domain(f.domain), f.op_type)
        if key in FUSED_OPS and key != (_domain(n.domain), n.op_type):
            found[i] = FUSED_OPS[key]
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            consumers.setdefault(name, []).append(i)
    for i in range(len(nodes) - 1, -1, -1):  # the others: gone, read by a node of the group
        if i in found:
            continue
        outs = [o for o in nodes[i].output if o]
        if not outs or any(o in present for o in outs):
            continue
        readers = sorted({c for o in outs for c in consumers.get(o, ()) if c in found})
        if readers:
            found[i] = found[readers[0]]
    return found


def _domain(d: str) -> str:
    return "" if d == "ai.onnx" else d


def as_float32(model: ModelProto) -> ModelProto:
    """`model` with every float16 tensor, type and cast made float32 (the model itself when
    it has none; `onnxfuse.retype` walks it), so that ORT's CPU EP fuses as its CUDA EP would
    (see the module notes): a one-element constant that rounds like one of `_EXPECTED` in
    float16 becomes that value in float32."""
    if not holds(model, _LOW_FLOATS):
        return model
    return Retype(_LOW_FLOATS, TensorProto.FLOAT, convert=_snap).model(model)


def _snap(a: np.ndarray) -> np.ndarray:
    """A one-element float16 constant, now float32, as the value ORT's fusions look for when
    it rounds to that value in float16 (ORT compares float16 constants so)."""
    if a.size == 1:
        same = _EXPECTED[np.abs(_EXPECTED).astype(np.float16) == np.float16(np.abs(a.flat[0]))]
        if same.size:
            return np.full_like(a, np.copysign(same[0], a.flat[0]))
    return a
