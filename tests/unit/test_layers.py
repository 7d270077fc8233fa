"""The layering of STYLE.md, held by the test suite: which package may import which.

The checker reads the source (``ast``), runs nothing, and reports every import that breaks a rule:

1. ``asteria_server`` never imports torch or ``asteria_client`` (the daemon runs without torch);
2. ``asteria_client/optim`` (the math) imports neither ``asteria_client.transport`` nor a
   submodule of ``asteria_client.runtime``, only the runtime package's public names; imports
   under ``if TYPE_CHECKING:`` are ignored here (annotations only);
3. in ``asteria_client`` only the embedded source (``runtime/embedded.py``) imports
   ``asteria_server.engine``: everyone else goes through it, so that the engine and SciPy load
   only when an embedded engine is used;
4. ``asteria_server/protocol`` (the wire) never imports ``asteria_server.engine``.

Each rule is first shown to catch a violation in a small synthetic tree, so that a clean real
tree means something.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asteria_server", "asteria_client")
EMBEDDED = "asteria_client.runtime.embedded"


@dataclass(frozen=True)
class Import:
    """``module`` (the importer, at ``line``) imports ``name``, a module or a module's attribute."""

    module: str
    name: str
    line: int
    type_checking: bool


@dataclass(frozen=True)
class Violation:
    rule: int
    module: str
    name: str
    line: int

    def __str__(self) -> str:
        return f"rule {self.rule}: {self.module} (line {self.line}) imports {self.name}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _walk(node: ast.AST, type_checking: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below ``node``, and whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
            continue
        yield child, type_checking
        yield from _walk(child, type_checking)


def imports_of(root: Path, package: str) -> list[Import]:
    """Every import in ``root/package`` (generated code left out), relative ones resolved.
    ``from a import b`` yields ``a``, and ``a.b`` too when ``b`` is a module of ``a``."""
    found: list[Import] = []
    for path in sorted((root / package).rglob("*.py")):
        if "generated" in path.relative_to(root).parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        module = ".".join(parts)
        here = parts if is_package else parts[:-1]  # the package a relative import starts from
        tree = ast.parse(path.read_text(), str(path))
        for node, type_checking in _walk(tree, False):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(Import(module, alias.name, line, type_checking))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = here[: len(here) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                found.append(Import(module, base, line, type_checking))
                for alias in node.names:
                    if alias.name != "*" and _is_module(root, f"{base}.{alias.name}"):
                        found.append(Import(module, f"{base}.{alias.name}", line, type_checking))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: Path) -> list[Violation]:
    """Every import in ``root`` that breaks one of the rules of the module docstring."""
    out: list[Violation] = []
    for package in PACKAGES:
        if not (root / package).is_dir():
            continue
        for imp in imports_of(root, package):
            rules = []
            if package == "asteria_server":
                if imp.name.split(".")[0] in ("torch", "asteria_client"):
                    rules.append(1)
                if _under(imp.module, "asteria_server.protocol") and _under(
                    imp.name, "asteria_server.engine"
                ):
                    rules.append(4)
            else:
                if (
                    _under(imp.module, "asteria_client.optim")
                    and not imp.type_checking
                    and (
                        _under(imp.name, "asteria_client.transport")
                        or imp.name.startswith("asteria_client.runtime.")
                    )
                ):
                    rules.append(2)
                if imp.module != EMBEDDED and _under(imp.name, "asteria_server.engine"):
                    rules.append(3)
            out += [Violation(rule, imp.module, imp.name, imp.line) for rule in rules]
    return sorted(set(out), key=str)


# --------------------------------------------------------------------------- the checker works


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def skeleton(tmp_path: Path) -> Path:
    """The packages the rules name, empty, and legal imports of each kind."""
    return _tree(
        tmp_path,
        {
            "asteria_server/__init__.py": "",
            "asteria_server/types.py": "import numpy\n",
            "asteria_server/engine/__init__.py": "from asteria_server.types import *\n",
            "asteria_server/engine/workers.py": "",
            "asteria_server/protocol/__init__.py": "",
            "asteria_server/protocol/convert.py": "from asteria_server import types\n",
            "asteria_client/__init__.py": "from asteria_client.optim import base\n",
            "asteria_client/optim/__init__.py": "",
            "asteria_client/optim/base.py": """\
                from typing import TYPE_CHECKING
                import torch
                from asteria_client.runtime import FreshnessRuntime, Mode
                from asteria_server.protocol import convert
                if TYPE_CHECKING:
                    from asteria_client.runtime.source import Source
                    from asteria_client.transport.daemon import DaemonSource
                """,
            "asteria_client/runtime/__init__.py": "from .source import Source\n",
            "asteria_client/runtime/source.py": "",
            "asteria_client/runtime/embedded.py": """\
                from asteria_server.engine import EngineConfig
                from asteria_server.engine.workers import default_num_workers
                """,
            "asteria_client/transport/__init__.py": "",
            "asteria_client/transport/daemon.py": "from asteria_server.protocol import convert\n",
        },
    )


