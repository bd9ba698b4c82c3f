"""Find groups of nodes that a pattern fuses. Reads only a pattern's `match` part.

For `elementwise_group` patterns a match is a maximal connected set of elementwise nodes
(producer-consumer edges) that is
- convex: no path leaves the group and comes back, so one node can replace it;
- shape-uniform: every tensor the group exposes (read outside it, or a graph output) has the
  same shape, the shape the fused kernel iterates over.
Nodes that could have joined but did not are reported with the reason.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from onnxfuse.graph import GraphView, _outer_refs, same_shape
from onnxfuse.ops import DTYPE_NAMES, RULES, node_attrs
from onnxfuse.pattern import Pattern

DTYPE_IDS = {"float32": 1, "float16": 10, "bfloat16": 16}


@dataclass(frozen=True)
class Match:
    pattern: Pattern
    nodes: tuple[int, ...]  # node indices, topological order
    outputs: tuple[str, ...]  # tensors the group exposes, in production order


@dataclass
class MatchResult:
    matches: list[Match] = field(default_factory=list)
    # reason -> number of nodes it kept out of a fusion
    rejected: Counter = field(default_factory=Counter)


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
                             accepted: _Accepted | None = None) -> MatchResult:
    """Groups of this pattern among the nodes not in `taken`; `accepted` holds the groups
    already matched (by patterns before this one) and gets this pattern's groups added."""
    result = MatchResult()
    accepted = _Accepted(len(view.nodes)) if accepted is None else accepted
    candidates: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i in taken or n.op_type not in pattern.match.ops or n.domain not in ("", "ai.onnx"):
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


def find_matches(view: GraphView, patterns: list[Pattern]) -> MatchResult:
    """Apply patterns in priority order; a node joins at most one match.

    Dead nodes (no graph output depends on them) never join: a group computes over the
    broadcast shape of all its inputs, and a dead node could read a larger input than the
    tensors the group exposes."""
    total = MatchResult()
    live = live_nodes(view)
    ops = {op for p in patterns for op in p.match.ops}
    taken: set[int] = set()
    for i, n in enumerate(view.nodes):
        if i not in live:
            taken.add(i)
            if n.op_type in ops and n.domain in ("", "ai.onnx"):
                total.rejected["result is never used"] += 1
    accepted = _Accepted(len(view.nodes))
    for p in patterns:
        r = match_elementwise_groups(view, p, taken, accepted)
        for m in r.matches:
            taken.update(m.nodes)
        total.matches += r.matches
        total.rejected.update(r.rejected)
    total.matches.sort(key=lambda m: m.nodes[0])
    return total


def numel(shape) -> int | None:
    if shape is None or any(not isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64))
