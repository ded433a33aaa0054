"""The typed boundaries of docs/concepts.md, checked on the real code.

- No core module and no training backend reads another plugin's config section by attribute name
  (``getattr``/``hasattr`` on a section): core reads sections through the contracts it owns
  (``RunConfig.generation``, the schemas checked at registration), and a section of another type
  is refused at that boundary.
- The run loop calls the trainer handle's methods, never a method named by a string.
- The one placement object core computes is what the backend and the generator factories get.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import attrs
import pytest

import rlcore
from rlcore.config import ConfigError, GenerationConfig, RunConfig
from rlcore.config.schema import PolicyConfig
from rlcore.interfaces import TrainerHandle

ROOT = Path(__file__).resolve().parents[2]
GUARDED = [ROOT / "core/src/rlcore", ROOT / "plugins/backend_fsdp2/src", ROOT / "plugins/backend_megatron/src"]
# Names that hold a plugin's config section (or a part of one) in this code base.
SECTION_NAMES = {"section", "sections", "section_config", "generation", "generation_config", "generation_cfg", "gen_cfg", "gen_section",
                 "env_section", "refit", "refit_cfg", "colocated", "resources", "turns"}


def _section_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")):
            continue
        target = ast.unparse(node.args[0])
        names = set(re.findall(r"[A-Za-z_]\w*", target))
        if names & SECTION_NAMES or ".section(" in target:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_core_module_or_backend_reads_a_section_by_attribute_name():
    files = [f for root in GUARDED for f in sorted(root.rglob("*.py"))]
    assert len(files) > 40  # the guard sees the code it is meant to
    reads = [read for f in files for read in _section_reads(f)]
    assert not reads, "read the section through its contract (rlcore.config), not by name:\n" + "\n".join(reads)


def test_the_guard_catches_a_getattr_on_a_section(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(config):\n    return getattr(config.section('policy.generation'), 'refit', None)\n"
                   "def g(gen_cfg):\n    return hasattr(gen_cfg, 'colocated')\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(_section_reads(bad)) == 2
    finally:
        ROOT = saved


def test_a_generation_section_of_another_type_is_refused_at_the_boundary():
    @attrs.frozen
    class NotAGenerationConfig:
        backend: str = "mine"
        temperature: float = 0.5

    config = RunConfig(policy=PolicyConfig(model_name="/nonexistent"), sections={"policy.generation": NotAGenerationConfig()})
    with pytest.raises(ConfigError, match=r"policy.generation.*NotAGenerationConfig, not a rlcore.config.GenerationConfig"):
        config.generation
    assert RunConfig(policy=PolicyConfig(model_name="/x")).generation == GenerationConfig()


def test_generator_schemas_extend_the_generation_contract(fake_site, monkeypatch):
    from rlcore.plugins import PluginError, PluginManager

    module = fake_site.add_module(fake_site.module_name("gen_schemas"), """
        import attrs
        from rlcore import hookimpl
        from rlcore.config import GenerationConfig

        @attrs.frozen
        class Loose:
            backend: str = "loose"

        @attrs.frozen
        class Strict(GenerationConfig):
            backend: str = "strict"

        @hookimpl
        def rlcore_generators(register):
            register("strict", "x:y", Strict)
            register("bare", "x:y")
            if LOOSE:
                register("loose", "x:y", Loose)
    """)
    import importlib

    monkeypatch.syspath_prepend(str(fake_site.root))
    mod = importlib.import_module(module)
    mod.LOOSE = False
    manager = PluginManager()
    manager.register_module(mod)
    assert issubclass(manager.get("generator", "strict").config_cls, GenerationConfig)
    assert manager.get("generator", "bare").config_cls is GenerationConfig
    mod.LOOSE = True
    with pytest.raises(PluginError, match=r"generator 'loose'.*Loose must extend rlcore.config.generation.GenerationConfig"):
        PluginManager().register_module(mod)


def test_every_installed_generator_follows_the_contract():
    manager = rlcore.get_plugin_manager()
    generators = manager.registry["generator"]
    assert {"hf", "vllm"} <= set(generators)
    assert all(issubclass(reg.config_cls, GenerationConfig) for reg in generators.values())


def test_the_loop_calls_trainer_methods_not_names():
    from rlcore.controller import async_driver, learner, loop, refitter, resume, validation

    trees = [ast.parse(inspect.getsource(m)) for m in (loop, learner, refitter, validation, resume, async_driver)]
    calls = [ast.unparse(n) for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert not [c for c in calls if re.search(r"\.call\(|getattr\(self\.(c\.)?trainer|getattr\(trainer", c)], calls
    used = {n.attr for tree in trees for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and ast.unparse(n.value) in ("trainer", "self.trainer", "self.c.trainer")}
    assert used <= {"logprobs", "train", "save_checkpoint", "load_checkpoint", "offload", "onload", "loop_step"}, used
    assert {"logprobs", "train", "save_checkpoint", "load_checkpoint"} <= used


@pytest.mark.parametrize("cls_path", ["rlcore.controller.workers:LocalTrainer", "rlcore.controller.workers:RayTrainerGroup",
                                      "rlcore.testing.faults:FaultInjectingTrainer"])
def test_trainer_handles_implement_the_whole_protocol(cls_path):
    from rlcore.utils import resolve

    cls = resolve(cls_path)
    members = {"logprobs", "train", "save_checkpoint", "load_checkpoint", "offload", "onload", "export_chunks", "run_on_ranks",
               "in_process", "shutdown"}
    missing = [m for m in members if not hasattr(cls, m)]
    assert not missing, missing
    for name in ("logprobs", "train", "run_on_ranks", "export_chunks"):
        ours = inspect.signature(getattr(TrainerHandle, name)).parameters
        theirs = inspect.signature(getattr(cls, name)).parameters
        assert list(theirs) == list(ours), (cls_path, name, list(theirs))


class _Recorded:
    placements: list = []


@attrs.frozen
class _FakeBackendConfig:
    enabled: bool = False


class _FakeBackend:
    """Records the placement it is built with; the protocol's methods exist (the run checks them), none is called."""

    def __init__(self, config, section, world):
        _Recorded.placements.append(("backend", world.placement))

    def logprobs(self, batch, *, reference=False):
        raise NotImplementedError

    def train(self, batch, algorithm):
        raise NotImplementedError

    def export_weights(self, dtype=None, chunk_bytes=1 << 30):
        raise NotImplementedError

    def save_checkpoint(self, path):
        raise NotImplementedError

    def load_checkpoint(self, path):
        raise NotImplementedError

    def export_hf(self, path):
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class _FakeGenerator:
    weights_version = 0

    def __init__(self, config, section, placement):
        _Recorded.placements.append(("generator", placement))

    def generate(self, prompts, params):  # the protocol's members (checked when built); never called here
        raise NotImplementedError

    def update_weights(self, chunks):
        raise NotImplementedError


