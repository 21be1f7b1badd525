"""Training text for the fine-tuning commands: FOLDOC entries as RAG passages and questions.

    from ragattn.apps.training_text import load_foldoc, rag_examples
    passages = load_foldoc()                       # [Passage], from Debian's dict-foldoc package
    train, held = split_passages(passages)         # disjoint by entry, fixed by the entries' titles
    for ex in rag_examples(train, rng, top_k=(4, 17)):   # endless: passages (gold among them) + question
        ...

The text is the Free On-line Dictionary of Computing (FOLDOC, GNU FDL 1.1 or later) as Debian's
``dict-foldoc`` package installs it (``/usr/share/dictd/foldoc.dict.dz``, a gzip-readable dictd
file): about 15,000 entries of prose about programming languages, companies, people and standards,
nothing of which any test or eval of this repository uses. Each usable entry becomes one passage
(title + its first sentences, cross-reference braces and source notes removed); questions are built
from templates around one or two gold passages ("What is X?", "How are X and Y related?"). No gold
answer is needed: the fine-tuning distils the model's own answers under full attention.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import random
import re
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

from ragattn.apps.corpus import Passage

FOLDOC = Path("/usr/share/dictd/foldoc.dict.dz")
FOLDOC_PACKAGE = "dict-foldoc"
FOLDOC_LICENCE = "GNU Free Documentation License 1.1 or later (FOLDOC, editor Denis Howe)"

_BRACES = re.compile(r"\{([^{}]*?)(?:\s*\([^(){}]*\))?\}")   # {term} and {label (url)} -> the text
_SOURCE = re.compile(r"\[[^\[\]]*\]")                        # [{Jargon File}], [Where did IBM ...?]
_DATE = re.compile(r"^\(\d{4}-\d{2}-\d{2}\)$")
_CATEGORY = re.compile(r"^<[^<>]*>\s*")                      # <programming>, <unit, data>
_PRONOUNCE = re.compile(r"^/[^/]{1,40}/\s*(or\s*/[^/]{1,40}/\s*)?")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


class TrainingTextError(RuntimeError):
    """The training text is missing or unusable (a user-facing error of the training commands)."""


def file_digest(path: Path = FOLDOC) -> str:
    """sha256 hex of the raw training-text file (recorded beside the trained weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _clean(text: str) -> str:
    for _ in range(3):                      # nested braces: {foo {bar}}
        text = _BRACES.sub(r"\1", text)
    text = _SOURCE.sub("", text)
    text = _CATEGORY.sub("", text.strip())
    text = _PRONOUNCE.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def _entries(path: Path) -> Iterator[Tuple[str, List[str]]]:
    """(headword, body paragraphs) per dictd entry: a headword line at column 0, the body indented."""
    title, paras, cur = None, [], []
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line and not line[0].isspace():
                if title is not None and cur == [] and not paras:
                    continue                # an alias line right after the headword
                if title is not None:
                    if cur:
                        paras.append(" ".join(cur))
                    yield title, paras
                title, paras, cur = line.strip(), [], []
            elif line.strip():
                cur.append(line.strip())
            elif cur:
                paras.append(" ".join(cur))
                cur = []
    if title is not None:
        if cur:
            paras.append(" ".join(cur))
        yield title, paras


def load_foldoc(path: Path = FOLDOC, *, min_words: int = 25, max_words: int = 60) -> List[Passage]:
    """FOLDOC entries as passages of ``min_words``-``max_words`` words (whole sentences), sorted by
    title. Entries that are only a cross-reference, dictionary front matter or too short are
    dropped. Raises :class:`TrainingTextError` naming the Debian package when it is not installed,
    and when the file holds no usable entry."""
    if not Path(path).is_file():
        raise TrainingTextError(f"the training text {path} is missing" + (
            f": install Debian's {FOLDOC_PACKAGE} package (apt-get install {FOLDOC_PACKAGE})"
            if Path(path) == FOLDOC else ""))
    try:
        entries = list(_entries(Path(path)))
    except (OSError, EOFError, UnicodeError) as exc:     # gzip.BadGzipFile is an OSError
        raise TrainingTextError(f"{path} is not a gzipped dictd file ({exc})") from None
    out, seen = [], set()
    for title, paras in entries:
        if title.startswith("00-") or title.lower() in seen:
            continue
        body = [_clean(p) for p in paras if not _DATE.match(p.strip())]
        text = ""
        for sentence in _SENTENCE.split(" ".join(p for p in body if p)):
            if len((text + " " + sentence).split()) > max_words:
                break
            text = (text + " " + sentence).strip()
        if not paras or paras[0].startswith("<introduction>") or len(text.split()) < min_words:
            continue
        seen.add(title.lower())
        out.append(Passage(id=f"foldoc-{len(out):05d}", title=title, text=text))
    if not out:
        raise TrainingTextError(f"{path}: no entry of at least {min_words} words (is it a dictd file?)")
    return sorted(out, key=lambda p: p.title.lower())


def split_passages(passages: Sequence[Passage], held_fraction: float = 0.02
                   ) -> Tuple[List[Passage], List[Passage]]:
    """(train, held): a fixed split by a hash of each title (independent of order and of the
    file's other entries), for the training run's own held-out loss."""
    def held(p):
        return int(hashlib.sha256(p.title.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < held_fraction
    return [p for p in passages if not held(p)], [p for p in passages if held(p)]


_ONE = ("What is {a}?", "What does {a} refer to?", "Briefly, what is {a} used for?",
        "Which document describes {a}, and what does it say?", "Explain {a} in one sentence.")
_TWO = ("How are {a} and {b} related?", "What do {a} and {b} have in common?",
        "Which is older, {a} or {b}?", "What is the difference between {a} and {b}?")


@dataclasses.dataclass(frozen=True)
class RagExample:
    passages: Tuple[Passage, ...]   # in prompt order, the gold ones among them
    question: str


def rag_examples(passages: Sequence[Passage], rng: random.Random, top_k: Tuple[int, int] = (4, 17),
                 two_hop: float = 0.3) -> Iterator[RagExample]:
    """Endless RAG examples: ``k`` passages drawn uniformly from ``[top_k[0], top_k[1])`` (one or two
    gold ones, the rest random distractors) in random order, and a templated question about the
    gold passage(s) (two with probability ``two_hop``)."""
    lo, hi = top_k
    if not 1 <= lo < hi or hi - 1 > len(passages):
        raise ValueError(f"rag_examples: top_k must be 1 <= lo < hi <= {len(passages) + 1}, got {top_k}")
    while True:
        k = rng.randrange(lo, hi)
        chosen = rng.sample(list(passages), k)
        if k >= 2 and rng.random() < two_hop:
            a, b = chosen[0].title, chosen[1].title
            question = rng.choice(_TWO).format(a=a, b=b)
        else:
            question = rng.choice(_ONE).format(a=chosen[0].title)
        rng.shuffle(chosen)
        yield RagExample(tuple(chosen), question)
