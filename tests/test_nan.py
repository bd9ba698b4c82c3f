"""NaN and +-Inf through every fused kernel kind (README, Reliability).

Every fused kernel propagates NaN as numpy and torch do: an element, or a max-pool window,
that holds a NaN gives NaN, wherever the NaN lies in the window. Relu, Max, Min and Clip of
a NaN are NaN; a conv whose sum reads a NaN (or both infinities) is NaN. +Inf comes out as
+Inf where it is the largest value, a window of -Inf (and padding) gives -Inf, Relu(-Inf)
is 0 and Clip clamps an infinity to its bound. The reference is numpy in float64
(np.maximum propagates NaN; tests/layer_ref.py).

Checked for every kernel kind:
- the library's CPU kernels on ONNX Runtime's CPU provider: small models that
  `optimize_model` fuses into PointwiseChain (Relu, Max, Min, Clip), FusedConv (Relu, Clip
  and residual epilogues, with and without a 2x2 MaxPool in the epilogue) and FusedMaxPool
  (tiling, padded, ceil-mode and dilated windows), NCHW; and a model laid out channels-last
  (kernels compiled for sm_90) with a grouped conv and a lone MaxPool;
- the Triton kernels (pointwise; conv tap loop, flat loop, direct loop, split K, pool in the
  epilogue; the flat, rows and nhwc pools) in Triton's interpreter, in one child process,
  with the GPU's rule for float max/min without NaN propagation
  (tests/test_codegen.py, `_install_gpu_max_semantics`): a kernel that would drop a NaN on
  the GPU drops it there too;
- the source text and the sm_90 PTX of those kernels: every float max and min is
  NaN-propagating (PTX max.NaN.f32; plain max.f32 returns the operand that is not NaN);
- on a GPU (marker `gpu`): the models above through the CUDA kernels.

ONNX Runtime's own kernels are no reference for NaN: its CPU MaxPool mostly drops it (which
element wins depends on where the NaN lies in the window, on the other values and on the
code path); `test_ort_cpu_maxpool_drops_nan` pins what README says about it. Its Relu,
Clip, Max and Min propagate NaN as the fused kernels do.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

import onnxfuse
from onnxfuse import optimize_model
from onnxfuse.layers import ConvAttrs, PoolAttrs
from tests.layer_ref import conv2d, maxpool2d
from tests.test_edges import assert_same
from tests.util import interpreted_run, model, run

REPO = Path(__file__).resolve().parents[1]
N = helper.make_node


@pytest.fixture(autouse=True)
def quiet_numpy():
    """The references compute inf - inf and NaN comparisons on purpose."""
    with np.errstate(invalid="ignore"):
        yield


# ---------------------------------------------------------------------------------------
# inputs and the reference
# ---------------------------------------------------------------------------------------

def sprinkle(shape: tuple[int, ...], seed: int, density: float) -> np.ndarray:
    """Standard normal float32 values with NaN at a fraction `density` of the positions and
    +Inf, -Inf at half that each."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    u = rng.random(shape)
    x[u < density] = np.nan
    x[(u >= density) & (u < 1.5 * density)] = np.inf
    x[(u >= 1.5 * density) & (u < 2 * density)] = -np.inf
    return x


