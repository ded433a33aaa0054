"""Schemas of the built-in algorithms. They share the ``algorithm`` section; ``name`` picks one.

This module imports no torch (``rlcore plugins`` lists these schemas).
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


def _optional(validator):
    return attrs.validators.optional(validator)


def _check_dual_clip(instance, attribute, value):
    if value is not None and value <= 1.0:
        raise ValueError(
            f"{attribute.name} must be > 1 (dual clip bounds the loss of negative-advantage tokens at c*|A|), got {value}"
        )


def _check_clip_min(instance, attribute, value):
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1) (the ratio is clipped below at 1 - {attribute.name}), got {value}")


@frozen(kw_only=True)
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: weights or masks on tokens by p_train / p_generator
    (formulas and sources: :mod:`rlcore.algorithms.rollout_correction`)."""

    preset: Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"] = field(
        default="none", metadata=doc("none, token_tis / seq_tis (truncate at cap), token_mis / seq_mis (drop outside "
                                     "[low, high]), icepop (drop tokens outside [1/icepop_k, icepop_k])"))
    cap: float = field(default=2.0, validator=_positive, metadata=doc("truncation C of the *_tis presets"))
    low: float = field(default=0.5, validator=_positive, metadata=doc("lower bound of the ratio kept by the *_mis presets"))
    high: float = field(default=2.0, validator=_positive, metadata=doc("upper bound of the ratio kept by the *_mis presets"))
    icepop_k: float = field(default=2.0, metadata=doc("IcePop's band [1/k, k] (k > 1)"))

    def __attrs_post_init__(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.icepop_k <= 1.0:
            raise ValueError(f"icepop_k must be > 1 (the band is [1/k, k]), got {self.icepop_k}")


@frozen(kw_only=True)
class PolicyGradientConfig:
    """Clipped importance-ratio policy gradient, KL to the reference and off-policy correction."""

    ratio_clip_min: float = field(
        default=0.2, validator=_check_clip_min, metadata=doc("ratio clipped below at 1 - ratio_clip_min")
    )
    ratio_clip_max: float = field(
        default=0.2, validator=_non_negative,
        metadata=doc("ratio clipped above at 1 + ratio_clip_max (DAPO clip-higher: > ratio_clip_min)"),
    )
    ratio_clip_c: float | None = field(
        default=None, validator=_check_dual_clip,
        metadata=doc("dual clip: loss of A<0 tokens at most c*|A|; None disables (c > 1)"),
    )
    kl_coef: float = field(
        default=0.0, validator=_non_negative,
        metadata=doc("weight of the KL penalty to the reference policy; 0 skips the reference pass"),
    )
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k3", metadata=doc("KL estimator: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r with r = p_ref / p")
    )
    use_old_logprobs: Literal["auto", True, False] = field(
        default="auto",
        metadata=doc("ratio against the old policy's logprobs (a logprob pass before training); false = against the "
                     "current policy's, detached (equal when one optimizer step trains on each generated batch); auto "
                     "= false when rlcore.run sees one optimizer step per batch (sync or async), else true"),
    )
    gen_is_cap: float | None = field(
        default=None, validator=_optional(_positive),
        metadata=doc("shorthand for rollout_correction {preset: token_tis, cap: gen_is_cap}; None disables"),
    )
    rollout_correction: RolloutCorrectionConfig = field(
        factory=RolloutCorrectionConfig, metadata=doc("correction for the generator-trainer mismatch (needs gen_logprobs)"))

    def __attrs_post_init__(self) -> None:
        if self.gen_is_cap is not None and self.rollout_correction.preset != "none":
            raise ValueError(f"gen_is_cap ({self.gen_is_cap}) and rollout_correction.preset "
                             f"({self.rollout_correction.preset!r}) are both set; keep one")

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The correction in effect (``gen_is_cap`` as the token_tis preset)."""
        if self.gen_is_cap is not None:
            return attrs.evolve(self.rollout_correction, preset="token_tis", cap=self.gen_is_cap)
        return self.rollout_correction


@frozen(kw_only=True)
class GroupAdvantageConfig(PolicyGradientConfig):
    """Group-relative advantages (shared by GRPO, DAPO and GSPO)."""

    leave_one_out_baseline: bool = field(default=False, metadata=doc("baseline = mean of the group's other rewards"))
    normalize_std: bool = field(default=True, metadata=doc("divide advantages by the group's reward std"))
    std_floor: float = field(default=1e-6, validator=_positive, metadata=doc("std is floored at this value before dividing"))


@frozen(kw_only=True)
class GRPOConfig(GroupAdvantageConfig):
    name: Literal["grpo"] = field(default="grpo", metadata=doc("algorithm"))
    loss_level: Literal["token", "sequence"] = field(
        default="token",
        metadata=doc("token: mean over the step's tokens; sequence: mean over sequences of per-sequence token means"),
    )


def _check_overlong(instance, attribute, value):
    if instance.overlong_buffer_length > 0:
        if instance.max_response_length is None:
            raise ValueError("overlong_buffer_length > 0 needs max_response_length")
        if instance.overlong_buffer_length > instance.max_response_length:
            raise ValueError(
                f"overlong_buffer_length ({instance.overlong_buffer_length}) exceeds "
                f"max_response_length ({instance.max_response_length})"
            )


@frozen(kw_only=True)
class DAPOConfig(GroupAdvantageConfig):
    name: Literal["dapo"] = field(default="dapo", metadata=doc("algorithm"))
    ratio_clip_max: float = field(
        default=0.28, validator=_non_negative, metadata=doc("clip-higher: ratio clipped above at 1 + ratio_clip_max")
    )
    loss_level: Literal["token", "sequence"] = field(default="token", metadata=doc("DAPO uses token-level normalization"))
    dynamic_sampling: bool = field(default=True, metadata=doc("drop groups whose rewards are all equal (zero gradient)"))
    max_refill_rounds: int = field(
        default=3, validator=_non_negative, metadata=doc("extra generation rounds the run loop may do to refill dropped groups")
    )
    overlong_filtering: bool = field(default=False, metadata=doc("do not train on truncated responses"))
    max_response_length: int | None = field(
        default=None, validator=_optional(_positive), metadata=doc("L_max of the overlong penalty (usually the generation limit)")
    )
    overlong_buffer_length: int = field(
        default=0, validator=[_non_negative, _check_overlong],
        metadata=doc("L_cache: penalty ramps over the last L_cache tokens before L_max; 0 disables"),
    )
    overlong_penalty_factor: float = field(default=1.0, validator=_non_negative, metadata=doc("penalty at (and past) L_max"))


@frozen(kw_only=True)
class GSPOConfig(GroupAdvantageConfig):
    name: Literal["gspo"] = field(default="gspo", metadata=doc("algorithm"))
    ratio_clip_min: float = field(
        default=3e-4, validator=_check_clip_min, metadata=doc("sequence ratio clipped below at 1 - ratio_clip_min")
    )
    ratio_clip_max: float = field(
        default=4e-4, validator=_non_negative, metadata=doc("sequence ratio clipped above at 1 + ratio_clip_max")
    )


@frozen(kw_only=True)
class DrGRPOConfig(PolicyGradientConfig):
    name: Literal["dr_grpo"] = field(default="dr_grpo", metadata=doc("algorithm"))
    normalizer_length: int = field(
        default=1024, validator=_positive,
        metadata=doc("constant token normalizer per sequence (usually the max response length)"),
    )


@frozen(kw_only=True)
class RLOOConfig(PolicyGradientConfig):
    name: Literal["rloo"] = field(default="rloo", metadata=doc("algorithm"))
    loss_level: Literal["token", "sequence"] = field(default="token", metadata=doc("token or sequence mean (see grpo)"))


@frozen(kw_only=True)
class ReinforcePPConfig(PolicyGradientConfig):
    name: Literal["reinforce_pp"] = field(default="reinforce_pp", metadata=doc("algorithm"))
    group_baseline: bool = field(
        default=True, metadata=doc("subtract the group mean before batch normalization (REINFORCE++-baseline)")
    )
    std_floor: float = field(default=1e-6, validator=_positive, metadata=doc("batch std is floored at this value"))
    loss_level: Literal["token", "sequence"] = field(default="token", metadata=doc("token or sequence mean (see grpo)"))


@frozen(kw_only=True)
class SFTConfig:
    name: Literal["sft"] = field(default="sft", metadata=doc("algorithm"))



def _check_is_clip_min(instance, attribute, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1] (the weight is truncated below at 1 - {attribute.name}; "
                         f"1 = no lower bound), got {value}")


@frozen(kw_only=True)
class CISPOConfig(GroupAdvantageConfig):
    """CISPO (:mod:`rlcore.algorithms.cispo`): the ratio clips only a detached weight, never the gradient."""

    name: Literal["cispo"] = field(default="cispo", metadata=doc("algorithm"))
    ratio_clip_min: float = field(
        default=1.0, validator=_check_is_clip_min,
        metadata=doc("IS weight truncated below at 1 - ratio_clip_min; 1 (default, as MiniMax-M1) = no lower bound"))
    ratio_clip_max: float = field(
        default=0.28, validator=_non_negative, metadata=doc("IS weight truncated above at 1 + ratio_clip_max"))
    loss_level: Literal["token", "sequence"] = field(
        default="token", metadata=doc("token (as the paper): mean over the step's tokens; sequence: per-sequence means"))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.ratio_clip_c is not None:
            raise ValueError(f"ratio_clip_c ({self.ratio_clip_c}) has no meaning for cispo: no token's gradient is "
                             "dropped by clipping, so there is no dual clip to bound it; leave it unset")



@frozen(kw_only=True)
class CriticConfig:
    """``algorithm.critic``: the value model PPO trains beside the policy, on the policy's training
    backend and ranks (its layout section), with its own optimizer, scheduler and micro-batches.
    Unset (None) keys take the policy's values."""

    model_name: str | None = field(
        default=None, metadata=doc("the critic's Hugging Face checkpoint (a causal LM gets a fresh value head, zero-"
                                   "initialized; a *ForTokenClassification one with one label keeps its head); None = "
                                   "the policy's"))
    lr: float = field(default=1e-5, validator=_positive, metadata=doc("the critic's peak learning rate"))
    weight_decay: float | None = field(default=None, validator=_optional(_non_negative),
                                       metadata=doc("decoupled weight decay; None = policy.optimizer.weight_decay"))
    max_grad_norm: float | None = field(default=None, validator=_optional(_non_negative),
                                        metadata=doc("gradient-norm clip; None = policy.max_grad_norm"))
    warmup_steps: int | None = field(default=None, validator=_optional(_non_negative),
                                     metadata=doc("linear learning-rate warmup steps; None = policy.scheduler.warmup_steps"))
    train_mb_tokens: int | None = field(default=None, validator=_optional(_positive),
                                        metadata=doc("token budget of a packed training micro-batch; None = the policy's"))
    values_mb_tokens: int | None = field(default=None, validator=_optional(_positive),
                                         metadata=doc("token budget of a packed micro-batch of the values pass; None = "
                                                      "policy.sequence_packing.logprob_mb_tokens"))


