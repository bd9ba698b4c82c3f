"""The custom-op library's FusedSqueezeExcite CPU kernel (csrc/kinds/squeeze_cpu.cc,
docs/format.md "FusedSqueezeExcite").

Each model is one hand-built FusedSqueezeExcite node (no function body: with the library
registered, onnxruntime runs the library's kernel), compared with a numpy reference of the
contract on seeded random inputs: the mean over H·W, FC1, the activation, FC2 and the gate,
rounded to the programs' dtypes where the contract rounds (`squeeze_excite` below).

Tolerances. fp32: the kernel sums in fp32, the reference in float64; each sum has at most
max(H·W, C) terms, so they differ by a few ulp of the partial sums: rtol 1e-5 plus an atol of
1e-5 of the output's scale. fp16: the intermediate values are rounded to fp16 on both sides,
and a different summation order can round one to the neighbouring half (2^-10 relative),
which the next layer carries on: rtol and atol 1e-2 of the scale.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse import expr
from onnxfuse.expr import Builder, Program, Ref

ort = pytest.importorskip("onnxruntime")

TP = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16}
NP = {"f32": np.float32, "f16": np.float16}


@pytest.fixture(scope="module")
def lib() -> str:
    from onnxfuse import runtime

    return runtime.library_path()


def act(kind: str, dtype: str) -> Program:
    """One value to one: relu, sigmoid, hard_sigmoid (ONNX's default alpha 0.2, beta 0.5) or
    hard_swish (x · hard_sigmoid(x) with alpha 1/6, MobileNetV3's)."""
    b = Builder([dtype])
    x = Ref(0)
    if kind == "relu":
        v = b.emit("max", x, 0.0)
    elif kind == "sigmoid":
        v = b.emit("sigmoid", x)
    else:
        alpha = 0.2 if kind == "hard_sigmoid" else 1.0 / 6.0
        v = b.emit("max", b.emit("min", b.emit("add", b.emit("mul", x, alpha), 0.5), 1.0), 0.0)
        if kind == "hard_swish":
            v = b.emit("mul", x, v)
    return b.build([(v, dtype)])


def se_model(prog: Program, gate: Program, tensor_dtype: str | None = None, **attrs) -> onnx.ModelProto:
    """X, W1, B1, W2, B2 -> Y, every dimension dynamic (so the kernel's own checks see wrong
    shapes); tensor_dtype: the tensors' type (default: the program's %0 dtype)."""
    tp = TP[tensor_dtype or prog.input_dtypes[0]]
    names = ["x", "w1", "b1", "w2", "b2"]
    node = helper.make_node("FusedSqueezeExcite", names, ["y"], domain="onnxfuse", name="se0",
                            program=prog.to_text(), gate=gate.to_text(), **attrs)
    ins = [helper.make_tensor_value_info(n, tp, None) for n in names]
    out = helper.make_tensor_value_info("y", TP[tensor_dtype or gate.outputs[0][1]], [None] * 4)
    graph = helper.make_graph([node], "se", ins, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("onnxfuse", 1)],
                             ir_version=10)


def run(model: onnx.ModelProto, feeds: dict, lib: str) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def feeds(n=2, c=24, cr=6, h=5, w=5, dtype=np.float32, x_nhwc=False, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    f = {"x": x.transpose(0, 2, 3, 1) if x_nhwc else x, "w1": rng.standard_normal((cr, c)) / np.sqrt(c),
         "b1": rng.standard_normal(cr) * 0.1, "w2": rng.standard_normal((c, cr)) / np.sqrt(cr),
         "b2": rng.standard_normal(c) * 0.1}
    return {k: np.ascontiguousarray(v).astype(dtype) for k, v in f.items()}


def squeeze_excite(prog: Program, gate: Program, f: dict, x_nhwc=False, y_nhwc=False) -> np.ndarray:
    """The contract in numpy: sums in float64, rounded where the node rounds."""
    def rnd(v, dt):
        return v.astype(NP[dt]).astype(np.float64)

    x = f["x"].astype(np.float64)
    x = x.transpose(0, 3, 1, 2) if x_nhwc else x
    t = prog.input_dtypes[0]
    with np.errstate(invalid="ignore"):
        m = rnd(x.mean(axis=(2, 3)), t)  # [N, C]
    z1 = rnd(m @ f["w1"].astype(np.float64).T + f["b1"], t)
    (h,) = expr.evaluate(prog, [z1.astype(np.float32)])
    z2 = rnd(h.astype(np.float64) @ f["w2"].astype(np.float64).T + f["b2"], gate.input_dtypes[0])
    (y,) = expr.evaluate(gate, [z2.astype(np.float32)])
    n, c = y.shape
    return y.reshape(n, 1, 1, c) if y_nhwc else y.reshape(n, c, 1, 1)


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    scale = float(np.abs(want.astype(np.float64)).max(initial=1.0))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("activation,gate", [("relu", "sigmoid"), ("relu", "hard_sigmoid"),
                                             ("hard_swish", "hard_sigmoid"), ("sigmoid", "sigmoid")])
@pytest.mark.parametrize("x_layout,y_layout", [("NCHW", "NCHW"), ("NHWC", "NCHW"), ("NHWC", "NHWC")])
def test_fp32(activation, gate, x_layout, y_layout, lib):
    prog, g = act(activation, "f32"), act(gate, "f32")
    xn, yn = x_layout == "NHWC", y_layout == "NHWC"
    f = feeds(x_nhwc=xn)
    got = run(se_model(prog, g, x_layout=x_layout, y_layout=y_layout), f, lib)
    _close(got, squeeze_excite(prog, g, f, xn, yn), 1e-5)


@pytest.mark.parametrize("x_layout", ["NCHW", "NHWC"])
def test_fp16(x_layout, lib):
    prog, g = act("hard_swish", "f16"), act("hard_sigmoid", "f16")
    xn = x_layout == "NHWC"
    f = feeds(n=3, c=32, cr=8, h=7, w=6, dtype=np.float16, x_nhwc=xn, seed=1)
    got = run(se_model(prog, g, x_layout=x_layout, y_layout=x_layout), f, lib)
    _close(got, squeeze_excite(prog, g, f, xn, xn), 1e-2)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_against_the_original_nodes(dtype, lib):
    """The nodes the contract fuses, GlobalAveragePool -> Conv -> Relu -> Conv -> HardSigmoid,
    in onnxruntime without the library, on the same inputs (the 1x1 weights unsqueezed)."""
    f = feeds(n=3, c=32, cr=8, h=7, w=6, dtype=NP[dtype], seed=3)
    N = helper.make_node
    nodes = [N("GlobalAveragePool", ["x"], ["m"]), N("Unsqueeze", ["w1", "axes"], ["w1_4d"]),
             N("Unsqueeze", ["w2", "axes"], ["w2_4d"]), N("Conv", ["m", "w1_4d", "b1"], ["z1"]),
             N("Relu", ["z1"], ["h"]), N("Conv", ["h", "w2_4d", "b2"], ["z2"]), N("HardSigmoid", ["z2"], ["y"])]
    vi = [helper.make_tensor_value_info(n, TP[dtype], None) for n in ["x", "w1", "b1", "w2", "b2", "y"]]
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])
    original = helper.make_model(helper.make_graph(nodes, "se", vi[:5], vi[5:], [axes]), ir_version=10,
                                 opset_imports=[helper.make_opsetid("", 21)])
    want = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)[0]
    got = run(se_model(act("relu", dtype), act("hard_sigmoid", dtype)), f, lib)
    _close(got, want, 1e-5 if dtype == "f32" else 1e-2)


