"""DPO's loss against hand-computed pairs, packing that keeps pairs together, and the preference
dataset's formats and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlcore.algorithms import config as C
from rlcore.algorithms.base import merge_metrics
from rlcore.algorithms.dpo import DPO
from rlcore.algorithms.pairs import pair_batch
from rlcore.interfaces import PreferencePair
from rlcore.data.packing import KEEP_TOGETHER_FIELD, make_micro_batches, plan_grouped_micro_batches, step_totals
from rlcore.data.preference.config import PreferenceDataConfig
from rlcore.data.preference.data import PreferenceDataError, build_preference_dataset
from rlcore.testing.preferences import vowel_preference_rows, write_jsonl

# Two pairs, prompt of 2 tokens. Response logprobs (policy / reference), summed per response:
#   pair 0: chosen [-1.0, -0.5] / [-1.5, -1.0]   rejected [-2.0] / [-1.0]
#   pair 1: chosen [-0.2] / [-0.2]               rejected [-0.3, -0.3, -0.4] / [-0.5, -0.5, -0.5]
POLICY = {(0, 1): [-1.0, -0.5], (0, 0): [-2.0], (1, 1): [-0.2], (1, 0): [-0.3, -0.3, -0.4]}
REF = {(0, 1): [-1.5, -1.0], (0, 0): [-1.0], (1, 1): [-0.2], (1, 0): [-0.5, -0.5, -0.5]}
# log-ratios: pair 0 chosen +1.0, rejected -1.0; pair 1 chosen 0.0, rejected +0.5
# h = beta * (chosen - rejected): beta 0.5 -> h0 = 1.0, h1 = -0.25


def _pairs():
    return [PreferencePair([5, 6], [7, 8], [9]), PreferencePair([5, 6], [10], [11, 12, 13])]


def _example():
    batch = pair_batch(_pairs())
    logprobs, ref = [], []
    for p in range(2):
        for chosen in (1, 0):
            logprobs.append(torch.tensor([0.0, 0.0] + POLICY[(p, chosen)], dtype=torch.float64))
            ref.append(torch.tensor([0.0, 0.0] + REF[(p, chosen)], dtype=torch.float64))
    batch.token_fields["ref_logprobs"] = ref
    return batch, logprobs


def _run(alg, batch, logprobs, max_tokens=64, dp_size=1):
    totals = step_totals(batch)
    leaves = [lp.clone().requires_grad_(True) for lp in logprobs]
    total, metrics = 0.0, {}
    for rank in range(dp_size):
        for mb in make_micro_batches(batch, max_tokens, rank, dp_size):
            if not mb.seq_ids:
                continue
            lp_T = torch.nn.functional.pad(torch.cat([leaves[i] for i in mb.seq_ids]), (0, mb.num_padding))
            loss, m = alg.loss(lp_T, mb, totals)
            loss.backward()
            total += float(loss.detach())
            merge_metrics(metrics, {k: float(v) for k, v in m.items()})
    return total, metrics, [lp.grad for lp in leaves]


def _sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("max_tokens,dp_size", [(64, 1), (8, 1), (8, 2)])  # one micro-batch; one per pair; two ranks
def test_dpo_hand_value_and_gradient(max_tokens, dp_size):
    batch, lp = _example()
    loss, m, grads = _run(DPO(C.DPOConfig(beta=0.5)), batch, lp, max_tokens, dp_size)
    h0, h1 = 1.0, -0.25
    assert loss == pytest.approx((-math.log(_sig(h0)) - math.log(_sig(h1))) / 2, abs=1e-12)
    assert m["accuracy"] == pytest.approx(0.5) and m["reward_margin"] == pytest.approx((h0 + h1) / 2)
    assert m["chosen_reward"] == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    assert m["rejected_reward"] == pytest.approx(0.5 * (-1.0 + 0.5) / 2)
    # d loss / d log p(chosen token) = -beta * sigmoid(-h) / P; rejected tokens the opposite
    g0, g1 = 0.5 * _sig(-h0) / 2, 0.5 * _sig(-h1) / 2
    assert grads[0].tolist() == pytest.approx([0, 0, -g0, -g0]) and grads[1].tolist() == pytest.approx([0, 0, g0])
    assert grads[2].tolist() == pytest.approx([0, 0, -g1]) and grads[3].tolist() == pytest.approx([0, 0, g1, g1, g1])


def test_dpo_label_smoothing_sft_term_and_reference_free():
    batch, lp = _example()
    loss, m, _ = _run(DPO(C.DPOConfig(beta=0.5, label_smoothing=0.1, sft_loss_weight=2.0)), batch, lp)
    pref = sum(-0.9 * math.log(_sig(h)) - 0.1 * math.log(_sig(-h)) for h in (1.0, -0.25)) / 2
    sft = ((1.0 + 0.5) / 2 + 0.2 / 1) / 2  # per-token NLL of each chosen response, mean over pairs
    assert m["preference_loss"] == pytest.approx(pref) and m["sft_loss"] == pytest.approx(sft)
    assert loss == pytest.approx(pref + 2.0 * sft)
    free = DPO(C.DPOConfig(beta=0.5, reference_free=True))
    assert not free.uses_reference
    del batch.token_fields["ref_logprobs"]
    loss, m, _ = _run(free, batch, lp)
    h0, h1 = 0.5 * (-1.5 + 2.0), 0.5 * (-0.2 + 1.0)  # policy log p(chosen) - log p(rejected)
    assert loss == pytest.approx((-math.log(_sig(h0)) - math.log(_sig(h1))) / 2)


def test_dpo_errors_name_what_is_missing():
    batch, lp = _example()
    with pytest.raises(ValueError, match="'ref_logprobs' is missing .reference_free is false"):
        _run(DPO(), pair_batch(_pairs()), lp)
    del batch.seq_fields[KEEP_TOGETHER_FIELD]  # packing may then split a pair
    with pytest.raises(ValueError, match="sequence field 'pack_group' is missing"):
        _run(DPO(), batch, lp)
    with pytest.raises(TypeError, match="trains on preference pairs"):
        DPO().advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 0.5\\)"):
        C.DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError, match="over policy.max_total_sequence_length=4"):
        pair_batch(_pairs(), max_length=4)


def test_grouped_packing_keeps_units_whole():
    plan = plan_grouped_micro_batches([3, 4, 5, 2, 6, 1], [0, 0, 1, 1, 2, 2], 9, dp_size=2)
    assert sorted(tuple(mb) for rank in plan for mb in rank if mb) == [(0, 1), (2, 3), (4, 5)]
    assert all(sum([3, 4, 5, 2, 6, 1][i] for i in mb) <= 9 for rank in plan for mb in rank)
    with pytest.raises(ValueError, match="sequences \\[0, 1\\] \\(pack_group 0\\) must share a micro-batch"):
        plan_grouped_micro_batches([5, 5], [0, 0], 9)
    unpacked = plan_grouped_micro_batches([3, 4, 5, 2], [0, 0, 1, 1], 9, pack=False, micro_batch_size=3)
    assert unpacked == [[[0, 1], [2, 3]]]  # whole pairs, at least one a micro-batch


# ---- the preference dataset ------------------------------------------------------------------
def _build(tiny_tokenizer, files, **kw):
    return build_preference_dataset(PreferenceDataConfig(train_files=tuple(str(f) for f in files), **kw), tiny_tokenizer)


def test_preference_files_text_messages_conversations_parquet(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    (pair,) = _build(tok, [text]).train
    assert pair.prompt_ids == tok("2+2=")["input_ids"] and pair.chosen_ids == tok("4")["input_ids"] + [tok.eos_token_id]
    msgs = write_jsonl(tmp_path / "msgs.jsonl", vowel_preference_rows(4, seed=1))
    data = _build(tok, [msgs], num_validation=1)
    assert len(data.train) == 3 and len(data.validation) == 1
    row = vowel_preference_rows(1, seed=1)[0]
    full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True)["input_ids"]
    first = next(p for p in data.train + data.validation if p.source.endswith("row 0"))
    assert first.prompt_ids + first.chosen_ids == full and tok.decode(first.chosen_ids) == row["chosen"][0]["content"] + "</s>"
    convo = write_jsonl(tmp_path / "convo.jsonl", [{"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}])
    assert _build(tok, [convo]).train[0].chosen_ids == first.chosen_ids
    import datasets

    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(vowel_preference_rows(3, seed=1, messages=False)).to_parquet(str(parquet))
    assert len(_build(tok, [parquet]).train) == 3


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "rejected": "b"}, "row 1: missing 'chosen'"),
    ({"prompt": "a", "chosen": 3, "rejected": "b"}, "row 1: 'chosen' must be text or a non-empty list"),
    ({"prompt": "a", "chosen": "", "rejected": "b"}, "row 1: 'chosen' is empty"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}, "row 1: without 'prompt'"),
])
def test_preference_row_errors_name_file_and_row(tiny_tokenizer, tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(PreferenceDataError, match=f"bad.jsonl: {message}"):
        _build(tiny_tokenizer, [path])


def test_preference_file_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(PreferenceDataError, match="missing.jsonl: no such file"):
        _build(tiny_tokenizer, [tmp_path / "missing.jsonl"])
    (tmp_path / "pairs.csv").write_text("prompt,chosen\n")
    with pytest.raises(PreferenceDataError, match="pairs.csv: cannot tell the format from '.csv'"):
        _build(tiny_tokenizer, [tmp_path / "pairs.csv"])
    with pytest.raises(ValueError, match="train_files is empty"):
        PreferenceDataConfig(train_files=())
