"""Where ONNX Runtime's own kernels put NaN: each model of tests/test_nan.py (pools, convs,
pointwise ops over inputs with NaN and Inf sprinkled in) run as the original model in ONNX
Runtime, against numpy's NaN placement. For README's Reliability section ("ONNX Runtime's own
kernels are not consistent about it").

    python benchmarks/ort_nan.py [--provider cuda] [--json out.json]

Prints a table (per model: NaN in numpy, NaN in ORT, elements where only one has NaN) and
writes JSON. Measured on the CPU provider in tests/test_nan.py; this is for the CUDA one
(TF32 off, so only NaN placement differs from fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_nan import MODEL_CASES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import onnxruntime as ort

    provider = (("CUDAExecutionProvider", {"use_tf32": "0"}) if args.provider == "cuda" else "CPUExecutionProvider")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    rows = []
    for case in MODEL_CASES:
        m, feeds, want = case.build()
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=[provider])
        (got,) = sess.run(None, feeds)
        rows.append({"model": case.id, "elements": int(want.size), "nan_numpy": int(np.isnan(want).sum()),
                     "nan_ort": int(np.isnan(got).sum()),
                     "nan_in_one_only": int((np.isnan(want) != np.isnan(got)).sum())})
    print(f"{'model':32} {'elements':>8} {'NaN numpy':>9} {'NaN ORT':>8} {'in one only':>11}")
    for r in rows:
        print(f"{r['model']:32} {r['elements']:8d} {r['nan_numpy']:9d} {r['nan_ort']:8d} {r['nan_in_one_only']:11d}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "provider": args.provider,
                                         "onnxruntime": ort.__version__, "models": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