class _BoundaryPlugin:
    @staticmethod
    @rlcore.hookimpl
    def rlcore_training_backends(register):
        register("boundary_backend", _FakeBackend, _FakeBackendConfig, section="policy.boundary_cfg", precedence=99)

    @staticmethod
    @rlcore.hookimpl
    def rlcore_generators(register):
        register("boundary_gen", _FakeGenerator)


def test_backend_and_generator_factories_get_the_one_placement(tmp_path, tiny_model_dir, single_process_group, monkeypatch):
    """(With a process group already up, the in-process trainer leaves this process's environment
    alone: subprocesses of later tests must not inherit its MASTER_PORT.)"""
    import os

    from rlcore.controller.grpo_run import build_components

    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}

    from rlcore.plugins import PluginManager

    manager = PluginManager()  # not the process-wide one: later tests must not see these providers
    manager.load_entry_points()
    manager.register_module(_BoundaryPlugin)
    monkeypatch.setattr("rlcore.controller.grpo_run.get_plugin_manager", lambda: manager)
    config = rlcore.build_config({
        "policy": {"model_name": str(tiny_model_dir), "boundary_cfg": {"enabled": True},  # preflight checks it
                   "generation": {"backend": "boundary_gen", "colocated": {"enabled": True}}},
        "algorithm": {"name": "grpo"}, "data": {"name": "arithmetic"}, "env": {"name": "math"},
        "logger": {"log_dir": str(tmp_path / "run"), "print_table": False, "plot": False},
    }, manager=manager)
    _Recorded.placements.clear()
    from rlcore.algorithms.grpo import GRPO

    class NoEnvironment:
        def step(self, samples, histories):
            return []

    class NoDataset:
        train, validation = [], None

    c = build_components(config, tokenizer=object(), algorithm=GRPO(), environment=NoEnvironment(), dataset=NoDataset(), loggers=[])
    try:
        (kind_a, a), (kind_b, b) = _Recorded.placements
        assert (kind_a, kind_b) == ("backend", "generator") and a is b
        assert a.device == "cpu" and a.trainer_ranks == 1 and not a.use_ray and a.colocated
        assert c.trainer.in_process and c.transport.name == "stream"
        assert c.transport.chunk_bytes == config.generation.refit.chunk_bytes
    finally:
        c.trainer.shutdown()
    assert {k: os.environ.get(k) for k in before} == before
