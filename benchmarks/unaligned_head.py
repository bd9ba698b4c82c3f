"""A product of unaligned output rows in ONNX Runtime's CUDA EP: which ONNX formulation is fast?
The align pass (onnxfuse/align.py; BENCHMARKS.md, Decisions, `align-unaligned-rows`) pads a
language model's head over an odd vocabulary and slices it back: on the H200 GPT-2-small's head
at 1024 rows, fp16, took 620 us as exported, 128 us padded plus 90 us for ORT's Slice (2.3
TB/s). What would take less, and where is the 1 GFLOP floor?

For each shape (rows M, K, vocabulary N) and dtype, one-node models of Y = X W, W [K, N]:
- plain:        MatMul(X, W) (as exported)
- padded_slice: MatMul(X, W padded to 16-byte rows), Slice back to N columns (what align writes)
- padded_split: the same with Split([N, pad]) instead of the Slice (output 0)
- padded_only:  MatMul(X, W padded), no Slice (the padded product alone, Y wider: a floor)
- trans_b:      Gemm(X, W^T, transB=1): B's rows aligned (K), Y's not
Times: the kernels' device time per run (CUPTI through torch's profiler) and the latency of a
run (synchronized, IO binding); errors: max |Y - X W| against float64 (padded_only on its first
N columns).

    python benchmarks/unaligned_head.py --json unaligned_head.json
    python benchmarks/unaligned_head.py --dry-run        # the models on the CPU, no timing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from onnxfuse.align import ALIGN_BYTES  # noqa: E402

# (M rows, K, N vocabulary): GPT-2-small's head at batch 8 and 1 (seq 128), a decode step, and a
# 30522-token vocabulary (BERT's masked-LM head: 61044-byte rows in fp16, not a multiple of 16)
SHAPES = [(1024, 768, 50257), (128, 768, 50257), (1, 768, 50257), (1024, 768, 30522)]
DTYPES = {"fp16": (np.float16, TensorProto.FLOAT16), "fp32": (np.float32, TensorProto.FLOAT)}


def _model(nodes, m: int, k: int, y_cols: int, elem: int, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", elem, [m, k])],
                          [helper.make_tensor_value_info("y", elem, [m, y_cols])], list(inits))
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def formulations(m: int, k: int, w: np.ndarray, elem: int) -> dict[str, onnx.ModelProto]:
    """name -> model; every model's y (padded_only: its first N columns) is x @ w."""
    N = helper.make_node
    n = w.shape[1]
    step = ALIGN_BYTES // w.dtype.itemsize
    wide = -(-n // step) * step
    wp = np.pad(w, [(0, 0), (0, wide - n)])
    init = {"w": numpy_helper.from_array(w, "w"), "wp": numpy_helper.from_array(wp, "wp"),
            "wt": numpy_helper.from_array(np.ascontiguousarray(w.T), "wt"),
            "starts": numpy_helper.from_array(np.array([0], np.int64), "starts"),
            "ends": numpy_helper.from_array(np.array([n], np.int64), "ends"),
            "axes": numpy_helper.from_array(np.array([-1], np.int64), "axes"),
            "sizes": numpy_helper.from_array(np.array([n, wide - n], np.int64), "sizes")}
    return {
        "plain": _model([N("MatMul", ["x", "w"], ["y"])], m, k, n, elem, [init["w"]]),
        "padded_slice": _model([N("MatMul", ["x", "wp"], ["p"]), N("Slice", ["p", "starts", "ends", "axes"], ["y"])],
                               m, k, n, elem, [init[x] for x in ("wp", "starts", "ends", "axes")]),
        "padded_split": _model([N("MatMul", ["x", "wp"], ["p"]), N("Split", ["p", "sizes"], ["y", "rest"], axis=-1)],
                               m, k, n, elem, [init["wp"], init["sizes"]]),
        "padded_only": _model([N("MatMul", ["x", "wp"], ["y"])], m, k, wide, elem, [init["wp"]]),
        "trans_b": _model([N("Gemm", ["x", "wt"], ["y"], transB=1)], m, k, n, elem, [init["wt"]]),
    }


def _inputs(m: int, k: int, n: int, dtype, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    return x, w


def dry_run(shapes, dtypes) -> list[dict]:
    """Every formulation through ONNX Runtime on the CPU: its error against float64."""
    import onnxruntime as ort

    rows = []
    for m, k, n in shapes:
        for name_dt in dtypes:
            dtype, elem = DTYPES[name_dt]
            x, w = _inputs(m, k, n, dtype)
            want = x.astype(np.float64) @ w.astype(np.float64)
            row = {"shape": [m, k, n], "dtype": name_dt}
            for name, model in formulations(m, k, w, elem).items():
                onnx.checker.check_model(model, full_check=True)
                so = ort.SessionOptions()
                so.log_severity_level = 3
                y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
                    ["y"], {"x": x})[0][:, :n]
                row[name + "_max_abs_err"] = float(np.abs(y.astype(np.float64) - want).max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def measure(shapes, dtypes, iters: int) -> list[dict]:
    import torch

    from benchmarks.gpu_timing import BoundSession, gpu_time_per_call, time_cuda

    rows = []
    for m, k, n in shapes:
        for name_dt in dtypes:
            dtype, elem = DTYPES[name_dt]
            x, w = _inputs(m, k, n, dtype)
            want = torch.from_numpy(x).double().cuda() @ torch.from_numpy(w).double().cuda()
            row = {"shape": [m, k, n], "dtype": name_dt, "gflop": 2 * m * k * n / 1e9}
            for name, model in formulations(m, k, w, elem).items():
                s = BoundSession(model, {"x": torch.from_numpy(x).cuda()})
                got = s.result()["y"][:, :n].double()
                row[name + "_ms"] = gpu_time_per_call(s.run)
                row[name + "_latency_ms"] = time_cuda(s.run, iters).median_ms
                row[name + "_max_abs_err"] = float((got - want).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--shapes", default="", help="M:K:N,... (default: GPT-2's head at 1024, 128 and 1 rows, "
                                                 "a 30522-token head)")
    ap.add_argument("--dry-run", action="store_true", help="the models on the CPU: errors, no timing")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",") if s] or SHAPES
    dtypes = [d for d in args.dtypes.split(",") if d]
    rows = dry_run(shapes, dtypes) if args.dry_run else measure(shapes, dtypes, args.iters)
    names = list(formulations(1, 2, np.zeros((2, 3), np.float32), TensorProto.FLOAT))
    key = "_max_abs_err" if args.dry_run else "_ms"
    print("\n| shape (M, K, N) | dtype | " + " | ".join(f"{n}{key}" for n in names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | " + " | ".join(f"{r[n + key]:.4g}" for n in names) + " |")
    if args.json:
        args.json.write_text(json.dumps({"dry_run": args.dry_run, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
