"""The one timed-session runner: models in ONNX Runtime sessions, timed.

A `BoundModel` is one model in a session with its inputs and outputs bound once on the
execution provider's device (IO binding: OrtValues on the GPU for provider cuda,
preallocated output buffers in both cases), so no copies are timed; it is run once untimed
(`first_ms`, which includes lazy initialization such as cuDNN's algorithm search or
CUDA-graph capture). Every timed call is ``run_with_iobinding`` followed by
``synchronize_outputs`` on a monotonic clock: on the GPU a synchronized wall-clock time,
what a caller waits for, ONNX Runtime's host work included. `run_model` times one model
(bench), `interleave` several at once (tune), `evaluate_model` runs one once for its outputs.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from onnxfuse import runtime
from onnxfuse.errors import OnnxfuseError
from onnxfuse.tools.cuda import CudaDriver

OPT_LEVELS = ("disable", "basic", "extended", "all")


@dataclass(frozen=True)
class BenchSettings:
    provider: str = "cpu"                                 # "cpu" or "cuda"
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input or dim name -> dims
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> .npy file or a number
    batch: int | None = None
    warmup: int = 10
    iters: int = 100
    cuda_graph: bool = False
    atol: float | None = None
    rtol: float | None = None
    seed: int = 0
    threads: int | None = None                            # intra-op threads (ORT default when None)
    library: bool = True                                  # register it for models with onnxfuse nodes
    opt_level: str = "all"
    device_id: int = 0
    tf32: bool = True                                     # CUDA: let MatMul/Conv use TF32 (ORT's default);
                                                          # bench() then gates against a TF32-off run
    provider_options: dict[str, str] = field(default_factory=dict)  # extra CUDA EP options
    reference: str = "float64"                            # "float64" or "fp32" (module docstring)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["library"] = "auto" if self.library else "off"
        d["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        d["tf32"] = self.tf32 and self.provider == "cuda"
        del d["provider"], d["device_id"]
        return d



class Progress:
    """A one-line progress bar on a terminal, shown once a model has taken `delay` seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, delay: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, enabled: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.total, self.delay, self.clock = label, max(total, 1), delay, clock
        self.start = clock()
        self.last = -1.0
        self.drawn = 0

    def update(self, done: int, what: str = "") -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.start < self.delay or (now - self.last < 0.1 and done < self.total):
            return
        self.last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * 24)
        text = f"\r{self.label} [{bar:<24}] {done}/{self.total} {what} {now - self.start:.1f} s"
        self.stream.write(text.ljust(self.drawn))
        self.stream.flush()
        self.drawn = len(text)

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * self.drawn + "\r")
            self.stream.flush()
            self.drawn = 0


@dataclass
class Run:
    load_ms: float
    first_run_ms: float
    times_ms: list[float]
    outputs: dict[str, np.ndarray]
    peak_gpu_mem_mb: float | None
    warmup_ms: float = 0.0  # the warm-up runs (under CUDA graphs: the capture)
    close_ms: float = 0.0  # reading the outputs back, releasing the session (the CUDA EP's teardown)


def ort_module():
    try:
        import onnxruntime as ort
    except ImportError:
        raise OnnxfuseError("bench needs ONNX Runtime: pip install 'onnxfuse[cpu]' or 'onnxfuse[gpu]'") from None
    return ort


def session_options(settings: BenchSettings, library: bool) -> Any:
    ort = ort_module()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[settings.opt_level]
    if settings.threads:
        so.intra_op_num_threads = settings.threads
    if library:
        runtime.session_options(so)
    return so


def providers(settings: BenchSettings, cuda_graph: bool) -> list:
    if settings.provider != "cuda":
        return ["CPUExecutionProvider"]
    opts = {"device_id": str(settings.device_id), "use_tf32": "1" if settings.tf32 else "0",
            **settings.provider_options}
    if cuda_graph:
        opts["enable_cuda_graph"] = "1"
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line[:400]


