"""The elementwise ONNX operators onnxfuse can fuse, and how each lowers to the expression IR.

This table is the one place that names ONNX elementwise op types. Each entry says which
inputs are tensors (program operands) and which must be constants (e.g. Clip's bounds),
and lowers one node into `onnxfuse.expr` instructions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx import NodeProto, TensorProto, helper

from onnxfuse.expr import Builder, Operand

# ONNX element types that fused kernels read and write, and their IR names.
FLOAT_TYPES = {TensorProto.FLOAT: "f32", TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}
BOOL_TYPE = TensorProto.BOOL
DTYPE_NAMES = {
    TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "float64", TensorProto.BOOL: "bool",
}

Lower = Callable[[Builder, list[Operand], dict, list], Operand]

# Key added to the attributes passed to `lower`: the ONNX element type of the node's output.
ELEM_TYPE = "_elem_type"
# Largest finite value per element type: Clip's default bounds (ONNX: numeric_limits::max()
# and lowest(); ONNX Runtime clamps +-inf to them).
FINITE_MAX = {TensorProto.FLOAT: float(np.finfo(np.float32).max), TensorProto.FLOAT16: 65504.0,
              TensorProto.BFLOAT16: float.fromhex("0x1.fep127")}


@dataclass(frozen=True)
class OpRule:
    """How one ONNX op type fuses.

    tensor_inputs: indices of inputs that are program operands (None = all, variadic).
    const_inputs: indices of optional inputs that must be scalar constants when present;
        their values are passed to `lower` as the `consts` list (None where absent).
    bool_inputs: indices of inputs that are bool (Where's condition).
    lower(builder, operands, attrs, consts): attrs are the node's attributes plus ELEM_TYPE.
    """

    lower: Lower
    tensor_inputs: tuple[int, ...] | None = None
    const_inputs: tuple[int, ...] = ()
    bool_inputs: tuple[int, ...] = ()
    check: Callable[[NodeProto, dict], str | None] | None = None


def _unary(op: str) -> Lower:
    return lambda b, a, attrs, c: b.emit(op, a[0])


def _binary(op: str) -> Lower:
    return lambda b, a, attrs, c: b.emit(op, a[0], a[1])


def _fold(op: str) -> Lower:
    def lower(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
        acc = a[0]
        for x in a[1:]:
            acc = b.emit(op, acc, x)
        return acc

    return lower


def _mean(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    acc = _fold("add")(b, a, attrs, c)
    return b.emit("div", acc, float(len(a))) if len(a) > 1 else acc


def _pow(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    if isinstance(a[1], float) and a[1] == 2.0:
        return b.emit("mul", a[0], a[0])
    if isinstance(a[1], float) and a[1] == 1.0:
        return a[0]
    return b.emit("pow", a[0], a[1])


def _relu(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    return b.emit("max", a[0], 0.0)


def _leaky_relu(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    alpha = attrs.get("alpha", 0.01)
    return b.emit("select", b.emit("ge", a[0], 0.0), a[0], b.emit("mul", a[0], alpha))


def _elu(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    alpha = attrs.get("alpha", 1.0)
    neg = b.emit("mul", b.emit("expm1", a[0]), alpha)  # exp(x) - 1 without its cancellation near 0
    # x >= 0, not x > 0: Elu(-0.0) is -0.0 (the ONNX definition; ONNX Runtime agrees)
    return b.emit("select", b.emit("ge", a[0], 0.0), a[0], neg)


def _hard_sigmoid(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    y = b.emit("add", b.emit("mul", a[0], attrs.get("alpha", 0.2)), attrs.get("beta", 0.5))
    return b.emit("max", b.emit("min", y, 1.0), 0.0)


def _hard_swish(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    y = b.emit("add", b.emit("mul", a[0], float(np.float32(1.0 / 6.0))), 0.5)
    return b.emit("mul", a[0], b.emit("max", b.emit("min", y, 1.0), 0.0))


def _reciprocal(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    return b.emit("div", 1.0, a[0])


def _clip(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    lo = c[0] if c and c[0] is not None else attrs.get("min")
    hi = c[1] if len(c) > 1 and c[1] is not None else attrs.get("max")
    # An absent bound is the type's lowest / largest finite value, so +-inf is clamped too.
    limit = FINITE_MAX[attrs.get(ELEM_TYPE, TensorProto.FLOAT)]
    x = b.emit("max", a[0], -limit if lo is None else float(lo))
    return b.emit("min", x, limit if hi is None else float(hi))


def _where(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    return b.emit("select", a[0], a[1], a[2])


def _cast(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    to = attrs["to"]
    if to == TensorProto.FLOAT16:
        return b.emit("round_f16", a[0])
    if to == TensorProto.BFLOAT16:
        return b.emit("round_bf16", a[0])
    return a[0]


def _check_cast(node: NodeProto, attrs: dict) -> str | None:
    to = attrs.get("to")
    if to not in FLOAT_TYPES:
        return f"Cast to {DTYPE_NAMES.get(to, TensorProto.DataType.Name(to))}"
    return None


def _gelu(b: Builder, a: list[Operand], attrs: dict, c: list) -> Operand:
    """0.5 x (1 + erf(x / sqrt 2)) as 0.5 x erfc(-x / sqrt 2), and the tanh form
    0.5 x (1 + tanh(z)) as x sigmoid(2z): equal, without the cancellation of 1 + erf or
    1 + tanh for negative x (`onnxfuse.expr.rewrite_tails`)."""
    x = a[0]
    if attrs.get("approximate", "none") == "tanh":
        inner = b.emit("add", x, b.emit("mul", b.emit("mul", b.emit("mul", x, x), x), 0.044715))
        # 2 * fp32(sqrt(2/pi)), exactly: the product is twice the tanh form's argument
        s = b.emit("sigmoid", b.emit("mul", inner, 2.0 * float(np.float32(math.sqrt(2.0 / math.pi)))))
        return b.emit("mul", x, s)
    e = b.emit("erfc", b.emit("mul", x, -float(np.float32(1.0 / math.sqrt(2.0)))))
    return b.emit("mul", b.emit("mul", x, 0.5), e)


def _check_gelu(node: NodeProto, attrs: dict) -> str | None:
    if attrs.get("approximate", "none") not in ("none", "tanh"):
        return f"Gelu approximate={attrs['approximate']!r}"
    return None


RULES: dict[str, OpRule] = {
    "Add": OpRule(_binary("add")),
    "Sub": OpRule(_binary("sub")),
    "Mul": OpRule(_binary("mul")),
    "Div": OpRule(_binary("div")),
    "Pow": OpRule(_pow),
    "Max": OpRule(_fold("max")),
    "Min": OpRule(_fold("min")),
    "Sum": OpRule(_fold("add")),
    "Mean": OpRule(_mean),
    "Neg": OpRule(_unary("neg")),
    "Abs": OpRule(_unary("abs")),
    "Relu": OpRule(_relu),
    "LeakyRelu": OpRule(_leaky_relu),
    "Elu": OpRule(_elu),
    "Sigmoid": OpRule(_unary("sigmoid")),
    "HardSigmoid": OpRule(_hard_sigmoid),
    "HardSwish": OpRule(_hard_swish),
    "Tanh": OpRule(_unary("tanh")),
    "Exp": OpRule(_unary("exp")),
    "Log": OpRule(_unary("log")),
    "Sqrt": OpRule(_unary("sqrt")),
    "Reciprocal": OpRule(_reciprocal),
    "Erf": OpRule(_unary("erf")),
    "Cos": OpRule(_unary("cos")),
    "Sin": OpRule(_unary("sin")),
    "Clip": OpRule(_clip, tensor_inputs=(0,), const_inputs=(1, 2)),
    "Softplus": OpRule(_unary("softplus")),
    "Where": OpRule(_where, bool_inputs=(0,)),
    "Cast": OpRule(_cast, check=_check_cast),
    "Gelu": OpRule(_gelu, check=_check_gelu),
}

ELEMENTWISE_OPS = frozenset(RULES)


def node_attrs(node: NodeProto) -> dict:
    """Attribute values of a node as Python values: text strings decoded, binary ones (the
    compiled kernels of a fused node, cubin bytes) kept as bytes."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: _text(v) if isinstance(v, bytes) else v for k, v in values.items()}


def _text(v: bytes) -> str | bytes:
    try:
        return v.decode()
    except UnicodeDecodeError:
        return v
