"""PPO's critic in the run: built beside the policy, one call per step, saved with it.

The critic runs in the trainer's own processes, colocated with the policy on its ranks and
process group: the training backend's registration names a factory (capability ``critic``,
``"module:attr"``), and :class:`RankCritic` builds one critic per trainer rank through
:meth:`rlcore.interfaces.TrainerHandle.run_on_ranks`, keeping it next to that rank's backend
(the same code path for a one-process run and for Ray actors). The critic is the backend's model
with a scalar head, trained with a copy of the run config whose ``policy`` keys are the critic's
(:func:`critic_run_config`): its own optimizer, scheduler, micro-batching and packing.

One step (:func:`before_training`, called by the learner after the logprob passes): the values
pass (timed ``values``), the algorithm's per-token targets (GAE), the critic's update (timed
``critic_train``); the policy then trains unless the critic is still warming up. With
``policy.generation.colocated.offload_trainer_state`` the critic's state lives in host memory
outside these two phases, as the policy's does while the engine generates.

Checkpoints hold the critic in ``critic/`` beside the policy's ``backend/``; the end of a run
exports it as a Hugging Face checkpoint to ``<log_dir>/critic``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from rlcore.config import ConfigError
from rlcore.interfaces import CriticAlgorithm, CriticHandle, Placement, SequenceBatch, TrainerHandle, WorldInfo
from rlcore.utils import resolve

CRITIC_DIR = "critic"

# Each trainer process's critics, by the id of the backend they sit beside (one per process in a run).
_CRITICS: dict[int, Any] = {}


def critic_run_config(config: Any, critic: Any) -> Any:
    """``config`` with the critic's model, optimizer, scheduler and packing in ``policy`` (unset keys
    of ``algorithm.critic`` keep the policy's); LoRA off: the critic trains all its weights."""
    policy = config.policy
    optimizer = attrs.evolve(policy.optimizer, lr=critic.lr,
                             weight_decay=policy.optimizer.weight_decay if critic.weight_decay is None else critic.weight_decay)
    scheduler = policy.scheduler if critic.warmup_steps is None else attrs.evolve(policy.scheduler, warmup_steps=critic.warmup_steps)
    packing = policy.sequence_packing
    packing = attrs.evolve(packing, train_mb_tokens=critic.train_mb_tokens or packing.train_mb_tokens,
                           logprob_mb_tokens=critic.values_mb_tokens or packing.logprob_mb_tokens)
    policy = attrs.evolve(policy, model_name=critic.model_name or policy.model_name, optimizer=optimizer, scheduler=scheduler,
                          sequence_packing=packing, lora=attrs.evolve(policy.lora, enabled=False),
                          max_grad_norm=policy.max_grad_norm if critic.max_grad_norm is None else critic.max_grad_norm)
    return attrs.evolve(config, policy=policy)


# ---- in each trainer rank's process -----------------------------------------------------------
def _critic(backend: Any) -> Any:
    found = _CRITICS.get(id(backend))
    if found is None:
        raise RuntimeError("no critic was built in this trainer process (RankCritic builds it first)")
    return found


def _build(backend, rank: int, world_size: int, factory: str, config: Any, section: Any, placement: Placement) -> None:
    # local rank 0, as the trainer's backends are built: each trainer process sees its one device
    world = WorldInfo(rank, world_size, 0, placement.device, placement)
    _CRITICS[id(backend)] = resolve(factory)(config, section, world)


def _values(backend, rank, world_size, batch):
    return _critic(backend).values(batch)


def _train(backend, rank, world_size, batch, loss):
    return _critic(backend).train(batch, loss)


def _save(backend, rank, world_size, path):
    return _critic(backend).save_checkpoint(path)


def _load(backend, rank, world_size, path):
    return _critic(backend).load_checkpoint(path)


def _export(backend, rank, world_size, path):
    return _critic(backend).export_hf(path)


def _offload(backend, rank, world_size):
    return _critic(backend).offload()


def _onload(backend, rank, world_size):
    return _critic(backend).onload()


def _shutdown(backend, rank, world_size):
    critic = _CRITICS.pop(id(backend), None)
    if critic is not None:
        critic.shutdown()


