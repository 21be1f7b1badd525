"""The shipped QA corpus and the corpus loader's validation."""
import json

import pytest

from ragattn.apps.corpus import CorpusError, exact_match, load_corpus, normalize_answer


def test_shipped_corpus_is_valid():
    c = load_corpus()
    assert 30 <= len(c.passages) <= 60 and 12 <= len(c.questions) <= 20
    for q in c.questions:
        # every gold answer is stated in its passage (the questions are answerable from one passage)
        text = normalize_answer(c.passage(q.passage_id).text)
        assert any(normalize_answer(a) in text for a in q.answers), q.id


def test_passage_lengths_in_tokens(minilm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))  # any subword tokenizer gives the scale
    lens = [len(tok(p.render())["input_ids"]) for p in load_corpus().passages]
    assert 55 <= min(lens) and max(lens) <= 160, (min(lens), max(lens))


def _write(tmp_path, passages, questions):
    (tmp_path / "passages.jsonl").write_text("\n".join(json.dumps(p) if not isinstance(p, str) else p for p in passages))
    (tmp_path / "questions.jsonl").write_text("\n".join(json.dumps(q) if not isinstance(q, str) else q for q in questions))
    return tmp_path


P = {"id": "p1", "title": "T", "text": "Paris is the capital of France."}
Q = {"id": "q1", "question": "Capital of France?", "answers": ["Paris"], "passage_id": "p1"}


def test_custom_corpus_loads(tmp_path):
    c = load_corpus(_write(tmp_path, [P], [Q]))
    assert c.passages[0].text == P["text"] and c.questions[0].answers == ("Paris",)


@pytest.mark.parametrize(
    "passages,questions,match",
    [
        ([P, '{"id": "p2", "title": '], [Q], r"passages.jsonl:2: not valid JSON"),
        ([{"id": "p1", "title": "T"}], [Q], r"passages.jsonl:1: missing field 'text'"),
        ([P, P], [Q], r"duplicate id 'p1'"),
        ([P], [dict(Q, answers=[])], r"questions.jsonl:1: field 'answers' must be a non-empty list"),
        ([P], [dict(Q, passage_id="nope")], r"passage_id 'nope'"),
        ([P], ["[1, 2]"], r"expected a JSON object"),
        ([P], [""], r"has no entries"),
    ],
)
def test_malformed_corpus_is_refused(tmp_path, passages, questions, match):
    with pytest.raises(CorpusError, match=match):
        load_corpus(_write(tmp_path, passages, questions))


def test_missing_corpus(tmp_path):
    with pytest.raises(CorpusError, match="is not a folder"):
        load_corpus(tmp_path / "absent")
    (tmp_path / "questions.jsonl").write_text(json.dumps(Q))
    with pytest.raises(CorpusError, match="passages.jsonl is missing"):
        load_corpus(tmp_path)


def test_exact_match():
    assert exact_match("The capital is Paris.", ["paris"])
    assert exact_match("It was the Wright brothers", ["Wright brothers"])
    assert not exact_match("London", ["Paris"])


def test_rag_prompts_reach_the_length_with_the_gold_passages():
    """``rag_prompts``: each prompt (head + chunks + tail) at least ``min_tokens`` long where the
    corpus allows, every supporting passage among its chunks, the same prompts on every call."""
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus, rag_prompts
    from ragattn.methods.prompt import prompt_parts

    class WordTokenizer:             # one token per word, no chat template
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 1000 for w in text.split()]}

    tok, corpus = WordTokenizer(), load_corpus(EVAL_CORPUS)
    got = rag_prompts(tok, 3, 1000, corpus)
    assert got == rag_prompts(tok, 3, 1000, corpus) and len(got) == 3
    for q, (question, chunks) in zip(corpus.questions, got):
        head, ids, tail = prompt_parts(tok, chunks, question)
        assert question == q.question and len(head) + sum(map(len, ids)) + len(tail) >= 1000
        assert all(corpus.passage(p).render() in chunks for p in q.passage_ids or (q.passage_id,) if p)
