"""FusedAttention in the custom-op library's CPU kernel (csrc/kinds/attention_cpu.cc): nodes built
by hand (docs/format.md, FusedAttention: the base tensors of Q, K^T and V with their perms, the
score program, a model-local function whose body is the original subgraph) run with the library
against the same model without it (ONNX Runtime inlines the function body) and against a numpy
float64 reference of the node contract (one rounding of the scores to Q's dtype, the program's
rounding, the probabilities rounded to V's dtype, one rounding at the store).

Cases: BERT's perms (heads made by Transposes of [B, S, H, D] tensors, Y stored back as
[B, S, H, Dv]), identity perms at rank 4 and rank 3, Dv != D, an additive [B, 1, 1, Sk] mask
after a Div by the scale, GPT-2's bool causal mask [1, 1, S, S] with Where, K and V broadcast
along a leading dim, f32 and f16, Sk = 0, a row of -inf (NaN, as ONNX's Softmax gives), float32
tensors standing for f16 ones; split_q / split_k / split_v (operands read in place from a packed
input): GPT-2's X [B, S, 3 * H * D] as one tensor fed to inputs 0, 1 and 2 (the body's one
Split(axis=-1) and Reshapes; f32 and f16), each third at its offset, V alone packed, rank 3 (X
rank 2), the rank from a split when no perm is given; the packed projection's bias (bias_q,
bias_k, bias_v: the body's Add before the Split; f32 and f16, rank 3); and one-line errors for a
perm that is not a permutation, mismatched D, an extra that does not broadcast, a split past X's
last dim, of the wrong length, with zero heads, and on an input of the wrong rank, a bias of the
wrong shape or dtype, without its split, among the extras, or whose split's heads are not H.

Tolerances: fp32 1e-5 of the output's scale, fp16 1e-2."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.expr import Program, evaluate

ort = pytest.importorskip("onnxruntime")
N = helper.make_node
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2}
ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
        np.dtype(np.bool_): TensorProto.BOOL}
PD = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.bool_): "bool"}
BERT = {"perm_q": (0, 2, 1, 3), "perm_k": (0, 2, 3, 1), "perm_v": (0, 2, 1, 3), "perm_y": (0, 2, 1, 3)}


@pytest.fixture(scope="module")
def lib() -> str:
    from onnxfuse import runtime

    return runtime.library_path()


def session(m: onnx.ModelProto, lib: str | None):
    so = ort.SessionOptions()
    if lib:
        so.register_custom_ops_library(lib)
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(m: onnx.ModelProto, feeds: dict, lib: str | None = None) -> np.ndarray:
    return session(m, lib).run(None, feeds)[0]


# ---------------------------------------------------------------------------------------
# building the node
# ---------------------------------------------------------------------------------------

def score_program(dtype, extras, body: list[str], out: int, out_dtype=None) -> str:
    """The score program: %0 the scores (Q's dtype), %1.. the extras; `body` its instructions."""
    lines = ["onnxfuse.pointwise v1", f"input %0 {PD[np.dtype(dtype)]}"]
    lines += [f"input %{i + 1} {PD[np.dtype(e.dtype)]}" for i, e in enumerate(extras)]
    lines += body
    lines.append(f"output %{out} {PD[np.dtype(out_dtype or dtype)]}")
    return "\n".join(lines) + "\n"


def split_nodes(arrays, splits: dict, shared: bool, bias: bool = False) -> tuple[list, list[str]]:
    """The function body's nodes that make each operand's base tensor from its formal input
    ("q", "k", "v"), and the three base tensors' names. shared (inputs 0, 1, 2 one tensor X, all
    split, X's last dim their concatenation in order): GPT-2's one Split(axis=-1) of "q" (of
    Add("q", "b") with `bias`: the packed projection's bias) and a Reshape per operand; otherwise
    a Slice on the last axis and a Reshape per split operand."""
    nodes, names = [], []
    keys = ("split_q", "split_k", "split_v")
    if shared:
        offs = [splits[key][0] for key in keys]
        sizes = [splits[key][1] * splits[key][2] for key in keys]
        assert offs == [0, sizes[0], sizes[0] + sizes[1]] and sum(sizes) == arrays[0].shape[-1], (offs, sizes)
        if bias:
            nodes.append(N("Add", ["q", "b"], ["q_biased"]))
        nodes += [N("Constant", [], ["sizes"], value=numpy_helper.from_array(np.array(sizes, np.int64))),
                  N("Split", ["q_biased" if bias else "q", "sizes"], ["q_p", "k_p", "v_p"], axis=-1)]
    for name, key, x in zip("qkv", keys, arrays, strict=True):
        if key not in splits:
            names.append(name)
            continue
        off, heads, hd = splits[key]
        if not shared:
            nodes += [N("Constant", [], [f"{name}_st"], value=numpy_helper.from_array(np.array([off], np.int64))),
                      N("Constant", [], [f"{name}_en"],
                        value=numpy_helper.from_array(np.array([off + heads * hd], np.int64))),
                      N("Constant", [], [f"{name}_ax"], value=numpy_helper.from_array(np.array([-1], np.int64))),
                      N("Slice", [name, f"{name}_st", f"{name}_en", f"{name}_ax"], [f"{name}_p"])]
        shape = np.array([0] * (x.ndim - 1) + [heads, hd], np.int64)
        nodes += [N("Constant", [], [f"{name}_sh"], value=numpy_helper.from_array(shape)),
                  N("Reshape", [f"{name}_p", f"{name}_sh"], [f"{name}_r"])]
        names.append(f"{name}_r")
    return nodes, names


def attention_model(q, k, v, extras: list[np.ndarray], program: str, score_nodes, perms: dict,
                    dyn: bool = False, y_type=None, splits: dict | None = None,
                    shared: bool = False, bias: np.ndarray | None = None, kv_group: int = 1) -> onnx.ModelProto:
    """A FusedAttention node over graph inputs q, k, v, e0, e1, ... and its function body: the
    Transposes, MatMul, the score nodes (from "s" and "e<i>" to "z"), Softmax, MatMul, the output
    Transpose. dyn: the graph inputs' dims are symbolic (no static shape inference). splits:
    split_q / split_k / split_v ([offset, heads, head_dim]; q, k, v then the packed inputs, the
    body Slices or Splits them and Reshapes, split_nodes). shared: q, k and v are one tensor, the
    graph input "x" fed to inputs 0, 1 and 2; with `bias` (shared only) the graph input "b", the
    node's last input, added to it before the split (bias_q = bias_k = bias_v). kv_group > 1: K
    and V have H / kv_group heads, repeated in the body (Unsqueeze, Expand, Reshape; rank 4)."""
    splits = splits or {}
    assert bias is None or shared
    r = q.ndim + ("split_q" in splits)
    full = {p: tuple(perms.get(p, range(r))) for p in ("perm_q", "perm_k", "perm_v", "perm_y")}
    formal = ["q", "k", "v", *(f"e{i}" for i in range(len(extras))), *(["b"] if bias is not None else [])]
    names = ["x", "x", "x", *formal[3:]] if shared else formal
    arrays = [q, k, v, *extras, *([bias] if bias is not None else [])]
    made, (qn, kn, vn) = split_nodes(arrays[:3], splits, shared, bias is not None)
    repeat = []
    if kv_group > 1:  # Hugging Face's repeat_kv on the logical K^T and V
        for x, perm in (("kt", full["perm_k"]), ("vt", full["perm_v"])):
            b_, h_, m_, n_ = (arrays[1 if x == "kt" else 2].shape[i] for i in perm)
            consts = {"axes": [2], "shape5": [b_, h_, kv_group, m_, n_], "shape4": [b_, h_ * kv_group, m_, n_]}
            repeat += [N("Constant", [], [f"{x}_{c}"], value=numpy_helper.from_array(np.array(v_, np.int64)))
                       for c, v_ in consts.items()]
            repeat += [N("Unsqueeze", [f"{x}0", f"{x}_axes"], [f"{x}1"]),
                       N("Expand", [f"{x}1", f"{x}_shape5"], [f"{x}2"]),
                       N("Reshape", [f"{x}2", f"{x}_shape4"], [x])]
    g0 = "0" if kv_group > 1 else ""
    body = [*made,
            N("Transpose", [qn], ["qt"], perm=list(full["perm_q"])),
            N("Transpose", [kn], [f"kt{g0}"], perm=list(full["perm_k"])),
            N("Transpose", [vn], [f"vt{g0}"], perm=list(full["perm_v"])), *repeat,
            N("MatMul", ["qt", "kt"], ["s"]), *score_nodes(),
            N("Softmax", ["z"], ["p"], axis=-1), N("MatMul", ["p", "vt"], ["yl"]),
            N("Transpose", ["yl"], ["y"], perm=list(full["perm_y"]))]
    overload = "onnxfuse_attention_test"
    fn = helper.make_function("onnxfuse", "FusedAttention", formal, ["y"], body, [helper.make_opsetid("", 20)])
    fn.overload = overload
    attrs = {k_: list(v_) for k_, v_ in {**perms, **splits}.items()}
    if kv_group > 1:
        attrs["kv_group"] = kv_group
    if bias is not None:
        attrs.update({f"bias_{w}": 3 + len(extras) for w in "qkv"})
    node = N("FusedAttention", names, ["y"], domain="onnxfuse", name="attn", program=program, **attrs)
    node.overload = overload
    graph_inputs = dict(zip(names, arrays, strict=True))  # "x" once when shared
    inputs = [helper.make_tensor_value_info(n, ONNX[a.dtype],
                                            [f"{n}_{i}" for i in range(a.ndim)] if dyn else list(a.shape))
              for n, a in graph_inputs.items()]
    ref = reference(q, k, v, extras, program, perms, splits=splits, bias=bias, kv_group=kv_group)
    out = helper.make_tensor_value_info("y", y_type or ONNX[q.dtype], None if dyn else list(ref.shape))
    g = helper.make_graph([node], "attention", inputs, [out])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("onnxfuse", 1)],
                          functions=[fn])
    m.ir_version = 10
    return m


