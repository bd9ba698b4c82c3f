"""Device peaks and the roofline: DRAM bandwidth and dense FLOP/s per precision (datasheet
presets, or what `onnxfuse calibrate` measured), and the time bound max(FLOPs / peak, bytes /
bandwidth) of a node's cost (`onnxfuse.cost`). Used by `analyze`, `profile` and tuning's
measuring order."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from onnxfuse.cost import NodeCost
from onnxfuse.errors import OnnxfuseError
from onnxfuse.files import record_read

DTYPE_PEAKS = ("fp32", "tf32", "fp16")


@dataclass(frozen=True)
class Device:
    """Peak numbers of one device: DRAM bandwidth and dense FLOP/s per precision."""

    key: str
    name: str
    bandwidth_tbps: float  # DRAM bandwidth, TB/s (10^12 bytes/s)
    peak_tflops: dict[str, float]  # "fp32" (CUDA cores), "tf32", "fp16" (dense tensor cores)
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


# Datasheet numbers. Tensor-core peaks are dense (NVIDIA quotes them with 2:4 sparsity, twice
# these); fp32 is the CUDA-core (non-tensor) rate.
DEVICES: dict[str, Device] = {
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: 4.8 TB/s HBM3e, FP32 67 TFLOPS,
    # TF32 Tensor Core 989 TFLOPS* and FP16 Tensor Core 1,979 TFLOPS* (*with sparsity).
    "h200": Device("h200", "NVIDIA H200 SXM", 4.8, {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5},
                   "NVIDIA H200 datasheet (SXM)"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: 3.35 TB/s HBM3, FP32 67 TFLOPS,
    # TF32 989 TFLOPS*, FP16 1,979 TFLOPS* (*with sparsity).
    "h100": Device("h100", "NVIDIA H100 SXM", 3.35, {"fp32": 67.0, "tf32": 494.5, "fp16": 989.5},
                   "NVIDIA H100 datasheet (SXM)"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: 2,039 GB/s HBM2e, FP32 19.5
    # TFLOPS, TF32 156 TFLOPS (312* sparse), FP16 312 TFLOPS (624* sparse).
    "a100": Device("a100", "NVIDIA A100 80GB SXM", 2.039, {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0},
                   "NVIDIA A100 datasheet (80GB SXM)"),
    # NVIDIA L4 Tensor Core GPU datasheet: 300 GB/s GDDR6, FP32 30.3 TFLOPS, TF32 120 TFLOPS*,
    # FP16 242 TFLOPS* (*with sparsity).
    "l4": Device("l4", "NVIDIA L4", 0.3, {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0}, "NVIDIA L4 datasheet"),
    # Not a datasheet: a nominal 2-core x86-64 machine like the CI machine of BENCHMARKS.md
    # (AMD EPYC with AVX-512). 44.5 GB/s: the copy bandwidth measured there (CPU kernel
    # section); fp32 peak: 2 cores x 2 FMA pipes x 16 lanes (AVX-512) x 2 FLOP x 3.0 GHz =
    # 384 GFLOP/s; no tensor cores. Set your machine's with --peak-tflops and --bandwidth-tbps.
    "cpu": Device("cpu", "2-core x86-64 CPU (nominal)", 0.0445, {"fp32": 0.384, "tf32": 0.384, "fp16": 0.384},
                  "nominal: BENCHMARKS.md copy bandwidth, AVX-512 FMA peak at 3 GHz"),
}


def load_device(spec: str) -> Device:
    """A preset name (h200, h100, a100, l4, cpu) or a device profile JSON file
    (what `onnxfuse calibrate` writes)."""
    key = spec.lower()
    if key in DEVICES:
        return DEVICES[key]
    p = Path(spec)
    if not p.is_file():
        raise OnnxfuseError(f"--device {spec}: not a preset ({', '.join(DEVICES)}) nor a device profile file")
    record_read(p)
    try:
        d = json.loads(p.read_text())
        peaks = {k: float(v) for k, v in d["peak_tflops"].items()}
        if "fp32" not in peaks:
            raise KeyError("peak_tflops.fp32")
        for k in DTYPE_PEAKS:
            peaks.setdefault(k, peaks["fp32"])
        bw = float(d["bandwidth_tbps"])
        if bw <= 0 or any(v <= 0 for v in peaks.values()):
            raise ValueError("bandwidth and peaks must be positive")
        return Device(d.get("key", p.stem), d.get("name", p.stem), bw, peaks, d.get("source", str(p)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise OnnxfuseError(f"{p}: not a device profile ({type(e).__name__}: {e}); "
                            "expected {\"bandwidth_tbps\": ..., \"peak_tflops\": {\"fp32\": ...}}") from None


@dataclass(frozen=True)
class Roof:
    """The roofline: DRAM bandwidth and the compute roofs (FLOP/s) for matmul-class and other nodes."""

    device: str
    source: str
    bandwidth: float  # bytes/s
    matrix_peak: float  # FLOP/s for MatMul, Gemm, Conv, ... (the --dtype-peak roof)
    vector_peak: float  # FLOP/s for everything else
    dtype_peak: str

    def peak(self, c: NodeCost) -> float:
        return self.matrix_peak if c.matrix else self.vector_peak

    def ridge(self, matrix: bool = False) -> float:
        return (self.matrix_peak if matrix else self.vector_peak) / self.bandwidth

    def time(self, c: NodeCost) -> float | None:
        """Roofline time estimate in seconds: max(FLOPs / peak, bytes / bandwidth)."""
        if not c.ok or c.flops is None or c.bytes is None:
            return None
        return max(c.flops / self.peak(c), c.bytes / self.bandwidth)

    def bound(self, c: NodeCost) -> str | None:
        i = c.intensity
        if i is None:
            return None
        return "compute" if i >= self.ridge(c.matrix) else "memory"

    def to_dict(self) -> dict:
        return {"device": self.device, "source": self.source, "bandwidth_bytes_per_s": self.bandwidth,
                "matrix_peak_flops": self.matrix_peak, "vector_peak_flops": self.vector_peak,
                "dtype_peak": self.dtype_peak, "ridge_flop_per_byte": self.ridge(True),
                "vector_ridge_flop_per_byte": self.ridge(False)}


def make_roof(device: str | Device | None = "h200", peak_tflops: float | None = None,
              bandwidth_tbps: float | None = None, dtype_peak: str = "fp32") -> Roof:
    dev = device if isinstance(device, Device) else load_device(device or "h200")
    if dtype_peak not in DTYPE_PEAKS:
        raise OnnxfuseError(f"--dtype-peak {dtype_peak}: choose one of {', '.join(DTYPE_PEAKS)}")
    for what, v in (("--peak-tflops", peak_tflops), ("--bandwidth-tbps", bandwidth_tbps)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise OnnxfuseError(f"{what} {v}: must be a positive number")
    bw = (bandwidth_tbps if bandwidth_tbps is not None else dev.bandwidth_tbps) * 1e12
    name, source = dev.name, dev.source
    if peak_tflops is not None:
        matrix = vector = peak_tflops * 1e12
    else:
        matrix = dev.peak_tflops.get(dtype_peak, dev.peak_tflops["fp32"]) * 1e12
        vector = dev.peak_tflops["fp32"] * 1e12
    if peak_tflops is not None or bandwidth_tbps is not None:
        name = f"{name}, overridden" if device else "custom"
        source = f"{source}; --peak-tflops {peak_tflops} --bandwidth-tbps {bandwidth_tbps}"
    return Roof(name, source, bw, matrix, vector, dtype_peak if peak_tflops is None else "custom")
