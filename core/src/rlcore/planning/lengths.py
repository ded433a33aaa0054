"""Response lengths for a plan: a mean and a tail (the longest response of a step), given on the command
line or read from a previous run's ``metrics.jsonl``.

Generation time depends on both: an engine decodes its share of the tokens in full batches, and then its
longest sequences alone (the decode tail), so a step whose mean response is 800 tokens but whose longest
runs to a 4000-token limit takes about as many decode steps as the limit. Training and logprob passes see
the total tokens, so the mean. The spread between them (the second moment, for attention FLOPs) is not
known from a mean and a maximum; the planner takes every sequence at the mean there.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from attrs import frozen

from rlcore.config.structure import ConfigError

FLAG = "--lengths-from"
MEAN, LONGEST, PROMPT = "rollout/mean_response_tokens", "rollout/max_response_tokens", "rollout/mean_prompt_tokens"
# (share of the responses, the metric of the length below which that share lies)
QUANTILES = ((0.0, "rollout/min_response_tokens"), (0.5, "rollout/p50_response_tokens"), (0.9, "rollout/p90_response_tokens"),
             (0.99, "rollout/p99_response_tokens"))


@frozen
class Lengths:
    prompt: float
    response_mean: float
    response_max: float
    steps: int  # records they came from
    quantiles: tuple = ()  # ((share, tokens), ...) of the responses, ending at (1, response_max); () when not logged

    def seq_sq_mean(self, prompt: float) -> float | None:
        return seq_sq_mean(prompt, self.quantiles) if self.quantiles else None


def seq_sq_mean(prompt: float, quantiles: tuple) -> float:
    """The mean of (prompt + response)^2 over responses whose quantile function is linear between the points
    ``((share, tokens), ...)`` (from share 0 to 1): on each piece from ``a`` to ``b`` the mean of a square is
    ``(A^2 + AB + B^2) / 3``."""
    total = 0.0
    for (u0, a), (u1, b) in zip(quantiles, quantiles[1:]):
        low, high = prompt + a, prompt + b
        total += (u1 - u0) * (low * low + low * high + high * high) / 3
    return total


def from_metrics(path: str | Path, skip_first: int = 1) -> Lengths:
    """The mean prompt and response lengths and the mean of each step's longest response over a run's
    records (``metrics.jsonl``), leaving out the first ``skip_first`` steps when there are more."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(FLAG, f"{path} is not a file (a run's metrics.jsonl)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(FLAG, f"{path} line {number}: not JSON ({exc.msg})") from None
        if isinstance(record, dict) and all(isinstance(record.get(k), (int, float)) for k in (MEAN, LONGEST, PROMPT)):
            records.append(record)
    if not records:
        raise ConfigError(FLAG, f"{path} has no record with {MEAN}, {LONGEST} and {PROMPT} (the rollout metrics of a run)")
    if len(records) > skip_first:
        records = records[skip_first:]
    mean = statistics.fmean(r[MEAN] for r in records)
    longest = statistics.fmean(r[LONGEST] for r in records)
    prompt = statistics.fmean(r[PROMPT] for r in records)
    if mean <= 0 or longest < mean:
        raise ConfigError(FLAG, f"{path}: mean response {mean:.1f} and longest {longest:.1f} tokens are not lengths to plan with")
    return Lengths(prompt=prompt, response_mean=mean, response_max=longest, steps=len(records),
                   quantiles=_quantiles(path, records, longest))


def _quantiles(path: Path, records: list[dict], longest: float) -> tuple:
    """The percentiles' means over the records, when every record logged them (runs before they were logged did not)."""
    if not all(isinstance(r.get(key), (int, float)) for r in records for _, key in QUANTILES):
        return ()
    points = tuple((share, statistics.fmean(r[key] for r in records)) for share, key in QUANTILES) + ((1.0, longest),)
    tokens = [t for _, t in points]
    if tokens[0] < 0 or any(b < a for a, b in zip(tokens, tokens[1:])):
        raise ConfigError(FLAG, f"{path}: response percentiles {', '.join(f'{t:.1f}' for t in tokens)} (min, p50, p90, p99, "
                          "longest) do not rise")
    return points