def unpack(x: np.ndarray, split) -> np.ndarray:
    """An operand's base tensor from its packed input X: X[..., offset : offset + heads *
    head_dim] reshaped to [X's leading dims..., heads, head_dim]."""
    off, heads, hd = split
    assert off + heads * hd <= x.shape[-1]
    return x[..., off:off + heads * hd].reshape(*x.shape[:-1], heads, hd)


def reference(q, k, v, extras, program: str, perms: dict, dtype=None, splits: dict | None = None,
              bias: np.ndarray | None = None, kv_group: int = 1) -> np.ndarray:
    """The node contract in numpy: float64 sums, the roundings of the original's stores; splits:
    q, k, v are the packed inputs of the operands split_q / split_k / split_v name (unpack);
    bias: added to each packed input first, the sum rounded to its dtype (the original's Add)."""
    splits = splits or {}
    dtype = np.dtype(dtype or q.dtype)
    if bias is not None:
        q, k, v = ((x.astype(np.float64) + bias.astype(np.float64)).astype(x.dtype) for x in (q, k, v))
    q, k, v = (unpack(x, splits[key]) if key in splits else x
               for x, key in zip((q, k, v), ("split_q", "split_k", "split_v"), strict=True))
    r = q.ndim

    def t(x, p):
        return np.transpose(x.astype(np.float64), perms.get(p, tuple(range(r))))

    lk, lv = t(k, "perm_k"), t(v, "perm_v")
    if kv_group > 1:  # query head j reads K's and V's head j // kv_group
        lk, lv = np.repeat(lk, kv_group, axis=1), np.repeat(lv, kv_group, axis=1)
    s = (t(q, "perm_q") @ lk).astype(dtype)
    (z,) = evaluate(Program.from_text(program), [s, *extras])
    z = z.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(axis=-1, keepdims=True, initial=-np.inf))
        p = (e / e.sum(axis=-1, keepdims=True)).astype(dtype).astype(np.float64)
    y = (p @ lv).astype(dtype)
    return np.transpose(y, perms.get("perm_y", tuple(range(r))))


