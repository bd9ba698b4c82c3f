"""Replace each match with one `onnxfuse` node whose function body is the original subgraph.

Each match's kind lowers it (`onnxfuse.kinds.base.Kind.lower`: its inputs, program and
attributes as docs/format.md lays out the kind's node); this module writes the node, its
function and its kernel name, and holds what the lowerings share (`lower_group`: pointwise
nodes to a Program) and what undoes a fusion (`unfuse`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import FunctionProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse import ir
from onnxfuse.errors import OnnxfuseError
from onnxfuse.expr import SIXTEEN_BIT, Builder, Operand, Program, Ref, relax_16bit, rewrite_tails
from onnxfuse.graph import GraphView, same_shape, shape_input_nodes, shape_input_spec
from onnxfuse.kinds.base import FusedNode, Match
from onnxfuse.load import UNKNOWN_DIM, default_opset
from onnxfuse.match import literal_inputs, numel, operands
from onnxfuse.ops import ELEM_TYPE, FLOAT_TYPES, RULES, node_attrs

DOMAIN = "onnxfuse"
DOMAIN_VERSION = 1
MIN_IR_VERSION = 10  # function overloads


def ir_dtype(view: GraphView, name: str) -> str:
    t = view.types[name]
    return "bool" if t == onnx.TensorProto.BOOL else FLOAT_TYPES[t]


def round_trip_source(view: GraphView, members: set[int], n: NodeProto) -> str | None:
    """s, when n is Cast(Cast(s: T -> float32) -> T) with both casts in the group (T is
    float16 or bfloat16): the original's value is s exactly. The program keeps s unrounded
    (it rounds only where it stores), so a rounding here would make the round trip differ
    from s by up to half an ulp of T, e.g. s - Cast(Cast(s)) would not be 0."""
    if n.op_type != "Cast" or view.types.get(n.input[0]) != onnx.TensorProto.FLOAT:
        return None
    to = node_attrs(n).get("to")
    p = view.producer.get(n.input[0])
    if to not in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) or p not in members:
        return None
    widen = view.nodes[p]
    return widen.input[0] if widen.op_type == "Cast" and view.types.get(widen.input[0]) == to else None


def lower_group(view: GraphView, nodes: tuple[int, ...], outputs: tuple[str, ...],
                first: str | None = None) -> tuple[Program, list[str], dict[str, float]]:
    """Lower pointwise nodes (topological order) to a Program computing `outputs`. Its
    inputs are `first` (if given), then the other boundary tensors in order of first use."""
    return lower_nodes(view, nodes, outputs, [(first, ir_dtype(view, first))] if first is not None else [])


def lower_nodes(view: GraphView, nodes: tuple[int, ...], outputs: tuple[str, ...], fixed: list[tuple[str, str]],
                prelude: Callable[[Builder, dict[str, Operand]], None] | None = None,
                defined: set[str] | None = None, store_pass_through: bool = True
                ) -> tuple[Program, list[str], dict[str, float]]:
    """Pointwise nodes (topological order) as a Program computing `outputs`, with the
    constants it folds. Its inputs are `fixed` ((name, IR dtype), in order), then the other
    boundary tensors in order of first use; `prelude` emits what defines the tensors in
    `defined` before the nodes' instructions (a row kind's statistics).
    `store_pass_through`: an output that is only one of the program's inputs still gets an
    instruction of its own (so that it has its own store)."""
    members = set(nodes)
    lits = {i: literal_inputs(view, i) for i in nodes}
    inputs = [name for name, _ in fixed]
    dtypes = [dt for _, dt in fixed]
    seen = set(inputs) | (defined or set())
    for i in nodes:
        for _, name in operands(view, i):
            if view.producer.get(name) not in members and name not in seen:
                inputs.append(name)
                dtypes.append(ir_dtype(view, name))
                seen.add(name)
    b = Builder(dtypes)
    env: dict[str, Operand] = {}
    for k, name in enumerate(inputs):
        env.setdefault(name, Ref(k))
    if prelude is not None:
        prelude(b, env)
    folded: dict[str, float] = {}
    for i in nodes:
        n = view.nodes[i]
        rule = RULES[n.op_type]
        consts = []
        for k in rule.const_inputs:
            name = n.input[k] if k < len(n.input) else ""
            consts.append(view.scalar_constant(name) if name else None)
            if name:
                folded[name] = consts[-1]
        args: list[Operand] = []
        for k, name in enumerate(n.input):
            if k in rule.const_inputs or (rule.tensor_inputs is not None and k not in rule.tensor_inputs):
                continue
            if k in lits[i]:
                args.append(lits[i][k])
                folded[name] = lits[i][k]
            else:
                args.append(env[name])
        source = round_trip_source(view, members, n)
        if source is not None:
            env[n.output[0]] = env[source]
            continue
        attrs = dict(node_attrs(n), **{ELEM_TYPE: view.types[n.output[0]]})
        env[n.output[0]] = rule.lower(b, args, attrs, consts)
    outs: list[tuple[Ref, str]] = []
    for o in outputs:
        v = env[o]
        if not isinstance(v, Ref):
            v = b.emit("add", v, 0.0)
        elif store_pass_through and v.index < len(inputs) and o not in inputs:
            v = b.emit("add", v, 0.0)  # a pure pass-through still gets its own store
        outs.append((v, FLOAT_TYPES[view.types[o]]))
    prog = b.build(outs)
    if all(dt in SIXTEEN_BIT for _, dt in prog.outputs):
        return relax_16bit(prog), inputs, folded
    return rewrite_tails(prog), inputs, folded


def _node_content(node: NodeProto) -> bytes:
    """What a function body's node computes, for the kernel's name: without its doc string and
    metadata. The dynamo exporter writes each node's Python stack trace into its metadata, with
    the paths of the torch that exported it; keyed on those, one model exported on two machines
    named (so cached) every kernel differently (the forty-fifth session's dynamo rows missed
    the kernel cache filled on the CPU machine: 134 of 158 ViT-S/16 binaries compiled again)."""
    if not node.metadata_props and not node.doc_string:
        return node.SerializeToString(deterministic=True)
    bare = NodeProto()
    bare.CopyFrom(node)
    del bare.metadata_props[:]
    bare.ClearField("doc_string")
    return bare.SerializeToString(deterministic=True)


def _function_body(view: GraphView, nodes: list[NodeProto], inputs: list[str], outputs: tuple[str, ...],
                   folded: dict[str, float]) -> tuple[list[NodeProto], list[str], list[str]]:
    """Copies of `nodes` with names normalized: x<i> inputs, y<i> outputs, t<i> internals,
    n<j> nodes, and Constant nodes for the constants that became literals and for any other
    constant a body node reads that is not an input (a Reshape's shape, a Split's sizes)."""
    names: dict[str, str] = {}
    for k, x in enumerate(inputs):
        names.setdefault(x, f"x{k}")  # a tensor passed twice is read through its first input
    names.update({y: f"y{k}" for k, y in enumerate(outputs)})
    body: list[NodeProto] = []
    consts = sorted(folded)
    consts += sorted({x for n in nodes for x in n.input if x and x not in names and x not in folded
                      and x in view.constants})
    for k, c in enumerate(consts):
        names[c] = f"c{k}"
        t = onnx.TensorProto()
        t.CopyFrom(view.constants[c])
        t.name = ""
        body.append(helper.make_node("Constant", [], [f"c{k}"], value=t))
    internal = 0
    for j, src in enumerate(nodes):
        n = NodeProto()
        n.CopyFrom(src)
        n.name = f"n{j}"
        for k, name in enumerate(n.input):
            if name and name not in names:  # a computed shape the fused node took its Reshape or Expand with
                spec = shape_input_spec(view, src)
                if spec is None or k != 1:
                    raise ValueError(f"{src.name}: input {name} is neither the fused node's nor a constant")
                names[name] = f"s{j}"
                body += shape_input_nodes(spec, n.input[0], f"s{j}", f"s{j}")  # (input 0 renamed already)
            if name:
                n.input[k] = names[name]
        for k, name in enumerate(n.output):
            if name and name not in names:
                names[name] = f"t{internal}"
                internal += 1
            if name:
                n.output[k] = names[name]
        body.append(n)
    return body, [f"x{k}" for k in range(len(inputs))], [f"y{k}" for k in range(len(outputs))]


def input_mode(view: GraphView, name: str, out_shape) -> str:
    shape = view.shapes.get(name)
    if same_shape(shape, out_shape):
        return "full"
    if numel(shape) == 1:
        return "scalar"
    return "strided"


def rewrite(model: ModelProto, view: GraphView, matches: list[Match]) -> tuple[ModelProto, list[FusedNode]]:
    """A copy of model with every match replaced; the model must be the one view indexes.

    On the gs graph (`onnxfuse.ir`; the view's own import when it is of this model and not
    edited yet, else a new one): each fused node is inserted reusing the match's boundary
    tensors, the nodes it replaces detached (their outputs cleared), then one
    `cleanup().toposort()` for all matches and one export."""
    if not matches:
        out = ModelProto()
        out.CopyFrom(model)
        return out, []
    m_ir = view.ir  # the gs graph the view reads its links from, when it is this model's
    if not isinstance(m_ir, ir.Model) or m_ir.source is not model or m_ir.edited:
        m_ir = ir.import_model(model)
    m_ir.edited = True
    graph = m_ir.graph
    gnodes = list(graph.nodes)  # node i of the view
    tensors = m_ir.tensors()
    opset = default_opset(model)
    used_names = {n.name for n in model.graph.node if n.name}
    tensor_names = _all_names(model)
    scratch = onnx.GraphProto()  # initializers the lowerings add (packed conv weights)
    functions: dict[str, FunctionProto] = {}
    fused: list[FusedNode] = []
    placed: dict[int, object] = {}  # last replaced node -> the fused node
    for m in matches:
        kind = m.pattern.kind
        node_name = unique_name(f"{m.pattern.name}_{view.nodes[m.nodes[0]].name or m.nodes[0]}", used_names)
        low = kind.lower(view, m, node_name, tensor_names, scratch)
        for t in scratch.initializer:
            tensors[t.name] = ir.constant(t)
        scratch = onnx.GraphProto()
        program = low.program
        body, fin, fout = _function_body(view, low.body, low.body_inputs or low.inputs, m.outputs, low.folded)
        digest = hashlib.sha256(program.to_text().encode())
        for n in body:
            digest.update(_node_content(n))
        digest.update(low.key.encode())
        kernel_name = f"onnxfuse_{m.pattern.name}_{digest.hexdigest()[:12]}"
        if kernel_name not in functions:
            f = helper.make_function(DOMAIN, kind.op_type, fin, fout, body, [helper.make_opsetid("", opset)])
            f.overload = kernel_name
            f.doc_string = f"onnxfuse pattern {m.pattern.name}: the original subgraph"
            functions[kernel_name] = f
        for i in m.nodes:
            gnodes[i].outputs.clear()
        attrs = dict(sorted({"program": program.to_text(), **low.attrs}.items()))  # as helper.make_node
        placed[m.nodes[-1]] = ir.make_node(kind.op_type, node_name, DOMAIN, attrs,
                                           [tensors[x] if x else ir.empty() for x in low.inputs],
                                           [tensors[y] for y in m.outputs], overload=kernel_name)
        fused.append(FusedNode(
            node_name=node_name, pattern=m.pattern.name, kernel_name=kernel_name, program=program,
            inputs=tuple(low.inputs), outputs=m.outputs, rank=low.rank, input_modes=low.input_modes,
            source_nodes=tuple(f"{view.nodes[i].op_type} {view.nodes[i].name}".rstrip() for i in m.nodes),
            kind=kind.name, measured_only=m.measured_only, **low.fields,
        ))
    # each fused node where its last node was (gs's toposort keeps the list order within a level)
    graph.nodes = [x for i, n in enumerate(gnodes) for x in ((n, placed[i]) if i in placed else (n,))]
    _type_fused_outputs(model.graph, tensors, view, fused)
    ir.cleanup(m_ir)
    out = ir.export_model(m_ir)
    # An input optimized before may have some of these functions already (same key, same body).
    present = {(f.domain, f.name, f.overload) for f in out.functions}
    out.functions.extend(f for k in sorted(functions) if (f := functions[k]) and
                         (f.domain, f.name, f.overload) not in present)
    if not any(i.domain == DOMAIN for i in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    out.ir_version = max(out.ir_version, MIN_IR_VERSION)
    return out, fused


def _type_fused_outputs(g: onnx.GraphProto, tensors: dict, view: GraphView, fused: list[FusedNode]) -> None:
    """Give every fused output that is not a graph output a value_info (its gs tensor a type):
    ONNX Runtime cannot infer the element types of a custom op's variadic outputs
    (docs/format.md). g: the graph as it was before the rewrite."""
    typed = {o.name for o in g.output} | {v.name for v in g.value_info}
    for f in fused:
        for name in f.outputs:
            if name not in typed:
                shape = view.shapes.get(name)
                dims = None if shape is None else [
                    None if isinstance(d, str) and d.startswith(UNKNOWN_DIM) else d for d in shape]
                ir.set_type(tensors[name], view.types[name], dims)
                typed.add(name)


def unique_name(name: str, used: set[str]) -> str:
    cand, k = name, 1
    while cand in used:
        cand = f"{name}_{k}"
        k += 1
    used.add(cand)
    return cand


def unfuse(model: ModelProto, fused: FusedNode) -> None:
    """Turn a fused node of `model` back into its original nodes, in place (`unfuse_named`),
    with the original node names of `fused.source_nodes`."""
    unfuse_all(model, [fused])


def unfuse_all(model: ModelProto, fused: list[FusedNode]) -> dict[str, list[str]]:
    """`unfuse` of every node of `fused`, in place, all at once (`unfuse_named`); returns each
    fused node's name -> the names of the nodes it became ("" for Constants)."""
    return unfuse_named(model, [(f.node_name, f.source_nodes) for f in fused])


