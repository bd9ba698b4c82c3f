"""The custom-op library's FusedConv and FusedMaxPool CPU kernels (docs/format.md).

Each model here is one hand-built FusedConv / FusedMaxPool node (no function body: with the
library registered, onnxruntime runs the library's kernel, and without it the session
cannot be created). Its result is compared with the same computation as standard ONNX ops
(Conv with the weights in ONNX's layout, the program lowered to ONNX ops by
tests/test_library.py's function-body builder, MaxPool) in onnxruntime's CPU provider, on
seeded random inputs.

Tolerances. fp32: rtol 1e-5, plus an atol for the convolution's summation order: each
output sums n = C/group * R * S products of magnitude at most max|x| * max|w|; both sides
round every partial sum (~6e-8 relative each) in a different order, so they differ by a
few ulp of the partial sums, far below 1e-5 * sqrt(n) * max|x| * max|w| (a random walk of
n terms of that size has magnitude ~ sqrt(n) * max|x| * max|w|), which is the atol, times
the largest factor an extra input multiplies the conv result by. fp16: rtol 1e-2 and an
atol of one fp16 ulp (2^-10 relative) of the largest conv result: the conv result is
rounded to fp16 before the epilogue, and a different summation order can round it to the
neighbouring half, which an epilogue that cancels (x + residual) turns into a large
relative difference.

Layouts (FusedConv's optional x_layout, y_layout and extra_layouts): the reference is the
same computation with Transpose nodes around it (NHWC X -> NCHW before the Conv, each NHWC
extra input before the program, the output -> NHWC after the MaxPool), on the same inputs.
w_layout KRSC: the fused node gets the weights packed [K, R, S, C/group], the reference the
same ONNX weights as always.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxfuse.expr import Builder, Program, Ref
from onnxfuse.layers import ConvAttrs, PoolAttrs

ort = pytest.importorskip("onnxruntime")

from tests.test_library import _body as program_nodes  # noqa: E402  (the program as ONNX nodes)

OPSET = 21
TP = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16}
NP = {"f32": np.float32, "f16": np.float16}


@pytest.fixture(scope="session")
def lib() -> str:
    from onnxfuse import runtime

    return runtime.library_path()


# ---------------------------------------------------------------------------------------
# Programs
# ---------------------------------------------------------------------------------------

def epilogue(extras: int, dtype: str = "f32", act: str = "relu") -> Program:
    """%0 (+ or *) %1 (+ or *) ... then an activation: extra input i is added when i is odd,
    multiplied when even."""
    b = Builder([dtype] * (1 + extras))
    v = Ref(0)
    for i in range(1, 1 + extras):
        v = b.emit("add" if i % 2 else "mul", v, Ref(i))
    if act == "relu":
        v = b.emit("max", v, 0.0)
    elif act == "silu":
        v = b.emit("mul", v, b.emit("sigmoid", v))
    elif act == "tanh2":
        v = b.emit("mul", b.emit("tanh", v), 2.0)
    elif act != "none":
        raise AssertionError(act)
    return b.build([(v, dtype)])


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------

def _vi(name: str, dtype: str, rank: int):
    return helper.make_tensor_value_info(name, TP[dtype], [None] * rank)


def _model(nodes, inputs, output: str, dtype: str) -> onnx.ModelProto:
    """inputs: [(name, dtype, rank)]; every dimension dynamic, so the kernels' own checks
    see wrong shapes."""
    graph = helper.make_graph(nodes, "conv", [_vi(*i) for i in inputs], [_vi(output, dtype, 4)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("onnxfuse", 1)],
                             ir_version=10)


def fused_conv_model(conv: ConvAttrs, pool: PoolAttrs | None, prog: Program, extra_ranks: list[int],
                     **attr_overrides) -> onnx.ModelProto:
    dt = prog.input_dtypes[0]
    ins = ["x", "w", "b"] + [f"e{i}" for i in range(len(extra_ranks))]
    attrs = {**conv.node_attrs(), **(pool.node_attrs() if pool else {}), "program": prog.to_text(), **attr_overrides}
    node = helper.make_node("FusedConv", ins, ["y"], domain="onnxfuse", name="conv0", **attrs)
    inputs = [("x", dt, 4), ("w", dt, 4), ("b", dt, 1)]
    inputs += [(f"e{i}", prog.input_dtypes[1 + i], r) for i, r in enumerate(extra_ranks)]
    return _model([node], inputs, "y", prog.outputs[0][1])


def reference_conv_model(conv: ConvAttrs, pool: PoolAttrs | None, prog: Program, extra_ranks: list[int],
                         conv_out: tuple[int, ...], bias: bool, x_nhwc: bool = False, y_nhwc: bool = False,
                         extra_layouts: tuple[int, ...] = ()) -> onnx.ModelProto:
    """Conv (ONNX weights [K, C/group, R, S]) -> the program as ONNX ops -> MaxPool; with
    layouts, Transpose (perm [0, 3, 1, 2]) of an NHWC X and of each NHWC extra input
    (extra_layouts 1) before, Transpose (perm [0, 2, 3, 1]) of the output after."""
    dt = prog.input_dtypes[0]
    extras = [f"e{i}" for i in range(len(extra_ranks))]
    nodes = []
    if x_nhwc:
        nodes.append(helper.make_node("Transpose", ["x"], ["x_nchw"], perm=[0, 3, 1, 2]))
    conv_in = ["x_nchw" if x_nhwc else "x", "w"] + (["b"] if bias else [])
    nodes.append(helper.make_node("Conv", conv_in, ["c"], **conv.node_attrs()))
    prog_in = ["c"]
    for i, e in enumerate(extras):
        if i < len(extra_layouts) and extra_layouts[i] == 1:
            nodes.append(helper.make_node("Transpose", [e], [f"{e}_nchw"], perm=[0, 3, 1, 2]))
            e = f"{e}_nchw"
        prog_in.append(e)
    out = "y_nchw" if y_nhwc else "y"
    nodes += program_nodes(prog, prog_in, ["z" if pool else out], conv_out)
    if pool:
        nodes.append(helper.make_node("MaxPool", ["z"], [out], **pool.node_attrs(prefix="")))
    if y_nhwc:
        nodes.append(helper.make_node("Transpose", [out], ["y"], perm=[0, 2, 3, 1]))
    inputs = [("x", dt, 4), ("w", dt, 4)] + ([("b", dt, 1)] if bias else [])
    inputs += [(e, prog.input_dtypes[1 + i], r) for i, (e, r) in enumerate(zip(extras, extra_ranks, strict=True))]
    return _model(nodes, inputs, "y", prog.outputs[0][1])


def fused_pool_model(pool: PoolAttrs, prog: Program, extra_ranks: list[int], **attr_overrides) -> onnx.ModelProto:
    ins = ["x"] + [f"e{i}" for i in range(len(extra_ranks))]
    attrs = {**pool.node_attrs(), "program": prog.to_text(), **attr_overrides}
    node = helper.make_node("FusedMaxPool", ins, ["y"], domain="onnxfuse", name="pool0", **attrs)
    inputs = [(n, dt, r) for n, dt, r in zip(ins, prog.input_dtypes, [4, *extra_ranks], strict=True)]
    return _model([node], inputs, "y", prog.outputs[0][1])


def reference_pool_model(pool: PoolAttrs, prog: Program, extra_ranks: list[int], x_shape) -> onnx.ModelProto:
    ins = ["x"] + [f"e{i}" for i in range(len(extra_ranks))]
    nodes = program_nodes(prog, ins, ["z"], tuple(x_shape))
    nodes.append(helper.make_node("MaxPool", ["z"], ["y"], **pool.node_attrs(prefix="")))
    inputs = [(n, dt, r) for n, dt, r in zip(ins, prog.input_dtypes, [4, *extra_ranks], strict=True)]
    return _model(nodes, inputs, "y", prog.outputs[0][1])


def run(model: onnx.ModelProto, feeds: dict, lib: str | None, threads: int = 0) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if lib:
        so.register_custom_ops_library(lib)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


# ---------------------------------------------------------------------------------------
# FusedConv against Conv -> program -> MaxPool
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvCase:
    x: tuple[int, int, int, int]  # N, C, H, W
    k: int
    conv: ConvAttrs
    pool: PoolAttrs | None = None
    # as is: "full" [N, K, P, Q], "channel" [1, K, 1, 1], "scalar" [], "row" [Q]; NHWC
    # (extra_layouts 1): "full_nhwc" [N, P, Q, K], "channel_nhwc" [1, 1, 1, K], "pixel_nhwc" [N, P, Q, 1]
    extras: tuple[str, ...] = ()
    act: str = "relu"
    bias: bool = True
    dtype: str = "f32"
    threads: int = 0
    x_layout: str = "NCHW"  # X [N, C, H, W], or "NHWC" [N, H, W, C] (shape x stays N, C, H, W)
    y_layout: str = "NCHW"
    w_layout: str = "RSCK"  # packed weights [R, S, C/group, K], or "KRSC" [K, R, S, C/group]
    id: str = field(default="", compare=False)

    @property
    def extra_layouts(self) -> tuple[int, ...]:
        return tuple(int(e.endswith("_nhwc")) for e in self.extras)

    @property
    def layout_attrs(self) -> dict:
        """The node's layout attributes (none for an all-NCHW case)."""
        a = {}
        if self.x_layout != "NCHW":
            a["x_layout"] = self.x_layout
        if self.y_layout != "NCHW":
            a["y_layout"] = self.y_layout
        if any(self.extra_layouts):
            a["extra_layouts"] = list(self.extra_layouts)
        if self.w_layout != "RSCK":
            a["w_layout"] = self.w_layout
        return a


