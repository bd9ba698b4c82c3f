"""ONNX Runtime's profile and CUPTI's trace: what each node of a session ran, and when.

`parse_ort_profile` reads ONNX Runtime's profiler JSON (per-node host intervals, and the GPU
kernel events of builds with CUDA profiling); `run_under_cupti` records GPU activities through
torch's profiler (CUPTI); `attribute_kernels` gives each activity to the node whose Compute
launched it. Used by `onnxfuse profile` (time per node against the roofline) and
`onnxfuse.bundle` (tuning's one-node models, timed together).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxfuse.runtime import session_options

SUFFIX = "_kernel_time"


@dataclass
class NodeTiming:
    """One node's measured times, one entry per measured run (µs)."""

    name: str
    op_type: str
    provider: str
    times_us: list[float] = field(default_factory=list)
    inputs: list[tuple[str, list[int]]] = field(default_factory=list)  # (ORT dtype, shape) per input
    outputs: list[tuple[str, list[int]]] = field(default_factory=list)
    first_ts: float = 0.0  # execution order

    @property
    def median_us(self) -> float:
        return statistics.median(self.times_us) if self.times_us else 0.0


@dataclass
class ParsedProfile:
    runs: list[tuple[float, float]]  # measured model_run intervals (µs since profiling start)
    run_us: list[float]  # their durations
    nodes: dict[str, NodeTiming]  # by node name, host times
    node_events: list[tuple[int, str, float, float]]  # (run, node, ts, dur) of measured runs
    kernel_us: dict[tuple[int, str], float]  # (run, node) -> GPU kernel µs, from "Kernel" events


def _type_shapes(entries) -> list[tuple[str, list[int]]]:
    out = []
    for e in entries or []:
        if isinstance(e, dict):
            for dt, shape in e.items():
                out.append((dt, [int(d) for d in shape]))
    return out


def parse_ort_profile(events: list[dict], warmup: int = 0) -> ParsedProfile:
    """Per-node times of the runs after the first `warmup` ones."""
    runs_all = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                      if e.get("cat") == "Session" and e.get("name") == "model_run")
    runs = runs_all[warmup:]
    starts = [r[0] for r in runs]

    def run_of(ts: float) -> int | None:
        k = bisect.bisect_right(starts, ts) - 1
        if k >= 0 and ts <= runs[k][1] + 1:
            return k
        return None

    nodes: dict[str, NodeTiming] = {}
    per_run: dict[tuple[int, str], float] = defaultdict(float)
    node_events: list[tuple[int, str, float, float]] = []
    kernel_us: dict[tuple[int, str], float] = defaultdict(float)
    last_node: tuple[int, str] | None = None
    for e in events:
        cat, name = e.get("cat"), str(e.get("name", ""))
        if cat == "Node" and name.endswith(SUFFIX):
            node = name[: -len(SUFFIX)]
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            k = run_of(ts)
            last_node = None if k is None else (k, node)
            if k is None:
                continue
            args = e.get("args", {})
            t = nodes.get(node)
            if t is None:
                t = nodes[node] = NodeTiming(node, args.get("op_name", "?"), args.get("provider", "?"),
                                             inputs=_type_shapes(args.get("input_type_shape")),
                                             outputs=_type_shapes(args.get("output_type_shape")), first_ts=ts)
            per_run[(k, node)] += dur
            node_events.append((k, node, ts, dur))
        elif cat == "Kernel":
            args = e.get("args", {})
            parent = args.get("parent_name")
            if parent:
                k = run_of(float(e["ts"]))
                if k is not None:
                    kernel_us[(k, parent)] += float(e.get("dur", 0))
            elif last_node is not None:
                kernel_us[last_node] += float(e.get("dur", 0))
    for (_run, node), dur in sorted(per_run.items()):
        nodes[node].times_us.append(dur)
    return ParsedProfile(runs, [b - a for a, b in runs], nodes, node_events, dict(kernel_us))


# ---------------------------------------------------------------------------------------
# CUDA kernels from CUPTI (torch's profiler), attributed to nodes
# ---------------------------------------------------------------------------------------

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