def _x(shape, dtype=np.float32, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    tol = TOL[want.dtype]
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = float(np.nanmax(np.abs(w), initial=1.0))
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True, err_msg=what)


def check(lib, q, k, v, extras, program, score_nodes, perms, against_ort=True, splits=None, shared=False,
          bias=None, kv_group=1):
    m = attention_model(q, k, v, extras, program, score_nodes, perms, splits=splits, shared=shared, bias=bias,
                        kv_group=kv_group)
    names = ["x", "x", "x"] if shared else ["q", "k", "v"]
    feeds = dict(zip([*names, *(f"e{i}" for i in range(len(extras)))], [q, k, v, *extras], strict=True))
    if bias is not None:
        feeds["b"] = bias
    got = run(m, feeds, lib)
    _close(got, reference(q, k, v, extras, program, perms, splits=splits, bias=bias, kv_group=kv_group),
           "library against the numpy reference")
    if against_ort:
        _close(got, run(m, feeds), "library against the function body in ONNX Runtime")
    return got


# score programs and their nodes

def scale_only(scale: float):
    return (lambda dt: score_program(dt, [], [f"%1 = mul %0 {scale!r}"], 1),
            lambda dt: lambda: [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array(scale, dt))),
                                N("Mul", ["s", "c"], ["z"])])


def div_add_mask(scale: float):
    """BERT: scores / sqrt(D) + mask (an additive [B, 1, 1, Sk] mask)."""
    return (lambda dt, mask: score_program(dt, [mask], [f"%2 = div %0 {scale!r}", "%3 = add %2 %1"], 3),
            lambda dt: lambda: [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array(scale, dt))),
                                N("Div", ["s", "c"], ["sd"]), N("Add", ["sd", "e0"], ["z"])])


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bert_perms_with_additive_mask(lib, dtype):
    b, s, h, d = 2, 7, 3, 16
    q, k, v = _x((b, s, h, d), dtype, 1), _x((b, s, h, d), dtype, 2), _x((b, s, h, d), dtype, 3)
    mask = np.zeros((b, 1, 1, s), dtype)
    mask[1, ..., 5:] = -10000.0
    prog, nodes = div_add_mask(4.0)
    check(lib, q, k, v, [mask], prog(dtype, mask), nodes(dtype), BERT)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_identity_perms_rank4(lib, dtype):
    q, k, v = _x((2, 3, 5, 8), dtype, 1), _x((2, 3, 8, 6), dtype, 2), _x((2, 3, 6, 8), dtype, 3)
    prog, nodes = scale_only(0.35)
    check(lib, q, k, v, [], prog(dtype), nodes(dtype), {})


def test_identity_perms_rank3(lib):
    q, k, v = _x((4, 5, 8), seed=1), _x((4, 8, 9), seed=2), _x((4, 9, 8), seed=3)
    prog, nodes = scale_only(0.5)
    check(lib, q, k, v, [], prog(np.float32), nodes(np.float32), {})


