"""Every module, class, function, attribute and file the documents name in backticks exists.

A document that names code which was renamed or removed sends its reader looking for
something that is not there. Checked: ``README.md``, ``docs/architecture.md`` and
``docs/nemo_rl_contract.md``. Each inline code span outside fenced blocks is read as
one of the forms below; a span that fits none (a command line with options, a value,
an expression, a name of another project's code) is skipped, never guessed at. A
trailing call (``name(...)``) or subscript (``name["key"]``) is cut off first. Nothing
here starts Ray or calls our code: modules are imported, everything else is read from
the packages' syntax trees.

1. **A dotted path from one of our packages** (``dataplane_client.wire.errors``,
   ``dataplane_server.start``): imported, then each remaining part looked up as an
   attribute; an attribute a class only sets on its instances counts (rule 3).
2. **A file or folder path**: a span with a ``/`` or ending in ``.py``, ``.md``,
   ``.proto``, ``.yaml``, ``.yml``, ``.toml``, ``.json`` or ``.sh`` (a folder ends in
   ``/``; ``*`` globs). It names a file of the repository when it exists relative to
   the repository root, or when it is the tail of an existing path (the documents
   write paths relative to the package or folder a sentence is about: ``core/keyspace.py``
   is ``dataplane_server/core/keyspace.py``). After it, ``::test_name`` (a pytest id) or
   ``:name`` must be defined in that file, and ``core/staleness.matching`` (a module
   path, then a name) names ``matching`` in ``core/staleness.py``. Paths outside the
   repository (``/proc/...``) and templates (``DIR/step-<n>``, ``{a,b}``) are skipped.
3. **``Class.attr``**, ``Class`` CamelCase and defined somewhere in our packages: some
   class of that name has ``attr``, as a method, a class-level or annotated field, or an
   attribute its methods set on ``self``, or inherits it (from a class of ours, or from
   a built-in base such as ``Exception``). A class with another base from outside,
   whose attribute is not found, is skipped.
4. **``module.name``**, ``module`` a module of ours named by its last part or parts
   (``publish.publish``, ``unit.partition.UnitPartition.stamp``): ``name`` is defined
   at the module's top level, or is an attribute of a class defined there (a variable
   named after its module, ``meta.extra_info`` for a ``KVBatchMeta``); a class's
   attribute after it as in rule 3.
5. **A bare name** (``WorkerGroup``, ``_in_flight``, ``admit_rollouts(...)``), the
   name in ``name=value`` / ``name: value``, and the first name of a dotted span none
   of the rules above reads (``unit_undo.PublishedWrites``): it occurs in our code or
   our tests, as a definition, a name used, an attribute, a parameter or keyword, an
   imported name, or a string that is exactly that identifier (tags, record kinds,
   metric names), or is a Python built-in or keyword. An ALL_CAPS name may also occur
   in a comment (a kernel constant or an environment variable we mention). A lowercase
   word without ``_`` that is not called (``sequential``, ``mypy``, ``keys.unit_alive``)
   may be prose and is skipped. This only says the name still exists somewhere.
6. **A command**: ``python -m module`` names a module of ours that exists, ``make
   target`` a target of the Makefile, and ``dataplane command`` a subcommand of the CLI
   (a module of ``dataplane_server/cli/``, or an entry point in ``pyproject.toml``).

In fenced ``python`` blocks, every ``import`` of our packages must resolve (rule 1).
"""

from __future__ import annotations

import ast
import builtins
import enum
import fnmatch
import functools
import importlib
import importlib.util
import keyword
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/architecture.md", "docs/nemo_rl_contract.md")
PACKAGES = ("dataplane_client", "dataplane_server", "policy_workers", "benchmarks")
FILE_ENDINGS = (".py", ".md", ".proto", ".yaml", ".yml", ".toml", ".json", ".sh")
# Folders that hold none of the repository's own files.
NOT_OURS = {"build", "dist", "node_modules", "__pycache__", "bench_results"}
# Bases from outside our packages whose attributes are known (None: it adds none we name).
KNOWN_BASES: dict[str, object | None] = {
    "object": None,
    "ABC": None,
    "Generic": None,
    "Protocol": None,
    "NamedTuple": tuple,
    "Enum": enum.Enum,
    "IntEnum": enum.IntEnum,
}