CONV_CASES = [
    ConvCase((1, 3, 8, 8), 4, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), id="3x3_same"),
    ConvCase((2, 5, 11, 13), 7, ConvAttrs((3, 3)), id="odd_sizes_valid"),
    ConvCase((2, 4, 15, 17), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), id="stride2"),
    ConvCase((1, 3, 9, 10), 5, ConvAttrs((3, 2), strides=(2, 1), pads=(0, 2, 1, 0)), id="asym_pads_strides"),
    ConvCase((1, 4, 12, 12), 8, ConvAttrs((3, 3), pads=(2, 2, 2, 2), dilations=(2, 2)), id="dilation2"),
    ConvCase((1, 2, 13, 9), 3, ConvAttrs((2, 3), dilations=(3, 1), strides=(1, 3), pads=(1, 0, 0, 2)),
             id="dilation_stride_mixed"),
    ConvCase((2, 16, 7, 9), 24, ConvAttrs((1, 1)), id="1x1"),
    ConvCase((1, 8, 9, 9), 12, ConvAttrs((1, 1), strides=(2, 2)), id="1x1_stride2"),
    ConvCase((1, 3, 32, 30), 16, ConvAttrs((7, 7), strides=(2, 2), pads=(3, 3, 3, 3)), id="7x7_stem"),
    ConvCase((1, 6, 10, 10), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=2), id="group2"),
    ConvCase((2, 8, 10, 11), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=8), id="depthwise"),
    ConvCase((1, 4, 9, 9), 12, ConvAttrs((3, 3), strides=(2, 2), group=4), id="depthwise_multiplier3_stride2"),
    ConvCase((1, 3, 8, 8), 5, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), bias=False, id="no_bias"),
    ConvCase((2, 4, 8, 8), 6, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("full",), id="residual"),
    ConvCase((2, 4, 8, 8), 6, ConvAttrs((3, 3)), extras=("channel", "channel"), act="none",
             id="per_channel_scale_shift"),
    ConvCase((1, 4, 8, 8), 6, ConvAttrs((3, 3)), extras=("scalar",), act="silu", id="scalar_extra_silu"),
    ConvCase((2, 3, 8, 9), 5, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("row", "full", "channel"),
             act="tanh2", id="three_extras"),
    ConvCase((1, 20, 17, 19), 40, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), id="k_blocks_partial"),
    # with a max pool
    ConvCase((2, 3, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)), id="pool2x2"),
    ConvCase((1, 3, 15, 13), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             id="pool2x2_odd"),
    ConvCase((1, 3, 17, 16), 6, ConvAttrs((3, 3)), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), id="pool3x3_s2_p1"),
    ConvCase((1, 3, 12, 12), 6, ConvAttrs((3, 3)), PoolAttrs((3, 3), (2, 2), (0, 1, 1, 0), ceil_mode=True),
             id="pool_ceil_padded"),
    ConvCase((1, 3, 14, 14), 6, ConvAttrs((3, 3)), PoolAttrs((2, 3), (1, 2), dilations=(2, 2)),
             id="pool_dilation2"),
    ConvCase((2, 4, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full", "channel"), id="pool_with_extras"),
    ConvCase((1, 4, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=4), PoolAttrs((3, 3), (2, 2)),
             act="silu", id="depthwise_pool"),
    # float16
    ConvCase((2, 4, 10, 11), 6, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), dtype="f16", id="f16"),
    ConvCase((2, 4, 16, 16), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 0, 1, 1)),
             PoolAttrs((2, 2), (2, 2)), extras=("full", "channel"), dtype="f16", id="f16_extras_pool"),
    ConvCase((1, 8, 9, 9), 8, ConvAttrs((3, 3), dilations=(2, 2), group=8), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)),
             act="silu", dtype="f16", id="f16_depthwise_dilated_pool"),
    # bigger: many parallel tasks; one thread and the default pool
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full",), id="big"),
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), threads=1, id="big_one_thread"),
    # layouts (x_layout, y_layout, extra_layouts)
    ConvCase((2, 5, 11, 13), 7, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout="NHWC", id="nhwc_x"),
    ConvCase((2, 16, 7, 9), 24, ConvAttrs((1, 1)), x_layout="NHWC", extras=("full",), id="nhwc_x_unpadded_1x1"),
    ConvCase((2, 4, 15, 17), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), y_layout="NHWC",
             extras=("channel", "row"), id="nhwc_y"),
    ConvCase((2, 4, 8, 9), 12, ConvAttrs((3, 3), pads=(1, 2, 0, 1)), x_layout="NHWC", y_layout="NHWC",
             extras=("full_nhwc", "channel"), id="nhwc_both_residual"),
    ConvCase((2, 3, 8, 9), 10, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout="NHWC", y_layout="NHWC",
             extras=("pixel_nhwc", "channel_nhwc", "scalar", "full"), act="tanh2", id="nhwc_both_mixed_extras"),
    ConvCase((2, 8, 10, 11), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=8), x_layout="NHWC", y_layout="NHWC",
             extras=("full_nhwc",), act="silu", id="nhwc_both_depthwise"),
    ConvCase((1, 20, 17, 19), 40, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout="NHWC", y_layout="NHWC",
             id="nhwc_both_k_blocks_partial"),
    ConvCase((2, 4, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc", "channel"), x_layout="NHWC", y_layout="NHWC", id="nhwc_both_pool2x2"),
    ConvCase((1, 3, 17, 16), 6, ConvAttrs((3, 3)), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), y_layout="NHWC",
             extras=("full_nhwc",), id="nhwc_y_pool3x3_s2_p1"),
    ConvCase((2, 3, 16, 15), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)), x_layout="NHWC",
             extras=("channel",), id="nhwc_x_pool2x2"),
    ConvCase((2, 4, 16, 16), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 0, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc", "channel"), dtype="f16", x_layout="NHWC", y_layout="NHWC", id="nhwc_f16_both_pool"),
    ConvCase((2, 4, 10, 11), 6, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("full_nhwc",), dtype="f16",
             x_layout="NHWC", y_layout="NHWC", id="nhwc_f16_both"),
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("full_nhwc",), x_layout="NHWC",
             y_layout="NHWC", id="big_nhwc"),
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc",), x_layout="NHWC", y_layout="NHWC", threads=1, id="big_nhwc_pool_one_thread"),
    # w_layout KRSC: weights [K, R, S, C/group] (the optimizer's NHWC path); R != S and
    # C/group > 1 in some cases, so that a mixed-up axis shows
    ConvCase((1, 3, 8, 8), 4, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), w_layout="KRSC", id="krsc_3x3_same"),
    ConvCase((1, 20, 17, 19), 40, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), w_layout="KRSC", id="krsc_k_blocks_partial"),
    ConvCase((1, 5, 10, 7), 17, ConvAttrs((3, 2), strides=(2, 1), pads=(0, 1, 2, 0), dilations=(2, 1)),
             w_layout="KRSC", id="krsc_3x2_dilated"),
    ConvCase((1, 2, 13, 9), 3, ConvAttrs((2, 3), dilations=(3, 1), strides=(1, 3), pads=(1, 0, 0, 2)),
             w_layout="KRSC", id="krsc_2x3_narrow"),
    ConvCase((2, 16, 7, 9), 24, ConvAttrs((1, 1)), w_layout="KRSC", id="krsc_1x1"),
    ConvCase((1, 6, 10, 10), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=2), w_layout="KRSC", id="krsc_group2"),
    ConvCase((1, 6, 9, 11), 20, ConvAttrs((3, 2), pads=(1, 0, 1, 1), group=2), w_layout="KRSC",
             id="krsc_group2_3x2_wide"),
    ConvCase((2, 8, 10, 11), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=8), w_layout="KRSC", id="krsc_depthwise"),
    ConvCase((1, 4, 9, 9), 12, ConvAttrs((3, 3), strides=(2, 2), group=4), w_layout="KRSC",
             id="krsc_depthwise_multiplier3_stride2"),
    ConvCase((2, 4, 8, 8), 6, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("full",), w_layout="KRSC",
             id="krsc_residual"),
    ConvCase((2, 3, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)), w_layout="KRSC",
             id="krsc_pool2x2"),
    ConvCase((1, 3, 17, 16), 6, ConvAttrs((3, 3)), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), extras=("channel",),
             w_layout="KRSC", id="krsc_pool3x3_s2_p1"),
    ConvCase((2, 5, 11, 13), 7, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), x_layout="NHWC", w_layout="KRSC",
             id="krsc_nhwc_x"),
    ConvCase((2, 4, 15, 17), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 1, 1, 1)), y_layout="NHWC",
             extras=("channel", "row"), w_layout="KRSC", id="krsc_nhwc_y"),
    ConvCase((2, 4, 8, 9), 12, ConvAttrs((3, 3), pads=(1, 2, 0, 1)), x_layout="NHWC", y_layout="NHWC",
             extras=("full_nhwc", "channel"), w_layout="KRSC", id="krsc_nhwc_both_residual"),
    ConvCase((2, 8, 10, 11), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=8), x_layout="NHWC", y_layout="NHWC",
             extras=("full_nhwc",), act="silu", w_layout="KRSC", id="krsc_nhwc_both_depthwise"),
    ConvCase((1, 12, 9, 10), 24, ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=3), x_layout="NHWC", y_layout="NHWC",
             w_layout="KRSC", id="krsc_nhwc_both_group3"),
    ConvCase((2, 4, 16, 16), 8, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc", "channel"), x_layout="NHWC", y_layout="NHWC", w_layout="KRSC",
             id="krsc_nhwc_both_pool2x2"),
    ConvCase((2, 4, 10, 11), 6, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), dtype="f16", w_layout="KRSC", id="krsc_f16"),
    ConvCase((2, 4, 16, 16), 6, ConvAttrs((3, 3), strides=(2, 2), pads=(1, 0, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc", "channel"), dtype="f16", x_layout="NHWC", y_layout="NHWC", w_layout="KRSC",
             id="krsc_nhwc_f16_both_pool"),
    ConvCase((1, 8, 9, 9), 8, ConvAttrs((3, 3), dilations=(2, 2), group=8), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)),
             act="silu", dtype="f16", w_layout="KRSC", id="krsc_f16_depthwise_dilated_pool"),
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), extras=("full_nhwc",), x_layout="NHWC",
             y_layout="NHWC", w_layout="KRSC", id="big_nhwc_krsc"),
    ConvCase((2, 32, 40, 40), 64, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)),
             extras=("full_nhwc",), x_layout="NHWC", y_layout="NHWC", w_layout="KRSC", threads=1,
             id="big_nhwc_krsc_pool_one_thread"),
]


