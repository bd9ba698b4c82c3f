"""The NHWC layout pass (`onnxfuse optimize --layout nhwc`, the default when kernels are
compiled for a GPU): convolutions run channels-last, with conversions only where a run of
fused convs meets other ops.

Why (H200, BENCHMARKS.md "Channels-last convolutions"): with NCHW activations a tile's
channels (the reduction dimension) are strided by H·W, and TF32 `wgmma` needs both tile
operands K-major; channels-last activations plus weights packed [K, R, S, C] make both
contiguous, and the 4-warp `wgmma` kernel ran 1.8x the NCHW one.

The plan, over the FusedConvs (grouped and depthwise ones too: their direct kernel reads
channels-last X a row of contiguous channels at a time):
- Tensors joined by Concat or Split over the channels (axis 1) form one component with the
  conv outputs they carry. A component turns NHWC when every tensor in it is produced by a
  FusedConv (its Y) or by such a Concat / Split, none is a graph input or output, and every
  reader is a FusedConv (as X or as an epilogue extra) or such a Concat / Split. Then its
  producers get `y_layout` NHWC, its readers `x_layout` NHWC or `extra_layouts[i]` 1, and
  its Concat / Split nodes axis 3. (A lone conv output is the one-tensor case.)
- A FusedMaxPool joins its X and Y into one component (a pool runs NHWC in and out or not
  at all): so conv -> pool -> conv (ResNet's stem) and conv -> pool -> pool -> pool into a
  Concat with the conv output (YOLO's SPPF) run channels-last with no Transpose. A pool reads
  its X as the one channels-last-capable input; its prologue's extra inputs stay NCHW (a
  component that one of them is in stays NCHW). Such pools get `x_layout` and `y_layout` NHWC.
- A FusedRows GroupNorm whose x is its only input of x's shape (the others per channel or
  image: gamma, beta, a time embedding) and y its only output is laid out as a pool (its
  kind's `node_layouts`): SD-UNet's conv -> GroupNorm + SiLU -> conv stays channels-last.
- Layout-free nodes join their tensors into one component too (`_layout_free_inputs`):
  elementwise ops and PointwiseChain nodes (every input that is not a constant scalar),
  GlobalAveragePool of known C, H, W (rewritten as a MatMul by a row of 1/(H·W)) and
  Resize with constant scales or sizes (permuted). So MobileNet's squeeze-excite
  (pool, two 1x1 convs, Mul) and YOLO's upsampling stay channels-last.
- The GlobalAveragePool rewrite only at conv precision "tf32" (`MATMUL_POOL_PRECISIONS`):
  ONNX Runtime's CUDA EP runs that MatMul in TF32 by default, an error like that of the
  tf32 convs (whose operands are rounded as cuBLAS rounds them) and of ORT's own convs, but
  far above what `--conv-precision ieee` or `tf32x3` promise (on the H200 a PP-OCR det
  model optimized with ieee came out 0.0105 off fp32, about 100x what its convs explain,
  through these MatMuls). With those the pool stays an NCHW
  GlobalAveragePool, not layout-free: its input's component stays NCHW (the conv that
  writes it writes NCHW), and its [N, C, 1, 1] result enters the channels-last convs after
  it through a Reshape to [N, 1, 1, C], which copies nothing.
- A group-1 conv whose X is still NCHW and has at least MIN_NHWC_CHANNELS channels
  (`onnxfuse.kinds.conv`, `Kind.transposes_x`) reads it through
  one `Transpose(perm=[0, 2, 3, 1])` put before its first reader (shared by all such
  readers); narrower inputs (an image) stay NCHW for the flat-reduction kernel.
- Every conv of the pass gets `w_layout` KRSC: its packed weights are repacked.
- Each changed node gets its own kernel name and function overload (suffix such as
  `_nhwc_nchw_krsc`), whose body transposes the NHWC tensors around the original
  subgraph, so the model stays valid ONNX that runs anywhere; value_infos of NHWC tensors
  are permuted to [N, H, W, C].

It runs in the compile pass (`onnxfuse.pipeline.compile_pass`, `onnxfuse.kernels.compile_fused`),
after the convs the heuristics leave to cuDNN are declined: its plan depends on which convs
stay fused. With it no conv is left to cuDNN (the channels-last kernel matched or beat
cuDNN's channels-last convs on every layer measured), and the `conv_alone` pattern fuses
convs with nothing after them so that they stay channels-last too (the choose-layout pass
picks the patterns, `onnxfuse.pipeline.NHWC_ONLY_PATTERNS`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import FunctionProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse import ir
from onnxfuse.kinds import KINDS, kind_of
from onnxfuse.kinds.base import NodeLayouts
from onnxfuse.rewrite import swap_functions

TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]
UNPACK = {"rsck": [3, 2, 0, 1], "krsc": [0, 3, 1, 2]}  # packed weights -> ONNX's [K, C, R, S]
# Name prefix of the Transposes a function body gets for its NHWC tensors: they are how the
# body reads channels-last storage, not work of the original model (onnxfuse.cost skips them).
BODY_TRANSPOSE_PREFIX = "onnxfuse_layout_"




@dataclasses.dataclass(frozen=True)
class Plan:
    """What the pass changes: per FusedConv node (x_layout, y_layout, extra_layouts,
    w_layout), per FusedMaxPool node ("nhwc", "nhwc", (), its unchanged w_layout); the NCHW
    tensors that get a Transpose to channels-last (tensor -> the nodes that read the NHWC
    copy as their X); the tensors that become NHWC; and the Concat / Split nodes between
    fused convs that then work on the channel axis 3."""

    nodes: dict[str, tuple[str, str, tuple[int, ...], str]]
    boundaries: dict[str, list[str]]
    nhwc: frozenset[str] = frozenset()
    transparent: frozenset[int] = frozenset()  # indices into the graph's node list as planned


def _channel_axis_node(n: NodeProto) -> bool:
    """A Concat or Split over axis 1 (the channels of a 4-D tensor: every tensor the pass
    considers is a conv output or joined to one through such nodes, so rank 4)."""
    if n.domain not in ("", "ai.onnx") or n.op_type not in ("Concat", "Split"):
        return False
    axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 0)
    return axis in (1, -3)


# Ops that compute the same on channels-last tensors when every input that is not a scalar
# is channels-last too: elementwise ops (numpy broadcasting of equal-rank tensors).
ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Neg", "Abs", "Relu", "LeakyRelu", "Elu",
    "Selu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Exp", "Log", "Sqrt", "Reciprocal", "Erf", "Cos",
    "Sin", "Clip", "Softplus", "Cast", "Gelu"})
# GlobalAveragePool of a channels-last [N, H, W, C] tensor as Reshape [N, H·W, C], MatMul by
# a row of 1/(H·W), Reshape [N, 1, 1, C]: ONNX Runtime's CUDA ReduceMean over axes (1, 2)
# took 24-37 µs on MobileNetV3-small's squeeze-excite inputs at batch 32, the MatMul 2.8-4.4
# µs, GlobalAveragePool of the NCHW tensor 3.2-11.8 (H200, benchmarks/global_pool.py,
# global_pool.json). It needs H, W and C known; the row's dtype is X's.
AVERAGE_ROW_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}
# Above this many pixels the one MatMul is split in two (`_average_nodes`): cuBLAS runs it as
# a GEMV parallel over the C columns only, each walking all H·W rows. On the H200
# (benchmarks/global_pool.py --shapes b1, global_pool_b1.json, kernel µs): [1, 112, 112, 32]
# one MatMul 35.2, split 4.1 (GlobalAveragePool on NCHW 20.8); at batch 16 16.8 against 10.3;
# at 56x56 (3136 pixels) the two tie (4.4-4.6 against 4.6-4.8) and below it one MatMul wins.
SPLIT_AVERAGE_MIN_PIXELS = 4096
# The conv precisions under which the pool becomes that MatMul (the module docstring): ORT
# runs it in TF32, as accurate as tf32 convs and no more. ieee and tf32x3 keep the pool.
MATMUL_POOL_PRECISIONS = ("tf32",)


def _layout_free_inputs(n: NodeProto, const_dims, opset: int, static_chw, matmul_pool: bool = True
                        ) -> list[int] | None:
    """The input positions through which `n` can carry the NHWC layout (its outputs then turn
    NHWC too), or None when it cannot: elementwise ops and PointwiseChain nodes (but those that
    read an input rotated along its last axis, `rotate_half`, or through a permutation,
    `transpose`, or compute only the first columns, `partial`) through every input that is not a
    constant scalar; GlobalAveragePool, with matmul_pool, through X when
    X's C, H and W and dtype are known (it becomes a MatMul, AVERAGE_ROW_DTYPES); Resize
    (opset 11 on) through X when its scales or sizes are a constant of 4 values (they get
    permuted) and it has no roi. const_dims(t): the dims of a constant tensor, None for
    others; static_chw(t): X's (C, H, W, elem_type) when all are known, else None."""
    def scalar(t: str) -> bool:
        d = const_dims(t)
        return d is not None and len(d) <= 4 and int(np.prod(d)) == 1

    kind = kind_of(n)
    if kind is not None and kind.layout_free and any(a.name in ("rotate_half", "rotate_pairs", "transpose", "partial")
                                                     for a in n.attribute):
        return None  # along the last axis, or through a perm: not the same on a permuted tensor
    if (kind is not None and kind.layout_free
            or n.domain in ("", "ai.onnx") and n.op_type in ELEMENTWISE):
        return [k for k, t in enumerate(n.input) if t and not scalar(t)] or None
    if n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "GlobalAveragePool":
        if not matmul_pool:
            return None
        chw = static_chw(n.input[0])
        return [0] if chw is not None and chw[3] in AVERAGE_ROW_DTYPES else None
    if n.op_type == "Resize" and opset >= 11:
        roi, scales, sizes = (list(n.input[1:4]) + ["", "", ""])[:3]
        given = [t for t in (scales, sizes) if t]
        return [0] if not roi and len(given) == 1 and const_dims(given[0]) == (4,) else None
    return None


