"""The generated FusedConv / FusedMaxPool Triton kernels on their own, against cuDNN and
torch.compile, at the layer shapes of the CNN benchmark models (no ONNX Runtime involved).

For each layer: every tile configuration in CONFIGS (JIT-compiled by Triton, checked
against torch's result), torch eager (cuDNN, NCHW and channels-last, TF32 allowed as the
peers in ../shared/DESIGN.md were measured) and torch.compile of the same function. Times
are triton.testing.do_bench medians (L2 flushed between runs). This is how the default
tile configurations in onnxfuse/codegen_conv.py are chosen.

    python benchmarks/conv_kernels.py --json results/conv_kernels.json [--quick] [--no-compile]
    python benchmarks/conv_kernels.py --pool-only --no-compile   # Relu + MaxPool 2x2 kernels only
    python benchmarks/conv_kernels.py --layers 26,27,28,29,30,31 --layouts nhwc-krsc --shipped \
        --no-compile --json results/conv_kernels_b1_small_m.json  # also each shipped variant

With --shipped, every group-1 layer also times the variants onnxfuse ships for it
(`conv_variants`, at the precision the node compiles at, one-pixel convs included), each
launched as csrc/kinds/conv_cuda.cc launches it: the plain tile, the split-K kernel with its
workspace and the counters zeroed before each launch, the small-M tile; TF32 kernels read
weights rounded as the compile step packs them. `launcher_pick` marks the variant the
library would choose at this M (`launcher_choice`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnxfuse.codegen_conv import (  # noqa: E402
    ConvSpec,
    ConvVariant,
    MaxPoolSpec,
    PoolVariant,
    generate_conv,
    generate_maxpool,
    group_gemm_fits,
    group_span,
    next_pow2,
    prerounds_weights,
    round_array_to_tf32,
)
from onnxfuse.expr import HEADER, parse  # noqa: E402
from onnxfuse.kinds.base import META_VERSION  # noqa: E402
from onnxfuse.kinds.conv import conv_variants, launcher_choice, layer_precision  # noqa: E402
from onnxfuse.layers import ConvAttrs, PoolAttrs  # noqa: E402

RELU = parse(HEADER + "\ninput %0 {dt}\n%1 = max %0 0.0\noutput %1 {dt}\n".replace("{dt}", "f32"))

# (name, N, C, H, K, pool?[, kernel, stride, pad[, group]]): 3x3 stride 1 pad 1 group 1 unless given
LAYERS = [
    ("conv3x3_relu 32x64x112", 32, 64, 112, 64, False),
    ("conv3x3_relu_maxpool 32x64x112", 32, 64, 112, 64, True),
    ("vgg block0 3->64 224 +pool", 32, 3, 224, 64, True),
    ("vgg block2 64 56 +pool", 32, 64, 56, 64, True),
    ("vgg block3 64 28 +pool", 32, 64, 28, 64, True),
    ("resnet 128 28", 32, 128, 28, 128, False),
    ("resnet 256 14", 32, 256, 14, 256, False),
    ("yolo b1 64 40", 1, 64, 40, 64, False),
    ("yolo b1 128 20", 1, 128, 20, 128, False),
    ("resnet stem 3->64 7x7 s2 224", 32, 3, 224, 64, False, 7, 2, 3),
    # MobileNetV3-small's depthwise convs at batch 32 (indices 10-15)
    ("mbv3 dw 16 3x3 s2 112", 32, 16, 112, 16, False, 3, 2, 1, 16),
    ("mbv3 dw 72 3x3 s2 56", 32, 72, 56, 72, False, 3, 2, 1, 72),
    ("mbv3 dw 88 3x3 28", 32, 88, 28, 88, False, 3, 1, 1, 88),
    ("mbv3 dw 96 5x5 s2 28", 32, 96, 28, 96, False, 5, 2, 2, 96),
    ("mbv3 dw 240 5x5 14", 32, 240, 14, 240, False, 5, 1, 2, 240),
    ("mbv3 dw 576 5x5 7", 32, 576, 7, 576, False, 5, 1, 2, 576),
    # grouped convs (indices 16-25): RegNetY-400MF's groups of 8 at batch 16 and 1, ResNeXt-50
    # 32x4d's groups of 4, and wider groups of 16, 32 and 64 channels
    ("regnety400 g8 48 s2 112 b16", 16, 48, 112, 48, False, 3, 2, 1, 6),
    ("regnety400 g8 104 s2 56 b16", 16, 104, 56, 104, False, 3, 2, 1, 13),
    ("regnety400 g8 208 14 b16", 16, 208, 14, 208, False, 3, 1, 1, 26),
    ("regnety400 g8 48 s2 112 b1", 1, 48, 112, 48, False, 3, 2, 1, 6),
    ("regnety400 g8 440 7 b1", 1, 440, 7, 440, False, 3, 1, 1, 55),
    ("resnext50 g32x4 128 56 b16", 16, 128, 56, 128, False, 3, 1, 1, 32),
    ("g16x16 256 28 b16", 16, 256, 28, 256, False, 3, 1, 1, 16),
    ("g16x32 512 14 b16", 16, 512, 14, 512, False, 3, 1, 1, 16),
    ("g16x64 1024 7 b16", 16, 1024, 7, 1024, False, 3, 1, 1, 16),
    ("g16x32 512 14 b1", 1, 512, 14, 512, False, 3, 1, 1, 16),
    # EfficientNet-B0's 1x1 convs at batch 1 (indices 26-31): expansion and projection at
    # 14x14 and 7x7, and the squeeze-excitation FCs on one pixel
    ("effnet b1 1x1 80->480 14", 1, 80, 14, 480, False, 1, 1, 0),
    ("effnet b1 1x1 192->1152 7", 1, 192, 7, 1152, False, 1, 1, 0),
    ("effnet b1 1x1 1152->192 7", 1, 1152, 7, 192, False, 1, 1, 0),
    ("effnet b1 se 1152->48 1x1", 1, 1152, 1, 48, False, 1, 1, 0),
    ("effnet b1 se 48->1152 1x1", 1, 48, 1, 1152, False, 1, 1, 0),
    ("effnet b1 se 144->6 1x1", 1, 144, 1, 6, False, 1, 1, 0),
]

CONFIGS = [  # block_m, block_n, block_k, warps, stages
    (64, 64, 32, 2, 4), (64, 64, 32, 2, 3), (64, 64, 32, 2, 5), (64, 64, 16, 2, 4),
    (64, 64, 64, 2, 3), (32, 64, 32, 2, 4), (32, 64, 32, 1, 4), (64, 64, 32, 1, 4),
    (128, 64, 32, 4, 4), (256, 64, 32, 4, 3), (64, 128, 32, 4, 4), (128, 128, 32, 4, 3),
    (128, 128, 32, 8, 3), (64, 32, 32, 1, 4), (128, 32, 32, 2, 4), (64, 128, 32, 2, 4),
]
QUICK = CONFIGS[:4]
# Grouped / depthwise convs, the direct loop (block_k, stages unused); the first entry is
# replaced by onnxfuse.kinds.conv.conv_variants' heuristic for the layer.
GROUPED_CONFIGS = [
    None, (32, 64, 32, 4, 1), (64, 64, 32, 4, 1), (16, 64, 32, 2, 1), (64, 32, 32, 4, 1), (128, 16, 32, 4, 1),
    (256, 8, 32, 4, 1), (128, 8, 32, 2, 1), (32, 128, 32, 4, 1), (64, 128, 32, 8, 1), (128, 32, 32, 8, 1),
]
# Grouped convs, the block-diagonal GEMM (block_k follows the tile's input span): block_m,
# block_n, warps, stages
GROUP_GEMM_CONFIGS = [(128, 16, 4, 3), (64, 16, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3),
                      (64, 64, 4, 3), (128, 16, 4, 4), (256, 16, 8, 3)]
FLAT_CONFIGS = [  # for few input channels: the reduction R*S*C in one flat loop
    (64, 64, 32, 2, 3), (128, 64, 32, 4, 3), (64, 64, 16, 2, 4), (128, 64, 16, 4, 3), (128, 64, 32, 4, 2),
    (64, 64, 32, 4, 2), (256, 64, 32, 8, 2), (64, 64, 64, 2, 2),
]
# Channels-last: 16-byte loads along channels, and with 4+ warps Triton emits sm_90 wgmma,
# whose TF32 form wants both operands K-major (weights packed [K, R, S, C]: "krsc").
NHWC_CONFIGS = [  # the first five: the best of the first channels-last sweep
    (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 4), (128, 128, 32, 4, 3), (64, 64, 32, 2, 3),
    (64, 128, 32, 4, 4), (64, 64, 32, 2, 4), (128, 128, 32, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 3), (256, 64, 32, 8, 3), (256, 128, 32, 8, 3), (64, 64, 64, 4, 3), (64, 256, 32, 8, 3),
    (64, 64, 32, 4, 3), (64, 32, 32, 4, 3),
    # small outputs (batch 1, 7x7 and one pixel): narrow M tiles, long K steps
    (32, 64, 32, 2, 3), (16, 64, 64, 2, 3), (32, 32, 64, 2, 3), (16, 32, 128, 1, 3), (16, 128, 32, 4, 3),
]

# Relu + MaxPool 2x2: (tile, blocks, warps). flat: (BLOCK,); rows: (BLOCK_OH, BLOCK_OW) of
# one plane (56 output columns here: BLOCK_OW 64 covers a row); nhwc: (BLOCK_P, BLOCK_C).
POOL_CONFIGS = [
    ("flat", (256,), 4), ("flat", (512,), 4), ("flat", (1024,), 4), ("flat", (1024, ), 8), ("flat", (2048,), 8),
    ("rows", (8, 64), 4), ("rows", (4, 64), 4), ("rows", (2, 64), 2), ("rows", (16, 64), 8), ("rows", (8, 32), 4),
    ("rows", (4, 32), 2), ("rows", (16, 32), 4), ("rows", (32, 64), 8), ("rows", (1, 64), 1),
    ("nhwc", (32, 64), 4), ("nhwc", (64, 64), 4), ("nhwc", (16, 64), 2), ("nhwc", (128, 64), 8), ("nhwc", (64, 32), 4),
]


def _load(src: str, name: str, tmp: Path):
    path = tmp / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="4 configurations per layer")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--layouts", default="nchw,nhwc,nhwc-krsc",
                    help="kernel layouts to time, X[-W[-Y]][+flat]: nchw (X, Y NCHW, weights [R,S,C,K]), nhwc (X, Y "
                         "channels last), nhwc-krsc (channels last, weights [K,R,S,C]), nhwc-krsc-nchw "
                         "(channels-last X, NCHW Y)")
    ap.add_argument("--layers", default=None, help="comma-separated indices into LAYERS (default: all)")
    ap.add_argument("--configs", type=int, default=None, help="time only the first N configurations per layout")
    ap.add_argument("--pool-only", action="store_true", help="only the Relu + MaxPool 2x2 section")
    ap.add_argument("--shipped", action="store_true",
                    help="also time the variants onnxfuse ships for each group-1 layer, launched as the library "
                         "launches them (module docstring)")
    args = ap.parse_args()

    import torch
    import triton
    from triton.testing import do_bench

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    tmp = Path(tempfile.mkdtemp(prefix="conv_kernels_"))
    rows, out = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "layers": []}

    def bench(fn) -> float:
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def measure_layer(lname: str, n: int, c: int, h: int, k: int, pool: bool, kw: int = 3, st: int = 1,
                      pad: int = 1, group: int = 1) -> None:
        conv = ConvAttrs((kw, kw), (st, st), (pad,) * 4, group=group)
        pa = PoolAttrs((2, 2), (2, 2)) if pool else None
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(n, c, h, h, generator=g).to(dev)
        w = (torch.randn(k, c // group, kw, kw, generator=g) / (c // group * kw * kw) ** 0.5).to(dev)
        b = torch.randn(k, generator=g).to(dev)
        wp = w.permute(2, 3, 1, 0).contiguous()
        wk = w.permute(0, 2, 3, 1).contiguous()

        def ref_fn(x=x, w=w, b=b, pool=pool):
            y = torch.relu(torch.nn.functional.conv2d(x, w, b, stride=st, padding=pad, groups=group))
            return torch.nn.functional.max_pool2d(y, 2, 2) if pool else y

        with torch.no_grad():
            torch.backends.cudnn.allow_tf32 = False
            exact = ref_fn()
            torch.backends.cudnn.allow_tf32 = True
            cudnn_err = float(((ref_fn() - exact).abs().max() / exact.abs().max()).item())
        layer = {"layer": lname, "shape": [n, c, h, h, k], "group": group, "pool": pool, "configs": [],
                 "cudnn_tf32_max_rel_err": cudnn_err}
        layer["cudnn_nchw_ms"] = bench(ref_fn)
        xl, wl = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
        layer["cudnn_nhwc_ms"] = bench(lambda: ref_fn(xl, wl))
        if not args.no_compile:
            cfn = torch.compile(ref_fn)
            cfn()
            layer["torch_compile_ms"] = bench(cfn)
            cfl = torch.compile(lambda: ref_fn(xl, wl))
            cfl()
            layer["torch_compile_nhwc_ms"] = bench(cfl)
        p, q = conv.out_size(h, h)
        op, oq = pa.out_size(p, q) if pa else (p, q)
        if group != 1:  # memory-bound: one read of X and one write of Y at copy bandwidth
            src = torch.empty(x.numel() + n * k * op * oq, device=dev)
            dst = torch.empty_like(src)
            layer["floor_ms"] = bench(lambda: dst.copy_(src)) / 2
        best = None
        layouts = args.layouts.split(",")
        for layout in layouts:
            # nhwc: X and Y channels last (the same logical tensors; the kernel reads storage)
            flat = layout.endswith("+flat")  # the flat (tap, channel) reduction
            parts = layout.removesuffix("+flat").split("-")  # X layout [-weights [-Y layout]]
            xlay, wlay, ylay = parts[0], (parts[1:2] or ["rsck"])[0], (parts[2:3] or [parts[0]])[0]
            xin = x if xlay == "nchw" else xl
            wt = wk if wlay == "krsc" else wp
            y = torch.empty(n, k, op, oq, device=dev)
            if ylay == "nhwc":
                y = y.to(memory_format=torch.channels_last)
            lbest = None
            # NCHW: the 6 best of the first sweep
            configs = CONFIGS[:6] if wlay == "rsck" and xlay == "nchw" else NHWC_CONFIGS
            if flat:
                configs = FLAT_CONFIGS
            if group != 1:  # (block_m, block_n, block_k, warps, stages, block-diagonal GEMM)
                gspec = ConvSpec("k", RELU, c, k, conv, pa, args.precision, x_layout=xlay, y_layout=ylay,
                                 w_layout=wlay)
                heur = conv_variants(gspec)[0]
                configs = [(heur.block_m, heur.block_n, heur.block_k, heur.num_warps, heur.num_stages,
                            int(heur.group_gemm))]
                configs += [(*cfg, 0) for cfg in GROUPED_CONFIGS[1:] if (*cfg, 0) != configs[0]]
                configs += [cfg for bm, bn, nw, ns in GROUP_GEMM_CONFIGS if group_gemm_fits(gspec, bn)
                            for cfg in [(bm, bn, min(max(next_pow2(group_span(gspec, bn)), 16), 64), nw, ns, 1)]
                            if cfg != configs[0]]
            if args.configs:
                configs = configs[:args.configs]
            for i, (bm, bn, bk, nw, ns, *gemm) in enumerate(configs[:4] if args.quick else configs):
                v = ConvVariant(0, bm, bn, bk, nw, ns, flat=flat, group_gemm=bool(gemm and gemm[0]))
                name = f"k_conv_{len(out['layers'])}_{layout.replace('-', '_').replace('+', '_')}_{i}"
                try:
                    spec = ConvSpec(name, RELU, c, k, conv, pa, args.precision, x_layout=xlay, y_layout=ylay,
                                    w_layout=wlay)
                    ks = generate_conv(spec, v)
                    fn = _load(ks.source, name, tmp)
                    win = 4 if pa else 1
                    m = n * op * oq * win
                    grid = (triton.cdiv(m, bm), triton.cdiv(k, bn))
                    consts = dict(ks.constexprs)

                    def run(fn=fn, grid=grid, consts=consts, nw=nw, ns=ns, xin=xin, y=y, wt=wt):
                        fn[grid](xin, wt, b, y, n, h, h, p, q, op, oq, num_warps=nw, num_stages=ns, **consts)

                    run()
                    torch.cuda.synchronize()
                    err = float(((y - exact).abs().max() / exact.abs().max()).item())
                    ms = bench(run)
                    rec = {"layout": layout, "config": [bm, bn, bk, nw, ns], "ms": ms, "max_rel_err": err}
                except Exception as e:  # a config that does not compile or fit: recorded, skipped
                    rec = {"layout": layout, "config": [bm, bn, bk, nw, ns],
                           "error": f"{type(e).__name__}: {str(e)[:200]}"}
                if v.group_gemm:
                    rec["group_gemm"] = True
                layer["configs"].append(rec)
                if "ms" in rec and (lbest is None or rec["ms"] < lbest["ms"]):
                    lbest = rec
            layer[f"best_{layout}"] = lbest
            if lbest and (best is None or lbest["ms"] < best["ms"]):
                best = lbest
        layer["best"] = best
        if args.shipped and group == 1:
            layer["shipped"] = shipped(lname, n, c, h, k, conv, pa, x, w, b, exact)
        if group != 1:  # the two loops apart, beside cuDNN and the copy floor
            for loop, is_gemm in (("direct", False), ("group_gemm", True)):
                layer[f"best_{loop}"] = min((r for r in layer["configs"] if "ms" in r
                                             and bool(r.get("group_gemm")) == is_gemm),
                                            key=lambda r: r["ms"], default=None)
            def cell(r):
                return f"{r['ms']:.4f} {r['config']} err {r['max_rel_err']:.1e}" if r else "-"

            print(f"{lname}: cuDNN {layer['cudnn_nchw_ms']:.4f} / channels-last {layer['cudnn_nhwc_ms']:.4f} ms "
                  f"(err {cudnn_err:.1e}), "
                  f"floor {layer['floor_ms']:.4f}; direct {cell(layer['best_direct'])}; block-diagonal GEMM "
                  f"{cell(layer['best_group_gemm'])}", flush=True)
        flops = 2 * n * k * c // group * kw * kw * p * q
        if best:
            layer["best_tflops"] = flops / best["ms"] / 1e9
        out["layers"].append(layer)
        bn_ = layer.get("best_nchw")
        bh_ = min((layer[f"best_{lay}"] for lay in layouts if lay != "nchw" and layer.get(f"best_{lay}")),
                  key=lambda r: r["ms"], default=None)
        rows.append((lname, layer["cudnn_nchw_ms"], layer["cudnn_nhwc_ms"], layer.get("torch_compile_ms"),
                     layer.get("torch_compile_nhwc_ms"), bn_["ms"] if bn_ else None, bh_["ms"] if bh_ else None,
                     (bh_ or bn_ or {}).get("config"), best["max_rel_err"] if best else None))
        print(json.dumps(layer["configs"]), flush=True)
        if args.json:  # after every layer: a run cut short by a time limit keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))


    def shipped(lname, n, c, h, k, conv, pa, x, w, b, exact) -> list[dict]:
        """Each variant `conv_variants` ships for the layer, channels last with [K, R, S, C]
        weights, launched as the library launches it (module docstring)."""
        p, q = conv.out_size(h, h)
        op, oq = pa.out_size(p, q) if pa else (p, q)
        win = 4 if pa else 1
        m = n * op * oq * win
        precision = layer_precision(args.precision, "f32", 1, p * q)
        spec = ConvSpec(f"k_shipped_{len(out['layers'])}", RELU, c, k, conv, pa, precision, x_layout="nhwc",
                        y_layout="nhwc", w_layout="krsc")
        variants = conv_variants(spec)
        meta = {"version": META_VERSION, "variants": [v.meta() for v in variants]}
        pick = launcher_choice(meta, m, k, torch.cuda.get_device_properties(dev).multi_processor_count)
        wk = w.permute(0, 2, 3, 1).contiguous()
        if prerounds_weights(spec):  # as the compile step packs them
            wk = torch.from_numpy(round_array_to_tf32(wk.cpu().numpy())).to(dev)
        xl = x.to(memory_format=torch.channels_last)
        recs = []
        for v in variants:
            kind = "split" if v.split_k else "small-M" if v.max_m else "plain"
            rec = {"variant": kind, "index": v.index, "precision": precision,
                   "config": [v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages],
                   **({"split": v.split} if v.split_k else {}), **({"max_m": v.max_m} if v.max_m else {}),
                   "launcher_pick": v.index == pick}
            try:
                ks = generate_conv(dataclasses.replace(spec, name=f"{spec.name}_{v.index}"), v)
                fn = _load(ks.source, ks.name, tmp)
                y = torch.empty(n, k, op, oq, device=dev).to(memory_format=torch.channels_last)
                grid = (triton.cdiv(m, v.block_m), triton.cdiv(k, v.block_n))
                extra = []
                if v.split_k:  # the workspace and the counters, zeroed before each launch
                    tiles = grid[0] * grid[1]
                    ws = torch.empty(v.split * tiles * v.block_m * v.block_n, device=dev)
                    cnt = torch.zeros(tiles, dtype=torch.int32, device=dev)
                    extra, grid = [ws, cnt], (*grid, v.split)
                consts = dict(ks.constexprs)

                def run(fn=fn, grid=grid, consts=consts, v=v, y=y, extra=extra):
                    if extra:
                        extra[1].zero_()
                    fn[grid](xl, wk, b, y, n, h, h, p, q, op, oq, *extra, num_warps=v.num_warps,
                             num_stages=v.num_stages, **consts)

                run()
                torch.cuda.synchronize()
                rec["max_rel_err"] = float(((y - exact).abs().max() / exact.abs().max()).item())
                rec["ms"] = bench(run)
            except Exception as e:  # recorded, skipped
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            recs.append(rec)
        print(f"{lname}: shipped (M = {m}, the launcher picks variant {pick}): " + "; ".join(
            f"{r['variant']} {r['config']} {precision} " + (f"{r['ms'] * 1000:.1f} us err {r['max_rel_err']:.1e}"
                                                            if "ms" in r else r.get("error", "")) for r in recs),
            flush=True)
        return recs

    chosen = [LAYERS[int(i)] for i in args.layers.split(",")] if args.layers else LAYERS
    if args.pool_only:
        chosen = []
    for layer in chosen:
        measure_layer(*layer)

    # Relu + MaxPool 2x2 at 32x64x112x112: the FusedMaxPool kernel against the memory floor.
    n, c, h = 32, 64, 112
    x = torch.randn(n, c, h, h, device=dev)
    pa = PoolAttrs((2, 2), (2, 2))
    ref = torch.nn.functional.max_pool2d(torch.relu(x), 2, 2)
    y = torch.empty_like(ref)
    copy_src = torch.empty(n * c * h * h + ref.numel(), device=dev)
    copy_dst = torch.empty_like(copy_src)
    floor = bench(lambda: copy_dst.copy_(copy_src)) / 2  # copy reads and writes: half is one pass
    pool_layer = {"layer": "relu_maxpool 32x64x112", "floor_ms": floor, "configs": []}
    pool_layer["torch_eager_ms"] = bench(lambda: torch.nn.functional.max_pool2d(torch.relu(x), 2, 2))
    if not args.no_compile:
        cf = torch.compile(lambda: torch.nn.functional.max_pool2d(torch.relu(x), 2, 2))
        cf()
        pool_layer["torch_compile_ms"] = bench(cf)
    # (tile, block sizes, warps): the flat kernel (one NCHW index per lane, BLOCK outputs),
    # the rows kernel for tiling pools (BLOCK_OH x BLOCK_OW outputs of one plane) and the
    # channels-last kernel (BLOCK_P pixels x BLOCK_C channels, X and Y NHWC)
    xl = x.to(memory_format=torch.channels_last)
    yl = torch.empty_like(ref).to(memory_format=torch.channels_last)
    for tile, blocks, nw in POOL_CONFIGS:
        name = f"k_pool_{tile}_{'_'.join(map(str, blocks))}_{nw}"
        v = (PoolVariant(0, blocks[0], nw) if tile == "flat" else
             PoolVariant(0, 0, nw, "rows", block_oh=blocks[0], block_ow=blocks[1]) if tile == "rows" else
             PoolVariant(0, 0, nw, "nhwc", block_p=blocks[0], block_c=blocks[1]))
        lay = "nhwc" if tile == "nhwc" else "nchw"
        ks = generate_maxpool(MaxPoolSpec(name, RELU, pa, x_layout=lay, y_layout=lay), v)
        fn = _load(ks.source, name, tmp)
        consts = dict(ks.constexprs)
        grid = v.grid(n, c, h // 2, h // 2)  # as the C++ launcher computes it
        xin, yout = (xl, yl) if tile == "nhwc" else (x, y)

        def run(fn=fn, consts=consts, grid=grid, nw=nw, xin=xin, yout=yout):
            fn[grid](xin, yout, n, c, h, h, h // 2, h // 2, num_warps=nw, **consts)

        yout.zero_()
        run()
        torch.cuda.synchronize()
        err = float((yout - ref).abs().max().item())
        ms = bench(run)
        pool_layer["configs"].append({"tile": tile, "config": [*blocks, nw], "ms": ms, "max_abs_err": err,
                                      "of_copy_bandwidth": floor / ms})
        print(f"relu_maxpool {tile:4} {str(blocks):10} warps {nw}: {ms:.4f} ms ({floor / ms:.0%} of copy "
              f"bandwidth) err {err:.1e}", flush=True)
    pbest = min(pool_layer["configs"], key=lambda r: r["ms"])
    pool_layer["best"] = pbest
    for tile in ("flat", "rows", "nhwc"):
        pool_layer[f"best_{tile}"] = min((r for r in pool_layer["configs"] if r["tile"] == tile),
                                         key=lambda r: r["ms"], default=None)
    out["layers"].append(pool_layer)

    print(f"\n{'layer':34} {'cuDNN':>7} {'cuDNN-cl':>8} {'compile':>8} {'comp-cl':>8} {'of-nchw':>8} {'of-nhwc':>8}"
          "  best channels-last config / err")
    for r in rows:
        cells = [f"{v:8.3f}" if isinstance(v, float) else f"{'-':>8}" for v in r[1:7]]
        print(f"{r[0]:34} {' '.join(cells)}  {r[7]} {r[8]}")
    print(f"relu_maxpool: floor {floor:.4f} ms, eager {pool_layer['torch_eager_ms']:.4f}, compile "
          f"{pool_layer.get('torch_compile_ms', float('nan')):.4f}, onnxfuse {pbest['ms']:.4f} {pbest['tile']} "
          f"{pbest['config']} ({floor / pbest['ms']:.0%} of copy bandwidth)")
    for tile in ("flat", "rows", "nhwc"):
        b = pool_layer[f"best_{tile}"]
        if b:
            print(f"  best {tile:4}: {b['ms']:.4f} ms {b['config']} ({floor / b['ms']:.0%} of copy bandwidth)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    np.random.seed(0)
    main()