def test_float32_tensors_for_fp16_programs(lib):
    """ONNX Runtime's isolated fp16 node: float32 tensors where the programs say f16, the
    values rounded where they say so (the output too: it holds fp16 values)."""
    prog, g = act("relu", "f16"), act("sigmoid", "f16")
    f = {k: v.astype(np.float32) for k, v in feeds(dtype=np.float16, seed=2).items()}
    got = run(se_model(prog, g, tensor_dtype="f32"), f, lib)
    want = squeeze_excite(prog, g, f)
    assert np.array_equal(got.astype(np.float16).astype(np.float32), got)
    _close(got, want.astype(np.float32), 1e-2)


def test_empty_batch_and_empty_image(lib):
    prog, g = act("relu", "f32"), act("sigmoid", "f32")
    got = run(se_model(prog, g), feeds(n=0), lib)
    assert got.shape == (0, 24, 1, 1)
    got = run(se_model(prog, g, x_layout="NHWC", y_layout="NHWC"), feeds(h=0, x_nhwc=True), lib)
    assert got.shape == (2, 1, 1, 24) and np.isnan(got).all()  # the mean of no pixels is NaN


@pytest.mark.parametrize("key,shape,msg", [
    ("w1", (6, 23), r"input 1 \(W1\) has shape \[6, 23\], expected \[CR, C\] with X's C = 24"),
    ("w1", (6, 24, 1, 1), r"input 1 \(W1\) has shape \[6, 24, 1, 1\], expected \[CR, C\]"),
    ("b1", (5,), r"input 2 \(B1\) has shape \[5\], expected \[CR\] = \[6\]"),
    ("w2", (6, 24), r"input 3 \(W2\) has shape \[6, 24\], expected \[C, CR\] = \[24, 6\]"),
    ("b2", (24, 1), r"input 4 \(B2\) has shape \[24, 1\], expected \[C\] = \[24\]"),
    ("x", (2, 24, 5), r"input 0 \(X\) has shape \[2, 24, 5\], expected rank 4 \[N, C, H, W\]"),
])
def test_shape_errors(key, shape, msg, lib):
    f = feeds()
    f[key] = np.zeros(shape, np.float32)
    with pytest.raises(Exception, match=r"onnxfuse FusedSqueezeExcite node 'se0': " + msg):
        run(se_model(act("relu", "f32"), act("sigmoid", "f32")), f, lib)


