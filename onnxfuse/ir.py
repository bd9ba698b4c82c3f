"""The graph IR of the passes that rewrite: an onnx-graphsurgeon `gs.Graph` of the model's
main graph, imported once per pass (`import_model`) and exported once (`export_model`).
A pass inserts its nodes reusing the boundary tensors, detaches the nodes they replace
(their outputs cleared), then runs one `graph.cleanup().toposort()`.

onnx-graphsurgeon 0.6 drops or cannot hold some of what our models carry; this module keeps
it beside the gs graph and puts it back on export:
- model-local functions: gs identifies a function by (domain, name) and its exporter drops
  `FunctionProto.overload`, while every fused node has its own overload of one op. So the
  functions stay FunctionProtos (the exported model gets the source model's, and the pass
  adds or removes its own); the gs graph is imported without them;
- per node: `overload` (ONNX IR 10), `doc_string`, `metadata_props`, and attributes gs does
  not round-trip: subgraphs (GRAPH, GRAPHS: put back as they were: no pass rewrites inside
  them) and types it skips. Imported nodes that carry any of these keep their NodeProto in
  `node.onnxfuse_proto` (new nodes: `make_node(..., overload=)`);
- STRING attributes that are not UTF-8 (a compiled node's cubin, `kernel_<i>`): gs decodes
  every string; they are held as `bytes` in `node.attrs`, which export writes back as they were;
- the model's other fields (IR version, opset imports, producer, doc string, metadata_props,
  model version), the graph's metadata_props, and the graph inputs' and outputs' own
  ValueInfoProtos (doc strings, denotations) are the source model's;
- initializers stay the TensorProtos they were (gs `LazyValues` of the source model's own
  protos, not copied on import: external data stays external, bytes unchanged); new ones join
  the same way (`constant`).
Export is deterministic: the same graph gives the same bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import AttributeProto, ModelProto, NodeProto, TensorProto
from onnx_graphsurgeon.ir.tensor import LazyValues
from onnx_graphsurgeon.logger import G_LOGGER

PROTO = "onnxfuse_proto"  # gs.Node attribute: the NodeProto whose extras export puts back
# attribute types gs imports and exports faithfully (the others are put back from the proto)
_GS_TYPES = {AttributeProto.FLOAT, AttributeProto.INT, AttributeProto.STRING, AttributeProto.TENSOR,
             AttributeProto.FLOATS, AttributeProto.INTS, AttributeProto.STRINGS}


@dataclass
class Model:
    """A gs graph of `source`'s main graph, and the model it came from (never changed)."""

    graph: gs.Graph
    source: ModelProto
    # initializers no main-graph node of the source reads (unused, or read only inside
    # subgraphs): gs exports only those its nodes read; these are put back
    unread: tuple[str, ...] = ()
    edited: bool = False  # a pass has edited the graph (a GraphView's import serves one rewrite)

    def tensors(self) -> dict[str, gs.Tensor]:
        """Every tensor of the main graph by name (a new dict; gs walks the graph)."""
        return self.graph.tensors()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """gs's warnings off (duplicate function ids, node names): onnxfuse reports its own."""
    severity = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.ERROR
    try:
        yield
    finally:
        G_LOGGER.severity = severity


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def import_model(model: ModelProto) -> Model:
    """The main graph of `model` as a gs graph, its nodes in the same order as
    `model.graph.node` (so node i of a GraphView of `model` is `graph.nodes[i]`)."""
    shell = ModelProto()
    shell.ir_version = model.ir_version
    shell.opset_import.extend(model.opset_import)
    # the graph without its initializers, which become Constants of the source's own TensorProtos
    # below (gs's LazyValues: no copy of the weights for each pass that imports the model)
    copy_fields(model.graph, shell.graph, skip="initializer")
    kept: list[int] = []  # nodes whose proto export needs
    read: set[str] = set()
    binary: dict[int, dict[str, bytes | list[bytes]]] = {}
    for i, n in enumerate(shell.graph.node):
        extra = bool(n.overload or n.doc_string or len(n.metadata_props))
        read.update(n.input)
        for a in n.attribute:
            t = a.type
            if t == AttributeProto.STRING:
                if not _utf8(a.s):
                    binary.setdefault(i, {})[a.name] = a.s
                    a.s = b""
            elif t == AttributeProto.STRINGS:
                if not all(_utf8(s) for s in a.strings):
                    binary.setdefault(i, {})[a.name] = list(a.strings)
                    del a.strings[:]
            elif t not in _GS_TYPES or a.ref_attr_name:
                extra = True
        if extra:
            kept.append(i)
    with _quiet():
        graph = gs.import_onnx(shell)
    tensors = graph.tensors()
    for t in model.graph.initializer:  # as gs imports an initializer, but of the source's proto
        v = tensors.get(t.name)
        if isinstance(v, gs.Variable):
            v.to_constant(LazyValues(t))
            v.data_location = int(t.data_location) if t.HasField("data_location") else None
    nodes = graph.nodes
    if len(nodes) != len(model.graph.node):
        raise AssertionError("onnx-graphsurgeon imported a different number of nodes")
    for i in kept:
        setattr(nodes[i], PROTO, model.graph.node[i])
    for i, attrs in binary.items():
        nodes[i].attrs.update(attrs)
    unread = tuple(t.name for t in model.graph.initializer if t.name not in read)
    return Model(graph, model, unread)


