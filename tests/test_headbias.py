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
from tests.util import check_fusion, check_library, model, op_types

N = helper.make_node
B, S, H, D = 2, 5, 3, 8
E = H * D


def _rotary(rotation: str = "half", transpose: bool = True, bias_first: bool = False, bias_read: bool = False,
            dtype: str = "float32", dynamic: bool = False, partial: int = 0):
    """x [B, S, E] @ W + b -> Reshape [B, S, H, D] (-> Transpose [B, H, S, D]) -> q * cos +
    rotate(q) * sin, rotate_half (`rotation` "half") or GPT-J's interleaved rotate_every_two
    ("pairs"); `bias_first`: Add(b, p); `bias_read`: the biased product is a graph output too;
    `dynamic`: x's batch and sequence symbolic, the Reshape to [0, 0, H, D], cos and sin graph
    inputs of the symbolic sequence (as a dynamic export computes them from the positions);
    `partial` r: the rotary embedding of the first r columns alone, Concat(rotary(q[..., :r]),
    q[..., r:]) (Phi's, StableLM's)."""
    rng = np.random.default_rng(7)
    np_dt = np.float16 if dtype == "float16" else np.float32
    width = partial or D  # the columns rotated
    rot_shape = [S, width] if transpose else [S, 1, width]
    inits = {"w": (rng.standard_normal((E, E)) / 4).astype(np_dt), "b": rng.standard_normal(E).astype(np_dt),
             "heads": np.array([0, 0, H, D] if dynamic else [B, S, H, D], np.int64),
             "cos": np.cos(rng.standard_normal(rot_shape)).astype(np_dt),
             "sin": np.sin(rng.standard_normal(rot_shape)).astype(np_dt),
             "lo": np.array([0], np.int64), "mid": np.array([width // 2], np.int64),
             "end": np.array([width], np.int64), "all": np.array([D], np.int64),
             "last": np.array([-1], np.int64), "one": np.array([1], np.int64), "two": np.array([2], np.int64)}
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["b", "p"] if bias_first else ["p", "b"], ["a"]),
             N("Reshape", ["a", "heads"], ["r"])]
    if transpose:
        nodes.append(N("Transpose", ["r"], ["q"], perm=[0, 2, 1, 3]))
    q = "q" if transpose else "r"
    if partial:  # the columns rotated, and the rest
        nodes += [N("Slice", [q, "lo", "end", "last"], ["q_rot"]), N("Slice", [q, "end", "all", "last"], ["q_pass"])]
        q = "q_rot"
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
        inits["shape_q"] = np.array([B, H, S, width] if transpose else [B, S, H, width], np.int64)
    nodes += [N("Mul", [q, "cos"], ["qc"]), N("Mul", ["rot", "sin"], ["rs"]),
              N("Add", ["qc", "rs"], ["y_rot" if partial else "y"])]
    if partial:
        nodes.append(N("Concat", ["y_rot", "q_pass"], ["y"], axis=-1))
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


@pytest.mark.parametrize("rotation", ["half", "pairs"])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_partial_rotations_bias_is_cut_with_its_columns(rotation, transpose, dtype):
    """Partial rotary (the first 4 of 8 columns): the Add before the head split goes, each Slice
    of the split adds its columns of the bias, and one partial chain takes both in: the rotated
    columns' bias in its program, the others' as its last input, added beyond r (`partial` [r, k,
    j]). The same values in the function bodies, the numpy reference and the library's CPU
    kernel."""
    m = _rotary(rotation, transpose, dtype=dtype, partial=4)
    r = check_fusion(m, expect_fused=1)
    assert r.report.notes[NOTE] == 1
    assert op_types(r.model) == ["MatMul", "Reshape", "PointwiseChain"], op_types(r.model)
    (chain,) = [n for n in r.model.graph.node if n.op_type == "PointwiseChain"]
    attrs = {a.name: helper.get_attribute_value(a) for a in chain.attribute}
    assert list(attrs["partial"]) == [4, 0, len(chain.input) - 1], attrs["partial"]
    check_library(m, r.model, dtype)


def test_a_partial_split_read_elsewhere_keeps_its_bias():
    """A partial rotation's split that something other than a Slice of its last axis reads (here
    a graph output) keeps its Add: nothing moves."""
    m = _rotary(partial=4)
    m.graph.output.append(helper.make_tensor_value_info("q", m.graph.output[0].type.tensor_type.elem_type,
                                                         [B, H, S, D]))
    r = optimize_model(m)
    assert NOTE not in r.report.notes
    assert op_types(r.model).count("Add") == 1


