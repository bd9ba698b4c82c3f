"""What to compile for a fused node: its kernel spec, from the node and the model."""

from __future__ import annotations

from onnxfuse.kinds import KINDS


def kernel_spec(model, f, conv_precision: str = "tf32", weight_dims: dict | None = None):
    """What to compile for one FusedNode of `model`, as its kind specifies it
    (`onnxfuse.kinds.base.Kind.spec`). `weight_dims` (initializer name -> dims, built once
    by the caller) saves a search of the initializers per node."""
    return KINDS[f.kind].spec(model, f, conv_precision, weight_dims)
