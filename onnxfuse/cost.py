"""The cost model: FLOPs and DRAM bytes per node, from inferred shapes.

This docstring is the one place the counting conventions are written down (the README's
"Cost conventions" section summarizes it). `onnxfuse analyze` and `onnxfuse profile` use it.

Bytes (DRAM traffic of one kernel per node)
- Every distinct input tensor is read once and every output written once, at its own size
  and dtype (a broadcast input is read at its own size; ``Mul(x, x)`` reads x once).
  Weights (initializers) are inputs like any other: they are counted, and reported apart
  as ``weight_bytes``. Caches are ignored: a tensor produced by one node and read by the
  next makes a full round trip through DRAM, which is what fusion removes.
- Exceptions, where a kernel provably touches less: views (Reshape, Flatten, Squeeze,
  Unsqueeze, Identity) move nothing (0 bytes); Shape and Size read only metadata (they
  write their small output); Gather, GatherElements, GatherND and Slice read only the
  elements they copy (the output's size) plus their indices; Constant nodes cost nothing.
- A fused node (``onnxfuse::PointwiseChain`` and any onnxfuse node with a function body)
  reads its inputs once and writes its outputs once: intermediates stay in registers.

FLOPs
- A multiply-add is 2 FLOPs. Add, sub, mul, div, max, min, neg, abs, comparisons and
  selects are 1 FLOP each per output element; Relu (a max) is 1 FLOP per element.
- Transcendental functions (exp, log, tanh, erf, sin, cos, pow, sqrt and the like) count
  ``TRANSCENDENTAL_FLOPS`` = 4 each: a rough price for a special-function-unit instruction
  or a short polynomial, in FP32-ALU slots. Sigmoid is exp + add + div; softplus is exp +
  log + add + select (see `EXPR_FLOPS`). Casts and rounding to fp16/bf16 are 0 FLOPs.
- ONNX elementwise ops that onnxfuse fuses are counted by lowering the node with
  `onnxfuse.ops.RULES` into the expression IR and pricing its instructions with
  `EXPR_FLOPS`, the same table that prices a fused node's ``program``: fusing keeps the
  FLOPs and removes bytes. Other elementwise ops are priced in `EXTRA_ELEMENTWISE`.
- Conv: 2·N·K·(C/groups)·R·S·P·Q (any number of spatial dims), plus N·K·P·Q when there is
  a bias. ConvTranspose: 2·N·C·H·W·(K/groups)·R·S plus the bias. MatMul: 2·M·N·K per batch
  element. Gemm: 2·M·N·K plus M·N to add C. Einsum: 2 × the product of all index sizes.
  Integer and quantized versions (MatMulInteger, QLinearConv, ...) count operations alike.
- Pooling: one FLOP per window element per output (a compare or an add), plus one per
  output for the average's division. Global pools: one per input element.
- Reductions: one FLOP per input element (two for sum of squares and L1/L2), plus one per
  output for ReduceMean and a transcendental per output for L2 / LogSum.
- Softmax and LogSoftmax: 4 + T per element (max, subtract, exp, sum, divide).
  LayerNormalization: 7 per element (mean, subtract, square and accumulate, normalize,
  scale, shift; 6 without a bias) plus T + 2 per normalized row. RMS/simplified norm:
  4 per element plus T + 2 per row. BatchNormalization (inference): 2 per element (folded
  into one multiply-add) plus T + 3 per channel.
- Resize: nearest 0; linear 3·(2^k - 1) per output element (k = number of resized
  dimensions, 3 FLOPs per linear interpolation); cubic 2·4^k per output element.
- Data movement (Concat, Split, Slice, Transpose, Gather, Pad, Tile, Expand, ...): 0 FLOPs.
- An onnxfuse node other than PointwiseChain: the FLOPs of its function body (the
  subgraph it replaced), with its own inputs and outputs as its bytes.

Shapes: from ONNX shape inference after binding the graph inputs' dynamic dimensions
(`bind_dims`: ``--shape NAME=DIMS``, ``--batch N``, else ``DEFAULT_DIM`` with a warning).
A node whose shapes are still unknown, or whose op is not in the model above, is reported
with status ``unknown-shape`` or ``unknown-op`` and ``None`` counts: never silently zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import FunctionProto, ModelProto, NodeProto, TensorProto, helper

from onnxfuse import ir
from onnxfuse.align import padding
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import Builder, Ref, parse
from onnxfuse.graph import GraphView
from onnxfuse.layout import BODY_TRANSPOSE_PREFIX
from onnxfuse.load import canonicalize, infer_shapes
from onnxfuse.ops import RULES, node_attrs

DEFAULT_DIM = 1  # dynamic dimensions nobody bound (with a warning)
TRANSCENDENTAL_FLOPS = 4
T = TRANSCENDENTAL_FLOPS

# FLOPs per element of each expression-IR instruction (onnxfuse.expr).
EXPR_FLOPS: dict[str, int] = {
    **dict.fromkeys(("add", "sub", "mul", "div", "max", "min", "neg", "abs", "gt", "ge", "lt", "le", "eq",
                     "select"), 1),
    **dict.fromkeys(("exp", "expm1", "log", "sqrt", "tanh", "erf", "erfc", "cos", "sin", "pow"), T),
    "sigmoid": T + 2,
    "softplus": 2 * T + 2,
    "round_f16": 0,
    "round_bf16": 0,
}

# Elementwise ops outside onnxfuse.ops.RULES: FLOPs per output element.
EXTRA_ELEMENTWISE: dict[str, int] = {
    **dict.fromkeys(("Not", "And", "Or", "Xor", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual",
                     "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf", "Mod", "BitShift", "BitwiseAnd",
                     "BitwiseOr", "BitwiseXor", "BitwiseNot", "Dropout"), 1),
    **dict.fromkeys(("Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"), T),
    "ThresholdedRelu": 2, "Shrink": 3, "PRelu": 3, "Softsign": 3, "Selu": T + 4, "Celu": T + 4,
    "Mish": 3 * T + 3, "QuantizeLinear": 3, "DequantizeLinear": 2, "CastLike": 0,
    # com.microsoft (ONNX Runtime's fused elementwise ops, seen by `onnxfuse profile`)
    "BiasAdd": 2, "QuickGelu": T + 4,
}

# ONNX Runtime contrib ops that are an ONNX elementwise op with a bias add in front.
_BIAS_THEN = {"BiasGelu": ("Gelu", {}), "FastGelu": ("Gelu", {"approximate": "tanh"})}

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
METADATA_OPS = frozenset({"Shape", "Size"})
GATHER_OPS = frozenset({"Gather", "GatherElements", "GatherND", "Slice"})
MOVE_OPS = frozenset({
    "Concat", "Split", "Transpose", "Pad", "Tile", "Expand", "ConstantOfShape", "EyeLike", "OneHot", "Trilu",
    "ReverseSequence", "DepthToSpace", "SpaceToDepth", "Compress", "NonZero", "Unique", "ScatterND",
    "ScatterElements", "Scatter", "MaxUnpool", "Col2Im", "CenterCropPad", "Range",
    # ONNX Runtime's layout and device copies
    "ReorderInput", "ReorderOutput", "MemcpyFromHost", "MemcpyToHost", "TransposeMatMul",
})
MATRIX_OPS = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "ConvInteger", "MatMulInteger", "QLinearConv",
    "QLinearMatMul", "FusedConv", "FusedMatMul", "FusedGemm", "NhwcConv", "NhwcFusedConv", "Attention",
})

ITEM_BITS = {
    TensorProto.FLOAT: 32, TensorProto.UINT8: 8, TensorProto.INT8: 8, TensorProto.UINT16: 16,
    TensorProto.INT16: 16, TensorProto.INT32: 32, TensorProto.INT64: 64, TensorProto.BOOL: 8,
    TensorProto.FLOAT16: 16, TensorProto.DOUBLE: 64, TensorProto.UINT32: 32, TensorProto.UINT64: 64,
    TensorProto.COMPLEX64: 64, TensorProto.COMPLEX128: 128, TensorProto.BFLOAT16: 16,
    TensorProto.FLOAT8E4M3FN: 8, TensorProto.FLOAT8E4M3FNUZ: 8, TensorProto.FLOAT8E5M2: 8,
    TensorProto.FLOAT8E5M2FNUZ: 8, TensorProto.UINT4: 4, TensorProto.INT4: 4,
}
for _name, _bits in (("FLOAT4E2M1", 4), ("FLOAT8E8M0", 8), ("UINT2", 2), ("INT2", 2)):
    if hasattr(TensorProto, _name):
        ITEM_BITS[getattr(TensorProto, _name)] = _bits


def dtype_name(t: int) -> str:
    if not t:
        return "?"
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(t).name if t != TensorProto.BFLOAT16 else "bfloat16"
    except (KeyError, ValueError, TypeError):
        return TensorProto.DataType.Name(t).lower()


@dataclass(frozen=True)
class Tensor:
    """A tensor as the cost model sees it: a concrete shape (None: unknown) and a dtype."""

    name: str
    shape: tuple[int, ...] | None
    dtype: int = 0
    const: bool = False  # an initializer (weight)

    @property
    def numel(self) -> int | None:
        return None if self.shape is None else int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int | None:
        n, bits = self.numel, ITEM_BITS.get(self.dtype)
        if n is None or bits is None:
            return None
        return (n * bits + 7) // 8


@dataclass
class NodeCost:
    """FLOPs and bytes of one node. Counts are None when status is not "ok"."""

    name: str
    op_type: str
    domain: str = ""
    flops: int | None = None
    bytes_read: int | None = None
    bytes_written: int | None = None
    weight_bytes: int = 0
    status: str = "ok"  # "ok", "unknown-op" or "unknown-shape"
    note: str = ""
    output_shape: tuple[int, ...] | None = None
    dtype: str = "?"
    matrix: bool = False  # runs on tensor cores where the device has them (MatMul, Conv, ...)
    body: list[NodeCost] | None = None  # a fused node: the costs of the subgraph it replaced

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def bytes(self) -> int | None:
        if self.bytes_read is None or self.bytes_written is None:
            return None
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float | None:
        """FLOPs per byte; inf for arithmetic without memory traffic, 0 for none of either."""
        if not self.ok or self.flops is None or self.bytes is None:
            return None
        if self.bytes == 0:
            return math.inf if self.flops else 0.0
        return self.flops / self.bytes

    @property
    def label(self) -> str:
        """The op chain a fused node replaced (Mul→Sigmoid→Mul), else the op type."""
        if self.body:
            return "→".join(c.op_type for c in self.body)
        return self.op_type

    def to_dict(self) -> dict:
        d = {
            "name": self.name, "op_type": self.op_type, "domain": self.domain, "status": self.status,
            "flops": self.flops, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
            "bytes": self.bytes, "weight_bytes": self.weight_bytes, "intensity": _json_float(self.intensity),
            "output_shape": list(self.output_shape) if self.output_shape is not None else None,
            "dtype": self.dtype, "matrix": self.matrix, "note": self.note,
        }
        if self.body is not None:
            d["replaces"] = [c.to_dict() for c in self.body]
        return d


def _json_float(x: float | None) -> float | str | None:
    if x is None:
        return None
    return "inf" if math.isinf(x) else x


@dataclass
class ModelCost:
    nodes: list[NodeCost]
    dims: dict[str, int] = field(default_factory=dict)  # symbolic dimension -> value used
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def known(self) -> list[NodeCost]:
        return [n for n in self.nodes if n.ok]

    @property
    def unknown(self) -> list[NodeCost]:
        return [n for n in self.nodes if not n.ok]

    @property
    def flops(self) -> int:
        return sum(n.flops or 0 for n in self.known)

    @property
    def bytes(self) -> int:
        return sum(n.bytes or 0 for n in self.known)

    def by_name(self) -> dict[str, NodeCost]:
        return {n.name: n for n in self.nodes}


# ---------------------------------------------------------------------------------------
# Dynamic dimensions
# ---------------------------------------------------------------------------------------

def bind_dims(model: ModelProto, shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None,
              default: int = DEFAULT_DIM
              ) -> tuple[ModelProto, dict[str, int], dict[str, tuple[int, ...]], list[str], list[str]]:
    """Make the graph inputs' shapes concrete. Returns (a copy with the dims set, symbol ->
    value, input -> shape, warnings, the dims that took ``default``: their names, or
    "input[k]" for unnamed ones). Symbolic dims are replaced everywhere they are named.

    Order: ``shapes`` (per input, or ``{"N": (8,)}`` for a named dimension), then ``batch``
    (the first dimension of every input whose first dimension is dynamic), then ``default``
    for what is left, with a warning."""
    shapes = dict(shapes or {})
    if batch is not None and batch < 1:
        raise OnnxfuseError(f"--batch {batch}: must be at least 1")
    m = ModelProto()
    m.CopyFrom(model)
    g = m.graph
    init = {t.name for t in g.initializer}
    inputs = [i for i in g.input if i.name not in init]
    names = [i.name for i in inputs]
    dim_params = {d.dim_param for i in inputs if i.type.HasField("tensor_type")
                  for d in i.type.tensor_type.shape.dim if d.HasField("dim_param")}
    symbols: dict[str, int] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []
    assumed: list[str] = []
    resolved: dict[str, tuple[int, ...]] = {}

    def bind(sym: str, value: int, how: str) -> None:
        if sym in symbols and symbols[sym] != value:
            raise OnnxfuseError(f"dimension {sym!r} is {symbols[sym]} ({sources[sym]}) and {value} ({how})")
        symbols.setdefault(sym, value)
        sources.setdefault(sym, how)

    for name in list(shapes):
        if name in names:
            continue
        if name in dim_params and len(shapes[name]) == 1:  # --shape N=8: a named dimension
            bind(name, shapes.pop(name)[0], f"--shape {name}")
            continue
        raise OnnxfuseError(f"--shape {name}: the model has no input {name!r} (inputs: {', '.join(names)}) "
                            f"nor a dimension of that name")

    # Pass 1: explicit shapes.
    for vi in inputs:
        if vi.name not in shapes or not vi.type.HasField("tensor_type"):
            continue
        want = shapes[vi.name]
        tt = vi.type.tensor_type
        if tt.HasField("shape") and len(tt.shape.dim) != len(want):
            raise OnnxfuseError(f"--shape {vi.name}: the input has rank {len(tt.shape.dim)}, "
                                f"got {len(want)} dimensions")
        if tt.HasField("shape"):
            for k, (d, v) in enumerate(zip(tt.shape.dim, want, strict=True)):
                if ir.known_dim(d) is not None and d.dim_value != v:
                    raise OnnxfuseError(f"--shape {vi.name}: dimension {k} is {d.dim_value} in the model, not {v}")
                if ir.dim_symbol(d) is not None:
                    bind(d.dim_param, v, f"--shape {vi.name}")
    # Pass 2: batch, then defaults.
    for vi in inputs:
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        if vi.name in shapes:
            if not tt.HasField("shape"):
                tt.shape.SetInParent()
                for v in shapes[vi.name]:
                    tt.shape.dim.add().dim_value = v
            else:
                for d, v in zip(tt.shape.dim, shapes[vi.name], strict=True):
                    d.Clear()
                    d.dim_value = v
            resolved[vi.name] = shapes[vi.name]
            continue
        if not tt.HasField("shape"):
            warnings.append(f"input {vi.name}: rank unknown; pass --shape {vi.name}=DIMS")
            continue
        dims = []
        for k, d in enumerate(tt.shape.dim):
            if ir.known_dim(d) is not None:
                dims.append(d.dim_value)
                continue
            sym = ir.dim_symbol(d)
            if sym is not None and sym in symbols:
                v = symbols[sym]
            elif k == 0 and batch is not None:
                v = batch
                if sym:
                    bind(sym, v, "--batch")
            else:
                v = default
                what = f"dimension {sym!r}" if sym else f"dimension {k}"
                warnings.append(f"input {vi.name}: {what} is dynamic, assumed {default} "
                                f"(set it with --shape {vi.name}=... or --batch)")
                assumed.append(sym or f"{vi.name}[{k}]")
                if sym:
                    bind(sym, v, "default")
            d.Clear()
            d.dim_value = v
            dims.append(v)
        resolved[vi.name] = tuple(dims)
    # Symbolic dims named elsewhere (outputs, value_info) take the bound values.
    for vi in list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if ir.dim_symbol(d) is not None and d.dim_param in symbols:
                    v = symbols[d.dim_param]
                    d.Clear()
                    d.dim_value = v
    return m, symbols, resolved, warnings, assumed


# ---------------------------------------------------------------------------------------
# One node
# ---------------------------------------------------------------------------------------

class _Unknown(Exception):
    def __init__(self, status: str, note: str):
        super().__init__(note)
        self.status, self.note = status, note


@dataclass
class _Est:
    flops: int
    read: int | None = None  # None: the default (every distinct input once)
    written: int | None = None  # None: the default (every output once)
    note: str = ""


@dataclass
class _Ctx:
    node: NodeProto
    attrs: dict
    inputs: list[Tensor | None]
    outputs: list[Tensor | None]
    literals: dict[int, float]
    functions: dict[tuple[str, str, str], FunctionProto]

    def inp(self, k: int) -> Tensor | None:
        return self.inputs[k] if k < len(self.inputs) else None

    def shape_in(self, k: int) -> tuple[int, ...]:
        t = self.inp(k)
        if t is None or t.shape is None:
            raise _Unknown("unknown-shape", f"shape of input {k} ({t.name if t else 'missing'}) unknown")
        return t.shape

    def shape_out(self, k: int = 0) -> tuple[int, ...]:
        t = self.outputs[k] if k < len(self.outputs) else None
        if t is None or t.shape is None:
            raise _Unknown("unknown-shape", f"shape of output {k} unknown")
        return t.shape

    def numel_in(self, k: int) -> int:
        return int(np.prod(self.shape_in(k), dtype=np.int64))

    def numel_out(self, k: int = 0) -> int:
        return int(np.prod(self.shape_out(k), dtype=np.int64))

    def broadcast_numel(self) -> int:
        """Elements of output 0: its inferred shape, else the broadcast of the inputs."""
        t = self.outputs[0] if self.outputs else None
        if t is not None and t.shape is not None:
            return t.numel or 0
        shapes = [self.shape_in(k) for k, x in enumerate(self.inputs) if x is not None]
        try:
            return int(np.prod(np.broadcast_shapes(*shapes), dtype=np.int64))
        except ValueError:
            raise _Unknown("unknown-shape", "inputs do not broadcast") from None

    def has(self, k: int) -> bool:
        return self.inp(k) is not None


Rule = Callable[[_Ctx], _Est]


def lowered_flops(op_type: str, attrs: dict, n_inputs: int, literals: dict[int, float] | None = None) -> int:
    """FLOPs per output element of one ONNX elementwise node, by lowering it with
    onnxfuse.ops.RULES into expression-IR instructions priced by EXPR_FLOPS."""
    rule = RULES[op_type]
    literals = literals or {}
    operand_idx = [k for k in range(n_inputs) if k not in rule.const_inputs
                   and (rule.tensor_inputs is None or k in rule.tensor_inputs)]
    refs = [k for k in operand_idx if k not in literals]
    b = Builder(["f32"] * len(refs))
    args = [float(literals[k]) if k in literals else Ref(refs.index(k)) for k in operand_idx]
    consts = [literals.get(k, 0.0) if k < n_inputs else None for k in rule.const_inputs]
    try:
        rule.lower(b, args, attrs, consts)
    except (KeyError, ValueError, TypeError):  # a lowering that needs more than attributes: its ops only
        return max(1, len(b.instrs))
    return sum(EXPR_FLOPS[i.op] for i in b.instrs)


def program_flops(program_text: str) -> int:
    """FLOPs per output element of a PointwiseChain program."""
    return sum(EXPR_FLOPS[i.op] for i in parse(program_text).instrs)


def _elementwise(c: _Ctx) -> _Est:
    op = c.node.op_type
    n_in = len(c.node.input)
    if op in RULES:
        per = lowered_flops(op, c.attrs, n_in, c.literals)
    elif op in _BIAS_THEN:
        base, attrs = _BIAS_THEN[op]
        per = lowered_flops(base, attrs, 1) + (1 if n_in > 1 and c.has(1) else 0)
    else:
        per = EXTRA_ELEMENTWISE[op]
    n = c.broadcast_numel()
    written = None
    if c.outputs and c.outputs[0] is not None and c.outputs[0].shape is None:
        written = n * ITEM_BITS.get(c.outputs[0].dtype or _first_dtype(c), 32) // 8
    return _Est(per * n, written=written)


def _first_dtype(c: _Ctx) -> int:
    return next((t.dtype for t in c.inputs if t is not None and t.dtype), TensorProto.FLOAT)


def _activation_flops(attrs: dict) -> int:
    """FLOPs per element of the activation a com.microsoft fused Conv/Gemm applies."""
    act = attrs.get("activation")
    if not act:
        return 0
    if act in RULES:
        alpha = attrs.get("activation_params") or []
        a = {"alpha": alpha[0]} if alpha else {}
        return lowered_flops(act, a, 3 if act == "Clip" else 1)
    return EXTRA_ELEMENTWISE.get(act, T)


def _conv(c: _Ctx) -> _Est:
    op = c.node.op_type
    w_idx, b_idx = (3, 8) if op == "QLinearConv" else (1, 2)
    w = c.shape_in(w_idx)
    y = c.numel_out()
    k = w[0]
    flops = 2 * y * (int(np.prod(w, dtype=np.int64)) // max(k, 1))
    if c.has(b_idx) and op != "ConvInteger":
        flops += y
    if op != "QLinearConv" and c.node.domain not in ("", "ai.onnx"):  # ONNX Runtime's fused convolutions
        flops += y * _activation_flops(c.attrs)
        if c.has(3):  # Z, a residual sum
            flops += y
    return _Est(flops)


def _conv_transpose(c: _Ctx) -> _Est:
    x, w = c.shape_in(0), c.shape_in(1)
    ch = w[0]
    flops = 2 * int(np.prod(x, dtype=np.int64)) * (int(np.prod(w, dtype=np.int64)) // max(ch, 1))
    if c.has(2):
        flops += c.numel_out()
    return _Est(flops)


def _matmul(c: _Ctx) -> _Est:
    op = c.node.op_type
    a_idx = 0
    a = c.shape_in(a_idx)
    if op == "FusedMatMul" and c.attrs.get("transA", 0) and len(a) >= 2:
        k = a[-2]
    else:
        k = a[-1] if a else 1
    y = c.numel_out()
    flops = 2 * y * k
    if op == "FusedMatMul" and c.attrs.get("alpha", 1.0) != 1.0:
        flops += y
    return _Est(flops)


def _gemm(c: _Ctx) -> _Est:
    a = c.shape_in(0)
    if len(a) != 2:
        raise _Unknown("unknown-shape", "Gemm input A is not 2-D")
    k = a[0] if c.attrs.get("transA", 0) else a[1]
    y = c.numel_out()
    flops = 2 * y * k + (y if c.has(2) else 0)
    if c.node.op_type == "FusedGemm":
        flops += y * _activation_flops(c.attrs)
    return _Est(flops)


def _einsum(c: _Ctx) -> _Est:
    eq = c.attrs.get("equation", "").replace(" ", "")
    lhs = eq.split("->")[0].split(",")
    if "..." in eq or len(lhs) != sum(1 for x in c.inputs if x is not None):
        raise _Unknown("unknown-shape", "Einsum with an ellipsis is not counted")
    sizes: dict[str, int] = {}
    for k, term in enumerate(lhs):
        shape = c.shape_in(k)
        if len(shape) != len(term):
            raise _Unknown("unknown-shape", "Einsum term and input rank differ")
        for letter, d in zip(term, shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), d)
    total = int(np.prod(list(sizes.values()), dtype=np.int64))
    return _Est(2 * total if len(lhs) > 1 else total)


def _pool(c: _Ctx) -> _Est:
    op = c.node.op_type
    if op.startswith("Global"):
        x = c.numel_in(0)
        return _Est(x + (c.numel_out() if op == "GlobalAveragePool" else 0) + (x if op == "GlobalLpPool" else 0))
    kernel = c.attrs.get("kernel_shape")
    if not kernel:
        raise _Unknown("unknown-shape", f"{op} without kernel_shape")
    window = int(np.prod(kernel, dtype=np.int64))
    y = c.numel_out()
    if op == "AveragePool":
        return _Est(y * window + y)
    if op == "LpPool":
        return _Est(y * (2 * window + T))
    return _Est(y * window)


# Reductions: (FLOPs per input element, FLOPs per output element).
_REDUCE = {
    "ReduceSum": (1, 0), "ReduceMax": (1, 0), "ReduceMin": (1, 0), "ReduceProd": (1, 0), "ReduceMean": (1, 1),
    "ReduceSumSquare": (2, 0), "ReduceL1": (2, 0), "ReduceL2": (2, T), "ReduceLogSum": (1, T),
    "ReduceLogSumExp": (T + 2, T + 1), "ArgMax": (1, 0), "ArgMin": (1, 0), "CumSum": (1, 0),
}


def _reduce(c: _Ctx) -> _Est:
    per_in, per_out = _REDUCE[c.node.op_type]
    return _Est(per_in * c.numel_in(0) + (per_out * c.numel_out() if per_out else 0))


def _topk(c: _Ctx) -> _Est:
    x = c.numel_in(0)
    k = max(c.shape_out(0)[c.attrs.get("axis", -1)] if c.shape_out(0) else 1, 1)
    return _Est(int(x * max(1.0, math.log2(k + 1))))


def _softmax(c: _Ctx) -> _Est:
    x = c.numel_in(0)
    op = c.node.op_type
    if op == "Hardmax":
        return _Est(x)
    flops = (4 + T) * x
    if op == "LogSoftmax":
        shape = c.shape_in(0)
        axis = c.attrs.get("axis", -1) % max(len(shape), 1) if shape else 0
        flops += T * (x // max(shape[axis], 1) if shape else 1)
    if op == "BiasSoftmax":
        flops += x
    return _Est(flops)


def _rows(shape: tuple[int, ...], axis: int) -> int:
    axis = axis % len(shape) if shape else 0
    return int(np.prod(shape[:axis], dtype=np.int64))


def _layer_norm(c: _Ctx) -> _Est:
    op = c.node.op_type
    x_shape = c.shape_in(0)
    x = c.numel_in(0)
    rows = _rows(x_shape, c.attrs.get("axis", -1))
    if op in ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization"):
        per = 4
        bias_idx = 3 if op.startswith("Skip") else None
    else:
        bias_idx = {"LayerNormalization": 2, "SkipLayerNormalization": 3}[op]
        per = 6
    if bias_idx is not None and c.has(bias_idx):
        per += 1
    if op.startswith("Skip"):
        per += 1 + (1 if c.has(4) else 0)  # the skip add, and the bias input
    return _Est(per * x + (T + 2) * rows)


def _group_norm(c: _Ctx) -> _Est:
    x_shape = c.shape_in(0)
    x = c.numel_in(0)
    op = c.node.op_type
    if op == "GroupNormalization":
        groups = x_shape[0] * c.attrs.get("num_groups", 1)
    elif op == "InstanceNormalization":
        groups = x_shape[0] * (x_shape[1] if len(x_shape) > 1 else 1)
    elif op == "LpNormalization":
        return _Est(3 * x + T * (x // max(x_shape[c.attrs.get("axis", -1)], 1)))
    else:  # MeanVarianceNormalization
        axes = c.attrs.get("axes", [0, 2, 3])
        groups = x // max(int(np.prod([x_shape[a] for a in axes if a < len(x_shape)], dtype=np.int64)), 1)
        return _Est(6 * x + (T + 2) * groups)
    return _Est(7 * x + (T + 2) * groups)


def _lrn(c: _Ctx) -> _Est:
    size = c.attrs.get("size", 1)
    return _Est((2 * size + T + 4) * c.numel_in(0))


def _batch_norm(c: _Ctx) -> _Est:
    x_shape = c.shape_in(0)
    channels = x_shape[1] if len(x_shape) > 1 else 1
    flops = 2 * c.numel_in(0) + (T + 3) * channels
    note = ""
    if c.attrs.get("training_mode", 0):
        flops += 3 * c.numel_in(0)
        note = "training mode: batch statistics counted as 3 FLOPs per element"
    return _Est(flops, note=note)


def _resize(c: _Ctx) -> _Est:
    x, y = c.shape_in(0), c.shape_out(0)
    mode = c.attrs.get("mode", "nearest")
    k = sum(1 for a, b in zip(x, y, strict=False) if a != b)
    n = c.numel_out()
    if mode in ("linear", "bilinear", "trilinear"):
        return _Est(3 * (2**k - 1) * n)
    if mode in ("cubic", "bicubic"):
        return _Est(2 * 4**k * n)
    return _Est(0)


def _grid_sample(c: _Ctx) -> _Est:
    y = c.numel_out()
    k = len(c.shape_out(0)) - 2
    mode = c.attrs.get("mode", "linear")
    per = 4 * k + (3 * (2**k - 1) if mode in ("linear", "bilinear") else 2 * 4**k if mode in ("cubic", "bicubic")
                   else 0)
    return _Est(per * y)


def _move(c: _Ctx) -> _Est:
    if c.node.op_type == "Range":
        return _Est(c.numel_out())
    return _Est(0)


def _view(c: _Ctx) -> _Est:
    return _Est(0, read=0, written=0, note="view: no data moved")


def _metadata(c: _Ctx) -> _Est:
    return _Est(0, read=0, note="reads shape metadata only")


def _gather(c: _Ctx) -> _Est:
    """Reads what it copies (the output's size at the data's dtype) and its index inputs."""
    out = c.outputs[0]
    if out is None or out.nbytes is None:
        raise _Unknown("unknown-shape", "output shape unknown")
    read = out.nbytes + sum(t.nbytes or 0 for k, t in enumerate(c.inputs) if k > 0 and t is not None)
    return _Est(0, read=read, note="reads only the elements it copies")


def _constant(c: _Ctx) -> _Est:
    return _Est(0, read=0, written=0, note="constant")


def _pointwise_chain(c: _Ctx) -> _Est:
    program = c.attrs.get("program")
    if not program:
        raise _Unknown("unknown-op", "PointwiseChain without a program attribute")
    try:
        per = program_flops(program)
    except (ValueError, KeyError) as e:
        raise _Unknown("unknown-op", f"cannot parse program: {e}") from None
    n = c.broadcast_numel()
    written = None
    if any(t is not None and t.shape is None for t in c.outputs):
        written = sum(n * ITEM_BITS.get(t.dtype, 32) // 8 for t in c.outputs if t is not None)
    return _Est(per * n, written=written, note="one kernel: inputs read once, outputs written once")


RULES_BY_OP: dict[str, Rule] = {
    **dict.fromkeys(RULES, _elementwise),
    **dict.fromkeys(EXTRA_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_BIAS_THEN, _elementwise),
    **dict.fromkeys(("Conv", "ConvInteger", "QLinearConv", "FusedConv", "NhwcConv", "NhwcFusedConv"), _conv),
    "ConvTranspose": _conv_transpose,
    **dict.fromkeys(("MatMul", "MatMulInteger", "FusedMatMul"), _matmul),
    "QLinearMatMul": lambda c: _Est(2 * c.numel_out() * (c.shape_in(0)[-1] if c.shape_in(0) else 1)),
    **dict.fromkeys(("Gemm", "FusedGemm"), _gemm),
    "Einsum": _einsum,
    **dict.fromkeys(("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
                     "NhwcMaxPool"), _pool),
    **dict.fromkeys(_REDUCE, _reduce),
    "TopK": _topk,
    **dict.fromkeys(("Softmax", "LogSoftmax", "Hardmax", "BiasSoftmax"), _softmax),
    **dict.fromkeys(("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization",
                     "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"), _layer_norm),
    **dict.fromkeys(("GroupNormalization", "InstanceNormalization", "MeanVarianceNormalization",
                     "LpNormalization"), _group_norm),
    "LRN": _lrn,
    "BatchNormalization": _batch_norm,
    **dict.fromkeys(("Resize", "Upsample"), _resize),
    "GridSample": _grid_sample,
    **dict.fromkeys(MOVE_OPS, _move),
    **dict.fromkeys(VIEW_OPS, _view),
    **dict.fromkeys(METADATA_OPS, _metadata),
    **dict.fromkeys(GATHER_OPS, _gather),
    "Constant": _constant,
}
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def cost_node(node: NodeProto, inputs: list[Tensor | None], outputs: list[Tensor | None],
              functions: dict[tuple[str, str, str], FunctionProto] | None = None,
              literals: dict[int, float] | None = None) -> NodeCost:
    """The cost of one node given its input and output tensors (None for absent ones)."""
    attrs = node_attrs(node)
    ctx = _Ctx(node, attrs, list(inputs), list(outputs), dict(literals or {}), functions or {})
    out0 = next((t for t in outputs if t is not None), None)
    cost = NodeCost(
        name=node.name, op_type=node.op_type, domain=node.domain,
        output_shape=out0.shape if out0 is not None else None,
        dtype=dtype_name(out0.dtype if out0 is not None and out0.dtype else _first_dtype(ctx)),
        matrix=node.op_type in MATRIX_OPS,
    )
    function = _function_for(node, ctx.functions)
    try:
        if node.domain == "onnxfuse" and node.op_type == "PointwiseChain":
            est = _pointwise_chain(ctx)
        elif node.op_type in _CONTROL_FLOW:
            raise _Unknown("unknown-op", f"control flow ({node.op_type}) is not costed")
        elif node.domain in ("", "ai.onnx") or node.domain.startswith(("com.microsoft", "com.ms.")):
            rule = RULES_BY_OP.get(node.op_type)
            if rule is None:
                raise _Unknown("unknown-op", f"no cost rule for {node.op_type}")
            est = rule(ctx)
        elif function is not None:
            est = None  # from the body, below
        else:
            raise _Unknown("unknown-op", f"no cost rule for {node.domain}::{node.op_type}")
        if function is not None:
            cost.body = body_costs(function, ctx.inputs, ctx.functions)
            bad = [b for b in cost.body if not b.ok]
            if est is None:
                if bad:
                    raise _Unknown(bad[0].status, f"function body: {bad[0].op_type}: {bad[0].note}")
                est = _Est(sum(b.flops or 0 for b in cost.body), note="FLOPs of its function body; one kernel")
                cost.matrix = any(b.matrix for b in cost.body)
        read, written, weights = _default_bytes(ctx)
        cost.flops = int(est.flops)
        cost.bytes_read = read if est.read is None else est.read
        cost.bytes_written = written if est.written is None else est.written
        cost.weight_bytes = weights if est.read is None else min(weights, cost.bytes_read)
        cost.note = est.note
    except _Unknown as u:
        cost.status, cost.note = u.status, u.note
        cost.flops = cost.bytes_read = cost.bytes_written = None
    return cost


def _default_bytes(c: _Ctx) -> tuple[int | None, int | None, int]:
    """(bytes read, bytes written, weight bytes): each distinct input once, each output once.
    None where a shape is unknown (a rule may supply its own count instead)."""
    read: int | None = 0
    weights = 0
    seen: set[str] = set()
    for t in c.inputs:
        if t is None or t.name in seen:
            continue
        seen.add(t.name)
        if t.nbytes is None:
            read = None
            continue
        if read is not None:
            read += t.nbytes
        if t.const:
            weights += t.nbytes
    written: int | None = 0
    for t in c.outputs:
        if t is None:
            continue
        if t.nbytes is None:
            written = None
        elif written is not None:
            written += t.nbytes
    return read, written, weights


def _function_for(node: NodeProto, functions: dict[tuple[str, str, str], FunctionProto]) -> FunctionProto | None:
    overload = getattr(node, "overload", "")
    return functions.get((node.domain, node.op_type, overload)) or functions.get((node.domain, node.op_type, ""))


def body_costs(function: FunctionProto, inputs: list[Tensor | None],
               functions: dict[tuple[str, str, str], FunctionProto] | None = None) -> list[NodeCost]:
    """Costs of a function body's nodes for these actual inputs (the unfused subgraph)."""
    g_inputs = []
    for name, t in zip(function.input, inputs, strict=False):
        if t is None:
            continue
        g_inputs.append(helper.make_tensor_value_info(name, t.dtype, list(t.shape) if t.shape is not None else None))
    outputs = [helper.make_empty_tensor_value_info(o) for o in function.output]
    g = helper.make_graph(list(function.node), "body", g_inputs, outputs)
    m = helper.make_model(g, opset_imports=list(function.opset_import))
    m.ir_version = 10
    m.functions.extend(f for f in (functions or {}).values() if f.domain != "onnxfuse")
    costs = _graph_costs(canonicalize(m))
    # A FusedConv's body starts with Transpose(packed weights): the layout of a constant,
    # which a runtime folds once (ONNX Runtime does at session creation), not a per-run
    # round trip of the unfused model.
    # The same for the Transposes a channels-last node's body has around the original nodes
    # (onnxfuse.layout): they read the node's NHWC storage; the fused kernel does not run them.
    consts = {name for name, t in zip(function.input, inputs, strict=False) if t is not None and t.const}
    layout = {n.name for n in function.node if n.op_type == "Transpose" and n.input
              and (n.input[0] in consts or n.name.startswith(BODY_TRANSPOSE_PREFIX))}
    return [c for c in costs if c.op_type != "Constant" and not (c.op_type == "Transpose" and c.name in layout)]


