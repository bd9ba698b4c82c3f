"""squeeze_excite: which squeeze-and-excitation blocks fuse (the forms torchvision, timm and
Paddle export), which do not and why, the FusedSqueezeExcite contract of docs/format.md, the
NHWC pass around it, and its kernel's source.

Numbers: each model runs in stock ONNX Runtime CPU before and after optimizing (the fused
node runs its function body), and the node is checked against the numpy reference of its
own inputs and attributes (`SqueezeExcite.evaluate`, via tests.util.check_fusion)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse import optimize_model
from onnxfuse.codegen_squeeze import SqueezeSpec, generate_squeeze, squeeze_candidates, squeeze_variants
from onnxfuse.expr import parse
from tests.util import check_fusion, model, op_types

N = helper.make_node
NP = {"float32": np.float32, "float16": np.float16}


@pytest.fixture(autouse=True)
def squeeze_all(monkeypatch):
    """The kind is fused only where tuning measures it (UNTUNED): here, as if tuned."""
    monkeypatch.setenv("ONNXFUSE_SQUEEZE_ALL", "1")


def se_model(act: str = "silu", gate: str = "sigmoid", c: int = 24, cr: int = 6, dtype: str = "float32",
             bias: bool | str = True, hw: tuple[int, int] = (5, 7)) -> onnx.ModelProto:
    """x [N, c, h, w] -> GlobalAveragePool -> Conv (c -> cr) -> act -> Conv (cr -> c) -> gate -> Mul(x, .);
    bias "add": each conv without one, then an Add of [1, K, 1, 1] constants (Paddle's export)."""
    rng = np.random.default_rng(0)
    inits = {"w1": (rng.standard_normal((cr, c, 1, 1)) / np.sqrt(c)).astype(NP[dtype]),
             "w2": (rng.standard_normal((c, cr, 1, 1)) / np.sqrt(cr)).astype(NP[dtype])}
    if bias:
        shape = (lambda k: (1, k, 1, 1)) if bias == "add" else (lambda k: (k,))
        inits |= {"b1": (0.1 * rng.standard_normal(shape(cr))).astype(NP[dtype]),
                  "b2": (0.1 * rng.standard_normal(shape(c))).astype(NP[dtype])}
    conv_bias = ["b1"] if bias is True else []
    nodes = [N("GlobalAveragePool", ["x"], ["m"])]
    if bias == "add":
        nodes += [N("Conv", ["m", "w1"], ["z1c"]), N("Add", ["z1c", "b1"], ["z1"])]
    else:
        nodes += [N("Conv", ["m", "w1", *conv_bias], ["z1"])]
    nodes += {"silu": [N("Sigmoid", ["z1"], ["s1"]), N("Mul", ["z1", "s1"], ["h"])],
              "relu": [N("Relu", ["z1"], ["h"])],
              "hardswish": [N("HardSwish", ["z1"], ["h"])],
              "none": [N("Identity", ["z1"], ["h"])]}[act]
    if bias == "add":
        nodes += [N("Conv", ["h", "w2"], ["z2c"]), N("Add", ["z2c", "b2"], ["z2"])]
    else:
        nodes.append(N("Conv", ["h", "w2", *(["b2"] if bias is True else [])], ["z2"]))
    nodes += {"sigmoid": [N("Sigmoid", ["z2"], ["g"])],
              "hardsigmoid": [N("HardSigmoid", ["z2"], ["g"], alpha=1 / 6, beta=0.5)],
              "paddle": [N("HardSigmoid", ["z2"], ["g"], alpha=0.2, beta=0.5)],
              "clip": [N("Add", ["z2", "three"], ["t"]), N("Clip", ["t", "zero", "six"], ["u"]),
                       N("Div", ["u", "six"], ["g"])]}[gate]
    if gate == "clip":
        inits |= {k: np.array(v, NP[dtype]) for k, v in (("three", 3.0), ("zero", 0.0), ("six", 6.0))}
    nodes.append(N("Mul", ["x", "g"], ["y"]))
    return model(nodes, {"x": (dtype, ["N", c, *hw])}, {"y": (dtype, ["N", c, *hw])}, inits, opset=17)


@pytest.mark.parametrize("act, gate", [("silu", "sigmoid"), ("relu", "hardsigmoid"), ("relu", "sigmoid"),
                                       ("hardswish", "paddle"), ("relu", "clip"), ("none", "sigmoid")])
def test_squeeze_excite_blocks_fuse(act, gate):
    """EfficientNet's (SiLU, Sigmoid), MobileNetV3's (Relu, HardSigmoid), RegNetY's (Relu,
    Sigmoid), PP-LCNet's (HardSigmoid 0.2) and the Clip / Div gate of older exports: one node,
    the Mul by the gate outside it."""
    m = se_model(act, gate)
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model).count("FusedSqueezeExcite") == 1
    assert "GlobalAveragePool" not in op_types(r.model) and "Conv" not in op_types(r.model)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedSqueezeExcite")
    shapes = {t.name: list(t.dims) for t in r.model.graph.initializer}
    assert [shapes.get(x) for x in node.input[1:]] == [[6, 24], [6], [24, 6], [24]]
    assert {a.name for a in node.attribute} >= {"program", "gate"}