def _check_unit(instance, attribute, value):
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


@frozen(kw_only=True)
class PPOConfig(PolicyGradientConfig):
    """PPO with a learned critic and GAE (:mod:`rlcore.algorithms.ppo`)."""

    name: Literal["ppo"] = field(default="ppo", metadata=doc("algorithm"))
    gamma: float = field(default=1.0, validator=_check_unit, metadata=doc("discount per generated token"))
    gae_lambda: float = field(default=1.0, validator=_check_unit,
                              metadata=doc("GAE's lambda: 1 = Monte-Carlo returns minus values, 0 = one-step TD"))
    whiten_advantages: bool = field(default=True, metadata=doc("advantages to zero mean, unit variance over the step's valid tokens"))
    kl_penalty_coef: float = field(
        default=0.0, validator=_non_negative,
        metadata=doc("beta of the per-token KL penalty in the reward, -beta * KL(p_old || p_ref) on every token; 0 "
                     "skips it (kl_coef is the loss term, as in grpo)"))
    kl_penalty_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1", metadata=doc("estimator of the reward's per-token KL (k1 = log p_old - log p_ref, as InstructGPT)"))
    value_clip: float | None = field(
        default=0.2, validator=_optional(_positive),
        metadata=doc("eps_v: the critic's new values are clipped to old +- eps_v in the value loss; None disables"))
    critic_warmup_steps: int = field(
        default=0, validator=_non_negative, metadata=doc("steps that train the critic alone before the policy trains"))
    loss_level: Literal["token", "sequence"] = field(default="token", metadata=doc("token or sequence mean (see grpo)"))
    critic: CriticConfig = field(factory=CriticConfig, metadata=doc("the value model"))


