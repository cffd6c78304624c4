"""The wheel as pip builds it: what it installs and what it makes users download."""

from __future__ import annotations

import email.parser
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def _tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in filter(None, listed.split("\0")) if (ROOT / name).is_file()]


def _copy_of_the_source(src: Path) -> Path:
    """The files git would ship, copied: a stale build/ in the checkout (setuptools reuses
    it) cannot add what the current configuration excludes."""
    for name in _tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        # Links stay links (relative ones resolve inside the copy), so the build meets
        # the package's link to proto/ as a build from the checkout does.
        shutil.copy2(ROOT / name, src / name, follow_symlinks=False)
    return src


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tarfile.TarFile:
    src = _copy_of_the_source(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("sdist")
    build = "from setuptools import build_meta; import sys; build_meta.build_sdist(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = out.glob("rl_dataplane-*.tar.gz")
    return tarfile.open(path)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = _copy_of_the_source(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
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


@pytest.mark.slow
def test_the_sdist_holds_every_file_a_clone_has(sdist):
    # It lacked deploy/ (and docs/, tests/, ...): setuptools alone ships only the packages.
    names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = sorted(set(_tracked_files()) - names)
    assert missing == [], f"the sdist lacks {missing[:20]}"
    assert "deploy/kuberay-rayjob.yaml" in names


@pytest.mark.slow
def test_the_license_the_metadata_names_is_shipped(wheel, sdist):
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    [meta_name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.parser.Parser().parsestr(wheel.read(meta_name).decode())
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    [licensed] = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(licensed).decode() == text
    assert any(name.endswith("/LICENSE") for name in sdist.getnames())


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


@pytest.fixture(scope="module")
def installed_without_extras(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The wheel installed alone (``--target``), and an environment that sees only it."""
    tmp_path = tmp_path_factory.mktemp("installed")
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
    return target, env


@pytest.mark.slow
def test_demo_without_the_demo_extra_is_one_line_naming_it_before_starting_anything(
    installed_without_extras, tmp_path
):
    _, env = installed_without_extras
    demo = subprocess.run(
        [sys.executable, "-m", "dataplane_server", "demo", "--small"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert demo.stdout == ""  # nothing started: no Ray, no service, no table
    [line] = demo.stderr.strip().splitlines()
    assert "pip install 'rl-dataplane[demo]'" in line
    assert "transformers" in line


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_wheel_without_extras_imports_and_serves(installed_without_extras, tmp_path):
    target, env = installed_without_extras
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
        start_new_session=True,  # its Ray processes too go with the group if it hangs
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
        try:
            rest, _ = serve.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)  # no service left behind for later tests
            raise
    assert serve.returncode == 0, "\n".join(seen) + rest


def test_readme_pip_instructions_install_the_cpu_torch_before_the_package():
    # pip's default torch is the CUDA build (5.8 GB with its nvidia packages); installed
    # first from PyTorch's CPU index, it satisfies our torch>=2.4 and pip keeps it.
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Installing the package with pip") :]
    commands = [
        line.split("#")[0].strip()
        for line in section[: section.index("```", section.index("```bash") + 3)].splitlines()
        if line.startswith("pip install")
    ]
    cpu_torch = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    assert commands[0] == cpu_torch, commands
    assert commands[1:] == [
        "pip install rl-dataplane",
        "pip install 'rl-dataplane[demo]'",
        "pip install 'rl-dataplane[mooncake]'",
    ]
