"""Whether ONNX Runtime multiplies a float32 subgraph's products in TF32 or in fp32, measured.

ORT's CUDA EP allows TF32 by default, but that is a permission, not a precision: cuDNN picks
each convolution's algorithm by timing them (an fp32 FMA one wins some shapes) and cuBLAS picks
its kernel per shape by heuristics. On the H100 (forty-sixth session, `benchmarks/ort_precision.py`)
ORT ran ViT-S/16's patch-embedding conv in fp32 at batch 1 and 8, and at batch 1 also the
Q·K^T products and the head's Gemm, while every product of BERT-base ran in TF32. A fused node
that multiplies in TF32 where ORT multiplied in fp32 is less accurate than ORT there, so tuning
asks this module, node by node, before it decides a precision (`onnxfuse.tune`).

The probe runs one subgraph (a fused node's original nodes, as a model of its own) three ways on
the same seeded inputs:

- in ORT's CUDA EP with its defaults, `SESSIONS` fresh sessions (cuDNN's choice may change from
  one session to the next: a conv that any session runs in fp32 reads fp32);
- exactly enough: in ORT's CPU EP, float32 FMA sums (its error against float64 is about 2**-24
  relative per sum term, TF32's about 2**-11: 8192x apart);
- TF32-emulated: the same on the CPU with both operands of every product first rounded to the
  nearest TF32 value inside the graph (`with_tf32_operands`), as TF32 tensor cores see them
  (products of two 11-bit significands are exact in float32, and the sums are float32).

Ratio = RMS(CUDA - exact) / RMS(TF32-emulated - exact). A TF32 product reads 0.9996-1.0011 (the
same rounding as the emulation's), an fp32 one 0.0-0.0025 (H100, forty-seventh session: 644
nodes probed over 30 suite rows; ViT-S/16's attentions at batch 1, 0.705, the only one between). Below
`FP32_RATIO` the subgraph reads "fp32": ORT is measurably more accurate there than TF32
would be. The threshold sits near 1 on purpose: a subgraph where ORT runs one product in fp32
and another in TF32 (an attention's two) reads between, and a fused node in TF32 would be less
accurate than ORT there too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import ModelProto, helper

from onnxfuse.tools.gate import rms_error
from onnxfuse.tools.session import BenchSettings, evaluate_model_on

# ops whose float32 products ORT's CUDA EP may run in TF32 (cuDNN, cuBLAS)
PRODUCT_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
# fresh CUDA sessions per probe: fp32 where any reads fp32
SESSIONS = 2
# at or above this ratio (ORT's RMS error over the TF32 emulation's) a subgraph reads "tf32"
FP32_RATIO = 0.8
# Veltkamp's splitting constant for float32 (24-bit significands) keeping 11 bits, TF32's:
# c = x * (2**13 + 1); c - (c - x) is x rounded to the nearest 11-bit significand
_SPLIT = float(2 ** 13 + 1)


@dataclasses.dataclass(frozen=True)
class Probe:
    """What one subgraph measured: "fp32" or "tf32", and per CUDA session the ratio of ORT's
    RMS error to the TF32 emulation's (None: the emulation is exact on these inputs, so TF32
    and fp32 cannot be told apart, and it makes no difference)."""

    multiplies: str
    ratios: tuple[float | None, ...]
    ort_rms: tuple[float, ...]
    tf32_rms: float


def float32_products(model: ModelProto) -> list[int]:
    """The indices of the main graph's product nodes (`PRODUCT_OPS`) whose first input is float32."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    except Exception:  # untyped intermediates: the product is not float32 as far as we know
        pass
    return [i for i, n in enumerate(model.graph.node) if n.op_type in PRODUCT_OPS and n.domain in ("", "ai.onnx")
            and types.get(n.input[0]) == onnx.TensorProto.FLOAT]


def with_tf32_operands(model: ModelProto) -> ModelProto:
    """A copy of `model` whose float32 products (`float32_products`) read their first two
    inputs rounded to the nearest TF32 value (Mul, Sub, Sub per operand: Veltkamp's split,
    exact float32 arithmetic). Their other inputs (a bias) stay as they are."""
    m = ModelProto()
    m.CopyFrom(model)
    products = set(float32_products(m))
    split = "onnxfuse_tf32_split"
    m.graph.initializer.append(helper.make_tensor(split, onnx.TensorProto.FLOAT, [], [_SPLIT]))
    rounded: dict[str, str] = {}
    nodes = []
    for i, n in enumerate(m.graph.node):
        if i in products:
            for k in (0, 1):
                x = n.input[k] if len(n.input) > k else ""
                if not x:
                    continue
                if x not in rounded:
                    r = rounded[x] = f"{x}.tf32"
                    nodes += [helper.make_node("Mul", [x, split], [f"{r}.c"]),
                              helper.make_node("Sub", [f"{r}.c", x], [f"{r}.d"]),
                              helper.make_node("Sub", [f"{r}.c", f"{r}.d"], [r])]
                n.input[k] = rounded[x]
        nodes.append(n)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _rms(outputs: dict[str, np.ndarray], exact: dict[str, np.ndarray]) -> float:
    """RMS over every float output's elements of outputs - exact (`gate.rms_error`), where both
    are finite (an epilogue's inf or NaN says nothing about how the products multiplied)."""
    diffs = [np.abs(np.asarray(outputs[name], np.float64) - np.asarray(e, np.float64)).ravel()
             for name, e in exact.items() if e.dtype.kind == "f"]
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return rms_error(d[np.isfinite(d)])


def probe(model: ModelProto, feeds: dict[str, np.ndarray], provider: str = "cuda",
          sessions: int = SESSIONS, tf32: bool = True) -> Probe:
    """Measure `model` (a subgraph with float32 products, `float32_products`) on `feeds`
    (module docstring). ORT's side runs with TF32 allowed (its default; `tf32` False: not,
    for tests); `provider` "cpu" runs it on the CPU EP (no TF32 there: it reads "fp32")."""
    cpu = BenchSettings(provider="cpu", library=False)
    exact = evaluate_model_on(model.SerializeToString(), [feeds], cpu, library=False, collect=False)[0]
    emulated = evaluate_model_on(with_tf32_operands(model).SerializeToString(), [feeds], cpu, library=False,
                                 collect=False)[0]
    tf32_rms = _rms(emulated, exact)
    ort = BenchSettings(provider=provider, library=False, tf32=tf32)
    data = model.SerializeToString()
    ort_rms = tuple(_rms(evaluate_model_on(data, [feeds], ort, library=False, collect=False)[0], exact)
                    for _ in range(sessions))
    ratios = tuple(e / tf32_rms if tf32_rms > 0 else None for e in ort_rms)
    fp32 = any(r is not None and r < FP32_RATIO for r in ratios)
    return Probe("fp32" if fp32 else "tf32", ratios, ort_rms, tf32_rms)
