"""Network-topology placement (spec.scheduling.topology): which nodes a gang takes, which rank
goes where, what a replaced rank gets, and a job that waits when no domain holds it. The plan
is pure (topology.py); the World runs it through decide() and a scheduler that honours node
affinity as kube-scheduler does (required terms filter, preferred weights rank)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opfakes import World, raw_spec
from pydantic import ValidationError

from hlat_api.labels import Reason
from hlat_api.spec import PretrainJobSpec, TopologySpec
from hlat_operator import topology
from hlat_operator.builders import RankPlacement, build_node_affinity
from hlat_operator.observe import ObservedNode

L1, L2, L3 = (f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))

# two layer-2 switches; under them layer-3 blocks of 2 (a), 3 (b) and 4 (c); names interleave
# across blocks, so name order is not topology order
RIG = {
    "n0": ("s1", "s2-x", "a"), "n3": ("s1", "s2-x", "a"),
    "n1": ("s1", "s2-x", "b"), "n2": ("s1", "s2-x", "b"), "n4": ("s1", "s2-x", "b"),
    "n5": ("s1", "s2-y", "c"), "n6": ("s1", "s2-y", "c"), "n7": ("s1", "s2-y", "c"),
    "n8": ("s1", "s2-y", "c"),
}


def _node(name: str, where: tuple[str, str, str]) -> ObservedNode:
    return ObservedNode(name, labels=dict(zip((L1, L2, L3), where, strict=True)))


NODES = [_node(n, w) for n, w in sorted(RIG.items())]


def _block(name: str) -> str:
    return RIG[name][2]


def _names(nodes: list[ObservedNode] | None) -> list[str]:
    assert nodes is not None
    return [n.name for n in nodes]


def test_a_required_level_takes_the_tightest_domain_that_holds_the_gang() -> None:
    required = TopologySpec(required=L3)
    assert _names(topology.plan(NODES, 3, required)) == ["n1", "n2", "n4"]  # b, not c
    assert _names(topology.plan(NODES, 2, required)) == ["n0", "n3"]  # a
    assert _names(topology.plan(NODES, 4, required)) == ["n5", "n6", "n7", "n8"]
    assert topology.plan(NODES, 5, required) is None
    assert topology.largest_domain(NODES, L3) == ("c", 4)
    # a layer-2 domain: the whole of s2-x (5 nodes) for 5; ranks follow the blocks in it
    assert [_block(n) for n in _names(topology.plan(NODES, 5, TopologySpec(required=L2)))] \
        == ["a", "a", "b", "b", "b"]


def test_a_gang_over_several_domains_takes_as_few_as_it_can_its_ranks_contiguous() -> None:
    preferred = TopologySpec(preferred=L3)
    # 6: no layer-2 switch holds 6, so the largest (s2-x: a and b, 5) whole, then 1 of s2-y
    six = _names(topology.plan(NODES, 6, preferred))
    assert [_block(n) for n in six] == ["a", "a", "b", "b", "b", "c"]
    # 7 within s2-x (5) and s2-y (4): s2-x whole, then 2 of c
    seven = _names(topology.plan(NODES, 7, preferred))
    assert [_block(n) for n in seven] == ["a", "a", "b", "b", "b", "c", "c"]
    # 3: the tightest layer-2 switch that holds it (s2-y, 4), one block there: never spread
    assert [_block(n) for n in _names(topology.plan(NODES, 3, preferred))] == ["c"] * 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, 3)),
                min_size=1, max_size=24),
       st.integers(1, 24), st.sampled_from([None, L1, L2, L3]))
def test_any_plan_is_distinct_usable_nodes_each_domain_s_ranks_contiguous(
        places: list[tuple[int, int, int]], count: int, required: str | None) -> None:
    nodes = [ObservedNode(f"node-{i}", labels={L1: f"p{a}", L2: f"p{a}-q{b}",
                                               L3: f"p{a}-q{b}-r{c}"})
             for i, (a, b, c) in enumerate(places)]
    topo = TopologySpec(required=required) if required else TopologySpec(preferred=L3)
    ranked = topology.plan(nodes, count, topo)
    if ranked is None:
        sizes = [topology.largest_domain(nodes, required)[1]] if required else [len(nodes)]
        assert max(sizes) < count
        return
    names = _names(ranked)
    assert len(names) == count == len(set(names))
    if required:
        assert len({n.labels[required] for n in ranked}) == 1
    for level in (L1, L2, L3):  # at every level, one run of ranks per domain
        runs = [v for i, v in enumerate(n.labels[level] for n in ranked)
                if i == 0 or ranked[i - 1].labels[level] != v]
        assert len(runs) == len(set(runs)), (level, [n.labels[level] for n in ranked])


def test_a_replaced_rank_goes_next_to_its_neighbours_in_the_gang_s_domain() -> None:
    by_name = {n.name: n for n in NODES}
    gang = {0: by_name["n5"], 2: by_name["n7"]}  # rank 1 (on n6) was lost
    free = [by_name[n] for n in ("n0", "n8")]
    place = topology.replacement(1, free, gang, TopologySpec(required=L2))
    assert place == RankPlacement(node="n8", required=(L2, "s2-y"), near=(L3, "c"))
    # nothing free in the domain: the domain only, the scheduler picks (or it waits)
    assert topology.replacement(1, free[:1], gang, TopologySpec(required=L3)) \
        == RankPlacement(required=(L3, "c"))
    # preferred: the closest free node anywhere
    assert topology.replacement(1, free[:1], gang, TopologySpec(preferred=L3)).node == "n0"


def test_the_affinity_keeps_the_avoided_nodes_out_and_the_gang_in_its_domain() -> None:
    place = RankPlacement(node="n1", required=(L3, "b"), near=(L3, "b"))
    affinity = build_node_affinity(["n9"], place)["nodeAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # one term: its expressions are ANDed (two terms would be ORed, and avoiding would not hold)
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn",
                                    "values": ["n9"]}]
    assert term["matchExpressions"] == [{"key": L3, "operator": "In", "values": ["b"]}]
    weights = {t["weight"]: t["preference"]
               for t in affinity["preferredDuringSchedulingIgnoredDuringExecution"]}
    assert weights[100]["matchFields"][0]["values"] == ["n1"]
    assert weights[50]["matchExpressions"][0] == {"key": L3, "operator": "In", "values": ["b"]}


@pytest.mark.parametrize(("topo", "field"), [
    ({}, "spec.scheduling.topology"),
    ({"required": L3, "preferred": L3}, "spec.scheduling.topology"),
    ({"required": "kubernetes.io/hostname"}, "spec.scheduling.topology.required"),
    ({"preferred": L3, "levels": [L1, L3, L3]}, "spec.scheduling.topology.levels"),
    ({"required": "not a label"}, "scheduling.topology.required"),
])
def test_a_topology_that_cannot_mean_anything_is_refused_naming_the_field(
        topo: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        PretrainJobSpec.model_validate(raw_spec(**{"scheduling.topology": topo}))


def _world(nodes: int, topo: dict[str, object], **spec: object) -> World:
    w = World(raw_spec(nodes=nodes, **{"scheduling.topology": topo,
                                       "train.globalBatch": 4 * nodes}, **spec),
              nodes=tuple(sorted(RIG)))
    w.nodes = {n: _node(n, RIG[n]) for n in RIG}
    return w


def test_a_job_requiring_a_block_runs_there_with_ranks_in_topology_order() -> None:
    w = _world(3, {"required": L3})
    w.until("Running", step=1)
    placed = {p.rank: p.node for p in w.live()}
    assert placed == {0: "n1", 1: "n2", 2: "n4"}  # block b; the default scheduler took n0..n2
    assert "placed by network topology in " + L3 + "=b" in " ".join(
        e.message for e in w.events if e.reason == Reason.PLACED)


def test_a_job_no_domain_holds_waits_without_pods_and_starts_when_one_does() -> None:
    w = _world(5, {"required": L3})
    w.run(15)
    assert w.status.phase == "Pending" and not w.pods
    cond = next(c for c in w.status.conditions if c.type == "Schedulable")
    assert cond.status == "False" and cond.reason == Reason.TOPOLOGY_UNAVAILABLE
    assert w.status.reason == Reason.TOPOLOGY_UNAVAILABLE  # kubectl get pj's Why column
    assert f"no {L3} domain has 5 usable nodes (the largest, c, has 4)" in cond.message
    assert w.reasons().count(Reason.TOPOLOGY_UNAVAILABLE) == 1  # said once, not every pass
    w.nodes["n9"] = _node("n9", ("s1", "s2-y", "c"))  # capacity arrives in block c
    w.until("Running", step=1, limit=30)
    assert sorted(p.node for p in w.live()) == ["n5", "n6", "n7", "n8", "n9"]
    assert w.status.reason not in (None, Reason.TOPOLOGY_UNAVAILABLE)  # the wait is over
    w.run(2, step=1)
    cond = next(c for c in w.status.conditions if c.type == "Schedulable")
    assert cond.status == "True"


def test_a_job_requiring_a_level_no_node_carries_says_so() -> None:
    w = World(raw_spec(**{"scheduling.topology": {"required": L3}}))  # unlabelled nodes
    w.run(3)
    cond = next(c for c in w.status.conditions if c.type == "Schedulable")
    assert f"no usable node carries the label {L3}" in cond.message and not w.pods


def test_a_rank_whose_node_was_lost_comes_back_in_the_block_next_to_its_neighbours() -> None:
    w = _world(3, {"required": L2}, **{"faultTolerance.restartStrategy": "InPlace"})
    w.until("Running", step=1)
    before = {p.rank: p.node for p in w.live()}
    assert before == {0: "n5", 1: "n6", 2: "n7"}  # s2-y, the tightest switch holding 3
    w.node_down("n6")
    w.run(60, step=2)
    assert w.status.restarts.in_place == 1 and w.status.phase == "Running"
    after = {p.rank: p.node for p in w.live() if p.node != "n6"}
    # ranks 0 and 2 kept in place; rank 1 on the free node of the domain (n0..n4 are free too,
    # under the other switch; the default scheduler would take n0)
    assert after == {0: "n5", 1: "n8", 2: "n7"}


def test_a_gang_whose_block_lost_a_node_it_needs_moves_whole_to_a_block_that_holds_it(
        ) -> None:
    """A 2-node gang requiring one block gets block a (2 nodes, the tightest); n3 goes down.
    Block a can no longer hold the gang, so an in-place restart would leave rank 1's pod
    unschedulable for good: the gang is recreated and planned afresh, in block b, its ranks in
    topology order, and the restart says why."""
    w = _world(2, {"required": L3}, **{"faultTolerance.restartStrategy": "InPlace"})
    w.until("Running", step=1)
    assert {p.rank: p.node for p in w.live()} == {0: "n0", 1: "n3"}
    w.node_down("n3")
    w.run(90, step=2)
    assert w.status.phase == "Running" and w.status.attempt == 1
    assert not w.status.restarts.in_place
    assert {p.rank: p.node for p in w.live()} == {0: "n1", 1: "n2"}  # block b, in order
    said = " ".join(e.message for e in w.events if e.reason == Reason.NODE_LOST)
    assert f"its domain {L3}=a has 1 usable nodes of the 2 it needs, so it moves to {L3}=b" in said


def test_a_gang_no_other_block_holds_restarts_in_place_and_waits_in_its_own() -> None:
    """Block c (4 nodes) holds a 4-node gang; one goes down and no other block has 4: the gang
    restarts in place and its lost rank waits in block c (the node may come back) rather
    than being torn down for nothing."""
    w = _world(4, {"required": L3}, **{"faultTolerance.restartStrategy": "InPlace"})
    w.until("Running", step=1)
    w.node_down("n6")
    w.run(60, step=2)
    assert w.status.restarts.in_place == 1
    assert {p.node for p in w.live() if p.node} <= {"n5", "n7", "n8"}


def test_without_topology_pods_carry_no_topology_affinity() -> None:
    w = World(raw_spec())
    w.until("Running", step=1)
    assert not w.requires.get("tiny-a0-0") and not w.prefers.get("tiny-a0-0")
    assert Reason.PLACED not in w.reasons()



def test_a_gang_preferring_blocks_gets_its_planned_nodes_rank_by_rank() -> None:
    """Six ranks over blocks a (2), b (3) and one of c: the scheduler, free to put any pod
    anywhere, follows each pod's planned node (name order would give rank 1 a node of b)."""
    w = _world(6, {"preferred": L3})
    w.until("Running", step=1)
    placed = [p.node for p in sorted(w.live(), key=lambda p: p.rank or 0)]
    assert placed == ["n0", "n3", "n1", "n2", "n4", "n5"]
    assert [_block(n) for n in placed] == ["a", "a", "b", "b", "b", "c"]


