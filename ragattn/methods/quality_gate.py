"""The quality gate: does chunk reuse stay near full attention on *this* model?

    from ragattn.methods.quality_gate import check_model, stored_check, Thresholds
    report = check_model(model, tokenizer)          # a GateReport: model checks + one row per method
    report.ok, report.failed, report.format_table(), report.to_dict()
    report = stored_check(model, tokenizer, "kv/")  # once per model: kv/quality-gate/<fingerprint>.json

Two parts, both against the model as given (an HF ``*ForCausalLM``, any dtype or device):

1. **Model checks**, which every cached-chunk method depends on:

   * ``family``/``rope``: the model family and its RoPE are ones ragattn can re-rotate
     (:func:`ragattn.hf.rope.rope_params`: a family outside ``SUPPORTED_FAMILIES``, RoPE with an
     attention factor (YaRN, LongRoPE), frequencies that depend on the length (dynamic NTK) or
     differ per layer type are **refused** by name: no method is run);
   * ``re-rotation``: a probe passage is prefilled at positions ``0..n-1`` and at ``P..P+n-1``
     (``P`` = :data:`ROTATION_OFFSET`, less where the window is shorter); ragattn's re-rotation
     (``ragattn.rerotate_keys_`` with the model's ``inv_freq``, ``rotary_dim`` and layout) of the
     first keys must give the second: the figure is the largest relative error over the layers,
     ``||rerotate(K_0, P) - K_P|| / ||K_P||``. Exact up to rounding in a RoPE model (float32:
     ~1e-5; bfloat16: ~1e-2); a rotary the model applies differently from what ragattn assumes
     (another layout, other frequencies, a patched rotary module) gives ~1. Above the limit every
     method **fails** with that figure;
   * ``recompute-all`` (when CacheBlend or FusionRAG is checked): CacheBlend at ratio 1 recomputes
     every chunk token at its true position, which is full attention: its first-token KL against
     full prefill on the first probe must be rounding (float32: ~1e-12; bfloat16: ~1e-3). Above
     ``max_exact_kl`` the recompute path is wrong for this model and the ratio methods **fail**.

2. **Method probes**: :data:`GATED` (the registry's cached-chunk methods, ratio methods at the
   given ratio, default ``registry.DEFAULT_RATIO``) answer ``probes`` short synthetic RAG prompts
   (:func:`probe_set`: invented places, people, codes and years, generated from a seed, that no
   eval or training text contains, so the model can only answer from the passages) and are
   compared with full prefill on the same tokens: first-token agreement (argmax equal) and
   KL(full || method) of the first-token distribution in nats (mean and max). ``no-context`` (the
   question without passages) is measured too: the floor a method must beat.

Verdicts (:class:`Thresholds`, every limit overridable): a method **fails** when its first-token
agreement is below ``min_agreement`` (default 0.5) or its mean KL above ``max_kl`` (1.0 nats), or
when the model checks failed; it is **warned** when its mean KL is above ``warn_kl`` (0.35 nats) or
not below no-context's (it is no closer to full attention than dropping the passages); else it
**passes**. The re-rotation limit is ``max_rotation_error`` (default: 1e-3 for float32 models, 0.1
for 16-bit ones), the recompute limit ``max_exact_kl`` (1e-6 and 0.02). On SmolLM2-135M-Instruct
(float32, 6 probes) every method passes, none near the limits (docs/vllm.md, "Quality gate").

A serving engine calls :func:`stored_check` once per model and store at start-up: the report is
saved under the store directory, keyed by the model's fingerprint and the gate's settings, and read
back on the next start; ``report.failed`` names the methods to refuse. The vLLM connector does so
with :func:`served_settings` (:mod:`ragattn.vllm.gate`: :func:`report_path` from the served
checkpoint's fingerprint, so a restart reads the verdict without loading a model).
"""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ragattn.methods import registry
from ragattn.methods.generate import kl_divergence

