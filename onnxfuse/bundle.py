"""Time many one-node models in one ONNX Runtime session, each by its own GPU kernels.

Tuning (`onnxfuse.tune`) times every fused node against what ONNX Runtime would run for the
same nodes. Timed a pair at a time, each model costs a session of its own: about 0.3 s on the
H200 (load, the first run with cuDNN's algorithm search, warm-up and CUDA graph capture,
teardown) for well under a millisecond of timed runs, so a 10 s budget measured a fifth to a
third of a CNN's fused nodes at batch 1 (sixteenth session, `node_runs`). Here the models go
side by side into one (`bundle`): one session, one first run, a few runs under CUPTI (torch's
profiler), and every GPU activity (kernel, memset, copy) is attributed to the node whose
Compute launched it (`onnxfuse.trace.attribute_kernels`). A model's time is the sum of its
activities' GPU time in a run, the median over runs: GPU work without launches, as the pair
timings under CUDA graphs measure it but without the gaps between one model's kernels, which
the caller counts apart (`Timed.kernels`). On the H200 every fused node of the suite's CNNs,
with its original, was timed in one to seven sessions, 0.5-8.4 s a model (seventeenth session).

The session runs in a worker process (`onnxfuse.tools.worker`): CUPTI stays attached to a
process once torch's profiler has run there, and every later launch in it pays (forty-first
session: ORT's BERT-base fp16 b1 7.5% slower with CUDA graphs, 19% without), so the tuning
process, and a caller of the Python API, never profile.

Every name of model i is prefixed ``b<i>~`` so that nothing collides; a node that ONNX Runtime
creates when it optimizes the bundle (its own fusions) is traced back to its model by the
prefix in its name or, failing that, in its tensors' names (the optimized graph ORT saves).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, helper

from onnxfuse import ir, trace
from onnxfuse.errors import OnnxfuseError
from onnxfuse.outputs import save_model
from onnxfuse.tools import worker
from onnxfuse.tools.feeds import random_array
from onnxfuse.tools.session import first_line

ITERS, WARMUP = 10, 2  # profiled runs; runs before them (the first one searches cuDNN's algorithms)
# the inputs and outputs of the models of one bundle at most: more go into several sessions
BUNDLE_BYTES = 2 * 2**30
# attributions that leave more than this fraction of a bundle's GPU time to no node are not
# trusted, beyond a floor per run: every bundle on the H200 left 29-31 µs of 10 runs to no node,
# whatever its size (an activity outside the nodes' Compute; seventeenth session), which failed
# the small bundles of one node's candidate configurations
MAX_UNATTRIBUTED = 0.05
UNATTRIBUTED_FLOOR_US = 5.0
PREFIX = re.compile(r"b(\d+)~")


@dataclass(frozen=True)
class Timed:
    """One model's time in a bundle: median µs per run of the GPU activities attributed to
    it, and how many activities a run has (median)."""

    us: float
    kernels: int


@dataclass
class BundleRun:
    """What one bundle's session measured. `times`: by model index, the models whose every
    node ran on the GPU and launched at least one activity (others are not measured this way:
    a node on the CPU spends time no kernel shows, and a model of aliasing nodes alone has
    nothing to attribute); the seconds of the session's phases; the GPU µs per run no node
    was found for."""

    times: dict[int, Timed]
    unattributed_us: float = 0.0
    load_s: float = 0.0
    first_run_s: float = 0.0
    profiled_s: float = 0.0
    pid: int = 0  # the process that ran it (a worker's: `run_bundle`)


def prefixed(i: int, name: str) -> str:
    return f"b{i}~{name}" if name else ""


def available() -> bool:
    """Whether bundles can be timed here: torch with CUDA (CUPTI through its profiler) and
    ONNX Runtime's CUDA execution provider. ``ONNXFUSE_TUNE_BUNDLES=0`` says no (tuning then
    times pairs alone, as before bundles: for measuring one against the other)."""
    if os.environ.get("ONNXFUSE_TUNE_BUNDLES") == "0":
        return False
    try:
        import onnxruntime as ort
        import torch
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


def bundleable(m: ModelProto) -> bool:
    """Whether `m` can join a bundle: no node holds a subgraph (If, Loop, Scan), whose
    references to outer names the renaming would not follow."""
    return not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                   for n in m.graph.node for a in n.attribute)


def io_bytes(m: ModelProto) -> int:
    """Bytes of a model's graph inputs and outputs (static shapes)."""
    total = 0
    for vi in [*m.graph.input, *m.graph.output]:
        t = vi.type.tensor_type
        size = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
        total += size * int(np.prod([d.dim_value for d in t.shape.dim]))
    return total


