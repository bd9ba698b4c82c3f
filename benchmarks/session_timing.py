"""How the way models are timed changes their times: each model alone (as `onnxfuse bench`
times it), then all of them open at once with their runs interleaved (as `optimize`'s tuning
times the original against its candidates), then interleaved again with ONNX Runtime's
intra-op threads not spinning (`interleaved-nospin`), and with one intra-op thread
(`interleaved-1thread`).

Why: on the H200 a 4-layer torch encoder at batch 8 timed 0.948 ms alone (bench) but
1.677 ms in tuning's interleaved whole-model check, so candidates slower than the original
were kept. The original runs its shape arithmetic on the CPU between GPU kernels; the guess
to test here is that other open sessions' spinning threads slow that host work.

    python benchmarks/session_timing.py enc.onnx enc.opt.onnx --provider cuda --batch 8 \\
        --shape seq=128 --json session_timing.json

Prints a table (median / p10 / p90 ms per model and mode) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onnxfuse.tools import session as ts  # noqa: E402
from onnxfuse.tools.shapes import parse_shapes  # noqa: E402
from onnxfuse.tune import TuneSettings, feeds_for, input_shapes  # noqa: E402

MODES = ("alone", "interleaved", "interleaved-nospin", "interleaved-1thread")


def _open(paths, feeds, settings, graph_modes):
    bound = {}
    for p in paths:
        for g in graph_modes:
            s = ts.BenchSettings(**{**settings.__dict__, "cuda_graph": g})
            try:
                b = ts.BoundModel(p, feeds, s, library=True)
                b.time(settings.warmup)
                bound[Path(p).name, g] = b
            except Exception as e:  # noqa: BLE001  a model that cannot run in a mode is reported
                bound[Path(p).name, g] = ts.first_line(e)
    return bound


def measure(paths: list[str], feeds, settings: ts.BenchSettings, mode: str, graph_modes) -> dict:
    out = {}
    if mode == "alone":
        for p in paths:
            for g in graph_modes:
                try:
                    run = ts.run_model(p, feeds, ts.BenchSettings(**{**settings.__dict__, "cuda_graph": g}), True)
                    out[Path(p).name, g] = run.times_ms
                except Exception as e:  # noqa: BLE001
                    out[Path(p).name, g] = ts.first_line(e)
        return out
    bound = _open(paths, feeds, settings, graph_modes)
    live = {k: b for k, b in bound.items() if not isinstance(b, str)}
    try:
        out = {k: b for k, b in bound.items() if isinstance(b, str)}
        out.update(ts.interleave(live, settings.iters, 5))
    finally:
        for b in live.values():
            b.close()
    return out


def _options(original, spinning: bool):
    def options(s, library):
        so = original(s, library)
        if not spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return so
    return options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int)
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import onnx

    original = onnx.load(args.models[0], load_external_data=False)
    feeds = feeds_for(original, input_shapes(original, TuneSettings(shapes=parse_shapes(args.shape), batch=args.batch)))
    graph_modes = (False, True) if args.provider == "cuda" else (False,)
    results = {}
    original_options = ts.session_options
    for mode in args.modes.split(","):
        if mode not in MODES:
            ap.error(f"--modes: {mode!r}: choose from {', '.join(MODES)}")
        settings = ts.BenchSettings(provider=args.provider, warmup=args.warmup, iters=args.iters,
                                    threads=1 if mode.endswith("1thread") else None)
        ts.session_options = _options(original_options, spinning=not mode.endswith("nospin"))
        try:
            got = measure(args.models, feeds, settings, mode, graph_modes)
        finally:
            ts.session_options = original_options
        for (name, g), v in got.items():
            row = results.setdefault(f"{name}{' + graph' if g else ''}", {})
            row[mode] = v if isinstance(v, str) else {
                "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
                "p90": float(np.percentile(v, 90)), "n": len(v)}
    modes = args.modes.split(",")
    print(f"{'model':<34}" + "".join(f"{m:>24}" for m in modes))
    for name, row in results.items():
        cells = []
        for m in modes:
            v = row.get(m)
            cells.append("-" if v is None else v[:26] if isinstance(v, str)
                         else f"{v['median']:.3f} ({v['p10']:.3f}-{v['p90']:.3f})")
        print(f"{name:<34}" + "".join(f"{c:>24}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"models": args.models, "batch": args.batch, "shapes": args.shape,
                                               "iters": args.iters, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