@dataclass
class Attribution:
    kernel_us: dict[tuple[int, str], float]  # (run, node) -> device µs
    unattributed_us: float
    kernels: int
    offset_us: float  # added to ORT's timestamps to meet the trace's
    counts: dict[tuple[int, str], int] = field(default_factory=dict)  # (run, node) -> GPU activities
    # node -> GPU activity name (a CUDA kernel's, a memcpy's) -> device µs over all runs
    names: dict[str, dict[str, float]] = field(default_factory=dict)


def best_offset(times: list[float], intervals: list[tuple[float, float]], window: float) -> float:
    """The clock offset o (|o| <= window) that puts the most launch times t inside a node
    interval (s <= t - o <= e): a sweep over the offsets each (launch, interval) pair allows.
    Among equally good ranges, the one nearest 0; inside it, 0 or its middle."""
    if not times or not intervals:
        return 0.0
    iv = sorted(intervals)
    starts = [a for a, _ in iv]
    longest = max(b - a for a, b in iv)
    edges: list[tuple[float, int]] = []
    for t in times:
        lo = bisect.bisect_left(starts, t - window - longest)
        hi = bisect.bisect_right(starts, t + window)
        for s, e in iv[lo:hi]:
            a, b = max(t - e, -window), min(t - s, window)
            if a <= b:
                edges.append((a, 1))
                edges.append((b, -1))
    if not edges:
        return 0.0
    edges.sort(key=lambda x: (x[0], -x[1]))  # closed ranges: openings first
    depth, top, ranges = 0, 0, []
    for k, (pos, d) in enumerate(edges):
        depth += d
        if d > 0 and k + 1 < len(edges):
            nxt = edges[k + 1][0]
            if depth > top:
                top, ranges = depth, [(pos, nxt)]
            elif depth == top:
                ranges.append((pos, nxt))
    if not ranges:
        return 0.0
    a, b = min(ranges, key=lambda r: 0.0 if r[0] <= 0 <= r[1] else min(abs(r[0]), abs(r[1])))
    return 0.0 if a <= 0 <= b else (a + b) / 2


def _coarse_offset(events: list[dict], base_us: float, runs: list[tuple[float, float]] | None, ort_us: float,
                   window: float) -> float:
    """Where to center the offset search: 0 when the clocks agree (the usual case: both use
    the system clock), else the median gap between our per-run annotations
    (``onnxfuse_run_<i>``) in the trace and ONNX Runtime's model_run starts."""
    if not runs:
        return 0.0
    marks = sorted(base_us + float(e["ts"]) for e in events
                   if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("onnxfuse_run_"))
    if len(marks) != len(runs):
        return 0.0
    gap = statistics.median(m - (ort_us + r[0]) for m, r in zip(marks, sorted(runs), strict=True))
    return 0.0 if abs(gap) < window / 2 else gap


