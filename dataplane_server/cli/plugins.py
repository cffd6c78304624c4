"""Subcommands that live in upper layers (the demo), found through entry points.

A package registers ``name = "module:main"`` under ``[project.entry-points."dataplane.commands"]``;
``main(argv) -> int`` gets every argument after the name. Nothing is imported
until the command runs, so the server layer never imports upward.
"""

from __future__ import annotations

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
        sub.add_parser(name, help=f"from {ep.module} (dataplane {name} --help)", add_help=False)
    return added


def run(ep: EntryPoint, argv: list[str]) -> int:
    try:
        main = ep.load()
    except ImportError as exc:  # e.g. an extra (the demo's transformers) is not installed
        raise CliError(
            f"cannot load the {ep.name!r} command from {ep.value}: {exc}", EXIT_FAILED
        ) from None
    return int(main(argv) or 0)
