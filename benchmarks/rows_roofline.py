"""Row reductions at BERT-base shapes (and an SD-UNet GroupNorm) on the GPU: how close the FusedRows kernels come to
their roofline bound, beside what ONNX Runtime runs for the same nodes.

Workloads (seq 128, hidden 768, 12 heads; batch 1 and 8; fp32 and fp16):
- ``skip_ln``:  y = LayerNormalization(x + r) * gamma + beta (opset 17 op; ORT fuses the Add
                into SkipLayerNormalization)
- ``ln``:       the decomposed LayerNorm torch's TorchScript exporter writes at opset 16
                (ReduceMean, Sub, Pow, ReduceMean, Add eps, Sqrt, Div, Mul, Add)
- ``softmax``:  Softmax(scores * 0.125 + mask) over the last axis, scores [B, 12, 128, 128],
                mask [B, 1, 1, 128]
- ``group_norm``: SD-UNet's resnet-block norm: SiLU(GroupNorm(x + temb)) over x [B, 320, 64, 64]
                in 32 groups (rows of 10 * 64 * 64 = 40960 elements: the looped kernel, B * 32
                programs), temb [B, 320, 1, 1], in the form torch.onnx.export writes nn.GroupNorm
                (Reshape, InstanceNormalization, Reshape, Mul, Add; then Sigmoid, Mul)

Each model is optimized with `onnxfuse optimize --no-tune --no-leave-to-ort` (the row
kernels forced, so that they are measured even where ORT's own fusion would keep the
nodes); `onnxfuse bench --provider cuda` gives both errors against the original in float64
(the optimized model's and the original's under ORT's defaults) and the gate; then the
original and the optimized model go through `onnxfuse profile --provider cuda --device
h200` (CUPTI kernel times per node, roofline bound from bytes and FLOPs). A time ratio is
a speedup only where the gate passes. Prints one table and writes JSON:

    python benchmarks/rows_roofline.py --json rows_roofline.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import roofline_runs as runs  # noqa: E402

SEQ, HIDDEN, HEADS = 128, 768, 12
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}


def _model(nodes, inputs, outputs, inits, opset: int) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "rows", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def skip_ln(batch: int, dtype: str) -> onnx.ModelProto:
    t, np_t = DTYPES[dtype]
    shape = [batch, SEQ, HIDDEN]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np_t), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(HIDDEN)).astype(np_t), "beta")]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, t, shape) for n in ("x", "r")]
    return _model(nodes, io, [helper.make_tensor_value_info("y", t, shape)], inits, 17)


def ln(batch: int, dtype: str) -> onnx.ModelProto:
    t, np_t = DTYPES[dtype]
    shape = [batch, SEQ, HIDDEN]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np_t), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(HIDDEN)).astype(np_t), "beta"),
             numpy_helper.from_array(np.array(2.0, np_t), "two"),
             numpy_helper.from_array(np.array(1e-5, np_t), "eps")]
    N = helper.make_node
    nodes = [N("ReduceMean", ["x"], ["mu"], axes=[-1]), N("Sub", ["x", "mu"], ["d"]),
             N("Pow", ["d", "two"], ["d2"]), N("ReduceMean", ["d2"], ["var"], axes=[-1]),
             N("Add", ["var", "eps"], ["ve"]), N("Sqrt", ["ve"], ["sd"]), N("Div", ["d", "sd"], ["n"]),
             N("Mul", ["n", "gamma"], ["g"]), N("Add", ["g", "beta"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", t, shape)],
                  [helper.make_tensor_value_info("y", t, shape)], inits, 16)


def softmax(batch: int, dtype: str) -> onnx.ModelProto:
    t, np_t = DTYPES[dtype]
    shape = [batch, HEADS, SEQ, SEQ]
    inits = [numpy_helper.from_array(np.array(0.125, np_t), "scale")]
    nodes = [helper.make_node("Mul", ["scores", "scale"], ["s"]), helper.make_node("Add", ["s", "mask"], ["m"]),
             helper.make_node("Softmax", ["m"], ["y"], axis=-1)]
    io = [helper.make_tensor_value_info("scores", t, shape),
          helper.make_tensor_value_info("mask", t, [batch, 1, 1, SEQ])]
    return _model(nodes, io, [helper.make_tensor_value_info("y", t, shape)], inits, 17)


GN_CHANNELS, GN_GROUPS, GN_SIZE = 320, 32, 64


def group_norm(batch: int, dtype: str) -> onnx.ModelProto:
    t, np_t = DTYPES[dtype]
    shape = [batch, GN_CHANNELS, GN_SIZE, GN_SIZE]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal((GN_CHANNELS, 1, 1))).astype(np_t), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal((GN_CHANNELS, 1, 1))).astype(np_t), "beta"),
             numpy_helper.from_array(np.array([0, GN_GROUPS, -1], np.int64), "split"),
             numpy_helper.from_array(np.ones(GN_GROUPS, np_t), "ones"),
             numpy_helper.from_array(np.zeros(GN_GROUPS, np_t), "zeros")]
    N = helper.make_node
    nodes = [N("Add", ["x", "temb"], ["h"]), N("Reshape", ["h", "split"], ["r"]),
             N("InstanceNormalization", ["r", "ones", "zeros"], ["i"], epsilon=1e-5), N("Shape", ["h"], ["hs"]),
             N("Reshape", ["i", "hs"], ["n0"]), N("Mul", ["n0", "gamma"], ["n1"]), N("Add", ["n1", "beta"], ["n"]),
             N("Sigmoid", ["n"], ["sg"]), N("Mul", ["n", "sg"], ["y"])]
    io = [helper.make_tensor_value_info("x", t, shape),
          helper.make_tensor_value_info("temb", t, [batch, GN_CHANNELS, 1, 1])]
    return _model(nodes, io, [helper.make_tensor_value_info("y", t, shape)], inits, 17)


WORKLOADS = {"skip_ln": skip_ln, "ln": ln, "softmax": softmax, "group_norm": group_norm}


def accuracy(src: Path, opt: Path, out: Path, provider: str = "cuda") -> dict:
    """`onnxfuse bench`'s errors and gate for the pair (roofline_runs.accuracy)."""
    return runs.accuracy(src, opt, out, provider)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rows_roofline_"))
    for wl in args.workloads.split(","):
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                tag = f"{wl}_{dtype}_b{batch}"
                src, opt = tmp / f"{tag}.onnx", tmp / f"{tag}.opt.onnx"
                onnx.save(WORKLOADS[wl](batch, dtype), src)
                row = {"workload": wl, "dtype": dtype, "batch": batch}
                try:
                    runs.cli("optimize", str(src), str(opt), "--no-tune", "--no-leave-to-ort")
                    row["accuracy"] = accuracy(src, opt, tmp / f"{tag}.bench.json")
                    row.update(runs.profile_pair(src, opt, tmp, tag, "gbps"))
                    row["fused_pct_bound"] = runs.fused_pct_bound(row, "FusedRows")
                except RuntimeError as e:
                    row["error"] = str(e)
                runs.keep(rows, row, args.json)
    print("\n| workload | dtype | batch | ORT nodes | ORT µs | onnxfuse nodes | onnxfuse µs | FusedRows % of bound "
          "| ORT err vs ref | onnxfuse err vs ref | gate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['workload']} | {r['dtype']} | {r['batch']} | error: {r['error'][:80]} | | | | | | | |")
            continue
        ort_ops, ours = (", ".join(n["op"] for n in r[w]["nodes"]) for w in ("ort", "onnxfuse"))
        pct, acc = r["fused_pct_bound"], r["accuracy"]
        print(f"| {r['workload']} | {r['dtype']} | {r['batch']} | {ort_ops} | {r['ort']['us']:.2f} | "
              f"{ours} | {r['onnxfuse']['us']:.2f} | {'-' if pct is None else f'{pct:.0f}%'} | "
              f"{acc['ort_err']:.2g} | {acc['err']:.2g} | {'pass' if acc['gate_passed'] else 'FAIL'} |")


if __name__ == "__main__":
    from onnxfuse.cli import end_process

    end_process(main() or 0)