def _packed(rotated: int = 2, partial: int = 0, flat: bool = False):
    """x [B, S, E] @ W [E, 3E] + b -> Split into three [B, S, E] parts (GPT-NeoX's query_key_value
    after onnxfuse.pack), each Reshape [B, S, H, D] -> Transpose [B, H, S, D]; the first `rotated`
    parts rotated (rotate_half, of the first `partial` columns when given), the others graph
    outputs as they are. `flat`: each part Reshape [B, S * H, D] instead, no Transpose (rotated
    alike, but not a head split of [..., N] to [..., H, D])."""
    rng = np.random.default_rng(3)
    width = partial or D
    inits = {"w": (rng.standard_normal((E, 3 * E)) / 4).astype(np.float32),
             "b": rng.standard_normal(3 * E).astype(np.float32), "sizes": np.array([E, E, E], np.int64),
             "heads": np.array([B, S * H, D] if flat else [B, S, H, D], np.int64),
             "cos": np.cos(rng.standard_normal((S * H if flat else S, width))).astype(np.float32),
             "sin": np.sin(rng.standard_normal((S * H if flat else S, width))).astype(np.float32),
             "lo": np.array([0], np.int64), "mid": np.array([width // 2], np.int64),
             "end": np.array([width], np.int64), "all": np.array([D], np.int64), "last": np.array([-1], np.int64)}
    nodes = [N("MatMul", ["x", "w"], ["p"]), N("Add", ["p", "b"], ["a"]),
             N("Split", ["a", "sizes"], ["s0", "s1", "s2"], axis=-1)]
    outputs = {}
    for k in range(3):
        if flat:
            nodes.append(N("Reshape", [f"s{k}", "heads"], [f"q{k}"]))
        else:
            nodes += [N("Reshape", [f"s{k}", "heads"], [f"r{k}"]),
                      N("Transpose", [f"r{k}"], [f"q{k}"], perm=[0, 2, 1, 3])]
        shape = [B, S * H, D] if flat else [B, H, S, D]
        if k >= rotated:
            outputs[f"q{k}"] = ("float32", shape)
            continue
        q = f"q{k}"
        if partial:
            nodes += [N("Slice", [q, "lo", "end", "last"], [f"qr{k}"]),
                      N("Slice", [q, "end", "all", "last"], [f"qp{k}"])]
            q = f"qr{k}"
        nodes += [N("Slice", [q, "mid", "end", "last"], [f"hi{k}"]), N("Slice", [q, "lo", "mid", "last"], [f"lh{k}"]),
                  N("Neg", [f"hi{k}"], [f"neg{k}"]), N("Concat", [f"neg{k}", f"lh{k}"], [f"rot{k}"], axis=-1),
                  N("Mul", [q, "cos"], [f"qc{k}"]), N("Mul", [f"rot{k}", "sin"], [f"rs{k}"]),
                  N("Add", [f"qc{k}", f"rs{k}"], [f"yr{k}" if partial else f"y{k}"])]
        if partial:
            nodes.append(N("Concat", [f"yr{k}", f"qp{k}"], [f"y{k}"], axis=-1))
        outputs[f"y{k}"] = ("float32", shape)
    return model(nodes, {"x": ("float32", [B, S, E])}, outputs, inits, opset=17)


@pytest.mark.parametrize("partial", [0, 4])
def test_a_packed_bias_is_cut_with_its_split(partial):
    """GPT-NeoX's packed query_key_value: the bias Add before the Split goes, each part adds its
    columns after it; Q's and K's then move into their rotary chains, V keeps an Add of its own
    third (here no attention takes it). The same values."""
    m = _packed(partial=partial)
    r = check_fusion(m, expect_fused=2)
    assert r.report.notes[NOTE] == 2
    ops = op_types(r.model)
    assert ops.count("Add") == 1 and ops.count("PointwiseChain") == 2, ops
    split = next(n for n in r.model.graph.node if n.op_type == "Split")
    assert split.input[0] == "p"  # the product itself
    (add,) = [n for n in r.model.graph.node if n.op_type == "Add"]
    assert add.output[0] == "s2"  # V's part, with its third of the bias


@pytest.mark.parametrize("case", ["two parts not rotated", "no head split"])
def test_a_packed_bias_stays_where_its_parts_would_keep_their_adds(case):
    """Cutting the bias where two of three parts would keep their Adds would leave more Adds than
    the one before the Split: nothing is cut, whether two parts are not rotated or the rotated
    ones' Reshapes are no head split that the move takes ([B, S, E] to [B, S * H, D])."""
    r = optimize_model(_packed(rotated=1) if case == "two parts not rotated" else _packed(flat=True))
    assert NOTE not in r.report.notes
    assert [n.op_type for n in r.model.graph.node[1:3]] == ["Add", "Split"], op_types(r.model)
