"""The run calls plugin objects through the members their protocols declare (rlcore.interfaces):
no member is looked up by name on a plugin object in the run code, an optional member is tested
for with its own protocol, and the conformance suites name a missing member."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import rlcore
from rlcore.controller.checkpoint import resume_loggers
from rlcore.interfaces import Algorithm, Environment, TrainingBackend, plugin_name
from rlcore.testing.conformance import AlgorithmConformance, EnvironmentConformance, TrainingBackendConformance
from rlcore.testing.conformance.members import protocol_members

ROOT = Path(rlcore.__file__).parent
# The modules that run a training loop and call plugin objects.
RUN_CODE = ("controller/*.py", "agents/*.py", "deadlines.py", "interfaces/members.py", "generation/rollout.py",
            "generation/batching.py", "data/reward_fn.py", "training/steps.py", "cli/evaluation.py")

# (module, first argument, second argument) of each getattr/hasattr the run code may make: none
# on a plugin object (an environment, generator, algorithm, backend, logger, transport, dataset).
ALLOWED: dict[tuple[str, str, str], str] = {
    ("deadlines.py", "self.inner", "attr"):
        "the timeout wrappers' pass-through of attributes the caller reads; they answer isinstance as the wrapped object",
    ("deadlines.py", "signal", "'setitimer'"): "the signal module: interval timers are POSIX-only",
    ("interfaces/members.py", "obj", "name"): "the protocol check itself, naming the member an object lacks",
    ("generation/batching.py", "step", "'reward'"): "a value an environment returned, checked to be an EnvStep before use",
    ("generation/batching.py", "step", "'metrics'"): "a value an environment returned, checked to be an EnvStep before use",
    ("controller/checks.py", "packing", "key"): "a config section's two token budgets, checked alike",
    ("controller/workers.py", "self", "'pids'"): "a Ray trainer group's own state, set once its actors started",
    ("controller/workers.py", "self", "'node_ips'"): "a Ray trainer group's own state, set once its actors started",
    ("agents/runner.py", "module", "name"): "the agent named by env.agent.function ('module:attr'), imported",
    ("agents/runner.py", "value", "'reward'"): "an agent's return value: a number, a dict or an EnvStep-like object",
    ("agents/runner.py", "value", "'metrics'"): "an agent's return value: a number, a dict or an EnvStep-like object",
    ("agents/server.py", "tokenizer", "'chat_template'"): "a transformers tokenizer, not a plugin object",
    ("agents/recorder.py", "tokenizer", "'name_or_path'"): "a transformers tokenizer, not a plugin object",
    ("agents/recorder.py", "ids", "'input_ids'"): "what a chat template returned (a list or a BatchEncoding)",
    ("generation/rollout.py", "tokenizer", "'all_special_ids'"): "a transformers tokenizer, not a plugin object",
    ("data/reward_fn.py", "fn", "'__name__'"): "a reward function's name (a lambda or callable object may lack one)",
}


def lookups_by_name() -> dict[tuple[str, str, str], list[int]]:
    """Every getattr/hasattr call of the run code: (module, first argument, second argument) -> lines."""
    found: dict[tuple[str, str, str], list[int]] = {}
    for pattern in RUN_CODE:
        for path in sorted(ROOT.glob(pattern)):
            module = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                    key = (module, ast.unparse(node.args[0]), ast.unparse(node.args[1]) if len(node.args) > 1 else "")
                    found.setdefault(key, []).append(node.lineno)
    return found


def test_run_code_looks_up_no_plugin_member_by_name():
    found = lookups_by_name()
    unexpected = {key: lines for key, lines in found.items() if key not in ALLOWED}
    listed = "\n".join(f"{module}:{lines[0]}: ({first}, {second})" for (module, first, second), lines in unexpected.items())
    assert not unexpected, ("getattr/hasattr in the run code; declare the member in its protocol (rlcore.interfaces) "
                            f"and call it, or test an optional one with isinstance:\n{listed}")
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allowed lookups no longer made (remove them from ALLOWED): {stale}"


def test_the_scan_sees_a_lookup_on_a_plugin_object(tmp_path, monkeypatch):
    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "x.py").write_text("def f(generator):\n    return getattr(generator, 'metrics', None)\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert lookups_by_name() == {("controller/x.py", "generator", "'metrics'"): [2]}


# ---- optional members: what the run does without them -------------------------------------
class Recording:
    def __init__(self):
        self.calls = []

    def log(self, metrics, step):
        pass

    def close(self):
        pass


class StepOnly(Recording):
    def resume_at(self, step):
        self.calls.append(step)


class WithRecords(Recording):
    def resume_at(self, step, records=None):
        self.calls.append((step, records))


def test_resume_reaches_the_loggers_that_take_it_in_either_form():
    plain, step_only, with_records = Recording(), StepOnly(), WithRecords()
    resume_loggers([plain, step_only, with_records], 3, [{"step": 1}])
    assert plain.calls == [] and step_only.calls == [3] and with_records.calls == [(3, [{"step": 1}])]


def test_plugin_name_is_the_name_declared_or_the_class():
    class Unnamed:
        def step(self, samples, histories):
            return []

    assert plugin_name(SimpleNamespace(name="math")) == "math"
    assert plugin_name(Unnamed()) == "Unnamed"
    assert plugin_name(SimpleNamespace(name="")) == "SimpleNamespace"  # an empty name names nothing


def test_a_transport_hook_result_without_a_name_is_refused_naming_the_protocol():
    from rlcore.controller.transport import pick_transport

    class Nameless:
        def transfer(self, trainer, generator):
            return {}

    manager = SimpleNamespace(weight_transport=lambda trainer, generator: Nameless())
    with pytest.raises(TypeError, match=r"returned a Nameless, which lacks a name.*WeightTransport"):
        pick_transport(manager, None, None, None)


# ---- the conformance suites name what is missing ------------------------------------------
def test_protocol_members_are_read_from_the_protocol():
    assert protocol_members(Environment) == ("step()",)
    assert set(protocol_members(Algorithm)) == {"name", "uses_reference", "uses_old_logprobs", "loss_level",
                                                "shape_rewards()", "keep_trajectories()", "advantages()", "loss()"}


def test_conformance_names_the_member_a_plugin_lacks():
    from rlcore.algorithms import config as C
    from rlcore.algorithms.grpo import GRPO

    class NoAdvantages:  # GRPO's members but one, not subclassing the base
        name, uses_reference, uses_old_logprobs, loss_level = "no-adv", False, False, "token"
        grpo = GRPO(C.GRPOConfig())
        shape_rewards, keep_trajectories, loss = grpo.shape_rewards, grpo.keep_trajectories, grpo.loss

    with pytest.raises(AssertionError, match=r"NoAdvantages lacks advantages\(\) of rlcore.interfaces.Algorithm"):
        AlgorithmConformance().test_implements_protocol(NoAdvantages())
    with pytest.raises(AssertionError, match=r"object lacks step\(\) of rlcore.interfaces.Environment"):
        EnvironmentConformance().test_implements_protocol(object())


def test_conformance_refuses_half_of_an_optional_protocol():
    class HalfOffloading:
        def offload(self, *, keep_weights=False):
            pass

    for member in ("logprobs", "train", "export_weights", "save_checkpoint", "load_checkpoint", "export_hf", "shutdown"):
        setattr(HalfOffloading, member, lambda self, *args, **kwargs: None)
    assert isinstance(HalfOffloading(), TrainingBackend)
    with pytest.raises(AssertionError, match=r"has offload\(\) but lacks onload\(\).*OffloadingBackend"):
        TrainingBackendConformance().test_implements_protocol(HalfOffloading())


def test_conformance_checks_an_optional_member_when_present():
    from rlcore.algorithms import config as C
    from rlcore.algorithms.grpo import GRPO

    algorithm = GRPO(C.GRPOConfig())
    AlgorithmConformance().test_optional_members(algorithm)
    algorithm.max_refill_rounds = -1
    with pytest.raises(AssertionError, match="max_refill_rounds is -1"):
        AlgorithmConformance().test_optional_members(algorithm)
