"""The training-backend and generator suites (:class:`TrainingBackendConformance`,
:class:`GeneratorConformance`) and the checkpoint helpers they share."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from rlcore.interfaces import GenerationResult, Generator, GeneratorMetrics, OffloadingBackend, SamplingParams, TrainingBackend
from rlcore.testing.conformance.members import assert_all_or_none, assert_follows


# ---- training backends and generators: shared helpers ----------------------------------------
def checkpoint_tensors(model_dir: str | Path) -> dict[str, Any]:
    """Every tensor of a saved Hugging Face checkpoint (safetensors), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no *.safetensors in {model_dir}"
    return tensors


def hf_reference_logprobs(model_dir: str | Path, sequences: list[list[int]]) -> list[Any]:
    """Token-aligned float32 logprobs of each sequence under the checkpoint, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in sequences:
            ids_1L = torch.tensor([ids])
            logits_LV = model(ids_1L).logits[0].float()
            lp = torch.log_softmax(logits_LV[:-1], dim=-1).gather(1, ids_1L[0, 1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), lp]))
    return out


def _vocab_size(model_dir: str | Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _random_sequences(model_dir, lengths: list[int], seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = _vocab_size(model_dir)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _assert_close_lists(got: list, want: list, atol: float, what: str) -> None:
    import torch

    assert len(got) == len(want), f"{what}: {len(got)} sequences, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
        assert a.shape == b.shape, f"{what}[{i}]: shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        err = float((a - b).abs().max()) if a.numel() else 0.0
        assert err <= atol, f"{what}[{i}]: max |difference| {err:.3g} > {atol}"


def _chunks_to_dict(chunks) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for chunk in chunks:
        for name, tensor in chunk:
            assert name not in out, f"export_weights yielded '{name}' twice"
            out[name] = tensor.detach().cpu().clone()
    return out


# ---- training backends -----------------------------------------------------------------------
class TrainingBackendConformance:
    """Logprobs are token-aligned and match the checkpoint, ``train`` changes the weights and
    reports the required metrics, ``export_weights`` streams the model in Hugging Face names,
    ``load_checkpoint`` runs no code planted in any checkpoint file."""

    logprob_atol: float = 1e-3  # vs transformers on the fp32 checkpoint; raise it for bf16 backends
    check_reference: bool = True  # False if the backend keeps no reference policy in this set-up
    lengths: tuple[int, ...] = (9, 14, 6, 11)
    prompt_len: int = 3

    @pytest.fixture
    def backend_algorithm(self):
        """The algorithm ``train`` is called with: built-in GRPO, one clipped PG step."""
        from rlcore.plugins import get_plugin_manager

        reg = get_plugin_manager().get("algorithm", "grpo")
        return reg.build(reg.config_cls())

    def _batch(self, model_dir):
        import torch

        from rlcore.interfaces import SequenceBatch

        seqs = _random_sequences(model_dir, list(self.lengths))
        masks = [torch.cat([torch.zeros(self.prompt_len), torch.ones(len(s) - self.prompt_len)]) for s in seqs]
        return SequenceBatch(input_ids=[torch.tensor(s) for s in seqs], loss_mask=masks)

    def test_implements_protocol(self, training_backend):
        assert_follows(training_backend, TrainingBackend)
        assert_all_or_none(training_backend, ("offload()", "onload()"), OffloadingBackend)

    def test_logprobs_token_aligned_and_match_checkpoint(self, training_backend, backend_model_dir):
        import torch

        batch = self._batch(backend_model_dir)
        got = training_backend.logprobs(batch)
        assert isinstance(got, list) and len(got) == len(batch)
        for i, lp in enumerate(got):
            assert lp.dtype == torch.float32 and lp.shape == (self.lengths[i],), f"logprobs[{i}]: {lp.dtype} {tuple(lp.shape)}"
            assert torch.isfinite(lp).all() and float(lp[0]) == 0.0 and float(lp.max()) <= 1e-5
        want = hf_reference_logprobs(backend_model_dir, [ids.tolist() for ids in batch.input_ids])
        # Only loss-masked tokens need a logprob (a backend may leave the prompt's at 0, never
        # computing their logits): compared there.
        on_mask = lambda values: [v[m > 0] for v, m in zip(values, batch.loss_mask)]  # noqa: E731
        _assert_close_lists(on_mask(got), on_mask(want), self.logprob_atol, "logprobs vs transformers")
        # Packing must not change a sequence's logprobs: a subset, in another order, agrees.
        subset = training_backend.logprobs(batch.select([2, 0]))
        _assert_close_lists(subset, [got[2], got[0]], self.logprob_atol, "logprobs of a subset")

    def test_export_weights_cover_the_checkpoint(self, training_backend, backend_model_dir):
        import torch

        reference = checkpoint_tensors(backend_model_dir)
        small = 64 * 1024
        chunks = [list(chunk) for chunk in training_backend.export_weights(chunk_bytes=small)]
        for chunk in chunks:
            size = sum(t.numel() * t.element_size() for _, t in chunk)
            assert size <= small or len(chunk) == 1, f"a chunk of {size} bytes > chunk_bytes={small}"
        exported = _chunks_to_dict(chunks)
        missing, extra = sorted(set(reference) - set(exported)), sorted(set(exported) - set(reference))
        assert not missing, f"export_weights misses {missing[:5]} ({len(missing)})"
        assert extra in ([], ["lm_head.weight"]), f"export_weights yields names the checkpoint lacks: {extra[:5]}"
        for name, tensor in reference.items():
            assert exported[name].shape == tensor.shape, f"{name}: {tuple(exported[name].shape)} vs {tuple(tensor.shape)}"
            err = float((exported[name].float() - tensor.float()).abs().max())
            assert err <= 1e-2 * max(1.0, float(tensor.float().abs().max())), f"{name} differs from the checkpoint by {err}"
        assert all(isinstance(t, torch.Tensor) for t in exported.values())

    def test_export_weights_takes_a_dtype_name(self, training_backend):
        """``dtype`` may be a name, as a generator that reads it from its config passes it."""
        import torch

        for dtype in ("float32", torch.float32):
            exported = _chunks_to_dict([list(chunk) for chunk in training_backend.export_weights(dtype=dtype)])
            assert exported and {t.dtype for t in exported.values()} == {torch.float32}, f"dtype={dtype!r}"

    def test_train_step_changes_weights_and_reports_metrics(self, training_backend, backend_model_dir, backend_algorithm):
        import torch

        batch = self._batch(backend_model_dir)
        before_lp = training_backend.logprobs(batch)
        before_ref = training_backend.logprobs(batch, reference=True) if self.check_reference else None
        before_w = _chunks_to_dict(training_backend.export_weights())
        batch.token_fields["old_logprobs"] = [lp.clone() for lp in before_lp]
        batch.seq_fields["advantages"] = torch.linspace(1.0, -1.0, len(batch))
        metrics = training_backend.train(batch, backend_algorithm)
        for key in ("loss", "grad_norm", "lr", "num_micro_batches"):
            assert key in metrics, f"train() metrics lack {key!r}: {sorted(metrics)}"
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["num_micro_batches"] >= 1 and "skipped_nonfinite" not in metrics
        after_w = _chunks_to_dict(training_backend.export_weights())
        changed = [n for n in before_w if not torch.equal(before_w[n], after_w[n])]
        assert changed, "no weight changed after a training step"
        after_lp = training_backend.logprobs(batch)
        assert any(not torch.allclose(a, b) for a, b in zip(after_lp, before_lp)), "logprobs did not change after training"
        if before_ref is not None:  # the reference policy is frozen
            _assert_close_lists(training_backend.logprobs(batch, reference=True), before_ref, 1e-6, "reference logprobs")

    def test_checkpoint_load_runs_no_code_from_any_file(self, training_backend, tmp_path):
        """A checkpoint is input: a code-running pickle planted in any file it consists of is
        refused (nothing runs) with an error naming that file; the untouched one still loads."""
        import shutil

        from rlcore.testing.planting import files_under, plant

        saved = tmp_path / "saved"
        training_backend.save_checkpoint(str(saved))
        files = files_under(saved)
        assert files, "save_checkpoint wrote no files"
        for i, original in enumerate(files):
            copy_dir, marker = tmp_path / f"planted{i}", tmp_path / f"ran{i}"
            shutil.copytree(saved, copy_dir)
            planted = copy_dir / original.relative_to(saved)
            plant(planted, marker)
            with pytest.raises(Exception) as failure:
                training_backend.load_checkpoint(str(copy_dir))
            assert not marker.exists(), f"loading a checkpoint ran code planted in {planted.name}"
            assert planted.name in str(failure.value), f"the error does not name {planted}: {failure.value!r}"
        training_backend.load_checkpoint(str(saved))


# ---- generators ------------------------------------------------------------------------------
class GeneratorConformance:
    """``generate`` returns n token-level results per prompt with matching logprobs;
    ``update_weights`` loads Hugging Face-named tensors in place and bumps ``weights_version``."""

    logprob_atol: float = 2e-2  # generate()'s sampling logprobs vs score() of the same tokens
    max_new_tokens: int = 6

    def _prompts(self, model_dir) -> list[list[int]]:
        return _random_sequences(model_dir, [5, 8, 3], seed=1)

    def _check_results(self, results, prompts, params, version) -> None:
        assert isinstance(results, list) and len(results) == len(prompts)
        for prompt, per_prompt in zip(prompts, results):
            assert len(per_prompt) == params.n, f"{len(per_prompt)} results for n={params.n}"
            for r in per_prompt:
                assert isinstance(r, GenerationResult)
                assert list(r.prompt_ids) == list(prompt), "prompt_ids must be the prompt's tokens"
                assert 1 <= len(r.response_ids) <= params.max_new_tokens
                assert len(r.response_logprobs) == len(r.response_ids), "one logprob per response token"
                assert all(math.isfinite(x) and x <= 1e-5 for x in r.response_logprobs), r.response_logprobs
                assert r.finish_reason in ("stop", "length", "abort", "truncated_prompt")
                assert r.response_mask is None or len(r.response_mask) == len(r.response_ids)
                assert r.policy_version == version

    def test_implements_protocol(self, generator):
        assert_follows(generator, Generator)
        assert isinstance(generator.weights_version, int), f"weights_version is {generator.weights_version!r}"

    def test_optional_metrics_are_numbers(self, generator):
        if not isinstance(generator, GeneratorMetrics):
            pytest.skip("no metrics() (rlcore.interfaces.GeneratorMetrics)")
        metrics = generator.metrics()
        assert isinstance(metrics, dict), f"metrics() returned {type(metrics).__name__}, not a dict"
        for key, value in metrics.items():
            assert isinstance(key, str) and math.isfinite(float(value)), f"metrics() entry {key!r}: {value!r}"

    def test_generate_n_results_per_prompt(self, generator, generator_model_dir):
        prompts = self._prompts(generator_model_dir)
        params = SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, n=3, seed=0)
        self._check_results(generator.generate(prompts, params), prompts, params, generator.weights_version)

    def test_greedy_is_deterministic_and_matches_score(self, generator, generator_model_dir):
        prompts = self._prompts(generator_model_dir)
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, n=1, ignore_eos=True)
        first = generator.generate(prompts, params)
        second = generator.generate(prompts, params)
        self._check_results(first, prompts, params, generator.weights_version)
        assert [r[0].response_ids for r in first] == [r[0].response_ids for r in second]
        assert all(len(r[0].response_ids) == self.max_new_tokens and r[0].finish_reason == "length" for r in first)
        sequences = [p + r[0].response_ids for p, r in zip(prompts, first)]
        scores = generator.score(sequences)
        assert [len(s) for s in scores] == [len(s) for s in sequences] and all(s[0] == 0.0 for s in scores)
        _assert_close_lists([s[len(p):] for s, p in zip(scores, prompts)], [r[0].response_logprobs for r in first],
                            self.logprob_atol, "score() vs generate() logprobs")

    def test_agenerate(self, generator, generator_model_dir):
        prompts = self._prompts(generator_model_dir)
        params = SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, n=1, seed=0)

        async def many():
            return await asyncio.gather(*(generator.agenerate(p, params) for p in prompts))

        results = asyncio.run(many())
        self._check_results([[r] for r in results], prompts, params, generator.weights_version)

    def test_update_weights_loads_in_place_and_bumps_version(self, generator, generator_model_dir):
        import torch

        original = checkpoint_tensors(generator_model_dir)
        probe = _random_sequences(generator_model_dir, [10, 7], seed=2)
        before = generator.score(probe)
        version = generator.weights_version
        g = torch.Generator().manual_seed(0)
        perturbed = [(n, t + 0.05 * torch.randn(t.shape, generator=g).to(t.dtype)) for n, t in original.items()]
        generator.update_weights(iter([perturbed[: len(perturbed) // 2], perturbed[len(perturbed) // 2:]]))
        assert generator.weights_version == version + 1
        changed = generator.score(probe)
        assert any(max(abs(a - b) for a, b in zip(x, y)) > 1e-3 for x, y in zip(changed, before)), "new weights were not used"
        generator.update_weights(iter([list(original.items())]))
        assert generator.weights_version == version + 2
        _assert_close_lists(generator.score(probe), before, 1e-4, "score after restoring the weights")
