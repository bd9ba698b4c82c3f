"""Accuracy of the transcendental ops over their tails and their bulk, in fp32.

For each op that a fused node computes (Sigmoid, Tanh, Erf, Exp, Log, Softplus, Elu, Gelu
and its tanh form, the exported erf Gelu, Sin, Cos), a one-node model ``OP(x) * one`` (``one``
an input of ones, so that onnxfuse fuses the op with the Mul, which is exact) is evaluated on
fp32 inputs swept over ranges (``--points`` per op, split among its ranges, evenly spaced or
geometric), four ways:

- ``ort``: the original model in ONNX Runtime's CPU provider (its own kernels);
- ``onnxfuse_cpu``: the model as ``onnxfuse.optimize_model`` writes it, one PointwiseChain
  node, through the custom-op library's CPU kernel (the C library's fp32 functions, glibc's
  vector math where the build found it);
- ``numpy``: the fused node's program in ``onnxfuse.expr.evaluate``, the reference semantics;
- ``triton_interp``: the fused node's generated Triton kernel under ``TRITON_INTERPRET=1``,
  with numpy standing in for libdevice (the shims of tests/test_codegen.py). This checks the
  formulas the code generator writes, not libdevice's accuracy on a GPU, which needs a GPU
  (``--no-triton`` skips it; it is the slow part).

Each is compared with the exact value at the same fp32 input, computed in float64 (scipy's
erf/erfc/expit where installed, math's otherwise): ``max_rel`` is the largest
|y - exact| / |exact| over the inputs whose exact value is a normal fp32 number (above
1.18e-38 in magnitude), ``max_abs`` the largest |y - exact| over all of them, denormal
results included. A result of 0 where the exact value is a normal number counts as relative
error 1.

    python -m benchmarks.tails --json benchmarks/results/tails.json --markdown tails.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FLT_MIN = float(np.finfo(np.float32).tiny)
WAYS = ("ort", "onnxfuse_cpu", "numpy", "triton_interp")


def _vectorized(name: str) -> Callable[[np.ndarray], np.ndarray]:
    try:
        import scipy.special as sp

        return getattr(sp, name)
    except ImportError:
        return np.vectorize(getattr(math, name), otypes=[np.float64])


def _expit(x: np.ndarray) -> np.ndarray:
    t = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, t) / (1.0 + t)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * _vectorized("erfc")(-x / math.sqrt(2.0))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    # 0.5 x (1 + tanh(z)) = x sigmoid(2z)
    return x * _expit(2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))


@dataclass(frozen=True)
class Range:
    label: str
    lo: float
    hi: float
    geometric: bool = False  # points evenly spaced in log|x| (lo, hi of one sign)


@dataclass(frozen=True)
class OpCase:
    name: str
    nodes: Callable[[], list[onnx.NodeProto]]  # x -> t
    exact: Callable[[np.ndarray], np.ndarray]
    ranges: tuple[Range, ...]
    opset: int = 20


N = helper.make_node


def _one(op: str, **attrs) -> Callable[[], list[onnx.NodeProto]]:
    return lambda: [N(op, ["x"], ["t"], **attrs)]


def _exported_gelu() -> list[onnx.NodeProto]:
    """torch.nn.functional.gelu as exporters write it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    c = helper.make_tensor
    return [
        N("Constant", [], ["s2"], value=c("s2", TensorProto.FLOAT, [], [1.4142135381698608])),
        N("Constant", [], ["c1"], value=c("c1", TensorProto.FLOAT, [], [1.0])),
        N("Constant", [], ["ch"], value=c("ch", TensorProto.FLOAT, [], [0.5])),
        N("Div", ["x", "s2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "c1"], ["a"]),
        N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "ch"], ["t"]),
    ]


