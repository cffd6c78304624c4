"""Subcommands that live in upper layers (the demo), found through entry points.

A package registers ``name = "module:main"`` under ``[project.entry-points."dataplane.commands"]``;
``main(argv) -> int`` gets every argument after the name. Nothing is imported
until the command runs, so the server layer never imports upward.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import EntryPoint, entry_points

from dataplane_server.cli.exits import EXIT_FAILED, CliError

GROUP = "dataplane.commands"


def commands() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def register(sub, found: dict[str, EntryPoint]) -> dict[str, EntryPoint]:
    """List them in ``dataplane --help`` (their own parsers handle ``--help``); a name a
    built-in command already has is skipped. Returns the ones registered."""
    added = {name: ep for name, ep in sorted(found.items()) if name not in sub.choices}
    for name, ep in added.items():
        sub.add_parser(name, help=f"{summary(ep)} (dataplane {name} --help)", add_help=False)
    return added


def summary(ep: EntryPoint) -> str:
    """What the command does: the first line of its module's docstring, read from the source
    without importing the module (a demo's imports take seconds), less a leading
    "`dataplane NAME`:" label; "from MODULE" when there is none."""
    try:
        spec = importlib.util.find_spec(ep.module)
        origin = spec.origin if spec is not None else None
        with open(origin or "", encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, OSError, SyntaxError, ValueError):
        doc = ""
    first = doc.strip().split("\n", 1)[0].strip()
    label = f"`dataplane {ep.name}`:"
    if first.startswith(label):
        first = first[len(label) :].strip()
    return first.rstrip(".") or f"from {ep.module}"


def run(ep: EntryPoint, argv: list[str]) -> int:
    try:
        main = ep.load()
    except ImportError as exc:  # e.g. an extra (the demo's transformers) is not installed
        raise CliError(
            f"cannot load the {ep.name!r} command from {ep.value}: {exc}", EXIT_FAILED
        ) from None
    return int(main(argv) or 0)
