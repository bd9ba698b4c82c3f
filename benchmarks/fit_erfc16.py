"""Fit and measure `erfc_16bit`'s polynomial: erfc in kernels that store 16 bits.

`onnxfuse.codegen.SIXTEEN_BIT_FORMS` computes erfc(x), for x >= 0, as

    t * 2^(Q(t) - x^2 log2(e)),   t = 1 / (1 + x / 2),

the form of the Chebyshev-fitted erfc in Press et al.'s Numerical Recipes, with a polynomial
Q of degree 7 of our own: Q(t) approximates log2(erfcx(x) / t) on t in (0, 1] (x from infinity
down to 0), where erfcx(x) = exp(x^2) erfc(x) is smooth and slowly varying, so the error of Q
is the relative error of erfc at every x, tails included. Negative x take 2 - erfc(|x|).

This script fits Q by iteratively reweighted least squares on Chebyshev nodes (minimax within
a few percent), prints its coefficients as fp32, and measures the shipped form
(`onnxfuse.codegen.ERFC16_Q`) as the kernel evaluates it, in fp32 arithmetic (numpy; the GPU's
fast reciprocal and exp2 add up to 2 fp32 ulps each, not modelled here):

- the relative error of erfc over |x| <= 4 (erfc >= 1.5e-8) and up to where fp32 underflows;
- the fp16 and bf16 GELU 0.5 x erfc(-x / sqrt 2) over every finite fp16 input: the largest
  distance in 16-bit ulps from the exactly rounded value, and the share of outputs that differ.

    python benchmarks/fit_erfc16.py                 # fit, measure, print
    python benchmarks/fit_erfc16.py --json fit.json

numpy only (no GPU); `tests/test_codegen.py` runs `measure` on the shipped coefficients.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnxfuse.codegen import ERFC16_Q  # noqa: E402

LOG2E = 1.4426950408889634
DEGREE = 7


def erfcx(x: np.ndarray) -> np.ndarray:
    """exp(x^2) erfc(x) in float64 for x >= 0: math.erfc below 25, the asymptotic series above
    (its first neglected term is below 1e-13 there)."""
    x = np.asarray(x, np.float64)
    small = x < 25
    out = np.empty_like(x)
    xs = x[small]
    out[small] = np.exp(xs * xs) * np.vectorize(math.erfc, otypes=[np.float64])(xs)
    xl = x[~small]
    u = 1 / (2 * xl * xl)
    out[~small] = (1 - u + 3 * u * u - 15 * u**3 + 105 * u**4) / (xl * math.sqrt(math.pi))
    return out


def target(t: np.ndarray) -> np.ndarray:
    """log2(erfcx(x) / t) at x = 2 (1 / t - 1)."""
    return np.log2(erfcx(2 * (1 / t - 1)) / t)


def fit(degree: int = DEGREE, nodes: int = 4000, rounds: int = 200) -> tuple[np.ndarray, float]:
    """Q's coefficients (constant first) and its largest error in log2 over t in (0, 1]."""
    t = (np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes) + 1) / 2
    a = np.stack([t**k for k in range(degree + 1)], 1)
    f = target(t)
    w = np.ones_like(t)
    best = None
    for _ in range(rounds):
        c, *_ = np.linalg.lstsq(a * w[:, None], f * w, rcond=None)
        e = np.abs(a @ c - f)
        if best is None or e.max() < best[1]:
            best = (c, e.max())
        w = w * (e / e.max() + 1e-3) ** 0.3
        w /= w.max()
    tt = np.linspace(0, 1, 200_001)[1:]
    return best[0], float(np.max(np.abs(np.stack([tt**k for k in range(degree + 1)], 1) @ best[0] - target(tt))))


def erfc16(x: np.ndarray, q: tuple[float, ...] = ERFC16_Q) -> np.ndarray:
    """The kernel's erfc_16bit in fp32 arithmetic (numpy)."""
    x = np.asarray(x, np.float32)
    z = np.abs(x)
    t = np.float32(1) / (np.float32(1) + np.float32(0.5) * z)
    p = np.float32(q[-1])
    for c in reversed(q[:-1]):
        p = p * t + np.float32(c)
    with np.errstate(over="ignore", under="ignore"):
        e = t * np.exp2(p - z * (z * np.float32(LOG2E)))
    return np.where(x < 0, np.float32(2) - e, e)


def ulps_apart(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """How many 16-bit floats (fp16 or bf16 arrays of one dtype) lie between got and want,
    elementwise; +0 and -0 count as equal."""
    def ordered(a: np.ndarray) -> np.ndarray:
        i = a.view(np.int16).astype(np.int32)
        return np.where(i < 0, -32768 - i, i)
    both_zero = (got.astype(np.float32) == 0) & (want.astype(np.float32) == 0)
    return np.where(both_zero, 0, np.abs(ordered(got) - ordered(want)))


def measure(q: tuple[float, ...] = ERFC16_Q) -> dict:
    """Relative errors of erfc16 and the 16-bit GELU's distance from the exactly rounded one."""
    import ml_dtypes

    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    x = np.linspace(-9.2, 9.2, 368_001).astype(np.float32)
    ref = erfc(x.astype(np.float64))
    rel = np.abs(erfc16(x, q) / ref - 1)
    out = {"max_rel_err_abs_x_le_4": float(rel[np.abs(x) <= 4].max()), "max_rel_err_to_underflow": float(rel.max())}
    xs = np.arange(65536, dtype=np.uint16).view(np.float16)
    xs = xs[np.isfinite(xs)].astype(np.float32)
    exact = 0.5 * xs.astype(np.float64) * erfc(-xs.astype(np.float64) / math.sqrt(2))
    got = np.float32(0.5) * xs * erfc16(xs * np.float32(-0.70710677), q)
    for name, dt in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        d = ulps_apart(got.astype(dt), exact.astype(dt))
        out[f"gelu_{name}_max_ulps"] = int(d.max())
        out[f"gelu_{name}_share_differing"] = float(np.mean(d > 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    c, err = fit()
    fitted = tuple(float(v) for v in np.float32(c))
    print(f"Q (degree {DEGREE}, fp32): {fitted}")
    print(f"fit: max |error| {err:.3g} in log2, a relative {err * math.log(2):.3g}")
    result = {"fitted": fitted, "fit_rel_err": err * math.log(2), "shipped": list(ERFC16_Q),
              "shipped_measured": measure(), "fitted_measured": measure(fitted)}
    for k in ("shipped", "fitted"):
        print(k, json.dumps(result[f"{k}_measured"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