def test_ultraserver_labels_as_levels_give_whole_ultraservers_ranks_by_node_id() -> None:
    """The Neuron docs' UltraServer labels (aws-neuron-sdk deploy/eks/ultraserver.rst:337-363:
    neuron.amazonaws.com/ultraserver-server-id-4 / -node-id-4) as levels: a 4-node job gets one
    whole UltraServer, ranks in (server id, node id) order, the order AWS's
    k8s-ultraserver-init-script.sh gives its topology ids and hostfile (`sort -t: -k1,1 -k2,2
    -k3,3` of server_id_N:node_id_N:fqdn); 8 nodes, two whole ones. Not server-id-2 between
    them: its values are random strings (the docs' example: u5wy80u0o2saugxy, ygml2651y0lwdd46),
    so the pair holding node ids 2 and 3 may sort first, as here."""
    us4, us2, nid = (f"neuron.amazonaws.com/ultraserver-{k}"
                     for k in ("server-id-4", "server-id-2", "node-id-4"))
    pair_ids = ("zq1", "ab7")  # the pair of node ids 0-1 sorts after that of 2-3
    nodes = [ObservedNode(f"ip-{server}-{9 - i}", labels={
        us4: f"us{server}", us2: f"{pair_ids[i // 2]}{server}", nid: str(i)})
        for server in (1, 2) for i in range(4)]
    topo = TopologySpec(required=us4, levels=[us4, nid])
    four = topology.plan(nodes, 4, topo)
    assert four is not None
    assert [n.labels[nid] for n in four] == ["0", "1", "2", "3"]  # names run the other way
    assert len({n.labels[us4] for n in four}) == 1
    eight = topology.plan(nodes, 8, TopologySpec(preferred=us4, levels=[us4, nid]))
    assert eight is not None
    assert [(n.labels[us4], n.labels[nid]) for n in eight] == [
        (f"us{s}", str(i)) for s in (1, 2) for i in range(4)]
    # with server-id-2 as a level between them, the ranks would follow the pairs' ids instead
    between = topology.plan(nodes, 4, TopologySpec(required=us4, levels=[us4, us2, nid]))
    assert between is not None
    assert [n.labels[nid] for n in between] == ["2", "3", "0", "1"]