def test_rank3_with_perms_and_dv_not_d(lib):
    """Rank 3 (B = 1, H the one dim): Q base [Sq, H, D] perm (1, 0, 2), K base [Sk, H, D] perm
    (1, 2, 0), V [H, Sk, Dv], Y stored [Sq, H, Dv]."""
    q, k, v = _x((6, 4, 8), seed=1), _x((9, 4, 8), seed=2), _x((4, 9, 5), seed=3)
    perms = {"perm_q": (1, 0, 2), "perm_k": (1, 2, 0), "perm_y": (1, 0, 2)}
    prog, nodes = scale_only(0.3)
    y = check(lib, q, k, v, [], prog(np.float32), nodes(np.float32), perms)
    assert y.shape == (6, 4, 5)


def test_perms_that_are_not_their_own_inverse(lib):
    """perm_q (1, 2, 0, 3), perm_k (2, 3, 1, 0), perm_v (3, 0, 2, 1), perm_y (2, 0, 3, 1): every
    operand read, and Y written, through the inverse mapping of its perm."""
    perms = {"perm_q": (1, 2, 0, 3), "perm_k": (2, 3, 1, 0), "perm_v": (3, 0, 2, 1), "perm_y": (2, 0, 3, 1)}
    b, h, sq, sk, d, dv = 2, 3, 5, 6, 8, 7

    def base(logical, perm, seed):  # a base tensor whose Transpose(perm) is `logical`
        return np.ascontiguousarray(np.transpose(_x(logical, seed=seed), np.argsort(perm)))

    q = base((b, h, sq, d), perms["perm_q"], 1)
    k = base((b, h, d, sk), perms["perm_k"], 2)
    v = base((b, h, sk, dv), perms["perm_v"], 3)
    prog, nodes = scale_only(0.35)
    y = check(lib, q, k, v, [], prog(np.float32), nodes(np.float32), perms)
    assert y.shape == tuple(np.array([b, h, sq, dv])[list(perms["perm_y"])])


def test_bert_dv_not_d(lib):
    b, s, h = 2, 9, 2
    q, k, v = _x((b, s, h, 16), seed=1), _x((b, s, h, 16), seed=2), _x((b, s, h, 12), seed=3)
    mask = np.where(_x((b, 1, 1, s), seed=4) > 0.5, -10000.0, 0.0).astype(np.float32)
    prog, nodes = div_add_mask(4.0)
    y = check(lib, q, k, v, [mask], prog(np.float32, mask), nodes(np.float32), BERT)
    assert y.shape == (b, s, h, 12)


def _gpt2_scores(dtype, s: int):
    """GPT-2's causal mask [1, 1, S, S], its score program (/ sqrt(8), Where(mask, scores, -10000))
    and the function body's score nodes."""
    causal = np.tril(np.ones((s, s), np.bool_))[None, None]
    prog = score_program(dtype, [causal], ["%2 = div %0 2.8284270763397217", "%3 = select %1 %2 -10000.0"], 3)

    def nodes():
        return [N("Constant", [], ["c"], value=numpy_helper.from_array(np.array(2.8284270763397217, dtype))),
                N("Constant", [], ["big"], value=numpy_helper.from_array(np.array(-10000.0, dtype))),
                N("Div", ["s", "c"], ["sd"]), N("Where", ["e0", "sd", "big"], ["z"])]
    return causal, prog, nodes


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpt2_causal_bool_mask_with_where(lib, dtype):
    """GPT-2: scores / sqrt(D), then Where(causal [1, 1, S, S] bool, scores, -10000)."""
    b, s, h, d = 2, 8, 2, 8
    q, k, v = _x((b, s, h, d), dtype, 1), _x((b, s, h, d), dtype, 2), _x((b, s, h, d), dtype, 3)
    causal, prog, nodes = _gpt2_scores(dtype, s)

    check(lib, q, k, v, [causal], prog, nodes, BERT)


def test_broadcast_leading_dims(lib):
    """K^T with H = 1 and V with B = 1 against Q's [B, H]: stride 0 on those dims."""
    q, k, v = _x((2, 3, 5, 8), seed=1), _x((2, 1, 8, 6), seed=2), _x((1, 3, 6, 8), seed=3)
    prog, nodes = scale_only(0.35)
    y = check(lib, q, k, v, [], prog(np.float32), nodes(np.float32), {})
    assert y.shape == (2, 3, 5, 8)


