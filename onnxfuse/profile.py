"""`onnxfuse profile`: measured time per node in ONNX Runtime, against its roofline bound.

Runs the model with ONNX Runtime's profiler on (the onnxfuse custom-op library registered
when the model has onnxfuse nodes), parses the profile JSON and joins every node's
measured time with its static cost (`onnxfuse.cost`, counted on the shapes the profiler
recorded): achieved GB/s and TFLOP/s, the roofline bound max(FLOPs/peak, bytes/bandwidth),
the percentage of the bound reached (bound / measured) and the time lost against it.

Where the times come from
- CPU: the profiler's per-node ``*_kernel_time`` events (the node's Compute, run to
  completion on the calling thread).
- CUDA: a node's Compute only launches its kernels, so its host time is not the kernel
  time. The GPU time per node comes from, in order: the profiler's own ``Kernel`` events
  (ONNX Runtime builds with CUDA profiling); else CUPTI through torch's profiler, each
  kernel attributed to the node whose Compute launched it (the launch's host timestamp
  falls in the node's interval; both clocks are the system clock, aligned by a search
  that maximizes containment); kernels named ``onnxfuse_*`` are also matched to the node
  whose overload they are. Without either, host times are reported with a warning.
ONNX Runtime's graph optimizations (``--ort-level``, default ``all``) may fuse or replace
nodes; those are costed from the optimized graph ONNX Runtime saves, and marked.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import NodeProto, TensorProto

from onnxfuse.analyze import (
    Roof,
    auto_dtype_peak,
    device_arg,
    device_file,
    fmt_intensity,
    fmt_si,
    fmt_time,
    load_device,
    make_roof,
)
from onnxfuse.cost import NodeCost, Tensor, cost_node, functions_of, model_cost, prepare, tensors_of
from onnxfuse.errors import OnnxfuseError
from onnxfuse.load import load_model
from onnxfuse.outputs import Outputs, write_bytes
from onnxfuse.plot import Series, check_path, roofline_plot
from onnxfuse.tools.feeds import make_feeds
from onnxfuse.tools.session import NP_DTYPES
from onnxfuse.tools.shapes import InputSpec, parse_shapes
from onnxfuse.trace import (  # noqa: F401  best_offset: re-exported, as onnxfuse.profile's API
    NodeTiming,
    attribute_kernels,
    best_offset,
    bound_runner,
    kernel_owners,
    parse_ort_profile,
    profiling_session,
    run_under_cupti,
)

ORT_DTYPES = {
    "float": TensorProto.FLOAT, "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
    "MLFloat16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "BFloat16": TensorProto.BFLOAT16,
    "double": TensorProto.DOUBLE, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8,
    "int16": TensorProto.INT16, "uint16": TensorProto.UINT16, "int32": TensorProto.INT32,
    "uint32": TensorProto.UINT32, "int64": TensorProto.INT64, "uint64": TensorProto.UINT64,
    "bool": TensorProto.BOOL, "string": TensorProto.STRING,
    "Float8E4M3FN": TensorProto.FLOAT8E4M3FN, "Float8E5M2": TensorProto.FLOAT8E5M2,
}
LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
          "all": "ORT_ENABLE_ALL"}


# ---------------------------------------------------------------------------------------
# Joining with the static costs
# ---------------------------------------------------------------------------------------

@dataclass
class ProfiledNode:
    name: str
    op_type: str
    provider: str
    in_model: bool  # False: created by ONNX Runtime's graph optimizations
    times_us: list[float]
    cost: NodeCost
    bound_s: float | None
    # the GPU activities the node launched (CUPTI): (kernel name, device µs per run), longest first
    kernels: list[tuple[str, float]] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return (statistics.median(self.times_us) if self.times_us else 0.0) * 1e-6

    @property
    def achieved_gbps(self) -> float | None:
        return self.cost.bytes / self.median_s / 1e9 if self.cost.bytes is not None and self.median_s > 0 else None

    @property
    def achieved_tflops(self) -> float | None:
        return self.cost.flops / self.median_s / 1e12 if self.cost.flops is not None and self.median_s > 0 else None

    @property
    def pct_of_bound(self) -> float | None:
        if self.bound_s is None or self.median_s <= 0:
            return None
        return 100.0 * self.bound_s / self.median_s

    @property
    def lost_s(self) -> float | None:
        return None if self.bound_s is None else max(self.median_s - self.bound_s, 0.0)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "op_type": self.op_type, "provider": self.provider, "in_model": self.in_model,
            "times_us": self.times_us, "median_s": self.median_s, "bound_s": self.bound_s,
            "achieved_gbps": self.achieved_gbps, "achieved_tflops": self.achieved_tflops,
            "pct_of_bound": self.pct_of_bound, "lost_s": self.lost_s, "cost": self.cost.to_dict(),
            "kernels": [{"name": k, "us_per_run": us} for k, us in self.kernels],
        }


@dataclass
class ProfileResult:
    model: str
    provider: str
    roof: Roof
    ort_level: str
    iters: int
    warmup: int
    time_source: str  # "ort-node", "ort-kernel", "cupti", "host"
    run_us: list[float]
    nodes: list[ProfiledNode]  # ranked by time lost against the bound
    input_shapes: dict[str, tuple[int, ...]]
    warnings: list[str] = field(default_factory=list)
    unattributed_us: float = 0.0

    @property
    def run_median_s(self) -> float:
        return statistics.median(self.run_us) * 1e-6 if self.run_us else 0.0

    def to_dict(self) -> dict:
        return {
            "model": self.model, "provider": self.provider, "roof": self.roof.to_dict(), "ort_level": self.ort_level,
            "iters": self.iters, "warmup": self.warmup, "time_source": self.time_source, "run_us": self.run_us,
            "run_median_s": self.run_median_s, "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "warnings": self.warnings, "unattributed_gpu_us_per_run": self.unattributed_us,
            "nodes": [n.to_dict() for n in self.nodes],
        }


def _align(names: list[str], prof: list[tuple[str, list[int]]], consts: set[str]) -> dict[str, Tensor]:
    """Profiled (dtype, shape) entries matched to tensor names. ONNX Runtime leaves out inputs it
    does not hold at run time (absent optional ones, pre-packed weights)."""
    present = [n for n in names if n]
    for cand in (present, [n for n in present if n not in consts]):
        if len(cand) == len(prof):
            out = {}
            for n, (dt, shape) in zip(cand, prof, strict=True):
                if dt in ORT_DTYPES:
                    out[n] = Tensor(n, tuple(shape), ORT_DTYPES[dt], n in consts)
            return out
    return {}


def join(parsed_nodes: dict[str, NodeTiming], times: dict[str, list[float]], roof: Roof,
         graphs: list[onnx.ModelProto], static: dict[str, Tensor], model_nodes: set[str],
         functions) -> list[ProfiledNode]:
    """Static cost per profiled node, from the node in the first graph that has it (ONNX
    Runtime's optimized graph, then the model) and the shapes the profiler recorded."""
    by_name: dict[str, NodeProto] = {}
    consts: set[str] = set()
    init_shapes: dict[str, Tensor] = {}
    for g in reversed(graphs):
        for n in g.graph.node:
            if n.name:
                by_name[n.name] = n
        for t in g.graph.initializer:
            consts.add(t.name)
            init_shapes[t.name] = Tensor(t.name, tuple(t.dims), t.data_type, True)
    out = []
    for name, t in parsed_nodes.items():
        node = by_name.get(name)
        if node is None:  # not in any graph we have: cost from the profiled shapes alone
            node = onnx.helper.make_node(t.op_type, [f"{name}:in{k}" for k in range(len(t.inputs))],
                                         [f"{name}:out{k}" for k in range(len(t.outputs))], name=name)
        found = {**static, **init_shapes, **_align(list(node.input), t.inputs, consts),
                 **_align(list(node.output), t.outputs, set())}
        ins = [(found.get(n) or Tensor(n, None, 0, n in consts)) if n else None for n in node.input]
        outs = [(found.get(n) or Tensor(n, None, 0)) if n else None for n in node.output]
        cost = cost_node(node, ins, outs, functions)
        cost.name = name
        out.append(ProfiledNode(name, t.op_type, t.provider, name in model_nodes, times.get(name, t.times_us),
                                cost, roof.time(cost)))
    out.sort(key=lambda p: (p.lost_s is None, -(p.lost_s or 0), -p.median_s))
    return out


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------

def random_feeds(sess, input_shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a session (`onnxfuse.tools.feeds`): at `input_shapes`, else the
    session's dims with 1 for a dynamic one; integers 0 (indices and ids: 0 is always valid)."""
    specs = []
    for i in sess.get_inputs():
        shape = input_shapes.get(i.name)
        if shape is None:
            shape = tuple(d if isinstance(d, int) else 1 for d in (i.shape or []))
        dt = NP_DTYPES.get(i.type)
        if dt is None:
            raise OnnxfuseError(f"input {i.name}: cannot make random data of type {i.type}")
        specs.append(InputSpec(i.name, np.dtype(dt).name, tuple(shape)))
    return make_feeds(specs, seed, zero_integers=True)


def detect_device(provider: str) -> tuple[str, str | None]:
    """A device preset for the provider, and a warning when it is a guess."""
    if provider == "cpu":
        return "cpu", None
    name = gpu_name()
    key = preset_for(name)
    if key is not None:
        return key, None
    return "h200", f"GPU {name or '(unknown)'} has no preset: using h200's roofline (pass --device)"


def gpu_name() -> str:
    """The first GPU's name, from torch or nvidia-smi; "" when neither knows."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - torch is optional
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def preset_for(name: str) -> str | None:
    """The device preset for a GPU name: "NVIDIA H200" -> h200, "NVIDIA A100-SXM4-80GB" -> a100."""
    n = name.lower().replace(" ", "").replace("-", "")
    if "l40" in n:
        return None  # L40 / L40S are not an L4
    return next((key for key in ("h200", "h100", "a100", "l4") if key in n), None)


def _ort_error(e: Exception, assumed: list[str] | tuple[str, ...] = ()) -> OnnxfuseError:
    """One line from ONNX Runtime's error; where dynamic dimensions were assumed 1 (no --shape:
    `Prepared.assumed`), the likeliest cause of a failing run (YOLO's Concats need an input
    size divisible by 32), named after it."""
    text = str(e).strip().splitlines()
    msg = f"onnxruntime: {text[0] if text else type(e).__name__}"
    if assumed:
        msg += (f" (the dynamic dimension(s) {', '.join(assumed)} were assumed 1: "
                "set real sizes with --shape NAME=N)")
    return OnnxfuseError(msg)


def profile(path: str, provider: str = "cpu", device: str | None = None, peak_tflops: float | None = None,
            bandwidth_tbps: float | None = None, dtype_peak: str = "auto",
            shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None, iters: int = 10,
            warmup: int = 3, ort_level: str = "all", keep_trace: str | None = None, outputs=None) -> ProfileResult:
    """Run `path` in ONNX Runtime's profiler and join the measured times with the costs.
    `keep_trace`: also keep ONNX Runtime's profile JSON there (written atomically, or staged
    in `outputs`, an `onnxfuse.outputs.Outputs`)."""
    if iters < 1 or warmup < 0:
        raise OnnxfuseError("--iters must be at least 1 and --warmup at least 0")
    model = load_model(path)
    prep = prepare(model, shapes, batch)
    warnings = list(prep.warnings)
    try:
        import onnxruntime as ort
    except ImportError:
        raise OnnxfuseError("profile needs onnxruntime: pip install 'onnxfuse[cpu]' (or [gpu])") from None
    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise OnnxfuseError("--provider cuda: this onnxruntime has no CUDA execution provider "
                            "(install onnxruntime-gpu)")
    if device is None:
        device, warn = detect_device(provider)
        if warn:
            warnings.append(warn)
    load_device(device)  # a bad --device fails before anything runs
    cost = model_cost(model, shapes, batch)
    auto = auto_dtype_peak(cost, tf32=provider == "cuda")  # the CUDA EP runs fp32 Conv/MatMul on TF32
    roof = make_roof(device, peak_tflops, bandwidth_tbps, auto if dtype_peak == "auto" else dtype_peak)
    torch = None
    if provider == "cuda":
        try:
            import torch  # noqa: F811 - CUPTI through torch's profiler, when it has CUDA
            if not torch.cuda.is_available():
                torch = None
        except ImportError:
            torch = None
    with tempfile.TemporaryDirectory(prefix="onnxfuse-profile-") as tmp:
        sess, dumped = _session(ort, path, model, provider, ort_level, Path(tmp))
        feeds = random_feeds(sess, prep.input_shapes)
        run = bound_runner(ort, sess, feeds, provider)
        trace = None
        try:
            for _ in range(warmup):
                run()
            if torch is not None:
                trace = run_under_cupti(torch, run, iters, Path(tmp))
            else:
                for _ in range(iters):
                    run()
        except OnnxfuseError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime's exception types
            raise _ort_error(e, prep.assumed) from None
        start_ns = sess.get_profiling_start_time_ns()
        profile_path = sess.end_profiling()
        if keep_trace:
            trace_bytes = Path(profile_path).read_bytes()
            if outputs is not None:
                outputs.data(keep_trace, trace_bytes)
            else:
                write_bytes(keep_trace, trace_bytes)
        events = json.loads(Path(profile_path).read_text())
        optimized = onnx.load(str(dumped), load_external_data=False) if dumped and dumped.is_file() else None
    parsed = parse_ort_profile(events, warmup)
    if not parsed.runs:
        raise OnnxfuseError("onnxruntime's profile has no runs")
    times = {name: t.times_us for name, t in parsed.nodes.items()}
    source = "ort-node"
    unattributed = 0.0
    kernel_names: dict[str, dict[str, float]] = {}
    if provider == "cuda":
        owners = kernel_owners(model)
        if parsed.kernel_us:
            times, source = _per_node(parsed.kernel_us, len(parsed.runs)), "ort-kernel"
        elif trace is not None:
            att = attribute_kernels(trace, parsed.node_events, start_ns, owners, runs=parsed.runs)
            if att.kernels:
                times, source = _per_node(att.kernel_us, len(parsed.runs)), "cupti"
                kernel_names = att.names
                unattributed = att.unattributed_us / len(parsed.runs)
                if att.unattributed_us > 0.05 * sum(att.kernel_us.values()):
                    warnings.append(f"{unattributed:.1f} µs of GPU time per run not attributed to a node")
            else:
                warnings.append("torch's profiler saw no GPU kernels: times are host-side launch times")
                source = "host"
        else:
            warnings.append("no GPU kernel times (ONNX Runtime without CUDA profiling, no torch with CUDA): "
                            "node times are host-side launch times, not kernel times")
            source = "host"
        for name, t in parsed.nodes.items():
            if t.provider == "CPUExecutionProvider":  # run on the host, synchronously: its own time
                times[name] = t.times_us
            times.setdefault(name, [0.0] * len(parsed.runs))
    graphs = [g for g in (optimized, prep.model) if g is not None]
    static = {}
    for name in prep.view.shapes:
        (t,) = tensors_of(prep.view, [name])
        if t is not None and t.shape is not None:
            static[name] = t
    model_nodes = {n.name for n in prep.model.graph.node}
    nodes = join(parsed.nodes, times, roof, graphs, static, model_nodes, functions_of(prep.model))
    for n in nodes:
        n.kernels = sorted(((k, us / len(parsed.runs)) for k, us in kernel_names.get(n.name, {}).items()),
                           key=lambda kv: -kv[1])
    created = [n.name for n in nodes if not n.in_model]
    if created:
        warnings.append(f"{len(created)} node(s) created by ONNX Runtime's graph optimizations (marked +; "
                        "--ort-level disable keeps the model's own nodes)")
    return ProfileResult(str(path), provider, roof, ort_level, iters, warmup, source, parsed.run_us, nodes,
                         prep.input_shapes, warnings, unattributed)


def _per_node(kernel_us: dict[tuple[int, str], float], runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * runs)
    for (run, node), us in kernel_us.items():
        out[node][run] += us
    return dict(out)


def _session(ort, path: str, model: onnx.ModelProto, provider: str, level: str, tmp: Path):
    """A profiling session (`trace.profiling_session`), saving ONNX Runtime's optimized graph
    when it can."""
    if provider == "cuda":
        providers = [("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    library = any(n.domain == "onnxfuse" for n in model.graph.node)
    try:
        sess, dump = profiling_session(ort, path, tmp, providers, library, LEVELS[level])
    except OnnxfuseError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _ort_error(e) from None
    if provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise OnnxfuseError("--provider cuda: ONNX Runtime could not use the CUDA execution provider (no GPU?)")
    return sess, dump


# ---------------------------------------------------------------------------------------
# Text and command line
# ---------------------------------------------------------------------------------------

SOURCES = {
    "ort-node": "ONNX Runtime's profiler, per node",
    "ort-kernel": "ONNX Runtime's CUDA kernel events",
    "cupti": "CUPTI (torch's profiler), GPU kernels attributed to nodes",
    "host": "host-side times (kernel times unavailable)",
}


KERNELS_PER_NODE = 3  # --kernels: the longest GPU activities printed under each node
KERNEL_NAME_CHARS = 110


# CUTLASS names a tensor-core kernel on fp32 operands by its instruction shape after "tensorop_s"
# ("cutlass_80_tensorop_s1688gemm_64x64_32x6_nn_align4": TF32 m16n8k8, which cuDNN ran for two of
# PP-OCR cls's fp32 convs on the H200, twentieth session); fp16 ones say "tensorop_f16_s16816gemm"
_TF32_NAMES = re.compile(r"tf32|tensorop_s\d")


def is_tf32_kernel(name: str) -> bool:
    """Whether a CUDA kernel's name says it multiplies on the tensor cores in TF32: cuDNN's and
    cuBLAS's kernels name the data type ("tf32"), CUTLASS's the fp32 tensor-op instruction."""
    return bool(_TF32_NAMES.search(name.lower()))


def tf32_us(r: ProfileResult) -> tuple[float, float]:
    """(µs per run in TF32 tensor-core kernels (`is_tf32_kernel`), µs per run in all attributed
    kernels): an fp32 model's convs or products in other kernels ran on CUDA cores, in full fp32."""
    total = sum(us for n in r.nodes for _, us in n.kernels)
    return sum(us for n in r.nodes for k, us in n.kernels if is_tf32_kernel(k)), total


