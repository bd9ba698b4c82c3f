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

JSON (``--json FILE``), schema ``onnxfuse.bench/1.2``; keys are only ever added under a new
minor revision, never renamed (1.1 added ``reference``, ``ort_max_abs_err`` and ``gate_atol``;
1.2 ``settings.reference`` and ``reference.float64``, ``fallback_reason``, ``seconds``)::

    {"schema": "onnxfuse.bench/1.2", "date": ISO-8601 UTC, "provider": "cpu" | "cuda",
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
        "outputs": [{"name", "dtype", "shape", "max_abs_err", "max_rel_err", "atol", "rtol",
                     "mismatches": int, "passed": bool, "note": str | null,
                     "ort_max_abs_err": float | null,    # ort_err of this output
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
import ctypes
import datetime
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from onnxfuse.errors import OnnxfuseError

SCHEMA = "onnxfuse.bench/1.2"

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
REFERENCES = ("float64", "fp32")
SLOW_REFERENCE_S = 10.0  # a float64 reference slower than this is mentioned on stderr
EXIT_MISMATCH = 1

# (rtol, atol) per output dtype; dtypes not listed must match exactly.
# (rtol, atol) per dtype. By default atol is relative to the output's scale: the absolute
# tolerance is atol x max|expected| (finite values). Convolutions and matmuls summed in
# another order differ by a few ulps of their *largest* values, so on elements near zero an
# absolute 1e-6 failed the same fp32 computation (vgg_stack, CPU library vs MLAS: 1.5e-5 on
# outputs up to ~20). `--atol` gives an absolute tolerance instead.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5), "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2), "float64": (1e-7, 1e-9),
}
OPT_LEVELS = ("disable", "basic", "extended", "all")

# ONNX TensorProto element types bench can feed, as numpy dtypes.
_NP_OF_ONNX = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
               9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
_ONNX_TYPE_NAMES = {0: "undefined", 8: "string", 14: "complex64", 15: "complex128", 16: "bfloat16"}


# ---------------------------------------------------------------------------------------
# Settings and results
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchSettings:
    provider: str = "cpu"                                 # "cpu" or "cuda"
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input or dim name -> dims
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> .npy file or a number
    batch: int | None = None
    warmup: int = 10
    iters: int = 100
    cuda_graph: bool = False
    atol: float | None = None
    rtol: float | None = None
    seed: int = 0
    threads: int | None = None                            # intra-op threads (ORT default when None)
    library: bool = True                                  # register it for models with onnxfuse nodes
    opt_level: str = "all"
    device_id: int = 0
    tf32: bool = True                                     # CUDA: let MatMul/Conv use TF32 (ORT's default);
                                                          # bench() then gates against a TF32-off run
    provider_options: dict[str, str] = field(default_factory=dict)  # extra CUDA EP options
    reference: str = "float64"                            # "float64" or "fp32" (module docstring)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["library"] = "auto" if self.library else "off"
        d["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        d["tf32"] = self.tf32 and self.provider == "cuda"
        del d["provider"], d["device_id"]
        return d


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


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
class OutputCheck:
    name: str
    dtype: str
    shape: list[int]
    max_abs_err: float | None
    max_rel_err: float | None
    atol: float
    rtol: float
    mismatches: int
    passed: bool
    note: str | None = None
    ort_max_abs_err: float | None = 0.0   # the original under ORT's defaults vs the reference
    gate_atol: float = 0.0                # 2 * ort_err + atol

    def failure(self) -> str:
        """Why this output fails the gate, in one line."""
        if self.note:
            return self.note
        ort = "" if self.ort_max_abs_err == 0.0 else f" (ORT's own: {_num(self.ort_max_abs_err)})"
        return (f"max abs err vs the reference {_num(self.max_abs_err)}{ort}, max rel err {_num(self.max_rel_err)}; "
                f"{self.mismatches} elements outside {self.gate_atol:.3g} + rtol {self.rtol:g} * |reference|")


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
        ort_max = _num(max(ort_errs, default=0.0, key=_nan_high))
        for i, m in enumerate(self.models):
            ort_e = ort_max
            if i == 0 and self.reference.get("separate_run"):
                abs_e, check = ort_max, "baseline"
            elif i == 0:
                abs_e = ort_e = "-"
                check = "reference"
            else:
                abs_e = _num(max((o.max_abs_err for o in m.outputs), default=0.0, key=_nan_high))
                check = "ok" if m.passed else "FAIL"
            lat = m.latency_ms
            rows.append([m.name, str(m.onnxfuse_nodes) + (" (lib)" if m.library else ""), f"{m.load_ms:.1f}",
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


def _num(v: float | None) -> str:
    return "nan/inf" if v is None else f"{v:.3g}"


def _nan_high(v: float | None) -> float:
    return float("inf") if v is None else v


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------
# Comparing outputs
# ---------------------------------------------------------------------------------------

def tolerance(dtype: np.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for an output dtype: the defaults, replaced by the ones given."""
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(np.dtype(dtype).name, (0.0, 0.0))
    return (d_rtol if rtol is None else rtol), (d_atol if atol is None else atol)


def compare_output(name: str, expected: np.ndarray | None, actual: np.ndarray | None,
                   rtol: float | None = None, atol: float | None = None) -> OutputCheck:
    """Check one output against a reference that is also the baseline: the gate with ort_err 0
    (an isclose with per-dtype tolerances)."""
    return gate_output(name, expected, None, actual, rtol, atol)


def gate_output(name: str, ref: np.ndarray | None, ort: np.ndarray | None, actual: np.ndarray | None,
                rtol: float | None = None, atol: float | None = None) -> OutputCheck:
    """The gate on one output: `actual` passes when every element has
    |actual - ref| <= 2 * ort_err + atol + rtol * |ref|, ort_err = max|ort - ref| (finite
    differences only; 0 when `ort` is None: the reference is the baseline itself), (rtol, atol)
    the dtype's floor (`tolerance`) with atol times max|ref| unless `atol` is given. NaN
    matches NaN and an infinity the same infinity; shapes must be equal. `ref` may be a
    float64 reference of a float output (`onnxfuse.reference`): the output's dtype, the one
    `actual` must have and whose floor applies, is then `ort`'s (`actual`'s without `ort`)."""
    base_arr = ref if ref is not None else actual
    for run in (ort, actual):
        if ref is not None and run is not None and _widened(ref.dtype, run.dtype):
            base_arr = run
            break
    assert base_arr is not None
    r, a = tolerance(base_arr.dtype, rtol, atol)
    if atol is None and ref is not None and ref.size and np.issubdtype(ref.dtype, np.floating):
        finite = np.abs(ref[np.isfinite(ref)].astype(np.float64))
        a = a * float(finite.max()) if finite.size else a  # scaled to the output (DEFAULT_TOLERANCES)
    base = dict(name=name, dtype=np.dtype(base_arr.dtype).name, shape=list(base_arr.shape), atol=a, rtol=r,
                gate_atol=a)
    if ref is None:
        return OutputCheck(**base, max_abs_err=None, max_rel_err=None, mismatches=0, passed=False,
                           note="not an output of the first model")
    fail = dict(max_abs_err=None, max_rel_err=None, mismatches=int(ref.size), passed=False)
    if actual is None:
        return OutputCheck(**base, **fail, note="missing from this model's outputs")
    if actual.dtype != base_arr.dtype:
        return OutputCheck(**base, **fail,
                           note=f"dtype {actual.dtype} differs from the first model's {base_arr.dtype}")
    if actual.shape != ref.shape:
        return OutputCheck(**base, **fail,
                           note=f"shape {list(actual.shape)} differs from the first model's {list(ref.shape)}")
    ort_err: float | None = 0.0
    slack = 0.0
    if ort is not None:
        if not (ort.dtype == ref.dtype or _widened(ref.dtype, ort.dtype)) or ort.shape != ref.shape:
            return OutputCheck(**base, **fail, note="the first model's timed run differs from the reference in "
                                                    f"dtype or shape ({ort.dtype}{list(ort.shape)})")
        ort_diff = _abs_diff(ref, ort)
        finite = ort_diff[np.isfinite(ort_diff)]
        slack = float(finite.max()) if finite.size else 0.0
        ort_err = float(ort_diff.max()) if ort_diff.size else 0.0
        ort_err = ort_err if np.isfinite(ort_err) else None
    base.update(gate_atol=2 * slack + a, ort_max_abs_err=ort_err)
    if ref.size == 0:
        return OutputCheck(**base, max_abs_err=0.0, max_rel_err=0.0, mismatches=0, passed=True)
    e = ref.astype(np.float64)
    diff = _abs_diff(ref, actual)
    with np.errstate(invalid="ignore", over="ignore"):
        bad = (diff > base["gate_atol"] + r * np.abs(e)) | np.isinf(diff)
        nz = (e != 0) & np.isfinite(e)
        rel = diff[nz] / np.abs(e[nz])
    max_abs = float(diff.max())
    max_rel = float(rel.max()) if rel.size else 0.0
    n_bad = int(bad.sum())
    return OutputCheck(**base, max_abs_err=max_abs if np.isfinite(max_abs) else None,
                       max_rel_err=max_rel if np.isfinite(max_rel) else None, mismatches=n_bad, passed=n_bad == 0)


def _widened(ref: np.dtype, dtype: np.dtype) -> bool:
    """Whether `ref` is the float64 reference of an output of float dtype `dtype`."""
    return ref == np.float64 and dtype != np.float64 and np.dtype(dtype).kind == "f"


def _abs_diff(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|x - ref| in float64: 0 where both are NaN or the same infinity, inf where only one
    side is NaN or the infinities differ."""
    e = ref.astype(np.float64)
    v = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(v - e)
        diff[(v == e) | (np.isnan(v) & np.isnan(e))] = 0.0
        diff[np.isnan(diff)] = np.inf
    return diff


def gate_outputs(ref: dict[str, np.ndarray], ort: dict[str, np.ndarray] | None, outputs: dict[str, np.ndarray],
                 rtol: float | None = None, atol: float | None = None) -> list[OutputCheck]:
    """`gate_output` on every output of the reference, by name; an output the reference does
    not have is listed and passes (optimizers may expose more)."""
    checks = [gate_output(n, ref[n], None if ort is None else ort.get(n), outputs.get(n), rtol, atol)
              for n in ref]
    for n, a in outputs.items():
        if n not in ref:
            extra = gate_output(n, None, None, a)
            extra.passed = True
            checks.append(extra)
    return checks


def max_abs_errors(ref: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, float | None]:
    """max|y - ref| per output of the reference (None: not finite, or missing or mismatched)."""
    out: dict[str, float | None] = {}
    for n, e in ref.items():
        y = outputs.get(n)
        if y is None or y.shape != e.shape or not (y.dtype == e.dtype or _widened(e.dtype, y.dtype)):
            out[n] = None
            continue
        m = float(_abs_diff(e, y).max()) if e.size else 0.0
        out[n] = m if np.isfinite(m) else None
    return out


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Input:
    name: str
    elem_type: int
    dims: tuple[int | str | None, ...]   # int (static), str (dim_param) or None (unknown)


def _read_model(path: str) -> Any:
    from onnxfuse.load import read_model

    return read_model(path)


def _signature(model: Any) -> list[_Input]:
    init = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in init:
            continue
        tt = vi.type.tensor_type
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append(None)
        out.append(_Input(vi.name, tt.elem_type, tuple(dims)))
    return out


def count_onnxfuse_nodes(model: Any) -> int:
    """Nodes in domain onnxfuse, in the graph and its subgraphs."""
    def walk(graph) -> int:
        n = 0
        for node in graph.node:
            n += node.domain == "onnxfuse"
            for a in node.attribute:
                if a.g.node:
                    n += walk(a.g)
                for g in a.graphs:
                    n += walk(g)
        return n

    return walk(model.graph)


def parse_dims(text: str) -> tuple[int, ...]:
    """'1x3x224x224', '1,3,224,224', '[1,3,224,224]' or '32' -> a tuple of dims."""
    t = text.strip().strip("[]()")
    parts = [p for p in t.replace("x", ",").replace("X", ",").split(",") if p.strip() != ""] if t else []
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise OnnxfuseError(f"bad dimensions {text!r}: expected e.g. 1x3x224x224") from None
    if any(d < 0 for d in dims):
        raise OnnxfuseError(f"bad dimensions {text!r}: negative size")
    return dims


def parse_assignments(items: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise OnnxfuseError(f"{what} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def resolve_inputs(sig: list[_Input], settings: BenchSettings, where: str) -> tuple[list[InputSpec], list[str]]:
    """Concrete shapes for every input, and notes about dimensions set by default."""
    names = {i.name for i in sig}
    params = {d for i in sig for d in i.dims if isinstance(d, str)}
    for key, dims in settings.shapes.items():
        if key not in names and key not in params:
            raise OnnxfuseError(f"--shape {key}: {where} has no input or dimension named {key!r} "
                                f"(inputs: {', '.join(sorted(names)) or 'none'})")
        if key not in names and len(dims) != 1:
            raise OnnxfuseError(f"--shape {key}: a named dimension takes one size, got {'x'.join(map(str, dims))}")
    for key in settings.inputs:
        if key not in names:
            raise OnnxfuseError(f"--input {key}: {where} has no input named {key!r} "
                                f"(inputs: {', '.join(sorted(names)) or 'none'})")
    specs, notes = [], []
    for inp in sig:
        if inp.elem_type not in _NP_OF_ONNX:
            tname = _ONNX_TYPE_NAMES.get(inp.elem_type, str(inp.elem_type))
            raise OnnxfuseError(f"{where}: input {inp.name!r} has type {tname}, which bench cannot generate")
        dtype = np.dtype(_NP_OF_ONNX[inp.elem_type]).name
        if inp.name in settings.shapes:
            shape = settings.shapes[inp.name]
            if len(shape) != len(inp.dims):
                raise OnnxfuseError(f"--shape {inp.name}: {len(shape)} dims given, the input has {len(inp.dims)}")
            for k, (given, declared) in enumerate(zip(shape, inp.dims, strict=True)):
                if isinstance(declared, int) and given != declared:
                    raise OnnxfuseError(f"--shape {inp.name}: dim {k} is {declared} in the model, {given} given")
            specs.append(InputSpec(inp.name, dtype, tuple(shape)))
            continue
        shape = []
        for k, d in enumerate(inp.dims):
            if isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d in settings.shapes:
                shape.append(settings.shapes[d][0])
            elif k == 0:
                shape.append(settings.batch or 1)
                if settings.batch is None:
                    notes.append(f"input {inp.name!r}: leading dim {d or '?'!s} set to 1 (--batch N to change)")
            else:
                shape.append(1)
                notes.append(f"input {inp.name!r}: dim {k} ({d or 'unnamed'}) set to 1 "
                             f"(--shape {inp.name}=... or --shape {d or 'NAME'}=N to change)")
        specs.append(InputSpec(inp.name, dtype, tuple(shape)))
    return specs, notes


def make_feeds(specs: list[InputSpec], settings: BenchSettings) -> dict[str, np.ndarray]:
    """Seeded random inputs: floats N(0, 1), integers in [0, 10), booleans fair coins;
    --input NAME=FILE.npy or NAME=NUMBER where given."""
    rng = np.random.default_rng(settings.seed)
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        dtype = np.dtype(s.dtype)
        given = settings.inputs.get(s.name)
        if given is not None:
            feeds[s.name] = _given_input(s, given)
            continue
        if dtype.kind == "f":
            a = rng.standard_normal(s.shape).astype(dtype)
        elif dtype.kind in "iu":
            a = rng.integers(0, 10, size=s.shape).astype(dtype)
        else:
            a = rng.random(s.shape) < 0.5
        feeds[s.name] = np.ascontiguousarray(a)
    return feeds


def _given_input(spec: InputSpec, value: str) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    if value.endswith(".npy"):
        from onnxfuse.files import record_read

        record_read(value)
        try:
            a = np.load(value, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise OnnxfuseError(f"--input {spec.name}: cannot read {value} ({e})") from None
        if a.dtype != dtype:
            raise OnnxfuseError(f"--input {spec.name}: {value} holds {a.dtype}, the input is {dtype}")
        return np.ascontiguousarray(a)
    try:
        number = float(value) if dtype.kind == "f" else int(value)
    except ValueError:
        raise OnnxfuseError(f"--input {spec.name}={value}: expected a number or a .npy file") from None
    return np.full(spec.shape, number, dtype=dtype)


# ---------------------------------------------------------------------------------------
# GPU helpers: the CUDA driver API through ctypes (no torch, no CUDA toolkit)
# ---------------------------------------------------------------------------------------

class CudaDriver:
    """Device name and memory in use (cuMemGetInfo) in the device's primary context, the one
    ONNX Runtime uses. Every method returns None when libcuda is unavailable."""

    def __init__(self, device_id: int = 0):
        self.ok = False
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
            self.dev = ctypes.c_int()
            self.ctx = ctypes.c_void_p()
            self._check(self.lib.cuInit(0))
            self._check(self.lib.cuDeviceGet(ctypes.byref(self.dev), device_id))
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev))
            self.ok = True
        except (OSError, AttributeError, RuntimeError):
            pass

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"CUDA driver error {status}")

    def name(self) -> str | None:
        if not self.ok:
            return None
        buf = ctypes.create_string_buffer(256)
        if self.lib.cuDeviceGetName(buf, 256, self.dev) != 0:
            return None
        return buf.value.decode(errors="replace")

    def used_bytes(self) -> int | None:
        if not self.ok:
            return None
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        old = ctypes.c_void_p()
        if self.lib.cuCtxPushCurrent_v2(self.ctx) != 0:
            return None
        try:
            if self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
                return None
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(old))
        return total.value - free.value

    def close(self) -> None:
        if self.ok:
            self.lib.cuDevicePrimaryCtxRelease_v2(self.dev)
            self.ok = False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on a terminal, shown once a model has taken `delay` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, delay: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.total, self.delay, self.clock = label, max(total, 1), delay, clock
        self.start = clock()
        self.last = -1.0
        self.drawn = 0

    def update(self, done: int, what: str = "") -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.start < self.delay or (now - self.last < 0.1 and done < self.total):
            return
        self.last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * 24)
        text = f"\r{self.label} [{bar:<24}] {done}/{self.total} {what} {now - self.start:.1f} s"
        self.stream.write(text.ljust(self.drawn))
        self.stream.flush()
        self.drawn = len(text)

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * self.drawn + "\r")
            self.stream.flush()
            self.drawn = 0


# ---------------------------------------------------------------------------------------
# Running one model
# ---------------------------------------------------------------------------------------

@dataclass
class _Run:
    load_ms: float
    first_run_ms: float
    times_ms: list[float]
    outputs: dict[str, np.ndarray]
    peak_gpu_mem_mb: float | None


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise OnnxfuseError("bench needs ONNX Runtime: pip install 'onnxfuse[cpu]' or 'onnxfuse[gpu]'") from None
    return ort


def _session_options(settings: BenchSettings, library: bool) -> Any:
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[settings.opt_level]
    if settings.threads:
        so.intra_op_num_threads = settings.threads
    if library:
        from onnxfuse import runtime

        runtime.session_options(so)
    return so


def _providers(settings: BenchSettings, cuda_graph: bool) -> list:
    if settings.provider != "cuda":
        return ["CPUExecutionProvider"]
    opts = {"device_id": str(settings.device_id), "use_tf32": "1" if settings.tf32 else "0",
            **settings.provider_options}
    if cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:400]


class BoundModel:
    """One model in an ONNX Runtime session, inputs and outputs bound on the provider's
    device once (IO binding: no copies are timed), run once (`first_ms`): ready for timed
    runs. Several can be open at once, so that their timed runs interleave (onnxfuse.tune)."""

    def __init__(self, path: str, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
                 gpu: CudaDriver | None = None):
        ort = _ort()
        cuda = settings.provider == "cuda"
        device = "cuda" if cuda else "cpu"
        dev_id = settings.device_id if cuda else 0
        self.path, self.gpu = path, gpu
        self.mem = [gpu.used_bytes()] if gpu is not None else []
        try:
            shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
            if settings.cuda_graph:
                # CUDA graphs need outputs bound to fixed buffers before the first (capturing) run:
                # learn their shapes from a session without graphs.
                probe = ort.InferenceSession(path, _session_options(settings, library),
                                             providers=_providers(settings, False))
                arrays = probe.run(None, feeds)
                shapes = {o.name: (a.shape, a.dtype) for o, a in zip(probe.get_outputs(), arrays, strict=True)}
                del probe, arrays
                gc.collect()
            t0 = time.perf_counter()
            self.sess = sess = ort.InferenceSession(path, _session_options(settings, library),
                                                    providers=_providers(settings, settings.cuda_graph))
            self.load_ms = (time.perf_counter() - t0) * 1e3
        except OnnxfuseError:
            raise
        except Exception as e:  # onnxruntime raises several exception types
            raise OnnxfuseError(f"{path}: onnxruntime cannot load it: {_first_line(e)}") from None
        self._note_memory()
        names_in = [i.name for i in sess.get_inputs()]
        missing = [n for n in names_in if n not in feeds]
        if missing:
            raise OnnxfuseError(f"{path}: input {missing[0]!r} is not an input of the first model")
        self.out_names = out_names = [o.name for o in sess.get_outputs()]
        try:
            self.values = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n], device, dev_id) for n in names_in}
            self.binding = binding = sess.io_binding()
            for n in names_in:
                binding.bind_ortvalue_input(n, self.values[n])
            self.outs: dict[str, Any] = {}
            if shapes is None:
                # First run with outputs allocated by ORT on the device; then fixed buffers.
                for n in out_names:
                    binding.bind_output(n, device, dev_id)
                t0 = time.perf_counter()
                sess.run_with_iobinding(binding)
                binding.synchronize_outputs()
                self.first_ms = (time.perf_counter() - t0) * 1e3
                first = binding.copy_outputs_to_cpu()
                shapes = {n: (a.shape, a.dtype) for n, a in zip(out_names, first, strict=True)}
                del first
                binding.clear_binding_outputs()
                _bind_outputs(ort, binding, out_names, shapes, device, dev_id, self.outs)
            else:
                _bind_outputs(ort, binding, out_names, shapes, device, dev_id, self.outs)
                t0 = time.perf_counter()
                sess.run_with_iobinding(binding)
                binding.synchronize_outputs()
                self.first_ms = (time.perf_counter() - t0) * 1e3
        except OnnxfuseError:
            raise
        except Exception as e:
            raise OnnxfuseError(f"{path}: onnxruntime failed to run it: {_first_line(e)}") from None
        self._note_memory()

    def _note_memory(self) -> None:
        if self.gpu is not None:
            self.mem.append(self.gpu.used_bytes())

    def time(self, n: int, progress: Progress | None = None, stage: str = "timed", done: int = 0) -> list[float]:
        """Milliseconds of each of n runs, each waited for (synchronized wall clock)."""
        run, sync, binding = self.sess.run_with_iobinding, self.binding.synchronize_outputs, self.binding
        clock = time.perf_counter
        times = [0.0] * n
        try:
            for i in range(n):
                t0 = clock()
                run(binding)
                sync()
                times[i] = (clock() - t0) * 1e3
                if progress is not None:
                    progress.update(done + i + 1, stage)
        except Exception as e:
            raise OnnxfuseError(f"{self.path}: onnxruntime failed to run it: {_first_line(e)}") from None
        return times

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(zip(self.out_names, self.binding.copy_outputs_to_cpu(), strict=True))

    def peak_mb(self) -> float | None:
        """Device memory in use above the level before the session was made (CUDA only)."""
        self._note_memory()
        if not self.mem or None in self.mem:
            return None
        return max(0, max(self.mem[1:]) - self.mem[0]) / 2**20

    def close(self) -> None:
        for name in ("binding", "sess", "values", "outs"):
            self.__dict__.pop(name, None)
        gc.collect()


