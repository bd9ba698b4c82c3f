"""Convolution and max-pool parameters, shared by the matcher, the rewriter, the code
generators, the cost model and the tests: one frozen value each, with ONNX's output-size
rules (docs/format.md, "FusedConv" and "FusedMaxPool").

Only 2-D (NCHW) convolutions and pools are described here; `auto_pad` is resolved to
explicit pads when a value is built from a node (`conv_from_node`, `pool_from_node`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx import NodeProto, helper


@dataclass(frozen=True)
class ConvAttrs:
    """A 2-D convolution: weights [K, C/group, R, S], pads (top, left, bottom, right)."""

    kernel: tuple[int, int]  # (R, S)
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)
    group: int = 1

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        """(P, Q): the output's spatial size for an input of h x w."""
        (r, s), (sh, sw), (pt, pl, pb, pr), (dh, dw) = self.kernel, self.strides, self.pads, self.dilations
        return ((h + pt + pb - dh * (r - 1) - 1) // sh + 1, (w + pl + pr - dw * (s - 1) - 1) // sw + 1)

    def node_attrs(self) -> dict:
        """The attributes of an ONNX Conv node (and of FusedConv) with these parameters."""
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides), "pads": list(self.pads),
                "dilations": list(self.dilations), "group": self.group}


@dataclass(frozen=True)
class PoolAttrs:
    """A 2-D max pool; `pads` are (top, left, bottom, right)."""

    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)
    ceil_mode: bool = False

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        """(OH, OW) by ONNX MaxPool's rule; with ceil_mode, a window that would start in the
        bottom/right padding is dropped (as ONNX Runtime and PyTorch do)."""
        return (_pool_dim(h, self.kernel[0], self.strides[0], self.pads[0], self.pads[2], self.dilations[0],
                          self.ceil_mode),
                _pool_dim(w, self.kernel[1], self.strides[1], self.pads[1], self.pads[3], self.dilations[1],
                          self.ceil_mode))

    @property
    def tiles(self) -> bool:
        """Windows tile the input exactly where they land: kernel == stride, no padding, no
        dilation, floor mode. Such a pool can run inside a convolution's epilogue (each
        conv output belongs to at most one window)."""
        return (self.kernel == self.strides and self.pads == (0, 0, 0, 0) and self.dilations == (1, 1)
                and not self.ceil_mode)

    def node_attrs(self, prefix: str = "pool_") -> dict:
        """Attributes of a fused node (prefix "pool_") or of an ONNX MaxPool (prefix "")."""
        if prefix:
            return {f"{prefix}kernel": list(self.kernel), f"{prefix}strides": list(self.strides),
                    f"{prefix}pads": list(self.pads), f"{prefix}dilations": list(self.dilations),
                    f"{prefix}ceil_mode": int(self.ceil_mode)}
        return {"kernel_shape": list(self.kernel), "strides": list(self.strides), "pads": list(self.pads),
                "dilations": list(self.dilations), "ceil_mode": int(self.ceil_mode)}


def _pool_dim(n: int, k: int, s: int, p0: int, p1: int, d: int, ceil_mode: bool) -> int:
    span = n + p0 + p1 - d * (k - 1) - 1
    if not ceil_mode:
        return span // s + 1
    out = math.ceil(span / s) + 1
    if (out - 1) * s >= n + p0:  # the last window would start inside the end padding
        out -= 1
    return out


def _attrs(node: NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _same_pads(size: tuple[int, int], kernel, strides, dilations, upper: bool) -> tuple[int, int, int, int]:
    begin, end = [], []
    for n, k, s, d in zip(size, kernel, strides, dilations, strict=True):
        out = -(-n // s)
        total = max(0, (out - 1) * s + d * (k - 1) + 1 - n)
        small, big = total // 2, total - total // 2
        begin.append(small if upper else big)
        end.append(big if upper else small)
    return (begin[0], begin[1], end[0], end[1])


def _resolve_pads(a: dict, kernel, strides, dilations, spatial: tuple[int, int] | None) -> tuple | str:
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("NOTSET", ""):
        pads = tuple(a.get("pads", (0, 0, 0, 0)))
        return pads if len(pads) == 4 else "pads is not 4 numbers"
    if auto == "VALID":
        return (0, 0, 0, 0)
    if spatial is None or not all(isinstance(x, int) for x in spatial):
        return f"auto_pad {auto} with an unknown input size"
    return _same_pads(spatial, kernel, strides, dilations, upper=auto == "SAME_UPPER")


def _window(a: dict, kernel, spatial: tuple[int, int] | None) -> tuple | str:
    """(strides, pads, dilations) of a Conv or MaxPool node's attributes, or why not 2-D."""
    strides = tuple(a.get("strides", (1, 1)))
    dilations = tuple(a.get("dilations", (1, 1)))
    if len(strides) != 2 or len(dilations) != 2:
        return "strides or dilations are not 2 numbers"
    pads = _resolve_pads(a, kernel, strides, dilations, spatial)
    if isinstance(pads, str):
        return pads
    return strides, pads, dilations


def conv_from_node(node: NodeProto, weight_dims: tuple[int, ...],
                   spatial: tuple[int, int] | None) -> ConvAttrs | str:
    """The ConvAttrs of a Conv node with 4-D weights of `weight_dims`, or why it is not a
    2-D convolution onnxfuse handles. `spatial` is the input's (H, W) where known."""
    if len(weight_dims) != 4:
        return f"{len(weight_dims) - 2}-D convolution"
    a = _attrs(node)
    kernel = tuple(a.get("kernel_shape", weight_dims[2:]))
    if kernel != tuple(weight_dims[2:]):
        return "kernel_shape differs from the weights"
    window = _window(a, kernel, spatial)
    if isinstance(window, str):
        return window
    return ConvAttrs(kernel, *window, int(a.get("group", 1)))


def pool_from_node(node: NodeProto, spatial: tuple[int, int] | None) -> PoolAttrs | str:
    """The PoolAttrs of a 2-D MaxPool node, or why onnxfuse does not handle it."""
    a = _attrs(node)
    kernel = tuple(a.get("kernel_shape", ()))
    if len(kernel) != 2:
        return f"{len(kernel)}-D max pool"
    if len([o for o in node.output if o]) != 1:
        return "MaxPool's Indices output is used"
    if int(a.get("storage_order", 0)) != 0:
        return "MaxPool storage_order is not 0"
    window = _window(a, kernel, spatial)
    if isinstance(window, str):
        return window
    return PoolAttrs(kernel, *window, bool(a.get("ceil_mode", 0)))


def conv_from_fused(attrs: dict) -> ConvAttrs:
    """ConvAttrs from a FusedConv node's attributes (name -> value)."""
    return ConvAttrs(tuple(attrs["kernel_shape"]), tuple(attrs["strides"]), tuple(attrs["pads"]),
                     tuple(attrs["dilations"]), int(attrs["group"]))


def pool_from_fused(attrs: dict) -> PoolAttrs | None:
    """PoolAttrs from a FusedConv / FusedMaxPool node's pool_* attributes, None if absent."""
    if "pool_kernel" not in attrs:
        return None
    return PoolAttrs(tuple(attrs["pool_kernel"]), tuple(attrs["pool_strides"]), tuple(attrs["pool_pads"]),
                     tuple(attrs["pool_dilations"]), bool(attrs["pool_ceil_mode"]))