def _shapes(g: onnx.GraphProto, tensors: dict | None) -> dict[str, tuple[tuple, int]]:
    """tensor -> (dims, elem_type) of the rank-4 tensors whose shape is known, from the
    shapes inferred while optimizing (`onnxfuse.pipeline.Result.shapes`) and the graph's
    value_info; a dim is an int, a dim_param or None."""
    out = {}
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and len(t.shape.dim) == 4:
            out[vi.name] = (tuple(ir.known_dim(d) for d in t.shape.dim),
                            t.elem_type)
    for name, (dims, elem) in (tensors or {}).items():
        if dims is not None and len(dims) == 4 and name not in out:
            out[name] = (tuple(d if isinstance(d, int) else None for d in dims), elem)
    return out


def _static_chw(shapes: dict[str, tuple[tuple, int]]) -> dict[str, tuple[int, int, int, int]]:
    """tensor -> (C, H, W, elem_type) of the rank-4 tensors whose C, H and W are known."""
    return {name: (*dims[1:], elem) for name, (dims, elem) in shapes.items() if all(d for d in dims[1:])}


def plan(model: ModelProto | ir.Model, fused: list, shapes: dict[str, tuple[tuple, int]] | None = None,
         conv_precision: str = "tf32") -> Plan:
    """shapes: `_shapes` of the graph (default: from its value_info); conv_precision: the
    fused convs' (`--conv-precision`): GlobalAveragePools become MatMuls only under
    MATMUL_POOL_PRECISIONS. model: the model or its gs graph (`onnxfuse.ir`), whose links
    give each tensor's producer and readers."""
    m = model if isinstance(model, ir.Model) else ir.import_model(model)
    g = m.source.graph
    # the fused nodes that take layouts (their kinds' NodeLayouts): "convs" turn X, Y and
    # each extra channels-last on their own, "pools" X and Y together (y_follows_x)
    laid = {f.node_name: (f, how) for f in fused if (how := KINDS[f.kind].node_layouts(f)) is not None}
    convs = {name: f for name, (f, how) in laid.items() if not how.y_follows_x}
    pools = {name: f for name, (f, how) in laid.items() if how.y_follows_x}
    how_of = {name: how for name, (_, how) in laid.items()}
    weight_dims = {t.name: tuple(t.dims) for t in g.initializer}
    # Nodes by index (into g.node, which is m.graph.nodes in the same order): only the fused
    # nodes' names are known to be unique.
    conv_at = {i: n.name for i, n in enumerate(g.node) if n.domain == "onnxfuse" and n.name in convs}
    pool_at = {i: n.name for i, n in enumerate(g.node) if n.domain == "onnxfuse" and n.name in pools}
    # producers and readers: the gs graph's links (gs.Tensor.inputs / outputs); a node of a
    # subgraph that reads the tensor is a reader at (-1, -1)
    at = {id(n): i for i, n in enumerate(m.graph.nodes)}
    by_name = m.tensors()

    def readers_of(t: str) -> list[tuple[int, int]]:
        tensor = by_name.get(t)
        if tensor is None:
            return []
        out = []
        for u in {id(u): u for u in tensor.outputs}.values():
            i = at.get(id(u))
            out += [(i, k) for k, x in enumerate(u.inputs) if x is tensor] if i is not None else [(-1, -1)]
        return out

    def producer_of(t: str) -> int | None:
        tensor = by_name.get(t)
        return at.get(id(tensor.inputs[0])) if tensor is not None and tensor.inputs else None

    outputs = {o.name for o in g.output}
    fixed = outputs | {i.name for i in g.input} | set(weight_dims)
    joins = {i: n for i, n in enumerate(g.node) if _channel_axis_node(n)}
    constants = {n.output[0]: next((tuple(a.t.dims) for a in n.attribute if a.name == "value"), None)
                 for n in g.node if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}
    opset = next((o.version for o in m.source.opset_import if o.domain in ("", "ai.onnx")), 1)
    chw = _static_chw(_shapes(g, None) if shapes is None else shapes)
    matmul_pool = conv_precision in MATMUL_POOL_PRECISIONS
    free = {i: pos for i, n in enumerate(g.node) if i not in joins and (pos := _layout_free_inputs(
        n, lambda t: weight_dims.get(t, constants.get(t)), opset, chw.get, matmul_pool)) is not None}
    # Tensors joined by channel-axis Concat / Split nodes, or by layout-free nodes, form one
    # component: all of it turns NHWC or none of it does.
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.setdefault(t, t) != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for n in joins.values():
        tensors = [t for t in ([n.input[0]] if n.op_type == "Split" else list(n.input)) + list(n.output) if t]
        for t in tensors[1:]:
            parent[find(t)] = find(tensors[0])
    for i, pos in free.items():
        n = g.node[i]
        tensors = [n.input[k] for k in pos] + [t for t in n.output if t]
        for t in tensors[1:]:
            parent[find(t)] = find(tensors[0])
    for f in pools.values():  # a pool's X and Y turn NHWC together
        parent[find(f.outputs[0])] = find(f.inputs[0])
    for f in convs.values():
        find(f.outputs[0])
    components: dict[str, list[str]] = {}
    for t in list(parent):
        components.setdefault(find(t), []).append(t)

    def reader_ok(u: int, k: int) -> bool:
        if u in conv_at:
            extras = how_of[conv_at[u]].extras
            return k == 0 or (extras is not None and k >= extras)
        if u in pool_at:
            return k == 0
        if u in free:
            return k in free[u]
        return u in joins and (k == 0 or joins[u].op_type == "Concat")

    def producer_ok(t: str) -> bool:
        p = producer_of(t)
        return ((p in conv_at and convs[conv_at[p]].outputs[0] == t) or p in joins or p in free
                or (p in pool_at and pools[pool_at[p]].outputs[0] == t))

    layouts = {name: ["nchw", "nchw", [0] * _n_extras(f, how_of[name])] for name, f in convs.items()}
    nhwc: set[str] = set()
    transparent: set[int] = set()
    nhwc_pools: set[str] = set()
    for comp in components.values():
        if any(t in fixed or not producer_ok(t) for t in comp):
            continue
        if not all(reader_ok(u, k) for t in comp for u, k in readers_of(t)):
            continue
        if not any(u in conv_at and how_of[conv_at[u]].wants_nhwc for t in comp for u, _ in readers_of(t)):
            continue  # nothing channels-last reads it
        nhwc.update(comp)
        for t in comp:
            p = producer_of(t)
            if p in conv_at:
                layouts[conv_at[p]][1] = "nhwc"
            elif p in pool_at:
                nhwc_pools.add(pool_at[p])
            else:
                transparent.add(p)
            for u, k in readers_of(t):
                if u not in conv_at:
                    continue
                if k == 0:
                    layouts[conv_at[u]][0] = "nhwc"
                else:
                    layouts[conv_at[u]][2][k - how_of[conv_at[u]].extras] = 1
    boundaries: dict[str, list[str]] = {}
    for name, f in convs.items():
        # a conv reads an NCHW X through a Transpose where its kind says so (group-1 convs
        # of at least MIN_NHWC_CHANNELS channels, onnxfuse.kinds.conv)
        if layouts[name][0] == "nchw" and KINDS[f.kind].transposes_x(f, weight_dims):
            layouts[name][0] = "nhwc"
            boundaries.setdefault(f.inputs[0], []).append(name)
    # every conv of the pass takes [K, R, S, C] weights: the channels-last kernels need them
    # for wgmma, and the flat kernel of narrow NCHW inputs was fastest with them too
    nodes = {name: (x, y, tuple(e), "krsc" if how_of[name].weights is not None else convs[name].w_layout)
             for name, (x, y, e) in layouts.items()}
    changed = {name: v for name, v in nodes.items()
               if (v[0], v[1]) != ("nchw", "nchw") or any(v[2]) or v[3] != convs[name].w_layout}
    changed.update({name: ("nhwc", "nhwc", (), pools[name].w_layout) for name in sorted(nhwc_pools)})
    return Plan(changed, boundaries, frozenset(nhwc), frozenset(transparent))


