"""Host cost of one node in ONNX Runtime's CUDA EP: a built-in op against an onnxfuse custom op.

Without CUDA graphs a model of many small nodes is bound by the host: every node costs ONNX
Runtime's dispatch plus its own Compute. This measures that cost per node, on tensors so small
that the GPU work is negligible:

- ``ort_sigmoid``     a chain of L Sigmoid nodes on x [1, 1024]
- ``fused_pointwise`` L copies of onnxfuse's FusedPointwise node for Sigmoid -> Neg
- ``ort_conv``        a chain of L Conv 1x1 (+ bias) nodes on x [1, 16, 4, 4]
- ``fused_conv``      L copies of onnxfuse's FusedConv node for the same Conv -> Relu

Each model is timed at L = 8 and L = 64 (synchronized latency, IO binding, no CUDA graphs);
per node = (t64 - t8) / 56.

    python benchmarks/node_overhead.py --json node_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_timing import BoundSession, time_cuda  # noqa: E402
from onnxfuse import library_path  # noqa: E402
from onnxfuse.compile import default_targets  # noqa: E402
from onnxfuse.kernels import compile_fused  # noqa: E402
from onnxfuse.pipeline import optimize_model  # noqa: E402

LENGTHS = (8, 64)


def _model(nodes, shape, inits=(), opsets=(("", 17),), functions=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info(f"x{len(nodes)}", TensorProto.FLOAT, shape)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], functions=list(functions))
    m.ir_version = 9
    return m


def _ort_chain(op: str, n: int, shape, weights: list[onnx.TensorProto]) -> onnx.ModelProto:
    names = [w.name for w in weights]
    return _model([helper.make_node(op, [f"x{i}", *names], [f"x{i + 1}"]) for i in range(n)], shape, weights)


def _fused_chain(one: onnx.ModelProto, n: int, shape) -> onnx.ModelProto:
    """n copies of the single onnxfuse node of `one` (optimized and compiled), chained."""
    [node] = [x for x in one.graph.node if x.domain == "onnxfuse"]
    nodes = []
    for i in range(n):
        c = onnx.NodeProto()
        c.CopyFrom(node)
        c.name = f"fused{i}"
        c.input[0] = f"x{i}"
        c.output[0] = f"x{i + 1}"
        nodes.append(c)
    m = _model(nodes, shape, one.graph.initializer, [(o.domain, o.version) for o in one.opset_import],
               one.functions)
    # ONNX Runtime infers a custom op's output type only from a declared one
    m.graph.value_info.extend(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, shape) for i in range(1, n))
    return m


def _optimized(model: onnx.ModelProto) -> onnx.ModelProto:
    r = optimize_model(model)
    info = compile_fused(r.model, r.fused, default_targets())
    if info["declined"] or info["failed"] or not r.fused:
        raise SystemExit(f"not fused: {info['summary']}")
    return r.model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    lib = os.environ.get("ONNXFUSE_LIBRARY") or str(library_path())
    rng = np.random.default_rng(0)

    pw_shape = [1, 1024]
    pw_one = _model([helper.make_node("Sigmoid", ["x0"], ["x1"]), helper.make_node("Neg", ["x1"], ["x2"])], pw_shape)
    conv_shape = [1, 16, 4, 4]
    w = numpy_helper.from_array(rng.standard_normal((16, 16, 1, 1)).astype(np.float32) * 0.2, "w")
    b = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    conv_one = _model([helper.make_node("Conv", ["x0", "w", "b"], ["x1"]), helper.make_node("Relu", ["x1"], ["x2"])],
                      conv_shape, [w, b])
    pw_fused, conv_fused = _optimized(pw_one), _optimized(conv_one)
    builders = {
        "ort_sigmoid": (lambda n: _ort_chain("Sigmoid", n, pw_shape, []), pw_shape, False),
        "fused_pointwise": (lambda n: _fused_chain(pw_fused, n, pw_shape), pw_shape, True),
        "ort_conv": (lambda n: _ort_chain("Conv", n, conv_shape, [w, b]), conv_shape, False),
        "fused_conv": (lambda n: _fused_chain(conv_fused, n, conv_shape), conv_shape, True),
    }
    rows = []
    for name, (build, shape, custom) in builders.items():
        x = torch.rand(*shape, device="cuda")
        row = {"model": name}
        for n in LENGTHS:
            s = BoundSession(build(n), {"x0": x}, library=lib if custom else None)
            row[f"L{n}_ms"] = time_cuda(s.run, args.iters, warmup=20).median_ms
            del s
        row["per_node_us"] = (row[f"L{LENGTHS[1]}_ms"] - row[f"L{LENGTHS[0]}_ms"]) / (LENGTHS[1] - LENGTHS[0]) * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| model | L={LENGTHS[0]} ms | L={LENGTHS[1]} ms | per node µs |\n|---|---|---|---|")
    lo, hi = (f"L{n}_ms" for n in LENGTHS)
    for r in rows:
        print(f"| {r['model']} | {r[lo]:.4f} | {r[hi]:.4f} | {r['per_node_us']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
