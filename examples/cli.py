"""The examples' command line: a user error prints one line and exits 2 (--debug: traceback)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence

# What a user's input can cause (a path, a flag's value, a checkpoint's contents): reported as
# one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (FileNotFoundError, NotADirectoryError, PermissionError, ValueError, TypeError,
               NotImplementedError, ImportError, KeyError)  # fmt: skip
DEBUG_FLAG = "--debug"
EXIT_USER_ERROR = 2  # argparse's own exit status for a bad flag


def setup_parser(parser) -> None:
    """Adds --debug to an argparse parser (read by `run` before the parser is), and makes its
    errors one line (argparse prints its whole usage first)."""

    def error(message: str):
        parser.exit(EXIT_USER_ERROR, f"{parser.prog}: error: {message} (--help: usage)\n")

    parser.error = error
    parser.add_argument(
        DEBUG_FLAG,
        action="store_true",
        help="on an error, show the Python traceback (without: one line saying what to do)",
    )


def one_line(err: BaseException) -> str:
    """The error as the one line the user reads: its type where the message alone would not
    say what went wrong, and its message with newlines folded."""
    text = " ".join(str(err).split()) if str(err) else type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    if isinstance(err, KeyError):
        text = f"missing key {text}"
    if isinstance(err, ImportError) and "pip install" not in text:
        text += " (pip install the package it names)"
    return text


def run(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> None:
    """Runs `main(argv)` as a command: a user error (USER_ERRORS, or SystemExit with a message)
    prints "error: <one line>" to stderr and exits 2; with --debug in argv the traceback is
    shown instead; Ctrl-C exits 130 with one line. An int that main returns is the exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv or os.environ.get("WNA16_DEBUG") == "1"
    name = os.path.basename(sys.argv[0]) or "example"
    try:
        result = main(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{name}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as exit_:
        if isinstance(exit_.code, str):
            if debug:
                raise
            print(f"{name}: error: {one_line(SystemExit(exit_.code))}", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"{name}: error: {one_line(err)} ({DEBUG_FLAG}: traceback)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    if isinstance(result, int):
        raise SystemExit(result)


def figure(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits, in plain notation from 1e-4 to 1e6 ("0.000123",
    "0.0456", "12.3", "4560"): a small positive figure never prints as 0."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if not 1e-4 <= abs(x) < 1e6:
        return f"{x:.{digits - 1}e}"
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0)
    return f"{x:.{decimals}f}"