def pool_input(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """`sprinkle`d, and in the first plane's top-left corner: an all-NaN 2x2 block, a block
    with +Inf then NaN, an all -Inf block, a block where +Inf wins, a NaN after finite values."""
    x = sprinkle(shape, seed, 0.08)
    p = x[0, 0]
    p[0:2, 0:2] = np.nan
    p[0:2, 2:4] = [[np.inf, 1.0], [2.0, np.nan]]
    p[2:4, 0:2] = -np.inf
    p[2:4, 2:4] = [[1.0, 2.0], [np.inf, 3.0]]
    p[4:6, 4:6] = [[1.0, 2.0], [3.0, np.nan]]
    return x


def conv_input(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Standard normal, with one NaN, one +Inf and one -Inf per image (a 3x3 conv spreads each
    to 9 positions of every output channel; where +Inf and -Inf meet, NaN)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    n, c, h, w = shape
    for i in range(n):
        spots = rng.choice(h * w, 3, replace=False)
        for value, spot in zip((np.nan, np.inf, -np.inf), spots, strict=True):
            x[i, rng.integers(c), spot // w, spot % w] = value
    return x


def finite_scale(a: np.ndarray) -> float:
    f = np.abs(a[np.isfinite(a)].astype(np.float64))
    return float(f.max()) if f.size else 1.0


def check(expected: np.ndarray, got: np.ndarray, what: str, rtol: float = 1e-5) -> None:
    """NaN exactly where the reference has NaN, the same infinities, finite values within
    rtol (relative, and of the largest finite reference value)."""
    assert_same(expected, got, rtol=rtol, atol=rtol * finite_scale(expected), signed_zero=False, what=what)


# ---------------------------------------------------------------------------------------
# models: (model, feeds, numpy reference, the fused op types optimize_model must give)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCase:
    id: str
    build: Callable[[], tuple[onnx.ModelProto, dict, np.ndarray]]
    fused: tuple[str, ...]


def _io(x_shape, y_shape, **extra) -> tuple[dict, dict]:
    return {"x": ("float32", list(x_shape)), **extra}, {"y": ("float32", list(y_shape))}


def pool_model(pool: PoolAttrs, prologue: str, shape=(2, 3, 12, 13), seed: int = 1):
    """prologue (Relu, or Mul by 1 which keeps -Inf) -> MaxPool."""
    x = pool_input(shape, seed)
    first = N("Relu", ["x"], ["t"]) if prologue == "relu" else N("Mul", ["x", "one"], ["t"])
    nodes = [first, N("MaxPool", ["t"], ["y"], **pool.node_attrs(prefix=""))]
    inits = {} if prologue == "relu" else {"one": np.array(1.0, np.float32)}
    m = model(nodes, *_io(shape, (shape[0], shape[1], *pool.out_size(*shape[2:]))), inits)
    z = np.maximum(x, np.float32(0)) if prologue == "relu" else x
    return m, {"x": x}, maxpool2d(z, pool)


def conv_model(act: str, pool: bool = False, residual: bool = False, seed: int = 2):
    """Conv 3x3 pad 1 (bias) [-> Add residual] -> Relu or Clip(0, 6) [-> MaxPool 2x2]."""
    n, c, k, h, w = 2, 4, 6, 10, 12
    rng = np.random.default_rng(seed)
    wt = (rng.standard_normal((k, c, 3, 3)) / 6).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    x = conv_input((n, c, h, w), seed)
    attrs = ConvAttrs((3, 3), pads=(1, 1, 1, 1))
    nodes = [N("Conv", ["x", "w", "b"], ["c"], **attrs.node_attrs())]
    inits = {"w": wt, "b": b}
    feeds = {"x": x}
    z = conv2d(x, wt, b, attrs).astype(np.float32)
    cur = "c"
    extra = {}
    if residual:
        feeds["e"] = sprinkle((n, k, h, w), seed + 1, 0.08)
        extra = {"e": ("float32", [n, k, h, w])}
        nodes.append(N("Add", ["c", "e"], ["a"]))
        z, cur = z + feeds["e"], "a"
    if act == "relu":
        nodes.append(N("Relu", [cur], ["r" if pool else "y"]))
        z = np.maximum(z, np.float32(0))
    else:
        nodes.append(N("Clip", [cur, "lo", "hi"], ["r" if pool else "y"]))
        inits.update(lo=np.array(0.0, np.float32), hi=np.array(6.0, np.float32))
        z = np.minimum(np.maximum(z, np.float32(0)), np.float32(6))
    out = (n, k, h, w)
    if pool:
        p = PoolAttrs((2, 2), (2, 2))
        nodes.append(N("MaxPool", ["r"], ["y"], **p.node_attrs(prefix="")))
        z, out = maxpool2d(z, p), (n, k, h // 2, w // 2)
    return model(nodes, *_io((n, c, h, w), out, **extra), inits), feeds, z


def pointwise_model(op: str, seed: int = 3):
    """Mul by 1 -> op: a PointwiseChain whose op reads a value computed in the kernel."""
    shape = (6, 37)
    x, z = sprinkle(shape, seed, 0.1), sprinkle(shape, seed + 1, 0.1)
    nodes = [N("Mul", ["x", "one"], ["t"])]
    inits = {"one": np.array(1.0, np.float32)}
    feeds, extra = {"x": x}, {}
    if op == "Relu":
        nodes.append(N("Relu", ["t"], ["y"]))
        want = np.maximum(x, np.float32(0))
    elif op == "Clip":
        nodes.append(N("Clip", ["t", "lo", "hi"], ["y"]))
        inits.update(lo=np.array(-1.0, np.float32), hi=np.array(2.0, np.float32))
        want = np.minimum(np.maximum(x, np.float32(-1)), np.float32(2))
    else:
        nodes.append(N(op, ["t", "z"], ["y"]))
        feeds["z"], extra = z, {"z": ("float32", list(shape))}
        want = (np.maximum if op == "Max" else np.minimum)(x, z)
    return model(nodes, *_io(shape, shape, **extra), inits), feeds, want


def nhwc_stack(seed: int = 4, group: int = 16):
    """Conv 3x3 -> Relu -> MaxPool 3x3 s2 p1 -> grouped Conv 3x3 -> Clip(0, 6): laid out
    channels-last, a FusedConv, a lone FusedMaxPool (pattern `maxpool`) and a grouped FusedConv
    (16 channels: depthwise by default; group 2, 8 channels per group, runs the block-diagonal
    GEMM at "tf32", two groups to a tile)."""
    n, c, h = 2, 16, 12
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((c, c, 3, 3)) / 12).astype(np.float32)
    b1 = rng.standard_normal(c).astype(np.float32)
    w2 = (rng.standard_normal((c, c // group, 3, 3)) / 3).astype(np.float32)
    b2 = rng.standard_normal(c).astype(np.float32)
    x = conv_input((n, c, h, h), seed)
    a1, a2 = ConvAttrs((3, 3), pads=(1, 1, 1, 1)), ConvAttrs((3, 3), pads=(1, 1, 1, 1), group=group)
    p = PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1))
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], **a1.node_attrs()), N("Relu", ["c1"], ["r1"]),
             N("MaxPool", ["r1"], ["p1"], **p.node_attrs(prefix="")),
             N("Conv", ["p1", "w2", "b2"], ["c2"], **a2.node_attrs()), N("Clip", ["c2", "lo", "hi"], ["y"])]
    inits = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "lo": np.array(0.0, np.float32),
             "hi": np.array(6.0, np.float32)}
    z = maxpool2d(np.maximum(conv2d(x, w1, b1, a1).astype(np.float32), np.float32(0)), p)
    z = np.minimum(np.maximum(conv2d(z, w2, b2, a2).astype(np.float32), np.float32(0)), np.float32(6))
    return model(nodes, *_io(x.shape, z.shape), inits), {"x": x}, z


