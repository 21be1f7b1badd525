"""The ragattn ops the methods and the HF patch call (design.md "Op surface v1").

Resolved at call time so that a test can monkeypatch them, and so that this module imports
before the op wrappers (``ragattn.hf.attention`` imports it early).
"""
from __future__ import annotations

import ragattn


def varlen_attention(*args, **kwargs):
    return ragattn.varlen_attention(*args, **kwargs)


def paged_attention(*args, **kwargs):
    return ragattn.paged_attention(*args, **kwargs)


def copy_kv_(*args, **kwargs):
    return ragattn.copy_kv_(*args, **kwargs)
