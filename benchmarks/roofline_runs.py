"""What the per-kind roofline benchmarks (rows_roofline.py, gemm_roofline.py) share: the
onnxfuse CLI run as a subprocess, `onnxfuse bench`'s two errors and its gate for an original
and its optimized model, and `onnxfuse profile`'s per-node CUPTI times of both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def cli(*args: str, env: Mapping[str, str] | None = None) -> str:
    """`python -m onnxfuse.cli ARGS`; its stdout, or RuntimeError with its last line."""
    r = subprocess.run([sys.executable, "-m", "onnxfuse.cli", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"onnxfuse {args[0]} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r.stdout


def accuracy(src: Path, opt: Path, out: Path, provider: str = "cuda", env: Mapping[str, str] | None = None) -> dict:
    """`onnxfuse bench` of the pair (on CUDA by default): the optimized model's max abs error
    against the float64 reference beside the original's under ORT's defaults, and the gate."""
    return accuracy_models(src, [opt], out, provider, env=env)[0]


def accuracy_models(src: Path, models: list[Path], out: Path, provider: str = "cuda",
                    inputs: Mapping[str, Path] | None = None, env: Mapping[str, str] | None = None) -> list[dict]:
    """`onnxfuse bench` of the original and `models` in one run (on the given `inputs`, .npy files
    by input name, else bench's own): per model its max abs error against the float64 reference
    (None where not finite), the original's under ORT's defaults, and the gate."""
    args = [sys.executable, "-m", "onnxfuse.cli", "bench", str(src), *map(str, models), "--provider", provider,
            "--warmup", "2", "--iters", "10", "--json", str(out)]
    for name, path in (inputs or {}).items():
        args += ["--input", f"{name}={path}"]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if not out.exists():  # exit 1 is a failed gate, which the JSON records; no JSON is an error
        raise RuntimeError(f"onnxfuse bench failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    res = []
    for m in json.loads(out.read_text())["models"][1:]:
        errs = [o["max_abs_err"] for o in m["outputs"]]
        res.append({"err": None if None in errs else max(errs),
                    "ort_err": max((o["ort_max_abs_err"] or 0.0) for o in m["outputs"]),
                    "gate_passed": all(o["passed"] for o in m["outputs"])})
    return res


def profile_nodes(profile_json: Path, metric: str) -> list[dict]:
    """The nodes of an `onnxfuse profile --json` file: name, op, µs, bound µs, % of bound and
    `metric` ("gbps" or "tflops", the achieved rate)."""
    d = json.loads(profile_json.read_text())
    return [{"node": n["name"], "op": n["op_type"], "us": n["median_s"] * 1e6,
             "bound_us": (n["bound_s"] or 0.0) * 1e6, "pct_bound": n["pct_of_bound"],
             metric: n[f"achieved_{metric}"]} for n in d["nodes"]]


def profile_pair(src: Path, opt: Path, tmp: Path, tag: str, metric: str,
                 env: Mapping[str, str] | None = None) -> dict[str, dict]:
    """CUPTI node times of the original ("ort") and the optimized model ("onnxfuse") on the
    H200: per model its nodes, their summed µs and the largest node bound."""
    out = {}
    for which, path in (("ort", src), ("onnxfuse", opt)):
        js = tmp / f"{tag}.{which}.json"
        cli("profile", str(path), "--provider", "cuda", "--device", "h200", "--iters", "50", "--json", str(js),
            env=env)
        nodes = profile_nodes(js, metric)
        out[which] = {"nodes": nodes, "us": sum(n["us"] for n in nodes),
                      "bound_us": max((n["bound_us"] for n in nodes), default=0.0)}
    return out


def fused_pct_bound(pair: dict[str, dict], op: str) -> float | None:
    """The largest % of its roofline bound that a fused node of op type `op` reached."""
    return max((n["pct_bound"] for n in pair["onnxfuse"]["nodes"] if n["op"] == op), default=None)


def keep(rows: list[dict], row: dict, json_path: Path | None) -> None:
    """Add a case's row, write the JSON after every case (a run cut short keeps what it
    measured) and print the row on one line, the per-node lists left out."""
    rows.append(row)
    if json_path:
        json_path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in ("ort", "onnxfuse")}
                     | {"ort_us": row.get("ort", {}).get("us"), "onnxfuse_us": row.get("onnxfuse", {}).get("us")}),
          flush=True)
