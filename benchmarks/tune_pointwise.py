"""Tune the pointwise kernels' launch configuration on the local GPU.

Generates each workload's kernel with onnxfuse.codegen for every configuration (BLOCK,
num_warps, int32 or int64 offsets, masked or mask-free), launches it through Triton's JIT on
torch tensors, and times it with triton.testing.do_bench (kernel time only), next to
torch.compile of the same function. Prints a table, writes JSON, and writes the best
configuration (lowest geometric-mean time over the selected workloads) as an
ONNXFUSE_POINTWISE_CONFIG string. torch.compile's own kernel configuration (Inductor's
autotuned XBLOCK / num_warps) is recorded where its debug log shows it (best effort).

    python benchmarks/tune_pointwise.py --json tune.json --best best.txt
    # the long chains only, BLOCK 256..8192 x 2/4/8 warps, int32, masked (54 timings):
    python benchmarks/tune_pointwise.py --workloads "r=32,r=64,r=128" \
        --blocks 256,512,1024,2048,4096,8192 --warps 2,4,8 --int32 1 --even 0 --json tune_long.json

Run time: each configuration is compiled by Triton's JIT (about 0.5-1 s) and timed by
``do_bench(warmup=50, rep=300)`` (about 0.35 s of kernels plus L2 flushes between them,
about 0.6 s), so about 1.5 s per (workload, configuration), plus about 10 s per torch.compile:
the long-chain command above takes about 1.5-2 minutes. ``--rep`` shortens the timing.
With ``--best``, note that benchmarks/gpu_session.sh's sweep applies best.txt to every
workload: write it only from a run over all workloads.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models.build import cos_cos, gelu_erf, mul_chain  # noqa: E402
from onnxfuse import optimize_model  # noqa: E402
from onnxfuse.codegen import Variant, generate  # noqa: E402

N = 64 * 2**20
WIDTH = 1024


def _bias_gelu():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Add", ["x", "b"], ["h"]), helper.make_node("Gelu", ["h"], ["y"])]
    g = helper.make_graph(nodes, "bias_gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])],
                          [numpy_helper.from_array(np.linspace(-1, 1, WIDTH, dtype=np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _fp16(m):
    from onnx import TensorProto

    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    for t in m.graph.initializer:
        t.data_type = TensorProto.FLOAT16
        import numpy as np

        t.raw_data = np.frombuffer(t.raw_data, np.float32).astype(np.float16).tobytes()
    return m


def _chain(r):
    def f(x):
        for _ in range(r):
            x = x * 2
        return x

    return f


WORKLOADS = {
    "x*2 r=8": (lambda: mul_chain(8, WIDTH), _chain(8), torch.float32),
    "cos(cos(x))": (lambda: cos_cos(WIDTH), lambda x: torch.cos(torch.cos(x)), torch.float32),
    "gelu_erf": (lambda: gelu_erf(WIDTH), lambda x: x * 0.5 * (1 + torch.erf(x / math.sqrt(2))), torch.float32),
    "bias+gelu (broadcast)": (_bias_gelu, None, torch.float32),
    "x*2 r=8 fp16": (lambda: _fp16(mul_chain(8, WIDTH)), _chain(8), torch.float16),
    # the long chains, where the kernel turns compute-bound (the intensity sweep's knee is at r = 64)
    "x*2 r=32": (lambda: mul_chain(32, WIDTH), _chain(32), torch.float32),
    "x*2 r=64": (lambda: mul_chain(64, WIDTH), _chain(64), torch.float32),
    "x*2 r=128": (lambda: mul_chain(128, WIDTH), _chain(128), torch.float32),
}
# Without --workloads: the five of the earlier runs (BENCHMARKS.md), so that the geometric
# mean and --best keep their meaning; the long chains get their own configuration
# (onnxfuse.kinds.pointwise.LONG_PROGRAM) and are tuned on their own.
DEFAULT_WORKLOADS = ("x*2 r=8", "cos(cos(x))", "gelu_erf", "bias+gelu (broadcast)", "x*2 r=8 fp16")
DEFAULT_GRID = {"blocks": [512, 1024, 2048, 4096], "warps": [4, 8], "int32": [1, 0], "even": [1, 0]}


def select_workloads(spec: str | None) -> list[str]:
    """The workloads named by a comma-separated list: an item equal to a workload's name
    selects it, "all" selects every workload, any other item every workload whose name
    contains it. None or "": DEFAULT_WORKLOADS. An item that selects nothing is an error."""
    if not spec:
        return list(DEFAULT_WORKLOADS)
    chosen = set()
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        if item == "all":
            hits = list(WORKLOADS)
        else:
            hits = [item] if item in WORKLOADS else [w for w in WORKLOADS if item in w]
        if not hits:
            raise SystemExit(f"--workloads: {item!r} matches none of: {', '.join(WORKLOADS)}")
        chosen.update(hits)
    return [w for w in WORKLOADS if w in chosen]


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--best", type=Path)
    ap.add_argument("--workloads", help="comma-separated names, substrings or 'all' (default: the first five): "
                    + "; ".join(WORKLOADS))
    ap.add_argument("--blocks", type=_ints, default=DEFAULT_GRID["blocks"], help="BLOCK sizes, e.g. 256,512,1024")
    ap.add_argument("--warps", type=_ints, default=DEFAULT_GRID["warps"], help="num_warps values, e.g. 2,4,8")
    ap.add_argument("--int32", type=_ints, default=DEFAULT_GRID["int32"], help="1: int32 offsets, 0: int64")
    ap.add_argument("--even", type=_ints, default=DEFAULT_GRID["even"], help="1: mask-free kernel, 0: masked")
    ap.add_argument("--warmup", type=int, default=50, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=300, help="do_bench repetitions (ms)")
    args = ap.parse_args(argv)
    args.workload_names = select_workloads(args.workloads)
    for b in args.blocks:
        if b <= 0 or b & (b - 1):
            ap.error(f"--blocks: {b} is not a power of two")
    for w in args.warps:
        if w <= 0 or w & (w - 1) or w > 32:
            ap.error(f"--warps: {w} is not a power of two up to 32")
    if not set(args.int32) <= {0, 1} or not set(args.even) <= {0, 1}:
        ap.error("--int32 and --even take 0 and/or 1")
    if N % max(args.blocks):
        ap.error(f"every block must divide {N} (the mask-free kernels need it)")
    args.configs = list(itertools.product(args.blocks, args.warps, args.int32, args.even))
    return args


class InductorConfigLog:
    """Collects torch.compile's Triton kernel configurations from Inductor's debug log
    (``torch._inductor.runtime.triton_heuristics``): the autotuner's "Best config for ..."
    lines, else the configurations a kernel was created with ("CachingAutotuner gets ...").
    Best effort: the messages are Inductor internals; anything missing just leaves it empty."""

    LOGGER = "torch._inductor.runtime.triton_heuristics"

    def __enter__(self):
        import logging

        self.lines: list[str] = []
        self.log = logging.getLogger(self.LOGGER)
        self.level = self.log.level
        lines = self.lines

        class Grab(logging.Handler):
            def emit(self, record):
                try:
                    lines.append(record.getMessage())
                except Exception:  # noqa: BLE001 - never let logging break a timing run
                    pass

        self.handler = Grab(logging.DEBUG)
        self.propagate = self.log.propagate
        self.log.addHandler(self.handler)
        self.log.setLevel(logging.DEBUG)
        self.log.propagate = False  # the debug messages go to this handler only, not to stderr
        return self

    def __exit__(self, *exc):
        self.log.removeHandler(self.handler)
        self.log.setLevel(self.level)
        self.log.propagate = self.propagate
        return False

    def configs(self) -> list[str]:
        best = [m for m in self.lines if m.startswith("Best config for")]
        if best:
            return best
        out, take = [], 0
        for m in self.lines:
            if m.startswith("CachingAutotuner gets"):
                out.append(m)
                take = int(m.split()[2]) if m.split()[2].isdigit() else 0
            elif take > 0:
                out.append(m)
                take -= 1
        return out


def load(source: str, name: str, tmp: Path):
    path = tmp / f"{name}_{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names, configs = args.workload_names, args.configs
    print(f"{len(names)} workloads x {len(configs)} configurations; about "
          f"{len(names) * (len(configs) * (1 + (args.warmup + args.rep) / 1000 * 1.6) + 10) / 60:.1f} min", flush=True)
    tmp = Path(tempfile.mkdtemp())
    rows, ref, tc_config = [], {}, {}
    for wname in names:
        make, fn, dtype = WORKLOADS[wname]
        r = optimize_model(make())
        (f,) = r.fused
        x = torch.randn(N // WIDTH, WIDTH, device="cuda", dtype=dtype)
        extra = []
        if "b" in f.inputs:
            extra = [torch.linspace(-1, 1, WIDTH, device="cuda", dtype=dtype)]
        out = torch.empty_like(x)
        torch._dynamo.reset()
        with InductorConfigLog() as log:
            if fn is not None:
                c = torch.compile(fn)
                c(x)
                call = (lambda c=c, x=x: c(x))
            else:
                b = extra[0]
                c = torch.compile(lambda x, b: torch.nn.functional.gelu(x + b))
                c(x, b)
                call = (lambda c=c, x=x, b=b: c(x, b))
            torch.cuda.synchronize()
        tc_config[wname] = log.configs()
        ref[wname] = do_bench(call, warmup=args.warmup, rep=args.rep)
        for block, warps, int32, even in configs:
            v = Variant(0, block=block, num_warps=warps, ptr_align=16, n_multiple=block if even else 16,
                        index_bits=32 if int32 else 64)
            ks = generate(f.program, f.kernel_name, f.rank, f.input_modes, f.source_nodes, v)
            kern = load(ks.source, f.kernel_name, tmp)
            ints = [N]
            if "strided" in f.input_modes:
                ints += [N // WIDTH, WIDTH, 0, 1]  # out dims, then the bias's strides
            grid = (triton.cdiv(N, block),)

            def launch(kern=kern, args=(x, *extra, out, *ints), grid=grid, block=block, warps=warps):
                kern[grid](*args, BLOCK=block, num_warps=warps)

            launch()
            ms = do_bench(launch, warmup=args.warmup, rep=args.rep)
            rows.append({"workload": wname, "block": block, "warps": warps, "int32": int32, "even": even, "ms": ms,
                         "gbps": 2 * N * x.element_size() / (ms * 1e-3) / 1e9})
        mine = [r for r in rows if r["workload"] == wname]
        best = min(mine, key=lambda r: r["ms"])
        default = [r["ms"] for r in mine if (r["block"], r["warps"], r["int32"], r["even"]) == (1024, 4, 1, 0)]
        print(f"{wname}: torch.compile {ref[wname]:.4f} ms; best {best['ms']:.4f} ms at block={best['block']} "
              f"warps={best['warps']} int32={best['int32']} even={best['even']}"
              + (f"; default 1024/4 {default[0]:.4f} ms" if default else ""), flush=True)
        for line in tc_config[wname]:
            print(f"  torch.compile kernel: {line}", flush=True)
    score = {}
    for cfg in configs:
        ms = [r["ms"] for r in rows if (r["block"], r["warps"], r["int32"], r["even"]) == cfg]
        score[cfg] = math.exp(sum(map(math.log, ms)) / len(ms))
    print("\n| block | warps | int32 | even | " + " | ".join(names) + " | geomean |")
    print("|---" * (5 + len(names)) + "|")
    for cfg in sorted(configs, key=score.get):
        by_w = {r["workload"]: r["ms"] for r in rows if (r["block"], r["warps"], r["int32"], r["even"]) == cfg}
        ms = [by_w[w] for w in names]
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | " + " | ".join(f"{m:.4f}" for m in ms)
              + f" | {score[cfg]:.4f} |")
    print("| torch.compile | | | | " + " | ".join(f"{ref[w]:.4f}" for w in names) + " | |")
    best = min(configs, key=score.get)
    best_text = f"block={best[0]},warps={best[1]},int32={best[2]},even={best[3]}"
    print("best:", best_text, "over", ", ".join(names))
    if args.best:
        args.best.write_text(best_text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "elements": N,
                                         "workloads": names, "do_bench": {"warmup": args.warmup, "rep": args.rep},
                                         "rows": rows, "torch_compile_ms": ref,
                                         "torch_compile_kernel_config": tc_config, "best": best_text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