class BoundModel:
    """One model in an ONNX Runtime session, inputs and outputs bound on the provider's
    device once (IO binding: no copies are timed), run once (`first_ms`): ready for timed
    runs. Several can be open at once, so that their timed runs interleave (onnxfuse.tune).
    `path`: a model file or a model's bytes; `name`: what errors call it (default the path)."""

    def __init__(self, path: str | bytes, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
                 gpu: CudaDriver | None = None, name: str | None = None):
        self.path, self.gpu = name or str(path), gpu
        self.mem = [gpu.used_bytes()] if gpu is not None else []
        try:
            self._open(path, feeds, settings, library, declared_shapes=settings.cuda_graph)
        except _DeclaredShapesFailed:  # the model's declared output shapes were not its outputs'
            self.close()
            self._open(path, feeds, settings, library, declared_shapes=False)
        self._note_memory()

    def _open(self, path: str | bytes, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
              declared_shapes: bool) -> None:
        ort = ort_module()
        cuda = settings.provider == "cuda"
        device = "cuda" if cuda else "cpu"
        dev_id = settings.device_id if cuda else 0
        try:
            shapes: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
            t0 = time.perf_counter()
            self.sess = sess = ort.InferenceSession(path, session_options(settings, library),
                                                    providers=providers(settings, settings.cuda_graph))
            self.load_ms = (time.perf_counter() - t0) * 1e3
            if settings.cuda_graph:
                # CUDA graphs need outputs bound to fixed buffers before the first (capturing) run:
                # their shapes as the model declares them when all are static (tuning's one-node
                # models), else learned from a run in a session without graphs (a second session,
                # and a second cuDNN algorithm search).
                shapes = static_output_shapes(sess) if declared_shapes else None
                declared_shapes = shapes is not None
                if shapes is None:
                    probe = ort.InferenceSession(path, session_options(settings, library),
                                                 providers=providers(settings, False))
                    arrays = probe.run(None, feeds)
                    shapes = {o.name: (a.shape, a.dtype) for o, a in zip(probe.get_outputs(), arrays, strict=True)}
                    del probe, arrays
                    gc.collect()
        except OnnxfuseError:
            raise
        except Exception as e:  # onnxruntime raises several exception types
            raise OnnxfuseError(f"{self.path}: onnxruntime cannot load it: {first_line(e)}") from None
        self._note_memory()
        names_in = [i.name for i in sess.get_inputs()]
        missing = [n for n in names_in if n not in feeds]
        if missing:
            raise OnnxfuseError(f"{self.path}: input {missing[0]!r} is not an input of the first model")
        self.out_names = out_names = [o.name for o in sess.get_outputs()]
        try:
            self.values = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n], device, dev_id) for n in names_in}
            self.binding = binding = sess.io_binding()
            for n in names_in:
                binding.bind_ortvalue_input(n, self.values[n])
            self.outs: dict[str, Any] = {}
            if shapes is None:
                # First run with outputs allocated by ORT on the device; then fixed buffers.
                for n in out_names:
                    binding.bind_output(n, device, dev_id)
                t0 = time.perf_counter()
                sess.run_with_iobinding(binding)
                binding.synchronize_outputs()
                self.first_ms = (time.perf_counter() - t0) * 1e3
                first = binding.copy_outputs_to_cpu()
                shapes = {n: (a.shape, a.dtype) for n, a in zip(out_names, first, strict=True)}
                del first
                binding.clear_binding_outputs()
                bind_outputs(ort, binding, out_names, shapes, device, dev_id, self.outs)
            else:
                bind_outputs(ort, binding, out_names, shapes, device, dev_id, self.outs)
                t0 = time.perf_counter()
                sess.run_with_iobinding(binding)
                binding.synchronize_outputs()
                self.first_ms = (time.perf_counter() - t0) * 1e3
        except OnnxfuseError:
            raise
        except Exception as e:
            if declared_shapes:
                raise _DeclaredShapesFailed from None
            raise OnnxfuseError(f"{self.path}: onnxruntime failed to run it: {first_line(e)}") from None

    def _note_memory(self) -> None:
        if self.gpu is not None:
            self.mem.append(self.gpu.used_bytes())

    def time(self, n: int, progress: Progress | None = None, stage: str = "timed", done: int = 0) -> list[float]:
        """Milliseconds of each of n runs, each waited for (synchronized wall clock)."""
        run, sync, binding = self.sess.run_with_iobinding, self.binding.synchronize_outputs, self.binding
        clock = time.perf_counter
        times = [0.0] * n
        try:
            for i in range(n):
                t0 = clock()
                run(binding)
                sync()
                times[i] = (clock() - t0) * 1e3
                if progress is not None:
                    progress.update(done + i + 1, stage)
        except Exception as e:
            raise OnnxfuseError(f"{self.path}: onnxruntime failed to run it: {first_line(e)}") from None
        return times

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(zip(self.out_names, self.binding.copy_outputs_to_cpu(), strict=True))

    def peak_mb(self) -> float | None:
        """Device memory in use above the level before the session was made (CUDA only)."""
        self._note_memory()
        if not self.mem or None in self.mem:
            return None
        return max(0, max(self.mem[1:]) - self.mem[0]) / 2**20

    def close(self, collect: bool = True) -> None:
        """Drop the session and its device buffers; `collect`: a full garbage collection too,
        so that a peak-memory reading that follows starts clean (about 0.1 s in a process that
        imported torch: tuning, which closes hundreds of sessions, skips it)."""
        for name in ("binding", "sess", "values", "outs"):
            self.__dict__.pop(name, None)
        if collect:
            gc.collect()