def copy_fields(src, dst, skip: str) -> None:
    """Every set field of message `src` but `skip` into `dst` (repeated ones appended)."""
    for fd, value in src.ListFields():
        if fd.name != skip:
            copy_field(dst, fd, value)


def copy_field(dst, fd, value) -> None:
    """One field (`fd`, `value`: an item of a message's ListFields()) into message `dst`."""
    if hasattr(value, "extend"):  # a repeated field
        getattr(dst, fd.name).extend(value)
    elif fd.message_type is not None:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def serialized_bytes(model: ModelProto, sizes: list[int] | None = None) -> int:
    """`model.ByteSize()`, at most 11 bytes a main-graph initializer above it, without a
    serialization of the whole model: protobuf's upb computes a message's size by encoding it,
    a transient copy of all its weights (or two); here one tensor at a time (`sizes`: the
    initializers' ByteSize() where the caller has them)."""
    light = ModelProto()
    copy_fields(model, light, skip="graph")
    copy_fields(model.graph, light.graph, skip="initializer")
    sizes = [t.ByteSize() for t in model.graph.initializer] if sizes is None else sizes
    # each initializer adds its own bytes, a 1-byte tag and a length of at most 10; the graph's
    # own length may take up to 10 bytes more than in `light`
    return light.ByteSize() + 10 + sum(n + 11 for n in sizes)


def subgraphs(n: NodeProto) -> list[onnx.GraphProto]:
    """The graphs `n`'s attributes hold (If's branches, Loop's and Scan's bodies)."""
    return [sg for a in n.attribute for sg in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs))]


def graphs(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """g, then every graph its nodes hold, and theirs, depth first."""
    yield g
    for n in g.node:
        for sg in subgraphs(n):
            yield from graphs(sg)


def all_names(model: ModelProto) -> set[str]:
    """Every tensor name of the main graph and its subgraphs."""
    names: set[str] = set()
    for g in graphs(model.graph):
        names.update(i.name for i in g.input)
        names.update(o.name for o in g.output)
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in g.value_info)
        for n in g.node:
            names.update(x for x in list(n.input) + list(n.output) if x)
    return names


def subgraph_reads(nodes) -> set[str]:
    """Names that the subgraphs (If / Loop / Scan bodies) of `nodes`, and theirs, read."""
    names: set[str] = set()
    for n in nodes:
        for sg in subgraphs(n):
            names.update(x for m in sg.node for x in m.input)
            names |= subgraph_reads(sg.node)
    return names


def graph_reads(g: onnx.GraphProto, nodes=None) -> set[str]:
    """Every name that `nodes` (default: g's), their subgraphs and g's outputs read: what
    a pass that removes nodes or initializers must keep."""
    nodes = g.node if nodes is None else nodes
    return {x for n in nodes for x in n.input} | {o.name for o in g.output} | subgraph_reads(nodes)


def unproduced_reads(g: onnx.GraphProto, outer: tuple[set[str], ...] = ()) -> list[str]:
    """Names that g's nodes (their subgraphs too, from the scopes around them) and outputs read
    but nothing before them gives (an input, an initializer, an earlier node's output, or the
    same in the `outer` scopes): empty for a well-formed graph. onnx.checker does not look into
    the subgraphs' outer reads."""
    known = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    scopes = (known, *outer)
    missing: list[str] = []
    for n in g.node:
        missing += [x for x in n.input if not any(x in s for s in scopes)]
        for sg in subgraphs(n):
            missing += unproduced_reads(sg, scopes)
        known.update(n.output)
    missing += [o.name for o in g.output if not any(o.name in s for s in scopes)]
    return list(dict.fromkeys(missing))


