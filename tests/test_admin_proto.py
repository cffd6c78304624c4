"""The committed generated code in dataplane_server/admin_pb matches proto/ (no drift).

Fix a failure with: python -m dataplane_server.admin.gen_proto
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("grpc_tools")

from dataplane_server.admin import gen_proto

FIX = "regenerate with: python -m dataplane_server.admin.gen_proto"


def _generated_version(text: str) -> str | None:
    found = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    return found.group(1) if found else None


def _descriptor(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("DESCRIPTOR = ")]
    return line


def test_generated_code_matches_the_proto(tmp_path):
    gen_proto.generate(tmp_path)
    committed = {n: (gen_proto.OUT_DIR / n).read_text() for n in gen_proto.GENERATED}
    fresh = {n: (tmp_path / n).read_text() for n in gen_proto.GENERATED}
    tools = _generated_version(fresh["admin_pb2_grpc.py"])
    if tools == _generated_version(committed["admin_pb2_grpc.py"]):
        for name in gen_proto.GENERATED:
            assert (gen_proto.OUT_DIR / name).read_bytes() == (tmp_path / name).read_bytes(), (
                f"{name} drifted from the proto; {FIX}"
            )
    else:  # another grpcio-tools version formats differently: compare the schema itself
        assert _descriptor(committed["admin_pb2.py"]) == _descriptor(fresh["admin_pb2.py"]), (
            f"admin_pb2.py drifted from the proto; {FIX}"
        )


def test_generated_grpc_module_imports_its_sibling_relatively():
    text = (gen_proto.OUT_DIR / "admin_pb2_grpc.py").read_text()
    assert "from . import admin_pb2 as" in text
    assert "from dataplane.admin" not in text


def test_check_mode_reports_drift(tmp_path, capsys):
    gen_proto.generate(tmp_path)
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "admin_pb2.py").write_text("# edited by hand\n")
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 1
    assert "admin_pb2.py" in capsys.readouterr().out
