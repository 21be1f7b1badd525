"""What a chunk that is not in memory costs from each source: a tier read against recomputing it.

    costs = TierCosts(disk=(2e-3, 1e-9), remote=(4e-3, 2e-9), recompute=(30e-3, 1e-3))
    store = ChunkStore(model, "kv/", remote=url, costs=costs)        # the loader picks the cheaper
    costs = TierCosts.measure(model, tokens=(32, 128, 512))          # calibrated on this machine

A source's cost is linear: ``fixed + per_unit * amount`` seconds per chunk, where the amount is
the chunk's bytes for the disk and remote tiers (``tokens * row_bytes``: read, sha256-verified,
decoded, copied into the pool) and its tokens for a recomputation (the model's prefill of the
chunk alone). ``TierCosts.measure`` fits both terms by least squares to timings of this model on
this machine; ``TierCosts.fit`` does it from timings taken elsewhere (``bench.remote_tier``).

The default of a store (``costs=None``) is :data:`TIERS_FIRST`: a tier read is always taken when
the chunk is in a tier, the order docs/chunk-store.md gives. On a CPU a tier read is 20-100x
cheaper than the prefill (docs/chunk-store.md, "Tier or recompute"), so choosing is only worth
its calibration on an accelerator whose prefill outruns the disk or the network (a small model on
a GPU, a slow or remote disk); a store given ``costs`` recomputes a chunk whose tokens it knows
exactly when :meth:`TierCosts.prefer_recompute` says so. The bytes are the same either way up to
the prefill's rounding: a tier's file was computed by the same prefill and is verified before use.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from typing import Dict, Iterable, Sequence, Tuple

import numpy as np
import torch

Line = Tuple[float, float]     # (seconds per chunk, seconds per unit: a byte for a tier, a token to recompute)
TIERS = ("disk", "remote")


def _check_line(name: str, line) -> Line:
    try:
        fixed, per = (float(x) for x in line)
    except (TypeError, ValueError):
        raise ValueError(f"ragattn.TierCosts: {name} must be (seconds per chunk, seconds per unit), "
                         f"got {line!r}") from None
    if not (fixed >= 0 and per >= 0):   # also refuses NaN
        raise ValueError(f"ragattn.TierCosts: {name} costs must be >= 0, got {line!r}")
    return fixed, per


@dataclasses.dataclass(frozen=True)
class TierCosts:
    """Seconds to bring one chunk into memory from each source. ``disk`` and ``remote``:
    ``(s per chunk, s per byte)``; ``recompute``: ``(s per chunk, s per token)``. ``inf`` marks a
    source never to prefer (the default recompute: the tiers first)."""

    disk: Line = (0.0, 0.0)
    remote: Line = (0.0, 0.0)
    recompute: Line = (math.inf, math.inf)

    def __post_init__(self):
        for name in ("disk", "remote", "recompute"):
            object.__setattr__(self, name, _check_line(name, getattr(self, name)))

    def tier_s(self, tier: str, nbytes: int) -> float:
        """Modelled seconds to read, verify and insert a chunk of ``nbytes`` from ``tier``."""
        if tier not in TIERS:
            raise ValueError(f"ragattn.TierCosts: tier must be one of {TIERS}, got {tier!r}")
        fixed, per = getattr(self, tier)
        return fixed + per * nbytes

    def recompute_s(self, tokens: int) -> float:
        """Modelled seconds to prefill a chunk of ``tokens`` tokens alone."""
        fixed, per = self.recompute
        return fixed + per * tokens if math.isfinite(fixed) and math.isfinite(per) else math.inf

    def prefer_recompute(self, tier: str, tokens: int, row_bytes: int) -> bool:
        """Whether recomputing a chunk of ``tokens`` tokens (``row_bytes`` of K/V each) is modelled
        strictly cheaper than reading it from ``tier``."""
        return self.recompute_s(tokens) < self.tier_s(tier, tokens * row_bytes)

    def crossover_tokens(self, tier: str, row_bytes: int) -> float:
        """Chunk length above which ``tier`` is cheaper than recomputing (0: always the tier;
        ``inf``: never). The line recomputes below it when the recompute's fixed cost is lower."""
        rf, rp = self.recompute
        tf, tp = getattr(self, tier)
        tp = tp * row_bytes
        if not (math.isfinite(rf) and math.isfinite(rp)):
            return 0.0
        if rp <= tp:
            return math.inf if rf < tf else 0.0
        return max(0.0, (tf - rf) / (rp - tp))

    @classmethod
    def fit(cls, samples: Dict[str, Iterable[Tuple[float, float]]]) -> "TierCosts":
        """Least-squares lines through ``samples``: per source (``disk``, ``remote``,
        ``recompute``) a list of ``(amount, seconds)`` (bytes for a tier, tokens to recompute). A
        source without samples keeps the default; both terms are clipped at 0."""
        lines = {}
        for name, pts in samples.items():
            if name not in ("disk", "remote", "recompute"):
                raise ValueError(f"ragattn.TierCosts.fit: unknown source {name!r}")
            pts = [(float(x), float(y)) for x, y in pts]
            if not pts:
                continue
            x, y = np.array(pts).T
            if len(set(x.tolist())) < 2:        # one amount: no slope to fit, all of it per unit
                lines[name] = (0.0, float(y.mean() / max(x.mean(), 1.0)))
                continue
            per, fixed = np.polyfit(x, y, 1)
            if per < 0:                          # noise: flat
                per, fixed = 0.0, float(y.mean())
            if fixed < 0:                        # through the origin instead
                per, fixed = float((x * y).sum() / (x * x).sum()), 0.0
            lines[name] = (float(fixed), float(per))
        return cls(**lines)

    @classmethod
    def measure(cls, model, tokens: Sequence[int] = (32, 128, 512), chunks: int = 4, remote=None,
                remote_secret=None, seed: int = 0) -> "TierCosts":
        """Calibrate on ``model`` (what ``ChunkStore`` takes) here: per length in ``tokens``,
        ``chunks`` random chunks computed (recompute), read by a fresh store from a temporary
        directory (disk), and, with ``remote`` (a URL or ``RemoteTier``), by a fresh store from
        the remote tier; each timed per chunk, then :meth:`fit`."""
        return cls.fit(measure_samples(model, tokens, chunks, remote, remote_secret, seed))


