"""The fusion kinds, one module each, and KINDS: the table the pipeline's stages look a
kind up in (by `Kind.name`, which fused nodes and kernel specs carry). A kind implements
`onnxfuse.kinds.base.Kind`; docs/kinds.md lists what a new one touches."""

from __future__ import annotations

from onnx import NodeProto

from onnxfuse.kinds.attention import Attention
from onnxfuse.kinds.base import Kind
from onnxfuse.kinds.conv import Conv
from onnxfuse.kinds.gemm import Gemm
from onnxfuse.kinds.maxpool import MaxPool
from onnxfuse.kinds.pointwise import Pointwise
from onnxfuse.kinds.rows import Rows
from onnxfuse.kinds.squeeze import SqueezeExcite
from onnxfuse.rewrite import DOMAIN

KINDS: dict[str, Kind] = {k.name: k for k in (Pointwise(), Conv(), MaxPool(), Rows(), Gemm(), Attention(),
                                            SqueezeExcite())}
BY_OP_TYPE: dict[str, Kind] = {k.op_type: k for k in KINDS.values()}


def kind_of(node: NodeProto) -> Kind | None:
    """The kind of a fused node (domain onnxfuse), or None for any other node."""
    return BY_OP_TYPE.get(node.op_type) if node.domain == DOMAIN else None
