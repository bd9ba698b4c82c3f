"""fp16 variants of fp32 models, made the way a user makes them: onnxconverter-common's
``float16.convert_float_to_float16`` (the [bench] extra), inputs and outputs fp16 too.

Its defaults are kept: ops without fp16 kernels in most runtimes (Resize, TopK, Range, Min,
Max, ...; its DEFAULT_OP_BLOCK_LIST) stay fp32 between Cast nodes, and fp32 constants outside
fp16's range are clamped (|x| to [1e-7, 1e4]). Three repairs, each a no-op where not needed:

- before converting, a BatchNormalization whose statistics the clamp would change (PP-OCR's
  detectors carry running variances up to 1e8) is rewritten, exactly in fp32, as its scale and
  shift: mean 0, variance 1 - epsilon. Clamped, PP-OCRv4 det's output went from 2e-5 to 1.0.
- after converting, a Cast to float32 whose output the converter retyped to float16 casts to
  float16 (onnxconverter-common 1.15 and 1.16 leave its ``to`` attribute, and ONNX Runtime
  refuses the model: issue microsoft/onnxconverter-common#320; 1.14, which had it right, pins
  protobuf 3.20.2, which onnx 1.23 cannot use). YOLOv8n's anchor arithmetic has such Casts, and
  DeBERTa's If branches (transformers 5.17's export) too: subgraphs are repaired alike.
- after converting, a main-graph tensor the converter declared float16 but whose node makes
  float32 (a blocked Resize's fp32 constant or output read by another op: BEiT's and DINOv2's
  position tables as transformers 5.17 exports them) gets a Cast to float16 after that node.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from onnxfuse.ir import graph_reads

DTYPES = ("fp32", "fp16")
MAX_FINITE = 1e4     # convert_float_to_float16's max_finite_val default


class ConverterUnavailable(Exception):
    """onnxconverter-common is not installed (pip install 'onnxfuse[bench]')."""


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp16 copy of an fp32 model: weights, activations, inputs and outputs in float16."""
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise ConverterUnavailable("onnxconverter-common is not installed (pip install 'onnxfuse[bench]')") from None
    with warnings.catch_warnings():   # one "will be truncated" per clamped constant (denormal weights)
        warnings.filterwarnings("ignore", message="the float32 number", category=UserWarning)
        m = float16.convert_float_to_float16(rescale_batchnorm(model), keep_io_types=False,
                                             max_finite_val=MAX_FINITE)
    _retarget_casts(m.graph)
    _cast_mistyped(m)
    m.producer_name = model.producer_name
    return m


def convert(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """`model` (fp32) in `dtype`: itself for "fp32", to_fp16's copy for "fp16"."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    return model if dtype == "fp32" else to_fp16(model)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The graph's constant tensors by name: initializers and Constant nodes' values."""
    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def rescale_batchnorm(model: onnx.ModelProto, limit: float = MAX_FINITE) -> onnx.ModelProto:
    """A copy of `model` where each BatchNormalization with a float32 statistic or parameter
    above `limit` in magnitude takes the same affine map as scale = gamma / sqrt(var + eps),
    shift = beta - mean * scale, mean 0 and variance 1 - eps (new initializers; the old
    constants go where nothing else reads them). Exact up to fp32 rounding."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    consts = _constants(m.graph)
    replaced: set[str] = set()
    for k, node in enumerate(m.graph.node):
        if node.op_type != "BatchNormalization" or len(node.input) != 5:
            continue
        params = [consts.get(name) for name in node.input[1:]]
        if any(p is None or p.dtype != np.float32 for p in params):
            continue
        if max(float(np.abs(p).max(initial=0.0)) for p in params) <= limit:
            continue
        gamma, beta, mean, var = (p.astype(np.float64) for p in params)
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        stem = f"{node.name or node.output[0]}.fp16_safe.{k}"
        new = {"scale": scale, "shift": shift, "mean": np.zeros_like(scale), "var": np.full_like(scale, 1.0 - eps)}
        for key, value in new.items():
            m.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), f"{stem}.{key}"))
        replaced.update(node.input[1:])
        node.input[1:] = [f"{stem}.{key}" for key in new]
    _drop_unread(m.graph, replaced)
    return m


def _drop_unread(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers and Constant nodes among `names` that nothing reads (in place)."""
    read = graph_reads(graph)
    dead = names - read
    keep_nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in dead)]
    keep_inits = [t for t in graph.initializer if t.name not in dead]
    del graph.node[:]
    graph.node.extend(keep_nodes)
    del graph.initializer[:]
    graph.initializer.extend(keep_inits)


def _retarget_casts(graph: onnx.GraphProto) -> None:
    """Cast nodes to float32 whose output value_info says float16 cast to float16 (in place), in
    the subgraphs of If and Loop nodes too (DeBERTa's relative-position If, as transformers 5.17
    exports it: ORT refused the converted model, "Type (tensor(float16)) of output arg ... of node
    Cast_736 does not match expected type")."""
    fp16 = {v.name for v in graph.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT16}
    fp16 |= {v.name for v in graph.output if v.type.tensor_type.elem_type == TensorProto.FLOAT16}
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in fp16:
            for a in node.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.FLOAT16
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                _retarget_casts(sub)


def _cast_mistyped(model: onnx.ModelProto, rounds: int = 8) -> None:
    """Where the converter declared a main-graph tensor float16 that its node makes float32 (in
    place): a Cast to float16 after that node. onnxconverter-common 1.16 keeps an fp32 constant
    fp32 for a blocked op (Resize) and still retypes another reader's output (BEiT's Identity of
    the relative-position table), or leaves a Resize's renamed fp32 output without its Cast
    (DINOv2's position embedding); transformers 5.17's exports; ORT refuses both ("Type
    (tensor(float16)) of output arg ... does not match expected type (tensor(float))"). The types
    are onnx's inference on the graph without its value_info; a mismatch is cast where it starts
    (no input of the node mistyped too), then inferred again."""
    g = model.graph
    for _ in range(rounds):
        bare = onnx.ModelProto()
        bare.CopyFrom(model)
        del bare.graph.value_info[:]
        try:
            typed = shape_inference.infer_shapes(bare, strict_mode=False)
        except Exception:  # noqa: BLE001 -- a model onnx cannot infer (over 2 GB, say) is left as converted
            return
        inferred = {v.name: v.type.tensor_type.elem_type for v in typed.graph.value_info}
        wrong = {v.name for v in g.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT16
                 and inferred.get(v.name) == TensorProto.FLOAT}
        if not wrong:
            return
        nodes = []
        for n in g.node:
            nodes.append(n)
            if any(x in wrong for x in n.input):
                continue
            for k, y in enumerate(n.output):
                if y in wrong:
                    n.output[k] = f"{y}.fp32"
                    nodes.append(helper.make_node("Cast", [n.output[k]], [y], name=f"{y}.fp16_cast",
                                                  to=TensorProto.FLOAT16))
        del g.node[:]
        g.node.extend(nodes)
