"""The prompt layout every method shares: ``head + chunk_1 + ... + chunk_k + tail``, where
``head``/``tail`` come from the tokenizer's chat template around "Documents: ... Question:
{question}"; the head is cached like a chunk (its own block at position 0), the tail (question +
assistant header) is the final block."""
from __future__ import annotations

from typing import Sequence

SYSTEM = "Answer the question using only the documents. Answer briefly."
_SENTINEL = "\u2063RAGATTN_DOCS\u2063"


def prompt_parts(tokenizer, chunks: Sequence, question: str):
    """(head_ids, [chunk_ids...], tail_ids): lists of int token ids of the three prompt parts."""
    def ids(x):
        if isinstance(x, str):
            return tokenizer(x, add_special_tokens=False)["input_ids"]
        return [int(t) for t in x]

    user = f"Documents:\n{_SENTINEL}\nQuestion: {question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            tokenize=False, add_generation_prompt=True)
    else:
        text = f"{SYSTEM}\n\n{user}\nAnswer:"
    head, tail = text.split(_SENTINEL)
    return ids(head), [ids(c) for c in chunks], ids(tail)
