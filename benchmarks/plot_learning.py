"""Learning curves of several GRPO runs side by side, from their ``metrics.jsonl``.

    python benchmarks/plot_learning.py NAME=PATH/metrics.jsonl ... --out learning.png [--log]

One PNG with, against the step: held-out greedy accuracy, training reward, the policy's entropy
estimate (``rollout/entropy_estimate``), the train-generator logprob gap (``train/gen_kl_error``:
mean |log p_gen - log p_train| of the sampled tokens) and, when a run has it, the KL to the
reference; and held-out accuracy against wall time (``time/elapsed_s``), for sync against async.
A resumed run's file holds its earlier records too (a record of a step redone after a resume
replaces the first one). ``--log`` appends one row per run to ``benchmarks/results.jsonl``
(start and end accuracy, steps, wall time, backend) and ``--band`` checks two runs' accuracy
curves against each other over the last 20% of steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PANELS = [
    ("val/accuracy", "held-out greedy accuracy"),
    ("train/reward_mean", "training reward"),
    ("rollout/entropy_estimate", "entropy estimate (nats/token)"),
    ("train/gen_kl_error", "train-generator |logprob gap|"),
    ("train/kl", "KL to reference"),
]


def load(path: Path) -> list[dict]:
    """Records by step, the last record of a step winning (a resumed run redoes the steps after its
    checkpoint)."""
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record.get("step", -1))] = {**by_step.get(int(record.get("step", -1)), {}), **record}
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    pts = [(r[x], r[key]) for r in records if key in r and x in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


BAND = 0.05  # the largest mean |accuracy gap| over the last 20% of steps that counts as "within the band"


def band(a: list[dict], b: list[dict], share: float = 0.2) -> dict:
    """Held-out accuracy of two runs at the steps both validated, over the last ``share`` of steps."""
    xa, ya = series(a, "val/accuracy")
    xb, yb = series(b, "val/accuracy")
    common = sorted(set(xa) & set(xb))
    if not common:
        return {"steps_compared": 0}
    last = [s for s in common if s >= common[-1] * (1 - share)]
    da, db = dict(zip(xa, ya)), dict(zip(xb, yb))
    gaps = [abs(da[s] - db[s]) for s in last]
    return {"steps_compared": len(last), "max_abs_gap": max(gaps), "mean_abs_gap": sum(gaps) / len(gaps),
            "mean_a": sum(da[s] for s in last) / len(last), "mean_b": sum(db[s] for s in last) / len(last)}


def summary(name: str, records: list[dict]) -> dict:
    _, acc = series(records, "val/accuracy")
    steps = [r["step"] for r in records if "timing/total" in r]
    elapsed = [r["time/elapsed_s"] for r in records if "time/elapsed_s" in r]
    gaps = [r["train/gen_kl_error"] for r in records if "train/gen_kl_error" in r]
    probe = [r["refit/probe_mean_abs_logprob_diff"] for r in records if "refit/probe_mean_abs_logprob_diff" in r]
    probe_worst = [r["refit/probe_max_abs_logprob_diff"] for r in records if "refit/probe_max_abs_logprob_diff" in r]
    return {"variant": name, "val_accuracy_start": acc[0] if acc else None, "val_accuracy_end": acc[-1] if acc else None,
            "val_accuracy_max": max(acc) if acc else None, "steps": max(steps) if steps else 0,
            "wall_s": max(elapsed) if elapsed else None,
            "mean_step_s": sum(r["timing/total"] for r in records if "timing/total" in r) / max(1, len(steps)),
            "gen_kl_error_mean": sum(gaps) / len(gaps) if gaps else None,
            "probe_mean_abs_logprob_gap_max": max(probe) if probe else None,
            "probe_max_abs_logprob_gap_max": max(probe_worst) if probe_worst else None, "refits_probed": len(probe)}


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, label) for k, label in PANELS if any(series(r, k)[0] for r in runs.values())]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.6))
    for ax, (key, label) in zip(axes, panels):
        for name, records in runs.items():
            xs, ys = series(records, key)
            ax.plot(xs, ys, marker="o" if key == "val/accuracy" else None, markersize=3, label=name)
        ax.set_xlabel("GRPO step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for name, records in runs.items():
        xs, ys = series(records, "val/accuracy", x="time/elapsed_s")
        ax.plot([x / 60 for x in xs], ys, marker="o", markersize=3, label=name)
    ax.set_xlabel("wall time (min)")
    ax.set_title("held-out accuracy vs wall time", fontsize=10)
    ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl")
    parser.add_argument("--out", default="learning.png")
    parser.add_argument("--title", default="GRPO on 3-digit +/- (recipes/grpo_arith3_gpu.yaml), one H200")
    parser.add_argument("--band", nargs=2, metavar=("A", "B"), action="append", default=[],
                        help="compare two runs' held-out accuracy over the last 20%% of steps (repeatable)")
    parser.add_argument("--log", action="store_true", help="append one row per run to benchmarks/results.jsonl")
    parser.add_argument("--machine", default=None, help="machine label of the rows (the runs' machine, not this one)")
    parser.add_argument("--config", default="grpo_arith3_gpu", help="config name of the rows (--log)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of the rows (--log)")
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        runs[name] = load(Path(path))
    plot(runs, Path(args.out), args.title)
    rows = [summary(name, records) for name, records in runs.items()]
    for row in rows:
        print(json.dumps(row))
    bands = []
    for a, b in args.band:
        missing = [name for name in (a, b) if name not in runs]
        if missing:
            parser.error(f"--band {a} {b}: no run named {', '.join(missing)} (runs: {', '.join(runs)})")
        bands.append({"variant": f"band {a} vs {b}", **band(runs[a], runs[b]), "band": BAND})
        print(json.dumps(bands[-1]))
    if args.log:
        import results_log

        if args.machine:
            results_log.machine = lambda: args.machine
        results_log.append(rows, bench="learning", config=args.config, gpus=args.gpus)
        if bands:
            results_log.append(bands, bench="learning-band", config=args.config, gpus=args.gpus)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
