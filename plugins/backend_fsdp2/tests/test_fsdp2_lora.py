"""LoRA on the fsdp2 backend (policy.lora): only adapters train, the reference is the base model,
refit/export weights are merged in fp32 and load into plain transformers, and the PEFT adapter
written by export_hf gives the same logprobs through peft."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Found, not imported, at collection: importing peft takes seconds, paid by the tests that run here.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed (rlcore-fsdp2[lora])")


@pytest.fixture(scope="module")
def lora_trainer(single_process_group, tiny_model_dir):
    from rlcore import build_config
    from rlcore.runtime import LocalTrainer
    from rlcore.plugins import get_plugin_manager

    config = build_config({"policy": {"model_name": str(tiny_model_dir), "precision": "float32",
                                      "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "dtensor_cfg": {"enabled": True},
                                      "lora": {"enabled": True, "rank": 4, "alpha": 8}}})
    reg = get_plugin_manager().get("training_backend", "fsdp2")
    trainer = LocalTrainer.build(reg, config, config.section(reg.section))
    yield trainer
    trainer.shutdown()


def _batch():
    from rlcore.interfaces import SequenceBatch

    ids = [torch.tensor([3, 10, 11, 12, 13, 14]), torch.tensor([3, 20, 21, 22])]
    return SequenceBatch(input_ids=ids, loss_mask=[torch.ones(6), torch.ones(4)])


def _hf_logprobs(model, batch):
    from rlcore.training.ops import token_logprobs

    with torch.no_grad():
        return [token_logprobs(model(input_ids=ids[None]).logits[0], ids) for ids in batch.input_ids]


def test_lora_trains_adapters_merges_and_exports(lora_trainer, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlcore.algorithms.sft import SFT

    backend, batch = lora_trainer.backend, _batch()
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    before = lora_trainer.logprobs(batch)
    losses = [lora_trainer.train(batch, SFT())["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    after, ref = lora_trainer.logprobs(batch), lora_trainer.logprobs(batch, reference=True)
    assert all(torch.equal(r, b) for r, b in zip(ref, before))  # the reference is the base model
    assert max(float((a - b).abs().max()) for a, b in zip(after, before)) > 1e-2
    merged = dict(kv for chunk in lora_trainer.export_chunks() for kv in chunk)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert set(merged) == set(plain.state_dict())  # the base model's Hugging Face names, no adapter tensors
    plain.load_state_dict(merged, strict=True)
    for got, want in zip(_hf_logprobs(plain, batch), after):
        assert torch.allclose(got, want, atol=1e-5)
    backend.export_hf(str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "export" / "adapter").eval()
    for a, b, want in zip(_hf_logprobs(exported, batch), _hf_logprobs(peft_model, batch), after):
        assert torch.allclose(a, want, atol=1e-5) and torch.allclose(b, want, atol=1e-5)


def test_merge_happens_in_fp32_before_the_cast():
    from rlcore_fsdp2.lora import merged

    base, a, b = torch.ones(1, 1), torch.full((1, 1), 0.5), torch.full((1, 1), 1e-3)  # update 2 * 0.5 * 1e-3 = 1e-3
    named = [("m.q_proj.base_layer.weight", base), ("m.q_proj.lora_A.default.weight", a),
             ("m.q_proj.lora_B.default.weight", b), ("m.norm.weight", torch.ones(1))]
    out = dict(merged(iter(named), 2.0, torch.float32))
    assert set(out) == {"m.q_proj.weight", "m.norm.weight"} and float(out["m.q_proj.weight"]) == pytest.approx(1.001)
    # merging in bf16 loses it: 1 + 1e-3 rounds to 1 (bf16 spacing at 1 is 2^-7)
    assert float(base.bfloat16() + (2.0 * (b @ a)).bfloat16()) == 1.0
    with pytest.raises(RuntimeError, match="missing a base weight or an adapter"):
        list(merged(iter(named[1:3]), 2.0, torch.float32))


def test_lora_config_errors_name_the_key(tiny_model_dir):
    from rlcore import build_config
    from rlcore_fsdp2.lora import apply_lora
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception, match="policy.lora.rank"):
        build_config({"policy": {"model_name": "x", "lora": {"rank": 0}}})
    with pytest.raises(Exception, match="policy.lora.rnk"):
        build_config({"policy": {"model_name": "x", "lora": {"rnk": 4}}})
    config = build_config({"policy": {"model_name": "x", "lora": {"enabled": True, "target_modules": ["qkv"]}}})
    with pytest.raises(ValueError, match="policy.lora.target_modules=\\['qkv'\\]"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config.policy.lora)