def test_a_tree_with_only_legal_imports_is_clean(skeleton: Path) -> None:
    assert violations(skeleton) == []


@pytest.mark.parametrize(
    ("rule", "name", "text", "expected"),
    [
        (1, "asteria_server/engine/solver.py", "import torch\n", "torch"),
        (1, "asteria_server/service/x.py", "from asteria_client import SOAP\n", "asteria_client"),
        (1, "asteria_server/types.py", "if True:\n    import torch.nn\n", "torch.nn"),
        (2, "asteria_client/optim/soap.py", "from asteria_client.transport import daemon\n", "*"),
        (2, "asteria_client/optim/soap.py", "import asteria_client.transport.daemon\n", "*"),
        (2, "asteria_client/optim/soap.py", "from ..runtime import source\n", "*"),
        (2, "asteria_client/optim/soap.py", "from asteria_client.runtime.source import X\n", "*"),
        (
            2,
            "asteria_client/optim/soap.py",
            "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    pass\n"
            "else:\n    from asteria_client.runtime.source import X\n",
            "asteria_client.runtime.source",
        ),
        (3, "asteria_client/train/loop.py", "from asteria_server.engine import X\n", "*"),
        (3, "asteria_client/bench/t.py", "from asteria_server.engine.workers import f\n", "*"),
        (3, "asteria_client/runtime/source.py", "from asteria_server import engine\n", "*"),
        (3, "asteria_client/cli/x.py", "def f():\n    import asteria_server.engine.workers\n", "*"),
        (4, "asteria_server/protocol/convert.py", "from asteria_server.engine import X\n", "*"),
        (4, "asteria_server/protocol/shm.py", "from ..engine import workers\n", "*"),
    ],
)
def test_each_rule_reports_a_violation(
    skeleton: Path, rule: int, name: str, text: str, expected: str
) -> None:
    _tree(skeleton, {name: text})
    module = name.removesuffix(".py").replace("/", ".")
    found = [v for v in violations(skeleton) if v.module == module]
    assert found and {v.rule for v in found} == {rule}, found
    if expected != "*":
        assert found[0].name == expected


def test_type_checking_imports_are_exempt_only_from_the_optim_rule(skeleton: Path) -> None:
    _tree(
        skeleton,
        {
            "asteria_client/optim/kl.py": """\
                import typing
                if typing.TYPE_CHECKING:
                    from asteria_client.runtime.source import Source
                    from asteria_server.engine import EngineConfig
                """
        },
    )
    assert [(v.rule, v.name) for v in violations(skeleton)] == [(3, "asteria_server.engine")]


# --------------------------------------------------------------------------- the real tree

REAL_RULES = [
    pytest.param(1, id="server-has-no-torch-or-client"),
    pytest.param(2, id="optim-uses-only-the-runtime-package"),
    pytest.param(3, id="only-embedded-imports-the-engine"),
    pytest.param(4, id="protocol-has-no-engine"),
]


@pytest.mark.parametrize("rule", REAL_RULES)
def test_the_source_tree_keeps_the_rule(rule: int) -> None:
    broken = [str(v) for v in violations(ROOT) if v.rule == rule]
    assert broken == [], "\n".join(broken)


def test_the_checker_sees_the_real_packages() -> None:
    """A walk that found nothing would pass every rule: it must see the imports we know of."""
    names = {(i.module, i.name) for i in imports_of(ROOT, "asteria_client")}
    assert (EMBEDDED, "asteria_server.engine") in names
    assert len({i.module for i in imports_of(ROOT, "asteria_server")}) > 10


def test_importing_the_client_does_not_load_scipy() -> None:
    code = "import sys, asteria_client; print(sorted(m for m in sys.modules if m == 'scipy'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]", "import asteria_client loaded SciPy"
