"""The accuracy gate: outputs against a reference, and which reference.

A speedup counts only at equal accuracy, judged against the truth: `gate_output` passes an
output of a later model when every element has
``|actual - reference| <= 2 * ort_err + atol * max|reference| + rtol * |reference|``,
ort_err being the first model's own error as ONNX Runtime runs it (`onnxfuse.bench`'s
docstring says it in full). The reference is the first model evaluated in float64
(`onnxfuse.reference`) when it can be had and looks right, else a float32 run
(`untimed_references`, `reference_info`). bench, bisect and tune gate with these.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import numpy as np

from onnxfuse import reference
from onnxfuse.tools.session import BenchSettings, evaluate_model

REFERENCES = ("float64", "fp32")

# (rtol, atol) per output dtype; dtypes not listed must match exactly.
# (rtol, atol) per dtype. By default atol is relative to the output's scale: the absolute
# tolerance is atol x max|expected| (finite values). Convolutions and matmuls summed in
# another order differ by a few ulps of their *largest* values, so on elements near zero an
# absolute 1e-6 failed the same fp32 computation (vgg_stack, CPU library vs MLAS: 1.5e-5 on
# outputs up to ~20). `--atol` gives an absolute tolerance instead.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5), "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2), "float64": (1e-7, 1e-9),
}

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
    rms_err: float | None = None          # sqrt(mean((y - ref)^2)): the error's bulk, not one element's
    ort_rms_err: float | None = 0.0       # the same for the original under ORT's defaults

    def failure(self) -> str:
        """Why this output fails the gate, in one line."""
        if self.note:
            return self.note
        ort = "" if self.ort_max_abs_err == 0.0 else f" (ORT's own: {fmt_err(self.ort_max_abs_err)})"
        return (f"max abs err vs the reference {fmt_err(self.max_abs_err)}{ort}, "
                f"max rel err {fmt_err(self.max_rel_err)}; "
                f"{self.mismatches} elements outside {self.gate_atol:.3g} + rtol {self.rtol:g} * |reference|")


def fmt_err(v: float | None) -> str:
    """An error for a table: 3 significant digits, "nan/inf" for one that is not finite (None)."""
    return "nan/inf" if v is None else f"{v:.3g}"


def nan_high(v: float | None) -> float:
    """A sort key that puts an error that is not finite (None) above every number."""
    return float("inf") if v is None else v



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
        base.update(ort_rms_err=rms_error(ort_diff))
    base.update(gate_atol=2 * slack + a, ort_max_abs_err=ort_err)
    if ref.size == 0:
        return OutputCheck(**base, max_abs_err=0.0, max_rel_err=0.0, mismatches=0, passed=True, rms_err=0.0)
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
                       max_rel_err=max_rel if np.isfinite(max_rel) else None, mismatches=n_bad, passed=n_bad == 0,
                       rms_err=rms_error(diff))


def rms_error(diff: np.ndarray) -> float | None:
    """The root mean square of |y - ref| (`_abs_diff`); None where an element is not finite.
    The max is one element's luck: two products rounded in another order can trade the largest
    error between them, while the RMS error moves only when most elements got worse."""
    if not diff.size:
        return 0.0
    with np.errstate(over="ignore"):
        v = float(np.sqrt(np.mean(np.square(diff))))
    return v if np.isfinite(v) else None


def _widened(ref: np.dtype, dtype: np.dtype) -> bool:
    """Whether `ref` is the float64 reference of an output of float dtype `dtype`."""
    return ref == np.float64 and dtype != np.float64 and reference.is_float(dtype)


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