def _n_extras(f, how: NodeLayouts) -> int:
    """The number of a laid-out node's extra inputs (each with its own layout)."""
    return len(f.inputs) - how.extras if how.extras is not None else 0


def apply_layouts(model: ModelProto, fused: list, tensors: dict | None = None, conv_precision: str = "tf32") -> list:
    """Rewrite `model` in place for the NHWC plan; returns `fused` with the changed nodes'
    FusedNode values replaced (new kernel names, inputs and layouts), in the same order.
    tensors: the shapes inferred while optimizing (`onnxfuse.pipeline.Result.shapes`);
    conv_precision: the precision the convs are compiled at (`plan`). On the gs graph
    (`onnxfuse.ir`): one import, the splices, one cleanup, one export. No toposort: the
    splices keep the node list topological (a replacement takes the replaced node's place,
    a boundary Transpose goes right before its first reader), and the order stays as the
    later steps (TF32 rounding, tuning) and the tests know it."""
    if not any(KINDS[f.kind].node_layouts(f) is not None for f in fused):
        return list(fused)  # nothing takes a layout (and no import of a large graph for nothing)
    g = model.graph
    shapes = _shapes(g, tensors)
    m = ir.import_model(model)
    p = plan(m, fused, shapes, conv_precision)
    if not p.nodes and not p.transparent:
        return list(fused)
    taken = ir.all_names(model)
    chw = _static_chw(shapes)
    by_name = m.tensors()
    nodes = list(m.graph.nodes)
    replaced = {i: _to_channels_last(m, nodes[i], by_name, taken, chw) for i in sorted(p.transparent)}
    m.graph.nodes = [r for i, n in enumerate(nodes) for r in replaced.get(i, [n])]
    single_pixel = {name for name, (dims, _) in shapes.items() if dims[2:] == (1, 1)}
    nhwc_copy = _insert_boundary_transposes(m, by_name, p.boundaries, taken, single_pixel)
    fused_nodes = {n.name: n for n in m.graph.nodes if n.domain == "onnxfuse"}  # fused nodes' names are unique
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    new_functions: dict[str, FunctionProto] = {}
    renamed: set[tuple[str, str, str]] = set()  # the functions of the nodes given new overloads
    out = []
    for f in fused:
        if f.node_name not in p.nodes:
            out.append(f)
            continue
        x, y, extras, w = p.nodes[f.node_name]
        node = fused_nodes[f.node_name]
        key = (node.domain, node.op, ir.overload(node))
        suffix = f"_{x}_{y}" + ("_e" + "".join(map(str, extras)) if any(extras) else "") + \
            ("_krsc" if w == "krsc" else "")
        name = f.kernel_name + suffix
        old = functions[key]
        renamed.add(key)
        how = KINDS[f.kind].node_layouts(f)
        if name not in new_functions:
            new_functions[name] = _layout_function(old, name, x, y, extras, how, w)
        for attr in ("x_layout", "y_layout", "extra_layouts", "w_layout"):
            node.attrs.pop(attr, None)
        node.attrs["x_layout"] = x.upper()
        node.attrs["y_layout"] = y.upper()
        if extras:
            node.attrs["extra_layouts"] = list(extras)
        if w != "rsck":
            node.attrs["w_layout"] = w.upper()
        if w != f.w_layout:
            k = how.weights
            node.inputs[k] = ir.constant(_repacked(ir.tensor_proto(node.inputs[k]), f.w_layout, w))
        ir.set_overload(node, name)
        inputs = f.inputs
        if f.node_name in nhwc_copy:
            node.inputs[0] = by_name[nhwc_copy[f.node_name]]
            inputs = (nhwc_copy[f.node_name], *inputs[1:])
        out.append(dataclasses.replace(f, kernel_name=name, inputs=inputs, x_layout=x, y_layout=y,
                                       extra_layouts=extras, w_layout=w))
    for t in sorted(p.nhwc):  # the conv outputs that turn NHWC and the Concat / Split results
        _permute_type(by_name[t])
    ir.cleanup(m, toposort=False)
    model.CopyFrom(ir.export_model(m))
    swap_functions(model, renamed, new_functions)
    return out


