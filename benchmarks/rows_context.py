"""Residual + LayerNorm row kernels in three contexts: why a tile that wins alone loses in the model.

On the H200 (twenty-second session, BERT-base b8 fp16) tuning timed FusedRows' one-warp tile at
2.56 us alone against 3.62 for the heuristic's 4 warps, and in the model it took 3.15 where the
heuristic's had taken 3.13; ORT's SkipLayerNormalization took 3.46 alone and 2.75 in the model.
This times the kernel `onnxfuse.codegen_rows` generates for y = LayerNorm(x + r) * gamma + beta
over rows of 768 (BERT-base's hidden size; M = batch x 128 rows) at every tile tuning can time
(`rows_candidates`), each with gamma and beta loaded after the statistics (as the kernels did
until the twenty-second session) and before the row (`RowsVariant.early_loads`, shipped since:
whether loads that wait for the reductions cost a memory round trip), in three contexts:
- ``hot``:   the same x and r every launch: they stay in L2 (3-6 MB);
- ``cold``:  cycling through enough copies of x, r and y (`--copies`, more where they would not
             fill twice the 50 MB L2) that every launch reads from DRAM;
- ``after_gemm``: each launch right after a cuBLAS product that writes its x (x = a @ w, a
             [M, 768], w [768, 768]), r written the launch before: as in the model, where the
             attention's output projection (or FFN2) writes the row kernel's input.
Beside it, torch's own fp32-accumulating `layer_norm` after `x + r` (two kernels, the peer a
framework runs), and two floors no LayerNorm kernel can beat, to tell a kernel's distance from
the roofline bound apart from the distance every kernel has at these sizes:
- ``torch add``: `x + r` into y alone, torch's elementwise kernel: the same three row tensors
  moved with no reduction (the bytes alone, a copy's cost);
- ``empty kernel``: a Triton kernel of one program that does nothing (the launch alone).
Every context is captured in a CUDA graph (20 launches; the cold one a launch per copy) and
replayed under torch's profiler (CUPTI): a kernel's time is its median duration over the
replays, as `onnxfuse profile` and tuning's bundles measure it. The roofline bound is the bytes
moved (x, r, y, gamma, beta) at the datasheet's bandwidth (H200 4.8 TB/s, H100 3.35); each row
prints its share of it (bound / hot time). Each kernel's output is compared with float64
(max |y - ref|). Batches beyond BERT's 1 and 8 (`--batches 8,1,32,128`) show where a kernel
leaves the launch-bound regime.

Needs torch with CUDA and triton (not onnxruntime):

    python benchmarks/rows_context.py --json rows_context.json
    TRITON_INTERPRET=1 python benchmarks/rows_context.py --dry-run   # the kernels on the CPU, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.conv_kernels import _load  # noqa: E402
from benchmarks.gemm_tiles import interpreted  # noqa: E402
from onnxfuse.codegen_rows import RowsSpec, generate_rows, rows_candidates  # noqa: E402
from onnxfuse.expr import HEADER, parse  # noqa: E402

SEQ, HIDDEN, EPS = 128, 768, 1e-5
REPS = 20  # launches per captured graph
L2_BYTES = 50 * 2**20  # the H200's (the H100's: 50 MB too)
PROLOGUE = "input %0 {dt}\ninput %1 {dt}\n%2 = add %0 %1\noutput %2 {dt}"
EPILOGUE = ("input %0 f32\ninput %1 f32\ninput %2 f32\ninput %3 {dt}\ninput %4 {dt}\n%5 = sub %0 %1\n"
            "%6 = add %2 1e-05\n%7 = sqrt %6\n%8 = div 1.0 %7\n%9 = mul %5 %8\n%10 = mul %9 %3\n%11 = add %10 %4\n"
            "output %11 {dt}")


def spec(dt: str, name: str = "onnxfuse_rows_context") -> RowsSpec:
    """The FusedRows kernel of a residual Add + LayerNormalization over the last axis."""
    def prog(text: str):
        return parse(f"{HEADER}\n{text.format(dt=dt)}\n")
    return RowsSpec(name, "layer_norm", prog(PROLOGUE), prog(EPILOGUE), ("full", "full", "last", "last"), 1, HIDDEN)


def kernels(dt: str, tmp: Path, loads: str = "both") -> list[tuple[str, str, object]]:
    """(label, kernel name, launcher factory) for every tile tuning can time: its single-pass
    variant (the one the C++ launcher picks for 16-byte aligned rows of 768) with gamma and beta
    loaded after the statistics (as before `rows-early-loads`) and first (`early_loads`, as
    shipped), each under its own name; `loads` ("first", "after", "both") picks which. Triton's
    JIT specializes on the pointers' alignment as the ahead-of-time compile's hints do."""
    out = []
    for i, (label, variants) in enumerate(rows_candidates(spec(dt))):
        for early in {"first": (True,), "after": (False,), "both": (False, True)}[loads]:
            name = f"onnxfuse_rows_context_{dt}_{i}{'_early' if early else ''}"
            ks = generate_rows(spec(dt, name), dataclasses.replace(variants[0], early_loads=early))
            out.append((label + (", loads first" if early else ", loads after sums"), name,
                        launcher(_load(ks.source, name, tmp), ks)))
    return out


def launcher(fn, ks):
    """m -> launch(x, r, g, b, y), with the grid and parameters the C++ launcher passes."""
    v, consts = ks.variant, dict(ks.constexprs)

    def at(m: int):
        def launch(x, r, g, b, y):
            fn[v.grid(m)](x, r, g, b, y, m, HIDDEN, num_warps=ks.num_warps, **consts)
        return launch
    return at


def torch_launcher(m: int):
    """The framework's peer: x + r (into y, as scratch), then torch's layer_norm (fp32
    statistics), whose new tensor it returns (no copy back: two kernels)."""
    import torch

    def launch(x, r, g, b, y):
        torch.add(x, r, out=y)
        return torch.nn.functional.layer_norm(y, (HIDDEN,), g, b, EPS)
    return launch


def float64_reference(x, r, g, b):
    s = x.double() + r.double()
    s = s.to(x.dtype).double()  # the Add's output is stored in x's dtype before the norm
    mean = s.mean(-1, keepdim=True)
    var = ((s - mean) ** 2).mean(-1, keepdim=True)
    return (s - mean) / (var + EPS).sqrt() * g.double() + b.double()


def draw(m: int, dtype, copies: int, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(23)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)
    g, b = t(HIDDEN, scale=0.5) + 1, t(HIDDEN, scale=0.1)
    return [(t(m, HIDDEN), t(m, HIDDEN)) for _ in range(copies)], g, b


def cupti_kernel_us(fn, tmp: Path, reps: int = REPS) -> dict[str, float]:
    """fn captured `reps` times in a CUDA graph, the graph replayed under the profiler: the
    median duration (µs) of each kernel name."""
    import torch

    from onnxfuse.trace import run_under_cupti

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    trace = run_under_cupti(torch, graph.replay, 5, tmp)
    if trace is None:
        raise RuntimeError("no CUPTI trace")
    by_name: dict[str, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "kernel":
            by_name.setdefault(e["name"], []).append(float(e["dur"]))
    return {k: statistics.median(v) for k, v in by_name.items()}


def contexts(launch, sets: list[tuple], g, b, ys: list, product: tuple) -> dict:
    """The three contexts' callables (module docstring) of launch(x, r, g, b, y): hot on the
    first set, cold walking through every set, after_gemm writing the first set's x by
    `product` = (a, w) before each launch."""
    import torch

    (x0, r0), state = sets[0], {"i": 0}

    def cold():
        j = state["i"] % len(sets)
        launch(*sets[j], g, b, ys[j])
        state["i"] += 1

    def after_gemm():
        torch.mm(*product, out=x0)
        launch(x0, r0, g, b, ys[0])
    return {"hot": lambda: launch(x0, r0, g, b, ys[0]), "cold": cold, "after_gemm": after_gemm}


def pick(times: dict[str, float], keys: tuple[str, ...]) -> float | None:
    """The summed median time of the kernels whose name holds one of `keys`."""
    found = [t for name, t in times.items() if any(k in name for k in keys)]
    return sum(found) if found else None


def timed(ctxs: dict, copies: int, keys: tuple[str, ...], tmp: Path) -> dict[str, float | None]:
    """{context}_us: the summed median time of the kernels named by `keys` in each context's graph
    (the cold one a launch per operand set: one graph walks through every copy)."""
    out = {}
    for ctx, fn_ctx in ctxs.items():
        us = pick(cupti_kernel_us(fn_ctx, tmp, copies if ctx == "cold" else REPS), keys)
        out[f"{ctx}_us"] = None if us is None else round(us, 3)
    return out


# torch's kernels for the peer (the add, layer_norm), not the product
TORCH_KERNELS = ("elementwise", "layer_norm")

EMPTY = """import triton