def interleave(models: dict[Any, BoundModel], iters: int, rounds: int = 5) -> dict[Any, list[float] | str]:
    """Timed runs of several open models, interleaved: `rounds` rounds, each running every
    model iters // rounds times in turn, so that a drift of the machine's speed (clocks,
    other processes) reaches them alike. A model that fails gets the error's text."""
    out: dict[Any, list[float] | str] = {k: [] for k in models}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for k, m in models.items():
            if isinstance(out[k], str):  # failed in an earlier round
                continue
            try:
                out[k] += m.time(per_round)
            except OnnxfuseError as e:
                out[k] = str(e)
    return out


def run_model(path: str, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
              progress: Progress | None = None, gpu: CudaDriver | None = None) -> _Run:
    """Load, run once, warm up and time one model; returns times and its outputs."""
    progress = progress or Progress("", 1, enabled=False)
    try:
        model = BoundModel(path, feeds, settings, library, gpu)
        try:
            progress.update(0, "loaded")
            model.time(settings.warmup, progress, "warmup")
            times = model.time(settings.iters, progress, "timed", settings.warmup)
            outputs = model.outputs()
            peak = model.peak_mb()
        finally:
            model.close()
    finally:
        progress.update(settings.warmup + settings.iters, "done")
        progress.close()
    return _Run(model.load_ms, model.first_ms, times, outputs, peak)