def unfuse_named(model: ModelProto, nodes: list[tuple[str, tuple[str, ...]]]) -> dict[str, list[str]]:
    """Turn the onnxfuse nodes of `model` named in `nodes` ((node name, its source nodes) each)
    back into their original nodes, in place, from the model alone: each function body inlined
    (`inline_function_node`), a Transpose of packed FusedConv weights folded into ONNX weights
    again. A function goes when no node uses it any more, the onnxfuse opset import when
    nothing uses the domain. One import and one export of the gs graph for all the nodes (an
    export copies every initializer: BERT-base's twelve FFN GemmEpilogues, 440 MB of weights,
    took 16 s of a tuning one node at a time). Returns node name -> the names of the nodes it
    became ("" for Constants)."""
    if not nodes:
        return {}
    for node_name, _ in nodes:
        _node_index(model.graph, node_name)  # exactly one node of that name, else a one-line error
    m_ir = ir.import_model(model)
    by_name = {n.name: n for n in m_ir.graph.nodes if n.name}
    taken = _all_names(model)
    node_names = {n.name for n in model.graph.node if n.name}
    keys, bodies = set(), {}
    for node_name, source_nodes in nodes:
        node = by_name[node_name]
        keys.add((node.domain, node.op, ir.overload(node)))
        body = _inline(m_ir, node, node_name, source_nodes, taken, node_names)
        _fold_weight_transposes(m_ir, [n for n in body if n.op == "Transpose"])
        bodies[node_name] = [n.name for n in body]
    model.CopyFrom(ir.export_model(m_ir))
    g = model.graph
    used = {(n.domain, n.op_type, n.overload) for n in g.node}
    if keys - used:
        kept = [fn for fn in model.functions if (fn.domain, fn.name, fn.overload) not in keys - used]
        del model.functions[:]
        model.functions.extend(kept)
    if not any(n.domain == DOMAIN for n in g.node) and not any(fn.domain == DOMAIN for fn in model.functions):
        kept_imports = [i for i in model.opset_import if i.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept_imports)
    return bodies


