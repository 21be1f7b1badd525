"""Instructions per basic block of one PTX entry, by opcode (``python bench/sm90/ptx_blocks.py FILE.ptx ENTRY``).

Register moves of constants and parameters, ``cvta`` and reading ``%tid`` are not counted (ptxas folds them
into operands). Used with bench/sm90/verify_draft_count.cu to count verify_draft's per-token cost: the hot
path is the sum of the blocks a common chunk runs through (docs/perf/h100.md names them)."""
import re
import sys
from collections import Counter

FREE = re.compile(r"^(mov\.(f32|b32)\s+%\w+, (0f|%r|%f)|ld\.param|cvta|mov\.u32\s+%r\d+, %tid)")


def blocks(ptx: str, entry: str):
    """[(label, [instruction, ...])] of ``entry`` in PTX text, in order."""
    body = ptx[ptx.index(f".entry {entry}("):]
    body = body[:body.index("\n}")]
    out, cur, name = [], [], "entry"
    for line in (raw.strip() for raw in body.splitlines()):
        m = re.match(r"^(\$L__BB\w+):", line)
        if m:
            out.append((name, cur))
            name, cur = m.group(1), []
        elif line and not line.startswith(("//", ".", "{", "}", ")")) and not FREE.match(line):
            cur.append(line)
    out.append((name, cur))
    return out


def opcode(instruction: str) -> str:
    words = instruction.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0].rstrip(";")


if __name__ == "__main__":
    for label, ins in blocks(open(sys.argv[1]).read(), sys.argv[2]):
        print(label, len(ins), dict(sorted(Counter(opcode(i) for i in ins).items())))
