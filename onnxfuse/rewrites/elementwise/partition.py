"""Partitioning a DAG of operations into fusible regions (graph-agnostic; used by fuse_elementwise).

Nodes are integers ``0..n-1`` *in topological order*. The caller supplies, per node, whether it is
fusible, its consumers and producers (node indices, including implicit ones such as an ``If`` whose
subgraph reads a value), and a ``check`` callback that judges a candidate region's outputs (the
shape contract of the fused op). The result is a list of disjoint regions such that:

* every region is weakly connected through producer→consumer edges between its own members;
* contracting every region into one node leaves the graph acyclic (no value leaves a region and
  comes back in through an outside node, also not through another region);
* ``check(region, final=True)`` accepts every region.

Algorithm
---------
Phase 1 (greedy growth, in topological order): each fusible node ``n`` tries to join the groups of
its fusible producers: all of them at once, else one at a time, largest first. A merge is accepted
when (a) it does not create a cycle in the contracted graph: starting from the merged set, a
depth-first search over already-processed nodes (jumping across whole groups, since a group is one
node after contraction) must not come back into the set; and (b) ``check(members, final=False)``
accepts it (values that certainly leave the group, i.e. graph outputs and values read by
non-fusible or already-placed nodes, must have the group's full output shape; values read by
later fusible nodes get the benefit of the doubt).

Cost: linear in the graph for chains and near-linear in general. Nothing in phase 1 is proportional
to a group's size: a group keeps its members, its *frontier* (outside nodes reading a member), its
*boundary* (members read from outside, or marked as sinks: the only ones whose values can leave) and
the judge's own summary (``Judge.state``: a region's inputs and produced values). A join is judged
from the summaries of the groups involved, the cycle search walks frontiers, group by group, and an
accepted join merges the smaller groups into the largest. Before (2026-11-23, a chain of 2,500
elementwise nodes took 5.6 s, 10,000 took 115 s, 20,000 nine minutes) every join rescanned the
whole group; see docs/architecture.md for the measured curve now.

Phase 2 (splitting): each group is checked with its final membership. When a value ``v`` produced
by member ``p`` is refused (it leaves the region but is smaller than the region's broadcast shape,
or that cannot be proven), the region is split into ``p`` with its in-region ancestors (whose
broadcast shape is exactly ``v``'s) and the remaining members, broken into connected components;
pieces are checked again. Splitting a convex region this way never creates a cycle (all edges
between the pieces go from the ancestor piece to the others), and every split strictly shrinks,
so this terminates. A one-node region always passes (its output is the broadcast of its inputs).
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol, Sequence

from onnxfuse.rewrites.engine.rule import Refuse


class Judge(Protocol):
    """What the caller knows about regions; ``state`` objects are its own summaries of groups."""

    def state(self, members: Iterable[int]) -> object:
        """A fresh summary of a group with these members."""

    def join(self, states: list, i: int) -> object:
        """The summary of ``states``' groups joined with node ``i``; may reuse (mutate) ``states[0]``,
        the largest, since it is called only for a join that was accepted."""

    def verdict(self, states: list, i: int | None, contains: Callable[[int], bool], boundary: list[int],
                final: bool, upto: int) -> "tuple[int, Refuse] | None":
        """None when the region made of ``states``' groups (and node ``i``, unless None) is acceptable,
        else (offending member, its refusal). ``boundary`` holds every member whose value may leave the
        region; ``contains`` tests membership in O(1)."""


class _Group:
    __slots__ = ("members", "frontier", "boundary", "state")

    def __init__(self, members: set[int], frontier: set[int], boundary: set[int], state: object):
        self.members, self.frontier, self.boundary, self.state = members, frontier, boundary, state


def _frontier_of(members: set[int], consumers: Sequence[Sequence[int]]) -> set[int]:
    return {c for m in members for c in consumers[m] if c not in members}


def _boundary_of(members: Iterable[int], consumers, sink, contains) -> set[int]:
    return {m for m in members if sink[m] or any(not contains(c) for c in consumers[m])}


def _components(members: set[int], consumers: Sequence[Sequence[int]],
                producers: Sequence[Sequence[int]]) -> list[set[int]]:
    left = set(members)
    out = []
    while left:
        start = min(left)
        comp = {start}
        stack = [start]
        left.discard(start)
        while stack:
            x = stack.pop()
            for y in list(consumers[x]) + list(producers[x]):
                if y in left:
                    left.discard(y)
                    comp.add(y)
                    stack.append(y)
        out.append(comp)
    return out


def partition(
    n: int,
    fusible: Sequence[bool],
    consumers: Sequence[Sequence[int]],
    producers: Sequence[Sequence[int]],
    judge: Judge,
    sink: Sequence[bool] | None = None,
    label: Callable[[int], str] = lambda i: f"#{i}",
) -> tuple[list[list[int]], dict[int, Refuse]]:
    """Regions (sorted member lists, sorted by first member) and notes on why nodes were kept apart.

    ``sink[i]``: node ``i``'s value leaves the graph whatever its readers (a graph output).
    ``notes[i]`` is the refusal of a node's merge with a neighbour (cycle or shape), whose reason
    qualifies the "single op" refusal.
    """
    sink = sink if sink is not None else [False] * n
    group_of: dict[int, int] = {}
    groups: dict[int, _Group] = {}
    notes: dict[int, Refuse] = {}
    next_gid = 0

    def creates_cycle(gids: list[int], i: int) -> int | None:
        """A node outside the joined set on a path that leaves it and comes back, else None.

        Walks only nodes before ``i`` (processed so far: later nodes cannot reach back), jumping
        across whole groups (a group is one node after contraction) through their frontiers.
        """
        inside = set(gids)

        def joined(x: int) -> bool:
            return x == i or group_of.get(x) in inside

        stack = [c for g in gids for c in groups[g].frontier if c < i and not joined(c)]
        stack += [c for c in consumers[i] if c < i and not joined(c)]
        seen_nodes: set[int] = set()
        seen_groups: set[int] = set()
        while stack:
            c = stack.pop()
            gid = group_of.get(c)
            if gid is not None:
                if gid in seen_groups:
                    continue
                seen_groups.add(gid)
                nexts = groups[gid].frontier
            else:
                if c in seen_nodes:
                    continue
                seen_nodes.add(c)
                nexts = consumers[c]
            for y in nexts:
                if joined(y):
                    return c
                if y < i:
                    stack.append(y)
        return None

    for i in range(n):
        if not fusible[i]:
            continue
        cand: list[int] = []
        for p in producers[i]:
            gid = group_of.get(p)
            if gid is not None and gid not in cand:
                cand.append(gid)

        def attempt(gids: list[int]):
            via = creates_cycle(gids, i)
            if via is not None:
                return Refuse(f"joining would create a cycle through {label(via)}")
            inside = set(gids)

            def contains(x: int) -> bool:
                return x == i or group_of.get(x) in inside

            boundary = [b for b in {b for g in gids for b in groups[g].boundary} | {i}
                        if sink[b] or any(not contains(c) for c in consumers[b])]
            verdict = judge.verdict([groups[g].state for g in gids], i, contains, sorted(boundary), False, i)
            if verdict is not None:
                return verdict[1]
            return boundary

        chosen: list[int] = []
        boundary: list[int] = [i] if sink[i] or consumers[i] else []
        if cand:
            result = attempt(cand)
            if not isinstance(result, Refuse):
                chosen, boundary = cand, result
            else:
                last_why = result
                for g in sorted(cand, key=lambda g: (-len(groups[g].members), min(groups[g].members))):
                    result = attempt(chosen + [g])
                    if not isinstance(result, Refuse):
                        chosen, boundary = chosen + [g], result
                    else:
                        last_why = result
                        for x in groups[g].members:
                            notes.setdefault(x, Refuse(f"not joined with {label(i)}: {result.reason}", result.node))
                if last_why and len(chosen) < len(cand):
                    notes[i] = last_why
        if chosen:  # merge the smaller groups into the largest, which keeps its id
            order = sorted(chosen, key=lambda g: -len(groups[g].members))
            gid, big = order[0], groups[order[0]]
            big.state = judge.join([groups[g].state for g in order], i)
            for g in order[1:]:
                part = groups.pop(g)
                big.members |= part.members
                big.frontier |= part.frontier
                for m in part.members:
                    group_of[m] = gid
            big.members.add(i)
            big.frontier.update(consumers[i])
            big.frontier = {c for c in big.frontier if c not in big.members}
            big.boundary = set(boundary)
        else:
            gid = next_gid
            next_gid += 1
            groups[gid] = _Group({i}, set(consumers[i]), set(boundary), judge.state([i]))
        group_of[i] = gid

    # Phase 2: split until every region passes the final check.
    work = [g.members for g in groups.values()]
    done: list[set[int]] = []
    while work:
        region = work.pop()
        if len(region) == 1:
            done.append(region)
            continue

        def contains(x: int, region=region) -> bool:
            return x in region

        boundary = sorted(_boundary_of(region, consumers, sink, contains))
        verdict = judge.verdict([judge.state(region)], None, contains, boundary, True, n)
        if verdict is None:
            done.append(region)
            continue
        p, why = verdict
        anc = {p}
        stack = [p]
        while stack:
            x = stack.pop()
            for y in producers[x]:
                if y in region and y not in anc:
                    anc.add(y)
                    stack.append(y)
        rest = region - anc
        for x in region:
            notes.setdefault(x, why)
        if not rest:  # cannot happen for a correct check; keep the members apart rather than loop
            done.extend({x} for x in region)
            continue
        work.append(anc)
        work.extend(_components(rest, consumers, producers))
    regions = sorted((sorted(r) for r in done), key=lambda r: r[0])
    return regions, notes
