"""Which parts of the package may import which, read from the source with ``ast``.

A *unit* is a subpackage (``model``, ``training``, ...) or a top-level module (``config``,
``policy``, ``__init__``, ``__main__``). Every import counts, at module level or inside a function,
absolute (``from elmo_jax.x import y``, ``from elmo_jax import x``, ``import elmo_jax.x``) or relative.
The rules:

- ``model`` imports only ``config``, ``policy`` and ``_util``;
- ``compat`` and ``text`` import only ``model``, ``config``, ``policy`` and ``_util``;
- ``_util`` imports nothing of the package;
- no module imports ``cli`` but ``cli`` itself and ``__main__``, and none imports the repository's
  ``benchmarks/`` or ``experiments/`` (by package name or by script name);
- only ``modules`` (the Flax modules) imports Flax: the model, training and extraction are plain
  jax over parameter pytrees;
- no cycles between units.

``python tests/test_layout.py`` prints the figures (units, dependencies between them, violations).
"""

from __future__ import annotations

import ast
import pathlib
import sys
import types

import pytest

import elmo_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "elmo_jax"

CORE = {"config", "policy", "_util"}
ALLOWED = {  # unit -> the other units it may import (a unit may always import itself)
    "model": CORE,
    "compat": CORE | {"model"},
    "text": CORE | {"model"},
    "_util": set(),
}
CLI_IMPORTERS = {"cli", "__main__"}
ONLY_IN = {"flax": {"modules"}}  # a third-party package -> the only units that import it
OUTSIDE = ("benchmarks", "experiments")  # repository folders of scripts


