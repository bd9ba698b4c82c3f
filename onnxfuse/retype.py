"""A model's floating-point tensors in another float type: one walk over everything that
holds an element type (graph inputs and outputs, value_info, dense and sparse initializers,
Constant / Cast-like attributes, subgraphs, model-local functions), shared by the float64
reference (`onnxfuse.reference`: float16 / bfloat16 / float32 -> float64) and the probe of
ONNX Runtime's fusions (`onnxfuse.ort_fusions`: float16 -> float32).

What changes, and only that: every tensor and type of a `source` element type becomes
`target`; attributes `to`, `dtype` and `output_dtype` naming a source type name the target;
when float32 is a source type, a Constant's `value_float(s)` becomes a `value` tensor of the
target type and a ConstantOfShape without a value gets the target type's 0 (both are float32
by default). `convert`, when given, maps each converted array (after the cast) to the value
to store, e.g. to snap constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from onnxfuse.load import PLACEHOLDER

CAST_ATTRS = ("to", "dtype", "output_dtype")


class Retype:
    """The walk for one (source types, target type, convert) choice."""

    def __init__(self, source: frozenset[int], target: int,
                 convert: Callable[[np.ndarray], np.ndarray] | None = None, keep_value_info: bool = True):
        self.source, self.target, self.convert = source, target, convert
        self.keep_value_info = keep_value_info
        self.np_target = helper.tensor_dtype_to_np_dtype(target)

    def model(self, model: ModelProto) -> ModelProto:
        """A converted copy of `model` (the input is not changed)."""
        m = ModelProto()
        m.CopyFrom(model)
        self.graph(m.graph)
        for f in m.functions:
            for n in f.node:
                self.node(n)
        return m

    def graph(self, g: GraphProto) -> None:
        for vi in [*g.input, *g.output]:
            self.value_type(vi.type)
        if self.keep_value_info:
            for vi in g.value_info:
                self.value_type(vi.type)
        else:
            del g.value_info[:]
        for t in g.initializer:
            self.tensor(t)
        for st in g.sparse_initializer:
            self.tensor(st.values)
        for n in g.node:
            self.node(n)

    def value_type(self, tp: onnx.TypeProto) -> None:
        which = tp.WhichOneof("value")
        if which == "tensor_type" and tp.tensor_type.elem_type in self.source:
            tp.tensor_type.elem_type = self.target
        elif which == "sequence_type":
            self.value_type(tp.sequence_type.elem_type)
        elif which == "optional_type":
            self.value_type(tp.optional_type.elem_type)
        elif which == "map_type":
            self.value_type(tp.map_type.value_type)

    def tensor(self, t: TensorProto) -> None:
        if t.data_type not in self.source:
            return
        if _is_stand_in(t):  # a weight's stand-in (`load.light_copy`): it has no values to convert
            t.data_type = self.target
            return
        a = numpy_helper.to_array(t).astype(self.np_target)
        if self.convert is not None:
            a = self.convert(a)
        t.CopyFrom(numpy_helper.from_array(a, t.name))

    def node(self, n: NodeProto) -> None:
        for a in n.attribute:
            if a.type == AttributeProto.TENSOR:
                self.tensor(a.t)
            elif a.type == AttributeProto.SPARSE_TENSOR:
                self.tensor(a.sparse_tensor.values)
            elif a.type == AttributeProto.INT and a.name in CAST_ATTRS and a.i in self.source:
                a.i = self.target
            elif a.type == AttributeProto.GRAPH:
                self.graph(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    self.graph(g)
        if TensorProto.FLOAT not in self.source or n.domain not in ("", "ai.onnx"):
            return
        if n.op_type == "Constant":  # value_float(s) are float32
            for a in list(n.attribute):
                if a.name in ("value_float", "value_floats"):
                    v = np.array(a.f if a.name == "value_float" else list(a.floats), self.np_target)
                    n.attribute.remove(a)
                    n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(v)))
        if n.op_type == "ConstantOfShape" and not any(a.name == "value" for a in n.attribute):
            # the default value is a float32 0
            n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, self.np_target))))


def _is_stand_in(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        kv.key == "location" and kv.value == PLACEHOLDER for kv in t.external_data)


def holds(model: ModelProto, types: frozenset[int]) -> bool:
    """Whether any tensor, type or cast attribute of `model` (subgraphs and functions
    included) is of one of `types`."""
    def graph(g: GraphProto) -> bool:
        if any(t.data_type in types for t in g.initializer):
            return True
        if any(vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in types
               for vi in [*g.input, *g.output, *g.value_info]):
            return True
        return any(node(n) for n in g.node)

    def node(n: NodeProto) -> bool:
        for a in n.attribute:
            if a.type == AttributeProto.INT and a.name in CAST_ATTRS and a.i in types:
                return True
            if a.type == AttributeProto.TENSOR and a.t.data_type in types:
                return True
            if any(graph(sg) for sg in ([a.g] if a.type == AttributeProto.GRAPH else a.graphs)):
                return True
        return False

    return graph(model.graph) or any(node(n) for f in model.functions for n in f.node)