def evaluate_model(model: str | bytes, feeds: dict[str, np.ndarray], settings: BenchSettings,
                   library: bool) -> dict[str, np.ndarray]:
    """Run a model (a path or serialized bytes) once, untimed, never under CUDA graphs: its
    outputs by name. TF32 as settings.tf32 says."""
    ort = _ort()
    where = model if isinstance(model, str) else "model"
    try:
        sess = ort.InferenceSession(model, _session_options(settings, library), providers=_providers(settings, False))
    except OnnxfuseError:
        raise
    except Exception as e:  # onnxruntime raises several exception types
        raise OnnxfuseError(f"{where}: onnxruntime cannot load it: {_first_line(e)}") from None
    names = [i.name for i in sess.get_inputs()]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise OnnxfuseError(f"{where}: input {missing[0]!r} is not an input of the first model")
    try:
        arrays = sess.run(None, {n: feeds[n] for n in names})
    except Exception as e:
        raise OnnxfuseError(f"{where}: onnxruntime failed to run it: {_first_line(e)}") from None
    outputs = {o.name: a for o, a in zip(sess.get_outputs(), arrays, strict=True)}
    for n, a in outputs.items():
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
            raise OnnxfuseError(f"output {n!r} is not a numeric tensor; bench supports numeric tensors only")
    del sess
    gc.collect()
    return outputs


