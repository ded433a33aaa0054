"""The current GRPO step-time and training-throughput tables, in NeMo-RL's step-time format, from
``benchmarks/results.jsonl`` (the newest row of each configuration and variant), as Markdown with
the command, date, machine and commit behind each row: what ``docs/performance.md`` shows.

    python benchmarks/performance_tables.py                  # prints the tables
    python benchmarks/performance_tables.py --results other.jsonl
    python benchmarks/performance_tables.py --write-demo      # the demo's figures into README.md, performance.md

Reads only the JSONL the benchmarks append to; runs anywhere (no GPU, no torch).
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path

from rlcore.controller.allocator import ALLOCATOR_ENV

HERE = Path(__file__).resolve().parent
STEP_RE = re.compile(r"(\d+) prompts x (\d+) samples x (\d+) new tokens, (\d+)-token micro-batches, steps (\d+) \(summary after (\d+)\)")
DEFAULTS = {"--prompts": "32", "--samples": "8", "--max-new-tokens": "1024", "--mb-tokens": "8192"}


def newest(rows: list[dict], bench: str) -> list[dict]:
    """The newest row of each (config, variant) of ``bench``, oldest first. A row whose mean includes its
    first step (``--warmup 0``, as a multi-turn call's single-turn reference) replaces only another such row."""
    keep: dict[tuple, dict] = {}
    for row in rows:
        if row.get("bench") != bench or row.get("transcribed") or "issue" in str(row.get("variant", "")):
            continue
        shape = re.sub(r",? steps \d+.*$", "", str(row.get("config")))  # the same work, however many steps
        key = (row.get("variant"), shape, row.get("gpus"))
        if key not in keep or (_warmed(row), row["date"]) >= (_warmed(keep[key]), keep[key]["date"]):
            keep[key] = row
    return sorted(keep.values(), key=lambda r: r["date"])


def _warmed(row: dict) -> bool:
    """Whether the row's means leave out at least one warm-up step."""
    m = STEP_RE.match(str(row.get("config")))
    return m is None or int(m.group(6)) > 0


def grpo_command(row: dict) -> str:
    """``bench_grpo_step.py`` arguments that reproduce a row (its variant name and shape string)."""
    name, extras = _variant_settings(str(row["variant"]))
    args, env = [f"--config {name}"], _allocator_env(extras)
    m = STEP_RE.match(row["config"])
    if m:
        for flag, value in zip(("--prompts", "--samples", "--max-new-tokens", "--mb-tokens"), m.groups()[:4]):
            if DEFAULTS[flag] != value:
                args.append(f"{flag} {value}")
        args.append(f"--steps {m.group(5)} --warmup {m.group(6)}")
    for extra in extras:
        if extra.startswith(ALLOCATOR_SETTING):
            continue
        if extra.startswith("mps trainer "):
            args.append(f"--trainer-mps-priority {extra.split()[-1]}")
        elif extra.startswith("trainer GEMMs leave "):
            args.append(f"--trainer-sm-margin {extra.split()[3]}")
        elif extra.endswith(" generator"):
            args.append(f"--generator {extra.split()[0]}")
        else:
            args.append(f"--set {extra}")
    return f"{env}python benchmarks/bench_grpo_step.py " + " ".join(args)


TRAIN_RE = re.compile(r"(\w+)[^,]*, (\d+) x (\d+) tokens/step/DP rank, lengths \[(\d+), (\d+)\], steps (\d+) \(\+(\d+) warm-up\)")


def train_command(row: dict) -> str:
    """``bench_train_megatron.py`` arguments that reproduce a row."""
    m = TRAIN_RE.match(row["config"])
    if not m:
        return ""
    shape, mbs, tokens, lo, hi, steps, warmup = m.groups()
    variant, extras = _variant_settings(str(row["variant"]))
    env = _allocator_env(extras)
    args = [f"--shape {shape}", f"--variants {variant}", f"--micro-batches {mbs}", f"--mb-tokens {tokens}",
            f"--min-len {lo} --max-len {hi}", f"--steps {steps} --warmup {warmup}"]
    tp = re.search(r"TP=(\d+)", str(row.get("layout", "")))
    if tp and tp.group(1) != "1":
        args.append(f"--tp {tp.group(1)}")
    if row.get("gpus", 1) > 1:
        args.append(f"--gpus {row['gpus']}")
    return f"{env}python benchmarks/bench_train_megatron.py " + " ".join(args)


def machine(row: dict) -> str:
    """The machine as the tables name it (rows written by different tools spell it differently)."""
    name = re.sub(r"\s*\(nvidia-h\d00[^)]*\)", "", str(row.get("machine", "")))
    return "1x NVIDIA H200" if name == "one H200" else name


def learning_table(rows: list[dict]) -> str:
    lines = ["| Recipe | Variant | Steps | Held-out accuracy | Mean step (s) | Date | Machine | Commit |",
             "|---|---|---:|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['config']}` | {r['variant']} | {r['steps']} | {r['val_accuracy_start']:.3f} -> "
                     f"**{r['val_accuracy_end']:.3f}** | {_f(r.get('mean_step_s'))} | {r['date'][:10]} | {machine(r)} | "
                     f"`{str(r['commit'])[:7]}` |")
    return "\n".join(lines)


def _f(value, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def grpo_table(rows: list[dict]) -> str:
    """NeMo-RL's step-time columns; PPO rows (a critic's ``values_s``) add Values and Critic after Logprobs."""
    critic = any(r.get("values_s") is not None for r in rows)
    extra = "Values | Critic | " if critic else ""
    lines = [f"| Config | GPUs | Step (s) | Train | Refit | Generation | Logprobs | {extra}Tokens/sample | Gen tok/GPU-s | "
             "Train MFU | Command | Date | Machine | Commit |",
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if critic else "") + "---:|---:|---:|---|---|---|---|"]
    for r in rows:
        mfu = f"{100 * r['train_mfu']:.1f}%" if r.get("train_mfu") else ""
        phases = f"{_f(r.get('values_s'))} | {_f(r.get('critic_train_s'))} | " if critic else ""
        lines.append(f"| `{r['variant']}` | {r['gpus']} | **{_f(r['step_s'])}** | {_f(r['train_s'])} | {_f(r['refit_s'])} | "
                     f"{_f(r['generation_s'])} | {_f(r.get('logprobs_s'))} | {phases}{_f(r.get('tokens_per_sample'), 0)} | "
                     f"{_f(r.get('gen_tokens_per_gpu_s'), 0)} | {mfu} | `{grpo_command(r)}` | {r['date'][:10]} | "
                     f"{machine(r)} | `{str(r['commit'])[:7]}` |")
    return "\n".join(lines)


def engine_pairs(steps: list[dict], rows: list[dict]) -> list[dict]:
    """Each row of a generator other than vLLM, after the vLLM row of the same configuration that ran just before it
    on the same machine (``bench_grpo_step.py --generator``: the pair runs back to back in one call)."""
    out = []
    for other in (r for r in steps if r.get("generator") not in (None, "vllm")):
        before = _run_just_before(rows, _variant_settings(other["variant"])[0], other)
        out += [before, other] if before else [other]
    return out


ALLOCATOR_SETTING = f"{ALLOCATOR_ENV}="  # results_log.py names a row's allocator settings so in its variant


def _allocator_env(settings: list[str]) -> str:
    """The environment prefix of a command that reproduces a row run under torch's allocator settings ("" if none)."""
    return "".join(f"{s} " for s in settings if s.startswith(ALLOCATOR_SETTING))


def _variant_settings(variant: str) -> tuple[str, list[str]]:
    """A row's configuration and the bracketed items its variant adds (``--set`` settings, the generator, torch's
    allocator settings)."""
    name, _, rest = variant.partition(" [")
    return name, [item.rstrip("]") for item in rest.split(" [")] if rest else []


def _run_just_before(rows: list[dict], variant: str, row: dict) -> dict | None:
    """The newest ``bench_grpo_step`` row of ``variant`` on ``row``'s machine from before ``row``, if any."""
    before = [r for r in rows if r.get("bench") == "bench_grpo_step" and r.get("variant") == variant
              and r.get("machine") == row["machine"] and r["date"] < row["date"]]
    return max(before, key=lambda r: r["date"]) if before else None


MEMORY_KEYS = ("gpu_memory_utilization", "empty_unused_memory_level", "offload_trainer_state")


SESSION_S = 2 * 3600  # the runs of a pair's sides: the same machine and commit, within this of the hand-set side's newest


def hand_set_pairs(steps: list[dict], rows: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """Each row run with hand-set memory settings (``--set`` of memory keys only: ``fits_pair`` in
    ``benchmarks/gpu/fits.sh``), with the rows of the same configuration and no key that ran on the same machine and
    commit (the pair runs back to back in one call; ``FITS_PAIR_ORDER=ABBA`` repeats each side): (no key, hand-set)
    rows, oldest first."""
    out = []
    for hand in steps:
        name, settings = _variant_settings(hand["variant"])
        if not settings or not all("=" in s and any(k in s.split("=")[0] for k in MEMORY_KEYS) for s in settings):
            continue
        no_key = _session_runs(rows, name, hand)
        if no_key and no_key[0]["date"] < hand["date"]:
            out.append((no_key, _session_runs(rows, hand["variant"], hand)))
    return out


def _session_runs(rows: list[dict], variant: str, newest_row: dict) -> list[dict]:
    """The ``bench_grpo_step`` rows of ``variant`` on ``newest_row``'s machine and commit, within :data:`SESSION_S`
    of it, oldest first."""
    end = datetime.fromisoformat(newest_row["date"])
    return sorted((r for r in rows if r.get("bench") == "bench_grpo_step" and r.get("variant") == variant
                   and r.get("machine") == newest_row["machine"] and r.get("commit") == newest_row.get("commit")
                   and abs((end - datetime.fromisoformat(r["date"])).total_seconds()) <= SESSION_S),
                  key=lambda r: r["date"])


def hand_set_table(pairs: list[tuple[list[dict], list[dict]]]) -> str:
    """No memory key (the run's plan chooses) beside hand-set memory settings: each side's mean step (each run's in
    parentheses where it ran more than once) and mean generation."""
    lines = ["| Config | Machine | No key: engine share | Step (s) | Generation | Hand-set | Step (s) | Generation | "
             "No key / hand-set | Date | Commit |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|---|"]

    def mean(side: list[dict], key: str) -> float | None:
        values = [r[key] for r in side if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    def step(side: list[dict]) -> str:
        each = f" ({', '.join(_f(r['step_s']) for r in side)})" if len(side) > 1 else ""
        return f"**{_f(mean(side, 'step_s'))}**{each}"

    for auto, hand in pairs:
        settings = ", ".join(f"`{s}`" for s in _variant_settings(hand[-1]["variant"])[1])
        lines.append(f"| `{auto[-1]['variant']}` | {machine(auto[-1])} | {_f(auto[-1].get('memory_plan/engine_fraction'))} | "
                     f"{step(auto)} | {_f(mean(auto, 'generation_s'))} | {settings} | {step(hand)} | "
                     f"{_f(mean(hand, 'generation_s'))} | {mean(auto, 'step_s') / mean(hand, 'step_s'):.2f} | "
                     f"{hand[-1]['date'][:10]} | `{str(hand[-1]['commit'])[:7]}` |")
    return "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
    """Rows with the run's memory plan: the engine's share and the release the plan chose, the step, and each
    phase's predicted peak beside the device's measured one (NVML; torch's allocator in parentheses): training
    is the trainer's phases (logprobs, training), generation the engine's awake ones (refit, generation)."""
    lines = ["| Config | Machine | Engine share | State released | Step (s) | Training: plan / measured GiB | "
             "Generation: plan / measured GiB | Command | Date | Commit |",
             "|---|---|---:|---|---:|---|---|---|---|---|"]

    def pair(plan, measured, torch_peak) -> str:
        if plan is None or measured is None:
            return ""
        return f"{plan:.1f} / {measured:.1f} ({100 * (measured / plan - 1):+.0f}%; torch {_f(torch_peak, 1)})"

    for r in rows:
        train = max((r[k] for k in ("memory/training_device_gib", "memory/logprobs_device_gib") if r.get(k) is not None),
                    default=None)
        train_torch = max((r[k] for k in ("memory/training_torch_gib", "memory/logprobs_torch_gib") if r.get(k) is not None),
                          default=None)
        awake = [k for k in ("memory/generation_device_gib", "memory/refit_device_gib") if r.get(k) is not None]
        awake_torch = [k for k in ("memory/generation_torch_gib", "memory/refit_torch_gib") if r.get(k) is not None]
        gen = max((r[k] for k in awake), default=None)
        gen_torch = max((r[k] for k in awake_torch), default=None)
        released = "yes" if r.get("memory_plan/offload_trainer_state") else "no"
        lines.append(f"| `{r['variant']}` | {machine(r)} | {_f(r.get('memory_plan/engine_fraction'))} | {released} | "
                     f"**{_f(r['step_s'])}** | {pair(r.get('memory_plan/training_gib'), train, train_torch)} | "
                     f"{pair(r.get('memory_plan/generation_gib'), gen, gen_torch)} | "
                     f"`{grpo_command(r)}` | {r['date'][:10]} | `{str(r['commit'])[:7]}` |")
    return "\n".join(lines)


def endpoint_table(rows: list[dict]) -> str:
    """Each ``*-tool-agent`` row (an agent through the OpenAI-compatible endpoint) beside the
    ``*-tool-async`` row of the same work and machine (``rlcore.generation.rollout``): the endpoint's overhead."""
    lines = ["| Config | Rollouts through | Step (s) | Generation | Endpoint overhead (step) | Command | Date | Machine | Commit |",
             "|---|---|---:|---:|---:|---|---|---|---|"]
    for agent in (r for r in rows if str(r["variant"]).endswith("-tool-agent")):
        base_name = str(agent["variant"])[: -len("agent")] + "async"
        same = [r for r in rows if r["variant"] == base_name and r["config"] == agent["config"] and machine(r) == machine(agent)]
        if not same:
            continue
        base = same[-1]
        for r, via in ((base, "`rlcore.generation.rollout`"), (agent, "the endpoint")):
            extra = ""
            if r is agent:
                extra = f"{agent['step_s'] - base['step_s']:+.2f} s ({100 * (agent['step_s'] / base['step_s'] - 1):+.1f}%)"
            lines.append(f"| `{r['variant']}` | {via} | **{_f(r['step_s'])}** | {_f(r['generation_s'])} | {extra} | "
                         f"`{grpo_command(r)}` | {r['date'][:10]} | {machine(r)} | `{str(r['commit'])[:7]}` |")
    return "\n".join(lines) if len(lines) > 2 else ""


def train_table(rows: list[dict]) -> str:
    lines = ["| Variant | Shape | Layout | GPUs | Step (s) | Tokens/s | MFU | Peak GiB | Command | Date | Machine | Commit |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['config']} | {r.get('layout', '')} | {r['gpus']} | {_f(r['step_s'], 3)} | "
                     f"{_f(r.get('tokens_per_s'), 0)} | {100 * r.get('mfu', 0):.1f}% | {_f(r.get('peak_mem_gib'), 1)} | "
                     f"`{train_command(r)}` | "
                     f"{r['date'][:10]} | {machine(r)} | `{str(r['commit'])[:7]}` |")
    return "\n".join(lines)


def sandbox_table(rows: list[dict]) -> str:
    """The code environment's grading throughput (``bench_code_sandbox.py``): one bwrap sandbox per solution."""
    lines = ["| Sandboxes at once | Solutions | Solutions/s | Load average | Command | Date | Machine | Commit |",
             "|---:|---:|---:|---:|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['solutions']} | **{_f(r['solutions_per_s'], 1)}** | {_f(r.get('load_average'), 1)} | "
                     f"`python benchmarks/bench_code_sandbox.py --solutions {r['solutions']} --workers {r['workers']}` | "
                     f"{r['date'][:10]} | {machine(r)} | `{str(r['commit'])[:7]}` |")
    return "\n".join(lines)


# The demo's figures in README.md and docs/performance.md: the text between these markers is
# written by --write-demo from the newest "demo" row (python -m rlcore.cli.demo --record), never by hand.
DEMO_BEGIN = "<!-- demo figures: python benchmarks/performance_tables.py --write-demo -->"
DEMO_END = "<!-- end of demo figures -->"
DEMO_PAGES = {"README.md": "readme", "docs/performance.md": "performance"}


def newest_demo(rows: list[dict]) -> dict:
    demo = [r for r in rows if r.get("bench") == "demo" and r.get("variant") == "make demo"]
    if not demo:
        raise SystemExit("no 'make demo' row in the results: python -m rlcore.cli.demo --record benchmarks/results.jsonl")
    return max(demo, key=lambda r: r["date"])


def demo_readme(row: dict) -> str:
    """What the demo printed at its end: the SFT warm start's last line, the summary table, the result."""
    import io

    from rich.console import Console

    from rlcore.controller.run_end import change, summary_table

    summary = {"window_first": row["window_first"], "window_last": row["window_last"], "timing/total": row["step_s"],
               "timing/training": row["train_s"], "timing/refit": row["refit_s"], "timing/generation": row["generation_s"],
               "timing/logprobs": row["logprobs_s"], "timing/reward": row["reward_s"],
               "rollout/mean_response_tokens": row["tokens_per_sample"]}
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(summary_table(summary, "grpo"))
    lines = [f"SFT warm start: {row['sft_steps']} steps, {row['sft_s']:.0f}s, held-out greedy accuracy {row['sft_accuracy']:.3f}"
             ] if row.get("sft_s") is not None else []
    lines += [line.rstrip() for line in console.file.getvalue().splitlines()]
    lines.append(f"GRPO took {row['grpo_s']:.0f}s; held-out accuracy {change(row['val_accuracy_first'], row['val_accuracy_last'])}")
    return "```text\n" + "\n".join(lines) + "\n```"


def demo_performance(row: dict) -> str:
    lines = ["| Steps | SFT warm start | GRPO | Step (s) | Train | Refit | Generation | Logprobs | Tokens/sample | Held-out accuracy | "
             "Load average | Command | Date | Machine | Commit |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|---|---|"]
    warm = f"{row['sft_steps']} steps, {row['sft_s']:.0f} s" if row.get("sft_s") is not None else "not recorded"
    lines.append(f"| {row['steps']} | {warm} | {row['grpo_s']:.0f} s | **{_f(row['step_s'])}** | {_f(row['train_s'])} | "
                 f"{_f(row['refit_s'])} | {_f(row['generation_s'])} | {_f(row['logprobs_s'])} | {_f(row['tokens_per_sample'], 1)} | "
                 f"{row['val_accuracy_first']:.3f} -> **{row['val_accuracy_last']:.3f}** | {_f(row.get('load_average'), 1)} | "
                 f"`make demo` | {row['date'][:10]} | {machine(row)} | `{str(row['commit'])[:7]}` |")
    return "\n".join(lines)


def write_demo(rows: list[dict], root: Path, check: bool) -> int:
    """Put the newest demo row's figures between the markers of each page (``check``: say which differ)."""
    row = newest_demo(rows)
    stale = []
    for page, kind in DEMO_PAGES.items():
        path = root / page
        text = path.read_text()
        before, rest = text.split(DEMO_BEGIN, 1)
        _, after = rest.split(DEMO_END, 1)
        figures = demo_readme(row) if kind == "readme" else demo_performance(row)
        new = f"{before}{DEMO_BEGIN}\n{figures}\n{DEMO_END}{after}"
        if new != text:
            stale.append(page)
            if not check:
                path.write_text(new)
    if check and stale:
        print(f"the demo's figures in {', '.join(stale)} are not the newest demo row's: python benchmarks/performance_tables.py --write-demo")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results.jsonl")
    parser.add_argument("--write-demo", action="store_true", help="write the newest demo row's figures into README.md "
                        "and docs/performance.md (between their demo-figures markers)")
    parser.add_argument("--check-demo", action="store_true", help="exit 1 if those pages do not show the newest demo row")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    if args.write_demo or args.check_demo:
        return write_demo(rows, HERE.parent, check=args.check_demo)
    steps = newest(rows, "bench_grpo_step")
    ppo = [r for r in steps if r.get("values_s") is not None]  # a critic's phases: PPO's own table
    steps = [r for r in steps if r not in ppo]
    gpu = [r for r in steps if "cpu" not in r["machine"].lower()]
    plain = [r for r in gpu if "[" not in r["variant"]]
    print("### GRPO step, GPU\n\n" + grpo_table(plain) + "\n")
    planned = [r for r in gpu + ppo if r.get("memory_plan/training_gib") is not None]
    if planned:
        print("### Memory: the run's plan against the measured peaks\n\n" + memory_table(planned) + "\n")
    print("### PPO step (a critic beside the policy)\n\n" + grpo_table(ppo) + "\n")
    hand_set = hand_set_pairs(gpu + ppo, rows)
    if hand_set:
        print("### Memory: no key beside hand-set settings\n\n" + hand_set_table(hand_set) + "\n")
    pairs = engine_pairs(gpu, rows)
    if pairs:
        print("### GRPO step, GPU: SGLang beside vLLM\n\n" + grpo_table(pairs) + "\n")
    print("### GRPO step, GPU, with experimental settings\n\n" + grpo_table([r for r in gpu if r not in plain + pairs + [h[-1] for _, h in hand_set]]) + "\n")
    print("### GRPO step, CPU (tiny shapes)\n\n" + grpo_table([r for r in steps if r not in gpu]) + "\n")
    endpoint = endpoint_table(steps)
    if endpoint:
        print("### Agents through the endpoint (3-turn tool workload)\n\n" + endpoint + "\n")
    train = [r for r in newest(rows, "bench_train_megatron") if "cpu" not in r["machine"].lower()]
    print("### Training step alone (`bench_train_megatron.py`)\n\n" + train_table(train) + "\n")
    learned = [r for r in newest(rows, "learning") if r.get("steps")]
    print("### Learning runs\n\n" + learning_table(learned) + "\n")
    print("### Code environment grading (`bench_code_sandbox.py`)\n\n" + sandbox_table(newest(rows, "bench_code_sandbox")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
