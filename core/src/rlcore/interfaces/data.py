"""The data passed between the parts: samples, sampling parameters, generation results, environment steps, sequence batches and their images, placements, preference pairs and datasets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch


NamedTensors = list[tuple[str, "torch.Tensor"]]


@attrs.define
class ImageInputs:
    """The processed images of one prompt (or of several, concatenated in order).

    With ``image_grid_thw_I3`` (int64 [images, 3], Qwen-VL) ``pixel_values`` is float [patches, patch
    dim] and the patches of image i are rows ``sum(prod(grid[:i])) ..``; without it (fixed-resolution
    families, LLaVA) ``pixel_values`` is float [images, 3, H, W]."""

    pixel_values: torch.Tensor
    image_grid_thw_I3: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        grid = self.image_grid_thw_I3
        return int(self.pixel_values.shape[0] if grid is None else grid.shape[0])

    def to(self, device: Any, non_blocking: bool = False) -> ImageInputs:
        grid = self.image_grid_thw_I3
        return ImageInputs(self.pixel_values.to(device, non_blocking=non_blocking),
                           None if grid is None else grid.to(device, non_blocking=non_blocking))

    def model_inputs(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward that carry these images."""
        inputs = {"pixel_values": self.pixel_values.to(dtype)}
        if self.image_grid_thw_I3 is not None:
            inputs["image_grid_thw"] = self.image_grid_thw_I3
        return inputs

    @staticmethod
    def concat(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The images of several prompts, in order (None: none had any)."""
        import torch

        present = [p for p in parts if p is not None and p.num_images]
        if not present:
            return None
        grids = [p.image_grid_thw_I3 for p in present]
        if any(g is None for g in grids) and not all(g is None for g in grids):
            raise ValueError("ImageInputs.concat: some parts have image_grid_thw and others not (images of two model families)")
        return ImageInputs(torch.cat([p.pixel_values for p in present]),
                           None if grids[0] is None else torch.cat(grids))


@attrs.define
class Sample:
    """One prompt of a dataset, with what the environment needs to score answers to it."""

    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    answer: Any = None  # ground truth, for the environment
    prompt_ids: list[int] | None = None  # filled by the dataset (chat template applied)
    metadata: dict[str, Any] = attrs.field(factory=dict)
    index: int = -1  # position in its dataset (data-order resume)
    response: str | None = None  # a reference response (the ``sft`` loop's target); None: ``str(answer)``
    # The prompt's processed images (vision-language models, :mod:`rlcore.data.multimodal`): ``prompt_ids``
    # then hold each image's placeholder tokens. None: a text-only prompt.
    images: ImageInputs | None = None


@attrs.define
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256  # = rlcore.config.generation.DEFAULT_MAX_NEW_TOKENS (test_config_core checks)
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


@attrs.define
class GenerationResult:
    """One sampled response. ``response_mask`` is 0 on tokens the model did not write
    (observations spliced in by a multi-turn environment); None means all ones."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # generator's logprob of each response token (0 where mask is 0)
    finish_reason: str  # "stop", "length", "abort", or "truncated_prompt"
    text: str = ""
    response_mask: list[int] | None = None
    policy_version: int = 0
    num_turns: int = 1
    # Mixture-of-experts generators that report their routing (routing replay R3): an integer array
    # [len(prompt_ids) + len(response_ids) - 1, MoE layers, top-k], the experts each MoE layer chose
    # for every token fed to the model (the last sampled token never is). None: not reported.
    routed_experts: Any = None
    # Earlier segments of an agent's trajectory whose history the agent rewrote (compaction, edits,
    # a dropped ``<think>``): sequences of their own that train with this trajectory's reward and
    # advantage (:mod:`rlcore.agents`). None: one sequence.
    segments: list[GenerationResult] | None = None
    # What an agent's conversation held beyond its tokens, request by request: the messages each
    # request added (tool results among them), the reply and its tool calls (rollout traces,
    # :mod:`rlcore.loggers.traces`). None: not recorded.
    turns: list[dict] | None = None

    @classmethod
    def dropped(cls, prompt_ids: list[int], policy_version: int) -> GenerationResult:
        """The empty answer to a prompt the engine's context cannot hold (``prompt_overflow: drop``)."""
        return cls(prompt_ids=list(prompt_ids), response_ids=[], response_logprobs=[], finish_reason="truncated_prompt",
                   policy_version=policy_version)


@attrs.define
class EnvStep:
    """An environment's answer to one trajectory's latest model turn."""

    reward: float = 0.0
    done: bool = True
    observation: str | None = None  # shown to the model as the next user/tool turn when not done
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.define
class StepTotals:
    """Global counts of one optimizer step, over every micro-batch and data-parallel rank.

    A backend that replays a captured CUDA graph of the loss passes the same counts as 0-d device
    tensors (float64), refilled before each replay: a Python number would be baked into the graph.
    Losses that declare :class:`~rlcore.interfaces.training.CapturableLoss` use them in arithmetic only."""

    num_valid_tokens: int
    num_valid_seqs: int


@attrs.define
class SequenceBatch:
    """The sequences of one training step, on CPU.

    ``input_ids[i]`` is prompt + response of sequence i (1-D int64); ``loss_mask[i]`` matches it.
    ``token_fields`` hold token-aligned per-token floats (``advantages``, ``old_logprobs``,
    ``ref_logprobs``, ``gen_logprobs``); ``seq_fields`` hold one float per sequence
    (``rewards``, ``advantages``).
    """

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    token_fields: dict[str, list[torch.Tensor]] = attrs.field(factory=dict)
    seq_fields: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # The generator's MoE routing per sequence (routing replay R3): int16 [len, MoE layers, top-k],
    # -1 where it reported none; None when the generator reported no routing.
    routed_experts: list[torch.Tensor] | None = None
    # Each sequence's prompt images (vision-language models), None where it has none; None: a
    # text-only batch. A sequence's image placeholder tokens in ``input_ids`` match its images.
    images: list[ImageInputs | None] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [int(x.numel()) for x in self.input_ids]

    def select(self, indices: Sequence[int]) -> SequenceBatch:
        return SequenceBatch(
            input_ids=[self.input_ids[i] for i in indices],
            loss_mask=[self.loss_mask[i] for i in indices],
            token_fields={k: [v[i] for i in indices] for k, v in self.token_fields.items()},
            seq_fields={k: v[list(indices)] for k, v in self.seq_fields.items()},
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in indices],
            images=None if self.images is None else [self.images[i] for i in indices],
        )