IDENT = r"[A-Za-z_]\w*"
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})*$")
CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
CAMEL = re.compile(r"^_?[A-Z]\w*[a-z]\w*$")  # a class name, not an ALL_CAPS constant
ASSIGNED = re.compile(rf"^({IDENT})(?:=(?!=)|: \S)")  # name=value, name=, name: value
PYTHON_M = re.compile(rf"\bpython3? -m ({IDENT}(?:\.{IDENT})*)")
MAKE = re.compile(r"^make ([\w-]+)")
CLI = re.compile(r"(?:^|/)dataplane ([a-z][\w-]*)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)(\w*)")


# ---------------------------------------------------------------------------- documents


def code_spans(text: str) -> list[tuple[int, str]]:
    """``(line, span)`` of every inline code span outside fenced blocks."""
    spans, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if opened and (fence is None or opened.group(1) == fence):
            fence = None if fence else opened.group(1)
            continue
        if fence is None:
            spans.extend((number, span.strip()) for span in INLINE_CODE.findall(line))
    return spans


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, code)`` of every fenced block marked ``python``."""
    blocks, lines, start, fence = [], [], 0, None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence, start, lines = (opened.group(1), opened.group(2)), number + 1, []
        elif fence is not None and opened and opened.group(1) == fence[0]:
            if fence[1] == "python":
                blocks.append((start, "\n".join(lines)))
            fence = None
        elif fence is not None:
            lines.append(line)
    return blocks


# ---------------------------------------------------------------------- our code, read


@dataclass
class ClassInfo:
    module: str
    bases: list[str]
    attrs: set[str] = field(default_factory=set)


@dataclass
class Index:
    modules: dict[str, Path] = field(default_factory=dict)  # dotted name -> file
    top_level: dict[str, set[str]] = field(default_factory=dict)  # module -> its names
    classes: dict[str, list[ClassInfo]] = field(default_factory=dict)  # name -> classes
    names: set[str] = field(default_factory=set)  # every identifier our code uses
    words: set[str] = field(default_factory=set)  # every word of its source, comments too
    aliases: dict[str, set[str]] = field(default_factory=dict)  # "import x as y": y -> x
    paths: list[str] = field(default_factory=list)  # every file and folder, from ROOT

    def modules_named(self, dotted: str) -> list[str]:
        """Our modules that ``dotted`` names: by their last parts, or by an import alias."""
        found = [m for m in self.modules if m == dotted or m.endswith("." + dotted)]
        return found + sorted(self.aliases.get(dotted, set()) & set(self.modules) - set(found))


def _base_name(node: ast.expr) -> str:
    while isinstance(node, ast.Subscript):  # Generic[T]
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target)
    return flat


def _class_attrs(node: ast.ClassDef) -> set[str]:
    attrs: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attrs.add(item.name)
        for target in _targets(item):
            if isinstance(target, ast.Name):
                attrs.add(target.id)
                if target.id == "__slots__" and isinstance(item, ast.Assign):
                    attrs.update(
                        e.value
                        for e in ast.walk(item.value)
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    )
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) or not item.args.args:
            continue
        me = item.args.args[0].arg  # self, or cls
        for sub in ast.walk(item):
            for target in _targets(sub):
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == me
                ):
                    attrs.add(target.attr)
            # object.__setattr__(self, "name", ...) and setattr(self, "name", ...)
            if isinstance(sub, ast.Call) and len(sub.args) >= 2:
                func = sub.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first, second = sub.args[0], sub.args[1]
                if (
                    called in ("__setattr__", "setattr")
                    and isinstance(first, ast.Name)
                    and first.id == me
                    and isinstance(second, ast.Constant)
                    and isinstance(second.value, str)
                ):
                    attrs.add(second.value)
    return attrs


def _names_used(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
            if node.asname:
                names.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and re.fullmatch(IDENT, str(node.value)):
            names.add(str(node.value))
    return names


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        names.update(_defined(node))
    return names


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    found = {t.id for t in _targets(node) if isinstance(t, ast.Name)}
    for child in ("body", "orelse", "finalbody", "handlers"):  # if/try blocks at top level
        for sub in getattr(node, child, []):
            if isinstance(sub, ast.stmt):
                found |= _defined(sub)
            elif isinstance(sub, ast.ExceptHandler):
                for inner in sub.body:
                    found |= _defined(inner)
    return found


def _walk_repo() -> list[str]:
    paths = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in NOT_OURS and "egg-info" not in d
        )
        rel = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        paths.extend(prefix + d + "/" for d in dirs)
        paths.extend(prefix + f for f in files)
    return paths


def build_index() -> Index:
    index = Index(paths=_walk_repo())
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            module = ".".join(parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            index.modules[module] = path
            index.top_level[module] = _top_level(tree)
            index.names |= _names_used(tree) | set(parts)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    source = f"{node.module}." if isinstance(node, ast.ImportFrom) else ""
                    for alias in node.names:
                        if alias.asname:
                            index.aliases.setdefault(alias.asname, set()).add(source + alias.name)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    info = ClassInfo(
                        module, [_base_name(b) for b in node.bases], _class_attrs(node)
                    )
                    index.classes.setdefault(node.name, []).append(info)
    for path in sorted((ROOT / "tests").rglob("*.py")):  # names tests use (hooks, policies)
        if path.resolve() == Path(__file__).resolve():
            continue  # this file's made-up names
        index.names |= _names_used(ast.parse(path.read_text(), filename=str(path)))
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            if path.resolve() != Path(__file__).resolve():
                index.words.update(re.findall(IDENT, path.read_text()))
    return index


@functools.cache
def repo_index() -> Index:
    return build_index()


# ------------------------------------------------------------------------------ checks


def class_has(index: Index, name: str, attr: str, seen: frozenset = frozenset()) -> bool | None:
    """Whether some class ``name`` of ours has ``attr`` (None: cannot tell, an outside base)."""
    verdict: bool | None = False
    for info in index.classes.get(name, []):
        if attr in info.attrs:
            return True
        for base in info.bases:
            if base in index.classes and base not in seen:
                found = class_has(index, base, attr, seen | {name})
            elif base in KNOWN_BASES:
                known = KNOWN_BASES[base]
                found = known is not None and hasattr(known, attr)
            elif isinstance(getattr(builtins, base, None), type):
                found = hasattr(getattr(builtins, base), attr)
            else:
                found = None
            if found:
                return True
            if found is None:
                verdict = None
    return verdict


def in_module(index: Index, module: str, rest: list[str]) -> bool | None:
    """Whether ``rest`` (names after a module of ours) is defined there (rule 4)."""
    if not rest:
        return True
    head = rest[0]
    if head in index.top_level.get(module, set()):
        if len(rest) > 1 and any(c.module == module for c in index.classes.get(head, [])):
            return class_has(index, head, rest[1])
        if f"{module}.{head}" in index.modules:  # a submodule imported into its package
            return in_module(index, f"{module}.{head}", rest[1:])
        return True  # a function or a variable: what follows is not ours to type
    if f"{module}.{head}" in index.modules:
        return in_module(index, f"{module}.{head}", rest[1:])
    classes_here = [
        n for n, infos in index.classes.items() if any(c.module == module for c in infos)
    ]
    return any(class_has(index, n, head) for n in classes_here)


def any_of(verdicts: list[bool | None]) -> bool | None:
    if any(v is True for v in verdicts):
        return True
    return None if any(v is None for v in verdicts) else False


def dotted_of_ours(index: Index, parts: list[str]) -> bool | None:
    """Rule 1: import the longest module prefix, then look the rest up as attributes."""
    module, i = importlib.import_module(parts[0]), 1
    while i < len(parts):
        name = ".".join(parts[: i + 1])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            break
        i += 1
    obj: object = module
    for attr in parts[i:]:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, type):  # an attribute its instances get
            return class_has(index, obj.__name__, attr)
        else:
            return False
    return True


def file_defines(path: Path, names: list[str]) -> bool:
    """Whether ``path`` (a Python file) defines each of ``names`` (test ids: nested ok)."""
    tree = ast.parse(path.read_text())
    defined = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    } | _top_level(tree)
    return all(name in defined for name in names)


def resolve_path(index: Index, path: str) -> list[str]:
    """The repository paths ``path`` names: from the root, else as the tail of one."""
    path = path.removeprefix("./")
    if any(ch in path for ch in "*?["):
        return [
            p for p in index.paths if fnmatch.fnmatch(p, path) or fnmatch.fnmatch(p, "*/" + path)
        ]
    if (ROOT / path).exists():
        return [path]
    return [p for p in index.paths if p == path or p.endswith("/" + path)]


def check_path(index: Index, span: str) -> bool | None:
    path, _, names = span.partition("::")
    path, _, name = path.partition(":")
    wanted = [n for n in names.split("::") if n] + ([name] if name else [])
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if not path.endswith(("/", *FILE_ENDINGS)) and "." in last:
        # "core/staleness.matching": a module path, then names in it
        stem, _, rest = last.partition(".")
        path = path[: len(path) - len(last)] + stem + ".py"
        found = resolve_path(index, path)
        modules = [m for m, f in index.modules.items() if f.relative_to(ROOT).as_posix() in found]
        return bool(found) and any_of([in_module(index, m, rest.split(".")) for m in modules])
    found = resolve_path(index, path)
    if not found:
        return False
    if wanted:
        files = [ROOT / p for p in found if p.endswith(".py")]
        return any(file_defines(f, wanted) for f in files)
    return True


def looks_like_code(name: str) -> bool:
    """A name with a "_" or a capital is code; a lowercase word ("sequential") may be prose."""
    return "_" in name or name != name.lower()


def check_name(index: Index, name: str) -> bool:
    """Rule 5: the name occurs in our code, or is Python's own."""
    if CONSTANT.match(name):  # ours, or the kernel's or an environment variable we mention
        return name in index.words
    return name in index.names or hasattr(builtins, name) or keyword.iskeyword(name)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):(?!=)", text, re.MULTILINE))


