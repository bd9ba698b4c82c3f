"""A read-only index over one ONNX graph: producers, consumers, constants, types and shapes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, numpy_helper

Dim = int | str | None  # a size, a symbolic name, or unknown
Shape = tuple[Dim, ...]


@dataclass
class GraphView:
    nodes: list[NodeProto]
    producer: dict[str, int]
    consumers: dict[str, list[int]]  # includes nodes whose subgraphs read the tensor
    graph_inputs: set[str]
    graph_outputs: set[str]
    constants: dict[str, TensorProto]
    types: dict[str, int]  # elem type per tensor name
    shapes: dict[str, Shape | None]  # None: rank unknown
    opset: int | None = None  # the default domain's opset (what an op means, e.g. Softmax's axis)

    @staticmethod
    def build(model: ModelProto, inferred: ModelProto | None = None) -> GraphView:
        g = model.graph
        producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        for i, n in enumerate(g.node):
            for o in n.output:
                if o:
                    producer[o] = i
            for name in dict.fromkeys(list(n.input) + sorted(_outer_refs(n))):
                if name:
                    consumers.setdefault(name, []).append(i)
        types: dict[str, int] = {}
        shapes: dict[str, Shape | None] = {}
        src = inferred.graph if inferred is not None else g
        inferred_vis = list(src.input) + list(src.value_info) + list(src.output)
        for k, vi in enumerate(inferred_vis + list(g.input) + list(g.output)):
            if vi.type.HasField("tensor_type"):
                # the model's own graph inputs and outputs only fill in what inference lacks
                # (inference may have named dims the declarations leave unknown)
                own = k >= len(inferred_vis)
                tt = vi.type.tensor_type
                if tt.elem_type and not (own and vi.name in types):
                    types[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    if not (own and shapes.get(vi.name) is not None):
                        shapes[vi.name] = tuple(_dim(d) for d in tt.shape.dim)
                else:
                    shapes.setdefault(vi.name, None)
        # an initializer that is also a graph input is an overridable default, not a constant
        graph_inputs = {i.name for i in g.input}
        constants = {t.name: t for t in g.initializer if t.name not in graph_inputs}
        for t in g.initializer:
            types[t.name] = t.data_type
            shapes[t.name] = tuple(t.dims)
        opset = next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), None)
        return GraphView(
            nodes=list(g.node), producer=producer, consumers=consumers,
            graph_inputs=graph_inputs, graph_outputs={o.name for o in g.output},
            constants=constants, types=types, shapes=shapes, opset=opset,
        )

    def scalar_constant(self, name: str) -> float | None:
        """The value of a one-element float constant, else None."""
        t = self.constants.get(name)
        if t is None or t.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16,
                                            TensorProto.DOUBLE):
            return None
        if int(np.prod(t.dims, dtype=np.int64)) != 1:
            return None
        return float(numpy_helper.to_array(t).reshape(()).astype(np.float64))

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)


def _dim(d: onnx.TensorShapeProto.Dimension) -> Dim:
    if d.HasField("dim_value"):
        return d.dim_value
    if d.HasField("dim_param") and d.dim_param:
        return d.dim_param
    return None


def _outer_refs(n: NodeProto) -> set[str]:
    """Names a node's subgraphs read from enclosing scopes."""
    refs: set[str] = set()
    for a in n.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            refs |= _graph_outer_refs(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sg in a.graphs:
                refs |= _graph_outer_refs(sg)
    return refs


def _graph_outer_refs(g: GraphProto) -> set[str]:
    local = {i.name for i in g.input} | {t.name for t in g.initializer}
    refs: set[str] = set()
    for n in g.node:
        refs |= {x for x in n.input if x and x not in local}
        refs |= {x for x in _outer_refs(n) if x not in local}
        local |= {o for o in n.output if o}
    refs |= {o.name for o in g.output if o.name not in local}
    return refs


def same_shape(a: Shape | None, b: Shape | None) -> bool:
    """True when both shapes are known to be equal (symbolic dims compare by name)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x is not None and x == y for x, y in zip(a, b, strict=True))