class RankCritic:
    """:class:`rlcore.interfaces.CriticHandle` of a critic on every trainer rank (see the module docstring)."""

    def __init__(self, trainer: TrainerHandle, factory: str, config: Any, section: Any, placement: Placement):
        self.trainer = trainer
        self._call("_build", factory, config, section, placement, what="'critic' (building it)")

    def _call(self, fn: str, *args, what: str) -> Any:
        return self.trainer.run_on_ranks(f"{__name__}:{fn}", *args, what=what)[0]

    def values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        return self._call("_values", batch, what="'values' (critic)")

    def train(self, batch: SequenceBatch, loss: Any) -> dict[str, float]:
        return self._call("_train", batch, loss, what="'train' (critic)")

    def save_checkpoint(self, path: str) -> None:
        self._call("_save", path, what="'save_checkpoint' (critic)")

    def load_checkpoint(self, path: str) -> None:
        self._call("_load", path, what="'load_checkpoint' (critic)")

    def export_hf(self, path: str) -> None:
        self._call("_export", path, what="'export_hf' (critic)")

    def offload(self) -> None:
        self._call("_offload", what="'offload' (critic)")

    def onload(self) -> None:
        self._call("_onload", what="'onload' (critic)")

    def shutdown(self) -> None:
        self._call("_shutdown", what="'shutdown' (critic)")


def trains_critic(algorithm: Any) -> bool:
    """Whether ``algorithm`` trains with a critic (:class:`rlcore.interfaces.CriticAlgorithm`)."""
    return isinstance(algorithm, CriticAlgorithm) and bool(algorithm.uses_critic)


def build_critic(config: Any, algorithm: Any, trainer: TrainerHandle, registration: Any, placement: Placement) -> CriticHandle | None:
    """The critic ``algorithm`` trains with (None for critic-free algorithms), on the trainer's ranks."""
    if not trains_critic(algorithm):
        return None
    factory = None if registration is None else registration.capabilities.get("critic")
    if factory is None:
        who = "a training backend passed as an object" if registration is None else f"the training backend '{registration.name}'"
        raise ConfigError("algorithm.name", f"'{algorithm.name}' trains a critic, and {who} provides none (its "
                          "registration has no 'critic' capability); use the fsdp2 or megatron backend")
    critic_cfg = config.require_section("algorithm").critic
    return RankCritic(trainer, factory, critic_run_config(config, critic_cfg), config.section(registration.section), placement)


# ---- in the run loop --------------------------------------------------------------------------
@attrs.frozen
class CriticStep:
    """What :func:`before_training` did: metrics for the step's record, and whether the policy trains."""

    metrics: dict[str, float]
    trains_policy: bool


def before_training(critic: CriticHandle | None, algorithm: Any, batch: SequenceBatch, rewards_N: torch.Tensor,
                    step: int, timer: Any, offload: bool) -> CriticStep:
    """Values, the algorithm's per-token targets (into ``batch.token_fields``) and the critic's
    update; a no-op for an algorithm without a critic."""
    if critic is None:
        return CriticStep({}, True)
    with timer.phase("values"):
        if offload:
            critic.onload()
        values = critic.values(batch)
    fields, metrics = algorithm.token_targets(batch, values, rewards_N)
    batch.token_fields.update(fields)
    with timer.phase("critic_train"):
        out = critic.train(batch, algorithm.value_loss)
        if offload:
            critic.offload()
    metrics.update({f"critic/{k}": float(v) for k, v in out.items()})
    trains = algorithm.trains_policy(step)
    if not trains:
        metrics["critic/warmup"] = 1.0
    return CriticStep(metrics, trains)


def save_critic(critic: CriticHandle | None, backend_path: str, offloaded: bool = False) -> None:
    """The critic beside the policy's state ``backend_path`` of a checkpoint, in ``critic/``; an
    ``offloaded`` critic (``offload_trainer_state``) comes back for the save and leaves again."""
    if critic is None:
        return
    if offloaded:
        critic.onload()
    critic.save_checkpoint(str(Path(backend_path).parent / CRITIC_DIR))
    if offloaded:
        critic.offload()


def load_critic(critic: CriticHandle | None, backend_path: str) -> None:
    """The counterpart of :func:`save_critic`."""
    if critic is None:
        return
    where = Path(backend_path).parent / CRITIC_DIR
    if not where.is_dir():
        raise FileNotFoundError(f"{where} is missing: the checkpoint was written without a critic")
    critic.load_checkpoint(str(where))


def export_at_end(critic: CriticHandle | None, run_dir: Path, offloaded: bool = False) -> Path | None:
    """The trained critic as a Hugging Face checkpoint in ``<run_dir>/critic``; an ``offloaded``
    critic comes back for it (the caller frees the engine's memory first)."""
    if critic is None:
        return None
    from rlcore.config.run_paths import inside, replace_dir

    out = inside(run_dir, CRITIC_DIR)
    if offloaded:
        critic.onload()
    return replace_dir(out, lambda path: critic.export_hf(str(path)), "the critic")
