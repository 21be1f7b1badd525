"""The fine-tuning's training text: dictd entries -> cleaned passages, a fixed held-out split, RAG
examples. Runs on small dictd files written here (the real one is Debian's dict-foldoc)."""
import gzip
import random

import pytest

from ragattn.apps import training_text as tt

_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
          "market engine ledger signal buffer kernel").split()


def _body(rng, n):
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _dictd(path, entries):
    """Write ``entries`` ([(headword lines, body paragraphs)]) as a gzipped dictd file."""
    lines = ["00-database-info", "", "   front matter, never a passage", ""]
    for heads, paras in entries:
        lines += list(heads) + [""]
        for para in paras:
            lines += ["   " + para, ""]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def test_entries_are_cleaned_into_passages(tmp_path):
    rng = random.Random(3)
    long = _body(rng, 30)
    f = _dictd(tmp_path / "d.dict.dz", [
        (["Widget Language", "WL"], [f"<language> /wij'*t/ A {{programming language (lang.html)}} "
                                     f"for {{widgets}}. {long}.",
                                     "[{Jargon File}]", "(2001-02-03)"]),
        (["tiny"], ["{Widget Language}"]),                          # a bare cross-reference: dropped
        (["Other Thing"], [f"Another entry, with [a source note] inside. {long}."]),
    ])
    ps = tt.load_foldoc(f, min_words=10, max_words=60)
    assert [p.title for p in ps] == ["Other Thing", "Widget Language"]      # sorted, alias line not a title
    wl = ps[1].text
    assert wl.startswith("A programming language for widgets.")
    for junk in ("{", "}", "<language>", "/wij", "lang.html", "Jargon", "2001-02-03"):
        assert junk not in wl
    assert "[a source note]" not in ps[0].text
    assert len(wl.split()) <= 60


def test_passages_keep_whole_sentences_within_max_words(tmp_path):
    rng = random.Random(5)
    sentences = [f"{_body(rng, 9).capitalize()}." for _ in range(12)]
    f = _dictd(tmp_path / "d.dict.dz", [(["Long One"], [" ".join(sentences)])])
    (p,) = tt.load_foldoc(f, min_words=5, max_words=35)
    assert p.text == " ".join(sentences[:3])           # 27 words; a fourth sentence would make 36


def test_missing_or_empty_text_is_a_user_error(tmp_path):
    with pytest.raises(tt.TrainingTextError, match="missing"):
        tt.load_foldoc(tmp_path / "nope.dict.dz")
    f = _dictd(tmp_path / "d.dict.dz", [(["short"], ["Too short."])])
    with pytest.raises(tt.TrainingTextError, match="no entry"):
        tt.load_foldoc(f)


def test_split_is_fixed_by_title_and_disjoint(tmp_path):
    rng = random.Random(7)
    entries = [([f"Term{i:03d}x"], [f"{_body(rng, 40)}."]) for i in range(300)]
    ps = tt.load_foldoc(_dictd(tmp_path / "d.dict.dz", entries))
    train, held = tt.split_passages(ps, held_fraction=0.1)
    assert held and train and len(train) + len(held) == len(ps)
    assert not {p.title for p in train} & {p.title for p in held}
    # the same titles are held out whatever the order and whatever else the file holds
    train2, held2 = tt.split_passages(list(reversed(ps[:150])), held_fraction=0.1)
    assert {p.title for p in held2} == {p.title for p in held if p in ps[:150]}


def test_rag_examples(tmp_path):
    rng = random.Random(11)
    entries = [([f"Term{i:03d}x"], [f"{_body(rng, 40)}."]) for i in range(40)]
    ps = tt.load_foldoc(_dictd(tmp_path / "d.dict.dz", entries))
    stream = tt.rag_examples(ps, random.Random(0), top_k=(2, 6), two_hop=0.5)
    seen_two = False
    for _ in range(60):
        ex = next(stream)
        assert 2 <= len(ex.passages) < 6 and len({p.title for p in ex.passages}) == len(ex.passages)
        named = [p.title for p in ex.passages if p.title in ex.question]
        assert named                                   # the question is about passages in the context
        seen_two |= len(named) == 2
    assert seen_two
    with pytest.raises(ValueError, match="top_k"):
        next(tt.rag_examples(ps, random.Random(0), top_k=(3, 3)))
    with pytest.raises(ValueError, match="top_k"):
        next(tt.rag_examples(ps[:4], random.Random(0), top_k=(2, 9)))
