"""GEMMs with an epilogue at BERT-base shapes on the GPU: how close the GemmEpilogue kernels come
to their roofline bound, beside what ONNX Runtime runs for the same nodes (cuBLAS plus its own
fusions: Gemm, BiasGelu, FastGelu) and torch's matmul as a peer.

Workloads (batch 8, seq 128: M = 1024 rows; fp32 and fp16), as torch.onnx.export writes them
(x [B, S, K] @ W [K, N] + b, W an initializer):
- ``qkv``:  768 -> 2304, + bias
- ``ffn1``: 768 -> 3072, + bias, erf-GELU (Div, Erf, Add, Mul, Mul)
- ``ffn2``: 3072 -> 768, + bias, + the residual r [B, S, 768]
- ``ffn``:  the block, ffn1 then ffn2 with x as the residual: two GEMM nodes, where fp32's
  FFN1 stores its output rounded to TF32 for FFN2 (the rounding plan, `gemm-tf32-at-producer`)

Each model is optimized with `onnxfuse optimize --no-tune` and ``ONNXFUSE_GEMM_ALL=1`` (the
gemm kind forced, so that it is measured even where the tune pass would leave the nodes to
ONNX Runtime: `--tune`'s per-node decision is what ships); `onnxfuse bench --provider cuda`
gives both errors against the original in float64 (the optimized model's, and the original's
under ORT's defaults: TF32 for fp32) and the gate (onnxfuse/tools/gate.py); then the original
and the optimized model go through `onnxfuse profile --provider cuda --device h200` (CUPTI
kernel times per node; the roofline bound max(FLOPs / peak, bytes / bandwidth) with the H200
datasheet's numbers, onnxfuse/analyze.py: TF32 494.5 and FP16 989.5 TFLOP/s, 4.8 TB/s). torch
runs the same computation (TF32 allowed for fp32, as ORT's default) timed with CUDA events,
queued back to back. A time ratio is a speedup only where the gate passes. Prints one table
and writes JSON:

    python benchmarks/gemm_roofline.py --json gemm_roofline.json
    python benchmarks/gemm_roofline.py --batch 1 --json gemm_roofline_b1.json   # M = 128: split K
    python benchmarks/gemm_roofline.py --dry-run   # CPU: builds, optimizes (no kernels) and checks the models
    python benchmarks/gemm_roofline.py --ceiling --json gemm_ceiling.json   # cuBLAS's own share of the peak

``--ceiling`` times torch.mm alone (cuBLAS; TF32 for fp32) at BERT-base's products and at
square sizes up to 8192, as TFLOP/s and the share of the datasheet peak the bound divides by:
the most a product reaches on this chip, to read the workloads' shares against.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import roofline_runs as runs  # noqa: E402

BATCH, SEQ = 8, 128
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}
# name -> (K, N, epilogue)
WORKLOADS = {"qkv": (768, 2304, "bias"), "ffn1": (768, 3072, "bias_gelu"), "ffn2": (3072, 768, "bias_residual"),
             "ffn": (768, 768, "block")}
HIDDEN = 3072  # the ffn block's inner width
ENV = {**os.environ, "ONNXFUSE_GEMM_ALL": "1"}


def build(name: str, dtype: str, batch: int = BATCH, seq: int = SEQ, scale: int = 1) -> onnx.ModelProto:
    """The workload's model; `scale` divides K and N (the dry run's small sizes)."""
    k, n, epilogue = WORKLOADS[name]
    k, n = k // scale, n // scale
    t, np_t = DTYPES[dtype]
    rng = np.random.default_rng(0)
    if epilogue == "block":
        return _ffn_block(k, HIDDEN // scale, t, np_t, rng, batch, seq)
    inits = [numpy_helper.from_array((rng.standard_normal((k, n)) / math.sqrt(k)).astype(np_t), "w"),
             numpy_helper.from_array((0.1 * rng.standard_normal(n)).astype(np_t), "b")]
    N = helper.make_node
    nodes = [N("MatMul", ["x", "w"], ["h"], name="matmul"), N("Add", ["h", "b"], ["hb" if epilogue != "bias" else "y"],
                                                             name="bias")]
    inputs = [helper.make_tensor_value_info("x", t, [batch, seq, k])]
    if epilogue == "bias_gelu":
        inits += [numpy_helper.from_array(np.array(v, np_t), name)
                  for name, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
        nodes += [N("Div", ["hb", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["e1"]),
                  N("Mul", ["hb", "e1"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    elif epilogue == "bias_residual":
        nodes.append(N("Add", ["hb", "r"], ["y"], name="residual"))
        inputs.append(helper.make_tensor_value_info("r", t, [batch, seq, n]))
    g = helper.make_graph(nodes, name, inputs, [helper.make_tensor_value_info("y", t, [batch, seq, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _ffn_block(d: int, hidden: int, t: int, np_t, rng, batch: int, seq: int) -> onnx.ModelProto:
    """x -> MatMul w1 + b1 -> erf-GELU -> MatMul w2 + b2 + x: a transformer's FFN as exported."""
    inits = [numpy_helper.from_array((rng.standard_normal((d, hidden)) / math.sqrt(d)).astype(np_t), "w"),
             numpy_helper.from_array((0.1 * rng.standard_normal(hidden)).astype(np_t), "b"),
             numpy_helper.from_array((rng.standard_normal((hidden, d)) / math.sqrt(hidden)).astype(np_t), "w2"),
             numpy_helper.from_array((0.1 * rng.standard_normal(d)).astype(np_t), "b2")]
    inits += [numpy_helper.from_array(np.array(v, np_t), name)
              for name, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    N = helper.make_node
    nodes = [N("MatMul", ["x", "w"], ["h"], name="matmul"), N("Add", ["h", "b"], ["hb"], name="bias"),
             N("Div", ["hb", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["e1"]),
             N("Mul", ["hb", "e1"], ["m"]), N("Mul", ["m", "half"], ["g"]),
             N("MatMul", ["g", "w2"], ["h2"], name="matmul2"), N("Add", ["h2", "b2"], ["hb2"], name="bias2"),
             N("Add", ["hb2", "x"], ["y"], name="residual")]
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", t, [batch, seq, d])],
                          [helper.make_tensor_value_info("y", t, [batch, seq, d])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def accuracy(src: Path, opt: Path, out: Path, provider: str = "cuda") -> dict:
    """`onnxfuse bench`'s errors and gate for the pair, GEMMs matched (roofline_runs.accuracy)."""
    return runs.accuracy(src, opt, out, provider, env=ENV)


def torch_peer(name: str, dtype: str, model: onnx.ModelProto, batch: int = BATCH) -> float:
    """torch's matmul and epilogue on the same inputs, µs per call (CUDA events, queued)."""
    import torch

    from benchmarks.gpu_timing import time_queued

    torch.backends.cuda.matmul.allow_tf32 = True  # as ORT's CUDA default (use_tf32)
    tdt = torch.float32 if dtype == "fp32" else torch.float16
    inits = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()).cuda() for t in model.graph.initializer}
    w, b = inits["w"], inits["b"]
    k, n = (v.type.tensor_type.shape.dim[2].dim_value for v in (model.graph.input[0], model.graph.output[0]))
    x = torch.randn(batch, SEQ, k, device="cuda", dtype=tdt)
    r = torch.randn(batch, SEQ, n, device="cuda", dtype=tdt)
    epilogue = WORKLOADS[name][2]

    def fn():
        if epilogue == "block":
            g = torch.nn.functional.gelu(torch.matmul(x, w) + b)
            return torch.matmul(g, inits["w2"]) + inits["b2"] + x
        h = torch.matmul(x, w) + b
        if epilogue == "bias_gelu":
            return torch.nn.functional.gelu(h)
        if epilogue == "bias_residual":
            return h + r
        return h
    return time_queued(fn, iters=100, warmup=20).median_ms * 1e3


CEILING_SHAPES = ((128, 3072, 768), (1024, 3072, 768), (1024, 768, 3072), (4096, 4096, 4096), (8192, 8192, 8192))


def ceiling(dtypes: list[str]) -> list[dict]:
    """torch.mm's TFLOP/s at CEILING_SHAPES (M, N, K) and its share of the GPU's datasheet peak
    (TF32 for fp32, as ORT's default). Each product is captured in a CUDA graph and replayed under
    CUPTI (`rows_context.cupti_kernel_us`): the kernels' device time, the host's launch left out
    (calls queued from Python are launch-bound below about 30 µs: the H100 run of the forty-third
    session read 30 µs for every BERT-base product that way)."""
    import torch

    from benchmarks.rows_context import cupti_kernel_us
    from onnxfuse.profile import detect_device
    from onnxfuse.roofline import DEVICES

    device = DEVICES[detect_device("cuda")[0]]
    torch.backends.cuda.matmul.allow_tf32 = True
    tmp = Path(tempfile.mkdtemp(prefix="gemm_ceiling_"))
    rows = []
    for dtype in dtypes:
        tdt, peak = (torch.float32, "tf32") if dtype == "fp32" else (torch.float16, "fp16")
        for m, n, k in CEILING_SHAPES:
            a, b = torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(k, n, device="cuda", dtype=tdt)
            c = torch.empty(m, n, device="cuda", dtype=tdt)
            us = sum(cupti_kernel_us(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), tmp, reps=10).values())
            tflops = 2 * m * n * k / us / 1e6
            rows.append({"dtype": dtype, "M": m, "N": n, "K": k, "us": round(us, 2), "tflops": round(tflops, 1),
                         "pct_peak": round(100 * tflops / device.peak_tflops[peak], 1), "device": device.key})
            print(f"cuBLAS {dtype} {m}x{n}x{k}: {us:.1f} us, {tflops:.0f} TFLOP/s, {rows[-1]['pct_peak']:.0f}% of the "
                  f"{peak} peak", flush=True)
    return rows