GATED = tuple(m.name for m in registry.REGISTRY if m.store and not m.ablation)
FLOOR = "no-context"
ROTATION_OFFSET = 1000       # positions the re-rotation check moves its passage by
DEFAULT_PROBES = 6
DEFAULT_PASSAGES = 4         # passages per probe
DEFAULT_SEED = 2026
SERVED_PROBES = 3            # probes of a vLLM server's start-up gate (served_settings)
_STORE_SUBDIR = "quality-gate"


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The gate's limits. ``min_agreement``: least share of probes whose first token equals full
    prefill's; ``max_kl`` / ``warn_kl``: mean first-token KL (nats) above which a method fails /
    is warned; ``max_rotation_error``: largest relative error of re-rotated keys (None: 1e-3 for a
    float32 model, 0.1 for a 16-bit one); ``max_exact_kl``: first-token KL of recompute-all against
    full prefill (None: 1e-6 for float32, 0.02 for 16-bit)."""
    min_agreement: float = 0.5
    max_kl: float = 1.0
    warn_kl: float = 0.35
    max_rotation_error: Optional[float] = None
    max_exact_kl: Optional[float] = None

    def __post_init__(self):
        for name in ("min_agreement", "max_kl", "warn_kl", "max_rotation_error", "max_exact_kl"):
            v = getattr(self, name)
            if v is None and name in ("max_rotation_error", "max_exact_kl"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ValueError(f"ragattn.methods.quality_gate.Thresholds: {name} must be a finite number >= 0, "
                                 f"got {v!r}")
        if self.min_agreement > 1:
            raise ValueError(f"ragattn.methods.quality_gate.Thresholds: min_agreement is a share in [0, 1], "
                             f"got {self.min_agreement!r}")
        if self.warn_kl > self.max_kl:
            raise ValueError(f"ragattn.methods.quality_gate.Thresholds: warn_kl ({self.warn_kl}) must not exceed "
                             f"max_kl ({self.max_kl})")

    def rotation_limit(self, dtype: torch.dtype) -> float:
        if self.max_rotation_error is not None:
            return float(self.max_rotation_error)
        return 1e-3 if dtype in (torch.float32, torch.float64) else 0.1

    def exact_limit(self, dtype: torch.dtype) -> float:
        if self.max_exact_kl is not None:
            return float(self.max_exact_kl)
        return 1e-6 if dtype in (torch.float32, torch.float64) else 0.02


@dataclasses.dataclass
class Check:
    """One model check: ``name``, ``verdict`` ("pass", "fail" or "refused"), ``figure`` (None for
    a refusal) and its ``limit``, ``detail`` (what was measured or why it was refused)."""
    name: str
    verdict: str
    detail: str
    figure: Optional[float] = None
    limit: Optional[float] = None


@dataclasses.dataclass
class MethodRow:
    """One method's probe figures and verdict ("pass", "warn", "fail", "refused"; ``reason`` says why)."""
    method: str
    verdict: str
    reason: str = ""
    probes: int = 0
    agreement: Optional[float] = None    # share of probes whose first token equals full prefill's
    mean_kl: Optional[float] = None      # nats
    max_kl: Optional[float] = None
    ratio: Optional[float] = None        # recompute ratio of a ratio method


