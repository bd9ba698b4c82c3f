"""Which of a float32 model's products ONNX Runtime multiplies in TF32, node by node: each Conv,
MatMul and Gemm run alone in ORT (CUDA EP, its defaults: TF32 allowed, cuDNN's exhaustive
algorithm search) on the inputs it gets inside the model, against the node evaluated in float64
(`onnxfuse.reference`) and against the same with its two multiplied operands first rounded to
the nearest TF32 value (`tf32_emulation.tf32_ops`, as cuBLAS and cuDNN round them).

    python -m benchmarks.ort_precision model.onnx --shape pixel_values=1,3,224,224 --json out.json

Per node: ORT's RMS error, the TF32-emulated RMS error, their ratio, and what the ratio says:
"tf32" (ORT's error is TF32's: ratio at least tuning's `onnxfuse.tf32probe.FP32_RATIO`) or
"fp32" (below it: CUDA-core FMA). cuDNN chooses its algorithm per convolution by timing them, so a conv's answer holds
for the shapes and machine it was measured on. The forty-sixth session's ViT-S/16 fp32: the
whole model's error under ORT matched the emulation that rounds every MatMul and not the
patch-embedding Conv (benchmarks/tf32_emulation.py); this script asks each node.

The inputs: the suite's image (uniform [0, 1), `numpy.random.default_rng(0)`) for float
inputs, tuning's feeds for the others (`onnxfuse.tune.feeds_for`); the nodes' own inputs come
from one run of the whole model on ORT's CPU EP. `--provider cpu` runs the same on the CPU EP
(no TF32 there: every node reads "fp32"; for tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tf32_emulation import fmt_sci, suite_image, tf32_ops  # noqa: E402
from onnxfuse import reference  # noqa: E402
from onnxfuse.tf32probe import FP32_RATIO  # noqa: E402
from onnxfuse.tools.gate import rms_error  # noqa: E402
from onnxfuse.tools.shapes import parse_shapes, with_input_dims  # noqa: E402
from onnxfuse.tune import feeds_for  # noqa: E402

PRODUCTS = ("Conv", "MatMul", "Gemm")  # the products tf32_emulation.tf32_ops emulates
# the verdict is tuning's (onnxfuse.tf32probe.FP32_RATIO): at or above it a node reads "tf32"; two
# TF32 products round alike (0.99-1.01 on the H100, forty-sixth session), an fp32 one is 500-2500x
# closer (0.0004-0.002 there: its error is its sums', TF32's the rounding of each operand by up
# to 2**-11)


def product_nodes(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    """The Conv, MatMul and Gemm nodes of the main graph whose first input is float32 (its
    value in `values`, or its initializer), in order."""
    inits = {t.name: t.data_type for t in model.graph.initializer}

    def f32(x: str) -> bool:
        return values[x].dtype == np.float32 if x in values else inits.get(x) == onnx.TensorProto.FLOAT
    return [n for n in model.graph.node if n.op_type in PRODUCTS and n.domain in ("", "ai.onnx") and f32(n.input[0])]


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str], provider: str
        ) -> dict[str, np.ndarray]:
    """The values of tensors `names` (made extra graph outputs of a copy) when `model` runs on
    `feeds` in ONNX Runtime with its defaults, on the CUDA EP ("cuda") or the CPU EP."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    outputs = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in outputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=providers)
    if provider == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
        raise SystemExit("ort_precision: ONNX Runtime has no CUDA execution provider here (--provider cpu)")
    return dict(zip(names, sess.run(names, feeds), strict=True))


def one_node_model(model: onnx.ModelProto, node: onnx.NodeProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`node` alone: its initializers as initializers, every other input a graph input shaped
    as its value in `values`."""
    inits = {t.name: t for t in model.graph.initializer}
    ins, consts = [], []
    for name in dict.fromkeys(x for x in node.input if x):
        if name in inits:
            consts.append(inits[name])
        else:
            v = values[name]
            ins.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape))
    outs = [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in node.output if o]
    m = helper.make_model(helper.make_graph([node], "product", ins, outs, consts),
                          opset_imports=[o for o in model.opset_import if o.domain in ("", "ai.onnx")])
    m.ir_version = model.ir_version
    return m


def probe(model: onnx.ModelProto, dims: dict[str, tuple[int, ...]], provider: str = "cuda") -> list[dict]:
    """One row per product node (`product_nodes`): name, op, input shapes, ORT's and the TF32
    emulation's RMS error against float64, their ratio and "tf32" or "fp32"."""
    from onnx.reference import ReferenceEvaluator

    model = with_input_dims(model, dims)
    feeds = suite_image(feeds_for(model, dims))
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    wanted = sorted({x for n in model.graph.node if n.op_type in PRODUCTS
                     for x in n.input if x and x not in inits and x not in feeds})
    values = {**feeds, **(run(model, feeds, wanted, "cpu") if wanted else {})}
    nodes = product_nodes(model, values)
    rows = []
    for node in nodes:
        one = one_node_model(model, node, values)
        inputs = {i.name: values[i.name] for i in one.graph.input}
        m64 = reference.float64_model(one)
        wide = {k: v.astype(np.float64) for k, v in inputs.items()}
        exact = ReferenceEvaluator(m64, new_ops=tf32_ops()).run(None, wide)[0]
        tf32 = ReferenceEvaluator(m64, new_ops=tf32_ops(PRODUCTS)).run(None, wide)[0]
        ort_y = run(one, inputs, [node.output[0]], provider)[node.output[0]]
        ort_err = rms_error(np.asarray(ort_y, np.float64) - exact)
        tf32_err = rms_error(tf32 - exact)
        ratio = ort_err / tf32_err if ort_err is not None and tf32_err else None
        rows.append({"node": node.name, "op": node.op_type,
                     "inputs": [list(values[x].shape) if x in values else inits[x] for x in node.input if x],
                     "ort_rms_err": ort_err, "tf32_rms_err": tf32_err, "ratio": ratio,
                     "multiplies": "tf32" if ratio is not None and ratio >= FP32_RATIO else "fp32"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="NAME=DIMS, as onnxfuse optimize takes it")
    ap.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = onnx.load(str(args.model))
    rows = probe(model, parse_shapes(args.shape), args.provider)
    print(f"{args.model.name} ({args.provider}): RMS error against float64, alone in ORT and TF32-emulated")
    print("| node | op | inputs | ORT | TF32 | ratio | multiplies |\n|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3g}"
        print(f"| {r['node']} | {r['op']} | {' x '.join('x'.join(map(str, s)) for s in r['inputs'])} | "
              f"{fmt_sci(r['ort_rms_err'])} | {fmt_sci(r['tf32_rms_err'])} | {ratio} | {r['multiplies']} |")
    counts = {k: sum(r["multiplies"] == k for r in rows) for k in ("tf32", "fp32")}
    print(f"{counts['tf32']} in TF32, {counts['fp32']} in fp32")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model.name, "provider": args.provider,
                                         "shapes": {k: list(v) for k, v in parse_shapes(args.shape).items()},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