CASES = (
    OpCase("Sigmoid", _one("Sigmoid"), _expit, (
        Range("x < -16", -104.0, -16.0), Range("-16 .. 16", -16.0, 16.0), Range("x > 16", 16.0, 100.0))),
    OpCase("Tanh", _one("Tanh"), np.tanh, (
        Range("|x| < 1e-3", 1e-40, 1e-3, True), Range("-10 .. 10", -10.0, 10.0), Range("x > 10", 10.0, 100.0))),
    OpCase("Erf", _one("Erf"), _vectorized("erf"), (
        Range("|x| < 1e-3", 1e-40, 1e-3, True), Range("-4 .. 4", -4.0, 4.0), Range("x < -4", -12.0, -4.0))),
    OpCase("Exp", _one("Exp"), np.exp, (
        Range("x < -87.3 (denormal results)", -104.0, -87.34), Range("-87.3 .. 88.7", -87.33, 88.72))),
    OpCase("Log", _one("Log"), np.log, (
        Range("denormal x", 1.4e-45, 1.17e-38, True), Range("1e-38 .. 1e38", 1.2e-38, 1e38, True),
        Range("0.5 .. 2", 0.5, 2.0))),
    OpCase("Softplus", _one("Softplus"), lambda x: np.logaddexp(0.0, x), (
        Range("x < -16", -104.0, -16.0), Range("-16 .. 16", -16.0, 16.0), Range("x > 16", 16.0, 1e4))),
    OpCase("Elu", _one("Elu", alpha=1.0), lambda x: np.where(x > 0, x, np.expm1(x)), (
        Range("-1e-3 < x < 0", -1e-40, -1e-3, True), Range("-20 .. 20", -20.0, 20.0))),
    OpCase("Gelu", _one("Gelu"), _gelu, (
        Range("x < -5", -14.0, -5.0), Range("-5 .. 5", -5.0, 5.0), Range("x > 5", 5.0, 100.0))),
    OpCase("Gelu (exported: Div, Erf, Add, Mul, Mul)", _exported_gelu, _gelu, (
        Range("x < -5", -14.0, -5.0), Range("-5 .. 5", -5.0, 5.0))),
    OpCase("Gelu (approximate=tanh)", _one("Gelu", approximate="tanh"), _gelu_tanh, (
        Range("x < -5", -14.0, -5.0), Range("-5 .. 5", -5.0, 5.0))),
    OpCase("Sin", _one("Sin"), np.sin, (Range("-100 .. 100", -100.0, 100.0), Range("1e2 .. 1e5", 1e2, 1e5))),
    OpCase("Cos", _one("Cos"), np.cos, (Range("-100 .. 100", -100.0, 100.0), Range("1e2 .. 1e5", 1e2, 1e5))),
)


def sweep(r: Range, n: int) -> np.ndarray:
    if r.geometric:
        sign = -1.0 if r.lo < 0 else 1.0
        x = sign * np.geomspace(abs(r.lo), abs(r.hi), n)
    else:
        x = np.linspace(r.lo, r.hi, n)
    return np.unique(x.astype(np.float32))