def copy_and_namer(model: ModelProto) -> tuple[ModelProto, Callable[[str], str]]:
    """A copy of `model` to edit, and a function giving names no tensor of it has yet (`base`,
    else `base_1`, `base_2`, ...), each name once."""
    out = ModelProto()
    out.CopyFrom(model)
    names = all_names(out)

    def fresh(base: str) -> str:
        k, name = 0, base
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.add(name)
        return name
    return out, fresh


def make_node(op: str, name: str, domain: str, attrs: dict, inputs: Sequence[gs.Tensor],
              outputs: Sequence[gs.Tensor], overload: str = "") -> gs.Node:
    """A gs node; attributes in the order given (None values left out, as helper.make_node
    does), `overload` kept for export."""
    node = gs.Node(op, name=name, domain=domain, attrs={k: v for k, v in attrs.items() if v is not None},
                   inputs=list(inputs), outputs=list(outputs))
    if overload:
        proto = NodeProto()
        proto.overload = overload
        setattr(node, PROTO, proto)
    return node


def set_overload(node: gs.Node, overload: str) -> None:
    """Give a node a new overload (export writes it)."""
    proto = NodeProto()
    old = getattr(node, PROTO, None)
    if old is not None:
        proto.CopyFrom(old)
    proto.overload = overload
    setattr(node, PROTO, proto)


def overload(node: gs.Node) -> str:
    proto = getattr(node, PROTO, None)
    return proto.overload if proto is not None else ""


def constant(t: TensorProto) -> gs.Constant:
    """An initializer as a gs Constant that exports as `t` itself (bytes, external data)."""
    return gs.Constant(t.name, LazyValues(t))


def variable(name: str) -> gs.Variable:
    """A new tensor of no known type (no value_info on export)."""
    return gs.Variable(name)


def copy_node(node: gs.Node, inputs: Sequence[gs.Tensor], outputs: Sequence[gs.Tensor]) -> gs.Node:
    """`node` with other tensors, keeping what export puts back (`PROTO`)."""
    new = gs.Node(node.op, name=node.name, domain=node.domain, attrs=node.attrs, inputs=list(inputs),
                  outputs=list(outputs))
    proto = getattr(node, PROTO, None)
    if proto is not None:
        setattr(new, PROTO, proto)
    return new


def tensor_proto(c: gs.Constant) -> TensorProto:
    """The TensorProto of a Constant (the one it was imported from, when it was)."""
    if isinstance(c._values, LazyValues):
        return c._values.tensor
    return onnx.numpy_helper.from_array(np.asarray(c.values), c.name)


def empty() -> gs.Variable:
    """An omitted optional input or output ("")."""
    return gs.Variable.empty()


def renamed(proto, name: str, keep_doc: bool = True):
    """A copy of a ValueInfoProto or TensorProto under another name; `keep_doc` False drops
    its doc_string too (tuning's one-node models of equal layers must serialize alike)."""
    out = type(proto)()
    out.CopyFrom(proto)
    out.name = name
    if not keep_doc:
        out.doc_string = ""
    return out


def known_dim(d: onnx.TensorShapeProto.Dimension) -> int | None:
    """A dimension's size, or None where it is dynamic: a dim_param, nothing, or a negative
    dim_value (Paddle's exporter writes -1 for its dynamic dims)."""
    return d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None


ANONYMOUS_DIMS = ("", "?")  # dim_params that name no dimension (Paddle writes "?" for each unknown one)


def dim_symbol(d: onnx.TensorShapeProto.Dimension) -> str | None:
    """The name of a symbolic dimension, shared by every dim of that name; None for a size or
    an anonymous dimension."""
    return d.dim_param if d.HasField("dim_param") and d.dim_param not in ANONYMOUS_DIMS else None


def set_type(tensor: gs.Variable, elem_type, dims: list | None) -> None:
    """Give a tensor a value_info on export: element type (ONNX's, or a gs dtype) and dims
    (None: unknown)."""
    if not isinstance(elem_type, int):
        tensor.dtype, tensor.shape = elem_type, dims
        return
    np_type = onnx.helper.tensor_dtype_to_np_dtype(elem_type) if elem_type != TensorProto.BFLOAT16 else None
    tensor.dtype = np_type if np_type is not None and np_type != np.dtype(object) else elem_type
    tensor.shape = dims


