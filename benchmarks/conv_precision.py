"""Conv precision: the error and time of onnxfuse's conv kernels at each precision, beside cuDNN.

For real layer shapes (ResNet-50, YOLOv8n and MobileNet-like), every conv kernel onnxfuse
ships for the layer (`onnxfuse.kinds.conv.conv_variants`: the tap loop, the flat loop of
narrow inputs, split K where the launcher would take it, the direct loop of grouped convs),
in the NCHW path's layouts (X, Y NCHW, weights [R, S, C, K]) and the NHWC pass's
(channels-last X and Y, weights [K, R, S, C]; narrow X stays NCHW), at each precision:

- ``tf32``        the activations rounded to the nearest TF32 value in the kernel, the weights
                  rounded beforehand (as the compile step packs them), then tl.dot (the default)
- ``tf32-ab``     both operands rounded in the kernel (the first rounding kernels)
- ``tf32-trunc``  Triton's own tf32 dot, which truncates them: the kernels before rounding
                  (generated with the private switch `codegen_conv._ROUND_TF32` off)
- ``tf32x3``, ``ieee``
- ``fp32``        grouped and depthwise convs: fp32 FMA on CUDA cores at every precision

and cuDNN through torch on the same inputs in the same memory format: ``cudnn-tf32``
(``torch.backends.cudnn.allow_tf32 = True``, as ONNX Runtime's CUDA EP by default) and
``cudnn-fp32`` (False). Errors are against the float64 conv of the same fp32 inputs, for
three inputs (bias 0, so only the conv shows):

- ``relu``      X uniform in [0, 1) (ReLU-like activations), weights N(0, 1)
- ``signed``    X and weights N(0, 1)
- ``positive``  X and weights uniform in [0, 1): the GEMM in which truncation's bias was found

as ``max`` = max |err| / max |ref|, ``bias`` = mean(err * sign(ref)) / mean |ref| (negative
when the results shrink toward zero, truncation's signature; for positive results it is
``mean`` = mean err / mean |ref|, also recorded) and ``l2`` = ||err|| / ||ref||. Time: the
kernel's median (triton.testing.do_bench, L2 flushed between runs) on the relu inputs; a
split-K run includes zeroing its arrival counters, as the launcher does before each launch.

    python benchmarks/conv_precision.py --json benchmarks/results/conv_precision.json
    python benchmarks/conv_precision.py --dry-run   # CPU: Triton's interpreter, small shapes

``--dry-run`` runs the same code on the CPU: TRITON_INTERPRET=1, each layer at batch 1, at
most 8x8 pixels and a quarter of the channels (a wall-clock time of one call instead of
do_bench). The interpreter's tl.dot computes in full fp32, so there only the ``tf32`` rows
show TF32's error; tf32-trunc equals ieee.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxfuse.codegen_conv as codegen_conv  # noqa: E402
from benchmarks.conv_kernels import _load  # noqa: E402
from onnxfuse.codegen import KernelSource  # noqa: E402
from onnxfuse.codegen_conv import (  # noqa: E402
    ConvSpec,
    ConvVariant,
    generate_conv,
    round_array_to_tf32,
    rounds_to_tf32,
)
from onnxfuse.expr import HEADER, parse  # noqa: E402
from onnxfuse.kinds.conv import MIN_NHWC_CHANNELS, conv_decline_reason, conv_variants  # noqa: E402
from onnxfuse.layers import ConvAttrs  # noqa: E402

IDENTITY = parse(HEADER + "\ninput %0 f32\noutput %0 f32\n")  # the conv's output as it is


@dataclass(frozen=True)
class Layer:
    """One conv layer: N x C x H x H input, K filters, a square kernel."""

    name: str
    n: int
    c: int
    h: int
    k: int
    kernel: int = 3
    stride: int = 1
    pad: int = 1
    group: int = 1

    @property
    def conv(self) -> ConvAttrs:
        return ConvAttrs((self.kernel,) * 2, (self.stride,) * 2, (self.pad,) * 4, group=self.group)

    def small(self) -> Layer:
        """The dry run's version: batch 1, at most 8x8 pixels, a quarter of the channels
        (at least 16, so that wide inputs stay channels-last; narrow ones as they are)."""
        def quarter(v: int) -> int:
            return v if v < MIN_NHWC_CHANNELS else max(MIN_NHWC_CHANNELS, v // 4)

        c, k = quarter(self.c), quarter(self.k)
        group = self.group if self.group == 1 else max(1, self.group * c // self.c)
        return replace(self, n=1, h=min(self.h, 8), c=c, k=k, group=group)


LAYERS = [
    Layer("resnet50 3x3 64->64 56²", 32, 64, 56, 64),
    Layer("resnet50 1x1 256->64 56²", 32, 256, 56, 64, kernel=1, pad=0),
    Layer("resnet50 3x3 256->256 14²", 32, 256, 14, 256),
    Layer("resnet50 3x3 s2 128->128 56²", 32, 128, 56, 128, stride=2),
    Layer("resnet50 stem 7x7 s2 3->64 224²", 32, 3, 224, 64, kernel=7, stride=2, pad=3),
    Layer("yolov8n stem 3x3 s2 3->16 640² b16", 16, 3, 640, 16, stride=2),
    Layer("yolov8n head 3x3 256->64 10² b1", 1, 256, 10, 64),
    Layer("grouped 3x3 128->128 g32 28²", 32, 128, 28, 128, group=32),
    Layer("depthwise 3x3 96 28²", 32, 96, 28, 96, group=96),
]
INPUTS = ("relu", "signed", "positive")
# (label, ConvSpec precision, codegen_conv._ROUND_TF32: which operands the kernel rounds; with
# "a" the weights are rounded beforehand, as the compile step does)
PRECISIONS = [("tf32", "tf32", "a"), ("tf32-ab", "tf32", "ab"), ("tf32-trunc", "tf32", ""),
              ("tf32x3", "tf32x3", "a"), ("ieee", "ieee", "a")]
DIRECT = [("fp32", "tf32", "a")]  # grouped convs: the precision changes nothing
SMS_DRY_RUN = 132  # the H200's multiprocessors, for the split-K rule in a dry run


def layouts(layer: Layer) -> dict[str, tuple[str, str, str]]:
    """Layout name -> (X, Y, weights): the NCHW path's, and the NHWC pass's (a group-1 conv
    with fewer than MIN_NHWC_CHANNELS input channels keeps NCHW X there)."""
    narrow = layer.group == 1 and layer.c < MIN_NHWC_CHANNELS
    return {"nchw": ("nchw", "nchw", "rsck"), "nhwc": ("nchw" if narrow else "nhwc", "nhwc", "krsc")}


def spec_for(layer: Layer, layout: tuple[str, str, str], precision: str, name: str = "k") -> ConvSpec:
    x, y, w = layout
    return ConvSpec(name, IDENTITY, layer.c, layer.k, layer.conv, None, precision, x_layout=x, y_layout=y,
                    w_layout=w)


def shipped_kernels(layer: Layer, layout: tuple[str, str, str], sms: int) -> list[tuple[str, ConvVariant]]:
    """(kind, variant) of the kernels onnxfuse ships for the layer: the plain one ("plain",
    "flat" or "direct"), the split-K one where the launcher would launch it (its tiles at
    most half the multiprocessors, docs/format.md) and the small-M one where M is at most its
    max_m."""
    out = []
    p, q = layer.conv.out_size(layer.h, layer.h)
    for v in conv_variants(spec_for(layer, layout, "tf32")):
        if v.split_k:
            tiles = math.ceil(layer.n * p * q / v.block_m) * math.ceil(layer.k / v.block_n)
            if tiles <= sms // 2:
                out.append(("split", v))
        elif v.max_m:
            if layer.n * p * q <= v.max_m:
                out.append(("small_m", v))
        else:
            out.append(("direct" if layer.group != 1 else "flat" if v.flat else "plain", v))
    return out


def generate(spec: ConvSpec, variant: ConvVariant, round_tf32: str) -> KernelSource:
    """The kernel source with the TF32 rounding mode `round_tf32` (the private switch, restored)."""
    saved = codegen_conv._ROUND_TF32
    codegen_conv._ROUND_TF32 = round_tf32
    try:
        return generate_conv(spec, variant)
    finally:
        codegen_conv._ROUND_TF32 = saved


def make_inputs(layer: Layer, kind: str, device, seed: int = 0):
    """X [N, C, H, H] and weights [K, C/group, R, S], float32 on `device` (INPUTS)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = (layer.n, layer.c, layer.h, layer.h)
    ws = (layer.k, layer.c // layer.group, layer.kernel, layer.kernel)
    if kind == "relu":
        x, w = torch.rand(xs, generator=g), torch.randn(ws, generator=g)
    elif kind == "signed":
        x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g)
    elif kind == "positive":
        x, w = torch.rand(xs, generator=g), torch.rand(ws, generator=g)
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    return x.to(device), w.to(device)


