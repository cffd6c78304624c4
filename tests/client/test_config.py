"""DataPlaneConfig: every bad value is a ConfigError naming its key; docs match the model."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import yaml

from dataplane_client.wire import parallel_copy
from dataplane_client.wire.config import DataPlaneConfig, env_var, parse_byte_size
from dataplane_client.wire.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FIELDS = list(DataPlaneConfig.model_fields)


@pytest.fixture(autouse=True)
def _no_dataplane_env(monkeypatch):
    # An operator's DATAPLANE_* variables must not leak into what these tests build.
    for name in FIELDS:
        monkeypatch.delenv(env_var(name), raising=False)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("admin_port", 70000),
        ("metrics_port", -1),
        ("admin_port", "50051"),  # strict: a quoted number is a mistake, not a port
        ("drain_timeout_s", -5),
        ("drain_timeout_s", float("nan")),
        ("stage_ttl_s", 0),  # 0 would reclaim staged bytes before their commit
        ("num_storage_units", "two"),
        ("num_storage_units", -1),  # 0 = one per alive node; below that is a mistake
        ("admin_enabled", "yes"),
        ("unit_capacity_bytes", "16 GiBs"),
        ("unit_capacity_bytes", "-4GiB"),
        ("unit_capacity_bytes", 1.5),
        ("unit_capacity_bytes", "1.5B"),
        ("admin_max_workers", 1),
        ("name", ""),
    ],
)
def test_bad_value_is_a_config_error_naming_key_and_value(key, value):
    with pytest.raises(ConfigError) as info:
        DataPlaneConfig.from_dict({key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value)
    assert info.value.fields == [key]
    assert isinstance(info.value, ValueError)


def test_unknown_key_names_it_and_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"'admin_prot'.*did you mean 'admin_port'"):
        DataPlaneConfig(admin_prot=50051)
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'; known keys: \["):
        DataPlaneConfig.from_dict({"zzz": 1})


def test_removed_extra_field_is_unknown():
    with pytest.raises(ConfigError, match="'extra'"):
        DataPlaneConfig(extra={})


def test_tls_cert_without_key_names_both():
    with pytest.raises(ConfigError) as info:
        DataPlaneConfig(admin_tls_cert="/tmp/cert.pem")
    assert info.value.fields == ["admin_tls_cert", "admin_tls_key"]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 << 30),
        ("512MiB", 512 << 20),
        ("4G", 4 * 10**9),
        ("4gb", 4 * 10**9),
        ("1.5GiB", 3 << 29),
        ("1024", 1024),
        (" 8 KiB ", 8192),
    ],
)
def test_byte_sizes_take_units(text, size):
    assert parse_byte_size(text) == size
    assert DataPlaneConfig(unit_capacity_bytes=text).unit_capacity_bytes == size


def test_ints_are_accepted_for_float_durations():
    assert DataPlaneConfig(drain_timeout_s=45).drain_timeout_s == 45.0


def test_environment_overrides_file_but_not_code(monkeypatch, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("metrics_port: 9000\nadmin_token: null\nname: from-file\n")
    monkeypatch.setenv("DATAPLANE_METRICS_PORT", "9464")  # env strings are parsed
    monkeypatch.setenv("DATAPLANE_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("DATAPLANE_UNIT_CAPACITY_BYTES", "1GiB")
    monkeypatch.setenv("DATAPLANE_NAMESPACE", "")  # empty = unset
    cfg = DataPlaneConfig.from_file(path)
    assert (cfg.metrics_port, cfg.admin_token, cfg.name) == (9464, "s3cret", "from-file")
    assert cfg.unit_capacity_bytes == 1 << 30
    assert cfg.namespace == "dataplane"
    assert DataPlaneConfig(metrics_port=1).metrics_port == 1  # code wins over env
    assert "s3cret" not in repr(cfg)  # the token stays out of logs


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DATAPLANE_ADMIN_PORT", "99999")
    with pytest.raises(ConfigError, match=r"DATAPLANE_ADMIN_PORT='99999'.*'admin_port'") as info:
        DataPlaneConfig()
    assert info.value.fields == ["admin_port"]


def test_round_trip_to_an_actor_ignores_the_receivers_environment(monkeypatch):
    # A complete dict (to_dict) names every key, so rebuilding it on a node with other
    # DATAPLANE_* variables keeps the sender's values; start() sends the object itself.
    sent = DataPlaneConfig(name="dp-x", unit_capacity_bytes="2GiB", admin_token="t").to_dict()
    monkeypatch.setenv("DATAPLANE_NAME", "other")
    received = DataPlaneConfig.from_dict(sent)
    assert received.name == "dp-x"
    assert received == pickle.loads(pickle.dumps(received))
    assert received.admin_token == "t"


def test_unknown_environment_variable_names_the_closest_key(monkeypatch):
    monkeypatch.setenv("DATAPLANE_UNIT_CAPACTIY_BYTES", "1GiB")
    with pytest.raises(ConfigError, match=r"DATAPLANE_UNIT_CAPACTIY_BYTES.*'unit_capacity_bytes'"):
        DataPlaneConfig()
    with pytest.raises(ConfigError) as info:  # every way of loading checks it, as for YAML
        DataPlaneConfig.from_dict({"name": "x"})
    assert info.value.fields == ["unit_capacity_bytes"]
    monkeypatch.setenv("DATAPLANE_UNIT_CAPACTIY_BYTES", "")  # empty = unset, as for a key
    DataPlaneConfig()


def test_the_clis_address_variable_is_not_a_config_key(monkeypatch):
    monkeypatch.setenv("DATAPLANE_ADMIN_ADDRESS", "127.0.0.1:50051")  # read by the CLI
    assert DataPlaneConfig().admin_port == 0


def test_copy_threads_come_from_the_config(monkeypatch):
    monkeypatch.setattr(parallel_copy, "_config", None)
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "3")  # no config given: the environment's
    assert DataPlaneConfig().copy_threads == 3
    assert parallel_copy.threads() == 3
    parallel_copy.configure(DataPlaneConfig(copy_threads=2))  # a unit: its service's config
    assert parallel_copy.threads() == 2
    parallel_copy.configure(None)
    monkeypatch.setenv("DATAPLANE_COPY_THREADS", "0")
    with pytest.raises(ConfigError, match="DATAPLANE_COPY_THREADS='0'"):
        parallel_copy.threads()
    monkeypatch.delenv("DATAPLANE_COPY_THREADS")
    assert DataPlaneConfig().copy_threads is None
    assert 1 <= parallel_copy.threads() <= 4


def test_the_controller_runs_with_the_config_object(service):
    # The controller reads its settings as attributes of the DataPlaneConfig start() gave
    # it (a dict would fail here): service_info reports three of them.
    info = service.client().service_info()
    assert (info.name, info.namespace) == (service.config.name, service.config.namespace)
    assert {unit.capacity_bytes for unit in info.units} == {service.config.unit_capacity_bytes}


def test_config_is_frozen():
    cfg = DataPlaneConfig()
    with pytest.raises(ValueError, match="frozen"):
        cfg.admin_port = 1


def test_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        DataPlaneConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("admin_port: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        DataPlaneConfig.from_file(bad)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a mapping, got list"):
        DataPlaneConfig.from_file(listing)
    typo = tmp_path / "typo.json"
    typo.write_text('{"drain_timeout": 5}')
    with pytest.raises(ConfigError, match="did you mean 'drain_timeout_s'"):
        DataPlaneConfig.from_file(typo)


def test_a_json_file_must_be_json_and_other_names_are_yaml(tmp_path):
    """A .json with a trailing comma was read as YAML (which takes it) and the service
    started; now a .json is strict JSON, and any other name is YAML."""
    refused = {
        "trailing.json": ('{"name": "x", "admin_port": 50051,}', "not valid JSON"),
        "yaml.json": ("name: x\n", "not valid JSON"),
        "bad.conf": ("name: [x\n", "not valid YAML"),
    }
    for name, (text, match) in refused.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=match) as e:
            DataPlaneConfig.from_file(path)
        assert str(path) in str(e.value)  # the typed error names the file
    read = {
        "good.json": '{"name": "loaded"}',
        "cfg.yml": "name: loaded\n",
        "c.YAML": "name: loaded",
        "dataplane": "name: loaded\n",  # a ConfigMap key mounted as a file
    }
    for name, text in read.items():
        (tmp_path / name).write_text(text)
        assert DataPlaneConfig.from_file(tmp_path / name).name == "loaded"


def test_every_field_has_a_description():
    for name, info in DataPlaneConfig.model_fields.items():
        assert info.description, name


def test_example_config_sets_every_field_with_a_comment():
    path = DEPLOY / "dataplane.example.yaml"
    cfg = DataPlaneConfig.from_file(path)
    assert cfg.admin_host == "127.0.0.1"  # the example keeps the safe default
    raw = yaml.safe_load(path.read_text())
    assert sorted(raw) == sorted(FIELDS), "the example must set every option"
    text = path.read_text()
    for name in FIELDS:  # each key is preceded by a comment line explaining it
        block = text[: text.index(f"\n{name}:")].rstrip().splitlines()
        assert block[-1].lstrip().startswith("#"), f"{name} has no comment above it"


def test_readme_table_lists_every_field_with_its_default():
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Configuration") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (.+) \|$", section, re.MULTILINE)
    assert [key for key, _, _ in rows] == FIELDS
    for key, default, meaning in rows:
        documented = getattr(DataPlaneConfig(**{key: yaml.safe_load(default)}), key)
        assert documented == DataPlaneConfig.model_fields[key].default, key
        # The table says what the model's own description says (one wording to keep).
        assert meaning.strip() == DataPlaneConfig.model_fields[key].description, key
