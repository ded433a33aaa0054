"""What the run calls on an algorithm and on a training backend (its ranks, its critic, a preference trainer)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable, TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlcore.interfaces.data import NamedTensors, PackedMicroBatch, PreferencePair, SequenceBatch, StepTotals


@runtime_checkable
class Algorithm(Protocol):
    """Advantage estimation and loss of one RL (or SFT) algorithm.

    Optional members, each declared by its own protocol, with defaults in
    :class:`rlcore.algorithms.base.AlgorithmBase` (which the built-in algorithms subclass):
    ``max_refill_rounds`` (:class:`RefillRounds`; an algorithm without it gets no refill rounds),
    ``capturable_loss`` (:class:`CapturableLoss`; without it no backend captures the loss),
    ``choose_old_logprobs`` (:class:`OldLogprobsChoice`; without it ``uses_old_logprobs`` stands)."""

    name: str
    uses_reference: bool  # the step must compute ref_logprobs
    uses_old_logprobs: bool  # the step must compute old_logprobs (importance ratio)
    loss_level: Literal["token", "sequence"]  # which StepTotals count normalizes the loss

    def shape_rewards(self, rewards_N: torch.Tensor, response_lengths_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        """Reward shaping before advantages (identity for most; DAPO's overlong penalty)."""

    def keep_trajectories(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        """Bool [N]: which trajectories to train on (DAPO dynamic sampling/overlong filter)."""

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        """Per-sequence advantages [N] from rewards and group ids."""

    def loss(self, logprobs_T: torch.Tensor, mb: PackedMicroBatch,
             totals: StepTotals) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """This micro-batch's share of the step loss (see module docstring) and its metrics:
        floats or detached 0-d tensors. Tensors let a backend read all metrics of a step with
        one device sync instead of one per micro-batch (the built-in algorithms return them)."""


@runtime_checkable
class RefillRounds(Protocol):
    """An :class:`Algorithm` that may ask for more rounds of rollouts when it drops whole groups
    (DAPO's dynamic sampling): after a step's first round keeps fewer than P*G trajectories, the
    run generates up to ``max_refill_rounds`` more rounds of P prompts (0: none, the default of
    :class:`rlcore.algorithms.base.AlgorithmBase`; an algorithm without the attribute gets none)."""

    max_refill_rounds: int


@runtime_checkable
class OldLogprobsChoice(Protocol):
    """An :class:`Algorithm` whose old-logprob pass may be skipped: it can take the current
    policy's logprobs, detached, as its importance ratio's denominator, which equals the old
    policy's when each batch trains exactly one optimizer step: the run loop takes the old
    logprobs right before that step, from the weights the step starts at, whichever policy version
    generated the batch (sync or async). ``rlcore.run`` calls :meth:`choose_old_logprobs` once before the run on the algorithm it
    uses, built from the recipe or passed as an object (an algorithm without the method keeps the
    ``uses_old_logprobs`` it declares). The built-in policy-gradient algorithms have it
    (``algorithm.use_old_logprobs: auto``)."""

    def choose_old_logprobs(self, one_update_per_batch: bool) -> bool:
        """Settle ``uses_old_logprobs`` for this run and return it: ``one_update_per_batch`` says
        whether each generated batch trains exactly one optimizer step.
        An algorithm asked explicitly (a config key) keeps its setting."""


@runtime_checkable
class CapturableLoss(Protocol):
    """An :class:`Algorithm` whose ``loss`` a backend may capture once in a CUDA graph and replay
    for other micro-batches of the same shapes (``policy.megatron_cfg.cuda_graph: micro_batch``).
    With ``capturable_loss`` true the loss promises: no host reads of tensor values (``.item()``,
    ``float(t)``, ``bool(t)``, ``.tolist()``, ``nonzero``, boolean-mask indexing or other
    data-dependent shapes) except in checks skipped while :func:`rlcore.algorithms.base.capturing`
    (``core/tests/test_capturable_loss.py`` checks the built-in ones); :class:`StepTotals` used in arithmetic only (it may hold 0-d device tensors); no reads of
    the micro-batch's host-side fields (``cu_seqlens``, ``seq_ids``, ``num_padding``, ``max_seqlen``:
    a graph would keep the captured micro-batch's); the same Python branches for every micro-batch
    with the same fields; metrics as 0-d tensors; and padding
    ignored: tokens with ``loss_mask_T == 0`` and sequences with no tokens (``seq_index_T`` never
    points at them) change neither the loss nor its gradient. The built-in policy-gradient
    algorithms and ``sft`` declare it; DPO and the reward model (pairs found on the host) do not."""

    capturable_loss: bool


@runtime_checkable
class TrainingBackend(Protocol):
    """Trains the policy. Built once per trainer rank; every rank gets the same calls.

    Optional: ``offload`` and ``onload`` (:class:`OffloadingBackend`), for
    ``policy.generation.colocated.offload_trainer_state`` (a run with the key on and a backend
    without them fails naming the key).
    """

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False) -> list[torch.Tensor] | None:
        """Token-aligned float32 logprobs [L_i] of each sequence (CPU). Rank 0 returns all N;
        other ranks may return None. ``reference=True`` uses the frozen initial policy. Values
        are required where ``loss_mask > 0`` (the tokens a loss, KL term or refit probe reads);
        elsewhere a backend may return 0 (it need not compute prompt tokens' logits)."""

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """Optimizer step(s) on ``batch`` with ``algorithm.loss`` (one per
        ``policy.train_global_batch_size`` sequences: :func:`rlcore.training.steps.train_in_optimizer_steps`);
        returns summed metrics plus ``loss``, ``grad_norm``, ``lr``, ``num_micro_batches``,
        ``num_optimizer_steps``. A non-finite loss skips that update and counts it in
        ``skipped_nonfinite``."""

    def export_weights(self, dtype: Any = None, chunk_bytes: int = 1 << 30) -> Iterator[NamedTensors]:
        """Chunks of (Hugging Face name, tensor) covering the whole model in ``dtype`` (a torch dtype or its
        name, e.g. ``"bfloat16"``; None: the backend's compute dtype), each at most ``chunk_bytes`` (one tensor
        larger than that forms its own chunk). Rank 0 yields; other ranks iterate too (collectives) and yield
        nothing."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None:
        """Write the trained policy as a Hugging Face checkpoint (safetensors + config)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class OffloadingBackend(Protocol):
    """A :class:`TrainingBackend` that can free its GPU memory while a colocated generator works
    (``policy.generation.colocated.offload_trainer_state``)."""

    def offload(self, *, keep_weights: bool = False) -> None:
        """Move the optimizer state and gradients, and the weights unless ``keep_weights``, to host
        memory, freeing their GPU memory (may be a no-op on CPU; a no-op when already offloaded;
        gradients need not survive, the next step zeroes them)."""

    def onload(self) -> None:
        """Undo :meth:`offload`, before the next ``logprobs`` or ``train``."""


@runtime_checkable
class TrainerHandle(Protocol):
    """The trainer ranks as the run loop and weight transports see them, wherever they run.

    Every method runs the same call on every rank (SPMD backends need that) and returns rank 0's
    result. Implemented by :class:`rlcore.controller.workers.LocalTrainer` (the backend in this
    process) and :class:`rlcore.controller.workers.RayTrainerGroup` (one Ray actor per rank,
    every wait bounded by ``cluster.timeout_s`` and a dead rank named at once). ``what``
    describes the call in those errors.
    """

    loop_step: int  # the run loop's step (not the backend's optimizer step): named in errors

    @property
    def in_process(self) -> bool:
        """Whether rank 0's backend lives in this process (one rank, no Ray): a transport may then
        hand this process's tensors to the generator directly."""

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False, what: str = "") -> list[torch.Tensor]:
        """:meth:`TrainingBackend.logprobs` on every rank; rank 0's (all N sequences)."""

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """:meth:`TrainingBackend.train` on every rank; rank 0's metrics."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def offload(self, *, keep_weights: bool = False) -> None:
        """The backend's optional ``offload`` (:class:`OffloadingBackend`) on every rank; a backend
        without it: an error naming the key."""

    def onload(self) -> None:
        """The backend's optional ``onload`` on every rank."""

    def export_chunks(self, dtype: Any = None, chunk_bytes: int = 1 << 30) -> Iterator[NamedTensors]:
        """Rank 0's :meth:`TrainingBackend.export_weights` chunks, in this process."""

    def run_on_ranks(self, fn: str, *args: Any, what: str = "") -> list[Any]:
        """``fn(backend, rank, world_size, *args)`` next to every rank's backend; all ranks' results
        in rank order. ``fn`` is a ``"module:attr"`` string imported in each rank's process, so a
        plugin's code (e.g. a weight sender) runs in the trainer processes."""

    def shutdown(self) -> None: ...