@pytest.mark.parametrize("attrs,msg", [
    ({"x_layout": "NCWH"}, r"attribute 'x_layout' is \"NCWH\", expected \"NCHW\" or \"NHWC\""),
    ({"y_layout": "nhwc"}, r"attribute 'y_layout' is \"nhwc\", expected \"NCHW\" or \"NHWC\""),
    ({"gate": None}, r"the node has no string attribute 'gate'"),
    ({"gate": "onnxfuse.pointwise v1\ninput %0 f32\ninput %1 f32\n%2 = mul %0 %1\noutput %2 f32\n"},
     r"the gate has 2 inputs and 1 outputs, expected 1 and 1"),
])
def test_attribute_errors_at_session_creation(attrs, msg, lib):
    model = se_model(act("relu", "f32"), act("sigmoid", "f32"))
    for k, v in attrs.items():
        a = next((a for a in model.graph.node[0].attribute if a.name == k), None)
        if a is not None:
            model.graph.node[0].attribute.remove(a)
        if v is not None:
            model.graph.node[0].attribute.append(helper.make_attribute(k, v))
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    with pytest.raises(Exception, match=r"onnxfuse FusedSqueezeExcite node 'se0': " + msg):
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_type_error(lib):
    f = feeds()
    f["w2"] = f["w2"].astype(np.float16)
    model = se_model(act("relu", "f32"), act("sigmoid", "f32"))
    model.graph.input[3].type.tensor_type.elem_type = TensorProto.FLOAT16
    with pytest.raises(Exception, match=r"input 3 \(W2\) is float16, X is float32"):
        run(model, f, lib)
