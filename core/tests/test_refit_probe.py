"""The refit probe (in ``Refitter.refit``): generator and trainer score the step's first sequences
after a refit; a mean gap over the threshold stops the run with an error that says which side moved
away from the rollout's own logprobs (a stale or corrupt generator, or a trainer whose logprob
pass is off). The fault is injected: the generator scores with logprobs the trainer does not."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rlcore.config.generation import RefitConfig
from rlcore.generation.batching import Trajectory, to_sequence_batch
from rlcore.controller.context import RunContext
from rlcore.controller.refit_probe import RefitError
from rlcore.controller.refitter import Refitter
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import GenerationResult, Sample

RESPONSE_LOGPROBS = [[-0.5, -1.0, -1.5], [-0.25, -0.75]]


class Scorer:
    """Logprobs of each sequence's tokens (0 for the first): the rollout's, shifted by ``shift``."""

    def __init__(self, prompt_lens: list[int], shift: float):
        self.prompt_lens, self.shift = prompt_lens, shift

    def rows(self, n_seqs: int) -> list[list[float]]:
        return [[0.0] * p + [lp + self.shift for lp in lps] for p, lps in zip(self.prompt_lens, RESPONSE_LOGPROBS)][:n_seqs]

    def score(self, sequences):  # the generator's side
        return self.rows(len(sequences))

    def logprobs(self, batch, what: str):  # the trainer's side
        return [torch.tensor(row) for row in self.rows(len(batch))]


def probe_refitter(generator_shift: float, threshold: float = 0.15) -> tuple[Refitter, object]:
    trajs = [Trajectory(Sample(prompt="p"), 0, GenerationResult(prompt_ids=prompt, response_ids=response,
                                                                 response_logprobs=lps, finish_reason="stop"))
             for prompt, response, lps in [([1, 2], [3, 4, 5], RESPONSE_LOGPROBS[0]), ([1], [6, 7], RESPONSE_LOGPROBS[1])]]
    batch = to_sequence_batch(trajs, torch.zeros(2), max_len=16)
    refitter = Refitter(trainer=Scorer([2, 1], 0.0), generator=Scorer([2, 1], generator_shift),
                        transport=SimpleNamespace(name="none", transfer=lambda trainer, generator: {}),
                        config=RefitConfig(probe_threshold=threshold, probe_num_sequences=4),
                        context=RunContext(max_sequence_length=16))
    return refitter, batch


def test_probe_passes_with_matching_weights_and_reports_the_gap():
    refitter, batch = probe_refitter(generator_shift=0.01)
    metrics = refitter.refit(batch, StepTimer(), 3)
    assert metrics["refit/probe_mean_abs_logprob_diff"] == pytest.approx(0.01, abs=1e-6)
    assert metrics["refit/probe_max_abs_logprob_diff"] == pytest.approx(0.01, abs=1e-6)


def test_probe_failure_names_the_gap_and_which_side_moved_from_the_rollout():
    refitter, batch = probe_refitter(generator_shift=-2.0)
    with pytest.raises(RefitError) as info:
        refitter.refit(batch, StepTimer(), 3)
    message = str(info.value)
    # five response tokens, mean rollout logprob (-0.5 - 1 - 1.5 - 0.25 - 0.75) / 5 = -0.8
    assert "at step 3" in message and "differ by 2 on average" in message and "over 5 probe tokens" in message
    assert "probe_threshold=0.15" in message
    assert "generator -2.8, trainer -0.8, the rollout's own at the weights before -0.8" in message


class LockThatLetsWaitersIn:
    """The generator's lock with a fair hand-over forced: each release pauses, so a thread waiting for the lock
    takes it before the releasing thread can take it again (a schedule CPython allows, rarely)."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()
        time.sleep(0.2)


def test_the_probe_scores_before_a_waiting_rollout_thread_generates():
    """One step off: the rollout thread waits for the lock during the refit to start the next batch.
    The probe's generator pass must come before that generation, or the step waits for all of it."""
    refitter, batch = probe_refitter(generator_shift=0.01)
    refitter.generator_lock = LockThatLetsWaitersIn()
    order: list[str] = []
    waiting = threading.Event()

    def rollout_thread():
        waiting.set()
        with refitter.generator_lock:
            order.append("generate")

    producer = threading.Thread(target=rollout_thread)

    class Transport:
        name = "ordered"

        def transfer(self, trainer, generator):
            producer.start()
            waiting.wait(5)
            time.sleep(0.05)  # the producer is now blocked on the lock the refit holds
            order.append("transfer")
            return {"seconds": 0.1, "bytes": 1e8}

    scorer = refitter.generator
    refitter.transport = Transport()
    refitter.generator = SimpleNamespace(score=lambda sequences: (order.append("score"), scorer.score(sequences))[1])
    metrics = refitter.refit(batch, StepTimer(), 3)
    producer.join(5)
    assert order == ["transfer", "score", "generate"]
    assert metrics["refit/probe_mean_abs_logprob_diff"] == pytest.approx(0.01, abs=1e-6)


def test_a_sequence_that_fills_the_length_limit_is_probed_on_its_scorable_tokens():
    """A generator scores by prefilling a sequence and sampling one token more, so it takes at most
    limit - 1 tokens (vLLM: "need 2..limit-1"); a rollout at the limit is probed on those."""
    refitter, batch = probe_refitter(generator_shift=0.01)
    limit = max(batch.lengths())  # the first sequence (2 + 3 tokens) fills it
    refitter.max_len = limit
    scorer = refitter.generator

    def score_like_an_engine(sequences):
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= limit - 1:
                raise ValueError(f"score: sequence {i} has {len(seq)} tokens; need 2..{limit - 1}")
        return [row[: len(seq)] for row, seq in zip(scorer.score(sequences), sequences)]

    refitter.generator = SimpleNamespace(score=score_like_an_engine)
    refitter.trainer = SimpleNamespace(logprobs=lambda probe, what: [t[: len(ids)] for t, ids in zip(
        Scorer([2, 1], 0.0).logprobs(probe, what), probe.input_ids)])
    metrics = refitter.refit(batch, StepTimer(), 3)
    assert metrics["refit/probe_mean_abs_logprob_diff"] == pytest.approx(0.01, abs=1e-6)


@pytest.mark.wall_clock
@pytest.mark.parametrize("hang", ["transfer", "score"])
def test_a_hung_transfer_or_probe_scoring_stops_the_refit_within_cluster_timeout(hang):
    """An injected fault: the transport's transfer, or the generator's scoring of the probe, never returns."""
    import time

    from rlcore.deadlines import GenerationTimeout

    refitter, batch = probe_refitter(generator_shift=0.01)
    released = threading.Event()
    if hang == "transfer":
        refitter.transport = SimpleNamespace(name="stuck", transfer=lambda trainer, generator: released.wait(60))
    else:
        refitter.generator = SimpleNamespace(score=lambda sequences: released.wait(60))
    refitter.timeout_s = 1.0
    began = time.monotonic()
    try:
        with pytest.raises(GenerationTimeout, match=r"timeout: the refit's (weight transfer \('stuck'\)|probe scoring by "
                                                    r"the generator at step 3) did not finish within 1s \(cluster.timeout_s\)"):
            refitter.refit(batch, StepTimer(), 3)
    finally:
        released.set()
    assert time.monotonic() - began < 4.0
    assert not refitter.generator_lock.locked()
