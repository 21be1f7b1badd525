"""Launch configurations per GPU: committed tables keyed by device name and shape class.

Each kernel family has a table ``configs/<family>.json`` next to this file (the way vLLM ships its
tuned MoE configs)::

    {"family": "varlen_attention",
     "shape_keys": "how the launcher names a shape class",
     "devices": {
        "NVIDIA H100 80GB HBM3": {"match": ["H100", "H800"], "source": "modelled, untuned ...",
                                  "configs": {"fwd/16bit/d128": {"BLOCK_M": 64, ...}, ...}},
        "default": {...},       # any GPU without an entry of its own: a safe heuristic
        "interpreter": {...}}}  # the CPU interpreter (TRITON_INTERPRET=1): few, big programs

A device entry is found by ``torch.cuda.get_device_name`` exactly, else by the longest of the
entries' ``match`` substrings contained in it (so "NVIDIA H100 PCIe" takes the H100 entry); a
shape key missing from a device entry (or a device without one) falls back to "default", and
within an entry to its "*" key. ``python -m ragattn.bench.tune FAMILY`` measures the GPU at hand
and writes its entry; every entry says in ``source`` whether it was measured or modelled.

``RAGATTN_CONFIG_DIR`` points the lookup at another folder of tables (a tuning run's output).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Dict, Iterator, Optional, Tuple

import torch

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT = "default"
INTERPRETER = "interpreter"


def config_dir() -> str:
    return os.environ.get("RAGATTN_CONFIG_DIR") or CONFIG_DIR


def table_path(family: str, folder: Optional[str] = None) -> str:
    return os.path.join(folder or config_dir(), f"{family}.json")


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table.get("devices"), dict) or DEFAULT not in table["devices"]:
        raise ValueError(f"ragattn config table {path}: needs a 'devices' object with a '{DEFAULT}' entry")
    return table


def load_table(family: str) -> dict:
    """The parsed table of ``family`` (cached per path; ``clear_cache`` after rewriting one)."""
    path = table_path(family)
    if not os.path.isfile(path) and config_dir() != CONFIG_DIR:
        path = table_path(family, CONFIG_DIR)  # an override folder need not hold every family
    return _load(path)


def clear_cache() -> None:
    _load.cache_clear()
    _resolve.cache_clear()


def device_entry_name(table: dict, device_name: Optional[str]) -> str:
    """Which entry of ``table`` serves ``device_name`` (None: the interpreter)."""
    devices = table["devices"]
    if device_name is None:
        return INTERPRETER if INTERPRETER in devices else DEFAULT
    if device_name in devices:
        return device_name
    best, best_len = DEFAULT, 0
    low = device_name.lower()
    for name, entry in devices.items():
        for sub in entry.get("match", ()):
            if sub.lower() in low and len(sub) > best_len:
                best, best_len = name, len(sub)
    return best


@functools.lru_cache(maxsize=4096)
def _resolve(path: str, family: str, device_name: Optional[str], shape_key: str) -> Tuple[Tuple, str]:
    table = _load(path)
    devices = table["devices"]
    entry = device_entry_name(table, device_name)
    for name in dict.fromkeys((entry, DEFAULT)):  # the device's entry, then the heuristic default
        configs = devices[name].get("configs", {})
        for key in (shape_key, "*"):
            if key in configs:
                return tuple(sorted(configs[key].items())), f"{name}[{key}]: {devices[name].get('source', '')}"
    raise KeyError(f"ragattn config table {family}: no entry for shape {shape_key!r} (device {device_name!r}) "
                   f"and no '{DEFAULT}' fallback for it")


# (family, shape_key) -> config forced by ``override`` (bench.tune times candidates through the
# launchers themselves)
_OVERRIDES: Dict[Tuple[str, str], Dict[str, object]] = {}


@contextlib.contextmanager
def override(family: str, shape_key: str, config: Dict[str, object]) -> Iterator[None]:
    """Within the block, every lookup of (``family``, ``shape_key``) on a GPU returns ``config``."""
    key = (family, shape_key)
    old = _OVERRIDES.get(key)
    _OVERRIDES[key] = dict(config)
    try:
        yield
    finally:
        if old is None:
            _OVERRIDES.pop(key, None)
        else:
            _OVERRIDES[key] = old


def lookup(family: str, device_name: Optional[str], shape_key: str) -> Tuple[Dict[str, object], str]:
    """``(config, where)``: the config dict and which entry gave it (for the benchmark tables)."""
    if _OVERRIDES and device_name is not None and (family, shape_key) in _OVERRIDES:
        return dict(_OVERRIDES[family, shape_key]), "override (bench.tune)"
    path = table_path(family)
    if not os.path.isfile(path) and config_dir() != CONFIG_DIR:
        path = table_path(family, CONFIG_DIR)
    items, where = _resolve(path, family, device_name, shape_key)
    return dict(items), where


def has_own_config(family: str, device_name: Optional[str], shape_key: str) -> bool:
    """Whether ``shape_key`` is forced by ``override`` or named in the device's own entry (not through
    its "*" or the default): for optional sub-classes such as a window variant of a shape class,
    which fall back to the plain class of the same entry when absent."""
    if _OVERRIDES and device_name is not None and (family, shape_key) in _OVERRIDES:
        return True
    table = load_table(family)
    return shape_key in table["devices"][device_entry_name(table, device_name)].get("configs", {})


def get_config(family: str, device_name: Optional[str], shape_key: str) -> Dict[str, object]:
    """The launch configuration of ``family`` for a shape class on a device.

    ``device_name``: ``torch.cuda.get_device_name`` of the GPU, or None for the CPU interpreter.
    A GPU without an entry gets the table's "default" (a heuristic that is safe on any GPU). The
    dict is a fresh copy (keys such as BLOCK_M, BLOCK_N, num_warps, num_stages; per family)."""
    return lookup(family, device_name, shape_key)[0]


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> Optional[str]:
    """The table key of a tensor's device: the CUDA device name, None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dtype_class(dtype: torch.dtype) -> str:
    """Shape keys' dtype part: "16bit" (fp16 and bf16 share tiles) or "fp32"."""
    return "fp32" if dtype == torch.float32 else "16bit"


def write_entry(family: str, device_name: str, configs: Dict[str, dict], source: str, *,
                folder: Optional[str] = None, match: Optional[list] = None) -> str:
    """Merge ``configs`` (shape key -> config) into the entry of ``device_name`` in ``family``'s table
    under ``folder`` (default: the committed tables) and write it; returns the path. The entry's
    other shape keys stay, and its ``source`` records which keys ``source`` covers. Starts from the
    committed table when ``folder`` has none yet."""
    path = table_path(family, folder)
    base = path if os.path.isfile(path) else table_path(family, CONFIG_DIR)
    with open(base) as f:
        table = json.load(f)
    old = table["devices"].get(device_name, {})
    merged = dict(old.get("configs", {}))
    merged.update({k: dict(v) for k, v in configs.items()})
    kept = sorted(set(merged) - set(configs))
    text = f"{source} (keys: {', '.join(sorted(configs))})"
    if kept and old.get("source"):
        text += f"; other keys: {old['source']}"
    entry = {}
    if match or old.get("match"):
        entry["match"] = list(match or old["match"])
    entry["source"] = text
    entry["configs"] = {k: merged[k] for k in sorted(merged)}
    table["devices"][device_name] = entry
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    clear_cache()
    return path
