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


@frozen
class Lengths:
    prompt: float
    response_mean: float
    response_max: float
    steps: int  # records they came from


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
    return Lengths(prompt=prompt, response_mean=mean, response_max=longest, steps=len(records))
