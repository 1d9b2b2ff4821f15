"""Training and held-out token streams from the text files under a directory, in a checkpoint's
own tokenizer; the same streams on every run for the same files and seed.

Files are those under ``root`` with one of ``suffixes``, outside :data:`SKIPPED_DIRS`
(``site-packages`` / ``dist-packages``: installed packages differ between machines). The held-out
files are a fixed share of them, chosen by a CRC-32 of their path relative to ``root`` (the same
files for any seed, and the files :func:`held_out_texts` gives a benchmark's prompts). Training
files are read in an order shuffled by ``seed`` until ``max_corpus_bytes``, held-out files in path
order until ``max_held_out_bytes``; each file's ids are followed by the eos id. A file that cannot be
read, is empty or holds a NUL byte (binary) is skipped; undecodable bytes are replaced.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from helixserve.models.tokenizer import HelixTokenizer
from helixserve.training.config import TrainingConfig

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CorpusError(ValueError):
    """The training text cannot be read (no such directory, no readable file, too little text)."""


@dataclass(frozen=True, slots=True)
class Corpus:
    """``train`` ``[N]`` and ``held_out`` ``[M]`` int64 token streams (``M`` may be 0)."""

    train: torch.Tensor
    held_out: torch.Tensor
    num_train_files: int
    held_out_files: list[str]


def text_files(root: str | Path, suffixes: Sequence[str]) -> list[Path]:
    """Every non-empty file under ``root`` ending in one of ``suffixes``, sorted, outside :data:`SKIPPED_DIRS`."""
    base = Path(root)
    if not base.exists():
        raise CorpusError(f"--train-on {root}: no such directory")
    if not base.is_dir():
        raise CorpusError(f"--train-on {root}: not a directory")
    return sorted(p for p in base.rglob("*") if p.suffix in suffixes and p.is_file() and p.stat().st_size > 0
                  and not SKIPPED_DIRS.intersection(p.relative_to(base).parts))


def split_files(root: str | Path, files: Sequence[Path], held_out_fraction: float) -> tuple[list[Path], list[Path]]:
    """``(train, held_out)``: the ``round(fraction * len(files))`` files (at least one when there
    are two or more and the fraction is > 0) of lowest CRC-32 of their relative path are held out."""
    if len(files) < 2 or held_out_fraction <= 0:
        return list(files), []
    count = min(len(files) - 1, max(1, round(held_out_fraction * len(files))))
    by_hash = sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p))
    held = set(by_hash[:count])
    return [p for p in files if p not in held], [p for p in files if p in held]


def read_file(path: Path, max_bytes: int) -> bytes | None:
    """Up to ``max_bytes`` of ``path``; None for a file that cannot be read, is empty or binary."""
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes)
    except OSError as exc:
        logger.warning("training corpus: skipping %s: %s", path, exc)
        return None
    return None if not data or b"\0" in data else data


def _texts(files: Sequence[Path], max_bytes: int) -> Iterator[str]:
    budget = max_bytes
    for path in files:
        if budget <= 0:
            return
        data = read_file(path, budget)
        if data is not None:
            budget -= len(data)
            yield data.decode("utf-8", errors="replace")


def encode_texts(texts: Iterator[str], tokenizer: HelixTokenizer, eos_token_id: int) -> tuple[torch.Tensor, int]:
    """``([N] int64 ids, files read)``: each text's ids, then ``eos_token_id``."""
    ids: list[int] = []
    count = 0
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(eos_token_id)
        count += 1
    return torch.tensor(ids, dtype=torch.int64), count


def load_corpus(root: str | Path, tokenizer: HelixTokenizer, eos_token_id: int, tc: TrainingConfig) -> Corpus:
    """The training and held-out streams of the text under ``root`` (see the module docstring;
    ``tc``'s ``suffixes``, ``held_out_fraction``, ``max_corpus_bytes``, ``max_held_out_bytes``, ``seed``)."""
    train_files, held_files = split_files(root, text_files(root, tc.suffixes), tc.held_out_fraction)
    random.Random(tc.seed).shuffle(train_files)
    train, num_train = encode_texts(_texts(train_files, tc.max_corpus_bytes), tokenizer, eos_token_id)
    if num_train == 0:
        raise CorpusError(f"--train-on {root}: no readable text file ending in {list(tc.suffixes)}")
    held_out, _ = encode_texts(_texts(held_files, tc.max_held_out_bytes), tokenizer, eos_token_id)
    logger.info("training corpus from %s: %d training files, %d tokens; %d held-out files, %d tokens",
                root, num_train, train.numel(), len(held_files), held_out.numel())
    return Corpus(train, held_out, num_train, [p.relative_to(root).as_posix() for p in held_files])


def held_out_texts(root: str | Path, tc: TrainingConfig) -> list[str]:
    """The held-out files' texts (path order, up to ``tc.max_held_out_bytes`` in all): prompts no
    training step saw."""
    _, held_files = split_files(root, text_files(root, tc.suffixes), tc.held_out_fraction)
    return list(_texts(held_files, tc.max_held_out_bytes))
