"""connect(): joining a Ray cluster by address, and what a user is told when it cannot.

Each case runs in a fresh interpreter: the session's Ray must stay as it is,
and ``connect`` only initialises Ray in a process that has not.
"""

import os
import subprocess
import sys

import pytest

# Each case starts Ray in a fresh interpreter: the full suite, not make test-fast.
pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from dataplane_client import connect
from dataplane_client.wire.errors import ServiceUnavailable

address = sys.argv[3] if len(sys.argv) > 3 else None
try:
    c = connect(sys.argv[1], sys.argv[2], address=address)
except ServiceUnavailable as e:
    print("UNAVAILABLE", e)
else:
    c.service_info()  # a real call to the controller
    print("CONNECTED", type(c).__name__)
"""


def _run(*args, env=None, drop=()):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop},
    )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr


def test_without_ray_and_without_an_address_it_says_to_pass_one():
    assert _run("dp", "ns").startswith("UNAVAILABLE")
    assert "address=" in _run("dp", "ns")


def test_token_authentication_it_cannot_satisfy_is_service_unavailable_saying_what_to_set(tmp_path):
    out = _run(
        "dp",
        "ns",
        "127.0.0.1:1",
        env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no-token")},
    )
    assert out.startswith("UNAVAILABLE"), out
    for needle in ("token", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "~/.ray/auth_token"):
        assert needle in out


@pytest.mark.slow
def test_an_address_joins_that_cluster_and_finds_the_service(service):
    import ray

    address = ray.get_runtime_context().gcs_address
    out = _run(service.config.name, service.config.namespace, address)
    assert out.startswith("CONNECTED RayDataPlaneClient"), out


@pytest.mark.slow
def test_a_token_refused_inside_a_connection_error_is_one_line_saying_what_to_set(service):
    """The session's Ray runs with token auth (Ray 2.60's default for a new local cluster);
    a process joining it without RAY_AUTH_MODE=token is refused, and Ray 2.60 reports that
    as a ConnectionError around the GCS's InvalidAuthToken, not as AuthenticationError."""
    import ray

    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        pytest.skip("the session's Ray runs without token auth")
    address = ray.get_runtime_context().gcs_address
    # Ray's join retries the refused GCS connection once a second, 20 times by default
    # (about 22 s of CI): three tries refuse it the same way.
    tries = {"RAY_gcs_server_port_wait_time_s": "3"}
    drop = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    out = _run("dp", "ns", address, env=tries, drop=drop)
    assert out.startswith("UNAVAILABLE Ray token authentication failed"), out
    assert "RAY_AUTH_MODE=token" in out
    assert "\n" not in out


TIMED = """
import sys, time
from dataplane_client import connect
from dataplane_client.wire.errors import ServiceUnavailable

t = time.monotonic()
try:
    connect("dp", "ns", address=sys.argv[1])
except ServiceUnavailable as e:
    print(f"{time.monotonic() - t:.2f}", e)
"""


@pytest.mark.slow
def test_joining_a_token_cluster_without_token_mode_says_so_at_once_in_whole_words(service):
    """Without RAY_AUTH_MODE=token a join was refused only after Ray's 20 retries (25 s,
    20 InvalidAuthToken lines on stderr), and the quoted Ray text began mid-word ("te
    clusters, ..."). The GCS is asked first: one line, within 5 s, nothing from Ray."""
    import ray

    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        pytest.skip("the session's Ray runs without token auth")
    address = ray.get_runtime_context().gcs_address
    drop = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    done = subprocess.run(
        [sys.executable, "-c", TIMED, address],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in drop},
    )
    assert done.stdout.count("\n") == 1, (done.stdout, done.stderr)
    took, message = done.stdout.strip().split(" ", 1)
    assert float(took) < 5.0, done.stdout
    assert message.startswith("Ray token authentication failed"), message
    assert "set RAY_AUTH_MODE=token" in message  # this process is not in token mode
    said = message.split("(Ray said: ", 1)[1]
    assert said.startswith("InvalidAuthToken: "), said  # whole words, from the start
    assert "InvalidAuthToken" not in done.stderr, done.stderr
