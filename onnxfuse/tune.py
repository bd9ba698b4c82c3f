"""Measured fusion decisions: `onnxfuse optimize` on a machine with an NVIDIA GPU.

When a GPU and onnxruntime-gpu are present, `optimize` tunes by default (`--no-tune`
skips it; without a GPU the documented heuristics decide alone). At one set of input
shapes (`--shape` / `--batch`; without them batch 1 and the model's own dims):

0. **Precision.** ONNX Runtime's default allows TF32 but does not always use it: cuDNN times
   its algorithms per conv (an fp32 one wins some shapes: ViT-S/16's patch-embedding conv on the
   H100) and cuBLAS picks per shape. Every fused node whose kernel would multiply float32 in
   TF32 has its original subgraph probed (`onnxfuse.tf32probe`: ORT's CUDA error against the
   CPU's float32 and against a TF32 emulation, in two fresh sessions; remembered in the cache,
   keyed as a timing is); where ORT multiplied it in fp32, the node compiles at PRECISE
   (`FusedNode.precision`; every node of the same kernel name alike) before anything is timed,
   so that the fused node is as accurate as what it replaces node by node.
1. **Per node.** Every fused node is timed as a one-node model (the node, its function
   and its kernel; library registered) against what ONNX Runtime would run for the same
   nodes: the node's original subgraph as a model of its own, in NCHW (the channels-last
   Transposes that the function body holds for the NHWC layout are left out: they are
   how the body reads onnxfuse's storage, not work the original did; so are the views that
   write its outputs, which ORT copies into a graph output and aliases in the model:
   `_without_output_views`). Both run in ORT's
   CUDA EP with its defaults (TF32 allowed). On CUDA with torch's CUPTI at hand, all of them
   at once (`onnxfuse.bundle`): every one-node model side by side in one session (in a worker
   process, `onnxfuse.tools.worker`, so that CUPTI never slows this one's later timings), each timed
   by the GPU time of the kernels its nodes launch (median of `bundle.ITERS` runs), plus a
   launch gap per kernel (`graph_gap`: what a CUDA graph spends between two kernels on this
   device) so that a fused node's fewer kernels count as they do in a graph. A session per model cost
   about 0.3 s, and a 10 s budget measured a fifth to a third of a CNN's nodes; a bundle
   measures every node of one in a few seconds. Nodes a bundle cannot time (a node of the
   original on the CPU, no CUPTI, a bundle that fails) are timed a pair at a time under CUDA
   graphs (GPU time: timed plainly, a fused node wins at batch 1 by its saved launches
   alone, which graphs take away; the whole-model check counts launches), plainly when a
   graph cannot be captured; median of `iters` synchronized runs. Convs are measured first,
   the largest first (the budget may run out: `measure_order`). A node
   whose original is faster (by more than `node_margin`: 2% or the timing noise) is
   left to ONNX Runtime, and so is a node offered from ORT's own fusions (`Match.measured_only`:
   a SkipLayerNormalization, a BiasGelu) that is not faster by more than that margin (a tie
   keeps ORT's fusion, `NodeDecision.loses`): the model is rebuilt from the state before the
   layout pass with those nodes unfused, so the NHWC plan routes around them, and recompiled
   (cache hits).
   With `--tune` each fused kernel's candidate configurations (`candidates`) are timed too
   and the fastest is kept; a kind whose tile heuristic is measured on few shapes
   (`Kind.search_configs`: FusedAttention, squeeze-excite) has its configurations timed without
   `--tune` as well, and so do pointwise chains offered against ORT's fused kernels
   (`Kind.search_offered`) and a kind's nodes where its heuristic is known weak (`Kind.searches`:
   convs whose launch is less than one wave of the heuristic's tiles). Configurations are timed
   after every node's own kernel, within the budget.
2. **Whole model.** The original (ORT defaults) and the optimized model are timed, with
   and without ORT's CUDA graphs. The optimized model is kept only when it is not slower
   than the original in either mode (within `MODEL_NOISE`); when per-node decisions were
   made, the model before them is tried as well, and when the budget left nodes unmeasured,
   the model fusing only the measured winners too; where a product with its epilogue (the gemm
   kind) was measured slower, the tuned model with that epilogue fused as a pointwise chain
   and the product left to ONNX Runtime (`split_epilogues`: a losing GemmEpilogue goes back
   whole, and an erf-GELU that ORT does not fuse, torch's dynamo export's, would run as five
   kernels; kept only where faster than the tuned model by more than MODEL_NOISE); and, where
   float32 products multiply in TF32, the first of these with the products ONNX Runtime runs
   itself given K-major weights (`onnxfuse.kmajor`, last: kept only where faster by more
   than MODEL_NOISE, and gated); the fastest that passes is kept. Which time counts depends
   on how the model will run (`TuneSettings.cuda_graph`, `--cuda-graph` / `--no-cuda-graph`):
   under CUDA graphs, the time with them; without, the time without; not said, a candidate
   replaces an earlier one only where it is faster in its faster mode and slower in neither
   (`model-modes`: K-major weights at BERT-base batch 1 fp32 were 5% faster under graphs and
   16% slower without).
   When none passes, the original model is written unchanged, and the report and a warning
   say so with the times.
3. **Accuracy.** When float32 convs run at "tf32" (the default), every candidate also
   meets `onnxfuse bench`'s gate, on two input sets (`accuracy_feeds`: the tuning's N(0, 1)
   inputs, and floats uniform in [0, 1) as images are; up to GATE_MAX_DRAWS of each where the
   smallest output has fewer than GATE_ELEMENTS elements, `gate_draws`, since the max error
   over a few elements changes by 10x from input to input, as many as their float64
   references afford, `affordable_draws`): its outputs against the reference,
   within 2x the original's own error under ORT's defaults plus the dtype's floor
   (`accuracy`, `accuracy_on`). The reference is bench's, the original evaluated in float64 on the CPU,
   where that is cheap at the tuning's shapes (`FLOAT64_MAX_FLOPS`); otherwise, and where
   it cannot be computed, the original run with TF32 off on the GPU. ORT's "default" is not always TF32:
   cuDNN picks fp32 algorithms for some layers (PP-OCR's direction classifier at batch 1 on
   the H200: 2.2e-5, where onnxfuse's tf32 convs gave 1.2e-3), and for small convs it picks
   them in one session and not in the next, so ORT's own error is the smallest of three fresh
   sessions' (`ORT_DEFAULT_SESSIONS`; one for a model without convs: `ort_default_sessions`),
   output by output. When the only candidates
   fast enough fail the gate, the same fusions are compiled at PRECISE (tf32x3) and kept if
   they pass and are not slower; otherwise the original is written, with a warning. In that
   precise model, the nodes that per-node timing gave to ORT go back to it only where ORT
   cannot multiply them in TF32 (`ort_may_use_tf32`): it picks TF32 or fp32 algorithms per
   session, so a model that leaves it a conv is as accurate as the session it runs in.

This is the guarantee: after `optimize` on a GPU, the model is not slower than the original
(in the mode `--cuda-graph` / `--no-cuda-graph` said, else in either) and no less accurate than
ONNX Runtime's own default, at the measured shapes and inputs.

Shapes: every tensor a one-node model needs comes from shape inference at the fixed input
shapes; tensors it cannot type (data-dependent Reshapes, custom ops) are filled by running
the model once at those shapes with them as extra outputs. Dynamic dims: only the shapes
given are measured, and the report lists them (`shapes`). A model with a symbolic dim that
is not the leading one and is not given is not measured (a warning asks for `--shape`).

Cache: every measured time is kept under ``~/.cache/onnxfuse/tune`` (``$ONNXFUSE_CACHE``
moves the root), one JSON file per device, ONNX Runtime, onnxfuse and kernel cache format,
keyed by a hash of the exact one-node (or whole) model and its input shapes, so a second
`optimize` of the same model at the same shapes measures nothing again. The accuracy gate's
records are kept there too, keyed by the original's and the candidate's whole bytes and the
input sets' values (`Timer.gate_keys`): the same candidates, built again (a second `optimize`,
or one per deployment mode), are not gated again.

Budget: per-node timing stops after `budget_s` seconds (default `BUDGET_S`); a bundle begun
before then runs to its end (every node of the suite's CNNs fit in one to seven, 0.5-8.4 s on
the H200). After that a node is decided only when its timings are remembered (a layer of the
same shapes as one measured, or an earlier tuning); nodes left keep the heuristics' decision
and are listed as not measured; the whole-model check always runs. Candidate configurations
(`--tune configs`, `Kind.search_configs`) are timed after every node's own kernel, with what is
left of the budget; past it, a node whose one-node model equals one already searched (a layer
of the same shapes) is searched from the remembered timings alone. The record's "phases" say
where the seconds went (node timing, recompiling, whole-model timing, accuracy); "node_steps"
(shapes, one-node models, bundles, graph gap, pairs, search compiles and timings), "bundles"
and "node_runs" split the node timing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, helper, numpy_helper

from onnxfuse import bundle, ir, kmajor, reference, runtime, tf32probe
from onnxfuse import compile as aot
from onnxfuse.cost import model_cost
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import Program
from onnxfuse.graph import GraphView
from onnxfuse.kinds import KINDS
from onnxfuse.kinds.base import FusedNode, Kind
from onnxfuse.layout import BODY_TRANSPOSE_PREFIX, TO_NCHW
from onnxfuse.load import infer_shapes
from onnxfuse.match import find_matches
from onnxfuse.outputs import save_model
from onnxfuse.rewrite import DOMAIN, rewrite, unfuse_all
from onnxfuse.roofline import make_roof
from onnxfuse.specs import kernel_spec, precision_of
from onnxfuse.tools.cuda import CudaDriver, local_gpu_archs
from onnxfuse.tools.feeds import make_feeds, static_feeds
from onnxfuse.tools.gate import gate_outputs, plausible_float64
from onnxfuse.tools.session import BenchSettings, BoundModel, cpu_name, evaluate_model_on, interleave, run_model
from onnxfuse.tools.shapes import resolve_inputs, signature, with_input_dims
from onnxfuse.version import __version__

ITERS, WARMUP = 15, 2          # per one-node model
MODEL_ITERS, MODEL_WARMUP = 30, 5  # per whole model
BUDGET_S = 60.0
# A node is left to ONNX Runtime when its original is faster by more than both margins
# (`node_margin`): one-node timings are synchronized wall clock, whose medians move by about a
# microsecond per run; a run of k replicated copies divides that by k.
NODE_MARGIN_MS = 0.002
NODE_MARGIN_REL = 0.02
# Bundled timings (onnxfuse.bundle) are sums of CUPTI kernel durations, medians of 10 runs:
# their noise is well under a microsecond
BUNDLED = "CUPTI, bundled"
BUNDLED_MARGIN_MS = 0.0003
# What a CUDA graph spends between two dependent kernels besides the kernels themselves:
# bundled timings count kernel time alone, so each side of a node is charged this per kernel
# it launches, as the whole model under graphs pays it. Measured by `graph_gap` once per device
# and software (cached); this where that measurement fails: the H200's, 0.617 µs (seventeenth
# session, every tuning of the suite)
GRAPH_GAP_MS = 0.0006
GAP_CHAINS = (32, 160)  # lengths of the two chains of small nodes `graph_gap` times
# Whole model: slower than the original by more than this fraction is slower.
MODEL_NOISE = 0.02
# 2: a model that did not run at all is no longer remembered as "graphs cannot capture it"
# (version 1 caches may hold such entries from a run without the library)
CACHE_VERSION = 2
REASON = "left to ONNX Runtime: its original subgraph measured faster (tuning)"
UNMEASURED_REASON = ("left to ONNX Runtime: not measured within the tuning budget, and the model fusing only "
                     "the measured winners was faster (tuning)")
KEPT_ORIGINAL = "kept the original model: the optimized one measured slower (tuning)"
KEPT_INACCURATE = "kept the original model: the optimized one was less accurate than ONNX Runtime's default (tuning)"
UNCHECKED = {"passed": True, "max_abs_err": None, "ort_max_abs_err": None, "failure": None}
# the gate's rule and record (`accuracy_on`) as remembered in the tuning cache: bump when either changes
GATE_VERSION = 1
# The accuracy gate's reference is the original evaluated in float64 on the CPU
# (onnxfuse.reference, as in `onnxfuse bench`) up to this many FLOPs at the tuning's shapes
# (onnxfuse.cost's count). Measured on 2 cores (benchmarks/reference_cost.py): YOLOv8n at
# 640x640, 8.2 GFLOP, 0.7 s; at batch 8, 66 GFLOP, 9.7 s; PP-OCRv4 rec at batch 16, 22 GFLOP,
# 12 s (its elementwise ops on large float64 tensors weigh more than FLOPs say); 20-50x an
# ORT float32 run. A GPU host's cores do it several times faster. Above it the reference is
# the original run with TF32 off on the GPU: a fraction of a second, but it takes ONNX
# Runtime's own kernels as the truth, tails included (README, Reliability).
FLOAT64_MAX_FLOPS = 20e9
# ONNX Runtime's own default error, the gate's baseline, is that of the most accurate of this many
# fresh sessions, output by output (CUDA): cuDNN's exhaustive search picks fp32 or TF32
# algorithms for small convs by timing, session by session. PP-OCR's direction classifier at
# batch 1 on the H200: 2.2e-5 in the suite's sessions, 1.8e-4 in the one tuning ran, whose gate
# then passed a model (1.4e-4) that failed the suite's (sixteenth session)
ORT_DEFAULT_SESSIONS = 3
# The ops whose algorithm cuDNN picks per session by timing (ORT's default search, EXHAUSTIVE):
# a model without them computes the same in every session (cuBLAS's heuristics pick per shape),
# so one session gives ORT's error, and a GPT-2-small fp32 tuning loads its 0.5 GB twice less
SEARCHED_OPS = frozenset({"Conv", "ConvTranspose"})
# The conv precision tried when the tf32 candidates fail the accuracy gate: as accurate as
# fp32 to about 1e-7 relative, 1.1-2.5x a tf32 kernel's time (BENCHMARKS.md, "Conv precision")
PRECISE = "tf32x3"
# The gate checks enough input sets that it sees this many elements of the smallest output per
# input distribution, at most GATE_MAX_DRAWS sets each (`gate_draws`)
GATE_ELEMENTS = 256
GATE_MAX_DRAWS = 8
# ONNX Runtime's CUDA kernels of these ops may multiply float32 in TF32 (its default): cuDNN and
# cuBLAS pick TF32 or fp32 algorithms by timing, session by session. PP-OCR's direction
# classifier at batch 1 on the H200: the original's own error 2.2e-5 in the suite's sessions and
# 1.8e-4 in one of tuning's; its tf32x3 model, with three convs and the head's GEMM that timed
# faster in ORT given back to it, passed tuning's gate on 16 input sets and failed the suite's
# (1.7e-4; eighteenth session). The precise candidate keeps such nodes fused (`ort_may_use_tf32`).
ORT_TF32_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


@dataclass(frozen=True)
class TuneSettings:
    """How `optimize` measures. shapes: input name or dim name -> dims (as `--shape`);
    batch: size of symbolic leading dims (default 1); configs: also search kernel
    configurations (`--tune`); explicit: the user asked for tuning, so what stops it is an
    error rather than a warning."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    batch: int | None = None
    configs: bool = False
    explicit: bool = False
    budget_s: float = BUDGET_S
    provider: str = "cuda"
    cache: bool = True
    iters: int = ITERS
    warmup: int = WARMUP
    model_iters: int = MODEL_ITERS
    model_warmup: int = MODEL_WARMUP
    # how the written model will run (`--cuda-graph` / `--no-cuda-graph`): True under ORT's CUDA
    # graphs, False without; whole models are compared in that mode alone. None (not said): a
    # model must be slower in neither (`model-modes`)
    cuda_graph: bool | None = None