def _check_label_smoothing(instance, attribute, value):
    if not 0.0 <= value < 0.5:
        raise ValueError(f"{attribute.name} must be in [0, 0.5) (the probability that a pair's label is flipped), got {value}")


@frozen(kw_only=True)
class DPOConfig:
    """DPO on preference pairs (:mod:`rlcore.algorithms.dpo`); runs with a preference dataset."""

    name: Literal["dpo"] = field(default="dpo", metadata=doc("algorithm"))
    beta: float = field(default=0.1, validator=_positive, metadata=doc("inverse temperature of the implicit reward beta * log(p / p_ref)"))
    label_smoothing: float = field(
        default=0.0, validator=_check_label_smoothing,
        metadata=doc("conservative DPO: assumed probability that a pair's preference is flipped; 0 = plain DPO"))
    sft_loss_weight: float = field(
        default=0.0, validator=_non_negative,
        metadata=doc("weight of the NLL of the chosen response (per-token mean per pair) added to the loss; 0 disables"))
    reference_free: bool = field(
        default=False, metadata=doc("no reference policy (log p_ref = 0): skips the reference pass"))


@frozen(kw_only=True)
class RewardModelConfig:
    """Bradley-Terry reward model on preference pairs (:mod:`rlcore.algorithms.reward_model`)."""

    name: Literal["reward_model"] = field(default="reward_model", metadata=doc("algorithm"))
    center_coef: float = field(
        default=0.0, validator=_non_negative,
        metadata=doc("weight of the centering term (r_c + r_r)^2 that keeps rewards near 0 (Eisenstein et al. 2023); 0 disables"))


