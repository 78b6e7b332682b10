"""The one exception for user mistakes, and the CLI boundary that prints it."""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence


class UserError(Exception):
    """A mistake the user can fix (bad config, bad input file, missing path).

    Raised anywhere in the package; caught once at the CLI boundary, printed
    without a traceback, exit status 2.
    """


def cli(main: Callable[[Sequence[str] | None], int | None]) -> Callable[[Sequence[str] | None], int]:
    """Wrap a stage's ``main(argv)`` so that a UserError becomes one message and exit status 2."""

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        try:
            return int(main(argv) or 0)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return wrapped