def chunks(models: Sequence[ModelProto], limit: int = BUNDLE_BYTES) -> list[list[int]]:
    """Indices of `models` in groups whose inputs and outputs stay within `limit` bytes (a
    model larger than that alone)."""
    out: list[list[int]] = []
    size = 0
    for i, m in enumerate(models):
        b = io_bytes(m)
        if not out or size + b > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += b
    return out


def bundle(models: Sequence[ModelProto]) -> ModelProto:
    """One model holding `models` side by side, each name of model i prefixed (`prefixed`):
    nodes, graph inputs and outputs, initializers, value_info. Functions are kept once per
    (domain, name, overload); opsets are the highest each domain is imported at."""
    nodes, inputs, outputs, inits, infos = [], [], [], [], []
    functions: dict[tuple[str, str, str], onnx.FunctionProto] = {}
    opsets: dict[str, int] = {}
    ir_version = 0
    for i, m in enumerate(models):
        if not bundleable(m):
            raise OnnxfuseError("a model with subgraphs cannot join a bundle")
        g = m.graph
        for n in g.node:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = prefixed(i, n.name or f"node{len(nodes)}")
            c.input[:] = [prefixed(i, x) for x in n.input]
            c.output[:] = [prefixed(i, x) for x in n.output]
            nodes.append(c)
        for src, dst in ((g.input, inputs), (g.output, outputs), (g.value_info, infos), (g.initializer, inits)):
            dst.extend(ir.renamed(v, prefixed(i, v.name)) for v in src)
        for f in m.functions:
            functions.setdefault((f.domain, f.name, f.overload), f)
        for o in m.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
        ir_version = max(ir_version, m.ir_version)
    graph = helper.make_graph(nodes, "bundle", inputs, outputs, inits, value_info=infos)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                            functions=list(functions.values()))
    out.ir_version = ir_version
    return out