# ---------------------------------------------------------------------------------------
# A whole model
# ---------------------------------------------------------------------------------------

def tensors_of(view: GraphView, names) -> list[Tensor | None]:
    out: list[Tensor | None] = []
    for name in names:
        if not name:
            out.append(None)
            continue
        shape = view.shapes.get(name)
        concrete = shape if shape is not None and all(isinstance(d, int) for d in shape) else None
        out.append(Tensor(name, concrete, view.types.get(name, 0), name in view.constants))
    return out


def _literals(view: GraphView, node: NodeProto) -> dict[int, float]:
    if node.op_type not in RULES:
        return {}
    return {k: v for k, name in enumerate(node.input) if name and (v := view.scalar_constant(name)) is not None}


def functions_of(model: ModelProto) -> dict[tuple[str, str, str], FunctionProto]:
    return {(f.domain, f.name, getattr(f, "overload", "")): f for f in model.functions}


def _graph_costs(model: ModelProto, view: GraphView | None = None) -> list[NodeCost]:
    if view is None:
        view = GraphView.build(model, infer_shapes(model))
    functions = functions_of(model)
    costs = []
    for i, n in enumerate(view.nodes):
        c = cost_node(n, tensors_of(view, n.input), tensors_of(view, n.output), functions, _literals(view, n))
        if not c.name:
            c.name = f"{n.op_type}_{i}"
        costs.append(c)
    return costs