def gated(settings: BenchSettings) -> bool:
    """Whether later models are gated against a separate TF32-off run of the first (CUDA with
    TF32 allowed, ORT's default), rather than against the first model's own run."""
    return settings.provider == "cuda" and settings.tf32


def reference_settings(settings: BenchSettings) -> BenchSettings:
    """The reference run's settings: TF32 off, no CUDA graphs, the rest as given."""
    return replace(settings, tf32=False, cuda_graph=False, warmup=0, iters=1)


def float64_reference(path: str, feeds: dict[str, np.ndarray], settings: BenchSettings
                      ) -> tuple[dict[str, np.ndarray] | None, str | None, float | None]:
    """The first model evaluated in float64 (`onnxfuse.reference`) when settings ask for it:
    (outputs, None, seconds), or (None, why not, None)."""
    from onnxfuse import reference

    if settings.reference != "float64":
        return None, None, None
    try:
        outputs, seconds = reference.timed_evaluate(path, feeds)
    except reference.Unavailable as e:
        return None, str(e), None
    return outputs, None, seconds


def plausible_float64(ref64: dict[str, np.ndarray] | None, run: dict[str, np.ndarray],
                      why_not: str | None) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """(ref64, why_not), or (None, the reason) when ref64 disagrees with the first model's own
    run as no float32 computation does (`onnxfuse.reference.disagreement`)."""
    from onnxfuse import reference

    if ref64 is None:
        return None, why_not
    problem = reference.disagreement(ref64, run)
    return (None, f"the float64 reference looks wrong: {problem}") if problem else (ref64, None)


