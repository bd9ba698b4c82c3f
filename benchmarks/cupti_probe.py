"""Does a torch profiler session (CUPTI) slow the ONNX Runtime runs that come after it in the
same process?

One model in two CUDA EP sessions (with and without CUDA graphs, IO binding, inputs of ones),
each timed (median of --iters synchronized runs), then one of the steps below in the same
process, then both timed again:

- ``profiler``: ten torch additions under ``torch.profiler.profile(activities=[CUDA])``, as
  tuning's bundles (`onnxfuse.bundle`) profile;
- ``torch``: the same additions without the profiler (torch's CUDA use alone);
- ``none``: nothing (the order alone: the second timing of each session).

Run ``TEARDOWN_CUPTI=1 python3 benchmarks/cupti_probe.py MODEL --step profiler`` to have
torch's Kineto finalize CUPTI when its profiler stops. Prints one line per step and writes
JSON with --json. Forty-first session, H100: BERT-base fp16 b1 (section "forty-first
session" of BENCHMARKS.md).

    python3 benchmarks/cupti_probe.py /tmp/suite-models/bert_base_fp16.onnx --steps profiler,torch,none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def _timed(sess, io, iters: int) -> float:
    for _ in range(10):
        sess.run_with_iobinding(io)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def _sessions(path: str, batch: int, seq: int) -> dict:
    import onnxruntime as ort

    out = {}
    for graph in (True, False):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        s = ort.InferenceSession(path, so, providers=[("CUDAExecutionProvider",
                                                       {"enable_cuda_graph": "1"} if graph else {})])
        io = s.io_binding()
        for i in s.get_inputs():
            shape = [d if isinstance(d, int) else (batch if k == 0 else seq) for k, d in enumerate(i.shape)]
            dtype = np.int64 if "int64" in i.type else np.float32 if "float)" in i.type else np.float16
            io.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy(np.ones(shape, dtype), "cuda", 0))
        for o in s.get_outputs():
            io.bind_output(o.name, "cuda")
        out["graph" if graph else "plain"] = (s, io)
    return out


def one(path: str, step: str, iters: int, batch: int, seq: int) -> dict:
    """Both sessions timed before and after `step`, in this process."""
    sessions = _sessions(path, batch, seq)
    before = {k: _timed(s, io, iters) for k, (s, io) in sessions.items()}
    if step in ("profiler", "torch"):
        import contextlib

        import torch
        from torch.profiler import ProfilerActivity, profile

        x = torch.ones(1024, device="cuda")
        ctx = profile(activities=[ProfilerActivity.CUDA]) if step == "profiler" else contextlib.nullcontext()
        with ctx:
            for _ in range(10):
                x = x + 1
            torch.cuda.synchronize()
    after = {k: _timed(s, io, iters) for k, (s, io) in sessions.items()}
    return {"step": step, "teardown_cupti": os.environ.get("TEARDOWN_CUPTI"), "before_ms": before, "after_ms": after}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", default="profiler,torch,none")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a step in a fresh process (each step gets its own)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.model, args.one, args.iters, args.batch, args.seq)))
        return 0
    rows = []
    for step in args.steps.split(","):
        p = subprocess.run([sys.executable, __file__, args.model, "--one", step, "--iters", str(args.iters),
                            "--batch", str(args.batch), "--seq", str(args.seq)], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{step}: failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(r)
        b, a = r["before_ms"], r["after_ms"]
        print(f"{step:<9} TEARDOWN_CUPTI={r['teardown_cupti']}: graph {b['graph']:.3f} -> {a['graph']:.3f} ms, "
              f"plain {b['plain']:.3f} -> {a['plain']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "iters": args.iters, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