@dataclass
class NodeDecision:
    node: str
    kind: str
    original_ms: float | None = None
    fused_ms: float | None = None
    # how both were timed: "CUDA graph" (GPU time: `replicas` copies per replayed graph, the
    # time per copy) or "plain" (a mode graphs cannot capture, and the CPU provider)
    mode: str = ""
    replicas: int = 1
    chosen: str = ""  # "fused", a configuration's label, "original" or "not measured (...)"
    candidates: list[dict] = field(default_factory=list)  # --tune: {"config", "ms"} or {"config", "error"}
    # bundled timings: GPU activities (kernels, memsets) per run of each side, and what a CUDA
    # graph spends between two kernels on this device (`graph_gap`)
    original_kernels: int | None = None
    fused_kernels: int | None = None
    gap_ms: float = 0.0
    # Match.measured_only: nodes ONNX Runtime fuses itself (a SkipLayerNormalization, a
    # BiasGelu), offered to tuning rather than matched outright; kept only where faster
    offered: bool = False
    # the precision its kernel multiplies at where the TF32 probe set one (PRECISE: ONNX Runtime
    # multiplied its original in fp32), else ""
    precision: str = ""

    def loses(self) -> bool:
        """Whether the fused node goes back to ONNX Runtime: its original is faster by more than
        `node_margin`, or, for an offered node, the fused one is not faster by more than it (a
        tie keeps ORT's own fusion: `offered-ties-to-ort`). Bundled timings charge each side
        `gap_ms` per kernel."""
        gaps = 0.0
        if self.mode == BUNDLED and self.original_kernels is not None and self.fused_kernels is not None:
            gaps = self.gap_ms * (self.fused_kernels - self.original_kernels)
        margin = node_margin(self.original_ms, self.replicas, self.mode)
        lead = self.original_ms - (self.fused_ms + gaps)  # what fusing saves
        return lead <= margin if self.offered else -lead > margin


@dataclass
class ModelTimes:
    """Median ms of one model, without and with CUDA graphs (None: could not run)."""

    plain_ms: float | None
    graph_ms: float | None
    graph_error: str | None = None

    def not_slower_than(self, other: ModelTimes, cuda_graph: bool | None = None) -> bool:
        """Not slower (within MODEL_NOISE) in the deployment's mode (`TuneSettings.cuda_graph`:
        True under CUDA graphs, False without, None either); a mode the other cannot run does
        not count, one only the other can run does; under graphs, where the other cannot run
        them, without."""
        pairs = {False: (self.plain_ms, other.plain_ms), True: (self.graph_ms, other.graph_ms)}
        if cuda_graph is None:
            modes = (False, True)
        else:
            modes = (True,) if cuda_graph and other.graph_ms is not None else (False,)
        for mine, theirs in (pairs[m] for m in modes):
            if theirs is None:
                continue
            if mine is None or mine > theirs * (1 + MODEL_NOISE):
                return False
        return True

    def best(self, cuda_graph: bool | None = None) -> float:
        """The time that ranks this model in the deployment's mode: the faster of its two
        modes (None), its time under graphs (True; plain where it cannot run them), or
        without (False)."""
        if cuda_graph is False or (cuda_graph and self.graph_ms is None):
            return self.plain_ms if self.plain_ms is not None else float("inf")
        if cuda_graph:
            return self.graph_ms
        return min((t for t in (self.plain_ms, self.graph_ms) if t is not None), default=float("inf"))


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------

def input_shapes(model: ModelProto, settings: TuneSettings) -> dict[str, tuple[int, ...]]:
    """Concrete dims for every graph input: --shape, else --batch (or 1) for a symbolic
    leading dim and the model's own dims. A symbolic dim elsewhere that --shape does not
    give raises OnnxfuseError naming it."""
    sig = signature(model)
    specs, _ = resolve_inputs(sig, settings.shapes, settings.batch, "the model")
    for inp, spec in zip(sig, specs, strict=True):
        for k, d in enumerate(inp.dims):
            if k > 0 and not isinstance(d, int) and inp.name not in settings.shapes and d not in settings.shapes:
                raise OnnxfuseError(f"input {inp.name!r} has a symbolic dim {k} ({d or 'unnamed'}): give the shapes "
                                    f"to measure at, e.g. --shape {inp.name}={','.join(map(str, spec.shape))}")
    return {s.name: s.shape for s in specs}


