"""GemmEpilogue tiles at BERT-base shapes against cuBLAS: which tile, and how far from cuBLAS.

Issue 17 asks for a Triton GEMM with its bias-GELU epilogue that beats cuBLAS plus ORT's own
fusion of the same nodes (BiasGelu). In the models (fifteenth session, BERT-base b8 fp16) the
fused FFN1 took 23.4 us where cuBLAS plus BiasGelu took 16.7, so tuning gave it back. This
sweep times the kernel `onnxfuse.codegen_gemm` generates for each workload over a set of tiles
(the shipped `TILES` and Hopper-sized ones: 128x256, 256x128, 64x256, 4-warp 128x128), each
plain and, where the plain grid leaves most SMs idle, split K, beside torch's cuBLAS product
alone (`torch.mm`, the lower bound of what ORT runs for the product) and cuBLASLt with its
own fused epilogue where torch exposes it (`addmm`: bias; `_addmm_activation`: bias + tanh
GELU).

Workloads, x [M, K] @ W [K, N] (M = batch x 128 rows, fp16 unless --dtypes says fp32, where
the kernels multiply at TF32 rounded to nearest as cuBLAS does and torch is allowed TF32):
- ``qkv``:  768 -> 2304, + bias
- ``ffn1``: 768 -> 3072, + bias, erf-GELU (the 16-bit program: `relax_16bit`'s form)
- ``ffn1_bias``: 768 -> 3072, + bias (the GELU's share of ffn1)
- ``ffn2``: 3072 -> 768, + bias + residual
- ``proj``: 768 -> 768, + bias + residual

Every callable is timed by `triton.testing.do_bench_cudagraph` (its launches captured in a CUDA
graph, so no launch cost: kernel time, as CUPTI reports in `onnxfuse profile`; median of the
replays), cycling through enough copies of the operands (`--copies`, default 12) that the
working set exceeds the H200's 50 MB L2, as a model's layers do (their weights are never
resident). The output of each kernel is compared with float64 (max |y - ref| over the whole
output; the reference computes the original graph's math exactly on the fp16 inputs), next to
the same error of torch's unfused fp16 result (product rounded to fp16, then the epilogue in
fp16 ops: the original graph under a framework). A split-K launch includes the zeroing of its
arrival counters (a memset, as the C++ launcher does).

Needs torch with CUDA and triton (not onnxruntime):

    python benchmarks/gemm_tiles.py --json gemm_tiles.json
    python benchmarks/gemm_tiles.py --batch 1 --workloads ffn1,qkv --json gemm_tiles_b1.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.conv_kernels import _load  # noqa: E402
from onnxfuse.codegen_gemm import TILES, GemmSpec, GemmVariant, generate_gemm  # noqa: E402
from onnxfuse.expr import HEADER, parse, relax_16bit  # noqa: E402

SEQ = 128
# name -> (K, N, epilogue program: the product %0, the bias %1 and, where there is one, the residual %2)
BIAS = ["%2 = add %0 %1", "output %2 {dt}"]
BIAS_RESIDUAL = ["input %2 {dt}", "%3 = add %0 %1", "%4 = add %3 %2", "output %4 {dt}"]
WORKLOADS = {
    "qkv": (768, 2304, BIAS),
    "ffn1": (768, 3072, ["%2 = add %0 %1", "%3 = div %2 {sqrt2}", "%4 = erf %3", "%5 = add %4 1.0",
                         "%6 = mul %2 %5", "%7 = mul %6 0.5", "output %7 {dt}"]),
    "ffn1_bias": (768, 3072, BIAS),
    "ffn2": (3072, 768, BIAS_RESIDUAL),
    "proj": (768, 768, BIAS_RESIDUAL),
}
# Tiles swept (block_m, block_n, block_k, warps, stages) by dtype: the shipped TILES first.
EXTRA_TILES = {
    "f16": [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4), (128, 128, 64, 4, 4),
            (128, 64, 64, 4, 4), (128, 128, 128, 8, 2), (64, 128, 128, 4, 3)],
    "f32": [(128, 256, 32, 8, 3), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4)],
}
SMS = 132
SPLIT_MIN_BLOCKS, SPLIT_MAX = 4, 16


def residual(name: str) -> bool:
    return WORKLOADS[name][2] is BIAS_RESIDUAL


def program(name: str, dt: str):
    """The workload's epilogue program, in the 16-bit forms (`relax_16bit`) for fp16."""
    sqrt2 = "1.4140625" if dt == "f16" else "1.4142135381698608"  # the exporter's constant in dt
    lines = ["input %0 {dt}", "input %1 {dt}", *WORKLOADS[name][2]]
    text = "\n".join([HEADER, *lines]).format(dt=dt, sqrt2=sqrt2) + "\n"
    prog = parse(text)
    return relax_16bit(prog) if dt == "f16" else prog


