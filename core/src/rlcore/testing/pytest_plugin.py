"""Fixtures rlcore ships to any pytest run where rlcore is installed (entry point pytest11).

Heavy imports stay inside the fixtures. Models are built once per session.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from rlcore.testing.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved random-init tiny Llama (fp32) with its tokenizer; returns the directory."""
    from rlcore.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(arch, **config_kwargs) -> path``; each (arch, kwargs) is built once per session."""
    from rlcore.testing.tiny import build_tiny_model

    cache: dict = {}

    def factory(arch: str = "llama", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)
        return cache[key]

    return factory
