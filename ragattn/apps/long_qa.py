"""A long-context QA set assembled from the shipped corpora (RAPID's evaluation).

    from ragattn.apps.long_qa import build_long_qa
    lqa = build_long_qa(tokenizer, min_tokens=4096)
    lqa.context          # one long document: shuffled rendered passages, >= min_tokens tokens
    lqa.questions        # the corpus questions whose supporting passages are all in it

The passages of the given corpora (default: the evaluation set ``ragattn/data/qa_eval``, then the
demo set ``ragattn/data/qa``) are shuffled with ``seed`` and taken until the context reaches
``min_tokens`` tokens of ``tokenizer``; every question answerable from the taken passages is kept,
so each question's evidence sits at some depth among many distractors (same-entity distractors in
the evaluation set), as in a LongBench-style single-document QA. Nothing is generated or downloaded.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from ragattn.apps.corpus import DEFAULT_CORPUS, EVAL_CORPUS, Passage, Question, load_corpus


@dataclass
class LongQA:
    """``context``: the long document; ``passages``: its passages in order; ``questions``: the
    answerable questions; ``tokens``: the context's token count."""
    context: str
    passages: list
    questions: list
    tokens: int


def build_long_qa(tokenizer, min_tokens: int = 4096, corpora: Sequence = (EVAL_CORPUS, DEFAULT_CORPUS),
                  seed: int = 0) -> LongQA:
    if min_tokens < 1:
        raise ValueError(f"ragattn.apps.long_qa: min_tokens must be >= 1, got {min_tokens}")
    passages: list[Passage] = []
    questions: list[Question] = []
    for root in corpora:
        c = load_corpus(root)
        passages += c.passages
        questions += c.questions
    rng = random.Random(seed)
    rng.shuffle(passages)
    taken, total = [], 0
    for p in passages:
        taken.append(p)
        total += len(tokenizer(p.render() + "\n", add_special_tokens=False)["input_ids"])
        if total >= min_tokens:
            break
    else:
        raise ValueError(f"ragattn.apps.long_qa: the corpora hold only about {total} tokens, fewer than "
                         f"min_tokens = {min_tokens}")
    ids = {p.id for p in taken}
    kept = [q for q in questions if q.passage_ids and set(q.passage_ids) <= ids]
    context = "\n".join(p.render() for p in taken)
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return LongQA(context, taken, kept, n)
