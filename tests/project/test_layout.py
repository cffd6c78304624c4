"""Tests mirror the packages: each test file sits in the folder of what it tests, and each
file in a package's folder imports (or runs) that package, so a reader who looks for a
module's tests finds them beside its folder's (verl's special_sanity/validate_structure
does the same for its tree)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# folder -> the packages its tests exercise (None: any; whole-system and repository tests)
FOLDERS: dict[str, tuple[str, ...] | None] = {
    "core": ("dataplane_server.core",),
    "client": ("dataplane_client", "dataplane_server.core.inprocess"),
    "server": ("dataplane_server",),
    "workers": ("policy_workers",),
    "bench": ("benchmarks",),
    "e2e": None,
    "project": None,
}
# The session's service fixtures stand for the server package (tests/conftest.py; ``dp`` is
# its client and an in-process one in turn).
SERVICE_FIXTURES = {"service", "service_factory", "client", "ray_session", "dp"}


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _fixtures(tree: ast.AST) -> set[str]:
    return {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for arg in node.args.args
    }


def _exercises(path: Path, packages: tuple[str, ...]) -> bool:
    source = path.read_text()
    tree = ast.parse(source)
    if "dataplane_server" in packages and _fixtures(tree) & SERVICE_FIXTURES:
        return True
    # Imported here, or in the code a test runs in a child process (``python -c``).
    code = _imports(tree) | {
        m
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for m in _imports_in_text(node.value)
    }
    return any(m == p or m.startswith(p + ".") for m in code for p in packages)


def _imports_in_text(text: str) -> set[str]:
    """A module's dotted name (``-m benchmarks.run``), or the imports of code run as text."""
    if all(part.isidentifier() for part in text.split(".")):
        return {text}
    try:
        return _imports(ast.parse(textwrap.dedent(text)))
    except (SyntaxError, ValueError):
        return set()


def test_every_test_file_sits_in_a_known_folder():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"test files outside a folder of {sorted(FOLDERS)}: {loose}"
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders <= set(FOLDERS), sorted(folders - set(FOLDERS))
    assert len(list(TESTS.glob("*/test_*.py"))) > 90  # the walk found the tree


def test_each_test_file_exercises_the_package_of_its_folder():
    strays = [
        f"{path.parent.name}/{path.name}"
        for folder, packages in FOLDERS.items()
        if packages is not None
        for path in sorted((TESTS / folder).glob("test_*.py"))
        if not _exercises(path, packages)
    ]
    assert strays == []


def test_the_check_sees_a_stray(tmp_path):
    stray = tmp_path / "test_x.py"
    stray.write_text("from policy_workers.loss import x\n\ndef test_a(): pass\n")
    assert not _exercises(stray, ("dataplane_server.core",))
    assert _exercises(stray, ("policy_workers",))