# --- slices (scheduling.topology.sliceSize) -----------------------------------------------------

def test_slices_take_whole_ones_from_each_domain_never_part_of_one() -> None:
    """Blocks of 2, 3 and 4: 4 nodes preferring blocks in slices of 2 take one slice from each
    of two blocks, not the 3 + 1 of the plain plan (block c holds two slices: the largest room
    first); 6 nodes take c's two slices and one more; with slices of 3, 6 nodes would need
    two blocks of at least 3: b and c."""
    plain = topology.plan(NODES, 4, TopologySpec(preferred=L3))
    assert [_block(n) for n in _names(plain)] == ["c"] * 4
    sliced = topology.plan(NODES, 4, TopologySpec(preferred=L3, slice_size=2))
    assert [_block(n) for n in _names(sliced)] == ["c"] * 4  # c's room: two whole slices
    six = topology.plan(NODES, 6, TopologySpec(preferred=L3, slice_size=2))
    blocks = [_block(n) for n in _names(six)]
    assert blocks in (["a", "a", "c", "c", "c", "c"], ["b", "b", "c", "c", "c", "c"]), blocks
    threes = topology.plan(NODES, 6, TopologySpec(preferred=L3, slice_size=3))
    assert [_block(n) for n in _names(threes)] == ["b"] * 3 + ["c"] * 3
    # each pod required in its slice's block (a preferred level alone would require nothing)
    placed = topology.placements(six or [], TopologySpec(preferred=L3, slice_size=2))
    assert [placed[r].required for r in range(6)] == [(L3, b) for b in blocks]
    # every slice of consecutive ranks in one block
    for plan, size in ((six, 2), (threes, 3)):
        names = _names(plan)
        assert all(len({_block(n) for n in names[i:i + size]}) == 1
                   for i in range(0, len(names), size))


