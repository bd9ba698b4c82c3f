"""TF32 rounding at the producer: where a conv's activations get rounded to TF32.

A float32 conv at precision "tf32" feeds TF32 values to the tensor cores, rounded to nearest
as cuDNN rounds them (`onnxfuse.codegen_conv.ROUND_TO_TF32`). Its weights are rounded once,
when they are packed; its activations are rounded in the kernel, between the load and the
dot, and that costs: the A tile then goes through registers instead of Triton's
asynchronous copy into shared memory (1.2-1.8x the kernel time of a large 3x3 layer on the
H200, BENCHMARKS.md, "Conv precision").

Most activations a conv reads were written by another fused conv. When every reader of a
fused conv's output Y rounds it anyway (it is the X input of "tf32" FusedConv nodes, directly
or through ops that only move values: Concat, Split, MaxPool, Resize nearest, Transpose,
...), the producer stores Y rounded (`ConvSpec.round_y`): rounding is idempotent, so the
readers see exactly the values they would have made, and a reader whose X is made only of
such tensors skips its own rounding (`ConvSpec.x_rounded`). The results are bit-identical to
rounding in every reader; only the time changes. A tensor that anything else reads (a graph
output, an Add, a Sigmoid, an extra input of an epilogue, a subgraph) is stored as computed.

The kinds say who takes part (`Kind.reads_tf32`, `Kind.may_store_tf32`): float32 "tf32"
FusedConv and GemmEpilogue nodes round their input 0 (a GEMM's A: rounded in the K loop, it
also makes ptxas serialize the fp32 wgmma) and may store rounded; FusedRows nodes (a
LayerNorm before the Q, K and V projections) may store their output 0 rounded.

`plan` decides both flags for the nodes of a model after the layout pass; `apply` gives the
nodes whose kernels change new kernel names (suffix `_rx` for x_rounded, `_ry` for round_y),
each with a copy of its function (the same body: the flags change no ONNX semantics). When a
kernel fails to compile and its node goes back to its original nodes, the plan is made
again for the rest (`onnxfuse.kernels.compile_fused`): a reader must not skip rounding
values that an ONNX Runtime conv now writes unrounded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onnx import FunctionProto, ModelProto, NodeProto, numpy_helper

from onnxfuse.ir import subgraph_reads
from onnxfuse.kinds import kind_of
from onnxfuse.rewrite import DOMAIN, swap_functions

# ONNX ops whose outputs hold only values of their data inputs (or zeros, NaN, +-inf, all
# TF32 values): index of the data inputs, None for all of them. Pad and Resize are checked
# further in `_moves_values`.
MOVES_VALUES = {
    "Identity": (0,), "Transpose": (0,), "Reshape": (0,), "Flatten": (0,), "Squeeze": (0,),
    "Unsqueeze": (0,), "Split": (0,), "Slice": (0,), "MaxPool": (0,), "Resize": (0,),
    "Upsample": (0,), "Pad": (0,), "DepthToSpace": (0,), "SpaceToDepth": (0,), "Expand": (0,),
    "Tile": (0,), "Gather": (0,), "Concat": None,
}


@dataclass(frozen=True)
class Plan:
    round_y: frozenset[str]  # fused nodes that store Y (output 0) rounded to TF32
    x_rounded: frozenset[str]  # fused nodes whose X (input 0) holds TF32 values only


def plan(model: ModelProto, rounding: set[str], may_store: set[str]) -> Plan:
    """Which FusedConv nodes store their output rounded, and which of those named in
    `rounding` (float32 "tf32" group-1 convs: the ones that round their activations) read an
    X that is rounded already. `may_store`: the FusedConv nodes whose kernels can store Y
    rounded (float32 "tf32" convs with a float32 output, grouped ones too: they multiply in
    fp32 themselves, but the convs that read them round)."""
    g = model.graph
    readers: dict[str, list[tuple[NodeProto, int]]] = {}
    producer: dict[str, NodeProto] = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name:
                readers.setdefault(name, []).append((n, i))
        for name in n.output:
            producer[name] = n
    opaque = {o.name for o in g.output} | subgraph_reads(g.node)

    memo: dict[str, bool] = {}

    def read_rounded(t: str) -> bool:
        """Every reader of t rounds it to TF32 before use (or only moves it to such readers);
        true of a tensor nothing reads (a Split output left unused)."""
        if t not in memo:
            memo[t] = False  # a cycle cannot happen in a valid graph; stay safe if it does
            memo[t] = t not in opaque and all(
                _rounds_input(n, i, rounding)
                or (_moves_values(n, i, g) and all(read_rounded(o) for o in n.output if o))
                for n, i in readers[t])
        return memo[t]

    round_y = frozenset(n.name for n in g.node if n.domain == DOMAIN
                        and n.name in may_store and readers.get(n.output[0]) and read_rounded(n.output[0]))
    held: dict[str, bool] = {}

    def holds_tf32(t: str) -> bool:
        """Every value of t is a TF32 value: stored rounded, or moved from such tensors."""
        if t not in held:
            held[t] = False
            n = producer.get(t)
            if n is None:
                ok = False
            elif n.domain == DOMAIN:  # a fused node: a conv that stores Y rounded
                ok = n.name in round_y
            else:
                data = MOVES_VALUES.get(n.op_type, ()) if n.domain in ("", "ai.onnx") else ()
                idx = range(len(n.input)) if data is None else data
                ok = bool(idx) and all(_moves_values(n, i, g) for i in idx) and \
                    all(holds_tf32(n.input[i]) for i in idx if i < len(n.input) and n.input[i])
            held[t] = ok
        return held[t]

    x_rounded = frozenset(n.name for n in g.node if n.domain == DOMAIN
                          and n.name in rounding and holds_tf32(n.input[0]))
    return Plan(round_y, x_rounded)


def base_name(kernel_name: str) -> str:
    """A kernel name without the suffixes `apply` adds."""
    for suffix in ("_ry", "_rx"):
        kernel_name = kernel_name.removesuffix(suffix)
    return kernel_name


def apply(model: ModelProto, fused: list, p: Plan) -> list:
    """The FusedNode values with the plan's flags. A node whose flags change gets the kernel
    name of its flags (its name without `_rx` / `_ry`, then `_rx` for x_rounded and `_ry`
    for round_y) and a function of that overload (a copy: the same body); unchanged nodes
    are returned as they are (the same objects)."""
    nodes = {n.name: n for n in model.graph.node if n.domain == DOMAIN}
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    added: dict[str, FunctionProto] = {}
    renamed: set[tuple[str, str, str]] = set()
    out = []
    for f in fused:
        rx, ry = f.node_name in p.x_rounded, f.node_name in p.round_y
        if (rx, ry) == (f.x_rounded, f.round_y):
            out.append(f)
            continue
        node = nodes[f.node_name]
        name = base_name(f.kernel_name) + ("_rx" if rx else "") + ("_ry" if ry else "")
        key = (node.domain, node.op_type, node.overload)
        renamed.add(key)
        if name not in added and (node.domain, node.op_type, name) not in functions:
            fn = FunctionProto()
            fn.CopyFrom(functions[key])
            fn.overload = name
            added[name] = fn
        node.overload = name
        out.append(dataclasses.replace(f, kernel_name=name, x_rounded=rx, round_y=ry))
    if renamed:
        swap_functions(model, renamed, added)
    return out


def _rounds_input(n: NodeProto, i: int, rounding: set[str]) -> bool:
    return n.domain == DOMAIN and i == 0 and n.name in rounding


def _moves_values(n: NodeProto, i: int, g) -> bool:
    """n only moves the values of its input i into its outputs (MOVES_VALUES), with the
    attributes it has: Resize in nearest mode, Pad in constant mode with a zero (or no)
    pad value, or edge/reflect mode; a fused node whose kind says so
    (`onnxfuse.kinds.base.Kind.moves_values`: a FusedMaxPool whose prologue is at most a Relu)."""
    kind = kind_of(n)
    if kind is not None:
        return kind.moves_values(n, i)
    if n.domain not in ("", "ai.onnx") or n.op_type not in MOVES_VALUES:
        return False
    data = MOVES_VALUES[n.op_type]
    if data is not None and i not in data:
        return False
    attrs = {a.name: a for a in n.attribute}
    if n.op_type in ("Resize", "Upsample"):
        mode = attrs["mode"].s.decode() if "mode" in attrs else "nearest"
        return mode == "nearest"
    if n.op_type == "Pad":
        mode = attrs["mode"].s.decode() if "mode" in attrs else "constant"
        if mode != "constant":
            return True
        if "value" in attrs:
            return attrs["value"].f == 0.0
        if len(n.input) > 2 and n.input[2]:
            init = next((t for t in g.initializer if t.name == n.input[2]), None)
            return init is not None and not numpy_helper.to_array(init).any()
        return True
    return True