TIERS_FIRST = TierCosts()


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure_samples(model, tokens: Sequence[int], chunks: int, remote=None, remote_secret=None,
                    seed: int = 0) -> Dict[str, list]:
    """``{source: [(amount, seconds per chunk), ...]}`` of :meth:`TierCosts.measure` (one point
    per length: the mean over ``chunks`` chunks, each source from a fresh store)."""
    from ragattn.store.chunk_store import ChunkStore

    if not tokens or chunks < 1 or any(int(n) < 1 for n in tokens):
        raise ValueError("ragattn.TierCosts.measure: tokens must be lengths >= 1 and chunks >= 1")
    samples: Dict[str, list] = {"disk": [], "recompute": []}
    if remote is not None:
        samples["remote"] = []
    g = torch.Generator().manual_seed(seed)
    opts = dict(remote=remote, remote_secret=remote_secret)
    with tempfile.TemporaryDirectory() as d:
        writer = ChunkStore(model, d, **opts)
        vocab = writer.vocab_size or 1000
        device, row_bytes = writer.device, writer.row_bytes
        for n in tokens:
            n = int(n)
            batch = [torch.randint(1, vocab, (n,), generator=g) for _ in range(chunks)]
            plain = ChunkStore(model, device=device)
            plain.add([torch.randint(1, vocab, (n,), generator=g)])     # warm-up: kernels, allocation
            t = _timed(lambda: [plain.add([c]) for c in batch], device)
            samples["recompute"].append((n, t / chunks))
            writer.add(batch)                                # written to the directory (and published)
            reader = ChunkStore(model, d, read_only=True, device=device)
            t = _timed(lambda: [reader.add([c]) for c in batch], device)
            assert reader.stats["loaded"] == chunks, reader.stats
            samples["disk"].append((n * row_bytes, t / chunks))
            if remote is not None:
                fetcher = ChunkStore(model, device=device, **opts)
                t = _timed(lambda: [fetcher.add([c]) for c in batch], device)
                samples["remote"].append((n * row_bytes, t / chunks))
    return samples
