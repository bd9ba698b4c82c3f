"""A read-only typed view of one ONNX graph: producers and consumers (from the links of its
onnx-graphsurgeon import), constants, types and shapes."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, numpy_helper

from onnxfuse import ir
from onnxfuse.dims import canonical

Dim = int | str | None  # a size, a symbolic name (or a product of names, `onnxfuse.dims`), or unknown
Shape = tuple[Dim, ...]


INDEX = "onnxfuse_index"  # gs.Node attribute: its position in the main graph's node list


class _Producer(Mapping):
    """tensor name -> the index of the node that produces it, read from the gs graph's links."""

    def __init__(self, tensors: dict):
        self._tensors = tensors

    def get(self, name, default=None):
        t = self._tensors.get(name)
        return getattr(t.inputs[0], INDEX, default) if t is not None and t.inputs else default

    def __getitem__(self, name):
        i = self.get(name)
        if i is None:
            raise KeyError(name)
        return i

    def __contains__(self, name) -> bool:
        return self.get(name) is not None

    def __iter__(self):
        return (name for name in self._tensors if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Consumers(_Producer):
    """tensor name -> the indices of the nodes that read it (a node whose subgraph reads it
    counts), ascending, read from the gs graph's links."""

    def get(self, name, default=None):
        t = self._tensors.get(name)
        if t is None or not t.outputs:
            return default
        readers = sorted({i for n in t.outputs if (i := getattr(n, INDEX, None)) is not None})
        return readers or default


@dataclass
class GraphView:
    """A read-only typed view of one graph for the matcher and the lowerings: its nodes (as
    NodeProtos, in order; a node is its index), each tensor's producer and consumers (read
    from the links of the graph's onnx-graphsurgeon import, `ir`: no index of their own),
    graph inputs and outputs, constants (initializers that are not graph inputs), element
    types and shapes (from shape inference)."""

    nodes: list[NodeProto]
    producer: Mapping[str, int]
    consumers: Mapping[str, list[int]]  # includes nodes whose subgraphs read the tensor
    graph_inputs: set[str]
    graph_outputs: set[str]
    constants: dict[str, TensorProto]
    types: dict[str, int]  # elem type per tensor name
    shapes: dict[str, Shape | None]  # None: rank unknown
    opset: int | None = None  # the default domain's opset (what an op means, e.g. Softmax's axis)
    ir: object = None  # the onnxfuse.ir.Model the links come from (rewrite edits it: one view, one rewrite)

    @staticmethod
    def build(model: ModelProto, inferred: ModelProto | None = None) -> GraphView:
        g = model.graph
        m = ir.import_model(model)

        def number(nodes, index=None) -> None:  # a subgraph's nodes count as their outer node
            for i, n in enumerate(nodes):
                k = i if index is None else index
                setattr(n, INDEX, k)
                for sub in n.subgraphs():
                    number(sub.nodes, k)

        number(m.graph.nodes)
        tensors = m.tensors()
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
            nodes=list(g.node), producer=_Producer(tensors), consumers=_Consumers(tensors),
            graph_inputs=graph_inputs, graph_outputs={o.name for o in g.output},
            constants=constants, types=types, shapes=shapes, opset=opset, ir=m,
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

    def is_op(self, i: int | None, op: str) -> bool:
        """Node `i` exists and is the default domain's `op`."""
        return i is not None and self.nodes[i].op_type == op and self.nodes[i].domain in ("", "ai.onnx")

    def only_reader(self, name: str, reader: int) -> bool:
        """`name` is no graph output and node `reader` alone reads it."""
        return name not in self.graph_outputs and list(self.consumers.get(name, ())) == [reader]


def _dim(d: onnx.TensorShapeProto.Dimension) -> Dim:
    if ir.known_dim(d) is not None:
        return d.dim_value
    if d.HasField("dim_param") and d.dim_param:
        return canonical(d.dim_param)  # one spelling of a product: "batch*12" is "12*batch"
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


def last_dim_vector(t: TensorProto, n: int, max_rank: int | None = None) -> bool:
    """Whether constant `t` is a vector of `n` values along the last dim: shape [n] or
    [1, ..., 1, n] (of at most `max_rank` dims), as a bias broadcast over rows is."""
    dims = [int(d) for d in t.dims]
    return bool(dims) and dims[-1] == n and all(d == 1 for d in dims[:-1]) \
        and (max_rank is None or len(dims) <= max_rank)


def shape_input_spec(view: GraphView, node: NodeProto) -> list[int | tuple[int]] | None:
    """What can stand for a Reshape's or an Expand's computed shape input (a dynamic export's
    Concat of Shape reads), read from the known shapes of its data input x and its output: per
    output dim a size (Reshape's 0 keeps x's dim there unless its allowzero is set, one -1 is
    inferred; Expand's 1 keeps x's dim) or (j,), x's dim j at run time, where the output's named
    dim is x's dim j. None where the shapes do not decide it, or for other nodes. A fused node's
    function body computes it from x (`shape_input_nodes`) instead of the shape arithmetic the
    node took it from."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Reshape", "Expand") or len(node.input) < 2:
        return None
    x, y = view.shapes.get(node.input[0]), view.shapes.get(node.output[0])
    if x is None or y is None or any(d is None for d in (*x, *y)):
        return None
    spec: list[int | tuple[int]] = []
    if node.op_type == "Reshape":
        zero_is_zero = any(a.name == "allowzero" and a.i for a in node.attribute)  # (torch's dynamo exporter's)
        inferred = False
        for i, d in enumerate(y):
            if isinstance(d, int) and d != 0:
                spec.append(d)
            elif i < len(x) and x[i] == d:
                spec.append((i,) if zero_is_zero else 0)
            elif d in x:
                spec.append((x.index(d),))
            elif not inferred and d != 0:
                spec.append(-1)
                inferred = True
            else:
                return None
        return spec
    lead = len(y) - len(x)
    if lead < 0:
        return None
    for i, d in enumerate(y):
        if i >= lead and x[i - lead] == d:
            spec.append(1)
        elif isinstance(d, int):
            spec.append(d)
        elif d in x:
            spec.append((x.index(d),))
        else:
            return None
    return spec


def shape_input_nodes(spec: list[int | tuple[int]], x: str, out: str, prefix: str) -> list[NodeProto]:
    """Nodes computing `shape_input_spec`'s `spec` into `out`: one Constant where it holds sizes
    alone, else x's Shape, the Gathers of its dims and a Concat (names begin with `prefix`)."""
    if all(isinstance(e, int) for e in spec):
        return [onnx.helper.make_node("Constant", [], [out], value=numpy_helper.from_array(
            np.array(spec, np.int64), ""))]
    nodes = [onnx.helper.make_node("Shape", [x], [f"{prefix}_shape"])]
    parts = []
    for k, e in enumerate(spec):
        part = f"{prefix}_{k}"
        if isinstance(e, int):
            nodes.append(onnx.helper.make_node("Constant", [], [part], value=numpy_helper.from_array(
                np.array([e], np.int64), "")))
        else:
            nodes.append(onnx.helper.make_node("Constant", [], [f"{part}_at"], value=numpy_helper.from_array(
                np.array([e[0]], np.int64), "")))
            nodes.append(onnx.helper.make_node("Gather", [f"{prefix}_shape", f"{part}_at"], [part], axis=0))
        parts.append(part)
    nodes.append(onnx.helper.make_node("Concat", parts, [out], axis=0))
    return nodes


def bias_add(view: GraphView, x: str, reader: int, taken: Collection[int] = ()) -> tuple[int, str, str] | None:
    """(the Add, its tensor input y, the bias) when `x`, which node `reader` alone reads, is
    Add(y, bias) (either order) with `bias` a constant of x's dtype and shape [N] or [1, ..., 1,
    N], N x's last dim (broadcast only along it: x has y's shape), the Add not in `taken`; None
    otherwise. A projection's bias: the attention kind absorbs it, `onnxfuse.headbias` moves it."""
    a = view.producer.get(x)
    if not view.is_op(a, "Add") or a in taken or not view.only_reader(x, reader) or len(view.nodes[a].input) != 2:
        return None
    xs = view.shapes.get(x)
    if xs is None or not xs or not isinstance(xs[-1], int):
        return None
    for k in (1, 0):
        b, y = view.nodes[a].input[k], view.nodes[a].input[1 - k]
        c = view.constants.get(b)
        if c is None or y in view.constants or view.shapes.get(y) != xs:
            continue
        if not last_dim_vector(c, xs[-1], len(xs)):
            continue
        if c.data_type != view.types.get(x) or view.types.get(y) != view.types.get(x):
            continue
        return a, y, b
    return None