def format_profile(r: ProfileResult, top: int | None = 30, kernels: bool = False) -> str:
    roof = r.roof
    lines = [f"model: {r.model}", f"provider: {r.provider}, ONNX Runtime level {r.ort_level}, "
             f"{r.iters} measured runs after {r.warmup} warm-up; times: {SOURCES[r.time_source]}"]
    if r.input_shapes:
        lines.append("inputs: " + ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in r.input_shapes.items()))
    lines.append(f"roofline: {roof.device}: {roof.bandwidth / 1e12:.3g} TB/s, {roof.vector_peak / 1e12:.3g} "
                 f"TFLOP/s" + (f" ({roof.matrix_peak / 1e12:.3g} for matmul-class nodes)"
                               if roof.matrix_peak != roof.vector_peak else ""))
    lines += [f"warning: {w}" for w in r.warnings]
    node_total = sum(n.median_s for n in r.nodes)
    bound_total = sum(n.bound_s or 0 for n in r.nodes)
    run = r.run_median_s
    lines.append(f"run: median {fmt_time(run)}; nodes {fmt_time(node_total)}"
                 + (f" ({100 * node_total / run:.0f}% of the run)" if run else "")
                 + f"; roofline bound of the nodes {fmt_time(bound_total)}"
                 + (f" ({100 * bound_total / node_total:.1f}% of the nodes' time)" if node_total else ""))
    lines.append("")
    shown = r.nodes if not top else r.nodes[:top]
    w = min(36, max([len(n.name) for n in shown] + [4]))
    ow = min(20, max([len(n.op_type) for n in shown] + [2]))
    lines.append(f"  {'node':<{w}}  {'op':<{ow}}  {'measured':>9}  {'bound':>9}  {'% bound':>7}  {'lost':>9}  "
                 f"{'GB/s':>8}  {'TFLOP/s':>8}  {'FLOP/B':>7}")
    for n in shown:
        mark = " " if n.in_model else "+"
        name = n.name if len(n.name) <= w else n.name[: w - 1] + "…"
        op = n.op_type if len(n.op_type) <= ow else n.op_type[: ow - 1] + "…"
        if not n.cost.ok:
            lines.append(f"{mark} {name:<{w}}  {op:<{ow}}  {fmt_time(n.median_s):>9}  {n.cost.status}: {n.cost.note}")
            if kernels:
                lines += _kernel_lines(n)
            continue
        pct = f"{n.pct_of_bound:.1f}%" if n.pct_of_bound is not None else "?"
        gbps = f"{n.achieved_gbps:.3g}" if n.achieved_gbps is not None else "?"
        tflops = f"{n.achieved_tflops:.3g}" if n.achieved_tflops is not None else "?"
        lines.append(f"{mark} {name:<{w}}  {op:<{ow}}  {fmt_time(n.median_s):>9}  {fmt_time(n.bound_s):>9}  "
                     f"{pct:>7}  {fmt_time(n.lost_s):>9}  {gbps:>8}  {tflops:>8}  "
                     f"{fmt_intensity(n.cost.intensity):>7}")
        if kernels:
            lines += _kernel_lines(n)
    if top and len(r.nodes) > top:
        lines.append(f"  ... {len(r.nodes) - top} more nodes (--top 0 shows all)")
    lines.append("(ranked by time lost against the roofline bound; % bound = bound / measured"
                 + ("; + = created by ONNX Runtime" if any(not n.in_model for n in r.nodes) else "") + ")")
    worst = [n for n in r.nodes if n.lost_s][:3]
    if worst:
        lines.append("most time lost: " + ", ".join(f"{n.name} ({fmt_time(n.lost_s)}, "
                                                    f"{fmt_si((n.cost.bytes or 0), 'B')})" for n in worst))
    if kernels:
        tf32, total = tf32_us(r)
        if total:
            lines.append(f"TF32 tensor-core kernels (by name): {fmt_time(tf32 * 1e-6)} of {fmt_time(total * 1e-6)} "
                         "of attributed kernel time per run")
        else:
            lines.append("no kernel names: they come from CUPTI (--provider cuda, with torch's CUDA build)")
    return "\n".join(lines)


