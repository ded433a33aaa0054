"""Objects a user passes to ``rlcore.run`` instead of the plugins a recipe names.

``rlcore.run(config, environment=..., dataset=..., algorithm=..., backend=..., generator=...,
tokenizer=..., loggers=[...])``: each object given replaces the plugin lookup of its kind
entirely, so no plugin of that kind needs to be installed (nor its recipe section written). Each is
checked at once against its protocol in :mod:`rlcore.interfaces`: a missing method or attribute
that every run uses is an error naming it, before any model is loaded. (Members only some runs
use are looked up when used: a generator's ``score`` by refit probes, ``agenerate`` by async and
multi-turn rollouts; a backend's checkpoint methods when checkpointing is on.)

``dataset`` may also be rows (a ``datasets.Dataset`` with a ``prompt`` column, TRL's
``train_dataset``; :mod:`rlcore.data.rows`), tokenized once the tokenizer is loaded.

A passed environment runs single-turn: multi-turn environments are registered plugins, whose
section holds the turn settings (:mod:`rlcore.config.environment`).
"""

from __future__ import annotations

from typing import Any

from rlcore import interfaces
from rlcore.interfaces.members import REQUIRED, missing_members
from rlcore.data.rows import check_rows, is_rows

KNOWN = (*REQUIRED, "tokenizer", "loggers")


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
