"""The kernel layer knows nothing of the layers above it (design.md "Layers"; issue 22.8): a file of
``triton_kernels/`` imports the standard library, torch, triton and ``ragattn.triton_kernels``
itself, never ``ragattn.ops``, ``ragattn.hf``, ``ragattn.methods`` or ``ragattn.reference``."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((ROOT / "triton_kernels").rglob("*.py"))


def _imported_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside triton_kernels
                yield "ragattn.triton_kernels." + (node.module or "")
            else:
                yield node.module or ""


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_kernel_files_import_nothing_above_them(path):
    bad = [m for m in _imported_modules(path)
           if (m == "ragattn" or m.startswith("ragattn.")) and not m.startswith("ragattn.triton_kernels")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: a kernel file must not know the op layer"


def test_the_check_sees_an_op_layer_import(tmp_path):
    """The walk finds nested and aliased imports (the test above can fail)."""
    f = tmp_path / "k.py"
    f.write_text("def f():\n    from ragattn.ops._validate import check_tensor\n    import ragattn.hf as h\n")
    assert list(_imported_modules(f)) == ["ragattn.ops._validate", "ragattn.hf"]
