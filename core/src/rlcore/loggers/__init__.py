"""Metric loggers (JSONL, TensorBoard, Weights & Biases, MLflow), registered by rlcore.builtin, and rollout traces; imports config and deadlines."""
