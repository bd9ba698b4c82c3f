"""Programmatic dependent launch (PDL) between a product and a row kernel, in CUDA graphs.

In BERT-base b8 fp16 under ORT's CUDA graphs (twenty-fifth session, H200) the kernels summed
629 µs and the model took 711: about 0.8 µs between each two of its ~100 kernels. On sm_90 a
kernel launched with the programmatic-stream-serialization attribute may start while the kernel
before it finishes; it waits for that kernel's results with ``griddepcontrol.wait`` (Triton's
``gdc_wait``), and a kernel may let the next one start early with
``griddepcontrol.launch_dependents`` (``gdc_launch_dependents``). This measures what that buys
where onnxfuse's kernels sit: a LayerNorm-with-residual row kernel after a cuBLAS product (the
product knows nothing of PDL), and row kernels one after another (both sides Triton).

Each sequence is captured once per mode in a torch CUDA graph and the graph replayed; the time
is the median over repeats of (events around `--replays` replays) / replays. Modes: "off" (plain
launches; the kernel still executes gdc_wait, a no-op then), "wait" (launched with PDL, waits
first), "wait+trigger" (also lets the next kernel launch as soon as it starts). Every mode's
output is checked bit-equal to "off"'s.

    python benchmarks/pdl.py --json pdl.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MODES = {"off": (False, False), "wait": (True, False), "wait+trigger": (True, True)}


@triton.jit
def add_layer_norm(x_ptr, r_ptr, g_ptr, b_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(r_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / N
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / N + eps)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (d * rstd * g + b).to(y_ptr.dtype.element_ty), mask=mask)


def rows(x, r, g, b, y, pdl: bool, trigger: bool):
    m, n = x.shape
    add_layer_norm[(m,)](x, r, g, b, y, n, 1e-5, BLOCK=triton.next_power_of_2(n), TRIGGER=trigger,
                         num_warps=4 if n <= 1024 else 8, launch_pdl=pdl)


@dataclasses.dataclass
class Tensors:
    x0: torch.Tensor  # the first input, [M, 768]
    w: torch.Tensor  # the product's weight, [768, 768]
    r: torch.Tensor  # the residual
    g: torch.Tensor
    b: torch.Tensor
    bufs: list  # two [M, 768] outputs, alternated


def gemm_rows(t: Tensors, layers: int, pdl: bool, trigger: bool):
    """`layers` times: a cuBLAS product, then the row kernel on its output (the next product's input)."""
    a = t.x0
    for _ in range(layers):
        torch.mm(a, t.w, out=t.bufs[0])
        rows(t.bufs[0], t.r, t.g, t.b, t.bufs[1], pdl, trigger)
        a = t.bufs[1]


def rows_rows(t: Tensors, layers: int, pdl: bool, trigger: bool):
    """2 x `layers` row kernels, each reading the one before."""
    a = t.x0
    for i in range(2 * layers):
        rows(a, t.r, t.g, t.b, t.bufs[i % 2], pdl, trigger)
        a = t.bufs[i % 2]


def graph_ms(fn, replays: int, repeats: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    for _ in range(20):
        g.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1024,128", help="M values (BERT-base b8 and b1: 1024, 128)")
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dtypes = {"fp16": torch.float16, "fp32": torch.float32}
    results = []
    print(f"{'sequence':<16} {'dtype':<5} {'M':>5} " + " ".join(f"{m:>13}" for m in MODES) + "  µs saved a boundary")
    for dname in args.dtypes.split(","):
        dt = dtypes[dname]
        torch.backends.cuda.matmul.allow_tf32 = False
        for m in (int(v) for v in args.rows.split(",")):
            n = 768
            w = torch.randn(n, n, device="cuda", dtype=dt) / n**0.5
            x0 = torch.randn(m, n, device="cuda", dtype=dt)
            r = torch.randn(m, n, device="cuda", dtype=dt)
            g = torch.rand(n, device="cuda", dtype=dt) + 0.5
            b = torch.randn(n, device="cuda", dtype=dt)
            bufs = [torch.empty(m, n, device="cuda", dtype=dt) for _ in range(2)]
            t = Tensors(x0, w, r, g, b, bufs)
            for seq, make, boundaries in (("gemm -> rows", gemm_rows, args.layers),
                                          ("rows -> rows", rows_rows, 2 * args.layers)):
                row = {"sequence": seq, "dtype": dname, "m": m, "n": n, "layers": args.layers, "ms": {}}
                ref = None
                for mode, (pdl, trigger) in MODES.items():
                    fn = functools.partial(make, t, args.layers, pdl, trigger)
                    row["ms"][mode] = graph_ms(fn, args.replays, args.repeats)
                    fn()
                    torch.cuda.synchronize()
                    out = bufs[1].clone() if seq == "gemm -> rows" else bufs[(2 * args.layers - 1) % 2].clone()
                    if ref is None:
                        ref = out
                    elif not torch.equal(out, ref):
                        print(f"{seq} {dname} M={m}: mode {mode} output differs from 'off'", file=sys.stderr)
                        return 1
                best = min(row["ms"]["wait"], row["ms"]["wait+trigger"])
                row["us_saved_per_boundary"] = (row["ms"]["off"] - best) * 1000 / boundaries
                results.append(row)
                print(f"{seq:<16} {dname:<5} {m:>5} " + " ".join(f"{row['ms'][k] * 1000:>10.2f} µs" for k in MODES)
                      + f"  {row['us_saved_per_boundary']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                       "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
