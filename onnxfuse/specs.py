"""What to compile for a fused node: its kernel spec, from the node and the model."""

from __future__ import annotations

from onnxfuse.kinds import KINDS


def precision_of(f, conv_precision: str) -> str:
    """The precision FusedNode `f` multiplies float32 at: its own (`FusedNode.precision`, set
    by tuning), else the model's."""
    return f.precision or conv_precision


def kernel_spec(model, f, conv_precision: str = "tf32", weight_dims: dict | None = None):
    """What to compile for one FusedNode of `model`, as its kind specifies it
    (`onnxfuse.kinds.base.Kind.spec`), at the node's precision (`precision_of`). `weight_dims`
    (initializer name -> dims, built once by the caller) saves a search of the initializers per node."""
    return KINDS[f.kind].spec(model, f, precision_of(f, conv_precision), weight_dims)
