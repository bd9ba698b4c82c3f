"""Build the small example models: python -m models.build [--out DIR]

Each model has a dynamic batch dimension "N" and opset 17 or newer. The ones committed to the
repository are small (example.onnx, a few hundred KB at most); big ones are made on demand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
N = helper.make_node
F = TensorProto.FLOAT


def _model(name: str, nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="onnxfuse-models")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def mul_chain(r: int, width: int = 1024) -> onnx.ModelProto:
    """y = x * 2 repeated r times (the intensity sweep's workload)."""
    names = ["x"] + [f"t{i}" for i in range(1, r)] + ["y"]
    nodes = [N("Mul", [names[i], "two"], [names[i + 1]]) for i in range(r)]
    return _model(f"mul_chain_{r}", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])], [_const("two", 2.0)])


def cos_cos(width: int = 1024) -> onnx.ModelProto:
    nodes = [N("Cos", ["x"], ["c"]), N("Cos", ["c"], ["y"])]
    return _model("cos_cos", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])])


def gelu_erf(width: int = 1024) -> onnx.ModelProto:
    """GELU as exporters write it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    nodes = [N("Div", ["x", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["a"]),
             N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    return _model("gelu_erf", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])],
                  [_const("sqrt2", np.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5)])


def example(dim: int = 64, hidden: int = 256, seed: int = 0) -> onnx.ModelProto:
    """A transformer MLP block as a PyTorch export writes it: LayerNorm written out, MatMul,
    bias, GELU around Erf, MatMul, bias, residual Add. The bundled example model."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w1, "fc1.weight"), numpy_helper.from_array(w2, "fc2.weight"),
        _const("fc1.bias", rng.standard_normal(hidden) * 0.1), _const("fc2.bias", rng.standard_normal(dim) * 0.1),
        _const("ln.weight", 1 + rng.standard_normal(dim) * 0.1), _const("ln.bias", rng.standard_normal(dim) * 0.1),
        _const("eps", 1e-5), _const("sqrt2", np.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5),
    ]
    nodes = [
        N("ReduceMean", ["x"], ["mean"], axes=[-1], name="ln/mean"),
        N("Sub", ["x", "mean"], ["xc"], name="ln/sub"),
        N("Mul", ["xc", "xc"], ["sq"], name="ln/square"),
        N("ReduceMean", ["sq"], ["var"], axes=[-1], name="ln/var"),
        N("Add", ["var", "eps"], ["var_eps"], name="ln/add_eps"),
        N("Sqrt", ["var_eps"], ["std"], name="ln/sqrt"),
        N("Div", ["xc", "std"], ["xn"], name="ln/div"),
        N("Mul", ["xn", "ln.weight"], ["xs"], name="ln/scale"),
        N("Add", ["xs", "ln.bias"], ["h0"], name="ln/shift"),
        N("MatMul", ["h0", "fc1.weight"], ["h1"], name="fc1/matmul"),
        N("Add", ["h1", "fc1.bias"], ["h2"], name="fc1/bias"),
        N("Div", ["h2", "sqrt2"], ["g0"], name="gelu/div"),
        N("Erf", ["g0"], ["g1"], name="gelu/erf"),
        N("Add", ["g1", "one"], ["g2"], name="gelu/add"),
        N("Mul", ["h2", "g2"], ["g3"], name="gelu/mul"),
        N("Mul", ["g3", "half"], ["g4"], name="gelu/half"),
        N("MatMul", ["g4", "fc2.weight"], ["h3"], name="fc2/matmul"),
        N("Add", ["h3", "fc2.bias"], ["h4"], name="fc2/bias"),
        N("Add", ["h4", "x"], ["y"], name="residual"),
    ]
    return _model("mlp_block", nodes, [helper.make_tensor_value_info("x", F, ["N", 16, dim])],
                  [helper.make_tensor_value_info("y", F, ["N", 16, dim])], inits)


SMALL = {
    "example.onnx": example,
    "mul_chain_8.onnx": lambda: mul_chain(8),
    "cos_cos.onnx": cos_cos,
    "gelu_erf.onnx": gelu_erf,
}


def build(out: Path, names: list[str] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in SMALL.items():
        if names and name not in names:
            continue
        path = out / name
        path.write_bytes(make().SerializeToString(deterministic=True))
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "build", help="output folder (default models/build)")
    ap.add_argument("names", nargs="*", help=f"models to build (default all: {', '.join(SMALL)})")
    args = ap.parse_args()
    for p in build(args.out, args.names):
        print(f"{p}  {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
