"""`onnxfuse bench`: time models in ONNX Runtime on the same inputs and check they agree.

    onnxfuse bench model.onnx model.opt.onnx --provider cuda --batch 32 --json bench.json

Every model gets the same seeded random inputs, made from the first model's input
signature; dynamic dimensions come from ``--shape`` and ``--batch`` (the leading dimension),
and any other dynamic dimension is 1 (a note on stderr says which). Each model is run
once untimed ("first run", which includes lazy initialization such as cuDNN's algorithm
search or CUDA-graph capture), ``--warmup`` times, then ``--iters`` timed times. Inputs and
outputs are bound once with IO binding on the execution provider's device (OrtValues on the
GPU for ``--provider cuda``, preallocated output buffers in both cases), so no copies are
timed. Every timed call is ``run_with_iobinding`` followed by ``synchronize_outputs`` on a
monotonic clock: on the GPU that is a synchronized wall-clock time, what a caller waits for,
ONNX Runtime's host work included.

The gate: a speedup counts only at equal accuracy, judged against the truth. The
*reference* is the first model, the original, evaluated in float64 on the CPU
(`onnxfuse.reference`: every float tensor widened, onnx's reference evaluator with fast
float64 kernels), before any timing. The first model's timed run, under ONNX Runtime's
defaults (TF32 allowed on CUDA), is the baseline; every later model runs under ORT's
defaults too. Per output, ``ort_err = max|baseline - reference|`` (the original's own error
as ORT runs it) and an element of a later model passes when::

    |actual - reference| <= 2 * ort_err + atol * max|reference| + rtol * |reference|

(`gate_output`; NaN matches NaN, an infinity the same infinity, a NaN or infinity on one side
fails; shapes must be equal and dtypes the first model's; ort_err counts only where it is
finite). A model passes when every output does: it may be no further from the exact result
than twice the original as ORT runs it. Neither run is the truth: ONNX Runtime's CPU
Sigmoid is off by up to 5x below x = -15, where onnxfuse's kernel is within 3e-7, and a gate
that took ORT's output as the reference failed the more accurate model.

When the float64 reference cannot be had (the evaluator lacks an op, e.g. of the
com.microsoft domain; or it differs from the baseline by more than
`onnxfuse.reference.SANITY` of an output's largest value, which points at an op the
evaluator gets wrong), a note says why and the float32 reference is used, as with
``--reference fp32``: on CUDA the first model run once untimed with TF32 off
(``use_tf32`` 0); on the CPU, and with ``--no-tf32`` (every model runs with TF32 off), the
first model's own timed run, with ort_err 0 (a plain isclose). The (rtol, atol) floor per
dtype: float32 1e-5 / 1e-5, float16 1e-2 / 1e-3, bfloat16 2e-2 / 1e-2, float64 1e-7 /
1e-9; other dtypes must be equal. ``--rtol`` / ``--atol`` replace the floor for every dtype,
``--atol`` as an absolute tolerance (not times max|reference|). ``--tf32`` is the default
(kept as a no-op). Exit status: 0 when every output passes, 1 when one does not, 2 on bad
input (unreadable model, unknown input name, a model ONNX Runtime cannot load or run).
``onnxfuse bisect`` names the fused nodes of a model that fails.

A model with ``onnxfuse`` nodes gets the onnxfuse custom-op library registered
(`onnxfuse.runtime`); ``--no-library`` runs their function bodies instead.

JSON (``--json FILE``), schema ``onnxfuse.bench/1.4``; keys are only ever added under a new
minor revision, never renamed (1.1 added ``reference``, ``ort_max_abs_err`` and ``gate_atol``;
1.2 ``settings.reference`` and ``reference.float64``, ``fallback_reason``, ``seconds``; 1.3
``models[].cuda_graph``; 1.4 ``outputs[].rms_err`` and ``ort_rms_err``)::

    {"schema": "onnxfuse.bench/1.4", "date": ISO-8601 UTC, "provider": "cpu" | "cuda",
     "device": str, "versions": {"onnxfuse", "onnxruntime", "onnx", "numpy", "python": str},
     "settings": {"warmup", "iters", "batch", "seed", "cuda_graph", "tf32", "threads", "atol",
                  "rtol", "library", "opt_level", "shapes", "inputs", "provider_options",
                  "reference": "float64" | "fp32"},  # what was asked for (--reference)
     "inputs": [{"name", "dtype", "shape"}],            # what every model was fed
     "batch": int,                                       # samples per run (leading dim of the first input)
     "reference": {"path": str, "tf32": false,           # what later models are gated against
                   "separate_run": bool,                 # true: not the first model's timed run
                   "float64": bool,                      # true: the first model evaluated in float64
                   "fallback_reason": str | null,        # why not, when float64 was asked for
                   "seconds": float | null,              # time to compute the float64 reference
                   "description": str,
                   "ort_max_abs_err": {output: float | null}},  # the first model's timed run vs it
     "models": [{
        "name", "path", "onnxfuse_nodes": int, "library": bool,
        "load_ms", "first_run_ms": float,
        "latency_ms": {"median", "p10", "p90", "min", "max", "mean": float, "iters": int},
        "runs_per_s", "samples_per_s": float,
        "peak_gpu_mem_mb": float | null,                 # CUDA only: device memory in use above
                                                         # the level before the session was made
        "speedup": float,                                # first model's median / this median
        "cuda_graph": bool | null,                       # --cuda-graph: whether it ran under CUDA
                                                         # graphs (false: ONNX Runtime cannot
                                                         # capture it, so it ran without); else null
        "outputs": [{"name", "dtype", "shape", "max_abs_err", "max_rel_err", "atol", "rtol",
                     "mismatches": int, "passed": bool, "note": str | null,
                     "ort_max_abs_err": float | null,    # ort_err of this output
                     "rms_err", "ort_rms_err": float | null,  # root mean square |y - reference|
                                                         # of this model's and of the first
                                                         # model's run (1.4)
                     "gate_atol": float}],               # 2 * ort_err + atol (scaled): the
                                                         # limit is gate_atol + rtol * |reference|
                                                         # [] for the first model
        "passed": bool}],
     "passed": bool}

``max_abs_err`` / ``max_rel_err`` are against the reference; ``max_rel_err`` is taken over
elements whose reference value is not 0; an error that is not finite (a NaN or infinity where
the other side has none) is written as null. ``settings.tf32`` is whether the timed runs
allowed TF32 (false on the CPU). ``dtype`` of an output is the first model's (a float64
reference is compared in float64).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import onnx

from onnxfuse.errors import OnnxfuseError
from onnxfuse.ir import graphs
from onnxfuse.load import read_model
from onnxfuse.outputs import Outputs
from onnxfuse.tools.cuda import CudaDriver
from onnxfuse.tools.feeds import input_files, make_feeds
from onnxfuse.tools.gate import (
    REFERENCES,
    OutputCheck,
    fallback_note,
    float64_reference,
    fmt_err,
    gate_outputs,
    gated,
    max_abs_errors,
    nan_high,
    plausible_float64,
    reference_info,
    reference_settings,
)
from onnxfuse.tools.session import (
    OPT_LEVELS,
    BenchSettings,
    Progress,
    Run,
    cpu_name,
    evaluate_model,
    ort_module,
    require_cuda,
    run_model,
)
from onnxfuse.tools.shapes import (
    Input,
    InputSpec,
    input_dtype,
    parse_assignments,
    parse_shapes,
    resolve_inputs,
    signature,
)
from onnxfuse.version import __version__

SCHEMA = "onnxfuse.bench/1.4"

GATE_HELP = (
    "A speedup counts only at equal accuracy. The reference is the first model (the original) evaluated in "
    "float64 on the CPU (onnx's reference evaluator); every model runs under ONNX Runtime's defaults (TF32 "
    "allowed on CUDA), and a later model passes when every output element satisfies |y - ref| <= 2 * ort_err "
    "+ atol * max|ref| + rtol * |ref|, where ort_err is the first model's own max abs error vs the reference, "
    "so an optimized model may be no further from the exact result than twice the original as ORT runs it. "
    "(rtol, atol) per dtype is the floor (float32 1e-5, 1e-5); --rtol/--atol replace it (--atol absolute). "
    "Where the float64 reference cannot be computed (a note says why), or with --reference fp32, the "
    "reference is the first model run with TF32 off on CUDA, or its own run on the CPU and with --no-tf32 "
    "(ort_err 0).")
SLOW_REFERENCE_S = 10.0  # a float64 reference slower than this is mentioned on stderr
EXIT_MISMATCH = 1

# ---------------------------------------------------------------------------------------
# Settings and results
# ---------------------------------------------------------------------------------------

@dataclass
class Latency:
    median: float
    p10: float
    p90: float
    min: float
    max: float
    mean: float
    iters: int

    @classmethod
    def of(cls, times_ms: list[float]) -> Latency:
        a = np.asarray(times_ms, dtype=np.float64)
        p10, p50, p90 = np.percentile(a, [10, 50, 90])
        return cls(float(p50), float(p10), float(p90), float(a.min()), float(a.max()), float(a.mean()), len(a))


@dataclass
class ModelResult:
    name: str
    path: str
    onnxfuse_nodes: int
    library: bool
    load_ms: float
    first_run_ms: float
    latency_ms: Latency
    runs_per_s: float
    samples_per_s: float
    peak_gpu_mem_mb: float | None
    speedup: float
    outputs: list[OutputCheck]
    passed: bool
    cuda_graph: bool | None = None  # --cuda-graph: under CUDA graphs, or false when it cannot be captured


@dataclass
class BenchReport:
    date: str
    provider: str
    device: str
    versions: dict[str, str]
    settings: dict
    inputs: list[InputSpec]
    batch: int
    models: list[ModelResult]
    passed: bool
    reference: dict = field(default_factory=dict)   # see the module docstring
    schema: str = SCHEMA

    def to_dict(self) -> dict:
        d = asdict(self)
        d["inputs"] = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape)} for i in self.inputs]
        order = ["schema", "date", "provider", "device", "versions", "settings", "inputs", "batch", "reference",
                 "models", "passed"]
        return _finite({k: d[k] for k in order})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def failures(self) -> list[str]:
        """One line per output that did not pass."""
        lines = []
        for m in self.models:
            for o in m.outputs:
                if not o.passed:
                    lines.append(f"{m.path}: output {o.name!r}: {o.failure()}")
        return lines

    # ---- tables ----
    COLUMNS = ("model", "fused", "load ms", "first ms", "median ms", "p10 ms", "p90 ms", "min ms", "samples/s",
               "peak MB", "speedup", "err vs ref", "ORT err vs ref", "gate")

    def rows(self) -> list[list[str]]:
        rows = []
        ort_errs = list(self.reference.get("ort_max_abs_err", {}).values())
        ort_max = fmt_err(max(ort_errs, default=0.0, key=nan_high))
        for i, m in enumerate(self.models):
            ort_e = ort_max
            if i == 0 and self.reference.get("separate_run"):
                abs_e, check = ort_max, "baseline"
            elif i == 0:
                abs_e = ort_e = "-"
                check = "reference"
            else:
                abs_e = fmt_err(max((o.max_abs_err for o in m.outputs), default=0.0, key=nan_high))
                check = "ok" if m.passed else "FAIL"
            lat = m.latency_ms
            name = m.name + (" (no graph)" if m.cuda_graph is False else "")
            rows.append([name, str(m.onnxfuse_nodes) + (" (lib)" if m.library else ""), f"{m.load_ms:.1f}",
                         f"{m.first_run_ms:.3f}", f"{lat.median:.3f}", f"{lat.p10:.3f}", f"{lat.p90:.3f}",
                         f"{lat.min:.3f}", f"{m.samples_per_s:.1f}",
                         "-" if m.peak_gpu_mem_mb is None else f"{m.peak_gpu_mem_mb:.0f}",
                         f"{m.speedup:.2f}x", abs_e, ort_e, check])
        return rows

    def caption(self) -> str:
        s = self.settings
        ins = ", ".join(f"{i.name} {i.dtype}[{'x'.join(map(str, i.shape))}]" for i in self.inputs)
        graph = ", CUDA graph" if s.get("cuda_graph") else ""
        tf32 = ", TF32 allowed (ORT's default)" if s.get("tf32") else (", TF32 off" if self.provider == "cuda" else "")
        ref = self.reference.get("description")
        return (f"{self.device} ({self.provider}{graph}{tf32}), onnxruntime {self.versions['onnxruntime']}, "
                f"onnxfuse {self.versions['onnxfuse']}, {self.date}; inputs {ins}; "
                f"{s['warmup']} warmup + {s['iters']} timed runs" + (f"; reference: {ref}" if ref else ""))

    def plain(self) -> str:
        rows = [list(self.COLUMNS)] + self.rows()
        widths = [max(len(r[c]) for r in rows) for c in range(len(self.COLUMNS))]
        lines = [self.caption()]
        for k, r in enumerate(rows):
            cells = zip(r, widths, strict=True)
            lines.append("  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(cells)))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [self.caption(), "", "| " + " | ".join(self.COLUMNS) + " |",
                 "|" + "|".join("---" for _ in self.COLUMNS) + "|"]
        lines += ["| " + " | ".join(v.replace("|", "\\|") for v in r) + " |" for r in self.rows()]
        return "\n".join(lines) + "\n"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def count_onnxfuse_nodes(model: Any) -> int:
    """Nodes in domain onnxfuse, in the graph and its subgraphs."""
    return sum(node.domain == "onnxfuse" for g in graphs(model.graph) for node in g.node)


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------

def bench(paths: list[str], settings: BenchSettings, stream: TextIO | None = None,
          notes: TextIO | None = None) -> BenchReport:
    """Run every model on the same inputs; time them and gate every later model's outputs
    against the reference (the module docstring says which run that is)."""
    validate(settings)
    ort = ort_module()
    if settings.provider == "cuda":
        require_cuda()
    notes = notes if notes is not None else sys.stderr
    models = [read_model(p) for p in paths]
    sig = signature(models[0])
    specs, defaulted = resolve_inputs(sig, settings.shapes, settings.batch, paths[0], settings.inputs)
    for p, m in zip(paths[1:], models[1:], strict=True):
        check_same_inputs(p, signature(m), specs, paths[0])
    for text in defaulted:
        print(f"note: {text}", file=notes)
    fused_counts = [count_onnxfuse_nodes(m) for m in models]
    del models
    feeds = make_feeds(specs, settings.seed, settings.inputs)
    batch = specs[0].shape[0] if specs and specs[0].shape else 1

    gpu = CudaDriver(settings.device_id) if settings.provider == "cuda" else None
    device = (gpu.name() if gpu else None) or (f"CUDA device {settings.device_id}" if gpu else cpu_name())
    names = _display_names(paths)
    results: list[ModelResult] = []
    reference: dict[str, np.ndarray] = {}
    baseline: dict[str, np.ndarray] | None = None   # the first model's timed run when it is not the reference
    ref64, why_not, ref_seconds = float64_reference(paths[0], feeds, settings)
    if ref_seconds is not None and ref_seconds > SLOW_REFERENCE_S:
        print(f"note: the float64 reference took {ref_seconds:.0f} s on the CPU (--reference fp32 skips it)",
              file=notes)
    try:
        for i, (path, name) in enumerate(zip(paths, names, strict=True)):
            library = settings.library and fused_counts[i] > 0
            if i == 0 and ref64 is None and gated(settings):
                reference = evaluate_model(path, feeds, reference_settings(settings), library)
            progress = Progress(f"{name}", settings.warmup + settings.iters, stream=stream)
            r, graph = run_timed(path, name, feeds, settings, library, progress, gpu, notes)
            lat = Latency.of(r.times_ms)
            checks: list[OutputCheck] = []
            if i == 0:
                ref64, why_not = plausible_float64(ref64, r.outputs, why_not)
                if why_not:
                    print(f"note: {fallback_note(path, settings, why_not)}", file=notes)
                if ref64 is not None:
                    reference, baseline = ref64, r.outputs
                elif gated(settings):
                    if not reference:  # the float64 reference was computed, and looked wrong
                        reference = evaluate_model(path, feeds, reference_settings(settings), library)
                    baseline = r.outputs
                else:
                    reference = r.outputs
            else:
                checks = gate_outputs(reference, baseline, r.outputs, settings.rtol, settings.atol)
            first_median = results[0].latency_ms.median if results else lat.median
            results.append(ModelResult(
                name=name, path=str(path), onnxfuse_nodes=fused_counts[i], library=library,
                load_ms=r.load_ms, first_run_ms=r.first_run_ms, latency_ms=lat,
                runs_per_s=1e3 / lat.median if lat.median > 0 else 0.0,
                samples_per_s=batch * 1e3 / lat.median if lat.median > 0 else 0.0,
                peak_gpu_mem_mb=r.peak_gpu_mem_mb,
                speedup=first_median / lat.median if lat.median > 0 else 0.0,
                outputs=checks, passed=all(c.passed for c in checks), cuda_graph=graph))
    finally:
        if gpu is not None:
            gpu.close()
    ort_errors = max_abs_errors(reference, baseline) if baseline is not None else {n: 0.0 for n in reference}
    return BenchReport(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        provider=settings.provider, device=device,
        versions={"onnxfuse": __version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
                  "numpy": np.__version__, "python": platform.python_version()},
        settings=settings.to_dict(), inputs=specs, batch=int(batch), models=results,
        passed=all(m.passed for m in results),
        reference=reference_info(paths[0], settings, ort_errors, float64=ref64 is not None, fallback_reason=why_not,
                                 seconds=ref_seconds if ref64 is not None else None))


def run_timed(path: str, name: str, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
              progress: Progress, gpu: CudaDriver | None, notes: TextIO, run=None) -> tuple[Run, bool | None]:
    """`run_model` of one model, and whether it ran under CUDA graphs (None: not asked). With
    --cuda-graph, a model that ONNX Runtime cannot capture (an exported model's shape
    arithmetic on the CPU: the original of `optimize --shape`) but that runs plainly is timed
    without graphs, with a note, so the models after it are still compared; one that does
    not run at all is the error it was."""
    run = run or run_model
    try:
        return run(path, feeds, settings, library, progress, gpu), (True if settings.cuda_graph else None)
    except OnnxfuseError as e:
        if not settings.cuda_graph:
            raise
        plain = dataclasses.replace(settings, cuda_graph=False)
        try:
            r = run(path, feeds, plain, library, progress, gpu)
        except OnnxfuseError:
            raise e from None
        why = str(e).strip().splitlines()[0] if str(e).strip() else "cannot capture"
        print(f"note: {name}: ran without CUDA graphs, as ONNX Runtime cannot capture it ({why})", file=notes)
        return r, False


def validate(s: BenchSettings) -> None:
    if s.provider not in ("cpu", "cuda"):
        raise OnnxfuseError(f"--provider {s.provider}: choose cpu or cuda")
    if s.iters < 1:
        raise OnnxfuseError("--iters must be at least 1")
    if s.warmup < 0:
        raise OnnxfuseError("--warmup must be 0 or more")
    if s.batch is not None and s.batch < 1:
        raise OnnxfuseError("--batch must be at least 1")
    if s.threads is not None and s.threads < 0:
        raise OnnxfuseError("--threads must be 0 (ORT's default) or more")
    if s.cuda_graph and s.provider != "cuda":
        raise OnnxfuseError("--cuda-graph needs --provider cuda")
    if s.opt_level not in OPT_LEVELS:
        raise OnnxfuseError(f"--opt-level {s.opt_level}: choose from {', '.join(OPT_LEVELS)}")
    for v, what in ((s.atol, "--atol"), (s.rtol, "--rtol")):
        if v is not None and not (v >= 0):
            raise OnnxfuseError(f"{what} must be 0 or more")
    if s.reference not in REFERENCES:
        raise OnnxfuseError(f"--reference {s.reference}: choose float64 or fp32")
    if "use_tf32" in s.provider_options:
        raise OnnxfuseError("provider option use_tf32: use the tf32 setting (--tf32 / --no-tf32)")


def check_same_inputs(path: str, sig: list[Input], specs: list[InputSpec], first: str) -> None:
    want = {s.name: s for s in specs}
    have = {i.name: i for i in sig}
    if set(have) != set(want):
        extra = sorted(set(have) - set(want))
        lost = sorted(set(want) - set(have))
        what = f"has input {extra[0]!r}" if extra else f"lacks input {lost[0]!r}"
        raise OnnxfuseError(f"{path}: {what}; every model must have the inputs of {first}")
    for name, inp in have.items():
        s = want[name]
        dtype = input_dtype(inp) or "unsupported"
        if dtype != s.dtype:
            raise OnnxfuseError(f"{path}: input {name!r} is {dtype}, in {first} it is {s.dtype}")
        if len(inp.dims) != len(s.shape) or any(
                isinstance(d, int) and d != g for d, g in zip(inp.dims, s.shape, strict=True)):
            dims = "x".join("?" if not isinstance(d, int) else str(d) for d in inp.dims)
            raise OnnxfuseError(f"{path}: input {name!r} has shape {dims}, cannot take {'x'.join(map(str, s.shape))}")


def _display_names(paths: list[str]) -> list[str]:
    names = [Path(p).name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]


# ---------------------------------------------------------------------------------------
# Command line (the arguments: onnxfuse.cli)
# ---------------------------------------------------------------------------------------

def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    provider = args.provider
    if provider is None:
        provider = "cuda" if "CUDAExecutionProvider" in ort_module().get_available_providers() else "cpu"
    shapes = parse_shapes(args.shape)
    defaults = BenchSettings()
    return BenchSettings(
        provider=provider, shapes=shapes, inputs=parse_assignments(args.input, "--input"), batch=args.batch,
        warmup=getattr(args, "warmup", defaults.warmup), iters=getattr(args, "iters", defaults.iters),
        cuda_graph=getattr(args, "cuda_graph", False), tf32=args.tf32, atol=args.atol, rtol=args.rtol,
        seed=args.seed, threads=args.threads, library=not args.no_library, opt_level=args.opt_level,
        reference=getattr(args, "reference", "float64"))


def run_cli(args: argparse.Namespace) -> int:
    """The `onnxfuse bench` command: write files, print the table, return the exit status."""
    markdown_file = args.markdown if args.markdown not in (None, "-") else None
    with Outputs([args.json, markdown_file], [*args.models, *input_files(args.input)]) as out:
        settings = settings_from_args(args)
        report = bench(args.models, settings)
        if markdown_file:
            out.text(markdown_file, report.markdown())
        if args.json:
            out.text(args.json, report.to_json())
        out.commit()  # before printing: a reader that stops early (| head) loses no file
    if args.markdown == "-":
        print(report.markdown(), end="")
    else:
        print(_table(report))
    failures = report.failures()
    for line in failures:
        print(f"onnxfuse: mismatch: {line}", file=sys.stderr)
    return EXIT_MISMATCH if failures else 0


def _table(report: BenchReport) -> str:
    try:
        if not sys.stdout.isatty():
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return report.plain()
    table = Table(title=report.caption(), title_justify="left")
    for c, col in enumerate(report.COLUMNS):
        table.add_column(col, justify="left" if c == 0 else "right")
    for row in report.rows():
        table.add_row(*row, style="red" if row[-1] == "FAIL" else None)
    # Never narrower than the table (rich would truncate cells): a narrow terminal wraps lines.
    need = max(len(line) for line in report.plain().splitlines()[1:]) + 3 * len(report.COLUMNS) + 2
    console = Console(width=max(need, Console().width))
    with console.capture() as cap:
        console.print(table)
    return cap.get().rstrip("\n")