def conv_ref(layer: Layer, x, w):
    """The float64 conv of the fp32 inputs."""
    import torch.nn.functional as F

    return F.conv2d(x.double(), w.double(), None, layer.stride, layer.pad, groups=layer.group)


def errors(y, ref) -> dict[str, float]:
    """y (any memory format) against the float64 reference (INPUTS' metrics)."""
    err = y.double() - ref
    mag = ref.abs()
    return {"max": float(err.abs().max() / mag.max()), "bias": float((err * ref.sign()).mean() / mag.mean()),
            "mean": float(err.mean() / mag.mean()), "l2": float(err.norm() / ref.norm())}


def launcher(fn, ks: KernelSource, v: ConvVariant, layer: Layer, x, w_packed, y) -> Callable[[], None]:
    """A call that runs the kernel on (x, packed weights) into y, with the grid, sizes and
    split-K buffers the C++ launcher passes (docs/format.md, kind conv)."""
    import torch

    n, h = layer.n, layer.h
    p, q = layer.conv.out_size(h, h)
    grid = (math.ceil(n * p * q / v.block_m), math.ceil(layer.k / v.block_n))
    b = torch.zeros(layer.k, device=x.device)
    consts = dict(ks.constexprs)
    split: list = []
    if v.split_k:
        tiles = grid[0] * grid[1]
        split = [torch.empty(v.split * tiles * v.block_m * v.block_n, device=x.device),
                 torch.zeros(tiles, dtype=torch.int32, device=x.device)]
        grid = (*grid, v.split)

    def run() -> None:
        if split:
            split[1].zero_()  # the arrival counters, zeroed before each launch
        fn[grid](x, w_packed, b, y, n, h, h, p, q, p, q, *split, num_warps=v.num_warps, num_stages=v.num_stages,
                 **consts)

    return run


