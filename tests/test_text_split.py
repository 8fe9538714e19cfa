"""``data.options.clients``: the ``text`` source's natural clients by role (the default) or
by play (issue #41 item 2), on fixture plays with the character tokenizer (no model, no
transformers)."""

import numpy as np
import pytest
import torch

from fedloom.config import ConfigError, DataConfig, load_config
from fedloom.data.shakespeare import encode_text, parse_play
from fedloom.data.sources import load_dataset
from fedloom.data.text import windows
from fedloom.report.compare import lower_is_better

PLAYS = {
    "a_gut.txt": {"Ham": "To be, or not to be, that is the question. " * 4,
                  "Oph": "Good my lord, how does your honour for this many a day? " * 3},
    "b_gut.txt": {"Lear": "Blow, winds, and crack your cheeks! rage! blow! " * 4,
                  "Fool": "Nuncle, give me an egg, and I'll give thee two crowns. " * 2,
                  "Kent": "Sir, I am too old to learn. " * 2},
    # too short for min_chars=300 as a play: no client under either split
    "c_gut.txt": {"Puck": "If we shadows have offended. " * 2},
}


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    d = tmp_path_factory.mktemp("plays")
    for name, roles in PLAYS.items():
        # one speech a block; each role speaks twice, so its lines are joined
        blocks = [f"{r}.\n{line}\n" for _ in range(2) for r, line in roles.items()]
        (d / name).write_text("A PLAY\n\n" + "\n".join(blocks))
    return str(d)


def dataset(plays, **text_keys):
    keys = {"seq_len": 8, "min_chars": 300, **text_keys}
    return load_dataset(DataConfig(name="text", options={"path": plays, **keys}), seed=0)


def role_windows(plays, name):
    """Each role's (x, y) windows of play ``name``, roles sorted (the split's order)."""
    roles = parse_play(open(f"{plays}/{name}").read())
    return {r: windows(encode_text(roles[r]), 8, 8) for r in sorted(roles)}


def test_play_split_is_one_client_per_play_with_every_roles_windows(plays):
    ds = dataset(plays, clients="play")
    assert sorted(set(ds.groups.tolist())) == [0, 1]  # a and b; c is under min_chars
    for k, name in enumerate(["a_gut.txt", "b_gut.txt"]):
        parts = list(role_windows(plays, name).values())
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        mine = ds.groups == k
        assert torch.equal(ds.x[mine], torch.from_numpy(x))
        assert torch.equal(ds.y[mine], torch.from_numpy(y))
    # no window spans two speakers: each is a window of one role's lines
    assert torch.equal(ds.x[:, 1:], ds.y[:, :-1])


def test_role_split_is_unchanged_one_client_per_role(plays):
    default, role = dataset(plays), dataset(plays, clients="role")
    assert torch.equal(default.x, role.x) and np.array_equal(default.groups, role.groups)
    # every role with min_chars characters, plays in order, roles sorted; the play split
    # with the same min_chars has fewer clients (whole plays)
    expect = [w for name in PLAYS for r, w in role_windows(plays, name).items()
              if len(parse_play(open(f"{plays}/{name}").read())[r]) >= 300]
    assert len(set(role.groups.tolist())) == len(expect) == 3
    assert torch.equal(role.x, torch.from_numpy(np.concatenate([w[0] for w in expect])))


def test_play_split_max_windows_spreads_over_the_play_and_max_clients(plays):
    parts = role_windows(plays, "b_gut.txt")
    full = np.concatenate([p[0] for p in parts.values()])
    ds = dataset(plays, clients="play", max_windows=5)
    b = ds.x[ds.groups == 1].numpy()
    assert len(b) == 5 and len(full) > 5
    # evenly spaced and in order: the play's first window (its first role's) and its
    # last (the last role's), not the first five
    assert len(full) == 87 and np.array_equal(b, full[[0, 22, 43, 64, 86]])
    two = dataset(plays, clients="play", max_clients=2, min_chars=1)
    assert set(two.groups.tolist()) == {0, 1}  # the first two plays, a and b
    assert torch.equal(two.x[two.groups == 1], torch.from_numpy(full))  # all of b's windows
    # min_chars counts the whole play: c qualifies as a play when the bar is lowered
    assert len(set(dataset(plays, clients="play", min_chars=100).groups.tolist())) == 3


def test_one_client_is_refused_and_an_unknown_split_is_one_line(plays):
    from fedloom.data.sources import DatasetUnavailable
    with pytest.raises(DatasetUnavailable, match="play"):
        dataset(plays, clients="play", max_clients=1)
    with pytest.raises(ConfigError, match=r"data\.options\.clients: must be one of"):
        load_config({"data": {"name": "text", "options": {"clients": "act"}}})


def test_perplexity_is_lower_is_better():
    # tuning on client_ppl_mean and the page's claims and plots read it this way
    for m in ("test_ppl", "client_ppl_mean", "client_ppl_worst10", "client_ppl_std"):
        assert lower_is_better(m)
    assert not lower_is_better("client_acc_worst10") and not lower_is_better("updates_applied")


def test_the_lora_suite_validates_without_its_model_file():
    # configs/llm/suite.yaml (docs/results/lora.md): every method x tuning point loads,
    # on the play split; the GGUF is read only when a run starts
    from pathlib import Path

    from fedloom.sweep import validate_suite
    from fedloom.sweep.suite import load_suite

    root = Path(__file__).resolve().parents[1]
    suite = load_suite(str(root / "configs/llm/suite.yaml"))
    assert validate_suite(suite) > 0
    cfg = load_config(str(root / "configs/llm/lora.yaml"))
    opts = cfg.model.options
    assert cfg.data.options["clients"] == "play"
    assert cfg.data.options["tokenizer"] == opts["gguf_file"]
    assert opts["lora"].r == 8 and opts["lora"].alpha == 16
