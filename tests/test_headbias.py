"""A projection's bias below its head split, into the rotary chain (onnxfuse.headbias): Qwen2's
query and key biases. The bias Add before the Reshape goes; the rotary chain adds the bias laid
out over the heads, and its rotation, itself; the fused model computes what the original does
(function bodies in stock ONNX Runtime, each node's numpy reference: tests.util.check_fusion)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.headbias import NOTE
from tests.util import check_fusion, model, op_types

N = helper.make_node
B, S, H, D = 2, 5, 3, 8
E = H * D


def _rotary(rotation: str = "half", transpose: bool = True, bias_first: bool = False, bias_read: bool = False,
            dtype: str = "float32", dynamic: bool = False):
    """x [B, S, E] @ W + b -> Reshape [B, S, H, D] (-> Transpose [B, H, S, D]) -> q * cos +
    rotate(q) * sin, rotate_half (`rotation` "half") or GPT-J's interleaved rotate_every_two
    ("pairs"); `bias_first`: Add(b, p); `bias_read`: the biased product is a graph output too;
    `dynamic`: x's batch and sequence symbolic, the Reshape to [0, 0, H, D], cos and sin graph
    inputs of the symbolic sequence (as a dynamic export computes them from the positions)."""
    rng = np.random.default_rng(7)
    np_dt = np.float16 if dtype == "float16" else np.float32
    rot_shape = [S, D] if transpose else [S, 1, D]
    inits = {"w": (rng.standard_normal((E, E)) / 4).astype(np_dt), "b": rng.standard_normal(E).astype(np_dt),
             "heads": np.array([0, 0, H, D] if dynamic else [B, S, H, D], np.int64),
             "cos": np.cos(rng.standard_normal(rot_shape)).astype(np_dt),
             "sin": np.sin(rng.standard_normal(rot_shape)).astype(np_dt),
             "lo": np.array([0], np.int64), "mid": np.array([D // 2], np.int64), "end": np.array([D], np.int64),
             "last": np.array([-1], np.int64), "one": np.array([1], np.int64), "two": np.array([2], np.int64)}
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["b", "p"] if bias_first else ["p", "b"], ["a"]),
             N("Reshape", ["a", "heads"], ["r"])]
    if transpose:
        nodes.append(N("Transpose", ["r"], ["q"], perm=[0, 2, 1, 3]))
    q = "q" if transpose else "r"
    if rotation == "half":
        nodes += [N("Slice", [q, "mid", "end", "last"], ["hi"]), N("Slice", [q, "lo", "mid", "last"], ["lo_half"]),
                  N("Neg", ["hi"], ["neg"]), N("Concat", ["neg", "lo_half"], ["rot"], axis=-1)]
    else:
        nodes += [N("Slice", [q, "one", "end", "last", "two"], ["odd"]),
                  N("Slice", [q, "lo", "end", "last", "two"], ["even"]),
                  N("Neg", ["odd"], ["neg"]),
                  N("Unsqueeze", ["neg", "last"], ["neg_u"]), N("Unsqueeze", ["even", "last"], ["even_u"]),
                  N("Concat", ["neg_u", "even_u"], ["pairs"], axis=4),
                  N("Reshape", ["pairs", "shape_q"], ["rot"])]
        inits["shape_q"] = np.array([B, H, S, D] if transpose else [B, S, H, D], np.int64)
    nodes += [N("Mul", [q, "cos"], ["qc"]), N("Mul", ["rot", "sin"], ["rs"]), N("Add", ["qc", "rs"], ["y"])]
    b, s = ("batch", "seq") if dynamic else (B, S)
    outputs = {"y": (dtype, [b, H, s, D] if transpose else [b, s, H, D])}
    if bias_read:
        outputs["a"] = (dtype, [b, s, E])
    inputs = {"x": (dtype, [b, s, E])}
    if dynamic:
        del inits["cos"], inits["sin"]
        inputs |= {w: (dtype, [s, D] if transpose else [s, 1, D]) for w in ("cos", "sin")}
    return model(nodes, inputs, outputs, inits, opset=17)


@pytest.mark.parametrize("rotation", ["half", "pairs"])
@pytest.mark.parametrize("transpose", [True, False])
def test_the_bias_joins_the_rotary_chain(rotation, transpose):
    """The Add before the head split goes: one chain adds the bias and the rotated bias, reading
    the product (through the Transpose) plainly and rotated; the same values."""
    m = _rotary(rotation, transpose)
    r = check_fusion(m, expect_fused=1)
    assert r.report.notes[NOTE] == 1
    assert op_types(r.model) == ["MatMul", "Reshape", "PointwiseChain"], op_types(r.model)
    (chain,) = [n for n in r.model.graph.node if n.op_type == "PointwiseChain"]
    attrs = {a.name for a in chain.attribute}
    assert ("rotate_half" if rotation == "half" else "rotate_pairs") in attrs
    assert ("transpose" in attrs) == transpose


def test_symbolic_batch_and_sequence():
    """A dynamic export's head split, Reshape to [0, 0, H, D] over symbolic batch and sequence:
    moved alike (the leading dims the same symbols); the same values at the export's shape."""
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((B, S, E)).astype(np.float32),
             "cos": np.cos(rng.standard_normal((S, D))).astype(np.float32),
             "sin": np.sin(rng.standard_normal((S, D))).astype(np.float32)}
    r = check_fusion(_rotary(dynamic=True), expect_fused=1, feeds=feeds)
    assert r.report.notes[NOTE] == 1
    assert op_types(r.model) == ["MatMul", "Reshape", "PointwiseChain"], op_types(r.model)


def test_bias_before_the_product_in_float16():
    """Add(b, p) (the exporter's operand order), float16: moved alike, within fp16 tolerance."""
    r = check_fusion(_rotary(bias_first=True, dtype="float16"), expect_fused=1)
    assert r.report.notes[NOTE] == 1
    assert "Add" not in op_types(r.model)


def test_a_bias_read_elsewhere_stays():
    """A biased product something else reads (here a graph output) keeps its Add: the rotary
    chain reads the head split as before."""
    r = optimize_model(_rotary(bias_read=True))
    assert NOTE not in r.report.notes
    assert op_types(r.model).count("Add") == 1