def feeds_for(model: ModelProto, dims: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of the given dims (onnxfuse.tools.feeds.make_feeds)."""
    specs, _ = resolve_inputs(signature(model), dims, None, "the model")
    return make_feeds(specs, seed)


def accuracy_feeds(feeds: dict[str, np.ndarray], seed: int = 1, draws: int = 1) -> dict[str, dict[str, np.ndarray]]:
    """The input sets the accuracy gate checks: `feeds` (floats N(0, 1)), and the same with
    every float input uniform in [0, 1), as images reach a vision model; `draws` seeded sets of
    each (`gate_draws`). A model's error can differ by 10x between them: PP-OCR's direction
    classifier at batch 1 on the H200, ORT's own 1.8e-4 on N(0, 1) and 2.2e-5 on one [0, 1)
    image (seventeenth session)."""
    rng = np.random.default_rng(seed)

    def draw(sample: Callable) -> dict[str, np.ndarray]:
        return {k: sample(v.shape).astype(v.dtype) if reference.is_float(v.dtype) else v for k, v in feeds.items()}

    images = [draw(rng.random)]  # first, so that one draw gives the sets it always gave
    normal = [feeds] + [draw(rng.standard_normal) for _ in range(draws - 1)]
    images += [draw(rng.random) for _ in range(draws - 1)]

    def named(base: str, sets: list) -> dict[str, dict[str, np.ndarray]]:
        return {base if i == 0 else f"{base} #{i + 1}": f for i, f in enumerate(sets)}

    return named("N(0, 1)", normal) | named("uniform [0, 1)", images)


def ort_may_use_tf32(f: FusedNode) -> bool:
    """Whether ONNX Runtime, running the fused node `f`'s original nodes on CUDA with its
    defaults, may multiply them in TF32 (a float32 Conv, MatMul or Gemm among them)."""
    return f.program.input_dtypes[0] == "f32" and any(
        s.split(" ", 1)[0] in ORT_TF32_OPS for s in f.source_nodes)


def gate_draws(output_elements: int | None) -> int:
    """How many input sets of each distribution the gate checks, given the element count of
    the model's smallest float output: GATE_ELEMENTS / that, within 1..GATE_MAX_DRAWS. The
    gate compares one max |error| with another; over a few elements that is a draw of noise
    (PP-OCR's direction classifier at batch 1, two probabilities: ORT's own error 2.2e-5 on
    the suite's image, 1.8e-4 on an N(0, 1) input, so a model as accurate as ORT on average
    fails some inputs and passes others)."""
    if not output_elements:
        return 1
    return max(1, min(GATE_MAX_DRAWS, -(-GATE_ELEMENTS // output_elements)))


def affordable_draws(model: ModelProto, feeds: dict[str, np.ndarray]) -> int:
    """Input sets of each distribution whose float64 references (`Timer.float64_reference`,
    the model's FLOPs each) fit in FLOAT64_MAX_FLOPS together; at least 1. A model past that
    limit has its reference run on the GPU, which costs little: GATE_MAX_DRAWS."""
    flops = _flops(model, feeds)
    if flops is None:  # no estimate: one set, as before the draws
        return 1
    if flops > FLOAT64_MAX_FLOPS:
        return GATE_MAX_DRAWS
    return max(1, int(FLOAT64_MAX_FLOPS // (2 * max(flops, 1.0))))


def smallest_output(model: ModelProto, dims: dict[str, tuple[int, ...]], feeds: dict[str, np.ndarray],
                    provider: str) -> int | None:
    """Elements of the model's smallest float output at these input dims (None: not known)."""
    outputs = {o.name for o in model.graph.output}
    try:
        infos = tensor_infos(model, dims, feeds, outputs, provider)
    except OnnxfuseError:
        return None
    sizes = [int(np.prod([d.dim_value for d in vi.type.tensor_type.shape.dim]))
             for name, vi in infos.items() if name in outputs
             and reference.is_float(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))]
    return min(sizes) if sizes else None


def inferred_infos(model: ModelProto, dims: dict[str, tuple[int, ...]]) -> dict[str, onnx.ValueInfoProto]:
    """The ValueInfo shape inference gives every tensor of `model` at the fixed input dims
    (its own value_info dropped first); none but the inputs' where onnx cannot infer it."""
    m = with_input_dims(model, dims)
    del m.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    except Exception:  # callers fill in or do without what inference cannot give
        inferred = m
    return {v.name: v for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}


def tensor_infos(model: ModelProto, dims: dict[str, tuple[int, ...]], feeds: dict[str, np.ndarray],
                 needed: set[str], provider: str) -> dict[str, onnx.ValueInfoProto]:
    """A typed, static ValueInfo for every tensor in `needed` (not initializers): shape
    inference at the fixed input dims, and for what it leaves unknown one run of the model
    at those inputs with the unknown tensors as extra outputs."""
    infos = inferred_infos(model, dims)
    inits = {t.name for t in model.graph.initializer}
    missing = sorted(n for n in needed if n not in inits and not (n in infos and _static(infos[n])))
    if missing:
        # element types where anything knows them: ONNX Runtime cannot infer the type of a
        # custom op's output that is made a graph output without one
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
        types.update(_fused_output_types(model))
        types.update({k: v.type.tensor_type.elem_type for k, v in infos.items() if v.type.tensor_type.elem_type})
        # run with the model's own value_info (dropped above for inference): ONNX Runtime
        # types a custom op's outputs from it
        for name, a in run_for_values(with_input_dims(model, dims), feeds, missing, provider, types).items():
            infos[name] = helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
    return infos


PROGRAM_TYPES = {"f32": onnx.TensorProto.FLOAT, "f16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


def _fused_output_types(model: ModelProto) -> dict[str, int]:
    """The element type of every fused node's outputs, from its program's output lines:
    shape inference does not see through custom ops, and the model may have no value_info."""
    out = {}
    for n in model.graph.node:
        text = next((a.s.decode() for a in n.attribute if a.name == "program"), None) if n.domain == DOMAIN else None
        if text is not None:
            prog = Program.from_text(text)
            out.update({name: PROGRAM_TYPES[dt] for name, (_, dt) in zip(n.output, prog.outputs, strict=False)
                        if name})
    return out


def run_for_values(model: ModelProto, feeds: dict[str, np.ndarray], names: list[str], provider: str,
                   types: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """The values of tensors `names` when `model` runs on `feeds` (they become extra graph
    outputs of a copy, typed by `types` where it knows them; the onnxfuse library is
    registered)."""
    import onnxruntime as ort

    m = ModelProto()
    m.CopyFrom(model)
    outputs = {o.name for o in m.graph.output}
    types = types or {}
    m.graph.output.extend(helper.make_tensor_value_info(n, types[n], None) if types.get(n) else
                          onnx.ValueInfoProto(name=n) for n in names if n not in outputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    runtime.session_options(so)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    try:
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=providers)
        values = sess.run(names, feeds)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise OnnxfuseError(f"cannot run the model to learn its tensors' shapes: {first}") from None
    return dict(zip(names, values, strict=True))


def _static(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.elem_type != 0 and t.HasField("shape") and all(ir.known_dim(d) is not None for d in t.shape.dim)


# ---------------------------------------------------------------------------------------
# One-node models
# ---------------------------------------------------------------------------------------

def fused_model(model: ModelProto, node: onnx.NodeProto, infos: dict) -> ModelProto:
    """A model of one fused node: its inputs (initializers stay constants), outputs and
    function, named canonically (i0.., o0.., node "n") so that equal layers hash equal."""
    inits = {t.name: t for t in model.graph.initializer}
    key = (node.domain, node.op_type, node.overload)
    fn = [f for f in model.functions if (f.domain, f.name, f.overload) == key]
    rename: dict[str, str] = {}
    inputs, consts = [], []
    for name in dict.fromkeys(x for x in node.input if x):
        new = rename[name] = f"i{len(rename)}"
        if name in inits:
            consts.append(ir.renamed(inits[name], new))
        else:
            inputs.append(ir.renamed(_info(infos, name, node), new, keep_doc=False))
    outputs = []
    for k, name in enumerate(node.output):
        rename[name] = f"o{k}"
        outputs.append(ir.renamed(_info(infos, name, node), f"o{k}", keep_doc=False))
    n = onnx.NodeProto()
    n.CopyFrom(node)
    n.name = "n"
    n.input[:] = [rename.get(x, x) for x in node.input]
    n.output[:] = [rename[x] for x in node.output]
    g = helper.make_graph([n], "node", inputs, outputs, consts)
    m = helper.make_model(g, opset_imports=list(model.opset_import), functions=fn)
    m.ir_version = model.ir_version
    return m


def original_model(model: ModelProto, node: onnx.NodeProto, infos: dict) -> ModelProto:
    """What ONNX Runtime runs for a fused node: its function body as a model, NCHW. The
    body's layout Transposes (onnxfuse.layout.BODY_TRANSPOSE_PREFIX) go, and the tensors
    they converted take their NCHW shapes."""
    key = (node.domain, node.op_type, node.overload)
    fn = next(f for f in model.functions if (f.domain, f.name, f.overload) == key)
    inits = {t.name: t for t in model.graph.initializer}
    actual = dict(zip(fn.input, node.input, strict=False))
    layout = [b for b in fn.node if b.op_type == "Transpose" and b.name.startswith(BODY_TRANSPOSE_PREFIX)]
    # entry Transposes (to_nchw of a formal input): readers of their output read the input,
    # which takes its NCHW shape; exit Transposes (to_nhwc of a formal output): the node
    # producing their input produces the output, NCHW
    rename: dict[str, str] = {}
    nchw: set[str] = set()
    for t in layout:
        if t.input[0] in fn.input:
            rename[t.output[0]] = t.input[0]
            nchw.add(t.input[0])
        elif t.output[0] in fn.output:
            rename[t.input[0]] = t.output[0]
            nchw.add(t.output[0])
    body = []
    for b in fn.node:
        if any(b is t for t in layout):
            continue
        n = onnx.NodeProto()
        n.CopyFrom(b)
        n.input[:] = [rename.get(x, x) for x in n.input]
        n.output[:] = [rename.get(x, x) for x in n.output]
        body.append(n)
    inputs, consts, used = [], [], {x for b in body for x in b.input}
    for formal in fn.input:
        name = actual.get(formal, "")
        if not name or formal not in used:
            continue
        if name in inits:
            consts.append(ir.renamed(inits[name], formal))
        else:
            vi = ir.renamed(_info(infos, name, node), formal, keep_doc=False)
            if formal in nchw:
                _permute(vi, TO_NCHW)
            inputs.append(vi)
    outputs = []
    for formal, name in zip(fn.output, node.output, strict=False):
        vi = ir.renamed(_info(infos, name, node), formal, keep_doc=False)
        if formal in nchw:
            _permute(vi, TO_NCHW)
        outputs.append(vi)
    g = helper.make_graph(body, "original", inputs, outputs, consts)
    opsets = {o.domain: o.version for o in model.opset_import if o.domain != "onnxfuse"}
    opsets.update({o.domain: o.version for o in fn.opset_import if o.domain != "onnxfuse"})
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())])
    m.ir_version = model.ir_version
    model_outputs = {o.name for o in model.graph.output}
    return _without_output_views(m, {formal for formal, name in zip(fn.output, node.output, strict=False)
                                     if name in model_outputs})


# ops that ONNX Runtime runs as an alias of their input inside a model, and as a copy when
# they write a graph output (its allocation planner gives a graph output a buffer of its own)
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _without_output_views(m: ModelProto, keep: set[str]) -> ModelProto:
    """The one-node original without the views that write its outputs (`VIEW_OPS`): cut out
    alone, such a view writes a graph output and ORT copies it, where in the model it reads
    the same buffer and costs nothing, so the original would be timed one copy kernel (and a
    launch gap) slower than it runs (`tune-output-views`). Each such output becomes the view's
    input, its shape inferred. Outputs in `keep` (the model's own outputs, copied in the model
    too), views of a graph input, and tensors whose shape cannot be inferred stay as they are."""
    g = m.graph
    views = {x for n in g.node if n.op_type in VIEW_OPS for x in n.output}
    if not any(o.name in views and o.name not in keep for o in g.output):
        return m  # nothing to strip: no shape inference (it copies the weights)
    try:
        inferred = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(m).graph.value_info}
    except Exception:  # shapes unknown: the model as it is (timed as before)
        return m
    changed, stripped = True, False
    while changed:
        changed = False
        producer = {x: n for n in g.node for x in n.output}
        read = {x for n in g.node for x in n.input}
        outs = [o.name for o in g.output]
        for k, name in enumerate(outs):
            n = producer.get(name)
            if name in keep or n is None or n.op_type not in VIEW_OPS or name in read:
                continue
            src = n.input[0]
            vi = inferred.get(src)
            if src not in producer or src in outs or vi is None or not _static(vi):
                continue
            g.output[k].CopyFrom(vi)
            g.node.remove(n)
            changed = stripped = True
            break
    # what only the views read (their shapes' Constant nodes) goes with them
    while stripped:
        used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(x in used for x in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    return m


def _info(infos: dict, name: str, node: onnx.NodeProto) -> onnx.ValueInfoProto:
    vi = infos.get(name)
    if vi is None or not _static(vi):
        raise OnnxfuseError(f"no static shape for {name!r} (a tensor of {node.name})")
    return vi


def _permute(vi: onnx.ValueInfoProto, perm: list[int]) -> None:
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    if len(dims) == len(perm):
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for p in perm:
            shape.dim.add().dim_value = dims[p]


REPLICA_BYTES = 256 * 2**20  # the inputs and outputs of all copies of a one-node model at most
MAX_REPLICAS = 16


def replicas(*models: ModelProto) -> int:
    """How many copies of each model one timed run holds (`replicated`): up to MAX_REPLICAS,
    as many as fit in REPLICA_BYTES of inputs and outputs for the largest of `models`."""
    largest = max(bundle.io_bytes(m) for m in models)
    return max(1, min(MAX_REPLICAS, REPLICA_BYTES // max(1, largest)))


def replicated(m: ModelProto, k: int) -> ModelProto:
    """A model of k copies of `m`'s graph, one after another, each with its own graph inputs
    and outputs (suffix `__r<i>`; initializers shared). Under CUDA graphs one run replays the
    k copies' kernels back to back, so the launch and synchronization that dominate a single
    small node's time (10-20 µs at batch 1) are paid once per k nodes. The copies read
    distinct inputs, so ONNX Runtime's common-subexpression elimination cannot merge them."""
    if k <= 1:
        return m
    out = ModelProto()
    out.CopyFrom(m)
    g = out.graph
    shared = {t.name for t in g.initializer}
    nodes, inputs, outputs, infos = list(g.node), list(g.input), list(g.output), list(g.value_info)
    for field_ in (g.node, g.input, g.output, g.value_info):
        del field_[:]
    for r in range(k):
        def ren(name: str, r: int = r) -> str:
            return name if not name or name in shared else f"{name}__r{r}"

        for i, n in enumerate(nodes):
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = f"{n.name or f'node{i}'}__r{r}"
            c.input[:] = [ren(x) for x in n.input]
            c.output[:] = [ren(x) for x in n.output]
            g.node.append(c)
        for src, dst in ((inputs, g.input), (outputs, g.output), (infos, g.value_info)):
            dst.extend(ir.renamed(v, ren(v.name), keep_doc=False) for v in src if v.name not in shared)
    return out


# ---------------------------------------------------------------------------------------
# Timing, cached
# ---------------------------------------------------------------------------------------

class Timer:
    """Times models in ONNX Runtime (onnxfuse.tools.session.BoundModel: IO binding, synchronized
    wall clock, ORT's defaults with TF32 allowed) and remembers every time in a JSON file
    per device and software versions."""

    ROUNDS = 5  # whole models: timed runs interleave in this many rounds

    def __init__(self, settings: TuneSettings, folder: Path):
        self.settings = settings
        self.folder = folder
        self.path = cache_path(settings.provider) if settings.cache else None
        self.entries: dict[str, dict] = _read_cache(self.path) if self.path else {}
        self.measured = 0
        self.hits = 0
        # where the one-node timings' seconds go (the record's "node_runs"): making their random
        # inputs, session loads, first runs (cuDNN's algorithm search), warm-up runs (under CUDA
        # graphs the capture), timed runs, reading the outputs back and releasing the session, and
        # the total (the rest: saving the model, binding the inputs)
        self.spent = {"runs": 0, "feeds_s": 0.0, "load_s": 0.0, "first_run_s": 0.0, "warmup_s": 0.0,
                      "timed_s": 0.0, "close_s": 0.0, "total_s": 0.0}
        # the same for bundles (onnxfuse.bundle; the record's "bundles"): sessions, models timed
        # in them, seconds per phase (first_run_s: the warm-up runs, the first with cuDNN's
        # algorithm searches), and the errors of bundles that did not run
        self.bundled = {"sessions": 0, "models": 0, "feeds_s": 0.0, "load_s": 0.0, "first_run_s": 0.0,
                        "profiled_s": 0.0, "total_s": 0.0, "unattributed_us": 0.0, "errors": []}
        self._float64: dict[tuple[int, int], tuple[dict[str, np.ndarray] | None, str | None]] = {}
        self._original_runs: dict[tuple, dict[str, dict[str, np.ndarray] | str]] = {}
        self._gate_prefix: dict[tuple, object] = {}  # gate_keys' hash of the original and the input sets
        self._infos: dict[int, tuple[ModelProto, dict]] = {}  # tensor_infos' answers, by model

    def tensor_infos(self, model: ModelProto, dims: dict[str, tuple[int, ...]], feeds: dict[str, np.ndarray],
                     needed: set[str]) -> dict[str, onnx.ValueInfoProto]:
        """`tensor_infos` of `model`, once per model a tuning: the TF32 probe and the node timing
        ask it of the same model (a transformer's shape inference: seconds), and the second reuses
        the first's answer where it types every tensor asked for."""
        seen = self._infos.get(id(model))
        if seen is not None and seen[0] is model:
            inits = {t.name for t in model.graph.initializer}
            if all(n in inits or (n in seen[1] and _static(seen[1][n])) for n in needed):
                return seen[1]
        infos = tensor_infos(model, dims, feeds, needed, self.settings.provider)
        self._infos[id(model)] = (model, infos)  # the model kept: its id is not reused while here
        return infos

    def _key(self, m: ModelProto, feeds: dict[str, np.ndarray], library: bool, graph: bool | str) -> str:
        """A model's cache key: its bytes without the values of its large initializers (layers
        of equal shapes time alike whatever their weights: one measurement serves them all),
        its input shapes, and how it runs (`graph`: with CUDA graphs or not, or "bundled")."""
        h = hashlib.sha256(_without_weights(m))
        for name in sorted(feeds):
            h.update(f"|{name}:{feeds[name].dtype}:{feeds[name].shape}".encode())
        h.update(f"|lib={library}|graph={graph}".encode())
        return h.hexdigest()

    def _settings(self, warmup: int, iters: int, graph: bool):
        return BenchSettings(provider=self.settings.provider, warmup=warmup, iters=iters, cuda_graph=graph, tf32=True)

    def _path(self, m: ModelProto) -> Path:
        path = self.folder / f"m{self.measured}_{len(list(self.folder.iterdir()))}.onnx"
        save_model(m, path)
        return path

    def time(self, m: ModelProto, feeds: dict[str, np.ndarray] | None, library: bool, graph: bool = False,
             cached_only: bool = False) -> float | None:
        """Median ms of one (small) model on `feeds`, with ORT's CUDA graphs or without;
        raises OnnxfuseError when it cannot run (or be captured). `cached_only`: the
        remembered time, or None where there is none (nothing is run). `feeds` None: seeded
        random inputs (`static_feeds`), made only if the model runs (the key reads their dtypes
        and shapes alone: 16 copies' random data would be 50 MB at BERT-base's FFN)."""
        key = self._key(m, feeds if feeds is not None else _shape_only_feeds(m), library, graph)
        if key in self.entries:
            self.hits += 1
            if "error" in self.entries[key]:
                raise OnnxfuseError(self.entries[key]["error"])
            return float(self.entries[key]["ms"])
        if cached_only:
            return None
        s = self.settings
        t0 = time.perf_counter()
        if feeds is None:
            feeds = static_feeds(m)
            self.spent["feeds_s"] += time.perf_counter() - t0
        path = self._path(m)
        try:
            run = run_model(str(path), feeds, self._settings(s.warmup, s.iters, graph), library=library,
                            collect=False)
        except OnnxfuseError as e:
            if graph and self._runs_plainly(path, feeds, library):
                # remembered: a graph that cannot be captured is not tried again. A model that
                # does not run at all (no library, a kernel that fails to load) is not a
                # capture failure, and a later tuning with that fixed must measure it.
                self.entries[key] = {"error": str(e).splitlines()[0][:300] if str(e) else "cannot capture"}
            raise
        ms = float(np.median(run.times_ms))
        self.measured += 1
        self.entries[key] = {"ms": ms}
        self.spent["runs"] += 1
        self.spent["load_s"] += run.load_ms / 1e3
        self.spent["first_run_s"] += run.first_run_ms / 1e3
        self.spent["warmup_s"] += run.warmup_ms / 1e3
        self.spent["timed_s"] += sum(run.times_ms) / 1e3
        self.spent["close_s"] += run.close_ms / 1e3
        self.spent["total_s"] += time.perf_counter() - t0
        return ms

    def time_bundled(self, models: list[tuple[ModelProto, bool]], deadline: float | None = None
                     ) -> list[bundle.Timed | None]:
        """GPU time of each (one-node model, library) by `onnxfuse.bundle`: remembered, else
        measured with the others in bundles (a session per `bundle.BUNDLE_BYTES` of inputs and
        outputs; models of equal keys, layers of the same shapes, once). None where a model
        is not timed so: it cannot join a bundle, its bundle failed (`bundled["errors"]`), the
        bundle could not attribute time to it, or `deadline` (perf_counter) passed first."""
        keys = [self._key(m, _shape_only_feeds(m), lib, "bundled") for m, lib in models]
        first: dict[str, int] = {}
        for k, (key, (m, _)) in enumerate(zip(keys, models, strict=True)):
            if key in self.entries:
                self.hits += 1
            elif bundle.bundleable(m):
                first.setdefault(key, k)
        todo = list(first.values())
        for part in bundle.chunks([models[k][0] for k in todo]):
            if deadline is not None and time.perf_counter() > deadline:
                break
            idx = [todo[j] for j in part]
            members = [models[k][0] for k in idx]
            t0 = time.perf_counter()
            feeds = bundle.bundle_feeds(members)
            self.bundled["feeds_s"] += time.perf_counter() - t0
            try:
                r = bundle.run_bundle(bundle.bundle(members), feeds, library=any(models[k][1] for k in idx))
            except OnnxfuseError as e:
                self.bundled["errors"].append(str(e).splitlines()[0][:300] if str(e) else "failed")
                continue
            finally:
                del feeds
            b = self.bundled
            b["sessions"] += 1
            b["models"] += len(members)
            b["load_s"] += r.load_s
            b["first_run_s"] += r.first_run_s
            b["profiled_s"] += r.profiled_s
            b["unattributed_us"] += r.unattributed_us
            b["total_s"] += time.perf_counter() - t0
            for j, k in enumerate(idx):
                t = r.times.get(j)
                if t is not None:
                    self.entries[keys[k]] = {"us": t.us, "kernels": t.kernels}
                    self.measured += 1
        out: list[bundle.Timed | None] = []
        for key in keys:
            e = self.entries.get(key)
            out.append(bundle.Timed(float(e["us"]), int(e["kernels"])) if e and "us" in e else None)
        return out

    def tf32_probe(self, m: ModelProto) -> dict:
        """What ONNX Runtime multiplies the one-node original `m` in (`onnxfuse.tf32probe.probe`
        on seeded inputs): {"multiplies": "fp32" or "tf32", "ratios": [...]}, remembered under
        the model's key as a timing is (layers of the same shapes: one probe; cuDNN and cuBLAS
        choose by shapes, not values)."""
        key = self._key(m, _shape_only_feeds(m), False, "tf32 probe")
        if key in self.entries:
            self.hits += 1
            return dict(self.entries[key])
        p = tf32probe.probe(m, static_feeds(m), self.settings.provider)
        self.measured += 1
        self.entries[key] = {"multiplies": p.multiplies, "ratios": [None if r is None else round(r, 5)
                                                                     for r in p.ratios]}
        return dict(self.entries[key])

    def _runs_plainly(self, path: Path, feeds: dict[str, np.ndarray], library: bool) -> bool:
        """Whether the model at `path` runs once without CUDA graphs."""
        try:
            run_model(str(path), feeds, self._settings(0, 1, False), library=library, collect=False)
        except OnnxfuseError:
            return False
        return True

    def time_models(self, models: dict[str, tuple[ModelProto, bool]], feeds: dict[str, np.ndarray],
                    graph_modes: tuple[bool, ...]) -> dict[tuple[str, bool], float | str]:
        """Median ms of whole models, label -> (model, library), in each CUDA-graph mode: all
        sessions open at once and their timed runs interleaved in ROUNDS rounds, so that a
        drift of the machine's speed reaches every model alike. A model that cannot load or
        run in a mode gets the error's text instead of a time."""
        s = self.settings
        out: dict[tuple[str, bool], float | str] = {}
        todo = []
        for label, (m, library) in models.items():
            path = None
            for graph in graph_modes:
                key = self._key(m, feeds, library, graph)
                if key in self.entries:
                    self.hits += 1
                    out[label, graph] = float(self.entries[key]["ms"])
                    continue
                path = path or self._path(m)
                todo.append((label, graph, key, path, library))
        bound = {}
        try:
            for label, graph, _key, path, library in todo:
                try:
                    b = BoundModel(str(path), feeds, self._settings(s.model_warmup, s.model_iters, graph), library)
                    bound[label, graph] = b
                    b.time(s.model_warmup)
                except OnnxfuseError as e:
                    out[label, graph] = str(e)
            timed = interleave({k: b for k, b in bound.items() if k not in out}, s.model_iters, self.ROUNDS)
            keys = {(label, graph): key for label, graph, key, _, _ in todo}
            for k, times in timed.items():
                if isinstance(times, str):
                    out[k] = times
                else:
                    out[k] = ms = float(np.median(times))
                    self.entries[keys[k]] = {"ms": ms}
                    self.measured += 1
        finally:
            for b in bound.values():
                b.close(collect=False)
        return out

    def outputs(self, models: dict[str, tuple[ModelProto, bool, bool]], feed_sets: dict[str, dict[str, np.ndarray]]
                ) -> dict[str, dict[str, dict[str, np.ndarray] | str]]:
        """One untimed run of each model on each input set, label -> (model, library, tf32), every
        set in one session (one cuDNN algorithm search): label -> set -> its outputs, or the
        error's text where it cannot run."""
        out: dict[str, dict[str, dict[str, np.ndarray] | str]] = {}
        for label, (m, library, tf32) in models.items():
            settings = BenchSettings(provider=self.settings.provider, tf32=tf32)
            try:
                runs = evaluate_model_on(str(self._path(m)), list(feed_sets.values()), settings, library,
                                         collect=False)
                out[label] = dict(zip(feed_sets, runs, strict=True))
            except OnnxfuseError as e:
                out[label] = dict.fromkeys(feed_sets, str(e).splitlines()[0][:300] if str(e) else "cannot run")
        return out

    def float64_reference(self, model: ModelProto, feeds: dict[str, np.ndarray]
                          ) -> tuple[dict[str, np.ndarray] | None, str | None]:
        """The original evaluated in float64 (once per tuning), or (None, why not): over
        FLOAT64_MAX_FLOPS at these shapes, or the evaluator cannot run it."""
        key = (id(model), id(feeds))
        if key not in self._float64:
            self._float64[key] = _float64_reference(model, feeds)
        return self._float64[key]

    def original_outputs(self, model: ModelProto, feed_sets: dict[str, dict[str, np.ndarray]], label: str,
                         tf32: bool) -> dict[str, dict[str, np.ndarray] | str]:
        """`outputs` of the original (no library) with TF32 allowed or not, run once per
        tuning: the accuracy gate of a later candidate (tf32x3) reuses it."""
        key = (id(model), tuple((name, id(f)) for name, f in feed_sets.items()), tf32)
        if key not in self._original_runs:
            self._original_runs[key] = self.outputs({label: (model, False, tf32)}, feed_sets)[label]
        return self._original_runs[key]

    def gate_keys(self, original: ModelProto, candidates: dict[str, ModelProto],
                  feed_sets: dict[str, dict[str, np.ndarray]]) -> dict[str, str]:
        """Per candidate, the cache key of its gate (`accuracy_on`): the original's and the
        candidate's whole bytes, weights included, the input sets' values and the custom-op
        library's bytes (a library rebuilt with a fix gates anew). A gate is remembered as a
        timing is (per device and software): `optimize` run again on the same model, or once
        per deployment mode (`--cuda-graph`), builds the same candidates, and the suite's
        second tuning of a GPT-2-small fp32 row spent 44 s gating them again."""
        memo = (id(original), tuple((name, id(f)) for name, f in feed_sets.items()))
        if memo not in self._gate_prefix:  # the original hashed once a tuning: its candidates are gated one by one
            h = hashlib.sha256(f"gate|{GATE_VERSION}|sessions={ort_default_sessions(original)}".encode())
            _hash_model(h, original)
            for name, feeds in feed_sets.items():
                h.update(f"|set {name}".encode())
                reference.hash_arrays(h, feeds)
            self._gate_prefix[memo] = h
        h = self._gate_prefix[memo].copy()
        h.update(f"|library {_library_digest()}".encode())
        keys = {}
        for label, m in candidates.items():
            c = h.copy()
            c.update(b"|candidate|")
            _hash_model(c, m)
            keys[label] = c.hexdigest()
        return keys

    def save(self) -> None:
        if self.path is not None and self.measured:
            _write_cache(self.path, self.entries)


SMALL_CONSTANT = 64  # initializers of at most this many elements (shapes, axes, scalars) keep their values in keys


def _large(t: onnx.TensorProto) -> bool:
    """An initializer whose values `_without_weights` drops (more than SMALL_CONSTANT elements)."""
    return int(np.prod(t.dims)) > SMALL_CONSTANT


def _without_weights(m: ModelProto) -> bytes:
    """m serialized with the data of its large initializers dropped (their dims and types stay)."""
    c = ModelProto()
    c.CopyFrom(m)
    for t in c.graph.initializer:
        if _large(t):
            for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                         "string_data", "external_data"):
                t.ClearField(name)
    return c.SerializeToString(deterministic=True)


def _library_digest() -> str:
    """sha256 of the custom-op library the candidates run with, built as their runs would build
    it ("none" where there is none)."""
    try:
        return hashlib.sha256(Path(runtime.library_path()).read_bytes()).hexdigest()
    except (OnnxfuseError, OSError):
        return "none"


def _hash_model(h, m: ModelProto) -> None:
    """Feed `h` the whole model, weights included, a large initializer at a time (one
    serialization of a model over 2 GB would fail)."""
    h.update(_without_weights(m))
    for t in m.graph.initializer:
        if _large(t):
            h.update(f"|{t.name}|".encode())
            if t.HasField("raw_data"):
                h.update(t.raw_data)
            elif t.external_data:  # not loaded: where its bytes are
                h.update(str([(e.key, e.value) for e in t.external_data]).encode())
            else:
                h.update(numpy_helper.to_array(t).tobytes())


def cache_path(provider: str) -> Path:
    """The tuning cache file for this device and software (see the module docstring)."""
    import onnxruntime as ort

    if provider == "cuda":
        gpu = CudaDriver()
        device = gpu.name() or "cuda"
        gpu.close()
    else:
        device = cpu_name()
    root = Path(os.environ.get("ONNXFUSE_CACHE") or Path.home() / ".cache" / "onnxfuse")
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device}-ort{ort.__version__}-onnxfuse{__version__}"
                  f"-k{aot.CACHE_FORMAT}-t{CACHE_VERSION}").strip("-")
    return root / "tune" / f"{slug}.json"


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
        return data["entries"] if data.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_cache(path: Path, entries: dict[str, dict]) -> None:
    """Merge with what another process wrote meanwhile, then replace atomically; a cache
    that cannot be written is skipped (tuning still worked)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = _read_cache(path) | entries
        fd, tmp = tempfile.mkstemp(prefix=".tune.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": merged}, f)
        os.replace(tmp, path)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------
# Kernel configurations (--tune)
# ---------------------------------------------------------------------------------------

def candidates(spec) -> list[tuple[str, tuple]]:
    """(label, variants) per candidate configuration of a kernel spec, as its kind lists them."""
    return KINDS[spec.kind].candidates(spec)


# ---------------------------------------------------------------------------------------
# The tuning step
# ---------------------------------------------------------------------------------------

def available(provider: str = "cuda") -> bool:
    """Whether this machine can tune: a CUDA GPU and onnxruntime-gpu (or provider cpu)."""
    if provider == "cpu":
        return True
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and bool(local_gpu_archs())


def tune(result, before, info: dict, recompile: Callable, settings: TuneSettings, targets: list[int],
         conv_precision: str = "tf32", jobs: int | None = None, recompile_precise: Callable | None = None) -> dict:
    """Measure and decide (module docstring). `result`: an `onnxfuse.pipeline.Result` whose
    kernels `recompile(result)` compiled, giving `info` (the compile report); `before`: a
    copy of it from before that step (`snapshot`). `recompile_precise(result)`, when given,
    compiles a copy at the precise conv precision (PRECISE), tried when no candidate passes
    the accuracy gate. `result` is changed in place to the chosen model; returns the compile
    report of that model with a "tune" entry."""
    if not available(settings.provider):
        raise OnnxfuseError("tuning needs an NVIDIA GPU and onnxruntime-gpu (CUDA execution provider)")
    if result.fused:  # every fused candidate runs through the library: one that cannot load fails here, named
        try:
            runtime.library_path()
        except OnnxfuseError as e:
            raise OnnxfuseError(f"the custom-op library cannot be used ({e})") from None
    t0 = time.perf_counter()
    original = result.original
    dims = input_shapes(original, settings)
    feeds = feeds_for(original, dims)
    phases, node_steps = Phases(), Phases()
    with tempfile.TemporaryDirectory(prefix="onnxfuse-tune-") as tmp:
        timer = Timer(settings, Path(tmp))
        with phases("precision"):
            probed = probe_precisions(result, dims, feeds, timer, settings, conv_precision)
        if not probed:  # nothing to probe (no TF32 kernel, or the CPU provider): no phase to report
            del phases.seconds["precision"]
        precise_names = precise_nodes(before, probed)
        if precise_names:  # compiled at PRECISE before anything is timed (module docstring, step 0)
            set_precision(before, precise_names, PRECISE)
            fresh = snapshot(before)
            with phases("recompile"):
                info = recompile(fresh)
            _adopt(result, fresh)
        with phases("nodes"):  # the budget is the node timing's: it starts here
            decisions = time_nodes(result, feeds, dims, timer, settings, targets, conv_precision, jobs,
                                   time.perf_counter(), node_steps)
        for d in decisions:
            if d.node in precise_names:
                d.precision = PRECISE
        losers = {d.node for d in decisions if d.chosen == "original"}
        models: list[tuple[str, object, dict]] = []
        if losers:
            tuned = snapshot(before)
            bodies = unfuse_nodes(tuned, losers)
            split = split_epilogues(before, tuned, bodies)  # before tuned's kernels
            with phases("recompile"):
                tuned_info = recompile(tuned)
            _copy_kernels(result.model, tuned.model, {d.node for d in decisions if d.candidates})
            models.append(("tuned", tuned, tuned_info))
            if split is not None:
                with phases("recompile"):
                    split_info = recompile(split)
                _copy_kernels(result.model, split.model, {d.node for d in decisions if d.candidates})
                models.append(("tuned" + SPLIT_LABEL, split, split_info))
        models.append(("heuristic" if losers else "optimized", result, info))
        unmeasured = {d.node for d in decisions if d.chosen.startswith("not measured")}
        if unmeasured and len(unmeasured) < len(decisions):
            # the budget ran out: also try fusing only what was measured to win (last: a tie
            # keeps the fuller model)
            winners = snapshot(before)
            unfuse_nodes(winners, losers | unmeasured, UNMEASURED_REASON)
            with phases("recompile"):
                winners_info = recompile(winners)
            _copy_kernels(result.model, winners.model, {d.node for d in decisions if d.candidates})
            models.append(("measured only", winners, winners_info))
        kmajor_done = _kmajor_candidate(result, models, conv_precision)
        graphs = (False, True) if settings.provider == "cuda" else (False,)
        with phases("models"):
            measured = timer.time_models({"original": (original, False),
                                          **{label: (cand.model, bool(cand.fused)) for label, cand, _ in models}},
                                         feeds, graphs)
        orig_times = _times(measured, "original", graphs)
        if orig_times.plain_ms is None:
            raise OnnxfuseError(f"the original model does not run at these shapes ({orig_times.graph_error})")
        times = {label: _times(measured, label, graphs) for label, _, _ in models}
        # the gate guards the choice of TF32 (float32 convs at "tf32": their kind says so);
        # other fusions compute in fp32, float16 convs as cuDNN's do
        # (and the K-major candidate: ORT's own TF32 products, summed by other kernels)
        checked = bool(kmajor_done) or any(KINDS[f.kind].multiplies_in_tf32(f, precision_of(f, conv_precision))
                                           for f in result.fused)
        feed_sets: dict[str, dict[str, np.ndarray]] = {}
        gates: dict[str, dict] = {} if checked else {label: UNCHECKED for label, _, _ in models}
        if checked:
            with phases("accuracy"):
                draws = gate_draws(smallest_output(original, dims, feeds, settings.provider))
                feed_sets = accuracy_feeds(feeds, draws=min(draws, affordable_draws(original, feeds)))
        candidates = {label: cand.model for label, cand, _ in models}

        def gate(label: str) -> dict:
            """One candidate's gate, when `_fastest` would keep it on its times (`lazy-gates`)."""
            with phases("accuracy"):
                return accuracy_on(timer, original, {label: candidates[label]}, feed_sets)[label]
        kept = _fastest(models, times, gates, orig_times, settings.cuda_graph, gate)
        if kept is None and recompile_precise is not None and any(
                times[label].not_slower_than(orig_times, settings.cuda_graph)
                and not gates.get(label, {"passed": True})["passed"] for label, _, _ in models):
            # fast enough but less accurate than ORT: the same fusions with exact-ish convs
            precise = snapshot(before)
            # nodes that ORT might run in TF32 stay fused: it decides per session
            left = {f.node_name for f in precise.fused if f.node_name in losers and not ort_may_use_tf32(f)}
            if left:
                unfuse_nodes(precise, left)
            with phases("recompile"):
                precise_info = recompile_precise(precise)
            label = f"precise ({PRECISE})"
            with phases("models"):
                extra = timer.time_models({"original": (original, False),
                                           label: (precise.model, bool(precise.fused))}, feeds, graphs)
            times[label] = _times(extra, label, graphs)
            candidates[label] = precise.model
            models.append((label, precise, precise_info))
            kept = _fastest(models[-1:], times, gates, orig_times, settings.cuda_graph, gate)
        timer.save()
    record = {
        "shapes": {k: list(v) for k, v in dims.items()}, "seconds": round(time.perf_counter() - t0, 2),
        "phases": phases.rounded(), "node_steps": node_steps.rounded(),
        "measured": timer.measured, "cache_hits": timer.hits, "cache": str(timer.path) if timer.path else None,
        "node_runs": {k: round(v, 3) for k, v in timer.spent.items()},
        "bundles": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in timer.bundled.items()},
        "nodes": [dataclasses.asdict(d) for d in decisions],
        "cuda_graph": settings.cuda_graph,
        "original": dataclasses.asdict(orig_times), "models": {k: dataclasses.asdict(v) for k, v in times.items()},
        "accuracy": gates if checked else None, "gate_inputs": list(feed_sets),
        "tf32_probe": probed, "precise": sorted(precise_names),
    }
    if kept is None:
        record["kept"] = "original"
        out = keep_original(result, orig_times, times, gates, settings.cuda_graph)
    else:
        label, cand, cand_info = kept
        record["kept"] = label
        if cand is not result:
            _adopt(result, cand)
        if label.endswith(KMAJOR_LABEL):
            result.report.notes[kmajor.NOTE] = len(kmajor_done)
        out = dict(cand_info)
        if label.startswith("precise"):
            why = next(g["failure"] for g in gates.values() if not g["passed"])
            result.warn(f"the optimized model's tf32 convs were less accurate than ONNX Runtime's own default "
                        f"({why}); its convs were compiled at {PRECISE} instead")
            fused_now = {f.node_name for f in result.fused}
            for d in decisions:
                if d.chosen == "original" and d.node in fused_now:
                    d.chosen = (f"fused at {PRECISE} (faster in ONNX Runtime, which may run it in TF32 "
                                f"or fp32 from one session to the next)")
            record["nodes"] = [dataclasses.asdict(d) for d in decisions]
        if label == "measured only":
            for d in decisions:
                if d.node in unmeasured:
                    d.chosen = "left to ONNX Runtime (not measured; fusing only the measured winners was faster)"
            record["nodes"] = [dataclasses.asdict(d) for d in decisions]
        if label == "heuristic":  # the per-node decisions made it slower: none of them stays
            for d in decisions:
                if d.chosen == "original":
                    d.chosen = "fused (leaving it to ONNX Runtime made the model slower)"
            record["nodes"] = [dataclasses.asdict(d) for d in decisions]
        else:
            _note_losers(result, decisions)
    out["tune"] = record
    out["summary"] = out.get("summary", "") + "\n" + summary(record)
    return out


