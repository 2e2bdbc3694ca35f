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

Phase 2 (splitting): each group is checked with its final membership. When a value ``v`` produced
by member ``p`` is refused (it leaves the region but is smaller than the region's broadcast shape,
or that cannot be proven), the region is split into ``p`` with its in-region ancestors (whose
broadcast shape is exactly ``v``'s) and the remaining members, broken into connected components;
pieces are checked again. Splitting a convex region this way never creates a cycle (all edges
between the pieces go from the ancestor piece to the others), and every split strictly shrinks,
so this terminates. A one-node region always passes (its output is the broadcast of its inputs).
"""

from __future__ import annotations

from typing import Callable, Sequence

#: check(members, final, upto) -> None when acceptable, else (offending member, reason).
CheckFn = Callable[[frozenset, bool, int], "tuple[int, str] | None"]


def _creates_cycle(members: set[int], consumers: Sequence[Sequence[int]], group_of: dict[int, int],
                   groups: dict[int, set[int]], upto: int) -> int | None:
    """A node outside ``members`` on a path that leaves ``members`` and comes back, else None.

    Only nodes before ``upto`` (the ones processed so far) are explored: later nodes cannot reach
    back into processed ones.
    """
    stack = [c for m in members for c in consumers[m] if c not in members and c < upto]
    seen: set[int] = set()
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        gid = group_of.get(c)
        group = groups[gid] if gid is not None else (c,)
        for x in group:
            seen.add(x)
        for x in group:
            for y in consumers[x]:
                if y in members:
                    return c
                if y not in seen and y < upto:
                    stack.append(y)
    return None


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
    check: CheckFn,
    label: Callable[[int], str] = lambda i: f"#{i}",
) -> tuple[list[list[int]], dict[int, str]]:
    """Regions (sorted member lists, sorted by first member) and notes on why nodes were kept apart.

    ``notes[i]`` is a short explanation for a node whose merge with a neighbour was refused (cycle or
    shape), used to qualify the "single op" refusal.
    """
    group_of: dict[int, int] = {}
    groups: dict[int, set[int]] = {}
    notes: dict[int, str] = {}
    next_gid = 0

    for i in range(n):
        if not fusible[i]:
            continue
        cand: list[int] = []
        for p in producers[i]:
            gid = group_of.get(p)
            if gid is not None and gid not in cand:
                cand.append(gid)

        def attempt(gids):
            members = {i}
            for g in gids:
                members |= groups[g]
            via = _creates_cycle(members, consumers, group_of, groups, i)
            if via is not None:
                return None, f"joining would create a cycle through {label(via)}"
            verdict = check(frozenset(members), False, i)
            if verdict is not None:
                return None, verdict[1]
            return members, None

        chosen: list[int] = []
        members = {i}
        if cand:
            m, why = attempt(cand)
            if m is not None:
                chosen, members = cand, m
            else:
                last_why = why
                for g in sorted(cand, key=lambda g: (-len(groups[g]), min(groups[g]))):
                    m, why = attempt(chosen + [g])
                    if m is not None:
                        chosen, members = chosen + [g], m
                    else:
                        last_why = why
                        for x in groups[g]:
                            notes.setdefault(x, f"not joined with {label(i)}: {why}")
                if last_why and len(chosen) < len(cand):
                    notes[i] = last_why
        gid = next_gid
        next_gid += 1
        for g in chosen:
            del groups[g]
        groups[gid] = members
        for m in members:
            group_of[m] = gid

    # Phase 2: split until every region passes the final check.
    work = [set(g) for g in groups.values()]
    done: list[set[int]] = []
    while work:
        region = work.pop()
        if len(region) == 1:
            done.append(region)
            continue
        verdict = check(frozenset(region), True, n)
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
