"""Find groups of nodes that patterns fuse: `find_matches` runs each pattern's kind matcher
(`onnxfuse.kinds.base.Kind.match`) in priority order, a node joining at most one match; and
the helpers those matchers share: which nodes may join a pointwise group (`check_node`),
which inputs become literals, and the pointwise neighbourhood of an anchor node (the Conv of
a conv epilogue, the MaxPool of a pool prologue): `grow_epilogue` and `single_result` after
it, `grow_prologue` and `prologue_inputs` before it, `match_anchored` over every anchor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

import numpy as np

from onnxfuse.graph import GraphView, Shape, _outer_refs
from onnxfuse.groups import Accepted, exposed_outputs, reentering
from onnxfuse.kinds.base import Match, MatchResult, Pattern, reason_rank
from onnxfuse.ops import DTYPE_NAMES, RULES, node_attrs

DTYPE_IDS = {"float32": 1, "float16": 10, "bfloat16": 16}


def literal_inputs(view: GraphView, node_idx: int) -> dict[int, float]:
    """Inputs of an elementwise node that become float literals: one-element float
    constants that do not raise the rank of the node's output."""
    n = view.nodes[node_idx]
    out_rank = view.rank(n.output[0])
    lits = {}
    for k, name in enumerate(n.input):
        v = view.scalar_constant(name) if name else None
        if v is not None and out_rank is not None and len(view.constants[name].dims) <= out_rank:
            others = [view.rank(x) for j, x in enumerate(n.input) if j != k and x]
            if any(r is not None and r == out_rank for r in others):
                lits[k] = v
    return lits


def check_node(view: GraphView, idx: int, pattern: Pattern) -> str | None:
    """Why node idx cannot join a group of this pattern, or None if it can."""
    n = view.nodes[idx]
    m = pattern.match
    if n.domain not in ("", "ai.onnx") or n.op_type not in m.ops:
        return "not elementwise"
    rule = RULES[n.op_type]
    allowed = {DTYPE_IDS[d] for d in m.dtypes}
    attrs = node_attrs(n)
    if rule.check is not None:
        reason = rule.check(n, attrs)
        if reason:
            return reason
    for k in rule.const_inputs:
        if k < len(n.input) and n.input[k] and view.scalar_constant(n.input[k]) is None:
            return f"{n.op_type} input {k} is not a constant scalar"
    for k, name in enumerate(n.input):
        if not name or k in rule.const_inputs:
            continue
        t = view.types.get(name)
        if k in rule.bool_inputs:
            if t != 9:
                return "unknown dtype" if t is None else f"{DTYPE_NAMES.get(t, t)} condition"
        elif t not in allowed:
            return dtype_reason(t)
    for name in n.output:
        if name:
            t = view.types.get(name)
            if t not in allowed:
                return dtype_reason(t)
            if view.shapes.get(name) is None:
                return "unknown shape"
    if len([o for o in n.output if o]) != 1:
        return "more than one output"
    return None


def dtype_reason(t: int | None) -> str:
    if t is None:
        return "unknown dtype"
    name = DTYPE_NAMES.get(t)
    if name is None:
        return "integer dtype" if t in (2, 3, 4, 5, 6, 7, 12, 13) else "unsupported dtype"
    return f"{name} dtype"


def live_nodes(view: GraphView) -> set[int]:
    """Nodes that a graph output depends on (directly, or through subgraphs that read them)."""
    live: set[int] = set()
    stack = [view.producer[o] for o in view.graph_outputs if o in view.producer]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        n = view.nodes[i]
        stack += [view.producer[x] for x in list(n.input) + sorted(_outer_refs(n)) if x in view.producer]
    return live


class Reserved(dict[int, str]):
    """Nodes ONNX Runtime's own fusions take (node -> the report's reason, `onnxfuse.ort_fusions`),
    and `offered`: the reasons whose nodes the matching kind may take all the same, because
    tuning times its fused node against ORT's fusion of them (`onnxfuse.pipeline.TIMED_AGAINST_ORT`:
    a pointwise chain its GELU fusions, whole or not at all, `onnxfuse.kinds.pointwise`; FusedRows
    its layer normalizations; the gemm kind is offered the chains' reasons, which it leaves to them)."""

    def __init__(self, reasons: dict[int, str] | None = None, offered: frozenset[str] = frozenset()):
        super().__init__(reasons or {})
        self.offered = offered