def bundle_feeds(models: Sequence[ModelProto], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs for a bundle of `models` (`onnxfuse.tools.feeds.random_array`).
    Inputs of one dtype and shape share their host array (each is still its own device
    buffer): a CNN's layers repeat shapes, and making the data is the slow part."""
    rng = np.random.default_rng(seed)
    made: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    feeds = {}
    for i, m in enumerate(models):
        for vi in m.graph.input:
            t = vi.type.tensor_type
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
            shape = tuple(d.dim_value for d in t.shape.dim)
            key = (dtype.str, shape)
            if key not in made:
                made[key] = random_array(rng, dtype, shape)
            feeds[prefixed(i, vi.name)] = made[key]
    return feeds


def owners(node_names: Sequence[str], optimized: ModelProto | None) -> dict[str, int]:
    """The model index of each node name ONNX Runtime reports: the prefix in the name, else
    the first prefixed tensor of the node of that name in ORT's optimized graph."""
    by_name = {n.name: n for n in optimized.graph.node} if optimized is not None else {}
    out = {}
    for name in node_names:
        m = PREFIX.search(name)
        if m is None and name in by_name:
            n = by_name[name]
            m = next((x for x in (PREFIX.match(t) for t in [*n.output, *n.input]) if x), None)
        if m is not None:
            out[name] = int(m.group(1))
    return out


def group_times(kernel_us: dict[tuple[int, str], float], counts: dict[tuple[int, str], int], runs: int,
                owner: dict[str, int], host: set[str]) -> dict[int, Timed]:
    """Per model: the median over `runs` of its nodes' summed GPU µs, and of their activity
    counts. Models with a node in `host` (run on the CPU) or without any activity are left out."""
    us: dict[int, list[float]] = defaultdict(lambda: [0.0] * runs)
    n: dict[int, list[int]] = defaultdict(lambda: [0] * runs)
    for (run, node), t in kernel_us.items():
        g = owner.get(node)
        if g is not None and 0 <= run < runs:
            us[g][run] += t
            n[g][run] += counts.get((run, node), 0)
    on_host = {owner[h] for h in host if h in owner}
    return {g: Timed(statistics.median(us[g]), round(statistics.median(n[g])))
            for g in sorted(us) if g not in on_host and any(n[g])}


def run_bundle(m: ModelProto, feeds: dict[str, np.ndarray], library: bool, iters: int = ITERS,
               warmup: int = WARMUP) -> BundleRun:
    """Load `m` (a `bundle`) in ONNX Runtime's CUDA EP with its defaults (TF32 allowed) and
    its profiler on, the onnxfuse library registered when `library`; run it `warmup` times,
    then `iters` times under CUPTI; attribute the GPU activities to the bundled models.
    All of it runs in a worker process (`onnxfuse.tools.worker`: CUPTI stays attached to a
    process once torch's profiler has run, and slows every later launch there), unless
    ``ONNXFUSE_BUNDLE_WORKER=0`` or off POSIX (in this process, as before the forty-first session).
    Raises OnnxfuseError when it cannot load or run, or when the attribution is not trusted
    (more than MAX_UNATTRIBUTED of the GPU time, and UNATTRIBUTED_FLOOR_US per run, found no
    node)."""
    with tempfile.TemporaryDirectory(prefix="onnxfuse-bundle-") as tmp:
        save_model(m, Path(tmp) / "bundle.onnx")  # external data beside it past protobuf's 2 GB
        with open(Path(tmp) / "feeds.pkl", "wb") as f:
            pickle.dump(feeds, f, protocol=pickle.HIGHEST_PROTOCOL)
        if os.environ.get("ONNXFUSE_BUNDLE_WORKER") == "0" or os.name != "posix":  # the worker waits by select()
            return run_saved(tmp, library, iters, warmup)
        return worker.shared().call("onnxfuse.bundle", "run_saved", tmp, library, iters, warmup)


def run_saved(folder: str, library: bool, iters: int = ITERS, warmup: int = WARMUP) -> BundleRun:
    """`run_bundle` of the bundle and feeds it saved in `folder` (bundle.onnx, feeds.pkl), in
    this process."""
    import onnxruntime as ort
    import torch

    folder_path = Path(folder)
    path = folder_path / "bundle.onnx"
    m = onnx.load(str(path), load_external_data=False)
    with open(folder_path / "feeds.pkl", "rb") as f:
        feeds = pickle.load(f)
    providers = [("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "1"}), "CPUExecutionProvider"]
    t0 = time.perf_counter()
    try:
        sess, dump = trace.profiling_session(ort, path, folder_path, providers, library)
        load_s = time.perf_counter() - t0
        run = trace.bound_runner(ort, sess, feeds, "cuda")
        t0 = time.perf_counter()
        for _ in range(warmup):
            run()
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cupti = trace.run_under_cupti(torch, run, iters, folder_path)
        profiled_s = time.perf_counter() - t0
        start_ns = sess.get_profiling_start_time_ns()
        events = json.loads(Path(sess.end_profiling()).read_text())
    except OnnxfuseError:
        raise
    except Exception as e:  # noqa: BLE001  onnxruntime's and torch's exception types
        raise OnnxfuseError(f"a bundle of one-node models did not run: {first_line(e)}") from None
    optimized = onnx.load(str(dump), load_external_data=False) if dump is not None and dump.is_file() else None
    parsed = trace.parse_ort_profile(events, warmup)
    if cupti is None or len(parsed.runs) != iters:
        raise OnnxfuseError("a bundle's profile is incomplete (CUPTI saw no runs)")
    att = trace.attribute_kernels(cupti, parsed.node_events, start_ns, trace.kernel_owners(m), runs=parsed.runs)
    total = sum(att.kernel_us.values()) + att.unattributed_us
    if total <= 0 or att.unattributed_us > max(MAX_UNATTRIBUTED * total, UNATTRIBUTED_FLOOR_US * iters):
        raise OnnxfuseError(f"a bundle's GPU time was not attributed to its nodes "
                            f"({att.unattributed_us:.0f} of {total:.0f} µs left over)")
    owner = owners(list(parsed.nodes), optimized)
    host = {name for name, t in parsed.nodes.items() if t.provider == "CPUExecutionProvider"}
    times = group_times(att.kernel_us, att.counts, iters, owner, host)
    return BundleRun(times, att.unattributed_us / iters, load_s, first_s, profiled_s, os.getpid())