def cleanup(m: Model, toposort: bool = True) -> None:
    """Nodes and tensors no graph output needs removed; nodes in topological order (gs's:
    by depth, the list order within a depth). toposort=False keeps the list order, for a
    pass whose edits keep it topological: the order decides which of several nodes with
    the same kernel a kernel's header names (the first matched), and matching follows it."""
    with _quiet():
        m.graph.cleanup()
        if toposort:
            m.graph.toposort()


def export_model(m: Model) -> ModelProto:
    """The model: the gs graph as the main graph, everything else as the source model has
    it (functions included: the caller adjusts them). The source is not changed (gs's exporter
    names an imported Constant's TensorProto after the tensor: a renamed one gets a copy)."""
    # gs's exporter copies each initializer twice (into its GraphProto, then into the model):
    # it exports empty stand-ins, and the weights are copied once, into `out`, below
    weights: dict[str, TensorProto] = {}
    lazy: list[tuple[gs.Constant, LazyValues]] = []
    for t in m.graph.tensors().values():
        if isinstance(t, gs.Constant) and isinstance(t._values, LazyValues):
            proto = t._values.tensor
            weights[t.name] = proto if proto.name == t.name else renamed(proto, t.name)
            lazy.append((t, t._values))
            t._values = LazyValues(TensorProto(name=t.name, data_type=proto.data_type, dims=proto.dims))
    try:
        with _quiet():
            out = gs.export_onnx(m.graph, do_type_check=False)
    finally:
        for t, values in lazy:
            t._values = values
    src = m.source
    for field in [fd.name for fd, _ in out.ListFields() if fd.name != "graph"]:
        out.ClearField(field)
    for fd, value in src.ListFields():
        if fd.name == "graph":
            continue
        if isinstance(value, (list, tuple)) or hasattr(value, "extend"):
            getattr(out, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(out, fd.name).CopyFrom(value)
        else:
            setattr(out, fd.name, value)
    g, sg = out.graph, src.graph
    g.metadata_props.extend(sg.metadata_props)
    # initializers in the source's order, new ones after them; gs exports only those the
    # main graph's nodes read: the others are kept (unused ones, those subgraphs read)
    # (sorted in place: protobuf's upb frees a message's memory only with its whole tree, so
    # initializers removed from `out` and added again would hold a second copy of the weights)
    order = {t.name: k for k, t in enumerate(sg.initializer)}
    present = {t.name for t in g.initializer}
    unread = set(m.unread) - present
    g.initializer.extend(t for t in sg.initializer if t.name in unread)
    g.initializer.sort(key=lambda t: order.get(t.name, len(order)))
    for t in g.initializer:
        if t.name in weights:  # the stand-in gets its weight (one copy: the output's)
            t.CopyFrom(weights[t.name])
    # the graph's inputs and outputs as they were (no pass changes them): gs drops an input
    # that is also an initializer (an overridable default) and rebuilds the others' types
    for own, mine in ((sg.input, g.input), (sg.output, g.output)):
        del mine[:]
        mine.extend(own)
    for proto_node, node in zip(g.node, m.graph.nodes, strict=True):
        proto = getattr(node, PROTO, None)
        if proto is not None:
            _restore(proto_node, proto)
    return out


def _restore(n: NodeProto, proto: NodeProto) -> None:
    """Put back what gs does not carry: overload, doc string, metadata_props, and the
    attributes it skips or rewrites (subgraphs, attribute references)."""
    if proto.HasField("overload"):
        n.overload = proto.overload
    if proto.HasField("doc_string"):
        n.doc_string = proto.doc_string
    n.metadata_props.extend(proto.metadata_props)
    own = [a for a in proto.attribute if a.type not in _GS_TYPES or a.ref_attr_name]
    if not own:
        return
    exported = {a.name: a for a in n.attribute}
    names = {a.name for a in own}
    attrs = [a if a.name in names else exported[a.name] for a in proto.attribute
             if a.name in names or a.name in exported]
    attrs += [a for a in n.attribute if a.name not in {b.name for b in proto.attribute}]
    copies = []
    for a in attrs:
        c = AttributeProto()
        c.CopyFrom(a)
        copies.append(c)
    del n.attribute[:]
    n.attribute.extend(copies)
