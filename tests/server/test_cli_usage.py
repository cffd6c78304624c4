"""The `dataplane` CLI without a service: exit codes, TLS diagnosis, watch rows, imports.

Each exit code has a test: 2 for usage (bad numbers, no address, a missing
--tls-ca file, a bad config for `serve`), 3 for an endpoint that cannot be
spoken to (here: TLS on one side only, explained). The gRPC servers here are
real ones with only the health service, so no Ray is needed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent import futures
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest
from cli_run import run_dataplane as dataplane
from grpc_health.v1 import health, health_pb2_grpc
from tls_certs import self_signed

from dataplane_server.cli import watch
from dataplane_server.cli.serve import connect_snippet, token_auth_hint

REPO = Path(__file__).resolve().parents[2]


def one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_version_comes_from_the_package_metadata():
    proc = dataplane("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"dataplane {version('rl-dataplane')}"


@pytest.mark.parametrize(
    "argv",
    [
        ["no-such-command"],
        [],
        ["samples", "p", "--page-size", "0", "--address", "127.0.0.1:1"],
        ["sample", "p", "s", "--max-elems", "-3", "--address", "127.0.0.1:1"],
        ["watch", "--interval", "nan", "--address", "127.0.0.1:1"],
        ["watch", "--interval", "0", "--address", "127.0.0.1:1"],
        ["watch", "--count", "-1", "--address", "127.0.0.1:1"],
        ["samples", "p", "--status", "done", "--address", "127.0.0.1:1"],
        ["delete", "--address", "127.0.0.1:1"],  # the partition is required
    ],
)
def test_usage_errors_exit_2(argv):
    proc = dataplane(*argv)
    assert proc.returncode == 2, proc.stderr
    assert "usage: dataplane" in proc.stderr


def test_no_address_is_a_usage_error():
    err = one_line_error(dataplane("partitions"), 2)
    assert "DATAPLANE_ADMIN_ADDRESS" in err


def test_missing_tls_ca_file_is_a_usage_error(tmp_path):
    missing = tmp_path / "no-such-ca.pem"
    err = one_line_error(
        dataplane("status", "--address", "127.0.0.1:1", "--tls-ca", str(missing)), 2
    )
    assert str(missing) in err
    assert "No such file" in err


@pytest.fixture
def health_server(request, tmp_path):
    """A real gRPC server with the health service: TLS when the test is parametrized so."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    cert, key = self_signed(tmp_path)
    if request.param == "tls":
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", cert
    server.stop(0)


@pytest.mark.parametrize("health_server", ["tls"], indirect=True)
def test_plaintext_against_a_tls_endpoint_is_explained(health_server):
    address, _cert = health_server
    err = one_line_error(dataplane("status", "--address", address, "--timeout", "3"), 3)
    assert f"the admin endpoint at {address} speaks TLS" in err
    assert "--tls-ca" in err


@pytest.mark.parametrize("health_server", ["plain"], indirect=True)
def test_tls_against_a_plaintext_endpoint_is_explained(health_server):
    address, cert = health_server
    proc = dataplane("status", "--address", address, "--tls-ca", str(cert), "--timeout", "3")
    err = one_line_error(proc, 3)
    assert f"the admin endpoint at {address} does not speak TLS" in err


@pytest.mark.parametrize("health_server", ["tls"], indirect=True)
def test_an_untrusted_certificate_is_explained(health_server, tmp_path):
    address, _cert = health_server
    (tmp_path / "other").mkdir()
    other_ca, _key = self_signed(tmp_path / "other")
    proc = dataplane("status", "--address", address, "--tls-ca", str(other_ca), "--timeout", "3")
    err = one_line_error(proc, 3)
    assert "not signed by the --tls-ca bundle" in err


