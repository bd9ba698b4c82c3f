"""What the gate's float64 reference costs: `onnxfuse.reference.evaluate` against one
ONNX Runtime float32 run on the CPU, per model and input shape, with the model's FLOPs
(`onnxfuse.cost`) and the largest difference between the two (float32's own error, as a
check that the evaluator computes the same model).

    python -m benchmarks.reference_cost --json benchmarks/results/reference_cost.json

Models: the small benchmark models (models/build.py, built into a temporary folder) and
the pretrained ones already in models/pretrained.py's cache (not fetched).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (model, input -> shape); pretrained models at the shapes the suite uses
PRETRAINED = [
    ("yolov8n_320", {"images": (1, 3, 320, 320)}), ("yolov8n_320", {"images": (1, 3, 640, 640)}),
    ("yolov8n_320", {"images": (8, 3, 640, 640)}), ("ppocr_det", {"x": (1, 3, 640, 640)}),
    ("ppocr_v3_det", {"x": (1, 3, 640, 640)}), ("ppocr_rec", {"x": (16, 3, 48, 320)}),
    ("ppocr_cls", {"x": (16, 3, 48, 192)}), ("doc_orientation", {"x": (16, 3, 224, 224)}),
]
BUILT = ["vgg_stack", "conv_relu_maxpool", "mlp_block", "example"]


def measure(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict:
    import onnxruntime as ort

    from onnxfuse import reference
    from onnxfuse.cost import model_cost

    m = onnx.load(str(path))
    init = {t.name for t in m.graph.initializer}
    feeds = {}
    rng = np.random.default_rng(0)
    for i in m.graph.input:
        if i.name in init:
            continue
        tt = i.type.tensor_type
        shape = shapes.get(i.name) or tuple(d.dim_value if d.dim_value > 0 else 1 for d in tt.shape.dim)
        feeds[i.name] = rng.random(shape).astype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
    try:
        flops: float | None = model_cost(m, {k: v.shape for k, v in feeds.items()}).flops
    except Exception:  # noqa: BLE001  a model onnxfuse.cost cannot bind (dims of -1)
        flops = None
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    t0 = time.perf_counter()
    got = sess.run(None, feeds)
    ort_s = time.perf_counter() - t0
    ref, ref_s = reference.timed_evaluate(m, feeds)
    rel = max(float(np.abs(a.astype(np.float64) - r).max() / max(np.abs(r).max(), 1e-30))
              for a, r in zip(got, ref.values(), strict=True))
    return {"model": path.stem, "inputs": {k: list(v.shape) for k, v in feeds.items()},
            "gflop": None if flops is None else flops / 1e9,
            "float64_s": ref_s, "ort_float32_s": ort_s, "max_diff_rel_to_scale": rel}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from models import build as mb
    from models import pretrained

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs: list[tuple[Path, dict]] = [(p, {}) for p in mb.build(Path(tmp), BUILT)]
        jobs += [(pretrained.cache_dir() / f"{n}.onnx", s) for n, s in PRETRAINED
                 if (pretrained.cache_dir() / f"{n}.onnx").is_file()]
        for path, shapes in jobs:
            r = measure(path, shapes)
            rows.append(r)
            print(f"{r['model']:<18} {'x'.join(map(str, next(iter(r['inputs'].values())))):<16} "
                  f"{r['gflop'] or float('nan'):8.2f} GFLOP  float64 {r['float64_s']:7.2f} s  "
                  f"ORT fp32 {r['ort_float32_s']:6.3f} s  "
                  f"diff {r['max_diff_rel_to_scale']:.1e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