def _extra_shape(kind: str, n: int, k: int, p: int, q: int) -> tuple[int, ...]:
    return {"full": (n, k, p, q), "channel": (1, k, 1, 1), "scalar": (), "row": (q,),
            "full_nhwc": (n, p, q, k), "channel_nhwc": (1, 1, 1, k), "pixel_nhwc": (n, p, q, 1)}[kind]


def conv_feeds(case: ConvCase, rng: np.random.Generator) -> tuple[dict, dict, tuple[int, ...]]:
    """(fused feeds, reference feeds, conv output shape [N, K, P, Q]); X (and the NHWC
    extras) in the case's layouts, the same tensors in both feeds."""
    n, c, h, w = case.x
    conv = case.conv
    p, q = conv.out_size(h, w)
    dt = NP[case.dtype]
    x = rng.standard_normal(case.x).astype(dt)
    if case.x_layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    wt = (rng.standard_normal((case.k, c // conv.group, *conv.kernel)) / math.sqrt(c // conv.group)).astype(dt)
    b = (rng.standard_normal(case.k) if case.bias else np.zeros(case.k)).astype(dt)
    extras = {}
    for i, kind in enumerate(case.extras):
        shape = _extra_shape(kind, n, case.k, p, q)
        # multiplied extras (even i >= 2) stay in [0.5, 1.5]
        e = rng.uniform(0.5, 1.5, shape) if i % 2 else rng.standard_normal(shape)
        extras[f"e{i}"] = np.asarray(e).astype(dt)
    packed = wt.transpose(0, 2, 3, 1) if case.w_layout == "KRSC" else wt.transpose(2, 3, 1, 0)
    fused = {"x": x, "w": np.ascontiguousarray(packed), "b": b, **extras}
    ref = {"x": x, "w": wt, **({"b": b} if case.bias else {}), **extras}
    return fused, ref, (n, case.k, p, q)


def _nchw(a: np.ndarray, layout: str) -> np.ndarray:
    return a.transpose(0, 3, 1, 2) if layout == "NHWC" else a


def conv_atol(case: ConvCase, feeds: dict, expected_conv_scale: float) -> float:
    if case.dtype == "f16":
        return 2.0**-10 * expected_conv_scale
    n = case.x[1] // case.conv.group * math.prod(case.conv.kernel)
    gain = max([1.0] + [float(np.abs(feeds[f"e{i}"]).max()) for i in range(1, len(case.extras), 2)])
    return 1e-5 * math.sqrt(n) * float(np.abs(feeds["x"]).max()) * float(np.abs(feeds["w"]).max()) * gain


# The CPU kernel's loop nests (ONNXFUSE_CPU_CONV; default: by K/group and the CPU): rows,
# and the tile micro-kernel per instruction set (one the CPU lacks falls back to a narrower one).
LOOPS = ["rows", "avx512", "avx2", "generic"]
CONV_PARAMS = [pytest.param(c, "", id=c.id) for c in CONV_CASES]
CONV_PARAMS += [pytest.param(c, loop, id=f"{c.id}-{loop}") for loop in LOOPS for c in CONV_CASES
                if not c.id.startswith("big")]


@pytest.mark.parametrize("case,loop", CONV_PARAMS)
def test_fused_conv(case, loop, lib, monkeypatch):
    if loop:
        monkeypatch.setenv("ONNXFUSE_CPU_CONV", loop)
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    prog = epilogue(len(case.extras), case.dtype, case.act)
    fused_feeds, ref_feeds, conv_out = conv_feeds(case, rng)
    ranks = [len(fused_feeds[f"e{i}"].shape) for i in range(len(case.extras))]
    got = run(fused_conv_model(case.conv, case.pool, prog, ranks, **case.layout_attrs), fused_feeds, lib,
              case.threads)
    want = run(reference_conv_model(case.conv, case.pool, prog, ranks, conv_out, case.bias,
                                    x_nhwc=case.x_layout == "NHWC", y_nhwc=case.y_layout == "NHWC",
                                    extra_layouts=case.extra_layouts), ref_feeds, None)
    n, k, p, q = conv_out if case.pool is None else (*conv_out[:2], *case.pool.out_size(*conv_out[2:]))
    expect_shape = (n, p, q, k) if case.y_layout == "NHWC" else (n, k, p, q)
    assert got.shape == want.shape == expect_shape
    assert got.dtype == want.dtype == NP[case.dtype]
    # the largest conv result, for the fp16 atol: from a plain Conv
    plain = reference_conv_model(case.conv, None, epilogue(0, case.dtype, "none"), [], conv_out, case.bias)
    plain_feeds = {k: v for k, v in ref_feeds.items() if k in ("w", "b")}
    plain_feeds["x"] = np.ascontiguousarray(_nchw(ref_feeds["x"], case.x_layout))
    scale = float(np.abs(run(plain, plain_feeds, None)).max())
    rtol = 1e-5 if case.dtype == "f32" else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=conv_atol(case, fused_feeds, scale))


@pytest.mark.parametrize("case_id", ["nhwc_both_mixed_extras", "nhwc_y_pool3x3_s2_p1", "nhwc_x_pool2x2", "residual",
                                     "krsc_group2", "krsc_nhwc_both_residual"])
def test_layer_ref_honours_layouts(case_id, lib):
    """tests/layer_ref.py's numpy reference of a node with layout attributes agrees with the
    library's kernel."""
    from tests.layer_ref import evaluate_fused

    case = next(c for c in CONV_CASES if c.id == case_id)
    prog = epilogue(len(case.extras), case.dtype, case.act)
    feeds, _, _ = conv_feeds(case, np.random.default_rng(3))
    ranks = [len(feeds[f"e{i}"].shape) for i in range(len(case.extras))]
    model = fused_conv_model(case.conv, case.pool, prog, ranks, **case.layout_attrs)
    got = run(model, feeds, lib)
    want = evaluate_fused(model.graph.node[0], [feeds[n] for n in model.graph.node[0].input])
    assert want.shape == got.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_fused_conv_is_deterministic_across_thread_counts(lib):
    for case in [c for c in CONV_CASES if c.id in ("big", "big_nhwc_pool_one_thread", "big_nhwc_krsc")]:
        fused_feeds, _, _ = conv_feeds(case, np.random.default_rng(7))
        model = fused_conv_model(case.conv, case.pool, epilogue(1), [4], **case.layout_attrs)
        np.testing.assert_array_equal(run(model, fused_feeds, lib, threads=1),
                                      run(model, fused_feeds, lib, threads=3))


def test_fused_conv_empty_batch(lib):
    conv = ConvAttrs((3, 3), pads=(1, 1, 1, 1))
    model = fused_conv_model(conv, PoolAttrs((2, 2), (2, 2)), epilogue(0), [])
    feeds = {"x": np.zeros((0, 3, 8, 8), np.float32), "w": np.zeros((3, 3, 3, 4), np.float32),
             "b": np.zeros(4, np.float32)}
    assert run(model, feeds, lib).shape == (0, 4, 4, 4)


# ---------------------------------------------------------------------------------------
# FusedMaxPool against the program -> MaxPool
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolCase:
    x: tuple[int, int, int, int]
    pool: PoolAttrs
    extras: tuple[tuple[int, ...], ...] = ()
    act: str = "relu"
    dtype: str = "f32"
    id: str = field(default="", compare=False)


POOL_CASES = [
    PoolCase((2, 3, 16, 16), PoolAttrs((2, 2), (2, 2)), id="relu_2x2_s2"),
    PoolCase((1, 4, 15, 17), PoolAttrs((2, 2), (2, 2)), id="relu_2x2_s2_odd"),
    PoolCase((2, 3, 17, 16), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), id="relu_3x3_s2_p1"),
    PoolCase((1, 3, 12, 13), PoolAttrs((3, 3), (2, 2), (1, 0, 0, 1), ceil_mode=True), id="ceil_mode_padded"),
    PoolCase((1, 3, 10, 10), PoolAttrs((2, 2), (3, 3), ceil_mode=True), id="ceil_mode_unpadded"),
    PoolCase((1, 2, 14, 15), PoolAttrs((3, 2), (1, 2), (1, 1, 2, 0), dilations=(2, 2)), id="dilation2_padded"),
    PoolCase((1, 2, 9, 9), PoolAttrs((1, 1), (2, 2)), act="none", id="1x1_subsample"),
    PoolCase((2, 4, 8, 8), PoolAttrs((2, 2), (2, 2)), extras=((1, 4, 1, 1),), id="extra_per_channel"),
    PoolCase((2, 4, 9, 8), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), extras=((2, 4, 9, 8), (8,)), act="silu",
             id="extra_full_and_row"),
    PoolCase((2, 3, 16, 16), PoolAttrs((2, 2), (2, 2)), extras=((1, 3, 1, 1),), dtype="f16", id="f16"),
    PoolCase((1, 3, 13, 12), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True), dtype="f16",
             id="f16_ceil_padded"),
    PoolCase((4, 32, 56, 56), PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), id="big"),
]