def module_names(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package_dir`` (a package's
    ``__init__.py`` is the package's own name)."""
    name = package_dir.name
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The names every import statement in ``path`` imports: modules of the package where they
    are modules, else the package (or subpackage) the name comes from; other top-level names
    as they are written."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def unit_of(module: str, package: str) -> str | None:
    """The unit of a module of ``package`` (None: not the package's)."""
    if module == package:
        return "__init__"
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def check(
    package_dir: pathlib.Path, outside_scripts: set[str] = frozenset()
) -> tuple[set[str], set[tuple[str, str]], list[str]]:
    """(units, dependencies between units, violations) of the package in ``package_dir``.
    ``outside_scripts``: module names of the repository's benchmark and experiment scripts."""
    package = package_dir.name
    modules = module_names(package_dir)
    units = {unit_of(m, package) for m in modules}
    edges, violations = set(), []
    for module, path in modules.items():
        unit = unit_of(module, package)
        for imported in sorted(imports_of(module, path, modules)):
            top = imported.split(".")[0]
            if top in OUTSIDE or top in outside_scripts:
                violations.append(f"{module} imports {imported} (outside the package: {top})")
            if top in ONLY_IN and unit not in ONLY_IN[top]:
                violations.append(f"{module} imports {imported}: only {', '.join(sorted(ONLY_IN[top]))} imports {top}")
            target = unit_of(imported, package)
            if target is None or target == unit:
                continue
            edges.add((unit, target))
            if unit in ALLOWED and target not in ALLOWED[unit]:
                violations.append(
                    f"{module} imports {imported}: {unit} may import only "
                    f"{', '.join(sorted(ALLOWED[unit])) or 'nothing of the package'}"
                )
            if target == "cli" and unit not in CLI_IMPORTERS:
                violations.append(f"{module} imports {imported}: only the command line's own modules import cli")
    violations += [f"import cycle between units: {' -> '.join(c)}" for c in cycles(units, edges)]
    return units, edges, violations


def cycles(units: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan), each sorted."""
    graph = {u: sorted(v for a, v in edges if a == u) for u in units}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(u):
        index[u] = low[u] = len(index)
        stack.append(u)
        on_stack.add(u)
        for v in graph[u]:
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in on_stack:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            component = []
            while True:
                v = stack.pop()
                on_stack.discard(v)
                component.append(v)
                if v == u:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for u in sorted(units):
        if u not in index:
            visit(u)
    return out


def outside_scripts() -> set[str]:
    return {p.stem for d in OUTSIDE for p in (ROOT / d).glob("*.py")}


def report() -> str:
    units, edges, violations = check(PACKAGE, outside_scripts())
    return "\n".join(
        [
            f"elmo_jax: {len(units)} units, {len(edges)} dependencies between them, {len(violations)} violations",
            *violations,
        ]
    )


def test_the_package_keeps_its_import_rules():
    units, edges, violations = check(PACKAGE, outside_scripts())
    print(report())
    assert {"model", "compat", "text", "training", "extract", "modules", "pretrained", "cli", "_util"} <= units
    assert not violations, "\n".join(violations)


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_forbidden_imports_and_cycles(tmp_path):
    """The negative control: a small package that breaks each rule once, written to tmp_path."""
    pkg = _write(
        tmp_path / "fakepkg",
        {
            "__init__.py": "",
            "config.py": "",
            "model/__init__.py": "",
            "model/lstm.py": "import numpy\nfrom fakepkg import config\n",
            "model/bilm.py": "def f():\n    from fakepkg.training import step  # inside a function\n",
            "compat/__init__.py": "",
            "compat/hdf5.py": "from ..extract import embedder\n",  # relative
            "text/__init__.py": "",
            "text/vocab.py": "import fakepkg.training.step\n",
            "training/__init__.py": "",
            "training/step.py": "from fakepkg.text import vocab\nimport harness\nfrom flax import struct\n",
            "extract/__init__.py": "",
            "extract/embedder.py": "from fakepkg.cli import main\n",
            "cli/__init__.py": "from fakepkg.cli.commands import main\n",
            "cli/commands.py": "from fakepkg.extract import embedder\n",
            "__main__.py": "from fakepkg.cli import main\n",
        },
    )
    units, edges, violations = check(pkg, {"harness"})
    assert units == {"__init__", "__main__", "config", "model", "compat", "text", "training", "extract", "cli"}
    assert ("model", "config") in edges and ("compat", "extract") in edges and ("__main__", "cli") in edges
    text = "\n".join(violations)
    assert "fakepkg.model.bilm imports fakepkg.training.step: model may import only" in text
    assert "fakepkg.compat.hdf5 imports fakepkg.extract.embedder: compat may import only" in text
    assert "fakepkg.text.vocab imports fakepkg.training.step: text may import only" in text
    assert "fakepkg.extract.embedder imports fakepkg.cli: only the command line's own modules import cli" in text
    assert "fakepkg.training.step imports harness (outside the package: harness)" in text
    assert "fakepkg.training.step imports flax: only modules imports flax" in text
    assert "import cycle between units: text -> training" in text
    assert "import cycle between units: cli -> extract" in text
    assert len(violations) == 8, text  # nothing else: lstm's and __main__'s imports are allowed


def test_a_clean_package_has_no_violations(tmp_path):
    pkg = _write(
        tmp_path / "cleanpkg",
        {
            "__init__.py": "from cleanpkg.model.lstm import run\n",
            "model/__init__.py": "",
            "model/lstm.py": "from . import bilm\nfrom .. import config\n",
            "model/bilm.py": "",
            "config.py": "",
        },
    )
    units, edges, violations = check(pkg)
    assert units == {"__init__", "model", "config"} and edges == {("__init__", "model"), ("model", "config")}
    assert violations == []


# What ``import elmo_jax`` offers, exactly: a name added to or dropped from the public API is a change here too.
PUBLIC = [
    "CharCNNConfig",
    "Compute",
    "ConfigError",
    "DataError",
    "Elmo",
    "ElmoNNX",
    "EmbedFileOptions",
    "EmbedFileResult",
    "Embedder",
    "ExportResult",
    "FROZEN_COLLECTION",
    "LSTMConfig",
    "Lines",
    "ModelConfig",
    "Options",
    "PRESETS",
    "RunSettings",
    "ScalarMix",
    "ShardedEmbeddings",
    "Stopped",
    "TextFiles",
    "TrainConfig",
    "VocabError",
    "Vocabulary",
    "WeightsError",
    "add_sentence_markers",
    "batch_to_ids",
    "bilm_apply",
    "build_vocab",
    "count_tokens",
    "embed_file",
    "enable_compile_cache",
    "evaluate",
    "export_run",
    "fetch",
    "init_bilm",
    "list_models",
    "load_hdf5",
    "load_pretrained",
    "load_run",
    "open_source",
    "options_for_vocab",
    "preset",
    "pretrain",
    "save_hdf5",
    "scalar_mix",
    "set_gpu_kernels",
    "token_to_ids",
    "tokenize",
    "tokenize_text",
    "with_bilm",
    "write_vocab",
]


def test_import_elmo_jax_exposes_exactly_the_public_names():
    assert sorted(elmo_jax.__all__) == sorted(PUBLIC) and len(elmo_jax.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(elmo_jax, name) is not None, name
    # Besides its subpackages and modules, dir() shows no other public name.
    shown = {
        n for n in dir(elmo_jax) if not n.startswith("_") and not isinstance(getattr(elmo_jax, n), types.ModuleType)
    }
    assert shown == set(PUBLIC)


if __name__ == "__main__":
    print(report())
    sys.exit(pytest.main([__file__, "-q"]) if "--test" in sys.argv else 0)


def _long_functions(source: str, limit: int = 60) -> list[str]:
    """Functions of ``source`` whose body is over ``limit`` lines and whose docstring gives no
    "Long because" reason. The body is counted from its first statement after the docstring: the
    formatter writes a long signature one parameter a line, which is no length to read."""
    import ast

    def body_lines(n) -> int:
        body = n.body[1:] if ast.get_docstring(n) is not None and len(n.body) > 1 else n.body
        return n.end_lineno - body[0].lineno + 1

    return [
        n.name
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and body_lines(n) > limit
        and "Long because" not in (ast.get_docstring(n) or "")
    ]


def test_no_library_function_is_over_60_lines_without_a_reason():
    long = {
        str(p.relative_to(PACKAGE.parent)): names
        for p in sorted(PACKAGE.rglob("*.py"))
        if (names := _long_functions(p.read_text()))
    }
    assert long == {}
    # Negative control: a long function is seen, and a stated reason lets it pass.
    body = "".join(f"    x{i} = {i}\n" for i in range(70))
    assert _long_functions(f"def f():\n{body}") == ["f"]
    assert _long_functions(f'def f():\n    """Long because: a table."""\n{body}') == []
