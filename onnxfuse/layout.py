"""The NHWC layout pass (`onnxfuse optimize --layout nhwc`): tensors passed from one FusedConv
to others stay channels-last, with conversions only at the boundaries of such a run.

The conv kernel reads NCHW activations with the channel (reduction) dimension strided by
H·W, so its tensor-core tiles are fed by 4-byte gathers; channels-last makes a tile's
channels contiguous (BENCHMARKS.md, conv kernels). A FusedConv output Y becomes NHWC when
every node that reads it is a FusedConv (group 1) reading it as its X or as an epilogue
extra, and Y is not a graph output. Then:

- the producer gets `y_layout` NHWC, each reader `x_layout` NHWC or `extra_layouts[i]` 1
  (docs/format.md, "Layouts");
- Y's value_info becomes [N, P, Q, K];
- each changed node gets its own kernel name and function overload (suffix such as
  `_nhwc_nchw`), whose body transposes the NHWC tensors around the original subgraph, so
  the model stays valid ONNX that runs anywhere.

It runs in the compile step (`onnxfuse.kernels.compile_fused`), after the convs the
heuristic leaves to cuDNN are unfused: an unfused conv between two fused ones would
otherwise run through Transposes.
"""

from __future__ import annotations

import dataclasses

import onnx
from onnx import FunctionProto, ModelProto, NodeProto, helper

from onnxfuse.graph import _outer_refs

LAYOUTS = ("nchw", "nhwc")
TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]


def plan(model: ModelProto, fused: list) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """node name -> (x_layout, y_layout, extra_layouts) for the FusedConv nodes that change."""
    g = model.graph
    convs = {f.node_name: f for f in fused if f.kind == "conv" and f.conv is not None and f.conv.group == 1}
    readers: dict[str, list[tuple[str, int]]] = {}
    for n in g.node:
        for k, name in enumerate(n.input):
            if name:
                readers.setdefault(name, []).append((n.name, k))
        for name in _outer_refs(n):
            readers.setdefault(name, []).append((n.name, -1))
    outputs = {o.name for o in g.output}
    layouts = {name: ["nchw", "nchw", [0] * (len(f.inputs) - 3)] for name, f in convs.items()}
    for name, f in convs.items():
        y = f.outputs[0]
        users = readers.get(y, [])
        if y in outputs or not users:
            continue
        if not all(u in convs and (k == 0 or k >= 3) for u, k in users):
            continue
        layouts[name][1] = "nhwc"
        for u, k in users:
            if k == 0:
                layouts[u][0] = "nhwc"
            else:
                layouts[u][2][k - 3] = 1
    return {name: (x, y, tuple(e)) for name, (x, y, e) in layouts.items()
            if (x, y) != ("nchw", "nchw") or any(e)}


def apply_layouts(model: ModelProto, fused: list) -> list:
    """Rewrite `model` in place for the NHWC plan; returns `fused` with the changed nodes'
    FusedNode values replaced (new kernel names and layouts), in the same order."""
    changes = plan(model, fused)
    if not changes:
        return list(fused)
    g = model.graph
    nodes = {n.name: n for n in g.node}
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    new_functions: dict[str, FunctionProto] = {}
    out = []
    for f in fused:
        if f.node_name not in changes:
            out.append(f)
            continue
        x, y, extras = changes[f.node_name]
        node = nodes[f.node_name]
        suffix = f"_{x}_{y}" + ("_e" + "".join(map(str, extras)) if any(extras) else "")
        name = f.kernel_name + suffix
        old = functions[(node.domain, node.op_type, node.overload)]
        if name not in new_functions:
            new_functions[name] = _layout_function(old, name, x, y, extras)
        for attr in [a for a in node.attribute if a.name in ("x_layout", "y_layout", "extra_layouts")]:
            node.attribute.remove(attr)
        node.attribute.append(helper.make_attribute("x_layout", x.upper()))
        node.attribute.append(helper.make_attribute("y_layout", y.upper()))
        if extras:
            node.attribute.append(helper.make_attribute("extra_layouts", list(extras)))
        node.overload = name
        if y == "nhwc":
            _permute_value_info(g, f.outputs[0])
        out.append(dataclasses.replace(f, kernel_name=name, x_layout=x, y_layout=y, extra_layouts=extras))
    used = {(n.domain, n.op_type, n.overload) for n in g.node}
    kept = [fn for fn in model.functions if (fn.domain, fn.name, fn.overload) in used]
    present = {(fn.domain, fn.name, fn.overload) for fn in kept}
    kept += [fn for k, fn in sorted(new_functions.items()) if (fn.domain, fn.name, fn.overload) not in present]
    del model.functions[:]
    model.functions.extend(kept)
    return out


def _layout_function(old: FunctionProto, overload: str, x: str, y: str, extras: tuple[int, ...]) -> FunctionProto:
    """The function of a FusedConv with layouts: the NCHW body between Transposes."""
    f = FunctionProto()
    f.CopyFrom(old)
    f.overload = overload
    nhwc_inputs = ([f.input[0]] if x == "nhwc" else []) + [f.input[3 + i] for i, e in enumerate(extras) if e]
    rename = {name: f"{name}_nchw" for name in nhwc_inputs}
    body: list[NodeProto] = [helper.make_node("Transpose", [name], [rename[name]], perm=TO_NCHW,
                                              name=f"to_nchw_{name}") for name in nhwc_inputs]
    y0 = f.output[0]
    for n in f.node:
        m = NodeProto()
        m.CopyFrom(n)
        for k, name in enumerate(m.input):
            if name in rename:
                m.input[k] = rename[name]
        if y == "nhwc":
            for k, name in enumerate(m.output):
                if name == y0:
                    m.output[k] = f"{y0}_nchw"
        body.append(m)
    if y == "nhwc":
        body.append(helper.make_node("Transpose", [f"{y0}_nchw"], [y0], perm=TO_NHWC, name="to_nhwc_y0"))
    del f.node[:]
    f.node.extend(body)
    f.doc_string = (old.doc_string + f"; X {x.upper()}, Y {y.upper()}"
                    + (f", extras {list(extras)}" if any(extras) else ""))
    return f


def _permute_value_info(g: onnx.GraphProto, name: str) -> None:
    for vi in g.value_info:
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            dims = list(vi.type.tensor_type.shape.dim)
            if len(dims) == 4:
                copies = [onnx.TensorShapeProto.Dimension() for _ in range(4)]
                for c, d in zip(copies, [dims[i] for i in TO_NHWC], strict=True):
                    c.CopyFrom(d)
                del vi.type.tensor_type.shape.dim[:]
                vi.type.tensor_type.shape.dim.extend(copies)
