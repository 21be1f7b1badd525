"""``RefragModel``: an unmodified HF decoder fed REFRAG's mixed token / chunk-embedding input.

    from ragattn.methods.refrag import RefragModel
    rm = RefragModel.from_smollm2(k=16)                       # + the shipped weights (or a checkpoint)
    ans = rm.generate("Who designed it?", passages, max_new_tokens=16, expand_fraction=0.1)
    inputs = rm.build_inputs([(passages_ids, prompt_ids, target_ids)], expand_masks=None)
    rm.loss(inputs)                                           # float32 [B]: per-row mean target NLL

The decoder's architecture and weights are untouched; everything enters through
``inputs_embeds`` (assembled by ``torch.ops.ragattn.refrag_assemble``) and compact
``position_ids`` (layout.py). The encoder and projector (:class:`ChunkEncoder`) are the only new
parameters, with a LoRA on the decoder when the run trained one. Checkpoints
(:meth:`save_checkpoint`) hold the encoder and projector state dicts, ``k`` and the decoder's
fingerprint (plus the decoder's state when it was trained too); the weights that ship
(``ragattn/weights/refrag-k16``, :meth:`load_shipped`) hold only what trained, in bfloat16.
:func:`answer` is the method's entry for ``python -m ragattn eval``.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from ragattn.methods.refrag.chunking import ChunkLayout, chunk_context, num_expanded
from ragattn.methods.refrag.encoder import ChunkEncoder
from ragattn.methods.refrag.layout import RefragExample, RefragLayout, build_layout
from ragattn.methods.refrag.policy import RandomPolicy, check_selection

CHECKPOINT_FORMAT = "ragattn-refrag-v1"
CKPT_ENV = "RAGATTN_REFRAG_CKPT"
SHIPPED = "refrag"     # ragattn.hf.adapters' name of the shipped weights (k = 16)


def default_checkpoint_path(k: int) -> Path:
    """``$RAGATTN_REFRAG_CKPT`` if set, else ``<ragattn cache>/refrag/smollm2-minilm-k{k}.pt``
    (``~/.cache/ragattn`` unless ``$RAGATTN_CACHE``)."""
    env = os.environ.get(CKPT_ENV)
    if env:
        return Path(env)
    from ragattn.hf.models import cache_dir

    return cache_dir() / "refrag" / f"smollm2-minilm-k{k}.pt"


@dataclass
class RefragInputs:
    """A batch ready for the decoder: the :class:`RefragLayout` (positions, ``cu_seqlens``,
    ``slot_src``, labels, chunk bookkeeping) plus ``inputs_embeds`` ``[T, d]`` (packed, the
    decoder's dtype) and ``chunk_c`` float32 ``[L_tot, d_enc]`` (every chunk's encoder embedding,
    when a policy needed it; else None)."""
    layout: RefragLayout
    inputs_embeds: torch.Tensor
    chunk_c: Optional[torch.Tensor] = None

    def __getattr__(self, name):  # layout fields read through: inputs.position_ids, inputs.labels, ...
        if name == "layout":
            raise AttributeError(name)
        return getattr(self.layout, name)

    def padded(self, side: str = "right"):
        """``(inputs_embeds [B, T_max, d], attention_mask int64 [B, T_max], position_ids int64
        [B, T_max], labels int64 [B, T_max])``: rows padded on ``side`` (zeros, mask 0, label -100,
        position 0)."""
        lay, emb = self.layout, self.inputs_embeds
        B, t_max, dev = lay.batch_size, max(lay.seq_lens), emb.device
        out = emb.new_zeros((B, t_max, emb.shape[1]))
        mask = torch.zeros(B, t_max, dtype=torch.int64, device=dev)
        pos = torch.zeros(B, t_max, dtype=torch.int64, device=dev)
        lab = torch.full((B, t_max), -100, dtype=torch.int64, device=dev)
        cu = lay.cu_seqlens.tolist()
        for b in range(B):
            n = cu[b + 1] - cu[b]
            sl = slice(0, n) if side == "right" else slice(t_max - n, t_max)
            out[b, sl] = emb[cu[b]:cu[b + 1]]
            mask[b, sl] = 1
            pos[b, sl] = lay.position_ids[cu[b]:cu[b + 1]].to(dev)
            lab[b, sl] = lay.labels[cu[b]:cu[b + 1]].to(dev)
        return out, mask, pos, lab


class RefragModel(nn.Module):
    """HF causal LM ``decoder`` + its ``tokenizer`` + a :class:`ChunkEncoder`, compression ``k``."""

    def __init__(self, decoder, tokenizer, k: int = 16, encoder: Optional[ChunkEncoder] = None):
        super().__init__()
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.k = k
        chunk_context([0], k)  # validates k
        dev = next(decoder.parameters()).device
        self.encoder = encoder if encoder is not None else ChunkEncoder(tokenizer, decoder.config.hidden_size,
                                                                        device=dev)
        if self.encoder.d_dec != decoder.config.hidden_size:
            raise ValueError(f"ragattn.refrag.RefragModel: the encoder projects to d = {self.encoder.d_dec}, "
                             f"the decoder's embeddings have d = {decoder.config.hidden_size}")
        self.trained = False   # set by load_checkpoint
        self.checkpoint_path: Optional[Path] = None

    @classmethod
    def from_smollm2(cls, k: int = 16, checkpoint: Optional[str | os.PathLike] = "default",
                     dtype: torch.dtype = torch.float32, device="cpu", decoder_and_tokenizer=None) -> "RefragModel":
        """SmolLM2-135M-Instruct (or ``decoder_and_tokenizer``) + MiniLM. ``checkpoint``: "default"
        loads ``$RAGATTN_REFRAG_CKPT`` when set, else the shipped weights (:meth:`load_shipped`)
        when they are for this ``k``, else :func:`default_checkpoint_path` when that file exists
        (a file that does not fit the decoder is a warning; the projector stays untrained:
        ``rm.trained`` is False), a path loads that file
        (errors raise), None loads nothing. The shipped decoder LoRA goes into a copy of the
        decoder (:func:`ragattn.hf.adapters.tuned_model`): the one given is never modified."""
        if decoder_and_tokenizer is None:
            from ragattn.hf.models import load_smollm2

            decoder_and_tokenizer = load_smollm2(dtype=dtype, device=device)
        rm = cls(*decoder_and_tokenizer, k=k)
        if checkpoint == "default":
            path, shipped = default_checkpoint_path(k), _shipped_for(k)
            try:
                if path.is_file() and (os.environ.get(CKPT_ENV) or not shipped):
                    rm.load_checkpoint(path)
                elif shipped:
                    rm.load_shipped()
            except ValueError as exc:  # e.g. trained for another decoder or k: stay untrained, say so
                warnings.warn(f"{exc}; the projector stays untrained", stacklevel=2)
        elif checkpoint is not None:
            rm.load_checkpoint(checkpoint)
        return rm

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    def embed_weight(self) -> torch.Tensor:
        return self.decoder.get_input_embeddings().weight

    # ----- inputs -----------------------------------------------------------------------------
    def _example(self, ex, k: int) -> RefragExample:
        if isinstance(ex, RefragExample):
            return ex
        passages, prompt, *rest = ex
        ctx = passages if isinstance(passages, ChunkLayout) else chunk_context(passages, k, allowed_k=None)
        return RefragExample(ctx, prompt, rest[0] if rest else ())

    def build_inputs(self, batch: Sequence, expand_masks: Optional[Sequence] = None, *, policy=None,
                     expand_fraction: float = 0.0, k: Optional[int] = None) -> RefragInputs:
        """Assemble a batch.

        ``batch``: :class:`RefragExample` s or tuples ``(passages, prompt_ids[, target_ids])`` with
        ``passages`` a list of token-id lists (or a :class:`ChunkLayout`); the row is
        ``[context][prompt][target]`` (use RefragExample for a prefix before the context).
        ``expand_masks``: per row bool ``[L_b]`` (True = expanded) or None; when None and
        ``expand_fraction > 0``, ``policy`` (default :class:`RandomPolicy` seeded 0) picks
        ``round(expand_fraction * L_b)`` chunks per row from every chunk's encoder embedding.
        Gradients flow to the encoder, projector and embedding table when enabled."""
        k = self._check_k(k, "build_inputs")
        _check_fraction(expand_fraction, "build_inputs")
        examples = [self._example(ex, k) for ex in batch]
        chunk_c = None
        if expand_masks is None and expand_fraction > 0:
            policy = policy or RandomPolicy(0)
            all_chunks = [c for ex in examples for c in ex.context.chunk_token_ids()]
            chunk_c, _ = self.encoder.embed(all_chunks, need_c=True, need_e=False)
            expand_masks, at = [], 0
            for ex in examples:
                L = ex.context.num_chunks
                n = num_expanded(L, expand_fraction)
                m = policy.select(chunk_c[at:at + L], ex.context.chunk_token_ids(), n)
                expand_masks.append(check_selection(m, L, n, policy))
                at += L
        lay = build_layout(examples, expand_masks)
        chunks = [lay.chunk_token_ids[i] for i in lay.compressed.tolist()]
        if chunk_c is not None:
            e = self.encoder.project(chunk_c[lay.compressed.to(chunk_c.device)])
        else:
            e = self.encoder(chunks)
        w = self.embed_weight()
        dev = w.device
        emb = torch.ops.ragattn.refrag_assemble(w, lay.token_ids.to(dev), e.to(w.dtype), lay.slot_src.to(dev))
        return RefragInputs(lay, emb, chunk_c)

    # ----- decoder ----------------------------------------------------------------------------
    def logits(self, inputs: RefragInputs) -> torch.Tensor:
        """float32 ``[B, T_max, V]`` decoder logits over each row's slots (right-padded; row ``b``
        has ``inputs.seq_lens[b]`` valid slots). One row runs unpadded, with no attention mask."""
        if inputs.layout.batch_size == 1:
            pos = inputs.position_ids.to(self.device)[None]
            out = self.decoder(inputs_embeds=inputs.inputs_embeds[None], position_ids=pos, use_cache=False)
        else:
            emb, mask, pos, _ = inputs.padded("right")
            out = self.decoder(inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.logits.float()

    def loss(self, inputs: RefragInputs, logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 ``[B]``: each row's mean next-token cross-entropy over its target tokens (slot
        ``t`` predicts the label of slot ``t + 1``); NaN for a row without targets."""
        if logits is None:
            logits = self.logits(inputs)
        _, _, _, labels = inputs.padded("right")
        labels = labels[:, 1:].to(logits.device)
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100,
                                                reduction="none")
        n = (labels != -100).sum(1)
        return nll.sum(1) / n

    # ----- generation -------------------------------------------------------------------------
    def _check_k(self, k, where: str) -> int:
        """``k`` (None: the model's own) as a chunk length >= 1."""
        if k is None:
            return self.k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ragattn.refrag.{where}: k (tokens per chunk) must be an integer >= 1 or None "
                             f"(the model's k={self.k}), got {k!r}")
        return k

    def _rag_example(self, question: str, passages: Sequence, k: int) -> RefragExample:
        """The RAG row of :meth:`generate`: ``[chat head][passages as chunks][question tail]``."""
        from ragattn.methods.prompt import prompt_parts

        if len(passages) == 0:
            raise ValueError("ragattn.refrag.generate: no passages given (empty context)")
        head, chunk_ids, tail = prompt_parts(self.tokenizer, passages, question)
        return RefragExample(chunk_context(chunk_ids, k, allowed_k=None), prompt=tail, prefix=head)

    @torch.no_grad()
    def precompute(self, passages: Sequence, question: str = "", k: Optional[int] = None) -> int:
        """Fill the chunk-embedding cache with the chunks :meth:`generate` will use for these
        passages (offline: the paper's "with cache" mode). Returns the number of chunks."""
        ex = self._rag_example(question, passages, k or self.k)
        self.encoder.embed(ex.context.chunk_token_ids(), need_c=True, need_e=True)
        return ex.context.num_chunks

    @torch.no_grad()
    def generate(self, question: str, passages: Sequence, max_new_tokens: int = 32, k: Optional[int] = None,
                 expand_fraction: float = 0.0, policy=None, **generate_kwargs):
        """Answer ``question`` from ``passages`` (strings or token-id lists) with the context
        compressed at rate ``k`` (default ``self.k``) and ``expand_fraction`` of its chunks
        expanded by ``policy`` (default random, seeded). The prompt is the chat template of
        :func:`ragattn.methods.prompt.prompt_parts`: ``[head][passages as chunks][question tail]``.
        One HF ``generate(inputs_embeds=...)`` call (greedy unless ``generate_kwargs`` say
        otherwise); positions continue compactly after the compressed prompt. Returns a
        :class:`ragattn.methods.generate.Answer` (``ttft_s`` includes chunking, encoding or cache
        lookup, assembly and prefill; ``extra``: slots, chunks, expanded, effective compression)."""
        from ragattn.methods.generate import _generate

        k = self._check_k(k, "generate")
        _check_fraction(expand_fraction, "generate")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"ragattn.refrag.generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        limit = getattr(self.decoder.config, "max_position_embeddings", None)
        t0 = time.perf_counter()
        ex = self._rag_example(question, passages, k)
        head, tail = ex.prefix, ex.prompt
        inputs = self.build_inputs([ex], policy=policy, expand_fraction=expand_fraction, k=k)
        n = inputs.layout.num_slots
        if limit is not None and n + max_new_tokens > limit:
            raise ValueError(f"ragattn.refrag.generate: {n} decoder slots + {max_new_tokens} new tokens exceed "
                             f"the decoder's window ({limit})")
        emb = inputs.inputs_embeds[None]
        ans = _generate(self.decoder, self.tokenizer, t0, "refrag", n, 0, max_new_tokens, generate_kwargs,
                        inputs_embeds=emb, attention_mask=torch.ones(emb.shape[:2], dtype=torch.long,
                                                                     device=emb.device))
        n_tok = len(head) + ex.context.num_tokens + len(tail)
        ans.extra.update(slots=n, tokens=n_tok, chunks=ex.context.num_chunks,
                         expanded=int(inputs.layout.expand_mask.sum()), k=k,
                         compression=ex.context.num_tokens / max(1, n - len(head) - len(tail)),
                         trained=self.trained)
        return ans

    # ----- checkpoints ------------------------------------------------------------------------
    def decoder_fingerprint(self) -> str:
        from ragattn.store import model_fingerprint

        return model_fingerprint(self.decoder)

    def save_checkpoint(self, path, include_decoder: bool = False, extra: Optional[dict] = None) -> Path:
        """Save the encoder and projector state dicts, ``k``, the encoder config and the decoder's
        fingerprint (and the decoder's state dict with ``include_decoder``: after CPT, where the
        decoder trains too). ``extra``: any picklable metadata (training stats)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"format": CHECKPOINT_FORMAT, "k": self.k,
                 "encoder": self.encoder.encoder.state_dict(), "projector": self.encoder.projector.state_dict(),
                 "encoder_config": self.encoder.encoder.config.to_dict(),
                 "d_dec": self.encoder.d_dec, "decoder_fingerprint": self.decoder_fingerprint(),
                 "decoder": self.decoder.state_dict() if include_decoder else None, "extra": extra or {}}
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, path, strict: bool = True) -> dict:
        """Load a :meth:`save_checkpoint` file (sets ``k``, ``trained``). With ``strict``, a
        checkpoint without decoder weights must have been trained against this decoder (same
        fingerprint), else ValueError. Returns the checkpoint's ``extra``."""
        path = Path(path)
        state = torch.load(path, map_location=self.device, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"ragattn.refrag.load_checkpoint: {path} is not a {CHECKPOINT_FORMAT} checkpoint")
        if state["d_dec"] != self.encoder.d_dec:
            raise ValueError(f"ragattn.refrag.load_checkpoint: {path} projects to d = {state['d_dec']}, this "
                             f"decoder has d = {self.encoder.d_dec}")
        if state.get("decoder") is not None:
            self.decoder.load_state_dict(state["decoder"])
        if strict and state["decoder_fingerprint"] != self.decoder_fingerprint():
            raise ValueError(f"ragattn.refrag.load_checkpoint: {path} was trained against another decoder "
                             "(fingerprint mismatch); pass strict=False to load it anyway")
        self.encoder.encoder.load_state_dict(state["encoder"])
        self.encoder.projector.load_state_dict(state["projector"])
        if self.encoder.cache is not None:
            self.encoder.cache.clear()
        self.k = int(state["k"])
        self.trained, self.checkpoint_path = True, path
        return state.get("extra", {})

    def load_shipped(self, name: str = SHIPPED) -> dict:
        """Load the shipped weights ``name`` (:mod:`ragattn.hf.adapters` checks their hashes): the
        decoder becomes a tuned copy with the LoRA merged (unless it already is one:
        ``config.ragattn_adapter == name``), the projector and the trained encoder layers are loaded.
        ValueError when they were trained for another ``k``, decoder or encoder. Returns the manifest."""
        from ragattn.hf.adapters import AdapterError, adapter_dir, shipped_adapter, tuned_model

        try:
            manifest = shipped_adapter(name)
            if manifest.get("k") != self.k:
                raise ValueError(f"ragattn.refrag.load_shipped: the shipped {name!r} weights are for k = "
                                 f"{manifest.get('k')}, this model has k = {self.k}")
            if "adapter_model.safetensors" in manifest.get("files", {}) and \
                    getattr(self.decoder.config, "ragattn_adapter", None) != name:
                self.decoder = tuned_model(self.decoder, name)
        except AdapterError as exc:
            raise ValueError(str(exc)) from None
        self.load_chunk_encoder(adapter_dir(name))
        self.trained, self.checkpoint_path = True, adapter_dir(name)
        return manifest

    def load_chunk_encoder(self, folder: str | os.PathLike) -> None:
        """Load the projector and the trained encoder layers of a shipped folder's
        ``chunk_encoder.safetensors`` (``projector.*`` / ``encoder.*`` names, any float dtype) into this
        model's chunk encoder, in its dtype; the decoder is left alone. ValueError when a tensor has
        no place here or another shape, or the projector is incomplete."""
        from safetensors.torch import load_file

        state = load_file(Path(folder) / "chunk_encoder.safetensors", device=str(self.device))
        parts = {"projector.": self.encoder.projector, "encoder.": self.encoder.encoder}
        for prefix, module in parts.items():
            own = module.state_dict()
            sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            bad = [k for k, v in sub.items() if k not in own or own[k].shape != v.shape]
            if bad or (prefix == "projector." and sub.keys() != own.keys()):
                raise ValueError(f"ragattn.refrag.load_chunk_encoder: the weights in {folder} do not fit this "
                                 f"chunk encoder ({len(bad)} foreign or misshapen tensors, e.g. {bad[:2]})")
            module.load_state_dict({k: v.to(own[k].dtype) for k, v in sub.items()}, strict=False)
        if self.encoder.cache is not None:
            self.encoder.cache.clear()


