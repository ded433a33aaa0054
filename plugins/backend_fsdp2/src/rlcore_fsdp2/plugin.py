"""Registers this distribution's providers with rlcore (filled in by its issue)."""

from rlcore import hookimpl  # noqa: F401
