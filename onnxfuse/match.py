"""Find groups of nodes that a pattern fuses. Reads only a pattern's `match` part.

For `elementwise_group` patterns a match is a maximal connected set of elementwise nodes
(producer-consumer edges) that is
- convex: no path leaves the group and comes back, so one node can replace it;
- shape-uniform: every tensor the group exposes (read outside it, or a graph output) has the
  same shape, the shape the fused kernel iterates over.
Nodes that could have joined but did not are reported with the reason.

For `conv_epilogue` patterns a match is a 2-D Conv, the largest group of pointwise nodes
after it with exactly one result (the conv output itself read only inside the group), and
for pool "tiling" the MaxPool that alone reads that result when its windows tile it. For
`pool_prologue` patterns a match is a 2-D MaxPool and the pointwise group whose one result
only it reads. Each Conv or MaxPool that does not fuse is reported with the reason.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from onnxfuse.graph import GraphView, Shape, _outer_refs, same_shape
from onnxfuse.layers import ConvAttrs, PoolAttrs, conv_from_node, pool_from_node
from onnxfuse.ops import DTYPE_NAMES, RULES, node_attrs
from onnxfuse.pattern import ConvEpilogueMatch, Pattern, PoolPrologueMatch, RowReductionMatch

DTYPE_IDS = {"float32": 1, "float16": 10, "bfloat16": 16}


@dataclass(frozen=True)
class Match:
    pattern: Pattern
    nodes: tuple[int, ...]  # node indices, topological order
    outputs: tuple[str, ...]  # tensors the group exposes, in production order
    # conv_epilogue and pool_prologue matches only:
    conv: int | None = None  # the Conv node
    pool: int | None = None  # the MaxPool node, if one is fused
    pointwise: tuple[int, ...] = ()  # the epilogue / prologue nodes, topological order
    conv_attrs: ConvAttrs | None = None
    pool_attrs: PoolAttrs | None = None
    first_input: str = ""  # program input %0: the conv output, or the prologue's X
    result: str = ""  # the program's one output (what the MaxPool reads, if one is fused)

    @property
    def kind(self) -> str:
        """"pointwise", "conv" or "maxpool": the kind of kernel the match becomes."""
        if self.conv is not None:
            return "conv"
        return "pointwise" if self.pool is None else "maxpool"


@dataclass
class MatchResult:
    matches: list[Match] = field(default_factory=list)
    # reason -> number of nodes it kept out of a fusion
    rejected: Counter = field(default_factory=Counter)
    # what a fusion decided that the report says besides (the rule of ONNX Runtime's fusions that
    # applied to a row reduction): note -> number of fused nodes
    notes: Counter = field(default_factory=Counter)


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
            return _dtype_reason(t)
    for name in n.output:
        if name:
            t = view.types.get(name)
            if t not in allowed:
                return _dtype_reason(t)
            if view.shapes.get(name) is None:
                return "unknown shape"
    if len([o for o in n.output if o]) != 1:
        return "more than one output"
    return None


def _dtype_reason(t: int | None) -> str:
    if t is None:
        return "unknown dtype"
    name = DTYPE_NAMES.get(t)
    if name is None:
        return "integer dtype" if t in (2, 3, 4, 5, 6, 7, 12, 13) else "unsupported dtype"
    return f"{name} dtype"


class _UnionFind:
    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _components(view: GraphView, members: set[int]) -> list[list[int]]:
    """Connected components of members over producer-consumer edges, each sorted."""
    uf = _UnionFind()
    for i in members:
        uf.find(i)
        for name in view.nodes[i].input:
            p = view.producer.get(name)
            if p is not None and p in members:
                uf.union(p, i)
    groups: dict[int, list[int]] = {}
    for i in sorted(members):
        groups.setdefault(uf.find(i), []).append(i)
    return list(groups.values())


def _exit_levels(view: GraphView, group: list[int]) -> list[set[int]]:
    """Split a group into convex parts in one pass: a member's level is the largest number
    of times a path from the group's members to it leaves the group. Levels never decrease
    along an edge and rise when a path leaves, so no path leaves a level set and comes back.
    Visits only nodes between the group's first and last member (in topological order)."""
    members = set(group)
    hi = group[-1]
    level = dict.fromkeys(group, 0)
    heap = list(group)
    heapq.heapify(heap)
    queued = set(group)
    while heap:
        v = heapq.heappop(heap)
        lv, leaving = level[v], v in members
        for o in view.nodes[v].output:
            for c in view.consumers.get(o, ()):
                if c > hi or c == v:
                    continue
                step = lv + 1 if leaving and c not in members else lv
                if step > level.get(c, -1):
                    level[c] = step
                if c not in queued:
                    queued.add(c)
                    heapq.heappush(heap, c)
    parts: dict[int, set[int]] = {}
    for i in group:
        parts.setdefault(level[i], set()).add(i)
    return list(parts.values())


