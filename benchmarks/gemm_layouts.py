"""cuBLAS's float32 products by the weight's layout, in ONNX Runtime and alone: why `onnxfuse.kmajor`
hands ORT's products their weights K-major, and what that costs without CUDA graphs.

A Hopper TF32 tensor-core product reads both operands K-major; an exported MatMul's weight
[K, N] is N-major. Per BERT-base product (FFN1, FFN2, QKV, the out-projection) at each --rows
(1024: batch 8 of 128 tokens; 128: batch 1), fp32 (TF32, ONNX Runtime's default) and fp16:

- ONNX Runtime (CUDA EP, its defaults): a model of L independent products of one input in one
  of three forms: ``matmul`` MatMul(x [B, 128, K], W [K, N]) as exported; ``gemm`` Reshape to
  rows, Gemm(rows, W), Reshape back (what the bias pass writes); ``gemm_tn`` the same Gemm with
  W transposed and transB 1 (what `onnxfuse.kmajor` writes). At L = 2 and L = 16 (LENGTHS): the
  latency per product without CUDA graphs (host dispatch and launches included: `time_cuda`) and
  with them, the kernels' device time per product (CUPTI) and how many GPU activities one
  product launches (a split-K kernel's memset or reduction shows there).
- torch alone: mm(a, W) ("nn"), mm(a, Wt.T) ("tn"), addmm(bias, a, Wt.T) (cuBLASLt's bias
  epilogue), the kernels' median CUPTI times over REPS calls captured in a CUDA graph
  (`rows_context.cupti_kernel_us`).

Every time has its error beside it: the first product's max |y - ref| against float64 on the
same operands (`err`; TF32 for float32, as ONNX Runtime's default and torch's matmul here).

    python benchmarks/gemm_layouts.py --json gemm_layouts.json [--rows 1024,128] [--dtypes fp32,fp16]
    python benchmarks/gemm_layouts.py --dry-run   # the three forms on the CPU: equal outputs, no timing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 128
# name: (K, N), BERT-base's products
PRODUCTS = {"ffn1": (768, 3072), "ffn2": (3072, 768), "qkv": (768, 2304), "out": (768, 768)}
FORMS = ("matmul", "gemm", "gemm_tn")
LENGTHS = (2, 16)
REPS = 50
DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}


def weights(k: int, n: int, dtype: str, length: int, seed: int = 0) -> list[np.ndarray]:
    """The products' weights [K, N], seeded."""
    npdt = helper.tensor_dtype_to_np_dtype(DTYPES[dtype])
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((k, n)) / np.sqrt(k)).astype(npdt) for _ in range(length)]


