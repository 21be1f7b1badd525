"""The layers point one way (design.md "Parts"):

* the kernel layer knows nothing above it: a file of ``triton_kernels/`` imports the standard
  library, torch, triton and ``ragattn.triton_kernels`` itself, never ``ragattn.ops``,
  ``ragattn.hf``, ``ragattn.methods`` or ``ragattn.reference``;
* ``ragattn.ops`` is the one way to the kernels and the one place an op's backend is chosen: no
  other module of the library imports ``ragattn.triton_kernels``, a private part of ``ragattn.ops``
  (a ``_`` module or name), calls a private op (``torch.ops.ragattn._*``) or reads
  ``ragattn._extension`` (``cpu_backend()``); no C++ op calls back into an op through the
  dispatcher (``csrc/``);
* the request KV layer ``ragattn.kv`` is engine-neutral: it imports ``ragattn.ops`` and
  ``ragattn.reference``, never ``ragattn.hf``, ``ragattn.methods``, a store, ``ragattn.vllm``, an
  app, or transformers/vllm themselves.

(``bench/`` and ``tests/`` measure and check the kernels directly and are outside these rules.)"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_FILES = sorted((ROOT / "triton_kernels").rglob("*.py"))


LIBRARY = ROOT / "ragattn"
# ragattn/__init__.py loads the extension (the schemas) first; _extension is that loader itself
OUTSIDE_OPS = sorted(p for p in LIBRARY.rglob("*.py")
                     if not p.is_relative_to(LIBRARY / "ops") and p.name != "_extension.py"
                     and p != LIBRARY / "__init__.py")
KV_FILES = sorted((LIBRARY / "kv").rglob("*.py"))


def _imported_modules(path: pathlib.Path, names: bool = False):
    """The modules ``path`` imports (relative imports: as ``ragattn.triton_kernels.*``, the only
    package using them); ``names=True``: ``module.name`` for each ``from module import name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "ragattn.triton_kernels." + (node.module or "") if node.level else node.module or ""
            yield module
            if names:
                yield from (f"{module}.{alias.name}" for alias in node.names)