MODEL_CASES = [
    ModelCase("relu_maxpool_2x2", lambda: pool_model(PoolAttrs((2, 2), (2, 2)), "relu"), ("FusedMaxPool",)),
    ModelCase("relu_maxpool_3x3_s3", lambda: pool_model(PoolAttrs((3, 3), (3, 3)), "relu"), ("FusedMaxPool",)),
    ModelCase("mul_maxpool_3x3_s2_p1", lambda: pool_model(PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1)), "mul"),
              ("FusedMaxPool",)),
    ModelCase("mul_maxpool_ceil", lambda: pool_model(PoolAttrs((3, 3), (2, 2), (1, 1, 1, 1), ceil_mode=True), "mul"),
              ("FusedMaxPool",)),
    ModelCase("relu_maxpool_dilated", lambda: pool_model(PoolAttrs((2, 2), (1, 1), dilations=(2, 2)), "relu"),
              ("FusedMaxPool",)),
    ModelCase("conv_relu", lambda: conv_model("relu"), ("FusedConv",)),
    ModelCase("conv_clip", lambda: conv_model("clip"), ("FusedConv",)),
    ModelCase("conv_residual_relu", lambda: conv_model("relu", residual=True), ("FusedConv",)),
    ModelCase("conv_relu_maxpool", lambda: conv_model("relu", pool=True), ("FusedConv",)),
    ModelCase("conv_residual_clip_maxpool", lambda: conv_model("clip", pool=True, residual=True), ("FusedConv",)),
    *[ModelCase(f"pointwise_{op.lower()}", lambda op=op: pointwise_model(op), ("PointwiseChain",))
      for op in ("Relu", "Max", "Min", "Clip")],
]


def library_session(m: onnx.ModelProto, provider: str = "CPUExecutionProvider"):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if provider != "CPUExecutionProvider":  # the fused nodes must run there
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return onnxfuse.InferenceSession(m.SerializeToString(), providers=[provider], sess_options=so)


def fused_types(m: onnx.ModelProto) -> tuple[str, ...]:
    return tuple(n.op_type for n in m.graph.node if n.domain == "onnxfuse")


def check_reference_is_meaningful(want: np.ndarray, what: str) -> None:
    """The reference has NaN, finite values, and (but for Clip) +Inf."""
    assert np.isnan(want).any() and np.isfinite(want).any(), what
    if "clip" not in what:
        assert np.isposinf(want).any(), what


# ---------------------------------------------------------------------------------------
# the library's CPU kernels
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.id)
def test_cpu_kernels_propagate_nan(case):
    """The library's CPU kernel of every kind against numpy: NaN where a window or element
    holds one. Before the fix the CPU max pool dropped NaN (the max of the other elements,
    -Inf for an all-NaN window)."""
    m, feeds, want = case.build()
    check_reference_is_meaningful(want, case.id)
    r = optimize_model(m)
    assert fused_types(r.model) == case.fused, r.report.summary()
    (got,) = library_session(r.model).run(None, feeds)
    check(want, got, f"{case.id} (library CPU kernel)")


