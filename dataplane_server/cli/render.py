"""Text for people: sizes, durations, times and aligned tables; JSON for scripts."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def human_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) if unix_s else "-"


def joined(items: Sequence[Any], limit: int = 60) -> str:
    """Items comma-joined, cut to ``limit`` characters so one cell cannot wreck a table."""
    text = ",".join(str(x) for x in items) or "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) for r in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def table_of(columns: dict[str, str], records: Sequence[dict[str, Any]]) -> str:
    """``table`` of dicts: ``columns`` maps each header to the key its cells are read at."""
    return table(list(columns), [[r[key] for key in columns.values()] for r in records])


def say(text: str = "") -> None:
    # Flushed: `watch` and `serve` are read line by line through pipes.
    print(text, flush=True)


def emit_json(obj: Any) -> None:
    print(json.dumps(obj), flush=True)
