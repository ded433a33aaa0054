"""The members a plugin must have, read from its protocol in :mod:`rlcore.interfaces`, so that a
suite's failure names what is missing (``isinstance`` against a protocol says only no)."""

from __future__ import annotations

from typing import Any

from rlcore.interfaces.members import missing_members


def protocol_members(protocol: type) -> tuple[str, ...]:
    """What ``protocol`` declares, spelled as :func:`rlcore.interfaces.members.missing_members` takes it:
    ``"name()"`` a method, ``"name"`` an attribute or property. Inherited protocols are not followed
    (the protocols of :mod:`rlcore.interfaces` inherit none)."""
    attributes = list(vars(protocol).get("__annotations__", {}))
    members = [name for name in attributes if not name.startswith("_")]
    for name, value in vars(protocol).items():
        if name.startswith("_") or name in members:
            continue
        if isinstance(value, property):
            members.append(name)
        elif callable(value):
            members.append(f"{name}()")
    return tuple(members)


def assert_follows(obj: Any, protocol: type) -> None:
    """Fail naming each member of ``protocol`` that ``obj`` lacks (a method must be callable)."""
    missing = missing_members(obj, protocol_members(protocol))
    assert not missing, (f"{type(obj).__name__} lacks {', '.join(missing)} of rlcore.interfaces.{protocol.__name__}")


def assert_all_or_none(obj: Any, members: tuple[str, ...], protocol: type) -> None:
    """An optional protocol's members come together: fail naming those missing when ``obj`` has some."""
    missing = missing_members(obj, members)
    assert len(missing) in (0, len(members)), (
        f"{type(obj).__name__} has {', '.join(m for m in members if m not in missing)} but lacks "
        f"{', '.join(missing)} (rlcore.interfaces.{protocol.__name__}: all or none)")
