"""On an NVIDIA GPU: models with FusedConv / FusedMaxPool nodes give the original's outputs
on ONNX Runtime's CUDA execution provider, with and without CUDA graphs, at several batch
sizes, and the fused nodes really run there.

Tolerances. The original runs with TF32 off (exact fp32 convolutions). The fused convs
multiply on tensor cores in the precision `onnxfuse optimize --conv-precision` chose:
- ``ieee``: fp32 FMA; only the summation order differs: rtol 1e-5, atol 1e-5 x max|y|;
- ``tf32`` (the default): both operands rounded to the nearest TF32 value (10-bit
  mantissas: at most 2^-11, about 4.9e-4, relative per operand, no bias). The kernels before
  the rounding truncated instead and were seen at 5e-4 to 7e-4 of max|y| on 64-channel 3x3
  layers (H200); rounding halves the worst case per operand. One layer is checked at
  2e-3 x max|y| and the stacks at 1e-2 x max|y| (errors add up through 4 layers).
fp16 models: rtol 1e-2, atol 1e-2 x max|y|."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from models.build import conv_relu, conv_relu_maxpool, relu_maxpool, vgg_stack  # noqa: E402
from onnxfuse import optimize_model  # noqa: E402
from onnxfuse.compile import local_gpu_archs  # noqa: E402
from onnxfuse.kernels import compile_fused  # noqa: E402
from tests.test_gpu import session  # noqa: E402
from tests.util import random_feeds  # noqa: E402

pytestmark = pytest.mark.gpu(torch=True)  # skipped without them: tests/conftest.py
N = helper.make_node


def fused(m: onnx.ModelProto, precision: str) -> tuple[onnx.ModelProto, set[str]]:
    r = optimize_model(m)
    assert r.fused, r.report.summary()
    info, _ = compile_fused(r.model, r.fused, local_gpu_archs(), conv_precision=precision)
    assert not info["failed"], info["failed"]
    return r.model, {n.op_type for n in r.model.graph.node if n.domain == "onnxfuse"}


def check(expected, actual, rel: float, what: str) -> None:
    for e, a in zip(expected, actual, strict=True):
        assert e.shape == a.shape and e.dtype == a.dtype, what
        scale = float(np.abs(e.astype(np.float64)).max()) or 1.0
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rel, atol=rel * scale,
                                   err_msg=what)


def _conv(name, x, w, b, y, k=3, stride=1, pad=1, dil=1):
    ins = [x, w.name] + ([b.name] if b is not None else [])
    return N("Conv", ins, [y], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4,
             dilations=[dil, dil], name=name)


def _image_model(nodes, name: str, c: int, size: int, inits, outputs=("y",)) -> onnx.ModelProto:
    """Opset 17, IR 10, shapes inferred: input x [N, c, size, size], outputs y (by default)."""
    g = helper.make_graph(nodes, name,
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", c, size, size])],
                          [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return onnx.shape_inference.infer_shapes(m)


def _weight(rng, name: str, *shape: int) -> onnx.TensorProto:
    """A float32 initializer of standard normals over sqrt(fan-in) (the first dim is fan-out)."""
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32), name)


def residual_block(c: int = 32, size: int = 20, seed: int = 0) -> onnx.ModelProto:
    """ResNet's basic block: Conv-BN-Relu, Conv-BN, Add(x), Relu; plus a strided 1x1 conv
    with SiLU (as YOLO exports it) and an asymmetric-padded dilated conv with LeakyRelu."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [init("w1", c, c, 3, 3, scale=(c * 9) ** -0.5), init("w2", c, c, 3, 3, scale=(c * 9) ** -0.5),
             init("w3", c, c, 1, 1, scale=c ** -0.5), init("b3", c),
             init("w4", c, c, 3, 3, scale=(c * 9) ** -0.5), init("b4", c)]
    for i in (1, 2):
        inits += [numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"bn{i}.scale"),
                  init(f"bn{i}.bias", c, scale=0.1), init(f"bn{i}.mean", c, scale=0.1),
                  numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), f"bn{i}.var")]
    nodes = [
        N("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
        N("BatchNormalization", ["c1", "bn1.scale", "bn1.bias", "bn1.mean", "bn1.var"], ["n1"], name="bn1"),
        N("Relu", ["n1"], ["r1"], name="relu1"),
        N("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
        N("BatchNormalization", ["c2", "bn2.scale", "bn2.bias", "bn2.mean", "bn2.var"], ["n2"], name="bn2"),
        N("Add", ["n2", "x"], ["a"], name="add"),
        N("Relu", ["a"], ["r2"], name="relu2"),
        N("Conv", ["r2", "w3", "b3"], ["c3"], kernel_shape=[1, 1], strides=[2, 2], name="conv3"),
        N("Sigmoid", ["c3"], ["s3"], name="sig"),
        N("Mul", ["c3", "s3"], ["silu"], name="silu"),
        N("Conv", ["silu", "w4", "b4"], ["c4"], kernel_shape=[3, 3], pads=[2, 1, 0, 2], dilations=[2, 1],
          name="conv4"),
        N("LeakyRelu", ["c4"], ["y"], alpha=0.1, name="leaky"),
    ]
    return _image_model(nodes, "residual_block", c, size, inits)


def conv_pool3(c: int = 16, size: int = 19) -> onnx.ModelProto:
    """Conv 3x3 + Relu + MaxPool 3x3 stride 3: a tiling window of 9 rows, padded to 16 in the
    kernel, on a size that leaves a row and a column over."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) / (c * 9) ** 0.5).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b")]
    nodes = [N("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
             N("Relu", ["c"], ["r"], name="relu"),
             N("MaxPool", ["r"], ["y"], kernel_shape=[3, 3], strides=[3, 3], name="pool")]
    return _image_model(nodes, "conv_pool3", c, size, inits)


def mobile_block(c: int = 16, e: int = 72, size: int = 29) -> onnx.ModelProto:
    """MobileNetV3's block: 1x1 expand + HardSwish, 5x5 stride-2 depthwise + Relu, a
    squeeze-excite (GlobalAveragePool, 1x1, Relu, 1x1, HardSigmoid, Mul), 1x1 project; then
    a depthwise conv with channel multiplier 2 and a grouped conv of 4 channels per group."""
    rng = np.random.default_rng(4)

    init = functools.partial(_weight, rng)
    inits = [init("w1", e, c, 1, 1), init("w2", e, 1, 5, 5), init("b2", e), init("w3", e // 4, e, 1, 1),
             init("w4", e, e // 4, 1, 1), init("w5", c, e, 1, 1), init("w6", 2 * c, 1, 3, 3),
             init("w7", 2 * c, 4, 3, 3)]
    nodes = [N("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1], name="expand"),
             N("HardSwish", ["c1"], ["h1"], name="hswish"),
             N("Conv", ["h1", "w2", "b2"], ["c2"], kernel_shape=[5, 5], strides=[2, 2], pads=[2, 2, 2, 2], group=e,
               name="dw"),
             N("Relu", ["c2"], ["r2"], name="relu"),
             N("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             N("Conv", ["g", "w3"], ["s1"], kernel_shape=[1, 1], name="se1"),
             N("Relu", ["s1"], ["s2"], name="se_relu"),
             N("Conv", ["s2", "w4"], ["s3"], kernel_shape=[1, 1], name="se2"),
             N("HardSigmoid", ["s3"], ["s4"], alpha=1 / 6, name="se_hsig"),
             N("Mul", ["r2", "s4"], ["se"], name="se_mul"),
             N("Conv", ["se", "w5"], ["c5"], kernel_shape=[1, 1], name="project"),
             N("Conv", ["c5", "w6"], ["c6"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=c, name="dw_mult2"),
             N("Relu", ["c6"], ["r6"], name="relu6"),
             N("Conv", ["r6", "w7"], ["c7"], kernel_shape=[3, 3], pads=[0, 1, 2, 1], group=2 * c // 4, name="grouped"),
             N("Sigmoid", ["c7"], ["y"], name="sig")]
    return _image_model(nodes, "mobile_block", c, size, inits)


CASES = {
    "conv_pool3": conv_pool3,
    "mobile_block": mobile_block,
    "conv_relu": lambda: conv_relu(channels=32, size=30),
    "conv_relu_maxpool": lambda: conv_relu_maxpool(channels=32, size=30),
    "relu_maxpool": lambda: relu_maxpool(channels=16, size=31),
    "vgg_stack": lambda: vgg_stack(blocks=4, channels=32, size=64),
    "residual_block": residual_block,
}
EXPECT = {"conv_pool3": {"FusedConv"}, "mobile_block": {"FusedConv"}, "conv_relu": {"FusedConv"},
          "conv_relu_maxpool": {"FusedConv"},
          "relu_maxpool": {"FusedMaxPool"},
          "vgg_stack": {"FusedConv"}, "residual_block": {"FusedConv"}}
TF32_TOL = {"vgg_stack": 1e-2, "residual_block": 1e-2, "mobile_block": 1e-2}


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_conv_matches_original_on_cuda(name, precision, tmp_path):
    m = CASES[name]()
    f, ops = fused(m, precision)
    assert EXPECT[name] <= ops, ops
    original = session(m, library=False)
    sess = session(f, library=True, profile=str(tmp_path / "prof"))
    rel = 1e-5 if precision == "ieee" else TF32_TOL.get(name, 2e-3)
    for batch in (2, 5, 1):
        feeds = random_feeds(m, {"N": batch}, seed=batch)
        check(original.run(None, feeds), sess.run(None, feeds), rel, f"{name} batch {batch}")
    events = json.loads(Path(sess.end_profiling()).read_text())
    ran = {(e["args"].get("op_name"), e["args"].get("provider")) for e in events if e.get("cat") == "Node"}
    for op in EXPECT[name]:
        assert (op, "CUDAExecutionProvider") in ran, sorted(ran)


@pytest.mark.parametrize("name", ["vgg_stack", "residual_block"])
def test_fused_conv_under_cuda_graphs(name):
    m = CASES[name]()
    f, _ = fused(m, "tf32")
    feeds = random_feeds(m, {"N": 4}, seed=7)
    expected = session(m, library=False).run(None, feeds)
    sess = session(f, library=True, cuda_graph=True)
    binding = sess.io_binding()
    inputs = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in feeds.items()}
    outputs = {o.name: ort.OrtValue.ortvalue_from_numpy(np.zeros_like(e), "cuda", 0)
               for o, e in zip(sess.get_outputs(), expected, strict=True)}
    for k, v in inputs.items():
        binding.bind_ortvalue_input(k, v)
    for k, v in outputs.items():
        binding.bind_ortvalue_output(k, v)
    for _ in range(3):  # capture, then replays
        sess.run_with_iobinding(binding)
    check(expected, [outputs[o.name].numpy() for o in sess.get_outputs()], 1e-2, name)
    feeds2 = random_feeds(m, {"N": 4}, seed=8)
    for k, v in feeds2.items():
        inputs[k].update_inplace(v)
    sess.run_with_iobinding(binding)
    check(session(m, library=False).run(None, feeds2), [outputs[o.name].numpy() for o in sess.get_outputs()],
          1e-2, name + " (new inputs)")


def _to_fp16(m: onnx.ModelProto) -> onnx.ModelProto:
    """The same model in float16: inputs, outputs and initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for t in out.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for v in list(out.graph.input) + list(out.graph.output):
        v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    del out.graph.value_info[:]
    return out


def test_fp16_conv_stack_matches_original():
    m = _to_fp16(vgg_stack(blocks=2, channels=32, size=32))
    f, ops = fused(m, "tf32")
    assert "FusedConv" in ops
    feeds = random_feeds(m, {"N": 3}, seed=3)
    check(session(m, library=False).run(None, feeds), session(f, library=True).run(None, feeds), 1e-2, "fp16")


def test_fp16_channels_last_mobile_block_matches_original():
    """fp16 on the GPU path: depthwise convs (the direct loop; the grouped conv of 4 channels
    per group is left to cuDNN by the heuristic), the squeeze-excite's MatMul average and
    channels-last pools."""
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    m = _to_fp16(mobile_block())
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("auto", layout="nhwc")).report.compile
    assert not info["failed"], info["failed"]
    assert any(n.op_type == "MatMul" for n in r.model.graph.node)
    sess = session(r.model, library=True)
    for batch in (2, 1):
        feeds = random_feeds(m, {"N": batch}, seed=40 + batch)
        check(session(m, library=False).run(None, feeds), sess.run(None, feeds), 1e-2, f"fp16 mobile b{batch}")


@pytest.mark.parametrize("name", ["conv_relu_maxpool", "relu_maxpool", "residual_block"])
def test_tune_times_candidates_and_keeps_a_correct_model(name):
    """--tune on the GPU: every fused node timed against its original and its candidate
    configurations, the whole model against the original, a model that runs right."""
    from onnxfuse.pipeline import compile_pass, tune_pass
    from onnxfuse.tune import TuneSettings
    from tests.util import kernel_options

    m = CASES[name]()
    r = optimize_model(m)
    options = dataclasses.replace(kernel_options("auto"),
                                  tune=TuneSettings(batch=4, configs=True, explicit=True, cache=False))
    info = tune_pass(compile_pass(r, options), options).report.compile
    rec = info["tune"]
    # "precise (tf32x3)": the tf32 candidates failed the accuracy gate (cuDNN ran these small
    # layers in fp32 on the H200); "measured only": the budget left nodes unmeasured
    assert rec["shapes"] and (rec["kept"] in ("optimized", "tuned", "heuristic", "original", "measured only")
                              or rec["kept"].startswith("precise"))
    assert rec["original"]["plain_ms"] > 0
    for d in rec["nodes"]:
        assert d["original_ms"] > 0 and d["fused_ms"] > 0, d
        timed = [c for c in d["candidates"] if "ms" in c]
        assert timed and all(c["ms"] > 0 for c in timed), d
        assert d["chosen"] in ("original", "fused") or d["chosen"] in {c["config"] for c in timed} \
            or d["chosen"].startswith("fused (leaving"), d
    feeds = random_feeds(m, {"N": 4}, seed=11)
    check(session(m, library=False).run(None, feeds), session(r.model, library=True).run(None, feeds), 1e-2,
          name + " tuned")


@pytest.mark.parametrize("name", ["vgg_stack", "residual_block", "mobile_block"])
def test_nhwc_layout_pass_matches_original(name):
    """`optimize --layout nhwc`: channels-last tensors between fused convs (docs/format.md)."""
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    m = CASES[name]()
    r = optimize_model(m, layout="nhwc")  # the GPU path's patterns (grouped convs, lone convs and pools)
    compile_pass(r, kernel_options("auto", layout="nhwc"))
    layouts = {a.s for n in r.model.graph.node for a in n.attribute if a.name in ("x_layout", "y_layout")}
    assert b"NHWC" in layouts
    sess = session(r.model, library=True)
    for batch in (2, 1):
        feeds = random_feeds(m, {"N": batch}, seed=20 + batch)
        check(session(m, library=False).run(None, feeds), sess.run(None, feeds), 1e-2, f"{name} nhwc")


def test_mobilenet_v3_small_channels_last_matches_original():
    """torchvision's MobileNetV3-small (seeded random weights) on the GPU path: depthwise convs
    in the direct kernel, channels-last between fused convs, against the original."""
    pytest.importorskip("torchvision")
    from models.build import torchvision_model
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    m = torchvision_model("mobilenet_v3_small", size=96)
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("auto", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"]
    groups = [a.i for n in r.model.graph.node if n.op_type == "FusedConv" for a in n.attribute if a.name == "group"]
    assert sum(g > 1 for g in groups) == 11  # every depthwise conv
    assert not [n for n in r.model.graph.node if n.op_type == "Conv"]
    sess = session(r.model, library=True)
    for batch in (3, 1):
        feeds = random_feeds(m, {"N": batch}, seed=30 + batch)
        check(session(m, library=False).run(None, feeds), sess.run(None, feeds), 1e-2, f"mobilenet b{batch}")


def deep_head(c: int = 256, size: int = 10) -> onnx.ModelProto:
    """YOLOv8's detection head at its smallest scale: 3x3 c -> 64 + SiLU, 3x3 64 -> 64 + SiLU,
    1x1 64 -> 80, beside a 1x1 c -> 2c + Relu. At batch 1 every conv's output is one or two
    tiles with a long reduction: the launcher takes the split-K kernels."""
    init = functools.partial(_weight, np.random.default_rng(5))

    inits = [init("w1", 64, c, 3, 3), init("b1", 64), init("w2", 64, 64, 3, 3), init("b2", 64),
             init("w3", 80, 64, 1, 1), init("b3", 80), init("w4", 2 * c, c, 1, 1), init("b4", 2 * c)]
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv1"),
             N("Sigmoid", ["c1"], ["s1"]), N("Mul", ["c1", "s1"], ["a1"]),
             N("Conv", ["a1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv2"),
             N("Sigmoid", ["c2"], ["s2"]), N("Mul", ["c2", "s2"], ["a2"]),
             N("Conv", ["a2", "w3", "b3"], ["y"], kernel_shape=[1, 1], name="conv3"),
             N("Conv", ["x", "w4", "b4"], ["c4"], kernel_shape=[1, 1], name="conv4"),
             N("Relu", ["c4"], ["z"])]
    return _image_model(nodes, "deep_head", c, size, inits, outputs=("y", "z"))


@pytest.mark.parametrize("layout,fp16", [("nchw", False), ("nhwc", False), ("nhwc", True)])
def test_split_k_convs_match_original(layout, fp16):
    """Split K (codegen_conv): small outputs with long reductions, at batch 1 and 3 (fewer
    tiles than half the SMs: the split kernels), and 64 (more: the plain ones), then under
    CUDA graphs (the workspace comes from the EP's arena and the counters are zeroed on its
    stream, inside the capture)."""
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    m = _to_fp16(deep_head()) if fp16 else deep_head()
    r = optimize_model(m, layout=layout)
    info = compile_pass(r, kernel_options("auto", layout=layout)).report.compile
    assert not info["failed"], info["failed"]
    # slices per fused conv, by its source conv (None: too short to split, 1x1 over 64
    # channels). NCHW leaves conv1 (reduction 2304) to cuDNN, and the lone 1x1 conv3 is fused
    # only channels-last. fp16 reduces 64 channels per step: fewer steps, fewer convs worth
    # splitting. (Keyed by name: the node order is the IR's toposort, not the model's.)
    # (the split variant is not always the last: the small-M one follows it)
    splits = {n.name.rsplit("_", 1)[1]: next((v["split"] for v in json.loads(a.s)["variants"] if "split" in v), None)
              for n in r.model.graph.node if n.op_type == "FusedConv" for a in n.attribute if a.name == "kernel_meta"}
    want = {("nchw", False): {"conv2": 3, "conv4": 2},
            ("nhwc", False): {"conv1": 12, "conv2": 3, "conv3": None, "conv4": 2},
            ("nhwc", True): {"conv1": 9, "conv2": None, "conv3": None, "conv4": None}}
    assert splits == want[layout, fp16]
    rel = 1e-2 if fp16 else 2e-3
    original, sess = session(m, library=False), session(r.model, library=True)
    for batch in (1, 3, 64):
        feeds = random_feeds(m, {"N": batch}, seed=50 + batch)
        check(original.run(None, feeds), sess.run(None, feeds), rel, f"deep head {layout} b{batch}")
    feeds = random_feeds(m, {"N": 1}, seed=60)
    expected = original.run(None, feeds)
    graph = session(r.model, library=True, cuda_graph=True)
    binding = graph.io_binding()
    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    outputs = [ort.OrtValue.ortvalue_from_numpy(np.zeros_like(e), "cuda", 0) for e in expected]
    for o, v in zip(graph.get_outputs(), outputs, strict=True):
        binding.bind_ortvalue_output(o.name, v)
    for i in range(4):  # capture, then replays: the counters must start at zero every time
        graph.run_with_iobinding(binding)
        check(expected, [v.numpy() for v in outputs], rel, f"deep head {layout} graph run {i}")


@pytest.mark.parametrize("name", ["resnet_stem", "sppf"])
def test_nhwc_pools_match_original(name):
    """FusedMaxPool nodes in the NHWC plan (ResNet's stem conv -> pool 3x3 s2 p1 -> conv,
    YOLO's SPPF 5x5 s1 p2 pools into a Concat): channels-last pools on CUDA, no Transposes."""
    from onnxfuse.pipeline import compile_pass
    from tests.test_layout import resnet_stem, sppf
    from tests.util import kernel_options

    m = {"resnet_stem": resnet_stem, "sppf": sppf}[name]()
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("auto", layout="nhwc")).report.compile
    assert not info["failed"], info["failed"]
    pools = [n for n in r.model.graph.node if n.op_type == "FusedMaxPool"]
    assert pools and all({a.name: a.s for a in n.attribute}.get("x_layout") == b"NHWC" for n in pools)
    assert "Transpose" not in [n.op_type for n in r.model.graph.node]
    sess = session(r.model, library=True)
    for batch in (2, 1):
        feeds = random_feeds(m, {"N": batch}, seed=30 + batch)
        check(session(m, library=False).run(None, feeds), sess.run(None, feeds), 1e-2, f"{name} nhwc")