class _Accepted:
    """Groups accepted so far (each to become one node). A path that reaches one member of
    such a group goes on from all of its members, as it will once the group is one node."""

    def __init__(self, n_nodes: int):
        self.owner: dict[int, int] = {}
        self.groups: list[list[int]] = []
        self._tree = [-1] * (n_nodes + 1)  # Fenwick tree: max last member by first member

    def add(self, group: list[int]) -> None:
        gid = len(self.groups)
        self.groups.append(group)
        for i in group:
            self.owner[i] = gid
        k, last = group[0] + 1, group[-1]
        while k < len(self._tree):
            self._tree[k] = max(self._tree[k], last)
            k += k & -k

    def horizon(self, hi: int) -> int:
        """The largest index a path from nodes <= hi can reach and still come back to an
        index <= hi: only through a group that has members on both sides."""
        while True:
            k, h = hi + 1, hi
            while k > 0:
                h = max(h, self._tree[k])
                k -= k & -k
            if h == hi:
                return hi
            hi = h


def _reentering(view: GraphView, group: list[int], accepted: _Accepted | None = None) -> set[int]:
    """Members reachable from the group through a path that leaves it (including their
    in-group descendants), where the groups in `accepted` count as single nodes (two groups
    that each depend on the other would make a cycle). Empty for a convex group."""
    members = set(group)
    hi = accepted.horizon(group[-1]) if accepted else group[-1]
    seen: set[int] = set()
    stack: list[int] = []
    expanded: set[int] = set()
    tainted: set[int] = set()

    def visit(c: int) -> None:
        if c > hi or c in seen:
            return
        if c in members:
            tainted.add(c)
            return
        seen.add(c)
        stack.append(c)
        g = accepted.owner.get(c) if accepted else None
        if g is not None and g not in expanded:
            expanded.add(g)
            for h in accepted.groups[g]:
                if h not in seen:
                    seen.add(h)
                    stack.append(h)

    for i in group:
        for o in view.nodes[i].output:
            for c in view.consumers.get(o, ()):
                if c not in members:
                    visit(c)
    while stack:
        v = stack.pop()
        for o in view.nodes[v].output:
            for c in view.consumers.get(o, ()):
                visit(c)
    if not tainted:
        return tainted
    for i in group:  # in-group descendants of tainted members are tainted too
        if i in tainted:
            continue
        for name in view.nodes[i].input:
            p = view.producer.get(name)
            if p in tainted:
                tainted.add(i)
                break
    return tainted


def exposed_outputs(view: GraphView, group: list[int]) -> list[str]:
    """Tensors produced in the group that are graph outputs or read outside it."""
    members = set(group)
    out = []
    for i in group:
        for o in view.nodes[i].output:
            if not o:
                continue
            if o in view.graph_outputs or any(c not in members for c in view.consumers.get(o, ())):
                out.append(o)
    return out


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