KMAJOR_LABEL = " + K-major"


def _kmajor_candidate(result, models: list, conv_precision: str) -> list[str]:
    """Where float32 products multiply in TF32 (`conv_precision` tf32, ORT's default): the
    first candidate (the tuned model, or the optimized one) with the float32 products ONNX
    Runtime runs itself given their weights K-major (`onnxfuse.kmajor`, from
    `kmajor.MEASURED_MIN_FLOPS`: measured here) appended to `models` as "<label> + K-major",
    last, so that it is kept only where faster than the others by more than MODEL_NOISE
    (`_fastest`). The products rewritten."""
    if conv_precision != "tf32" or not models:
        return []
    label, first, info = models[0]
    model, done = kmajor.kmajor_weights(first.model, result.shapes, measured=True)
    if done:
        models.append((label + KMAJOR_LABEL, snapshot(first, model), info))
    return done


SPLIT_LABEL = " + split epilogues"
SPLIT_ONLY = "not an epilogue measured slower with its product (tuning's split epilogues)"


def split_epilogues(before, tuned, bodies: dict[str, list[str]]):
    """A copy of `tuned` (a `snapshot` of `before` whose losing fused nodes `unfuse_nodes`
    turned back into `bodies`: fused node -> the nodes it became) with the epilogues of the
    gemm kind's among them fused again on their own: the pointwise patterns matched over those
    nodes alone, so that the product goes to ONNX Runtime (cuBLAS) and its bias and activation
    run as one chain. None where no loser is of the gemm kind or no chain forms (an epilogue
    of one bias Add: ORT fuses that with the product). `tuned` is not changed.
    The chains were not timed one by one: this is a whole-model candidate, kept only where the
    model is measured faster (`_fastest`). ViT-S/16 from torch's dynamo exporter at batch 1
    fp32 (forty-fourth session, H100): 11 of 12 FFN1 Triton GEMMs with their erf-GELU lost
    (20.1-20.6 µs against ORT's 17.7-17.8, seven kernels: ORT does not fuse that export's GELU
    form), and the model read 1.12x the best peer (error 0.0022 against ORT's 0.0020) where the
    TorchScript export's, whose FFN1 ran cuBLASLt's product and a bias + GELU chain, read 1.37x
    (0.0023 against 0.0020)."""
    gemm = {f.node_name for f in before.fused if f.node_name in bodies and f.kind == "gemm"}
    if not gemm:
        return None
    cand = snapshot(tuned)
    freed = {name for g in gemm for name in bodies[g] if name}
    view = GraphView.build(cand.model, infer_shapes(cand.model))
    patterns = [p for p in cand.patterns if p.kind.name == "pointwise"]
    found = find_matches(view, patterns, {i: SPLIT_ONLY for i, n in enumerate(view.nodes) if n.name not in freed})
    if not found.matches:
        return None
    cand.model, fused = rewrite(cand.model, view, found.matches)
    cand.fused = [*cand.fused, *fused]
    refused = sum(len(f.source_nodes) for f in fused)  # counted as left to ORT by unfuse_nodes
    left = cand.report.not_fused.get(REASON, 0) - refused
    if left > 0:
        cand.report.not_fused[REASON] = left
    else:
        cand.report.not_fused.pop(REASON, None)
    return cand


