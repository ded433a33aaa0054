"""A model written by ``rlcore export`` (from an fsdp2 run checkpoint) generates in the session's vLLM
engine exactly as ``transformers`` does with the exported directory: its Hugging Face names and
layouts are what vLLM loads. (The engine itself is the session one: no extra engine start.)"""

from __future__ import annotations

import pytest
import torch
import yaml

from rlcore.interfaces import SamplingParams

from _vllm_helpers import hf_greedy, hf_token_logprobs, state_dict_trainer

pytestmark = pytest.mark.vllm


@pytest.fixture
def exported_dir(vllm_model_dir, tmp_path, single_process_group):
    """One fsdp2 training step from the engine's model, saved as a run checkpoint, then exported."""
    pytest.importorskip("rlcore_fsdp2", reason="the checkpoint is written by the FSDP2 backend (rlcore-fsdp2)")
    from rlcore import build_config
    from rlcore.runtime import CheckpointManager, to_dict
    from rlcore.runtime import export_checkpoint
    from rlcore.interfaces import SequenceBatch, WorldInfo
    from rlcore.plugins import get_plugin_manager
    from rlcore_fsdp2.backend import FSDP2Backend

    run_dir = tmp_path / "run"
    config = build_config({"policy": {"model_name": str(vllm_model_dir), "precision": "float32", "max_grad_norm": None,
                                      "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True}},
                           "logger": {"log_dir": str(run_dir)}})
    backend = FSDP2Backend(config, config.section("policy.dtensor_cfg"), WorldInfo(0, 1))
    ids = [torch.arange(3, 23), torch.arange(30, 42)]
    backend.train(SequenceBatch(input_ids=ids, loss_mask=[torch.ones(len(t)) for t in ids]),
                  get_plugin_manager().get("algorithm", "sft").build(None))
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
    CheckpointManager(run_dir / "checkpoints", 1).save(1, backend.save_checkpoint, {"step": 1, "run": {"log_dir": str(run_dir)}})
    backend.shutdown()
    export_checkpoint(run_dir, tmp_path / "exported")
    return tmp_path / "exported"


def test_an_exported_checkpoint_generates_in_vllm_like_transformers(sync_generator, hf_model, exported_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlcore.plugins import get_plugin_manager

    exported = load_file(str(exported_dir / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(exported_dir, dtype=torch.float32).eval()
    assert max(float((exported[k] - v).abs().max()) for k, v in hf_model.state_dict().items() if k in exported) > 1e-3
    transport = get_plugin_manager().weight_transport(trainer=state_dict_trainer(exported), generator=sync_generator)
    prompts = [[5, 6, 7, 8, 9], [3, 40, 41, 42]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    try:
        transport.transfer(state_dict_trainer(exported), sync_generator)
        got = [r[0].response_ids for r in sync_generator.generate(prompts, greedy)]
        assert got == [hf_greedy(reference, p, 12) for p in prompts]
        seq = prompts[0] + got[0]
        assert (torch.tensor(sync_generator.score([seq])[0]) - hf_token_logprobs(reference, seq)).abs().max().item() < 1e-3
    finally:
        transport.transfer(state_dict_trainer(dict(hf_model.state_dict())), sync_generator)
