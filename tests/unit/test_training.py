"""Training a small checkpoint on local text: the loss falls, the same seed gives byte-identical
weights (and another seed different ones), the checkpoint loads through ``LLM`` and generates,
and bad corpora are refused with the offending path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helixserve.cli import main
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.training.corpus import CorpusError, corpus_tokens, text_files
from helixserve.training.trainer import TRAINING_LOG, TrainingConfig, train_checkpoint

PRESET = "kimi-linear-tiny"
QUICK = TrainingConfig(steps=6, batch_size=2, seq_len=32, lr=1e-2, warmup_steps=2)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: bit-identical results need the same thread count, and the shared CI
    cores run a one-thread step fastest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    lines = [f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60)]
    (root / "a.py").write_text("".join(lines))
    (root / "pkg").mkdir()
    (root / "pkg" / "b.py").write_text("".join(reversed(lines)))
    (root / "notes.txt").write_text("not Python\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "c.py").write_text("installed elsewhere\n")
    return root


def test_the_corpus_takes_matching_files_outside_installed_packages(corpus):
    assert [p.relative_to(corpus).as_posix() for p in text_files(corpus, (".py",))] == ["a.py", "pkg/b.py"]
    tokens = corpus_tokens(corpus, (".py",), 10_000, eos_token_id=257, seed=0)
    assert int((tokens == 257).sum()) == 2 and int(tokens.max()) == 257
    assert corpus_tokens(corpus, (".py",), 100, 257, 0).numel() == 101  # cut at max_bytes, eos after


def test_training_lowers_the_loss_and_is_reproducible(corpus, tmp_path):
    first = train_checkpoint(PRESET, tmp_path / "a", corpus, QUICK)
    again = train_checkpoint(PRESET, tmp_path / "b", corpus, QUICK)
    other = train_checkpoint(PRESET, tmp_path / "c", corpus, QUICK.model_copy(update={"seed": 1, "steps": 1}))
    losses = first.losses
    assert len(losses) == QUICK.steps
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in "abc"]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    log = json.loads((tmp_path / "a" / TRAINING_LOG).read_text())
    assert log["losses"] == losses and log["config"]["steps"] == QUICK.steps


def test_the_trained_checkpoint_serves(corpus, tmp_path):
    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(out), "--train-on", str(corpus),
                 "--train-steps", "2"]) == 0
    llm = LLM(out)
    result = llm.generate(["def f1"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(result.token_ids) == 8 and isinstance(result.text, str)


def test_bad_corpora_are_refused(corpus, tmp_path):
    with pytest.raises(CorpusError, match="not a directory"):
        corpus_tokens(tmp_path / "missing", (".py",), 100, 257, 0)
    with pytest.raises(CorpusError, match=r"no file ending in \['.rst'\]"):
        corpus_tokens(corpus, (".rst",), 100, 257, 0)
    with pytest.raises(CorpusError, match="fewer than seq_len"):
        train_checkpoint(PRESET, tmp_path / "x", corpus, QUICK.model_copy(update={"max_corpus_bytes": 20}))
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"),
                 "--train-on", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