def untimed_references(path: str, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
                       notes: TextIO | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, dict]:
    """The gate's reference and baseline for the first model `path` run once, untimed (bisect;
    bench's baseline is its timed run): (reference, baseline or None where the reference is the
    baseline itself, the report's reference entry without ORT's errors). The module docstring
    says which reference; a note on `notes` says why when float64 was asked for and not used."""
    ref64, why_not, seconds = float64_reference(path, feeds, settings)
    ref = None
    if ref64 is None and gated(settings):
        ref = evaluate_model(path, feeds, reference_settings(settings), library)
    ort = evaluate_model(path, feeds, settings, library)
    ref64, why_not = plausible_float64(ref64, ort, why_not)
    if why_not:
        print(f"note: {fallback_note(path, settings, why_not)}", file=notes if notes is not None else sys.stderr)
    if ref64 is not None:
        return ref64, ort, reference_info(path, settings, {}, float64=True, seconds=seconds)
    info = reference_info(path, settings, {}, fallback_reason=why_not)
    if gated(settings):
        if ref is None:
            ref = evaluate_model(path, feeds, reference_settings(settings), library)
        return ref, ort, info
    return ort, None, info


def fallback_note(path: str, settings: BenchSettings, why_not: str) -> str:
    """The note printed when the float64 reference was asked for and is not used."""
    return f"float64 reference not used ({why_not}); gating against {_fp32_reference(path, settings)}"