def pool_inputs(case: PoolCase):
    """The case's program, seeded random feeds (x, e0, e1, ...) and the extras' ranks."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    dt = NP[case.dtype]
    feeds = {"x": rng.standard_normal(case.x).astype(dt)}
    for i, s in enumerate(case.extras):
        feeds[f"e{i}"] = (rng.uniform(0.5, 1.5, s) if i % 2 else rng.standard_normal(s)).astype(dt)
    return epilogue(len(case.extras), case.dtype, case.act), feeds, [len(s) for s in case.extras]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c.id for c in POOL_CASES])
def test_fused_maxpool(case, lib):
    prog, feeds, ranks = pool_inputs(case)
    got = run(fused_pool_model(case.pool, prog, ranks), feeds, lib)
    want = run(reference_pool_model(case.pool, prog, ranks, case.x), feeds, None)
    assert got.shape == want.shape == (*case.x[:2], *case.pool.out_size(*case.x[2:]))
    assert got.dtype == want.dtype
    if case.dtype == "f32" and case.act in ("relu", "none"):  # rational ops, one rounding: exact
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=1e-5 if case.dtype == "f32" else 1e-2, atol=1e-6)


NHWC_POOL_CASES = [c for c in POOL_CASES if c.id in (
    "relu_2x2_s2_odd", "relu_3x3_s2_p1", "ceil_mode_padded", "dilation2_padded", "extra_per_channel",
    "extra_full_and_row", "f16", "f16_ceil_padded")] + [
    PoolCase((2, 6, 9, 8), PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), act="none", id="sppf_5x5_s1_p2"),
]


@pytest.mark.parametrize("y_layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("case", NHWC_POOL_CASES, ids=[c.id for c in NHWC_POOL_CASES])
def test_fused_maxpool_channels_last(case, y_layout, lib):
    """x_layout NHWC (and y_layout NHWC or NCHW): the same values as the NCHW node, on X
    stored [N, H, W, C]; the extras still broadcast to the logical [N, C, H, W]."""
    prog, feeds, ranks = pool_inputs(case)
    want = run(fused_pool_model(case.pool, prog, ranks), feeds, lib)
    nhwc_feeds = {**feeds, "x": np.ascontiguousarray(feeds["x"].transpose(0, 2, 3, 1))}
    got = run(fused_pool_model(case.pool, prog, ranks, x_layout="NHWC", y_layout=y_layout), nhwc_feeds, lib)
    if y_layout == "NHWC":
        want = want.transpose(0, 2, 3, 1)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_fused_maxpool_nchw_x_nhwc_y(lib):
    case = next(c for c in POOL_CASES if c.id == "relu_3x3_s2_p1")
    prog = epilogue(0)
    x = np.random.default_rng(7).standard_normal(case.x).astype(np.float32)
    want = run(fused_pool_model(case.pool, prog, []), {"x": x}, lib)
    got = run(fused_pool_model(case.pool, prog, [], y_layout="NHWC"), {"x": x}, lib)
    np.testing.assert_array_equal(got, want.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("attrs,msg", [
    ({"x_layout": "NCWH"}, r"attribute 'x_layout' is \"NCWH\", expected \"NCHW\" or \"NHWC\""),
    ({"y_layout": 1}, r"attribute 'y_layout' must be a string"),
])
def test_fused_maxpool_layout_attribute_errors(attrs, msg, lib):
    with pytest.raises(Exception, match=msg):
        run(fused_pool_model(PoolAttrs((2, 2), (2, 2)), epilogue(0), [], **attrs),
            {"x": np.zeros((1, 2, 4, 4), np.float32)}, lib)


def test_fused_maxpool_nhwc_shape_errors(lib):
    prog = epilogue(1)
    model = without_ranks(fused_pool_model(PoolAttrs((2, 2), (2, 2)), prog, [4], x_layout="NHWC"))
    x = np.zeros((1, 8, 8, 3), np.float32)
    with pytest.raises(Exception, match=r"input 1 \(program input %1\) has shape \[1, 8, 1, 1\], which does not "
                                        r"broadcast to X's logical shape \(x_layout NHWC\) \[N, C, H, W\] = "
                                        r"\[1, 3, 8, 8\]"):
        run(model, {"x": x, "e0": np.zeros((1, 8, 1, 1), np.float32)}, lib)
    with pytest.raises(Exception, match=r"input 0 \(X, x_layout NHWC\) has shape \[8, 8, 3\], expected rank 4 "
                                        r"\[N, H, W, C\]"):
        run(model, {"x": np.zeros((8, 8, 3), np.float32), "e0": np.zeros((1, 3, 1, 1), np.float32)}, lib)


def test_fused_maxpool_padding_never_wins(lib):
    """All-negative input, padded windows: the result is the largest real element, not 0."""
    pool = PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True)
    prog = epilogue(0, act="none")
    x = -1.0 - np.random.default_rng(3).random((1, 2, 6, 7)).astype(np.float32)
    got = run(fused_pool_model(pool, prog, []), {"x": x}, lib)
    want = run(reference_pool_model(pool, prog, [], x.shape), {"x": x}, None)
    np.testing.assert_array_equal(got, want)
    assert (got < -1.0).all()


@pytest.mark.parametrize("pool", [PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), PoolAttrs((2, 2), (1, 1), dilations=(2, 2)),
                                  PoolAttrs((2, 2), (2, 2))], ids=["3x3_s2_p1", "dilated", "2x2_s2"])
def test_fused_maxpool_propagates_nan(pool, lib):
    """A window that holds a NaN gives NaN wherever the NaN lies, as numpy and torch compute
    it (and the Triton kernels: tests/test_nan.py). Regression: the kernel took the max of the
    elements that are not NaN, -inf when all were. (ONNX Runtime's own MaxPool mostly drops
    NaN, differently from one code path to another, so it is no reference here.)"""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    x[rng.random(x.shape) < 0.4] = np.nan
    x[0, 0, :4, :4] = np.nan  # some all-NaN windows
    got = run(fused_pool_model(pool, epilogue(0, act="none"), []), {"x": x}, lib)
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = pool.kernel, pool.strides, pool.pads, pool.dilations
    oh, ow = pool.out_size(9, 8)
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)), constant_values=-np.inf)
    want = np.full((2, 3, oh, ow), -np.inf, np.float32)
    for i in range(kh):
        for j in range(kw):
            tap = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
            want = np.maximum(want, tap)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[0, 0, 0, 0]) and np.isfinite(got).any()


# ---------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------

def without_ranks(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph inputs' ranks unknown too, so that onnxruntime lets any rank through."""
    for i in model.graph.input:
        i.type.tensor_type.ClearField("shape")
    return model