def _private_op_calls(path: pathlib.Path):
    """``torch.ops.ragattn._name`` attribute chains in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and ast.unparse(node.value) == "torch.ops.ragattn":
            yield ast.unparse(node)


def _layering_errors(path: pathlib.Path) -> list:
    """What ``path`` (a library module outside ``ragattn.ops``) may not do: reach the kernels, a
    private part of the op layer or the backend switch other than through ``ragattn.ops``."""
    bad = []
    for m in _imported_modules(path, names=True):
        parts = m.split(".")
        if m.startswith("ragattn.triton_kernels") or m == "ragattn._extension" or m.startswith("ragattn._extension."):
            bad.append(m)
        elif parts[:2] == ["ragattn", "ops"] and any(p.startswith("_") for p in parts[2:]):
            bad.append(m)
    return bad + list(_private_op_calls(path))


def _kv_errors(path: pathlib.Path) -> list:
    banned = ("ragattn.hf", "ragattn.methods", "ragattn.store", "ragattn.vllm", "ragattn.apps", "ragattn.cli",
              "ragattn.demo", "ragattn.eval", "ragattn.finetune", "ragattn.build_store", "ragattn.long_qa",
              "ragattn.corpus", "ragattn.bench", "bench", "transformers", "vllm")
    return [m for m in _imported_modules(path) if any(m == b or m.startswith(b + ".") for b in banned)]


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


@pytest.mark.parametrize("path", OUTSIDE_OPS, ids=[str(p.relative_to(LIBRARY)) for p in OUTSIDE_OPS])
def test_only_the_op_layer_reaches_the_kernels(path):
    bad = _layering_errors(path)
    assert not bad, (f"{path.relative_to(ROOT)} uses {bad}: kernels, private ops and the backend choice are "
                     "ragattn.ops' own (call the public ops, PageTable, plan/run or ops.PagedAttentionStep)")


@pytest.mark.parametrize("path", KV_FILES, ids=[p.name for p in KV_FILES])
def test_the_request_kv_layer_is_engine_neutral(path):
    bad = _kv_errors(path)
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: ragattn.kv sits below every engine and the store"


def _cpp_backend_choices(root: pathlib.Path) -> list:
    banned = ("findSchema", "Dispatcher::singleton", "RAGATTN_CPU_BACKEND")
    return [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*")) if p.is_file()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if any(b in line.split("//")[0] for b in banned)]


def test_no_cpp_op_chooses_a_backend():
    """An op's C++ kernel runs what it was given: the backend is chosen in ragattn/ops, never by a
    C++ op reading RAGATTN_CPU_BACKEND or looking up another op (e.g. a Python one) by schema."""
    offenders = _cpp_backend_choices(ROOT / "csrc")
    assert not offenders, offenders


def test_the_layering_checks_see_a_broken_rule(tmp_path):
    """Each rule above fails on a module that breaks it (seen failing once)."""
    f = tmp_path / "m.py"
    f.write_text("import torch\nfrom ragattn import _extension\nfrom ragattn.ops.paged_attention_run import "
                 "_rope_table, PagedAttentionStep\nimport ragattn.triton_kernels.paged_attention as pa\n"
                 "def g(q):\n    return torch.ops.ragattn._paged_attention_tagged_cpu(q)\n")
    assert _layering_errors(f) == ["ragattn._extension", "ragattn.ops.paged_attention_run._rope_table",
                                   "ragattn.triton_kernels.paged_attention",
                                   "torch.ops.ragattn._paged_attention_tagged_cpu"]
    k = tmp_path / "kv.py"
    k.write_text("from ragattn.ops import PageTable\nfrom ragattn.hf.rope import rope_params\n"
                 "def f():\n    import transformers\n    from ragattn.methods.baseline import full_prefill\n")
    assert _kv_errors(k) == ["ragattn.hf.rope", "transformers", "ragattn.methods.baseline"]
    c = tmp_path / "csrc"
    c.mkdir()
    (c / "op.cpp").write_text('// RAGATTN_CPU_BACKEND in a comment is fine\nconst char* e = std::getenv("RAGATTN_CPU_BACKEND");\n')
    assert _cpp_backend_choices(c) == ["op.cpp:2"]


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
# request KV layer's: the store imports them from ragattn.kv.


def _import_targets(path: pathlib.Path, package: str):
    """Every dotted module or ``module.name`` an import of ``path`` (a module of ``package``) reaches
    (``from ragattn import apps`` reaches ``ragattn.apps``; relative imports are resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module
            for alias in node.names:
                yield f"{module}.{alias.name}"


def _module_package(path: pathlib.Path) -> str:
    """The package a file's relative imports start from (``ragattn/store/model.py`` -> ``ragattn.store``)."""
    return ".".join(path.relative_to(ROOT).parts[:-1])


def _reaches(target: str, part: str) -> bool:
    return target == part or target.startswith(part + ".")


def _store_violations(path: pathlib.Path):
    return sorted({t for t in _import_targets(path, _module_package(path))
                   if any(_reaches(t, p) for p in STORE_MAY_NOT_IMPORT)})


def _app_imports(path: pathlib.Path):
    return sorted({t for t in _import_targets(path, _module_package(path)) if _reaches(t, "ragattn.apps")})


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
    """The walks see nested, relative and ``from ragattn import`` forms (the tests above can fail)."""
    src = ("def f():\n    from ragattn.hf.rope import rope_params\n    from ragattn.hf.attention import QueryCaptured\n"
           "    from ..hf.cache import PagedCache\n    from .. import apps\n    import ragattn.methods.prompt\n")
    tree_file = tmp_path / "m.py"
    tree_file.write_text(src)
    targets = set(_import_targets(tree_file, "ragattn.store"))
    assert "ragattn.hf.rope.rope_params" in targets and "ragattn.apps" in targets
    assert "ragattn.methods.prompt" in targets
    assert {"ragattn.hf.attention.QueryCaptured", "ragattn.hf.cache.PagedCache"} <= targets
    assert _module_package(PKG / "store" / "model.py") == "ragattn.store"
    assert sorted({t for t in targets if any(_reaches(t, p) for p in STORE_MAY_NOT_IMPORT)}) == [
        "ragattn.apps", "ragattn.hf.attention", "ragattn.hf.attention.QueryCaptured", "ragattn.hf.cache",
        "ragattn.hf.cache.PagedCache", "ragattn.hf.rope", "ragattn.hf.rope.rope_params", "ragattn.methods.prompt"]