def _kernel_lines(n: ProfiledNode) -> list[str]:
    out = []
    for k, us in n.kernels[:KERNELS_PER_NODE]:
        name = k if len(k) <= KERNEL_NAME_CHARS else k[: KERNEL_NAME_CHARS - 1] + "…"
        out.append(f"      {fmt_time(us * 1e-6):>9}  {name}")
    if len(n.kernels) > KERNELS_PER_NODE:
        out.append(f"      ... {len(n.kernels) - KERNELS_PER_NODE} more kernels")
    return out


def plot_profile(r: ProfileResult, path: str, outputs=None) -> Path:
    total = sum(n.median_s for n in r.nodes) or 1.0
    series = []
    kinds = (("fused nodes", lambda n: n.cost.domain == "onnxfuse"),
             ("matmul-class nodes", lambda n: n.cost.domain != "onnxfuse" and n.cost.matrix),
             ("other nodes", lambda n: n.cost.domain != "onnxfuse" and not n.cost.matrix))
    skipped = 0
    for (label, keep), color in zip(kinds, ("tab:red", "tab:blue", "tab:green"), strict=True):
        s = Series(f"measured: {label}", color=color)
        for n in r.nodes:
            if not keep(n):
                continue
            i = n.cost.intensity
            if i is None or not n.cost.flops or math.isinf(i) or n.median_s <= 0:
                skipped += 1
                continue
            s.x.append(i)
            s.y.append(n.cost.flops / n.median_s)
            s.size.append(n.median_s / total)
            s.names.append(n.name)
        if s.x:
            series.append(s)
    notes = [f"{r.provider}, times: {SOURCES[r.time_source]}", "marker area: share of the measured node time"]
    if skipped:
        notes.append(f"{skipped} node(s) without FLOPs or cost not shown")
    return roofline_plot(path, r.roof, series, [], f"{Path(r.model).name}: measured on {r.provider}", None, notes,
                         ylabel="achieved", outputs=outputs)


def cmd_profile(args: argparse.Namespace) -> int:
    """The `onnxfuse profile` command: write --json / --plot / --keep-trace, print the table."""
    if args.plot:
        check_path(args.plot)
    spec = device_arg(args)
    with Outputs([args.json, args.plot, args.keep_trace], [args.model, device_file(args)]) as out:
        r = profile(args.model, args.provider, spec, args.peak_tflops, args.bandwidth_tbps, args.dtype_peak,
                    parse_shapes(args.shape), args.batch, args.iters, args.warmup, args.ort_level,
                    args.keep_trace, outputs=out)
        if args.json:
            out.text(args.json, json.dumps(r.to_dict(), indent=2, default=str) + "\n")
        if args.plot:
            plot_profile(r, args.plot, outputs=out)
        out.commit()  # before printing: a reader that stops early (| head) loses no file
    print(format_profile(r, top=args.top or None, kernels=args.kernels))
    for path in (args.keep_trace, args.json, args.plot):
        if path:
            print(f"wrote {path}")
    return 0