def _fp32_reference(path: str, settings: BenchSettings) -> str:
    if gated(settings):
        return (f"{Path(path).name} run once with TF32 off (use_tf32 0); later models may differ from it by "
                "twice the first model's own error under ORT's defaults (TF32 allowed)")
    if settings.provider == "cuda":
        return f"{Path(path).name}'s own run, TF32 off (--no-tf32)"
    return f"{Path(path).name}'s own run (the CPU has no TF32)"


def reference_info(path: str, settings: BenchSettings, ort_errors: dict[str, float | None], float64: bool = False,
                   fallback_reason: str | None = None, seconds: float | None = None) -> dict:
    """The report's `reference` entry."""
    if float64:
        tf32 = " (TF32 allowed)" if gated(settings) else ""
        what = (f"{Path(path).name} evaluated in float64 on the CPU (onnx's reference evaluator, "
                f"{seconds or 0:.1f} s); every model may differ from it by twice the first model's own error under "
                f"ORT's defaults{tf32}")
    else:
        what = _fp32_reference(path, settings)
        if fallback_reason:
            what += f" (float64 reference not used: {fallback_reason})"
    return {"path": str(path), "tf32": False, "separate_run": float64 or gated(settings), "float64": float64,
            "fallback_reason": fallback_reason, "seconds": seconds, "description": what,
            "ort_max_abs_err": ort_errors}


