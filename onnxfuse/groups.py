"""Groups of nodes that one node can replace: convexity in the graph's DAG.

A group is convex when no path leaves it and comes back; only then can one node stand for
it. The matchers of every kind (onnxfuse.kinds) use these: `components` and `exit_levels`
split candidate sets into connected, convex parts, `reentering` finds the members a path
from outside reaches (groups accepted earlier counting as one node each, `Accepted`), and
`exposed_outputs` the tensors a group hands to the rest of the graph."""

from __future__ import annotations

import heapq

from onnxfuse.graph import GraphView


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


def components(view: GraphView, members: set[int]) -> list[list[int]]:
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


def exit_levels(view: GraphView, group: list[int]) -> list[set[int]]:
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


class Accepted:
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


def reentering(view: GraphView, group: list[int], accepted: Accepted | None = None) -> set[int]:
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
