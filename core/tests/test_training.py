"""The outer layer both training backends share (rlcore.training.steps, MicroBatch.to, the HF writer)."""

from __future__ import annotations

import json

import pytest
import torch

from rlcore.interfaces import SequenceBatch
from rlcore.data.packing import make_micro_batches
from rlcore.training.steps import combine_optimizer_steps, sum_over_ranks, train_in_optimizer_steps
from rlcore.training.weights import chunked, write_hf_checkpoint


def _batch(n: int) -> SequenceBatch:
    ids = [torch.arange(1, 4 + i) for i in range(n)]
    return SequenceBatch(input_ids=ids, loss_mask=[torch.ones(len(x)) for x in ids],
                         seq_fields={"rewards": torch.arange(n, dtype=torch.float32)})


def _step(loss: float, mbs: int, lr: float, skipped: bool = False) -> dict[str, float]:
    out = {"loss": loss, "grad_norm": 1.0, "lr": lr, "num_micro_batches": float(mbs)}
    return {**out, "skipped_nonfinite": 1.0} if skipped else out


def test_a_step_splits_into_optimizer_steps_of_the_global_batch_size():
    seen = []

    def step(part):
        seen.append(part.seq_fields["rewards"].tolist())
        return _step(float(len(part)), 1, 0.1 * len(seen))

    out = train_in_optimizer_steps(_batch(5), 2, step, "test backend")
    assert seen == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert out["loss"] == pytest.approx(5 / 3) and out["lr"] == pytest.approx(0.3)
    assert out["num_micro_batches"] == 3 and out["num_optimizer_steps"] == 3 and "skipped_nonfinite" not in out
    assert train_in_optimizer_steps(_batch(5), None, step, "x")["num_optimizer_steps"] == 1  # unset: one step
    with pytest.raises(ValueError, match="test backend: train\\(\\) got an empty batch"):
        train_in_optimizer_steps(_batch(0), 2, step, "test backend")


def test_skipped_steps_are_counted_apart_from_the_updates():
    one = combine_optimizer_steps([_step(float("nan"), 2, 0.1, skipped=True)])
    assert one["num_optimizer_steps"] == 0 and one["skipped_nonfinite"] == 1 and one["num_micro_batches"] == 2
    two = combine_optimizer_steps([_step(1.0, 2, 0.1), _step(float("nan"), 3, 0.2, skipped=True)])
    assert two["num_optimizer_steps"] == 1 and two["skipped_nonfinite"] == 1 and two["num_micro_batches"] == 5
    assert two["lr"] == 0.2


def test_metrics_summed_over_one_rank_are_themselves(single_process_group):
    assert sum_over_ranks({"loss": 2.5, "nll": 1.0}) == {"loss": 2.5, "nll": 1.0}


def test_micro_batch_to_moves_tokens_and_keeps_boundaries_on_the_host():
    (mb,) = make_micro_batches(_batch(3), 64, pad_to_multiple=8)
    moved = mb.to(torch.device("meta"))
    for name in ("input_ids_T", "position_ids_T", "seq_index_T", "loss_mask_T"):
        assert getattr(moved, name).device.type == "meta", name
    assert moved.seq_fields["rewards"].device.type == "meta"
    assert moved.cu_seqlens is mb.cu_seqlens and moved.seq_ids == mb.seq_ids
    assert mb.input_ids_T.device.type == "cpu"  # a copy: the original stays


def test_hf_checkpoint_writer_shards_and_takes_the_named_tokenizer(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<only-in-the-named-tokenizer>"])
    tokenizer.save_pretrained(tokenizer_dir)
    state = {n: t.detach() for n, t in model.state_dict().items()}
    out = tmp_path / "export"
    write_hf_checkpoint(chunked(state.items(), 64 << 10), out, AutoConfig.from_pretrained(tiny_model_dir), torch.bfloat16,
                        str(tokenizer_dir), model_dir=str(tiny_model_dir))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    assert all(torch.equal(reloaded.state_dict()[n].float(), t.to(torch.bfloat16).float()) for n, t in state.items())
    assert "<only-in-the-named-tokenizer>" in AutoTokenizer.from_pretrained(out).get_vocab()
    assert (out / "generation_config.json").is_file()
    write_hf_checkpoint(iter([]), tmp_path / "not-rank-0", None, torch.float32, None, rank=1)
    assert not (tmp_path / "not-rank-0").exists()
