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


# ---------------------------------------------------------------- the store and the apps
# The chunk store (ragattn/store) sits below the model patches, the methods, the engines and the apps:
# it takes a model description (ragattn.store.ChunkModel), never an HF model's code. No library module
# imports an app (ragattn/apps: the command lines; ragattn/__main__.py dispatches to them).

PKG = ROOT / "ragattn"
STORE_FILES = sorted((PKG / "store").rglob("*.py"))
LIBRARY_FILES = sorted(p for p in PKG.rglob("*.py")
                       if PKG / "apps" not in p.parents and p != PKG / "__main__.py")
STORE_MAY_NOT_IMPORT = ("ragattn.hf", "ragattn.methods", "ragattn.apps", "ragattn.vllm", "ragattn.bench")
# The request caches the store fills (the copy path's PagedKV, the zero-copy TaggedPagedKV) are the
# request KV layer's; they live in ragattn.hf until that layer has a package of its own, and these two
# names are the only ones the store may take from there.
STORE_PENDING_KV = {("ragattn.hf.attention", "PagedKV"), ("ragattn.hf.tagged", "TaggedPagedKV")}


def _import_targets(path: pathlib.Path, package: str):
    """``(target, allowed_pending)`` for every import of ``path`` (a module of ``package``): the dotted
    module or ``module.name`` it reaches (``from ragattn import apps`` reaches ``ragattn.apps``;
    relative imports are resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, False
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            pending = all((module, a.name) in STORE_PENDING_KV for a in node.names)
            yield module, pending
            for alias in node.names:
                yield f"{module}.{alias.name}", pending


def _module_package(path: pathlib.Path) -> str:
    """The package a file's relative imports start from (``ragattn/store/model.py`` -> ``ragattn.store``)."""
    return ".".join(path.relative_to(ROOT).parts[:-1])


def _reaches(target: str, part: str) -> bool:
    return target == part or target.startswith(part + ".")


def _store_violations(path: pathlib.Path):
    return sorted({t for t, pending in _import_targets(path, _module_package(path))
                   if not pending and any(_reaches(t, p) for p in STORE_MAY_NOT_IMPORT)})


def _app_imports(path: pathlib.Path):
    return sorted({t for t, _ in _import_targets(path, _module_package(path)) if _reaches(t, "ragattn.apps")})


@pytest.mark.parametrize("path", STORE_FILES, ids=[p.name for p in STORE_FILES])
def test_store_imports_no_model_patch_method_engine_or_app(path):
    bad = _store_violations(path)
    assert not bad, (f"{path.relative_to(ROOT)} imports {bad}: the chunk store takes a model description "
                     "(ragattn.store.ChunkModel) and knows nothing above it")


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=[str(p.relative_to(PKG)) for p in LIBRARY_FILES])
def test_no_library_module_imports_an_app(path):
    bad = _app_imports(path)
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library never imports ragattn.apps"


def test_the_store_and_app_checks_see_what_they_forbid(tmp_path):
    """The walks see nested, relative and ``from ragattn import`` forms (the tests above can fail),
    and the two pending request caches are the only names let through."""
    src = ("def f():\n    from ragattn.hf.rope import rope_params\n    from ragattn.hf.attention import PagedKV\n"
           "    from ..hf.tagged import TaggedPagedKV\n    from .. import apps\n    import ragattn.methods.prompt\n")
    tree_file = tmp_path / "m.py"
    tree_file.write_text(src)
    targets = {t for t, pending in _import_targets(tree_file, "ragattn.store") if not pending}
    assert "ragattn.hf.rope.rope_params" in targets and "ragattn.apps" in targets
    assert "ragattn.methods.prompt" in targets
    assert not any(t.startswith(("ragattn.hf.attention", "ragattn.hf.tagged")) for t in targets)
    assert _module_package(PKG / "store" / "model.py") == "ragattn.store"
    bad = sorted({t for t, pending in _import_targets(tree_file, "ragattn.store")
                  if not pending and any(_reaches(t, p) for p in STORE_MAY_NOT_IMPORT)})
    assert bad == ["ragattn.apps", "ragattn.hf.rope", "ragattn.hf.rope.rope_params", "ragattn.methods.prompt"]
