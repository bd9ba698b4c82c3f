"""The fusion-kind protocol (`Kind`): what one kind of fused node implements, from the
pattern's parameters to the kernel that runs it. docs/kinds.md describes it; the kinds are
listed in `onnxfuse.kinds.KINDS`."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import numpy as np
from onnx import ModelProto, NodeProto

from onnxfuse.codegen import KernelSource
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import Program
from onnxfuse.rewrite import FusedNode

META_VERSION = 1  # kernel_meta's "version" (docs/format.md)


class Spec(Protocol):
    """What to compile for one fused node: every kind's spec has these (and its own fields)."""

    kind: ClassVar[str]  # the `Kind.name` whose kernel it is
    name: str  # the kernel name
    program: Program
    source_nodes: tuple[str, ...]


class Kind(ABC):
    """One kind of fused node: its op type in domain onnxfuse, how patterns of the kind
    match and lower to that node, and how its kernel is specified, configured, generated
    and described to the library (kernel_meta). One instance of each kind is listed in
    `onnxfuse.kinds.KINDS`, by `name`."""

    name: ClassVar[str]  # FusedNode.kind and kernel_meta's "kind": "pointwise", "conv", ...
    op_type: ClassVar[str]  # the custom op in domain onnxfuse (docs/format.md)

    # ---- compile -----------------------------------------------------------------------

    @abstractmethod
    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> Spec:
        """What to compile for fused node `f` of `model` (`precision`: `--conv-precision`;
        `weight_dims`: initializer name -> dims, or None to look them up in `model`)."""

    def decline_reason(self, spec: Spec, layout: str) -> str | None:
        """Why the heuristics leave this node to ONNX Runtime rather than compile it (with
        `layout`, the compile pass's), or None to compile it."""
        return None

    @abstractmethod
    def variants(self, spec: Spec) -> tuple:
        """The variants the kernel ships with, most specialized first (docs/format.md,
        "Choosing a binary"); each has an `index` and a `requires()`."""

    @abstractmethod
    def generate(self, spec: Spec, variant) -> KernelSource:
        """The Triton source of one variant, and what `triton.compile` needs beside it."""

    @abstractmethod
    def kernel_meta(self, spec: Spec, variants: tuple, binaries: list[dict]) -> dict:
        """The node's `kernel_meta` object (docs/format.md) for these variants and binaries."""

    def ptx_arch(self, archs: list[int]) -> tuple[int, bool]:
        """The target whose PTX is embedded beside the cubins (of the compiled `archs`, in
        ascending order), and whether its `.target` is relaxed from sm_XXa to sm_XX so that
        newer GPUs JIT it (`onnxfuse.compile.portable_ptx`): the highest target's, relaxed."""
        return archs[-1], True

    def candidates(self, spec: Spec) -> list[tuple[str, tuple]]:
        """(label, variants) of each configuration `--tune` times, the heuristics' first."""
        return [("default", self.variants(spec))]

    # ---- TF32 rounding at the producer (onnxfuse.rounding) ------------------------------

    def reads_tf32(self, spec: Spec) -> bool:
        """The kernel rounds its input 0 to TF32 before it multiplies (so a producer may
        store it rounded for it)."""
        return False

    def may_store_tf32(self, spec: Spec) -> bool:
        """The kernel can store its output 0 rounded to TF32 (FusedNode.round_y)."""
        return False

    def tf32_initializers(self, f: FusedNode, spec: Spec) -> tuple[str, ...]:
        """Initializers the kernel reads rounded to TF32: the compile step rounds them."""
        return ()

    # ---- reference ---------------------------------------------------------------------

    @abstractmethod
    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """The node's outputs for these input values, computed in numpy from its inputs and
        attributes as docs/format.md defines them (not from its function body)."""


def env_config(var: str, cfg: dict, known: tuple[str, ...] | None = None) -> dict:
    """`cfg` updated from ``$var`` ("key=value,..."; integers, but `tile` a name): how the
    tuning experiments override a kind's launch configuration. An unknown key is an error
    naming the known ones (default: cfg's keys)."""
    known = tuple(cfg) if known is None else known
    for item in filter(None, os.environ.get(var, "").split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise OnnxfuseError(f"{var}: unknown key {key!r} (known: {', '.join(known)})")
        cfg[key] = value if key == "tile" else int(value)
    return cfg


def layout_attr(attrs: dict[str, Any], name: str, default: str, allowed: tuple[str, ...]) -> str:
    """A node's string layout attribute (`onnx.helper.get_attribute_value` values), checked."""
    v = attrs.get(name, default.encode())
    v = v.decode() if isinstance(v, bytes) else v
    if v not in allowed:
        raise ValueError(f"{name} is {v!r}, expected one of {', '.join(map(repr, allowed))}")
    return v