def test_without_biases_and_in_float16():
    check_fusion(se_model(bias=False), expect_fused=1)
    # Paddle's biases: a Conv without one, then an Add of a [1, K, 1, 1] constant; it becomes the node's bias
    r = check_fusion(se_model("relu", "paddle", bias="add"), expect_fused=1)
    assert "Add" not in op_types(r.model)
    r = check_fusion(se_model("silu", "hardsigmoid", dtype="float16"), expect_fused=1, rtol=1e-2)
    node = next(n for n in r.model.graph.node if n.op_type == "FusedSqueezeExcite")
    attrs = {a.name: a.s.decode() for a in node.attribute if a.s}
    assert parse(attrs["program"]).input_dtypes == ("f16",) and parse(attrs["gate"]).outputs[0][1] == "f16"


def _rewired(m: onnx.ModelProto, edit) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    edit(out.graph)
    return out


def test_blocks_that_do_not_fuse_say_why():
    base = se_model("relu", "sigmoid")

    def pool_read_twice(g):  # the pooled values are an output too
        g.output.append(helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, None))

    def act_reads_another_tensor(g):  # z1 + an input of its shape before the Relu
        g.input.append(helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, ["N", 6, 1, 1]))
        relu = next(n for n in g.node if n.op_type == "Relu")
        g.node.insert(list(g.node).index(relu), N("Add", ["z1", "t"], ["z1t"]))
        relu.input[0] = "z1t"

    def act_scales_per_channel(g):  # Relu, then Mul by a [1, 6, 1, 1] constant: no bias, another input
        g.initializer.append(onnx.numpy_helper.from_array(np.linspace(0.5, 1.5, 6, dtype=np.float32)
                                                          .reshape(1, 6, 1, 1), "scale"))
        relu = next(n for n in g.node if n.op_type == "Relu")
        relu.output[0] = "hr"
        g.node.insert(list(g.node).index(relu) + 1, N("Mul", ["hr", "scale"], ["h"]))

    for edit, reason in ((pool_read_twice, "the pool is not read by one conv alone"),
                         (act_reads_another_tensor, "an activation or gate reads another tensor"),
                         (act_scales_per_channel, "an activation or gate reads another tensor")):
        r = optimize_model(_rewired(base, edit))
        assert "FusedSqueezeExcite" not in op_types(r.model), reason
        assert any(reason in k for k in r.report.not_fused), r.report.summary()


def test_a_second_conv_that_does_not_give_back_the_channels_does_not_fuse():
    """A pool, a 1x1 conv and another 1x1 conv to fewer channels is no squeeze-excite block."""
    rng = np.random.default_rng(0)
    m = model([N("GlobalAveragePool", ["x"], ["m"]), N("Conv", ["m", "w1"], ["z1"]), N("Relu", ["z1"], ["h"]),
               N("Conv", ["h", "w2"], ["y"])],
              {"x": ("float32", ["N", 16, 4, 4])}, {"y": ("float32", ["N", 10, 1, 1])},
              {"w1": rng.standard_normal((4, 16, 1, 1)).astype(np.float32),
               "w2": rng.standard_normal((10, 4, 1, 1)).astype(np.float32)}, opset=17)
    r = optimize_model(m)
    assert "FusedSqueezeExcite" not in op_types(r.model)
    assert any("does not give back every channel" in k for k in r.report.not_fused), r.report.summary()


def test_without_tuning_blocks_stay_with_onnx_runtime(monkeypatch):
    monkeypatch.delenv("ONNXFUSE_SQUEEZE_ALL")
    r = optimize_model(se_model())
    assert "FusedSqueezeExcite" not in op_types(r.model)
    assert "squeeze-excite blocks: fused only where tuning measures" in r.report.summary()