def inline_function_node(model: ModelProto, node_name: str, source_nodes: tuple[str, ...] = ()) -> list[NodeProto]:
    """Replace the main-graph node `node_name`, a call of a model-local function, by the
    function's body, in place; returns the inlined nodes. The body's inputs and outputs
    become the node's tensors (an input the node omits becomes ""), its other tensors get
    fresh names `<node>/<name>`; an attribute reference takes the node's value or the
    function's default. Node names: none for Constants, else the names of `source_nodes`
    ("OpType name") in order as op types match, else `<node>/<optype>`. Functions and
    opset imports are left as they are. The body takes the node's place in the node list
    (so the order stays topological; nothing is cleaned up: a body output no one reads stays)."""
    idx = _node_index(model.graph, node_name)
    m_ir = ir.import_model(model)
    body = _inline(m_ir, m_ir.graph.nodes[idx], node_name, source_nodes)
    model.CopyFrom(ir.export_model(m_ir))
    return list(model.graph.node[idx:idx + len(body)])


def _inline(m_ir: ir.Model, node, node_name: str, source_nodes: tuple[str, ...], taken: set[str] | None = None,
            node_names: set[str] | None = None) -> list:
    """`inline_function_node` on the gs graph: the body's gs nodes, spliced in place of `node`.
    `taken` / `node_names`: the tensor and node names in use (default: the source model's),
    given where one gs graph takes several bodies, so that a later one's fresh names stay
    clear of an earlier one's."""
    model = m_ir.source
    key = (node.domain, node.op, ir.overload(node))
    f = next((f for f in model.functions if (f.domain, f.name, f.overload) == key), None)
    if f is None:
        raise OnnxfuseError(f"node {node_name!r} ({node.domain}::{node.op}) has no model-local function")
    fv, mv = _default_version(f.opset_import), _default_version(model.opset_import)
    if fv is not None and mv is not None and fv != mv:
        raise OnnxfuseError(f"node {node_name!r}: its function uses opset {fv}, the model {mv}; cannot inline it")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in f.node for a in n.attribute):
        raise OnnxfuseError(f"node {node_name!r}: its function body has subgraphs; cannot inline it")
    proto = model.graph.node[_node_index(model.graph, node_name)]
    rename = {x: (proto.input[k] if k < len(proto.input) else "") for k, x in enumerate(f.input)}
    rename |= {y: proto.output[k] for k, y in enumerate(f.output) if k < len(proto.output) and proto.output[k]}
    attrs = {a.name: a for a in f.attribute_proto} | {a.name: a for a in proto.attribute}
    taken = _all_names(model) if taken is None else taken
    originals = [tuple(s.split(" ", 1)) if " " in s else (s, "") for s in source_nodes]
    node_names = {n.name for n in model.graph.node if n.name} if node_names is None else node_names
    body: list[NodeProto] = []
    for b in f.node:
        n = NodeProto()
        n.CopyFrom(b)
        for k, name in enumerate(n.output):
            if name and name not in rename:
                rename[name] = unique_name(f"{node_name}/{name}", taken)
            if name:
                n.output[k] = rename[name]
        for k, name in enumerate(n.input):
            if name:
                n.input[k] = rename[name]
        _bind_attribute_refs(n, attrs)
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            n.name = ""
        elif originals and originals[0][0] == n.op_type:
            n.name = originals.pop(0)[1]
        else:
            n.name = unique_name(f"{node_name}/{n.op_type.lower()}", node_names)
        body.append(n)
    # the body as gs nodes (imported as a graph of its own), relinked to the main graph's tensors
    part = ModelProto()
    part.ir_version = model.ir_version
    part.opset_import.extend(model.opset_import)
    part.graph.node.extend(body)
    tensors = m_ir.tensors()
    graph = m_ir.graph
    nodes = []
    for b in ir.import_model(part).graph.nodes:
        def link(t):
            if t.is_empty():
                return ir.empty()
            return tensors.setdefault(t.name, ir.variable(t.name))
        ins, outs = [link(t) for t in b.inputs], [link(t) for t in b.outputs]
        b.inputs.clear()
        b.outputs.clear()
        nodes.append(ir.copy_node(b, ins, outs))
    node.inputs.clear()
    node.outputs.clear()
    at = next(k for k, n in enumerate(graph.nodes) if n is node)
    graph.nodes[at:at + 1] = nodes
    return nodes


