"""The quality gate at a vLLM server's start-up (free of vLLM): does chunk reuse stay near full
attention on the served model? (:mod:`ragattn.methods.quality_gate`)

    verdict = run_gate(chunk_dir, fingerprint, hf_path, dtype, mode)   # worker, once at start-up
    verdict = read_verdict(chunk_dir, fingerprint)                     # scheduler: what the worker found
    verdict.refused            # {method: why, with the figure}; requests asking for one get full attention

The worker runs :func:`ragattn.methods.quality_gate.check_model` with
:func:`~ragattn.methods.quality_gate.served_settings` (the served methods, 3 probes) on the served
checkpoint, loaded with transformers on the CPU in the served dtype and dropped afterwards (vLLM's
model is not an HF model, and the device's memory is already vLLM's), and keeps the report in
``chunk_dir/quality-gate/<key>.json`` (:func:`~ragattn.methods.quality_gate.report_path`: the
checkpoint's fingerprint, the settings, the ragattn, torch and transformers versions). A restart
finds it and loads nothing; ``python -m ragattn check-model MODEL --served --store chunk_dir
--dtype D`` writes the same file ahead of time (on another machine, a GPU). The scheduler, built
after the worker in vLLM's engine, reads the file.

Modes (``kv_connector_extra_config`` ``quality_gate``, :data:`MODES`):

* ``"warn"`` (the default): a method that fails (or is refused: a RoPE ragattn cannot re-rotate)
  is refused by name, with the figure, in the log; requests asking for it are computed with full
  attention and their ``kv_transfer_params`` say why; the other methods are served. A method the
  gate only warns about is logged and served.
* ``"refuse"``: a failing method stops the server at start-up (:class:`GateError`, naming it and
  the figure), as does a gate that cannot run (a checkpoint transformers cannot load).
* ``"off"``: no gate; every method is served.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ragattn.methods import quality_gate
from ragattn.methods.quality_gate import GateReport

log = logging.getLogger(f"vllm.{__name__}")   # vLLM's logger tree (configured in a vLLM process)

MODES = ("warn", "refuse", "off")
DEFAULT_MODE = "warn"


class GateError(RuntimeError):
    """The gate refuses to start the server (mode "refuse"), or a load of a method it refused."""


@dataclass
class ServedVerdict:
    """What the gate found: ``report`` (the :class:`~ragattn.methods.quality_gate.GateReport`),
    ``refused`` (method -> why, with its figures: the methods that failed or were refused),
    ``warned`` (method -> why: served, but logged)."""
    report: GateReport
    refused: dict = field(default_factory=dict)
    warned: dict = field(default_factory=dict)

    @classmethod
    def from_report(cls, report: GateReport) -> "ServedVerdict":
        out = cls(report)
        for row in report.rows:
            if row.verdict in ("fail", "refused"):
                out.refused[row.method] = _why(row, report)
            elif row.verdict == "warn":
                out.warned[row.method] = _why(row, report)
        return out


def _why(row, report: GateReport) -> str:
    """A method's verdict as one line: the reason and its figures against full prefill."""
    verb = {"fail": "failed", "refused": "was refused by", "warn": "was warned by"}[row.verdict]
    text = f"{row.method} {verb} ragattn's quality gate on this model: {row.reason}"
    if row.agreement is not None:
        ratio = "" if row.ratio is None else f" at ratio {row.ratio:g}"
        text += (f" (first-token agreement {100 * row.agreement:.0f}%, mean KL {row.mean_kl:.3g} nats against "
                 f"full prefill over {row.probes} probes{ratio})")
    return text


def verdict_path(directory, fingerprint: str) -> Path:
    """Where the verdict of the model ``fingerprint`` is kept under the chunk directory."""
    return quality_gate.report_path(directory, fingerprint, **quality_gate.served_settings())


def read_verdict(directory, fingerprint: str) -> Optional[ServedVerdict]:
    """The kept verdict, or None when the gate has not run (or its file is damaged)."""
    report = quality_gate.read_report(verdict_path(directory, fingerprint))
    return None if report is None else ServedVerdict.from_report(report)


def _load(hf_path, dtype: torch.dtype):
    """(model, tokenizer): the served checkpoint (a folder or a cached hub id) with transformers, on
    the CPU. OSError / ValueError when transformers cannot read it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf_path), dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(str(hf_path))


def run_gate(directory, fingerprint: str, hf_path, dtype: torch.dtype, mode: str = DEFAULT_MODE
             ) -> Optional[ServedVerdict]:
    """The gate at start-up (module docstring): the kept verdict, else the gate run on ``hf_path``
    (the served HF checkpoint, whose chunk-store fingerprint is ``fingerprint``) in ``dtype`` and
    kept under ``directory``. None for mode "off", or when the gate cannot run in mode "warn"
    (logged). GateError in mode "refuse" when a method fails or the gate cannot run."""
    if mode_option(mode) == "off":
        return None
    path = verdict_path(directory, fingerprint)
    report = quality_gate.read_report(path)
    if report is not None:
        log.info("ragattn.vllm: quality gate verdict of this model read from %s", path)
    else:
        t0 = time.perf_counter()
        try:
            model, tokenizer = _load(hf_path, dtype)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            why = " ".join(str(exc).split())
            msg = f"ragattn.vllm: the quality gate cannot load {hf_path} with transformers ({why})"
            if mode == "refuse":
                raise GateError(f"{msg}; the server is not started (quality_gate 'refuse'; 'warn' serves "
                                "the methods ungated)") from exc
            log.warning("%s; the cached-chunk methods are served ungated", msg)
            return None
        report = quality_gate.check_model(model, tokenizer, name=str(hf_path), **quality_gate.served_settings())
        del model
        try:
            quality_gate.write_report(path, report)
        except OSError as exc:
            log.warning("ragattn.vllm: cannot keep the quality gate verdict in %s (%s): it runs again at the next "
                        "start, and the scheduler cannot read it (requests asking for a refused method have their "
                        "loads failed by the worker and are computed exactly)", path, exc)
        log.info("ragattn.vllm: quality gate ran on %s (%s) in %.1f s; verdict kept in %s", hf_path,
                 str(dtype).replace("torch.", ""), time.perf_counter() - t0, path)
    verdict = ServedVerdict.from_report(report)
    for why in verdict.warned.values():
        log.warning("ragattn.vllm: %s; served", why)
    if verdict.refused and mode == "refuse":
        raise GateError("ragattn.vllm: the server is not started (quality_gate 'refuse'): "
                        + "; ".join(verdict.refused.values()) + f". Verdict kept in {path}")
    for why in verdict.refused.values():
        log.warning("ragattn.vllm: %s; requests asking for it are computed with full attention", why)
    if not verdict.refused:
        log.info("ragattn.vllm: quality gate: every served method passes on this model (%s)",
                 ", ".join(f"{r.method} KL {r.mean_kl:.3g}" for r in report.rows if r.mean_kl is not None))
    return verdict


def mode_option(value) -> str:
    """The ``quality_gate`` option, checked (None: :data:`DEFAULT_MODE`)."""
    if value is None:
        return DEFAULT_MODE
    if value not in MODES:
        raise ValueError(f"ragattn.vllm: kv_connector_extra_config 'quality_gate' must be one of {list(MODES)}, "
                         f"got {value!r}")
    return value


__all__ = ["MODES", "DEFAULT_MODE", "GateError", "ServedVerdict", "verdict_path", "read_verdict", "run_gate",
           "mode_option"]