@frozen(kw_only=True)
class DistillationConfig(PolicyGradientConfig):
    """On-policy distillation from a teacher checkpoint (:mod:`rlcore.algorithms.distillation`)."""

    name: Literal["distillation"] = field(default="distillation", metadata=doc("algorithm"))
    teacher_model: str | None = field(
        default=None, metadata=doc("the teacher's Hugging Face checkpoint directory (the policy's tokenizer); required to run"))
    teacher_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata=doc("dtype the teacher scores in"))
    teacher_device: Literal["auto", "cpu", "cuda"] = field(
        default="auto", metadata=doc("where the teacher scores the rollouts (auto: cuda when available)"))
    teacher_batch_size: int = field(default=32, validator=_positive, metadata=doc("sequences per teacher forward pass"))
    use_old_logprobs: bool = field(
        default=False, metadata=doc("ratio and advantage against the old policy's logprobs; false = one on-policy update "
                                    "per batch against the current policy (detached)"))


ALGORITHM_CONFIGS = {
    c.__attrs_attrs__.name.default: c
    for c in (GRPOConfig, DAPOConfig, GSPOConfig, DrGRPOConfig, RLOOConfig, ReinforcePPConfig, SFTConfig, CISPOConfig,
              DPOConfig, RewardModelConfig, PPOConfig)
}
