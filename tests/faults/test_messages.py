"""Hostile messages decoded: duplicate keys (item 9)."""

from __future__ import annotations

import pytest

from migd.api import PingRequest, decode_request
from migd.errors import ProtocolError


@pytest.mark.parametrize(
    "line",
    [
        b'{"version":1,"op":"ping","op":"reload"}',
        b'{"version":1,"version":1,"op":"ping"}',
        b'{"version":1,"op":"report","lease_id":"L1","event":"note","data":{"a":1,"a":2}}',
    ],
)
def test_a_key_named_twice_is_refused(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="more than once"):
        decode_request(line)


def test_distinct_keys_still_decode() -> None:
    assert isinstance(decode_request(b'{"version":1,"op":"ping","id":7}'), PingRequest)