def inline_foreign_functions(model: ModelProto) -> ModelProto:
    """Inline model-local functions other than onnxfuse's (ONNX Runtime inlines them too)."""
    foreign = [(f.domain, f.name) for f in model.functions if f.domain != "onnxfuse"]
    if not foreign:
        return model
    from onnx import inliner

    return inliner.inline_selected_functions(model, foreign)


@dataclass
class Prepared:
    """A model canonicalized, its dynamic dims bound and its shapes inferred."""

    model: ModelProto
    view: GraphView
    dims: dict[str, int]
    input_shapes: dict[str, tuple[int, ...]]
    warnings: list[str]
    assumed: list[str]  # dynamic dims set to the default (bind_dims)


def prepare(model: ModelProto, shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None,
            default_dim: int = DEFAULT_DIM) -> Prepared:
    m = inline_foreign_functions(canonicalize(model))
    m, dims, input_shapes, warnings, assumed = bind_dims(m, shapes, batch, default_dim)
    return Prepared(m, GraphView.build(m, infer_shapes(m)), dims, input_shapes, warnings, assumed)


def model_cost(model: ModelProto, shapes: dict[str, tuple[int, ...]] | None = None, batch: int | None = None,
               default_dim: int = DEFAULT_DIM) -> ModelCost:
    """FLOPs and bytes of every node of a model (canonicalized as `optimize` sees it)."""
    p = prepare(model, shapes, batch, default_dim)
    dims, input_shapes, warnings = p.dims, p.input_shapes, list(p.warnings)
    nodes = _graph_costs(p.model, p.view)
    unknown_shapes = sum(1 for n in nodes if n.status == "unknown-shape")
    if unknown_shapes:
        warnings.append(f"{unknown_shapes} node(s) with shapes that inference could not make concrete")
    unaligned = [p.view.nodes[i].name or p.view.nodes[i].output[0] for i in range(len(p.view.nodes))
                 if padding(p.view, i) is not None]
    if unaligned:
        warnings.append(f"{len(unaligned)} product(s) with output rows not a multiple of 16 bytes, which cuBLAS runs "
                        f"without its tensor-core kernels (optimize pads them for the GPU: onnxfuse.align): "
                        f"{', '.join(unaligned[:3])}{' ...' if len(unaligned) > 3 else ''}")
    return ModelCost(nodes, dims, input_shapes, warnings)