def _conv_feeds(x=(1, 4, 8, 8), w=(3, 3, 4, 6), b=(6,), extras=()):
    z = {"x": np.zeros(x, np.float32), "w": np.zeros(w, np.float32), "b": np.zeros(b, np.float32)}
    z.update({f"e{i}": np.zeros(s, np.float32) for i, s in enumerate(extras)})
    return z


CONV_ERRORS = [
    (dict(x=(4, 8, 8)), r"input 0 \(X\) has shape \[4, 8, 8\], expected rank 4"),
    (dict(w=(3, 3, 5, 6)), r"input 1 \(W\) has shape \[3, 3, 5, 6\], expected the packed weights .*\[3, 3, 4, K\]"),
    (dict(w=(6, 4, 3, 3)), r"input 1 \(W\) has shape \[6, 4, 3, 3\], expected the packed weights"),
    (dict(b=(5,)), r"input 2 \(B\) has shape \[5\], expected the bias \[K\] = \[6\]"),
    (dict(extras=[(1, 6, 8, 7)]), r"input 3 \(program input %1\) has shape \[1, 6, 8, 7\], which does not broadcast "
                                   r"to the conv output \[N, K, P, Q\] = \[1, 6, 8, 8\]"),
    (dict(extras=[(2, 1, 6, 1, 1)]), r"input 3 .* does not broadcast"),
    (dict(x=(1, 4, 1, 8)), r"input 0 \(X\) \[1, 4, 1, 8\] is too small for kernel_shape \[3, 3\]"),
]


@pytest.mark.parametrize("kw,msg", CONV_ERRORS, ids=[str(k) for k, _ in CONV_ERRORS])
def test_fused_conv_shape_errors(kw, msg, lib):
    extras = kw.get("extras", [(1, 6, 1, 1)])
    model = without_ranks(fused_conv_model(ConvAttrs((3, 3), pads=(1, 1, 1, 1) if "x" not in kw else (0, 0, 0, 0)),
                                           None, epilogue(1), [len(s) for s in extras]))
    with pytest.raises(Exception, match=r"onnxfuse FusedConv node 'conv0': " + msg):
        run(model, _conv_feeds(**{**kw, "extras": extras}), lib)


def test_fused_conv_type_errors(lib):
    model = fused_conv_model(ConvAttrs((3, 3)), None, epilogue(0), [])
    feeds = _conv_feeds()
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.FLOAT16
    feeds["w"] = feeds["w"].astype(np.float16)
    with pytest.raises(Exception, match=r"FusedConv node 'conv0': input 1 \(W\) is float16, X is float32"):
        run(model, feeds, lib)


def test_fused_conv_wrong_input_count(lib):
    model = fused_conv_model(ConvAttrs((3, 3)), None, epilogue(1), [4])
    del model.graph.node[0].input[3]
    del model.graph.input[3]
    with pytest.raises(Exception, match=r"FusedConv node 'conv0': the node has 3 inputs, expected 4"):
        run(model, _conv_feeds(), lib)


@pytest.mark.parametrize("attrs,msg", [
    ({"pads": [1, 1]}, r"attribute 'pads' is \[1, 1\], expected 4 numbers"),
    ({"strides": [0, 1]}, r"attribute 'strides' is \[0, 1\], values must be >= 1"),
    ({"pool_kernel": [2, 2]}, r"the node has some of the pool_\* attributes but not all five"),
    ({"program": "onnxfuse.pointwise v1\ninput %0 f32\noutput %0 f32\noutput %0 f32"},
     r"the program has 2 outputs, expected 1"),
])
def test_fused_conv_attribute_errors_at_session_creation(attrs, msg, lib):
    model = fused_conv_model(ConvAttrs((3, 3)), None, epilogue(0), [], **attrs)
    with pytest.raises(Exception, match=r"onnxfuse FusedConv node 'conv0': " + msg):
        run(model, _conv_feeds(), lib)


