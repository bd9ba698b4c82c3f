"""Fold inference-mode BatchNormalization into the Conv before it.

Conv(X, W, B) -> BatchNormalization(scale, beta, mean, var, epsilon) becomes one
Conv(X, W', B') with, per output channel k,

    s[k] = scale[k] / sqrt(var[k] + epsilon)
    W'[k] = W[k] * s[k]
    B'[k] = (B[k] - mean[k]) * s[k] + beta[k]      (B = 0 without a bias)

computed as ONNX Runtime's own ConvBNFusion computes them (the graph optimization it applies
at its default level, ORT_ENABLE_BASIC and above): one operation at a time in the weights'
dtype, each result rounded to it, in ORT's order (var + eps, sqrt, scale / that, W * s;
with a conv bias ((B - mean) * s) + beta, without one beta - mean * s). So where ORT folds
the same pair in the original model, the folded Conv has its weights bit for bit, and a
fused node's function body gives the original's results bit for bit (checked on the CPU
provider, float32 and float16, tests/test_conv_patterns.py). With ORT's optimizations off
(ORT_DISABLE_ALL) the original normalizes after the sum instead, and results differ by the
fold's rounding: a few ulps of the conv's scale.

The folded Conv writes the BatchNormalization's output tensor. Only when it is safe and ORT
would fold it too: every parameter is a constant initializer, the BatchNormalization is in
inference mode with one output used, which is not a graph output, and it alone reads the
conv output, which is not a graph output either. Weights and biases that other nodes also
read are left as they are (the folded values get new initializers).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import ModelProto, TensorProto, numpy_helper

from onnxfuse import ir

FLOAT_WEIGHTS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def fold_batchnorm(model: ModelProto) -> tuple[ModelProto, int]:
    """A copy of `model` with each Conv -> BatchNormalization pair that can be folded
    replaced by one Conv; returns it and the number of pairs folded. On the gs graph
    (`onnxfuse.ir`): the Conv takes the BatchNormalization's output tensor and the folded
    weights, then one cleanup (the BatchNormalization and unread weights go) and export.
    The node order stays (the Conv already precedes every reader of the BatchNormalization's
    output): no toposort, so the matcher sees the nodes in the order it did before."""
    if not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        out = ModelProto()
        out.CopyFrom(model)
        return out, 0
    m = ir.import_model(model)
    graph_inputs = {i.name for i in model.graph.input}  # initializers among them: overridable
    graph_outputs = {o.name for o in model.graph.output}
    names = ir.all_names(model)
    count = 0
    for bn in list(m.graph.nodes):
        if bn.op != "BatchNormalization" or bn.domain not in ("", "ai.onnx", None) or not bn.inputs \
                or bn.inputs[0].is_empty() or len(bn.inputs[0].inputs) != 1:
            continue
        conv = bn.inputs[0].inputs[0]
        values = _foldable(conv, bn, graph_inputs, graph_outputs)
        if values is None:
            continue
        w, b = _folded(*values, eps=float(bn.attrs.get("epsilon", 1e-5)))
        w_c = _store(conv, 1, w, graph_outputs, names)
        b_c = _store(conv, 2, b, graph_outputs, names, fresh=f"{conv.name or conv.inputs[1].name}.bias_folded")
        x = conv.inputs[0]
        conv.inputs.clear()
        conv.inputs.extend([x, w_c, b_c])
        y = bn.outputs[0]
        bn.outputs.clear()
        conv.outputs[0] = y
        count += 1
    if not count:
        out = ModelProto()
        out.CopyFrom(model)
        return out, 0
    ir.cleanup(m, toposort=False)
    return ir.export_model(m), count


def _constant(t, graph_inputs: set[str]) -> TensorProto | None:
    """The initializer a gs tensor is, unless it is a graph input (an overridable default)."""
    if not isinstance(t, gs.Constant) or t.name in graph_inputs:
        return None
    return ir.tensor_proto(t)


def _foldable(conv, bn, graph_inputs: set[str], graph_outputs: set[str]):
    """(W, B or None, scale, beta, mean, var) as arrays when the pair can be folded, else None."""
    if conv.op != "Conv" or conv.domain not in ("", "ai.onnx", None) or len(conv.inputs) < 2:
        return None
    y = conv.outputs[0]
    if y.name in graph_outputs or len(y.outputs) != 1 or bn.outputs[0].name in graph_outputs:
        return None
    attrs = bn.attrs
    if attrs.get("training_mode", 0) or attrs.get("spatial", 1) != 1 or len(bn.inputs) != 5:
        return None
    if any(not o.is_empty() for o in bn.outputs[1:]):
        return None
    w = _constant(conv.inputs[1], graph_inputs)
    if w is None or w.data_type not in FLOAT_WEIGHTS or len(w.dims) < 3:
        return None
    b = None
    if len(conv.inputs) > 2 and not conv.inputs[2].is_empty():
        b = _constant(conv.inputs[2], graph_inputs)
        if b is None or b.data_type != w.data_type:
            return None
    params = [_constant(t, graph_inputs) for t in bn.inputs[1:]]
    if any(p is None or p.data_type != w.data_type or len(p.dims) != 1 for p in params):
        return None
    k = w.dims[0]
    arrays = [numpy_helper.to_array(t) for t in [w, *params]]
    if any(a.shape != (k,) for a in arrays[1:]) or (b is not None and tuple(b.dims) != (k,)):
        return None
    return arrays[0], None if b is None else numpy_helper.to_array(b), *arrays[1:]


def _folded(w: np.ndarray, b: np.ndarray | None, scale: np.ndarray, beta: np.ndarray, mean: np.ndarray,
            var: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """W' and B' as ONNX Runtime's ConvBNFusion computes them (module docstring): each
    operation in float32 (float64 for double weights) and its result rounded to W's dtype."""
    dt = w.dtype
    wide = np.float64 if dt == np.float64 else np.float32

    def f(a: np.ndarray) -> np.ndarray:  # an operand, widened
        return np.asarray(a).astype(wide)

    def r(a: np.ndarray) -> np.ndarray:  # a result, rounded to the weights' dtype
        return np.asarray(a).astype(dt)

    eps32 = wide(np.float32(eps))  # the attribute is a float, added as one
    s = r(f(scale) / f(r(np.sqrt(f(r(f(var) + eps32))))))
    w2 = r(f(w) * f(s).reshape((-1,) + (1,) * (w.ndim - 1)))
    if b is not None:
        b2 = r(f(r(f(r(f(b) - f(mean))) * f(s))) + f(beta))
    else:
        b2 = r(f(beta) - f(r(f(mean) * f(s))))
    return w2, b2


def _store(conv, k: int, value: np.ndarray, graph_outputs: set[str], names: set[str], fresh: str = ""):
    """A Constant holding `value` for input k of the Conv: under the old initializer's name
    when only that Conv reads it (it takes its place), else under a new unique name."""
    old = conv.inputs[k] if k < len(conv.inputs) and not conv.inputs[k].is_empty() else None
    if old is not None and len(old.outputs) == 1 and old.name not in graph_outputs:
        return ir.constant(numpy_helper.from_array(value, old.name))
    base = fresh or f"{old.name}_folded"
    new, n = base, 1
    while new in names:
        new = f"{base}_{n}"
        n += 1
    names.add(new)
    return ir.constant(numpy_helper.from_array(value, new))
