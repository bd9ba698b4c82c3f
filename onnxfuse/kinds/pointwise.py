"""The pointwise kind: connected groups of elementwise ops become one PointwiseChain node
whose kernel reads each input once and writes each output once (docs/format.md, "The node").

Launch configuration (`choose_variants`): 4 warps, and a BLOCK giving each thread two
16-byte accesses per tensor: 1024 (8 elements per thread) when some input or output is
fp32, 2048 when all are 16-bit or bool. Programs of 48 to 191 instructions take
LONG_PROGRAM's block and warps instead (BENCHMARKS.md, Decisions, `long-program`); with 8
warps, x*2 repeated 64-256 times ran 6-16% slower on the H200. Measured on the H200
(64M elements, Triton JIT, 2026-11-29): 1024/4 was within about 5% of the best of
512..4096 x 2..16 warps for cos(cos(x)) and x*2 (8x) in fp32; an fp16 GELU ran 116 us at
1024/4 and 110 us at 2048/4. benchmarks/tune_pointwise.py (2026-11-29, H200, 64M
elements, 32 configurations x 5 workloads, BENCHMARKS.md): 1024/4 with int32 offsets was
best by geometric mean and equal to torch.compile's kernels; mask-free (even) kernels and
int64 offsets made no measurable difference, so the mask-free variant is off by default
(ONNXFUSE_POINTWISE_CONFIG=even=1 turns it on).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, helper, numpy_helper

from onnxfuse.codegen import ROTATED_MODES, STRIDED_MODES, KernelSource, KernelSpec, Variant, generate
from onnxfuse.expr import Program, evaluate, with_input
from onnxfuse.graph import GraphView, same_shape, shape_input_spec
from onnxfuse.groups import Accepted, components, exit_levels, exposed_outputs, reentering
from onnxfuse.kinds.base import (
    META_VERSION,
    Fields,
    FusedNode,
    Kind,
    Lowering,
    Match,
    MatchResult,
    Pattern,
    env_config,
)
from onnxfuse.match import check_node, literal_inputs, offered_reasons
from onnxfuse.ops import FLOAT_TYPES, RULES, node_attrs
from onnxfuse.rewrite import input_mode, lower_group, unique_name

BLOCK = 1024  # with any fp32 tensor
# the least block of a row variant (`row_block`): 2 warps of 8 elements; a CTA of one warp
# could not fill an SM (at most 32 CTAs an SM on sm_90, 64 warps)
ROW_BLOCK_MIN = 512
BLOCK_16BIT = 2048  # when every tensor is f16, bf16 or bool
NUM_WARPS = 4  # 8 warps for long programs was 6-16% slower on the H200 (BENCHMARKS.md)
DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class LongProgram:
    """The launch configuration of long programs: those of `min_instrs` instructions or more,
    and fewer than `max_instrs`, get `block` and `warps` instead of BLOCK / NUM_WARPS."""

    min_instrs: int
    block: int
    warps: int
    max_instrs: int = 1 << 30


# Long programs turn compute-bound (x*2 repeated 64 times: the knee of the intensity sweep).
# benchmarks/tune_pointwise.py on the H200 (tune_long.json, 2026-11-29, kernel ms at 64M
# floats): r = 64: 1024/4 0.1636, 1024/2 0.1495, 4096/4 0.1480, torch.compile 0.1577;
# r = 128: 1024/4 0.2812, 1024/2 0.2719, torch.compile 0.2826; r = 32: 1024/4 0.1307,
# 1024/2 0.1325. 1024 x 2 warps had the best geometric mean of the long chains (18
# configurations); 8 warps was worse. Fewer threads per block hold more elements each,
# whose independent multiply chains hide the FMA latency. Fully compute-bound programs do
# not gain: r = 256 took 0.573 ms with 1024/2 against 0.536 with 1024/4 and torch.compile's
# 0.537 (intensity_sweep.json), so from 192 instructions the default launch returns.
# $ONNXFUSE_POINTWISE_CONFIG still overrides it; None turns it off.
LONG_PROGRAM: LongProgram | None = LongProgram(min_instrs=48, block=1024, warps=2, max_instrs=192)
# 64-bit offsets a thread (elements a thread x strided inputs) the int64 variant may hold: sm_90
# binaries compiled on the CPU (ptxas, triton 3.6), fp16 rank-4 chains of 4 inputs at 4 warps:
# 4 strided inputs x 16 elements spilled (96-139 local stores; LLaMA's rotary chain read through
# its Transpose), 3 x 16 and 4 x 8 did not
INT64_MAX_OFFSETS = 48


def choose_variants(spec: KernelSpec) -> tuple[Variant, ...]:
    """The variants of a kernel, most specialized first (the launcher takes the first whose
    requirements hold): where `row_block` gives one, the row variant (aligned, n % 16 == 0,
    int32 offsets, the collapsed last dim a multiple of its block); where configured, the
    mask-free one (aligned, n a multiple of BLOCK, int32 offsets); aligned, n % 16 == 0,
    int32 offsets; anything, int64 offsets.

    Programs of 48 to 191 instructions take LONG_PROGRAM's block and warps (1024 and 2:
    measured on the long chains, see LONG_PROGRAM).
    ``$ONNXFUSE_POINTWISE_CONFIG`` (e.g. ``block=2048,warps=8,int32=0,even=0``) overrides
    the launch configuration; it is for tuning experiments (benchmarks/tune_pointwise.py)."""
    prog = spec.program
    narrow = "f32" not in prog.input_dtypes and all(dt != "f32" for _, dt in prog.outputs)
    cfg = {"block": BLOCK_16BIT if narrow else BLOCK, "warps": NUM_WARPS,
           "int32": 1, "even": 0}
    if LONG_PROGRAM is not None and LONG_PROGRAM.min_instrs <= len(prog.instrs) < LONG_PROGRAM.max_instrs:
        cfg.update(block=LONG_PROGRAM.block, warps=LONG_PROGRAM.warps)
    env_config("ONNXFUSE_POINTWISE_CONFIG", cfg)
    block, warps, bits = cfg["block"], cfg["warps"], 32 if cfg["int32"] else 64
    variants = []
    if (row := row_block(spec, block)) and bits == 32:
        variants.append(dict(block=row, num_warps=row_warps(row, warps), ptr_align=16, n_multiple=16,
                             index_bits=32, last_multiple=row))
    if cfg["even"]:
        variants.append(dict(ptr_align=16, n_multiple=max(block, 16), index_bits=bits))
    variants.append(dict(ptr_align=16, n_multiple=16, index_bits=bits))
    # the int64 variant (2**31 elements or more) holds a 64-bit offset per element a thread and
    # strided input: at most INT64_MAX_OFFSETS, its block halved down to one element a thread
    strided = sum(m in STRIDED_MODES for m in spec.input_modes)
    wide = block
    while strided * (wide // (32 * warps)) > INT64_MAX_OFFSETS and wide > 32 * warps:
        wide //= 2
    variants.append(dict(index_bits=64, block=wide))
    return tuple(Variant(k, **{"block": block, "num_warps": warps, **v}) for k, v in enumerate(variants))


def row_block(spec: KernelSpec, block: int) -> int:
    """The block of the row variant (`row-vector-loads`), 0 for none: where some input is read
    strided (broadcast: a bias along the last dim) and the output's last dim is static, the
    largest power of two dividing that dim, up to `block`, from ROW_BLOCK_MIN. Its programs
    each lie in one row, so a bias is read in vectors; the launcher takes it where the
    collapsed last dim is a multiple of its block (BERT-base's FFN bias over 3072: 1024)."""
    if "strided" not in spec.input_modes or spec.partial:
        return 0
    b = min(pow2_factor(spec.last_dim), block)
    return b if b >= ROW_BLOCK_MIN else 0


def pow2_factor(n: int) -> int:
    """The largest power of two dividing n (0 for n <= 0: an unknown dim)."""
    return n & -n if n > 0 else 0


def row_warps(block: int, warps: int) -> int:
    """A row variant's warps: the heuristic's, fewer where its block would give a thread fewer
    than 8 elements (one 16-byte access of a 16-bit tensor)."""
    return max(1, min(warps, block // 256))


def pointwise_candidates(spec: KernelSpec) -> list[tuple[str, tuple[Variant, ...]]]:
    """(label, variants) per launch configuration tuning times for a chain offered to it
    against one of ONNX Runtime's own fused kernels (`Match.measured_only`: BiasGelu,
    FastGelu; `offered-chains-searched`): the heuristic's first, then half and a quarter of
    its block, twice its block, twice and half its warps, each as the heuristic's variants are
    (the "even" variant's multiple follows the block). Why: BERT-base's fp16 bias + GELU chain
    over [1024, 3072] took 8.13 µs against BiasGelu's 6.37, GPT-2's over [128, 3072] 3.26
    against FastGelu's 1.9 (H200, twenty-first session): every launch shape but the
    heuristic's untimed at these sizes. A row variant scales its own block and warps the
    same way, and is left out where its block no longer divides the last dim. Half the warps
    (twenty-fourth session): at BERT-base b8 fp16 the row variant took 6.80 µs with 8 elements
    a thread and 7.33 with 4 (H200, tuning's timings); with 16 a thread each thread has two
    16-byte loads of the input in flight before its math, untimed."""
    base = choose_variants(spec)
    out = [("default", base)]
    plain = [v for v in base if not v.last_multiple]
    block, warps = plain[0].block, plain[0].num_warps
    seen = {(block, warps)}
    for b, w in ((block // 2, warps), (block // 4, warps), (block * 2, warps), (block, warps * 2),
                 (block, warps // 2)):
        if (b, w) in seen or not 256 <= b <= 8192 or not 1 <= w <= 8:
            continue
        seen.add((b, w))
        vs = []
        for v in base:
            # a row variant scales its own block and warps by the same factors
            vb, vw = (v.block * b // block, v.num_warps * w // warps) if v.last_multiple else (b, w)
            if v.last_multiple and (spec.last_dim % vb or not ROW_BLOCK_MIN <= vb or not 1 <= vw <= 8):
                continue  # no row variant at this block
            vs.append(replace(v, index=len(vs), block=vb, num_warps=vw, last_multiple=vb if v.last_multiple else 0,
                              n_multiple=max(vb, 16) if v.even else v.n_multiple))
        out.append((f"block {b}, {w} warps", tuple(vs)))
    return out


@dataclass(frozen=True)
class PointwiseParams:
    """Match connected groups of elementwise nodes (pattern fields ops, dtypes, min_nodes)."""

    ops: frozenset[str]
    dtypes: frozenset[str]
    min_nodes: int

    @property
    def fused_ops(self) -> frozenset[str]:
        """Every op type a match may contain."""
        return self.ops


# ---------------------------------------------------------------------------------------
# matching: maximal connected, convex, shape-uniform groups of elementwise nodes
# ---------------------------------------------------------------------------------------

def _shape_misfits(view: GraphView, group: list[int], outputs: list[str]) -> set[int]:
    """Members whose exposed output's shape differs from the group's shape (that of the
    highest-rank output, the latest among equals), or is not known to be equal to it."""
    ranked = [(len(view.shapes.get(o) or ()), k) for k, o in enumerate(outputs)]
    target_name = outputs[max(ranked)[1]]
    target = view.shapes.get(target_name)
    return {view.producer[o] for o in outputs if o != target_name and not same_shape(view.shapes.get(o), target)}


def _has_tensor_input(view: GraphView, group: list[int]) -> bool:
    members = set(group)
    for i in group:
        lits = literal_inputs(view, i)
        rule = RULES[view.nodes[i].op_type]
        for k, name in enumerate(view.nodes[i].input):
            if name and k not in lits and k not in rule.const_inputs and view.producer.get(name) not in members:
                if name not in view.constants:
                    return True
    return False


@dataclass(frozen=True)
class Rotation:
    """A group input the chain reads as rotate_half(x) = Concat(Neg(x[..., h:]), x[..., :h]) along
    the last axis (h half of x's last dim): rotary embeddings as LLaMA-style models export them; or,
    `pairs`, as its interleaved form rotate_pairs(x) = flatten(stack(-x[..., 1::2], x[..., ::2]))
    (GPT-J's rotate_every_two, Cohere's and GLM's rotate_half)."""

    tensor: str  # the Concat's (pairs: the Reshape's) output, which the group reads
    x: str  # the tensor rotated: the fused node's input instead (attribute rotate_half / rotate_pairs)
    nodes: tuple[int, ...]  # the two Slices, the Neg and the Concat (pairs: the Unsqueezes, the Reshape)
    pairs: bool = False


def _const_ints(view: GraphView, name: str) -> list[int] | None:
    t = view.constants.get(name) if name else None
    if t is None:
        return None
    a = numpy_helper.to_array(t)
    return [int(v) for v in a.reshape(-1)] if a.dtype.kind in "iu" else None


def last_axis_slice(view: GraphView, i: int | None, x_rank: int, last: int,
                    step: int = 1) -> tuple[str, int, int] | None:
    """(input, start, end) of node i when it is a Slice of its input's last axis with step `step`,
    constant starts and ends clamped to [0, last]; None otherwise."""
    if i is None or view.nodes[i].op_type != "Slice" or view.nodes[i].domain not in DEFAULT_DOMAINS:
        return None
    n = view.nodes[i]
    if len(n.input) < 4:  # opset 10+: data, starts, ends, axes[, steps]; axes needed
        return None
    starts, ends, axes = (_const_ints(view, x) for x in n.input[1:4])
    steps = _const_ints(view, n.input[4]) if len(n.input) > 4 and n.input[4] else [1]
    if not (starts and ends and axes and steps) or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
        return None
    if axes[0] % x_rank != x_rank - 1 or steps[0] != step:
        return None

    def clamp(v: int) -> int:
        return min(max(v + last if v < 0 else v, 0), last)
    return n.input[0], clamp(starts[0]), clamp(ends[0])


def _unsqueezed_last(view: GraphView, i: int | None, rank: int) -> str | None:
    """The input of node i when it is an Unsqueeze of a rank-`rank` tensor at its new last axis
    (axes [-1] or [rank], as an input from opset 13, else an attribute); None otherwise."""
    if i is None or view.nodes[i].op_type != "Unsqueeze" or view.nodes[i].domain not in DEFAULT_DOMAINS:
        return None
    n = view.nodes[i]
    axes = _const_ints(view, n.input[1]) if len(n.input) > 1 else list(node_attrs(n).get("axes", ()))
    return n.input[0] if axes is not None and len(axes) == 1 and axes[0] % (rank + 1) == rank else None


def pairs_at(view: GraphView, tensor: str, readers: set[int], taken: set[int],
             reserved: dict[int, str]) -> Rotation | None:
    """The interleaved rotation making `tensor`, read only by `readers` (and not a graph output):
    Reshape(Concat(Unsqueeze(Neg(Slice(x, 1, D, step 2)), -1), Unsqueeze(Slice(x, 0, D, step 2), -1)),
    axis -1) to x's shape, x a float tensor with a static, even last dim D, each node read by the
    next alone, none taken or left to ONNX Runtime, the Reshape's shape a constant or one its input's
    shape decides (`shape_input_spec`, a dynamic export's); None otherwise."""
    r = view.producer.get(tensor)
    if r is None or r in taken or r in reserved or tensor in view.graph_outputs:
        return None
    rn = view.nodes[r]
    if rn.op_type != "Reshape" or rn.domain not in DEFAULT_DOMAINS or len(rn.input) < 2:
        return None
    if rn.input[1] not in view.constants and shape_input_spec(view, rn) is None:
        return None  # (a shape computed at run time that the body cannot compute from the Concat's output)
    if not set(view.consumers.get(tensor, ())) <= readers:
        return None
    shape = view.shapes.get(tensor)
    if shape is None or not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    rank, last = len(shape), shape[-1]
    c = view.producer.get(rn.input[0])
    if c is None or view.nodes[c].op_type != "Concat" or view.nodes[c].domain not in DEFAULT_DOMAINS:
        return None
    cn = view.nodes[c]
    if len(cn.input) != 2 or int(node_attrs(cn).get("axis", 0)) % (rank + 1) != rank:
        return None
    u_neg, u_even = view.producer.get(cn.input[0]), view.producer.get(cn.input[1])
    neg_out, even = _unsqueezed_last(view, u_neg, rank), _unsqueezed_last(view, u_even, rank)
    neg = view.producer.get(neg_out) if neg_out else None
    if even is None or neg is None or view.nodes[neg].op_type != "Neg" or view.nodes[neg].domain not in DEFAULT_DOMAINS:
        return None
    odd_slice, even_slice = view.producer.get(view.nodes[neg].input[0]), view.producer.get(even)
    a, b = last_axis_slice(view, odd_slice, rank, last, 2), last_axis_slice(view, even_slice, rank, last, 2)
    if a is None or b is None or a != (b[0], 1, last) or b[1:] != (0, last):
        return None
    x = a[0]
    nodes = (odd_slice, even_slice, neg, u_neg, u_even, c, r)
    only = [(view.nodes[odd_slice].output[0], neg), (neg_out, u_neg), (even, u_even), (cn.input[0], c),
            (cn.input[1], c), (rn.input[0], r)]
    if any(i in taken or i in reserved for i in nodes) or any(
            name in view.graph_outputs or list(view.consumers.get(name, ())) != [k] for name, k in only):
        return None
    if view.shapes.get(x) != shape or view.types.get(x) not in FLOAT_TYPES:
        return None
    return Rotation(tensor, x, nodes, pairs=True)


def rotation_at(view: GraphView, tensor: str, readers: set[int], taken: set[int],
                reserved: dict[int, str]) -> Rotation | None:
    """The rotate_half subgraph making `tensor`, read only by `readers` (and not a graph
    output): Concat(Neg(Slice(x, h, 2h)), Slice(x, 0, h)) over the last axis of x, a float tensor
    with a static, even last dim 2h, each node read by the next alone, none taken or left to ONNX
    Runtime; None otherwise."""
    c = view.producer.get(tensor)
    if c is None or c in taken or c in reserved or tensor in view.graph_outputs:
        return None
    cn = view.nodes[c]
    if cn.op_type != "Concat" or cn.domain not in DEFAULT_DOMAINS or len(cn.input) != 2:
        return None
    if not set(view.consumers.get(tensor, ())) <= readers:
        return None
    shape = view.shapes.get(tensor)  # (its other dims may be symbolic: the library checks them)
    if shape is None or not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    rank, last = len(shape), shape[-1]
    if int(node_attrs(cn).get("axis", 0)) % rank != rank - 1:
        return None
    neg, lo = view.producer.get(cn.input[0]), view.producer.get(cn.input[1])
    if neg is None or view.nodes[neg].op_type != "Neg" or view.nodes[neg].domain not in DEFAULT_DOMAINS:
        return None
    hi = view.producer.get(view.nodes[neg].input[0])
    a, b = last_axis_slice(view, hi, rank, last), last_axis_slice(view, lo, rank, last)
    h = last // 2
    if a is None or b is None or a != (b[0], h, last) or b[1:] != (0, h):
        return None
    x = a[0]
    nodes = (hi, lo, neg, c)
    only = [(view.nodes[hi].output[0], neg), (view.nodes[neg].output[0], c), (view.nodes[lo].output[0], c)]
    if any(i in taken or i in reserved for i in nodes) or any(
            name in view.graph_outputs or list(view.consumers.get(name, ())) != [r] for name, r in only):
        return None
    if view.shapes.get(x) != shape or view.types.get(x) not in FLOAT_TYPES:
        return None
    return Rotation(tensor, x, nodes)


def group_rotations(view: GraphView, group: list[int], outputs: list[str], taken: set[int],
                    reserved: dict[int, str]) -> tuple[Rotation, ...]:
    """The group's inputs that are rotate_half of a tensor of the group's shape (`rotation_at`), or
    its interleaved form (`pairs_at`)."""
    members = set(group)
    shape = view.shapes.get(outputs[0])
    found = []
    for name in dict.fromkeys(x for i in group for x in view.nodes[i].input if x):
        if view.producer.get(name) in members or name in view.constants:
            continue
        r = rotation_at(view, name, members, taken, reserved) or pairs_at(view, name, members, taken, reserved)
        if r is not None and same_shape(view.shapes.get(r.x), shape):
            found.append(r)
    return tuple(found)


@dataclass(frozen=True)
class Transposed:
    """A group input (or a rotated one's x) that a Transpose keeping the last axis makes: the chain
    reads the Transpose's input through the permutation instead (attribute `transpose`, mode
    strided), and the Transpose's copy goes (LLaMA-style models' Q and K before their rotary
    embeddings: Transpose(Reshape(Q), [0, 2, 1, 3]))."""

    tensor: str  # the Transpose's output, which the group (or a rotation) reads
    x: str  # its input: the fused node's input instead
    perm: tuple[int, ...]
    node: int


def group_transposes(view: GraphView, group: list[int], rotations: tuple[Rotation, ...], outputs: list[str],
                     taken: set[int], reserved: dict[int, str],
                     partial: Partial | None = None) -> tuple[Transposed, ...]:
    """The group's inputs (and its rotations' x, a partial chain's x) that a Transpose makes of a
    tensor of the group's rank, its permutation keeping the last axis (reads stay contiguous along
    it), its output of the group's shape, read only inside the group, its rotations and its
    partial's Slices, and the Transpose not taken or left to ONNX Runtime."""
    members = set(group) | {i for r in rotations for i in r.nodes} | set(partial.nodes if partial else ())
    shape = view.shapes.get(outputs[0])
    if not shape:
        return ()
    rank = len(shape)
    names = [x for i in group for x in view.nodes[i].input if x and view.producer.get(x) not in members]
    found = []
    for name in dict.fromkeys([*names, *(r.x for r in rotations), *((partial.x,) if partial else ())]):
        t = view.producer.get(name)
        if t is None or t in taken or t in reserved or name in view.constants or name in view.graph_outputs:
            continue
        n = view.nodes[t]
        if n.op_type != "Transpose" or n.domain not in DEFAULT_DOMAINS:
            continue
        perm = tuple(int(a) for a in node_attrs(n).get("perm", ()))
        if len(perm) != rank or perm[-1] != rank - 1 or perm == tuple(range(rank)):
            continue
        if not same_shape(view.shapes.get(name), shape) or not set(view.consumers.get(name, ())) <= members:
            continue
        found.append(Transposed(name, n.input[0], perm, t))
    return tuple(found)


@dataclass(frozen=True)
class ChainInfo:
    """What a PointwiseChain's kernel needs besides its program and modes (FusedNode.params):
    the output's last dim where the kernel compiles it in (else 0) and the node's `partial`
    (the columns it computes, the input it copies beyond them; () for none)."""

    last_dim: int = 0
    partial: tuple[int, ...] = ()


@dataclass(frozen=True)
class Partial:
    """A chain over the first `width` columns of a tensor x whose result is put back in front of
    x's other columns: Concat(chain(Slice(x, 0, r)), Slice(x, r, D)) over the last axis, the
    partial rotary embeddings of GPT-NeoX, Phi and StableLM (rotary_pct, partial_rotary_factor).
    The fused node computes over x's shape: the chain where the column is below r (its inputs of
    r columns read there, those of x's shape read at the same element of x), x's element beyond
    (attribute `partial`); the Slices' and the Concat's copies go. The columns beyond may add a
    constant, Concat(chain(...), Add(Slice(x, r, D), c)): a projection's bias below the head split
    (`onnxfuse.headbias`); the node then reads c over all D columns (zeros below r) as one more
    input and adds it beyond r."""

    x: str  # the tensor sliced: the fused node reads it instead of its first columns
    narrow: str  # Slice(x, 0, r): the chain reads it (plain, or rotated)
    output: str  # the chain's result, of r columns
    concat_output: str  # the fused node's output, of x's shape
    width: int  # r
    nodes: tuple[int, ...]  # the two Slices and the Concat (and the Add of c)
    addend: str = ""  # c, a constant the columns beyond r add; "" for none


def partial_at(view: GraphView, group: list[int], outputs: list[str], rotations: tuple[Rotation, ...],
               taken: set[int], reserved: dict[int, str]) -> Partial | None:
    """The group's `Partial` where its one output is the first input of a Concat over the last
    axis whose second is Slice(x, r, D) of a float tensor x of static, even last dim D > r, and every
    input of the group's shape (rotated too) is Slice(x, 0, r), read plain at least once; the
    Slices and the Concat not taken or left to ONNX Runtime, each Slice read there alone (the
    first inside the group); None otherwise."""
    if len(outputs) != 1 or outputs[0] in view.graph_outputs:
        return None
    out, shape = outputs[0], view.shapes.get(outputs[0])
    readers = list(view.consumers.get(out, ()))
    if not shape or not isinstance(shape[-1], int) or len(readers) != 1:
        return None
    c = readers[0]
    cn, rank, r = view.nodes[c], len(shape), shape[-1]
    if cn.op_type != "Concat" or cn.domain not in DEFAULT_DOMAINS or list(cn.input[:1]) != [out] or len(cn.input) != 2:
        return None
    if int(node_attrs(cn).get("axis", 0)) % rank != rank - 1 or c in taken or c in reserved:
        return None
    rest = cn.input[1]
    rs = view.producer.get(rest)
    add, addend = _added_constant(view, rs, c)
    if add is not None:  # Add(Slice(x, r, D), c)
        rest = next(t for t in view.nodes[add].input if t != addend)
        rs = view.producer.get(rest)
    x = view.nodes[rs].input[0] if rs is not None and view.nodes[rs].input else None
    xs = view.shapes.get(x) if x else None
    if xs is None or len(xs) != rank or not isinstance(xs[-1], int) or xs[-1] <= r or r < 2 or xs[-1] % 2:
        return None  # (D even: a pair rotation's read beyond r stays in its row)
    d = xs[-1]
    if last_axis_slice(view, rs, rank, d) != (x, r, d) or not view.only_reader(rest, c if add is None else add):
        return None
    if addend and not _fits_beyond(view.shapes.get(addend), xs, d - r):
        return None
    if view.types.get(x) not in FLOAT_TYPES or not same_shape(view.shapes.get(cn.output[0]), xs):
        return None
    members = set(group) | {i for rot in rotations for i in rot.nodes}
    rotated = {rot.tensor: rot.x for rot in rotations}
    reads = [(rotated.get(name, name), name in rotated)
             for name in dict.fromkeys(n for i in group for n in view.nodes[i].input if n)
             if view.producer.get(name) not in set(group) and name not in view.constants]
    narrow = {name for name, _ in reads if same_shape(view.shapes.get(name), shape)}
    if len(narrow) != 1 or not any(name in narrow and not was_rotated for name, was_rotated in reads):
        return None
    (name,) = narrow
    ns = view.producer.get(name)
    if last_axis_slice(view, ns, rank, d) != (x, 0, r) or name in view.graph_outputs:
        return None
    if not set(view.consumers.get(name, ())) <= members:
        return None
    nodes = (ns, rs, c) + ((add,) if add is not None else ())
    if any(i in taken or i in reserved for i in nodes) or rest in view.graph_outputs:
        return None
    return Partial(x, name, out, cn.output[0], r, nodes, addend)


def _widened_addend(view: GraphView, part: Partial, node_name: str, names: set[str],
                    graph: GraphProto) -> tuple[str, tuple[int, ...]]:
    """The node's input for a partial chain's constant c added beyond r: c over all D columns,
    zeros below r (its last dim of 1 repeated), added to `graph`; its name and shape. The
    function body reads c itself."""
    c = numpy_helper.to_array(view.constants[part.addend])
    d = view.shapes[part.x][-1]
    c = np.broadcast_to(c, c.shape[:-1] + (d - part.width,))
    wide = np.concatenate([np.zeros(c.shape[:-1] + (part.width,), c.dtype), c], axis=-1)
    name = unique_name(f"{node_name}.beyond", names)
    graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(wide), name))
    return name, wide.shape


def _added_constant(view: GraphView, i: int | None, reader: int) -> tuple[int | None, str]:
    """(i, c) when node i is an Add of a float constant c and a computed tensor, its output read by
    `reader` alone and not a graph output; (None, "") otherwise."""
    if not view.is_op(i, "Add") or len(view.nodes[i].input) != 2:
        return None, ""
    n = view.nodes[i]
    consts = [x for x in n.input if x in view.constants]
    if len(consts) != 1 or view.types.get(consts[0]) not in FLOAT_TYPES:
        return None, ""
    return (i, consts[0]) if view.only_reader(n.output[0], reader) else (None, "")


def _fits_beyond(shape, x_shape, width: int) -> bool:
    """Whether a constant of `shape` broadcasts over x's shape with `width` columns without
    widening it: as many dims or fewer, each 1 or x's (its last `width` or 1)."""
    if shape is None or not 0 < len(shape) <= len(x_shape) or shape[-1] not in (1, width):
        return False
    return all(a == 1 or a == b for a, b in zip(shape[-2::-1], x_shape[-2::-1], strict=False))


@dataclass(frozen=True)
class ChainReads:
    """What a chain's match reads other than as the graph's tensors (Match.params): inputs
    rotated (rotate_half), inputs read through a Transpose, the columns it computes (partial)."""

    rotations: tuple[Rotation, ...] = ()
    transposes: tuple[Transposed, ...] = ()
    partial: Partial | None = None


def match_elementwise_groups(view: GraphView, pattern: Pattern, taken: set[int],
                             accepted: Accepted | None = None, reserved: dict[int, str] | None = None) -> MatchResult:
    """Groups of this pattern among the nodes not in `taken`; `accepted` holds the groups
    already matched (by patterns before this one) and gets this pattern's groups added.
    Nodes in `reserved` (node -> reason) join no group: they are counted under that reason;
    except those of the reasons `reserved.offered` (`onnxfuse.match.Reserved`), which a group
    takes only whole: every node of that fusion next to it, or none."""
    result = MatchResult()
    accepted = Accepted(len(view.nodes)) if accepted is None else accepted
    reserved = reserved or {}
    offered = offered_reasons(reserved)
    candidates: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type not in pattern.match.ops or n.domain not in ("", "ai.onnx"):
            continue
        if i in reserved and reserved[i] not in offered:
            result.rejected[reserved[i]] += 1
            continue
        reason = check_node(view, i, pattern)
        if reason is None:
            candidates.add(i)
        else:
            result.rejected[reason] += 1
    work = [part for comp in components(view, candidates) for level_set in exit_levels(view, comp)
            for part in components(view, level_set)]
    while work:
        group = work.pop()
        after = reentering(view, group, accepted)
        if after:
            work += components(view, set(group) - after) + components(view, after)
            continue
        outputs = exposed_outputs(view, group)
        if not outputs:
            result.rejected["result is never used"] += len(group)
            continue
        split = _split_offered(view, group, reserved, offered, pattern.match.ops)
        if split:
            for i in split:
                result.rejected[reserved[i]] += 1
            work += components(view, set(group) - split)
            continue
        misfits = _shape_misfits(view, group, outputs)
        if misfits:
            result.rejected["output shape differs from the group's"] += len(misfits)
            work += components(view, set(group) - misfits)
            continue
        if len(group) < pattern.match.min_nodes:
            result.rejected["no elementwise neighbour to fuse with"] += len(group)
            continue
        if not _has_tensor_input(view, group):
            result.rejected["computes only on constants"] += len(group)
            continue
        rotations = group_rotations(view, group, outputs, taken, reserved)
        partial = partial_at(view, group, outputs, rotations, taken, reserved)
        if partial is not None:
            outputs = [partial.concat_output]
        transposes = group_transposes(view, group, rotations, outputs, taken, reserved, partial)
        nodes = sorted({*group, *(i for r in rotations for i in r.nodes), *(t.node for t in transposes),
                        *(partial.nodes if partial else ())})
        accepted.add(nodes)
        reads = ChainReads(rotations, transposes, partial) if rotations or transposes or partial else None
        result.matches.append(Match(pattern, tuple(nodes), tuple(outputs), params=reads,
                                    measured_only=any(reserved.get(i) in offered for i in group)))
    result.matches.sort(key=lambda m: m.nodes)
    return result


def _split_offered(view: GraphView, group: list[int], reserved: dict[int, str], offered: frozenset[str],
                   ops: frozenset[str]) -> set[int]:
    """The group's nodes of an offered ONNX Runtime fusion that it holds only in part (a
    producer or reader of one of them outside the group, of the pattern's `ops`, belongs to the
    same fusion; `ort_fusions` also gives a fusion the shape arithmetic ORT folds beside it,
    which no group would hold): taking them would leave ORT the rest unfused."""
    members = set(group)
    out: set[int] = set()
    for i in group:
        r = reserved.get(i)
        if r is None or r not in offered:
            continue
        n = view.nodes[i]
        near = [view.producer.get(x) for x in n.input if x] + [c for o in n.output for c in view.consumers.get(o, ())]
        if any(j is not None and j not in members and reserved.get(j) == r and view.nodes[j].op_type in ops
               for j in near):
            out |= {k for k in group if reserved.get(k) == r}
    return out


class Pointwise(Kind):
    """A match is a maximal connected set of elementwise nodes (producer-consumer edges)
    that is convex (no path leaves the group and comes back, so one node can replace it)
    and shape-uniform (every tensor the group exposes, read outside it or a graph output,
    has the same shape: the shape the kernel iterates over). Nodes that could have joined
    but did not are reported with the reason."""

    name = "pointwise"
    op_type = "PointwiseChain"
    match_kind = "elementwise_group"
    params = frozenset({"min_nodes"})
    layout_free = True  # an elementwise program computes the same on channels-last tensors
    # chains offered against BiasGelu / FastGelu: a block size decides (GPT-2-small b8 fp16 on
    # the H200: the twenty-second session's chains 84.5 µs for 12 in the model, 95.4 before)
    search_offered = True

    def parse(self, m: Fields, ops: frozenset[str], dtypes: frozenset[str]) -> PointwiseParams:
        min_nodes = m.get("min_nodes", int, 2)
        if min_nodes < 1:
            m.fail("match.min_nodes", "must be at least 1")
        return PointwiseParams(ops, dtypes, min_nodes)

    def match(self, view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
              reserved: dict[int, str]) -> MatchResult:
        return match_elementwise_groups(view, pattern, taken, accepted, reserved)

    def lower(self, view: GraphView, match: Match, node_name: str, names: set[str], graph: GraphProto) -> Lowering:
        """Inputs: the group's boundary tensors in order of first use; outputs: the tensors
        it exposes. The function body is the group's nodes."""
        reads = match.params or ChainReads()
        rotated = {r.tensor: r for r in reads.rotations}
        transposed = {t.tensor: t for t in reads.transposes}
        part = reads.partial
        absorbed = ({i for r in reads.rotations for i in r.nodes} | {t.node for t in reads.transposes}
                    | set(part.nodes if part else ()))
        chain_outputs = (part.output,) if part else match.outputs
        program, inputs, folded = lower_group(view, tuple(i for i in match.nodes if i not in absorbed), chain_outputs)
        shape = view.shapes[match.outputs[0]]
        rank = len(shape)
        # per input: 0 read as it is, 1 rotate_half, 2 rotate_pairs (the interleaved form)
        flags = [(2 if rotated[x].pairs else 1) if x in rotated else 0 for x in inputs]
        inputs = [rotated[x].x if x in rotated else x for x in inputs]  # rotate_half(x): read x
        if part:  # Slice(x, 0, r): read x (at the same element; beyond r the node copies x)
            inputs = [part.x if x == part.narrow else x for x in inputs]
        widened = _widened_addend(view, part, node_name, names, graph) if part and part.addend else None
        if widened is not None:  # the constant beyond r, read over all D columns (the program not)
            program = with_input(program, FLOAT_TYPES[view.types[part.addend]])
            inputs, flags = [*inputs, widened[0]], [*flags, 0]
        perms = [transposed[x].perm if x in transposed else tuple(range(rank)) for x in inputs]

        def mode(x: str, rotated_read: int) -> str:
            if rotated_read:
                kind = "rotate_pairs" if rotated_read == 2 else "rotate_half"
                return kind + ("_strided" if x in transposed else "")
            if widened is not None and x == widened[0]:
                return "full" if same_shape(widened[1], shape) else "strided"
            if part and x != part.x and (view.shapes.get(x) or (1,))[-1] == part.width:
                return "narrow"  # (r columns, read where the column is below r)
            return "strided" if x in transposed else input_mode(view, x, shape)
        modes = tuple(mode(x, f) for x, f in zip(inputs, flags, strict=True))
        inputs = [transposed[x].x if x in transposed else x for x in inputs]  # Transpose(x): read x
        static_last = bool(shape) and isinstance(shape[-1], int)
        last = shape[-1] if static_last and (part or any(m != "full" and m != "scalar" for m in modes)) else 0
        # the row variants' blocks follow the largest power of two dividing the last dim
        # (`row_block`, `pointwise_candidates`): it names the kernel too
        row = pow2_factor(last) if "strided" in modes and not part else 0
        key = f"row={row}" if row >= ROW_BLOCK_MIN else ""
        if any(flags):  # the rotation's half is compiled in
            key += f" rotate={flags} last={last}"
        attrs: dict = {}
        if 1 in flags:
            attrs["rotate_half"] = [int(f == 1) for f in flags]
        if 2 in flags:
            attrs["rotate_pairs"] = [int(f == 2) for f in flags]
        if transposed:  # (the kernel reads them by strides the launcher derives from the perms)
            attrs["transpose"] = [a for p in perms for a in p]
        if transposed or part:
            key += f" modes={list(modes)}"
        partial: tuple[int, ...] = ()
        if part:  # the columns computed and the input copied beyond them are compiled in
            x_read = transposed[part.x].x if part.x in transposed else part.x
            partial = (part.width, next(k for k, x in enumerate(inputs)
                                        if x == x_read and not flags[k] and modes[k] in ("full", "strided")))
            if widened is not None:  # x + c beyond r, c the node's last input
                partial += (len(inputs) - 1,)
            attrs["partial"] = list(partial)
            key += f" partial={list(partial)} last={last}"
        return Lowering(program, folded, inputs, [view.nodes[i] for i in match.nodes], attrs, key, rank, modes,
                        {"params": ChainInfo(last, partial)})

    def spec(self, model: ModelProto, f: FusedNode, precision: str, weight_dims: dict | None) -> KernelSpec:
        info = f.params or ChainInfo()
        return KernelSpec(f.program, f.kernel_name, f.rank, f.input_modes, f.source_nodes, info.last_dim, info.partial)

    def variants(self, spec: KernelSpec) -> tuple[Variant, ...]:
        return choose_variants(spec)

    def candidates(self, spec: KernelSpec) -> list[tuple[str, tuple[Variant, ...]]]:
        return pointwise_candidates(spec)

    def generate(self, spec: KernelSpec, variant: Variant) -> KernelSource:
        return generate(spec.program, spec.name, spec.rank, spec.input_modes, list(spec.source_nodes), variant,
                        spec.last_dim, spec.partial)

    def kernel_meta(self, spec: KernelSpec, variants: tuple, binaries: list[dict]) -> dict:
        return {
            "version": META_VERSION,
            "name": spec.name,
            "rank": spec.rank,
            "input_modes": list(spec.input_modes),
            **({"rotate_last": spec.last_dim} if set(spec.input_modes) & set(ROTATED_MODES) else {}),
            **({"partial": list(spec.partial), "last_dim": spec.last_dim} if spec.partial else {}),
            "variants": [{"requires": v.requires(), "block": v.block} for v in variants],
            "binaries": binaries,
        }

    def evaluate(self, node: NodeProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        program = Program.from_text(attrs["program"].decode())
        halves, pairs = list(attrs.get("rotate_half", ())), list(attrs.get("rotate_pairs", ()))
        flat = list(attrs.get("transpose", ()))
        rank = len(flat) // max(len(inputs), 1)
        perms = [tuple(flat[k * rank:(k + 1) * rank]) for k in range(len(inputs))] if flat else []
        # Transpose(x, perm) first (an identity one: x as it is, of any rank), then cut, then rotated
        inputs = [np.transpose(x, perms[k]) if perms and perms[k] != tuple(range(rank)) else x
                  for k, x in enumerate(inputs)]
        partial = list(attrs.get("partial", ()))
        if partial:  # the program over the first r columns (of the inputs as wide as x), x (+ c) beyond
            r, x = partial[0], inputs[partial[1]]
            beyond = x[..., r:]
            if len(partial) > 2:  # in float32, rounded once to x's type as the kernel stores it
                beyond = (beyond.astype(np.float32) + inputs[partial[2]][..., r:]).astype(x.dtype)
            inputs = [v[..., :r] if v.ndim and v.shape[-1] == x.shape[-1] else v for v in inputs]
        inputs = [rotate_half(x) if k < len(halves) and halves[k] else rotate_pairs(x) if k < len(pairs) and pairs[k]
                  else x for k, x in enumerate(inputs)]
        ys = evaluate(program, inputs)
        if partial:
            ys = [np.concatenate([np.broadcast_to(y, x[..., :r].shape), beyond.astype(y.dtype)], axis=-1)
                  for y in ys]
        return ys


def rotate_half(x: np.ndarray) -> np.ndarray:
    """Concat(-x[..., h:], x[..., :h]) along the last axis, h half of it (docs/format.md,
    PointwiseChain's rotate_half)."""
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rotate_pairs(x: np.ndarray) -> np.ndarray:
    """The interleaved rotation: each pair (x[2i], x[2i+1]) along the last axis becomes
    (-x[2i+1], x[2i]) (docs/format.md, PointwiseChain's rotate_pairs)."""
    y = np.empty_like(x)
    y[..., 0::2] = -x[..., 1::2]
    y[..., 1::2] = x[..., 0::2]
    return y
