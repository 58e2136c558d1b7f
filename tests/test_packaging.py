"""A fresh install gets everything raytrain imports: every third-party module imported anywhere in the package is
a declared dependency (a module present only on a development machine, e.g. a stray `cloudpickle`, fails here)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
# Distribution name -> the top-level module it installs, where the two differ.
MODULE_OF = {"ray[train,default]": "ray", "pyyaml": "yaml"}


def _declared_modules() -> set[str]:
    """Top-level modules of the dependencies and of the optional extras (imported only where guarded), not of
    the test extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = [r for name, group in project["optional-dependencies"].items() if name != "test" for r in group]
    names = set()
    for requirement in [*project["dependencies"], *extras]:
        name = re.split(r"[<>=!~;\s]", requirement, maxsplit=1)[0]
        names.add(MODULE_OF.get(name, name.split("[")[0]).replace("-", "_"))
    return names


def _imported_top_level_modules() -> dict[str, str]:
    """module -> a file importing it, over every module of the package (imports inside functions too)."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "raytrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_a_declared_dependency() -> None:
    declared = _declared_modules()
    assert {"torch", "ray", "numpy", "pyarrow"} <= declared, declared
    undeclared = {
        module: where
        for module, where in _imported_top_level_modules().items()
        if module not in declared and module not in sys.stdlib_module_names and module != "raytrain"
    }
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"


def test_the_top_level_names_the_docs_use_import_and_import_raytrain_stays_light() -> None:
    """`raytrain.ParquetSource`, `raytrain.attach`, `raytrain.export` and `raytrain.load_model`, as README,
    docstrings and error messages write them, are the real ones; `import raytrain` alone loads neither torch nor
    Ray (a CLI start or a config check pays for
    them only when it needs them)."""
    import subprocess

    code = (
        "import sys, raytrain\n"
        "heavy = {'torch', 'ray', 'pyarrow'} & set(sys.modules)\n"
        "assert not heavy, sorted(heavy)\n"
        "from raytrain import ParquetSource, attach\n"
        "from raytrain.data.parquet import ParquetSource as Source\n"
        "from raytrain.session import attach as attach_fn\n"
        "assert ParquetSource is Source and attach is attach_fn\n"
        "assert sorted(raytrain.__all__) == ['ParquetSource', 'attach', 'export', 'load_model']\n"
        "from raytrain import export, load_model\n"
        "import raytrain.model_export as module\n"
        "assert export is module.export and load_model is module.load_model\n"
        "try:\n"
        "    raytrain.Nope\n"
        "except AttributeError as err:\n"
        "    assert \"no attribute 'Nope'\" in str(err)\n"
        "else:\n"
        "    raise AssertionError('raytrain.Nope resolved')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