def match_elementwise_groups(view: GraphView, pattern: Pattern, taken: set[int],
                             accepted: _Accepted | None = None, reserved: dict[int, str] | None = None) -> MatchResult:
    """Groups of this pattern among the nodes not in `taken`; `accepted` holds the groups
    already matched (by patterns before this one) and gets this pattern's groups added.
    Nodes in `reserved` (node -> reason) join no group: they are counted under that reason."""
    result = MatchResult()
    accepted = _Accepted(len(view.nodes)) if accepted is None else accepted
    reserved = reserved or {}
    candidates: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type not in pattern.match.ops or n.domain not in ("", "ai.onnx"):
            continue
        if i in reserved:
            result.rejected[reserved[i]] += 1
            continue
        reason = check_node(view, i, pattern)
        if reason is None:
            candidates.add(i)
        else:
            result.rejected[reason] += 1
    work = [part for comp in _components(view, candidates) for level_set in _exit_levels(view, comp)
            for part in _components(view, level_set)]
    while work:
        group = work.pop()
        after = _reentering(view, group, accepted)
        if after:
            work += _components(view, set(group) - after) + _components(view, after)
            continue
        outputs = exposed_outputs(view, group)
        if not outputs:
            result.rejected["result is never used"] += len(group)
            continue
        misfits = _shape_misfits(view, group, outputs)
        if misfits:
            result.rejected["output shape differs from the group's"] += len(misfits)
            work += _components(view, set(group) - misfits)
            continue
        if len(group) < pattern.match.min_nodes:
            result.rejected["no elementwise neighbour to fuse with"] += len(group)
            continue
        if not _has_tensor_input(view, group):
            result.rejected["computes only on constants"] += len(group)
            continue
        accepted.add(group)
        result.matches.append(Match(pattern, tuple(group), tuple(outputs)))
    result.matches.sort(key=lambda m: m.nodes)
    return result


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


def find_matches(view: GraphView, patterns: list[Pattern], reserved: dict[int, str] | None = None,
                 row_matcher: Callable | None = None) -> MatchResult:
    """Apply patterns in priority order; a node joins at most one match. Nodes in
    `reserved` (node -> reason: those ONNX Runtime's own fusions take, `onnxfuse.ort_fusions`)
    join no elementwise group; conv epilogues and pool prologues may still take them.
    `row_matcher` matches row_reduction patterns (`onnxfuse.rows.match_rows`, which imports
    this module; without it they match nothing); it applies ONNX Runtime's fusions' rule
    itself (`reserved` is None without leave_to_ort).

    Dead nodes (no graph output depends on them) never join: a group computes over the
    broadcast shape of all its inputs, and a dead node could read a larger input than the
    tensors the group exposes. A Conv or MaxPool that no pattern fuses is reported with the
    reason the last pattern that looked at it gave."""
    total = MatchResult()
    live = live_nodes(view)
    ops = {op for p in patterns for op in p.match.fused_ops}
    taken: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i not in live:
            taken.add(i)
            if n.op_type in ops and n.domain in ("", "ai.onnx"):
                total.rejected["result is never used"] += 1
    accepted = _Accepted(len(view.nodes))
    layer_reasons: dict[int, str] = {}  # Conv / MaxPool node -> why it did not fuse
    for p in patterns:
        if isinstance(p.match, RowReductionMatch):  # kind rows (issue 17)
            if row_matcher is not None:
                matches, reasons = row_matcher(view, p, taken, accepted, reserved)
                layer_reasons.update(reasons)
                total.matches += matches
                for m in matches:
                    if m.note:
                        total.notes[m.note] += len(m.nodes)
            continue
        if isinstance(p.match, (ConvEpilogueMatch, PoolPrologueMatch)):
            matches, reasons = match_layers(view, p, taken, accepted)
            layer_reasons.update(reasons)
            total.matches += matches
            continue
        r = match_elementwise_groups(view, p, taken, accepted, reserved)
        for m in r.matches:
            taken.update(m.nodes)
        total.matches += r.matches
        total.rejected.update(r.rejected)
    total.rejected.update(reason for i, reason in layer_reasons.items() if i not in taken)
    total.matches.sort(key=lambda m: m.nodes[0])
    return total


# ---------------------------------------------------------------------------------------
# Conv epilogues and MaxPool prologues
# ---------------------------------------------------------------------------------------

def broadcasts_to(shape: Shape | None, target: Shape) -> bool:
    """True when a tensor of `shape` is known to broadcast to `target` without enlarging
    it (numpy rules): each of its dims is 1 or known to equal target's."""
    if shape is None or len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape):]
    return all(d == 1 or (d is not None and d == t) for d, t in zip(shape, tail, strict=True))


