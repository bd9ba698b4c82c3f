"""numpy references for the tests: the layers (onnxfuse.reference's conv2d and maxpool2d, which
the conv and maxpool kinds evaluate their nodes with), TF32 rounding and truncation, and
`evaluate_fused`: output 0 of a fused node computed from its own inputs and attributes as
docs/format.md defines them (its kind's `evaluate`), not from its function body."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto

from onnxfuse.kinds import KINDS
from onnxfuse.reference import conv2d, maxpool2d

__all__ = ["conv2d", "maxpool2d", "round_to_tf32", "truncate_to_tf32", "evaluate_fused"]

# TF32: fp32's sign and 8 exponent bits, the top 10 of its 23 mantissa bits (13 dropped).
TF32_DROPPED = np.uint32(0x1FFF)
TF32_HALF = np.uint32(0x1000)  # half of the lowest kept mantissa bit
EXPONENT = np.uint32(0x7F800000)


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest TF32 value, ties away from zero (PTX
    cvt.rna.tf32.f32, what cuBLAS and cuDNN do to fp32 operands); Inf and NaN unchanged. The
    bit-exact reference of codegen_conv's round_to_tf32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = (bits + TF32_HALF) & ~TF32_DROPPED  # uint32 arrays wrap; only Inf/NaN could
    return np.where((bits & EXPONENT) == EXPONENT, bits, rounded).view(np.float32)


def truncate_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values with the 13 low mantissa bits cleared: what tl.dot(...,
    input_precision="tf32") does to its fp32 operands."""
    return (np.asarray(x, np.float32).view(np.uint32) & ~TF32_DROPPED).view(np.float32)


def evaluate_fused(node: NodeProto, inputs: list[np.ndarray]) -> np.ndarray:
    """Output 0 of a fused node (any kind) for these input values."""
    kind = next((k for k in KINDS.values() if k.op_type == node.op_type), None)
    if kind is None:
        raise ValueError(f"not a fused node: {node.op_type}")
    return kind.evaluate(node, inputs)[0]