def _shipped_for(k: int) -> bool:
    """Whether the shipped weights (any state) are there for compression rate ``k``."""
    import json

    from ragattn.hf.adapters import adapter_dir

    f = adapter_dir(SHIPPED) / "manifest.json"
    try:
        return json.loads(f.read_text()).get("k") == k
    except (OSError, ValueError):
        return False


_RM: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # decoder -> {k: RefragModel}


def answer(model, tokenizer, chunks: Sequence, question: str, max_new_tokens: int = 16, store=None,
           k: int = 16, expand_fraction: float = 0.0):
    """REFRAG as ``python -m ragattn eval`` calls a method (:mod:`ragattn.methods.registry`): the
    passages ``chunks`` compressed at rate ``k`` with ``expand_fraction`` of their chunks expanded
    (random policy, seeded), greedy. ``model``: the shipped tuned decoder
    (``tuned_model(model, "refrag")``; its encoder weights are loaded too) or any other decoder (the
    projector is then untrained). ``store`` is unused (REFRAG caches chunk embeddings, not KV).
    Returns a :class:`ragattn.methods.generate.Answer`; the model for a decoder is built once."""
    per = _RM.setdefault(model, {})
    if k not in per:
        rm = RefragModel(model, tokenizer, k=k)
        if getattr(model.config, "ragattn_adapter", None) == SHIPPED:
            rm.load_shipped()
        per[k] = rm
    return per[k].generate(question, chunks, max_new_tokens=max_new_tokens, expand_fraction=expand_fraction)


def _check_fraction(expand_fraction, where: str) -> None:
    if not isinstance(expand_fraction, (int, float)) or not 0.0 <= expand_fraction <= 1.0:   # NaN fails too
        raise ValueError(f"ragattn.refrag.{where}: expand_fraction must be a number in [0, 1], got "
                         f"{expand_fraction!r}")