def test_multi_query_bert_layout(lib):
    """Q base [B, S, H, D] with BERT's perms; K and V with one head ([B, S, 1, D])."""
    q, k, v = _x((2, 6, 4, 8), seed=1), _x((2, 7, 1, 8), seed=2), _x((2, 7, 1, 8), seed=3)
    prog, nodes = scale_only(0.35)
    y = check(lib, q, k, v, [], prog(np.float32), nodes(np.float32), BERT)
    assert y.shape == (2, 6, 4, 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_grouped_query_heads(lib, dtype):
    """kv_group 3: Q with 6 heads, K and V with 2 ([B, S, H, D] bases, BERT's perms), query head j
    reading K's and V's head j // 3; against the reference and the body's repeat_kv in ORT."""
    q, k, v = _x((2, 5, 6, 8), dtype, 1), _x((2, 7, 2, 8), dtype, 2), _x((2, 7, 2, 8), dtype, 3)
    prog, nodes = scale_only(0.35)
    y = check(lib, q, k, v, [], prog(dtype), nodes(dtype), BERT, kv_group=3)
    assert y.shape == (2, 5, 6, 8)


def test_grouped_query_heads_that_do_not_divide(lib):
    q, k, v = _x((1, 4, 6, 8), seed=1), _x((1, 4, 2, 8), seed=2), _x((1, 4, 2, 8), seed=3)
    prog, nodes = scale_only(0.35)
    m = attention_model(q, k, v, [], prog(np.float32), nodes(np.float32), BERT, dyn=True, kv_group=3)
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": _x((1, 4, 3, 8), seed=2), "v": _x((1, 4, 3, 8), seed=3)}, lib)
    assert "Q has 6 heads, K^T 3 and V 3: with kv_group 3 K^T and V must have H / kv_group" in _one_line(e)


def test_program_casts_to_f32_before_softmax(lib):
    """An f16 node whose score program stores f32 (a Cast to float before the Softmax): the
    program's output is not rounded to f16; the probabilities are (V's dtype)."""
    dt = np.float16
    q, k, v = _x((1, 2, 5, 8), dt, 1), _x((1, 2, 8, 7), dt, 2), _x((1, 2, 7, 8), dt, 3)
    prog = score_program(dt, [], ["%1 = mul %0 0.5"], 1, out_dtype=np.float32)
    m = attention_model(q, k, v, [], prog, lambda: [], {})
    got = run(m, {"q": q, "k": k, "v": v}, lib)
    _close(got, reference(q, k, v, [], prog, {}), "f32 scores against the reference")


def test_exact_scores_keeps_the_scores_in_fp32(lib):
    """exact_scores (onnxfuse writes it on 16-bit nodes): the product and the program's output
    stay fp32 up to the softmax. A program adding 1000 to the scores (the softmax ignores it)
    shows it: rounded to f16 there, the scores would move in steps of 0.5. The library matches
    the numpy contract (`kinds.attention.evaluate_attention`) and a float64 reference without
    those roundings, and is far from the rounded contract's result."""
    from onnxfuse.kinds.attention import evaluate_attention

    dt = np.float16
    q, k, v = _x((2, 3, 9, 16), dt, 1), _x((2, 3, 16, 11), dt, 2), _x((2, 3, 11, 16), dt, 3)
    prog = score_program(dt, [], ["%1 = div %0 4.0", "%2 = add %1 1000.0"], 2)
    m = attention_model(q, k, v, [], prog, lambda: [], {})
    m.graph.node[0].attribute.append(helper.make_attribute("exact_scores", 1))
    got = run(m, {"q": q, "k": k, "v": v}, lib)
    s = q.astype(np.float64) @ k.astype(np.float64) / 4.0
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = (e / e.sum(axis=-1, keepdims=True)).astype(dt).astype(np.float64)
    _close(got, (p @ v.astype(np.float64)).astype(dt), "exact scores against float64")
    contract = evaluate_attention(Program.from_text(prog), q, k, v, [], exact_scores=True)
    _close(got, contract, "against the numpy contract")
    rounded = reference(q, k, v, [], prog, {})
    assert np.abs(got.astype(np.float64) - rounded).max() > 0.05


def test_sk_zero_gives_zeros(lib):
    q, k, v = _x((2, 3, 5, 8), seed=1), np.zeros((2, 3, 8, 0), np.float32), np.zeros((2, 3, 0, 4), np.float32)
    prog, nodes = scale_only(0.35)
    m = attention_model(q, k, v, [], prog(np.float32), nodes(np.float32), {})
    got = run(m, {"q": q, "k": k, "v": v}, lib)
    assert got.shape == (2, 3, 5, 4) and not got.any()


def test_row_of_minus_inf_is_nan(lib):
    """A query row whose scores are all -inf (an additive mask of -inf): NaN, as ONNX's Softmax."""
    q, k, v = _x((1, 2, 4, 8), seed=1), _x((1, 2, 8, 5), seed=2), _x((1, 2, 5, 8), seed=3)
    mask = np.zeros((1, 1, 4, 5), np.float32)
    mask[0, 0, 2, :] = -np.inf
    mask[0, 0, 1, 3] = -np.inf
    prog, nodes = div_add_mask(2.0)
    got = check(lib, q, k, v, [mask], prog(np.float32, mask), nodes(np.float32), {})
    assert np.isnan(got[:, :, 2]).all() and not np.isnan(np.delete(got, 2, axis=2)).any()


def test_float32_standing_for_f16(lib):
    """ONNX Runtime's CPU provider may hand an f16 node float32 tensors ("isolated fp16 node"):
    the kernel reads them as they are and rounds as the node says (f16), storing float32."""
    q, k, v = _x((2, 5, 2, 8), seed=1), _x((2, 6, 2, 8), seed=2), _x((2, 6, 2, 8), seed=3)
    prog = score_program(np.float16, [], ["%1 = mul %0 0.35"], 1)
    m = attention_model(q, k, v, [], prog, lambda: [N("Identity", ["s"], ["z"])], BERT)
    got = run(m, {"q": q, "k": k, "v": v}, lib)
    want = reference(q, k, v, [], prog, BERT, dtype=np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got, got.astype(np.float16).astype(np.float32))  # rounded to f16


def test_the_kernel_runs_not_the_function_body(lib):
    """A program changed to scale by 0 (its body left as it was): uniform probabilities, the
    mean of V's rows, show in the output."""
    q, k, v = _x((1, 2, 4, 8), seed=1), _x((1, 2, 8, 5), seed=2), _x((1, 2, 5, 8), seed=3)
    prog, nodes = scale_only(0.35)
    m = attention_model(q, k, v, [], prog(np.float32).replace("0.35", "0.0"), nodes(np.float32), {})
    got = run(m, {"q": q, "k": k, "v": v}, lib)
    np.testing.assert_allclose(got, np.broadcast_to(v.mean(axis=2, keepdims=True), got.shape), rtol=1e-5, atol=1e-6)


def gpt2_split(h: int, d: int) -> dict:
    """GPT-2's c_attn output X [..., 3 * H * D] read as Q, K and V (Split on the last axis)."""
    return {"split_q": (0, h, d), "split_k": (h * d, h, d), "split_v": (2 * h * d, h, d)}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpt2_packed_qkv_one_tensor(lib, dtype):
    """GPT-2: one tensor X [B, S, 3 * H * D] fed to inputs 0, 1 and 2 with split_q / split_k /
    split_v, BERT's perms on the [B, S, H, D] heads, the causal Where; the function body is the
    original Split(axis=-1), Reshapes and Transposes (ONNX Runtime takes the node's repeated
    input name, each formal input of the function bound to X)."""
    b, s, h, d = 2, 7, 3, 8
    x = _x((b, s, 3 * h * d), dtype, 1)
    causal, prog, nodes = _gpt2_scores(dtype, s)

    y = check(lib, x, x, x, [causal], prog, nodes, BERT, splits=gpt2_split(h, d), shared=True)
    assert y.shape == (b, s, h, d)
    m = attention_model(x, x, x, [causal], prog, nodes, BERT, splits=gpt2_split(h, d), shared=True)
    assert [i.name for i in m.graph.input] == ["x", "e0"] and list(m.graph.node[0].input[:3]) == ["x"] * 3
    assert [n.op_type for n in m.functions[0].node].count("Split") == 1


def test_packed_qkv_is_read_at_each_offset(lib):
    """Q, K and V from one X whose thirds differ in scale: a swap of two offsets would show."""
    b, s, h, d = 1, 5, 2, 8
    x = np.concatenate([_x((b, s, h * d), seed=1), 3 * _x((b, s, h * d), seed=2),
                        10 + _x((b, s, h * d), seed=3)], axis=-1)
    prog, nodes = scale_only(0.35)
    y = check(lib, x, x, x, [], prog(np.float32), nodes(np.float32), BERT, splits=gpt2_split(h, d), shared=True)
    assert y.mean() > 5  # V's third


def test_split_on_v_only(lib):
    """Q and K plain [B, S, H, D] with BERT's perms; V read from a packed [B, S, 40] tensor at
    offset 16 (heads 2, Dv 12: two spare elements at the end), the other operands unsplit."""
    b, s, h, d = 2, 6, 2, 8
    q, k = _x((b, s, h, d), seed=1), _x((b, s, h, d), seed=2)
    xv = _x((b, s, 40), seed=3)
    prog, nodes = scale_only(0.35)
    y = check(lib, q, k, xv, [], prog(np.float32), nodes(np.float32), BERT, splits={"split_v": (16, h, 12)})
    assert y.shape == (b, s, h, 12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rank3_packed_qkv(lib, dtype):
    """Rank 3 (X rank 2, [S, 3 * H * D]): the heads [S, H, D] with perm_q (1, 0, 2), perm_k
    (1, 2, 0), perm_v (1, 0, 2), Y stored [S, H, D]."""
    s, h, d = 9, 4, 8
    x = _x((s, 3 * h * d), dtype, 1)
    perms = {"perm_q": (1, 0, 2), "perm_k": (1, 2, 0), "perm_v": (1, 0, 2), "perm_y": (1, 0, 2)}
    prog, nodes = scale_only(0.35)
    y = check(lib, x, x, x, [], prog(dtype), nodes(dtype), perms, splits=gpt2_split(h, d), shared=True)
    assert y.shape == (s, h, d)


def test_split_without_perms_takes_rank_from_the_split(lib):
    """No perms: the rank is Q's (plain, 4); V's packed input [1, 2, 51] has rank 3 = r - 1 and
    split_v [3, 6, 8] makes its base tensor [1, 2, 6, 8] (the logical V, Sk = 6) from offset 3."""
    q, k, xv = _x((1, 2, 5, 8), seed=1), _x((1, 2, 8, 6), seed=2), _x((1, 2, 51), seed=3)
    prog, nodes = scale_only(0.35)
    check(lib, q, k, xv, [], prog(np.float32), nodes(np.float32), {}, splits={"split_v": (3, 6, 8)})


def test_split_q_without_perms_gives_the_rank(lib):
    """No perms, Q packed: r = Q's input's rank + 1 = 4; K^T and V plain rank 4."""
    xq, k, v = _x((2, 3, 40), seed=1), _x((2, 3, 8, 6), seed=2), _x((2, 3, 6, 7), seed=3)
    prog, nodes = scale_only(0.35)
    y = check(lib, xq, k, v, [], prog(np.float32), nodes(np.float32), {}, splits={"split_q": (8, 4, 8)})
    assert y.shape == (2, 3, 4, 7)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_qkv_with_its_bias(lib, dtype):
    """bias_q = bias_k = bias_v: the packed projection's bias b [3 * H * D] (input 4, after the
    causal mask) added to X before the split, each sum rounded to X's dtype as the body's Add
    stores it; the function body is Add, Split, Reshapes."""
    b, s, h, d = 2, 7, 3, 8
    x = _x((b, s, 3 * h * d), dtype, 1)
    bias = (2 * _x((3 * h * d,), np.float32, 5)).astype(dtype)
    causal, prog, nodes = _gpt2_scores(dtype, s)

    y = check(lib, x, x, x, [causal], prog, nodes, BERT, splits=gpt2_split(h, d), shared=True, bias=bias)
    # the bias shows: without it the output differs by more than the tolerance
    unbiased = reference(x, x, x, [causal], prog, BERT, splits=gpt2_split(h, d))
    assert np.abs(y.astype(np.float64) - unbiased.astype(np.float64)).max() > 0.1


def test_packed_bias_rank3(lib):
    """Rank 3 (X [S, 3 * H * D]) with a bias."""
    s, h, d = 9, 4, 8
    x, bias = _x((s, 3 * h * d), seed=1), _x((3 * h * d,), seed=6)
    perms = {"perm_q": (1, 0, 2), "perm_k": (1, 2, 0), "perm_v": (1, 0, 2), "perm_y": (1, 0, 2)}
    prog, nodes = scale_only(0.35)
    check(lib, x, x, x, [], prog(np.float32), nodes(np.float32), perms, splits=gpt2_split(h, d), shared=True,
          bias=bias)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------

def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "onnxfuse FusedAttention node 'attn'" in msg, msg
    return msg


def _bert_model(**kw):
    b, s, h, d = 1, 4, 2, 8
    q, k, v = _x((b, s, h, d), seed=1), _x((b, s, h, d), seed=2), _x((b, s, h, d), seed=3)
    prog, nodes = scale_only(0.35)
    return attention_model(q, k, v, [], prog(np.float32), nodes(np.float32), BERT, dyn=True, **kw), (q, k, v)


def test_perm_that_is_not_a_permutation(lib):
    m, (q, k, v) = _bert_model()
    attr = next(a for a in m.graph.node[0].attribute if a.name == "perm_k")
    attr.ints[:] = [0, 2, 2, 1]
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v}, lib)
    assert "perm_k [0, 2, 2, 1] is not a permutation of 0 .. 3" in _one_line(e)


