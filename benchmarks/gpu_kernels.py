"""Where a model's GPU time goes, kernel by kernel: each model runs in ONNX Runtime (CUDA EP,
its defaults; the onnxfuse library registered for optimized models) under torch's profiler,
whose CUPTI tracing records every kernel of the process, ONNX Runtime's and cuDNN's included.
Per model: the kernels grouped by name (GPU µs per run, launches per run), their sum against
the run's wall clock (the rest is launch overhead and idle GPU), and the kernel families
(onnxfuse Triton kernels, convolutions, transposes, elementwise, reductions, copies).

    python benchmarks/gpu_kernels.py original.onnx optimized.onnx --shape x=1,3,224,224 \\
        [--iters 20] [--top 25] [--json out.json]

Needs an NVIDIA GPU, onnxruntime-gpu and torch with CUDA (for the profiler only). Kernel time
is what the GPU spent; it does not change with CUDA graphs, which remove the launches.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnxfuse.rewrite import DOMAIN  # noqa: E402
from onnxfuse.tools.feeds import static_feeds  # noqa: E402
from onnxfuse.tools.session import BenchSettings, BoundModel  # noqa: E402
from onnxfuse.tools.shapes import parse_shapes, with_input_dims  # noqa: E402

# (family, pattern over the kernel name), first match wins
FAMILIES = [
    ("onnxfuse", re.compile(r"onnxfuse")),
    ("transpose", re.compile(r"[Tt]ranspose|nchwToNhwc|nhwcToNchw|permute", re.I)),
    ("conv", re.compile(r"conv|cudnn|implicit_?gemm|wgrad|dgrad|fprop|xmma|sm\d+_xmma", re.I)),
    ("gemm", re.compile(r"gemm|cublas|cutlass|matmul", re.I)),
    ("reduce", re.compile(r"reduce|pool|softmax|norm", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|_impl|binary|unary|Add|Mul|Sigmoid|Relu|Clip|Cast", re.I)),
]


def family(name: str) -> str:
    return next((f for f, pat in FAMILIES if pat.search(name)), "other")


def profile(path: Path, feeds: dict[str, np.ndarray], iters: int, warmup: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    m = onnx.load(str(path), load_external_data=False)
    library = any(n.domain == DOMAIN for n in m.graph.node)
    settings = BenchSettings(provider="cuda", warmup=warmup, iters=iters)
    model = BoundModel(str(path), feeds, settings, library)
    try:
        model.time(warmup)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            model.time(iters)
            wall_ms = (time.perf_counter() - t0) * 1e3 / iters
        torch.cuda.synchronize()
    finally:
        model.close()
    kernels: dict[str, dict] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if not us:
            continue
        k = kernels.setdefault(ev.key, {"name": ev.key, "family": family(ev.key), "us": 0.0, "count": 0})
        k["us"] += us / iters
        k["count"] += ev.count / iters
    rows = sorted(kernels.values(), key=lambda r: -r["us"])
    families: dict[str, float] = {}
    for r in rows:
        families[r["family"]] = families.get(r["family"], 0.0) + r["us"]
    return {"model": str(path), "library": library, "wall_ms": wall_ms,
            "kernel_ms": sum(r["us"] for r in rows) / 1e3, "launches": sum(r["count"] for r in rows),
            "families_us": dict(sorted(families.items(), key=lambda kv: -kv[1])), "kernels": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="NAME=D0,D1,... (repeatable)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dims = parse_shapes(args.shape)
    first = with_input_dims(onnx.load(str(args.models[0]), load_external_data=False), dims)
    feeds = static_feeds(first)
    out = []
    for path in args.models:
        rec = profile(path, feeds, args.iters, args.warmup)
        out.append(rec)
        print(f"\n{path.name}: wall {rec['wall_ms']:.3f} ms per run, kernels {rec['kernel_ms']:.3f} ms "
              f"({rec['launches']:.0f} launches); by family (µs): "
              + ", ".join(f"{k} {v:.1f}" for k, v in rec["families_us"].items()))
        for r in rec["kernels"][:args.top]:
            print(f"  {r['us']:8.1f} µs  x{r['count']:<5.0f} {r['family']:11s} {r['name'][:110]}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "shapes": {k: list(v) for k, v in
                                                                                     dims.items()},
                                         "models": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
