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
