"""PPO's critic in a plan: its two phases, and its state's trips to host memory.

The critic is a value model (the policy's body with a one-wide head, or ``algorithm.critic.model_name``'s)
on the trainer's ranks and layout (:mod:`rlcore.controller.critic_step`). Each step it runs a values pass (a
forward, priced like a logprob pass) and a training pass (priced like the policy's, with its own 1-wide
output in place of the vocabulary's logits). When the trainer's state leaves the GPU while the engine is
awake, the critic's goes with it and comes back for its two phases: its weights, gradients and optimizer
state cross to host memory and back each step (counted in the offload phase). Its memory beside the
policy's is :func:`rlcore.planning.memory.estimate`'s.
"""

from __future__ import annotations

from rlcore.planning import memory
from rlcore.planning.calibration import Calibration
from rlcore.planning.hardware import Cluster
from rlcore.planning.layout import Layout, Workload
from rlcore.planning.shapes import ModelShape

def state_gib(model: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration) -> float:
    """The critic's state between its passes on its busiest GPU (:func:`rlcore.planning.memory.idle_state`)."""
    stages = ["first", "last"] if lay.pp > 1 else ["last"]
    return max(sum(memory.idle_state(memory.training_parts(model, work, lay, cluster, cal, s), lay).values())
               for s in stages)


def phases(model: ModelShape, work: Workload, lay: Layout, cluster: Cluster, cal: Calibration, pass_s) -> dict:
    """``values`` and ``critic`` seconds (``pass_s(forward_only)`` prices a pass of ``model`` on the trainer's
    layout), and ``offload``: the critic's state moved to and from host memory when the trainer's leaves."""
    out = {"values": pass_s(True), "critic": pass_s(False)}
    if lay.colocated and work.generation and lay.releases_state:
        out["offload"] = 2 * state_gib(model, work, lay, cluster, cal) * 2**30 / (cal.offload_gbps * 1e9)
    return out
