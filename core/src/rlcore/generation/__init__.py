"""Generating and scoring trajectories: the built-in transformers generator, multi-turn rollouts, the teacher and trajectory batches; imports config, interfaces, data and training."""
