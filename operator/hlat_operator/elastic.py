"""Elastic sizing (spec.elastic): which size a job short of nodes shrinks to, and which size it
grows back to, as pure functions of the spec, the size it runs at and the nodes it can use.

The global batch is kept at every size (the trainer's data lanes make every step's batch the
same sequences: docs/trainer.md), so a size must divide it: `PretrainJobSpec.sizes`. The size
is state, not spec: `effective` is the spec the gang of an attempt is built from (its pods,
Leases and the config the trainers read), `spec.nodes` the size it returns to.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from hlat_api.spec import PretrainJobSpec
from hlat_operator.observe import ObservedNode

MAX_RESIZES = 10
"""status.size.resizes keeps the last this many."""


def applies(spec: PretrainJobSpec, queued: bool) -> bool:
    """Whether the job resizes: spec.elastic set, and not in a Kueue queue (its Workload's pod
    count is the full size). Under Volcano the PodGroup's minMember follows the size."""
    return spec.elastic is not None and not queued


def effective(spec: PretrainJobSpec, size: int | None) -> PretrainJobSpec:
    """The spec an attempt at `size` nodes runs (None: spec.nodes): `PretrainJobSpec.at_size`,
    which the trainers apply to the spec as written from the world they were started in
    (`PretrainJobSpec.at_world`)."""
    return spec.at_size(size)


def pace(spec: PretrainJobSpec, size: int) -> str:
    """What a size costs a step, for the Events: nothing to say where its data-parallel ranks
    split the micro-batches evenly; otherwise how many ranks train one more and the speed."""
    sized = effective(spec, size)
    if not sized.uneven:
        return ""
    most, dp = sized.grad_accum_steps, sized.data_parallel
    more = sized.micro_batches_per_step % dp
    return (f"; {more} of its {dp} data-parallel ranks train {most} micro-batches a step, the "
            f"others {most - 1}: about {spec.speed_at(size):.0%} of full speed")


def can_host(node: ObservedNode, selector: Mapping[str, str]) -> bool:
    """Could take a worker pod now: Ready, not cordoned, carrying the selector's labels."""
    return node.ready and not node.cordoned and all(
        node.labels.get(k) == v for k, v in selector.items())


def usable_nodes(nodes: Iterable[ObservedNode], selector: Mapping[str, str],
                 avoided: Collection[str] = ()) -> list[ObservedNode]:
    """Nodes a worker could run on now, healthy ones only (the job's own included: they host
    its pods), less those the job avoids (its avoid list: a job that can train on fewer nodes
    does not go back to a node that failed it before the entry expires)."""
    return [n for n in nodes if can_host(n, selector) and n.healthy and n.name not in avoided]


def usable(nodes: Iterable[ObservedNode], selector: Mapping[str, str],
           avoided: Collection[str] = ()) -> int:
    """How many `usable_nodes` there are."""
    return len(usable_nodes(nodes, selector, avoided))


def smallest(spec: PretrainJobSpec) -> int:
    """The fewest nodes the job can train at (elastic.minNodes, or the next size up that keeps
    the global batch)."""
    assert spec.elastic is not None
    return min(spec.sizes(spec.elastic.min_nodes))


def shrink_to(spec: PretrainJobSpec, current: int, usable_nodes: int) -> int | None:
    """The largest size below `current` that fits the usable nodes and keeps the global batch,
    not below elastic.minNodes; None when there is none (the job waits)."""
    assert spec.elastic is not None
    return next((n for n in spec.sizes(spec.elastic.min_nodes)
                 if n < current and n <= usable_nodes), None)


def grow_to(spec: PretrainJobSpec, current: int, usable_nodes: int) -> int | None:
    """The largest size above `current`, up to spec.nodes, that the usable nodes hold; None
    when there is none."""
    assert spec.elastic is not None
    return next((n for n in spec.sizes(spec.elastic.min_nodes)
                 if current < n <= usable_nodes), None)
