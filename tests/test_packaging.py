"""The wheel as pip builds it: what it installs and what it makes users download."""

from __future__ import annotations

import email.parser
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Only the demo and the benchmarks use these; a plain install must not pull them.
NOT_CORE = {"transformers", "tqdm", "psutil", "matplotlib"}
# Package data a user of the wheel needs: the admin API schema, the example config
# and the PEP 561 marker that makes type checkers read the client's annotations.
PACKAGE_DATA = {
    "dataplane_server/admin/proto/dataplane/admin/v1/admin.proto": ROOT
    / "proto/dataplane/admin/v1/admin.proto",
    "dataplane_server/examples/dataplane.example.yaml": ROOT / "deploy/dataplane.example.yaml",
    "dataplane_client/py.typed": ROOT / "dataplane_client/py.typed",
}


def _requirement_name(req: str) -> str:
    return req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # Built from a copy of the files git would ship, so a stale build/ in the checkout
    # (setuptools reuses it) cannot add packages the current configuration excludes.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            # Links stay links (relative ones resolve inside the copy), so the build meets
            # the package's link to proto/ as a build from the checkout does.
            shutil.copy2(ROOT / name, src / name, follow_symlinks=False)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = out.glob("rl_dataplane-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.slow
def test_wheel_installs_only_our_packages(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    packages = {t for t in top_level if not t.endswith(".dist-info")}
    assert packages == {"dataplane_client", "dataplane_server", "policy_workers"}
    assert "dataplane_server/admin_pb/admin_pb2.py" in wheel.namelist()


@pytest.mark.slow
def test_core_dependencies_are_lean_and_extras_hold_the_rest(wheel):
    [meta_name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.parser.Parser().parsestr(wheel.read(meta_name).decode())
    requires = meta.get_all("Requires-Dist")
    core = {_requirement_name(r) for r in requires if "extra ==" not in r}
    assert not core & NOT_CORE, f"core install pulls {sorted(core & NOT_CORE)}"
    assert {"pydantic", "PyYAML", "prometheus-client", "grpcio"} <= core

    def extra(name: str) -> set[str]:
        return {_requirement_name(r) for r in requires if f'extra == "{name}"' in r}

    assert {"transformers", "tqdm"} <= extra("demo")
    assert {"psutil", "matplotlib"} <= extra("bench")
    assert set(meta.get_all("Provides-Extra")) >= {"demo", "bench", "dev"}


@pytest.mark.slow
def test_wheel_metadata_points_at_no_file_outside_the_package(wheel):
    # The long description is README.md: a "../" path in it names a file next to the
    # checkout it was written in, which neither a clone nor an installed wheel has.
    [meta_name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = wheel.read(meta_name).decode()
    title = (ROOT / "README.md").read_text().splitlines()[0]
    assert title in meta  # the README is the long description
    assert "../" not in meta


@pytest.mark.slow
def test_wheel_ships_the_proto_the_example_config_and_py_typed(wheel):
    names = set(wheel.namelist())
    missing = sorted(set(PACKAGE_DATA) - names)
    assert not missing, f"the wheel lacks {missing}"
    for name, source in PACKAGE_DATA.items():
        assert wheel.read(name) == source.read_bytes(), f"{name} differs from {source}"


def test_deploy_example_config_is_the_packaged_one():
    # One source of truth: deploy/ links to the file the wheel ships.
    linked = ROOT / "deploy/dataplane.example.yaml"
    assert linked.is_symlink()
    assert linked.resolve() == (ROOT / "dataplane_server/examples/dataplane.example.yaml").resolve()


def test_packaged_proto_is_the_top_level_one():
    # One source of truth: the package links to proto/, the file `make proto` compiles.
    linked = ROOT / "dataplane_server/admin/proto/dataplane/admin/v1/admin.proto"
    assert linked.is_symlink()
    assert linked.resolve() == (ROOT / "proto/dataplane/admin/v1/admin.proto").resolve()


def test_packaged_files_are_found_through_importlib_resources():
    from importlib import resources

    proto = resources.files("dataplane_server.admin") / "proto/dataplane/admin/v1/admin.proto"
    assert "service AdminService" in proto.read_text()
    example = resources.files("dataplane_server") / "examples/dataplane.example.yaml"
    assert "admin_port:" in example.read_text()


# Installed where nothing of the repo is on the path, with the extras' packages made
# unimportable in every process (a sitecustomize, so Ray's workers get it too).
_BLOCK_EXTRAS = """
import importlib.abc, sys

class _NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is an extra: the core install must not need it")
        return None

sys.meta_path.insert(0, _NoExtras())
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_wheel_without_extras_imports_and_serves(wheel, tmp_path):
    target, site = tmp_path / "installed", tmp_path / "site"
    site.mkdir()
    # psutil stays importable: Ray itself needs it (ray[default] installs it).
    blocked = sorted(NOT_CORE - {"psutil"})
    (site / "sitecustomize.py").write_text(_BLOCK_EXTRAS.format(blocked=blocked))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target]
        + [wheel.filename],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATAPLANE_", "RAY_ADDRESS", "RAY_AUTH_MODE", "PYTHONPATH"))
    }
    env["PYTHONPATH"] = f"{target}{os.pathsep}{site}"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import dataplane_client, dataplane_server, sys;"
            "print(dataplane_server.__file__); import transformers",
        ],  # fmt: skip
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.startswith(str(target)), probe.stdout + probe.stderr
    assert "is an extra" in probe.stderr  # the blocker is in force, so what follows proves it
    serve = subprocess.Popen(
        [sys.executable, "-m", "dataplane_server", "serve", "--num-cpus", "4"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        for line in serve.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("admin_address="):
                break
        assert seen, "serve printed nothing"
        assert seen[-1].startswith("admin_address=127.0.0.1:"), "\n".join(seen)
    finally:
        serve.send_signal(signal.SIGTERM)
        rest, _ = serve.communicate(timeout=120)
    assert serve.returncode == 0, "\n".join(seen) + rest
