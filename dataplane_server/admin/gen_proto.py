"""Regenerate ``dataplane_server/admin_pb`` from the AdminService proto.

The proto ships inside the package (``dataplane_server/admin/proto/dataplane/admin/v1/
admin.proto``), so an installed wheel holds the schema its generated code came from.

    python -m dataplane_server.admin.gen_proto           # rewrite the committed code
    python -m dataplane_server.admin.gen_proto --check   # exit 1 if it drifted

protoc writes ``from dataplane.admin.v1 import admin_pb2``; the generated code
lives in ``dataplane_server.admin_pb`` instead, so that import is rewritten to a
package-relative one. Needs grpcio-tools (a dev dependency).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# The include root: the file's path below it is the name compiled into the descriptor
# ("dataplane/admin/v1/admin.proto"), which reflection serves and grpcurl shows.
PROTO_ROOT = Path(__file__).resolve().parent / "proto"
PROTO_FILE = "dataplane/admin/v1/admin.proto"
PROTO_PATH = PROTO_ROOT / PROTO_FILE
OUT_DIR = Path(__file__).resolve().parents[1] / "admin_pb"
GENERATED = ("__init__.py", "admin_pb2.py", "admin_pb2_grpc.py")

_INIT = '''"""Generated from dataplane_server/admin/proto/dataplane/admin/v1/admin.proto; do not edit.

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


def drifted(committed_dir: Path = OUT_DIR) -> list[str]:
    """Names of the generated files whose committed bytes differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as fresh:
        generate(Path(fresh))
        return [
            name
            for name in GENERATED
            if not (committed_dir / name).exists()
            or (committed_dir / name).read_bytes() != (Path(fresh) / name).read_bytes()
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
