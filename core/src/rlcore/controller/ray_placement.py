"""Ray placement groups for the trainer ranks: one bundle per rank, checked against the cluster first.

A placement group whose bundles no node can ever hold stays pending forever (Ray only logs a
warning), so the request is compared with the alive nodes' *total* resources before it is made,
and one that cannot fit fails at once naming the strategy, the bundles and what is missing.
Resources that exist but are held by other jobs are waited for, up to ``cluster.timeout_s``.

Bundles: ``{"CPU": 1}`` per rank on a CPU run (``cluster.cpu_workers`` ranks), ``{"CPU": 1,
"GPU": 1}`` per rank on a GPU run (``cluster.gpus_per_node x num_nodes`` less the generator's
GPUs when not colocated; see :mod:`rlcore.controller.placement`). Strategies are Ray's:
``PACK`` (as few nodes as possible), ``SPREAD`` (as many as possible), ``STRICT_PACK`` (one
node), ``STRICT_SPREAD`` (one node per rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlcore.interfaces import Placement

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_SHOWN = ("CPU", "GPU")  # resources a bundle asks for; nodes also list memory, node:<ip>, custom ones


def rank_bundles(placement: Placement) -> list[dict[str, float]]:
    bundle = {"CPU": 1.0, "GPU": 1.0} if placement.device == "cuda" else {"CPU": 1.0}
    return [dict(bundle) for _ in range(placement.trainer_ranks)]


def _fits(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` one node holds."""
    return int(min(node.get(key, 0.0) // need for key, need in bundle.items() if need > 0))


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{key} {resources.get(key, 0.0):g}" for key in _SHOWN if key in resources or key == "CPU")


def unsatisfiable(bundles: Sequence[Mapping[str, float]], nodes: Mapping[str, Mapping[str, float]], strategy: str) -> str | None:
    """Why ``nodes`` (node address -> total resources) can never hold ``bundles`` placed with
    ``strategy``; None when they can. The bundles are identical (one per rank)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; choose one of {STRATEGIES}")
    if not bundles:
        return None
    bundle, n = bundles[0], len(bundles)
    per_node = {name: _fits(resources, bundle) for name, resources in nodes.items()}
    ask = f"{n} trainer ranks need {n} bundles of {{{_describe(bundle)}}} ({strategy})"
    listing = "; ".join(f"{name}: {_describe(res)}" for name, res in nodes.items()) or "none"
    have = f"the Ray cluster's {len(nodes)} alive node(s) ({listing})"
    if strategy == "STRICT_PACK":
        if any(count >= n for count in per_node.values()):
            return None
        missing = {key: n * need - max((res.get(key, 0.0) for res in nodes.values()), default=0.0) for key, need in bundle.items()}
        return f"{ask}, all on one node, but no node of {have} holds them: the largest lacks {_missing(missing)}"
    if strategy == "STRICT_SPREAD":
        usable = sum(count >= 1 for count in per_node.values())
        if usable >= n:
            return None
        return f"{ask}, each on its own node, but {have} has only {usable} node(s) that hold one: {n - usable} node(s) missing"
    if sum(per_node.values()) >= n:
        return None
    missing = {key: n * need - sum(res.get(key, 0.0) for res in nodes.values()) for key, need in bundle.items()}
    if any(value > 0 for value in missing.values()):
        return f"{ask}, but {have} has in all {_missing(missing, short=True)}"
    return f"{ask}, but the nodes of {have} hold only {sum(per_node.values())} whole bundles between them"


def _missing(missing: Mapping[str, float], short: bool = False) -> str:
    parts = [f"{value:g} {key}" for key, value in missing.items() if value > 0]
    return ("too few: " if short else "") + (", ".join(parts) or "nothing") + (" missing" if short else "")


def alive_node_resources(ray) -> dict[str, dict[str, float]]:
    """Total resources of each alive node, keyed ``<address> (<node id prefix>)``."""
    return {f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})": dict(n.get("Resources", {}))
            for n in ray.nodes() if n.get("Alive")}


def create_rank_placement_group(ray, placement: Placement, strategy: str, timeout_s: float):
    """The trainer ranks' placement group, ready; bundle ``i`` is rank ``i``'s."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = rank_bundles(placement)
    reason = unsatisfiable(bundles, alive_node_resources(ray), strategy)
    if reason is not None:
        raise PlacementError(f"cannot place the trainer: {reason}; lower cluster.cpu_workers (CPU) or cluster.gpus_per_node "
                             "x num_nodes (GPU), change cluster.placement_strategy, or add nodes")
    group = placement_group(bundles, strategy=strategy, name="rlcore-trainer")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(f"the trainer's placement group ({len(bundles)} x {bundles[0]}, {strategy}) was not ready after "
                             f"{timeout_s:.0f}s (cluster.timeout_s): the cluster could hold it, but other jobs hold the resources; "
                             f"available now: {_describe(ray.available_resources())}")
    return group


class PlacementError(RuntimeError):
    """The Ray cluster cannot hold the trainer's placement group."""
