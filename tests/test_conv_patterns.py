"""conv_relu, conv_relu_maxpool, relu_maxpool and BatchNormalization folding: what fuses,
what does not and why, the FusedConv / FusedMaxPool layout of docs/format.md, and that
the optimized model computes what the original does.

Numbers: each model runs in stock ONNX Runtime CPU before and after optimizing (fused nodes
run their function bodies), and each fused node is checked against a numpy reference of
its own inputs and attributes (tests/layer_ref.py, via check_fusion / check_programs)."""

from __future__ import annotations

import dataclasses
import io
import textwrap
import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from models import build as mb
from onnxfuse import PatternError, load_patterns, optimize_model
from onnxfuse.expr import Program
from onnxfuse.fold import fold_batchnorm
from onnxfuse.kinds.conv import ConvParams
from onnxfuse.layers import ConvAttrs, PoolAttrs
from onnxfuse.pattern import example_model, load_pattern_file
from onnxfuse.pipeline import Result
from onnxfuse.rewrite import unfuse
from tests.util import check_fusion, check_programs, op_types, random_feeds, run
from tests.util import model as util_model

N = helper.make_node
NP = {"float32": np.float32, "float16": np.float16}


def weights(k: int, c: int, r: int, s: int | None = None, seed: int = 0, dtype: str = "float32") -> np.ndarray:
    s = r if s is None else s
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, c, r, s)) / np.sqrt(c * r * s)).astype(NP[dtype])


def bias(k: int, seed: int = 1, dtype: str = "float32") -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(k) * 0.1).astype(NP[dtype])


def bn_params(k: int, prefix: str = "bn", seed: int = 2, dtype: str = "float32") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"{prefix}.scale": (1 + 0.2 * rng.standard_normal(k)).astype(NP[dtype]),
            f"{prefix}.beta": (0.1 * rng.standard_normal(k)).astype(NP[dtype]),
            f"{prefix}.mean": (0.1 * rng.standard_normal(k)).astype(NP[dtype]),
            f"{prefix}.var": (0.5 + rng.random(k)).astype(NP[dtype])}


def bn(x: str, y: str, prefix: str = "bn", **attrs) -> onnx.NodeProto:
    return N("BatchNormalization", [x, f"{prefix}.scale", f"{prefix}.beta", f"{prefix}.mean", f"{prefix}.var"], [y],
             name=prefix, **attrs)


def image(c: int = 3, h: int = 10, w: int = 12, dtype: str = "float32", name: str = "x") -> dict:
    return {name: (dtype, ["N", c, h, w])}


def out(*names: str, dtype: str = "float32") -> dict:
    """Graph outputs whose shapes `model` takes from shape inference."""
    return {n: (dtype, None) for n in names}


def model(nodes, inputs: dict, outputs: dict, initializers=(), opset: int = 17) -> onnx.ModelProto:
    """tests.util.model with the outputs' shapes inferred (opset 17 by default)."""
    draft = util_model(nodes, inputs, {}, initializers, opset=opset)
    inferred = onnx.shape_inference.infer_shapes(draft, strict_mode=True)
    known = {vi.name: vi for vi in inferred.graph.value_info}
    draft.graph.output.extend(known[name] for name in outputs)
    onnx.checker.check_model(draft, full_check=True)
    return draft


def counts(r: Result) -> Counter:
    return Counter(op_types(r.model))


def fused_node(r: Result, op_type: str = "FusedConv") -> onnx.NodeProto:
    (node,) = [n for n in r.model.graph.node if n.op_type == op_type]
    return node


def attrs_of(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def program_of(node: onnx.NodeProto) -> Program:
    return Program.from_text(attrs_of(node)["program"].decode())


def check_close(m: onnx.ModelProto, r: Result, rtol: float, feeds: dict | None = None) -> None:
    """Original vs optimized in ONNX Runtime CPU, and each fused node against its reference."""
    onnx.checker.check_model(r.model, full_check=True)
    feeds = random_feeds(m) if feeds is None else feeds
    for e, a in zip(run(m, feeds), run(r.model, feeds), strict=True):
        assert e.dtype == a.dtype and e.shape == a.shape
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol,
                                   atol=rtol * 0.1 * float(np.max(np.abs(e), initial=1.0)))
    check_programs(m, r, feeds, rtol=rtol)


# ---------------------------------------------------------------------------------------
# conv_relu: epilogues
# ---------------------------------------------------------------------------------------