def attribute_kernels(trace: dict, node_events: list[tuple[int, str, float, float]], ort_start_ns: int,
                      kernel_owner: dict[str, list[str]] | None = None, search_us: float = 500.0,
                      runs: list[tuple[float, float]] | None = None) -> Attribution:
    """Attribute each GPU activity of a torch (kineto) chrome trace to the node whose Compute
    launched it. node_events: (run, node, ts µs since ORT's profiling start, dur µs); runs:
    the measured model_run intervals on the same axis.
    kernel_owner: kernel name -> node names (onnxfuse kernels: the node's overload), used
    when a kernel's launch call is not in the trace. Both profilers stamp host events with
    the system clock; `best_offset` absorbs what is left between them."""
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1000.0
    events = trace.get("traceEvents", [])
    launches: dict[int, float] = {}
    gpu: list[tuple[int | None, str, float, float]] = []
    for e in events:
        cat = e.get("cat")
        args = e.get("args") or {}
        corr = args.get("correlation")
        if cat in API_CATS and corr is not None:
            launches[int(corr)] = base_us + float(e["ts"])
        elif cat in GPU_CATS:
            gpu.append((int(corr) if corr is not None else None, str(e.get("name", "")), base_us + float(e["ts"]),
                        float(e.get("dur", 0))))
    ort_us = ort_start_ns / 1000.0
    intervals = sorted((ort_us + ts, ort_us + ts + dur, run, node) for run, node, ts, dur in node_events)
    starts = [iv[0] for iv in intervals]

    def owner(t: float, offset: float) -> tuple[int, str] | None:
        k = bisect.bisect_right(starts, t - offset) - 1
        if k >= 0 and t - offset <= intervals[k][1]:
            return intervals[k][2], intervals[k][3]
        return None

    launch_times = [launches[c] for c, *_ in gpu if c is not None and c in launches]
    center = _coarse_offset(events, base_us, runs, ort_us, search_us)
    best = center + best_offset([t - center for t in launch_times], [(s, e) for s, e, _, _ in intervals],
                                search_us)
    kernel_us: dict[tuple[int, str], float] = defaultdict(float)
    counts: dict[tuple[int, str], int] = defaultdict(int)
    unattributed, count = 0.0, 0
    # runs in absolute time, for kernels matched by name: ORT's model_run intervals (they end
    # after the end-of-run synchronization), else the span of each run's nodes
    run_spans: dict[int, tuple[float, float]] = {}
    if runs:
        run_spans = {k: (ort_us + a, ort_us + b) for k, (a, b) in enumerate(runs)}
    else:
        for s, e, run, _ in intervals:
            a, b = run_spans.get(run, (s, e))
            run_spans[run] = (min(a, s), max(b, e + 1000))
    by_name_seen: dict[tuple[int, str], int] = defaultdict(int)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for corr, name, ts, dur in gpu:
        count += 1
        who = owner(launches[corr], best) if corr is not None and corr in launches else None
        if who is None and kernel_owner and name in kernel_owner:
            run = next((r for r, (a, b) in run_spans.items() if a <= ts - best <= b), None)
            if run is not None:
                owners = kernel_owner[name]
                i = by_name_seen[(run, name)]
                by_name_seen[(run, name)] += 1
                who = (run, owners[i % len(owners)])
        if who is None:
            unattributed += dur
        else:
            kernel_us[who] += dur
            counts[who] += 1
            names[who[1]][name] += dur
    return Attribution(dict(kernel_us), unattributed, count, best, dict(counts),
                       {node: dict(k) for node, k in names.items()})


def kernel_owners(model: onnx.ModelProto) -> dict[str, list[str]]:
    """onnxfuse kernel name (a fused node's overload) -> the nodes running it, in graph order."""
    owners: dict[str, list[str]] = defaultdict(list)
    for n in model.graph.node:
        if n.domain == "onnxfuse" and getattr(n, "overload", ""):
            owners[n.overload].append(n.name)
    return dict(owners)


def profiling_session(ort, path: str | Path, folder: Path, providers: list, library: bool,
                      level: str = "ORT_ENABLE_ALL"):
    """An ONNX Runtime session of the model at `path` with its profiler on (its JSON under
    `folder`), the onnxfuse custom-op library registered when `library`, graph optimizations
    at `level` (a GraphOptimizationLevel name). ORT's optimized graph is saved to
    `folder`/ort_optimized.onnx when it can be (best effort): (session, that path or None).
    The second attempt's exception, if any, is the caller's to word."""
    def options(dump: Path | None):
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = str(folder / "ort_profile")
        so.log_severity_level = 3
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        if dump is not None:
            so.optimized_model_filepath = str(dump)
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        dump.name + ".data")
        if library:
            session_options(so)  # the custom-op library runs the fused nodes
        return so

    dump = folder / "ort_optimized.onnx"
    try:
        return ort.InferenceSession(str(path), options(dump), providers=providers), dump
    except Exception:  # noqa: BLE001 - saving the optimized graph is best effort
        return ort.InferenceSession(str(path), options(None), providers=providers), None


def bound_runner(ort, sess, feeds: dict[str, np.ndarray], provider: str):
    """A function running `sess` once on `feeds`; on CUDA with inputs bound on the device (no
    copies inside the timed runs) and outputs left on it."""
    if provider != "cuda":
        return lambda: sess.run(None, feeds)
    binding = sess.io_binding()
    for name, arr in feeds.items():  # inputs live on the GPU: no copies inside the timed runs
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cuda", 0)
    return lambda: sess.run_with_iobinding(binding)


def run_under_cupti(torch, run, iters: int, tmp: Path) -> dict | None:
    """`iters` calls of run() under torch's profiler (CUPTI), each in a ``onnxfuse_run_<i>``
    annotation: its chrome trace, or None when it cannot be read."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            with record_function(f"onnxfuse_run_{i}"):
                run()
        torch.cuda.synchronize()
    out = tmp / "cupti_trace.json"
    prof.export_chrome_trace(str(out))
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return None