@contextlib.contextmanager
def cudnn_tf32(allow: bool) -> Iterator[None]:
    import torch

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def round_weights(w):
    """Float32 weights (a torch tensor) rounded to TF32 as the compile step rounds them
    (`onnxfuse.codegen_conv.round_array_to_tf32`)."""
    import torch

    return torch.from_numpy(round_array_to_tf32(w.cpu().numpy())).to(w.device)


def pack(w, w_layout: str):
    """ONNX weights [K, C/group, R, S] as the kernels read them."""
    return (w.permute(2, 3, 1, 0) if w_layout == "rsck" else w.permute(0, 2, 3, 1)).contiguous()


def measure_layer(index: int, layer: Layer, device, timer: Callable[[Callable[[], object]], float], sms: int,
                  tmp: Path) -> list[dict]:
    """Every row of one layer: onnxfuse kernels and cuDNN, per layout."""
    import torch
    import torch.nn.functional as F

    inputs = {kind: make_inputs(layer, kind, device, seed=index) for kind in INPUTS}
    refs = {kind: conv_ref(layer, *xw) for kind, xw in inputs.items()}
    p, q = layer.conv.out_size(layer.h, layer.h)
    rows = []
    for lname, lay in layouts(layer).items():
        x_cl, y_cl = lay[0] == "nhwc", lay[1] == "nhwc"
        fmt = torch.channels_last
        xs = {kind: x.contiguous(memory_format=fmt) if x_cl else x for kind, (x, _) in inputs.items()}
        ws = {kind: pack(w, lay[2]) for kind, (_, w) in inputs.items()}
        y = torch.empty(layer.n, layer.k, p, q, device=device)
        if y_cl:
            y = y.contiguous(memory_format=fmt)
        base = {"layer": layer.name, "shape": [layer.n, layer.c, layer.h, layer.h, layer.k],
                "kernel_size": layer.kernel, "stride": layer.stride, "group": layer.group, "layout": lname,
                "x_y_w": list(lay)}
        declined = conv_decline_reason(spec_for(layer, lay, "tf32"), lname)
        for kind, v in shipped_kernels(layer, lay, sms):
            for label, precision, round_tf32 in (DIRECT if layer.group != 1 else PRECISIONS):
                row = {**base, "kernel": kind, "precision": label,
                       "config": [v.block_m, v.block_n, v.block_k, v.num_warps, v.num_stages, v.split],
                       "declined_by_heuristic": declined}
                name = f"k_prec_{index}_{lname}_{kind}_{label.replace('-', '_')}"
                try:
                    spec = spec_for(layer, lay, precision, name)
                    ks = generate(spec, v, round_tf32)
                    fn = _load(ks.source, name, tmp)
                    row["errors"] = {}
                    pre = round_tf32 == "a" and rounds_to_tf32(spec)  # weights rounded when packed
                    for inp in INPUTS:
                        w = round_weights(ws[inp]) if pre else ws[inp]
                        run = launcher(fn, ks, v, layer, xs[inp], w, y)
                        y.fill_(float("nan"))
                        run()
                        row["errors"][inp] = errors(y, refs[inp])
                    w = round_weights(ws["relu"]) if pre else ws["relu"]
                    row["ms"] = timer(launcher(fn, ks, v, layer, xs["relu"], w, y))
                except Exception as e:  # a kernel that does not compile or run: recorded
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        wl = {kind: (w.contiguous(memory_format=fmt) if x_cl else w) for kind, (_, w) in inputs.items()}
        for label, allow in (("cudnn-tf32", True), ("cudnn-fp32", False)):
            row = {**base, "kernel": "cudnn", "precision": label, "errors": {}}
            with cudnn_tf32(allow):
                for inp in INPUTS:
                    out = F.conv2d(xs[inp], wl[inp], None, layer.stride, layer.pad, groups=layer.group)
                    row["errors"][inp] = errors(out, refs[inp])
                x, w = xs["relu"], wl["relu"]
                row["ms"] = timer(lambda x=x, w=w: F.conv2d(x, w, None, layer.stride, layer.pad, groups=layer.group))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a text table: time, then the relu inputs' max / bias / L2, the signed
    inputs' max / L2 and the positive inputs' bias."""
    head = (f"{'layer':34} {'layout':6} {'kernel':7} {'precision':10} {'ms':>8} | {'relu max':>9} {'bias':>9} "
            f"{'L2':>9} | {'sgn max':>9} {'L2':>9} | {'pos bias':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = f"{r['layer'][:34]:34} {r['layout']:6} {r['kernel']:7} {r['precision']:10}"
        if "error" in r:
            lines.append(f"{cells} failed: {r['error'][:80]}")
            continue
        e = r["errors"]
        vals = [e["relu"]["max"], e["relu"]["bias"], e["relu"]["l2"], e["signed"]["max"], e["signed"]["l2"],
                e["positive"]["bias"]]
        v = [f"{x:9.1e}" for x in vals]
        lines.append(f"{cells} {r['ms']:8.4f} | {' '.join(v[:3])} | {' '.join(v[3:5])} | {v[5]}")
    return "\n".join(lines)


def rounding_cost(rows: list[dict]) -> list[str]:
    """Per onnxfuse kernel: the rounding tf32 kernels' times over the truncating one's (tf32,
    then tf32-ab)."""
    ms = {(r["layer"], r["layout"], r["kernel"], r["precision"]): r.get("ms") for r in rows}
    out = []
    for (layer, layout, kernel, precision), t in ms.items():
        trunc = ms.get((layer, layout, kernel, "tf32-trunc"))
        both = ms.get((layer, layout, kernel, "tf32-ab"))
        if precision == "tf32" and t and trunc:
            ab = f"  {both / trunc:.3f}" if both else ""
            out.append(f"{layer[:34]:34} {layout:6} {kernel:7} {t / trunc:.3f}{ab}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write every row (and the device) here")
    ap.add_argument("--layers", default=None, help="comma-separated indices into LAYERS (default: all)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: Triton's interpreter, small shapes, one timed call (checks the script)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dry_run:  # read when the kernels' modules are loaded (triton.jit)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    chosen = [LAYERS[int(i)] for i in args.layers.split(",")] if args.layers else LAYERS
    if args.dry_run:
        device, sms = torch.device("cpu"), SMS_DRY_RUN
        chosen = [layer.small() for layer in chosen]

        def timer(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    else:
        from triton.testing import do_bench

        device = torch.device("cuda")
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        torch.backends.cudnn.benchmark = True

        def timer(fn: Callable[[], object]) -> float:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    out = {"device": "cpu (dry run, Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
           "dry_run": args.dry_run, "multiprocessors": sms, "inputs": list(INPUTS), "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="conv_precision_"))
    index = {layer.name: i for i, layer in enumerate(LAYERS)}
    for layer in chosen:
        out["rows"] += measure_layer(index[layer.name], layer, device, timer, sms, tmp)
        if args.json:  # after every layer: a run cut short keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    print()
    print(table(out["rows"]))
    print("\nRounded tf32 over truncated tf32, kernel time (tf32, then tf32-ab)"
          + (" (dry run: the interpreter's wall clock, not a GPU time):" if args.dry_run else ":"))
    print("\n".join(rounding_cost(out["rows"])))
    return out


if __name__ == "__main__":
    main()
