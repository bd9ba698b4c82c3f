"""CPU kernel of the custom-op library against ONNX Runtime's own CPU kernels.

Workload: ``x = x * 2`` repeated R times (default 8) on N float32 elements (default 16M).
- ``ort unfused``: R Mul nodes, ONNX Runtime CPU EP (ORT_ENABLE_ALL), the stock way.
- ``onnxfuse``: one PointwiseChain node (docs/format.md) run by libonnxfuse_ops.so's CPU
  kernel in the same ONNX Runtime, same threads.
Both bind the output to a preallocated buffer (IO binding), so the numbers are the
kernels' time, not page faults of a fresh 64 MB output; ``run()`` columns are the plain
``session.run`` time for reference. ``numpy 1 pass`` is ``np.multiply(x, 2**R, out=y)``:
one read and one write on one thread, a rough memory floor for a single core.

    python benchmarks/cpu_kernel.py                       # 16M floats, 8 muls
    python benchmarks/cpu_kernel.py --n 4000000 --repeats 8 64 --threads 1 2

Prints a table (median and min ms over --iters runs) and writes JSON (default
benchmarks/results/cpu_kernel.json). The bar: onnxfuse >= 2x faster than ORT unfused on
16M floats, 8 muls. Exit status 1 if a measured configuration at the default size misses it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onnxfuse import expr  # noqa: E402
from onnxfuse.runtime import library_path  # noqa: E402

DEFAULT_JSON = Path(__file__).parent / "results" / "cpu_kernel.json"
OPSET = 21
BAR = 2.0


def unfused_model(r: int) -> onnx.ModelProto:
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    names = ["x"] + [f"t{i}" for i in range(1, r)] + ["y"]
    nodes = [helper.make_node("Mul", [names[i], "two"], [names[i + 1]]) for i in range(r)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])], initializer=[two])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)


def fused_model(r: int) -> onnx.ModelProto:
    b = expr.Builder(["f32"])
    v = expr.Ref(0)
    for _ in range(r):
        v = b.emit("mul", v, 2.0)
    text = b.build([(v, "f32")]).to_text()
    import hashlib

    overload = "onnxfuse_pointwise_chain_" + hashlib.sha256(text.encode()).hexdigest()[:12]
    node = helper.make_node("PointwiseChain", ["x"], ["y"], domain="onnxfuse", program=text)
    node.overload = overload
    names = ["x"] + [f"t{i}" for i in range(1, r)] + ["y"]
    body = [helper.make_node("Constant", [], ["two"], value_float=2.0)]
    body += [helper.make_node("Mul", [names[i], "two"], [names[i + 1]]) for i in range(r)]
    fn = helper.make_function("onnxfuse", "PointwiseChain", ["x"], ["y"], body, [helper.make_opsetid("", OPSET)],
                              attributes=["program"], overload=overload)
    g = helper.make_graph([node], "fused", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("onnxfuse", 1)],
                          functions=[fn], ir_version=10)
    onnx.checker.check_model(m)
    return m


def _times_ms(fn, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def _median_ms(fn, iters: int, warmup: int = 2) -> float:
    return statistics.median(_times_ms(fn, iters, warmup))


def measure(model: onnx.ModelProto, x: np.ndarray, threads: int, lib: str | None, iters: int) -> dict:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if lib:
        so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    y = np.empty_like(x)
    io = sess.io_binding()
    io.bind_cpu_input("x", x)
    io.bind_output("y", "cpu", 0, np.float32, list(y.shape), y.ctypes.data)
    bound = _times_ms(lambda: sess.run_with_iobinding(io), iters)
    plain = _median_ms(lambda: sess.run(None, {"x": x}), max(3, iters // 2))
    return {"ms": statistics.median(bound), "min_ms": min(bound), "run_ms": plain, "y": y}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024, help="elements (default 16M)")
    ap.add_argument("--repeats", type=int, nargs="+", default=[8], help="muls in the chain (default 8)")
    ap.add_argument("--threads", type=int, nargs="+", default=[0],
                    help="ORT intra-op threads (0: ORT's default, one per physical core)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)

    lib = library_path()
    x = np.random.default_rng(0).uniform(-1, 1, args.n).astype(np.float32)
    rows = []
    failed = False
    for r in args.repeats:
        want = x * np.float32(2.0**r)
        y_np = np.empty_like(x)
        numpy_ms = _median_ms(lambda r=r, y_np=y_np: np.multiply(x, np.float32(2.0**r), out=y_np), args.iters)
        for th in args.threads:
            base = measure(unfused_model(r), x, th, None, args.iters)
            fused = measure(fused_model(r), x, th, lib, args.iters)
            np.testing.assert_array_equal(fused["y"], want)
            np.testing.assert_array_equal(base["y"], want)
            speedup = base["ms"] / fused["ms"]
            gbs = 2 * x.nbytes / (fused["ms"] * 1e-3) / 1e9
            row = {"n": args.n, "repeats": r, "threads": th, "ort_unfused_ms": round(base["ms"], 3),
                   "onnxfuse_ms": round(fused["ms"], 3), "speedup": round(speedup, 2),
                   "ort_unfused_min_ms": round(base["min_ms"], 3), "onnxfuse_min_ms": round(fused["min_ms"], 3),
                   "speedup_of_min": round(base["min_ms"] / fused["min_ms"], 2),
                   "ort_unfused_run_ms": round(base["run_ms"], 3), "onnxfuse_run_ms": round(fused["run_ms"], 3),
                   "numpy_one_pass_ms": round(numpy_ms, 3), "onnxfuse_GBps": round(gbs, 2)}
            rows.append(row)
            if args.n == 16 * 1024 * 1024 and r == 8 and speedup < BAR:
                failed = True

    hdr = (f"{'n':>10} {'muls':>4} {'thr':>3} | {'ORT unfused':>11} {'onnxfuse':>9} {'speedup':>7} | "
           f"{'min ORT':>8} {'min fused':>9} {'speedup':>7} | "
           f"{'run() ORT':>9} {'run() fused':>11} | {'numpy 1 pass':>12} {'fused GB/s':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['n']:>10} {r['repeats']:>4} {r['threads']:>3} | {r['ort_unfused_ms']:>11.2f} "
              f"{r['onnxfuse_ms']:>9.2f} {r['speedup']:>6.2f}x | {r['ort_unfused_min_ms']:>8.2f} "
              f"{r['onnxfuse_min_ms']:>9.2f} {r['speedup_of_min']:>6.2f}x | {r['ort_unfused_run_ms']:>9.2f} "
              f"{r['onnxfuse_run_ms']:>11.2f} | {r['numpy_one_pass_ms']:>12.2f} {r['onnxfuse_GBps']:>10.2f}")
    print("(median and min ms over --iters runs, output bound to a preallocated buffer; run(): plain "
          "session.run, median)")
    out = {
        "benchmark": "cpu_kernel", "workload": "x*2 repeated R times, float32",
        "bar": f"onnxfuse >= {BAR}x faster than ORT unfused at 16M floats, 8 muls",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "onnxruntime": ort.__version__, "python": platform.python_version()},
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
