"""Replace each match with one `onnxfuse` node whose function body is the original subgraph."""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass

import onnx
from onnx import FunctionProto, ModelProto, NodeProto, helper

from onnxfuse.expr import Builder, Operand, Program, Ref
from onnxfuse.graph import GraphView, _outer_refs, same_shape
from onnxfuse.load import UNKNOWN_DIM, default_opset
from onnxfuse.match import Match, literal_inputs, numel
from onnxfuse.ops import ELEM_TYPE, FLOAT_TYPES, RULES, node_attrs

DOMAIN = "onnxfuse"
DOMAIN_VERSION = 1
MIN_IR_VERSION = 10  # function overloads


@dataclass(frozen=True)
class FusedNode:
    """One fused node, with what code generation needs to know about it."""

    node_name: str
    pattern: str
    kernel_name: str  # also the function overload
    program: Program
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    rank: int
    input_modes: tuple[str, ...]
    source_nodes: tuple[str, ...]  # "OpType name" of each replaced node


def _ir_dtype(view: GraphView, name: str) -> str:
    t = view.types[name]
    return "bool" if t == onnx.TensorProto.BOOL else FLOAT_TYPES[t]


def _round_trip_source(view: GraphView, members: set[int], n: NodeProto) -> str | None:
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


def build_program(view: GraphView, match: Match) -> tuple[Program, list[str], dict[str, float]]:
    """Lower a match to a Program; returns it, the boundary input tensors in program
    order, and the constant inputs that became literals (name -> value)."""
    members = set(match.nodes)
    rules = {i: RULES[view.nodes[i].op_type] for i in match.nodes}
    lits = {i: literal_inputs(view, i) for i in match.nodes}

    def operand_inputs(i: int):
        """(k, name) of node i's inputs that are program operands, not constants."""
        rule = rules[i]
        for k, name in enumerate(view.nodes[i].input):
            if k in rule.const_inputs or (rule.tensor_inputs is not None and k not in rule.tensor_inputs):
                continue
            yield k, name

    # Boundary inputs first (in order of first use): instruction numbers start after them.
    inputs: list[str] = []
    seen: set[str] = set()
    for i in match.nodes:
        for k, name in operand_inputs(i):
            if k not in lits[i] and view.producer.get(name) not in members and name not in seen:
                inputs.append(name)
                seen.add(name)
    b = Builder([_ir_dtype(view, x) for x in inputs])
    env: dict[str, Operand] = {x: Ref(k) for k, x in enumerate(inputs)}
    folded: dict[str, float] = {}
    for i in match.nodes:
        n = view.nodes[i]
        consts = []
        for k in rules[i].const_inputs:
            name = n.input[k] if k < len(n.input) else ""
            consts.append(view.scalar_constant(name) if name else None)
            if name:
                folded[name] = consts[-1]
        args: list[Operand] = []
        for k, name in operand_inputs(i):
            if k in lits[i]:
                args.append(lits[i][k])
                folded[name] = lits[i][k]
            else:
                args.append(env[name])
        source = _round_trip_source(view, members, n)
        if source is not None:
            env[n.output[0]] = env[source]
            continue
        attrs = dict(node_attrs(n), **{ELEM_TYPE: view.types[n.output[0]]})
        env[n.output[0]] = rules[i].lower(b, args, attrs, consts)
    outs: list[tuple[Ref, str]] = []
    for o in match.outputs:
        v = env[o]
        if not isinstance(v, Ref):
            v = b.emit("add", v, 0.0)
        elif v.index < len(inputs) and o not in inputs:
            v = b.emit("add", v, 0.0)  # a pure pass-through still gets its own store
        outs.append((v, FLOAT_TYPES[view.types[o]]))
    return b.build(outs), inputs, folded


