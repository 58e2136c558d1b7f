"""Where the user's code failed: the frames of a traceback that are the user's, in a few lines.

A bug in `loss_fn` at step 3 reaches the user through Ray's worker, Ray Train's controller and raytrain's driver;
the exception's text alone ("shape '[7, -1]' is invalid ...") does not say which line of which file. The worker
renders the traceback where it is raised (`describe` below, a few lines; `full` the whole traceback for
`<run>/raytrain.log`) and the strings travel with the exception (`raytrain.failures.mark`), so the driver shows
them whatever Ray did to the exception on the way.

A frame is the user's when its file lies outside raytrain, the Python installation (the standard library and every
`site-packages` / `dist-packages` directory) and Python's own frozen modules: a project of several files, a
script run from anywhere, a module of the user's installed in editable mode.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import traceback

RAYTRAIN_DIR = os.path.dirname(os.path.abspath(__file__))
SHOWN_FRAMES = 3  # the innermost frames of the user's shown; the log holds all of them


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The Python installation's and the environments' package directories, each ending in a separator."""
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    found.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return tuple(os.path.abspath(p) + os.sep for p in found if p)


def is_user_file(filename: str) -> bool:
    """Whether a traceback frame's file is the user's (module docstring)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(RAYTRAIN_DIR + os.sep):
        return False
    return not path.startswith(_library_dirs()) and "site-packages" not in path and "dist-packages" not in path


def _chain(error: BaseException) -> list[BaseException]:
    """The error and the exceptions it was raised from or during, outermost first (no cycles)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return seen


def describe(error: BaseException, limit: int = SHOWN_FRAMES) -> str:
    """A few lines naming where `error` came from: the innermost `limit` frames of the user's code (file, line,
    function and the line's code, as Python prints them) and, when the exception was raised inside a library
    below them, that library's file and line. Empty when no frame of the traceback is the user's. Looks through
    the exceptions `error` was raised from, innermost traceback first."""
    for link in reversed(_chain(error)):
        frames = traceback.extract_tb(link.__traceback__)
        mine = [f for f in frames if is_user_file(f.filename)]
        if not mine:
            continue
        lines = [f'  File "{f.filename}", line {f.lineno}, in {f.name}' + _code(f) for f in mine[-limit:]]
        last = frames[-1]
        if last is not mine[-1]:
            lines.append(f"  (raised inside {_short(last.filename)}, line {last.lineno}, in {last.name})")
        return "\n".join(lines)
    return ""


def _code(frame: traceback.FrameSummary) -> str:
    return f"\n    {frame.line.strip()}" if frame.line else ""


def _short(filename: str) -> str:
    """A library file's path from its package on ("torch/nn/functional.py"), else the path as given."""
    path = os.path.abspath(filename)
    for root in sorted(_library_dirs(), key=len, reverse=True):
        if path.startswith(root):
            return path[len(root) :]
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else filename


def full(error: BaseException) -> str:
    """The whole traceback of `error` with its chain, as Python prints it."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
