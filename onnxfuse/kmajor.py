"""Float32 weights handed to cuBLAS K-major.

ONNX Runtime multiplies float32 products in TF32 by default (CUDA EP `use_tf32`). On Hopper a
TF32 tensor-core product (wgmma) reads both operands K-major from shared memory: only 16-bit
operands may be transposed there. An exported MatMul's constant weight W [K, N] is N-major,
and cuBLAS then runs it with an "nn" kernel that is much slower than the "tn" one it uses for
the same product with W stored transposed. Measured on an H100 (thirty-seventh session,
BENCHMARKS.md, Decisions, `kmajor-weights`; CUPTI, ORT 1.31.1): BERT-base's FFN1 at batch 8
(1024 x 768 x 3072) 29.3 µs as MatMul, 29.8 as Gemm, **21.1 as Gemm with the weight
transposed and transB = 1**; FFN2 (1024 x 3072 x 768) 24.0 / 24.2 / 19.9; float16 the same
within 5% either way (9.6 / 9.6 / 9.6, 11.3 / 11.3 / 10.8): 16-bit wgmma transposes in shared
memory. (Kernel times alone, no error measured; the models' errors are below.)

`kmajor_weights` rewrites the float32 products ONNX Runtime runs itself (not fused nodes, whose
GemmEpilogue packs its own weights K-major) so that cuBLAS gets that layout: a Gemm with a
constant W and transB = 0 reads a transposed copy of W with transB = 1; a MatMul of a constant
2-D W becomes that Gemm, between Reshapes to [M, K] and back where A has more than two dims
(static dims only); a MatMul whose B is Transpose(W^T) of a constant W^T (a weight stored
K-major: torch's dynamo export of a Linear, a GemmEpilogue's packed weight where tuning gave the
node back), which ORT would fold into an N-major copy, becomes the Gemm reading W^T itself.
The product is the same sum of the same TF32-rounded terms (cuBLAS rounds either operand
layout alike); only its kernel changes.

Whether it pays is measured where the tune pass runs: the tuned model with such products
rewritten (from MEASURED_MIN_FLOPS) is one more candidate (`onnxfuse.tune`), kept as any
candidate is (not slower than the original in either mode, through the accuracy gate, faster
than the model without it by more than the noise, by its best of plain and CUDA-graph runs).
Untuned, only products of at least MIN_FLOPS (2 M N K, M static) are rewritten: in BERT-base
fp32 on the H100 the rewrite took batch 8 from 1.491 to 1.287 ms under CUDA graphs and from
1.614 to 1.409 without them (max error against float64 0.0043 -> 0.0044, ORT's own 0.0041), but
batch 1 (M = 128, every product under 1 GFLOP) from 0.694 to 0.661 under graphs and from 0.943
to 1.092 *without* them (tuning's model timings; where that CPU-side cost comes from was not
measured). ``$ONNXFUSE_KMAJOR=0`` turns it off everywhere, ``=all`` drops the floors (the
candidate's, MEASURED_MIN_FLOPS, only spares tuning a model for products too small to matter).

Left as they are, so that none of ONNX Runtime's own fusions around a product is lost: a
MatMul read by an Add, Sub, Mul or Div (MatMul + Add into Gemm, SkipLayerNormalization's bias,
MatMul + scale into FusedMatMul) or whose A is a Transpose, Mul or Div (FusedMatMul); a weight
that another node, a subgraph or the graph's outputs read too (a tied embedding would be copied),
or that is also a graph input (the caller may feed another); A with symbolic dims (M unknown).
"""

from __future__ import annotations

import math
import os

import numpy as np
from onnx import ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.ir import copy_and_namer, graph_reads, subgraph_reads
from onnxfuse.ops import node_attrs

FLOAT = 1  # TensorProto.FLOAT
# ops whose reading a MatMul's output (or feeding its A) lets ONNX Runtime fuse it with them
_FUSING_READERS = frozenset({"Add", "Sub", "Mul", "Div"})
_FUSING_WRITERS = frozenset({"Transpose", "Mul", "Div"})
MIN_FLOPS = 1e9  # BERT-base's products at batch 8 (1.2-4.8 GFLOP) gained; at batch 1 (0.15-0.6) see above
# where tuning measures the rewrite, products below this are left out only to spare it a candidate
# for a CNN's classifier head (ResNet's 512 x 1000 at batch 16: 16 MFLOP, a few µs either way)
MEASURED_MIN_FLOPS = 1e8
# the report's note (Report.notes) on the products rewritten
NOTE = ("float32 products left to ONNX Runtime given their constant weights K-major (Gemm with transB 1), "
        "which cuBLAS's TF32 kernels read faster (onnxfuse.kmajor)")


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, int) and d > 0 for d in shape)


def _transposed_weight(b: str, producer: dict[str, NodeProto], inits: dict, readers: dict[str, int]) -> bool:
    """B is Transpose(W^T) of a constant 2-D W^T, neither read elsewhere (a MatMul weight
    stored K-major: torch's dynamo export of a Linear, or a GemmEpilogue's packed weight where
    tuning gave the node back), which ONNX Runtime would fold into an N-major copy."""
    t = producer.get(b)
    if t is None or t.op_type != "Transpose" or t.domain not in ("", "ai.onnx") or readers.get(b, 0) != 1:
        return False
    w = inits.get(t.input[0])
    perm = list(node_attrs(t).get("perm", [1, 0]))
    return w is not None and len(w.dims) == 2 and perm == [1, 0] and readers.get(w.name, 0) == 1


