"""One sync and one async vLLM engine per test session (engine start is the expensive part).

Both run their engine core out of process (vLLM's default), so the pytest process never owns
vLLM's torch.distributed group; refits into them go through shared memory.
"""

from __future__ import annotations

import pytest

MAX_MODEL_LEN = 192


def _build(model_dir, *, async_engine: bool):
    from rlcore_vllm.config import VllmConfig
    from rlcore_vllm.generator import VllmGenerator

    cfg = VllmConfig(async_engine=async_engine, enforce_eager=True, kv_cache_space_gib=0.125, max_num_seqs=64,
                     refit=dict_refit())
    return VllmGenerator(str(model_dir), cfg, max_model_len=MAX_MODEL_LEN, dtype="float32", seed=0)


def dict_refit():
    from rlcore_vllm.config import RefitConfig

    return RefitConfig(chunk_bytes=64 << 10, probe_threshold=1e-3)  # small chunks split layers across chunks


@pytest.fixture(scope="session")
def vllm_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="session")
def sync_generator(vllm_model_dir):
    gen = _build(vllm_model_dir, async_engine=False)
    yield gen
    gen.shutdown()


@pytest.fixture(scope="session")
def async_generator(vllm_model_dir):
    gen = _build(vllm_model_dir, async_engine=True)
    yield gen
    gen.shutdown()


@pytest.fixture(scope="session")
def hf_model(vllm_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
