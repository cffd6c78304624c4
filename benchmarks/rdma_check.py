"""``make rdma-check``: Mooncake's transfer engine over RDMA beside its TCP path, where this
machine has a usable RDMA NIC; one line and exit 0 where it has none.

The probe: an InfiniBand/RoCE device under ``/sys/class/infiniband`` with a port whose
state is ACTIVE (what ``ibv_devinfo`` reports as PORT_ACTIVE; a device whose ports are
all down cannot carry a transfer). Without one it prints ``{"check": "rdma", "skipped":
why}`` and exits 0 at once (nothing is imported).

With one: the transfers a cross-node get makes (``dataplane_client/transport/payload/
mooncake.py``): a peer process registers ``--sizes`` bytes with its own engine, this
process pulls them into a registered buffer (``transfer_sync_read``), CRC-32C checked,
once over TCP and once over RDMA (``initialize(ip, "P2PHANDSHAKE", "rdma", device)``),
both with the P2P handshake, in the same run; medians of ``--repeats``. The data plane's
get moves its bytes over RDMA on such a machine (``cross_node_transport: auto``: Mooncake's
engine takes RDMA wherever it finds a device) unless ``tcp`` keeps it on TCP: the figures
say what each costs here. Published figures are printed beside ours
(``PUBLISHED``).

A table, then ONE JSON line (``--out`` writes it too). Exit 1 when bytes differ or a
transfer fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import GiB, MiB, markdown_table, median, parse_size

SYSFS = Path("/sys/class/infiniband")
DEFAULT_SIZES = (128 * MiB, GiB)
# What Mooncake's authors measured (their README, "Transfer Engine" > "Performance",
# github.com/kvcache-ai/Mooncake): 40 GB moved between two nodes.
PUBLISHED = [
    {
        "source": "github.com/kvcache-ai/Mooncake README, Transfer Engine performance",
        "network": "4x200 Gbps RoCE",
        "GB/s": 87,
        "vs TCP": "about 2.4x",
    },
    {
        "source": "github.com/kvcache-ai/Mooncake README, Transfer Engine performance",
        "network": "8x400 Gbps RoCE",
        "GB/s": 190,
        "vs TCP": "about 4.6x",
    },
]


def rdma_devices(root: Path = SYSFS) -> tuple[list[str], str]:
    """(devices with an ACTIVE port, why none when the list is empty)."""
    if not root.is_dir():
        return [], f"no RDMA device: {root} does not exist (no InfiniBand/RoCE driver loaded)"
    devices = sorted(p.name for p in root.iterdir())
    if not devices:
        return [], f"no RDMA device: {root} is empty"
    active = [
        d
        for d in devices
        if any("ACTIVE" in _read(port / "state") for port in (root / d / "ports").glob("*"))
    ]
    if not active:
        return [], f"no RDMA device with an active port (found {', '.join(devices)}, all down)"
    return active, ""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


PEER = """
import sys
import numpy as np
from benchmarks.rdma_check import start_engine
protocol, device, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = start_engine(protocol, device)
data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
assert engine.register_memory(data.ctypes.data, data.nbytes) == 0
from dataplane_client.transport.payload import checksum
print(engine.get_rpc_port(), data.ctypes.data, checksum.of(data.data), flush=True)
sys.stdin.read()  # held until the check closes our stdin
"""


def start_engine(protocol: str, device: str) -> Any:
    """An engine on loopback over ``protocol`` ("tcp", or "rdma" on ``device``). The engine
    picks its transport itself (RDMA wherever it finds a device: ``dataplane_client/
    transport/payload/mooncake.py``), so TCP is forced with ``MC_FORCE_TCP``, read as each
    engine starts; without it, the "tcp" leg would run over RDMA on a machine with a NIC."""
    from dataplane_client.transport.payload.mooncake import engine_environment

    if protocol == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
    engine_environment()
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, {protocol}, {device!r}): {rc}")
    return engine


def measure(protocol: str, device: str, nbytes: int, repeats: int) -> dict[str, Any]:
    """Pulls of ``nbytes`` from a peer process over ``protocol``: GiB/s (median) and
    whether every pull's bytes matched the peer's CRC-32C."""
    import numpy as np

    from dataplane_client.transport.payload import checksum

    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, protocol, device, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None
        port, addr, crc = (int(x) for x in peer.stdout.readline().split())
        engine = start_engine(protocol, device)
        buf = np.zeros(nbytes, dtype=np.uint8)
        assert engine.register_memory(buf.ctypes.data, nbytes) == 0
        session, seconds, intact = f"127.0.0.1:{port}", [], True
        for attempt in range(repeats + 1):  # the first sets up the connection: not timed
            buf[::4096] = 0
            t0 = time.perf_counter()
            rc = engine.transfer_sync_read(session, buf.ctypes.data, addr, nbytes)
            took = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"{protocol} pull of {nbytes} bytes returned {rc}")
            intact &= checksum.of(buf.data) == crc
            if attempt:
                seconds.append(took)
        engine.unregister_memory(buf.ctypes.data)
    finally:
        peer.kill()
        peer.wait(timeout=30)
    return {"GiB/s": nbytes / GiB / median(seconds), "seconds": seconds, "intact": intact}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="also write the JSON line here")
    p.add_argument(
        "--protocols",
        default="tcp,rdma",
        help="what to run where a NIC exists (tests run tcp alone with --device none)",
    )
    p.add_argument("--device", help="RDMA device (default: the first with an active port)")
    a = p.parse_args(argv)
    if a.device is None:
        devices, why = rdma_devices()
        if not devices:
            return _emit({"check": "rdma", "skipped": why}, a.out)
        a.device = devices[0]
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    protocols = a.protocols.split(",")
    rows, out = [], {"check": "rdma", "device": a.device, "results": [], "published": PUBLISHED}
    try:
        for nbytes in sizes:
            got = {proto: measure(proto, a.device, nbytes, a.repeats) for proto in protocols}
            for proto, r in got.items():
                out["results"].append({"protocol": proto, "bytes": nbytes, **r})
            tcp, rdma = got.get("tcp"), got.get("rdma")
            ratio = rdma["GiB/s"] / tcp["GiB/s"] if tcp and rdma else None
            rows.append(
                [
                    f"{nbytes / MiB:g} MiB",
                    *(f"{got[p]['GiB/s']:.2f}" for p in protocols),
                    "-" if ratio is None else f"{ratio:.1f}x",
                    "yes" if all(r["intact"] for r in got.values()) else "NO",
                ]
            )
    except Exception as e:  # noqa: BLE001 - reported in the JSON line, exit 1
        out["error"] = f"{type(e).__name__}: {e}"
    print(
        markdown_table(
            ["size", *(f"{p} GiB/s" for p in protocols), "rdma/tcp", "bytes intact"], rows
        )
    )
    print("published (Mooncake's README): 87 GB/s on 4x200 Gbps RoCE, 190 GB/s on 8x400 Gbps")
    ok = "error" not in out and all(r["intact"] for r in out["results"])
    _emit(out, a.out)
    return 0 if ok else 1


def _emit(result: dict, path: str | None) -> int:
    line = json.dumps(result)
    print(line, flush=True)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        Path(path).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
