"""Deprecated import path: the zero-copy request cache is :mod:`ragattn.kv.zero_copy`
(``ragattn.kv.TaggedPagedKV``); this name stays for code that imported it from here."""
from ragattn.kv.zero_copy import TaggedPagedKV  # noqa: F401

__all__ = ["TaggedPagedKV"]