@triton.jit
def onnxfuse_rows_context_empty(x_ptr, m):
    pass
"""


def floors(tmp: Path) -> list[tuple[str, tuple[str, ...], object]]:
    """(label, kernel-name keys, launcher factory) of the two floors (module docstring)."""
    import torch
    empty = _load(EMPTY, "onnxfuse_rows_context_empty", tmp)

    def add(m: int):
        return lambda x, r, g, b, y: torch.add(x, r, out=y)

    def nothing(m: int):
        return lambda x, r, g, b, y: empty[(1,)](x, m)
    return [("floor: torch add (the bytes alone)", ("elementwise",), add),
            ("floor: empty kernel (the launch alone)", ("onnxfuse_rows_context_empty",), nothing)]


def run(args) -> list[dict]:
    import torch

    from onnxfuse.profile import detect_device
    from onnxfuse.roofline import DEVICES

    bandwidth_tbps = DEVICES[detect_device("cuda")[0]].bandwidth_tbps  # the datasheet's, as `onnxfuse profile`
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rows-context-"))
    floor_kernels = floors(tmp)
    for dt in args.dtypes.split(","):
        dtype = {"f16": torch.float16, "f32": torch.float32}[dt]
        for batch in (int(b) for b in args.batches.split(",")):
            m = batch * SEQ
            # the cold context's copies: x, r and y of all of them twice the L2 at least
            copies = max(args.copies, -(-2 * L2_BYTES // (3 * m * HIDDEN * dtype.itemsize)))
            sets, g, b = draw(m, dtype, copies, "cuda")
            ys = [torch.empty(m, HIDDEN, dtype=dtype, device="cuda") for _ in sets]
            a = torch.randn(m, HIDDEN, device="cuda").to(dtype)
            w = (torch.randn(HIDDEN, HIDDEN, device="cuda") * HIDDEN ** -0.5).to(dtype)
            floor_us = (3 * m * HIDDEN + 2 * HIDDEN) * dtype.itemsize / (bandwidth_tbps * 1e12) * 1e6
            x0, r0 = sets[0]
            for label, name, at in kernels(dt, tmp, args.loads) + [("torch add + layer_norm", None, torch_launcher)]:
                ref = float64_reference(x0, r0, g, b)  # x0 as the last after_gemm context left it
                launch = at(m)
                out = launch(x0, r0, g, b, ys[0])  # torch's returns its output; ours write ys[0]
                torch.cuda.synchronize()
                err = float(((ys[0] if out is None else out).double() - ref).abs().max())
                row = {"dtype": dt, "batch": batch, "kernel": label, "err": err, "floor_us": round(floor_us, 3)}
                keys = (name,) if name else TORCH_KERNELS
                row.update(timed(contexts(launch, sets, g, b, ys, (a, w)), len(sets), keys, tmp))
                rows.append(row)
                print(_line(row), flush=True)
            for label, keys, at in floor_kernels:
                launch = at(m)
                row = {"dtype": dt, "batch": batch, "kernel": label, "err": None, "floor_us": round(floor_us, 3)}
                row.update(timed(contexts(launch, sets, g, b, ys, (a, w)), len(sets), keys, tmp))
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    def f(k):
        return "-" if row.get(k) is None else f"{row[k]:.2f}"
    hot = row.get("hot_us")
    share = f"{100 * row['floor_us'] / hot:3.0f}%" if hot else "  -"
    err = "-" if row["err"] is None else f"{row['err']:.2g}"
    return (f"{row['dtype']} b{row['batch']:<3} {row['kernel']:38} hot {f('hot_us'):>6} ({share} of bound)  "
            f"cold {f('cold_us'):>6}  after gemm {f('after_gemm_us'):>6} us  (bound {row['floor_us']:.2f})  err {err}")


def dry_run() -> list[dict]:
    """CPU, Triton's interpreter: every tile's kernel at 6 rows, fp16 and fp32, against float64;
    raises where the error exceeds the output dtype's rounding."""
    import torch

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rows-context-dry-"))
    for dt, dtype, tol in (("f16", torch.float16, 2.0**-9), ("f32", torch.float32, 1e-5)):
        sets, g, b = draw(6, dtype, 1, "cpu")
        x, r = sets[0]
        ref = float64_reference(x, r, g, b)
        for label, _, at in kernels(dt, tmp):
            y = torch.empty(6, HIDDEN, dtype=dtype)
            at(6)(x, r, g, b, y)
            err = float((y.double() - ref).abs().max())
            bound = float(ref.abs().max()) * tol
            rows.append({"dtype": dt, "kernel": label, "err": err})
            print(f"{dt} {label:37} err {err:.2g} (bound {bound:.2g})")
            if not err <= bound:
                raise AssertionError(f"{dt} {label}: error {err:.3g} above {bound:.3g}")
    return rows


def finish(name: str, args, run_fn, dry_fn) -> None:
    """A kernel sweep's last step: its rows timed (`run_fn(args)`) or, with --dry-run, its
    kernels run under Triton's interpreter (`dry_fn()`); written to --json as {"benchmark":
    name, "rows": ...}; the process ended as the console scripts end it."""
    holder: dict = {}
    if args.dry_run:
        interpreted(lambda: holder.setdefault("rows", dry_fn()))
    else:
        holder["rows"] = run_fn(args)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": name, "rows": holder["rows"]}, indent=1) + "\n")
    from onnxfuse.cli import end_process
    end_process(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dtypes", default="f16,f32")
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--loads", choices=("first", "after", "both"), default="both",
                    help="gamma and beta loaded before the row (as shipped), after the statistics, or both")
    ap.add_argument("--copies", type=int, default=24, help="operand sets cycled in the cold context")
    ap.add_argument("--dry-run", action="store_true", help="the kernels under Triton's interpreter (CPU), no timing")
    finish("rows_context", ap.parse_args(), run, dry_run)


if __name__ == "__main__":
    main()
