"""The fusion kinds, one module each, and KINDS: the table the pipeline's stages look a
kind up in (by `Kind.name`, which fused nodes and kernel specs carry). A kind implements
`onnxfuse.kinds.base.Kind`; docs/kinds.md lists what a new one touches."""

from __future__ import annotations

from onnxfuse.kinds.base import Kind
from onnxfuse.kinds.conv import Conv
from onnxfuse.kinds.maxpool import MaxPool
from onnxfuse.kinds.pointwise import Pointwise

KINDS: dict[str, Kind] = {k.name: k for k in (Pointwise(), Conv(), MaxPool())}
