"""Wait in the main thread until SIGTERM or SIGINT, without taking a lock in the handler.

Python runs a signal handler in the main thread between two bytecodes of whatever the
main thread was doing. A handler that sets a ``threading.Event`` takes the event's lock;
when the signal lands while the main thread itself holds that lock (inside
``Event.wait``, around its timed wait), the handler blocks on it forever: ``serve`` then
never drains and never exits (seen once in CI, 1 run in 11). So the handler here only
stores the signal's number, and the main thread polls it.
"""

from __future__ import annotations

import signal
import time

# How often the main thread looks at the flag: the delay between a signal and the drain.
POLL_S = 0.2


class StopSignal:
    """SIGTERM / SIGINT handlers that record the first signal; ``wait`` returns after it.

    A second signal, while the caller drains, gets the default behaviour: stop at once.
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> StopSignal:
        """Route SIGTERM and SIGINT here (call from the main thread)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_signal)
        return self

    def on_signal(self, signum: int, _frame) -> None:
        # No lock, no I/O: only attribute stores and signal.signal, safe at any bytecode.
        self.received = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def wait(self) -> int:
        """Block until a signal has been recorded; the signal's number."""
        while self.received is None:
            time.sleep(POLL_S)
        return self.received
