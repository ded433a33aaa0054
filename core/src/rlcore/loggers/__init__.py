"""Metric loggers (JSONL, TensorBoard, Weights & Biases, MLflow), registered by rlcore.builtin."""
