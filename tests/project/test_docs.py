"""The repository's documents stand on their own in a clone.

They point only at files inside the repository (no ``../`` reaching a sibling
checkout that a clone lacks), every relative markdown link names a file that
exists, and ``tests/README.md`` gives every test file a row.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
# Folders that hold no documentation of ours: tools' caches, environments, build output.
NOT_OURS = {"build", "dist", "node_modules", "__pycache__"}

# An inline link or image, "[text](target)" or "[text](target "title")", and a reference
# definition, "[name]: target".
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCED_BLOCK = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# A path that climbs out of the folder it is written in: "../x", "../../x/y.md".
PARENT_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[^\s`'\")\]>]*)")
# A table row's first cell: "| `test_a.py` | ..." or "| `test_a.py`, `test_b.py` | ...".
FIRST_CELL = re.compile(r"^\|([^|\n]*)\|", re.MULTILINE)
TEST_FILE_NAME = re.compile(r"`(\w+/test_\w+\.py)`")  # its folder under tests/, then its name


def _markdown_files() -> list[Path]:
    found = [
        path
        for path in ROOT.rglob("*.md")
        if not any(
            part.startswith(".") or part.endswith(".egg-info") or part in NOT_OURS
            for part in path.relative_to(ROOT).parts[:-1]
        )
    ]
    return sorted(found)


def _inside_the_repo(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def _links(text: str) -> list[str]:
    """The targets of the markdown links in ``text`` (code blocks and spans are not links)."""
    prose = INLINE_CODE.sub("", FENCED_BLOCK.sub("", text))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def _is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][\w+.-]*:|^#|^/", target)  # not a URL, an anchor, absolute


def test_the_documents_checked_here_include_the_known_ones():
    # A broken walk (say, one that skipped every folder) would let every test below pass.
    names = {path.relative_to(ROOT).as_posix() for path in _markdown_files()}
    assert {"README.md", "RELIABILITY.md", "tests/README.md", "deploy/README.md"} <= names


def test_no_document_points_outside_the_repo():
    # A "../" path must land on a file of this repository, read from the document's own
    # folder: "../shared/DESIGN.md" in README.md named a sibling checkout's file.
    outside = [
        f"{doc.relative_to(ROOT)}: {ref}"
        for doc in _markdown_files()
        for ref in PARENT_PATH.findall(doc.read_text())
        if not (_inside_the_repo(doc.parent / ref) and (doc.parent / ref).exists())
    ]
    assert outside == [], "documents point at files a clone does not have"


def test_every_relative_link_names_a_file_in_the_repo():
    broken = []
    for doc in _markdown_files():
        for target in _links(doc.read_text()):
            path = target.split("#")[0]
            if not path or not _is_relative(target):
                continue
            resolved = doc.parent / path
            if not (_inside_the_repo(resolved) and resolved.exists()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == [], "links to files that do not exist (or lie outside the repo)"


def test_link_finder_sees_links_and_not_code():
    text = (
        "See [the notes](docs/architecture.md#state) and ![a figure](fig.png 'x').\n"
        '[ref]: deploy/README.md "deploy"\n'
        "`x[0](y)` is code, and so is\n```\nf[i](j)\n```\n"
    )
    assert sorted(_links(text)) == ["deploy/README.md", "docs/architecture.md#state", "fig.png"]
    assert PARENT_PATH.findall("in `../shared/DESIGN.md`, see ../../x.md and [y](../y)") == [
        "../shared/DESIGN.md",
        "../../x.md",
        "../y",
    ]


def test_package_metadata_points_only_inside_the_repo():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = ROOT / project["readme"]
    assert _inside_the_repo(readme), project["readme"]
    assert readme.is_file(), project["readme"]
    assert "../" not in project["description"]
    for url in project.get("urls", {}).values():
        assert "../" not in url, url


def test_tests_readme_has_a_row_for_every_test_file_and_no_other():
    # Every test file says in one line what it checks; a new file without a row fails here.
    text = (ROOT / "tests/README.md").read_text()
    rows = [name for cell in FIRST_CELL.findall(text) for name in TEST_FILE_NAME.findall(cell)]
    assert len(rows) > 50, "tests/README.md's table of test files went missing"
    tests = ROOT / "tests"
    files = {path.relative_to(tests).as_posix() for path in tests.glob("*/test_*.py")}
    assert sorted(files - set(rows)) == [], "test files without a row in tests/README.md"
    assert sorted(set(rows) - files) == [], "rows in tests/README.md for files that do not exist"
    assert len(rows) == len(set(rows)), "a test file is listed twice"


def _declared_floors() -> dict[str, str]:
    """``name -> minimum`` of every dependency pyproject.toml declares (any extra too)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    specs += [s for extra in project["optional-dependencies"].values() for s in extra]
    floors = {}
    for spec in specs:
        found = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", spec)
        if found and found.group(1) != "rl-dataplane":
            floors[found.group(1).lower()] = found.group(2)
    floors["python"] = project["requires-python"].removeprefix(">=")
    return floors


def _version_statements(text: str, names: set[str]) -> list[tuple[str, str]]:
    """``(name, version)`` of each "name>=version" (or "name >= version", "Python 3.10+")."""
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    pins = re.compile(rf"(?<![\w-])({alternatives})(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*\d)", re.I)
    found = [(n.lower(), v) for n, v in pins.findall(text)]
    found += [("python", v) for v in re.findall(r"\bPython (\d\.\d+)\+", text)]
    return found


def test_every_version_a_document_states_is_the_floor_pyproject_declares():
    # deploy/runtime_env.yaml once asked for grpcio>=1.85 while the package floor was 1.62.3.
    floors = _declared_floors()
    assert {"grpcio", "protobuf", "torch", "python"} <= set(floors)
    documents = _markdown_files() + sorted((ROOT / "deploy").glob("*.yaml"))
    stated = {
        (doc.relative_to(ROOT).as_posix(), name, version)
        for doc in documents
        for name, version in _version_statements(doc.read_text(), set(floors))
    }
    assert any(doc == "deploy/runtime_env.yaml" for doc, _, _ in stated)  # the finder sees it
    wrong = sorted(
        f"{doc}: {name}>={version} (pyproject: {floors[name]})"
        for doc, name, version in stated
        if version != floors[name]
    )
    assert wrong == [], "documents state versions pyproject.toml does not declare"


def test_version_finder_sees_each_way_of_writing_a_floor():
    text = "pip: grpcio>=1.85, `protobuf >= 4.21.6`, ray[default]>=2.40; Python 3.10+; x-grpcio>=9"
    assert _version_statements(text, {"grpcio", "protobuf", "ray"}) == [
        ("grpcio", "1.85"),
        ("protobuf", "4.21.6"),
        ("ray", "2.40"),
        ("python", "3.10"),
    ]
