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

import numpy as np
import onnx
from onnx import FunctionProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.graph import _outer_refs

LAYOUTS = ("nchw", "nhwc")
TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]
UNPACK = {"rsck": [3, 2, 0, 1], "krsc": [0, 3, 1, 2]}  # packed weights -> ONNX's [K, C, R, S]


# A conv whose X arrives NCHW (a graph input, or any other node's output) reads it through a
# Transpose to channels-last when X has at least this many channels: the NHWC kernel with
# [K, R, S, C] weights (sm_90 TF32 wgmma) is 1.8x faster than the NCHW one on 64 channels
# at 112² (0.166 vs 0.303 ms) while the Transpose is one read and one write of X; with 3
# channels (an image) the NCHW kernel is 2.8x faster (0.364 vs 1.017 ms). H200,
# benchmarks/conv_kernels.py, BENCHMARKS.md.
MIN_NHWC_CHANNELS = 16


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the pass changes: per FusedConv node (x_layout, y_layout, extra_layouts,
    w_layout), and the NCHW tensors that get a Transpose to channels-last (tensor -> the
    nodes that read the NHWC copy as their X)."""

    nodes: dict[str, tuple[str, str, tuple[int, ...], str]]
    boundaries: dict[str, list[str]]


def plan(model: ModelProto, fused: list) -> Plan:
    g = model.graph
    convs = {f.node_name: f for f in fused if f.kind == "conv" and f.conv is not None and f.conv.group == 1}
    weight_dims = {t.name: tuple(t.dims) for t in g.initializer}
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
    boundaries: dict[str, list[str]] = {}
    for name, f in convs.items():
        if layouts[name][0] == "nchw" and channels(f, weight_dims) >= MIN_NHWC_CHANNELS:
            layouts[name][0] = "nhwc"
            boundaries.setdefault(f.inputs[0], []).append(name)
    # every conv of the pass takes [K, R, S, C] weights: the channels-last kernels need them
    # for wgmma, and the flat kernel of narrow NCHW inputs was fastest with them too
    nodes = {name: (x, y, tuple(e), "krsc") for name, (x, y, e) in layouts.items()}
    return Plan({name: v for name, v in nodes.items()
                 if (v[0], v[1]) != ("nchw", "nchw") or any(v[2]) or v[3] != convs[name].w_layout}, boundaries)


def channels(f, weight_dims: dict[str, tuple[int, ...]]) -> int:
    """C of a FusedConv, from its packed weights ([R, S, C/group, K] or [K, R, S, C/group])."""
    dims = weight_dims[f.inputs[1]]
    return int(dims[2] if f.w_layout == "rsck" else dims[3]) * f.conv.group


def apply_layouts(model: ModelProto, fused: list) -> list:
    """Rewrite `model` in place for the NHWC plan; returns `fused` with the changed nodes'
    FusedNode values replaced (new kernel names, inputs and layouts), in the same order."""
    p = plan(model, fused)
    if not p.nodes:
        return list(fused)
    g = model.graph
    nhwc_copy = _insert_boundary_transposes(g, p.boundaries)  # rebuilds the node list: first
    nodes = {n.name: n for n in g.node}
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    new_functions: dict[str, FunctionProto] = {}
    initializers = {t.name: t for t in g.initializer}
    out = []
    for f in fused:
        if f.node_name not in p.nodes:
            out.append(f)
            continue
        x, y, extras, w = p.nodes[f.node_name]
        node = nodes[f.node_name]
        suffix = f"_{x}_{y}" + ("_e" + "".join(map(str, extras)) if any(extras) else "") + \
            ("_krsc" if w == "krsc" else "")
        name = f.kernel_name + suffix
        old = functions[(node.domain, node.op_type, node.overload)]
        if name not in new_functions:
            new_functions[name] = _layout_function(old, name, x, y, extras, w)
        for attr in [a for a in node.attribute if a.name in ("x_layout", "y_layout", "extra_layouts", "w_layout")]:
            node.attribute.remove(attr)
        node.attribute.append(helper.make_attribute("x_layout", x.upper()))
        node.attribute.append(helper.make_attribute("y_layout", y.upper()))
        if extras:
            node.attribute.append(helper.make_attribute("extra_layouts", list(extras)))
        if w != "rsck":
            node.attribute.append(helper.make_attribute("w_layout", w.upper()))
        if w != f.w_layout:
            _repack(initializers[f.inputs[1]], f.w_layout, w)
        node.overload = name
        inputs = f.inputs
        if f.node_name in nhwc_copy:
            node.input[0] = nhwc_copy[f.node_name]
            inputs = (node.input[0], *inputs[1:])
        if y == "nhwc":
            _permute_value_info(g, f.outputs[0])
        out.append(dataclasses.replace(f, kernel_name=name, inputs=inputs, x_layout=x, y_layout=y,
                                       extra_layouts=extras, w_layout=w))
    used = {(n.domain, n.op_type, n.overload) for n in g.node}
    kept = [fn for fn in model.functions if (fn.domain, fn.name, fn.overload) in used]
    present = {(fn.domain, fn.name, fn.overload) for fn in kept}
    kept += [fn for k, fn in sorted(new_functions.items()) if (fn.domain, fn.name, fn.overload) not in present]
    del model.functions[:]
    model.functions.extend(kept)
    return out


def _insert_boundary_transposes(g: onnx.GraphProto, boundaries: dict[str, list[str]]) -> dict[str, str]:
    """Put `Transpose(perm=[0, 2, 3, 1])` of each boundary tensor right before its first
    reader; returns reader node name -> the NHWC tensor it reads."""
    if not boundaries:
        return {}
    taken = {v for n in g.node for v in (*n.input, *n.output)} | {i.name for i in g.input} | \
        {t.name for t in g.initializer}
    copies: dict[str, str] = {}
    for tensor in boundaries:
        name, k = f"{tensor}_nhwc", 1
        while name in taken:
            name, k = f"{tensor}_nhwc_{k}", k + 1
        taken.add(name)
        copies[tensor] = name
    reader_of = {r: t for t, rs in boundaries.items() for r in rs}
    body, placed = [], set()
    for n in g.node:
        t = reader_of.get(n.name)
        if t is not None and t not in placed:
            body.append(helper.make_node("Transpose", [t], [copies[t]], perm=TO_NHWC, name=f"onnxfuse_to_nhwc_{t}"))
            placed.add(t)
            _add_permuted_value_info(g, t, copies[t])
        body.append(n)
    del g.node[:]
    g.node.extend(body)
    return {r: copies[t] for r, t in reader_of.items()}


def _repack(t: onnx.TensorProto, src: str, dst: str) -> None:
    """Packed conv weights from one layout to the other, in place ([R, S, C, K] <-> [K, R, S, C])."""
    a = numpy_helper.to_array(t)
    a = a.transpose(3, 0, 1, 2) if (src, dst) == ("rsck", "krsc") else a.transpose(1, 2, 3, 0)
    t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(a), t.name))


def _layout_function(old: FunctionProto, overload: str, x: str, y: str, extras: tuple[int, ...],
                     w: str = "rsck") -> FunctionProto:
    """The function of a FusedConv with layouts: the NCHW body between Transposes; with
    [K, R, S, C] weights its unpacking Transpose has perm [0, 3, 1, 2]."""
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
        if m.op_type == "Transpose" and m.input[0] == f.input[1]:  # the weights' unpacking
            del m.attribute[:]
            m.attribute.append(helper.make_attribute("perm", UNPACK[w]))
        body.append(m)
    if y == "nhwc":
        body.append(helper.make_node("Transpose", [f"{y0}_nchw"], [y0], perm=TO_NHWC, name="to_nhwc_y0"))
    del f.node[:]
    f.node.extend(body)
    f.doc_string = (old.doc_string + f"; X {x.upper()}, Y {y.upper()}"
                    + (f", extras {list(extras)}" if any(extras) else "") + (f", W {w.upper()}" if w != "rsck" else ""))
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


def _add_permuted_value_info(g: onnx.GraphProto, src: str, dst: str) -> None:
    """A value_info for dst: src's type with its dims in NHWC order (when src's is known)."""
    for vi in [*g.value_info, *g.input, *g.output]:
        if vi.name == src and vi.type.tensor_type.HasField("shape"):
            copy = onnx.ValueInfoProto()
            copy.CopyFrom(vi)
            copy.name = dst
            copy.doc_string = ""
            g.value_info.append(copy)
            _permute_value_info(g, dst)
            return
