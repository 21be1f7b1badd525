"""What every ``python -m ragattn`` sub-command shares: one way to fail (a single ``error: ...``
line on stderr, exit status 2, for bad arguments and for every user-facing error found later),
argument checks, and output paths checked before the work starts and never lost after it.

    p = OneLineParser(prog="python -m ragattn finetune")     # argparse errors: one line, exit 2
    device = parse_device(args.device)                       # UsageError for xyz, or cuda without CUDA
    out = writable_dir(args.out, "--out")                    # before any work
    save_or_keep(lambda p: torch.save(state, p), path, "--checkpoint")   # a failed write keeps the result
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Callable

from ragattn.store.disk_tier import probe_writable_dir


class UsageError(Exception):
    """A user-facing error of a sub-command: printed as one ``error:`` line, exit status 2."""


# errors of other modules that are the user's to fix (reported the same way), by module
_USER_ERRORS = (("ragattn.apps.demo", "DemoError"), ("ragattn.apps.eval", "EvalError"),
                ("ragattn.apps.corpus", "CorpusError"), ("ragattn.store.errors", "ChunkStoreError"),
                ("ragattn.methods.refrag.train", "TrainError"), ("ragattn.apps.training_text", "TrainingTextError"),
                ("ragattn.hf.adapters", "AdapterError"), ("ragattn.apps.eval_compare", "CompareError"))


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, UsageError):
        return True
    for mod, name in _USER_ERRORS:
        cls = getattr(sys.modules.get(mod), name, None)
        if cls is not None and isinstance(exc, cls):
            return True
    return False


def report(exc: BaseException, prog: str | None = None) -> int:
    """Print ``exc`` as one ``error:`` line; returns 2."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if prog and not msg.startswith(("python -m ragattn", "ragattn", prog.rsplit(" ", 1)[-1] + ":")):
        msg = f"{prog}: {msg}"
    print(f"error: {msg}", file=sys.stderr)
    return 2


def run_command(fn: Callable[[], int], prog: str) -> int:
    """``fn()``, with every user-facing error (see ``_USER_ERRORS``) as one line and exit status 2."""
    try:
        return fn()
    except SystemExit as exc:   # argparse's: the message is printed already
        if isinstance(exc.code, int):
            return exc.code
        raise
    except Exception as exc:   # noqa: BLE001 (anything else is a bug: re-raised with its traceback)
        if _is_user_error(exc):
            return report(exc, prog)
        raise


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``error: <prog>: ...`` line and exit status 2."""

    def error(self, message):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


# ----- argument checks ---------------------------------------------------------------------------
def parse_device(name: str, flag: str = "--device"):
    """``cpu``, ``cuda`` or ``cuda:N`` of a device that exists, else UsageError."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag}: unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"{flag}: device {name!r} is not supported (use cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {name} but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {name} but only {torch.cuda.device_count()} CUDA device(s) are available")
    return device


def check_positive(value: float, flag: str) -> float:
    """A finite number > 0 (learning rates), else UsageError."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UsageError(f"{flag} must be a finite number > 0, got {value!r}")
    return value


def check_at_least(value: int, lo: int, flag: str) -> int:
    if value < lo:
        raise UsageError(f"{flag} must be >= {lo}, got {value}")
    return value


# ----- output paths ------------------------------------------------------------------------------
def writable_dir(path, flag: str) -> Path:
    """Create ``path`` (a folder) if needed and check that files can be written in it, before any
    work is done; UsageError naming ``flag`` otherwise."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise UsageError(f"{flag} {d}: exists and is not a folder")
    try:
        probe_writable_dir(d)
    except OSError as exc:
        raise UsageError(f"{flag} {d}: cannot write there ({exc.strerror or exc})") from None
    return d


def writable_file(path, flag: str) -> Path:
    """Check that ``path`` (a file) can be written (its folder created and writable; not a folder)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {p}: is a folder, expected a file path")
    writable_dir(p.parent, flag)
    return p


def save_or_keep(write: Callable[[Path], object], path, flag: str):
    """``write(path)``; when that fails (disk full, permissions changed during the run), ``write``
    a copy into a fresh temporary folder instead, so that the result is not lost, and raise a
    UsageError naming both paths. Returns ``write``'s result."""
    path = Path(path)
    try:
        return write(path)
    except OSError as exc:
        why = exc.strerror or str(exc)
    keep = Path(tempfile.mkdtemp(prefix="ragattn-kept-")) / path.name
    try:
        write(keep)
    except OSError as exc2:
        raise UsageError(f"{flag} {path}: cannot write it ({why}), nor a copy to {keep.parent} "
                         f"({exc2.strerror or exc2}): the result is lost") from None
    raise UsageError(f"{flag} {path}: cannot write it ({why}); the result was kept in {keep}")
