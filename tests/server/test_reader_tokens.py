"""A same-node reader sends its process token to a unit once, then names it by key.

The token (an object the reader's process owns) is how a unit learns that a
reader died and releases its leases; sending the reference on every read costs
Ray borrower bookkeeping on the hot path. A unit that forgot the key (it
restarted, or saw too many readers since) answers ``ReaderUnknown`` and the
client sends the token itself again: no read fails for it.
"""

import pytest
import ray
import torch

from dataplane_client.wire import failpoints
from dataplane_client.wire.errors import InvalidBatch, ReaderUnknown
from dataplane_server.unit.reader_tokens import ReaderTokens

ROWS, ROW_FLOATS = 8, 64 * 1024  # 2 MiB a field: mapped and leased, not inline


def _remembered(handle) -> int:
    return ray.get(handle.units[0].holdings.remote()).reader_tokens


def test_a_token_is_remembered_by_key_and_the_least_recent_forgotten(ray_session):
    tokens = ReaderTokens(capacity=2)
    a, b, c = (ray.put(None) for _ in range(3))
    assert tokens.resolve([a]) is a
    assert tokens.resolve(a.binary()) is a
    assert tokens.resolve(None) is None
    tokens.resolve([b])
    tokens.resolve(a.binary())  # a is now the most recently seen
    tokens.resolve([c])  # over capacity: b goes
    with pytest.raises(ReaderUnknown):
        tokens.resolve(b.binary())
    assert tokens.resolve(a.binary()) is a
    tokens.forget({a})
    with pytest.raises(ReaderUnknown):
        tokens.resolve(a.binary())
    with pytest.raises(InvalidBatch, match="owner"):
        tokens.resolve("not a token")


def _rows(start: int) -> torch.Tensor:
    n = ROWS * ROW_FLOATS
    return torch.arange(start, start + n, dtype=torch.float32).reshape(ROWS, ROW_FLOATS)


def test_connect_introduces_the_process_so_its_first_read_names_its_token_by_key(unit):
    before = _remembered(unit)
    client = unit.client()
    # Before any read: the unit remembers the token, and the client knows it does.
    assert 0 in client._transport._token_sent
    assert _remembered(unit) == before + 1
    client.register_partition("intro", fields=["x"])
    client.put_samples([f"i{k}" for k in range(ROWS)], "intro", {"x": _rows(0)})
    got = client.get_samples([f"i{k}" for k in range(ROWS)], "intro", ["x"])["x"]
    assert torch.equal(got, _rows(0))
    assert _remembered(unit) == before + 1  # named by key: nothing more remembered


def test_reads_send_the_token_once_and_survive_a_unit_that_forgot_it(unit):
    writer, reader = unit.client(), unit.client()
    writer.register_partition("p", fields=["x"])
    first, second = [f"a{i}" for i in range(ROWS)], [f"b{i}" for i in range(ROWS)]
    writer.put_samples(first, "p", {"x": _rows(0)})
    reader._transport._token_sent.clear()  # as if connect's introduction went unanswered
    failpoints.arm(failpoints.READER_TOKENS_LOST)
    assert torch.equal(reader.get_samples(first, "p", ["x"])["x"], _rows(0))
    assert failpoints.fired(failpoints.READER_TOKENS_LOST) == 1
    assert 0 in reader._transport._token_sent  # its later reads name it by key
    assert torch.equal(reader.get_samples(first, "p", ["x"])["x"], _rows(0))
    assert _remembered(unit) == 1  # the reader's, sent by its first read

    failpoints.arm(failpoints.READER_TOKENS_LOST)  # as a restart of the unit would
    writer.put_samples(second, "p", {"x": _rows(1)})
    # Rows the reader has no route to: located by the controller, then read from the
    # unit, which answers ReaderUnknown to the key; the read sends the token itself.
    held = reader.get_samples(second, "p", ["x"])["x"]
    assert torch.equal(held, _rows(1))
    assert failpoints.fired(failpoints.READER_TOKENS_LOST) == 1
    assert _remembered(unit) == 1  # the reader's token, sent again
    assert ray.get(unit.units[0].holdings.remote()).read_leases, "the read holds its lease"


def test_a_malformed_read_request_is_refused_by_name(unit):
    with pytest.raises(InvalidBatch, match="read_request"):
        ray.get(unit.units[0].read_shm.remote(("p", ["a0"])))