def _function_body(view: GraphView, match: Match, inputs: list[str], folded: dict[str, float],
                   opset: int) -> tuple[list[NodeProto], list[str], list[str]]:
    """The match's nodes with names normalized: x<i> inputs, y<i> outputs, t<i> internals,
    and Constant nodes for the constants that became literals."""
    names: dict[str, str] = {x: f"x{k}" for k, x in enumerate(inputs)}
    names.update({y: f"y{k}" for k, y in enumerate(match.outputs)})
    body: list[NodeProto] = []
    for k, c in enumerate(sorted(folded)):
        names[c] = f"c{k}"
        t = onnx.TensorProto()
        t.CopyFrom(view.constants[c])
        t.name = ""
        body.append(helper.make_node("Constant", [], [f"c{k}"], value=t))
    internal = 0
    for j, i in enumerate(match.nodes):
        n = NodeProto()
        n.CopyFrom(view.nodes[i])
        n.name = f"n{j}"
        for k, name in enumerate(n.input):
            if name:
                n.input[k] = names[name]
        for k, name in enumerate(n.output):
            if name and name not in names:
                names[name] = f"t{internal}"
                internal += 1
            if name:
                n.output[k] = names[name]
        body.append(n)
    return body, [f"x{k}" for k in range(len(inputs))], [f"y{k}" for k in range(len(match.outputs))]


def _input_mode(view: GraphView, name: str, out_shape) -> str:
    shape = view.shapes.get(name)
    if same_shape(shape, out_shape):
        return "full"
    if numel(shape) == 1:
        return "scalar"
    return "strided"