def _bind_outputs(ort, binding, names, shapes, device, dev_id, keep: dict) -> None:
    for n in names:
        shape, dtype = shapes[n]
        if np.dtype(dtype).kind not in "biuf":
            raise OnnxfuseError(f"output {n!r} is not a numeric tensor; bench supports numeric tensors only")
        keep[n] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, dev_id)
        binding.bind_ortvalue_output(n, keep[n])


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------

def bench(paths: list[str], settings: BenchSettings, stream: TextIO | None = None,
          notes: TextIO | None = None) -> BenchReport:
    """Run every model on the same inputs; time them and gate every later model's outputs
    against the reference (the module docstring says which run that is)."""
    import onnx

    import onnxfuse

    _validate(settings)
    ort = _ort()
    if settings.provider == "cuda":
        require_cuda()
    notes = notes if notes is not None else sys.stderr
    models = [_read_model(p) for p in paths]
    sig = _signature(models[0])
    specs, defaulted = resolve_inputs(sig, settings, paths[0])
    for p, m in zip(paths[1:], models[1:], strict=True):
        _check_same_inputs(p, _signature(m), specs, paths[0])
    for text in defaulted:
        print(f"note: {text}", file=notes)
    fused_counts = [count_onnxfuse_nodes(m) for m in models]
    del models
    feeds = make_feeds(specs, settings)
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
            r = run_model(path, feeds, settings, library, progress, gpu)
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
                outputs=checks, passed=all(c.passed for c in checks)))
    finally:
        if gpu is not None:
            gpu.close()
    ort_errors = max_abs_errors(reference, baseline) if baseline is not None else {n: 0.0 for n in reference}
    return BenchReport(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        provider=settings.provider, device=device,
        versions={"onnxfuse": onnxfuse.__version__, "onnxruntime": ort.__version__, "onnx": onnx.__version__,
                  "numpy": np.__version__, "python": platform.python_version()},
        settings=settings.to_dict(), inputs=specs, batch=int(batch), models=results,
        passed=all(m.passed for m in results),
        reference=reference_info(paths[0], settings, ort_errors, float64=ref64 is not None, fallback_reason=why_not,
                                 seconds=ref_seconds if ref64 is not None else None))