def conv_then(nodes: list[onnx.NodeProto], extra_inits: dict | None = None, c: int = 3, k: int = 4,
              bias_too: bool = True, outputs: tuple[str, ...] = ("y",), **conv_attrs) -> onnx.ModelProto:
    """x -> Conv 3x3 pad 1 (k filters) -> c0 -> nodes."""
    conv_attrs = conv_attrs or {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    ins = ["x", "w", "b"] if bias_too else ["x", "w"]
    inits = {"w": weights(k, c, 3), **({"b": bias(k)} if bias_too else {}), **(extra_inits or {})}
    return model([N("Conv", ins, ["c0"], name="conv", **conv_attrs), *nodes], image(c), out(*outputs), inits)


def test_conv_relu_fuses_into_one_node():
    m = conv_then([N("Relu", ["c0"], ["y"], name="relu")])
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv"]
    node = fused_node(r)
    a = attrs_of(node)
    assert list(node.input) == ["x", "conv_relu_conv.weight_packed", "b"] and list(node.output) == ["y"]
    assert (a["kernel_shape"], a["strides"], a["pads"], a["dilations"], a["group"]) == ([3, 3], [1, 1], [1] * 4,
                                                                                        [1, 1], 1)
    assert not any(k.startswith("pool_") for k in a)
    assert node.overload.startswith("onnxfuse_conv_relu_") and len(node.overload) == len("onnxfuse_conv_relu_") + 12
    prog = program_of(node)
    assert prog.input_dtypes == ("f32",) and len(prog.outputs) == 1
    packed = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}
    np.testing.assert_array_equal(packed[node.input[1]], weights(4, 3, 3).transpose(2, 3, 1, 0))
    assert "w" not in packed  # the ONNX-layout weights are gone: only the packed copy is read
    f = r.fused[0]
    assert (f.kind, f.conv, f.pool, f.rank) == ("conv", ConvAttrs((3, 3), pads=(1, 1, 1, 1)), None, 4)
    assert f.source_nodes == ("Conv conv", "Relu relu") and f.input_modes == ("full",)
    (fn,) = r.model.functions
    assert [n.op_type for n in fn.node] == ["Transpose", "Conv", "Relu"]
    assert list(fn.node[0].input) == ["x1"] and helper.get_attribute_value(fn.node[0].attribute[0]) == [3, 2, 0, 1]
    assert list(fn.node[1].input) == ["x0", "t0", "x2"]


@pytest.mark.parametrize("epilogue,inits", [
    ([N("Clip", ["c0", "zero", "six"], ["y"])], {"zero": np.float32(0), "six": np.float32(6)}),
    ([N("LeakyRelu", ["c0"], ["y"], alpha=0.1)], {}),
    ([N("HardSwish", ["c0"], ["y"])], {}),
    ([N("Sigmoid", ["c0"], ["s"]), N("Mul", ["c0", "s"], ["y"])], {}),  # SiLU as YOLO exports it
    ([N("Mul", ["c0", "scale"], ["t"]), N("Add", ["t", "shift"], ["u"]), N("Relu", ["u"], ["y"])],
     {"scale": np.linspace(0.5, 1.5, 4, dtype=np.float32).reshape(4, 1, 1), "shift": np.float32(0.25)}),
], ids=["clip6", "leaky_relu", "hardswish", "silu", "per_channel_affine_relu"])
def test_epilogues_fuse(epilogue, inits):
    m = conv_then(epilogue, {k: np.asarray(v) for k, v in inits.items()})
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv"]
    assert len(r.fused[0].source_nodes) == 1 + len(epilogue)


def test_residual_add_relu_reads_the_shortcut_as_an_extra_input():
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
               N("Add", ["c0", "x"], ["a"], name="residual"), N("Relu", ["a"], ["y"], name="relu")],
              image(4), out("y"), {"w": weights(4, 4, 3), "b": bias(4)})
    r = check_fusion(m, expect_fused=1)
    node = fused_node(r)
    assert list(node.input)[::2] == ["x", "b"] and node.input[3] == "x"  # X, W, B, then the shortcut
    assert program_of(node).input_dtypes == ("f32", "f32")
    assert r.fused[0].input_modes == ("full", "full")


def test_conv_without_bias_gets_zeros():
    m = conv_then([N("Relu", ["c0"], ["y"])], bias_too=False)
    r = check_fusion(m, expect_fused=1)
    node = fused_node(r)
    zeros = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}[node.input[2]]
    assert zeros.dtype == np.float32 and zeros.shape == (4,) and not zeros.any()


@pytest.mark.parametrize("attrs,want", [
    ({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, ConvAttrs((3, 3), (2, 2), (1, 1, 1, 1))),
    ({"kernel_shape": [3, 3], "pads": [0, 1, 2, 0]}, ConvAttrs((3, 3), pads=(0, 1, 2, 0))),
    # 11 x 14: 2 rows of padding (1 + 1), 1 column (0 + 1 for UPPER, 1 + 0 for LOWER)
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, ConvAttrs((3, 3), (2, 2), (1, 0, 1, 1))),
    ({"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"}, ConvAttrs((3, 3), (2, 2), (1, 1, 1, 0))),
    ({"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2]},
     ConvAttrs((3, 3), pads=(2, 2, 2, 2), dilations=(2, 2))),
    ({"kernel_shape": [3, 3], "strides": [1, 2], "auto_pad": "VALID"}, ConvAttrs((3, 3), (1, 2))),
    ({"kernel_shape": [1, 1]}, ConvAttrs((1, 1))),
    ({"kernel_shape": [7, 7], "strides": [2, 2], "pads": [3, 3, 3, 3]}, ConvAttrs((7, 7), (2, 2), (3, 3, 3, 3))),
    ({"kernel_shape": [1, 5], "pads": [0, 2, 0, 2]}, ConvAttrs((1, 5), pads=(0, 2, 0, 2))),
], ids=["stride2", "asymmetric_pads", "same_upper", "same_lower", "dilation2", "valid_strides12",
        "1x1", "7x7_stride2", "1x5"])
def test_conv_geometry(attrs, want):
    r_, s_ = attrs["kernel_shape"]
    m = model([N("Conv", ["x", "w", "b"], ["c0"], name="conv", **attrs), N("Relu", ["c0"], ["y"])],
              image(3, 11, 14), out("y"), {"w": weights(5, 3, r_, s_), "b": bias(5)})
    r = check_fusion(m, expect_fused=1)
    assert r.fused[0].conv == want
    a = attrs_of(fused_node(r))
    assert "auto_pad" not in a and a["pads"] == list(want.pads)


def test_fp16_conv_relu():
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), N("Relu", ["c0"], ["y"])],
              image(3, dtype="float16"), out("y", dtype="float16"),
              {"w": weights(4, 3, 3, dtype="float16"), "b": bias(4, dtype="float16")})
    r = check_fusion(m, expect_fused=1, rtol=1e-2)
    node = fused_node(r)
    assert program_of(node).input_dtypes == ("f16",) and program_of(node).outputs[0][1] == "f16"
    packed = {t.name: t for t in r.model.graph.initializer}
    assert packed[node.input[1]].data_type == packed[node.input[2]].data_type == onnx.TensorProto.FLOAT16