def test_cpu_kernels_propagate_nan_channels_last(tmp_path, monkeypatch):
    """The NHWC layout (kernels compiled for sm_90, conv precision ieee so that the weights
    stay as they are): FusedConv NCHW -> NHWC, a lone FusedMaxPool NHWC, a grouped FusedConv
    NHWC -> NCHW, through the library's CPU kernels."""
    pytest.importorskip("triton")
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m, feeds, want = nhwc_stack()
    check_reference_is_meaningful(want, "nhwc_stack clip")
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options("sm_90", conv_precision="ieee", layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"], info
    assert sorted(fused_types(r.model)) == ["FusedConv", "FusedConv", "FusedMaxPool"], r.report.summary()
    (got,) = library_session(r.model).run(None, feeds)
    check(want, got, "nhwc_stack (library CPU kernels)")


def test_issue_example_relu_maxpool():
    """The issue's case: Relu -> MaxPool 2x2 on a 3x4x10x10 input with NaN and Inf sprinkled
    in. The fused node gives NaN in every window that holds one, as numpy and torch do; ONNX
    Runtime's own MaxPool (the original model, and the fused node's function body) drops most
    of them (README, Reliability)."""
    x = sprinkle((3, 4, 10, 10), 0, 0.1)
    m = model([N("Relu", ["x"], ["t"]), N("MaxPool", ["t"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
              *_io(x.shape, (3, 4, 5, 5)))
    r = optimize_model(m)
    assert fused_types(r.model) == ("FusedMaxPool",)
    want = maxpool2d(np.maximum(x, np.float32(0)), PoolAttrs((2, 2), (2, 2)))
    (got,) = library_session(r.model).run(None, {"x": x})
    check(want, got, "Relu -> MaxPool (library CPU kernel)")
    original = run(m, {"x": x})[0]
    bodies = run(r.model, {"x": x})[0]
    np.testing.assert_array_equal(bodies, original)
    assert (np.isnan(original).sum(), np.isnan(want).sum()) == (36, 125)  # README's numbers


def test_ort_cpu_maxpool_drops_nan():
    """What README says about ONNX Runtime's own CPU kernels (measured with onnxruntime 1.32 on
    x86): Relu, Clip, Max and Min give NaN for a NaN at any position; MaxPool gives NaN for a
    2x2 window of ones with a NaN only when the NaN is the window's last element (no
    dilation), only when it is the first (dilated, or with the Indices output), and the
    result also depends on the other values; a 1-D MaxPool and GlobalMaxPool drop it. If this
    fails, ONNX Runtime changed: update README."""
    def pool_nan_positions(shape, indices: bool = False, **attrs) -> list[int]:
        outs = {"y": ("float32", [None] * 4), **({"i": ("int64", [None] * 4)} if indices else {})}
        m = model([N("MaxPool", ["x"], list(outs), **attrs)], {"x": ("float32", list(shape))}, outs)
        s, (kh, kw), d = attrs["strides"][0], attrs["kernel_shape"], attrs.get("dilations", [1, 1])[0]
        out = []
        for pos in range(kh * kw):
            x = np.ones(shape, np.float32)
            x[0, 0, s + (pos // kw) * d, s + (pos % kw) * d] = np.nan  # in output (1, 1)'s window
            out.append(int(np.isnan(run(m, {"x": x})[0][0, 0, 1, 1])))
        return out

    assert pool_nan_positions((1, 1, 8, 8), kernel_shape=[2, 2], strides=[2, 2]) == [0, 0, 0, 1]
    assert pool_nan_positions((1, 1, 12, 12), kernel_shape=[2, 2], strides=[2, 2], dilations=[2, 2]) == [1, 0, 0, 0]
    assert pool_nan_positions((1, 1, 8, 8), True, kernel_shape=[2, 2], strides=[2, 2]) == [1, 0, 0, 0]
    m1 = model([N("MaxPool", ["x"], ["y"], kernel_shape=[3], strides=[3])], {"x": ("float32", [1, 1, 9])},
               {"y": ("float32", [1, 1, 3])})
    for pos in range(3):
        x = np.ones((1, 1, 9), np.float32)
        x[0, 0, 3 + pos] = np.nan
        assert run(m1, {"x": x})[0][0, 0, 1] == 1.0, pos

    def pool_of(vals):
        m = model([N("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], {"x": ("float32", [1, 1, 2, 2])},
                  {"y": ("float32", [1, 1, 1, 1])})
        return float(run(m, {"x": np.array(vals, np.float32).reshape(1, 1, 2, 2)})[0].item())

    assert pool_of([2, 1, 1, np.nan]) == 2.0 and np.isnan(pool_of([np.nan, np.nan, 1, 2]))
    x = np.ones((1, 1, 16, 16), np.float32)
    x[0, 0, 3, 3] = np.nan
    g = model([N("GlobalMaxPool", ["x"], ["y"])], {"x": ("float32", [1, 1, 16, 16])}, {"y": ("float32", [1, 1, 1, 1])})
    assert run(g, {"x": x})[0].item() == 1.0
    for op in ("Relu", "Max", "Min", "Clip"):
        m, feeds, want = pointwise_model(op)
        np.testing.assert_array_equal(np.isnan(run(m, feeds)[0]), np.isnan(want), err_msg=op)


# ---------------------------------------------------------------------------------------
# the Triton kernels in the interpreter (child process), with the GPU's max/min rule
# ---------------------------------------------------------------------------------------

RELU = "%1 = max %0 0.0\noutput %1 {dt}"
IDENT = "%1 = mul %0 1.0\noutput %1 {dt}"  # keeps -Inf, which Relu would turn into 0
CLIP = "%1 = max %0 0.0\n%2 = min %1 6.0\noutput %2 {dt}"
RESIDUAL_RELU = "%2 = add %0 %1\n%3 = max %2 0.0\noutput %3 {dt}"

# (id, input dtypes, program body): pointwise kernels over 1-D tensors of 301 elements
POINTWISE = [
    ("relu", ("f32",), "%1 = max %0 0.0\noutput %1 f32"),
    ("max", ("f32", "f32"), "%2 = max %0 %1\noutput %2 f32"),
    ("min", ("f32", "f32"), "%2 = min %0 %1\noutput %2 f32"),
    ("clip", ("f32",), "%1 = max %0 -1.0\n%2 = min %1 2.0\noutput %2 f32"),
    ("relu-f16", ("f16",), "%1 = max %0 0.0\noutput %1 f16"),
]


def _interp_cases():
    from tests.test_conv_codegen import ConvCase, PoolCase

    pad1 = (1, 1, 1, 1)
    pools = [
        PoolCase("flat-3x3-s2-p1", (2, 3, 9, 9), PoolAttrs((3, 3), (2, 2), pad1)),
        PoolCase("flat-ceil-ident", (1, 2, 10, 9), PoolAttrs((3, 3), (2, 2), pad1, (1, 1), True), IDENT),
        PoolCase("flat-dilated-asym", (1, 3, 11, 9), PoolAttrs((2, 3), (2, 2), (0, 1, 1, 0), (2, 1), True)),
        PoolCase("rows-2x2", (3, 5, 13, 11), PoolAttrs((2, 2), (2, 2)), tile="rows"),
        PoolCase("rows-3x3-s3-ident", (2, 3, 11, 14), PoolAttrs((3, 3), (3, 3)), IDENT, tile="rows"),
        PoolCase("rows-fp16", (2, 5, 9, 10), PoolAttrs((2, 2), (2, 2)), dtype="f16", tile="rows"),
        PoolCase("rows-residual", (3, 3, 7, 9), PoolAttrs((2, 2), (2, 2)), RESIDUAL_RELU, ("full",), tile="rows"),
        PoolCase("rows-default-blocks", (2, 3, 20, 150), PoolAttrs((2, 2), (2, 2)), tile="default"),
        PoolCase("nhwc-3x3-s2-p1-ident", (2, 6, 9, 11), PoolAttrs((3, 3), (2, 2), pad1), IDENT, tile="nhwc",
                 layouts=("nhwc", "nhwc")),
        PoolCase("nhwc-to-nchw-residual", (2, 5, 7, 6), PoolAttrs((3, 3), (2, 2), pad1), RESIDUAL_RELU, ("full",),
                 tile="nhwc", layouts=("nhwc", "nchw")),
    ]
    c3 = ConvAttrs((3, 3), (1, 1), pad1)
    p2 = PoolAttrs((2, 2), (2, 2))
    convs = [
        ConvCase("tap-relu", 1, 32, (7, 6), 20, c3),
        ConvCase("tap-clip", 2, 3, (9, 11), 5, c3, body=CLIP),
        ConvCase("pool2x2", 2, 4, (8, 8), 6, c3, p2),
        ConvCase("pool3x3-padded-window-ident", 1, 4, (9, 9), 6, c3, PoolAttrs((3, 3), (3, 3)), body=IDENT),
        ConvCase("residual-pool", 2, 4, (8, 8), 6, c3, p2, body=RESIDUAL_RELU, extras=("full",)),
        ConvCase("nhwc-krsc-pool-clip", 2, 32, (8, 9), 16, c3, p2, body=CLIP, layouts=("nhwc", "nhwc"),
                 w_layout="krsc"),
        ConvCase("flat-rgb-pool", 2, 3, (9, 10), 16, c3, p2, flat=True),
        ConvCase("fp16-pool", 2, 16, (7, 7), 16, c3, p2, dtype="f16"),
        ConvCase("depthwise-residual", 1, 8, (8, 7), 8, ConvAttrs((3, 3), (1, 1), pad1, group=8),
                 body=RESIDUAL_RELU, extras=("full",), layouts=("nhwc", "nhwc"), w_layout="krsc"),
        ConvCase("split3-residual", 1, 40, (5, 6), 24, c3, body=RESIDUAL_RELU, extras=("full",),
                 layouts=("nhwc", "nhwc"), w_layout="krsc", split=3),
        # two groups of 8 channels to a 16-column tile: a NaN or Inf in one group's input must
        # not reach the other group's outputs through its zero weights
        ConvCase("group-gemm-residual", 1, 32, (8, 7), 32, ConvAttrs((3, 3), (1, 1), pad1, group=4),
                 body=RESIDUAL_RELU, extras=("full",), layouts=("nhwc", "nhwc"), w_layout="krsc",
                 tile=(32, 16, 16), gemm=True),
    ]
    return pools, convs


INTERP_POOLS, INTERP_CONVS = _interp_cases()


def _pointwise_inputs(i: int, dtypes: tuple[str, ...]) -> list[np.ndarray]:
    return [sprinkle((301,), 100 + 10 * i + j, 0.1).astype(np.float16 if dt == "f16" else np.float32)
            for j, dt in enumerate(dtypes)]


def _pool_inputs(i: int, case) -> tuple[np.ndarray, list[np.ndarray]]:
    from tests.test_conv_codegen import _extra_shape

    x = pool_input(case.shape, 200 + i).astype(np.float16 if case.dtype == "f16" else np.float32)
    return x, [sprinkle(_extra_shape(e, case.shape), 250 + i, 0.08) for e in case.extras]


def _conv_inputs(i: int, case):
    from tests.test_conv_codegen import _extra_shape

    rng = np.random.default_rng(300 + i)
    h, w = case.hw
    dt = np.float16 if case.dtype == "f16" else np.float32
    x = conv_input((case.n, case.c, h, w), 300 + i).astype(dt)
    cg = case.c // case.conv.group
    wt = (rng.standard_normal((case.k, cg) + case.conv.kernel) / np.sqrt(cg * 9)).astype(dt)
    b = rng.standard_normal(case.k).astype(dt)
    p, q = case.conv.out_size(h, w)
    extras = [sprinkle(_extra_shape(e, (case.n, case.k, p, q)), 350 + i, 0.08) for e in case.extras]
    return x, wt, b, extras


def _pointwise_reference(body: str, inputs: list[np.ndarray]) -> np.ndarray:
    from onnxfuse.expr import evaluate, parse

    return evaluate(parse(_pointwise_text(body, inputs)), inputs)[0]


def _pointwise_text(body: str, inputs) -> str:
    from onnxfuse.expr import HEADER

    dts = ["f16" if a.dtype == np.float16 else "f32" for a in inputs]
    return "\n".join([HEADER, *[f"input %{j} {dt}" for j, dt in enumerate(dts)], body]) + "\n"


def _run_interpreted(workdir: Path) -> None:
    """The child process: every case's kernel under the interpreter; writes out.npz, and
    KEY_error.txt for a kernel that failed."""
    import torch

    from onnxfuse.codegen import Variant, generate
    from onnxfuse.codegen_conv import generate_conv, generate_maxpool
    from onnxfuse.expr import parse
    from tests.test_conv_codegen import _conv_spec, _launch_conv, _launch_pool, _load_kernel, _pool_spec

    results = {}

    def attempt(key: str, fn, *args) -> None:
        try:
            results[key] = fn(*args)
        except Exception as e:  # reported by the case's test
            (workdir / f"{key}_error.txt").write_text(f"{type(e).__name__}: {e}")

    def pointwise(i: int, dtypes, body: str) -> np.ndarray:
        inputs = _pointwise_inputs(i, dtypes)
        name = f"k_nan_pw_{i}"
        ks = generate(parse(_pointwise_text(body, inputs)), name, 1, ("full",) * len(inputs), (), Variant(0, 64))
        fn = _load_kernel(workdir, ks.source, name)
        out = torch.empty(301, dtype=torch.float16 if dtypes[0] == "f16" else torch.float32)
        fn[(-(-301 // 64),)](*map(torch.from_numpy, inputs), out, 301, BLOCK=64)
        return out.float().numpy()

    def pool(i: int, case) -> np.ndarray:
        spec, v = _pool_spec(1000 + i, case)
        ks = generate_maxpool(spec, v)
        x, extras = _pool_inputs(i, case)
        return _launch_pool(_load_kernel(workdir, ks.source, spec.name), ks, v, case, x, extras)

    def conv(i: int, case) -> np.ndarray:
        spec, v = _conv_spec(1000 + i, case)
        ks = generate_conv(spec, v)
        return _launch_conv(_load_kernel(workdir, ks.source, spec.name), ks, v, case, *_conv_inputs(i, case))

    for i, (_, dtypes, body) in enumerate(POINTWISE):
        attempt(f"pw{i}", pointwise, i, dtypes, body)
    for i, case in enumerate(INTERP_POOLS):
        attempt(f"pool{i}", pool, i, case)
    for i, case in enumerate(INTERP_CONVS):
        attempt(f"conv{i}", conv, i, case)
    np.savez(workdir / "out.npz", **results)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    with interpreted_run(__file__, "onnxfuse-nan-interp-") as workdir:
        yield workdir


def _interpreted(workdir: Path, key: str) -> np.ndarray:
    err = workdir / f"{key}_error.txt"
    if err.exists():
        pytest.fail(f"kernel failed: {err.read_text()}")
    return np.load(workdir / "out.npz")[key]


@pytest.mark.parametrize("index", range(len(POINTWISE)), ids=[c[0] for c in POINTWISE])
def test_interpreted_pointwise_kernels_propagate_nan(interpreted, index):
    _, dtypes, body = POINTWISE[index]
    inputs = _pointwise_inputs(index, dtypes)
    want = _pointwise_reference(body, inputs).astype(np.float32)
    assert np.isnan(want).any()
    check(want, _interpreted(interpreted, f"pw{index}"), POINTWISE[index][0], 1e-3 if "f16" in dtypes else 1e-5)


@pytest.mark.parametrize("index", range(len(INTERP_POOLS)), ids=[c.id for c in INTERP_POOLS])
def test_interpreted_pool_kernels_propagate_nan(interpreted, index):
    """Before the fix: the flat and nhwc kernels took tl.maximum(best, v) at its default (PTX
    max.f32, which drops a NaN operand) and the rows kernel tl.max over each window row."""
    from tests.test_conv_codegen import _pool_reference

    case = INTERP_POOLS[index]
    x, extras = _pool_inputs(index, case)
    want = _pool_reference(case, x, extras).astype(np.float32)
    check_reference_is_meaningful(want, case.id)
    check(want, _interpreted(interpreted, f"pool{index}"), case.id, 1e-2 if case.dtype == "f16" else 1e-5)


@pytest.mark.parametrize("index", range(len(INTERP_CONVS)), ids=[c.id for c in INTERP_CONVS])
def test_interpreted_conv_kernels_propagate_nan(interpreted, index):
    """Before the fix: the pool in the epilogue was tl.max over each window (max.f32)."""
    from tests.test_conv_codegen import _conv_reference

    case = INTERP_CONVS[index]
    want = _conv_reference(case, *_conv_inputs(index, case)).astype(np.float32)
    check_reference_is_meaningful(want, case.id)
    check(want, _interpreted(interpreted, f"conv{index}"), case.id, 1e-2 if case.dtype == "f16" else 1e-5)


# ---------------------------------------------------------------------------------------
# the source text and the PTX
# ---------------------------------------------------------------------------------------

# PTX float max/min that return the operand that is not NaN (max.f32, max.ftz.f32, ...);
# the NaN-propagating forms are max.NaN.f32 and the like
DROPS_NAN = re.compile(r"\b(?:max|min)(?:\.ftz)?\.(?:f32|f16|bf16|f16x2|bf16x2)\b")


def _kernel_specs():
    """One spec of every pool kernel, conv epilogue and pointwise kind, for sm_90."""
    from onnxfuse.codegen import KernelSpec
    from onnxfuse.codegen_conv import ConvSpec, MaxPoolSpec
    from onnxfuse.expr import HEADER, parse

    def prog(body: str, dt: str = "f32", extras: int = 0):
        lines = [HEADER, f"input %0 {dt}"] + [f"input %{i + 1} f32" for i in range(extras)]
        return parse("\n".join(lines) + "\n" + body.replace("{dt}", dt) + "\n")

    c3, p2, pad1 = ConvAttrs((3, 3), pads=(1, 1, 1, 1)), PoolAttrs((2, 2), (2, 2)), (1, 1, 1, 1)
    return [
        MaxPoolSpec("onnxfuse_nan_pool_rows", prog(RELU), p2),
        MaxPoolSpec("onnxfuse_nan_pool_rows_f16", prog(RESIDUAL_RELU, "f16", 1), PoolAttrs((3, 3), (3, 3))),
        MaxPoolSpec("onnxfuse_nan_pool_flat", prog(RELU), PoolAttrs((3, 3), (2, 2), pad1)),
        MaxPoolSpec("onnxfuse_nan_pool_nhwc", prog(IDENT), PoolAttrs((3, 3), (2, 2), pad1), x_layout="nhwc",
                    y_layout="nhwc"),
        ConvSpec("onnxfuse_nan_conv_pool", prog(RELU), 16, 32, c3, p2),
        ConvSpec("onnxfuse_nan_conv_pool_nhwc", prog(CLIP), 32, 64, c3, p2, x_layout="nhwc", y_layout="nhwc",
                 w_layout="krsc"),
        ConvSpec("onnxfuse_nan_conv_pool_f16", prog(RELU, "f16"), 16, 16, c3, PoolAttrs((3, 3), (3, 3))),
        ConvSpec("onnxfuse_nan_conv_clip", prog(CLIP), 16, 32, c3),
        ConvSpec("onnxfuse_nan_conv_grouped", prog(RESIDUAL_RELU, "f32", 1), 16, 16, ConvAttrs((3, 3), group=16),
                 x_layout="nhwc", y_layout="nhwc", w_layout="krsc"),
        KernelSpec(prog("%2 = max %0 %1\n%3 = min %2 6.0\n%4 = max %3 0.0\noutput %4 f32", "f32", 1),
                   "onnxfuse_nan_pointwise", 1, ("full", "full")),
    ]


def test_generated_source_uses_only_nan_propagating_max():
    """Every float max in the pool and conv kernels is the module's `max_nan` (tl.maximum with
    propagate_nan=ALL), also the window reductions (tl.reduce with max_nan, not tl.max)."""
    from onnxfuse.codegen_conv import MaxPoolSpec, PoolVariant, generate_conv, generate_maxpool
    from onnxfuse.kinds.conv import conv_variants
    from onnxfuse.kinds.maxpool import pool_variants

    checked = set()
    for spec in _kernel_specs()[:-1]:
        is_pool = isinstance(spec, MaxPoolSpec)
        variants = pool_variants(spec) if is_pool else conv_variants(spec)
        if is_pool and spec.x_layout == "nchw":
            variants = [*variants, PoolVariant(9, 64, 4)]  # the flat kernel too
        for v in variants:
            ks = generate_maxpool(spec, v) if is_pool else generate_conv(spec, v)
            src = ks.source
            checked.add(getattr(v, "tile", "conv"))
            assert "tl.max(" not in src and "tl.min(" not in src, spec.name
            calls = re.findall(r"tl\.(?:maximum|minimum)\([^\n]*", src)
            assert all("propagate_nan=tl.PropagateNan.ALL" in c for c in calls), (spec.name, calls)
            if is_pool or spec.pool is not None:
                assert "def max_nan(a, b):" in src, spec.name
                assert "tl.reduce(" in src or "best = max_nan(best, " in src, spec.name
    assert checked == {"rows", "flat", "nhwc", "conv"}


def test_sm90_ptx_has_no_max_that_drops_nan(tmp_path):
    """Compiled for sm_90 (no GPU needed): no max.f32 / min.f32 in any pool, conv or
    pointwise kernel, and NaN-propagating max.NaN.f32 where they take a max. Before the fix
    the pool kernels and the conv kernels with a pool in the epilogue held max.f32."""
    pytest.importorskip("triton")
    from onnxfuse.compile import compile_kernels

    specs = _kernel_specs()
    out = compile_kernels(specs, [90], cache_dir=tmp_path, jobs=4)
    for spec, ck in zip(specs, out, strict=True):
        meta = ck.kernel_meta()
        ptxs = [blob.decode() for b, blob in zip(meta["binaries"], ck.kernels(), strict=True) if b["format"] == "ptx"]
        assert ptxs, spec.name
        for ptx in ptxs:
            assert not DROPS_NAN.findall(ptx), (spec.name, sorted(set(DROPS_NAN.findall(ptx))))
            assert "max.NaN.f32" in ptx, spec.name


# ---------------------------------------------------------------------------------------
# on a GPU: the same models through the CUDA kernels
# ---------------------------------------------------------------------------------------

def _targets() -> str:
    from onnxfuse.compile import default_targets

    return ",".join(f"sm_{a}" for a in default_targets())


# the conv precision matters for convs only: the other cases run once, at ieee
CUDA_CASES = [pytest.param(c, p, id=f"{c.id}-{p}") for c in MODEL_CASES
              for p in (("ieee", "tf32") if c.id.startswith("conv") else ("ieee",))]


@pytest.mark.gpu
@pytest.mark.parametrize("case, precision", CUDA_CASES)
def test_cuda_kernels_propagate_nan(case, precision, tmp_path, monkeypatch):
    """Every kernel kind compiled for the local GPU, on ONNX Runtime's CUDA provider: NaN and
    Inf where numpy has them. "tf32" convs round their operands to TF32 (Inf and NaN kept), so
    finite values are compared at 2e-3 there."""
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m, feeds, want = case.build()
    r = optimize_model(m)
    info = compile_pass(r, kernel_options(_targets(), conv_precision=precision)).report.compile
    assert not info["failed"] and not info["declined"], info
    assert fused_types(r.model) == case.fused, r.report.summary()
    (got,) = library_session(r.model, "CUDAExecutionProvider").run(None, feeds)
    check(want, got, f"{case.id} (CUDA kernel, {precision})", 2e-3 if precision == "tf32" else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("group, precision", [(16, "ieee"), (16, "tf32"), (2, "tf32")],
                         ids=["depthwise-ieee", "depthwise-tf32", "groups-of-8-tf32"])
def test_cuda_kernels_propagate_nan_channels_last(group, precision, tmp_path, monkeypatch):
    """The channels-last model: conv tap loop NCHW -> NHWC, the nhwc pool kernel, the grouped
    conv's direct loop (depthwise) or block-diagonal GEMM (groups of 8 at tf32; at ieee the
    heuristic leaves them to cuDNN), on CUDA."""
    from onnxfuse.pipeline import compile_pass
    from tests.util import kernel_options

    monkeypatch.setenv("ONNXFUSE_CACHE", str(tmp_path / "cache"))
    m, feeds, want = nhwc_stack(group=group)
    r = optimize_model(m, layout="nhwc")
    info = compile_pass(r, kernel_options(_targets(), conv_precision=precision, layout="nhwc")).report.compile
    assert not info["failed"] and not info["declined"], info
    assert sorted(fused_types(r.model)) == ["FusedConv", "FusedConv", "FusedMaxPool"], r.report.summary()
    (got,) = library_session(r.model, "CUDAExecutionProvider").run(None, feeds)
    check(want, got, f"nhwc_stack group {group} (CUDA kernels, {precision})", 2e-3 if precision == "tf32" else 1e-5)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpret"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        from tests.test_codegen import _install_gpu_max_semantics, _install_libdevice_shims

        _install_libdevice_shims()
        _install_gpu_max_semantics()  # max/min that would drop NaN on the GPU drop it here too
        _run_interpreted(Path(sys.argv[2]))
