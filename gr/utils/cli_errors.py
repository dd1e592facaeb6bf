"""Command-line entry points end a known error in one line and exit status 2, not a traceback.

``run_cli(prog, main)`` runs ``main()``; bad input (a missing or unreadable file, a config
key or file that does not validate, a non-UTF-8 or too deeply nested file, a diverged run)
prints ``<prog>: error: <message>`` on stderr and returns ``USAGE_EXIT_STATUS``. The
messages of these errors name the file or config key. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

USAGE_EXIT_STATUS = 2

# OSError: missing / unreadable files and directories; ValueError: validation (config keys,
# file formats, UnicodeDecodeError, JSONDecodeError); RecursionError: a too deeply nested
# file; ArithmeticError: gr.utils.finite.NonFiniteError (a diverged run).
KNOWN_ERRORS = (OSError, ValueError, RecursionError, ArithmeticError)


def one_line(error: BaseException) -> str:
    """The error's message on one line (a nested cause's own lines joined with '; ')."""
    text = str(error) or type(error).__name__
    if isinstance(error, UnicodeDecodeError):
        text = f"not UTF-8 text ({error.reason} at byte {error.start})"
    elif isinstance(error, RecursionError):
        text = f"input nested too deeply ({text})"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def run_cli(prog: str, main: Callable[[], int]) -> int:
    """``main()``'s exit status, or USAGE_EXIT_STATUS after one line on stderr for a known error."""
    try:
        return main()
    except KNOWN_ERRORS as error:
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        return USAGE_EXIT_STATUS