class Phases:
    """Seconds spent in each named phase of a tuning: `with phases("nodes"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.seconds.items()}


def _flops(model: ModelProto, feeds: dict[str, np.ndarray]) -> float | None:
    """The model's FLOPs at the feeds' shapes (onnxfuse.cost), None where it has no estimate."""
    try:
        return model_cost(model, {k: tuple(v.shape) for k, v in feeds.items()}).flops
    except Exception:  # noqa: BLE001  no estimate
        return None


def _float64_reference(model: ModelProto, feeds: dict[str, np.ndarray]
                       ) -> tuple[dict[str, np.ndarray] | None, str | None]:
    flops = _flops(model, feeds)  # no estimate: not risked
    if flops is None or flops > FLOAT64_MAX_FLOPS:
        size = "an unknown number of" if flops is None else f"{flops / 1e9:.0f} G"
        return None, f"{size}FLOPs at these shapes, more than {FLOAT64_MAX_FLOPS / 1e9:.0f} G in float64 on the CPU"
    try:
        return reference.evaluate(model, feeds), None
    except reference.Unavailable as e:
        return None, str(e)


def accuracy(timer: Timer, original: ModelProto, candidates: dict[str, ModelProto],
             feeds: dict[str, np.ndarray]) -> dict[str, dict]:
    """The accuracy gate of `onnxfuse bench` (onnxfuse.tools.gate.gate_outputs) on every
    candidate, at one set of inputs: the reference is the original in float64
    (`Timer.float64_reference`), else the original with TF32 off, and a candidate passes when
    each output is within 2x the original's own error under ORT's defaults (TF32 allowed)
    plus the dtype's floor. Per label: passed, max_abs_err, ort_max_abs_err, rms_err and
    ort_rms_err (reported, not gated), the first failure's text (or the error that stopped the
    run) and which reference it was. On CUDA, ORT's own error is the smallest of
    `ort_default_sessions` sessions', output by output."""
    gates = accuracy_on(timer, original, candidates, {"": feeds})
    return {label: {k: v for k, v in g.items() if k != "inputs"} for label, g in gates.items()}


