"""What to compile for a fused node: its kernel spec, from the node and the model."""

from __future__ import annotations

from onnxfuse import compile as aot
from onnxfuse.codegen_rows import RowsSpec


def kernel_spec(model, f, conv_precision: str = "tf32", weight_dims: dict | None = None):
    """What to compile for one FusedNode of `model`: a KernelSpec (pointwise), ConvSpec or
    MaxPoolSpec. C and K of a conv come from its packed weights ([R, S, C/group, K], or
    [K, R, S, C/group] with w_layout krsc);
    `weight_dims` (initializer name -> dims, built once by the caller) saves a search of the
    initializers per node."""
    if f.kind == "pointwise":
        return aot.KernelSpec(f.program, f.kernel_name, f.rank, f.input_modes, f.source_nodes)
    if f.kind == "conv":
        dims = (weight_dims[f.inputs[1]] if weight_dims is not None else
                tuple(next(t.dims for t in model.graph.initializer if t.name == f.inputs[1])))
        c, k = (dims[2], dims[3]) if f.w_layout == "rsck" else (dims[3], dims[0])
        return aot.ConvSpec(f.kernel_name, f.program, channels=int(c) * f.conv.group,
                            filters=int(k), conv=f.conv, pool=f.pool, precision=conv_precision,
                            source_nodes=f.source_nodes, x_layout=f.x_layout, y_layout=f.y_layout,
                            extra_layouts=f.extra_layouts, w_layout=f.w_layout,
                            x_rounded=f.x_rounded, round_y=f.round_y)
    if f.kind == "maxpool":
        return aot.MaxPoolSpec(f.kernel_name, f.program, pool=f.pool, source_nodes=f.source_nodes,
                               x_layout=f.x_layout, y_layout=f.y_layout)
    if f.kind == "rows":  # kind rows (issue 17): docs/format.md, FusedRows
        r = f.rows
        return RowsSpec(f.kernel_name, r.reduction, r.prologue, f.program, f.input_modes, r.axis, r.n_cols,
                        r.x_output, f.source_nodes)
    raise ValueError(f"unknown fused node kind {f.kind!r}")
