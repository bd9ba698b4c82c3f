"""cuBLASLt's ranked algorithms for BERT-base's products with their bias, against ONNX Runtime's
own kernels for the same nodes: would a GemmEpilogue run by cuBLASLt, its rank searched, beat
ORT on the products onnxfuse leaves to ORT today (QKV, the out-projection and FFN2, whose bias
ORT's SkipLayerNormalization or the attention takes)?

Per BERT-base product (K, N) at each --rows (1024: batch 8 of 128 tokens; 128: batch 1) and
dtype (fp16; fp32 at TF32, ONNX Runtime's default):

- ORT (CUDA EP, its defaults): MatMul(x [B, 128, K], W [K, N]) alone ("matmul") and MatMul +
  Add(bias) ("matmul_add"), each a one-node model;
- onnxfuse: MatMul + Add(bias) as one GemmEpilogue (`ONNXFUSE_GEMM_ALL=1`: the pattern matched
  without tuning), its kernel_meta cut to cuBLASLt's bias epilogue at rank r (`gemm-library-ranks`)
  for each r of --ranks ("rank r"; a rank past what the heuristic returns runs its first).

Each: the kernels' device µs per call (CUPTI, `gpu_activities`), the kernels' names (a split-K
algorithm shows its reduction), the latency of a call under CUDA graphs (`time_cuda`, launch
and gap included), and the max |y - ref| against float64 on the same operands (`err`).

    python benchmarks/gemm_ranks.py --json gemm_ranks.json [--rows 128,1024] [--dtypes fp16,fp32] [--ranks 0-7]
    python benchmarks/gemm_ranks.py --dry-run   # the GemmEpilogue of each product on the CPU (reference), no timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 128
# name: (K, N), BERT-base's products
PRODUCTS = {"qkv": (768, 2304), "out": (768, 768), "ffn1": (768, 3072), "ffn2": (3072, 768)}
DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


def operands(k: int, n: int, dtype: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The product's weight [K, N] and bias [N], seeded."""
    npdt = helper.tensor_dtype_to_np_dtype(DTYPES[dtype])
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((k, n)) / np.sqrt(k)).astype(npdt),
            (0.1 * rng.standard_normal(n)).astype(npdt))