def ort_default_sessions(model: ModelProto) -> int:
    """How many fresh sessions give ORT's own error (`accuracy_on`): ORT_DEFAULT_SESSIONS where
    the model has a SEARCHED_OPS node (in its graph, a subgraph or a function), else one."""
    ops = {n.op_type for g in ir.graphs(model.graph) for n in g.node if n.domain in ("", "ai.onnx")}
    ops |= {n.op_type for f in model.functions for n in f.node if n.domain in ("", "ai.onnx")}
    return ORT_DEFAULT_SESSIONS if ops & SEARCHED_OPS else 1


def accuracy_on(timer: Timer, original: ModelProto, candidates: dict[str, ModelProto],
                feed_sets: dict[str, dict[str, np.ndarray]]) -> dict[str, dict]:
    """`accuracy` on each input set (`accuracy_feeds`), every model's sets in one session: a
    candidate passes when it passes on every set; its record is that of the first set it fails
    on, else of the set where its error is largest against ORT's own, with the set's name
    ("inputs")."""
    keys = timer.gate_keys(original, candidates, feed_sets)
    out = {label: dict(timer.entries[key]["gate"]) for label, key in keys.items() if key in timer.entries}
    timer.hits += len(out)
    todo = {label: m for label, m in candidates.items() if label not in out}
    if not todo:
        return out
    ort_runs = [timer.original_outputs(original, feed_sets, "ort", True)]
    if timer.settings.provider == "cuda":
        ort_runs += [timer.outputs({"ort": (original, False, True)}, feed_sets)["ort"]
                     for _ in range(ort_default_sessions(original) - 1)]
    runs = timer.outputs({label: (m, True, True) for label, m in todo.items()}, feed_sets)
    per_set = {name: _gate_set(timer, original, feed_sets, name, [r[name] for r in ort_runs],
                               {label: runs[label][name] for label in todo})
               for name in feed_sets}

    def ratio(g: dict) -> float:
        err, ort = g["max_abs_err"], g["ort_max_abs_err"]
        return -1.0 if err is None else err / ort if ort else float("inf") if err else 0.0

    for label in todo:
        sets = [{**g[label], "inputs": name} for name, g in per_set.items()]
        failed = [g for g in sets if not g["passed"]]
        out[label] = failed[0] if failed else max(sets, key=ratio)
        if all(not isinstance(runs[label][name], str) for name in feed_sets):  # a candidate that ran
            timer.entries[keys[label]] = {"gate": out[label]}
            timer.measured += 1
    return {label: out[label] for label in candidates}


def _gate_set(timer: Timer, original: ModelProto, feed_sets: dict[str, dict[str, np.ndarray]], name: str,
              ort_runs: list, runs: dict[str, dict[str, np.ndarray] | str]) -> dict[str, dict]:
    """The gate on input set `name`, given the original's ORT default runs and the candidates'."""
    feeds = feed_sets[name]
    ref64, why_not = timer.float64_reference(original, feeds)
    ort = ort_runs[0]
    if ref64 is not None and not isinstance(ort, str):
        ref64, why_not = plausible_float64(ref64, ort, why_not)
    reference = ref64 if ref64 is not None else timer.original_outputs(original, feed_sets, "reference", False)[name]
    if isinstance(reference, str) or isinstance(ort, str):
        raise OnnxfuseError(f"the original model does not run at these shapes "
                            f"({reference if isinstance(reference, str) else ort})")
    if len(ort_runs) > 1:
        ort = most_accurate(ort_runs, reference)
    what = "float64" if ref64 is not None else f"TF32 off ({why_not})"
    out = {}
    for label, got in runs.items():
        if isinstance(got, str):
            out[label] = {"passed": False, "max_abs_err": None, "ort_max_abs_err": None, "failure": got,
                          "reference": what, "rms_err": None, "ort_rms_err": None}
            continue
        checks = gate_outputs(reference, ort, got)
        failed = [c for c in checks if not c.passed]
        out[label] = {"passed": not failed, "max_abs_err": _largest(checks, "max_abs_err"),
                      "ort_max_abs_err": _largest(checks, "ort_max_abs_err"),
                      "failure": f"output {failed[0].name!r}: {failed[0].failure()}" if failed else None,
                      "reference": what,
                      # the bulk of the error beside one element's (gate.rms_error): reported, not gated
                      "rms_err": _largest(checks, "rms_err"), "ort_rms_err": _largest(checks, "ort_rms_err")}
    return out


def _largest(checks: list, key: str) -> float | None:
    """The largest of the outputs' `key` (an OutputCheck field) that is known, or None."""
    return max((getattr(c, key) for c in checks if getattr(c, key) is not None), default=None)