def test_an_mbconv_block_keeps_its_squeeze_excite_channels_last(tmp_path, monkeypatch):
    """Conv + SiLU, the block's squeeze-excite, the Mul and the projection conv: with the NHWC
    pass the fused node reads the conv's channels-last output and writes its gate channels
    last (the same bytes as NCHW [N, C, 1, 1]), so no Transpose sits between them; the model
    computes the original's with its function bodies and with the library's CPU kernels."""
    pytest.importorskip("triton")
    from onnxfuse.pipeline import compile_pass
    from tests.test_layout import check_same
    from tests.util import kernel_options

    rng = np.random.default_rng(0)
    c, cr = 32, 8
    inits = {"w0": (0.1 * rng.standard_normal((c, 16, 3, 3))).astype(np.float32),
             "w1": (0.1 * rng.standard_normal((cr, c, 1, 1))).astype(np.float32),
             "b1": rng.standard_normal(cr).astype(np.float32),
             "w2": (0.1 * rng.standard_normal((c, cr, 1, 1))).astype(np.float32),
             "b2": rng.standard_normal(c).astype(np.float32),
             "w3": (0.1 * rng.standard_normal((24, c, 1, 1))).astype(np.float32)}
    m = model([N("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]), N("Sigmoid", ["c0"], ["s0"]),
               N("Mul", ["c0", "s0"], ["a0"]), N("GlobalAveragePool", ["a0"], ["m"]),
               N("Conv", ["m", "w1", "b1"], ["z1"]), N("Relu", ["z1"], ["h"]), N("Conv", ["h", "w2", "b2"], ["z2"]),
               N("HardSigmoid", ["z2"], ["g"], alpha=1 / 6, beta=0.5), N("Mul", ["a0", "g"], ["sc"]),
               N("Conv", ["sc", "w3"], ["y"])],
              {"x": ("float32", ["N", 16, 14, 14])}, {"y": ("float32", ["N", 24, 14, 14])}, inits, opset=17)
    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    from onnxfuse import codegen_conv

    monkeypatch.setattr(codegen_conv, "_ROUND_TF32", "ab")  # conv weights as they are (tests/test_layout.py)
    r = optimize_model(m, layout="nhwc")  # with the patterns of channels-last convs (conv_alone)
    info = compile_pass(r, kernel_options("sm_90", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"]
    onnx.checker.check_model(r.model, full_check=True)
    se = next(n for n in r.model.graph.node if n.op_type == "FusedSqueezeExcite")
    layouts = {a.name: a.s.decode() for a in se.attribute if a.name.endswith("layout")}
    assert layouts == {"x_layout": "NHWC", "y_layout": "NHWC"}
    assert op_types(r.model).count("Transpose") == 1  # the graph input's, before the first conv
    for library in (False, True):
        check_same(m, r.model, library)


def _spec(x_layout: str = "nchw", dtype: str = "f32", c: int = 96, cr: int = 24) -> SqueezeSpec:
    act = parse(f"onnxfuse.pointwise v1\ninput %0 {dtype}\n%1 = max %0 0.0\noutput %1 {dtype}\n")
    gate = parse(f"onnxfuse.pointwise v1\ninput %0 {dtype}\n%1 = sigmoid %0\noutput %1 {dtype}\n")
    return SqueezeSpec("onnxfuse_squeeze_excite_t", act, gate, c, cr, dtype, x_layout=x_layout, y_layout=x_layout)


@pytest.mark.parametrize("x_layout", ["nchw", "nhwc"])
def test_kernel_source_reads_x_in_its_layout(x_layout):
    spec = _spec(x_layout)
    src = generate_squeeze(spec, squeeze_variants(spec)[0]).source
    load = ("x_img + ps[:, None] * C + cs[None, :]" if x_layout == "nhwc" else "x_img + cs[:, None] * HW + ps[None, :]")
    assert load in src
    assert src.count("@triton.jit") == 3 and "def act(x0):" in src and "def gate(x0):" in src
    assert 'tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel")' in src
    # the hidden units past CR are zeroed before FC2: sigmoid(0) would add W2 * 0.5
    assert "h = tl.where(mask_r, h, 0.0)" in src


def test_float16_kernels_round_between_steps_as_the_original_stores():
    spec = _spec(dtype="f16")
    src = generate_squeeze(spec, squeeze_variants(spec)[0]).source
    for step in ("mean = (tl.sum(ws, axis=0) / HW).to(tl.float16", "h = (act(z1.to(tl.float16",
                 ".to(tl.float32))).to(tl.float16", "y = gate(z2.to(tl.float16", "y.to(tl.float16"):
        assert step in src, step


def test_candidates_start_with_the_heuristic_and_are_distinct():
    spec = _spec("nhwc")
    cands = squeeze_candidates(spec)
    assert cands[0][1] == squeeze_variants(spec)
    assert len({c[1] for c in cands}) == len(cands) >= 3


@pytest.mark.parametrize("x_layout, dtype", [("nchw", "f32"), ("nhwc", "f16")])
def test_kernel_compiles_for_sm90(x_layout, dtype, tmp_path):
    """Triton compiles it ahead of time (no GPU needed), and its kernel_meta is the contract's."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    spec = _spec(x_layout, dtype, c=40, cr=10)
    [ck] = compile_kernels([spec], [90], cache_dir=tmp_path)
    meta = ck.kernel_meta()
    assert meta["kind"] == "squeeze_excite" and (meta["channels"], meta["hidden"]) == (40, 10)
    assert meta["variants"][0]["min_chunk"] >= meta["variants"][0]["block_p"]
    assert ("x_layout" in meta) == (x_layout == "nhwc")
    assert any(b["format"] == "cubin" and b["arch"] == 90 for b in meta["binaries"])