def test_perm_of_the_wrong_rank(lib):
    m, (q, k, v) = _bert_model()
    next(a for a in m.graph.node[0].attribute if a.name == "perm_y").ints[:] = [0, 2, 1]
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v}, lib)
    assert "perm_y [0, 2, 1] and the other perms (4 entries) differ in length" in _one_line(e)


def test_mismatched_d(lib):
    m, (q, k, v) = _bert_model()
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": _x((1, 4, 2, 6), seed=2), "v": v}, lib)
    assert "Q's last dim D = 8 and K^T's second-to-last 6 differ" in _one_line(e)


def test_extra_that_does_not_broadcast(lib):
    b, s, h, d = 1, 4, 2, 8
    q, k, v = _x((b, s, h, d), seed=1), _x((b, s, h, d), seed=2), _x((b, s, h, d), seed=3)
    mask = np.zeros((b, 1, 1, s), np.float32)
    prog, nodes = div_add_mask(4.0)
    m = attention_model(q, k, v, [mask], prog(np.float32, mask), nodes(np.float32), BERT, dyn=True)
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v, "e0": np.zeros((b, 1, 1, 3), np.float32)}, lib)
    msg = _one_line(e)
    assert ("input 3 (extra %1) has shape [1, 1, 1, 3], which does not broadcast to the scores' shape "
            "[1, 2, 4, 4]") in msg