@runtime_checkable
class CriticHandle(Protocol):
    """A value model trained beside the policy (PPO's critic), wherever its ranks run.

    A training backend provides one through its registration's ``critic`` capability, a
    ``"module:attr"`` factory ``(config, section_config, world) -> critic`` called in every trainer
    rank's process with a :class:`~rlcore.config.RunConfig` whose ``policy`` keys are the critic's
    (:func:`rlcore.controller.critic_step.critic_run_config`); the run reaches it through this
    protocol (:class:`rlcore.controller.critic_step.RankCritic`). Every method runs on every rank
    and returns rank 0's result, as :class:`TrainerHandle`'s do.

    Values are token-aligned like logprobs: ``values(batch)[i][t]`` is the critic's estimate of
    the return from token t of sequence i on, read from the prefix ``ids[:t]`` (the hidden state
    of token t-1); index 0 is 0. They are required where ``loss_mask > 0``."""

    def values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Token-aligned float32 values [L_i] of each sequence (CPU), in batch order."""

    def train(self, batch: SequenceBatch, loss: Any) -> dict[str, float]:
        """Optimizer step(s) of the critic on ``loss.loss(values_T, mb, totals)`` (global
        normalization, as :meth:`Algorithm.loss`); metrics as :meth:`TrainingBackend.train`."""

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG into the new directory ``path`` (resumable)."""

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None:
        """The critic as a Hugging Face ``*ForTokenClassification`` checkpoint with one label."""

    def offload(self) -> None:
        """Optimizer state, gradients and weights to host memory (a no-op on CPU)."""

    def onload(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class CriticAlgorithm(Protocol):
    """An :class:`Algorithm` that trains with a critic (``ppo``): the run builds a
    :class:`CriticHandle` for it and :mod:`rlcore.controller.critic_step` calls these."""

    uses_critic: bool
    value_loss: Any  # what CriticHandle.train gets: loss(values_T, mb, totals) -> (loss, metrics)

    def token_targets(self, batch: SequenceBatch, values: list[torch.Tensor],
                      rewards_N: torch.Tensor) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """Token fields (``advantages``, ``returns``, ``values``) from the critic's values and the
        shaped rewards, and their metrics."""

    def trains_policy(self, step: int) -> bool:
        """Whether run-loop step ``step`` (from 1) trains the policy (not during a critic warm-up)."""


@runtime_checkable
class PairTrainer(Protocol):
    """What the pairwise loop (:mod:`rlcore.controller.pairs`) trains: DPO through a training
    backend, or a reward model."""

    def train_pairs(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """One step on these pairs; metrics under ``train/``."""

    def evaluate(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """Held-out metrics under ``val/`` (``val/accuracy``: fraction of pairs ranked right)."""

    def save(self, path: str) -> None:
        """Write the trained model as a Hugging Face checkpoint."""

    def save_checkpoint(self, path: str) -> None:
        """Write what resuming needs (model, optimizer, RNG) into the new directory ``path``
        (called when ``checkpointing.enabled``)."""

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    def shutdown(self) -> None: ...