def build(rows: int, k: int, n: int, dtype: str, bias: bool = True) -> onnx.ModelProto:
    """MatMul(x [rows / SEQ, SEQ, K], W) (+ bias) as an ONNX model."""
    elem = DTYPES[dtype]
    w, b = operands(k, n, dtype)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p" if bias else "y"], name="product")]
    inits = [numpy_helper.from_array(w, "w")]
    if bias:
        nodes.append(helper.make_node("Add", ["p", "b"], ["y"], name="bias"))
        inits.append(numpy_helper.from_array(b, "b"))
    batch = rows // SEQ
    g = helper.make_graph(nodes, "product", [helper.make_tensor_value_info("x", elem, [batch, SEQ, k])],
                          [helper.make_tensor_value_info("y", elem, [batch, SEQ, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def fused(m: onnx.ModelProto, compile_for: list[int] | None) -> tuple[onnx.ModelProto, dict]:
    """The model with its MatMul + Add as one GemmEpilogue whose first variant is cuBLASLt's
    (raises otherwise), compiled for `compile_for` (None: not compiled); and its kernel_meta."""
    from onnxfuse import optimize_model
    from onnxfuse.kernels import compile_fused

    os.environ["ONNXFUSE_GEMM_ALL"] = "1"
    r = optimize_model(m)
    if compile_for is not None:
        info, _ = compile_fused(r.model, r.fused, compile_for, conv_precision="tf32")
        if info["failed"]:
            raise RuntimeError(f"compile failed: {info['failed']}")
    (node,) = [nd for nd in r.model.graph.node if nd.op_type == "GemmEpilogue"]
    meta = json.loads(next(a for a in node.attribute if a.name == "kernel_meta").s) if compile_for is not None else {}
    if compile_for is not None and meta["variants"][0].get("library") != "cublaslt":
        raise RuntimeError(f"cuBLASLt does not take this product: {meta['variants'][0]}")
    return r.model, meta


def at_rank(m: onnx.ModelProto, meta: dict, rank: int) -> onnx.ModelProto:
    """`m` with its GemmEpilogue's kernel_meta cut to cuBLASLt's variant at `rank`, no Triton
    fallback (a product cuBLASLt declined would fail, not time a Triton kernel)."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    (node,) = [nd for nd in out.graph.node if nd.op_type == "GemmEpilogue"]
    attr = next(a for a in node.attribute if a.name == "kernel_meta")
    attr.s = json.dumps({**meta, "variants": [{**meta["variants"][0], "rank": rank}], "binaries": []}).encode()
    return out


def _err(y: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> float:
    ref = x.astype(np.float64) @ w.astype(np.float64)
    if b is not None:
        ref = ref + b.astype(np.float64)
    return float(np.abs(y.astype(np.float64) - ref).max())


def gpu_rows(rows: int, dtype: str, ranks: list[int], iters: int) -> list[dict]:
    import torch

    from benchmarks.gpu_timing import BoundSession, gpu_activities, time_cuda
    from onnxfuse import library_path
    from onnxfuse.compile import local_gpu_archs

    lib = library_path()
    archs = local_gpu_archs()
    out = []
    tdt = torch.float32 if dtype == "fp32" else torch.float16
    for name, (k, n) in PRODUCTS.items():
        x = torch.randn(rows // SEQ, SEQ, k, device="cuda").to(tdt)
        xs = x.cpu().numpy()
        w, b = operands(k, n, dtype)
        base, meta = fused(build(rows, k, n, dtype), archs)
        forms = {"matmul": (build(rows, k, n, dtype, bias=False), None, None),
                 "matmul_add": (build(rows, k, n, dtype), None, b)}
        forms.update({f"rank {r}": (at_rank(base, meta, r), lib, b) for r in ranks})
        for form, (m, library, bias) in forms.items():
            row = {"dtype": dtype, "rows": rows, "product": name, "form": form}
            try:
                s = BoundSession(m, {"x": x}, library=library)
                acts = {a: v for a, v in gpu_activities(s.run).items() if "memcpy" not in a.lower()}
                row["device_us"] = round(sum(us for _, us in acts.values()), 2)
                row["kernels"] = sorted(acts)
                row["err"] = _err(s.result()["y"].cpu().numpy(), xs, w, bias)
                del s
                g = BoundSession(m, {"x": x}, library=library, cuda_graph=True)
                row["graph_us"] = round(time_cuda(g.run, iters, warmup=10).median_ms * 1e3, 2)
                del g
            except Exception as e:  # one form failing (cuBLASLt declining at a rank) leaves the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append(row)
            if "error" in row:
                print(f"{dtype} M={rows:<5} {name:5} {form:10} failed: {row['error']}", flush=True)
                continue
            kernels = ", ".join(kn[:60] for kn in row["kernels"])
            print(f"{dtype} M={rows:<5} {name:5} {form:10} device {row['device_us']:7.2f} µs  graph call "
                  f"{row['graph_us']:7.2f} µs  err {row['err']:.2g}  [{kernels}]", flush=True)
    return out


def dry_run() -> list[dict]:
    """Each product at a few rows as the GemmEpilogue the GPU run times, evaluated by onnxfuse's
    reference on the CPU: within the dtype's rounding of the float64 product + bias."""
    from onnxfuse.reference import evaluate

    out = []
    for dtype in DTYPES:
        npdt = helper.tensor_dtype_to_np_dtype(DTYPES[dtype])
        for name, (k, n) in PRODUCTS.items():
            m, _ = fused(build(SEQ, k, n, dtype), None)
            ops = [nd.op_type for nd in m.graph.node]
            if ops != ["GemmEpilogue"]:
                raise AssertionError(f"{dtype} {name}: {ops}, not one GemmEpilogue")
            x = np.random.default_rng(1).standard_normal((1, SEQ, k)).astype(npdt)
            w, b = operands(k, n, dtype)
            y = np.asarray(evaluate(m, {"x": x})["y"])
            err = _err(y, x, w, b)
            ref = x.astype(np.float64) @ w.astype(np.float64) + b
            bound = float(np.abs(ref).max()) * (2.0**-9 if dtype == "fp16" else 1e-5)
            print(f"{dtype} {name:5} GemmEpilogue err {err:.2g} (bound {bound:.2g})")
            if not err <= bound:
                raise AssertionError(f"{dtype} {name}: {err:.3g} from float64, above {bound:.3g}")
            out.append({"dtype": dtype, "product": name, "err": err})
    return out


def _ranks(text: str) -> list[int]:
    if "-" in text:
        lo, hi = (int(v) for v in text.split("-"))
        return list(range(lo, hi + 1))
    return [int(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", default="128,1024", help="M values (multiples of 128), comma-separated")
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--ranks", default="0-7", help="cuBLASLt ranks: 0-7 or 0,2,5 (0: the heuristic's first)")
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--dry-run", action="store_true", help="the GemmEpilogues on the CPU (reference), no timing")
    args = ap.parse_args()
    if args.dry_run:
        result = {"benchmark": "gemm_ranks", "rows": dry_run()}
    else:
        import torch

        wanted = args.products.split(",")
        for p in list(PRODUCTS):
            if p not in wanted:
                del PRODUCTS[p]
        out = []
        for dtype in args.dtypes.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                out += gpu_rows(rows, dtype, _ranks(args.ranks), args.iters)
                if args.json:  # after every group: a time limit keeps what ran
                    args.json.write_text(json.dumps({"benchmark": "gemm_ranks", "device": torch.cuda.get_device_name(),
                                                     "rows": out}, indent=1) + "\n")
        result = {"benchmark": "gemm_ranks", "device": torch.cuda.get_device_name(), "rows": out}
        print("\n| dtype | M | product | form | device µs | graph call µs | err vs float64 | kernels |")
        print("|---|---|---|---|---|---|---|---|")
        for r in out:
            if "error" not in r:
                print(f"| {r['dtype']} | {r['rows']} | {r['product']} | {r['form']} | {r['device_us']} | "
                      f"{r['graph_us']} | {r['err']:.2g} | {len(r['kernels'])} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