def kmajor_weights(model: ModelProto, shapes: dict[str, tuple], measured: bool = False
                   ) -> tuple[ModelProto, list[str]]:
    """`model` with its float32 MatMul / Gemm products over constant weights given those
    weights K-major (module notes), and the names of the nodes rewritten. `shapes`: tensor ->
    (dims, elem_type) as the pipeline inferred them (`Result.shapes`); `measured`: for tuning's
    candidate (products from MEASURED_MIN_FLOPS, not MIN_FLOPS; none left out with
    ``$ONNXFUSE_KMAJOR=all``). The model given is not changed; where nothing applies it is
    returned as it is."""
    mode = os.environ.get("ONNXFUSE_KMAJOR", "")
    if mode == "0":
        return model, []
    min_flops = 0.0 if mode == "all" else MEASURED_MIN_FLOPS if measured else MIN_FLOPS
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    # a subgraph's read, a graph output or a graph input of the same name (a default the caller
    # may override) also counts as a reader
    for x in (subgraph_reads(g.node) | {o.name for o in g.output} | {i.name for i in g.input}):
        readers[x] = readers.get(x, 0) + 1
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)

    plan: dict[int, tuple[str, int, int]] = {}  # node index -> (how: "gemm", "matmul" or "matmul_t"; K; N)
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2:
            continue
        w = inits.get(n.input[1])
        kmajor_already = (w is None and n.op_type == "MatMul"
                          and _transposed_weight(n.input[1], producer, inits, readers))
        if kmajor_already:  # B = Transpose(W^T): W^T is the K-major weight
            w = inits[producer[n.input[1]].input[0]]
        if w is None or w.data_type != FLOAT or len(w.dims) != 2 or readers.get(w.name, 0) != 1:
            continue
        a_shape, a_type = shapes.get(n.input[0], (None, 0))
        if a_type != FLOAT or a_shape is None or len(a_shape) < 2 or not _static(a_shape):
            continue
        attrs = node_attrs(n)
        rows = a_shape[-1] if n.op_type == "Gemm" and attrs.get("transA", 0) else math.prod(a_shape[:-1])
        dims = [int(d) for d in w.dims]
        k, width = dims[::-1] if kmajor_already else dims
        if 2 * rows * k * width < min_flops:
            continue
        if n.op_type == "Gemm":
            if not attrs.get("transB", 0):
                plan[i] = ("gemm", k, width)
            continue
        a_writer = producer.get(n.input[0])
        if a_writer is not None and a_writer.op_type in _FUSING_WRITERS:
            continue
        if any(c.op_type in _FUSING_READERS for c in consumers.get(n.output[0], ())):
            continue
        plan[i] = ("matmul_t" if kmajor_already else "matmul", k, width)
    if not plan:
        return model, []

    out, fresh = copy_and_namer(model)
    g = out.graph
    replace: dict[int, list[NodeProto]] = {}
    done: list[str] = []
    transposes: set[str] = set()  # the Transposes whose input a "matmul_t" product reads directly
    for i, (how, k, width) in plan.items():
        n = g.node[i]
        stem = n.name or n.output[0]
        done.append(n.name or n.output[0])
        if how == "matmul_t":
            wt = producer[n.input[1]].input[0]
            transposes.add(n.input[1])
        else:
            wt = fresh(f"{n.input[1]}.kmajor")
            w = numpy_helper.to_array(inits[n.input[1]])
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), wt))
        if how == "gemm":
            m = NodeProto()
            m.CopyFrom(n)
            m.input[1] = wt
            del m.attribute[:]
            m.attribute.extend(a for a in n.attribute if a.name != "transB")
            m.attribute.append(helper.make_attribute("transB", 1))
            replace[i] = [m]
            continue
        a_shape = shapes[n.input[0]][0]
        if len(a_shape) == 2:
            replace[i] = [helper.make_node("Gemm", [n.input[0], wt], list(n.output), name=n.name or None, transB=1)]
            continue
        rows, product = fresh(f"{stem}.kmajor_rows"), fresh(f"{stem}.kmajor_product")
        shape_in, shape_out = fresh(f"{stem}.kmajor_rows_shape"), fresh(f"{stem}.kmajor_out_shape")
        g.initializer.append(numpy_helper.from_array(np.array([-1, k], np.int64), shape_in))
        g.initializer.append(numpy_helper.from_array(np.array([*a_shape[:-1], width], np.int64), shape_out))
        replace[i] = [helper.make_node("Reshape", [n.input[0], shape_in], [rows], name=fresh(f"{stem}.kmajor_flatten")),
                      helper.make_node("Gemm", [rows, wt], [product], name=n.name or fresh(f"{stem}.kmajor_gemm"),
                                       transB=1),
                      helper.make_node("Reshape", [product, shape_out], list(n.output),
                                       name=fresh(f"{stem}.kmajor_unflatten"))]
    kept: list[NodeProto] = []
    for i, n in enumerate(g.node):
        if not (n.op_type == "Transpose" and n.output[0] in transposes):
            kept += replace.get(i, [n])
    del g.node[:]
    g.node.extend(kept)
    gone = {model.graph.node[i].input[1] for i, (how, _, _) in plan.items() if how != "matmul_t"} - graph_reads(g)
    alive = [t for t in g.initializer if t.name not in gone]
    del g.initializer[:]
    g.initializer.extend(alive)
    return out, done
