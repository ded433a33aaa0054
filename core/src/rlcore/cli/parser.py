"""The argument parser class of every ``rlcore`` command line."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An argparse parser that takes no abbreviated option: ``--resum`` is an error, not ``--resume``
    (a prefix that happens to be unique today changes meaning when an option is added). Subparsers
    are made of the same class, so every level of ``rlcore`` refuses abbreviations."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