def _operands(view: GraphView, idx: int):
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


def _pointwise_candidate(view: GraphView, idx: int, pattern: Pattern, taken: set[int]) -> bool:
    n = view.nodes[idx]
    return (idx not in taken and n.domain in ("", "ai.onnx") and n.op_type in pattern.match.ops
            and check_node(view, idx, pattern) is None)


def _joins_epilogue(view: GraphView, idx: int, inside: set[str], target: Shape) -> bool:
    """Node idx computes over `target` when every input from outside the group broadcasts to it."""
    return all(name in inside or broadcasts_to(view.shapes.get(name), target) for _, name in _operands(view, idx))


def _readers_outside(view: GraphView, name: str, members: set[int]) -> bool:
    return name in view.graph_outputs or any(c not in members for c in view.consumers.get(name, ()))


def _conv_output_shape(view: GraphView, x_shape: Shape, k: int, attrs: ConvAttrs, out: str) -> Shape:
    """[N, K, P, Q]: P, Q by ONNX's rule where H, W are known, else as inferred."""
    h, w = x_shape[2], x_shape[3]
    inferred = view.shapes.get(out)
    if isinstance(h, int) and isinstance(w, int):
        p, q = attrs.out_size(h, w)
    else:
        p, q = (inferred[2], inferred[3]) if inferred is not None and len(inferred) == 4 else (None, None)
    return (x_shape[0], k, p, q)


def _conv_layer(view: GraphView, ci: int, pattern: Pattern) -> tuple[ConvAttrs, Shape] | str:
    """The conv's parameters and output shape, or why this pattern cannot fuse it."""
    m: ConvEpilogueMatch = pattern.match
    n = view.nodes[ci]
    if len(n.input) < 2 or len(n.output) != 1:
        return "Conv without weights"
    x, w = n.input[0], n.input[1]
    b = n.input[2] if len(n.input) > 2 and n.input[2] else None
    x_shape = view.shapes.get(x)
    if x_shape is None:
        return "unknown shape"
    if len(x_shape) != 4:
        return f"{len(x_shape) - 2}-D convolution"
    dtype = view.types.get(x)
    if dtype not in {DTYPE_IDS[d] for d in m.dtypes}:
        return _dtype_reason(dtype)
    wt = view.constants.get(w)
    if wt is None:
        return "conv weights are not a constant"
    if wt.data_type != dtype or (b is not None and view.types.get(b) != dtype):
        return "conv weights' dtype differs from the input's"
    if b is not None and (b not in view.constants or tuple(view.constants[b].dims) != (wt.dims[0],)):
        return "conv bias is not a constant of K numbers"
    if not isinstance(x_shape[1], int):
        return "unknown number of input channels"
    spatial = x_shape[2:] if all(isinstance(d, int) for d in x_shape[2:]) else None
    attrs = conv_from_node(n, tuple(wt.dims), spatial)
    if isinstance(attrs, str):
        return attrs
    if m.group is not None and attrs.group != m.group:
        return "grouped convolution"
    if wt.dims[1] * attrs.group != x_shape[1] or wt.dims[0] % attrs.group:
        return "conv weights do not match the input channels"
    return attrs, _conv_output_shape(view, x_shape, wt.dims[0], attrs, n.output[0])


def _grow_epilogue(view: GraphView, ci: int, target: Shape, pattern: Pattern, taken: set[int]) -> set[int]:
    """Every pointwise node reachable from the conv output through pointwise nodes that
    compute over the conv output's shape."""
    inside = {view.nodes[ci].output[0]}
    group: set[int] = set()
    work = [view.nodes[ci].output[0]]
    while work:
        t = work.pop()
        for c in view.consumers.get(t, ()):
            if c in group or not _pointwise_candidate(view, c, pattern, taken):
                continue
            if _joins_epilogue(view, c, inside, target):
                group.add(c)
                out = view.nodes[c].output[0]
                inside.add(out)
                work.append(out)
    return group