def test_two_results_shrink_to_one():
    """Relu's output is a graph output and read by Sigmoid: the epilogue keeps Relu only."""
    m = conv_then([N("Relu", ["c0"], ["r"]), N("Sigmoid", ["r"], ["y"])], outputs=("r", "y"))
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv", "Sigmoid"]
    assert list(fused_node(r).output) == ["r"]


def test_identical_layers_share_one_function_and_other_shapes_do_not():
    nodes, inits, cur = [], {}, "x"
    for i, k in enumerate([4, 4, 4, 6]):
        c = 4 if i else 3
        if i == 1:
            c = 4
        nodes += [N("Conv", [cur, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                  N("Relu", [f"c{i}"], [f"r{i}"])]
        inits |= {f"w{i}": weights(k, c, 3, seed=i), f"b{i}": bias(k, seed=10 + i)}
        cur = f"r{i}"
    nodes[-1].output[0] = "y"
    m = model(nodes, image(3), out("y"), inits)
    r = check_fusion(m, expect_fused=4)
    names = [f.kernel_name for f in r.fused]
    assert names[1] == names[2] and len(set(names)) == 3  # C=3 K=4; C=4 K=4 (twice); C=4 K=6
    assert len(r.model.functions) == 3


def test_kernel_names_ignore_the_exporters_metadata():
    """The dynamo exporter writes each node's stack trace (the exporting torch's paths) into its
    metadata: one model exported on two machines must name, so cache, its kernels the same."""
    def exported(where):
        m = conv_then([N("Relu", ["c0"], ["r"]), N("Sigmoid", ["r"], ["y"])])
        for n in m.graph.node:
            n.doc_string = f"{n.op_type} from {where}"
            helper.set_metadata_props(n, {"pkg.torch.onnx.stack_trace": f'File "{where}/torch/nn/conv.py"'})
        return m

    here, there = (optimize_model(exported(p)) for p in ("/usr/lib/python3", "/tmp/venv/lib"))
    assert [f.kernel_name for f in here.fused] == [f.kernel_name for f in there.fused] != []


# ---------------------------------------------------------------------------------------
# What does not fuse, and why
# ---------------------------------------------------------------------------------------

def test_conv_output_read_elsewhere_is_not_fused():
    m = conv_then([N("Relu", ["c0"], ["y"]), N("Transpose", ["c0"], ["y2"], perm=[0, 1, 3, 2])], outputs=("y", "y2"))
    r = check_fusion(m, expect_fused=0)
    assert r.report.not_fused["conv output is also read elsewhere"] == 1


def test_conv_output_read_by_two_pointwise_groups_is_not_fused():
    """Relu(c) and Neg(Sigmoid(c)) are both results: no group with one result keeps c inside."""
    m = conv_then([N("Relu", ["c0"], ["y"]), N("Sigmoid", ["c0"], ["z"]), N("Neg", ["z"], ["y2"])],
                  outputs=("y", "y2"))
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["Conv", "Relu", "PointwiseChain"]  # Sigmoid + Neg
    assert r.report.not_fused["conv output is also read elsewhere"] == 1


def test_conv_output_that_is_a_graph_output_is_not_fused():
    m = conv_then([N("Relu", ["c0"], ["y"])], outputs=("y", "c0"))
    r = check_fusion(m, expect_fused=0)
    assert r.report.not_fused == {"conv output is also read elsewhere": 1, "no elementwise neighbour to fuse with": 1}


@pytest.mark.parametrize("group,k", [(2, 4), (4, 4), (4, 8)], ids=["grouped", "depthwise", "depthwise-multiplier2"])
def test_grouped_convs_fuse_on_the_gpu_path_only(group, k):
    """conv_grouped is an NHWC-only pattern: the Triton direct loop beats cuDNN, the library's
    CPU kernel loses to ONNX Runtime's CPU conv."""
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group),
               N("Relu", ["c0"], ["y"])], image(4), out("y"), {"w": weights(k, 4 // group, 3), "b": bias(k)})
    r = check_fusion(m, expect_fused=1, layout="nhwc")
    assert attrs_of(fused_node(r))["group"] == group and r.report.patterns_applied == {"conv_grouped": 1}
    r = check_fusion(m, expect_fused=0)
    assert r.report.not_fused["grouped convolution"] == 1


def test_pattern_for_group_1_leaves_grouped_convs():
    patterns = [p for p in load_patterns() if p.name == "conv_relu"]
    patterns = [dataclasses.replace(p, match=dataclasses.replace(p.match, group=1)) for p in patterns]
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=4),
               N("Relu", ["c0"], ["y"])], image(4), out("y"), {"w": weights(4, 1, 3), "b": bias(4)})
    r = check_fusion(m, expect_fused=0, patterns=patterns)
    assert r.report.not_fused["grouped convolution"] == 1


