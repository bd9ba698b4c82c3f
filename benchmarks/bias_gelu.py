"""The FFN's bias + GELU chain in every launch the pointwise kind offers, and in three math forms.

In the twenty-fourth session (H200, fp16, tuning's one-node CUPTI timings) BERT-base b8's bias +
erf-GELU chain over [1024, 3072] took 6.80 µs in its row variant (`row-vector-loads`: the bias
read in 16-byte vectors), 8.13 before in the plain one, against ORT's BiasGelu at 6.37 and a
memory floor of 2.6 µs: 1.9 TB/s. Its sm_90 SASS held 42 instructions an element, 34 of them
the GELU's (libdevice's erf + 1). This times the chain `onnxfuse.codegen` generates at the FFN
shapes of BERT-base, ViT-S/16 and GPT-2-small (tanh GELU), in the forms `relax_16bit` writes
now (0.5 x erfc(-x RN(1/sqrt 2)) and x sigmoid(2z): in 16-bit programs the generators'
`erfc_16bit` / `sigmoid_16bit`) under each launch: the row variant as shipped (its block the
largest power of two dividing the last dim), the same with half and twice its warps (16 and 4
elements a thread at 1024 fp16), and the plain variants at the heuristic's block and at the row
block; at the shipped launch only, the forms before (erf + 1, 1 + tanh: libdevice) and the
bias add alone (no GELU: what the launch costs without the math); beside them torch's
gelu(x + b) (its add and gelu kernels). Each launch is captured 20 times in a CUDA graph and
replayed under CUPTI (`rows_context.cupti_kernel_us`): "hot" launches read one input set
(L2-resident, as after the product that wrote it), "cold" ones walk through copies worth more
than twice the L2. Errors: max |y - ref| against float64. ORT's BiasGelu is not here (no
onnxruntime): tuning's record of the suite times it.

Needs torch with CUDA and triton:

    python benchmarks/bias_gelu.py --json bias_gelu.json
    TRITON_INTERPRET=1 python benchmarks/bias_gelu.py --dry-run   # the kernels on the CPU, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.conv_kernels import _load  # noqa: E402
from benchmarks.rows_context import cupti_kernel_us, finish, pick  # noqa: E402
from onnxfuse.codegen import KernelSpec, Variant, generate  # noqa: E402
from onnxfuse.expr import HEADER, parse  # noqa: E402
from onnxfuse.kinds.pointwise import choose_variants  # noqa: E402

# name: (rows per batch item, columns, GELU): the FFN's first product's output
WORKLOADS = {"bert": (128, 3072, "erf"), "vit": (197, 1536, "erf"), "gpt2": (128, 3072, "tanh")}
BODIES = {  # the forms relax_16bit writes now (first per GELU), before, and the bias add alone
    "erfc": ["%2 = add %0 %1", "%3 = mul %2 -0.70710677", "%4 = erfc %3", "%5 = mul %2 %4", "%6 = mul %5 0.5"],
    "erf": ["%2 = add %0 %1", "%3 = mul %2 0.70710677", "%4 = erf %3", "%5 = add %4 1.0", "%6 = mul %2 %5",
            "%7 = mul %6 0.5"],
    "sigmoid": ["%2 = add %0 %1", "%3 = mul %2 %2", "%4 = mul %3 %2", "%5 = mul %4 0.044715", "%6 = add %2 %5",
                "%7 = mul %6 1.5957692", "%8 = sigmoid %7", "%9 = mul %2 %8"],
    "tanh": ["%2 = add %0 %1", "%3 = mul %2 %2", "%4 = mul %3 %2", "%5 = mul %4 0.044715", "%6 = add %2 %5",
             "%7 = mul %6 0.7978846", "%8 = tanh %7", "%9 = add %8 1.0", "%10 = mul %2 %9", "%11 = mul %10 0.5"],
    "add": ["%2 = add %0 %1"],
}
FORMS = {"erf": ("erfc", "erf", "add"), "tanh": ("sigmoid", "tanh", "add")}  # the first in every launch
L2_BYTES = 50 * 2**20
TORCH_KERNELS = ("elementwise", "gelu", "vectorized")


def program(form: str, dtype: str):
    """The chain in `form` (a key of BODIES), reading and storing `dtype`."""
    body = BODIES[form]
    last = body[-1].split()[0]
    return parse("\n".join([HEADER, f"input %0 {dtype}", f"input %1 {dtype}", *body, f"output {last} {dtype}"]) + "\n")


def launches(prog, cols: int) -> list[tuple[str, Variant]]:
    """(label, variant) of every launch timed: the shipped variants' first (the row one where
    the last dim allows it), its warps halved and doubled, the plain variant at the heuristic's
    block and at the row block."""
    row = choose_variants(KernelSpec(prog, "k", 2, ("full", "strided"), (), cols))[0]
    plain = choose_variants(KernelSpec(prog, "k", 2, ("full", "strided")))[0]
    out = [(f"plain {plain.block}/{plain.num_warps}", plain)]
    if row.last_multiple:
        out = [(f"row {row.block}/{row.num_warps} (shipped)", row)] + [
            (f"row {row.block}/{w}", dataclasses.replace(row, num_warps=w))
            for w in (row.num_warps // 2, row.num_warps * 2) if 1 <= w <= 8] + out
        if (plain.block, plain.num_warps) != (row.block, row.num_warps):
            out.append((f"plain {row.block}/{row.num_warps}", dataclasses.replace(plain, block=row.block,
                                                                                 num_warps=row.num_warps)))
    return out


def float64_gelu(form: str, h: np.ndarray) -> np.ndarray:
    """What the chain in `form` computes, in float64."""
    if form == "add":
        return h
    if form in ("erf", "erfc"):
        return 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h**3)))


def kernels(gelu: str, dtype: str, cols: int, tmp: Path) -> list[tuple[str, str, Variant, object]]:
    """(form, label, variant, JIT function) per kernel timed: the shipped form in every launch,
    the others in the first (the shipped variant); the text is the variant's (row or plain)."""
    out = []
    for form in FORMS[gelu]:
        prog = program(form, dtype)
        every = launches(prog, cols)
        for k, (label, v) in enumerate(every if form == FORMS[gelu][0] else every[:1]):
            name = f"bias_gelu_{form}_{dtype}_{cols}_{k}"
            out.append((form, f"{form}: {label}", v,
                        _load(generate(prog, name, 2, ("full", "strided"), [], v).source, name, tmp)))
    return out


