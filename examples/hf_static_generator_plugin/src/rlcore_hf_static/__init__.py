"""rlcore-hf-static: an example third-party rlcore generator on ``transformers``' ``generate()`` with a static KV cache."""

__version__ = "0.1.0"
