"""Objects a user passes to ``rlcore.run`` instead of the plugins a recipe names.

``rlcore.run(config, environment=..., dataset=..., algorithm=..., backend=..., generator=...,
tokenizer=..., loggers=[...])``: each object given replaces the plugin lookup of its kind
entirely, so no plugin of that kind needs to be installed (nor its recipe section written). Each is
checked at once against its protocol in :mod:`rlcore.interfaces`: a missing method or attribute
that every run uses is an error naming it, before any model is loaded. (Members only some runs
use are looked up when used: a generator's ``score`` by refit probes, ``agenerate`` by async and
multi-turn rollouts; a backend's checkpoint methods when checkpointing is on.)

``dataset`` may also be rows (a ``datasets.Dataset`` with a ``prompt`` column, TRL's
``train_dataset``; :mod:`rlcore.rows`), tokenized once the tokenizer is loaded.

A passed environment runs single-turn: multi-turn environments are registered plugins, whose
section holds the turn settings (:mod:`rlcore.config.environment`).
"""

from __future__ import annotations

from typing import Any

from rlcore import interfaces
from rlcore.rows import check_rows, is_rows

# keyword of rlcore.run -> (protocol, the members every run uses: "name()" a method, "name" an attribute)
REQUIRED: dict[str, tuple[type, tuple[str, ...]]] = {
    "algorithm": (interfaces.Algorithm, ("name", "uses_reference", "uses_old_logprobs", "loss_level",
                                         "shape_rewards()", "keep_trajectories()", "advantages()", "loss()")),
    "environment": (interfaces.Environment, ("step()",)),
    "dataset": (interfaces.PromptDataset, ("train", "validation")),
    "backend": (interfaces.TrainingBackend, ("logprobs()", "train()", "export_weights()", "shutdown()")),
    "generator": (interfaces.Generator, ("weights_version", "generate()", "update_weights()")),
}
KNOWN = (*REQUIRED, "tokenizer", "loggers")
# plugin kind -> what its factory's product must have (rlcore.plugins.Registration.build checks it);
# every kind of rlcore.plugins.KINDS has an entry (a test checks it)
BUILT_CHECKS: dict[str, tuple[type, tuple[str, ...]]] = {
    "environment": REQUIRED["environment"], "generator": REQUIRED["generator"], "algorithm": REQUIRED["algorithm"],
    "dataset": REQUIRED["dataset"], "training_backend": REQUIRED["backend"],
    "logger": (interfaces.MetricLogger, ("log()", "close()")),
}


def missing_members(obj: Any, members: tuple[str, ...]) -> list[str]:
    """The entries of ``members`` that ``obj`` lacks (a method must be callable)."""
    missing = []
    for member in members:
        name = member.removesuffix("()")
        if member.endswith("()") and not callable(getattr(obj, name, None)) or not hasattr(obj, name):
            missing.append(member)
    return missing


def check_given(given: dict[str, Any]) -> None:
    """Raise TypeError naming the keyword, the object's type and what it lacks, for the first
    object passed to ``rlcore.run`` that does not follow its protocol."""
    unknown = sorted(set(given) - set(KNOWN))
    if unknown:
        raise TypeError(f"rlcore.run got unknown keyword(s) {unknown}; it takes {', '.join(KNOWN)}")
    for kind, (protocol, members) in REQUIRED.items():
        obj = given.get(kind)
        if kind == "dataset" and obj is not None and is_rows(obj):  # a datasets.Dataset, a list of dicts
            check_rows(obj)
        elif obj is not None:
            _refuse_missing(f"rlcore.run({kind}=...)", obj, members, protocol)
    loggers = given.get("loggers")
    for index, logger in enumerate(loggers or []):
        _refuse_missing(f"rlcore.run(loggers=[...]): loggers[{index}]", logger, ("log()", "close()"), interfaces.MetricLogger)


def _refuse_missing(where: str, obj: Any, members: tuple[str, ...], protocol: type) -> None:
    missing = missing_members(obj, members)
    if missing:
        others = f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise TypeError(f"{where}: {type(obj).__name__} has no {missing[0]}{others}; "
                        f"it must follow rlcore.interfaces.{protocol.__name__}")
