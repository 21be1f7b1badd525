"""Where a benchmark table comes from: ragattn's own commit and the device it ran on.

Run from a copy of the tree without ``.git`` that sits inside some other repository,
``git rev-parse HEAD`` walks up and answers for that repository. ``project_commit`` asks git only when the repository git finds is
ragattn's own (its top level is this tree's root and holds ragattn's sources); otherwise the
``RAGATTN_COMMIT`` environment variable, else a ``RAGATTN_COMMIT`` file at the root (write it when
copying the tree: ``git rev-parse HEAD > RAGATTN_COMMIT``), else "unknown".
"""
from __future__ import annotations

import os
import platform
import subprocess
from typing import Mapping, Optional

import torch

COMMIT_ENV = "RAGATTN_COMMIT"
COMMIT_FILE = "RAGATTN_COMMIT"
# Files that only ragattn's source tree holds at its root.
_MARKERS = (os.path.join("ragattn", "__init__.py"), os.path.join("csrc", "torch_bindings.cpp"),
            os.path.join("triton_kernels", "__init__.py"))


def source_root() -> str:
    """The tree this module runs from: ``<root>/bench/provenance.py`` in a checkout."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_ragattn_tree(root: str) -> bool:
    return all(os.path.isfile(os.path.join(root, m)) for m in _MARKERS)


def _git(root: str, *args: str) -> Optional[str]:
    try:
        return subprocess.check_output(["git", "-C", root, *args], text=True, stderr=subprocess.DEVNULL,
                                       timeout=30).strip()
    except Exception:
        return None


def git_commit(root: str) -> Optional[str]:
    """``root``'s short commit (``-dirty`` when tracked files differ from it), or None when git
    finds no repository at ``root`` itself (a copy inside another repository finds that one)."""
    if not is_ragattn_tree(root):
        return None
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return None
    head = _git(root, "rev-parse", "--short", "HEAD")
    if not head:
        return None
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def project_commit(root: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> str:
    """ragattn's commit for a result table: git (ragattn's own repository only), else the
    ``RAGATTN_COMMIT`` environment variable, else a ``RAGATTN_COMMIT`` file at the root, else
    "unknown"."""
    root = source_root() if root is None else root
    env = os.environ if env is None else env
    commit = git_commit(root)
    if commit:
        return commit
    if env.get(COMMIT_ENV, "").strip():
        return env[COMMIT_ENV].strip()
    path = os.path.join(root, COMMIT_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read().strip()
        if text:
            return text.split()[0]
    return "unknown"


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on CUDA (the key of the config tables), else the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