def build(form: str, rows: int, k: int, n: int, dtype: str, length: int, seed: int = 0) -> onnx.ModelProto:
    """`length` products of x [rows / SEQ, SEQ, K] in `form` (module notes), each with its own
    weight (`weights`), each output a graph output [rows / SEQ, SEQ, N]."""
    elem = DTYPES[dtype]
    batch = rows // SEQ
    inits = [] if form == "matmul" else [numpy_helper.from_array(np.array([-1, k], np.int64), "rows_shape"),
                                         numpy_helper.from_array(np.array([batch, SEQ, n], np.int64), "out_shape")]
    nodes, outputs = [], []
    for i, w in enumerate(weights(k, n, dtype, length, seed)):
        y = f"y{i}"
        outputs.append(helper.make_tensor_value_info(y, elem, [batch, SEQ, n]))
        if form == "matmul":
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [y], name=f"p{i}"))
            continue
        tn = form == "gemm_tn"
        inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T) if tn else w, f"w{i}"))
        nodes += [helper.make_node("Reshape", ["x", "rows_shape"], [f"r{i}"]),
                  helper.make_node("Gemm", [f"r{i}", f"w{i}"], [f"g{i}"], name=f"p{i}", transB=int(tn)),
                  helper.make_node("Reshape", [f"g{i}", "out_shape"], [y])]
    g = helper.make_graph(nodes, f"{form}_x{length}", [helper.make_tensor_value_info("x", elem, [batch, SEQ, k])],
                          outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _err(y, x, w: np.ndarray, bias=None) -> float:
    """max |y - (x @ w + bias)| against float64 (y, x, bias torch tensors; w numpy [K, N])."""
    import torch

    ref = x.double() @ torch.from_numpy(w.astype(np.float64)).to(x.device)
    if bias is not None:
        ref = ref + bias.double()
    return float((y.double() - ref).abs().max())


def ort_rows(rows: int, dtype: str, iters: int) -> list[dict]:
    import torch

    from benchmarks.gpu_timing import BoundSession, gpu_activities, time_cuda

    out = []
    tdt = torch.float32 if dtype == "fp32" else torch.float16
    for name, (k, n) in PRODUCTS.items():
        x = torch.randn(rows // SEQ, SEQ, k, device="cuda").to(tdt)
        for form in FORMS:
            row = {"dtype": dtype, "rows": rows, "product": name, "form": form}
            lat = {}
            for length in LENGTHS:
                m = build(form, rows, k, n, dtype, length)
                for graph in (False, True):
                    s = BoundSession(m, {"x": x}, cuda_graph=graph)
                    lat[length, graph] = time_cuda(s.run, iters, warmup=10).median_ms
                    if length == LENGTHS[-1] and not graph:
                        acts = {a: v for a, v in gpu_activities(s.run).items() if "memcpy" not in a.lower()}
                        row["device_us"] = round(sum(us for _, us in acts.values()) / length, 2)
                        row["activities_per_product"] = round(sum(c for c, _ in acts.values()) / length, 2)
                        row["kernels"] = sorted(acts)[:4]
                        row["err"] = _err(s.result()["y0"], x, weights(k, n, dtype, 1)[0])
                    del s
            span = LENGTHS[-1] - LENGTHS[0]
            row["plain_us"] = round((lat[LENGTHS[-1], False] - lat[LENGTHS[0], False]) / span * 1e3, 2)
            row["graph_us"] = round((lat[LENGTHS[-1], True] - lat[LENGTHS[0], True]) / span * 1e3, 2)
            out.append(row)
            print(f"ort   {dtype} M={rows:<5} {name:5} {form:8} device {row['device_us']:7.2f} µs  plain "
                  f"{row['plain_us']:7.2f}  graph {row['graph_us']:7.2f}  activities {row['activities_per_product']}"
                  f"  err {row['err']:.2g}", flush=True)
    return out


def torch_rows(rows: int, dtype: str, tmp: Path) -> list[dict]:
    import torch

    from benchmarks.rows_context import cupti_kernel_us

    tdt = torch.float32 if dtype == "fp32" else torch.float16
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # ONNX Runtime's default math for float32
    out = []
    try:
        for name, (k, n) in PRODUCTS.items():
            a = torch.randn(rows, k, device="cuda").to(tdt)
            w = torch.from_numpy(weights(k, n, dtype, 1)[0]).cuda()  # [K, N]: N-major, as exported
            wt = w.t().contiguous()  # [N, K]: K-major
            b = torch.randn(n, device="cuda").to(tdt)
            variants = {"nn": lambda a=a, w=w: torch.mm(a, w), "tn": lambda a=a, wt=wt: torch.mm(a, wt.t()),
                        "addmm_tn": lambda a=a, wt=wt, b=b: torch.addmm(b, a, wt.t())}
            row = {"dtype": dtype, "rows": rows, "product": name}
            for label, fn in variants.items():
                row[f"{label}_us"] = round(sum(cupti_kernel_us(fn, tmp, REPS).values()), 2)
                row[f"{label}_err"] = _err(fn(), a, weights(k, n, dtype, 1)[0], b if label == "addmm_tn" else None)
            out.append(row)
            print(f"torch {dtype} M={rows:<5} {name:5} " + "  ".join(
                f"{label} {row[f'{label}_us']:7.2f} µs (err {row[f'{label}_err']:.2g})" for label in variants),
                flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return out


def dry_run() -> list[dict]:
    """The three forms at small sizes on ONNX Runtime's CPU provider: each product's output
    equal to the MatMul form's (the same weights), within the dtype's rounding."""
    import onnxruntime as ort

    rows = []
    for dtype in DTYPES:
        npdt = helper.tensor_dtype_to_np_dtype(DTYPES[dtype])
        x = np.random.default_rng(1).standard_normal((2, SEQ, 48)).astype(npdt)
        got = {}
        for form in FORMS:
            m = build(form, 2 * SEQ, 48, 40, dtype, 2)
            sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            got[form] = sess.run(None, {"x": x})
        for form in FORMS:
            err = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
                      for a, b in zip(got[form], got["matmul"], strict=True))
            scale = max(float(np.abs(a.astype(np.float64)).max()) for a in got["matmul"])
            bound = scale * (2.0**-9 if dtype == "fp16" else 1e-5)
            rows.append({"dtype": dtype, "form": form, "err": err})
            print(f"{dtype} {form:8} err {err:.2g} (bound {bound:.2g})")
            if not err <= bound:
                raise AssertionError(f"{dtype} {form}: {err:.3g} from the MatMul form, above {bound:.3g}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rows", default="1024,128", help="M values (multiples of 128), comma-separated")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--dry-run", action="store_true", help="the forms on the CPU (equal outputs), no timing")
    args = ap.parse_args()
    if args.dry_run:
        result = {"benchmark": "gemm_layouts", "rows": dry_run()}
    else:
        import tempfile

        import torch

        ort_out, torch_out = [], []
        tmp = Path(tempfile.mkdtemp(prefix="gemm-layouts-"))
        for dtype in args.dtypes.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                torch_out += torch_rows(rows, dtype, tmp)
                ort_out += ort_rows(rows, dtype, args.iters)
        result = {"benchmark": "gemm_layouts", "device": torch.cuda.get_device_name(), "ort": ort_out,
                  "torch": torch_out}
        print("\n| dtype | M | product | form | device µs | activities | plain µs / product | graph µs / product "
              "| err vs float64 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in ort_out:
            print(f"| {r['dtype']} | {r['rows']} | {r['product']} | {r['form']} | {r['device_us']} | "
                  f"{r['activities_per_product']} | {r['plain_us']} | {r['graph_us']} | {r['err']:.2g} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