def cli_commands() -> set[str]:
    """``dataplane``'s subcommands: a module each under the CLI, or an entry point."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = project.get("entry-points", {}).get("dataplane.commands", {})
    return {p.stem for p in (ROOT / "dataplane_server/cli").glob("*.py")} | set(plugins)


def check_span(index: Index, span: str) -> bool | None:
    """True: what the span names exists; False: it does not; None: not a form read here."""
    command = PYTHON_M.search(span)
    if command and command.group(1).split(".")[0] in PACKAGES:
        return importlib.util.find_spec(command.group(1)) is not None
    make = MAKE.match(span)
    if make:
        return make.group(1) in make_targets()
    cli = CLI.search(span)
    if cli:
        return cli.group(1) in cli_commands()
    span = span.removeprefix("await ")
    assigned = ASSIGNED.match(span)
    if assigned:  # a keyword argument or a config key: a name our code uses
        return check_name(index, assigned.group(1))
    head = re.split(r"[(\[]", span, maxsplit=1)[0].strip()
    if not head or re.search(r"[\s<>{}|,'\"=]", head) or head.startswith(("/", "~", "-", "$")):
        return None
    if "/" in head or head.endswith(FILE_ENDINGS) or "::" in head:
        return None if re.match(r"^\w+:", head) else check_path(index, head)  # not a URL
    if not DOTTED.match(head):
        return None
    parts = head.split(".")
    first = parts[0]
    if first in PACKAGES:
        return dotted_of_ours(index, parts)
    if CAMEL.match(first) and first in index.classes:
        return True if len(parts) == 1 else class_has(index, first, parts[1])
    if len(parts) == 1:
        called = span[len(head) :].startswith("(")
        return check_name(index, first) if called or looks_like_code(first) else None
    if not CAMEL.match(first):
        for cut in range(len(parts) - 1, 0, -1):  # rule 4: the longest module tail
            modules = index.modules_named(".".join(parts[:cut]))
            if modules:
                return any_of([in_module(index, m, parts[cut:]) for m in modules])
    # A class from elsewhere (TensorDict.x), a variable (keys.unit_alive) or another
    # project's module (asyncio.to_thread): what follows is not ours, but a first name
    # that looks like code must occur in ours (unit_undo.PublishedWrites: a module gone).
    return False if looks_like_code(first) and not check_name(index, first) else None


def check_python_block(index: Index, code: str) -> list[str]:
    """The imports of our packages in ``code`` that do not resolve."""
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [[*node.module.split("."), a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for parts in names:
            if parts[0] in PACKAGES and dotted_of_ours(index, parts) is False:
                missing.append(".".join(parts))
    return missing


def stale_names(index: Index, text: str) -> list[tuple[int, str]]:
    """``(line, span)`` of every name in ``text`` that does not exist."""
    stale = [(line, span) for line, span in code_spans(text) if check_span(index, span) is False]
    for start, code in python_blocks(text):
        stale += [(start, f"import {name}") for name in check_python_block(index, code)]
    return stale


# ------------------------------------------------------------------------------- tests


def test_every_name_the_documents_give_in_backticks_exists():
    index = repo_index()
    stale = [
        f"{doc}:{line}: `{span}`"
        for doc in DOCUMENTS
        for line, span in stale_names(index, (ROOT / doc).read_text())
    ]
    assert stale == [], "the documents name code or files that do not exist:\n" + "\n".join(stale)


def test_the_documents_name_enough_code_for_the_check_to_mean_something():
    # A reader that skipped every span (a broken pattern) would pass the test above.
    index = repo_index()
    checked = [
        span
        for doc in DOCUMENTS
        for _, span in code_spans((ROOT / doc).read_text())
        if check_span(index, span) is True
    ]
    assert len(checked) > 300, len(checked)


# Names of ours that exist; names that do not (the first three are the ones the
# reorganisation left in docs/architecture.md); spans no rule reads.
REAL = [
    "dataplane_client.wire.errors",
    "dataplane_server.start()",
    "RayDataPlaneClient.put_samples",
    "KeySpace.check_commit",
    "keyspace.Partition.gen",
    "publish.publish(...)",
    "core/keyspace.py",
    "dataplane_server/core/claim_policies/",
    "tests/project/test_doc_names.py::test_the_span_reader_skips_fenced_blocks",
    "core/staleness.matching",
    "launch/service.py:start",
    "admit_rollouts(pid, n, wait=True)",
    "put_credits=4",
    "ValueError",
    "python -m benchmarks.run --only store",
    "make demo",
    "dataplane demo --help",
]
STALE = [
    "WorkerGroup",
    "_in_flight",
    "after_publish",
    "KeySpace.no_such_attr",
    "dataplane_client.no_such_module",
    "dataplane_server.no_such_function()",
    "core/no_such.py",
    "tests/test_no_such_*.py",
    "tests/project/test_doc_names.py::test_no_such_test",
    "core/staleness.no_such",
    "publish.no_such",
    "no_such_module.name",
    "python -m benchmarks.no_such",
    "make no-such-target",
    "dataplane no-such-command",
]
SKIPPED = [
    "keys.unit_alive",
    "asyncio.to_thread",
    "TensorDict.no_such_attr",
    "/proc/self/pagemap",
    "DIR/step-<n>",
    "--small",
    "x + 1",
    "sequential",
]


def test_the_checker_flags_stale_names_and_passes_real_ones():
    index = repo_index()
    assert {span: check_span(index, span) for span in REAL} == dict.fromkeys(REAL, True)
    assert {span: check_span(index, span) for span in STALE} == dict.fromkeys(STALE, False)
    assert {span: check_span(index, span) for span in SKIPPED} == dict.fromkeys(SKIPPED)


def test_the_checker_reads_a_document_and_its_python_blocks():
    text = "\n".join(
        [
            "# A document",
            "Real: " + ", ".join(f"`{span}`" for span in REAL) + ".",
            "Stale: " + ", ".join(f"`{span}`" for span in STALE) + ".",
            "```python",
            "from dataplane_client import shard_meta_for_dp, no_such_name",
            "import dataplane_server.launch.no_such_module",
            "```",
            "```bash",
            "`WorkerGroup` in another fence is not a span",
            "```",
        ]
    )
    assert stale_names(repo_index(), text) == [(3, span) for span in STALE] + [
        (5, "import dataplane_client.no_such_name"),
        (5, "import dataplane_server.launch.no_such_module"),
    ]


def test_the_span_reader_skips_fenced_blocks():
    text = "a `x`\n```python\n`y`\n```\n~~~\n`z`\n~~~\nb `w` and `v`\n"
    assert code_spans(text) == [(1, "x"), (8, "w"), (8, "v")]
    assert python_blocks(text) == [(3, "`y`")]