def test_too_few_whole_slices_is_no_plan_even_when_preferred() -> None:
    """8 nodes in slices of 3 need 3 blocks holding 3 each: only b and c do."""
    assert topology.plan(NODES, 9, TopologySpec(preferred=L3, slice_size=3)) is None
    assert topology.plan(NODES, 6, TopologySpec(required=L3, slice_size=3)) is None  # no 6
    one = topology.plan(NODES, 4, TopologySpec(required=L3, slice_size=2))
    assert [_block(n) for n in _names(one)] == ["c"] * 4


US4, NID4 = ("neuron.amazonaws.com/ultraserver-server-id-4",
             "neuron.amazonaws.com/ultraserver-node-id-4")


def _ultraservers(usable: int = 4) -> list[ObservedNode]:
    """Three 4-node UltraServers (the Neuron device plugin's labels); the third has `usable`
    nodes left."""
    return [ObservedNode(f"ip-{s}-{9 - i}", labels={US4: f"us{s}", NID4: str(i)})
            for s in (1, 2, 3) for i in range(4 if s < 3 else usable)]


def test_ultraservers_in_slices_of_4_are_taken_whole_ranks_by_node_id() -> None:
    topo = TopologySpec(preferred=US4, levels=[US4, NID4], slice_size=4)
    eight = topology.plan(_ultraservers(usable=3), 8, topo)
    assert [(n.labels[US4], n.labels[NID4]) for n in eight or []] == [
        (f"us{s}", str(i)) for s in (1, 2) for i in range(4)]
    assert topology.plan(_ultraservers(usable=3), 12, topo) is None  # us3 is not whole


