"""Timing on the GPU: ONNX Runtime sessions with IO binding on a torch stream, CUDA events.

ONNX Runtime runs on the stream torch uses (``user_compute_stream``), inputs and outputs are
bound on the device once (IO binding), so only the session's run is timed, between CUDA
events recorded on that stream. ``cuda_graph=True`` turns on ONNX Runtime's CUDA graphs.

Three timings, each meaning one thing for every contender:
- `time_cuda`: latency, call -> result available. Each call starts on an idle GPU and is
  followed by a device-wide synchronization, so the host's launch work is inside the time
  for every contender (ONNX Runtime's ``run_with_iobinding`` synchronizes by itself;
  torch's asynchronous calls would otherwise queue behind the previous call and hide it).
- `time_throughput`: back-to-back calls, wall clock per call (host work overlaps the GPU).
- `gpu_time_per_call`: the kernels' device time alone (CUPTI; `gpu_activities` by name).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch

TORCH_DTYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 9: torch.bool, 7: torch.int64}


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float


def summarize(times_ms: list[float]) -> Timing:
    q = np.percentile(times_ms, [10, 90])
    return Timing(statistics.median(times_ms), float(q[0]), float(q[1]), min(times_ms))


def time_cuda(fn: Callable[[], object], iters: int = 50, warmup: int = 10) -> Timing:
    """Latency of fn: per call, the CUDA-event time from before the call to after its result
    is available, on torch's current stream.

    Every iteration records the start event on an idle GPU, calls fn, records the end event
    and synchronizes the device before the next call. So each call's host work (Python,
    guards, launches; ONNX Runtime's Run and its end-of-run synchronization) counts, whether
    fn synchronizes by itself (ONNX Runtime) or returns before the GPU is done (torch): what
    a caller that waits for each result sees. Without the per-call synchronization an
    asynchronous fn's start event would queue behind the previous call's kernels and the
    times would be back-to-back throughput with the launch hidden (see `time_throughput`
    for that, and `time_queued`)."""
    return _time_events(fn, iters, warmup, sync_each=True)


def time_queued(fn: Callable[[], object], iters: int = 50, warmup: int = 10) -> Timing:
    """CUDA-event times of calls queued back to back (one synchronization at the end): for
    an asynchronous fn whose GPU work is much longer than its launch (a large copy), the
    device time per call with the launch hidden. Not a latency; `copy_bandwidth` uses it."""
    return _time_events(fn, iters, warmup, sync_each=False)


def _time_events(fn: Callable[[], object], iters: int, warmup: int, sync_each: bool) -> Timing:
    for _ in range(warmup):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


class BoundSession:
    """An ORT CUDA session with inputs and outputs bound to torch tensors on the GPU."""

    def __init__(self, model: onnx.ModelProto | str, feeds: dict[str, torch.Tensor], *,
                 cuda_graph: bool = False, library: str | None = None, prefer_nhwc: bool = False,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                 profile_prefix: str | None = None):
        """profile_prefix: turn on ONNX Runtime's profiler for the timed session (its JSON
        file starts with this; ``self.sess.end_profiling()`` writes it and returns the path)."""
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.log_severity_level = 3
        if library:
            so.register_custom_ops_library(library)
        stream = torch.cuda.current_stream().cuda_stream
        opts = {"device_id": "0", "has_user_compute_stream": "1", "user_compute_stream": str(stream)}
        if cuda_graph:
            opts["enable_cuda_graph"] = "1"
        if prefer_nhwc:
            opts["prefer_nhwc"] = "1"
        data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        self.feeds = {k: v.contiguous() for k, v in feeds.items()}
        # Output shapes: one run of a session without CUDA graphs on numpy copies of the inputs.
        plain = {k: v for k, v in opts.items() if k != "enable_cuda_graph"}
        probe = ort.InferenceSession(data, so, providers=[("CUDAExecutionProvider", plain)])
        arrays = probe.run(None, {k: v.cpu().numpy() for k, v in self.feeds.items()})
        self.outputs = {o.name: torch.from_numpy(np.ascontiguousarray(a)).cuda()
                        for o, a in zip(probe.get_outputs(), arrays, strict=True)}
        del probe
        if profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        self.sess = ort.InferenceSession(data, so, providers=[("CUDAExecutionProvider", opts)])
        self.binding = self.sess.io_binding()
        for name, t in list(self.feeds.items()) + list(self.outputs.items()):
            bind = self.binding.bind_input if name in self.feeds else self.binding.bind_output
            bind(name, "cuda", 0, _np_dtype(t.dtype), list(t.shape), t.data_ptr())

        # For throughput: runs that return without waiting for the GPU (the caller
        # synchronizes the device); see time_throughput.
        self.async_options = ort.RunOptions()
        self.async_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def run(self) -> None:
        self.sess.run_with_iobinding(self.binding)

    def run_async(self) -> None:
        self.sess.run_with_iobinding(self.binding, self.async_options)

    def result(self) -> dict[str, torch.Tensor]:
        self.run()
        torch.cuda.synchronize()
        return {k: v.clone() for k, v in self.outputs.items()}


def _np_dtype(dt: torch.dtype):
    return {torch.float32: np.float32, torch.float16: np.float16, torch.bool: np.bool_,
            torch.int64: np.int64}.get(dt, np.float32) if dt != torch.bfloat16 else np.uint16


def time_throughput(fn: Callable[[], object], iters: int = 200, warmup: int = 20) -> float:
    """Milliseconds per call of `iters` back-to-back calls between two device-wide
    synchronizations (wall clock): steady-state throughput, where host work overlaps the
    GPU's. For ONNX Runtime use BoundSession.run_async: ORT runs on its own stream, which
    only a device-wide synchronization waits for."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def copy_bandwidth(n_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (copies
    queued back to back, as before the latency fix of `time_cuda`: the floor stays a device
    rate, with no launch in it)."""
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = time_queued(lambda: b.copy_(a), iters=30)
    return 2 * n_bytes / (t.median_ms * 1e-3)


def gpu_activities(fn: Callable[[], object], iters: int = 20) -> dict[str, tuple[float, float]]:
    """The GPU activities (kernels, memsets, copies) one call of fn launches, from CUPTI
    (torch's profiler sees every kernel in the process, ONNX Runtime's included), by name:
    (how many per call, device µs per call); host overhead is not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        count, total = out.get(e.name, (0.0, 0.0))
        out[e.name] = (count + 1 / iters, total + us / iters)
    return out


def gpu_time_per_call(fn: Callable[[], object], iters: int = 20, prefix: str | None = None) -> float:
    """Device time (ms) of the GPU kernels one call of fn launches (`gpu_activities`, copies
    left out). prefix: only kernels whose name starts with it."""
    return sum(us for name, (_, us) in gpu_activities(fn, iters).items()
               if "memcpy" not in name.lower() and (prefix is None or name.startswith(prefix))) / 1e3
