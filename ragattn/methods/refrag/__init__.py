"""REFRAG: chunk encoder + projector, the mixed token / chunk-embedding decoder input
(``torch.ops.ragattn.refrag_assemble``), selective expansion, generation on HF decoders.

    from ragattn.methods.refrag import RefragModel, chunk_context, RandomPolicy
    rm = RefragModel.from_smollm2(k=16)
    rm.generate("question?", ["passage one ...", "passage two ..."], expand_fraction=0.1)

Modules: ``chunking`` (k-token chunks, per passage), ``encoder`` (ChunkEncoder, ChunkProjector,
ChunkEmbeddingCache), ``layout`` (slots, positions, labels of a batch), ``policy`` (the
expansion-policy interface, NoExpansion, RandomPolicy), ``model`` (RefragModel). See
docs/refrag.md.
"""
from ragattn.methods.refrag.chunking import (DEFAULT_KS, ChunkLayout, chunk_context, chunk_spans,
                                             effective_compression, num_expanded)
from ragattn.methods.refrag.layout import RefragExample, RefragLayout, build_layout
from ragattn.methods.refrag.policy import ExpansionPolicy, NoExpansion, RandomPolicy


def __getattr__(name):  # the torch.nn / transformers-heavy modules load on first use
    if name in ("ChunkEncoder", "ChunkProjector", "ChunkEmbeddingCache", "minilm_encoder"):
        from ragattn.methods.refrag import encoder

        return getattr(encoder, name)
    if name in ("RefragModel", "RefragInputs", "default_checkpoint_path"):
        from ragattn.methods.refrag import model

        return getattr(model, name)
    raise AttributeError(f"module 'ragattn.methods.refrag' has no attribute {name!r}")