def model(case: OpCase) -> onnx.ModelProto:
    nodes = case.nodes() + [N("Mul", ["t", "one"], ["y"])]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "tails", [vi("x", TensorProto.FLOAT, ["n"]), vi("one", TensorProto.FLOAT, ["n"])],
                          [vi("y", TensorProto.FLOAT, ["n"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=10)


def fused(m: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """The optimized model (one PointwiseChain node) and its program text."""
    from onnxfuse import optimize_model

    r = optimize_model(m, leave_to_ort=False)  # the kernel's accuracy, not ORT's Gelu fusion
    nodes = [n for n in r.model.graph.node if n.domain == "onnxfuse"]
    if len(nodes) != 1 or len(r.model.graph.node) != 1:
        raise RuntimeError(f"expected one fused node: {r.report.summary()}")
    prog = next(a.s.decode() for a in nodes[0].attribute if a.name == "program")
    return r.model, prog


def run_ort(m: onnx.ModelProto, x: np.ndarray, library: bool) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if library:
        from onnxfuse import runtime

        runtime.session_options(so)
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x, "one": np.ones_like(x)})[0]


def run_numpy(program: str, x: np.ndarray) -> np.ndarray:
    from onnxfuse.expr import evaluate, parse

    return evaluate(parse(program), [x, np.ones_like(x)])[0]


def run_interpreted(jobs: list[tuple[str, np.ndarray]]) -> list[np.ndarray | str]:
    """Each (program, x) through its Triton kernel in the interpreter (a child process)."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-tails-") as tmp:
        work = Path(tmp)
        for i, (program, x) in enumerate(jobs):
            (work / f"job{i}.txt").write_text(program)
            np.save(work / f"job{i}_x.npy", x)
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "benchmarks.tails", "--interpret-child", str(work), str(len(jobs))]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            return [f"interpreter failed: {proc.stderr.strip().splitlines()[-1:]}"] * len(jobs)
        out: list[np.ndarray | str] = []
        for i in range(len(jobs)):
            err = work / f"job{i}_error.txt"
            out.append(err.read_text() if err.exists() else np.load(work / f"job{i}_y.npy"))
        return out


BLOCK = 1 << 16  # elements per program: few programs, so the interpreter runs whole arrays at a time


def _interpret_child(work: Path, n_jobs: int) -> None:
    import importlib.util

    import torch

    from onnxfuse.codegen import Variant, generate
    from onnxfuse.expr import parse
    from tests.test_codegen import _install_libdevice_shims

    _install_libdevice_shims()
    name = "onnxfuse_pointwise_chain_000000000000"
    for i in range(n_jobs):
        try:
            prog = parse((work / f"job{i}.txt").read_text())
            x = np.load(work / f"job{i}_x.npy")
            ks = generate(prog, name, 1, ("full", "full"), [], Variant(0, block=BLOCK))
            path = work / f"job{i}.py"
            path.write_text(ks.source)
            spec = importlib.util.spec_from_file_location(f"job{i}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            xt = torch.from_numpy(x)
            y = torch.empty_like(xt)
            getattr(mod, name)[(-(-x.size // BLOCK),)](xt, torch.ones_like(xt), y, x.size, BLOCK=BLOCK)
            np.save(work / f"job{i}_y.npy", y.numpy())
        except Exception as e:  # reported in the table
            (work / f"job{i}_error.txt").write_text(f"{type(e).__name__}: {e}")


def errors(y: np.ndarray, exact: np.ndarray) -> dict[str, float | int]:
    y64 = y.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(y64 - exact)
    diff[(y64 == exact) | (np.isnan(y64) & np.isnan(exact))] = 0.0
    diff[np.isnan(diff)] = np.inf
    normal = np.abs(exact) >= FLT_MIN
    rel = diff[normal] / np.abs(exact[normal])
    worst = int(np.argmax(rel)) if rel.size else -1
    return {"max_rel": float(rel.max()) if rel.size else 0.0, "max_abs": float(diff.max()) if diff.size else 0.0,
            "worst_x": float(np.flatnonzero(normal)[worst]) if worst >= 0 else None,
            "zeros": int(np.count_nonzero((y64 == 0) & normal))}


def measure(points: int, triton: bool, log=print) -> list[dict]:
    rows: list[dict] = []
    jobs: list[tuple[str, np.ndarray]] = []
    for case in CASES:
        m = model(case)
        f, program = fused(m)
        per = max(2, points // len(case.ranges))
        for r in case.ranges:
            x = sweep(r, per)
            exact = case.exact(x.astype(np.float64))
            row = {"op": case.name, "range": r.label, "lo": r.lo, "hi": r.hi, "points": int(x.size),
                   "program": program}
            for way, y in (("ort", run_ort(m, x, False)), ("onnxfuse_cpu", run_ort(f, x, True)),
                           ("numpy", run_numpy(program, x))):
                row[way] = _with_worst_x(errors(y, exact), x)
            if triton:
                jobs.append((program, x))
            rows.append(row)
            log(f"{case.name:<42} {r.label:<30} " + "  ".join(
                f"{w} {row[w]['max_rel']:.2e}" for w in WAYS if w in row), file=sys.stderr)
    if triton:
        for row, (_, x), y in zip(rows, jobs, run_interpreted(jobs), strict=True):
            case = next(c for c in CASES if c.name == row["op"])
            row["triton_interp"] = y if isinstance(y, str) else _with_worst_x(
                errors(y, case.exact(x.astype(np.float64))), x)
    return rows


def _with_worst_x(e: dict, x: np.ndarray) -> dict:
    if e["worst_x"] is not None:
        e["worst_x"] = float(x[int(e["worst_x"])])
    return e


def _cell(v: dict | str | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    zeros = f", {v['zeros']} zeros" if v["zeros"] else ""
    return f"{v['max_rel']:.2g} ({v['max_abs']:.2g} abs{zeros})"


def markdown(rows: list[dict]) -> str:
    heads = ["op", "x", "points", "ONNX Runtime CPU", "onnxfuse CPU kernel", "numpy evaluator",
             "Triton formula (interpreter)"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = " | ".join(_cell(r.get(w)) for w in WAYS)
        lines.append(f"| {r['op']} | {r['range']} | {r['points']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=1_000_000, help="inputs per op, split among its ranges")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton interpreter (the slow part)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    ap.add_argument("--markdown", type=Path, help="write the table as Markdown")
    ap.add_argument("--interpret-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.interpret_child:
        _interpret_child(Path(args.interpret_child[0]), int(args.interpret_child[1]))
        return 0
    import onnxruntime

    import onnxfuse

    rows = measure(args.points, not args.no_triton)
    table = markdown(rows)
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        meta = {"onnxruntime": onnxruntime.__version__, "onnxfuse": onnxfuse.__version__, "numpy": np.__version__,
                "machine": platform.machine(), "processor": _cpu_name(), "points": args.points,
                "metric": "max_rel over exact values of normal fp32 magnitude; max_abs over all; "
                          "zeros: results 0 where the exact value is a normal number"}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
