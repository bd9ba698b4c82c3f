"""What a model's error would be if every convolution multiplied in TF32, on the CPU: the
model evaluated in float64 (`onnxfuse.reference`) with each Conv's X and W first rounded to
the nearest TF32 value, as cuDNN and cuBLAS round them, against the same evaluation without
the rounding. Beside ONNX Runtime's own error on the GPU, it says which algorithms cuDNN ran:
an ORT error far below the emulated one means fp32 (CUDA-core) kernels for most convs.

    python -m benchmarks.tf32_emulation models/build/pretrained/ppocr_cls.onnx --shape x=1,3,48,192 \
        --json benchmarks/results/tf32_emulation_ppocr_cls.json

Inputs: the suite's image (uniform [0, 1), `numpy.random.default_rng(0)`, as
models/suite.py makes it), then tuning's gate sets (`onnxfuse.tune.accuracy_feeds`,
`--draws` of each). Two emulations: group-1 convs only (cuDNN's depthwise kernels multiply in
fp32) and every conv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from onnxfuse import reference  # noqa: E402
from onnxfuse.codegen_conv import round_array_to_tf32  # noqa: E402
from onnxfuse.tools.shapes import parse_shapes  # noqa: E402
from onnxfuse.tune import accuracy_feeds, feeds_for  # noqa: E402


def round_to_tf32(a: np.ndarray) -> np.ndarray:
    """a as float32 rounded to TF32 the way the shipped kernels round (and cuDNN / cuBLAS:
    `onnxfuse.codegen_conv.round_array_to_tf32`), returned in float64."""
    return round_array_to_tf32(np.asarray(a, np.float32)).astype(np.float64)


def tf32_ops(grouped: bool) -> list[type]:
    """onnxfuse.reference's fast ops with a Conv that rounds X and W to TF32 (group-1 convs
    only unless `grouped`)."""
    base = reference.FAST_OPS
    fast_conv = next(c for c in base if c.__name__ == "Conv")

    class Conv(fast_conv):
        op_domain = ""

        def _run(self, X, W, B=None, **kw):
            if grouped or int(kw.get("group") or 1) == 1:
                X, W = round_to_tf32(X), round_to_tf32(W)
            return super()._run(X, W, B, **kw)

    return [c for c in base if c.__name__ != "Conv"] + [Conv]


def emulate(model: onnx.ModelProto, sets: dict[str, dict[str, np.ndarray]]) -> list[dict]:
    from onnx.reference import ReferenceEvaluator

    m64 = reference.float64_model(model)
    exact = ReferenceEvaluator(m64, new_ops=reference.FAST_OPS)
    emulated = {"group-1 convs": ReferenceEvaluator(m64, new_ops=tf32_ops(False)),
                "every conv": ReferenceEvaluator(m64, new_ops=tf32_ops(True))}
    rows = []
    for name, feeds in sets.items():
        wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        ref = exact.run(None, wide)
        row = {"inputs": name}
        for label, ev in emulated.items():
            got = ev.run(None, wide)
            row[label] = max(float(np.abs(np.asarray(g) - np.asarray(r)).max()) for g, r in zip(got, ref, strict=True))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="NAME=DIMS, as onnxfuse optimize takes it")
    ap.add_argument("--draws", type=int, default=8, help="input sets of each of tuning's distributions")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = onnx.load(str(args.model))
    dims = parse_shapes(args.shape)
    feeds = feeds_for(model, dims)
    image = {k: np.random.default_rng(0).random(v.shape, dtype=np.float32).astype(v.dtype, copy=False)
             if v.dtype.kind == "f" else v for k, v in feeds.items()}
    sets = {"suite image (seed 0)": image, **accuracy_feeds(feeds, draws=args.draws)}
    rows = emulate(model, sets)
    print(f"{args.model.name}: max |TF32-emulated - exact| over the outputs")
    print("| inputs | group-1 convs in TF32 | every conv in TF32 |\n|---|---|---|")
    for r in rows:
        print(f"| {r['inputs']} | {r['group-1 convs']:.2e} | {r['every conv']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model.name, "shapes": {k: list(v) for k, v in dims.items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