def test_client_commands_import_neither_ray_nor_torch():
    code = (
        "import sys\n"
        "from dataplane_server.cli import main\n"
        "rc = main(['status', '--address', '127.0.0.1:1', '--timeout', '0.5'])\n"
        "heavy = sorted({'ray', 'torch'} & set(sys.modules))\n"
        "print(rc, heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.strip() == "3 []", proc.stdout + proc.stderr


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_entry_point_commands_get_every_argument():
    """`demo` is registered by policy_workers as an entry point; --help reaches its parser."""
    proc = dataplane("demo", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: dataplane demo")
    listed = dataplane("--help")
    assert "demo" in listed.stdout
    assert "bench" not in listed.stdout


# ------------------------------------------------------------------- serve, no Ray


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_serve_with_a_bad_config_key_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "dataplane.yaml"
    config.write_text("name: x\nadmin_prot: 50051\n")  # misspelt
    err = one_line_error(dataplane("serve", "--config", str(config)), 2)
    assert err.startswith("dataplane: error: config error:")
    assert "admin_prot" in err


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_serve_with_a_bad_config_value_names_the_key(tmp_path):
    config = tmp_path / "dataplane.yaml"
    config.write_text("admin_port: 70000\n")
    err = one_line_error(dataplane("serve", "--config", str(config)), 2)
    assert "admin_port" in err


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_serve_with_a_missing_config_file_exits_2(tmp_path):
    err = one_line_error(dataplane("serve", "--config", str(tmp_path / "nope.yaml")), 2)
    assert "nope.yaml" in err


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_serve_with_a_bad_environment_override_exits_2():
    err = one_line_error(dataplane("serve", env={"DATAPLANE_ADMIN_PORT": "two"}), 2)
    assert "admin_port" in err


def test_connect_snippet_names_the_address_and_the_service(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    lines = connect_snippet("127.0.0.1:6380", "dp", "ns")
    call = 'dataplane_client.connect(name="dp", namespace="ns", address="127.0.0.1:6380")'
    assert call in lines[-1]
    assert "RAY_AUTH_MODE" not in "\n".join(lines)
    # With token auth on, the snippet sets the mode itself, before anything imports ray.
    code = [line.strip() for line in connect_snippet("127.0.0.1:6380", "dp", "ns", True)[1:]]
    assert code.index('os.environ["RAY_AUTH_MODE"] = "token"  # before ray is imported') < (
        code.index("import dataplane_client")
    )
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/etc/ray/token")
    assert 'os.environ["RAY_AUTH_TOKEN_PATH"] = "/etc/ray/token"' in "\n".join(
        connect_snippet("127.0.0.1:6380", "dp", "ns", True)
    )


def test_token_auth_hint(monkeypatch):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert token_auth_hint() is None
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert token_auth_hint() is None
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert "RAY_AUTH_MODE=token" in token_auth_hint()
    assert "~/.ray/auth_token" in token_auth_hint()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/etc/ray/token")
    assert "RAY_AUTH_TOKEN_PATH=/etc/ray/token" in token_auth_hint()


# --------------------------------------------------------------------- watch rows


def snapshot(t: float, **values) -> dict:
    base = {
        "timestamp": t,
        "num_samples": 0,
        "bytes": 0,
        "put_bytes_total": 0,
        "get_bytes_total": 0,
        "put_requests_total": 0,
        "get_requests_total": 0,
        "claims_waiting": 0,
        "errors": {},
    }
    return base | values


def test_watch_row_shows_rates_per_second():
    prev = snapshot(100.0, put_bytes_total=1 << 20, put_requests_total=10, errors={"X": 1})
    snap = snapshot(
        102.0,
        put_bytes_total=(1 << 20) + (4 << 20),
        get_bytes_total=2 << 20,
        put_requests_total=30,
        get_requests_total=20,
        errors={"X": 3, "Y": 2},
        claims_waiting=5,
        puts_waiting=7,
        puts_rejected_total=2,  # refused puts count as errors (Overloaded)
    )
    cells = watch.row(snap, prev).split("  ")
    cells = [c.strip() for c in cells if c.strip()]
    # TIME SAMPLES STORED PUT/s GET/s REQ/s PUTQ WAIT ERR/s
    assert cells[3:] == ["2.0 MiB", "1.0 MiB", "20.0", "7", "5", "3.0"]


def test_watch_row_has_no_rates_first_or_after_a_counter_reset():
    first = watch.row(snapshot(1.0, put_bytes_total=50), None)
    assert first.split().count("-") == 4
    restarted = watch.row(snapshot(3.0, put_bytes_total=10), snapshot(2.0, put_bytes_total=50))
    assert restarted.split().count("-") == 4


def test_watch_rows_fit_80_columns_with_large_figures():
    prev = snapshot(0.0)
    snap = snapshot(
        1.0,
        num_samples=99_999_999,
        bytes=900 << 40,
        put_bytes_total=900 << 30,
        get_bytes_total=900 << 30,
        put_requests_total=999_999,
        claims_waiting=999,
        puts_waiting=99_999,
        errors={"E": 99_999},
    )
    header = watch._line([h for h, _ in watch.COLUMNS])
    assert len(header) <= 80
    assert len(watch.row(snap, prev)) <= 80


# ------------------------------------------------------- serve: start failures, one line
# Each is found before anything starts: the output holds no line of Ray's, and it comes
# in seconds (an unreachable --address used to take 24 s of retries and 59 lines).
def _serve_refused(tmp_path, code: int, *args: str, config: str | None = None) -> str:
    argv = ["serve", *args]
    if config is not None:
        (tmp_path / "cfg.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "cfg.yaml")]
    started = time.monotonic()
    proc = dataplane(*argv, env={"RAY_ADDRESS": ""})
    err = one_line_error(proc, code)
    assert proc.stdout == "", proc.stdout  # nothing started, nothing printed
    assert time.monotonic() - started < 45  # generous: "fails fast", not a timing claim
    return err


@pytest.mark.slow  # a fresh interpreter that imports Ray
def test_serve_with_its_admin_port_taken_is_one_line_exit_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _serve_refused(tmp_path, 1, config=f"admin_port: {port}\n")
    assert f"admin_port {port} on 127.0.0.1 cannot be used" in err


@pytest.mark.slow
def test_serve_with_missing_tls_files_is_one_line_exit_2(tmp_path):
    cert, key = tmp_path / "no-cert.pem", tmp_path / "no-key.pem"
    err = _serve_refused(
        tmp_path, 2, config=f"admin_tls_cert: {cert}\nadmin_tls_key: {key}\nadmin_token: t\n"
    )
    assert f"admin_tls_cert: cannot read {str(cert)!r}" in err


@pytest.mark.slow
def test_serve_with_an_unreachable_ray_address_is_one_line_exit_1(tmp_path):
    err = _serve_refused(tmp_path, 1, "--address", "127.0.0.1:1")
    assert "cannot reach a Ray cluster at '127.0.0.1:1'" in err


@pytest.mark.slow
def test_serve_with_an_empty_config_file_is_one_line_exit_2(tmp_path):
    err = _serve_refused(tmp_path, 2, config="# nothing but a comment\n")
    assert "is empty" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--num-cpus", "-1"],
        ["serve", "--num-cpus", "0"],
        ["status", "--timeout", "-1", "--address", "127.0.0.1:1"],
        ["partitions", "--timeout", "0", "--address", "127.0.0.1:1"],
    ],
)
def test_negative_cpu_counts_and_timeouts_are_usage_errors(argv):
    proc = dataplane(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("dataplane ")  # argparse's line
    assert "must be a positive" in proc.stderr