@attrs.frozen
class Placement:
    """Where a run's trainer and generator go. Computed once by core
    (:func:`rlcore.controller.placement.plan_placement`) and handed, the same object, to the
    backend factory (``WorldInfo.placement``) and to the generator factory."""

    device: Literal["cpu", "cuda"] = "cpu"
    trainer_ranks: int = 1  # trainer processes (GPUs on a GPU run)
    use_ray: bool = False  # trainer ranks are Ray actors (else the one rank runs in the driver)
    colocated: bool = True  # generation shares the trainer's devices
    # When not colocated on GPUs of one node with a local Ray instance: the devices left to generation
    # (as CUDA_VISIBLE_DEVICES names them); the trainer's actors hold the others. Empty otherwise.
    generator_gpus: tuple[str, ...] = ()
    # The run's memory plan (rlcore.planning.run_memory), for recipes that leave these keys auto: the
    # engine's share of a GPU (None: the generator's own choice, or no plan), and whether the trainer's
    # gradients and optimizer state leave the GPU while a colocated engine is awake.
    engine_memory_fraction: float | None = None
    offload_trainer_state: bool = False


@attrs.frozen
class WorldInfo:
    """The process a backend is built in. torch.distributed is initialized before the factory runs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    placement: Placement = attrs.field(factory=Placement)


class PackedMicroBatch(Protocol):
    """What a loss reads of one micro-batch in the flat packed layout (``T`` tokens, ``n`` real
    sequences); :class:`rlcore.data.packing.MicroBatch` is the one backends build and documents each field.
    Declared here so that this module needs nothing of :mod:`rlcore.data.packing`, which imports it."""

    input_ids_T: torch.Tensor  # int64 [T]
    position_ids_T: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [n+1], host side
    max_seqlen: int
    seq_ids: list[int]  # indices of the n sequences in the SequenceBatch
    seq_index_T: torch.Tensor  # int64 [T], -1 on padding
    loss_mask_T: torch.Tensor  # float [T]
    token_fields: dict[str, torch.Tensor]  # each float [T]
    seq_fields: dict[str, torch.Tensor]  # each [n]
    num_padding: int

    @property
    def num_seqs(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@runtime_checkable
class Named(Protocol):
    """A plugin object with a name of its own for messages: :class:`~rlcore.interfaces.training.Algorithm` and
    :class:`~rlcore.interfaces.generation.WeightTransport` declare one; an :class:`~rlcore.interfaces.generation.Environment` may (see :func:`plugin_name`)."""

    name: str


def plugin_name(obj: Any) -> str:
    """The name ``obj`` goes by in the run's messages: its ``name`` (:class:`Named`) when that is a
    non-empty string, else its class's name."""
    name = obj.name if isinstance(obj, Named) else None
    return name if isinstance(name, str) and name else type(obj).__name__


@runtime_checkable
class PromptDataset(Protocol):
    train: Sequence[Sample]
    validation: Sequence[Sample] | None


@attrs.define
class PreferencePair:
    """One preference: the same prompt answered twice, ``chosen`` preferred over ``rejected``.
    Token ids; ``source`` names where the pair came from (``file:row``) for errors."""

    prompt_ids: list[int]
    chosen_ids: list[int]  # response tokens only (EOS or the template's end-of-turn included)
    rejected_ids: list[int]
    source: str = ""


@runtime_checkable
class PreferenceDataset(Protocol):
    train: Sequence[PreferencePair]
    validation: Sequence[PreferencePair] | None
