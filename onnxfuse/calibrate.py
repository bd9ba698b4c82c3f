"""`onnxfuse calibrate`: measure this machine's GPU and save a device profile.

Measures DRAM copy bandwidth (bytes read + written per second), dense matmul throughput in
fp32 (CUDA cores, TF32 off), tf32 and fp16 (tensor cores), and convolution throughput, and
writes them as JSON that ``onnxfuse analyze --device FILE`` (or ``--profile-file FILE``)
and ``onnxfuse profile`` use instead of datasheet numbers:

    {"key": "calibrated", "name": "NVIDIA H200 (calibrated)", "bandwidth_tbps": 4.2,
     "peak_tflops": {"fp32": 51.0, "tf32": 380.0, "fp16": 700.0},
     "conv_tflops": {"tf32": ..., "fp16": ...}, "source": "...", "measured": {...}}

It uses torch when torch sees a CUDA device (CUDA events; matmuls of 8192 x 8192), else
onnxruntime-gpu's CUDA execution provider (IO binding on the device, wall-clock per
synchronous run over many runs). Without a GPU it stops with a one-line error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.errors import OnnxfuseError
from onnxfuse.files import check_output
from onnxfuse.outputs import write_text
from onnxfuse.tools.session import BenchSettings, BoundModel

MATMUL_N = 8192
CONV = (32, 256, 256, 56, 56)  # N, C, K, H, W; 3x3 kernel, padding 1


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() and torch.cuda.device_count() > 0 else None
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" here
        return None


def _ort_cuda():
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    return ort if "CUDAExecutionProvider" in ort.get_available_providers() else None


def _time_torch(torch, fn, iters: int, warmup: int = 3) -> float:
    """Median seconds per call, between CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(times)


