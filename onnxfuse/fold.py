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
from onnx import ModelProto, NodeProto, numpy_helper

from onnxfuse.graph import _outer_refs
from onnxfuse.ops import node_attrs

FLOAT_WEIGHTS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)


def fold_batchnorm(model: ModelProto) -> tuple[ModelProto, int]:
    """A copy of `model` with each Conv -> BatchNormalization pair that can be folded
    replaced by one Conv; returns it and the number of pairs folded."""
    out = ModelProto()
    out.CopyFrom(model)
    g = out.graph
    graph_inputs = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    inits = {t.name: t for t in g.initializer if t.name not in graph_inputs}
    readers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for name in dict.fromkeys(list(n.input) + sorted(_outer_refs(n))):
            readers.setdefault(name, []).append(i)
        for o in n.output:
            if o:
                producer[o] = i
    names = {t.name for t in g.initializer} | {x for n in g.node for x in list(n.input) + list(n.output)}
    names |= {v.name for v in list(g.input) + list(g.output) + list(g.value_info)}
    dropped: set[int] = set()
    count = 0
    for bi, bn in enumerate(g.node):
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or not bn.input[0]:
            continue
        ci = producer.get(bn.input[0])
        if ci is None or ci in dropped:
            continue
        conv = g.node[ci]
        values = _foldable(conv, bn, inits, readers, graph_outputs)
        if values is None:
            continue
        w, b = _folded(*values, eps=float(node_attrs(bn).get("epsilon", 1e-5)))
        w_name = _store(g, inits, readers, graph_outputs, conv.input[1], w, ci, names)
        has_bias = len(conv.input) > 2 and conv.input[2]
        b_name = _store(g, inits, readers, graph_outputs, conv.input[2] if has_bias else "", b, ci, names,
                        fresh=f"{conv.name or conv.input[1]}.bias_folded")
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        old = conv.output[0]
        conv.output[0] = bn.output[0]
        producer[bn.output[0]] = ci
        dropped.add(bi)
        _drop_value_info(g, old)
        count += 1
    if not count:
        return out, 0
    kept = [n for i, n in enumerate(g.node) if i not in dropped]
    del g.node[:]
    g.node.extend(kept)
    read = {x for n in g.node for x in list(n.input) + sorted(_outer_refs(n))}
    keep = [t for t in g.initializer if t.name in read or t.name in graph_inputs or t.name in graph_outputs
            or t.name not in readers]
    del g.initializer[:]
    g.initializer.extend(keep)
    return out, count


def _foldable(conv: NodeProto, bn: NodeProto, inits: dict, readers: dict, graph_outputs: set[str]):
    """(W, B or None, scale, beta, mean, var) as arrays when the pair can be folded, else None."""
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.input) < 2:
        return None
    y = conv.output[0]
    if y in graph_outputs or len(readers.get(y, ())) != 1 or bn.output[0] in graph_outputs:
        return None
    attrs = node_attrs(bn)
    if attrs.get("training_mode", 0) or attrs.get("spatial", 1) != 1 or len(bn.input) != 5:
        return None
    if any(o for o in bn.output[1:]):
        return None
    w = inits.get(conv.input[1])
    if w is None or w.data_type not in FLOAT_WEIGHTS or len(w.dims) < 3:
        return None
    b = None
    if len(conv.input) > 2 and conv.input[2]:
        b = inits.get(conv.input[2])
        if b is None or b.data_type != w.data_type:
            return None
    params = [inits.get(name) for name in bn.input[1:]]
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


def _store(g: onnx.GraphProto, inits: dict, readers: dict, graph_outputs: set[str], name: str,
           value: np.ndarray, conv_idx: int, names: set[str], fresh: str = "") -> str:
    """Put `value` in an initializer for the Conv: in place when only that Conv reads `name`,
    else under a new unique name. Returns the name."""
    if name and readers.get(name) == [conv_idx] and name not in graph_outputs:
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
        return name
    base = fresh or f"{name}_folded"
    new, k = base, 1
    while new in names:
        new = f"{base}_{k}"
        k += 1
    names.add(new)
    t = numpy_helper.from_array(value, new)
    g.initializer.append(t)
    inits[new] = g.initializer[-1]
    readers[new] = [conv_idx]
    return new


def _drop_value_info(g: onnx.GraphProto, name: str) -> None:
    kept = [v for v in g.value_info if v.name != name]
    if len(kept) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(kept)