@dataclasses.dataclass
class GateReport:
    """What :func:`check_model` found: ``checks`` (model level), ``rows`` (one per method, the
    no-context floor last, verdict "floor"), ``settings`` (thresholds, probes, seed, model)."""
    checks: list
    rows: list
    settings: dict

    @property
    def failed(self) -> list:
        """Names of the methods that failed or were refused."""
        return [r.method for r in self.rows if r.verdict in ("fail", "refused")]

    @property
    def warned(self) -> list:
        return [r.method for r in self.rows if r.verdict == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict:
        return dict(ok=self.ok, failed=self.failed, warned=self.warned, settings=self.settings,
                    checks=[dataclasses.asdict(c) for c in self.checks],
                    methods=[dataclasses.asdict(r) for r in self.rows])

    @classmethod
    def from_dict(cls, d: dict) -> "GateReport":
        return cls([Check(**c) for c in d["checks"]], [MethodRow(**r) for r in d["methods"]], d["settings"])

    def format_table(self) -> str:
        s, t = self.settings, self.settings["thresholds"]
        lines = [f"ragattn quality gate: {s['model']} ({s['dtype']}), {s['probes']} probes of {s['passages']} "
                 f"passages (seed {s['seed']}), against full prefill", "",
                 "| check | verdict | figure | limit | detail |", "|---|---|---|---|---|"]
        for c in self.checks:
            lines.append(f"| {c.name} | {c.verdict} | {_num(c.figure)} | {_num(c.limit)} | {c.detail} |")
        lines += ["", "| method | verdict | 1st-token agree | mean KL | max KL | reason |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            name = r.method + ("" if r.ratio is None else f" ({100 * r.ratio:g}%)")
            agree = "-" if r.agreement is None else f"{100 * r.agreement:.0f}%"
            lines.append(f"| {name} | {r.verdict} | {agree} | {_num(r.mean_kl)} | {_num(r.max_kl)} | {r.reason} |")
        lines += ["", f"limits: fail below {100 * t['min_agreement']:g}% first-token agreement or above mean KL "
                  f"{t['max_kl']:g} nats; warn above mean KL {t['warn_kl']:g} or at no-context's KL. "
                  "KL = KL(full prefill || method) of the first-token distribution."]
        verdict = ("PASS" if not self.warned else "PASS with warnings: " + ", ".join(self.warned)) if self.ok \
            else "FAIL: " + ", ".join(self.failed)
        lines.append(f"verdict: {verdict}")
        return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# ----- the probe text ---------------------------------------------------------------------------
_SYLLABLES = ("ka", "lo", "vi", "dre", "mon", "sa", "tu", "rel", "bo", "zen", "qua", "fi", "nor", "ith", "ul",
              "pra", "vek", "sol", "gar", "een", "myr", "tho")
_KINDS = ("observatory", "mill", "library", "bridge", "shipyard", "lighthouse", "granary", "foundry")
_ROLES = ("chief engineer", "head librarian", "first keeper", "lead chemist", "harbour master", "archivist")
_EXTRA = ("Travellers reach it by a narrow road that floods every spring.",
          "Its walls were rebuilt twice after storms, each time in grey stone.",
          "The town council meets there on the last day of every month.",
          "A small museum beside it keeps the original plans and tools.")


def _word(r: random.Random, n: int) -> str:
    return "".join(r.choice(_SYLLABLES) for _ in range(n)).capitalize()


def probe_set(n: int = DEFAULT_PROBES, passages: int = DEFAULT_PASSAGES, seed: int = DEFAULT_SEED) -> list:
    """``n`` probes ``(passages, question)``: ``passages`` invented facts (a place, a building, its
    year, its code and the person in a role; 1 to 3 sentences, so the chunks have uneven lengths)
    and a question on one of them. Deterministic for a seed."""
    if n < 1 or passages < 1:
        raise ValueError(f"ragattn.methods.quality_gate.probe_set: needs n >= 1 and passages >= 1, got {n}, {passages}")
    r = random.Random(seed)
    out = []
    for _ in range(n):
        texts, facts = [], []
        for _ in range(passages):
            place, person = _word(r, 3), f"{_word(r, 2)} {_word(r, 3)}"
            kind, role, year, code = r.choice(_KINDS), r.choice(_ROLES), r.randint(1201, 1989), r.randint(1000, 9999)
            text = f"The {kind} of {place} was completed in {year}. Its {role} was {person}."
            text += f" Its door opens with the code {code}." if r.random() < 0.5 else ""
            text += " " + r.choice(_EXTRA) if r.random() < 0.5 else ""
            texts.append(text)
            facts.append((place, kind, role, year))
        place, kind, role, year = facts[r.randrange(passages)]
        question = r.choice((f"Who was the {role} of the {kind} of {place}?",
                             f"In which year was the {kind} of {place} completed?",
                             f"Which building of {place} is described, and who was its {role}?"))
        out.append((texts, question))
    return out


# ----- the checks -------------------------------------------------------------------------------
def rotation_error(model, tokenizer, text: str, offset: int = ROTATION_OFFSET) -> tuple[float, int]:
    """(largest relative error over the layers of ragattn's re-rotation of ``text``'s keys from
    positions ``0..n-1`` to ``offset..offset+n-1`` against the model's own keys there, the offset
    used: ``offset`` or less, so that the passage fits the model's window). Raises what
    :func:`ragattn.hf.store_model.describe` raises for a model ragattn cannot re-rotate."""
    import ragattn
    from ragattn.hf.store_model import describe

    spec = describe(model, fingerprint="quality-gate")   # RoPE from the model (refusals raise here)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = int(ids.numel())
    offset = max(1, min(offset, spec.max_positions - n))
    dev = next(model.parameters()).device
    ids, cu = ids.to(dev), torch.tensor([0, n], dtype=torch.int32, device=dev)
    with torch.no_grad():
        k0, _ = spec.prefill(ids, torch.arange(n, device=dev), cu)
        k_at, _ = spec.prefill(ids, offset + torch.arange(n, device=dev), cu)
    moved = [k.detach().float().contiguous() for k in k0]
    rope = spec.rope
    ragattn.rerotate_keys_(moved, torch.arange(n, device=dev), torch.full((n,), offset, device=dev),
                           rope.inv_freq.to(dev), rope.rotary_dim, rope.interleaved)
    errs = [float((m - k.float()).norm() / k.float().norm().clamp_min(1e-30)) for m, k in zip(moved, k_at)]
    return max(errs), offset


def _model_checks(model, tokenizer, text: str, limits: Thresholds) -> list:
    from ragattn.hf.rope import model_family

    fam = model_family(model)
    try:
        err, offset = rotation_error(model, tokenizer, text)
    except (NotImplementedError, ValueError) as exc:
        return [Check("rope", "refused", " ".join(str(exc).split()))]
    dtype = next(model.parameters()).dtype
    limit = limits.rotation_limit(dtype)
    ok = err <= limit
    detail = (f"{fam}: keys re-rotated by {offset} positions vs the model's own keys there, largest relative "
              "error over the layers" + ("" if ok else "; the model rotates keys differently from what "
                                         "ragattn's re-rotation assumes (RoPE layout, frequencies or a "
                                         "patched rotary): cached chunks would be placed wrong"))
    return [Check("re-rotation", "pass" if ok else "fail", detail, err, limit)]


def _recompute_check(model, tokenizer, chunks, question, base, store, limits: Thresholds) -> Check:
    """CacheBlend at ratio 1 (every chunk token recomputed: full attention) against full prefill."""
    ans = registry.get("cacheblend").answer(model, tokenizer, chunks, question, max_new_tokens=1, store=store, ratio=1.0)
    kl = kl_divergence(base.first_logits, ans.first_logits)
    limit = limits.exact_limit(next(model.parameters()).dtype)
    ok = kl <= limit
    detail = ("CacheBlend at ratio 1 (every chunk token recomputed, i.e. full attention) vs full prefill, "
              "first-token KL on the first probe" + ("" if ok else "; the recompute path is wrong for this model"))
    return Check("recompute-all", "pass" if ok else "fail", detail, kl, limit)


def _verdict(agree: float, mean_kl: float, floor_kl: Optional[float], limits: Thresholds) -> tuple[str, str]:
    if agree < limits.min_agreement:
        return "fail", f"first-token agreement {100 * agree:.0f}% < {100 * limits.min_agreement:g}%"
    if mean_kl > limits.max_kl:
        return "fail", f"mean KL {mean_kl:.3g} > {limits.max_kl:g}"
    if floor_kl is not None and mean_kl >= floor_kl:
        return "warn", f"mean KL {mean_kl:.3g} not below no-context's {floor_kl:.3g}"
    if mean_kl > limits.warn_kl:
        return "warn", f"mean KL {mean_kl:.3g} > {limits.warn_kl:g}"
    return "pass", ""


def check_model(model, tokenizer, *, methods: Optional[Sequence[str]] = None, thresholds: Optional[Thresholds] = None,
                probes: int = DEFAULT_PROBES, passages: int = DEFAULT_PASSAGES, seed: int = DEFAULT_SEED,
                ratio: Optional[float] = None, store=None, name: Optional[str] = None,
                progress: Optional[Callable[[str], None]] = None) -> GateReport:
    """Run the gate (module docstring) on ``model`` and ``tokenizer``; returns a :class:`GateReport`.

    ``methods``: names or aliases among :data:`GATED` (default: all of them); ``ratio``: recompute
    ratio in [0, 1] of the ratio methods (None: ``registry.DEFAULT_RATIO``); ``store``: the
    :class:`~ragattn.store.ChunkStore` the methods share (None: a fresh one in memory); ``name``:
    the model as the report names it; ``progress(step)``: called after each answer (a bar's
    update). ValueError for an unknown method, a bad ratio or probe count."""
    limits = thresholds or Thresholds()
    wanted = GATED if methods is None else {registry.canonical(m, GATED) for m in methods}
    chosen = [m for m in GATED if m in wanted]     # registry order
    if not chosen:
        raise ValueError("ragattn.methods.quality_gate.check_model: no method to check")
    if ratio is not None and registry.check_ratio(ratio) is not None:
        raise ValueError(f"ragattn.methods.quality_gate.check_model: ratio {registry.check_ratio(ratio)}")
    probe = probe_set(probes, passages, seed)
    dtype = next(model.parameters()).dtype
    settings = dict(model=name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
                    family=getattr(model.config, "model_type", "?"), dtype=str(dtype).replace("torch.", ""),
                    probes=probes, passages=passages, seed=seed,
                    ratio=registry.DEFAULT_RATIO if ratio is None else ratio,
                    thresholds=dataclasses.asdict(limits), methods=chosen)
    checks = _model_checks(model, tokenizer, " ".join(probe[0][0]), limits)
    if any(c.verdict == "refused" for c in checks):
        why = next(c.detail for c in checks if c.verdict == "refused")
        return GateReport(checks, [MethodRow(m, "refused", why) for m in chosen], settings)
    if store is None:
        from ragattn.store import ChunkStore

        store = ChunkStore(model)
    entries = [registry.get(m) for m in chosen] + [registry.get(FLOOR)]
    figures = {m.name: [] for m in entries}
    for i, (chunks, question) in enumerate(probe):
        base = registry.get(registry.BASELINE).answer(model, tokenizer, chunks, question, max_new_tokens=1)
        if i == 0 and any(m.ratio for m in entries):
            checks.append(_recompute_check(model, tokenizer, chunks, question, base, store, limits))
        for m in entries:
            ans = m.answer(model, tokenizer, chunks, question, max_new_tokens=1, store=store,
                         ratio=ratio if m.ratio else None)
            kl = kl_divergence(base.first_logits, ans.first_logits)
            figures[m.name].append((ans.tokens[0] == base.tokens[0], kl))
            if progress is not None:
                progress(m.name)
    rows = []
    floor = figures[FLOOR]
    floor_kl = sum(k for _, k in floor) / len(floor)
    for m in entries:
        fs = figures[m.name]
        agree, kls = sum(a for a, _ in fs) / len(fs), [k for _, k in fs]
        row = MethodRow(m.name, "floor" if m.name == FLOOR else "", probes=len(fs), agreement=agree,
                        mean_kl=sum(kls) / len(kls), max_kl=max(kls),
                        ratio=(settings["ratio"] if m.ratio else None))
        if m.name != FLOOR:
            row.verdict, row.reason = _verdict(agree, row.mean_kl, floor_kl, limits)
            # a failed model check fails every method it underlies, with its figure
            broken = [c for c in checks if c.verdict == "fail" and (c.name == "re-rotation" or m.ratio)]
            if broken:
                why = "; ".join(f"{c.name} {'error' if c.name == 're-rotation' else 'KL'} {c.figure:.3g} > "
                                f"{c.limit:g}" for c in broken)
                row.verdict, row.reason = "fail", why + (f"; {row.reason}" if row.reason else "")
        else:
            row.reason = "the question without passages: the floor a method must beat"
        rows.append(row)
    return GateReport(checks, rows, settings)


def steps(methods: Optional[Sequence[str]] = None, probes: int = DEFAULT_PROBES) -> int:
    """How many times :func:`check_model` calls ``progress`` (a bar's total)."""
    return probes * (len(GATED if methods is None else set(registry.canonical(m, GATED) for m in methods)) + 1)


def served_settings() -> dict:
    """The settings a vLLM server's start-up gate runs with (:mod:`ragattn.vllm.gate`): the served
    methods among :data:`GATED` (Full Reuse is not served) and :data:`SERVED_PROBES` probes, the
    rest :func:`check_model`'s defaults. ``check-model --served`` uses the same, so a report it
    keeps with ``--store`` is the one the server reads."""
    served = set(registry.names(served=True))
    return dict(methods=[m for m in GATED if m in served], probes=SERVED_PROBES)


def report_path(directory, fingerprint: str, **kwargs) -> Path:
    """Where :func:`stored_check` keeps the report of the model whose fingerprint
    (:func:`ragattn.store.model_fingerprint`) is ``fingerprint``, checked with ``kwargs`` (those of
    :func:`check_model`): ``directory/quality-gate/<key>.json``, ``key`` a hash of the fingerprint,
    the settings as :func:`check_model` resolves them (a default given or left out is the same key;
    ``store``, ``progress`` and ``name`` are not part of it) and the ragattn, torch and
    transformers versions."""
    import hashlib

    import transformers

    import ragattn

    limits = kwargs.get("thresholds") or Thresholds()
    # the settings as check_model resolves them: a default given or left out is the same key
    keyed = dict(methods=None, probes=DEFAULT_PROBES, passages=DEFAULT_PASSAGES, seed=DEFAULT_SEED, ratio=None)
    keyed.update({k: v for k, v in kwargs.items() if k not in ("store", "progress", "thresholds", "name")})
    wanted = GATED if keyed["methods"] is None else {registry.canonical(m, GATED) for m in keyed["methods"]}
    keyed["methods"] = [m for m in GATED if m in wanted]
    keyed["ratio"] = registry.DEFAULT_RATIO if keyed["ratio"] is None else keyed["ratio"]
    ident = json.dumps(dict(model=fingerprint, thresholds=dataclasses.asdict(limits), **keyed,
                            versions=[getattr(ragattn, "__version__", "?"), torch.__version__,
                                      transformers.__version__]), sort_keys=True, default=str)
    return Path(directory) / _STORE_SUBDIR / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")


def read_report(path) -> Optional[GateReport]:
    """The report kept at ``path``, or None when there is none (or it is damaged, or of another layout)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return GateReport.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_report(path, report: GateReport) -> None:
    """Keeps ``report`` at ``path`` (written whole: a temporary file of this process, then renamed,
    so processes writing the same report at once never leave a torn file). OSError when it cannot."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    tmp.replace(path)


def stored_check(model, tokenizer, directory, **kwargs) -> GateReport:
    """:func:`check_model` once per model and settings: the report is read from
    :func:`report_path` when there, else computed and written there. ``kwargs``: those of
    :func:`check_model` (``store`` and ``progress`` are not part of the key)."""
    from ragattn.store.fingerprint import model_fingerprint

    path = report_path(directory, model_fingerprint(model), **kwargs)
    report = read_report(path)
    if report is None:
        report = check_model(model, tokenizer, **kwargs)
        write_report(path, report)
    return report