def test_program_without_one_output(lib):
    m, (q, k, v) = _bert_model()
    attr = next(a for a in m.graph.node[0].attribute if a.name == "program")
    attr.s = attr.s.replace(b"output %1 f32\n", b"output %1 f32\noutput %0 f32\n")
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v}, lib)
    assert "exactly one output" in _one_line(e)


def _gpt2_model(**kw):
    b, s, h, d = 1, 4, 2, 8
    x = _x((b, s, 3 * h * d), seed=1)
    prog, nodes = scale_only(0.35)
    return attention_model(x, x, x, [], prog(np.float32), nodes(np.float32), BERT, dyn=True,
                           splits=gpt2_split(h, d), shared=True, **kw), x


def test_split_past_the_last_dim(lib):
    m, x = _gpt2_model()
    with pytest.raises(Exception) as e:
        run(m, {"x": x[..., :40]}, lib)
    assert ("split_v [32, 2, 8] reads elements [32, 48) of the last dim of V's input [1, 4, 40], which has 40: "
            "offset + heads * head_dim must be at most its last dim") in _one_line(e)


def test_split_of_the_wrong_length(lib):
    m, x = _gpt2_model()
    next(a for a in m.graph.node[0].attribute if a.name == "split_k").ints[:] = [16, 2]
    with pytest.raises(Exception) as e:
        run(m, {"x": x}, lib)
    assert "split_k [16, 2] must have 3 entries: [offset, heads, head_dim]" in _one_line(e)


