"""The fsdp2 backend on 2 CPU ranks (gloo, fp32) against single-process Hugging Face references.

One 2-process launch runs every scenario (see ``_fsdp2_worker.py``); each test below checks one
property of its recorded outputs:

- logprobs equal a plain per-sequence HF forward for llama, qwen2, qwen3 and qwen3_moe;
- a train() call (GRPO with KL, two optimizer steps of packed, accumulated micro-batches over
  2 data-parallel ranks) equals a single-process AdamW reference, parameter by parameter;
- tensor parallelism (with sequence parallelism and activation checkpointing; and for MoE
  without packing) equals data parallelism and the reference;
- save -> load -> next step equals the uninterrupted run; a non-finite loss skips the update;
- exported safetensors reload in transformers with the same weights and logits;
- a bad mesh, an unsupported architecture and another model's checkpoint fail with clear errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _fsdp2_common import algorithm, hf_logprobs, hf_state, load_hf, make_batch, max_diff, reference_train
from rlcore.utils import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("_fsdp2_worker.py")
TOL = 1e-5


def _launch(spec: dict, out: Path, timeout: float = 240.0) -> None:
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(WORKER.parent)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(spec_path)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"fsdp2 workers did not finish within {timeout} s")
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log[-4000:]}"


@pytest.fixture(scope="module")
def run(tiny_model_factory, tmp_path_factory):
    from transformers import GPT2Config

    out = tmp_path_factory.mktemp("fsdp2-run")
    gpt2 = out / "gpt2"
    GPT2Config(n_layer=1, n_embd=64, n_head=1, vocab_size=128).save_pretrained(gpt2)
    heads = dict(num_heads=4, num_kv_heads=2)
    spec = {
        "llama": str(tiny_model_factory("llama")),
        "llama_other": str(tiny_model_factory("llama", intermediate_size=192)),
        "qwen2": str(tiny_model_factory("qwen2")),
        "qwen3": str(tiny_model_factory("qwen3", **heads)),
        "qwen3_moe": str(tiny_model_factory("qwen3_moe", **heads)),
        "qwen2_tied": str(tiny_model_factory("qwen2", tie_word_embeddings=True, **heads)),
        "gpt2": str(gpt2),
        "ckpt": str(out / "ckpt"),
        "hf_out": str(out / "hf_export"),
        "out": str(out),
    }
    _launch(spec, out)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    print("fsdp2 scenario seconds:", {k: round(v, 1) for k, v in results[0]["timings"].items()})
    return spec, results


def scenario(run, name: str) -> dict:
    _, results = run
    for rank, res in enumerate(results):
        entry = res[name]
        if isinstance(entry, dict) and "error" in entry:
            pytest.fail(f"scenario {name!r} failed on rank {rank}:\n{entry['error']}")
    return results[0][name]


@pytest.fixture(scope="module")
def references(run):
    """Single-process HF results, computed once: logprobs and params after the training step."""
    spec, results = run
    out = {}
    batch = make_batch(1)
    for arch, name in [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("qwen3_moe", "qwen3_moe"),
                       ("qwen2_tied", "qwen2_tied_tp")]:
        model = load_hf(spec[arch])
        with torch.no_grad():
            out[f"{arch}/logprobs"] = [hf_logprobs(model, ids) for ids in batch.input_ids]
        trained = results[0][name].get("step1") or results[0][name]
        if isinstance(trained, dict) and "batch" in trained:
            out[f"{arch}/stats"] = reference_train(model, trained["batch"], algorithm(), gbs=4)
            out[f"{arch}/params"] = hf_state(model)
    return out


def on_mask(values: list[torch.Tensor], batch_seed: int = 1) -> list[torch.Tensor]:
    """Each sequence's values on its loss-masked tokens (of ``make_batch(batch_seed)``): the
    backend computes logprobs only there (prompt tokens' are 0 without sequence parallelism)."""
    return [v[m > 0] for v, m in zip(values, make_batch(batch_seed).loss_mask)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_logprobs_match_single_process_hf(run, references, arch):
    got = scenario(run, arch)["logprobs"]
    want = references[f"{arch}/logprobs"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert g[0] == 0.0
    for i, (g, w) in enumerate(zip(on_mask(got), on_mask(want))):
        assert float((g - w).abs().max()) < TOL, f"{arch} sequence {i}: max diff {float((g - w).abs().max())}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_train_step_matches_single_process_reference(run, references, arch):
    res = scenario(run, arch)
    step = res.get("step1") or res
    diff = max_diff(step["params"], references[f"{arch}/params"])
    assert diff < TOL, f"{arch}: params after train() differ from the reference by {diff}"
    metrics = step["metrics"]
    # Loss and pre-clip gradient norm (mean of the two steps) pin the normalization and the
    # SUM over data-parallel ranks directly, whatever the optimizer does with the gradient.
    stats = references[f"{arch}/stats"]
    assert metrics["loss"] == pytest.approx(sum(s[0] for s in stats) / 2, rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(sum(s[1] for s in stats) / 2, rel=1e-5)
    assert metrics["num_optimizer_steps"] == 2.0  # 7 sequences, train_global_batch_size 4
    assert metrics["num_micro_batches"] >= 3  # 32-token budget: gradient accumulation over micro-batches
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert 0.0 < metrics["grad_norm"] and "kl" in metrics and "policy_loss" in metrics


def test_training_changed_the_weights(run, references):
    """Guards the parity tests: parameters moved well beyond the tolerance."""
    from safetensors.torch import load_file

    spec, _ = run
    before = load_file(Path(spec["llama"]) / "model.safetensors")
    after = scenario(run, "llama")["step1"]["params"]
    assert max_diff(before, after) > 100 * TOL


@pytest.mark.parametrize("name, arch", [("qwen3_tp", "qwen3"),  # + sequence parallel + activation checkpointing
                                        ("qwen3_tp_plain", "qwen3"),  # TP alone, custom plan
                                        ("qwen3_moe_tp", "qwen3_moe")])  # + sequence parallel, no packing
def test_tensor_parallel_equals_data_parallel(run, references, name, arch):
    tp, dp = scenario(run, name), scenario(run, arch)
    for i, (a, b) in enumerate(zip(on_mask(tp["logprobs"]), on_mask(dp["logprobs"]))):
        assert float((a - b).abs().max()) < TOL, f"{arch} TP=2 logprobs of sequence {i} differ from TP=1"
    assert max_diff(tp["params"], dp["params"]) < TOL
    assert max_diff(tp["params"], references[f"{arch}/params"]) < TOL


def test_deferred_gradient_sync_equals_per_micro_batch_reduction(run, references):
    """defer_grad_sync accumulates unsharded fp32 grads over the micro-batches and reduces once;
    reshard_after_forward=false keeps gathered params across passes (logprobs must free them)."""
    deferred, plain = scenario(run, "qwen3_deferred"), scenario(run, "qwen3")
    for i, (a, b) in enumerate(zip(on_mask(deferred["logprobs"]), on_mask(plain["logprobs"]))):
        assert float((a - b).abs().max()) < TOL, f"logprobs of sequence {i} differ"
    assert deferred["metrics"]["num_micro_batches"] >= 3
    assert max_diff(deferred["params"], references["qwen3/params"]) < TOL


def test_custom_parallel_plan_replaces_the_builtin_one(run):
    custom, builtin = scenario(run, "qwen3_tp_plain")["placements"], scenario(run, "qwen3_tp")["placements"]
    assert len(custom["self_attn.q_proj.weight"]) == 2 and len(custom["mlp.gate_proj.weight"]) == 1  # MLP: FSDP only
    assert len(builtin["mlp.gate_proj.weight"]) == 2  # (dp_shard, tp) by the built-in plan
    assert len(scenario(run, "qwen3")["placements"]["mlp.gate_proj.weight"]) == 1


def test_tensor_parallel_with_tied_embeddings(run, references):
    """Qwen2 with tied embeddings (kept replicated over TP) under TP=2 + sequence parallelism."""
    res = scenario(run, "qwen2_tied_tp")
    for i, (a, b) in enumerate(zip(on_mask(res["logprobs"]), on_mask(references["qwen2_tied/logprobs"]))):
        assert float((a - b).abs().max()) < TOL, f"sequence {i}"
    assert "lm_head.weight" not in res["params"]  # tied: exported once, as the embedding
    assert max_diff(res["params"], references["qwen2_tied/params"]) < TOL


def test_reference_policy_is_the_initial_weights(run):
    res = scenario(run, "llama")
    for a, b in zip(res["ref_after_train"], res["logprobs"]):
        assert torch.equal(a, b)
    before, after = res["offload"]
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert any(float((a - b).abs().max()) > 1e-4 for a, b in zip(before, res["logprobs"]))  # the policy did move


def test_export_weights_respects_chunk_budget(run):
    sizes = scenario(run, "llama")["chunk_sizes"]
    assert len(sizes) > 1
    for chunk in sizes:
        assert sum(chunk) <= 40_000 or len(chunk) == 1


def test_checkpoint_resume_equals_uninterrupted(run):
    straight, resumed = scenario(run, "llama")["step2"], scenario(run, "resume")
    assert resumed["step"] == 4  # 2 optimizer steps before the save, 2 after
    assert max_diff(straight["params"], resumed["step2"]["params"]) == 0.0
    assert straight["metrics"]["lr"] == resumed["step2"]["metrics"]["lr"]
    assert straight["metrics"]["loss"] == resumed["step2"]["metrics"]["loss"]


def test_fewer_sequences_than_ranks(run):
    res = scenario(run, "resume")
    assert len(res["single_logprobs"]) == 1 and res["single_logprobs"][0].shape == (len(make_batch(5, n=1).input_ids[0]),)
    metrics = res["single_metrics"]
    assert metrics["num_micro_batches"] == 1.0 and metrics["nll"] > 0 and metrics["grad_norm"] > 0
    assert "skipped_nonfinite" not in metrics


def test_nonfinite_loss_skips_the_update(run):
    res = scenario(run, "llama")
    assert res["nonfinite_metrics"]["skipped_nonfinite"] == 2.0  # both optimizer steps of the call
    assert max_diff(res["params_after_nonfinite"], res["step2"]["params"]) == 0.0


def test_exported_checkpoint_reloads_in_transformers(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, _ = run
    res = scenario(run, "llama")
    path = Path(spec["hf_out"])
    assert "rlcore_varlen" not in (path / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    assert max_diff(hf_state(model), res["params_after_nonfinite"]) == 0.0
    assert len(AutoTokenizer.from_pretrained(path)) > 0
    with torch.no_grad():
        probe = make_batch(3)
        for ids, mask, got in zip(probe.input_ids, probe.loss_mask, res["probe_logprobs"]):
            assert float((hf_logprobs(model, ids) - got)[mask > 0].abs().max()) < TOL


def test_clear_errors(run):
    errors = scenario(run, "errors")
    assert "tensor_parallel_size" in errors["mesh"] and "world size 2" in errors["mesh"]
    assert "num_key_value_heads" in errors["heads"]
    assert "unsupported architecture" in errors["arch"] and "gpt2" in errors["arch"]
    assert "different model" in errors["shape"] and "intermediate_size" in errors["shape"]
    assert "mlp" in errors["shape"]  # names the first parameter whose shape differs


def test_releasing_the_state_to_host_memory_and_back_changes_nothing(run):
    """policy.generation.colocated.offload_trainer_state's round trip, on 2 gloo ranks: storages empty while out
    (weights kept for the refit, then released too), every tensor bitwise equal back, the next step the same."""
    res = scenario(run, "release")
    assert res["out_True"] and res["out_False"]
    assert res["equal_True"] and res["equal_False"]
    assert res["loss_equal"] and res["params_equal"] and res["state_equal"]
