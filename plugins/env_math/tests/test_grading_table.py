"""Table-driven grading through the production path (a spawned process pool): >= 60 cases,
each with its expected reward and status, each answered within its time limit."""

from __future__ import annotations

import time

import pytest

from grading_cases import all_cases
from rlcore_math.config import GradingConfig
from rlcore_math.grading import reward_of
from rlcore_math.pool import InlineGrader, ProcessGradingPool

pytestmark = pytest.mark.wall_clock

OPTIONS = GradingConfig(num_workers=2, timeout_s=2.0, kill_grace_s=1.0)
# Per case: the verification deadline, the kill grace, and slack for pipes on a busy 2-core box.
CASE_LIMIT_S = OPTIONS.timeout_s + OPTIONS.kill_grace_s + 2.0
CASES = all_cases()


def test_table_is_big_enough():
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def pool():
    pool = ProcessGradingPool(OPTIONS)
    pool.grade(["1"], ["1"])  # wait until the workers are up (imports), outside any case's clock
    yield pool
    pool.close()


@pytest.mark.parametrize("case_id,response,gold,reward,status", CASES, ids=[c[0] for c in CASES])
def test_graded_case(pool, case_id, response, gold, reward, status):
    started = time.monotonic()
    verdict = pool.grade([response], [gold])[0]
    elapsed = time.monotonic() - started
    assert (reward_of(verdict, OPTIONS), verdict.status) == (reward, status), verdict
    assert elapsed < CASE_LIMIT_S, f"{case_id} took {elapsed:.2f}s"


def test_whole_table_in_one_batch_keeps_order(pool):
    # Cheap cases only (timeouts are covered per case): one batch spread over both workers.
    cases = [c for c in CASES if c[4] != "timeout"]
    verdicts = pool.grade([c[1] for c in cases], [c[2] for c in cases])
    got = [(c[0], reward_of(v, OPTIONS), v.status) for c, v in zip(cases, verdicts)]
    assert got == [(c[0], c[3], c[4]) for c in cases]
    assert pool.restarts == 0


def test_inline_grader_agrees_on_cheap_cases():
    cases = [c for c in CASES if c[4] in ("ok", "parse_error", "rejected")][:25]
    # Agreement, not speed (each case's time is checked above): a deadline no cheap case meets only on a loaded machine.
    patient = GradingConfig(executor="inline", timeout_s=60.0)
    verdicts = InlineGrader(patient).grade([c[1] for c in cases], [c[2] for c in cases])
    assert [(reward_of(v, OPTIONS), v.status) for v in verdicts] == [(c[3], c[4]) for c in cases]


def test_format_reward_and_strict_format():
    lenient = GradingConfig(executor="inline", format_reward=0.5, answer_format="boxed")
    verdicts = InlineGrader(lenient).grade(["\\boxed{4}", "so it is 4", "\\boxed{5}"], ["4", "4", "4"])
    assert [reward_of(v, lenient) for v in verdicts] == [1.5, 1.0, 0.5]
    strict = GradingConfig(executor="inline", answer_format="boxed", strict_format=True)
    verdicts = InlineGrader(strict).grade(["\\boxed{4}", "so it is 4"], ["4", "4"])
    assert [(reward_of(v, strict), v.status) for v in verdicts] == [(1.0, "ok"), (0.0, "format_error")]


def test_stuck_worker_is_killed_and_replaced():
    options = GradingConfig(num_workers=2, timeout_s=0.5, kill_grace_s=0.5, chunk_size=8)
    pool = ProcessGradingPool(options, grade_fn="hang_helpers:blocking_grade")
    try:
        pool.grade(["1"], ["1"])
        started = time.monotonic()
        verdicts = pool.grade(["hang", "#### 3", "\\boxed{4}", "5"], ["1", "3", "4", "6"])
        elapsed = time.monotonic() - started
        assert [(v.correct, v.status) for v in verdicts] == [(False, "timeout"), (True, "ok"), (True, "ok"), (False, "ok")]
        assert pool.restarts == 1
        assert elapsed < 10, elapsed
        assert pool.grade(["#### 7"], ["7"])[0].correct  # the replacement works
    finally:
        pool.close()


def test_dead_worker_scores_error_and_is_replaced():
    options = GradingConfig(num_workers=1, timeout_s=1.0)
    pool = ProcessGradingPool(options, grade_fn="hang_helpers:crashing_grade")
    try:
        verdicts = pool.grade(["crash", "#### 3"], ["1", "3"])
        assert [(v.correct, v.status) for v in verdicts] == [(False, "error"), (True, "ok")]
        assert pool.restarts == 1
    finally:
        pool.close()


def test_worker_killed_while_idle_is_replaced():
    # The sixteenth GPU session lost a batch's rewards to this: a grader killed between batches (the host
    # out of memory) got the next chunk through a broken pipe, and the whole batch scored 0.
    import os
    import signal

    pool = ProcessGradingPool(GradingConfig(num_workers=2, timeout_s=2.0, chunk_size=2))
    try:
        pool.grade(["#### 1", "#### 2"], ["1", "2"])  # both workers up
        for worker in pool._workers:
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.join(timeout=5)
            assert not worker.process.is_alive()
        verdicts = pool.grade(["#### 3", "#### 4", "#### 5", "#### 9"], ["3", "4", "5", "6"])
        assert [(v.correct, v.status) for v in verdicts] == [(True, "ok")] * 3 + [(False, "ok")]
        assert pool.restarts == 2
    finally:
        pool.close()


def test_workers_that_cannot_start_raise_a_clear_error():
    pool = ProcessGradingPool(GradingConfig(num_workers=1, timeout_s=1.0), grade_fn="no_such_module:grade")
    try:
        with pytest.raises(RuntimeError, match=r"grader workers were replaced.*no_such_module:grade"):
            pool.grade(["#### 3"], ["3"])
    finally:
        pool.close()


def test_deadline_restores_an_outer_timer():
    import signal

    from rlcore_math.grading import GradeTimeout, call_with_deadline

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        assert call_with_deadline(lambda: 7, 0.2) == 7
        with pytest.raises(GradeTimeout):
            call_with_deadline(lambda: time.sleep(1), 0.1)
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0 < remaining < 0.6
        time.sleep(remaining + 0.2)
        assert fired == [True]  # the outer timer (pytest-timeout, say) still fired, with its handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