def _node_index(g: onnx.GraphProto, name: str) -> int:
    found = [i for i, n in enumerate(g.node) if n.name == name]
    if len(found) != 1:
        raise OnnxfuseError(f"the graph has {len(found) or 'no'} nodes named {name!r}")
    return found[0]


def _default_version(imports) -> int | None:
    return next((i.version for i in imports if i.domain in ("", "ai.onnx")), None)


def _bind_attribute_refs(n: NodeProto, attrs: dict[str, onnx.AttributeProto]) -> None:
    """Attributes of n that refer to the function's (ref_attr_name) take the caller's value
    (or the default); one with neither is dropped."""
    if not any(a.ref_attr_name for a in n.attribute):
        return
    kept = []
    for a in n.attribute:
        if a.ref_attr_name:
            if a.ref_attr_name not in attrs:
                continue
            bound = onnx.AttributeProto()
            bound.CopyFrom(attrs[a.ref_attr_name])
            bound.name = a.name
            a = bound
        kept.append(a)
    del n.attribute[:]
    n.attribute.extend(kept)


def _fold_weight_transposes(m_ir: ir.Model, transposes: list) -> None:
    """After unfusing a FusedConv: a Transpose of packed weights that only it reads becomes
    the ONNX weights again, an initializer, so the unfused Conv reads them as the original
    did (no Transpose left for the runtime to fold). On the gs graph: the Transpose's output
    becomes a Constant, the Transpose and the packed weights go."""
    graph = m_ir.graph
    originals = None  # the graph's initializers by shape, dtype and bytes, built when needed
    for t in transposes:
        src = t.inputs[0]
        if not isinstance(src, gs.Constant) or len(src.outputs) != 1:
            continue
        perm = list(t.attrs["perm"])
        y = t.outputs[0]
        value = np.ascontiguousarray(numpy_helper.to_array(ir.tensor_proto(src)).transpose(perm))
        if originals is None:
            originals = _constants_by_shape(graph)
        # the weights the node was made from, when they are still in the graph (shared by
        # other readers, as torch exports the identical layers of a deep-copied block), so
        # unfusing gives back the original graph rather than a copy per node
        weights = next((c for c in originals.get((value.shape, value.dtype.str), ())
                        if np.array_equal(numpy_helper.to_array(ir.tensor_proto(c)), value)), None)
        if weights is None:
            weights = ir.constant(numpy_helper.from_array(value, y.name))
        for reader in list(y.outputs):
            for k, x in enumerate(list(reader.inputs)):
                if x is y:
                    reader.inputs[k] = weights
        t.inputs.clear()
        t.outputs.clear()
        graph.nodes = [n for n in graph.nodes if n is not t]


