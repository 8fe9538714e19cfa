import pytest
import torch

from fedloom.compress import Identity, PayloadError


def test_identity_round_trip_and_exact_size():
    x = torch.randn(101, generator=torch.Generator().manual_seed(0))
    c = Identity()
    p = c.encode(x)
    assert isinstance(p, bytes) and len(p) == 8 + 4 * 101
    assert torch.equal(c.decode(p), x)


def test_identity_rejects_bad_payloads():
    c = Identity()
    p = c.encode(torch.ones(4))
    with pytest.raises(PayloadError, match="truncated header"):
        c.decode(p[:5])
    with pytest.raises(PayloadError, match="body has"):
        c.decode(p[:-1])
    with pytest.raises(PayloadError, match="body has"):
        c.decode(p + b"\0")
    with pytest.raises(PayloadError, match="magic"):
        c.decode(b"XX" + p[2:])
    with pytest.raises(PayloadError, match="codec"):
        c.decode(p[:3] + b"\x07" + p[4:])
