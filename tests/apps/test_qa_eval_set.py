"""The shipped evaluation QA set (ragattn/data/qa_eval): schema, sizes, gold answers in the supporting
passages, multi-hop structure. Pure data checks (no model), plus the loader's passage_ids validation."""
import json

import pytest

from ragattn.apps.corpus import EVAL_CORPUS, CorpusError, load_corpus, normalize_answer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(EVAL_CORPUS)


def test_sizes_and_unique_ids(corpus):
    assert len(corpus.passages) >= 100
    assert len(corpus.questions) >= 60
    assert len({p.id for p in corpus.passages}) == len(corpus.passages)
    assert len({q.id for q in corpus.questions}) == len(corpus.questions)
    multi = [q for q in corpus.questions if q.multi_hop]
    assert 3 * len(multi) >= len(corpus.questions), "at least a third of the questions are multi-hop"


def test_every_question_has_support_and_gold_in_it(corpus):
    by_id = {p.id: p for p in corpus.passages}
    for q in corpus.questions:
        assert q.passage_ids, q.id
        assert len(set(q.passage_ids)) == len(q.passage_ids), q.id
        support = " ".join(normalize_answer(by_id[x].title + " " + by_id[x].text) for x in q.passage_ids)
        for a in q.answers:
            assert normalize_answer(a), (q.id, a)
            assert normalize_answer(a) in support, f"{q.id}: gold {a!r} is not in passages {q.passage_ids}"
        if q.passage_id is not None:  # single-hop questions name their one passage in both fields
            assert q.passage_ids == (q.passage_id,), q.id


def test_multi_hop_questions_need_two_distinct_passages(corpus):
    by_id = {p.id: p for p in corpus.passages}
    for q in corpus.questions:
        if not q.multi_hop:
            continue
        assert q.passage_id is None, q.id
        # the gold answer is not already given by the first (bridge) passage alone
        bridge = f" {normalize_answer(by_id[q.passage_ids[0]].text)} "
        assert not any(f" {normalize_answer(a)} " in bridge for a in q.answers), f"{q.id} is answerable from one passage"


def test_passage_lengths_are_chunk_sized(corpus):
    words = [len(p.text.split()) for p in corpus.passages]
    assert 20 <= min(words) and max(words) <= 60, (min(words), max(words))


def _write(tmp_path, passages, questions):
    (tmp_path / "passages.jsonl").write_text("\n".join(json.dumps(p) for p in passages))
    (tmp_path / "questions.jsonl").write_text("\n".join(json.dumps(q) for q in questions))
    return tmp_path


def test_loader_validates_passage_ids(tmp_path):
    ps = [{"id": "a", "title": "A", "text": "alpha"}, {"id": "b", "title": "B", "text": "beta"}]
    ok = load_corpus(_write(tmp_path, ps, [{"id": "q", "question": "?", "answers": ["x"], "passage_ids": ["a", "b"]},
                                           {"id": "r", "question": "?", "answers": ["x"], "passage_id": "b"},
                                           {"id": "s", "question": "?", "answers": ["x"]}]))
    assert [q.passage_ids for q in ok.questions] == [("a", "b"), ("b",), ()]
    assert [q.multi_hop for q in ok.questions] == [True, False, False]
    for bad, msg in [({"passage_ids": ["a", "zz"]}, "'zz'"), ({"passage_ids": []}, "non-empty list"),
                     ({"passage_ids": "a"}, "non-empty list"),
                     ({"passage_id": "a", "passage_ids": ["b"]}, "not among its passage_ids")]:
        _write(tmp_path, ps, [{"id": "q", "question": "?", "answers": ["x"], **bad}])
        with pytest.raises(CorpusError, match=msg):
            load_corpus(tmp_path)


def test_retriever_indexes_the_set(corpus):
    pytest.importorskip("transformers")
    from ragattn.methods import retrieval

    try:
        retrieval.minilm_dir()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(str(exc))
    r = retrieval.Retriever([f"{p.title}. {p.text}" for p in corpus.passages])
    assert r.embeddings.shape == (len(corpus.passages), 384)
    ids = [p.id for p in corpus.passages]
    hits = 0
    for q in corpus.questions[:20]:
        idx, _ = r.top_k(q.question, 8)
        hits += all(ids[i] in {ids[j] for j in idx} for i in [ids.index(x) for x in q.passage_ids])
    assert hits >= 14, hits  # measured: 80/90 questions have all their support in the top 8
