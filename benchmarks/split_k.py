"""Split K on small outputs: YOLOv8n's deep layers at batch 1 (320² input), one Conv + SiLU
per model, channels-last (the GPU path), fp32.

At batch 1 the 10x10 and 20x20 layers have 100 or 400 output pixels: one to seven tiles of
the plain kernel, each reducing over up to 2304 values, on a GPU of 132 SMs. For each layer:

- ``cudnn``   the original Conv + Sigmoid + Mul in ONNX Runtime's CUDA EP (channels-first)
- ``plain``   onnxfuse without the split-K variant (``ONNXFUSE_CONV_CONFIG=split=0``)
- ``split``   onnxfuse as shipped (the launcher picks the split-K variant for these sizes)

Times: the kernels' device time per run (CUPTI; for onnxfuse the boundary Transposes of the
one-conv model are left out: the kernel's name prefix) and the synchronized latency of a run.

    python benchmarks/split_k.py --json split_k.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_timing import BoundSession, gpu_time_per_call, time_cuda  # noqa: E402
from onnxfuse import library_path, optimize_model  # noqa: E402
from onnxfuse.pipeline import build_options, compile_pass  # noqa: E402

# (C, K, kernel, stride, input H = W) of YOLOv8n at 320², batch 1
LAYERS = [(256, 64, 3, 1, 10), (64, 64, 3, 1, 10), (256, 80, 3, 1, 10), (128, 128, 3, 1, 10),
          (512, 256, 1, 1, 10), (128, 256, 3, 2, 20), (128, 80, 3, 1, 20), (64, 128, 3, 2, 40)]


def conv_silu(c: int, k: int, ks: int, stride: int, size: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((k, c, ks, ks)) / (c * ks * ks) ** 0.5).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b")
    N = helper.make_node
    nodes = [N("Conv", ["x", "w", "b"], ["c"], kernel_shape=[ks, ks], strides=[stride] * 2, pads=[ks // 2] * 4),
             N("Sigmoid", ["c"], ["s"]), N("Mul", ["c", "s"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph(nodes, "conv_silu", [x], [y], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def fused(m: onnx.ModelProto, split: bool) -> onnx.ModelProto:
    """m optimized and compiled channels-last, with or without the split-K variant (through
    ``$ONNXFUSE_CONV_CONFIG``, restored afterwards)."""
    saved = os.environ.get("ONNXFUSE_CONV_CONFIG")
    os.environ["ONNXFUSE_CONV_CONFIG"] = "" if split else "split=0"
    try:
        r = optimize_model(m, layout="nhwc")
        info = compile_pass(r, build_options("auto", "nhwc", tune="off")).report.compile
    finally:
        if saved is None:
            os.environ.pop("ONNXFUSE_CONV_CONFIG", None)
        else:
            os.environ["ONNXFUSE_CONV_CONFIG"] = saved
    if info["failed"] or info["declined"] or not r.fused:
        raise SystemExit(f"not fused: {info['summary']}")
    return r.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    lib = os.environ.get("ONNXFUSE_LIBRARY") or str(library_path())
    rows = []
    for c, k, ks, stride, size in LAYERS:
        m = conv_silu(c, k, ks, stride, size)
        x = torch.randn(1, c, size, size, device="cuda")
        want = None
        row = {"layer": f"{c}->{k} {ks}x{ks} s{stride} at {size}x{size}"}
        for name, model, custom in (("cudnn", m, False), ("plain", fused(m, False), True),
                                    ("split", fused(m, True), True)):
            s = BoundSession(model, {"x": x}, library=lib if custom else None)
            y = s.result()["y"]
            want = y if want is None else want
            prefix = "onnxfuse_" if custom else None
            row[f"{name}_kernel_ms"] = gpu_time_per_call(s.run, prefix=prefix)
            row[f"{name}_latency_ms"] = time_cuda(s.run, args.iters).median_ms
            row[f"{name}_max_abs_err"] = float((y - want).abs().max())
            del s
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| layer | cuDNN kernels | plain | split | split vs plain | latency cuDNN / plain / split |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['cudnn_kernel_ms'] * 1e3:.1f} µs | {r['plain_kernel_ms'] * 1e3:.1f} µs | "
              f"{r['split_kernel_ms'] * 1e3:.1f} µs | {r['plain_kernel_ms'] / r['split_kernel_ms']:.2f}x | "
              f"{r['cudnn_latency_ms']:.4f} / {r['plain_latency_ms']:.4f} / {r['split_latency_ms']:.4f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
