"""A token stream from the text files under a directory, the same on every run for the same files.

Files are those under ``root`` with one of ``suffixes`` (``site-packages`` / ``dist-packages``
folders are skipped: installed packages differ between machines), shuffled by ``seed`` and read
until ``max_bytes``; each file is encoded with the presets' byte-level tokenizer and followed by
the eos id. Undecodable bytes are replaced (the byte tokenizer encodes any text).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from helixserve.models.tokenizer_hf import build_byte_tokenizer

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class CorpusError(ValueError):
    """The training text cannot be read (no such directory, no matching file, too little text)."""


def text_files(root: str | Path, suffixes: Sequence[str]) -> list[Path]:
    """Every file under ``root`` ending in one of ``suffixes``, sorted, outside :data:`SKIPPED_DIRS`."""
    base = Path(root)
    if not base.is_dir():
        raise CorpusError(f"--train-on {root}: not a directory")
    return sorted(p for p in base.rglob("*")
                  if p.suffix in suffixes and p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(base).parts))


def corpus_tokens(root: str | Path, suffixes: Sequence[str], max_bytes: int, eos_token_id: int,
                  seed: int) -> torch.Tensor:
    """``[N]`` int64 token ids of up to ``max_bytes`` of text under ``root`` (see the module docstring)."""
    files = text_files(root, suffixes)
    if not files:
        raise CorpusError(f"--train-on {root}: no file ending in {list(suffixes)}")
    random.Random(seed).shuffle(files)
    tokenizer = build_byte_tokenizer()
    ids: list[int] = []
    num_bytes = num_files = 0
    for path in files:
        if num_bytes >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - num_bytes]
        num_bytes += len(data)
        num_files += 1
        ids.extend(tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids)
        ids.append(eos_token_id)
    logger.info("training corpus: %d files, %d bytes, %d tokens from %s", num_files, num_bytes, len(ids), root)
    return torch.tensor(ids, dtype=torch.int64)
