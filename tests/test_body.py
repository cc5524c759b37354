"""body.Inflater without sockets: output bounded by the limit whatever the ratio, pieces of any
size, gzip members, zlib and raw deflate, and malformed or cut streams as 400s."""

from __future__ import annotations

import gzip
import time
import zlib

import pytest

from gateway.web.body import Inflater, UnsupportedEncoding, _encoding
from gateway.errors import BadRequest, PayloadTooLarge

TEXT = b'{"model":"m","messages":[{"role":"user","content":"' + b"hello " * 500 + b'"}]}'


def _inflate(encoding: str, data: bytes, limit: int, piece: int) -> bytes:
    inf = Inflater(encoding, limit)
    out: list[bytes] = []
    for i in range(0, len(data), piece):
        out += inf.feed(data[i : i + piece])
    inf.end()
    return b"".join(out)


@pytest.mark.parametrize("piece", [1, 7, 1000, 1 << 20])
def test_gzip_and_deflate_inflate_fed_in_pieces_of_any_size(piece):
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert _inflate("gzip", gzip.compress(TEXT), 10_000, piece) == TEXT
    assert _inflate("x-gzip", gzip.compress(TEXT[:100]) + gzip.compress(TEXT[100:]), 10_000, piece) == TEXT  # two members
    assert _inflate("deflate", zlib.compress(TEXT), 10_000, piece) == TEXT
    assert _inflate("deflate", raw.compress(TEXT) + raw.flush(), 10_000, piece) == TEXT


def test_a_bomb_inflates_to_one_byte_past_the_limit_and_no_further():
    block = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = block.compress(b"\0" * (200 << 20)) + block.flush()  # 200 MiB from ~200 KB
    inf = Inflater("gzip", 1 << 20)
    t0 = time.perf_counter()
    with pytest.raises(PayloadTooLarge, match="inflates"):
        for i in range(0, len(bomb), 1 << 16):
            inf.feed(bomb[i : i + (1 << 16)])
    assert inf.size == (1 << 20) + 1
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize(
    ("encoding", "data"),
    [
        ("gzip", b"\x1f\x8b" + b"\0" * 8),  # a gzip header with an unknown method
        ("gzip", b"not gzip at all"),
        ("deflate", b"\xff\xff\xff\xff"),
        ("deflate", zlib.compress(TEXT) + b"tail"),  # data after the end of a deflate stream
        ("gzip", gzip.compress(TEXT, mtime=0) + b"\x1f\x8b junk"),  # a second member that is not one
    ],
)
def test_malformed_streams_are_400s(encoding, data):
    with pytest.raises(BadRequest) as exc:
        _inflate(encoding, data, 1 << 20, 64)
    assert exc.value.code == "invalid_content_encoding"


def test_a_cut_stream_is_a_400_at_its_end():
    with pytest.raises(BadRequest, match="cut short"):
        _inflate("gzip", gzip.compress(TEXT)[:-10], 1 << 20, 64)


@pytest.mark.parametrize(("header", "want"), [(None, None), ("", None), (" Identity ", None), ("GZIP", "gzip"), ("x-gzip", "x-gzip"),
                                              ("deflate", "deflate")])
def test_accepted_encodings(header, want):
    assert _encoding(header) == want


@pytest.mark.parametrize("header", ["br", "zstd", "compress", "gzip, gzip", "gzip;q=1", "*"])
def test_other_encodings_are_415(header):
    with pytest.raises(UnsupportedEncoding) as exc:
        _encoding(header)
    assert exc.value.status == 415 and exc.value.param == "Content-Encoding"


def test_a_body_of_more_gzip_members_than_clients_send_is_refused_at_the_first_one_over() -> None:
    """Each gzip member starts a decompressor in a Python loop: 200,000 empty members in 4 MiB
    cost the event loop ~15x an ordinary 4 MiB body (review helper's repro). Up to
    MAX_GZIP_MEMBERS are one body, as RFC 1952 says; one more is a 400."""
    import gzip

    from gateway.web.body import MAX_GZIP_MEMBERS

    ok = b"".join(gzip.compress(f"part{i};".encode(), mtime=0) for i in range(MAX_GZIP_MEMBERS))
    inf = Inflater("gzip", 1 << 20)
    assert b"".join(inf.feed(ok)) == b"".join(f"part{i};".encode() for i in range(MAX_GZIP_MEMBERS))
    inf.end()
    flood = gzip.compress(b"", mtime=0) * 200_000
    inf = Inflater("gzip", 4 << 20)
    with pytest.raises(BadRequest, match=f"more than {MAX_GZIP_MEMBERS} gzip members"):
        for i in range(0, len(flood), 65536):
            inf.feed(flood[i:i + 65536])


def test_the_body_budget_refuses_only_an_owner_over_its_share_once_the_budget_is_spent() -> None:
    from gateway.errors import Unavailable
    from gateway.web.body import BodyBudget

    b = BodyBudget(100)
    b.take("mallory", 90)
    b.take("alice", 30)  # over the budget, but alice holds less than her share (100 / 2)
    with pytest.raises(Unavailable) as exc:
        b.take("mallory", 1)  # 91 > 50
    assert exc.value.code == "overloaded" and exc.value.status == 503
    with pytest.raises(Unavailable):
        b.take("bob", 40)  # a third owner: 40 > 100 / 3
    b.give("mallory", 90)
    b.take("bob", 40)  # under the budget again
    b.give("alice", 30)
    b.give("bob", 40)
    assert b.total == 0 and b.held == {}
