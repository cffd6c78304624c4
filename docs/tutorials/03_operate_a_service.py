"""Tutorial 03: operating a service: serve, connect from another process, status,
checkpoint, restore, drain and stop.

Run it: ``.venv/bin/python docs/tutorials/03_operate_a_service.py`` (under a minute on
2 cores; most of it is Ray starting).

What an operator types, done from Python so it runs as a test:

1. ``dataplane serve --config dataplane.yaml --num-cpus 4`` runs the service in the
   foreground (here, a subprocess) on an embedded Ray on 127.0.0.1. It prints
   ``ray_address=``, ``admin_address=``, ``metrics_address=`` and the lines a trainer
   pastes to connect, including ``RAY_AUTH_MODE=token`` when Ray's token auth is on
   (Ray reads that variable when ``ray`` is first imported, so it is set first).
2. Another process (this script) joins with ``dataplane_client.connect(name,
   namespace, address=ray_address)`` and writes samples.
3. ``dataplane status --address ADMIN`` shows the service, its units and totals
   (the admin endpoint speaks gRPC: the CLI loads neither Ray nor torch).
4. ``dataplane checkpoint save DIR`` writes every partition, sample and cursor to
   ``DIR``; ``dataplane checkpoint restore DIR`` loads it into a service holding no
   partition (here the same one, after ``delete_partition``). A service with an
   ``admin_token`` needs ``--token`` for both.
5. SIGTERM (or Ctrl-C) drains: in-flight calls finish, then the service stops and
   ``serve`` exits 0 (with ``drain_checkpoint_dir`` set, after a last checkpoint).

Next: ``04_async_rl.py``, a rollout actor and a trainer sharing one store.
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

DATAPLANE = [sys.executable, "-m", "dataplane_server"]  # the `dataplane` command, same code
START_S = 180.0  # a cold Ray start on a loaded 2-core machine


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The process's output, line by line, read in a thread (so reads can have deadlines)."""
    lines: queue.Queue = queue.Queue()

    def pump(output: Iterable[str]) -> None:
        for line in output:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    return lines


def read_until(lines: queue.Queue, prefix: str, deadline: float) -> tuple[str, list[str]]:
    """The first line starting with ``prefix``, and every line before it."""
    seen: list[str] = []
    while True:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
        if line is None:
            raise RuntimeError("serve ended early:\n" + "\n".join(seen))
        if line.startswith(prefix):
            return line, seen
        seen.append(line)


def cli(*args: str) -> str:
    """Run one ``dataplane`` client command; its output (it exits non-zero on failure)."""
    done = subprocess.run([*DATAPLANE, *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"dataplane {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="tutorial-03-"))
    config = work / "dataplane.yaml"
    config.write_text("name: tutorial-03\nnamespace: tutorials\nunit_warm_reserve_bytes: 0\n")

    # 1. Serve (in a terminal: dataplane serve --config dataplane.yaml --num-cpus 4).
    serve = subprocess.Popen(
        [*DATAPLANE, "serve", "--config", str(config), "--num-cpus", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = lines_of(serve)
    try:
        deadline = time.monotonic() + START_S
        ray_address = read_until(lines, "ray_address=", deadline)[0].split("=", 1)[1]
        admin = read_until(lines, "admin_address=", deadline)[0].split("=", 1)[1]
        _, snippet = read_until(lines, "the embedded Ray listens", deadline)
        print(f"serving: ray {ray_address}, admin {admin}")

        # 2. Connect from this process, as the printed snippet says.
        if any("RAY_AUTH_MODE" in line for line in snippet):
            os.environ["RAY_AUTH_MODE"] = "token"  # before ray is imported (next line)
        import ray
        import torch

        import dataplane_client

        client = dataplane_client.connect("tutorial-03", "tutorials", address=ray_address)
        client.register_partition("kept", fields=["x"], consumer_tasks=["train"])
        client.put_samples(["a", "b", "c"], "kept", {"x": torch.arange(12.0).reshape(3, 4)})

        # 3. Status through the admin endpoint.
        print(cli("status", "--address", admin))

        # 4. Checkpoint, lose the partition, restore it, read it back.
        saved = work / "ckpt"
        print(cli("checkpoint", "save", str(saved), "--address", admin).strip())
        client.delete_partition("kept")
        print(cli("checkpoint", "restore", str(saved), "--address", admin).strip())
        meta = client.claim_meta("kept", "train", ["x"], batch_size=3)
        total = client.get_data(meta)["x"].sum().item()
        print(f"after restore: {sorted(meta.sample_ids)}, sum {total:g}")
        client.close()
        ray.shutdown()  # leave the cluster before it goes

        # 5. Drain and stop: SIGTERM, then serve says "dataplane: stopped" and exits 0.
        serve.send_signal(signal.SIGTERM)
        read_until(lines, "dataplane: stopped", time.monotonic() + 120)
        print("serve exited", serve.wait(timeout=60))
    finally:
        if serve.poll() is None:  # something above failed: do not leave the service behind
            serve.kill()
            serve.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
