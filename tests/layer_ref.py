"""numpy references of FusedConv and FusedMaxPool, computed from the node's own inputs and
attributes exactly as docs/format.md defines them (not from the function body): they check
that the optimizer wrote the contract the kernels implement."""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, helper

from onnxfuse.expr import Program, evaluate
from onnxfuse.layers import ConvAttrs, PoolAttrs, conv_from_fused, pool_from_fused


def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, conv: ConvAttrs) -> np.ndarray:
    """ONNX Conv in float64: x [N, C, H, W], w [K, C/group, R, S], b [K]."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    (sh, sw), (pt, pl, pb, pr), (dh, dw), g = conv.strides, conv.pads, conv.dilations, conv.group
    p, q = conv.out_size(h, wd)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    w64 = w.astype(np.float64)
    kg = k // g
    out = np.zeros((n, k, p, q))
    for i in range(r):
        for j in range(s):
            patch = xp[:, :, i * dh:i * dh + sh * (p - 1) + 1:sh, j * dw:j * dw + sw * (q - 1) + 1:sw]
            for gi in range(g):
                out[:, gi * kg:(gi + 1) * kg] += np.einsum(
                    "ncpq,kc->nkpq", patch[:, gi * cg:(gi + 1) * cg], w64[gi * kg:(gi + 1) * kg, :, i, j])
    return out + b.astype(np.float64)[None, :, None, None]


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


def maxpool2d(x: np.ndarray, pool: PoolAttrs) -> np.ndarray:
    """ONNX MaxPool: padding never wins; with ceil_mode the last window may be partial."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = pool.kernel, pool.strides, pool.pads, pool.dilations
    oh, ow = pool.out_size(h, w)
    need_h = (oh - 1) * sh + dh * (kh - 1) + 1
    need_w = (ow - 1) * sw + dw * (kw - 1) + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, max(pb, need_h - h - pt)), (pl, max(pr, need_w - w - pl))),
                constant_values=-np.inf)
    out = np.full((n, c, oh, ow), -np.inf)
    for i in range(kh):
        for j in range(kw):
            out = np.maximum(out, xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw])
    return out.astype(x.dtype)


def _layout(attrs: dict, name: str) -> str:
    v = attrs.get(name, b"NCHW")
    v = v.decode() if isinstance(v, bytes) else v
    if v not in ("NCHW", "NHWC"):
        raise ValueError(f"{name} is {v!r}, expected 'NCHW' or 'NHWC'")
    return v


def evaluate_fused(node: NodeProto, inputs: list[np.ndarray]) -> np.ndarray:
    """Output 0 of a FusedConv or FusedMaxPool node for these input values. A FusedConv's
    optional layout attributes (x_layout, y_layout, extra_layouts, w_layout) are honoured: NHWC
    tensors are transposed to NCHW before, an NHWC output from NCHW after."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    program = Program.from_text(attrs["program"].decode())
    y_nhwc = False
    if node.op_type == "FusedConv":
        x, packed, b, *extras = inputs
        if _layout(attrs, "x_layout") == "NHWC":
            x = x.transpose(0, 3, 1, 2)
        y_nhwc = _layout(attrs, "y_layout") == "NHWC"
        layouts = list(attrs.get("extra_layouts", [0] * len(extras)))
        if len(layouts) != len(extras) or any(v not in (0, 1) for v in layouts):
            raise ValueError(f"extra_layouts {layouts} for {len(extras)} extra inputs")
        extras = [e.transpose(0, 3, 1, 2) if v == 1 else e for e, v in zip(extras, layouts, strict=True)]
        w_layout = attrs.get("w_layout", b"RSCK")
        w_layout = w_layout.decode() if isinstance(w_layout, bytes) else w_layout
        if w_layout not in ("RSCK", "KRSC"):
            raise ValueError(f"w_layout {w_layout!r}")
        # [R, S, C/group, K] or [K, R, S, C/group] -> ONNX's [K, C/group, R, S]
        w = packed.transpose(3, 2, 0, 1) if w_layout == "RSCK" else packed.transpose(0, 3, 1, 2)
        y = conv2d(x, w, b, conv_from_fused(attrs)).astype(x.dtype)  # rounded to X's dtype
        (z,) = evaluate(program, [y, *extras])
    elif node.op_type == "FusedMaxPool":
        (z,) = evaluate(program, inputs)
    else:
        raise ValueError(f"not a conv or max pool node: {node.op_type}")
    pool = pool_from_fused(attrs)
    z = z if pool is None else maxpool2d(z, pool)
    return np.ascontiguousarray(z.transpose(0, 2, 3, 1)) if y_nhwc else z