@pytest.mark.parametrize("attrs,msg", [
    ({"x_layout": "NCWH"}, r"attribute 'x_layout' is \"NCWH\", expected \"NCHW\" or \"NHWC\""),
    ({"y_layout": "nhwc"}, r"attribute 'y_layout' is \"nhwc\", expected \"NCHW\" or \"NHWC\""),
    ({"x_layout": 1}, r"attribute 'x_layout' must be a string"),
    ({"extra_layouts": [0, 1]}, r"attribute 'extra_layouts' is \[0, 1\], 2 values for 1 extra inputs"),
    ({"extra_layouts": [2]}, r"attribute 'extra_layouts' is \[2\], values must be 0 \(as is\) or 1 \(NHWC\)"),
    ({"w_layout": "KCRS"}, r"attribute 'w_layout' is \"KCRS\", expected \"RSCK\" or \"KRSC\""),
    ({"w_layout": "krsc"}, r"attribute 'w_layout' is \"krsc\", expected \"RSCK\" or \"KRSC\""),
    ({"w_layout": 1}, r"attribute 'w_layout' must be a string, \"RSCK\" or \"KRSC\""),
    ({"w_layout": [1, 2]}, r"attribute 'w_layout' must be a string, \"RSCK\" or \"KRSC\""),
], ids=["bad_x_layout", "lower_case_y_layout", "int_x_layout", "extra_layouts_count", "extra_layouts_value",
        "bad_w_layout", "lower_case_w_layout", "int_w_layout", "ints_w_layout"])
def test_fused_conv_layout_attribute_errors_at_session_creation(attrs, msg, lib):
    model = fused_conv_model(ConvAttrs((3, 3)), None, epilogue(1), [4], **attrs)
    with pytest.raises(Exception, match=r"onnxfuse FusedConv node 'conv0': " + msg):
        run(model, _conv_feeds(extras=[(1, 6, 1, 1)]), lib)


def test_fused_conv_extra_layouts_without_extras(lib):
    model = fused_conv_model(ConvAttrs((3, 3)), None, epilogue(0), [], extra_layouts=[1])
    with pytest.raises(Exception, match=r"FusedConv node 'conv0': attribute 'extra_layouts' is \[1\], 1 values for "
                                        r"0 extra inputs"):
        run(model, _conv_feeds(), lib)


NHWC_ERRORS = [
    (dict(x=(4, 8, 8)), r"input 0 \(X, x_layout NHWC\) has shape \[4, 8, 8\], expected rank 4 \[N, H, W, C\] "
                        r"\(x_layout NHWC\)"),
    # an NCHW X given to an NHWC node: C is read from the last dimension
    (dict(x=(1, 4, 8, 8)), r"input 1 \(W\) has shape \[3, 3, 4, 6\], expected the packed weights .*\[3, 3, 8, K\] "
                           r".*X's C = 8 from its last dimension \(x_layout NHWC: X is \[N, H, W, C\]\)"),
    (dict(x=(1, 8, 8, 5), w=(3, 3, 5, 6)), None),  # fine: C = 5 (group 1)
    (dict(x=(1, 1, 8, 4)), r"input 0 \(X, x_layout NHWC\) \[1, 1, 8, 4\] is too small for kernel_shape \[3, 3\]"),
    (dict(extras=[(1, 6, 8, 8)]), r"input 3 \(program input %1, extra_layouts 1: NHWC\) has shape \[1, 6, 8, 8\], "
                                  r"whose NCHW transpose \[1, 8, 6, 8\] does not broadcast to the conv output "
                                  r"\[N, K, P, Q\] = \[1, 6, 8, 8\]"),
    (dict(extras=[(8, 8, 6)]), r"input 3 \(program input %1, extra_layouts 1: NHWC\) has shape \[8, 8, 6\], "
                               r"expected a rank-4 NHWC tensor"),
]


@pytest.mark.parametrize("kw,msg", NHWC_ERRORS, ids=[str(k) for k, _ in NHWC_ERRORS])
def test_fused_conv_nhwc_shape_errors(kw, msg, lib):
    """x_layout and y_layout NHWC, extra_layouts [1]: the messages name the layout they
    assumed. X [1, 8, 8, 4] (pads 1, or none when the case changes X), W [3, 3, 4, 6]."""
    extras = kw.get("extras", [(1, 8, 8, 6)])
    model = without_ranks(fused_conv_model(ConvAttrs((3, 3), pads=(1, 1, 1, 1) if "x" not in kw else (0, 0, 0, 0)),
                                           None, epilogue(1), [len(s) for s in extras], x_layout="NHWC",
                                           y_layout="NHWC", extra_layouts=[1]))
    feeds = _conv_feeds(**{"x": (1, 8, 8, 4), **kw, "extras": extras})
    if msg is None:
        feeds["e0"] = np.zeros((1, 6, 6, 6), np.float32)
        assert run(model, feeds, lib).shape == (1, 6, 6, 6)
        return
    with pytest.raises(Exception, match=r"onnxfuse FusedConv node 'conv0': " + msg):
        run(model, feeds, lib)


KRSC_ERRORS = [
    # RSCK weights given to a KRSC node
    (dict(w=(3, 3, 4, 6)), r"input 1 \(W\) has shape \[3, 3, 4, 6\], expected the packed weights \[K, R, S, C/group\] "
                           r"= \[K, 3, 3, 4\] \(w_layout KRSC, kernel_shape \[3, 3\], X's C = 4, group 1\)"),
    (dict(w=(6, 3, 3, 5)), r"input 1 \(W\) has shape \[6, 3, 3, 5\], expected the packed weights "
                           r"\[K, R, S, C/group\] = \[K, 3, 3, 4\] \(w_layout KRSC"),
    (dict(w=(6, 3, 3)), r"input 1 \(W\) has shape \[6, 3, 3\], expected the packed weights \[K, R, S, C/group\]"),
    # K comes from W's first dimension
    (dict(w=(5, 3, 3, 4)), r"input 2 \(B\) has shape \[6\], expected the bias \[K\] = \[5\]"),
    (dict(w=(5, 3, 3, 4), b=(5,), extras=[(1, 5, 1, 1)]), None),  # fine: K = 5
    # an NCHW X given to an NHWC node: C is read from the last dimension
    (dict(x_layout="NHWC"),
     r"input 1 \(W\) has shape \[6, 3, 3, 4\], expected the packed weights \[K, R, S, C/group\] = "
     r"\[K, 3, 3, 8\] \(w_layout KRSC, kernel_shape \[3, 3\], X's C = 8 from its last dimension"),
    (dict(group=2, w=(5, 3, 3, 2), b=(5,), extras=[(1, 5, 1, 1)]),
     r"input 1 \(W\) has K = 5 output channels, not a multiple of group 2"),
    (dict(group=2), r"input 1 \(W\) has shape \[6, 3, 3, 4\], expected the packed weights \[K, R, S, C/group\] = "
                    r"\[K, 3, 3, 2\] \(w_layout KRSC, kernel_shape \[3, 3\], X's C = 4, group 2\)"),
]


@pytest.mark.parametrize("kw,msg", KRSC_ERRORS, ids=[str(k) for k, _ in KRSC_ERRORS])
def test_fused_conv_krsc_shape_errors(kw, msg, lib):
    """w_layout KRSC: W must be [K, R, S, C/group], K is its first dimension. X [1, 4, 8, 8]
    (NCHW unless the case says x_layout), W [6, 3, 3, 4], pads 1."""
    kw = dict(kw)
    extras = kw.pop("extras", [(1, 6, 1, 1)])
    layouts = {"x_layout": kw.pop("x_layout")} if "x_layout" in kw else {}
    conv = ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=kw.pop("group", 1))
    model = without_ranks(fused_conv_model(conv, None, epilogue(1), [len(s) for s in extras], w_layout="KRSC",
                                           **layouts))
    feeds = _conv_feeds(**{"w": (6, 3, 3, 4), **kw, "extras": extras})
    if msg is None:
        assert run(model, feeds, lib).shape == (1, 5, 8, 8)
        return
    with pytest.raises(Exception, match=r"onnxfuse FusedConv node 'conv0': " + msg):
        run(model, feeds, lib)


