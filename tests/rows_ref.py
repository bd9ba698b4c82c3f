"""A numpy reference of the FusedRows contract (docs/format.md): prologue, row reduction
(statistics in float64), epilogue. The tests compare the Triton kernels (interpreter), the
C++ CPU kernel and the rewrite's programs with it."""

from __future__ import annotations

import numpy as np

from onnxfuse.expr import Program, evaluate


def row_values(reduction: str, x: np.ndarray, axis: int) -> list[np.ndarray]:
    """The values a reduction gives the epilogue (codegen_rows.ROW_VALUES), as float32
    arrays that broadcast to x: x itself, then per-row statistics with the normalized dims
    kept as 1."""
    trail = tuple(range(axis, x.ndim))
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        if reduction == "layer_norm":
            mean = x64.mean(axis=trail, keepdims=True)
            var = ((x64 - mean) ** 2).mean(axis=trail, keepdims=True)
            return [x.astype(np.float32), mean.astype(np.float32), var.astype(np.float32)]
        if reduction == "rms_norm":
            return [x.astype(np.float32), (x64 * x64).mean(axis=trail, keepdims=True).astype(np.float32)]
        m = np.max(x64, axis=trail, keepdims=True)
        m = np.where(np.isnan(x64).any(axis=trail, keepdims=True), np.nan, m)
        e = np.exp(x64 - m)
        s = e.sum(axis=trail, keepdims=True)
        y = e / s if reduction == "softmax" else (x64 - m) - np.log(s)
        return [y.astype(np.float32)]


def evaluate_rows(reduction: str, prologue: Program, epilogue: Program, inputs: list[np.ndarray], axis: int,
                  x_output: bool = False) -> list[np.ndarray]:
    """The node's outputs for `inputs` (the prologue's, then the epilogue's extras)."""
    p = len(prologue.input_dtypes)
    (x,) = evaluate(prologue, inputs[:p])
    axis = axis % max(x.ndim, 1) if x.ndim else 0
    values = row_values(reduction, x, axis)
    outs = evaluate(epilogue, [*values, *inputs[p:]])
    shape = x.shape
    outs = [np.broadcast_to(o, shape).copy() for o in outs]
    return outs + ([x] if x_output else [])


def evaluate_rows_node(node, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The outputs of a FusedRows node (its attributes read as the C++ kernel reads them)."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    prologue = Program.from_text(attrs["prologue"].decode())
    epilogue = Program.from_text(attrs["program"].decode())
    return evaluate_rows(attrs["reduction"].decode(), prologue, epilogue, inputs, int(attrs["axis"]),
                         bool(attrs.get("x_output", 0)))
