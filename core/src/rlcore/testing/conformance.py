"""Conformance tests every rlcore plugin of a kind must pass, for a plugin's own CI.

Subclass the suite of your plugin's kind in a test module (name the subclass ``Test...``) and
provide the fixtures it asks for; pytest collects the inherited tests::

    import pytest
    from rlcore.testing.conformance import EnvironmentConformance

    class TestMyEnv(EnvironmentConformance):
        @pytest.fixture
        def environment(self):
            from my_package.env import MyEnv
            return MyEnv()

Suites and their fixtures (required ones first; the others have defaults you may override):

- :class:`EnvironmentConformance`: ``environment``; ``env_samples``, ``env_graded_examples``.
- :class:`AlgorithmConformance`: ``algorithm``; ``algorithm_name`` (the registered name, to
  check the registration).
- :class:`TrainingBackendConformance`: ``training_backend``, ``backend_model_dir`` (the Hugging
  Face checkpoint the backend was built from, fp32 recommended); ``backend_algorithm``.
- :class:`GeneratorConformance`: ``generator``, ``generator_model_dir`` (the checkpoint it serves).

Expensive objects may use ``scope="class"``: tests that change weights run after those that
compare against the checkpoint (pytest keeps definition order). Tolerances are class attributes
(``logprob_atol``, ``max_step_seconds``). To opt out of one test, override it in the subclass
with ``@pytest.mark.skip(reason=...)``. Heavy imports (torch, transformers) happen inside the
tests, so importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from rlcore.interfaces import Algorithm, Environment, EnvStep, GenerationResult, Generator, Sample, SamplingParams, TrainingBackend

# Model output an environment must survive: empty, control characters, unpaired surrogates,
# mixed scripts, huge text, nesting bombs, numbers that explode when evaluated, code that loops.
JUNK_RESPONSES: dict[str, str] = {
    "empty": "",
    "whitespace": " \n\t\r\n ",
    "control": "\x00\x01\x02\x1b[31m\x7f",
    "surrogate": "answer \ud800 \udfff",
    "unicode": "答案是 ４２ 🙂 \u202eRTL\u202c \u200b∑∞√ Ω≈ç",
    "huge_digits": "9" * 200_000,
    "huge_words": "the answer is " * 20_000,
    "boxed_bomb": "\\boxed{" * 5_000 + "1" + "}" * 4_000,
    "paren_bomb": "(" * 20_000,
    "power_tower": "\\boxed{9^{9^{9^{9^{9^{9}}}}}} 10**10**10**10",
    "huge_float": "\\boxed{1e999999999} -inf nan NaN 0/0 \\frac{1}{0}",
    "unclosed_tags": "<think>" * 1_000 + "<answer>",
    "code_loop": "```python\nwhile True:\n    pass\n```",
    "latex_junk": "$$\\frac{\\sqrt{}}{\\left(} \\begin{matrix} & \\\\ \\end{pmatrix}$$",
}


def default_samples() -> list[Sample]:
    return [
        Sample(prompt="What is 2 + 3? Put the answer in \\boxed{}.", answer="5", index=0),
        Sample(prompt=[{"role": "user", "content": "Compute 7 * 6."}], answer="42", index=1),
        Sample(prompt="Simplify 1/2 + 1/4.", answer="\\frac{3}{4}", index=2),
    ]


def _check_env_steps(steps: Any, n: int, where: str) -> None:
    assert isinstance(steps, list), f"{where}: step() must return a list, got {type(steps).__name__}"
    assert len(steps) == n, f"{where}: step() returned {len(steps)} results for {n} trajectories"
    for i, step in enumerate(steps):
        assert isinstance(step, EnvStep), f"{where}: result {i} is a {type(step).__name__}, not an EnvStep"
        assert isinstance(step.reward, (int, float)) and not isinstance(step.reward, bool), \
            f"{where}: reward {i} is {step.reward!r}, not a number"
        assert math.isfinite(step.reward), f"{where}: reward {i} is {step.reward}"
        assert isinstance(step.done, bool), f"{where}: done {i} is {step.done!r}, not a bool"
        if not step.done:
            assert isinstance(step.observation, str), f"{where}: trajectory {i} continues without an observation"
        for key, value in step.metrics.items():
            assert isinstance(key, str) and isinstance(value, (int, float)) and math.isfinite(value), \
                f"{where}: metric {key!r} of result {i} is {value!r}"


def _env_key(steps: list[EnvStep]) -> list[tuple]:
    return [(float(s.reward), s.done, s.observation, sorted(s.metrics.items())) for s in steps]


class EnvironmentConformance:
    """An environment is pure: it never raises on model output, answers every trajectory with a
    finite reward, is deterministic, and does not modify its inputs."""

    max_step_seconds: float = 60.0  # for one step() over every junk response

    @pytest.fixture
    def env_samples(self) -> list[Sample]:
        """Samples the environment can score (answers in its own format)."""
        return default_samples()

    @pytest.fixture
    def env_graded_examples(self) -> list[tuple[Sample, list[str], float]] | None:
        """``(sample, history, expected reward)`` triples checked exactly; None skips that test."""
        return None

    def test_implements_protocol(self, environment):
        assert isinstance(environment, Environment), f"{type(environment).__name__} has no step(samples, histories)"

    def test_one_step_per_trajectory(self, environment, env_samples):
        histories = [[f"The answer is \\boxed{{{s.answer}}}."] for s in env_samples]
        _check_env_steps(environment.step(env_samples, histories), len(env_samples), "plausible answers")

    def test_empty_batch(self, environment):
        assert environment.step([], []) == []

    def test_never_raises_on_junk(self, environment, env_samples):
        names = list(JUNK_RESPONSES)
        samples = [env_samples[i % len(env_samples)] for i in range(len(names))]
        start = time.perf_counter()
        try:
            steps = environment.step(samples, [[JUNK_RESPONSES[name]] for name in names])
        except Exception as exc:  # noqa: BLE001 - find which input broke it, for the message
            culprits = []
            for name, sample in zip(names, samples):
                try:
                    environment.step([sample], [[JUNK_RESPONSES[name]]])
                except Exception as inner:  # noqa: BLE001
                    culprits.append(f"{name}: {inner!r}")
            pytest.fail(f"step() raised {exc!r} on model output; failing inputs: {culprits}")
        elapsed = time.perf_counter() - start
        _check_env_steps(steps, len(names), "junk responses")
        assert elapsed < self.max_step_seconds, f"step() over junk took {elapsed:.1f} s: reward functions need timeouts"

    def test_multi_turn_histories(self, environment, env_samples):
        histories = [["Let me think.", "Still thinking...", f"So it is {s.answer}."] for s in env_samples]
        _check_env_steps(environment.step(env_samples, histories), len(env_samples), "three-turn histories")

    def test_deterministic(self, environment, env_samples):
        histories = [[f"\\boxed{{{s.answer}}}"] if i % 2 else ["no idea"] for i, s in enumerate(env_samples)]
        first = environment.step(env_samples, histories)
        second = environment.step(env_samples, histories)
        assert _env_key(first) == _env_key(second)

    def test_does_not_modify_inputs(self, environment, env_samples):
        histories = [[f"\\boxed{{{s.answer}}}"] for s in env_samples]
        samples_before, histories_before = copy.deepcopy(env_samples), copy.deepcopy(histories)
        environment.step(env_samples, histories)
        assert histories == histories_before and env_samples == samples_before

    def test_graded_examples(self, environment, env_graded_examples):
        if env_graded_examples is None:
            pytest.skip("no env_graded_examples fixture")
        samples = [s for s, _, _ in env_graded_examples]
        steps = environment.step(samples, [h for _, h, _ in env_graded_examples])
        _check_env_steps(steps, len(samples), "graded examples")
        got = [s.reward for s in steps]
        want = [r for _, _, r in env_graded_examples]
        assert got == pytest.approx(want), f"rewards {got}, expected {want}"


# ---- algorithms ------------------------------------------------------------------------------
def make_algorithm_batch(algorithm, *, num_groups: int = 3, group_size: int = 4, prompt_len: int = 3,
                         vocab_size: int = 64, seed: int = 0):
    """A step's batch with every token field an algorithm may need, plus leaf logprobs.

    Returns ``(batch, logprobs)``: ``logprobs[i]`` is a float64 leaf tensor [L_i] (index 0 is 0)
    standing for the current policy; old, reference and generator logprobs are near it, so
    importance ratios are near 1 and some are clipped.
    """
    import torch

    from rlcore.interfaces import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    rewards_N = (torch.rand(n, generator=g) > 0.5).double()
    rewards_N[:group_size] = 1.0  # one group with equal rewards (zero std)
    if num_groups > 1:
        rewards_N[group_size] = 0.0  # and one with both outcomes
    group_ids_N = torch.arange(num_groups).repeat_interleave(group_size)
    lengths = torch.randint(prompt_len + 2, prompt_len + 12, (n,), generator=g).tolist()
    truncated_N = torch.tensor([length == max(lengths) for length in lengths])
    response_lengths_N = torch.tensor([length - prompt_len for length in lengths])
    shaped_N = algorithm.shape_rewards(rewards_N, response_lengths_N, truncated_N)
    advantages_N = algorithm.advantages(shaped_N, group_ids_N)

    def near(base, scale):
        out = base + scale * torch.randn(base.shape, generator=g, dtype=torch.float64)
        out[0] = 0.0
        return out

    input_ids, loss_mask, old, ref, gen, teacher, logprobs = [], [], [], [], [], [], []
    for length in lengths:
        input_ids.append(torch.randint(3, vocab_size, (length,), generator=g))
        mask = torch.zeros(length)
        mask[prompt_len:] = 1.0
        loss_mask.append(mask)
        base = -3.0 * torch.rand(length, generator=g, dtype=torch.float64) - 0.05
        base[0] = 0.0
        old.append(base)
        ref.append(near(base, 0.1))
        gen.append(near(base, 0.05))
        teacher.append(near(base, 0.3))  # a teacher model's (on-policy distillation)
        logprobs.append(near(base, 0.15).requires_grad_(True))
    batch = SequenceBatch(
        input_ids=input_ids, loss_mask=loss_mask,
        token_fields={"old_logprobs": old, "ref_logprobs": ref, "gen_logprobs": gen, "teacher_logprobs": teacher},
        seq_fields={"rewards": shaped_N, "advantages": advantages_N.double()},
    )
    from rlcore.interfaces import CriticAlgorithm

    if isinstance(algorithm, CriticAlgorithm) and algorithm.uses_critic:  # ppo: per-token targets from a critic's values
        values = [near(torch.zeros(length, dtype=torch.float64), 0.5).float() for length in lengths]
        fields, _ = algorithm.token_targets(batch, values, shaped_N)
        batch.token_fields.update(fields)
    return batch, logprobs


def _packed(logprobs: list, mb) -> Any:
    import torch

    # Padding comes from the model too in a real backend: it carries a gradient (of zero), so an
    # empty micro-batch still gives a loss that backward() accepts.
    parts = [logprobs[i] for i in mb.seq_ids]
    parts.append(torch.zeros(mb.num_padding, dtype=torch.float64, requires_grad=True))
    return torch.cat(parts)


def _loss_over(algorithm, batch, logprobs, micro_batches, totals) -> tuple[Any, dict[str, float]]:
    """Sum of micro-batch losses (backward run on each) and of their metrics (``*_max`` by maximum)."""
    import torch

    from rlcore.algorithms.base import merge_metric

    total, metrics = torch.zeros((), dtype=torch.float64), {}
    for mb in micro_batches:
        loss, mb_metrics = algorithm.loss(_packed(logprobs, mb), mb, totals)
        assert loss.dim() == 0, f"loss must be a scalar, got shape {tuple(loss.shape)}"
        assert torch.isfinite(loss), f"non-finite loss {loss} on micro-batch {mb.seq_ids}"
        loss.backward()
        total = total + loss.detach().double()
        for key, value in mb_metrics.items():
            if isinstance(value, torch.Tensor):
                assert value.dim() == 0 and not value.requires_grad, f"metric {key!r} must be a detached 0-d tensor, got {value!r}"
                value = float(value)
            assert isinstance(value, float) and math.isfinite(value), f"metric {key!r} is {value!r}"
            metrics[key] = merge_metric(key, metrics[key], value) if key in metrics else value
    return total, metrics


class AlgorithmConformance:
    """Advantages and loss follow :class:`rlcore.interfaces.Algorithm`, and the loss of a
    micro-batch is its share of the step loss (global normalization)."""

    atol: float = 1e-9

    @pytest.fixture
    def algorithm_name(self) -> str | None:
        """The name the algorithm is registered under; None skips the registration test."""
        return None

    def test_implements_protocol(self, algorithm):
        assert isinstance(algorithm, Algorithm)
        assert isinstance(algorithm.name, str) and algorithm.name
        assert isinstance(algorithm.uses_reference, bool) and isinstance(algorithm.uses_old_logprobs, bool)
        assert algorithm.loss_level in ("token", "sequence")

    def test_advantages_shape_and_finite(self, algorithm):
        import torch

        rewards_N = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
        group_ids_N = torch.arange(3).repeat_interleave(4)
        adv_N = algorithm.advantages(rewards_N, group_ids_N)
        assert adv_N.shape == (12,) and adv_N.is_floating_point()
        assert torch.isfinite(adv_N).all(), f"advantages {adv_N} (a group with equal rewards must not give NaN)"
        keep_N = algorithm.keep_trajectories(rewards_N, group_ids_N, torch.zeros(12, dtype=torch.bool))
        assert keep_N.shape == (12,) and keep_N.dtype == torch.bool
        shaped_N = algorithm.shape_rewards(rewards_N, torch.full((12,), 5), torch.zeros(12, dtype=torch.bool))
        assert shaped_N.shape == (12,) and torch.isfinite(shaped_N).all()

    def test_loss_finite_with_finite_gradient(self, algorithm):
        import torch

        from rlcore.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        totals = step_totals(batch)
        _loss_over(algorithm, batch, logprobs, make_micro_batches(batch, max_tokens=10_000), totals)
        grads = [lp.grad for lp in logprobs]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads), "the loss does not depend on the logprobs"

    @pytest.mark.parametrize("dp_size, max_tokens, pad", [(2, 10_000, 1), (1, 24, 1), (3, 16, 8)])
    def test_micro_batch_losses_sum_to_the_step_loss(self, algorithm, dp_size, max_tokens, pad):
        from rlcore.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        totals = step_totals(batch)
        whole, whole_metrics = _loss_over(algorithm, batch, logprobs, make_micro_batches(batch, max_tokens=10_000), totals)
        whole_grads = [lp.grad.clone() for lp in logprobs]
        for lp in logprobs:
            lp.grad = None
        split = [mb for rank in range(dp_size)
                 for mb in make_micro_batches(batch, max_tokens, rank, dp_size, pad_to_multiple=pad)]
        assert len(split) > 1
        parts, parts_metrics = _loss_over(algorithm, batch, logprobs, split, totals)
        assert float(parts) == pytest.approx(float(whole), abs=self.atol, rel=1e-9)
        for lp, grad in zip(logprobs, whole_grads):
            assert lp.grad is not None and (lp.grad - grad).abs().max() <= 1e-9 + 1e-9 * grad.abs().max()
        assert parts_metrics.keys() == whole_metrics.keys()
        for key in whole_metrics:
            assert parts_metrics[key] == pytest.approx(whole_metrics[key], abs=1e-9, rel=1e-6), f"metric {key!r} is not a share"

    def test_empty_micro_batch_is_a_zero_loss(self, algorithm):
        from rlcore.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm, num_groups=1, group_size=2)
        micro_batches = make_micro_batches(batch, 10_000, dp_rank=2, dp_size=3, pad_to_multiple=4)
        assert micro_batches and all(mb.num_seqs == 0 for mb in micro_batches)
        for mb in micro_batches:
            loss, metrics = algorithm.loss(_packed(logprobs, mb), mb, step_totals(batch))
            assert float(loss.detach()) == 0.0 and all(v == 0.0 for v in metrics.values()), (loss, metrics)
            assert loss.requires_grad, "backends call backward() on every micro-batch, empty ones included"
            loss.backward()

    def test_masked_tokens_do_not_matter(self, algorithm):
        import torch

        from rlcore.packing import make_micro_batches, step_totals

        batch, logprobs = make_algorithm_batch(algorithm)
        (mb,) = make_micro_batches(batch, 10_000, pad_to_multiple=16)
        totals = step_totals(batch)
        logprobs_T = _packed(logprobs, mb).detach()
        changed_T = torch.where(mb.loss_mask_T > 0, logprobs_T, torch.full_like(logprobs_T, -50.0))
        assert float(algorithm.loss(changed_T, mb, totals)[0]) == pytest.approx(float(algorithm.loss(logprobs_T, mb, totals)[0]), abs=1e-12)

    def test_registered_with_config_class(self, algorithm, algorithm_name):
        if algorithm_name is None:
            pytest.skip("no algorithm_name fixture")
        import attrs

        from rlcore.config import structure
        from rlcore.plugins import get_plugin_manager

        reg = get_plugin_manager().get("algorithm", algorithm_name)
        assert reg.config_cls is not None and attrs.has(reg.config_cls), "register it with a frozen attrs config class"
        config = structure(reg.config_cls, {"name": algorithm_name}, reg.section)
        built = reg.build(config)
        assert isinstance(built, Algorithm) and built.name == algorithm_name
        assert type(built) is type(algorithm)


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
        assert isinstance(training_backend, TrainingBackend)

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
        assert isinstance(generator, Generator) and isinstance(generator.weights_version, int)

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
