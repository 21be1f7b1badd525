"""MiniLM retriever: embeddings are unit-norm mean-pooled, and the right passage comes first."""
import pytest
import torch

from ragattn.apps.corpus import load_corpus
from ragattn.methods.retrieval import Retriever, SentenceEncoder


@pytest.fixture(scope="module")
def encoder(minilm_dir):
    import os

    before = os.environ.get("HF_HUB_OFFLINE")
    enc = SentenceEncoder()
    # loading the shipped model must not switch the whole process to offline mode
    assert os.environ.get("HF_HUB_OFFLINE") == before
    return enc


def test_embeddings_are_unit_and_pooled(encoder):
    e = encoder.encode(["a short sentence", "a noticeably longer sentence that needs padding in a batch"])
    assert e.shape == (2, 384) and e.dtype == torch.float32
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(2))
    # padding must not change an embedding: encode alone == encode in a padded batch
    torch.testing.assert_close(encoder.encode(["a short sentence"])[0], e[0], atol=1e-5, rtol=1e-5)


def test_shipped_questions_retrieve_their_passage(encoder):
    c = load_corpus()
    r = Retriever([f"{p.title}. {p.text}" for p in c.passages], encoder)
    hits = sum(c.passages[r.top_k(q.question, 1)[0][0]].id == q.passage_id for q in c.questions)
    assert hits >= len(c.questions) - 1, hits
    idx, scores = r.top_k(c.questions[0].question, 3)
    assert len(idx) == 3 and scores == sorted(scores, reverse=True)
    assert len(r.top_k("anything", 1000)[0]) == len(c.passages)


def test_bad_inputs(encoder):
    with pytest.raises(ValueError, match="passages is empty"):
        Retriever([], encoder)
    with pytest.raises(ValueError, match="k must be >= 1"):
        Retriever(["x"], encoder).top_k("q", 0)
