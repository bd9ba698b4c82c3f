"""The accuracy gate's reference: the original model evaluated in float64.

`onnxfuse bench`, `onnxfuse bisect` and benchmarks/compare.py judge an optimized model and
the original as ONNX Runtime runs it against the same truth: the original graph with every
float tensor in float64, evaluated on the CPU. Neither ONNX Runtime run is the truth: its CPU
Sigmoid is off by up to 5x below x = -15 (README, Reliability), where onnxfuse's kernel is
within 3e-7, so a gate that took ORT's output as the reference failed the more accurate
model.

`float64_model` makes the copy: graph inputs and outputs, initializers, Constant and
ConstantOfShape values and Cast targets (``to``, and ``dtype`` attributes) of float32,
float16 and bfloat16 become float64, in subgraphs and model-local functions too; integer
and bool tensors are left alone. `evaluate` runs it with onnx's reference evaluator
(`onnx.reference.ReferenceEvaluator`), whose numpy kernels compute in the inputs' dtype.
ONNX Runtime is no alternative: its CPU provider has no float64 kernel for Conv,
ConvTranspose, AveragePool, GlobalAveragePool, Erf, Softplus, Elu, HardSigmoid,
InstanceNormalization (onnxruntime 1.32), and falling back to float32 there keeps the error
where it matters (Erf: Gelu). Some of the reference evaluator's kernels are slow loops or
compute in float32; `FAST_OPS` replaces them for the common cases (other attribute
combinations run the reference's own code):

- Conv: im2col and a float64 matrix product per group (BLAS), depthwise as a sum of shifted
  products; the reference loops per output channel.
- ConvTranspose: a matrix product and a scatter-add per kernel offset (col2im).
- MaxPool, AveragePool: a max / sum over a window view of the padded input; the reference
  loops in Python per output element.
- Erf, Gelu: float64 erf (scipy's when installed, else math.erf per element); the
  reference rounds erf to float32, and runs Gelu as its function body with that Erf.
- GatherElements: indices smaller than the data on the other axes read its leading part,
  as ONNX Runtime and torch.gather do (DeBERTa's relative-position gathers); the reference
  refuses them.

Model-local functions are inlined first (the evaluator runs a function with its own kernels,
not these).

Cost (benchmarks/reference_cost.py on 2 cores, numpy 2.4 with OpenBLAS): 20-50x one ONNX
Runtime float32 run on the same CPU. YOLOv8n at 640x640 0.7 s (ORT: 0.04 s), at batch 8 9.7 s;
PP-OCRv4 detection at 640x640 0.9 s, recognition at batch 16 12 s. `onnxfuse bench` reports
it (``reference.seconds``); ``--reference fp32`` skips it.

A model the evaluator cannot run (an op of another domain such as com.microsoft, an op it
does not implement) raises `Unavailable`, with the reason; the callers then fall back to
their float32 reference and say so.

`evaluate` remembers its last results (`MEMO_BYTES` of outputs, least recently used first
out) by the model's bytes and the feeds' values, so that a process evaluating one model on
one input set again gets the same arrays, read-only, for the cost of hashing them (BERT-base's
436 MB: about 1 s on 2 cores, where evaluating it at batch 1 takes 5-8 s): benchmarks/compare.py
tunes each model twice (`optimize` and `optimize --cuda-graph`), and each tuning's gate evaluates
the same original on the same draws where it is under `onnxfuse.tune.FLOAT64_MAX_FLOPS` (the CNN
suite; BERT-base and GPT-2-small at 128 tokens are over it, their gates' reference is the GPU run
with TF32 off).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from onnxfuse.errors import OnnxfuseError
from onnxfuse.layers import ConvAttrs, PoolAttrs
from onnxfuse.retype import Retype

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
# im2col buffers are cut into chunks of at most this many float64 elements (256 MB)
CHUNK_ELEMENTS = 1 << 25


def is_float(dtype) -> bool:
    """Whether numpy `dtype` is a float that the float64 copy widens: numpy's floats, and
    bfloat16 (ml_dtypes', as onnx and the tests make it: its numpy kind is "V", not "f")."""
    d = np.dtype(dtype)
    return d.kind == "f" or d.name == "bfloat16"


class Unavailable(OnnxfuseError):
    """The float64 reference cannot be computed for this model (the message says why)."""


# ---------------------------------------------------------------------------------------
# the float64 copy
# ---------------------------------------------------------------------------------------

def float64_model(model: ModelProto) -> ModelProto:
    """A copy of `model` with every float32 / float16 / bfloat16 tensor in float64 (the
    module docstring lists what changes; `onnxfuse.retype` walks the model). value_info
    entries are dropped (the evaluator does not need them and they would name the old types)."""
    m = Retype(FLOAT_TYPES, TensorProto.DOUBLE, keep_value_info=False).model(model)
    if m.functions:
        # inlined: the evaluator runs a model-local function with its own kernels, not FAST_OPS
        from onnx.inliner import inline_local_functions

        m = inline_local_functions(m)
    return m


# ---------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------

MEMO_BYTES = 256 << 20  # outputs `evaluate` keeps for a later call on the same model and feeds
_memo: OrderedDict[str, dict[str, np.ndarray] | str] = OrderedDict()


def evaluate(model: ModelProto | str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float64 copy of `model` (a ModelProto or a path; external data is read) run on
    `feeds` (float inputs are widened to float64): its outputs by name, float ones in
    float64, read-only (module docstring: remembered). Raises `Unavailable` when the
    reference evaluator cannot run the model."""
    if isinstance(model, str):
        try:
            model = onnx.load(model)
        except Exception as e:  # noqa: BLE001  unreadable: the caller's own load reports it better
            raise Unavailable(f"cannot read the model: {_first_line(e)}") from None
    key = _memo_key(model, feeds)
    if key is not None and key in _memo:
        _memo.move_to_end(key)
        hit = _memo[key]
        if isinstance(hit, str):
            raise Unavailable(hit)
        return dict(hit)
    try:
        out = _evaluate(model, feeds)
    except Unavailable as e:
        if key is not None:
            _remember(key, str(e))
        raise
    for a in out.values():
        a.setflags(write=False)
    if key is not None:
        _remember(key, out)
    return dict(out)


def _memo_key(model: ModelProto, feeds: dict[str, np.ndarray]) -> str | None:
    """The model's bytes and the feeds' names, dtypes, shapes and values, hashed; None for a
    model protobuf cannot serialize (2 GiB or more in memory)."""
    try:
        data = model.SerializeToString()
    except ValueError:
        return None
    h = hashlib.sha256(data)
    hash_arrays(h, feeds)
    return h.hexdigest()


def hash_arrays(h, arrays: dict[str, np.ndarray]) -> None:
    """Feed hashlib object `h` each array's name, dtype, shape and values, in name order."""
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"|{name}:{a.dtype}:{a.shape}|".encode())
        h.update(a.reshape(-1).view(np.uint8).data)  # bytes: a buffer of bfloat16 (ml_dtypes) is refused


def _remember(key: str, value: dict[str, np.ndarray] | str) -> None:
    size = sum(a.nbytes for a in value.values()) if isinstance(value, dict) else 0
    if size > MEMO_BYTES:
        return
    _memo[key] = value
    while sum(sum(a.nbytes for a in v.values()) for v in _memo.values() if isinstance(v, dict)) > MEMO_BYTES:
        _memo.popitem(last=False)


def _evaluate(model: ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    m64 = float64_model(model)
    init = {t.name for t in m64.graph.initializer}
    names = [i.name for i in m64.graph.input if i.name not in init]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise Unavailable(f"input {missing[0]!r} has no value")
    wide = {n: (feeds[n].astype(np.float64) if is_float(feeds[n].dtype) else feeds[n]) for n in names}
    try:
        ev = ReferenceEvaluator(m64, new_ops=FAST_OPS)
        with np.errstate(all="ignore"):
            arrays = ev.run(None, wide)
    except Exception as e:  # noqa: BLE001  any op the evaluator lacks or fails on
        raise Unavailable(f"onnx's reference evaluator cannot run it: {_first_line(e)}") from None
    out = {}
    for o, a in zip(m64.graph.output, arrays, strict=True):
        if not isinstance(a, np.ndarray):
            a = np.asarray(a)
        out[o.name] = a
    return out


def timed_evaluate(model: ModelProto | str, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """`evaluate`, and the seconds it took."""
    t0 = time.perf_counter()
    out = evaluate(model, feeds)
    return out, time.perf_counter() - t0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


# ---------------------------------------------------------------------------------------
# fast float64 kernels for the reference evaluator
# ---------------------------------------------------------------------------------------

def _explicit_pads(auto_pad: str | None, pads, in_sizes, kernel, strides, dilations) -> list[int] | None:
    """ONNX's pads for NOTSET / VALID / SAME_UPPER / SAME_LOWER (begin..., end...), or None
    for an auto_pad value this module does not handle."""
    nd = len(in_sizes)
    if auto_pad in (None, "", "NOTSET"):
        return list(pads) if pads is not None else [0] * 2 * nd
    if auto_pad == "VALID":
        return [0] * 2 * nd
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        return None
    out = [0] * 2 * nd
    for i in range(nd):
        o = -(-in_sizes[i] // strides[i])
        total = max(0, (o - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sizes[i])
        small = total // 2
        out[i], out[i + nd] = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
    return out


def _windows(xp: np.ndarray, kernel, strides, dilations) -> np.ndarray:
    """View [N, C, O..., K...] of the padded input: window o, offset k."""
    nd = len(kernel)
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    w = np.lib.stride_tricks.sliding_window_view(xp, span, axis=tuple(range(2, 2 + nd)))
    return w[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
             + tuple(slice(None, None, d) for d in dilations)]


def _make_fast_ops() -> list[type]:
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_average_pool import AveragePool_19 as _AveragePool
    from onnx.reference.ops.op_batch_normalization import BatchNormalization_14 as _BatchNormalization
    from onnx.reference.ops.op_conv import Conv as _Conv
    from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ConvTranspose
    from onnx.reference.ops.op_erf import Erf as _Erf
    from onnx.reference.ops.op_gather_elements import GatherElements as _GatherElements
    from onnx.reference.ops.op_max_pool import MaxPool as _MaxPool

    class Conv(_Conv):
        op_domain = ""

        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None, pads=None,
                 strides=None):
            nd = X.ndim - 2
            kernel = list(W.shape[2:])
            dil = list(dilations or [1] * nd)
            st = list(strides or [1] * nd)
            p = _explicit_pads(auto_pad, pads, X.shape[2:], kernel, st, dil)
            if nd < 1 or p is None or (kernel_shape is not None and list(kernel_shape) != kernel):
                return super()._run(X, W, B, auto_pad=auto_pad, dilations=dilations, group=group,
                                    kernel_shape=kernel_shape, pads=pads, strides=strides)
            return (conv(X, W, B, int(group or 1), p, st, dil),)

    class ConvTranspose(_ConvTranspose):
        op_domain = ""

        def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None,
                 output_padding=None, output_shape=None, pads=None, strides=None):
            nd = X.ndim - 2
            kernel = list(W.shape[2:])
            if (nd < 1 or output_shape is not None or auto_pad not in (None, "", "NOTSET")
                    or (kernel_shape is not None and list(kernel_shape) != kernel)):
                return super()._run(X, W, B, auto_pad=auto_pad, dilations=dilations, group=group,
                                    kernel_shape=kernel_shape, output_padding=output_padding,
                                    output_shape=output_shape, pads=pads, strides=strides)
            return (conv_transpose(X, W, B, int(group or 1), list(pads or [0] * 2 * nd),
                                   list(strides or [1] * nd), list(dilations or [1] * nd),
                                   list(output_padding or [0] * nd)),)

    class MaxPool(_MaxPool):
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None,
                 storage_order=None, strides=None):
            nd = x.ndim - 2
            dil = list(dilations or [1] * nd)
            st = list(strides or [1] * nd)
            p = _explicit_pads(auto_pad, pads, x.shape[2:], kernel_shape, st, dil)
            if p is None or ceil_mode or len(self.onnx_node.output) > 1 or x.dtype.kind != "f":
                return super()._run(x, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
                                    kernel_shape=kernel_shape, pads=pads, storage_order=storage_order,
                                    strides=strides)
            xp = np.pad(x, [(0, 0), (0, 0)] + [(p[i], p[i + nd]) for i in range(nd)], constant_values=-np.inf)
            w = _windows(xp, kernel_shape, st, dil)
            return (w.max(axis=tuple(range(2 + nd, 2 + 2 * nd))),)

    class AveragePool(_AveragePool):
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, count_include_pad=None, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
            nd = x.ndim - 2
            dil = list(dilations or [1] * nd)
            st = list(strides or [1] * nd)
            p = _explicit_pads(auto_pad, pads, x.shape[2:], kernel_shape, st, dil)
            if p is None or ceil_mode or x.dtype.kind != "f":
                return super()._run(x, auto_pad=auto_pad, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                                    dilations=dilations, kernel_shape=kernel_shape, pads=pads, strides=strides)
            widths = [(0, 0), (0, 0)] + [(p[i], p[i + nd]) for i in range(nd)]
            axes = tuple(range(2 + nd, 2 + 2 * nd))
            total = _windows(np.pad(x, widths), kernel_shape, st, dil).sum(axis=axes)
            if count_include_pad:
                return (total / math.prod(kernel_shape),)
            ones = np.pad(np.ones((1, 1, *x.shape[2:]), x.dtype), widths)
            count = _windows(ones, kernel_shape, st, dil).sum(axis=axes)
            return ((total / count).astype(x.dtype),)

    class BatchNormalization(_BatchNormalization):
        op_domain = ""

        def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None, is_test=None,
                 spatial=None):
            # Inference unless the node asks for training (training_mode=1, or the running
            # statistics as outputs): the reference evaluator's version 9 takes batch
            # statistics whenever `momentum` is set (PaddlePaddle's exports set it).
            if training_mode or len(self.onnx_node.output) > 1 or is_test == 0:
                raise NotImplementedError("BatchNormalization in training mode")
            shape = (1, -1) + (1,) * (x.ndim - 2)
            eps = 1e-5 if epsilon is None else epsilon
            y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape)
            y = y + bias.reshape(shape)
            return (y.astype(x.dtype),)

    class Erf(_Erf):
        op_domain = ""

        def _run(self, x):
            return (erf(x).astype(x.dtype),)

    class Gelu(OpRun):
        # the evaluator expands Gelu into its function body, whose Erf is its own (float32)
        op_domain = ""

        def _run(self, x, approximate=None):
            x64 = np.asarray(x, np.float64)
            if approximate == "tanh":
                # 0.5 x (1 + tanh(z)) = x sigmoid(2z), without the cancellation
                z2 = 2.0 * math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)
                t = np.exp(-np.abs(z2))
                y = x64 * np.where(z2 >= 0, 1.0, t) / (1.0 + t)
            else:
                y = 0.5 * x64 * erfc(-x64 / math.sqrt(2.0))
            return (y.astype(x.dtype),)

    class GatherElements(_GatherElements):
        # indices may be smaller than data on the other axes (ONNX Runtime and torch.gather read
        # the leading part; DeBERTa's relative-position gathers): the evaluator requires them equal
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = int(axis or 0) % data.ndim
            if indices.ndim != data.ndim or any(
                    i > d for a, (i, d) in enumerate(zip(indices.shape, data.shape, strict=True)) if a != axis):
                return super()._run(data, indices, axis=axis)
            part = data[tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape))]
            size = data.shape[axis]
            if indices.size and (indices.min() < -size or indices.max() >= size):
                raise IndexError(f"GatherElements index out of [-{size}, {size - 1}]")
            return (np.take_along_axis(part, np.where(indices < 0, indices + size, indices), axis=axis),)

    return [Conv, ConvTranspose, MaxPool, AveragePool, BatchNormalization, Erf, Gelu, GatherElements]


def erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (scipy's when installed)."""
    try:
        from scipy.special import erf as sp_erf
    except ImportError:
        return np.vectorize(math.erf, otypes=[np.float64])(x)
    return sp_erf(np.asarray(x, np.float64))


def erfc(x: np.ndarray) -> np.ndarray:
    """erfc in float64 (scipy's when installed)."""
    try:
        from scipy.special import erfc as sp_erfc
    except ImportError:
        return np.vectorize(math.erfc, otypes=[np.float64])(x)
    return sp_erfc(np.asarray(x, np.float64))


def conv(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, group: int, pads: list[int], strides: list[int],
         dilations: list[int]) -> np.ndarray:
    """ONNX Conv in X's dtype (float64 here) with explicit pads (begin..., end...)."""
    nd = X.ndim - 2
    N, C = X.shape[:2]
    M = W.shape[0]
    kernel = list(W.shape[2:])
    G, Cg, Mg, K = group, C // group, M // group, math.prod(kernel)
    xp = np.pad(X, [(0, 0), (0, 0)] + [(pads[i], pads[i + nd]) for i in range(nd)])
    win = _windows(xp, kernel, strides, dilations)  # N, C, O..., K...
    out_sp = win.shape[2:2 + nd]
    P = math.prod(out_sp)
    dtype = np.result_type(X, W)
    if K == 1 and G == 1 and all(v == 1 for v in strides) and not any(pads):
        # 1x1, stride 1: a matrix product per image, no copy of X
        Y = np.matmul(W.reshape(M, C), X.reshape(N, C, P))
    elif Cg == 1 and Mg == 1:
        # depthwise: Y[n, c] = sum_k W[c, k] X_shifted_k[n, c]
        Wk = W.reshape(C, K)
        acc = np.zeros((N, C, *out_sp), dtype)
        for k, idx in enumerate(np.ndindex(*kernel)):
            shifted = win[(slice(None), slice(None)) + (slice(None),) * nd + idx]
            acc += shifted * Wk[:, k].reshape(1, C, *[1] * nd)
        Y = acc
    else:
        # im2col: one copy of the windows as [G, Cg * K, n * P], a matrix product per group
        Y = np.empty((N, G, Mg, P), dtype)
        Wg = W.reshape(G, Mg, Cg * K)
        order = (1, *range(2 + nd, 2 + 2 * nd), 0, *range(2, 2 + nd))  # C, K..., n, O...
        per = max(1, CHUNK_ELEMENTS // max(1, C * K * P))
        for n0 in range(0, N, per):
            n1 = min(N, n0 + per)
            cols = np.reshape(win[n0:n1].transpose(order), (G, Cg * K, (n1 - n0) * P))
            Y[n0:n1] = np.matmul(Wg, cols).reshape(G, Mg, n1 - n0, P).transpose(2, 0, 1, 3)
    Y = Y.reshape(N, M, *out_sp)
    if B is not None:
        Y = Y + B.reshape(1, M, *[1] * nd)
    return Y.astype(X.dtype, copy=False)


def conv_transpose(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, group: int, pads: list[int],
                   strides: list[int], dilations: list[int], output_padding: list[int]) -> np.ndarray:
    """ONNX ConvTranspose with explicit pads and no output_shape: Y = col2im(W^T X)."""
    nd = X.ndim - 2
    N, C = X.shape[:2]
    in_sp = X.shape[2:]
    kernel = list(W.shape[2:])
    G, Cg, Mg, K = group, C // group, W.shape[1], math.prod(kernel)
    M = Mg * G
    full = [(in_sp[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 + output_padding[i] for i in range(nd)]
    P = math.prod(in_sp)
    dtype = np.result_type(X, W)
    Yf = np.zeros((N, M, *full), dtype)
    Wg = W.reshape(G, Cg, Mg, K).transpose(0, 3, 2, 1)  # G, K, Mg, Cg
    xg = X.reshape(N, G, Cg, P)
    for g in range(G):
        xs = xg[:, g].transpose(1, 0, 2).reshape(Cg, N * P)  # Cg, N*P
        for k, idx in enumerate(np.ndindex(*kernel)):
            contrib = (Wg[g, k] @ xs).reshape(Mg, N, *in_sp).swapaxes(0, 1)  # N, Mg, in...
            sl = tuple(slice(idx[i] * dilations[i], idx[i] * dilations[i] + (in_sp[i] - 1) * strides[i] + 1,
                             strides[i]) for i in range(nd))
            Yf[(slice(None), slice(g * Mg, (g + 1) * Mg)) + sl] += contrib
    crop = tuple(slice(pads[i], full[i] - pads[i + nd]) for i in range(nd))
    Y = Yf[(slice(None), slice(None)) + crop]
    if B is not None:
        Y = Y + B.reshape(1, M, *[1] * nd)
    return np.ascontiguousarray(Y).astype(X.dtype, copy=False)


FAST_OPS: list[Any] = _make_fast_ops()


# ---------------------------------------------------------------------------------------
# is it plausible?
# ---------------------------------------------------------------------------------------

# A float64 reference that differs from the original's own run by more than this fraction
# of an output's largest value is not trusted: float32 (even TF32 or float16) does not lose
# that much on a model that is not broken, an op the evaluator gets wrong does (its
# BatchNormalization-9 took batch statistics whenever `momentum` was set: 0.22 on PP-OCR's
# recognizer, where float32 is within 4e-6).
SANITY = 0.1


# ---------------------------------------------------------------------------------------
# the layers of the fused nodes' contract (docs/format.md), in float64: the kinds' references
# (`onnxfuse.kinds.base.Kind.evaluate`)
# ---------------------------------------------------------------------------------------

def conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray, conv: ConvAttrs) -> np.ndarray:
    """ONNX Conv in float64: x [N, C, H, W], w [K, C/group, R, S], b [K]."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    (sh, sw), (pt, pl, pb, pr), (dh, dw), g = conv.strides, conv.pads, conv.dilations, conv.group
    p, q = conv.out_size(h, wd)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    w64 = w.astype(np.float64)
    kg = k // g
    out = np.zeros((n, k, p, q))
    for i in range(r):
        for j in range(s):
            patch = xp[:, :, i * dh:i * dh + sh * (p - 1) + 1:sh, j * dw:j * dw + sw * (q - 1) + 1:sw]
            for gi in range(g):
                out[:, gi * kg:(gi + 1) * kg] += np.einsum(
                    "ncpq,kc->nkpq", patch[:, gi * cg:(gi + 1) * cg], w64[gi * kg:(gi + 1) * kg, :, i, j])
    return out + b.astype(np.float64)[None, :, None, None]


def maxpool2d(x: np.ndarray, pool: PoolAttrs) -> np.ndarray:
    """ONNX MaxPool: padding never wins; with ceil_mode the last window may be partial."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (pt, pl, pb, pr), (dh, dw) = pool.kernel, pool.strides, pool.pads, pool.dilations
    oh, ow = pool.out_size(h, w)
    need_h = (oh - 1) * sh + dh * (kh - 1) + 1
    need_w = (ow - 1) * sw + dw * (kw - 1) + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, max(pb, need_h - h - pt)), (pl, max(pr, need_w - w - pl))),
                constant_values=-np.inf)
    out = np.full((n, c, oh, ow), -np.inf)
    for i in range(kh):
        for j in range(kw):
            out = np.maximum(out, xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw])
    return out.astype(x.dtype)


def disagreement(ref64: dict[str, np.ndarray], run: dict[str, np.ndarray]) -> str | None:
    """Why the float64 reference looks wrong next to the original's own run (`run`), or None.
    Per float output: a difference above SANITY times its largest finite magnitude, or a NaN
    or infinity in the reference where the run is finite."""
    for name, e in ref64.items():
        y = run.get(name)
        if y is None or y.shape != e.shape or e.dtype.kind != "f" or y.dtype.kind != "f" or not e.size:
            continue
        e64, y64 = e.astype(np.float64), y.astype(np.float64)
        lost = ~np.isfinite(e64) & np.isfinite(y64)
        if lost.any():
            return f"output {name!r}: {int(lost.sum())} NaN or infinite values where the original's own run is finite"
        both = np.isfinite(e64) & np.isfinite(y64)
        if not both.any():
            continue
        scale = float(np.abs(e64[both]).max())
        diff = float(np.abs(e64[both] - y64[both]).max())
        if diff > SANITY * scale:
            return (f"output {name!r}: it differs from the original's own run by {diff:.3g}, more than "
                    f"{SANITY:g} x the largest value {scale:.3g}")
    return None