def rewrite(model: ModelProto, view: GraphView, matches: list[Match]) -> tuple[ModelProto, list[FusedNode]]:
    """A copy of model with every match replaced; the model must be the one view indexes."""
    out = ModelProto()
    out.CopyFrom(model)
    g = out.graph
    opset = default_opset(model)
    used_names = {n.name for n in g.node if n.name}
    functions: dict[str, FunctionProto] = {}
    fused: list[FusedNode] = []
    replaced: dict[int, NodeProto | None] = {}
    for m in matches:
        program, inputs, folded = build_program(view, m)
        body, fin, fout = _function_body(view, m, inputs, folded, opset)
        digest = hashlib.sha256(program.to_text().encode())
        for n in body:
            digest.update(n.SerializeToString(deterministic=True))
        kernel_name = f"onnxfuse_{m.pattern.name}_{digest.hexdigest()[:12]}"
        if kernel_name not in functions:
            f = helper.make_function(DOMAIN, m.pattern.replace.op_type, fin, fout, body,
                                     [helper.make_opsetid("", opset)])
            f.overload = kernel_name
            f.doc_string = f"onnxfuse pattern {m.pattern.name}: the original subgraph"
            functions[kernel_name] = f
        node_name = _unique(f"{m.pattern.name}_{view.nodes[m.nodes[0]].name or m.nodes[0]}", used_names)
        node = helper.make_node(m.pattern.replace.op_type, inputs, list(m.outputs), name=node_name,
                                domain=DOMAIN, program=program.to_text())
        node.overload = kernel_name
        out_shape = view.shapes[m.outputs[0]]
        fused.append(FusedNode(
            node_name=node_name, pattern=m.pattern.name, kernel_name=kernel_name, program=program,
            inputs=tuple(inputs), outputs=m.outputs, rank=len(out_shape),
            input_modes=tuple(_input_mode(view, x, out_shape) for x in inputs),
            source_nodes=tuple(f"{view.nodes[i].op_type} {view.nodes[i].name}".rstrip() for i in m.nodes),
        ))
        for i in m.nodes:
            replaced[i] = None
        replaced[m.nodes[-1]] = node
    if not matches:
        return out, []
    nodes = [replaced.get(i, n) for i, n in enumerate(g.node)]
    nodes = toposort([n for n in nodes if n is not None], g)
    del g.node[:]
    g.node.extend(nodes)
    _drop_dead_tensors(g, view)
    _type_fused_outputs(g, view, fused)
    # An input optimized before may have some of these functions already (same key, same body).
    present = {(f.domain, f.name, f.overload) for f in out.functions}
    out.functions.extend(f for k in sorted(functions) if (f := functions[k]) and
                         (f.domain, f.name, f.overload) not in present)
    if not any(i.domain == DOMAIN for i in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    out.ir_version = max(out.ir_version, MIN_IR_VERSION)
    return out, fused


def _type_fused_outputs(g: onnx.GraphProto, view: GraphView, fused: list[FusedNode]) -> None:
    """Give every fused output that is not a graph output a value_info: ONNX Runtime cannot
    infer the element types of a custom op's variadic outputs (docs/format.md)."""
    typed = {o.name for o in g.output} | {v.name for v in g.value_info}
    for f in fused:
        for name in f.outputs:
            if name not in typed:
                shape = view.shapes.get(name)
                dims = None if shape is None else [
                    None if isinstance(d, str) and d.startswith(UNKNOWN_DIM) else d for d in shape]
                g.value_info.append(helper.make_tensor_value_info(name, view.types[name], dims))
                typed.add(name)


def _unique(name: str, used: set[str]) -> str:
    cand, k = name, 1
    while cand in used:
        cand = f"{name}_{k}"
        k += 1
    used.add(cand)
    return cand


def _drop_dead_tensors(g: onnx.GraphProto, view: GraphView) -> None:
    """Remove value_info of tensors no node produces any more, and initializers that only
    fused groups read (their values now live in the programs and function bodies)."""
    produced = {o for n in g.node for o in n.output}
    read = {x for n in g.node for x in list(n.input) + sorted(_outer_refs(n))}
    vi = [v for v in g.value_info if v.name in produced]
    if len(vi) != len(g.value_info):
        del g.value_info[:]
        g.value_info.extend(vi)
    was_read = set(view.consumers)
    graph_io = view.graph_inputs | view.graph_outputs
    keep = [t for t in g.initializer if t.name in read or t.name not in was_read or t.name in graph_io]
    if len(keep) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(keep)


def toposort(nodes: list[NodeProto], g: onnx.GraphProto) -> list[NodeProto]:
    """Stable topological order: among ready nodes, the one listed first goes first."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps: list[set[int]] = []
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        d = {producer[x] for x in list(n.input) + sorted(_outer_refs(n)) if x in producer and producer[x] != i}
        deps.append(d)
        for p in d:
            users[p].append(i)
    pending = [len(d) for d in deps]
    ready = [i for i, c in enumerate(pending) if c == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise AssertionError("fusion created a cycle; please report this model")
    return [nodes[i] for i in order]


def unfuse(model: ModelProto, fused: FusedNode) -> None:
    """Turn a fused node of `model` back into its original nodes, in place: its function
    body, inlined with the node's tensor names (internal tensors get fresh names, folded
    constants become Constant nodes, node names are the originals'). The function goes
    when no node uses it any more, the onnxfuse opset import when nothing uses the domain."""
    g = model.graph
    idx = next(i for i, n in enumerate(g.node) if n.name == fused.node_name)
    node = g.node[idx]
    key = (node.domain, node.op_type, node.overload)
    f = next(f for f in model.functions if (f.domain, f.name, f.overload) == key)
    rename = dict(zip(f.input, node.input, strict=True)) | dict(zip(f.output, node.output, strict=True))
    taken = _all_names(model)
    originals = iter(s.split(" ", 1)[1] if " " in s else "" for s in fused.source_nodes)
    body = []
    for b in f.node:
        n = NodeProto()
        n.CopyFrom(b)
        for k, name in enumerate(n.output):
            if name and name not in rename:
                rename[name] = _unique(f"{fused.node_name}/{name}", taken)
            if name:
                n.output[k] = rename[name]
        for k, name in enumerate(n.input):
            if name:
                n.input[k] = rename[name]
        n.name = next(originals, "") if n.op_type != "Constant" or n.domain not in ("", "ai.onnx") else ""
        body.append(n)
    nodes = list(g.node[:idx]) + body + list(g.node[idx + 1:])
    del g.node[:]
    g.node.extend(nodes)
    if not any((n.domain, n.op_type, n.overload) == key for n in g.node):
        kept = [fn for fn in model.functions if (fn.domain, fn.name, fn.overload) != key]
        del model.functions[:]
        model.functions.extend(kept)
    if not any(n.domain == DOMAIN for n in g.node) and not any(fn.domain == DOMAIN for fn in model.functions):
        kept_imports = [i for i in model.opset_import if i.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept_imports)


def _all_names(model: ModelProto) -> set[str]:
    """Every tensor name of the main graph and its subgraphs."""
    names: set[str] = set()

    def walk(g: onnx.GraphProto) -> None:
        names.update(i.name for i in g.input)
        names.update(o.name for o in g.output)
        names.update(t.name for t in g.initializer)
        names.update(v.name for v in g.value_info)
        for n in g.node:
            names.update(x for x in list(n.input) + list(n.output) if x)
            for a in n.attribute:
                for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sg)

    walk(model.graph)
    return names