def _single_result(view: GraphView, anchor: int, first: str, epilogue: set[int],
                   accepted: _Accepted) -> tuple[set[int], str | None]:
    """Shrink the epilogue until the group (anchor + epilogue) is convex and exactly one
    tensor other than `first` leaves it: drop the last node while several leave. Returns
    the epilogue and that tensor (None when the epilogue ends up empty)."""
    epilogue = set(epilogue)
    while epilogue:
        group = sorted(epilogue | {anchor})
        tainted = _reentering(view, group, accepted)
        if tainted:
            epilogue -= tainted
            continue
        outs = exposed_outputs(view, group)
        if len(outs) == 1 and outs[0] != first:
            return epilogue, outs[0]
        epilogue.discard(max(epilogue))
    return epilogue, None


def _conv_match(view: GraphView, ci: int, pattern: Pattern, taken: set[int], accepted: _Accepted) -> Match | str:
    """The conv_epilogue match anchored at Conv node ci, or why there is none."""
    m: ConvEpilogueMatch = pattern.match
    layer = _conv_layer(view, ci, pattern)
    if isinstance(layer, str):
        return layer
    attrs, target = layer
    out = view.nodes[ci].output[0]
    epilogue = _grow_epilogue(view, ci, target, pattern, taken)
    if not epilogue and m.pool == "none" and not m.alone:
        return "conv without a fusible epilogue"
    direct = [c for c in view.consumers.get(out, ()) if c not in epilogue]
    if (out in view.graph_outputs or direct) and not (m.alone and not epilogue):
        pool_only = (m.pool != "none" and not epilogue and len(direct) == 1
                     and view.nodes[direct[0]].op_type == "MaxPool" and out not in view.graph_outputs)
        if not pool_only:
            if not m.alone:
                return "conv output is also read elsewhere"
            epilogue = set()  # the conv alone: its output goes to every reader
    grown = bool(epilogue)
    epilogue, result = _single_result(view, ci, out, epilogue, accepted)
    if grown and not epilogue and not m.alone:  # every smaller group leaves the conv output to others
        return "conv output is also read elsewhere"
    result = result or out
    pool = pool_attrs = None
    if m.pool != "none":
        readers = view.consumers.get(result, ())
        pi = readers[0] if len(readers) == 1 else None
        if pi is None or result in view.graph_outputs or pi in taken or view.nodes[pi].op_type != "MaxPool" \
                or view.nodes[pi].domain not in ("", "ai.onnx"):
            return "no max pool reads the conv's result alone"
        pool_attrs = pool_from_node(view.nodes[pi], target[2:] if all(isinstance(d, int) for d in target[2:])
                                    else None)
        if isinstance(pool_attrs, str):
            return pool_attrs
        if m.pool == "tiling" and not pool_attrs.tiles:
            return "max pool windows do not tile the conv output"
        pool = pi
    nodes = sorted(epilogue | {ci} | ({pool} if pool is not None else set()))
    if _reentering(view, nodes, accepted):
        return "fusing would create a cycle"
    final = view.nodes[pool].output[0] if pool is not None else result
    if view.types.get(final) is None:
        return "unknown dtype"
    return Match(pattern, tuple(nodes), (final,), conv=ci, pool=pool, pointwise=tuple(sorted(epilogue)),
                 conv_attrs=attrs, pool_attrs=pool_attrs, first_input=out, result=result)


def _grow_prologue(view: GraphView, start: int, pattern: Pattern, taken: set[int]) -> set[int]:
    """`start` and every pointwise node before it (through producers) with a 4-D output."""
    group = {start}
    work = [start]
    while work:
        i = work.pop()
        for _, name in _operands(view, i):
            q = view.producer.get(name)
            if q is None or q in group or not _pointwise_candidate(view, q, pattern, taken):
                continue
            if view.rank(view.nodes[q].output[0]) == 4:
                group.add(q)
                work.append(q)
    return group


def _prologue_inputs(view: GraphView, group: list[int]) -> list[str]:
    """The group's boundary operands in order of first use (the program's input order)."""
    members = set(group)
    seen: dict[str, None] = {}
    for i in group:
        for _, name in _operands(view, i):
            if view.producer.get(name) not in members:
                seen.setdefault(name)
    return list(seen)