def offered_reasons(reserved: dict[int, str]) -> frozenset[str]:
    """`reserved.offered` for a Reserved, else none."""
    return reserved.offered if isinstance(reserved, Reserved) else frozenset()


def find_matches(view: GraphView, patterns: list[Pattern], reserved: dict[int, str] | None = None,
                 offered: Mapping[str, frozenset[str]] | None = None) -> MatchResult:
    """Apply patterns in priority order, each through its kind's matcher; a node joins at
    most one match. Nodes in `reserved` (node -> reason: those ONNX Runtime's own fusions
    take, `onnxfuse.ort_fusions`) join no elementwise group, unless their reason is one of
    those `offered` to the pattern's kind (kind name -> reasons; `Reserved`); conv epilogues
    and pool prologues may still take them.

    Dead nodes (no graph output depends on them) never join: a group computes over the
    broadcast shape of all its inputs, and a dead node could read a larger input than the
    tensors the group exposes. An anchor node (a Conv, a MaxPool) that no pattern fuses is
    reported with the most specific reason any pattern that looked at it gave (`reason_rank`:
    an attention's "batch dims differ" over the rows kind's "nothing to fuse with it", that over
    "no MatMul before the Softmax"), the later pattern's of two equally specific ones."""
    total = MatchResult()
    live = live_nodes(view)
    ops = {op for p in patterns for op in p.match.fused_ops}
    taken: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i not in live:
            taken.add(i)
            if n.op_type in ops and n.domain in ("", "ai.onnx"):
                total.rejected["result is never used"] += 1
    accepted = Accepted(len(view.nodes))
    anchors: dict[int, str] = {}  # anchor node -> why it did not fuse
    for p in patterns:
        r = p.kind.match(view, p, taken, accepted, Reserved(reserved, (offered or {}).get(p.kind.name, frozenset())))
        for m in r.matches:
            taken.update(m.nodes)
        total.matches += r.matches
        total.rejected.update(r.rejected)
        total.notes.update(r.notes)
        for i, reason in r.anchors.items():
            if i not in anchors or reason_rank(reason) >= reason_rank(anchors[i]):
                anchors[i] = reason
    total.rejected.update(reason for i, reason in anchors.items() if i not in taken)
    total.matches.sort(key=lambda m: m.nodes[0])
    return total


# ---------------------------------------------------------------------------------------
# The pointwise neighbourhood of an anchor node (conv epilogues, pool prologues)
# ---------------------------------------------------------------------------------------

def broadcasts_to(shape: Shape | None, target: Shape) -> bool:
    """True when a tensor of `shape` is known to broadcast to `target` without enlarging
    it (numpy rules): each of its dims is 1 or known to equal target's."""
    if shape is None or len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape):]
    return all(d == 1 or (d is not None and d == t) for d, t in zip(shape, tail, strict=True))


def operands(view: GraphView, idx: int):
    """(k, name) of node idx's inputs that become program operands (not constants that the
    program folds: Clip's bounds, one-element literals)."""
    n = view.nodes[idx]
    rule = RULES[n.op_type]
    lits = literal_inputs(view, idx)
    for k, name in enumerate(n.input):
        if not name or k in rule.const_inputs or k in lits:
            continue
        if rule.tensor_inputs is not None and k not in rule.tensor_inputs:
            continue
        yield k, name


def pointwise_candidate(view: GraphView, idx: int, pattern: Pattern, taken: set[int]) -> bool:
    n = view.nodes[idx]
    return (idx not in taken and n.domain in ("", "ai.onnx") and n.op_type in pattern.match.ops
            and check_node(view, idx, pattern) is None)


def joins_epilogue(view: GraphView, idx: int, inside: set[str], target: Shape) -> bool:
    """Node idx computes over `target` when every input from outside the group broadcasts to it."""
    return all(name in inside or broadcasts_to(view.shapes.get(name), target) for _, name in operands(view, idx))


def readers_outside(view: GraphView, name: str, members: set[int]) -> bool:
    return name in view.graph_outputs or any(c not in members for c in view.consumers.get(name, ()))