def dry_run() -> list[dict]:
    """CPU: each workload (small K and N) optimized without kernels; one GemmEpilogue node whose
    function body gives the original's outputs."""
    from onnxfuse.pipeline import build_options, optimize_model
    from tests.util import random_feeds, run

    os.environ["ONNXFUSE_GEMM_ALL"] = "1"
    rows = []
    for name in WORKLOADS:
        for dtype in DTYPES:
            m = build(name, dtype, batch=2, seq=8, scale=16)
            r = optimize_model(m, options=build_options(target="none", tune="off"))
            ops = [n.op_type for n in r.model.graph.node]
            feeds = random_feeds(m, {}, seed=3)
            (want,), (got,) = run(m, feeds), run(r.model, feeds)
            err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
            rows.append({"workload": name, "dtype": dtype, "nodes": ops, "function_body_err": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--no-torch", action="store_true", help="skip the torch peer")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help=f"batch of seq-{SEQ} rows (default {BATCH}: M = {BATCH * SEQ}; 1 gives BERT-base's M = 128)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build and optimize the models, no timing")
    ap.add_argument("--ceiling", action="store_true", help="cuBLAS's product alone at BERT-base and square sizes")
    args = ap.parse_args()
    if args.ceiling:
        rows = ceiling(args.dtypes.split(","))
        if args.json:
            args.json.write_text(json.dumps({"ceiling": True, "rows": rows}, indent=1) + "\n")
        return
    if args.dry_run:
        rows = dry_run()
        if args.json:
            args.json.write_text(json.dumps({"dry_run": True, "rows": rows}, indent=1) + "\n")
        return
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="gemm_roofline_"))
    for wl in args.workloads.split(","):
        for dtype in args.dtypes.split(","):
            tag = f"{wl}_{dtype}"
            src, opt = tmp / f"{tag}.onnx", tmp / f"{tag}.opt.onnx"
            model = build(wl, dtype, batch=args.batch)
            onnx.save(model, src)
            k, n, _ = WORKLOADS[wl]
            row = {"workload": wl, "dtype": dtype, "M": args.batch * SEQ, "N": n, "K": k}
            try:
                runs.cli("optimize", str(src), str(opt), "--no-tune", env=ENV)
                row["accuracy"] = accuracy(src, opt, tmp / f"{tag}.bench.json")
                row.update(runs.profile_pair(src, opt, tmp, tag, "tflops", env=ENV))
                row["fused_pct_bound"] = runs.fused_pct_bound(row, "GemmEpilogue")
                row["speedup_vs_ort"] = row["ort"]["us"] / row["onnxfuse"]["us"] if row["onnxfuse"]["us"] else None
                if not args.no_torch:
                    row["torch_us"] = torch_peer(wl, dtype, model, args.batch)
            except RuntimeError as e:
                row["error"] = str(e)
            runs.keep(rows, row, args.json)
    print("\n| workload | dtype | M x N x K | ORT nodes | ORT µs | GemmEpilogue µs | % of bound | torch µs "
          "| ORT / onnxfuse | ORT err vs ref | onnxfuse err vs ref | gate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['workload']} | {r['dtype']} | | error: {r['error'][:80]} | | | | | | | | |")
            continue
        ort_ops = ", ".join(x["op"] for x in r["ort"]["nodes"])
        pct, acc = r["fused_pct_bound"], r["accuracy"]
        torch_us = r.get("torch_us")
        print(f"| {r['workload']} | {r['dtype']} | {r['M']}x{r['N']}x{r['K']} | {ort_ops} | {r['ort']['us']:.1f} | "
              f"{r['onnxfuse']['us']:.1f} | {'-' if pct is None else f'{pct:.0f}%'} | "
              f"{'-' if torch_us is None else f'{torch_us:.1f}'} | {r['speedup_vs_ort']:.2f} | "
              f"{acc['ort_err']:.2g} | {acc['err']:.2g} | {'pass' if acc['gate_passed'] else 'FAIL'} |")


if __name__ == "__main__":
    from onnxfuse.cli import end_process

    end_process(main() or 0)