def test_conv_without_epilogue_is_not_fused():
    m = model([N("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3])], image(3), out("y"), {"w": weights(4, 3, 3)})
    r = check_fusion(m, expect_fused=0)
    assert r.report.not_fused == {"conv without a fusible epilogue": 1}


@pytest.mark.parametrize("case,reason", [
    ("weights_input", "conv weights are not a constant"),
    ("conv1d", "1-D convolution"),
    ("same_with_dynamic_size", "auto_pad SAME_UPPER with an unknown input size"),
    ("float64", "float64 dtype"),
])
def test_convs_onnxfuse_does_not_handle(case, reason):
    inits = {"w": weights(4, 3, 3)}
    inputs = image(3)
    attrs = {"kernel_shape": [3, 3]}
    if case == "weights_input":
        inputs = {**inputs, "w": ("float32", [4, 3, 3, 3])}
        inits = {}
    elif case == "conv1d":
        inputs = {"x": ("float32", ["N", 3, 10])}
        inits = {"w": weights(4, 3, 3)[:, :, :, 0]}
        attrs = {"kernel_shape": [3]}
    elif case == "same_with_dynamic_size":
        inputs = {"x": ("float32", ["N", 3, "H", "W"])}
        attrs = {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"}
    else:
        inputs = image(3, dtype="float64")
        inits = {"w": weights(4, 3, 3).astype(np.float64)}
    m = model([N("Conv", ["x", "w"], ["c0"], **attrs), N("Relu", ["c0"], ["y"])], inputs,
              out("y", dtype="float64" if case == "float64" else "float32"), inits)
    if case == "float64":  # ONNX Runtime's CPU provider has no float64 Conv: nothing to run
        r = optimize_model(m)
        assert op_types(r.model) == ["Conv", "Relu"] and r.report.not_fused == {reason: 2}  # Conv, Relu
        return
    else:
        feeds = random_feeds(m) if case != "same_with_dynamic_size" else random_feeds(m, {"H": 9, "W": 6})
        if case == "weights_input":
            feeds["w"] = weights(4, 3, 3)
        r = check_fusion(m, expect_fused=0, feeds=feeds)
    assert r.report.not_fused.get(reason) == 1, r.report.not_fused


def test_dynamic_image_size_fuses_without_the_size():
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
               N("Relu", ["c0"], ["t"]), N("Mul", ["t", "scale"], ["y"])],
              {"x": ("float32", ["N", 3, "H", "W"])}, out("y"),
              {"w": weights(4, 3, 3), "b": bias(4), "scale": np.linspace(1, 2, 4, dtype=np.float32).reshape(4, 1, 1)})
    r = check_fusion(m, expect_fused=1, feeds=random_feeds(m, {"N": 2, "H": 9, "W": 13}))
    assert op_types(r.model) == ["FusedConv"]


def test_two_convs_into_one_add_fuse_once():
    """ResNet's downsampling block: Conv -> Add(., Conv(shortcut)) -> Relu. The first conv
    takes Add and Relu; nothing is left after the other one."""
    m = model([N("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
               N("Conv", ["x", "w2", "b2"], ["c2"], kernel_shape=[1, 1], strides=[2, 2]),
               N("Add", ["c1", "c2"], ["a"]), N("Relu", ["a"], ["y"])],
              image(3), out("y"), {"w1": weights(4, 3, 3), "b1": bias(4), "w2": weights(4, 3, 1, seed=5),
                                   "b2": bias(4, seed=6)})
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["Conv", "FusedConv"]
    assert r.report.not_fused == {"conv without a fusible epilogue": 1}


# ---------------------------------------------------------------------------------------
# Max pools
# ---------------------------------------------------------------------------------------

def test_conv_relu_maxpool_fuses_a_tiling_pool():
    m = conv_then([N("Relu", ["c0"], ["r"]), N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])])
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv"]
    a = attrs_of(fused_node(r))
    assert (a["pool_kernel"], a["pool_strides"], a["pool_pads"], a["pool_dilations"], a["pool_ceil_mode"]) == \
        ([2, 2], [2, 2], [0] * 4, [1, 1], 0)
    assert r.fused[0].pattern == "conv_relu_maxpool" and r.fused[0].pool == PoolAttrs((2, 2), (2, 2))
    assert [n.op_type for n in r.model.functions[0].node] == ["Transpose", "Conv", "Relu", "MaxPool"]


def test_conv_maxpool_without_epilogue_fuses():
    m = conv_then([N("MaxPool", ["c0"], ["y"], kernel_shape=[2, 2], strides=[2, 2])])
    r = check_fusion(m, expect_fused=1)
    prog = program_of(fused_node(r))
    assert prog.instrs == () and prog.outputs == ((0, "f32"),)


def test_overlapping_pool_stays_after_conv_relu():
    """MaxPool 3x3 stride 2 pad 1 does not tile: conv_relu fuses, the pool stays (its input
    comes from the FusedConv, not from a pointwise op); on the GPU path (layout nhwc) it
    becomes a FusedMaxPool of its own (pattern maxpool)."""
    m = conv_then([N("Relu", ["c0"], ["r"]),
                   N("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])])
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv", "MaxPool"]
    assert r.fused[0].pattern == "conv_relu" and r.fused[0].pool is None
    assert r.report.not_fused == {"its input is computed by another fused node": 1}
    r = check_fusion(m, expect_fused=2, layout="nhwc")
    assert op_types(r.model) == ["FusedConv", "FusedMaxPool"]
    assert r.fused[1].pattern == "maxpool" and r.fused[1].program.to_text().endswith("output %0 f32\n")


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [1, 2], "pads": [1, 0, 1, 0], "dilations": [2, 1]},
    {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
], ids=["3x3s2p1_ceil", "2x2_ceil_odd", "dilated", "same_upper"])
def test_relu_maxpool_fuses_any_pool(attrs):
    m = model([N("Relu", ["x"], ["r"]), N("MaxPool", ["r"], ["y"], **attrs)], image(4, 9, 11), out("y"))
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedMaxPool"]
    node = fused_node(r, "FusedMaxPool")
    assert list(node.input) == ["x"] and r.fused[0].kind == "maxpool"
    assert {"pool_kernel", "pool_strides", "pool_pads", "pool_dilations", "pool_ceil_mode", "program"} == \
        set(attrs_of(node))


def test_prologue_with_a_broadcast_input():
    m = model([N("Mul", ["x", "scale"], ["t"]), N("Add", ["t", "shift"], ["u"]), N("Relu", ["u"], ["r"]),
               N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
              image(4, 8, 8), out("y"),
              {"scale": np.linspace(0.5, 2, 4, dtype=np.float32).reshape(4, 1, 1), "shift": np.float32(0.1)})
    r = check_fusion(m, expect_fused=1)
    node = fused_node(r, "FusedMaxPool")
    assert list(node.input) == ["x", "scale"] and r.fused[0].input_modes == ("full", "strided")
    assert len(r.fused[0].source_nodes) == 4


def test_prologue_read_elsewhere_keeps_only_the_last_ops():
    """t = x * 2 is also a graph output: the prologue is Relu alone, Mul stays out."""
    m = model([N("Mul", ["x", "two"], ["t"]), N("Relu", ["t"], ["r"]),
               N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
              image(4, 8, 8), out("y", "t"), {"two": np.float32(2)})
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["Mul", "FusedMaxPool"]
    assert list(fused_node(r, "FusedMaxPool").input) == ["t"]


def test_maxpool_reasons():
    m = model([N("MaxPool", ["x"], ["p"], kernel_shape=[2, 2]), N("Relu", ["p"], ["r"]),
               N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2]), N("Sigmoid", ["r"], ["z"])],
              image(4, 8, 8), out("y", "z"))
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["MaxPool", "PointwiseChain", "MaxPool"]  # Relu + Sigmoid
    assert r.report.not_fused == {"no pointwise op before the max pool": 1, "max pool input is also read elsewhere": 1}
    # on the GPU path (pattern maxpool) both pools run alone as FusedMaxPool
    r = check_fusion(m, expect_fused=3, layout="nhwc")
    assert op_types(r.model) == ["FusedMaxPool", "PointwiseChain", "FusedMaxPool"]


def test_maxpool_with_indices_is_not_fused():
    m = model([N("Relu", ["x"], ["r"]), N("MaxPool", ["r"], ["y", "i"], kernel_shape=[2, 2])],
              image(4, 8, 8), {"y": ("float32", None), "i": ("int64", None)})
    r = check_fusion(m, expect_fused=0)
    assert r.report.not_fused["MaxPool's Indices output is used"] == 1


# ---------------------------------------------------------------------------------------
# BatchNormalization folding
# ---------------------------------------------------------------------------------------

# Folding changes the arithmetic (one multiply-add per weight instead of a normalization
# after the sum): results differ from the original by a few ulps of the conv's scale, so
# these comparisons use rtol 1e-4 instead of the 1e-5 of unfolded models.
FOLD_RTOL = 1e-4


def conv_bn(extra: list[onnx.NodeProto], bias_too: bool = True, dtype: str = "float32", k: int = 6,
            outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    inits = {"w": weights(k, 3, 3, dtype=dtype), **bn_params(k, dtype=dtype)}
    if bias_too:
        inits["b"] = bias(k, dtype=dtype)
    ins = ["x", "w", "b"] if bias_too else ["x", "w"]
    return model([N("Conv", ins, ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
                  bn("c0", "n0", epsilon=1e-3), *extra], image(3, 8, 8, dtype=dtype),
                 out(*outputs, dtype=dtype), inits)


@pytest.mark.parametrize("bias_too", [True, False], ids=["bias", "no_bias"])
def test_conv_bn_relu(bias_too):
    m = conv_bn([N("Relu", ["n0"], ["y"])], bias_too)
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedConv"] and r.report.folded_batchnorm == 1
    assert "folded_batchnorm: 1" in r.report.summary()
    assert [n.op_type for n in r.model.functions[0].node] == ["Transpose", "Conv", "Relu"]
    check_close(m, r, FOLD_RTOL)


def test_conv_bn_relu_maxpool():
    m = conv_bn([N("Relu", ["n0"], ["r"]), N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])])
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedConv"] and r.fused[0].pattern == "conv_relu_maxpool"
    check_close(m, r, FOLD_RTOL)


def _ort_folded(m: onnx.ModelProto, tmp_path) -> dict[str, np.ndarray]:
    """The initializers of `m` after ONNX Runtime's own basic graph optimizations (its
    ConvBNFusion among them), as it writes them out."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(tmp_path / "ort_optimized.onnx")
    ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "ort_optimized.onnx"))
    assert "BatchNormalization" not in op_types(opt)  # ORT folded it
    return {t.name: numpy_helper.to_array(t) for t in opt.graph.initializer}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("bias_too", [True, False], ids=["bias", "no_bias"])
def test_fold_is_onnxruntimes_bit_for_bit(tmp_path, dtype, bias_too):
    """The folded weights and bias are the ones ONNX Runtime's ConvBNFusion computes, bit for
    bit (fp32 and fp16, with and without a conv bias)."""
    m = conv_bn([N("Relu", ["n0"], ["y"])], bias_too, dtype=dtype)
    folded, n = fold_batchnorm(m)
    assert n == 1 and op_types(folded) == ["Conv", "Relu"]
    ours = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}
    conv = folded.graph.node[0]
    w, b = ours[conv.input[1]], ours[conv.input[2]]
    theirs = _ort_folded(m, tmp_path)
    (tw,) = [a for a in theirs.values() if a.shape == w.shape]
    (tb,) = [a for a in theirs.values() if a.shape == b.shape]
    assert w.dtype == tw.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(w.view(np.uint8), tw.view(np.uint8))
    np.testing.assert_array_equal(b.view(np.uint8), tb.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_function_bodies_give_the_original_bit_for_bit(dtype):
    """Without the library the fused node runs its function body: under ONNX Runtime's
    default optimizations (which fold the original's BatchNormalization the same way) the
    outputs are the original's bit for bit. With ORT's optimizations off the original
    normalizes after the sum, and the results differ (README, Reliability)."""
    m = conv_bn([N("Relu", ["n0"], ["y"])], dtype=dtype, k=32)
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedConv"] and r.report.folded_batchnorm == 1
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 3, 8, 8)).astype(dtype)}

    def run(model, level):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)

    default = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    (want,), (got,) = run(m, default), run(r.model, default)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    (unfolded,) = run(m, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert not np.array_equal(got, unfolded)
    rtol, atol = (FOLD_RTOL, 1e-6) if dtype == "float32" else (1e-2, 1e-3)
    np.testing.assert_allclose(got.astype(np.float64), unfolded.astype(np.float64), rtol=rtol, atol=atol)


def test_batchnorm_writing_a_graph_output_is_not_folded():
    """ONNX Runtime does not fold a BatchNormalization whose output is a graph output; neither
    does onnxfuse, so that the folding stays ORT's own."""
    _, n = fold_batchnorm(conv_bn([], outputs=("n0",)))
    assert n == 0


def test_fold_fp16():
    m = conv_bn([N("Relu", ["n0"], ["y"])], dtype="float16")
    r = optimize_model(m)
    assert op_types(r.model) == ["FusedConv"] and r.report.folded_batchnorm == 1
    assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in r.model.graph.initializer)
    check_close(m, r, 1e-2)


def test_fold_keeps_shared_weights():
    """Two Convs read the same weights; only one is followed by BatchNormalization."""
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), bn("c0", "n0"),
               N("Conv", ["x", "w", "b"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
               N("Add", ["n0", "c1"], ["y"])], image(3, 8, 8), out("y"),
              {"w": weights(6, 3, 3), "b": bias(6), **bn_params(6)})
    folded, n = fold_batchnorm(m)
    assert n == 1
    convs = [node for node in folded.graph.node if node.op_type == "Conv"]
    assert list(convs[1].input) == ["x", "w", "b"] and convs[0].input[1:] != convs[1].input[1:]
    r = optimize_model(m)
    assert r.report.folded_batchnorm == 1
    check_close(m, r, FOLD_RTOL)


@pytest.mark.parametrize("case", ["conv_output_read_elsewhere", "conv_output_is_graph_output", "variable_scale",
                                  "training_mode", "mean_output_used"])
def test_batchnorm_not_folded(case):
    k = 6
    inits = {"w": weights(k, 3, 3), **bn_params(k)}
    inputs, outputs = image(3, 8, 8), out("y")
    nodes = [N("Conv", ["x", "w"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), bn("c0", "y")]
    opset = 15
    if case == "conv_output_read_elsewhere":
        nodes.append(N("Relu", ["c0"], ["z"]))
        outputs = out("y", "z")
    elif case == "conv_output_is_graph_output":
        outputs = out("y", "c0")
    elif case == "variable_scale":
        del inits["bn.scale"]
        inputs = {**inputs, "bn.scale": ("float32", [k])}
    elif case == "training_mode":
        nodes[1] = N("BatchNormalization", list(nodes[1].input), ["y", "rm", "rv"], training_mode=1)
    else:
        nodes[1] = N("BatchNormalization", list(nodes[1].input), ["y", "rm", "rv", "sm", "sv"])
        opset = 7
    m = model(nodes, inputs, outputs, inits, opset=opset)
    _, n = fold_batchnorm(m)
    assert n == 0


def test_chained_batchnorms_fold_twice():
    m = model([N("Conv", ["x", "w"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]), bn("c0", "n0"),
               bn("n0", "n1", prefix="bn2"), N("Relu", ["n1"], ["y"])], image(3, 8, 8), out("y"),
              {"w": weights(6, 3, 3), **bn_params(6), **bn_params(6, "bn2", seed=7)})
    r = optimize_model(m)
    assert r.report.folded_batchnorm == 2 and op_types(r.model) == ["FusedConv"]
    check_close(m, r, FOLD_RTOL)


# ---------------------------------------------------------------------------------------
# unfuse, the models of models/build.py
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["conv", "conv_pool", "maxpool"])
def test_unfuse_restores_a_valid_model(which):
    if which == "maxpool":
        m = model([N("Relu", ["x"], ["r"], name="relu"),
                   N("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1, name="pool")],
                  image(4, 9, 9), out("y"))
    else:
        pool = [N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2], name="pool")]
        m = conv_then([N("Relu", ["c0"], ["r" if which == "conv_pool" else "y"], name="relu"),
                       *(pool if which == "conv_pool" else [])])
    r = optimize_model(m)
    (f,) = r.fused
    unfuse(r.model, f)
    onnx.checker.check_model(r.model, full_check=True)
    assert not r.model.functions and all(n.domain != "onnxfuse" for n in r.model.graph.node)
    names = [(n.op_type, n.name) for n in r.model.graph.node]
    if which == "maxpool":
        assert names == [("Relu", "relu"), ("MaxPool", "pool")]
    else:
        # the packed weights become ONNX weights again: no Transpose is left
        assert names[:2] == [("Conv", "conv"), ("Relu", "relu")]
        assert not any(t.name.endswith("weight_packed") for t in r.model.graph.initializer)
    feeds = random_feeds(m)
    for e, a in zip(run(m, feeds), run(r.model, feeds), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,make,want", [
    ("relu_maxpool", lambda: mb.relu_maxpool(8, 16), {"FusedMaxPool": 1}),
    ("conv_relu", lambda: mb.conv_relu(8, 16), {"FusedConv": 1}),
    ("conv_relu_maxpool", lambda: mb.conv_relu_maxpool(8, 16), {"FusedConv": 1}),
    ("vgg_stack", lambda: mb.vgg_stack(4, 8, 3, 32), {"FusedConv": 4}),
])
def test_build_models_fuse(name, make, want):
    m = make()
    r = check_fusion(m, feeds=random_feeds(m, {"N": 2}))
    assert counts(r) == Counter(want), r.report.summary()
    assert r.report.not_fused == {}
    if name in ("conv_relu_maxpool", "vgg_stack"):
        assert all(f.pattern == "conv_relu_maxpool" and f.pool == PoolAttrs((2, 2), (2, 2)) for f in r.fused)