def test_a_sliced_rank_made_again_goes_only_to_its_slice_s_domain() -> None:
    topo = TopologySpec(preferred=L3, slice_size=2)
    gang = {0: _node("n0", RIG["n0"]), 2: _node("n5", RIG["n5"]), 3: _node("n6", RIG["n6"])}
    free = [_node(n, RIG[n]) for n in ("n1", "n7")]
    # rank 1's slice is ranks 0-1, in block a: no free node there, so block a only
    assert topology.replacement(1, free, gang, topo) == RankPlacement(required=(L3, "a"))
    gang = {0: _node("n5", RIG["n5"]), 1: _node("n6", RIG["n6"]), 2: _node("n0", RIG["n0"])}
    place = topology.replacement(3, [_node(n, RIG[n]) for n in ("n3", "n7")], gang, topo)
    assert place.node == "n3" and place.required == (L3, "a")


def test_a_sliced_gang_whose_domain_lost_a_node_moves_whole_to_whole_slices() -> None:
    """A 4-node gang in slices of 2 preferring blocks takes block c (room for the most
    slices); rank 1's node goes down. Block c has 3 usable nodes left, one slice, not the two
    the gang has there, and an in-place restart could only put rank 1 in c (its slice's
    domain) or outside its slice: the gang is recreated on whole slices elsewhere, and the
    restart says why."""
    w = _world(4, {"preferred": L3, "sliceSize": 2},
               **{"faultTolerance.restartStrategy": "InPlace"})
    w.until("Running", step=1)
    before = {p.rank: p.node for p in w.live()}
    assert [_block(n) for _, n in sorted(before.items())] == ["c"] * 4, before
    w.node_down(before[1])
    w.run(90, step=2)
    assert w.status.phase == "Running" and w.status.attempt == 1
    after = {p.rank: p.node for p in w.live()}
    blocks = [_block(n) for _, n in sorted(after.items())]
    assert all(blocks[i] == blocks[i + 1] for i in (0, 2)), after  # slices whole
    assert before[1] not in after.values()
    said = " ".join(e.message for e in w.events if e.reason == Reason.NODE_LOST)
    assert f"its domain {L3}=c has 3 usable nodes of the 4 its slices of 2 need" in said


def test_a_slice_size_that_does_not_divide_the_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="sliceSize: 4 does not divide nodes"):
        PretrainJobSpec.model_validate(raw_spec(nodes=6, **{
            "scheduling.topology": {"preferred": L3, "sliceSize": 4},
            "train.globalBatch": 24}))
