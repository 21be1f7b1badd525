"""The QA corpus the demo retrieves from and asks questions about.

A corpus is a folder with two JSON-lines files (schema in ``ragattn/data/qa/README.md``)::

    passages.jsonl   {"id": str, "title": str, "text": str}
    questions.jsonl  {"id": str, "question": str, "answers": [str, ...], "passage_id": str?,
                      "passage_ids": [str, ...]?}

    from ragattn.apps.corpus import load_corpus
    corpus = load_corpus()              # the corpus shipped in the package
    corpus = load_corpus("my/corpus")   # same format; CorpusError on anything missing or malformed
"""
from __future__ import annotations

import dataclasses
import json
import re
import string
from pathlib import Path
from typing import List, Optional, Union

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "qa"   # ragattn/data (package data)
EVAL_CORPUS = Path(__file__).resolve().parents[1] / "data" / "qa_eval"  # python -m ragattn eval


class CorpusError(ValueError):
    """A corpus folder is missing, or one of its files is malformed (message names file and line)."""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    def render(self) -> str:
        """The passage as it appears in a prompt (one retrieved chunk)."""
        return f"- Title: {self.title}\n{self.text}\n"


@dataclasses.dataclass(frozen=True)
class Question:
    """``passage_ids``: the supporting passages (all of them are needed for a multi-hop question);
    ``(passage_id,)`` when only ``passage_id`` is given, ``()`` when neither is."""
    id: str
    question: str
    answers: tuple
    passage_id: Optional[str] = None
    passage_ids: tuple = ()

    @property
    def multi_hop(self) -> bool:
        return len(self.passage_ids) >= 2


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: Path
    passages: List[Passage]
    questions: List[Question]

    def passage(self, pid: str) -> Passage:
        for p in self.passages:
            if p.id == pid:
                return p
        raise KeyError(pid)


def _read_jsonl(path: Path, fields: dict) -> List[dict]:
    """Rows of a JSONL file; ``fields`` maps a required key to its type (``list`` = list of str)."""
    if not path.is_file():
        raise CorpusError(f"ragattn corpus: {path} is missing (a corpus folder needs passages.jsonl and questions.jsonl)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"ragattn corpus: {where}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise CorpusError(f"ragattn corpus: {where}: expected a JSON object, got {type(row).__name__}")
            for key, typ in fields.items():
                if key not in row:
                    raise CorpusError(f"ragattn corpus: {where}: missing field {key!r}")
                val = row[key]
                if typ is list:
                    if not isinstance(val, list) or not val or not all(isinstance(a, str) and a.strip() for a in val):
                        raise CorpusError(f"ragattn corpus: {where}: field {key!r} must be a non-empty list of non-empty strings, got {val!r}")
                elif not isinstance(val, str) or not val.strip():
                    raise CorpusError(f"ragattn corpus: {where}: field {key!r} must be a non-empty string, got {val!r}")
            rows.append(row)
    if not rows:
        raise CorpusError(f"ragattn corpus: {path} has no entries")
    seen = set()
    for row in rows:
        if row["id"] in seen:
            raise CorpusError(f"ragattn corpus: {path}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    return rows


def load_corpus(root: Union[str, Path, None] = None) -> Corpus:
    """Load and validate a corpus folder (default: the one shipped in ``ragattn/data/qa``)."""
    root = Path(root) if root is not None else DEFAULT_CORPUS
    if not root.is_dir():
        raise CorpusError(f"ragattn corpus: {root} is not a folder (expected passages.jsonl and questions.jsonl in it)")
    passages = [Passage(r["id"], r["title"], r["text"]) for r in _read_jsonl(root / "passages.jsonl", {"id": str, "title": str, "text": str})]
    ids = {p.id for p in passages}
    questions = []
    for r in _read_jsonl(root / "questions.jsonl", {"id": str, "question": str, "answers": list}):
        pid = r.get("passage_id")
        if pid is not None and pid not in ids:
            raise CorpusError(f"ragattn corpus: question {r['id']!r} names passage_id {pid!r}, which is not in passages.jsonl")
        support = r.get("passage_ids")
        if support is None:
            support = [pid] if pid is not None else []
        elif not isinstance(support, list) or not support or not all(isinstance(x, str) for x in support):
            raise CorpusError(f"ragattn corpus: question {r['id']!r}: passage_ids must be a non-empty list of passage ids, got {support!r}")
        for x in support:
            if x not in ids:
                raise CorpusError(f"ragattn corpus: question {r['id']!r} names passage_ids entry {x!r}, which is not in passages.jsonl")
        if pid is not None and pid not in support:
            raise CorpusError(f"ragattn corpus: question {r['id']!r}: passage_id {pid!r} is not among its passage_ids {support}")
        questions.append(Question(r["id"], r["question"], tuple(r["answers"]), pid, tuple(support)))
    return Corpus(root, passages, questions)


def rag_prompts(tokenizer, n: int, min_tokens: int, corpus: Optional[Corpus] = None) -> List[tuple]:
    """``n`` (question, chunk texts) of ``corpus`` (default: the shipped QA set), each prompt
    (``ragattn.methods.prompt.prompt_parts``: head, chunks, tail) at least ``min_tokens`` tokens
    when the corpus has enough passages: the question's supporting passages, then other passages
    in a fixed order (rotated per question), each inserted mid-list so the gold passage is not
    always first. Deterministic: the live vLLM tests and ``bench.served`` build the same prompts."""
    from ragattn.methods.prompt import prompt_parts

    corpus = load_corpus() if corpus is None else corpus
    out = []
    for i, q in enumerate(corpus.questions[:n]):
        gold = [corpus.passage(p) for p in (q.passage_ids or (q.passage_id,)) if p]
        others = [p for p in corpus.passages if p not in gold]
        others = others[(5 * i) % len(others):] + others[:(5 * i) % len(others)]
        chunks = [p.render() for p in gold]
        for p in others:
            head, ids, tail = prompt_parts(tokenizer, chunks, q.question)
            if len(head) + sum(map(len, ids)) + len(tail) >= min_tokens:
                break
            chunks.insert(len(chunks) // 2, p.render())     # the gold passage not always first
        out.append((q.question, chunks))
    return out


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers) -> bool:
    """Block-Attention's metric (best_subspan_em): some normalised gold answer occurs in the prediction."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(a) and normalize_answer(a) in pred for a in answers)


def token_f1(prediction: str, answers) -> float:
    """SQuAD token F1 of the prediction against the best-matching gold answer (normalised tokens)."""
    from collections import Counter

    pred = normalize_answer(prediction).split()
    best = 0.0
    for a in answers:
        gold = normalize_answer(a).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            p, r = common / len(pred), common / len(gold)
            best = max(best, 2 * p * r / (p + r))
    return best