def most_accurate(runs: list, reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per output, the value of the run (outputs by name; a run that failed is its error's
    text) closest to the reference by max abs error."""
    ok = [r for r in runs if not isinstance(r, str)]

    def err(r: dict, name: str) -> float:
        got, want = r[name].astype(np.float64), reference[name].astype(np.float64)
        d = np.abs(got - want)
        d[np.isnan(d)] = np.inf  # a NaN the reference does not have is the worst error
        d[np.isnan(got) & np.isnan(want)] = 0.0
        return float(d.max(initial=0.0))

    return {name: min(ok, key=lambda r: err(r, name))[name] for name in ok[0]}


def _fastest(models: list, times: dict[str, ModelTimes], gates: dict[str, dict], orig: ModelTimes,
             cuda_graph: bool | None = None, gate: Callable[[str], dict] | None = None):
    """The fastest candidate (label, result, info) that is not slower than the original in the
    deployment's mode (`TuneSettings.cuda_graph`) and passes the accuracy gate, or None.
    Candidates come in order of preference (the tuned model, every node decision of which was
    measured, first): a later one replaces an earlier one only where it is faster by more than
    MODEL_NOISE (`model-ties-keep-tuned`), in the deployment's mode, or, where that is not
    known, in its faster mode and slower in neither (`model-modes`).

    `gates` holds the gate records known; `gate(label)`, when given, gates a candidate missing
    from them and `gates` keeps its record (`lazy-gates`). Only a candidate its times would make
    the one kept is gated: one slower than the original or not faster than the one kept cannot
    change the choice whatever its accuracy, so the choice is the one every candidate gated
    gives at the cost of the gates that could change it."""
    kept = None
    for label, cand, cand_info in models:
        t = times[label]
        if not t.not_slower_than(orig, cuda_graph):
            continue
        if kept is not None and not (t.best(cuda_graph) * (1 + MODEL_NOISE) < times[kept[0]].best(cuda_graph)
                                     and t.not_slower_than(times[kept[0]], cuda_graph)):
            continue
        if label not in gates and gate is not None:
            gates[label] = gate(label)
        if gates[label]["passed"]:
            kept = (label, cand, cand_info)
    return kept


def probe_precisions(result, dims: dict[str, tuple[int, ...]], feeds: dict[str, np.ndarray], timer: Timer,
                     settings: TuneSettings, conv_precision: str) -> dict[str, dict]:
    """Step 0 (module docstring): for each fused node of `result` whose kernel would multiply
    float32 in TF32, what ONNX Runtime multiplies its original subgraph in (`Timer.tf32_probe`),
    by node name; {"error": why} where it cannot be probed (that node keeps the model's
    precision). Empty on the CPU provider, which multiplies nothing in TF32."""
    if settings.provider != "cuda":
        return {}
    todo = [f for f in result.fused if KINDS[f.kind].multiplies_in_tf32(f, precision_of(f, conv_precision))]
    if not todo:
        return {}
    nodes = {n.name: n for n in result.model.graph.node}
    needed = {x for f in todo for x in (*nodes[f.node_name].input, *nodes[f.node_name].output) if x}
    infos = timer.tensor_infos(result.model, dims, feeds, needed)
    out = {}
    for f in todo:
        try:
            out[f.node_name] = timer.tf32_probe(original_model(result.model, nodes[f.node_name], infos))
        except Exception as e:  # a node that cannot be probed keeps the model's precision
            out[f.node_name] = {"error": _why(e)}
    return out


def precise_nodes(before, probed: dict[str, dict]) -> set[str]:
    """The fused nodes of `before` (an `onnxfuse.pipeline.Result`) that compile at PRECISE:
    those whose original ONNX Runtime multiplied in fp32 (`probe_precisions`), and every node
    that shares a kernel name with one (one kernel, one precision)."""
    fp32 = {name for name, p in probed.items() if p.get("multiplies") == "fp32"}
    kernels = {f.kernel_name for f in before.fused if f.node_name in fp32}
    return {f.node_name for f in before.fused if f.kernel_name in kernels}


def set_precision(result, names: set[str], precision: str) -> None:
    """The fused nodes `names` of `result` multiply at `precision` (`FusedNode.precision`)
    when it is next compiled."""
    result.fused = [dataclasses.replace(f, precision=precision) if f.node_name in names else f for f in result.fused]


def time_nodes(result, feeds, dims, timer: Timer, settings: TuneSettings, targets, conv_precision, jobs,
               t0: float, steps: Phases | None = None) -> list[NodeDecision]:
    """Per-node timings and decisions (module docstring, step 1). `steps`, when given, gets the
    seconds of each step (the record's "node_steps": where a budget's overrun went)."""
    if not result.fused:
        return []
    steps = steps if steps is not None else Phases()
    nodes = {n.name: n for n in result.model.graph.node}
    needed = {x for f in result.fused for x in (*nodes[f.node_name].input, *nodes[f.node_name].output) if x}
    with steps("shapes"):
        infos = timer.tensor_infos(result.model, dims, feeds, needed)
    decisions = [NodeDecision(f.node_name, f.kind, offered=f.measured_only) for f in result.fused]
    order = measure_order(result, dims)
    built: dict[int, tuple[ModelProto, ModelProto]] = {}  # index -> (original, fused) one-node models
    with steps("one-node models"):
        for i in order:
            node = nodes[result.fused[i].node_name]
            try:
                built[i] = (original_model(result.model, node, infos), fused_model(result.model, node, infos))
            except Exception as e:  # a node that cannot be measured keeps the heuristics' decision
                decisions[i].chosen = f"not measured ({_why(e)})"
    with steps("bundles"):
        bundled = (_time_bundled(timer, built, t0 + settings.budget_s)
                   if settings.provider == "cuda" and bundle.available() else {})
    with steps("graph gap"):
        gap = graph_gap(timer) if bundled else 0.0
    searches = []  # (fused node, node, its one-node model, decision) whose configurations are timed
    for i in order:
        if i not in built:
            continue
        f, d = result.fused[i], decisions[i]
        orig, mini = built[i]
        if i in bundled:
            o, fz = bundled[i]
            d.mode, d.replicas, d.gap_ms = BUNDLED, 1, gap
            d.original_ms, d.fused_ms = o.us / 1e3, fz.us / 1e3
            d.original_kernels, d.fused_kernels = o.kernels, fz.kernels
        else:
            # past the budget a node is still decided when its pair was timed before (a layer of
            # the same shapes as one measured, or an earlier tuning): that costs no GPU time
            spent = time.perf_counter() - t0 > settings.budget_s
            try:
                with steps("pairs"):
                    pair = _time_pair(timer, orig, mini, settings.provider == "cuda", cached_only=spent)
            except Exception as e:  # a node that cannot be measured keeps the heuristics' decision
                d.chosen = f"not measured ({_why(e)})"
                continue
            if pair is None:
                d.chosen = f"not measured (tuning budget of {settings.budget_s:g} s spent)"
                continue
            d.mode, d.replicas, d.original_ms, d.fused_ms = pair
        d.chosen = "fused"
        # offered chains compete with ORT's own fused kernels at a margin: their configurations
        # are searched in every tuning (`offered-chains-searched`), and so are a kind's nodes
        # where its heuristic is known weak (`Kind.searches`: convs under one wave)
        kind = KINDS[f.kind]
        if (settings.configs or (f.measured_only and kind.search_offered)
                or _searches(kind, result, f, nodes[f.node_name], infos, conv_precision)):
            searches.append((f, nodes[f.node_name], mini, d))
        if d.loses():
            d.chosen = "original"
    # Then the candidate configurations, with what is left of the budget. Every node's own
    # kernel is timed first, so a search (one compile per tile) never leaves later nodes
    # unmeasured (the thirteenth session's BERT-base b8: four attention tiles spent the 10 s
    # before any GEMM was timed); the nodes with the most time at stake are searched first
    # (BERT-base b8 fp16: an attention layer's 10.3 µs before a LayerNorm's 3.5). Past the
    # budget a node is still searched where one of the same one-node model (a layer of the same
    # shapes) was: its kernels are compile-cache hits and its timings remembered, so it costs
    # no GPU time (the twenty-first session's BERT-base b8 fp16: two of twelve attention layers
    # got the 7.1 µs tile, ten kept the default's 10.3).
    searches.sort(key=lambda s: -(s[3].fused_ms or 0.0))
    searched: set[str] = set()
    for f, node, mini, d in searches:
        key = timer._key(mini, _shape_only_feeds(mini), True, "search")
        spent = time.perf_counter() - t0 > settings.budget_s
        if spent and key not in searched:
            continue
        searched.add(key)
        best = _search_configs(result, f, node, mini, d, timer, targets, conv_precision, jobs, cached_only=spent,
                               steps=steps)
        if best is not None:
            d.fused_ms, d.chosen = best
            if d.loses():
                d.chosen = "original"
    return decisions


def _time_bundled(timer: Timer, built: dict[int, tuple[ModelProto, ModelProto]], deadline: float
                  ) -> dict[int, tuple[bundle.Timed, bundle.Timed]]:
    """(original, fused) bundled times of the nodes `built` (index -> their one-node models)
    that `Timer.time_bundled` timed on both sides; each node's pair side by side, in the order
    given, so that a budget spent between two bundles leaves whole nodes unmeasured."""
    idx = list(built)
    models = [pair for i in idx for pair in ((built[i][0], False), (built[i][1], True))]
    times = timer.time_bundled(models, deadline)
    out = {}
    for k, i in enumerate(idx):
        o, fz = times[2 * k], times[2 * k + 1]
        if o is not None and fz is not None:
            out[i] = (o, fz)
    return out


def graph_gap(timer: Timer) -> float:
    """What a CUDA graph spends between two dependent kernels on this device besides the
    kernels themselves (ms): two chains of small elementwise nodes (GAP_CHAINS long) timed
    under CUDA graphs and in a bundle; the difference of their graph times less that of their
    kernel times, per kernel more. Measured once per device and software (the tuning cache);
    GRAPH_GAP_MS where it cannot be."""
    key = f"graph-gap|{GAP_CHAINS}"
    if key in timer.entries:
        timer.hits += 1
        return float(timer.entries[key]["ms"])
    chains = [_chain(n) for n in GAP_CHAINS]
    try:
        graph_ms = [timer.time(c, None, False, graph=True) for c in chains]
        kernels = timer.time_bundled([(c, False) for c in chains])
    except OnnxfuseError:
        return GRAPH_GAP_MS
    short, long = kernels
    if short is None or long is None or long.kernels <= short.kernels:
        return GRAPH_GAP_MS
    gap = ((graph_ms[1] - graph_ms[0]) - (long.us - short.us) / 1e3) / (long.kernels - short.kernels)
    timer.entries[key] = {"ms": max(0.0, gap)}
    timer.measured += 1
    return max(0.0, gap)


def _chain(n: int) -> ModelProto:
    """n dependent elementwise nodes (Relu and Sigmoid in turn, which ONNX Runtime does not
    fuse) on 1024 floats: kernels of a couple of microseconds, one after another."""
    names = ["x", *(f"t{k}" for k in range(1, n)), "y"]
    nodes = [helper.make_node("Relu" if k % 2 == 0 else "Sigmoid", [names[k]], [names[k + 1]], name=f"n{k}")
             for k in range(n)]
    vi = [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [1, 1024]) for x in ("x", "y")]
    m = helper.make_model(helper.make_graph(nodes, f"chain{n}", vi[:1], vi[1:]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def measure_order(result, dims: dict[str, tuple[int, ...]]) -> list[int]:
    """Indices of result.fused in the order `time_nodes` measures them. Convs first (their kind's
    `measure_first`): they are where ORT's own kernels (cuDNN) may be faster; pointwise chains
    and pools replace memory-bound nodes and seldom lose. Within each group the largest first,
    by the roofline time of the subgraph each node replaced (onnxfuse.cost at the tuning's
    shapes, the H200's roofline; an order, not a prediction), so that when the budget runs out
    the nodes left unmeasured are the smallest: at batch 1 a 10 s budget measured 20 of
    EfficientNet-B0's 81 convs in graph order (H200, sixteenth session). Graph order breaks
    ties and stands alone where the costs cannot be counted."""
    try:
        costs = model_cost(result.model, dims).by_name()
    except Exception:  # noqa: BLE001  no costs: graph order
        costs = {}
    roof = make_roof("h200", dtype_peak="tf32")

    def size(i: int) -> float:
        c = costs.get(result.fused[i].node_name)
        parts = (c.body or [c]) if c is not None else []
        times = [roof.time(p) for p in parts]
        return sum(t for t in times if t is not None)

    return sorted(range(len(result.fused)), key=lambda i: (not KINDS[result.fused[i].kind].measure_first, -size(i), i))


def node_margin(original_ms: float, replicas: int, mode: str = "") -> float:
    """How much slower than its original a fused node may time and still count as a tie (ms):
    NODE_MARGIN_REL of the original, or the timing noise, whichever is larger. The noise,
    NODE_MARGIN_MS, is that of one synchronized run's median; a node timed k copies per run
    (CUDA graphs, `replicated`) has its time divided by k, and its noise with it. (On the
    H200 a BERT-base attention softmax timed 3.34 µs fused against 2.68 µs for ORT's Add +
    Softmax, 16 copies per run, and a flat 2 µs margin kept it fused in all 12 layers.)
    Bundled timings (`mode` BUNDLED: kernel durations) have BUNDLED_MARGIN_MS of noise."""
    noise = BUNDLED_MARGIN_MS if mode == BUNDLED else NODE_MARGIN_MS / max(replicas, 1)
    return max(noise, NODE_MARGIN_REL * original_ms)


def _time_pair(timer: Timer, orig: ModelProto, mini: ModelProto, graphs: bool,
               cached_only: bool = False) -> tuple[str, int, float, float] | None:
    """(mode, copies, original ms, fused ms) of one node; with `cached_only`, from the
    timer's remembered times alone, or None where one of them is not remembered.

    On CUDA both run under CUDA graphs, k copies per run (`replicated`; the time is per
    copy), so the times are the GPU's work without the launches (a fused node's fewer
    launches are the whole-model check's to count, in both modes): timed plainly, a fused
    node that is slower on the GPU than the cuDNN conv it replaces still won at batch 1 by
    its launches alone, and the model lost once graphs took the launches away; timed one
    copy per graph (H200, seventh session), every node of MobileNetV3-S measured 12-21 µs,
    mostly the graph's own launch and synchronization, and the model with graphs was slower.
    A pair that graphs cannot capture is timed plainly, one copy."""
    if graphs:
        k = replicas(orig, mini)
        rep_o, rep_f = replicated(orig, k), replicated(mini, k)
        try:
            original = _timed(timer, rep_o, False, True, cached_only)
            fused = None if original is None else _timed(timer, rep_f, True, True, cached_only)
            return None if original is None or fused is None else ("CUDA graph", k, original / k, fused / k)
        except OnnxfuseError:
            pass
    original = _timed(timer, orig, False, False, cached_only)
    fused = None if original is None else _timed(timer, mini, True, False, cached_only)
    return None if original is None or fused is None else ("plain", 1, original, fused)


def _timed(timer: Timer, m: ModelProto, library: bool, graph: bool, cached_only: bool) -> float | None:
    """`timer.time` of a one-node model: remembered, else timed on seeded random inputs made
    only then (unless `cached_only`)."""
    return timer.time(m, None, library, graph=graph, cached_only=cached_only)


def _shape_only_feeds(m: ModelProto) -> dict[str, np.ndarray]:
    """`static_feeds`' dtypes and shapes without its data (read-only zero-stride views): what
    a cache key reads."""
    out = {}
    for vi in m.graph.input:
        t = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        out[vi.name] = np.broadcast_to(np.zeros((), dtype), [d.dim_value for d in t.shape.dim])
    return out


def _why(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0][:200] if text else ""
    return first if isinstance(e, OnnxfuseError) else f"{type(e).__name__}: {first}"


def _searches(kind, result, f, node, infos, conv_precision) -> bool:
    """kind.searches for the node: its spec and its first output's static shape."""
    if type(kind).searches is Kind.searches:
        return kind.search_configs  # the kind's own flag: no spec needed
    info = infos.get(node.output[0])
    dims = (tuple(d.dim_value if d.HasField("dim_value") else -1 for d in info.type.tensor_type.shape.dim)
            if info is not None else None)
    try:
        spec = kernel_spec(result.model, f, conv_precision)
    except Exception:  # a spec that cannot be built is not searched (the search would fail the same way)
        return kind.search_configs
    return kind.searches(spec, dims)


def precompile_searches(result, dims: dict[str, tuple[int, ...]], targets: list[int], conv_precision: str = "tf32",
                        jobs: int | None = None) -> dict:
    """Compile, without a GPU, the candidate configurations that tuning would search for the
    fused nodes of `result` (the passes up to the compile pass, run as where tuning follows, at
    the input dims `dims` tuning will use): every node whose kind searches by itself
    (`Kind.search_configs`, `Kind.searches` from its spec and output shape, at the shapes shape
    inference gives) or that was offered from ORT's fusions to a kind that searches those
    (`Kind.search_offered`), all in one parallel compile, so that tuning's "search compiles"
    are kernel-cache hits. Those took 6-20 s of each of a suite row's two tunings on the
    H100 (forty-fourth session's dynamo rows) and spent the nodes phase's budget: the second
    tuning searched what the first had no time left for. The nodes tuning only searches with
    `--tune` configs are not compiled. Returns the kernels and candidates compiled and the
    seconds the compile took."""
    infos = inferred_infos(result.model, dims)  # none inferred: the kinds that search by themselves still do
    nodes = {n.name: n for n in result.model.graph.node}
    specs, variants = [], []
    for f in result.fused:
        node, kind = nodes.get(f.node_name), KINDS[f.kind]
        if node is None or not ((f.measured_only and kind.search_offered)
                                or _searches(kind, result, f, node, infos, conv_precision)):
            continue
        try:
            spec = kernel_spec(result.model, f, conv_precision)
        except Exception:  # tuning cannot search it either
            continue
        for _, v in candidates(spec):
            specs.append(spec)
            variants.append(v)
    compiled = aot.compile_kernels(specs, targets, jobs=jobs, errors="collect", variant_overrides=variants) \
        if specs else []
    done = [c for c in compiled if isinstance(c, aot.CompiledKernel)]
    return {"candidates": len(specs), "compiled": sum(c.compiled for c in done),
            "cache_hits": sum(c.cache_hits for c in done), "failed": len(compiled) - len(done),
            "seconds": round(sum(c.compile_seconds for c in done), 2)}


def _search_configs(result, f, node, mini, d: NodeDecision, timer: Timer, targets, conv_precision, jobs,
                    cached_only: bool = False, steps: Phases | None = None) -> tuple[float, str] | None:
    """--tune: time each candidate configuration of the node's kernel as the node itself was
    timed (in one bundle, or a pair's way); attach the fastest to the node in result.model
    (bundled: its kernel count to `d`). Returns (ms, label) of the fastest, or None.
    `cached_only`: remembered timings alone (none run); a candidate without one is not timed.
    `steps` gets the seconds spent compiling and timing them."""
    steps = steps if steps is not None else Phases()
    spec = kernel_spec(result.model, f, conv_precision)
    configs = candidates(spec)
    # every candidate compiled in one call, in parallel: compiled one at a time, the searches of
    # four squeeze-excite nodes took most of EfficientNet-B0's 10 s budget on the H200 (17th session)
    try:
        with steps("search compiles"):
            compiled = aot.compile_kernels([spec] * len(configs), targets, jobs=jobs, errors="collect",
                                           variant_overrides=[variants for _, variants in configs])
    except Exception as e:  # a kernel generator that fails on every configuration
        compiled = [e] * len(configs)
    trials = []  # (label, one-node model, compiled kernel)
    for (label, _), ck in zip(configs, compiled, strict=True):
        if not isinstance(ck, aot.CompiledKernel):  # a configuration that does not compile is skipped
            d.candidates.append({"config": label, "error": ck.message if isinstance(ck, aot.CompileFailure)
                                 else _why(ck)})
            continue
        trial = ModelProto()
        trial.CopyFrom(mini)
        aot.attach(trial.graph.node[0], ck)
        trials.append((label, trial, ck))
    with steps("search timings"):
        if d.mode == BUNDLED:
            timed = timer.time_bundled([(t, True) for _, t, _ in trials],
                                       deadline=time.perf_counter() if cached_only else None)
            scored = [(label, None if t is None else (t.us / 1e3, t.kernels), ck)
                      for (label, _, ck), t in zip(trials, timed, strict=True)]
        else:
            scored = []
            for label, trial, ck in trials:
                try:
                    # looked up before its inputs are made: a layer of the same shapes timed it already
                    ms = _timed(timer, replicated(trial, d.replicas), True, d.mode == "CUDA graph", cached_only)
                    scored.append((label, None if ms is None else (ms / d.replicas, None), ck))
                except Exception as e:  # a configuration that does not run is skipped
                    d.candidates.append({"config": label, "error": _why(e)})
    best = None
    for label, got, ck in scored:
        if got is None:
            d.candidates.append({"config": label, "error": "not timed: tuning budget spent" if cached_only
                                 else "not timed in its bundle"})
            continue
        ms, kernels = got
        d.candidates.append({"config": label, "ms": ms, **({"kernels": kernels} if kernels is not None else {})})
        # bundled: the launch gaps of each candidate's kernels count too (a split K launches two)
        score = ms + d.gap_ms * (kernels or 0)
        if best is None or score < best[0]:
            best = (score, label, ck, ms, kernels)
    if best is None:
        return None
    _, label, ck, ms, kernels = best
    if kernels is not None:
        d.fused_kernels = kernels
    aot.attach(node, ck)
    return ms, label


def _times(measured: dict, label: str, graphs: tuple[bool, ...]) -> ModelTimes:
    """ModelTimes of one label from Timer.time_models' answer (an error's text for a mode
    that failed; a plain run that failed leaves no time at all)."""
    plain = measured[label, False]
    graph = measured.get((label, True), "CUDA graphs need the CUDA execution provider")
    if isinstance(plain, str):
        return ModelTimes(None, None, plain[:300])
    return ModelTimes(plain, graph if not isinstance(graph, str) else None,
                      graph[:300] if isinstance(graph, str) else None)


# ---------------------------------------------------------------------------------------
# Changing the result
# ---------------------------------------------------------------------------------------

def snapshot(result, model: ModelProto | None = None):
    """A copy of an `onnxfuse.pipeline.Result` that later steps do not change; with `model`,
    one whose model is that one instead (not copied: a transformer's is hundreds of MB)."""
    if model is None:
        model = ModelProto()
        model.CopyFrom(result.model)
    return dataclasses.replace(result, model=model, report=copy.deepcopy(result.report), fused=list(result.fused))


def unfuse_nodes(result, names: set[str], reason: str = REASON) -> dict[str, list[str]]:
    """Turn the fused nodes `names` of result back into their original nodes, all at once
    (`unfuse_all`); returns each one's name -> the names of the nodes it became."""
    bodies = unfuse_all(result.model, [f for f in result.fused if f.node_name in names])
    result.drop_fused(names, reason)
    return bodies


def _adopt(result, other) -> None:
    """Make `result` the candidate `other` (a `snapshot` recompiled): its model, fused nodes
    and report."""
    result.model = other.model
    result.fused = list(other.fused)
    for k in dataclasses.fields(result.report):
        setattr(result.report, k.name, getattr(other.report, k.name))


def _copy_kernels(src: ModelProto, dst: ModelProto, names: set[str]) -> None:
    """The kernels --tune chose for nodes `names` of src, onto the same nodes of dst where
    they still run the same kernel (same overload)."""
    have = {n.name: n for n in src.graph.node if n.name in names}
    for n in dst.graph.node:
        s = have.get(n.name)
        if s is None or (s.domain, s.op_type, s.overload) != (n.domain, n.op_type, n.overload):
            continue
        for a in [a for a in n.attribute if aot._KERNEL_ATTR.fullmatch(a.name)]:
            n.attribute.remove(a)
        n.attribute.extend(a for a in s.attribute if aot._KERNEL_ATTR.fullmatch(a.name))


def _note_losers(result, decisions: list[NodeDecision]) -> None:
    """The report's reason for the nodes left to ONNX Runtime names both times."""
    losers = [d for d in decisions if d.chosen == "original"]
    n = result.report.not_fused.pop(REASON, None)
    if n is None or not losers:
        return
    result.report.not_fused[REASON + ": " + "; ".join(
        f"{d.node} {d.original_ms:.4f} ms vs fused {d.fused_ms:.4f} ms" for d in losers[:8])
        + (f"; and {len(losers) - 8} more" if len(losers) > 8 else "")] = n


def keep_original(result, orig: ModelTimes, times: dict[str, ModelTimes], gates: dict[str, dict] | None = None,
                  cuda_graph: bool | None = None) -> dict:
    """Make `result` the original model, unchanged; returns its compile report. `gates`:
    the candidates' accuracy (`accuracy`); the warning says which were fast enough (in the
    deployment's mode, `cuda_graph`) but less accurate than ORT's own default."""
    m = ModelProto()
    m.CopyFrom(result.original)
    n = len(m.graph.node)
    fused_nodes = sum(len(f.source_nodes) for f in result.fused)
    result.model = m
    result.fused = []
    r = result.report
    r.nodes_after, r.patterns_applied, r.fused, r.folded_batchnorm = n, {}, [], 0
    gates = gates or {}
    inaccurate = [k for k, t in times.items()
                  if t.not_slower_than(orig, cuda_graph) and not gates.get(k, {}).get("passed", True)]
    shown = ", ".join(f"{k} {_fmt(t)}" + (" (less accurate than ORT)" if k in inaccurate else "")
                      for k, t in times.items())
    if inaccurate:
        why = gates[inaccurate[0]]["failure"]
        reason = f"{KEPT_INACCURATE}: {inaccurate[0]}: {why}"
        result.warn(f"the optimized model was less accurate than ONNX Runtime's own default ({why}) or slower than "
                    f"the original (original {_fmt(orig)}; {shown}); the original model is written unchanged")
    else:
        reason = f"{KEPT_ORIGINAL}: original {_fmt(orig)}; {shown}"
        result.warn(f"the optimized model measured slower than the original (original {_fmt(orig)}; {shown}); "
                    "the original model is written unchanged")
    r.not_fused = {reason: fused_nodes}
    return {"summary": "kernels: none kept (the original model is written unchanged)", "kernels": 0}


def _fmt(t: ModelTimes) -> str:
    plain = f"{t.plain_ms:.3f} ms" if t.plain_ms is not None else "failed"
    graph = f"{t.graph_ms:.3f} ms" if t.graph_ms is not None else "n/a"
    return f"{plain} (CUDA graph {graph})"


def _err(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2g}"


def summary(record: dict) -> str:
    shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in record["shapes"].items())
    lines = [f"tune at {shapes}: {record['measured']} timings, {record['cache_hits']} from the cache, "
             f"{record['seconds']:.1f} s"
             + (" (" + ", ".join(f"{k} {v:.1f} s" for k, v in record["phases"].items()) + ")"
                if record.get("phases") else "")]
    if record.get("node_steps"):
        lines.append("  nodes: " + ", ".join(f"{k} {v:.1f} s" for k, v in record["node_steps"].items()))
    b = record.get("bundles") or {}
    if b.get("sessions") or b.get("errors"):
        lines.append(f"  bundled: {b['models']} one-node models in {b['sessions']} session(s), {b['total_s']:.1f} s"
                     + (f"; {len(b['errors'])} bundle(s) failed: {b['errors'][0]}" if b["errors"] else ""))
    for d in record["nodes"]:
        if d["chosen"] == "original":
            lines.append(f"  {d['node']}: left to ONNX Runtime (original {d['original_ms']:.4f} ms, "
                         f"fused {d['fused_ms']:.4f} ms, {d.get('mode') or 'plain'})")
        elif d["chosen"].startswith(("not measured", f"fused at {PRECISE}")):
            lines.append(f"  {d['node']}: {d['chosen']}")
        elif d["candidates"]:
            lines.append(f"  {d['node']}: {d['chosen']} ({d['fused_ms']:.4f} ms; original {d['original_ms']:.4f})")
    if record.get("precise"):
        names = record["precise"]
        lines.append(f"  {len(names)} node(s) multiply at {PRECISE}, where ONNX Runtime multiplied their originals in "
                     f"fp32 (TF32 probe): " + ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8
                                                                     else ""))
    failed = {k: v["error"] for k, v in (record.get("tf32_probe") or {}).items() if "error" in v}
    if failed:
        first = next(iter(failed.items()))
        lines.append(f"  TF32 probe failed for {len(failed)} node(s), which keep the model's precision: "
                     f"{first[0]}: {first[1]}")
    o = ModelTimes(**record["original"])
    mode = {True: "under CUDA graphs (--cuda-graph)", False: "without CUDA graphs (--no-cuda-graph)"}.get(
        record.get("cuda_graph"), "in both modes, slower in neither")
    lines.append(f"  original: {_fmt(o)}; models compared {mode}")
    sets = record.get("gate_inputs") or []
    if len(sets) > 2:
        lines.append(f"  accuracy gate on {len(sets)} input sets (few output elements: one set's max error is noise)")
    gates = record.get("accuracy")
    for k, t in record["models"].items():
        g = (gates or {}).get(k)
        ungated = "; not gated (its times could not make it the model kept)" if gates is not None else ""
        acc = ungated if g is None else (
            f"; max abs err {_err(g['max_abs_err'])} vs ORT's own {_err(g['ort_max_abs_err'])}"
            + (f", RMS {_err(g['rms_err'])} vs {_err(g.get('ort_rms_err'))}" if g.get("rms_err") is not None else "")
            + (f" (inputs {g['inputs']})" if g.get("inputs") else "") + ", "
            + ("accurate" if g["passed"] else "LESS ACCURATE than ORT"))
        lines.append(f"  {k}: {_fmt(ModelTimes(**t))}{acc}" + (" <- kept" if k == record["kept"] else ""))
    if record["kept"] == "original":
        lines.append("  kept: the original model (the optimized one was slower)")
    return "\n".join(lines)
