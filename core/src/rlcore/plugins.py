"""Plugin discovery and the registries filled by the registration hooks.

Every plugin, rlcore's own built-ins included, arrives through an entry point of group
``rlcore``. A plugin that fails to import or registers a name that another provider already
holds stops the program with :class:`PluginError`, naming the distribution, the entry point and
the cause: a half-loaded plugin set would otherwise surface much later as a confusing
"unknown backend".

Environment variables:

- ``RLCORE_DISABLE_PLUGINS=name,...``: skip these entry points (by entry-point name or
  distribution name).
- ``RLCORE_NO_AUTOLOAD=1``: load only rlcore's built-ins; others can be added with
  :meth:`PluginManager.register_module` (used by tests and by the composable Python API).
- ``RLCORE_PLUGINS=module,...``: also register these importable modules as plugins, after the
  entry points (as pytest's ``PYTEST_PLUGINS``): a plugin for one run that no distribution
  installs, e.g. the faults a test injects (:mod:`rlcore.testing.faults`).

Nothing here imports torch: listing plugins must stay fast.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pluggy

from rlcore import hookspecs
from rlcore.utils import resolve

ENTRY_POINT_GROUP = "rlcore"
BUILTIN_ENTRY_POINT = "builtin"

hookimpl = pluggy.HookimplMarker("rlcore")

# kind -> (hook name, default section template; "{name}" is replaced by the provider's name)
KINDS: dict[str, tuple[str, str | None]] = {
    "training_backend": ("rlcore_training_backends", None),
    "generator": ("rlcore_generators", "policy.generation"),
    "environment": ("rlcore_environments", "env.{name}"),
    "algorithm": ("rlcore_algorithms", "algorithm"),
    "dataset": ("rlcore_datasets", "data"),
    "logger": ("rlcore_loggers", "logger.{name}"),
}
# Sections shared by every provider of a kind name the provider with this key.
SHARED_SECTION_KEYS = {"policy.generation": "backend", "algorithm": "name", "data": "name"}


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


@attrs.frozen
class Source:
    """Where a registration came from."""

    distribution: str
    version: str
    entry_point: str  # "name = module:attr"

    def describe(self) -> str:
        return f"{self.distribution} {self.version} (entry point '{self.entry_point}')"


@attrs.frozen
class Registration:
    kind: str
    name: str
    factory: Any  # callable, or "module:attr" resolved on first use
    config_cls: type | None
    section: str | None
    capabilities: dict[str, Any]
    source: Source

    def build(self, *args, **kwargs):
        factory = self.factory
        if isinstance(factory, str):
            try:
                factory = resolve(factory)
            except Exception as exc:  # noqa: BLE001 - re-raised with the provider named
                raise PluginError(
                    f"{self.kind} '{self.name}' from {self.source.describe()}: "
                    f"cannot import factory '{self.factory}': {exc!r}"
                ) from exc
        return self._checked(factory(*args, **kwargs))

    def _checked(self, built: Any) -> Any:
        """What the factory returned, refused at build time (naming the plugin and what it returned)
        unless it has the members every run uses of its kind's protocol (every kind): a wrong object
        would otherwise fail at the first call with an AttributeError naming no plugin, or, for an
        environment, score every rollout 0 as "errors" in a run that exits 0."""
        from rlcore.interfaces.members import BUILT_CHECKS, missing_members

        check = BUILT_CHECKS.get(self.kind)
        if check is None:
            return built
        protocol, members = check
        missing = missing_members(built, members) if built is not None else list(members)
        if missing:
            shown = repr(built)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise PluginError(f"{self.kind} '{self.name}' from {self.source.describe()}: its factory returned "
                              f"{type(built).__name__} {shown}, which has no {', '.join(missing)}; it must return an "
                              f"object following rlcore.interfaces.{protocol.__name__}")
        return built


def _check_capabilities(capabilities: dict[str, Any], where: str) -> None:
    def plain(value) -> bool:
        if isinstance(value, (str, int, float, bool)) or value is None:
            return True
        if isinstance(value, (tuple, list)):
            return all(plain(v) for v in value)
        return False

    for key, value in capabilities.items():
        if not plain(value):
            raise PluginError(
                f"{where}: capability '{key}' must be plain data "
                f"(str, number, bool or a tuple of them), got {type(value).__name__}"
            )


def _contract_schema(kind: str, config_cls: type | None, capabilities: dict[str, Any], where: str) -> type | None:
    """The schema a registration gets, checked against what core reads of its section: a
    generator's extends :class:`rlcore.config.GenerationConfig` (none given: that base itself),
    a multi-turn environment's extends :class:`rlcore.config.environment.MultiTurnEnvConfig`, and
    a training backend's or logger's has the ``enabled`` switch that selects it."""
    from rlcore.config.environment import MultiTurnEnvConfig
    from rlcore.config.generation import GenerationConfig

    if kind in ("training_backend", "logger"):
        if config_cls is not None and "enabled" not in attrs.fields_dict(config_cls):
            raise PluginError(f"{where}: config_cls {config_cls.__qualname__} needs a bool field 'enabled' "
                              "(its section's enabled: true is what turns it on)")
        return config_cls
    if kind == "generator":
        base = GenerationConfig
    elif kind == "environment" and capabilities.get("multi_turn"):
        base = MultiTurnEnvConfig
    else:
        return config_cls
    if config_cls is None:
        return base
    if not issubclass(config_cls, base):
        raise PluginError(f"{where}: config_cls {config_cls.__qualname__} must extend {base.__module__}.{base.__qualname__}, "
                          "the keys of this section that rlcore itself reads")
    return config_cls


class PluginManager:
    """Loads the ``rlcore`` entry points and holds what they register, per kind."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("rlcore")
        self.pm.add_hookspecs(hookspecs)
        self.registry: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}
        self.sources: list[Source] = []
        self._collected: set[int] = set()

    # ---- loading -------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        disabled = {s.strip() for s in os.environ.get("RLCORE_DISABLE_PLUGINS", "").split(",") if s.strip()}
        only_builtin = os.environ.get("RLCORE_NO_AUTOLOAD", "") not in ("", "0")
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name != BUILTIN_ENTRY_POINT, e.name)):
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            is_builtin = dist == "rlcore" and ep.name == BUILTIN_ENTRY_POINT
            if (only_builtin and not is_builtin) or ep.name in disabled or dist in disabled:
                continue
            version = ep.dist.version if ep.dist is not None else "?"
            source = Source(dist, version, f"{ep.name} = {ep.value}")
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must name the plugin
                raise PluginError(
                    f"plugin {source.describe()} failed to import: {exc!r}\n"
                    f"{traceback.format_exc(limit=-3)}"
                    f"Fix or uninstall it, or skip it with RLCORE_DISABLE_PLUGINS={ep.name}"
                ) from exc
            self.register_module(module, source)
        self._load_named_modules()

    def _load_named_modules(self) -> None:
        for name in (s.strip() for s in os.environ.get("RLCORE_PLUGINS", "").split(",")):
            if not name:
                continue
            source = Source(name.split(".")[0], "local", f"{name} (RLCORE_PLUGINS)")
            try:
                module = importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import failure must name the plugin
                raise PluginError(f"plugin {source.describe()} failed to import: {exc!r}; "
                                  "fix the module name in RLCORE_PLUGINS or unset it") from exc
            self.register_module(module, source)

    def register_module(self, module: Any, source: Source | None = None) -> None:
        """Register one plugin object (a module or an instance with hookimpls)."""
        if source is None:
            name = getattr(module, "__name__", type(module).__name__)
            source = Source(name.split(".")[0], "local", f"{name} (registered in-process)")
        if self.pm.is_registered(module):
            return
        try:
            self.pm.register(module, name=source.entry_point)
            # Checked per plugin so the error names it: a misspelled hook would otherwise be
            # silently ignored and its providers would be "not installed".
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            raise PluginError(f"plugin {source.describe()}: {exc}") from exc
        self.sources.append(source)
        self._collect(module, source)

    def _collect(self, module: Any, source: Source) -> None:
        """Call this plugin's registration hooks as pluggy registered them (so an implementation
        named differently with ``@hookimpl(specname=...)`` is found), in :data:`KINDS` order."""
        kind_of = {hook_name: kind for kind, (hook_name, _) in KINDS.items()}
        impls = [(impl, caller.name) for caller in self.pm.get_hookcallers(module) or [] if caller.name in kind_of
                 for impl in caller.get_hookimpls() if impl.plugin is module]
        for impl, hook_name in sorted(impls, key=lambda pair: list(kind_of).index(pair[1])):
            try:
                impl.function(register=self._registrar(kind_of[hook_name], source))
            except PluginError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failing hook must name its plugin
                raise PluginError(f"plugin {source.describe()}: hook {hook_name} failed: {exc!r}") from exc

    def _registrar(self, kind: str, source: Source) -> Callable[..., None]:
        def register(name: str, factory: Any, config_cls: type | None = None, *, section: str | None = None, **capabilities):
            where = f"{kind} '{name}' from {source.describe()}"
            if not isinstance(name, str) or not name.isidentifier():
                raise PluginError(f"{where}: name must be an identifier-like string")
            if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
                raise PluginError(f"{where}: factory must be callable or 'module:attr'")
            if config_cls is not None and not attrs.has(config_cls):
                raise PluginError(f"{where}: config_cls must be an attrs class, got {config_cls!r}")
            config_cls = _contract_schema(kind, config_cls, capabilities, where)
            _check_capabilities(capabilities, where)
            template = KINDS[kind][1]
            if section is None:
                if template is None:
                    raise PluginError(f"{where}: a {kind} must name its config section (section='policy.xxx_cfg')")
                section = template.format(name=name)
            existing = self.registry[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"duplicate {kind} name '{name}': provided by {existing.source.describe()} "
                    f"and by {source.describe()}. Disable one with RLCORE_DISABLE_PLUGINS=<entry point name>"
                )
            owner = None if section in SHARED_SECTION_KEYS else next((r for r in self.iter_registrations() if r.section == section), None)
            if owner is not None:  # two schemas for one section: the config would pick one silently
                raise PluginError(
                    f"{where}: config section '{section}' is already owned by {owner.kind} '{owner.name}' "
                    f"from {owner.source.describe()}; sections other than {sorted(SHARED_SECTION_KEYS)} have one owner"
                )
            self.registry[kind][name] = Registration(kind, name, factory, config_cls, section, dict(capabilities), source)

        return register

    # ---- queries -------------------------------------------------------------------------
    def get(self, kind: str, name: str) -> Registration:
        try:
            return self.registry[kind][name]
        except KeyError:
            import difflib

            known = sorted(self.registry[kind])
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise PluginError(
                f"no {kind.replace('_', ' ')} named '{name}' is installed (known: {', '.join(known) or 'none'}){hint}"
            ) from None

    def by_section(self, section: str) -> list[Registration]:
        return [r for regs in self.registry.values() for r in regs.values() if r.section == section]

    def sections(self) -> set[str]:
        return {r.section for regs in self.registry.values() for r in regs.values() if r.section}

    def weight_transport(self, trainer: Any, generator: Any):
        return self.pm.hook.rlcore_weight_transport(trainer=trainer, generator=generator)

    def wrap_trainer(self, trainer: Any) -> Any:
        """The run's trainer handle, as a plugin's ``rlcore_wrap_trainer`` wraps it (itself when none does)."""
        wrapped = self.pm.hook.rlcore_wrap_trainer(trainer=trainer)
        return trainer if wrapped is None else wrapped

    def benchmarks(self) -> dict[str, Any]:
        """Every plugin's component benchmarks (``rlcore_benchmarks``), by name; a name given twice is an error."""
        found: dict[str, Any] = {}
        for answer in self.pm.hook.rlcore_benchmarks():
            if not isinstance(answer, dict):
                raise PluginError(f"rlcore_benchmarks returned {type(answer).__name__}; it returns a dict name -> benchmark")
            for name, fn in answer.items():
                if name in found:
                    raise PluginError(f"duplicate component benchmark name '{name}'; benchmark names are unique")
                found[name] = fn
        return found

    def export_checkpoint(self, backend: str, checkpoint_dir: Any, config: Any, out_dir: Any):
        return self.pm.hook.rlcore_export_checkpoint(backend=backend, checkpoint_dir=checkpoint_dir, config=config,
                                                     out_dir=out_dir)

    def iter_registrations(self) -> Iterable[Registration]:
        for kind in KINDS:
            yield from self.registry[kind].values()


_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded on first use."""
    global _MANAGER
    if _MANAGER is None:
        manager = PluginManager()
        manager.load_entry_points()
        _MANAGER = manager
    return _MANAGER

