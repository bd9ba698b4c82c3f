"""Tune the pointwise kernels' launch configuration on the local GPU.

Generates each workload's kernel with onnxfuse.codegen for every configuration (BLOCK,
num_warps, int32 or int64 offsets, masked or mask-free), launches it through Triton's JIT on
torch tensors, and times it with triton.testing.do_bench (kernel time only), next to
torch.compile of the same function. Prints a table, writes JSON, and writes the best
configuration (lowest geometric-mean time) as an ONNXFUSE_POINTWISE_CONFIG string.

    python benchmarks/tune_pointwise.py --json tune.json --best best.txt
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
}


def load(source: str, name: str, tmp: Path):
    path = tmp / f"{name}_{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--best", type=Path)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    configs = list(itertools.product([512, 1024, 2048, 4096], [4, 8], [1, 0], [1, 0]))
    rows, ref = [], {}
    for wname, (make, fn, dtype) in WORKLOADS.items():
        r = optimize_model(make())
        (f,) = r.fused
        x = torch.randn(N // WIDTH, WIDTH, device="cuda", dtype=dtype)
        extra = []
        if "b" in f.inputs:
            extra = [torch.linspace(-1, 1, WIDTH, device="cuda", dtype=dtype)]
        out = torch.empty_like(x)
        if fn is not None:
            torch._dynamo.reset()
            c = torch.compile(fn)
            c(x)
            ref[wname] = do_bench(lambda c=c, x=x: c(x), warmup=50, rep=300)
        else:
            b = extra[0]
            torch._dynamo.reset()
            c = torch.compile(lambda x, b: torch.nn.functional.gelu(x + b))
            c(x, b)
            ref[wname] = do_bench(lambda c=c, x=x, b=b: c(x, b), warmup=50, rep=300)
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
            ms = do_bench(launch, warmup=50, rep=300)
            rows.append({"workload": wname, "block": block, "warps": warps, "int32": int32, "even": even, "ms": ms,
                         "gbps": 2 * N * x.element_size() / (ms * 1e-3) / 1e9})
        best = min((r for r in rows if r["workload"] == wname), key=lambda r: r["ms"])
        print(f"{wname}: torch.compile {ref[wname]:.4f} ms; best {best['ms']:.4f} ms at block={best['block']} "
              f"warps={best['warps']} int32={best['int32']} even={best['even']}", flush=True)
    score = {}
    for cfg in configs:
        ms = [r["ms"] for r in rows if (r["block"], r["warps"], r["int32"], r["even"]) == cfg]
        score[cfg] = math.exp(sum(map(math.log, ms)) / len(ms))
    print("\n| block | warps | int32 | even | " + " | ".join(WORKLOADS) + " | geomean |")
    print("|---" * (5 + len(WORKLOADS)) + "|")
    for cfg in sorted(configs, key=score.get):
        by_w = {r["workload"]: r["ms"] for r in rows if (r["block"], r["warps"], r["int32"], r["even"]) == cfg}
        ms = [by_w[w] for w in WORKLOADS]
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | " + " | ".join(f"{m:.4f}" for m in ms)
              + f" | {score[cfg]:.4f} |")
    print("| torch.compile | | | | " + " | ".join(f"{ref[w]:.4f}" for w in WORKLOADS) + " | |")
    best = min(configs, key=score.get)
    best_text = f"block={best[0]},warps={best[1]},int32={best[2]},even={best[3]}"
    print("best:", best_text)
    if args.best:
        args.best.write_text(best_text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "elements": N, "rows": rows,
                                         "torch_compile_ms": ref, "best": best_text}, indent=2) + "\n")


if __name__ == "__main__":
    main()
