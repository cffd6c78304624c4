"""Running `dataplane serve` as a process in tests: its output lines, its snippet, its tree."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START_S = 180


def _pump(pipe, lines: queue.Queue) -> None:
    for line in pipe:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def start_serve(config: Path, args: list[str], env: dict) -> tuple[subprocess.Popen, queue.Queue]:
    """``dataplane serve --config config *args``, its output lines pumped into a queue."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "dataplane_server", "serve", "--config", str(config), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(serve.stdout, lines), daemon=True).start()
    return serve, lines


def read_until(
    lines: queue.Queue, prefix: str, seen: list[str], deadline: float | None = None
) -> str:
    """Lines up to the first that starts with ``prefix`` (kept in ``seen``): each within
    START_S, or all of them before ``deadline`` (monotonic) where one is given."""
    while True:
        wait = START_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            line = lines.get(timeout=wait)
        except queue.Empty:
            pytest.fail(f"no {prefix!r} line in time; got:\n" + "\n".join(seen))
        if line is None:
            pytest.fail(f"serve ended before {prefix!r}; got:\n" + "\n".join(seen))
        seen.append(line)
        if line.startswith(prefix):
            return line


def read_snippet(lines: queue.Queue, seen: list[str]) -> list[str]:
    """The indented lines after "connect from another process", dedented."""
    read_until(lines, "connect from another process", seen)
    snippet = []
    while (line := lines.get(timeout=START_S)) is not None and line.startswith("    "):
        seen.append(line)
        snippet.append(line[4:])
    seen.append(str(line))
    return snippet


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it (Ray's GCS, raylet, workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree
