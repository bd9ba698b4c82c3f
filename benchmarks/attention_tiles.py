"""FusedAttention's kernel against cuDNN's flash attention at BERT-base, ViT-S/16 and GPT-2-small
shapes, over a wide set of tiles: where the 1.2-1.6x gap at batch 8 comes from.

In the twenty-third session's models (H200, fp16, CUPTI) the attention took 6.83 µs a layer in
BERT-base b8 and 9.18 in ViT-S/16 b8 at tuning's best of four tiles, where cuDNN's fused kernel
(through torch) took 5.2 and 5.8 alone in the fourteenth session. This times the kernel
`onnxfuse.codegen_attention` generates for each model's attention as onnxfuse's pack pass
leaves it (Q, K and V strided views of the packed projection [B, S, 3 * H * 64] with its bias
added in the kernel; BERT's additive key mask [B, 1, 1, S] read as a row, GPT-2's causal mask
computed from the indices, the scores divided by 8) at every tile below (`--tiles`), with V's
tile loaded after the softmax (as shipped) and with K's (`AttentionVariant.v_first`); beside it
torch's scaled_dot_product_attention on the same strided views (no bias: the peer gets the sum
for free, and its error is against a reference without it) with each backend alone (cudnn,
flash, efficient). Every launch is captured 20 times in a CUDA graph, replayed under torch's
profiler (CUPTI): a kernel's time is its median duration. Inputs stay in L2 between launches
(the model's attention reads what its projection wrote just before). Errors: max |y - ref|
against float64 on the same inputs (the bias added and rounded as the original's Add stores
it): `err` against the original's roundings (scores and P stored in fp16), `err_math` against
the math itself. `--once` launches each kernel once more instead of timing it, for Nsight Compute around
the process (`gpu_session.sh attention-ncu`).

`--dtype fp32` times the float32 kernel at precision tf32 (ONNX Runtime's default math; Q, K^T,
P and V rounded to nearest TF32 in the kernel) over `F32_TILES`; its peers are torch's
memory-efficient SDPA (float32 FMA), and torch's unfused attention with TF32 products (two batched
cuBLAS products around a softmax: what ONNX Runtime's fp32 Attention runs at 128 tokens).

Needs torch with CUDA and triton (not onnxruntime):

    python benchmarks/attention_tiles.py --json attention_tiles.json
    TRITON_INTERPRET=1 python benchmarks/attention_tiles.py --dry-run   # the kernels on the CPU, no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.conv_kernels import _load  # noqa: E402
from benchmarks.rows_context import cupti_kernel_us, finish, pick  # noqa: E402
from onnxfuse.codegen_attention import ALTERNATIVES, PEEL, AttentionSpec, _variants, generate_attention  # noqa: E402
from onnxfuse.expr import HEADER, parse  # noqa: E402

D = 64
# name: (heads, seq, mask): the models' attentions; mask "key" (BERT's additive [B, 1, 1, S],
# read as a row), "causal" (GPT-2's lower triangle as a Where, computed from the indices, the
# key blocks past the diagonal skipped) or "" (ViT)
WORKLOADS = {"bert": (12, 128, "key"), "vit": (6, 197, ""), "gpt2": (12, 128, "causal")}
PROGRAMS = {"key": "input %0 {dt}\ninput %1 {dt}\n%2 = mul %0 0.125\n%3 = add %2 %1\noutput %3 {dt}",
            "causal": "input %0 {dt}\ninput %1 bool\n%2 = mul %0 0.125\n%3 = select %1 %2 -10000.0\noutput %3 {dt}",
            "": "input %0 {dt}\n%1 = mul %0 0.125\noutput %1 {dt}"}
# (block_m, block_n, num_warps, num_stages): the fp16 tiles tuning times, then two more
TILES = (*ALTERNATIVES["f16"], (64, 256, 8, 1), (32, 32, 4, 2))
# float32: the tiles tuning times, then wider and one-stage ones (a tile's fifth field PEEL as
# tuning peels it)
F32_TILES = (*ALTERNATIVES["f32"], (32, 32, 4, 1), (32, 64, 4, 1), (64, 32, 4, 2), (64, 64, 4, 1), (64, 64, 8, 2),
             (32, 128, 4, 2), (16, 32, 4, 2), (32, 32, 2, 2))
TORCH_BACKENDS = {"fp16": ("cudnn", "flash", "efficient"), "fp32": ("efficient", "unfused_tf32")}
DTYPES = {"fp16": "f16", "fp32": "f32"}
REPS = 20


def spec(workload: str, batch: int, name: str, exact_scores: bool = False, dtype: str = "fp16") -> AttentionSpec:
    heads, seq, mask = WORKLOADS[workload]
    prog = parse(f"{HEADER}\n{PROGRAMS[mask].format(dt=DTYPES[dtype])}\n")
    return AttentionSpec(name, prog, D, D, "tf32", batch * heads, seq, seq, bias=(True, True, True),
                         extras_broadcast={"key": ("m",), "causal": ("causal",), "": ()}[mask],
                         causal_fill=-10000.0 if mask == "causal" else None, exact_scores=exact_scores)


# The options a tile is timed with (--options): "" as shipped (exp2, the scores rounded as the
# original stores them), "v_first", and `peel`, `tailN` (tail_n N, with peel), `exp` (tl.exp,
# not exp2), `exact` (the node's exact_scores: the scores fp32 up to the softmax), joined by "+"
OPTIONS = ("", "v_first")
FLAGS = ("v_first", "peel", "exp", "exact")


def kernels(workload: str, batch: int, tmp: Path, tiles=TILES, options=OPTIONS, dtype: str = "fp16"):
    """(label, kernel name, launch(x, bias, mask, y)) per tile and option set; every operand
    is aligned, so each tile is its aligned variant (what the launcher picks for them)."""
    heads, seq, mask_kind = WORKLOADS[workload]
    out = []
    for i, tile in enumerate(tiles):
        for k, opt in enumerate(options):
            parts = {f for f in opt.split("+") if f}
            tails = [int(f[4:]) for f in parts if f.startswith("tail")]
            names = {f for f in parts if not f.startswith("tail")}
            if not names <= set(FLAGS) or any(t >= tile[1] for t in tails):
                raise SystemExit(f"attention_tiles: options {opt!r}: each of {FLAGS} or tailN (N < BLOCK_N), "
                                 "joined by '+'")
            flags = {f: True for f in names & {"v_first", "peel"}}
            flags.update({"tail_n": tails[0]} if tails else {})
            flags.update({"exp2": False} if "exp" in names else {})  # tl.exp, not the shipped exp2
            exact = "exact" in names
            name = f"onnxfuse_attention_tiles_{workload}_{dtype}_b{batch}_{i}_{k}"
            v = dataclasses.replace(_variants(tile)[0], **flags)  # the tile as tuning builds it, aligned
            ks = generate_attention(spec(workload, batch, name, exact_scores=exact, dtype=dtype), v)
            out.append((v.label + (", V first" if v.v_first else "") + (", exact scores" if exact else ""), name,
                        launcher(_load(ks.source, name, tmp), ks, batch, heads, seq, mask_kind)))
    return out


def launcher(fn, ks, batch: int, heads: int, seq: int, mask_kind: str):
    """launch(x, bias, mask, y) with the strides the C++ launcher passes for the packed product
    x [B, S, 3, H, D], its bias [3, H, D], BERT's mask [B, 1, 1, S] (GPT-2's causal one is not
    read: a stand-in pointer, zero strides), y [B, S, H, D]."""
    v, consts = ks.variant, dict(ks.constexprs)
    hd = heads * D

    def launch(x, bias, mask, y):
        q, k, vv = x[:, :, :hd], x[:, :, hd:2 * hd], x[:, :, 2 * hd:]
        sb, sm = x.stride(0), x.stride(1)
        strides = [sb, D, sm, 1, sb, D, 1, sm, sb, D, sm, 1, y.stride(0), D, y.stride(1), 1]
        extras = [mask] if mask_kind else []
        if mask_kind == "key":
            strides += [mask.stride(0), 0, 0, mask.stride(-1)]
        elif mask_kind == "causal":
            strides += [0, 0, 0, 0]
        fn[v.grid(seq, batch * heads)](q, k, vv, *extras, bias[:hd], bias[hd:2 * hd], bias[2 * hd:], y,
                                       heads, seq, seq, *strides, D, D, D,
                                       num_warps=ks.num_warps, num_stages=ks.num_stages, **consts)
    return launch


def torch_launcher(backend: str, heads: int, seq: int, mask_kind: str):
    """F.scaled_dot_product_attention on the strided heads of x (the bias not added), BERT's
    mask broadcast as attn_mask, GPT-2's as is_causal, one backend alone; "unfused_tf32": the
    scores, softmax and P @ V as separate kernels, the products at TF32."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "unfused_tf32":
        return unfused_launcher(heads, seq, mask_kind)
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def launch(x, bias, mask, y):
        b = x.shape[0]
        qkv = x.view(b, seq, 3, heads, D).permute(2, 0, 3, 1, 4)
        with sdpa_kernel([chosen]):
            return torch.nn.functional.scaled_dot_product_attention(
                qkv[0], qkv[1], qkv[2], attn_mask=mask if mask_kind == "key" else None,
                is_causal=mask_kind == "causal", scale=0.125)
    return launch


def unfused_launcher(heads: int, seq: int, mask_kind: str):
    """The attention as ONNX Runtime's unfused path runs it (no bias: as the SDPA peers): Q @ K^T
    (a batched cuBLAS product, TF32 allowed), the scale and mask, the softmax, P @ V (TF32)."""
    import torch

    def launch(x, bias, mask, y):
        b = x.shape[0]
        qkv = x.view(b, seq, 3, heads, D).permute(2, 0, 3, 1, 4)
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            s = torch.matmul(qkv[0], qkv[1].transpose(-1, -2)) * 0.125
            if mask_kind == "key":
                s = s + mask
            elif mask_kind == "causal":
                s = s.masked_fill(~torch.ones(seq, seq, dtype=torch.bool, device=s.device).tril(), -10000.0)
            return torch.matmul(torch.softmax(s, -1), qkv[2])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    return launch


def float64_reference(x, bias, mask, heads: int, seq: int, mask_kind: str, rounded: bool = True):
    """The original's attention in float64: the bias Add stored in x's dtype, scores rounded as
    the MatMul, the score program and the Softmax store them, P rounded to x's dtype; `rounded`
    False: the math itself on the biased operands (no rounding after the bias Add), what an
    fp32 model's output approaches."""
    import torch

    def r(t):
        return t.to(x.dtype).double() if rounded else t

    b = x.shape[0]
    xb = (x.double() + bias.double()).to(x.dtype).double()
    qkv = xb.view(b, seq, 3, heads, D).permute(2, 0, 3, 1, 4)
    s = r(qkv[0] @ qkv[1].transpose(-1, -2))
    s = r(s * 0.125)
    if mask_kind == "key":
        s = r(s + mask.double())
    elif mask_kind == "causal":
        s = torch.where(torch.ones(seq, seq, dtype=torch.bool, device=s.device).tril(), s, -10000.0)
    p = r(torch.softmax(s, -1))
    return (p @ qkv[2]).permute(0, 2, 1, 3)  # [B, S, H, D]


def draw(batch: int, heads: int, seq: int, device: str, dtype: str = "fp16"):
    import torch

    dt = {"fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator(device=device).manual_seed(23)
    x = torch.randn(batch, seq, 3 * heads * D, generator=gen, device=device).to(dt)
    bias = (torch.randn(3 * heads * D, generator=gen, device=device) * 0.1).to(dt)
    keep = torch.rand(batch, 1, 1, seq, generator=gen, device=device) > 0.1
    keep[..., 0] = True  # every row keeps a key
    mask = torch.where(keep, 0.0, -10000.0).to(dt)
    return x, bias, mask


def _tile_list(text: str | None, dtype: str = "fp16") -> tuple[tuple, ...]:
    """--tiles "32x128x4x2,64x64x4x1xpeel" (block_m x block_n x warps x stages [x peel: as tuning
    peels it]), default TILES (F32_TILES for fp32)."""
    if not text:
        return F32_TILES if dtype == "fp32" else TILES
    return tuple(tuple(v if v == PEEL else int(v) for v in t.split("x")) for t in text.split(","))


def run(args) -> list[dict]:
    import torch

    tiles = _tile_list(args.tiles, args.dtype)
    dt = {"fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    options = tuple(args.options.split(",")) if args.options is not None else ("",) if args.once else OPTIONS
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="attention-tiles-"))
    for workload in args.workloads.split(","):
        heads, seq, mask_kind = WORKLOADS[workload]
        for batch in (int(b) for b in args.batches.split(",")):
            x, bias, mask = draw(batch, heads, seq, "cuda", args.dtype)
            y = torch.empty(batch, seq, heads, D, dtype=dt, device="cuda")
            ref = float64_reference(x, bias, mask, heads, seq, mask_kind)
            ref_peer = float64_reference(x, bias * 0, mask, heads, seq, mask_kind)  # torch's gets no bias
            math = float64_reference(x, bias, mask, heads, seq, mask_kind, rounded=False)
            math_peer = float64_reference(x, bias * 0, mask, heads, seq, mask_kind, rounded=False)
            flops = 4 * batch * heads * seq * seq * D
            peers = [(f"torch {b}" if b == "unfused_tf32" else f"torch sdpa {b}", None,
                      torch_launcher(b, heads, seq, mask_kind)) for b in TORCH_BACKENDS[args.dtype]]
            for label, name, launch in kernels(workload, batch, tmp, tiles, options, args.dtype) + peers:
                row = {"workload": workload, "batch": batch, "dtype": args.dtype, "kernel": label}
                try:
                    out = launch(x, bias, mask, y)
                    torch.cuda.synchronize()
                    got = y if out is None else out.permute(0, 2, 1, 3)
                    row["err"] = float((got.double() - (ref if name else ref_peer)).abs().max())
                    row["err_math"] = float((got.double() - (math if name else math_peer)).abs().max())
                    if args.once:  # one launch more, untimed: for a profiler (ncu) around the process
                        launch(x, bias, mask, y)
                        torch.cuda.synchronize()
                    else:
                        keys = (name,) if name else ("",)
                        us = pick(cupti_kernel_us(lambda f=launch, a=(x, bias, mask, y): f(*a), tmp, REPS), keys)
                        row["us"] = None if us is None else round(us, 3)
                        row["tflops"] = None if not us else round(flops / us / 1e6, 1)
                except Exception as e:  # a backend that refuses, a tile that does not fit
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['workload']} {row.get('dtype', 'fp16')} b{row['batch']:<2} {row['kernel']:60} {row['error']}"
    us = "-" if row.get("us") is None else f"{row['us']:.2f}"
    return (f"{row['workload']} {row.get('dtype', 'fp16')} b{row['batch']:<2} {row['kernel']:60} {us:>7} us  "
            f"err {row['err']:.2g}"
            f"  err_math {row['err_math']:.2g}")