def test_fused_conv_krsc_is_not_rsck(lib):
    """The same tensor read as KRSC and as RSCK (a square one, so both nodes accept it)
    gives different results: the attribute is not ignored."""
    conv = ConvAttrs((3, 3), pads=(1, 1, 1, 1))
    rng = np.random.default_rng(17)
    feeds = {"x": rng.standard_normal((1, 3, 6, 6)).astype(np.float32),
             "w": rng.standard_normal((3, 3, 3, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    prog = epilogue(0, act="none")
    krsc = run(fused_conv_model(conv, None, prog, [], w_layout="KRSC"), feeds, lib)
    rsck = run(fused_conv_model(conv, None, prog, [], w_layout="RSCK"), feeds, lib)
    np.testing.assert_array_equal(rsck, run(fused_conv_model(conv, None, prog, []), feeds, lib))
    assert not np.allclose(krsc, rsck)
    ref = run(reference_conv_model(conv, None, prog, [], (1, 3, 6, 6), True),
              {**feeds, "w": np.ascontiguousarray(feeds["w"].transpose(0, 3, 1, 2))}, None)
    np.testing.assert_allclose(krsc, ref, rtol=1e-5, atol=1e-5)


def test_fused_conv_nhwc_empty_batch(lib):
    conv = ConvAttrs((3, 3), pads=(1, 1, 1, 1))
    model = fused_conv_model(conv, PoolAttrs((2, 2), (2, 2)), epilogue(0), [], x_layout="NHWC", y_layout="NHWC")
    feeds = {"x": np.zeros((0, 8, 8, 3), np.float32), "w": np.zeros((3, 3, 3, 4), np.float32),
             "b": np.zeros(4, np.float32)}
    assert run(model, feeds, lib).shape == (0, 4, 4, 4)
    model = fused_conv_model(conv, None, epilogue(0), [], y_layout="NHWC")
    feeds["x"] = np.zeros((0, 3, 8, 6), np.float32)
    assert run(model, feeds, lib).shape == (0, 8, 6, 4)


def test_fused_maxpool_errors(lib):
    pool = PoolAttrs((2, 2), (2, 2))
    model = without_ranks(fused_pool_model(pool, epilogue(1), [4]))
    with pytest.raises(Exception, match=r"onnxfuse FusedMaxPool node 'pool0': input 0 \(X\) has shape \[3, 8, 8\], "
                                        r"expected rank 4"):
        run(model, {"x": np.zeros((3, 8, 8), np.float32), "e0": np.zeros((1, 3, 1, 1), np.float32)}, lib)
    with pytest.raises(Exception, match=r"FusedMaxPool node 'pool0': input 1 \(program input %1\) has shape "
                                        r"\[1, 4, 1, 1\], which does not broadcast to X's shape \[1, 3, 8, 8\]"):
        run(model, {"x": np.zeros((1, 3, 8, 8), np.float32), "e0": np.zeros((1, 4, 1, 1), np.float32)}, lib)
    with pytest.raises(Exception, match=r"FusedMaxPool node 'pool0': the max pool's input \[1, 3, 1, 8\] is too small"):
        run(model, {"x": np.zeros((1, 3, 1, 8), np.float32), "e0": np.zeros((1, 3, 1, 1), np.float32)}, lib)
    no_pool = fused_pool_model(pool, epilogue(0), [])
    for a in [a for a in no_pool.graph.node[0].attribute if a.name == "pool_strides"]:
        no_pool.graph.node[0].attribute.remove(a)
    with pytest.raises(Exception, match=r"FusedMaxPool node 'pool0': the node needs the five attributes"):
        run(no_pool, {"x": np.zeros((1, 3, 8, 8), np.float32)}, lib)


# ---------------------------------------------------------------------------------------
# CUDA launcher (the device machine): kernels compiled with onnxfuse.compile, attached as
# docs/format.md says, compared with the CPU kernel of the same node
# ---------------------------------------------------------------------------------------

def with_kernels(model: onnx.ModelProto, spec) -> onnx.ModelProto:
    import json

    from onnxfuse.compile import compile_kernels, local_gpu_archs

    ck = compile_kernels([spec], local_gpu_archs())[0]
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("kernel_meta", json.dumps(ck.kernel_meta())))
    for i, blob in enumerate(ck.kernels()):
        node.attribute.append(helper.make_attribute(f"kernel_{i}", blob))
    return model


def with_meta_keys(model: onnx.ModelProto, **keys) -> onnx.ModelProto:
    """The node's kernel_meta with `keys` set, or removed where the value is None (a
    hand-made mismatch)."""
    import json

    attr = next(a for a in model.graph.node[0].attribute if a.name == "kernel_meta")
    meta = {**json.loads(attr.s), **keys}
    attr.s = json.dumps({k: v for k, v in meta.items() if v is not None}).encode()
    return model


def run_cuda(model: onnx.ModelProto, feeds: dict, lib: str) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(lib)
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the node must run on CUDA
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])
    return sess.run(None, feeds)[0]


def check_cuda_conv(case: ConvCase, seed: int, kernel_name: str, lib: str) -> None:
    """The node of `case` (an epilogue reading every extra) on CUDA, with a kernel compiled
    for its layouts in "ieee" precision, against the CPU kernel of the same node."""
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import ConvSpec

    prog = epilogue(len(case.extras))
    feeds, _, _ = conv_feeds(case, np.random.default_rng(seed))
    ranks = [len(feeds[f"e{i}"].shape) for i in range(len(case.extras))]
    model = fused_conv_model(case.conv, case.pool, prog, ranks, **case.layout_attrs)
    want = run(model, feeds, lib)  # the CPU kernel (no kernel_meta needed)
    spec = ConvSpec(kernel_name, prog, case.x[1], case.k, case.conv, case.pool, "ieee",
                    x_layout=case.x_layout.lower(), y_layout=case.y_layout.lower(),
                    extra_layouts=case.extra_layouts, w_layout=case.w_layout.lower())
    got = run_cuda(with_kernels(model, spec), feeds, lib)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("pool", [None, PoolAttrs((2, 2), (2, 2))], ids=["no_pool", "pool2x2"])
def test_cuda_fused_conv_extras_of_every_shape(pool, lib):
    """One extra input of each broadcast shape (full, per channel, scalar, rank-1 row): the
    launcher's strides over [N, K, P, Q], right-aligned."""
    case = ConvCase((2, 8, 12, 13), 16, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), pool,
                    extras=("full", "channel", "scalar", "row"), act="relu", id="cuda")
    check_cuda_conv(case, 11, "onnxfuse_conv_test_cuda_0000", lib)


CUDA_LAYOUTS = [("NHWC", "NCHW", None), ("NCHW", "NHWC", None), ("NHWC", "NHWC", None),
                ("NHWC", "NHWC", PoolAttrs((2, 2), (2, 2))), ("NCHW", "NHWC", PoolAttrs((2, 2), (2, 2)))]


@pytest.mark.gpu
@pytest.mark.parametrize("x_layout,y_layout,pool", CUDA_LAYOUTS,
                         ids=[f"{x}_{y}" + ("_pool" if p else "") for x, y, p in CUDA_LAYOUTS])
def test_cuda_fused_conv_layouts(x_layout, y_layout, pool, lib):
    """x_layout / y_layout / extra_layouts on CUDA (kernel compiled for the layouts, the
    launcher's shapes and NHWC extra strides) against the CPU kernel of the same node."""
    case = ConvCase((2, 8, 12, 14), 16, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), pool,
                    extras=("full_nhwc", "channel", "pixel_nhwc", "full"), x_layout=x_layout, y_layout=y_layout,
                    id="cuda_layouts")
    idx = CUDA_LAYOUTS.index((x_layout, y_layout, pool))
    check_cuda_conv(case, 13, f"onnxfuse_conv_test_cuda_1{idx:03d}", lib)


CUDA_KRSC = [("NHWC", "NHWC", None), ("NHWC", "NHWC", PoolAttrs((2, 2), (2, 2))), ("NCHW", "NCHW", None)]


@pytest.mark.gpu
@pytest.mark.parametrize("x_layout,y_layout,pool", CUDA_KRSC,
                         ids=[f"{x}_{y}" + ("_pool" if p else "") for x, y, p in CUDA_KRSC])
def test_cuda_fused_conv_krsc(x_layout, y_layout, pool, lib):
    """w_layout KRSC on CUDA (a kernel compiled for [K, R, S, C] weights, kernel_meta
    "w_layout": "krsc") against the CPU kernel of the same node."""
    case = ConvCase((2, 12, 10, 14), 20, ConvAttrs((3, 3), pads=(1, 1, 1, 1)), pool,
                    extras=("full_nhwc" if y_layout == "NHWC" else "full", "channel"), x_layout=x_layout,
                    y_layout=y_layout, w_layout="KRSC", id="cuda_krsc")
    idx = CUDA_KRSC.index((x_layout, y_layout, pool))
    check_cuda_conv(case, 14, f"onnxfuse_conv_test_cuda_2{idx:03d}", lib)