def _to_channels_last(m: ir.Model, n, tensors: dict, taken: set[str], chw: dict) -> list:
    """A node between channels-last tensors (a gs node), rewritten to work on them; returns
    the nodes that replace it: Concat and Split on axis 3; GlobalAveragePool as MatMuls
    (`_average_nodes`, AVERAGE_ROW_DTYPES); Resize with its scales or sizes permuted to
    [N, H, W, C] (new initializers: the old ones may be shared).
    Elementwise ops stay as they are. chw: `_static_chw` of the graph before the pass."""
    if n.op in ("Concat", "Split"):
        n.attrs.pop("axis", None)
        n.attrs["axis"] = 3
    elif n.op == "GlobalAveragePool":
        x, y = n.inputs[0], n.outputs[0]
        nodes = _average_nodes(n, x, y, taken, *chw[x.name])
        n.inputs.clear()
        n.outputs.clear()
        return nodes
    elif n.op == "Resize":
        k = 2 if len(n.inputs) > 2 and not n.inputs[2].is_empty() else 3
        src = n.inputs[k]
        # an initializer or a Constant node's value
        const = src if isinstance(src, gs.Constant) else src.inputs[0].attrs["value"]
        value = numpy_helper.to_array(ir.tensor_proto(const))
        name = _fresh(f"{src.name}_nhwc", taken)
        n.inputs[k] = ir.constant(numpy_helper.from_array(value[TO_NHWC].copy(), name))
    return [n]