def test_split_with_zero_heads(lib):
    m, x = _gpt2_model()
    next(a for a in m.graph.node[0].attribute if a.name == "split_q").ints[:] = [0, 0, 8]
    with pytest.raises(Exception) as e:
        run(m, {"x": x}, lib)
    assert "split_q [0, 0, 8]: [offset, heads, head_dim] needs offset >= 0, heads >= 1" in _one_line(e)


def test_split_input_of_the_wrong_rank(lib):
    """split_v on a rank-4 input against rank-4 perms: its base tensor would be rank 5."""
    m, (q, k, v) = _bert_model()
    m.graph.node[0].attribute.append(helper.make_attribute("split_v", [0, 2, 8]))
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v}, lib)
    assert ("V's input [1, 4, 2, 8] (split_v [0, 2, 8]) gives a base tensor of rank 5, the operands have rank 4 "
            "(from the perms' length)") in _one_line(e)


def _biased_model():
    b, s, h, d = 1, 4, 2, 8
    x, bias = _x((b, s, 3 * h * d), seed=1), _x((3 * h * d,), seed=2)
    prog, nodes = scale_only(0.35)
    return attention_model(x, x, x, [], prog(np.float32), nodes(np.float32), BERT, dyn=True,
                           splits=gpt2_split(h, d), shared=True, bias=bias), x, bias


def test_bias_of_the_wrong_shape(lib):
    m, x, bias = _biased_model()
    m.graph.input[1].type.tensor_type.ClearField("shape")  # any rank
    for wrong in (bias[:40], bias.reshape(1, -1)):
        with pytest.raises(Exception) as e:
            run(m, {"x": x, "b": wrong}, lib)
        assert (f"input 3 (bias_q) has shape {list(wrong.shape)}: a bias must be 1-D of its packed input's last "
                "dim (Q's input [1, 4, 48])") in _one_line(e)


def test_bias_of_another_dtype(lib):
    m, x, bias = _biased_model()
    m.graph.input[1].type.tensor_type.elem_type = TensorProto.FLOAT16
    with pytest.raises(Exception) as e:
        run(m, {"x": x, "b": bias.astype(np.float16)}, lib)
    assert "input 3 is float16, the node declares f32" in _one_line(e)


def test_bias_without_its_split(lib):
    """bias_q on a plain (unsplit) Q: session creation fails naming the attribute."""
    m, (q, k, v) = _bert_model()
    m.graph.node[0].input.append("q")
    m.graph.node[0].attribute.append(helper.make_attribute("bias_q", 3))
    with pytest.raises(Exception) as e:
        run(m, {"q": q, "k": k, "v": v}, lib)
    assert "bias_q 3 needs split_q: a bias is added to the packed input the operand is split from" in _one_line(e)


def test_bias_index_among_the_extras(lib):
    m, x, bias = _biased_model()
    next(a for a in m.graph.node[0].attribute if a.name == "bias_k").i = 2
    with pytest.raises(Exception) as e:
        run(m, {"x": x, "b": bias}, lib)
    assert "bias_k 2 names an input before the biases, which follow Q, K^T, V and the 0 extras" in _one_line(e)


def test_bias_with_heads_not_the_h_dim(lib):
    """The kernels add a head's slice of the bias along D: a perm that makes the split's heads
    another dim than H is refused."""
    m, x, bias = _biased_model()
    for key, perm in (("perm_q", [0, 1, 2, 3]), ("perm_k", [0, 1, 3, 2]), ("perm_v", [0, 1, 2, 3]),
                      ("perm_y", [0, 1, 2, 3])):  # attention over [B, S] with H as the rows
        next(a for a in m.graph.node[0].attribute if a.name == key).ints[:] = perm
    with pytest.raises(Exception) as e:
        run(m, {"x": x, "b": bias}, lib)
    assert ("bias_q: perm_q [0, 1, 2, 3] must read split_q's heads as the operand's head dim (dim 1) and its "
            "head_dim as D (dim 3)") in _one_line(e)