# ---------------------------------------------------------------------------------------
# Pattern files of the new kinds
# ---------------------------------------------------------------------------------------

CONV_PATTERN = textwrap.dedent("""\
    name: my_conv
    description: Conv and Relu only.
    priority: 5
    match:
      kind: conv_epilogue
      ops: [Relu]
      dtypes: [float32]
      group: 1
      pool: none
    replace:
      op_type: FusedConv
      kernel: conv
    example:
      inputs: {x: [float32, [N, 2, 5, 5]]}
      initializers: {w: [float32, [3, 2, 3, 3]], b: [float32, [3], 0.5]}
      nodes:
        - [Conv, [x, w, b], [c], {kernel_shape: [3, 3]}]
        - [Relu, [c], [y]]
      outputs: [y]
      expect: {FusedConv: 1}
    """)


def test_user_conv_pattern_runs_alone(tmp_path):
    path = tmp_path / "my_conv.yaml"
    path.write_text(CONV_PATTERN)
    p = load_pattern_file(path)
    assert p.match == ConvParams(frozenset({"Relu"}), frozenset({"float32"}), 1, "none")
    m = example_model(p)
    init = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    assert (init["b"] == 0.5).all() and init["w"].shape == (3, 2, 3, 3) and init["w"].std() > 0
    r = optimize_model(m, [p])
    assert op_types(r.model) == ["FusedConv"] and r.fused[0].pattern == "my_conv"


