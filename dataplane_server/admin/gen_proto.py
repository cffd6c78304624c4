"""Regenerate ``dataplane_server/admin_pb`` from the AdminService proto.

The source is the repository's top-level ``proto/dataplane/admin/v1/admin.proto``;
``dataplane_server/admin/proto/dataplane/admin/v1/admin.proto`` is a symbolic link to
it, so the wheel ships the schema its generated code came from (setuptools copies
the file the link names).

    python -m dataplane_server.admin.gen_proto           # rewrite the committed code
    python -m dataplane_server.admin.gen_proto --check   # exit 1 if it drifted

protoc writes ``from dataplane.admin.v1 import admin_pb2``; the generated code
lives in ``dataplane_server.admin_pb`` instead, so that import is rewritten to a
package-relative one.

The committed code comes from one pinned generator, ``GENERATOR`` (run through
``make proto``, which installs it into a venv of its own): grpcio-tools 1.62.3,
the last release whose output carries no runtime version gate (later ones
write ``ValidateProtobufRuntimeVersion`` / ``GRPC_GENERATED_VERSION`` checks
that would force protobuf >= their own version on every user). That is what
lets pyproject ask only for grpcio >= 1.62.3 and protobuf >= 4.21.6, the
floors ``tests/project/test_dependency_floor.py`` installs and runs the admin tests on.
Any grpcio-tools can run ``--check``: with another version it compares the
compiled schema, not the text.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
from pathlib import Path

# The include root, the repository's top-level proto/: the file's path below it is the
# name compiled into the descriptor ("dataplane/admin/v1/admin.proto"), which reflection
# serves and grpcurl shows.
PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
PROTO_FILE = "dataplane/admin/v1/admin.proto"
PROTO_PATH = PROTO_ROOT / PROTO_FILE
OUT_DIR = Path(__file__).resolve().parents[1] / "admin_pb"
GENERATED = ("__init__.py", "admin_pb2.py", "admin_pb2_grpc.py")
GENERATOR = "grpcio-tools==1.62.3"

_INIT = '''"""Generated from proto/dataplane/admin/v1/admin.proto; do not edit.

Regenerate with: python -m dataplane_server.admin.gen_proto
"""
'''
_ABSOLUTE_IMPORT = "from dataplane.admin.v1 import admin_pb2 as"
_RELATIVE_IMPORT = "from . import admin_pb2 as"


def generate(out_dir: Path) -> list[Path]:
    """Compile the proto into ``out_dir`` (created if missing); return the files written."""
    from importlib import resources

    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            PROTO_FILE,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        produced = Path(raw) / Path(PROTO_FILE).parent
        pb2 = (produced / "admin_pb2.py").read_text()
        grpc_code = (produced / "admin_pb2_grpc.py").read_text()
    if _ABSOLUTE_IMPORT not in grpc_code:
        raise RuntimeError(f"expected {_ABSOLUTE_IMPORT!r} in protoc's output; did protoc change?")
    grpc_code = grpc_code.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT)
    written = []
    for name, text in (
        ("__init__.py", _INIT),
        ("admin_pb2.py", pb2),
        ("admin_pb2_grpc.py", grpc_code),
    ):
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    return written


def _tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def schema_of(pb2_text: str) -> bytes | None:
    """The serialized FileDescriptorProto an ``admin_pb2.py`` registers (None: none found)."""
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2_text)
    return ast.literal_eval(match.group(1)) if match else None


def methods_of(grpc_text: str) -> list[str]:
    """The RPC paths an ``admin_pb2_grpc.py`` wires, sorted."""
    return sorted(set(re.findall(r"'(/dataplane\.admin\.v1\.AdminService/\w+)'", grpc_text)))


def _same(name: str, committed: Path, fresh: Path, exact: bool) -> bool:
    if not committed.exists():
        return False
    if exact or name == "__init__.py":
        return committed.read_bytes() == fresh.read_bytes()
    # Another generator formats differently: compare what the code means instead.
    old, new = committed.read_text(), fresh.read_text()
    if name == "admin_pb2.py":
        return schema_of(old) == schema_of(new)
    return methods_of(old) == methods_of(new)


def drifted(committed_dir: Path = OUT_DIR) -> list[str]:
    """Names of the generated files that no longer match the proto.

    Byte for byte under the pinned generator; under any other grpcio-tools, the
    compiled schema and the RPC paths (so ``--check`` works in every dev venv).
    """
    exact = f"grpcio-tools=={_tools_version()}" == GENERATOR
    with tempfile.TemporaryDirectory() as fresh:
        generate(Path(fresh))
        return [
            name
            for name in GENERATED
            if not _same(name, committed_dir / name, Path(fresh) / name, exact)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dataplane_server.admin.gen_proto")
    parser.add_argument(
        "--out", type=Path, default=OUT_DIR, help=f"output folder (default {OUT_DIR})"
    )
    parser.add_argument("--check", action="store_true", help="only report drift; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted(args.out)
        if stale:
            print(f"generated code drifted from {PROTO_FILE}: {stale}; run {parser.prog}")
            return 1
        print("generated code is up to date")
        return 0
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
