"""Filesystem checks shared by the command lines and the chunk store's disk tier (no torch)."""
from __future__ import annotations

import os
from pathlib import Path


def probe_writable_dir(d: Path) -> None:
    """Create folder ``d`` if needed and write (then remove) an empty probe file in it, so that an
    unwritable output is found before any work; raises the ``OSError`` otherwise."""
    probe = d / f".ragattn-write-probe-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()
