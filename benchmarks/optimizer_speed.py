"""Speed of the optimizer itself (`onnxfuse.optimize_model`; no kernel compilation).

Builds synthetic graphs of pointwise chains at several sizes and times optimize_model on each.
A block of the graph is a chain of 10 elementwise ops with branching and multi-consumer
tensors (x used twice, a SiLU, a residual rejoin, a broadcast input coming from the previous
block's ReduceSum, two exposed outputs), then non-fusable ops: a ReduceSum side branch and a
separator that alternates MatMul / Transpose. Every 5th block also has a path that leaves the
chain through a Transpose and comes back, so the matcher has to split a non-convex group.

`--graph residual` adds a transformer-like residual stream: each block's separator output is
added back to the block's input (h_next = Add(h, sep)). The residual Adds link every block's
chain into one connected elementwise component spanning the whole graph, which the matcher
must split at each separator (the path chain -> MatMul -> residual Add leaves and re-enters).

    python benchmarks/optimizer_speed.py                      # 1k 5k 10k 25k 50k nodes
    python benchmarks/optimizer_speed.py --sizes 1000 50000 --repeat 3 --json out.json
    python benchmarks/optimizer_speed.py --profile 50000      # cProfile of one run, top functions
    python benchmarks/optimizer_speed.py --graph residual     # residual-stream graphs instead
    python benchmarks/optimizer_speed.py --gemm               # the gemm kind matched too (a tuned GPU run)

Prints a table (nodes, seconds, nodes/s, fused groups, and the time of each stage) and
writes JSON (default benchmarks/results/optimizer_speed.json, or optimizer_speed_residual.json).
The requirement it checks: time grows linearly with graph size (log-log slope of seconds over
nodes close to 1) and 50,000 nodes optimize in under 10 s. Exit status 1 when a checked requirement fails.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import platform
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse import optimize_model
from onnxfuse.graph import GraphView
from onnxfuse.load import canonicalize, infer_shapes
from onnxfuse.match import find_matches
from onnxfuse.pattern import load_patterns
from onnxfuse.rewrite import rewrite

DEFAULT_SIZES = (1_000, 5_000, 10_000, 25_000, 50_000)
RESULTS = Path(__file__).parent / "results"  # default JSON: optimizer_speed[_<graph>].json
LIMIT_NODES, LIMIT_SECONDS = 50_000, 10.0
MAX_SLOPE = 1.15  # log-log slope of time over size that still counts as linear
D = 64  # tensors are [D, D] float32, so Transpose and MatMul keep the shape


GRAPHS = ("chains", "residual")


def build_model(target_nodes: int, graph: str = "chains", seed: int = 0) -> onnx.ModelProto:
    """A model of about target_nodes nodes (never fewer) made of pointwise-chain blocks;
    graph="residual" adds a residual Add around each block."""
    if graph not in GRAPHS:
        raise ValueError(f"graph must be one of {GRAPHS}")
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((D, D)) / D).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"),
        numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"),
        numpy_helper.from_array(np.array(1.25, dtype=np.float32), "scale"),
    ]
    nodes: list[onnx.NodeProto] = []
    h, r = "x", "r_in"  # the chain's input and the broadcast [D, 1] input from the previous block
    b = 0
    while len(nodes) < target_nodes:
        p = f"b{b}_"

        def add(op: str, inputs: list[str], out: str, p: str = p, **attrs) -> str:
            nodes.append(helper.make_node(op, inputs, [p + out], name=p + out, **attrs))
            return p + out

        a0 = add("Add", [h, "half"], "a0")           # scalar constant becomes a literal
        a1 = add("Mul", [a0, h], "a1")               # h read twice (here and by a0)
        a2 = add("Sigmoid", [a1], "a2")
        a3 = add("Mul", [a1, a2], "a3")              # SiLU: a1 has two consumers
        if b % 5 == 4:                               # leaves the chain and comes back: non-convex
            t = add("Transpose", [a2], "t", perm=[1, 0])
            a4 = add("Add", [a3, t], "a4")
        else:
            a4 = add("Tanh", [a3], "a4")
        a5 = add("Add", [a4, a0], "a5")              # residual rejoin
        a6 = add("Relu", [a5], "a6")
        a7 = add("Sub", [a6, r], "a7")               # broadcast [D, 1] from the previous block
        a8 = add("Abs", [a7], "a8")
        a9 = add("Mul", [a8, "scale"], "a9")
        r = add("ReduceSum", [a5, "axes"], "r", keepdims=1)  # a5 exposed: read outside the group
        if b % 2 == 0:
            sep = add("MatMul", [a9, "W"], "s")
        else:
            sep = add("Transpose", [a9], "s", perm=[1, 0])
        h = add("Add", [h, sep], "res") if graph == "residual" else sep
        b += 1
    y = helper.make_node("Add", [h, r], ["y"], name="out")
    nodes.append(y)
    graph = helper.make_graph(
        nodes, f"pointwise_{graph}_{target_nodes}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [D, D]),
         helper.make_tensor_value_info("r_in", TensorProto.FLOAT, [D, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [D, D])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def stage_times(model: onnx.ModelProto, patterns) -> dict[str, float]:
    """The stages of optimize_model, timed one by one (mirrors onnxfuse.pipeline)."""
    out = {}
    t = time.perf_counter()
    canonical = canonicalize(model)
    out["canonicalize"] = time.perf_counter() - t
    t = time.perf_counter()
    inferred = infer_shapes(canonical)
    out["infer_shapes"] = time.perf_counter() - t
    t = time.perf_counter()
    view = GraphView.build(canonical, inferred)
    out["graph_view"] = time.perf_counter() - t
    t = time.perf_counter()
    found = find_matches(view, patterns)
    out["match"] = time.perf_counter() - t
    t = time.perf_counter()
    rewrite(canonical, view, found.matches)
    out["rewrite"] = time.perf_counter() - t
    return out


def measure(size: int, graph: str, repeat: int, stages: bool, patterns) -> dict:
    model = build_model(size, graph)
    n = len(model.graph.node)
    best, result = math.inf, None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        result = optimize_model(model, patterns)
        best = min(best, time.perf_counter() - t)
    row = {
        "target": size, "nodes": n, "seconds": best, "nodes_per_s": n / best,
        "fused_groups": len(result.fused), "nodes_after": len(result.model.graph.node),
        "fused_nodes": sum(len(f.source_nodes) for f in result.fused),
    }
    if stages:
        gc.collect()
        row["stages"] = stage_times(model, patterns)
    return row


def loglog_slope(rows: list[dict]) -> float | None:
    if len(rows) < 2:
        return None
    x = np.log([r["nodes"] for r in rows])
    y = np.log([r["seconds"] for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def table(rows: list[dict]) -> str:
    stage_names = list(rows[0].get("stages", {}))
    head = f"{'nodes':>8} {'seconds':>8} {'nodes/s':>9} {'fused':>6} {'after':>7}"
    head += "".join(f" {s[:12]:>12}" for s in stage_names)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['nodes']:>8} {r['seconds']:>8.3f} {r['nodes_per_s']:>9.0f} "
                f"{r['fused_groups']:>6} {r['nodes_after']:>7}")
        line += "".join(f" {r['stages'][s]:>12.3f}" for s in stage_names)
        lines.append(line)
    return "\n".join(lines)


def profile(size: int, graph: str, patterns, top: int) -> str:
    model = build_model(size, graph)
    prof = cProfile.Profile()
    prof.enable()
    optimize_model(model, patterns)
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="target node counts")
    ap.add_argument("--graph", choices=GRAPHS, default="chains", help="kind of synthetic graph")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size; the best is reported")
    ap.add_argument("--max-seconds", type=float, default=60.0,
                    help="skip the larger sizes once one run takes longer than this")
    ap.add_argument("--json", type=Path, help=f"output file (default {RESULTS}/optimizer_speed.json, "
                    "optimizer_speed_residual.json with --graph residual)")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage timing run")
    ap.add_argument("--profile", type=int, metavar="NODES", help="cProfile one run at this size and print it")
    ap.add_argument("--top", type=int, default=25, help="functions to list with --profile")
    ap.add_argument("--gemm", action="store_true",
                    help="match the gemm kind too, as optimize does when it tunes on a GPU (ONNXFUSE_GEMM_ALL=1)")
    args = ap.parse_args(argv)
    if args.gemm:
        os.environ["ONNXFUSE_GEMM_ALL"] = "1"

    patterns = load_patterns()
    optimize_model(build_model(200, args.graph), patterns)  # warm-up: imports, caches
    if args.profile:
        print(profile(args.profile, args.graph, patterns, args.top))
        return 0

    rows, skipped = [], []
    for size in sorted(args.sizes):
        if rows and rows[-1]["seconds"] > args.max_seconds:
            skipped.append(size)
            continue
        rows.append(measure(size, args.graph, args.repeat, not args.no_stages, patterns))
        print(f"  {rows[-1]['nodes']} nodes: {rows[-1]['seconds']:.3f} s", file=sys.stderr, flush=True)
    print(f"graph: {args.graph}")
    print(table(rows))
    if skipped:
        print(f"skipped sizes {skipped}: a run took more than {args.max_seconds:.0f} s (--max-seconds)")

    slope = loglog_slope(rows)
    per_node = [r["seconds"] / r["nodes"] for r in rows]
    growth = per_node[-1] / per_node[0] if len(rows) > 1 else None
    checks = {}
    if slope is not None:
        checks["linear"] = slope <= MAX_SLOPE
        print(f"log-log slope of seconds over nodes: {slope:.2f} (linear: <= {MAX_SLOPE}); "
              f"time per node at {rows[-1]['nodes']} vs {rows[0]['nodes']} nodes: x{growth:.2f}")
    big = [r for r in rows if r["nodes"] >= LIMIT_NODES]
    if skipped and max(skipped) >= LIMIT_NODES:
        checks["under_limit"] = False
        print(f"{LIMIT_NODES} nodes: not run, smaller sizes already too slow (limit {LIMIT_SECONDS:.0f} s)")
    elif big:
        checks["under_limit"] = big[0]["seconds"] < LIMIT_SECONDS
        print(f"{big[0]['nodes']} nodes in {big[0]['seconds']:.2f} s "
              f"({'ok' if checks['under_limit'] else 'TOO SLOW'}: limit {LIMIT_SECONDS:.0f} s)")
    if "linear" in checks and not checks["linear"]:
        print("time grows faster than linearly: run with --profile to see where")

    out = {
        "benchmark": "optimizer_speed", "graph": args.graph, "gemm": args.gemm, "skipped_sizes": skipped,
        "machine": {"python": platform.python_version(), "onnx": onnx.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "repeat": args.repeat, "rows": rows, "loglog_slope": slope, "per_node_growth": growth,
        "checks": checks,
    }
    path = args.json or RESULTS / ("optimizer_speed.json" if args.graph == "chains"
                                   else f"optimizer_speed_{args.graph}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
