import pytest
import torch

from fedloom.compress import Identity, PayloadError


def test_identity_round_trip_and_exact_size():
    x = torch.randn(101, generator=torch.Generator().manual_seed(0))
    c = Identity()
    p = c.encode(x)
    # header 8 + 101 float32 + the CRC-32C trailer 4 (on by default)
    assert isinstance(p, bytes) and len(p) == 8 + 4 * 101 + 4
    assert torch.equal(c.decode(p), x)
    bare = Identity(checksum=False).encode(x)
    assert len(bare) == 8 + 4 * 101 and bare[8:] == p[8:-4]  # the same body, no trailer


def test_identity_rejects_bad_payloads():
    c = Identity()
    p = c.encode(torch.ones(4))
    with pytest.raises(PayloadError, match="truncated header"):
        c.decode(p[:5])
    with pytest.raises(PayloadError, match="checksum mismatch"):
        c.decode(p[:-1])
    with pytest.raises(PayloadError, match="checksum mismatch"):
        c.decode(p + b"\0")
    bare = Identity(checksum=False)
    q = bare.encode(torch.ones(4))
    with pytest.raises(PayloadError, match="body has"):
        bare.decode(q[:-1])
    with pytest.raises(PayloadError, match="body has"):
        bare.decode(q + b"\0")
    with pytest.raises(PayloadError, match="magic"):
        c.decode(b"XX" + p[2:])
    with pytest.raises(PayloadError, match="codec"):
        bare.decode(q[:3] + b"\x07" + q[4:])
    with pytest.raises(PayloadError, match="checksum mismatch"):  # the CRC sees it first
        c.decode(p[:3] + b"\x07" + p[4:])


def test_in_place_payload_is_the_identity_payload():
    """InPlacePayload stands for ``Identity.encode(row)`` without building it: the
    same length (the bytes counted) and, built, the same bytes; decoding it into its
    own row copies nothing and into another vector gives the row's values; the
    coordinates counted are d. A checksum setting the receiver does not expect is
    refused as the bytes would be, and a row that is not float32 is refused."""
    from fedloom.compress import InPlacePayload, coordinates_sent

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 1001, generator=g)
    rows[1, 7] = 3.0e38  # huge but finite: the bytes carry it as it is
    for checksum in (True, False):
        comp = Identity(checksum)
        for row in rows:
            p = InPlacePayload(row, checksum)
            ref = comp.encode(row)
            assert len(p) == len(ref) and bytes(p) == ref
            assert coordinates_sent(p) == row.numel()
            ptr = row.data_ptr()
            assert comp.decode_into(p, row) is row and row.data_ptr() == ptr
            other = torch.empty_like(row)
            assert torch.equal(comp.decode_into(p, other), row)
            assert torch.equal(comp.decode(p), row)
        with pytest.raises(PayloadError, match="checksum"):
            Identity(not checksum).decode_into(InPlacePayload(rows[0], checksum),
                                               torch.empty(1001))
    with pytest.raises(PayloadError):  # a row of another size: the bytes' own check
        Identity().decode_into(InPlacePayload(rows[0], True), torch.empty(1000))
    with pytest.raises(ValueError, match="float32"):
        InPlacePayload(rows[0].double(), True)