def _average_nodes(n, x, y, taken: set[str], c: int, h: int, w: int, elem: int) -> list:
    """GlobalAveragePool `n` (a gs node) of a channels-last [N, H, W, C] tensor `x` into `y`,
    as MatMuls: Reshape [N, H·W, C], MatMul by a row of 1/(H·W), Reshape [N, 1, 1, C]. Above
    SPLIT_AVERAGE_MIN_PIXELS, where H·W has a divisor S > 1 up to its square root (the
    largest), the MatMul is split in two: Reshape [N, S, H·W/S, C], MatMul by a row of
    1/(H·W) over H·W/S, Reshape [N, S, C], MatMul by a row of S ones."""
    dt, name, pixels = AVERAGE_ROW_DTYPES[elem], n.name or y.name, h * w
    s = max(d for d in range(1, int(pixels ** 0.5) + 1) if pixels % d == 0) if pixels > SPLIT_AVERAGE_MIN_PIXELS else 1

    def const(key: str, value: np.ndarray):
        return ir.constant(numpy_helper.from_array(value, _fresh(f"{y.name}_{key}", taken)))

    def node(op: str, key: str, inputs: list, outputs: list):
        return ir.make_node(op, _fresh(f"{name}_{key}", taken), "", {}, inputs, outputs)

    row = const("row", np.full((1, pixels // s), 1.0 / pixels, dt))
    shape3 = const("shape3", np.array([0, s, c] if s > 1 else [0, pixels, c], np.int64))
    shape4 = const("shape4", np.array([0, 1, 1, c], np.int64))
    x3, mean = (ir.variable(_fresh(f"{y.name}_{k}", taken)) for k in ("rows", "mean"))
    if s == 1:
        return [node("Reshape", "rows", [x, shape3], [x3]), node("MatMul", "mean", [row, x3], [mean]),
                ir.make_node("Reshape", n.name, "", {}, [mean, shape4], [y])]
    split = const("shape_split", np.array([0, s, pixels // s, c], np.int64))
    part, part3 = (ir.variable(_fresh(f"{y.name}_{k}", taken)) for k in ("partial", "partials"))
    return [node("Reshape", "rows", [x, split], [x3]), node("MatMul", "partial", [row, x3], [part]),
            node("Reshape", "partials", [part, shape3], [part3]),
            node("MatMul", "mean", [const("ones", np.ones((1, s), dt)), part3], [mean]),
            ir.make_node("Reshape", n.name, "", {}, [mean, shape4], [y])]


def _fresh(name: str, taken: set[str]) -> str:
    base, k = name, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _insert_boundary_transposes(m: ir.Model, tensors: dict, boundaries: dict[str, list[str]],
                                taken: set[str], single_pixel: set[str] = frozenset()) -> dict[str, str]:
    """Put `Transpose(perm=[0, 2, 3, 1])` of each boundary tensor right before its first
    reader; returns reader node name -> the NHWC tensor it reads (added to `tensors`).
    `taken`: every tensor name of the model, its subgraphs' included (the new names avoid
    them). A tensor of `single_pixel`, known to be [N, C, 1, 1] (a squeeze-excite's pooled
    vector), has the same bytes in either layout: it gets `Reshape(shape=[0, 1, 1, -1])`
    instead, which copies nothing."""
    if not boundaries:
        return {}
    shape = None
    if single_pixel & set(boundaries):
        name = _fresh("onnxfuse_nhwc_single_pixel_shape", taken)
        shape = ir.constant(numpy_helper.from_array(np.array([0, 1, 1, -1], np.int64), name))
    copies = {tensor: _fresh(f"{tensor}_nhwc", taken) for tensor in boundaries}
    reader_of = {r: t for t, rs in boundaries.items() for r in rs}
    body, placed = [], set()
    for n in m.graph.nodes:
        t = reader_of.get(n.name)
        if t is not None and t not in placed:
            src = tensors[t]
            copy = tensors[copies[t]] = ir.variable(copies[t])
            if src.shape is not None:  # its type: src's with the dims in NHWC order
                ir.set_type(copy, src.dtype, list(src.shape))
                _permute_type(copy)
            body.append(ir.make_node("Reshape", f"onnxfuse_to_nhwc_{t}", "", {}, [src, shape], [copy])
                        if t in single_pixel else
                        ir.make_node("Transpose", f"onnxfuse_to_nhwc_{t}", "", {"perm": TO_NHWC}, [src], [copy]))
            placed.add(t)
        body.append(n)
    m.graph.nodes = body
    return {r: copies[t] for r, t in reader_of.items()}


def _repacked(t: onnx.TensorProto, src: str, dst: str) -> onnx.TensorProto:
    """Packed conv weights from one layout to the other ([R, S, C, K] <-> [K, R, S, C])."""
    a = numpy_helper.to_array(t)
    a = a.transpose(3, 0, 1, 2) if (src, dst) == ("rsck", "krsc") else a.transpose(1, 2, 3, 0)
    return numpy_helper.from_array(np.ascontiguousarray(a), t.name)


def _layout_function(old: FunctionProto, overload: str, x: str, y: str, extras: tuple[int, ...],
                     how: NodeLayouts, w: str = "rsck") -> FunctionProto:
    """The function of a laid-out node (`how`: its kind's NodeLayouts) with layouts: the
    NCHW body between Transposes; with [K, R, S, C] weights (a FusedConv's) its unpacking
    Transpose has perm [0, 3, 1, 2]."""
    f = FunctionProto()
    f.CopyFrom(old)
    f.overload = overload
    nhwc_inputs = ([f.input[0]] if x == "nhwc" else []) + [f.input[how.extras + i] for i, e in enumerate(extras) if e]
    rename = {name: f"{name}_nchw" for name in nhwc_inputs}
    body: list[NodeProto] = [helper.make_node("Transpose", [name], [rename[name]], perm=TO_NCHW,
                                              name=f"{BODY_TRANSPOSE_PREFIX}to_nchw_{name}") for name in nhwc_inputs]
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
        if how.weights is not None and m.op_type == "Transpose" and m.input[0] == f.input[how.weights]:  # unpacking
            del m.attribute[:]
            m.attribute.append(helper.make_attribute("perm", UNPACK[w]))
        body.append(m)
    if y == "nhwc":
        body.append(helper.make_node("Transpose", [f"{y0}_nchw"], [y0], perm=TO_NHWC,
                                     name=f"{BODY_TRANSPOSE_PREFIX}to_nhwc_y0"))
    del f.node[:]
    f.node.extend(body)
    f.doc_string = (old.doc_string + f"; X {x.upper()}, Y {y.upper()}"
                    + (f", extras {list(extras)}" if any(extras) else "")
                    + (f", W {w.upper()}" if how.weights is not None and w != "rsck" else ""))
    return f


def _permute_type(t) -> None:
    """A gs tensor's 4-D shape (its value_info on export) in NHWC order."""
    if t.shape is not None and len(t.shape) == 4:
        t.shape = [t.shape[i] for i in TO_NHWC]
