"""``rlcore eval MODEL RECIPE [--k K]``: greedy accuracy and pass@k on a recipe's validation set.

The recipe supplies everything but the weights: the dataset (its validation split, the first
``train.max_val_samples`` prompts, over-long prompts dropped as a run drops them), the generator
(``policy.generation``), the environment (``env``) and the seed. Greedy decoding and scoring are
the run loop's own (:mod:`rlcore.generation.batching`), so the greedy accuracy of a run's final
weights is that run's last ``val/accuracy``.

pass@k uses the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", eq. 1): with n >= k samples per prompt of which c are correct,
``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over prompts; computed as a product for stability.

``MODEL`` is a Hugging Face model directory (an export, the base model) or an rlcore checkpoint
(a step directory, a checkpoints root or a run directory), exported first to a temporary
directory by :func:`rlcore.cli.export.export_checkpoint`.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from rlcore.config import ConfigError
from rlcore.loading.loader import load_config
from rlcore.interfaces import ClosableEnvironment


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (``n >= k``)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _components(config):
    """Tokenizer, validation samples, environment, generator and multi-turn runner, as ``rlcore.run`` builds them."""
    from transformers import AutoTokenizer

    from rlcore.controller.environment import build_environment
    from rlcore.controller.placement import plan_placement
    from rlcore.controller.model_files import check_model_name
    from rlcore.controller.preflight import check_prompt_lengths
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    check_model_name(config)
    tokenizer = AutoTokenizer.from_pretrained(config.policy.tokenizer_name or config.policy.model_name)
    data_cfg = config.require_section("data")
    dataset = manager.get("dataset", data_cfg.name).build(data_cfg, tokenizer)
    check_prompt_lengths(dataset, config)
    if not dataset.validation:
        raise ConfigError("data", f"the dataset '{data_cfg.name}' of this recipe has no validation split to evaluate on")
    samples = list(dataset.validation[: config.train.max_val_samples])
    environment, multi_turn_env = build_environment(config, manager, {})  # env.reward_fn or the env.name plugin
    config.require_section("policy.generation")
    generator = manager.get("generator", config.generation.backend).build(config, config.generation, plan_placement(config))
    multi_turn = None
    if multi_turn_env:
        from rlcore.agents.runner import build_multi_turn_runner

        multi_turn = build_multi_turn_runner(generator, environment, tokenizer, config)
    return samples, environment, generator, multi_turn


def _scored(samples, params, environment, generator, multi_turn) -> list[list]:
    """Per sample, its ``params.n`` scored trajectories (the run loop's rollout and scoring)."""
    from rlcore.generation.batching import Trajectory, apply_env_steps, score
    from rlcore.interfaces import EnvStep

    from rlcore.controller.rollouts import image_generator, no_images_in_multi_turn

    if multi_turn is not None:
        no_images_in_multi_turn(samples)
        results = multi_turn(samples, params)
        steps = [EnvStep(reward=t.reward, metrics=t.env_metrics) for group in multi_turn.last_trajectories for t in group]
    elif any(s.images is not None for s in samples):
        results = image_generator(generator).generate_with_images([s.prompt_ids for s in samples], [s.images for s in samples], params)
    else:
        results = generator.generate([s.prompt_ids for s in samples], params)
    trajs = [[Trajectory(s, i, r) for r in rs] for i, (s, rs) in enumerate(zip(samples, results))]
    flat = [t for group in trajs for t in group]
    if multi_turn is not None:
        apply_env_steps(flat, steps)
    else:
        score(environment, flat)
    return trajs


def evaluate_model(model_dir: str, recipe: str, overrides: list[str] = (), *, k: int = 1, num_samples: int | None = None,
                   batch_size: int = 256, progress: bool = True) -> dict:
    """Greedy accuracy and pass@k of the Hugging Face model in ``model_dir`` on ``recipe``'s validation set."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlcore.generation.batching import is_correct, sampling_params

    if k < 1:
        raise ConfigError("--k", f"must be at least 1, got {k}")
    check_eval_options(batch_size, None)
    n = num_samples or k
    if n < k:
        raise ConfigError("--samples", f"pass@{k} needs at least {k} samples per prompt, got {n}")
    config = load_config(recipe, [*overrides, f"policy.model_name={model_dir}"])
    started = time.perf_counter()
    samples, environment, generator, multi_turn = _components(config)
    seed = config.train.seed
    greedy_correct, greedy_rewards, passes, sample_correct = [], [], [], []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
            greedy_task = bar.add_task("greedy", total=len(samples))
            sampled_task = bar.add_task(f"sampled (n={n})", total=len(samples))
            for first in range(0, len(samples), batch_size):
                chunk = samples[first : first + batch_size]
                for group in _scored(chunk, sampling_params(config.generation, 1, seed, greedy=True), environment,
                                     generator, multi_turn):
                    greedy_correct.append(is_correct(group[0].reward, group[0].env_metrics))
                    greedy_rewards.append(group[0].reward)
                bar.advance(greedy_task, len(chunk))
            for first in range(0, len(samples), batch_size):
                chunk = samples[first : first + batch_size]
                for group in _scored(chunk, sampling_params(config.generation, n, seed + first, greedy=False), environment,
                                     generator, multi_turn):
                    correct = sum(is_correct(t.reward, t.env_metrics) for t in group)
                    passes.append(pass_at_k(len(group), correct, k))
                    sample_correct.append(correct / len(group))
                bar.advance(sampled_task, len(chunk))
    finally:
        generator.shutdown()
        if isinstance(environment, ClosableEnvironment):
            environment.close()
    count = len(samples)
    return {
        "model": str(model_dir), "recipe": str(recipe), "num_prompts": count, "seed": seed,
        "generator": config.generation.backend, "environment": config.env.name,
        "greedy_accuracy": sum(greedy_correct) / count, "greedy_reward_mean": sum(greedy_rewards) / count,
        "k": k, "num_samples": n, "temperature": config.generation.temperature,
        f"pass@{k}": sum(passes) / count, "sampled_accuracy": sum(sample_correct) / count,
        "seconds": round(time.perf_counter() - started, 2),
    }


def evaluate(model: str, recipe: str, overrides: list[str] = (), **kwargs) -> dict:
    """:func:`evaluate_model` on a Hugging Face directory, or on an rlcore checkpoint exported first."""
    from rlcore.cli.export import export_checkpoint, final_model, is_hf_model_dir

    if is_hf_model_dir(model):
        return evaluate_model(model, recipe, overrides, **kwargs)
    final = final_model(model)
    if final is not None:  # a run directory without checkpoints: its final model, as it is
        summary = evaluate_model(str(final), recipe, overrides, **kwargs)
        summary.update(model=str(model), final_model=str(final))
        return summary
    if not Path(model).expanduser().exists():
        raise ConfigError("MODEL", f"{model!r}: no such directory (a Hugging Face model directory or an rlcore checkpoint)")
    with tempfile.TemporaryDirectory(prefix="rlcore-eval-") as tmp:
        done = export_checkpoint(model, Path(tmp) / "model")
        summary = evaluate_model(done["out"], recipe, overrides, **kwargs)
    summary.update(model=str(model), exported_from=done["checkpoint"])
    return summary


def check_eval_options(batch_size: int, out: str | None) -> None:
    """``--batch-size`` and ``--out`` checked before any model is loaded: a bad one would otherwise
    fail after the whole evaluation (``--out``: with its result lost)."""
    if batch_size < 1:
        raise ConfigError("--batch-size", f"must be at least 1, got {batch_size}")
    if out is None:
        return
    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError("--out", f"{out} is a directory; give a file path for the JSON summary")
    if not path.parent.is_dir():
        raise ConfigError("--out", f"{out}: its directory {path.parent} does not exist")
    # Tried, not asked of os.access: root passes every permission check, yet cannot create a file in
    # /proc or on a read-only filesystem. A file this creates is removed again.
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError("--out", f"{out} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def write_summary(summary: dict, path: str | None) -> str:
    text = json.dumps(summary, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    return text
