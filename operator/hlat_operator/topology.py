"""Network topology: which nodes a gang takes, and which node rank goes where (pure).

Each node carries its place in the network as labels, one per level, top first (on EKS, EC2's
instance topology: `topology.k8s.aws/network-node-layer-1` .. `-3`; nodes that share the
bottom layer's value are the closest). For a new gang the operator picks its nodes the way
Kueue's Topology-Aware Scheduling does (kueue#2724, "BestFit"): at each level, the tightest
domain that holds what is left; where none does, as few domains as can, the largest first,
the remainder in the tightest that holds it. The chosen nodes sorted by their labels, then by
name, give the ranks: consecutive ranks share the lowest switch they can, so the data-parallel
ring crosses each higher switch once. A rank created again in a live gang (its pod lost) is
steered to the free node closest to its neighbours' nodes.

The plan is carried out by node affinity (builders.build_node_affinity): required on the
domain's value when the level is required, preferred on each planned node. Which nodes are
free is not known here (the scheduler knows other jobs' pods): a planned node that is taken
leaves its pod to the scheduler, within the required domain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from hlat_api.spec import TopologySpec
from hlat_operator.builders import RankPlacement
from hlat_operator.observe import ObservedNode


def path(node: ObservedNode, levels: Sequence[str]) -> tuple[str, ...]:
    """The node's place, top first, then its name (a missing label sorts first)."""
    return (*(node.labels.get(level, "") for level in levels), node.name)


def plan(nodes: Iterable[ObservedNode], count: int, topo: TopologySpec
         ) -> list[ObservedNode] | None:
    """`count` of `nodes` (the usable ones) in rank order, or None when `topo.required` names
    a level none of whose domains holds `count` of them."""
    nodes = list(nodes)
    if topo.slice_size:
        return _plan_slices(nodes, count, topo, topo.slice_size)
    if topo.required is None:
        return _pick(nodes, count, topo.levels) if len(nodes) >= count else None
    below = topo.levels[topo.levels.index(topo.required) + 1:]
    domains = _group(nodes, topo.required)
    fitting = [(len(group), value) for value, group in domains.items()
               if value and len(group) >= count]
    if not fitting:
        return None
    _, value = min(fitting)
    return _pick(domains[value], count, below)


def slice_level(topo: TopologySpec) -> str:
    """The level whose domains hold whole slices (`sliceSize`): the required or preferred one."""
    level = topo.required or topo.preferred
    assert level is not None  # the spec has exactly one
    return level


def _plan_slices(nodes: list[ObservedNode], count: int, topo: TopologySpec, size: int
                 ) -> list[ObservedNode] | None:
    """`count` nodes in whole slices of `size`, each in one domain of the slice level: all in
    the tightest domain that holds them where the level is required, else in as few domains as
    hold them, those with room for the most slices first; None where there are too few. The
    nodes sorted by their levels give each domain consecutive ranks, a multiple of `size` of
    them, so each slice of ranks lies in one domain."""
    level = slice_level(topo)
    below = topo.levels[topo.levels.index(level) + 1:]
    need = count // size
    domains = {v: g for v, g in _group(nodes, level).items() if v and len(g) >= size}
    take: dict[str, int] = {}
    if topo.required is not None:
        fitting = [(len(g), v) for v, g in domains.items() if len(g) // size >= need]
        if not fitting:
            return None
        take[min(fitting)[1]] = need
    else:
        left = need
        for value in sorted(domains, key=lambda v: (-(len(domains[v]) // size), v)):
            if left:
                take[value] = min(left, len(domains[value]) // size)
                left -= take[value]
        if left:
            return None
    chosen = [n for value, k in take.items() for n in _pick(domains[value], k * size, below)]
    return sorted(chosen, key=lambda n: path(n, topo.levels))


def largest_domain(nodes: Iterable[ObservedNode], level: str) -> tuple[str, int]:
    """The domain of `level` with the most of `nodes` (for saying why a gang waits)."""
    sizes = [(len(group), value) for value, group in _group(nodes, level).items() if value]
    size, value = max(sizes, default=(0, ""))
    return value, size


def _group(nodes: Iterable[ObservedNode], level: str) -> dict[str, list[ObservedNode]]:
    groups: dict[str, list[ObservedNode]] = defaultdict(list)
    for node in nodes:
        groups[node.labels.get(level, "")].append(node)
    return groups


def _pick(nodes: list[ObservedNode], count: int, levels: Sequence[str]) -> list[ObservedNode]:
    """Best fit, level by level (the nodes share every level above `levels[0]`)."""
    if count <= 0:
        return []
    if not levels:
        return sorted(nodes, key=lambda n: n.name)[:count]
    groups = _group(nodes, levels[0])
    sizes = sorted(((len(g), v) for v, g in groups.items()), key=lambda s: (-s[0], s[1]))
    chosen: list[ObservedNode] = []
    left = count
    while left:
        fitting = [s for s in sizes if s[0] >= left]
        size, value = min(fitting) if fitting else sizes[0]
        take = min(left, size)
        chosen += _pick(groups[value], take, levels[1:])
        sizes.remove((size, value))
        left -= take
    return sorted(chosen, key=lambda n: path(n, levels))


def placements(ranked: Sequence[ObservedNode], topo: TopologySpec) -> dict[int, RankPlacement]:
    """Each rank's affinity for a planned gang (`ranked`: plan()'s nodes)."""
    return {rank: _placement(node, topo) for rank, node in enumerate(ranked)}


def _placement(node: ObservedNode, topo: TopologySpec) -> RankPlacement:
    """Required affinity to the node's domain of the required level (of the slice level, with
    slices: a slice's pods stay in its domain), preferred to the node and its bottom domain."""
    bottom = topo.levels[-1]
    required = None
    level = slice_level(topo) if topo.slice_size else topo.required
    if level is not None:
        required = (level, node.labels.get(level, ""))
    near = (bottom, node.labels[bottom]) if node.labels.get(bottom) else None
    return RankPlacement(node=node.name, required=required, near=near)


def replacement(rank: int, free: Iterable[ObservedNode], gang: Mapping[int, ObservedNode],
                topo: TopologySpec) -> RankPlacement:
    """Where a rank created again in a live gang goes: in the gang's required domain (that of
    its placed pods), on the free node there that shares the most levels with its neighbour
    ranks' nodes. No free node known there: the domain only, the scheduler picks. With
    slices, the domain is the rank's slice's (that of the slice's other ranks' nodes)."""
    required = None
    if topo.slice_size:
        level, first = slice_level(topo), rank - rank % topo.slice_size
        values = {gang[r].labels.get(level, "") for r in range(first, first + topo.slice_size)
                  if r in gang} - {""}
        if len(values) == 1:
            required = (level, values.pop())
    elif topo.required is not None:
        values = {n.labels.get(topo.required, "") for n in gang.values()} - {""}
        if len(values) == 1:
            required = (topo.required, values.pop())
    candidates = [n for n in free
                  if required is None or n.labels.get(required[0]) == required[1]]
    neighbours = [gang[r] for r in (rank - 1, rank + 1) if r in gang]
    if not candidates:
        return RankPlacement(required=required)

    def closeness(node: ObservedNode) -> tuple[int, str]:
        mine = path(node, topo.levels)[:-1]
        shared = max((_common(mine, path(n, topo.levels)[:-1]) for n in neighbours), default=0)
        return -shared, node.name

    return _placement(min(candidates, key=closeness), topo)


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y or not x:
            break
        shared += 1
    return shared
