"""The core imports without Ray, checked where it counts: in a fresh interpreter.

The core is what must run with no Ray at all: the key space and what the controller
builds on it (journal, checkpoints, recovery, retention), a storage unit's store, the
in-process client, and the client's wire vocabulary and data model. import-linter forbids ``ray`` in these modules
(pyproject.toml), but it reads import statements only: it cannot see what a
package's ``__init__`` does when it runs, which is how the key space once loaded
Ray through ``dataplane_client/__init__.py``. So each module here is imported for
real, and ``sys.modules`` decides.

The server's share of the core is exactly the folder ``dataplane_server/core/``
(checked below), so the tree shows what runs without Ray.

Not core, because they call Ray itself: dataplane_client.client and the
``dataplane_client/transport/`` folder (the Ray client and its bulk-data path), and the
service's actor shells and their callers in ``dataplane_server/controller/``,
``dataplane_server/unit/`` and ``dataplane_server/launch/``, with the operations surface
above them (admin, cli).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CORE_MODULES = (
    # the controller's pure parts
    "dataplane_server.core.keyspace",
    "dataplane_server.core.claim_policies",
    "dataplane_server.core.columns",
    "dataplane_server.core.journal",
    "dataplane_server.core.claim_answers",
    "dataplane_server.core.unit.arena",
    "dataplane_server.core.checkpoint",
    "dataplane_server.core.file_digest",
    "dataplane_server.core.recovery",
    "dataplane_server.core.recovery_messages",
    "dataplane_server.core.retention",
    "dataplane_server.core.unit_calls",
    "dataplane_server.core.in_flight",
    "dataplane_server.core.inprocess",
    "dataplane_server.core.stats",
    "dataplane_server.core.views",
    "dataplane_server.core.staleness",
    "dataplane_server.core.staleness_journal",
    "dataplane_server.core.steps",
    "dataplane_server.core.partial_rollouts",
    "dataplane_server.core.async_rl",
    "dataplane_server.core.group_deadline",
    "dataplane_server.core.claim_wait",
    # a storage unit's bytes (the actor around them is not core)
    "dataplane_server.core.unit.store",
    "dataplane_server.core.unit.partition",
    "dataplane_server.core.unit.leases",
    "dataplane_server.core.unit.undo",
    "dataplane_server.core.unit.groups",
    "dataplane_server.core.unit.chunk_files",
    "dataplane_server.core.unit.row_log",
    "dataplane_server.core.unit.durable_layout",
    "dataplane_server.core.unit.checkpoint",
    "dataplane_server.core.unit.segment_file",
    "dataplane_server.core.unit.preview",
    "dataplane_server.core.unit.warm_reserve",
    # the client's vocabulary and data model
    "dataplane_client.transport.admission",
    "dataplane_client.wire.arguments",
    "dataplane_client.codec.assembly",
    "dataplane_client.wire.atomic_dir",
    "dataplane_client.batching.batched_data_dict",
    "dataplane_client.wire.byte_format",
    "dataplane_client.wire.tag_filters",
    "dataplane_client.transport.call_batcher",
    "dataplane_client.transport.claim_batcher",
    "dataplane_client.codec.fields",
    "dataplane_client.wire.encoded",
    "dataplane_client.wire.config",
    "dataplane_client.codec.devices",
    "dataplane_client.wire.enum_codes",
    "dataplane_client.wire.errors",
    "dataplane_client.wire.failpoints",
    "dataplane_client.interface",
    "dataplane_client.batching.materialize",
    "dataplane_client.wire.messages",
    "dataplane_client.wire.meta",
    "dataplane_client.wire.object_columns",
    "dataplane_client.batching.packing",
    "dataplane_client.wire.parallel_copy",
    "dataplane_client.transport.placement",
    "dataplane_client.codec.prepare",
    "dataplane_client.wire.group_fields",
    "dataplane_client.batching.preshard",
    "dataplane_client.codec.quiet",
    "dataplane_client.wire.shm",
    "dataplane_client.codec.tensordict_io",
    "dataplane_client.wire.version",
)

# Imports each module in turn and names the first after whose import Ray is loaded
# (it, or something it imports, brought Ray in). One interpreter for all: seconds, not
# one each.
_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    if "ray" in sys.modules:
        print(json.dumps(name))
        break
else:
    print(json.dumps(None))
"""


def _first_to_load_ray(modules: list[str]) -> str | None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_core_modules_import_without_ray():
    # The package alone first (every `import dataplane_client.<x>` runs its __init__),
    # and the Ray client last, as the control: a probe that never notices Ray must fail.
    control = "dataplane_client.client"
    first = _first_to_load_ray(["dataplane_client", *CORE_MODULES, control])
    assert first == control, f"{first} loads Ray"


def test_the_packages_public_names_still_resolve():
    import dataplane_client
    from dataplane_client import (
        DataPlaneClient,
        DataPlaneConfig,
        KVBatchMeta,
        RayDataPlaneClient,
        client,
        connect,
        interface,
    )
    from dataplane_client.wire import config, meta

    assert connect is client.connect
    assert RayDataPlaneClient is client.RayDataPlaneClient
    assert DataPlaneConfig is config.DataPlaneConfig
    assert DataPlaneClient is interface.DataPlaneClient
    assert KVBatchMeta is meta.KVBatchMeta
    assert set(dataplane_client.__all__) <= set(dir(dataplane_client))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = dataplane_client.not_a_name


def test_import_linter_forbids_ray_in_exactly_the_core():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [
        c
        for c in config["contracts"]
        if c["type"] == "forbidden" and c["forbidden_modules"] == ["ray"]
    ]
    assert sorted(contract["source_modules"]) == sorted(CORE_MODULES)


def test_the_core_folder_is_exactly_the_servers_core_modules():
    core = ROOT / "dataplane_server" / "core"
    listed = {name for name in CORE_MODULES if name.startswith("dataplane_server.")}
    in_folder = {"dataplane_server.core." + path.stem for path in core.glob("*.py")}
    in_folder.discard("dataplane_server.core.__init__")
    for package in (p.parent for p in core.glob("*/__init__.py")):
        name = f"dataplane_server.core.{package.name}"
        if name in listed:  # a package listed whole (claim_policies)
            in_folder.add(name)
        else:  # a folder whose modules are listed one by one (unit/)
            in_folder.update(
                f"{name}.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__"
            )
    assert in_folder == listed
