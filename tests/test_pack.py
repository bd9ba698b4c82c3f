"""Packing an attention's Q, K and V projections (onnxfuse.pack): three MatMuls of one input
(with their bias Adds) become one over the concatenated weights and a Split, which the
attention absorbs (its split_q / split_k / split_v): no Split, no Transpose and one MatMul
left; the fused model computes what the original does (function bodies in stock ONNX Runtime,
and each node's numpy reference: tests.util.check_fusion)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.pipeline import PACKED
from tests.test_attention_patterns import PATTERNS
from tests.util import check_fusion, model, op_types

N = helper.make_node
B, S, H, D = 2, 6, 2, 8
E = H * D


def _bert_attention(bias: bool = True, cross: bool = False, opset: int = 17):
    """x [B, S, E] -> q, k, v projections (k and v of `mem` when cross) -> heads -> attention."""
    rng = np.random.default_rng(3)
    inits = {"shape": np.array([B, S, H, D], np.int64), "scale": np.array(np.sqrt(D), np.float32)}
    nodes = []
    for w in "qkv":
        src = "mem" if cross and w != "q" else "x"
        inits[f"w{w}"] = (rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32)
        nodes.append(N("MatMul", [src, f"w{w}"], [f"{w}p" if bias else f"{w}b"]))
        if bias:
            inits[f"b{w}"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
            nodes.append(N("Add", [f"b{w}", f"{w}p"], [f"{w}b"]))  # torch writes the bias first
        nodes.append(N("Reshape", [f"{w}b", "shape"], [f"{w}4"]))
    nodes += [N("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]), N("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              N("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]), N("MatMul", ["qh", "kt"], ["s"]),
              N("Div", ["s", "scale"], ["t"]), N("Softmax", ["t"], ["p"], axis=-1), N("MatMul", ["p", "vh"], ["o"]),
              N("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3])]
    inputs = {"x": ("float32", [B, S, E])}
    if cross:
        inputs["mem"] = ("float32", [B, S, E])
    return model(nodes, inputs, {"y": ("float32", [B, S, H, D])}, inits, opset=opset)


def test_projections_packed_and_read_in_place():
    m = _bert_attention()
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    ops = op_types(r.model)
    assert ops.count("MatMul") == 1 and ops.count("Add") == 1 and ops.count("FusedAttention") == 1, ops
    assert "Split" not in ops and "Transpose" not in ops and "Reshape" not in ops, ops
    node = next(n for n in r.model.graph.node if n.op_type == "FusedAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert len(set(node.input[:3])) == 1  # Q, K and V: one packed tensor
    assert [attrs[f"split_{w}"] for w in "qkv"] == [[0, H, D], [E, H, D], [2 * E, H, D]]
    assert r.report.notes.get(PACKED) == 1
    # the three weights and biases are gone; one packed copy of each is there
    inits = {t.name: t for t in r.model.graph.initializer}
    assert not {"wq", "wk", "wv", "bq", "bk", "bv"} & set(inits)
    assert sorted(tuple(t.dims) for t in inits.values() if len(t.dims) == 2) == [(E, 3 * E)]


def test_without_bias_and_at_opset_11():
    for bias, opset in ((False, 17), (True, 11)):
        m = _bert_attention(bias=bias, opset=opset)
        r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
        assert op_types(r.model).count("MatMul") == 1 and "Split" not in op_types(r.model), (bias, opset)


def test_cross_attention_is_not_packed():
    """Q from one input, K and V from another: nothing to pack; the attention still fuses."""
    m = _bert_attention(cross=True)
    r = check_fusion(m, expect_fused=1, patterns=PATTERNS)
    assert op_types(r.model).count("MatMul") == 3 and PACKED not in r.report.notes


def test_nothing_packed_without_the_attention_pattern():
    m = _bert_attention()
    r = optimize_model(m, [p for p in PATTERNS if p.name != "attention"])
    assert op_types(r.model).count("MatMul") == 5 and PACKED not in r.report.notes
