"""Reward models: training one on preference pairs (algorithm ``reward_model``, driven by the
pairwise loop) and scoring GRPO trajectories with it (environment ``reward_model``); imports config,
interfaces, algorithms and training."""