def tiles(dt: str) -> list[tuple[int, int, int, int, int]]:
    key = "f32" if dt == "f32" else "f16"
    out = [t[key] for t in TILES.values()]
    return out + [t for t in EXTRA_TILES[key] if t not in out]


def variants(dt: str, m: int, n: int, k: int) -> list[GemmVariant]:
    """Each tile aligned, and its split-K variant where the plain grid fills at most half the SMs."""
    out = []
    for bm, bn, bk, w, s in tiles(dt):
        if bm > max(16, m):
            continue
        v = GemmVariant(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, aligned=True)
        out.append(v)
        most = min(SPLIT_MAX, -(-k // bk) // SPLIT_MIN_BLOCKS)
        if most >= 2 and 2 * v.tiles(m, n) <= SMS:
            out.append(GemmVariant(**{**v.__dict__, "split": most}))
    return out


def float64_reference(name: str, x, w, b, r):
    import torch

    h = x.double() @ w.double() + b.double()
    if name == "ffn1":
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    if r is not None:
        h = h + r.double()
    return h


def max_error(y, ref) -> float:
    return float((y.double() - ref).abs().max())


def framework_result(name: str, x, w, b, r):
    """The original graph's math in the operands' dtype, op by op (torch eager)."""
    import torch

    h = torch.mm(x, w) + b
    if name == "ffn1":
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h + r if r is not None else h


def cycled(sets: list[tuple], fn, outs: list | None = None):
    """A callable that runs fn on the next operand set (and its own output buffer) at each call:
    captured `len(sets)` times or more in a CUDA graph, the replays walk through every copy, so
    no copy's operands are still in L2 from its last run when the sets together exceed L2."""
    state = {"i": 0}

    def call():
        j = state["i"] % len(sets)
        fn(*sets[j], *([outs[j]] if outs is not None else []))
        state["i"] += 1
    return call


def draw_sets(name: str, m: int, dtype, copies: int, device: str = "cuda", scale: int = 1) -> list[tuple]:
    """`copies` seeded operand sets (x [M, K], W [K, N] scaled by 1/sqrt(K), the bias, the
    residual or None) of a workload; `scale` divides K and N (the dry run's sizes)."""
    import torch

    k, n = (d // scale for d in WORKLOADS[name][:2])
    gen = torch.Generator(device=device).manual_seed(17)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    return [(draw(m, k), draw(k, n, scale=k ** -0.5), draw(n, scale=0.1), draw(m, n) if residual(name) else None)
            for _ in range(copies)]


def launcher(fn, ks, v: GemmVariant, m: int, n: int, k: int, device: str):
    """launch(x, w, b, r, y) of a generated kernel with the parameters and grid the C++
    launcher passes (x [M, K] @ w [K, N], the bias b, the residual r or None), or None for a
    split-K variant the launcher would not run at this size. A split launch zeroes its arrival
    counters first, as the launcher does (a memset)."""
    import torch

    slices = v.slices(m, n, k, 1) if v.split_k else 0
    if v.split_k and slices < 2:
        return None
    ws = torch.empty(max(1, slices * v.tiles(m, n) * v.block_m * v.block_n), device=device)
    cnt = torch.zeros(max(1, v.tiles(m, n)), dtype=torch.int32, device=device)
    grid, consts = v.grid(m, n, 1, slices), dict(ks.constexprs)

    def launch(x, w, b, r, y):
        ints = [m, n, k, 0, k, 0, n]
        if v.split_k:
            cnt.zero_()
            ints += [ws, cnt]
        fn[grid](x, w, b, *([r] if r is not None else []), y, *ints, num_warps=ks.num_warps,
                 num_stages=ks.num_stages, **consts)
    return launch


def interpreted(fn) -> None:
    """Run `fn` (a script's dry run) under Triton's interpreter, with the stand-ins the tests
    install for it (libdevice in numpy, run-time loop bounds); exits where TRITON_INTERPRET=1
    was not set before triton was imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run runs under Triton's interpreter: set TRITON_INTERPRET=1")
    from tests.test_codegen import _install_libdevice_shims
    from tests.test_rows_codegen import install_index_fix

    _install_libdevice_shims()
    install_index_fix()
    fn()


def dry_run() -> list[dict]:
    """CPU, under Triton's interpreter (TRITON_INTERPRET=1): every workload at a sixteenth of its
    K and N and 32 rows, one small tile plain and split K, against float64; raises where a
    kernel's error exceeds fp16's rounding of the output (2^-10 of its largest value)."""
    import torch

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="gemm-tiles-dry-"))
    m = 32
    for name, (k, n, _) in WORKLOADS.items():
        k, n = k // 16, n // 16
        x, w, b, r = draw_sets(name, m, torch.float16, 1, "cpu", scale=16)[0]
        ref = float64_reference(name, x, w, b, r)
        spec = GemmSpec(f"k_{name}_dry", program(name, "f16"), ("row", "full") if r is not None else ("row",),
                        m=m, n=n, k=k, batch=1)
        small = GemmVariant(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2, aligned=True)
        for i, v in enumerate((small, GemmVariant(**{**small.__dict__, "split": 2}))):
            ks = generate_gemm(spec, v)
            fn = _load(ks.source.replace(spec.name, f"{spec.name}_{i}"), f"{spec.name}_{i}", tmp)
            y = torch.empty(m, n, dtype=torch.float16)
            launch = launcher(fn, ks, v, m, n, k, "cpu")
            assert launch is not None, f"{name}: the split variant does not run at this size"
            cycled([(x, w, b, r)], launch, [y])()  # as the timed path calls it
            err = max_error(y, ref)
            bound = float(ref.abs().max()) * 2.0**-10
            rows.append({"workload": name, "split": v.split_k, "err": err, "bound": bound})
            print(f"{name:10} {'split K' if v.split_k else 'plain':8} err {err:.2g} (bound {bound:.2g})")
            if not err <= bound:
                raise AssertionError(f"{name}: error {err:.3g} above {bound:.3g}")
    return rows


def run(args) -> list[dict]:
    import torch
    from triton.testing import do_bench_cudagraph

    torch.backends.cuda.matmul.allow_tf32 = True  # ORT's default for fp32 products
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="gemm-tiles-"))
    for dtype in args.dtypes.split(","):
        dt = {"fp16": "f16", "fp32": "f32"}[dtype]
        tdt = {"f16": torch.float16, "f32": torch.float32}[dt]
        for name in args.workloads.split(","):
            k, n, _ = WORKLOADS[name]
            m = args.batch * SEQ
            with_r = residual(name)
            sets = draw_sets(name, m, tdt, args.copies)
            x, w, b, r = sets[0]
            ref = float64_reference(name, x, w, b, r)
            flops = 2.0 * m * n * k
            peer = {}
            peer["cublas mm"] = do_bench_cudagraph(cycled(sets, lambda x, w, b, r: torch.mm(x, w)), rep=args.rep,
                                                   return_mode="median")
            peer["cublasLt addmm (bias)"] = do_bench_cudagraph(
                cycled(sets, lambda x, w, b, r: torch.addmm(b, x, w)), rep=args.rep, return_mode="median")
            if name == "ffn1":
                peer["cublasLt bias+tanh-GELU"] = do_bench_cudagraph(
                    cycled(sets, lambda x, w, b, r: torch._addmm_activation(b, x, w, use_gelu=True)), rep=args.rep,
                    return_mode="median")
            framework_err = max_error(framework_result(name, x, w, b, r), ref)
            spec = GemmSpec(f"k_{name}_{dt}", program(name, dt), ("row", "full") if with_r else ("row",),
                            precision="tf32", m=m, n=n, k=k, batch=1)
            for i, v in enumerate(variants(dt, m, n, k)):
                label = f"{v.block_m}x{v.block_n}x{v.block_k} w{v.num_warps} s{v.num_stages}" + \
                    (f" split<={v.split}" if v.split_k else "")
                try:
                    ks = generate_gemm(spec, v)
                    fn = _load(ks.source.replace(spec.name, f"{spec.name}_{i}"), f"{spec.name}_{i}", tmp)
                except Exception as e:  # noqa: BLE001 -- reported in the row
                    rows.append({"dtype": dtype, "workload": name, "tile": label, "error": f"{type(e).__name__}: {e}"})
                    continue
                launch = launcher(fn, ks, v, m, n, k, "cuda")
                if launch is None:
                    continue
                outs = [torch.empty(m, n, dtype=tdt, device="cuda") for _ in sets]
                try:
                    launch(x, w, b, r, outs[0])
                    torch.cuda.synchronize()
                    e = max_error(outs[0], ref)
                    ms = do_bench_cudagraph(cycled(sets, launch, outs), rep=args.rep, return_mode="median")
                except Exception as ex:  # noqa: BLE001 -- a tile that does not compile or fit
                    rows.append({"dtype": dtype, "workload": name, "tile": label,
                                 "error": f"{type(ex).__name__}: {str(ex)[:200]}"})
                    continue
                rows.append({"dtype": dtype, "workload": name, "m": m, "n": n, "k": k, "tile": label,
                             "slices": v.slices(m, n, k, 1) if v.split_k else 0, "us": ms * 1e3,
                             "tflops": flops / (ms * 1e-3) / 1e12,
                             "err": e, "framework_err": framework_err,
                             **{f"{p} us": t * 1e3 for p, t in peer.items()}})
                print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['dtype']:5} {row['workload']:10} {row['tile']:30} ERROR {row['error']}"
    mm = row["cublas mm us"]
    return (f"{row['dtype']:5} {row['workload']:10} {row['tile']:30} {row['us']:7.2f} us {row['tflops']:6.0f} TF/s"
            f"  cuBLAS mm {mm:6.2f} ({mm / row['us']:.2f}x)  addmm {row['cublasLt addmm (bias) us']:6.2f}"
            + (f"  Lt bias+gelu {row['cublasLt bias+tanh-GELU us']:6.2f}" if "cublasLt bias+tanh-GELU us" in row
               else "") + f"  err {row['err']:.2g} (framework {row['framework_err']:.2g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens: M = 128 x batch")
    ap.add_argument("--copies", type=int, default=12, help="operand sets cycled through (L2 cold)")
    ap.add_argument("--rep", type=int, default=50, help="ms of replays per timing")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: run every workload's kernels small under Triton's interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.dry_run:
        interpreted(dry_run)
        return
    rows = run(args)
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = r["dtype"], r["workload"]
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\nbest tile per workload:")
    for row in best.values():
        print(_line(row))
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
