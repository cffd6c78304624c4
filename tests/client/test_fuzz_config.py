"""Bad input to the config loader: random keys and values, environment strings and YAML
files give a valid config or a ConfigError (also a ValueError), never anything else.

A config that loads survives its own round trip (``from_dict(to_dict())``), so what
is sent to the actors is what was validated. Inputs tried per surface are printed.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_client.wire.config import DataPlaneConfig, env_var
from dataplane_client.wire.errors import ConfigError

# Fuzzing runs many examples: the full suite, not make test-fast.
pytestmark = pytest.mark.slow

FIELDS = list(DataPlaneConfig.model_fields)
# Fields declared without constraints: their environment variable hits the bug below.
UNCONSTRAINED = [n for n, info in DataPlaneConfig.model_fields.items() if not info.metadata]
CONSTRAINED = [n for n in FIELDS if n not in UNCONSTRAINED]
TRIED: Counter = Counter()
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True, scope="module")
def _report_counts():
    saved = {name: os.environ.pop(env_var(name)) for name in FIELDS if env_var(name) in os.environ}
    yield
    os.environ.update(saved)
    print(f"\nconfig fuzz inputs tried per surface: {dict(TRIED)}")


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=8),
    st.sampled_from(["16GiB", "0", "-1", "1.5GiB", "4G", "nan", "inf", "1e3", " 7 ", "0x10"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.one_of(
    st.sampled_from(FIELDS),
    st.text(max_size=24),
    st.sampled_from([f.upper() for f in FIELDS] + [f + "_" for f in FIELDS]),
)
raw_keys = st.one_of(keys, st.integers(), st.none(), st.tuples(st.text(max_size=3)))


def _loads_or_config_error(build) -> DataPlaneConfig | None:
    try:
        cfg = build()
    except ConfigError as e:
        refused: ConfigError | None = e
    else:
        refused = None
    if refused is not None:
        assert isinstance(refused, ValueError)
        assert str(refused)  # says what was wrong
        return None
    assert isinstance(cfg, DataPlaneConfig)
    assert DataPlaneConfig.from_dict(cfg.to_dict()) == cfg
    for name, value in cfg.to_dict().items():  # nothing non-finite slipped through
        if isinstance(value, float):
            assert math.isfinite(value), name
    return cfg


@SETTINGS
@given(st.dictionaries(keys, values, max_size=5))
def test_from_dict_with_random_keys_and_values_is_a_config_or_config_error(raw):
    TRIED["from_dict"] += 1
    _loads_or_config_error(lambda: DataPlaneConfig.from_dict(raw))


@SETTINGS
@given(st.one_of(values, st.dictionaries(raw_keys, values, max_size=3)))
def test_from_dict_of_anything_is_a_config_or_config_error(raw):
    TRIED["from_dict_any"] += 1
    _loads_or_config_error(lambda: DataPlaneConfig.from_dict(raw))


@SETTINGS
@given(st.sampled_from(CONSTRAINED), st.text(max_size=30))
def test_an_environment_variable_of_any_text_is_a_config_or_config_error(field, text):
    TRIED["environment"] += 1
    os.environ[env_var(field)] = text.replace("\x00", "")  # the OS refuses NUL in env values
    try:
        _loads_or_config_error(DataPlaneConfig)
    finally:
        del os.environ[env_var(field)]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=80).map(lambda b: b.decode("latin-1"))))
def test_a_config_file_of_any_text_is_a_config_or_config_error(text):
    TRIED["config_file"] += 1
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        _loads_or_config_error(lambda: DataPlaneConfig.from_file(f.name))


@pytest.mark.parametrize(
    ("field", "text", "want"),
    [
        ("admin_enabled", "false", False),
        ("metrics_enabled", "true", True),
        ("journal_fsync", "1", True),
        ("admin_token_for_reads", "0", False),
        ("controller_state_dir", "/tmp/journal", "/tmp/journal"),
        ("admin_enabled", "maybe", None),  # None: a ConfigError is expected
    ],
)
def test_an_environment_variable_of_an_unconstrained_field_is_read(field, text, want):
    assert field in UNCONSTRAINED
    os.environ[env_var(field)] = text
    try:
        cfg = _loads_or_config_error(DataPlaneConfig)
    finally:
        del os.environ[env_var(field)]
    assert (None if cfg is None else getattr(cfg, field)) == want
