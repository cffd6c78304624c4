"""One local Ray on loopback for the whole test session, plus a data-plane service.

RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 must be set before Ray starts so it binds
127.0.0.1 instead of the machine's external address.
"""

import contextlib
import os
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Set before Ray starts, so every actor sees it (dataplane_client/wire/failpoints.py).
os.environ.setdefault("RL_DATAPLANE_FAILPOINTS", tempfile.mkdtemp(prefix="dataplane-failpoints-"))

import pytest

RAY_NUM_CPUS = 8  # logical: actors need slots even when idle; the machine has 2 cores


def pytest_collection_modifyitems(items):
    """Mark every test that needs the session's Ray as `ray`, so `make test-fast` can skip them."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from dataplane_server.launch.local_ray import init_local_ray

    init_local_ray(RAY_NUM_CPUS, namespace="dataplane-tests", object_store_memory=2 << 30)
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def _services(**defaults):
    """``make(prefix, **config)``: a service named ``prefix`` plus a unique suffix, with
    ``defaults`` and then ``config`` set; every one made is shut down on leaving."""
    import uuid

    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server import start

    handles = []

    def make(prefix: str, **config):
        settings = {"name": f"{prefix}-{uuid.uuid4().hex[:6]}", **defaults, **config}
        handles.append(start(DataPlaneConfig(**settings)))
        return handles[-1]

    try:
        yield make
    finally:
        for h in handles:
            h.shutdown()


@pytest.fixture
def service_factory(ray_session):
    """Fresh services for tests that break them (faults, health); all shut down after.

    ``make(prefix, **config)``: a uniquely named service, no warm reserve, a fast
    liveness watch; ``config`` overrides any of it.
    """
    with _services(unit_warm_reserve_bytes=0, liveness_interval_s=0.2) as make:
        yield make


@pytest.fixture(scope="module")
def module_services(ray_session):
    """``make(prefix, **config)``: a uniquely named service with ``config`` and nothing else
    set, kept for the test module (a start costs seconds here); all shut down after its
    last test."""
    with _services() as make:
        yield make


@pytest.fixture(scope="session")
def service(ray_session):
    """A data-plane service shared by the test session (tests use their own partitions)."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server import start

    handle = start(DataPlaneConfig(name="dp-tests", num_storage_units=2))
    yield handle
    handle.shutdown()


@pytest.fixture(scope="session")
def client(service):
    return service.client()


@pytest.fixture(scope="session")
def addr(service):
    """The session's service's admin endpoint."""
    return service.admin_address


@pytest.fixture(scope="module")
def unit(ray_session, request):
    """A service of its own for the test module (named after it): one storage unit, the
    one its tests watch (``unit.units[0]``), and no admin endpoint."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server import start

    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    name = "dp-" + module.replace("_", "-")
    handle = start(DataPlaneConfig(name=name, num_storage_units=1, admin_enabled=False))
    yield handle
    handle.shutdown()


@pytest.fixture
def admin_server(service):
    """``make(**config)``: an admin endpoint in this process over the session's service,
    started, on a free loopback port; ``config`` sets more (``admin_token=...``). Every one
    made is stopped after the test."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_server.admin.server import AdminServer
    from dataplane_server.admin.sources import ActorSources

    servers = []

    def make(**config):
        cfg = DataPlaneConfig(
            name=service.config.name, namespace=service.config.namespace, **config
        )
        servers.append(AdminServer(cfg, ActorSources(cfg.name, cfg.namespace)))
        servers[-1].start()
        return servers[-1]

    yield make
    for server in servers:
        server.stop(grace_s=0)


@pytest.fixture(params=[pytest.param("ray", marks=pytest.mark.ray), "in_process"])
def dp(request):
    """A client of each kind in turn: the session's Ray service's, then an in-process one
    (a test taking it runs on both, as code written against DataPlaneService does)."""
    from dataplane_server.core.inprocess import InProcessDataPlaneClient

    if request.param == "ray":
        c = request.getfixturevalue("service").client()
    else:
        c = InProcessDataPlaneClient()
    yield c
    c.close()