def _constants_by_shape(graph) -> dict:
    """The graph's constant tensors of at least 2 dims, by (shape, dtype) (their values are
    read only where a shape matches)."""
    out: dict[tuple, list] = {}
    for c in graph.tensors().values():
        if isinstance(c, gs.Constant) and len(c.shape) >= 2:
            t = ir.tensor_proto(c)
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            out.setdefault((tuple(t.dims), np.dtype(dtype).str), []).append(c)
    return out


_all_names = ir.all_names  # (the layout pass imports it from here)


def swap_functions(model: ModelProto, renamed: set[tuple[str, str, str]], added: dict) -> None:
    """After fused nodes moved to new overloads (the layout and rounding passes): the
    functions keyed (domain, name, overload) in `renamed` go when no node calls them any more
    (the model's own functions stay: subgraphs or other functions may call them), and the
    new functions in `added` (overload -> FunctionProto) join, in overload order."""
    used = {(n.domain, n.op_type, n.overload) for n in model.graph.node}
    kept = [fn for fn in model.functions if (k := (fn.domain, fn.name, fn.overload)) in used or k not in renamed]
    present = {(fn.domain, fn.name, fn.overload) for fn in kept}
    kept += [fn for _, fn in sorted(added.items()) if (fn.domain, fn.name, fn.overload) not in present]
    del model.functions[:]
    model.functions.extend(kept)