def measure_torch(torch, size_mb: int, iters: int) -> dict:
    n_bytes = size_mb * 2**20
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t_copy = _time_torch(torch, lambda: dst.copy_(src), iters)
    src = dst = None  # free the buffers before the matmuls
    measured = {"copy": {"bytes": 2 * n_bytes, "seconds": t_copy}}
    mm = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    saved = (mm.allow_tf32, cudnn.allow_tf32, cudnn.benchmark)
    peaks, convs = {}, {}
    try:
        cudnn.benchmark = True
        n = MATMUL_N
        for key, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                 ("fp16", torch.float16, False)):
            mm.allow_tf32 = cudnn.allow_tf32 = tf32
            x = torch.randn(n, n, device="cuda", dtype=dtype)
            y = torch.randn(n, n, device="cuda", dtype=dtype)
            t = _time_torch(torch, lambda x=x, y=y: torch.mm(x, y), max(5, iters // 2))
            peaks[key] = 2 * n**3 / t / 1e12
            measured[f"matmul_{key}"] = {"n": n, "seconds": t}
            del x, y
        nb, c, k, h, w = CONV
        conv = torch.nn.functional.conv2d
        for key, dtype, tf32 in (("tf32", torch.float32, True), ("fp16", torch.float16, False)):
            mm.allow_tf32 = cudnn.allow_tf32 = tf32
            x = torch.randn(nb, c, h, w, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
            wt = torch.randn(k, c, 3, 3, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
            t = _time_torch(torch, lambda x=x, wt=wt: conv(x, wt, padding=1), max(5, iters // 2))
            convs[key] = 2 * nb * k * c * 9 * h * w / t / 1e12
            measured[f"conv_{key}"] = {"shape": list(CONV), "kernel": [3, 3], "seconds": t}
            del x, wt
    finally:
        mm.allow_tf32, cudnn.allow_tf32, cudnn.benchmark = saved
        torch.cuda.empty_cache()
    return {
        "name": f"{torch.cuda.get_device_name(0)} (calibrated)",
        "bandwidth_tbps": 2 * n_bytes / t_copy / 1e12,
        "peak_tflops": peaks, "conv_tflops": convs,
        "source": f"onnxfuse calibrate with torch {torch.__version__} (CUDA events), "
                  f"{datetime.date.today().isoformat()}",
        "measured": measured,
    }


def _ort_time(model, feeds: dict, tf32: bool, iters: int, provider: str = "cuda") -> float:
    """Median seconds per synchronized run of `model` in ONNX Runtime, IO binding on the
    device (`onnxfuse.tools.session.BoundModel`), after 3 untimed runs."""
    settings = BenchSettings(provider=provider, tf32=tf32)
    run = BoundModel(model.SerializeToString(), feeds, settings, library=False, name="calibrate")
    try:
        if provider == "cuda" and run.sess.get_providers()[0] != "CUDAExecutionProvider":
            raise OnnxfuseError("calibrate: ONNX Runtime could not use the CUDA execution provider (no GPU?)")
        run.time(3)
        return statistics.median(run.time(iters)) * 1e-3
    finally:
        run.close()


def measure_ort(ort, size_mb: int, iters: int) -> dict:
    def model(nodes, inputs, output, inits=()):
        g = helper.make_graph(nodes, "calibrate", inputs, [output], list(inits))
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    n_elems = size_mb * 2**20 // 4
    copy = model([helper.make_node("Mul", ["x", "one"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_elems])],
                 helper.make_tensor_value_info("y", TensorProto.FLOAT, [n_elems]),
                 [numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    x = np.zeros(n_elems, np.float32)
    t_copy = _ort_time(copy, {"x": x}, True, iters)
    del x
    measured = {"copy": {"bytes": 8 * n_elems, "seconds": t_copy, "how": "Mul(x, 1) in onnxruntime"}}
    peaks = {}
    n = MATMUL_N
    for key, dt, npdt, tf32 in (("fp32", TensorProto.FLOAT, np.float32, False),
                                ("tf32", TensorProto.FLOAT, np.float32, True),
                                ("fp16", TensorProto.FLOAT16, np.float16, False)):
        mm = model([helper.make_node("MatMul", ["a", "b"], ["c"])],
                   [helper.make_tensor_value_info("a", dt, [n, n]), helper.make_tensor_value_info("b", dt, [n, n])],
                   helper.make_tensor_value_info("c", dt, [n, n]))
        a = np.random.default_rng(0).standard_normal((n, n)).astype(npdt)
        t = _ort_time(mm, {"a": a, "b": a}, tf32, max(5, iters // 2))
        peaks[key] = 2 * n**3 / t / 1e12
        measured[f"matmul_{key}"] = {"n": n, "seconds": t}
    return {
        "name": "CUDA GPU (calibrated with onnxruntime)",
        "bandwidth_tbps": 8 * n_elems / t_copy / 1e12,
        "peak_tflops": peaks, "conv_tflops": {},
        "source": f"onnxfuse calibrate with onnxruntime {ort.__version__} (wall clock per synchronous run), "
                  f"{datetime.date.today().isoformat()}",
        "measured": measured,
    }


def calibrate(size_mb: int = 1024, iters: int = 20) -> dict:
    if size_mb < 1 or iters < 1:
        raise OnnxfuseError("calibrate: --size-mb and --iters must be at least 1")
    torch = _torch_cuda()
    if torch is not None:
        profile = measure_torch(torch, size_mb, iters)
    else:
        ort = _ort_cuda()
        if ort is None:
            raise OnnxfuseError("calibrate needs a CUDA GPU: neither torch nor onnxruntime "
                                "(CUDAExecutionProvider) sees one on this machine")
        try:
            profile = measure_ort(ort, size_mb, iters)
        except OnnxfuseError:
            raise
        except Exception as e:  # noqa: BLE001 - onnxruntime's exception types
            first = str(e).strip().splitlines()
            raise OnnxfuseError(f"calibrate: onnxruntime: {first[0] if first else type(e).__name__}") from None
    profile = {"key": "calibrated", **profile}
    return profile


def cmd_calibrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_output(out)  # before measuring
    profile = calibrate(args.size_mb, args.iters)
    write_text(out, json.dumps(profile, indent=2) + "\n")
    p = profile["peak_tflops"]
    print(f"{profile['name']}: copy {profile['bandwidth_tbps']:.3g} TB/s; matmul "
          + ", ".join(f"{k} {v:.3g}" for k, v in p.items()) + " TFLOP/s"
          + ("; conv " + ", ".join(f"{k} {v:.3g}" for k, v in profile["conv_tflops"].items()) + " TFLOP/s"
             if profile.get("conv_tflops") else ""))
    print(f"wrote {out} (use it with: onnxfuse analyze MODEL --device {out})")
    return 0
