"""The chunk store's remote tier: chunk files shared by a fleet on a Redis (or Valkey) server.

A chunk missing from memory and disk is fetched from the server before it is computed, and a
computed chunk is published to it once. The value is the disk tier's chunk file, byte for byte
(:func:`~ragattn.store.disk_tier.encode_chunk`: format, fingerprint, key, sha256, dtype, shape),
split into parts of at most ``max_value_bytes``:

* ``<prefix>:part:<key>:<sha256 of the value>:<i>`` the parts (named by their value: a writer that
  loses the race for the manifest removes its own);
* ``<prefix>:chunk:<key>`` the manifest, written last with ``SET NX`` (one copy wins; a reader
  that sees a manifest finds its parts, or a miss if the server evicted them): JSON
  ``{"size", "parts", "sha256", "mac"}``, ``mac`` = HMAC-SHA256 with the deployment's secret
  over the manifest's Redis key and the whole value.

A value is served only when its parts are all there, its length, sha256 and HMAC match and the
chunk file verifies (fingerprint, format, shape, dtype, checksum, key); otherwise it is counted
(``stats["remote_bad"]``), the chunk is computed and the entry replaced. A server that is down,
slow or restarting costs at most ``timeout`` seconds per call, one warning per outage, and the
tier is skipped for ``retry_after`` seconds before the client reconnects.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import time
import warnings

from ragattn.store.disk_tier import decode_chunk, encode_chunk
from ragattn.store.errors import ChunkStoreError

DEFAULT_MAX_VALUE_BYTES = 8 << 20
_ERRORS: tuple = ()


def _client_errors() -> tuple:
    global _ERRORS
    if not _ERRORS:
        import redis

        _ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError)
    return _ERRORS


class RemoteTier:
    """A Redis/Valkey server holding chunk files for every process of a fleet.

    ``url``: ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS); ``secret``: bytes or
    str, the deployment's HMAC key (required: a value without a valid HMAC is never served);
    ``timeout``: seconds a call may wait on the server; ``max_value_bytes``: largest value
    written; ``prefix``: the namespace of this store's keys; ``client_options``: passed to
    ``redis.Redis.from_url`` (``ssl_ca_certs``, ``username``, ``password``, ...)."""

    def __init__(self, url: str, secret, *, timeout: float = 0.5, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 prefix: str = "ragattn", retry_after: float = 1.0, client_options: dict | None = None):
        try:
            import redis
        except ImportError:
            raise ChunkStoreError("ragattn.ChunkStore: remote= needs the redis client "
                                  "(pip install 'ragattn[remote]')") from None
        if not secret:
            raise ChunkStoreError("ragattn.ChunkStore: remote= needs remote_secret= (the deployment's HMAC "
                                  "key, bytes or str; or the RAGATTN_REMOTE_SECRET environment variable)")
        if isinstance(max_value_bytes, bool) or not isinstance(max_value_bytes, int) or max_value_bytes < 1024:
            raise ChunkStoreError(f"ragattn.ChunkStore: remote max_value_bytes must be an int >= 1024, "
                                  f"got {max_value_bytes!r}")
        self.url, self.prefix, self.max_value_bytes = url, prefix, max_value_bytes
        self.secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.timeout, self.retry_after = float(timeout), float(retry_after)
        opts = dict(socket_timeout=self.timeout, socket_connect_timeout=self.timeout, retry_on_timeout=False)
        opts.update(client_options or {})
        try:
            self.client = redis.Redis.from_url(url, **opts)
        except ValueError as exc:
            raise ChunkStoreError(f"ragattn.ChunkStore: remote URL {url!r} is not a Redis URL ({exc})") from None
        self._down_until = 0.0
        self._warned = False
        self.stats = {"remote_hits": 0, "remote_published": 0, "remote_bad": 0, "remote_errors": 0}

    # ----- availability -----------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc) -> None:
        """The server did not answer: skip it for ``retry_after`` seconds; warn once per outage."""
        import redis

        self.stats["remote_errors"] += 1
        if isinstance(exc, redis.ResponseError):    # the server answered (e.g. out of memory): not an outage
            return
        self._down_until = time.monotonic() + self.retry_after
        if not self._warned:
            self._warned = True
            warnings.warn(f"ragattn.ChunkStore: remote tier {self.url} unavailable ({type(exc).__name__}: "
                          f"{exc}); chunks are computed locally until it answers", RuntimeWarning, stacklevel=4)

    def _ok(self) -> None:
        self._warned = False

    # ----- keys and authentication ------------------------------------------------------------
    def manifest_key(self, key: str) -> str:
        return f"{self.prefix}:chunk:{key}"

    def _part_key(self, key: str, digest: str, i: int) -> str:
        return f"{self.prefix}:part:{key}:{digest}:{i}"

    def _mac(self, key: str, value: bytes) -> str:
        return hmac.new(self.secret, self.manifest_key(key).encode() + b"\0" + value, hashlib.sha256).hexdigest()

    # ----- fetch and publish --------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """Whether the server holds a manifest of ``key`` (nothing verified; False when it is down)."""
        if not self._available():
            return False
        try:
            found = bool(self.client.exists(self.manifest_key(key)))
            self._ok()
            return found
        except _client_errors() as exc:
            self._failed(exc)
            return False

    def fetch(self, key: str, fingerprint: str, layout: tuple):
        """``(key, tokens, k, v, variant)`` of ``key`` from the server, verified; None on a miss,
        a bad value (counted) or an unavailable server."""
        if not self._available():
            return None
        try:
            raw = self.client.get(self.manifest_key(key))
            if raw is None:
                self._ok()
                return None
            try:
                m = json.loads(raw)
                size, parts, digest, mac = int(m["size"]), int(m["parts"]), str(m["sha256"]), str(m["mac"])
            except (ValueError, TypeError, KeyError):
                return self._bad(key)
            if not 0 < parts <= 1 << 16:
                return self._bad(key)
            values = self.client.mget([self._part_key(key, digest, i) for i in range(parts)])
            self._ok()
        except _client_errors() as exc:
            self._failed(exc)
            return None
        if any(v is None for v in values):    # parts evicted (maxmemory): a miss, replaced when computed
            return self._drop(key)
        value = b"".join(values)
        if len(value) != size or hashlib.sha256(value).hexdigest() != digest \
                or not hmac.compare_digest(self._mac(key, value), mac):
            return self._bad(key)
        try:
            got = decode_chunk(value, fingerprint, layout, f"remote chunk {key}")
        except ChunkStoreError:
            return self._bad(key)
        if got[0] != key:
            return self._bad(key)
        self.stats["remote_hits"] += 1
        return got

    def _bad(self, key: str):
        """A value that must not be served: counted, and dropped."""
        self.stats["remote_bad"] += 1
        return self._drop(key)

    def _drop(self, key: str):
        """Remove the manifest of ``key`` so that the next publication replaces the entry."""
        try:
            self.client.delete(self.manifest_key(key))
        except _client_errors() as exc:
            self._failed(exc)
        return None

    def publish(self, key: str, tokens, k, v, fingerprint: str, variant=None) -> bool:
        """Publish a computed chunk (``k``, ``v`` ``[L, n, Hkv, D]``, ``tokens`` int64 ``[n]``) unless
        a copy is there; True when this call wrote it. Never raises on a server error."""
        if not self._available():
            return False
        value = encode_chunk(key, tokens, k, v, fingerprint, variant)
        digest = hashlib.sha256(value).hexdigest()
        step = self.max_value_bytes
        chunks = [value[i:i + step] for i in range(0, len(value), step)]
        manifest = json.dumps({"size": len(value), "parts": len(chunks), "sha256": digest,
                               "mac": self._mac(key, value)})
        try:
            if self.client.exists(self.manifest_key(key)):
                self._ok()
                return False
            pipe = self.client.pipeline(transaction=False)
            for i, c in enumerate(chunks):    # parts first: a manifest is never seen before them
                pipe.set(self._part_key(key, digest, i), c)
            pipe.execute()
            wrote = bool(self.client.set(self.manifest_key(key), manifest, nx=True))
            if not wrote:   # another writer won: its parts stay, ours go (safetensors' header order
                # varies between writes, so the two values need not be the same bytes)
                pipe = self.client.pipeline(transaction=False)
                for i in range(len(chunks)):
                    pipe.delete(self._part_key(key, digest, i))
                pipe.execute()
            self._ok()
        except _client_errors() as exc:
            self._failed(exc)
            return False
        if wrote:
            self.stats["remote_published"] += 1
        return wrote
