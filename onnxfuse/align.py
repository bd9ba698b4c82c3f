"""Products whose output rows are not a multiple of 16 bytes, padded for cuBLAS.

cuBLAS runs its fast tensor-core GEMMs only when every matrix's leading dimension is a multiple
of 16 bytes (8 fp16 / bf16 values, 4 fp32 ones); otherwise it falls back to kernels that load
and store one element at a time. A [K, N] weight of N columns not such a multiple makes both B's
and Y's leading dimension N: a language model's head over a vocabulary of 50257 tokens (GPT-2)
is one. On the H200 (onnxruntime-gpu 1.31.1, CUPTI) GPT-2-small's LM head, [1024, 768] x
[768, 50257] in fp16, took 620 us (127 TFLOP/s) where the model's other, aligned products ran at
430 TFLOP/s; at 128 rows 110 us (90 TFLOP/s). Training code pads such vocabularies (50304) for
the same reason; an exported model has the odd size baked in.

`pad_columns` gives such a product weights with zero columns (Gemm with transB: zero rows) up
to the next multiple of 16 bytes, and a Slice of the first N columns after it: the same products
and sums for every kept column (the padded columns are never read), one copy of the output more.
The padded weights are a new initializer; the original goes unless something else reads it (a
tied embedding's Gather: then the model holds both). Only where:
- the weights are a constant (a MatMul's 2-D B; a Gemm's B without C, alpha 1);
- the product is large enough for the copy to be repaid (MIN_FLOPS, from static shapes: a
  single-token decode step, M = 1, is not padded);
- no reader of the product is a pointwise op (that a GemmEpilogue or ONNX Runtime's fusions
  would take with the product; the Slice would stand between them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

from onnxfuse.graph import GraphView
from onnxfuse.ir import copy_and_namer, graph_reads
from onnxfuse.ops import RULES

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
ALIGN_BYTES = 16  # cuBLAS's requirement on leading dimensions for its tensor-core kernels
# 2 M N K of at least this: the aligned product takes >= ~2 us on an H200 at the measured
# 430 TFLOP/s (fp16), the unaligned one 3-5x that, and the Slice's copy of [M, N] ~1-3 us
MIN_FLOPS = 1e9


@dataclass(frozen=True)
class Padding:
    """One product to pad: its node, its output columns before and after padding, and whether
    its weights are [N, K] (a Gemm with transB: rows padded) rather than [K, N]."""

    node: int
    n: int
    padded: int
    trans_b: bool


def padding(view: GraphView, i: int) -> Padding | None:
    """How node i is padded, or None where it is not (module docstring)."""
    n = view.nodes[i]
    if n.domain not in ("", "ai.onnx") or n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
        return None
    trans_b = False
    if n.op_type == "Gemm":
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if (len(n.input) > 2 and n.input[2]) or a.get("alpha", 1.0) != 1.0 or a.get("transA", 0):
            return None
        trans_b = bool(a.get("transB", 0))
    w = view.constants.get(n.input[1])
    xs = view.shapes.get(n.input[0])
    if w is None or len(w.dims) != 2 or xs is None or not all(isinstance(d, int) for d in xs):
        return None
    cols, k = (int(w.dims[0]), int(w.dims[1])) if trans_b else (int(w.dims[1]), int(w.dims[0]))
    size = np.dtype(helper.tensor_dtype_to_np_dtype(w.data_type)).itemsize
    if w.data_type not in FLOAT_TYPES or (cols * size) % ALIGN_BYTES == 0:
        return None
    if 2 * int(np.prod(xs[:-1], dtype=np.int64)) * cols * k < MIN_FLOPS:
        return None
    out = n.output[0]
    if any(view.nodes[c].op_type in RULES for c in view.consumers.get(out, [])):
        return None
    step = ALIGN_BYTES // size
    return Padding(i, cols, -(-cols // step) * step, trans_b)


def pad_columns(model: ModelProto, view: GraphView) -> tuple[ModelProto, list[str]]:
    """`model` with each product of unaligned output rows padded (module docstring), and the
    padded nodes' names; the model itself when there are none. `view` indexes `model`."""
    pads = [p for i in range(len(view.nodes)) if (p := padding(view, i)) is not None]
    if not pads:
        return model, []
    out, fresh = copy_and_namer(model)
    g = out.graph
    after: dict[int, list] = {}
    for p in pads:
        node = g.node[p.node]
        stem = node.name or node.output[0]
        w = numpy_helper.to_array(view.constants[node.input[1]])
        widths = [(0, p.padded - p.n), (0, 0)] if p.trans_b else [(0, 0), (0, p.padded - p.n)]
        w_name, wide = fresh(f"{stem}.weight_padded"), fresh(f"{stem}.padded")
        starts, ends, axes = fresh(f"{stem}.slice_starts"), fresh(f"{stem}.slice_ends"), fresh(f"{stem}.slice_axes")
        g.initializer.extend([numpy_helper.from_array(np.pad(w, widths), w_name),
                              numpy_helper.from_array(np.array([0], np.int64), starts),
                              numpy_helper.from_array(np.array([p.n], np.int64), ends),
                              numpy_helper.from_array(np.array([-1], np.int64), axes)])
        y = node.output[0]
        node.input[1], node.output[0] = w_name, wide
        after[p.node] = [helper.make_node("Slice", [wide, starts, ends, axes], [y], name=fresh(f"{stem}.unpad"))]
    nodes = [m for j, n in enumerate(g.node) for m in (n, *after.get(j, ()))]
    del g.node[:]
    g.node.extend(nodes)
    replaced = {view.nodes[p.node].input[1] for p in pads}
    read = graph_reads(g)
    unread = replaced - read  # the original weights, where nothing else reads them
    kept = [t for t in g.initializer if t.name not in unread]
    del g.initializer[:]
    g.initializer.extend(kept)
    return out, [view.nodes[p.node].name or view.nodes[p.node].output[0] for p in pads]

