"""The committed generated code in dataplane_server/admin_pb matches the top-level proto/
(no drift), and carries no runtime version gate (what keeps the grpcio/protobuf floors low).

Fix a failure with: make proto
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from dataplane_server.admin import gen_proto

FIX = "regenerate with: make proto"
ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto():
    assert gen_proto.drifted() == [], FIX


def test_the_generator_compiles_the_top_level_proto():
    # The file developers edit, not the package's link to it: a drift check against a
    # stale copy would pass while the source moved on.
    assert gen_proto.PROTO_PATH == ROOT / "proto/dataplane/admin/v1/admin.proto"
    assert gen_proto.PROTO_PATH.is_file()
    assert not gen_proto.PROTO_PATH.is_symlink()
    assert gen_proto.OUT_DIR == ROOT / "dataplane_server/admin_pb"


def test_generated_grpc_module_imports_its_sibling_relatively():
    text = (gen_proto.OUT_DIR / "admin_pb2_grpc.py").read_text()
    assert "from . import admin_pb2 as" in text
    assert "from dataplane.admin" not in text


def test_committed_code_has_no_runtime_version_gate():
    # Newer generators write checks that refuse any runtime older than themselves;
    # pyproject's floors (grpcio 1.62.3, protobuf 4.21.6) hold only without them.
    pb2 = (gen_proto.OUT_DIR / "admin_pb2.py").read_text()
    grpc_code = (gen_proto.OUT_DIR / "admin_pb2_grpc.py").read_text()
    assert "ValidateProtobufRuntimeVersion" not in pb2, FIX
    assert "GRPC_GENERATED_VERSION" not in grpc_code, FIX


def test_check_mode_reports_drift(tmp_path, capsys):
    gen_proto.generate(tmp_path)
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "admin_pb2.py").write_text("# edited by hand\n")
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 1
    assert "admin_pb2.py" in capsys.readouterr().out


def test_a_schema_change_is_drift_under_any_generator(tmp_path, capsys, monkeypatch):
    # Under a grpcio-tools other than the pinned one the check compares meaning, not
    # text: a renamed field and a dropped RPC must both still count as drift.
    monkeypatch.setattr(gen_proto, "GENERATOR", "grpcio-tools==0.0.0")
    gen_proto.generate(tmp_path)
    assert gen_proto.drifted(tmp_path) == []
    pb2 = tmp_path / "admin_pb2.py"
    pb2.write_text(pb2.read_text().replace("restored_samples", "restored_sampleZ"))
    grpc_code = tmp_path / "admin_pb2_grpc.py"
    grpc_code.write_text(grpc_code.read_text().replace("AdminService/WatchStats", "AdminService/X"))
    assert gen_proto.drifted(tmp_path) == ["admin_pb2.py", "admin_pb2_grpc.py"]
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 1
    assert "admin_pb2.py" in capsys.readouterr().out
