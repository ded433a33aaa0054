"""The plugin manager against real entry points of fake installed distributions.

In-process tests build a fresh :class:`PluginManager` (discovery through importlib.metadata on
``sys.path``); CLI tests run the installed ``rlcore`` script with the fake site on PYTHONPATH.
"""

from __future__ import annotations

import json

import pytest

from rlcore.plugins import KINDS, PluginError, PluginManager

ISOLATE = "rlcore-fsdp2,rlcore-megatron,rlcore-vllm,rlcore-math"

TOY_ENV = """
    import attrs
    from rlcore import hookimpl

    @attrs.frozen
    class ToyConfig:
        scale: float = 1.0

    @hookimpl
    def rlcore_environments(register):
        register("toy", "nowhere_heavy_module:build", ToyConfig, devices=("cpu",), multi_turn=False)
"""


def load(monkeypatch, disable: str = ISOLATE) -> PluginManager:
    monkeypatch.setenv("RLCORE_DISABLE_PLUGINS", disable)
    manager = PluginManager()
    manager.load_entry_points()
    return manager


def test_discovers_fake_distribution_with_lazy_factory(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-toy", "toy", TOY_ENV, version="2.3.4")
    manager = load(monkeypatch)
    reg = manager.get("environment", "toy")
    assert reg.source.distribution == "rlcore-toy" and reg.source.version == "2.3.4"
    assert reg.section == "env.toy"
    assert reg.capabilities == {"devices": ("cpu",), "multi_turn": False}
    assert reg.config_cls.__name__ == "ToyConfig"
    # Built-ins arrive through the same path, from rlcore's own entry point.
    assert manager.get("logger", "jsonl").source.entry_point == "builtin = rlcore.builtin"
    # The factory module is only imported on first use, and a failure names the provider.
    with pytest.raises(PluginError, match=r"environment 'toy' from rlcore-toy 2\.3\.4.*nowhere_heavy_module"):
        reg.build(None)


def test_broken_plugin_names_distribution_entry_point_and_cause(fake_site, monkeypatch):
    module = fake_site.add_plugin("rlcore-broken", "brk", "import numpy\nraise ImportError('needs the missing package flux_capacitor')\n")
    with pytest.raises(PluginError) as info:
        load(monkeypatch)
    message = str(info.value)
    assert "rlcore-broken 1.0.0" in message
    assert f"entry point 'brk = {module}'" in message
    assert "flux_capacitor" in message
    assert "RLCORE_DISABLE_PLUGINS=brk" in message


def test_broken_plugin_cli_exits_2_naming_it_and_disable_skips_it(fake_site, run_cli):
    fake_site.add_plugin("rlcore-broken", "brk", "raise RuntimeError('kaboom at import')\n")
    fake_site.add_plugin("rlcore-toy", "toy", TOY_ENV)
    result = run_cli("plugins", "--json", env=fake_site.env())
    assert result.returncode == 2, result.stdout + result.stderr
    assert "rlcore-broken" in result.stderr and "brk =" in result.stderr and "kaboom at import" in result.stderr
    assert result.stdout == ""
    for disable in ("brk", "rlcore-broken", " rlcore-broken , other"):  # by entry point or distribution
        result = run_cli("plugins", "--json", env=fake_site.env(RLCORE_DISABLE_PLUGINS=disable))
        assert result.returncode == 0, result.stderr
        dists = {d["distribution"]: d for d in json.loads(result.stdout)}
        assert "rlcore-broken" not in dists
        assert dists["rlcore-toy"]["provides"]["environment"][0]["name"] == "toy"


def test_no_autoload_loads_only_builtins(fake_site, run_cli, monkeypatch):
    fake_site.add_plugin("rlcore-broken", "brk", "raise RuntimeError('must not be imported')\n")
    result = run_cli("plugins", "--json", env=fake_site.env(RLCORE_NO_AUTOLOAD="1"))
    assert result.returncode == 0, result.stderr
    assert [d["distribution"] for d in json.loads(result.stdout)] == ["rlcore"]
    # RLCORE_NO_AUTOLOAD=0 means "autoload" again.
    monkeypatch.setenv("RLCORE_NO_AUTOLOAD", "0")
    with pytest.raises(PluginError, match="must not be imported"):
        load(monkeypatch)
    # In-process registration still works on an isolated manager (composable Python API).
    monkeypatch.setenv("RLCORE_NO_AUTOLOAD", "1")
    manager = load(monkeypatch, disable="")
    assert {s.distribution for s in manager.sources} == {"rlcore"}
    import importlib

    manager.register_module(importlib.import_module(fake_site.add_plugin("rlcore-toy", "toy", TOY_ENV)))
    assert manager.get("environment", "toy").source.version == "local"


def test_duplicate_name_names_both_providers(fake_site, monkeypatch, run_cli):
    first = fake_site.add_plugin("rlcore-toy-a", "toy_a", TOY_ENV, version="1.0")
    second = fake_site.add_plugin("rlcore-toy-b", "toy_b", TOY_ENV, version="2.0")
    with pytest.raises(PluginError) as info:
        load(monkeypatch)
    message = str(info.value)
    assert "duplicate environment name 'toy'" in message
    assert f"rlcore-toy-a 1.0 (entry point 'toy_a = {first}')" in message
    assert f"rlcore-toy-b 2.0 (entry point 'toy_b = {second}')" in message
    result = run_cli("plugins", env=fake_site.env())
    assert result.returncode == 2 and "rlcore-toy-a" in result.stderr and "rlcore-toy-b" in result.stderr


def test_duplicate_of_a_builtin_names_rlcore(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-mylog", "mylog", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_loggers(register):
            register("jsonl", "x:y")
    """)
    with pytest.raises(PluginError, match=r"provided by rlcore 0\.1\.0 \(entry point 'builtin = rlcore\.builtin'\) and by rlcore-mylog"):
        load(monkeypatch)


def test_same_name_in_different_kinds_is_allowed(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-multi", "multi", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_environments(register):
            register("shared_name", "x:y")

        @hookimpl
        def rlcore_datasets(register):
            register("shared_name", "x:z")
    """)
    manager = load(monkeypatch)
    assert manager.get("environment", "shared_name").factory == "x:y"
    assert manager.get("dataset", "shared_name").factory == "x:z"


def test_check_pending_catches_misspelled_hook(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-typo", "typo", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_enviroments(register):
            register("never", "x:y")
    """)
    with pytest.raises(PluginError) as info:
        load(monkeypatch)
    assert "rlcore-typo 1.0.0" in str(info.value)
    assert "rlcore_enviroments" in str(info.value)


def test_misspelled_hook_in_process_registration_is_caught():
    import types

    import rlcore

    module = types.ModuleType("inline_plugin")

    @rlcore.hookimpl
    def rlcore_algorithm(register):  # missing "s"
        pass

    module.rlcore_algorithm = rlcore_algorithm
    manager = PluginManager()
    with pytest.raises(PluginError, match="rlcore_algorithm"):
        manager.register_module(module)


def test_failing_hook_names_its_plugin(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-fails", "fails", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_generators(register):
            import a_module_that_is_not_installed
    """)
    with pytest.raises(PluginError, match=r"rlcore-fails 1\.0\.0.*rlcore_generators failed.*a_module_that_is_not_installed"):
        load(monkeypatch)


@pytest.mark.parametrize("capability, shown", [
    ("devices={'cpu', 'cuda'}", "set"),
    ("hook=print", "builtin_function_or_method"),
    ("limits={'tp': 8}", "dict"),
    ("parallelism=('dp', object())", "tuple"),
])
def test_capabilities_must_be_plain_data(fake_site, monkeypatch, capability, shown):
    fake_site.add_plugin("rlcore-caps", "caps", f"""
        from rlcore import hookimpl

        @hookimpl
        def rlcore_environments(register):
            register("capsenv", "x:y", {capability})
    """)
    key = capability.split("=")[0]
    with pytest.raises(PluginError, match=rf"environment 'capsenv' from rlcore-caps.*capability '{key}' must be plain data.*got {shown}"):
        load(monkeypatch)


@pytest.mark.parametrize("call, problem", [
    ('register("bad-name", "x:y")', "name must be an identifier"),
    ('register("ok", "no_colon")', "factory must be callable or 'module:attr'"),
    ('register("ok", "x:y", dict)', "config_cls must be an attrs class"),
])
def test_invalid_registrations_name_the_plugin(fake_site, monkeypatch, call, problem):
    fake_site.add_plugin("rlcore-bad", "bad", f"""
        from rlcore import hookimpl

        @hookimpl
        def rlcore_environments(register):
            {call}
    """)
    with pytest.raises(PluginError, match=rf"rlcore-bad 1\.0\.0.*{problem}"):
        load(monkeypatch)


def test_training_backend_must_name_its_section(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-nosection", "nosec", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_training_backends(register):
            register("mybackend", "x:y")
    """)
    with pytest.raises(PluginError, match="must name its config section"):
        load(monkeypatch)


def test_every_kind_registers_with_default_sections(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-allkinds", "allkinds", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_training_backends(register):
            register("k_backend", "x:y", section="policy.k_cfg", precedence=3)

        @hookimpl
        def rlcore_generators(register):
            register("k_gen", "x:y")

        @hookimpl
        def rlcore_environments(register):
            register("k_env", "x:y")

        @hookimpl
        def rlcore_algorithms(register):
            register("k_algo", "x:y")

        @hookimpl
        def rlcore_datasets(register):
            register("k_data", "x:y")

        @hookimpl
        def rlcore_loggers(register):
            register("k_log", "x:y")
    """)
    manager = load(monkeypatch)
    sections = {kind: manager.get(kind, name).section for kind, name in [
        ("training_backend", "k_backend"), ("generator", "k_gen"), ("environment", "k_env"),
        ("algorithm", "k_algo"), ("dataset", "k_data"), ("logger", "k_log")]}
    assert sections == {
        "training_backend": "policy.k_cfg", "generator": "policy.generation", "environment": "env.k_env",
        "algorithm": "algorithm", "dataset": "data", "logger": "logger.k_log",
    }
    assert set(sections) == set(KINDS)
    with pytest.raises(PluginError, match=r"no environment named 'k_evn'.*did you mean 'k_env'"):
        manager.get("environment", "k_evn")


def test_weight_transport_is_first_result_latest_plugin_first(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-wt-a", "wt_a", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_weight_transport(trainer, generator):
            return "transport-a"
    """)
    fake_site.add_plugin("rlcore-wt-b", "wt_b", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_weight_transport(trainer, generator):
            return None if generator == "only-a" else "transport-b"
    """)
    manager = load(monkeypatch)
    # Entry points load in name order (wt_a, then wt_b); pluggy asks the latest first.
    assert manager.weight_transport(trainer="be", generator="gen") == "transport-b"
    assert manager.weight_transport(trainer="be", generator="only-a") == "transport-a"


def test_a_config_section_has_one_owner(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-mybackend", "mybackend", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_training_backends(register):
            register("mine", "x:y", section="policy.dtensor_cfg")
    """)
    with pytest.raises(PluginError, match=r"training_backend 'mine' from rlcore-mybackend.*section 'policy.dtensor_cfg' is already "
                                          r"owned by training_backend 'fsdp2' from rlcore-fsdp2"):
        load(monkeypatch, disable="")
    # Shared sections (policy.generation, algorithm, data) take any number of providers.
    fake_site.add_plugin("rlcore-mygen", "mygen", """
        from rlcore import hookimpl

        @hookimpl
        def rlcore_generators(register):
            register("mygen", "x:y")
    """)
    manager = load(monkeypatch, disable="mybackend")
    assert len(manager.by_section("policy.generation")) >= 2


def test_registration_hooks_named_by_specname_are_called(fake_site, monkeypatch):
    fake_site.add_plugin("rlcore-specname", "specname", """
        from rlcore import hookimpl

        @hookimpl(specname="rlcore_environments")
        def register_my_environments(register):
            register("specname_env", "x:y")
    """)
    manager = load(monkeypatch)
    assert manager.get("environment", "specname_env").source.distribution == "rlcore-specname"