def _pool_match(view: GraphView, pi: int, pattern: Pattern, taken: set[int], accepted: _Accepted) -> Match | str:
    """The pool_prologue match anchored at MaxPool node pi, or why there is none."""
    m: PoolPrologueMatch = pattern.match
    n = view.nodes[pi]
    x = n.input[0]
    x_shape = view.shapes.get(x)
    if x_shape is None:
        return "unknown shape"
    if len(x_shape) != 4:
        return f"{len(x_shape) - 2}-D max pool"
    if view.types.get(x) not in {DTYPE_IDS[d] for d in m.dtypes}:
        return _dtype_reason(view.types.get(x))
    if not isinstance(x_shape[1], int):
        return "unknown number of channels"
    attrs = pool_from_node(n, x_shape[2:] if all(isinstance(d, int) for d in x_shape[2:]) else None)
    if isinstance(attrs, str):
        return attrs
    p = view.producer.get(x)
    prologue = p is not None and p not in accepted.owner and _pointwise_candidate(view, p, pattern, taken) \
        and not _readers_outside(view, x, {pi})
    if not prologue and m.min_nodes == 0:  # the max pool alone: the identity program on X
        return _lone_pool_match(view, pi, pattern, attrs, x)
    if p is not None and p in accepted.owner:
        return "its input is computed by another fused node"
    if p is None or not _pointwise_candidate(view, p, pattern, taken):
        return "no pointwise op before the max pool"
    if _readers_outside(view, x, {pi}):
        return "max pool input is also read elsewhere"
    group = _grow_prologue(view, p, pattern, taken)
    while True:  # only x may leave: drop members read outside, with their in-group producers
        members = group | {pi}
        leaving = {i for i in group if i != p and _readers_outside(view, view.nodes[i].output[0], members)}
        if not leaving:
            break
        stack = list(leaving)
        while stack:
            i = stack.pop()
            if i in group:
                group.discard(i)
                stack += [view.producer[name] for _, name in _operands(view, i) if view.producer.get(name) in group]
    if len(group) < m.min_nodes:
        return "too few pointwise ops before the max pool"
    ordered = sorted(group)
    inputs = _prologue_inputs(view, ordered)
    first = next((a for a in inputs if view.rank(a) == 4 and view.types.get(a) != 9
                  and all(b == a or broadcasts_to(view.shapes.get(b), view.shapes[a]) for b in inputs)), None)
    if first is None or view.shapes[first][1] != x_shape[1]:
        return "no prologue input has the max pool input's shape"
    nodes = sorted(group | {pi})
    if _reentering(view, nodes, accepted):
        return "fusing would create a cycle"
    if view.types.get(n.output[0]) is None:
        return "unknown dtype"
    return Match(pattern, tuple(nodes), (n.output[0],), pool=pi, pointwise=tuple(ordered),
                 pool_attrs=attrs, first_input=first, result=x)


def _lone_pool_match(view: GraphView, pi: int, pattern: Pattern, attrs, x: str) -> Match | str:
    """A MaxPool with no fusible prologue (pattern min_nodes 0): program %0 -> %0."""
    n = view.nodes[pi]
    if view.types.get(n.output[0]) is None:
        return "unknown dtype"
    return Match(pattern, (pi,), (n.output[0],), pool=pi, pointwise=(), pool_attrs=attrs, first_input=x, result=x)


def match_layers(view: GraphView, pattern: Pattern, taken: set[int],
                 accepted: _Accepted) -> tuple[list[Match], dict[int, str]]:
    """Matches of a conv_epilogue or pool_prologue pattern, in topological order of their
    Conv / MaxPool; adds their nodes to `taken` and `accepted`. Also returns why each
    other Conv / MaxPool (not already taken) did not match."""
    conv = isinstance(pattern.match, ConvEpilogueMatch)
    anchor_op = "Conv" if conv else "MaxPool"
    matches: list[Match] = []
    reasons: dict[int, str] = {}
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type != anchor_op or n.domain not in ("", "ai.onnx"):
            continue
        found = (_conv_match if conv else _pool_match)(view, i, pattern, taken, accepted)
        if isinstance(found, str):
            reasons[i] = found
            continue
        matches.append(found)
        taken.update(found.nodes)
        accepted.add(list(found.nodes))
    return matches, reasons


def numel(shape) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))