# An anchor's epilogue grows to at most this many nodes, nearest first. Without a bound, a
# residual stream of same-shaped Adds lets every anchor's epilogue reach the end of the graph
# and `single_result` shrink it back one node at a time: matching GEMMs on optimizer_speed.py's
# residual graphs took 0.40 / 1.17 / 4.97 s at 1k / 2k / 4k nodes (quadratic; about 13 min at
# 50k). Exported epilogues are far smaller (an erf-GELU after a bias is 6 nodes, BatchNorm
# unfolded plus SiLU and a residual add under 10).
MAX_EPILOGUE_NODES = 64


def grow_epilogue(view: GraphView, ci: int, target: Shape, pattern: Pattern, taken: set[int]) -> set[int]:
    """The pointwise nodes reachable from the anchor's output through pointwise nodes that
    compute over its shape, breadth first, at most MAX_EPILOGUE_NODES of them."""
    inside = {view.nodes[ci].output[0]}
    group: set[int] = set()
    work = deque([view.nodes[ci].output[0]])
    while work and len(group) < MAX_EPILOGUE_NODES:
        t = work.popleft()
        for c in view.consumers.get(t, ()):
            if c in group or not pointwise_candidate(view, c, pattern, taken):
                continue
            if joins_epilogue(view, c, inside, target):
                group.add(c)
                out = view.nodes[c].output[0]
                inside.add(out)
                work.append(out)
                if len(group) == MAX_EPILOGUE_NODES:
                    break
    return group


def single_result(view: GraphView, anchor: int, first: str, epilogue: set[int],
                   accepted: Accepted) -> tuple[set[int], str | None]:
    """Shrink the epilogue until the group (anchor + epilogue) is convex and exactly one
    tensor other than `first` leaves it: drop the last node while several leave. Returns
    the epilogue and that tensor (None when the epilogue ends up empty)."""
    epilogue = set(epilogue)
    while epilogue:
        group = sorted(epilogue | {anchor})
        tainted = reentering(view, group, accepted)
        if tainted:
            epilogue -= tainted
            continue
        outs = exposed_outputs(view, group)
        if len(outs) == 1 and outs[0] != first:
            return epilogue, outs[0]
        epilogue.discard(max(epilogue))
    return epilogue, None


def grow_prologue(view: GraphView, start: int, pattern: Pattern, taken: set[int]) -> set[int]:
    """`start` and every pointwise node before it (through producers) with a 4-D output."""
    group = {start}
    work = [start]
    while work:
        i = work.pop()
        for _, name in operands(view, i):
            q = view.producer.get(name)
            if q is None or q in group or not pointwise_candidate(view, q, pattern, taken):
                continue
            if view.rank(view.nodes[q].output[0]) == 4:
                group.add(q)
                work.append(q)
    return group


def prologue_inputs(view: GraphView, group: list[int]) -> list[str]:
    """The group's boundary operands in order of first use (the program's input order)."""
    members = set(group)
    seen: dict[str, None] = {}
    for i in group:
        for _, name in operands(view, i):
            if view.producer.get(name) not in members:
                seen.setdefault(name)
    return list(seen)


def numel(shape) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))


def match_anchored(view: GraphView, pattern: Pattern, taken: set[int], accepted: Accepted,
                   anchor_ops: str | frozenset[str],
                   match_one: Callable[[GraphView, int, Pattern, set[int], Accepted], Match | str],
                   note: Callable[[Match], str | tuple[str, ...]] | None = None) -> MatchResult:
    """The matches `match_one` finds anchored at each node of an op type in `anchor_ops` (a Conv,
    a MaxPool, a MatMul or Gemm, a Softmax) not taken yet, in topological order; adds their nodes
    to `taken` and `accepted`. The result's `anchors` say why each other such node did not match;
    its `notes` count a match's nodes under each note `note(match)` gives (one, or a tuple)."""
    ops = frozenset({anchor_ops}) if isinstance(anchor_ops, str) else anchor_ops
    result = MatchResult()
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type not in ops or n.domain not in ("", "ai.onnx"):
            continue
        found = match_one(view, i, pattern, taken, accepted)
        if isinstance(found, str):
            result.anchors[i] = found
            continue
        result.matches.append(found)
        said = note(found) if note is not None else ()
        for text in (said,) if isinstance(said, str) else said:
            if text:
                result.notes[text] += len(found.nodes)
        taken.update(found.nodes)
        accepted.add(list(found.nodes))
    return result