def dry_run() -> list[dict]:
    """CPU, Triton's interpreter: two tiles in both load orders per workload at batch 1 and
    short sequences, against float64; raises where the error exceeds 2^-8 of the output's
    scale; then float32 at tf32, unpeeled and peeled."""
    import torch

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="attention-tiles-dry-"))
    saved = dict(WORKLOADS)
    try:
        WORKLOADS.update(vit=(2, 37, ""), bert=(2, 32, "key"), gpt2=(2, 40, "causal"))
        runs = [(w, "fp16", (*OPTIONS, "peel+exact+tail16", "exp")) for w in WORKLOADS]
        runs += [(w, "fp32", ("", "peel")) for w in WORKLOADS]
        for workload, dtype, options in runs:
            heads, seq, mask_kind = WORKLOADS[workload]
            x, bias, mask = draw(1, heads, seq, "cpu", dtype)
            ref = float64_reference(x, bias, mask, heads, seq, mask_kind)
            math = float64_reference(x, bias, mask, heads, seq, mask_kind, rounded=False)
            for label, _, launch in kernels(workload, 1, tmp, tiles=((16, 32, 4, 1), (32, 64, 4, 2)),
                                            options=options, dtype=dtype):
                y = torch.empty(1, seq, heads, D, dtype=x.dtype)
                launch(x, bias, mask, y)
                err = float((y.double() - ref).abs().max())
                bound = float(ref.abs().max()) * 2.0**-8
                err_math = float((y.double() - math).abs().max())
                rows.append({"workload": workload, "dtype": dtype, "kernel": label, "err": err, "err_math": err_math})
                print(f"{workload} {dtype} {label:60} err {err:.2g} err_math {err_math:.2g} (bound {bound:.2g})")
                own = err_math if "exact" in label else err  # against the node's own contract
                if not own <= bound:
                    raise AssertionError(f"{workload} {label}: error {own:.3g} above {bound:.3g}")
    finally:
        WORKLOADS.update(saved)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workloads", default="vit,bert,gpt2")
    ap.add_argument("--batches", default="8")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp16",
                    help="fp32: the float32 kernel at precision tf32, its tiles F32_TILES")
    ap.add_argument("--tiles", help="block_m x block_n x warps x stages, comma-separated (default: TILES)")
    ap.add_argument("--options", help="option sets per tile, comma-separated, each of "
                    f"{', '.join(FLAGS)} joined by '+', '' as shipped (default: as shipped, then v_first)")
    ap.add_argument("--once", action="store_true",
                    help="each kernel launched twice (the check, then once more), V after the softmax only, no "
                         "timing: for `ncu --set full python benchmarks/attention_tiles.py --once ...`")
    ap.add_argument("--dry-run", action="store_true", help="the kernels under Triton's interpreter (CPU), no timing")
    finish("attention_tiles", ap.parse_args(), run, dry_run)


if __name__ == "__main__":
    main()
