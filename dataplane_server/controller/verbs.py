"""How every controller verb is served: only once the key space is rebuilt, errors counted.

A (re)started controller rebuilds its key space before answering anything
(``Controller._up``); a call that arrives meanwhile waits for it. Every typed
error a verb raises is counted in the controller's stats by class, so the
metrics show what callers got wrong or what failed.
"""

from __future__ import annotations

import functools
import inspect

from dataplane_server.core.stats import counts_errors


def served(method):
    """Wait for recovery, then run ``method`` (sync or async), counting its typed errors."""
    counted = counts_errors(method)

    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        await self._up()
        result = counted(self, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    return wrapper
