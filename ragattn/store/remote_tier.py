"""The chunk store's remote tier: chunk files shared by a fleet on a Redis (or Valkey) server.

A chunk missing from memory and disk is fetched from the server before it is computed, and a
computed chunk is published to it once (a derived entry written again by ``put`` replaces it). The
value is the disk tier's chunk file, byte for byte (:func:`~ragattn.store.disk_tier.encode_chunk`:
format, fingerprint, key, sha256, dtype, shape), split into parts of at most ``max_value_bytes``.
Every name carries ``<ns>``, 16 hex digits of an HMAC of a fixed text under the deployment's secret:
processes with another secret live in another namespace and never read (nor remove) these entries.

* ``<prefix>:part:<ns>:<key>:<nonce>:<i>`` the parts, ``<nonce>`` random per write: no two writers
  (nor two writes) share a part's name, so a writer removes only its own parts;
* ``<prefix>:chunk:<ns>:<key>`` the manifest, written last (a reader never sees it before its
  parts): JSON ``{"size", "parts", "sha256", "nonce", "mac"}``, ``mac`` = HMAC-SHA256 with the
  secret over the manifest's name and the whole value. A chunk is published with ``SET NX`` (the
  first copy wins; the loser removes its own parts); a replacement (``replace=True``) swaps the
  manifest with ``GETSET`` and lets the parts of the one it replaced expire after ``RETIRE_SECONDS``
  (a reader that read the old manifest still finds them).

Everything read from the server is untrusted: a manifest that is not a JSON object of the right
types and ranges, a value whose length or HMAC does not match, or a chunk file that fails its own
checks (the key; its checksum is the writer's, and the HMAC covers it) is a bad entry: counted
(``stats["remote_bad"]``), its manifest removed *if it is still the one read* (compare and delete)
and the chunk computed and published again. A value that is authentic (its HMAC holds) but for
another model, layout or format (:class:`~ragattn.store.errors.ForeignChunkError`: a reader with
other weights, a stale key) is a miss here and stays on the server for the processes it belongs to.
A server that is down, slow, restarting or not a Redis server at all (any client error) costs at
most ``timeout`` seconds per call, one warning per outage naming the URL (without its password),
and the tier is skipped for ``retry_after`` seconds before the client reconnects.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import numbers
import re
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Optional

from ragattn.store.disk_tier import decode_chunk, encode_chunk
from ragattn.store.errors import ChunkStoreError, ForeignChunkError

DEFAULT_MAX_VALUE_BYTES = 8 << 20
MAX_VALUE_LIMIT = 512 << 20        # the largest string a Redis server stores
MAX_PARTS = 1 << 16
MIN_SECRET_BYTES = 16
RETIRE_SECONDS = 60                # how long a replaced entry's parts outlive their manifest
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NONCE = re.compile(r"^[0-9a-f]{32}$")
# compare and delete: remove a manifest only if it is still the value this reader judged
_DELETE_IF_SAME = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
_WHERE = "ragattn.ChunkStore: remote"


def _redacted(url: str) -> str:
    """``url`` without its password (``redis://user:***@host``), for warnings and errors."""
    return re.sub(r"^([a-z+]+://[^:@/]*:)[^@/]*@", r"\1***@", url)


def _secret_bytes(secret) -> bytes:
    """The HMAC key: bytes or str of at least ``MIN_SECRET_BYTES`` bytes, else ChunkStoreError (a
    number would become that many zero bytes: a key anyone can guess)."""
    if secret is None or (isinstance(secret, (str, bytes, bytearray)) and not secret):
        raise ChunkStoreError(f"{_WHERE}= needs remote_secret= (the deployment's HMAC key, bytes or str; or the "
                              "RAGATTN_REMOTE_SECRET environment variable)")
    if not isinstance(secret, (str, bytes, bytearray)):
        raise ChunkStoreError(f"{_WHERE}_secret must be bytes or str (the deployment's HMAC key), "
                              f"got {type(secret).__name__}")
    b = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(b) < MIN_SECRET_BYTES:
        raise ChunkStoreError(f"{_WHERE}_secret must hold at least {MIN_SECRET_BYTES} bytes, got {len(b)}")
    return b


def _seconds(name: str, value, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise ChunkStoreError(f"{_WHERE} option {name} must be a finite number of seconds "
                              f"{'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Manifest:
    size: int
    parts: int
    sha256: str
    nonce: str
    mac: str


def _count(x, lo: int, hi: int) -> Optional[int]:
    """``x`` when it is a JSON integer (not a bool, not a float) in ``[lo, hi]``, else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi else None


def parse_manifest(raw) -> Optional[Manifest]:
    """A manifest read from the server, parsed as untrusted: None unless it is a JSON object with
    ``size`` (int in ``[1, MAX_PARTS * MAX_VALUE_LIMIT]``), ``parts`` (int in ``[1, MAX_PARTS]``),
    ``sha256`` and ``mac`` (64 hex digits) and ``nonce`` (32 hex digits); no NaN or Infinity."""
    def refuse(name):
        raise ValueError(name)
    try:
        m = json.loads(raw, parse_constant=refuse)
    except (ValueError, TypeError, RecursionError):   # bad UTF-8 or JSON, NaN/Infinity, 1e400
        return None
    if not isinstance(m, dict):
        return None
    size, parts = _count(m.get("size"), 1, MAX_PARTS * MAX_VALUE_LIMIT), _count(m.get("parts"), 1, MAX_PARTS)
    digest, nonce, mac = m.get("sha256"), m.get("nonce"), m.get("mac")
    if size is None or parts is None or not all(isinstance(s, str) for s in (digest, nonce, mac)):
        return None
    if not (_HEX64.match(digest) and _HEX64.match(mac) and _NONCE.match(nonce)):
        return None
    return Manifest(size, parts, digest, nonce, mac)


class RemoteTier:
    """A Redis/Valkey server holding chunk files for every process of a fleet.

    ``url``: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS); ``secret``: bytes or
    str of at least 16 bytes, the deployment's HMAC key (required: a value without a valid HMAC is
    never served); ``timeout``: seconds a call may wait on the server (> 0); ``retry_after``:
    seconds the tier is skipped after a failed call; ``max_value_bytes``: largest value written
    (1 KiB .. 512 MiB); ``prefix``: the namespace of this store's keys (a non-empty str);
    ``client_options``: passed to ``redis.Redis.from_url`` (``ssl_ca_certs``, ``username``, ...).
    Every argument is checked here (``ChunkStoreError`` naming it), not at the first call."""

    OPTIONS = ("timeout", "max_value_bytes", "prefix", "retry_after", "client_options")

    def __init__(self, url: str, secret, *, timeout: float = 0.5, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 prefix: str = "ragattn", retry_after: float = 1.0, client_options: dict | None = None):
        try:
            import redis
        except ImportError:
            raise ChunkStoreError("ragattn.ChunkStore: remote= needs the redis client "
                                  "(pip install 'ragattn[remote]')") from None
        if not isinstance(url, str):
            raise ChunkStoreError(f"{_WHERE}= must be a redis:// or rediss:// URL (a str), got {type(url).__name__}")
        self.secret = _secret_bytes(secret)
        if isinstance(max_value_bytes, bool) or not isinstance(max_value_bytes, int) \
                or not 1024 <= max_value_bytes <= MAX_VALUE_LIMIT:
            raise ChunkStoreError(f"{_WHERE} option max_value_bytes must be an int in [1024, {MAX_VALUE_LIMIT}], "
                                  f"got {max_value_bytes!r}")
        if not isinstance(prefix, str) or not prefix:
            raise ChunkStoreError(f"{_WHERE} option prefix must be a non-empty str, got {prefix!r}")
        if client_options is not None and not isinstance(client_options, dict):
            raise ChunkStoreError(f"{_WHERE} option client_options must be a dict of redis.Redis.from_url "
                                  f"arguments, got {type(client_options).__name__}")
        if (client_options or {}).get("decode_responses"):   # values are bytes: str would match nothing
            raise ChunkStoreError(f"{_WHERE} option client_options: decode_responses must stay off (chunk "
                                  "values are bytes)")
        self.url, self.prefix, self.max_value_bytes = url, prefix, max_value_bytes
        self.timeout = _seconds("timeout", timeout, positive=True)
        self.retry_after = _seconds("retry_after", retry_after, positive=False)
        self.namespace = hmac.new(self.secret, b"ragattn-remote-namespace", hashlib.sha256).hexdigest()[:16]
        opts = dict(socket_timeout=self.timeout, socket_connect_timeout=self.timeout, retry_on_timeout=False)
        opts.update(client_options or {})
        try:
            self.client = redis.Redis.from_url(url, **opts)
        except (ValueError, TypeError) as exc:
            raise ChunkStoreError(f"{_WHERE} URL {_redacted(url)!r} is not a Redis URL or its client_options "
                                  f"are wrong ({exc})") from None
        self._delete_if_same = self.client.register_script(_DELETE_IF_SAME)
        self._down_until = 0.0
        self._warned = False
        self.stats = {"remote_hits": 0, "remote_published": 0, "remote_bad": 0, "remote_errors": 0}

    @classmethod
    def from_options(cls, url, secret, options: dict | None) -> "RemoteTier":
        """``RemoteTier(url, secret, **options)`` with ``options`` checked: a dict of :attr:`OPTIONS`."""
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise ChunkStoreError(f"{_WHERE}_options must be a dict, got {type(options).__name__}")
        unknown = sorted(set(options) - set(cls.OPTIONS), key=str)
        if unknown:
            raise ChunkStoreError(f"{_WHERE}_options: unknown option(s) {unknown}; known: {list(cls.OPTIONS)}")
        return cls(url, secret, **options)

    # ----- availability -----------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc) -> None:
        """A call failed: an answer of the server (``ResponseError``, e.g. out of memory) is counted;
        anything else (down, slow, not a Redis server) skips the tier for ``retry_after`` seconds,
        with one warning per outage naming the URL."""
        import redis

        self.stats["remote_errors"] += 1
        if isinstance(exc, redis.ResponseError):
            return
        self._down_until = time.monotonic() + self.retry_after
        if not self._warned:
            self._warned = True
            warnings.warn(f"ragattn.ChunkStore: remote tier {_redacted(self.url)} unavailable "
                          f"({type(exc).__name__}: {exc}); chunks are computed locally until it answers",
                          RuntimeWarning, stacklevel=4)

    def _ok(self) -> None:
        self._warned = False

    # ----- names and authentication -------------------------------------------------------------
    def manifest_key(self, key: str) -> str:
        return f"{self.prefix}:chunk:{self.namespace}:{key}"

    def part_key(self, key: str, nonce: str, i) -> str:
        return f"{self.prefix}:part:{self.namespace}:{key}:{nonce}:{i}"

    def _mac(self, key: str, value: bytes) -> str:
        return hmac.new(self.secret, self.manifest_key(key).encode() + b"\0" + value, hashlib.sha256).hexdigest()

    # ----- fetch --------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """Whether the server holds a manifest of ``key`` (nothing verified; False when it is down)."""
        if not self._available():
            return False
        import redis

        try:
            found = bool(self.client.exists(self.manifest_key(key)))
            self._ok()
            return found
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return False

    def fetch(self, key: str, fingerprint: str, layout: tuple):
        """``(key, tokens, k, v, variant)`` of ``key`` from the server, verified; None on a miss, a
        bad entry (counted, removed), another model's entry (left) or an unavailable server."""
        if not self._available():
            return None
        import redis

        name = self.manifest_key(key)
        try:
            raw = self.client.get(name)
            if raw is None:
                self._ok()
                return None
            m = parse_manifest(raw)
            if m is None:
                return self._bad(name, raw)
            values = self.client.mget([self.part_key(key, m.nonce, i) for i in range(m.parts)])
            self._ok()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return None
        if any(not isinstance(v, bytes) for v in values):   # parts evicted (maxmemory): a miss
            self._delete(name, raw)
            return None
        value = b"".join(values)
        # The HMAC proves the bytes are what a writer holding the secret wrote: the manifest's plain
        # sha256 (written for readers that still check it) and the chunk file's own checksum add nothing.
        if len(value) != m.size or not hmac.compare_digest(self._mac(key, value), m.mac):
            return self._bad(name, raw)
        try:
            got = decode_chunk(value, fingerprint, layout, f"remote chunk {key}", authenticated=True)
        except ForeignChunkError:   # authentic, for another model or layout: not this reader's to judge
            return None
        except ChunkStoreError:
            return self._bad(name, raw)
        if got[0] != key:
            return self._bad(name, raw)
        self.stats["remote_hits"] += 1
        return got

    def _bad(self, name: str, raw: bytes):
        """An entry proven bad by its own bytes: counted, and removed (if still the one read)."""
        self.stats["remote_bad"] += 1
        self._delete(name, raw)
        return None

    def _delete(self, name: str, raw: bytes) -> None:
        """Remove the manifest ``name`` if it still holds ``raw``: a replacement written since stays."""
        import redis

        try:
            self._delete_if_same(keys=[name], args=[raw])
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)

    # ----- publish ------------------------------------------------------------------------------
    def publish(self, key: str, tokens, k, v, fingerprint: str, variant=None, *, replace: bool = False) -> bool:
        """Publish a chunk (``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64 ``[n]``): unless a copy
        is there, or with ``replace`` over the copy that is (a derived entry written again). True when
        this call's manifest was written. Never raises on a server error."""
        if not self._available():
            return False
        import redis

        value = encode_chunk(key, tokens, k, v, fingerprint, variant)
        nonce = uuid.uuid4().hex
        step = self.max_value_bytes
        chunks = [value[i:i + step] for i in range(0, len(value), step)]
        manifest = json.dumps({"size": len(value), "parts": len(chunks), "sha256": hashlib.sha256(value).hexdigest(),
                               "nonce": nonce, "mac": self._mac(key, value)})
        name = self.manifest_key(key)
        try:
            if not replace and self.client.exists(name):
                self._ok()
                return False
            pipe = self.client.pipeline(transaction=False)
            for i, c in enumerate(chunks):    # parts first: a manifest is never seen before them
                pipe.set(self.part_key(key, nonce, i), c)
            pipe.execute()
            if replace:
                old = parse_manifest(self.client.getset(name, manifest) or b"null")   # any server version
                wrote = True
                if old is not None:           # its parts outlive it a while, for readers of it
                    pipe = self.client.pipeline(transaction=False)
                    for i in range(old.parts):
                        pipe.expire(self.part_key(key, old.nonce, i), RETIRE_SECONDS)
                    pipe.execute()
            else:
                wrote = bool(self.client.set(name, manifest, nx=True))
                if not wrote:                 # another writer won: its parts stay, ours (our nonce) go
                    self.client.delete(*[self.part_key(key, nonce, i) for i in range(len(chunks))])
            self._ok()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return False
        if wrote:
            self.stats["remote_published"] += 1
        return wrote