@pytest.mark.gpu
def test_cuda_fused_maxpool_extra_of_rank_3(lib):
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import MaxPoolSpec

    pool = PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1))
    prog = epilogue(1)
    rng = np.random.default_rng(12)
    feeds = {"x": rng.standard_normal((2, 5, 11, 12)).astype(np.float32),
             "e0": rng.standard_normal((5, 1, 1)).astype(np.float32)}
    model = fused_pool_model(pool, prog, [3])
    want = run(model, feeds, lib)
    got = run_cuda(with_kernels(model, MaxPoolSpec("onnxfuse_pool_test_cuda_0000", prog, pool)), feeds, lib)
    np.testing.assert_array_equal(got, want)


CUDA_POOLS = [  # (pool, x_layout, y_layout, variant tile)
    (PoolAttrs((2, 2), (2, 2)), "NCHW", "NCHW", "rows"),
    (PoolAttrs((3, 3), (3, 3)), "NCHW", "NCHW", "rows"),
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "NCHW", "NCHW", "flat"),
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "NHWC", "NHWC", "nhwc"),
    (PoolAttrs((5, 5), (1, 1), (2, 2, 2, 2)), "NHWC", "NHWC", "nhwc"),
    (PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True), "NHWC", "NHWC", "nhwc"),
    (PoolAttrs((3, 2), (1, 2), (1, 1, 2, 0), dilations=(2, 2)), "NHWC", "NCHW", "nhwc"),
    (PoolAttrs((2, 2), (2, 2)), "NHWC", "NHWC", "nhwc"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("channels,height,width", [(70, 23, 29), (64, 24, 32)])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("index", range(len(CUDA_POOLS)),
                         ids=[f"{p.kernel[0]}x{p.kernel[1]}s{p.strides[0]}_{x}_{y}_{t}" for p, x, y, t in CUDA_POOLS])
def test_cuda_fused_maxpool_kernels(index, dtype, channels, height, width, lib):
    """Each pool kernel (kinds.maxpool.pool_variants' choice: rows, flat, nhwc) on CUDA against the
    CPU kernel of the same node, with a per-channel prologue extra; odd sizes. 64 channels
    and width 32 take the nhwc and rows kernels' variants for C or W % 16 == 0 (vector
    loads), 70 x 29 the ones for any size."""
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import MaxPoolSpec
    from onnxfuse.kinds.maxpool import pool_variants

    pool, x_layout, y_layout, tile = CUDA_POOLS[index]
    prog = epilogue(1, dtype)
    rng = np.random.default_rng(40 + index)
    x = rng.standard_normal((3, channels, height, width)).astype(NP[dtype])
    feeds = {"x": np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x_layout == "NHWC" else x,
             "e0": rng.standard_normal((1, channels, 1, 1)).astype(NP[dtype])}
    model = fused_pool_model(pool, prog, [4], x_layout=x_layout, y_layout=y_layout)
    want = run(model, feeds, lib)
    spec = MaxPoolSpec(f"onnxfuse_pool_test_cuda_1{index:02d}{dtype}{channels}", prog, pool, x_layout=x_layout.lower(),
                       y_layout=y_layout.lower())
    assert pool_variants(spec)[0].tile == tile
    got = run_cuda(with_kernels(model, spec), feeds, lib)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2 if dtype == "f16" else 1e-6,
                               atol=1e-6)


@pytest.mark.gpu
def test_cuda_fused_maxpool_layout_mismatch_is_a_clear_error(lib):
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import MaxPoolSpec

    pool = PoolAttrs((2, 2), (2, 2))
    model = with_kernels(fused_pool_model(pool, epilogue(0), [], x_layout="NHWC", y_layout="NHWC"),
                         MaxPoolSpec("onnxfuse_pool_test_cuda_0002", epilogue(0), pool))
    with pytest.raises(Exception, match=r"FusedMaxPool node 'pool0' \(CUDA\): the node has x_layout NHWC and y_layout "
                                        r"NHWC, its kernel_meta has x_layout \"nchw\" and y_layout \"nchw\""):
        run_cuda(model, {"x": np.zeros((1, 8, 8, 4), np.float32)}, lib)


@pytest.mark.gpu
def test_cuda_kernel_meta_mismatches_are_clear_errors(lib):
    pytest.importorskip("triton")
    from onnxfuse.codegen_conv import ConvSpec, MaxPoolSpec

    conv, pool = ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2))
    feeds = _conv_feeds(extras=[])
    # a maxpool kernel attached to a FusedConv node
    model = with_kernels(fused_conv_model(conv, None, epilogue(0), []),
                         MaxPoolSpec("onnxfuse_pool_test_cuda_0001", epilogue(0), pool))
    with pytest.raises(Exception, match=r"FusedConv node 'conv0' \(CUDA\): kernel_meta describes a kernel of kind "
                                        r"\"maxpool\", this op launches kind \"conv\""):
        run_cuda(model, feeds, lib)
    # a kernel without the pool attached to a node with one
    model = with_kernels(fused_conv_model(conv, pool, epilogue(0), []),
                         ConvSpec("onnxfuse_conv_test_cuda_0001", epilogue(0), 4, 6, conv, None, "ieee"))
    with pytest.raises(Exception, match=r"the node has pool_\* attributes, its kernel_meta has no pool_in_epilogue"):
        run_cuda(model, feeds, lib)
    # an NCHW kernel attached to a node with x_layout NHWC
    model = with_kernels(fused_conv_model(conv, None, epilogue(0), [], x_layout="NHWC"),
                         ConvSpec("onnxfuse_conv_test_cuda_0002", epilogue(0), 4, 6, conv, None, "ieee"))
    with pytest.raises(Exception, match=r"FusedConv node 'conv0' \(CUDA\): the node has x_layout NHWC and y_layout "
                                        r"NCHW, its kernel_meta has x_layout \"nchw\" and y_layout \"nchw\""):
        run_cuda(model, {**feeds, "x": np.zeros((1, 8, 8, 4), np.float32)}, lib)
    # an RSCK kernel (kernel_meta without w_layout) attached to a node with w_layout KRSC
    krsc_feeds = {**feeds, "w": np.zeros((6, 3, 3, 4), np.float32)}
    model = with_kernels(fused_conv_model(conv, None, epilogue(0), [], w_layout="KRSC"),
                         ConvSpec("onnxfuse_conv_test_cuda_0003", epilogue(0), 4, 6, conv, None, "ieee"))
    with pytest.raises(Exception, match=r"FusedConv node 'conv0' \(CUDA\): the node has w_layout KRSC, its "
                                        r"kernel_meta has w_layout \"rsck\" \(absent: \"rsck\"\)"):
        run_cuda(with_meta_keys(model, w_layout=None), krsc_feeds, lib)
    # a kernel_meta saying krsc on a node without w_layout (RSCK)
    model = with_kernels(fused_conv_model(conv, None, epilogue(0), []),
                         ConvSpec("onnxfuse_conv_test_cuda_0003", epilogue(0), 4, 6, conv, None, "ieee"))
    with pytest.raises(Exception, match=r"FusedConv node 'conv0' \(CUDA\): the node has w_layout RSCK, its "
                                        r"kernel_meta has w_layout \"krsc\""):
        run_cuda(with_meta_keys(model, w_layout="krsc"), feeds, lib)
    # w_layout in kernel_meta is lower case
    model = with_kernels(fused_conv_model(conv, None, epilogue(0), [], w_layout="KRSC"),
                         ConvSpec("onnxfuse_conv_test_cuda_0003", epilogue(0), 4, 6, conv, None, "ieee"))
    with pytest.raises(Exception, match=r"FusedConv node 'conv0' \(CUDA\): kernel_meta: w_layout must be \"rsck\" "
                                        r"or \"krsc\""):
        run_cuda(with_meta_keys(model, w_layout="KRSC"), krsc_feeds, lib)
