"""The intensity sweep: y = x*2 repeated r times on 64M floats, r = 1, 2, 4, ..., 256, and cos(cos(x)).

For each workload, in one run on one GPU: the original model in ONNX Runtime (CUDA EP,
ORT_ENABLE_ALL, IO binding), the onnxfuse model in ONNX Runtime (with and without CUDA
graphs), torch.compile of the same function, and the memory floor (2 x 64M x 4 bytes at the
measured copy bandwidth). Fused, the bytes stay at one read and one write while FLOPs grow
with r, so the time stays flat until the kernel turns compute-bound.

Three times per contender (benchmarks/gpu_timing.py):
- latency (the "ms" columns): `time_cuda`, call -> result available, the device synchronized
  after every call, so every contender's host work (ORT's Run, torch.compile's guards and
  launch) is inside it. The earlier runs (the intensity sweep tables in benchmarks/results/history.md, first session, of
  2026-11-29) did not synchronize after torch.compile's calls, which hid its launch.
- throughput: back-to-back calls, wall clock per call (`time_throughput`);
- kernel: CUPTI device time of the kernels alone (`gpu_time_per_call`).
Each row's ``host_ms`` is latency minus kernel time: the host and synchronization overhead.
``--ort-profile DIR`` also writes ONNX Runtime's profile of 20 runs of the fused model
(without CUDA graphs) per workload and adds its medians to the row (``ort_profile``): the
whole Run (``model_run``) and the fused node's Compute on the host (``node``).

    python benchmarks/intensity_sweep.py --json sweep.json --png sweep.png
    python benchmarks/intensity_sweep.py --max-r 64 --ort-profile /tmp/prof   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_timing import (  # noqa: E402
    BoundSession,
    copy_bandwidth,
    gpu_time_per_call,
    time_cuda,
    time_throughput,
)
from models.build import cos_cos, mul_chain  # noqa: E402
from onnxfuse import library_path, load_patterns, optimize_model  # noqa: E402
from onnxfuse.compile import local_gpu_archs  # noqa: E402
from onnxfuse.kernels import compile_fused  # noqa: E402

WIDTH = 1024


def fuse(m, single_ops: bool):
    """Optimize and compile; single_ops lets a lone elementwise node fuse too (r = 1)."""
    patterns = load_patterns()
    if single_ops:
        patterns = [dataclasses.replace(p, match=dataclasses.replace(p.match, min_nodes=1))
                    if p.name == "pointwise_chain" else p for p in patterns]
    r = optimize_model(m, patterns)
    compile_fused(r.model, r.fused, local_gpu_archs())
    return r.model, len(r.fused)


def ort_profile(model, feeds: dict, library: str, prefix: Path, runs: int = 20) -> dict:
    """Medians (ms) of ONNX Runtime's own profile of `runs` runs of a session without CUDA
    graphs: ``model_run`` (the whole Run, host side, its synchronization included) and
    ``node`` (the fused node's Compute on the host: bind, choose, launch)."""
    s = BoundSession(model, feeds, library=library, profile_prefix=str(prefix))
    for _ in range(5 + runs):  # the first runs (warm-up, module loading) are dropped below
        s.run()
    path = s.sess.end_profiling()
    return {"file": path, **profile_medians(json.loads(Path(path).read_text()), runs)}


def profile_medians(events: list[dict], runs: int) -> dict:
    """From an ONNX Runtime profile: the medians (ms) of the last `runs` ``model_run`` events
    and of the last `runs` PointwiseChain nodes' ``*_kernel_time`` events (None if absent)."""
    runs_us = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    node_us = [e["dur"] for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
               and e.get("args", {}).get("op_name") == "PointwiseChain"]

    def med(xs):
        return float(np.median(xs[-runs:])) / 1e3 if xs else None

    return {"model_run_ms": med(runs_us), "node_ms": med(node_us)}


def measure(name: str, m, fn, flops_per_elem: int, x: torch.Tensor, floor_ms: float, iters: int,
            profile_dir: Path | None = None) -> dict:
    feeds = {"x": x}
    fused, n_fused = fuse(m, single_ops=True)
    lib = library_path()
    orig = BoundSession(m, feeds)
    fz = BoundSession(fused, feeds, library=lib)
    fzg = BoundSession(fused, feeds, library=lib, cuda_graph=True)
    expected = fn(x)
    errs = []
    for s in (orig, fz, fzg):
        y = s.result()["y"]
        errs.append(float(((y - expected).abs() / expected.abs().clamp_min(1e-30)).max()))
    torch._dynamo.reset()  # a fresh compile per workload (no recompile limit, no eager fallback)
    compiled = torch.compile(fn)
    compiled(x)
    t_orig = time_cuda(orig.run, iters)
    t_fused = time_cuda(fz.run, iters)
    t_graph = time_cuda(fzg.run, iters)
    t_tc = time_cuda(lambda: compiled(x), iters)
    # Kernel time alone (CUPTI): separates the kernels' speed from ORT's per-run host overhead.
    gpu = {"ort": gpu_time_per_call(orig.run), "fused": gpu_time_per_call(fz.run),
           "torch_compile": gpu_time_per_call(lambda: compiled(x))}
    # Throughput: back-to-back runs that do not wait for the GPU, like torch's calls.
    tput = {"ort": time_throughput(orig.run_async), "fused": time_throughput(fz.run_async),
            "fused_graph": time_throughput(fzg.run_async), "torch_compile": time_throughput(lambda: compiled(x))}
    host = {"ort": t_orig.median_ms - gpu["ort"], "fused": t_fused.median_ms - gpu["fused"],
            "fused_graph": t_graph.median_ms - gpu["fused"], "torch_compile": t_tc.median_ms - gpu["torch_compile"]}
    prof = None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        prof = ort_profile(fused, feeds, lib, profile_dir / name.replace("*", "x").replace(" ", "_").replace("=", ""))
    n = x.numel()
    best = min(t_fused.median_ms, t_graph.median_ms)
    return {
        "workload": name, "fused_nodes": n_fused, "ort_ms": t_orig.median_ms, "fused_ms": t_fused.median_ms,
        "fused_graph_ms": t_graph.median_ms, "torch_compile_ms": t_tc.median_ms, "floor_ms": floor_ms,
        "fused_over_floor": best / floor_ms, "speedup_vs_ort": t_orig.median_ms / best,
        "fused_vs_torch_compile": best / t_tc.median_ms,
        "fused_tflops": n * flops_per_elem / (best * 1e-3) / 1e12, "fused_gbps": 8 * n / (best * 1e-3) / 1e9,
        "max_rel_err_ort_fused_graph": errs, "kernel_ms": gpu, "throughput_ms": tput, "host_ms": host,
        "ort_profile": prof,
        "detail": {"ort": dataclasses.asdict(t_orig), "fused": dataclasses.asdict(t_fused),
                   "fused_graph": dataclasses.asdict(t_graph), "torch_compile": dataclasses.asdict(t_tc)},
    }


def chain(r: int):
    def f(x):
        for _ in range(r):
            x = x * 2
        return x

    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replot", type=Path, metavar="JSON", help="only redraw --png from an earlier --json")
    ap.add_argument("--elements", type=int, default=64 * 2**20)
    ap.add_argument("--max-r", type=int, default=256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--ort-profile", type=Path, metavar="DIR",
                    help="also write ONNX Runtime profiles of the fused model per workload here")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.png)
        return
    torch.manual_seed(0)
    x = torch.randn(args.elements // WIDTH, WIDTH, device="cuda")
    bw = copy_bandwidth()
    floor_ms = 2 * x.numel() * 4 / bw * 1e3
    rows = []
    r = 1
    while r <= args.max_r:
        rows.append(measure(f"x*2 r={r}", mul_chain(r, WIDTH), chain(r), r, x, floor_ms, args.iters,
                            args.ort_profile))
        print(_fmt(rows[-1]), flush=True)
        r *= 2
    rows.append(measure("cos(cos(x))", cos_cos(WIDTH), lambda t: torch.cos(torch.cos(t)), 2, x, floor_ms, args.iters,
                        args.ort_profile))
    print(_fmt(rows[-1]), flush=True)
    result = {
        "benchmark": "intensity_sweep",
        "pointwise_config": os.environ.get("ONNXFUSE_POINTWISE_CONFIG", "default"),
        "latency": "time_cuda: CUDA events, device synchronized after every call (host work included)",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(), "elements": x.numel(), "copy_bandwidth_tbps": bw / 1e12,
        "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "python": platform.python_version()},
        "rows": rows,
    }
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.png:
        plot(result, args.png)


HEADER = ("| workload | ORT latency ms | onnxfuse latency ms | onnxfuse+graph latency ms | torch.compile latency ms | "
          "floor ms | best/floor | vs ORT | vs compile | TFLOP/s | GB/s | kernel ms: onnxfuse / torch.compile | "
          "throughput ms/run: ORT / onnxfuse / onnxfuse+graph / torch.compile | "
          "latency - kernel ms: onnxfuse+graph / torch.compile |")


def _fmt(row: dict) -> str:
    return (f"| {row['workload']} | {row['ort_ms']:.3f} | {row['fused_ms']:.3f} | {row['fused_graph_ms']:.3f} | "
            f"{row['torch_compile_ms']:.3f} | {row['floor_ms']:.3f} | {row['fused_over_floor']:.2f} | "
            f"{row['speedup_vs_ort']:.1f}x | {row['fused_vs_torch_compile']:.2f} | {row['fused_tflops']:.2f} | "
            f"{row['fused_gbps']:.0f} | {row['kernel_ms']['fused']:.3f} / {row['kernel_ms']['torch_compile']:.3f} | "
            + " / ".join(f"{row['throughput_ms'][k]:.3f}" for k in ("ort", "fused", "fused_graph", "torch_compile"))
            + " | " + (" / ".join(f"{row['host_ms'][k]:.3f}" for k in ("fused_graph", "torch_compile"))
                       if "host_ms" in row else "") + " |")


def table(result: dict) -> str:
    lines = [f"{result['device']}, {result['elements']} fp32 elements, copy bandwidth "
             f"{result['copy_bandwidth_tbps']:.2f} TB/s, {result['date']}", "", HEADER,
             "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [_fmt(r) for r in result["rows"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["workload"].startswith("x*2")]
    rs = [int(r["workload"].split("=")[1]) for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    series = (("ort_ms", "ORT (unfused)"), ("fused_ms", "onnxfuse"), ("fused_graph_ms", "onnxfuse + CUDA graph"),
              ("torch_compile_ms", "torch.compile"), ("floor_ms", "memory floor"))
    for key, label in series:
        ax[0].plot(rs, [r[key] for r in rows], marker="o", label=label)
    if all("kernel_ms" in r for r in rows):
        ax[0].plot(rs, [r["kernel_ms"]["fused"] for r in rows], linestyle="--", marker=".",
                   label="onnxfuse kernel alone (CUPTI)")
    ax[0].set(xscale="log", yscale="log", xlabel="r (multiplies per element)", ylabel="ms", title="run time")
    ax[0].legend()
    ax[1].plot(rs, [r["fused_tflops"] for r in rows], marker="o")
    ax[1].set(xscale="log", yscale="log", xlabel="r", ylabel="TFLOP/s", title="onnxfuse achieved FLOP rate")
    ax[2].plot(rs, [r["fused_gbps"] for r in rows], marker="o")
    ax[2].axhline(result["copy_bandwidth_tbps"] * 1e3, color="gray", linestyle="--", label="copy bandwidth")
    ax[2].set(xscale="log", xlabel="r", ylabel="GB/s", title="onnxfuse achieved bandwidth")
    ax[2].legend()
    fig.suptitle(f"x*2 repeated r times, {result['elements']} floats, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    np.random.seed(0)
    main()
