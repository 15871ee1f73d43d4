"""The argparse class of every command line of the project (spec-router here, spec-bench through bench.cli): no
abbreviations (`--baseli` is an error, not `--baseline`) and a bad flag is one line, never a usage block."""
from __future__ import annotations

import argparse


class ArgError(Exception):
    """A bad flag or flag value; the command prints it as one line and exits 2."""


class OneLineParser(argparse.ArgumentParser):
    """error() raises ArgError (a subclass may print and exit instead); abbreviations are off."""

    def __init__(self, *args, **kw) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str):  # type: ignore[override]
        raise ArgError(message)