def require_cuda() -> None:
    """OnnxfuseError unless this onnxruntime has the CUDA execution provider."""
    if "CUDAExecutionProvider" not in _ort().get_available_providers():
        raise OnnxfuseError("--provider cuda: this onnxruntime has no CUDA execution provider "
                            "(pip install 'onnxfuse[gpu]')")


def _validate(s: BenchSettings) -> None:
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


def _check_same_inputs(path: str, sig: list[_Input], specs: list[InputSpec], first: str) -> None:
    want = {s.name: s for s in specs}
    have = {i.name: i for i in sig}
    if set(have) != set(want):
        extra = sorted(set(have) - set(want))
        lost = sorted(set(want) - set(have))
        what = f"has input {extra[0]!r}" if extra else f"lacks input {lost[0]!r}"
        raise OnnxfuseError(f"{path}: {what}; every model must have the inputs of {first}")
    for name, inp in have.items():
        s = want[name]
        dtype = np.dtype(_NP_OF_ONNX[inp.elem_type]).name if inp.elem_type in _NP_OF_ONNX else "unsupported"
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
# Command line (wired into onnxfuse.cli)
# ---------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL", help="ONNX models; the first is the original (baseline)")
    add_run_arguments(p)
    p.add_argument("--warmup", type=int, default=10, help="untimed runs after the first (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed runs (default 100)")
    p.add_argument("--cuda-graph", action="store_true", help="run with ONNX Runtime's CUDA graphs")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (schema onnxfuse.bench/1.2)")
    p.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                   help="print the table as Markdown (or write it to FILE)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options bench and bisect share: provider, inputs, the gate, the session."""
    p.add_argument("--provider", choices=["cuda", "cpu"], default=None,
                   help="execution provider (default: cuda when this onnxruntime has it, else cpu)")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS",
                   help="an input's shape (x=1x3x224x224) or a named dimension's size (seq=128); repeatable")
    p.add_argument("--input", action="append", metavar="NAME=VALUE",
                   help="an input's value: a .npy file or a number filling its shape (sr=16000); repeatable")
    p.add_argument("--batch", type=int, help="size of dynamic leading dimensions (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--reference", choices=REFERENCES, default="float64",
                   help="what outputs are judged against: float64 (the default), the first model evaluated in float64 "
                        "on the CPU; fp32, its float32 run (TF32 off on CUDA, its own run on the CPU)")
    p.add_argument("--tf32", action="store_true", default=True,
                   help="CUDA: run the models under ORT's defaults, TF32 allowed (the default; kept for "
                        "compatibility); with --reference fp32 they are gated against a TF32-off run of the first")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="CUDA: run every model with TF32 off; with --reference fp32 the reference is then the first "
                        "model's run (ort_err 0)")
    p.add_argument("--atol", type=float, help="absolute tolerance floor for every output (default per dtype, "
                                              "times max|reference|)")
    p.add_argument("--rtol", type=float, help="relative tolerance floor for every output (default per dtype)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ORT's)")
    p.add_argument("--opt-level", choices=OPT_LEVELS, default="all", help="ONNX Runtime graph optimizations")
    p.add_argument("--no-library", action="store_true",
                   help="do not register the onnxfuse library (fused nodes run their function bodies)")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    provider = args.provider
    if provider is None:
        provider = "cuda" if "CUDAExecutionProvider" in _ort().get_available_providers() else "cpu"
    shapes = {k: parse_dims(v) for k, v in parse_assignments(args.shape, "--shape").items()}
    defaults = BenchSettings()
    return BenchSettings(
        provider=provider, shapes=shapes, inputs=parse_assignments(args.input, "--input"), batch=args.batch,
        warmup=getattr(args, "warmup", defaults.warmup), iters=getattr(args, "iters", defaults.iters),
        cuda_graph=getattr(args, "cuda_graph", False), tf32=args.tf32, atol=args.atol, rtol=args.rtol,
        seed=args.seed, threads=args.threads, library=not args.no_library, opt_level=args.opt_level,
        reference=getattr(args, "reference", "float64"))


def run_cli(args: argparse.Namespace) -> int:
    """The `onnxfuse bench` command: write files, print the table, return the exit status."""
    from onnxfuse.pipeline import Outputs

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


def input_files(assignments: list[str] | None) -> list[str]:
    """The .npy files of --input NAME=VALUE options (inputs of the command)."""
    return [v for a in assignments or () for v in [a.partition("=")[2]] if v.endswith(".npy")]


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
