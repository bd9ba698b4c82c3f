"""What a model's error would be if its convolutions and matrix products multiplied in TF32, on
the CPU: the model evaluated in float64 (`onnxfuse.reference`) with each Conv's X and W (and,
in the last two emulations, each MatMul's and Gemm's A and B) first rounded to the nearest TF32
value, as cuDNN and cuBLAS round them, against the same evaluation without the rounding. Beside
ONNX Runtime's own error on the GPU, it says which algorithms ORT ran: an ORT error far below
the emulated one means fp32 (CUDA-core) kernels for most convs; one equal to "matmuls" and
below "matmuls + every conv" means cuBLAS multiplied in TF32 and cuDNN did not (the
forty-sixth session's ViT-S/16: its patch-embedding conv).

    python -m benchmarks.tf32_emulation models/build/pretrained/ppocr_cls.onnx --shape x=1,3,48,192 \
        --json benchmarks/results/tf32_emulation_ppocr_cls.json

Inputs: the suite's image (uniform [0, 1), `numpy.random.default_rng(0)`, as
models/suite.py makes it), then tuning's gate sets (`onnxfuse.tune.accuracy_feeds`,
`--draws` of each). Four emulations: group-1 convs only (cuDNN's depthwise kernels multiply in
fp32), every conv, the matrix products only (ORT's CUDA EP default: cuBLAS in TF32), and the
products and every conv, and any other set of ops given with `--emulate` (MatMul,Conv: the
products without Gemm's); each as the max and the root mean square of |emulated - exact| over
the outputs (the RMS over all their elements).
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
from onnxfuse.tools.gate import rms_error  # noqa: E402
from onnxfuse.tools.shapes import parse_shapes  # noqa: E402
from onnxfuse.tune import accuracy_feeds, feeds_for  # noqa: E402


def round_to_tf32(a: np.ndarray) -> np.ndarray:
    """a as float32 rounded to TF32 the way the shipped kernels round (and cuDNN / cuBLAS:
    `onnxfuse.codegen_conv.round_array_to_tf32`), returned in float64."""
    return round_array_to_tf32(np.asarray(a, np.float32)).astype(np.float64)


# label: the ops whose operands are rounded ("Conv1": group-1 convs only)
EMULATIONS = {"group-1 convs": ("Conv1",), "every conv": ("Conv",), "matmuls": ("MatMul", "Gemm"),
              "matmuls + every conv": ("MatMul", "Gemm", "Conv")}
OPS = ("Conv1", "Conv", "MatMul", "Gemm")


def tf32_ops(ops: tuple[str, ...] = ()) -> list[type]:
    """onnxfuse.reference's fast ops with a Conv (every one with "Conv" in `ops`, group-1 ones
    with "Conv1"), a MatMul ("MatMul") and a Gemm ("Gemm") that round their two multiplied
    operands to TF32 first; the others exact."""
    from onnx.reference.ops.op_gemm import Gemm_7
    from onnx.reference.ops.op_matmul import MatMul as RefMatMul

    base = reference.FAST_OPS
    fast_conv = next(c for c in base if c.__name__ == "Conv")

    class Conv(fast_conv):
        op_domain = ""

        def _run(self, X, W, B=None, **kw):
            if "Conv" in ops or ("Conv1" in ops and int(kw.get("group") or 1) == 1):
                X, W = round_to_tf32(X), round_to_tf32(W)
            return super()._run(X, W, B, **kw)

    class MatMul(RefMatMul):
        op_domain = ""

        def _run(self, a, b):
            return super()._run(*((round_to_tf32(a), round_to_tf32(b)) if "MatMul" in ops else (a, b)))

    class Gemm(Gemm_7):
        op_domain = ""

        def _run(self, a, b, c=None, **kw):
            return super()._run(*((round_to_tf32(a), round_to_tf32(b)) if "Gemm" in ops else (a, b)), c, **kw)

    return [c for c in base if c.__name__ != "Conv"] + [Conv, MatMul, Gemm]


def emulate(model: onnx.ModelProto, sets: dict[str, dict[str, np.ndarray]],
            emulations: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """Per input set: {"inputs": name, <emulation>: max |emulated - exact|, "<emulation> rms": its
    RMS}, for each emulation (label: ops, `tf32_ops`; default EMULATIONS)."""
    emulations = EMULATIONS if emulations is None else emulations
    from onnx.reference import ReferenceEvaluator

    m64 = reference.float64_model(model)
    exact = ReferenceEvaluator(m64, new_ops=tf32_ops())
    emulated = {label: ReferenceEvaluator(m64, new_ops=tf32_ops(ops)) for label, ops in emulations.items()}
    rows = []
    for name, feeds in sets.items():
        wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        ref = exact.run(None, wide)
        row = {"inputs": name}
        for label, ev in emulated.items():
            got = ev.run(None, wide)
            diffs = [np.abs(np.asarray(g) - np.asarray(r)).ravel() for g, r in zip(got, ref, strict=True)]
            d = np.concatenate(diffs) if diffs else np.zeros(0)
            row[label] = float(d.max()) if d.size else 0.0
            row[f"{label} rms"] = rms_error(d)
        rows.append(row)
    return rows


def fmt_sci(v: float | None) -> str:
    """An error for the table: two decimals, "nan/inf" where it is not finite (None)."""
    return "nan/inf" if v is None else f"{v:.2e}"


def suite_image(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`feeds` with each float input replaced as models/suite.py makes an image: uniform in
    [0, 1), `numpy.random.default_rng(0)`, in the input's dtype."""
    return {k: np.random.default_rng(0).random(v.shape, dtype=np.float32).astype(v.dtype, copy=False)
            if v.dtype.kind == "f" else v for k, v in feeds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="NAME=DIMS, as onnxfuse optimize takes it")
    ap.add_argument("--draws", type=int, default=8, help="input sets of each of tuning's distributions")
    ap.add_argument("--emulate", action="append", default=[], metavar="OPS",
                    help=f"one more emulation: the comma-separated ops ({', '.join(OPS)}) rounded to TF32, "
                         "e.g. MatMul,Conv (repeatable)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    extra = {e: tuple(e.split(",")) for e in args.emulate}
    bad = sorted({op for ops in extra.values() for op in ops} - set(OPS))
    if bad:
        ap.error(f"--emulate: unknown op {bad[0]!r} (one of {', '.join(OPS)})")
    emulations = EMULATIONS | extra
    model = onnx.load(str(args.model))
    dims = parse_shapes(args.shape)
    feeds = feeds_for(model, dims)
    sets = {"suite image (seed 0)": suite_image(feeds), **accuracy_feeds(feeds, draws=args.draws)}
    rows = emulate(model, sets, emulations)
    print(f"{args.model.name}: |TF32-emulated - exact| over the outputs, max (RMS), multiplied in TF32:")
    print("| inputs | " + " | ".join(emulations) + " |\n" + "|---" * (len(emulations) + 1) + "|")
    for r in rows:
        print(f"| {r['inputs']} | " + " | ".join(f"{r[k]:.2e} ({fmt_sci(r[k + ' rms'])})" for k in emulations) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model.name, "shapes": {k: list(v) for k, v in dims.items()},
                                         "emulations": emulations, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