def launch(fn, v: Variant, x, y, b, rows: int, cols: int) -> None:
    import triton

    fn[(triton.cdiv(rows * cols, v.block),)](x, b, y, rows * cols, rows, cols, 0, 1, BLOCK=v.block,
                                             num_warps=v.num_warps)


def torch_gelu(x, y, b, approximate: str) -> None:
    import torch

    torch.nn.functional.gelu(x + b, approximate=approximate)


def timed(step, xs: list, ys: list, keys: tuple[str, ...], tmp: Path) -> dict[str, float | None]:
    """step(x, y)'s kernels (names holding one of `keys`), µs: hot on the first set, cold
    walking through all of them."""
    state = {"i": 0}

    def cold():
        j = state["i"] % len(xs)
        step(xs[j], ys[j])
        state["i"] += 1
    return {ctx: pick(cupti_kernel_us(fn, tmp), keys) for ctx, fn in
            (("hot", lambda: step(xs[0], ys[0])), ("cold", cold))}


def run(args) -> list[dict]:
    import torch

    out = []
    tmp = Path(tempfile.mkdtemp(prefix="bias-gelu-"))
    for dt in args.dtypes.split(","):
        dtype = {"f16": torch.float16, "f32": torch.float32}[dt]
        for name in args.workloads.split(","):
            per_item, cols, gelu = WORKLOADS[name]
            for batch in (int(b) for b in args.batches.split(",")):
                rows = batch * per_item
                g = torch.Generator(device="cuda").manual_seed(0)
                copies = max(1, math.ceil(2 * L2_BYTES / (rows * cols * dtype.itemsize)) + 1)
                xs = [(torch.randn(rows, cols, device="cuda", generator=g) * 2).to(dtype) for _ in range(copies)]
                b = (torch.randn(cols, device="cuda", generator=g) * 0.1).to(dtype)
                ys = [torch.empty_like(x) for x in xs]
                h = xs[0].double().cpu().numpy() + b.double().cpu().numpy()
                floor = (2 * rows * cols + cols) * dtype.itemsize / 4.8e12 * 1e6
                approx = "tanh" if gelu == "tanh" else "none"
                cases = [(form, label, v, functools.partial(launch, fn, v, b=b, rows=rows, cols=cols))
                         for form, label, v, fn in kernels(gelu, dt, cols, tmp)]
                cases.append((gelu, "torch gelu(x + b)", None,
                              functools.partial(torch_gelu, b=b, approximate=approx)))
                refs = {form: float64_gelu(form, h) for form, *_ in cases}
                for form, label, v, step in cases:
                    times = timed(step, xs, ys, ("bias_gelu",) if v is not None else TORCH_KERNELS, tmp)
                    step(xs[0], ys[0])
                    got = ys[0] if v is not None else torch.nn.functional.gelu(xs[0] + b, approximate=approx)
                    torch.cuda.synchronize()
                    err = float(np.max(np.abs(got.double().cpu().numpy() - refs[form])))
                    out.append({"workload": name, "dtype": dt, "batch": batch, "shape": [rows, cols], "form": form,
                                "launch": label, "block": v.block if v else None, "warps": v.num_warps if v else None,
                                "hot_us": times["hot"], "cold_us": times["cold"], "floor_us": round(floor, 2),
                                "max_abs_err_vs_float64": err})
                    print(f"{name:5} {dt} b{batch:<2} {label:32} hot {times['hot'] or float('nan'):6.2f} µs  "
                          f"cold {times['cold'] or float('nan'):6.2f}  floor {floor:5.2f}  err {err:.3g}", flush=True)
    return out


def dry_run() -> list[dict]:
    """CPU, under Triton's interpreter: every kernel timed above, on [4, cols], against float64."""
    import torch

    out = []
    with tempfile.TemporaryDirectory() as d:
        for name, (_, cols, gelu) in WORKLOADS.items():
            for dt, dtype in (("f16", torch.float16), ("f32", torch.float32)):
                x = (torch.randn(4, cols, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
                b = (torch.randn(cols, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
                h = x.double().numpy() + b.double().numpy()
                refs = {form: float64_gelu(form, h) for form in FORMS[gelu]}
                for form, label, v, fn in kernels(gelu, dt, cols, Path(d)):
                    y = torch.empty_like(x)
                    launch(fn, v, x, y, b, 4, cols)
                    err = float(np.max(np.abs(y.double().numpy() - refs[form])))
                    print(f"{name:5} {dt} {label:32} err {err:.2g}")
                    assert err < (2e-2 if dt == "f16" else 1e-5), (name, dt, label, err)
                    out.append({"workload": name, "dtype": dt, "form": form, "launch": label,
                                "max_abs_err_vs_float64": err})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dtypes", default="f16,f32")
    ap.add_argument("--workloads", default="bert,vit,gpt2")
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--dry-run", action="store_true", help="the kernels under Triton's interpreter (CPU), no timing")
    finish("bias_gelu", ap.parse_args(), run, dry_run)


if __name__ == "__main__":
    main()
