"""``serve`` and the demo wait for SIGTERM / SIGINT with a handler that can run anywhere.

Found in CI: ``serve`` once ignored a SIGTERM for 120 s and never drained. Its handler
set a ``threading.Event`` the main thread was waiting on; a signal landing while the main
thread held the event's lock (inside ``Event.wait``) blocked the handler on that lock
forever. A real signal's timing cannot be chosen, so the test calls the handler the way
Python would, between two lines of the waiting code, at every line in turn.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a child: the handler sets process-wide signal dispositions, and a deadlock there
# must not hang pytest. Prints each line number it tries, so a hang names where it was.
_EVERY_LINE = textwrap.dedent(
    """
    import signal, sys
    from dataplane_server.launch import stop_signal
    from dataplane_server.launch.stop_signal import StopSignal

    stop_signal.POLL_S = 0.0005  # many loop turns within the lines tried

    def signal_at_line(n):
        stop, seen = StopSignal(), 0

        def trace(frame, event, arg):
            nonlocal seen
            if event == "line":
                seen += 1
                if seen == n:  # as if SIGTERM arrived just before this line ran
                    stop.on_signal(signal.SIGTERM, frame)
            return trace

        sys.settrace(trace)
        try:
            return stop.wait()
        finally:
            sys.settrace(None)

    for n in range(1, int(sys.argv[1]) + 1):
        print(n, flush=True)
        assert signal_at_line(n) == signal.SIGTERM, n
    print("done", flush=True)
    """
)


def test_a_signal_between_any_two_lines_of_the_wait_ends_it():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        run = subprocess.run(
            [sys.executable, "-c", _EVERY_LINE, "60"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        tried = (exc.stdout or b"").decode().split() or ["none"]
        raise AssertionError(f"the wait hung with the signal before its line {tried[-1]}") from None
    assert run.returncode == 0, run.stdout[-200:] + run.stderr
    assert run.stdout.split()[-1] == "done"


def test_a_real_sigterm_ends_the_wait_and_a_second_one_stops_at_once():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time\n"
            "from dataplane_server.launch.stop_signal import StopSignal\n"
            "stop = StopSignal().install()\n"
            "print('waiting', flush=True)\n"
            "print('got', stop.wait(), flush=True)\n"
            "os.kill(os.getpid(), 15)\n"  # the second signal: default action, no drain
            "print('still running', flush=True)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "waiting\n"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert out == f"got {int(signal.SIGTERM)}\n"
    assert child.returncode == -signal.SIGTERM