def test_alone_pattern_with_ops_falls_back_to_the_conv_alone(tmp_path):
    """alone: true with epilogue ops: a conv whose output other nodes also read fuses alone
    (its output goes to every reader) instead of not fusing."""
    path = tmp_path / "alone.yaml"
    path.write_text(CONV_PATTERN.replace("  pool: none\n", "  pool: none\n  alone: true\n"))
    p = load_pattern_file(path)
    assert p.match.alone
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
               N("Relu", ["c0"], ["y"]), N("Sigmoid", ["c0"], ["z"])],
              image(4), out("y", "z"), {"w": weights(4, 4, 3), "b": bias(4)})
    r = optimize_model(m, [p])
    assert op_types(r.model) == ["FusedConv", "Relu", "Sigmoid"]
    assert r.fused[0].program.to_text().endswith("output %0 f32\n")
    check_close(m, r, 1e-5)


def test_group_any_fuses_grouped_convolutions(tmp_path):
    path = tmp_path / "any.yaml"
    path.write_text(CONV_PATTERN.replace("group: 1", "group: any"))
    p = load_pattern_file(path)
    m = model([N("Conv", ["x", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2),
               N("Relu", ["c0"], ["y"])], image(4), out("y"), {"w": weights(6, 2, 3), "b": bias(6)})
    r = optimize_model(m, [p])
    assert op_types(r.model) == ["FusedConv"] and r.fused[0].conv.group == 2
    packed = {t.name: numpy_helper.to_array(t) for t in r.model.graph.initializer}[r.fused[0].inputs[1]]
    assert packed.shape == (3, 3, 2, 6)  # [R, S, C/group, K]
    check_close(m, r, 1e-5)


@pytest.mark.parametrize("edit,field", [
    (("pool: none", "pool: sometimes"), "match.pool"),
    (("group: 1", "group: 0"), "match.group"),
    (("group: 1", "group: true"), "match.group"),
    (("kernel: conv", "kernel: pointwise"), "replace.kernel"),
    (("dtypes: [float32]", "dtypes: [bfloat16]"), "match.dtypes"),
    (("pool: none", "min_nodes: 2"), "match.min_nodes"),
    (("b: [float32, [3], 0.5]", "b: [float32, 3]"), "example.initializers.b"),
    (("b: [float32, [3], 0.5]", "b: [int64, [3]]"), "example.initializers.b"),
    (("kind: conv_epilogue", "kind: pool_prologue"), "match.group"),  # a conv field in a pool pattern
])
def test_bad_conv_pattern_names_file_and_field(tmp_path, edit, field):
    old, new = edit
    assert old in CONV_PATTERN
    path = tmp_path / "p.yaml"
    path.write_text(CONV_PATTERN.replace(old, new))
    with pytest.raises(PatternError) as e:
        load_pattern_file(path)
    assert str(e.value).startswith(f"{path}: {field}:"), str(e.value)


def test_builtin_conv_patterns_run_in_priority_order():
    names = [p.name for p in load_patterns()]
    assert names.index("conv_relu_maxpool") < names.index("conv_relu") < names.index("relu_maxpool") \
        < names.index("pointwise_chain")


def test_pointwise_ops_around_a_conv_do_not_make_a_cycle():
    """s = Sigmoid(x) feeds the conv and Mul(s, Relu(conv)) reads it: Mul and Tanh join the
    epilogue (s is an extra input) and Sigmoid stays apart (one node with Sigmoid and Mul
    would both feed and read the FusedConv)."""
    m = model([N("Sigmoid", ["x"], ["s"]), N("Conv", ["s", "w", "b"], ["c0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
               N("Relu", ["c0"], ["r"]), N("Mul", ["s", "r"], ["t"]), N("Tanh", ["t"], ["y"])],
              image(4), out("y"), {"w": weights(4, 4, 3), "b": bias(4)})
    r = check_fusion(m)
    assert op_types(r.model) == ["Sigmoid", "FusedConv"]
    assert list(fused_node(r).input)[3:] == ["s"] and len(r.fused[0].source_nodes) == 4


def test_resnet_style_block_exported_by_torch():
    """A torch module (stem Conv-BN-ReLU-MaxPool 3x3, a basic block with a downsampling
    shortcut, Conv-BN-SiLU, Conv-Hardswish-MaxPool 2x2) exported with BatchNormalization
    kept in the graph: the five BNs fold, five convs fuse, the shortcut conv and the
    overlapping pool stay."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
            self.c1, self.b1 = nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16)
            self.c2, self.b2 = nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
            self.down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
            self.head = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.SiLU(),
                                      nn.Conv2d(16, 8, 1), nn.Hardswish(), nn.MaxPool2d(2))

        def forward(self, x):
            x = self.stem(x)
            return self.head(torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.down(x)))

    torch.manual_seed(0)
    net = Net().eval()
    for bn_mod in net.modules():
        if isinstance(bn_mod, nn.BatchNorm2d):
            bn_mod.running_mean.uniform_(-0.2, 0.2)
            bn_mod.running_var.uniform_(0.5, 1.5)
            bn_mod.weight.data.uniform_(0.5, 1.5)
            bn_mod.bias.data.uniform_(-0.2, 0.2)
    f = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():  # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 32, 32),), f, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
                          do_constant_folding=False)  # keep BatchNormalization in the graph
    m = onnx.load_from_string(f.getvalue())
    assert Counter(op_types(m))["BatchNormalization"] == 5
    r = optimize_model(m)
    assert r.report.folded_batchnorm == 5
    assert r.report.patterns_applied == {"conv_relu": 4, "conv_relu_maxpool": 1}
    assert counts(r) == Counter({"FusedConv": 5, "Conv": 1, "MaxPool": 1})
    assert sorted(len(f.source_nodes) for f in r.fused) == [2, 2, 3, 3, 3]  # Conv+Add+Relu, SiLU, Hardswish+pool
    check_close(m, r, FOLD_RTOL, random_feeds(m, {"N": 2}))
    # the GPU path's patterns fuse the shortcut conv and the overlapping pool too
    r = optimize_model(m, layout="nhwc")
    assert counts(r) == Counter({"FusedConv": 6, "FusedMaxPool": 1})
    check_close(m, r, FOLD_RTOL, random_feeds(m, {"N": 2}))


def test_tiling_pool_that_leaves_rows_over():
    """MaxPool 3x3 stride 3 on a 10 x 12 conv output: floor mode drops the last row; the
    windows still tile what they cover, so the pool joins the conv."""
    m = conv_then([N("Relu", ["c0"], ["r"]), N("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[3, 3])])
    r = check_fusion(m, expect_fused=1)
    assert op_types(r.model) == ["FusedConv"] and r.fused[0].pool == PoolAttrs((3, 3), (3, 3))
    assert [d.dim_value for d in r.model.graph.output[0].type.tensor_type.shape.dim][1:] == [4, 3, 4]
