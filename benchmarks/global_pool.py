"""Global average pooling of a channels-last tensor in ONNX Runtime's CUDA EP: which ONNX
formulation is fast? The NHWC layout pass (onnxfuse.layout) keeps MobileNet's
squeeze-excite channels-last only if it can average [N, H, W, C] over H and W cheaply.

For each shape (MobileNetV3-small's squeeze-excite inputs at batch 32), one-node models:
- nchw_gap:       GlobalAveragePool of the NCHW tensor (what the original model runs)
- nhwc_reducemean: ReduceMean over axes (1, 2), keepdims, of the NHWC tensor
- nhwc_matmul:    Reshape to [N, H*W, C], MatMul by a [1, H*W] row of 1/(H*W), Reshape to
                  [N, 1, 1, C]
- nhwc_transpose_gap: Transpose to NCHW, then GlobalAveragePool
- nhwc_matmul_split: the MatMul split in two where H*W has a divisor S near its square root:
                  [N, S, H*W/S, C] times a row of 1/(H*W) over H*W/S, then a row of ones
                  over S (cuBLAS runs the one long MatMul as a GEMV parallel over C only)
Times: device time of the kernels per run (CUPTI), and the latency of a run (synchronized,
IO binding), with the memory floor of reading X once.

    python benchmarks/global_pool.py --json global_pool.json
    python benchmarks/global_pool.py --shapes b1 --json global_pool_b1.json   # EfficientNet-B0's at batch 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_timing import BoundSession, copy_bandwidth, gpu_time_per_call, time_cuda  # noqa: E402

SHAPES = {  # N, H, W, C
    "mbv3": [(32, 56, 56, 16), (32, 14, 14, 96), (32, 14, 14, 240), (32, 7, 7, 576)],
    # EfficientNet-B0's squeeze-excite inputs at batch 1, its first at batch 16
    "b1": [(1, 112, 112, 32), (1, 56, 56, 96), (1, 56, 56, 144), (1, 28, 28, 240), (1, 14, 14, 480),
           (1, 7, 7, 1152), (16, 112, 112, 32)],
}


def _split(hw: int) -> int:
    """The divisor of hw nearest its square root from below (1 for a prime)."""
    return max(d for d in range(1, int(hw ** 0.5) + 1) if hw % d == 0)


def _model(nodes, x_shape, y_shape, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "global_pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def formulations(n: int, h: int, w: int, c: int) -> dict[str, tuple[onnx.ModelProto, tuple[int, ...]]]:
    """name -> (model, input shape); every model's y is the per-channel mean."""
    N = helper.make_node
    nhwc, nchw = [n, h, w, c], [n, c, h, w]
    s = _split(h * w)
    row = numpy_helper.from_array(np.full((1, h * w), 1.0 / (h * w), np.float32), "row")
    s3 = numpy_helper.from_array(np.array([0, h * w, c], np.int64), "s3")
    s4 = numpy_helper.from_array(np.array([0, 1, 1, c], np.int64), "s4")
    return {
        "nchw_gap": (_model([N("GlobalAveragePool", ["x"], ["y"])], nchw, [n, c, 1, 1]), tuple(nchw)),
        "nhwc_reducemean": (_model([N("ReduceMean", ["x"], ["y"], axes=[1, 2], keepdims=1)], nhwc, [n, 1, 1, c]),
                            tuple(nhwc)),
        "nhwc_matmul": (_model([N("Reshape", ["x", "s3"], ["x3"]), N("MatMul", ["row", "x3"], ["m"]),
                                N("Reshape", ["m", "s4"], ["y"])], nhwc, [n, 1, 1, c], [row, s3, s4]), tuple(nhwc)),
        "nhwc_transpose_gap": (_model([N("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]),
                                       N("GlobalAveragePool", ["t"], ["y"])], nhwc, [n, c, 1, 1]), tuple(nhwc)),
        "nhwc_matmul_split": (_model(
            [N("Reshape", ["x", "s4s"], ["x4"]), N("MatMul", ["rows", "x4"], ["part"]),
             N("Reshape", ["part", "s3s"], ["p3"]), N("MatMul", ["ones", "p3"], ["m"]),
             N("Reshape", ["m", "s4"], ["y"])], nhwc, [n, 1, 1, c],
            [numpy_helper.from_array(np.array([0, s, h * w // s, c], np.int64), "s4s"),
             numpy_helper.from_array(np.full((1, h * w // s), 1.0 / (h * w), np.float32), "rows"),
             numpy_helper.from_array(np.array([0, s, c], np.int64), "s3s"),
             numpy_helper.from_array(np.ones((1, s), np.float32), "ones"), s4]), tuple(nhwc)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="mbv3")
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for n, h, w, c in SHAPES[args.shapes]:
        x = torch.randn(n, h, w, c, device="cuda")
        want = x.mean(dim=(1, 2))
        row = {"shape_nhwc": [n, h, w, c], "floor_ms": x.numel() * 4 / bw * 1e3}
        for name, (m, shape) in formulations(n, h, w, c).items():
            feed = x if shape == (n, h, w, c) else x.permute(0, 3, 1, 2).contiguous()
            s = BoundSession(m, {"x": feed})
            got = s.result()["y"].reshape(n, c)
            row[name + "_ms"] = gpu_time_per_call(s.run)  # the kernels' device time
            row[name + "_latency_ms"] = time_cuda(s.run, args.iters).median_ms
            row[name + "_max_abs_err"] = float((got - want).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(formulations(1, 2, 2, 1))
    print("\n| N, H, W, C | floor | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for r in rows:
        print(f"| {r['shape_nhwc']} | {r['floor_ms']:.4f} | " + " | ".join(f"{r[k + '_ms']:.4f}" for k in names) + " |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth_tbps": bw / 1e12,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
