"""Tests reach a running actor only through its remote methods, never its internals.

``__ray_call__`` runs a lambda inside an actor and ``__ray_metadata__`` unwraps
an actor class: a test using either pins the actor's private attributes, so a
refactor breaks it while behaviour stays the same (and it checks state no caller
can see). Unit logic is tested on ``UnitStore`` directly; what a test must see
of a running actor, a remote method says (e.g. ``StorageUnit.holdings``).
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FORBIDDEN = ("__ray_call__", "__ray_metadata__")


def offenders() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__):
            continue
        rel = path.relative_to(TESTS).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(name in line for name in FORBIDDEN):
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_no_test_runs_code_inside_an_actor_or_unwraps_its_class():
    assert offenders() == []
