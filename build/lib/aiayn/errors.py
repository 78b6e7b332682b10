"""The one exception for user mistakes, and the CLI boundary that prints it."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from typing import Callable, Iterator, Sequence


class UserError(Exception):
    """A mistake the user can fix (bad config, bad input file, missing path).

    Raised anywhere in the package; caught once at the CLI boundary, printed
    without a traceback, exit status 2.
    """


def _argument_error(parser: argparse.ArgumentParser, message: str):
    raise UserError(f"{parser.prog}: {message} (`{parser.prog} --help` lists the options)")


@contextlib.contextmanager
def _argument_errors_are_user_errors() -> Iterator[None]:
    """argparse answers misuse with its usage, ``prog: error: ...`` and exit status 2; within a stage's
    ``main`` that becomes one ``error:`` message like any other. (Every stage builds a plain
    ArgumentParser; this is the one place that changes what its ``error`` does.)"""
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _argument_error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def cli(main: Callable[[Sequence[str] | None], int | None]) -> Callable[[Sequence[str] | None], int]:
    """Wrap a stage's ``main(argv)`` so that a UserError becomes one message and exit status 2.

    So do a directory where a file belongs and a file where a directory belongs, wherever a stage
    meets them first: the path's shape is the user's to fix, whatever was about to read it.
    """

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        try:
            with _argument_errors_are_user_errors():
                return int(main(argv) or 0)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
        except IsADirectoryError as error:
            print(f"error: {error.filename} is a directory, but a file is expected here; give the file itself",
                  file=sys.stderr)
        except NotADirectoryError as error:
            print(f"error: {error.filename}: a file stands where a directory is expected in this path; "
                  "check the path", file=sys.stderr)
        return 2

    return wrapped