def interleave(models: dict[Any, BoundModel], iters: int, rounds: int = 5) -> dict[Any, list[float] | str]:
    """Timed runs of several open models, interleaved: `rounds` rounds, each running every
    model iters // rounds times in turn, so that a drift of the machine's speed (clocks,
    other processes) reaches them alike. A model that fails gets the error's text."""
    out: dict[Any, list[float] | str] = {k: [] for k in models}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for k, m in models.items():
            if isinstance(out[k], str):  # failed in an earlier round
                continue
            try:
                out[k] += m.time(per_round)
            except OnnxfuseError as e:
                out[k] = str(e)
    return out


def run_model(path: str, feeds: dict[str, np.ndarray], settings: BenchSettings, library: bool,
              progress: Progress | None = None, gpu: CudaDriver | None = None, collect: bool = True) -> Run:
    """Load, run once, warm up and time one model; returns times and its outputs. `collect`:
    as `BoundModel.close`."""
    progress = progress or Progress("", 1, enabled=False)
    clock = time.perf_counter
    try:
        model = BoundModel(path, feeds, settings, library, gpu)
        try:
            progress.update(0, "loaded")
            t0 = clock()
            model.time(settings.warmup, progress, "warmup")
            warmup_ms = (clock() - t0) * 1e3
            times = model.time(settings.iters, progress, "timed", settings.warmup)
            t0 = clock()
            outputs = model.outputs()
            peak = model.peak_mb()
        finally:
            model.close(collect)
        close_ms = (clock() - t0) * 1e3  # from reading the outputs back through the release
    finally:
        progress.update(settings.warmup + settings.iters, "done")
        progress.close()
    return Run(model.load_ms, model.first_ms, times, outputs, peak, warmup_ms, close_ms)


def evaluate_model(model: str | bytes, feeds: dict[str, np.ndarray], settings: BenchSettings,
                   library: bool, collect: bool = True) -> dict[str, np.ndarray]:
    """Run a model (a path or serialized bytes) once, untimed, never under CUDA graphs: its
    outputs by name. TF32 as settings.tf32 says; `collect`: as `BoundModel.close`."""
    return evaluate_model_on(model, [feeds], settings, library, collect)[0]


def evaluate_model_on(model: str | bytes, feed_list: list[dict[str, np.ndarray]], settings: BenchSettings,
                      library: bool, collect: bool = True) -> list[dict[str, np.ndarray]]:
    """`evaluate_model` on each of several inputs, in one session: one load and one first run
    (on CUDA, cuDNN's algorithm search) for them all."""
    ort = ort_module()
    where = model if isinstance(model, str) else "model"
    try:
        sess = ort.InferenceSession(model, session_options(settings, library), providers=providers(settings, False))
    except OnnxfuseError:
        raise
    except Exception as e:  # onnxruntime raises several exception types
        raise OnnxfuseError(f"{where}: onnxruntime cannot load it: {first_line(e)}") from None
    names = [i.name for i in sess.get_inputs()]
    results = []
    for feeds in feed_list:
        missing = [n for n in names if n not in feeds]
        if missing:
            raise OnnxfuseError(f"{where}: input {missing[0]!r} is not an input of the first model")
        try:
            arrays = sess.run(None, {n: feeds[n] for n in names})
        except Exception as e:
            raise OnnxfuseError(f"{where}: onnxruntime failed to run it: {first_line(e)}") from None
        outputs = {o.name: a for o, a in zip(sess.get_outputs(), arrays, strict=True)}
        for n, a in outputs.items():
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf":
                raise OnnxfuseError(f"output {n!r} is not a numeric tensor; bench supports numeric tensors only")
        results.append(outputs)
    del sess
    if collect:
        gc.collect()
    return results


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"



class _DeclaredShapesFailed(Exception):
    """The first run with outputs bound at the shapes the model declares failed: the session
    is opened again, the shapes learned from a run."""


# ONNX Runtime's type strings (NodeArg.type) -> numpy dtypes
NP_DTYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16, "tensor(uint16)": np.uint16, "tensor(bool)": np.bool_,
}


def static_output_shapes(sess) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
    """Each output's (shape, dtype) as the session's model declares it, or None when one is
    not a static numeric tensor."""
    out = {}
    for o in sess.get_outputs():
        if o.type not in NP_DTYPES or not all(isinstance(d, int) and d >= 0 for d in o.shape):
            return None
        out[o.name] = (tuple(o.shape), np.dtype(NP_DTYPES[o.type]))
    return out


def bind_outputs(ort, binding, names, shapes, device, dev_id, keep: dict) -> None:
    for n in names:
        shape, dtype = shapes[n]
        if np.dtype(dtype).kind not in "biuf":
            raise OnnxfuseError(f"output {n!r} is not a numeric tensor; bench supports numeric tensors only")
        keep[n] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, dev_id)
        binding.bind_ortvalue_output(n, keep[n])



def require_cuda() -> None:
    """OnnxfuseError unless this onnxruntime has the CUDA execution provider."""
    if "CUDAExecutionProvider" not in ort_module().get_available_providers():
        raise OnnxfuseError("--provider cuda: this onnxruntime has no CUDA execution provider "
                            "(pip install 'onnxfuse[gpu]')")
