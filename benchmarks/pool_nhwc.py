"""The channels-last FusedMaxPool kernel on YOLOv8's SPPF pools (MaxPool 5x5 stride 1 pad 2
at 10x10 with 256 channels, batch 1 and 16), per tile configuration, launched as the
ahead-of-time kernel runs in a model: integer arguments not specialized (Triton's JIT would
otherwise assume C divisible by 16 and vectorize), and with specialization for comparison.
Times: triton.testing.do_bench medians; torch's max_pool2d (channels-last) as the peer.

    python benchmarks/pool_nhwc.py --json pool_nhwc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.conv_kernels import RELU, _load  # noqa: E402
from onnxfuse.codegen_conv import MaxPoolSpec, PoolVariant, generate_maxpool  # noqa: E402
from onnxfuse.layers import PoolAttrs  # noqa: E402

CONFIGS = [(32, 64, 4), (16, 64, 2), (8, 64, 2), (8, 64, 1), (4, 64, 1), (16, 32, 1), (8, 32, 1), (4, 128, 2),
           (2, 128, 1), (8, 128, 4), (2, 64, 1), (4, 32, 1)]  # BLOCK_P, BLOCK_C, warps
# N, C, H=W, pool (kernel, stride, pad): YOLO's SPPF, ResNet's stem pool, the 2x2 layer
SHAPES = [(16, 256, 10, (5, 1, 2)), (1, 256, 10, (5, 1, 2)), (16, 128, 20, (5, 1, 2)), (16, 64, 40, (5, 1, 2)),
          (32, 64, 112, (3, 2, 1)), (32, 64, 112, (2, 2, 0))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shapes", help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--aot-only", action="store_true", help="only the unspecialized (AOT-like) launches")
    args = ap.parse_args()
    import torch
    import triton
    from triton.testing import do_bench

    tmp = Path(tempfile.mkdtemp(prefix="pool_nhwc_"))
    ap_only = args.shapes
    rows = []
    for i, (n, c, h, (k, st, pd)) in enumerate(SHAPES):
        if ap_only and str(i) not in ap_only.split(","):
            continue
        pa = PoolAttrs((k, k), (st, st), (pd,) * 4)
        oh = (h + 2 * pd - k) // st + 1
        x = torch.randn(n, c, h, h, device="cuda").to(memory_format=torch.channels_last)
        ref = torch.nn.functional.max_pool2d(torch.relu(x), k, st, pd)
        peer = do_bench(lambda x=x, k=k, st=st, pd=pd: torch.nn.functional.max_pool2d(torch.relu(x), k, st, pd),
                        return_mode="median")
        for bp, bc, nw in CONFIGS:
            name = f"k_pool_nhwc_{bp}_{bc}_{nw}"
            v = PoolVariant(0, 0, nw, "nhwc", block_p=bp, block_c=bc)
            ks = generate_maxpool(MaxPoolSpec(name, RELU, pa, x_layout="nhwc", y_layout="nhwc"), v)
            fn = _load(ks.source, name, tmp)
            plain = triton.jit(fn.fn, do_not_specialize=["N", "C", "H", "W", "OH", "OW"])
            consts = dict(ks.constexprs)
            grid = v.grid(n, c, oh, oh)
            y = torch.empty_like(ref)
            for label, kern in (("aot-like", plain), ("specialized", fn))[:1 if args.aot_only else 2]:
                def run(kern=kern, grid=grid, nw=nw, consts=consts, y=y, x=x, dims=(n, c, h, h, oh, oh)):
                    kern[grid](x, y, *dims, num_warps=nw, **consts)

                run()
                torch.cuda.synchronize()
                err = float((y - ref).abs().max())
                ms = do_bench(run, return_mode="median")
                rows.append({"shape": [n, c, h, h], "config": [bp, bc, nw], "launch": label, "ms": ms, "err": err,
                             "torch_ms": peer})
                print(f"N{n} C{c} {h}x{h} k{k}s{st}p{pd} {label:11} {bp:3}x{bc:3} w{nw}: {ms * 1e3:7.2f} us "
                      f"(torch {peer * 1e3:.2f}) err {err:.1e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
