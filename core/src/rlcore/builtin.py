"""rlcore's own plugin: built-in algorithms and loggers, registered like any third party's.

Factories are "module:attr" strings so that listing them imports no torch.
"""

from __future__ import annotations

from rlcore.algorithms.config import (
    CISPOConfig,
    DAPOConfig,
    DistillationConfig,
    DPOConfig,
    DrGRPOConfig,
    GRPOConfig,
    GSPOConfig,
    PPOConfig,
    ReinforcePPConfig,
    RewardModelConfig,
    RLOOConfig,
    SFTConfig,
)
from rlcore.loggers.config import JsonlLoggerConfig, MlflowLoggerConfig, TensorboardLoggerConfig, WandbLoggerConfig
from rlcore.plugins import hookimpl


@hookimpl
def rlcore_loggers(register):
    register("jsonl", "rlcore.loggers.jsonl:JsonlLogger", JsonlLoggerConfig, format="jsonl")
    register("tensorboard", "rlcore.loggers.tensorboard:TensorboardLogger", TensorboardLoggerConfig, requires=("tensorboard",))
    register("wandb", "rlcore.loggers.external:WandbLogger", WandbLoggerConfig, requires=("wandb",))
    register("mlflow", "rlcore.loggers.external:MlflowLogger", MlflowLoggerConfig, requires=("mlflow",))


@hookimpl
def rlcore_generators(register):
    from rlcore.config.hf_generation import HFGenerationConfig

    register("hf", "rlcore.generation.hf_generator:build", HFGenerationConfig, devices=("cpu", "cuda"), async_engine=False, exact=True)


@hookimpl
def rlcore_algorithms(register):
    register("grpo", "rlcore.algorithms.grpo:GRPO", GRPOConfig, loss_level="token|sequence")
    register("dapo", "rlcore.algorithms.dapo:DAPO", DAPOConfig, loss_level="token|sequence", dynamic_sampling=True)
    register("gspo", "rlcore.algorithms.gspo:GSPO", GSPOConfig, loss_level="sequence")
    register("dr_grpo", "rlcore.algorithms.dr_grpo:DrGRPO", DrGRPOConfig, loss_level="sequence")
    register("rloo", "rlcore.algorithms.rloo:RLOO", RLOOConfig, loss_level="token|sequence")
    register("reinforce_pp", "rlcore.algorithms.reinforce_pp:ReinforcePP", ReinforcePPConfig, loss_level="token|sequence")
    register("sft", "rlcore.algorithms.sft:SFT", SFTConfig, loss_level="token", trains_on="answers")
    register("cispo", "rlcore.algorithms.cispo:CISPO", CISPOConfig, loss_level="token|sequence")
    register("ppo", "rlcore.algorithms.ppo:PPO", PPOConfig, loss_level="token|sequence", critic=True)
    register("dpo", "rlcore.algorithms.dpo:DPO", DPOConfig, loss_level="sequence", trains_on="pairs",
             pair_trainer="rlcore.controller.pairs:policy_pair_trainer")
    register("reward_model", "rlcore.algorithms.reward_model:RewardModel", RewardModelConfig, loss_level="sequence",
             trains_on="pairs", pair_trainer="rlcore.reward_model.trainer:build", head="scalar")
    register("distillation", "rlcore.algorithms.distillation:Distillation", DistillationConfig, loss_level="token|sequence",
             teacher="rlcore.generation.teacher:build_teacher")


@hookimpl
def rlcore_datasets(register):
    from rlcore.config.images import CountingTaskConfig, ImageDataConfig
    from rlcore.data.preference.config import PreferenceDataConfig

    register("preference", "rlcore.data.preference.data:build_preference_dataset", PreferenceDataConfig,
             provides="pairs", requires=("datasets",))
    register("images", "rlcore.data.image_data:build_from_config", ImageDataConfig, requires=("PIL",))
    register("image_counting", "rlcore.data.image_data:build_counting", CountingTaskConfig, requires=("PIL",))


@hookimpl
def rlcore_environments(register):
    from rlcore.config.agents import AgentEnvConfig
    from rlcore.reward_model.config import RewardModelEnvConfig

    register("reward_model", "rlcore.reward_model.env:build", RewardModelEnvConfig, devices=("cpu", "cuda"))
    register("counting", "rlcore.data.image_data:counting_env", None)
    # conformance="plugin": its agent scores trajectories through the endpoint, never step() (which
    # refuses); the agents' own tests (core/tests/test_agents_*) hold it to its contract.
    register("agent", "rlcore.agents.environment:build", AgentEnvConfig, multi_turn=True, endpoint="openai",
             requires=("fastapi", "uvicorn", "openai"), conformance="plugin")
