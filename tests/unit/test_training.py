"""Training a small checkpoint and its drafters (a draft model, a hidden-state drafter) on local
text: the corpus is read in the checkpoint's own tokenizer with a fixed held-out split, the loss
falls, the same seed gives byte-identical weights (and another seed different ones), the target
and its drafters load through ``LLM`` and generate with the same tokenizer files, and bad corpora or presets are refused with
the offending value before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helixserve.cli import main
from helixserve.engine.llm import LLM
from helixserve.engine.request import SamplingParams
from helixserve.models.config import KimiModelConfig
from helixserve.models.loading import load_model
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.presets import TOKENIZER_FORMATS, get_preset, init_random_weights, write_tokenizer
from helixserve.models.tokenizer import EOS_ID, NUM_BYTES, SPECIAL_TOKENS
from helixserve.models.tokenizer_loader import dummy_tokenizer, load_tokenizer
from helixserve.config_speculative import SpeculativeConfig
from helixserve.training.checkpoint import (DRAFT_SUBDIR, HIDDEN_SUBDIR, TRAINING_LOG, default_draft_preset,
                                            default_hidden_preset, train_checkpoint)
from helixserve.training.corpus import CorpusError, held_out_texts, load_corpus, split_files, text_files
from helixserve.training.config import TrainingConfig
from helixserve.training.trainer import eval_windows, held_out_loss, step_loss

PRESET = "kimi-linear-tiny"
QUICK = TrainingConfig(steps=6, draft_steps=3, batch_size=2, seq_len=32, lr=1e-2, warmup_steps=2,
                       eval_windows=4)
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


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
    def text(first: int) -> str:
        return "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(first, first + 60))

    for k, name in enumerate(("a", "b", "c", "d")):
        (root / f"{name}.py").write_text(text(100 * k))
    (root / "pkg").mkdir()
    (root / "pkg" / "e.py").write_text(text(400))
    (root / "pkg" / "empty.py").write_text("")
    (root / "pkg" / "binary.py").write_bytes(b"\x00\x01\x02")
    (root / "notes.txt").write_text("not Python\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "c.py").write_text("installed elsewhere\n")
    return root


SPLIT = TrainingConfig(max_corpus_bytes=100_000, max_held_out_bytes=100_000, held_out_fraction=0.2)


def _corpus(root: Path, **kw):
    return load_corpus(root, dummy_tokenizer("byte-level"), EOS_ID, SPLIT.model_copy(update=kw))


def test_the_corpus_holds_out_a_fixed_share_of_files_whatever_the_seed(corpus):
    files = text_files(corpus, (".py",))
    assert [p.relative_to(corpus).as_posix() for p in files] == [
        "a.py", "b.py", "c.py", "d.py", "pkg/binary.py", "pkg/e.py"]  # not the empty file
    train, held = split_files(corpus, files, 0.2)
    assert len(held) == 1 and set(train).isdisjoint(held) and sorted(train + held) == files
    first, other_seed = _corpus(corpus), _corpus(corpus, seed=1)
    assert first.held_out_files == other_seed.held_out_files == [held[0].relative_to(corpus).as_posix()]
    assert torch.equal(first.held_out, other_seed.held_out)
    assert not torch.equal(first.train, other_seed.train)  # the training files' order follows the seed
    # the binary file is skipped: every text file's ids end with one eos
    num_text = len([p for p in train if p.name != "binary.py"])
    assert first.num_train_files == num_text and int((first.train == EOS_ID).sum()) == num_text
    assert held_out_texts(corpus, SPLIT) == [held[0].read_text()]
    assert _corpus(corpus, max_corpus_bytes=100).train.numel() == 101  # cut at max_corpus_bytes, eos after
    assert split_files(corpus, files[:1], 0.2) == (files[:1], [])  # one file: nothing held out


def test_the_corpus_is_read_with_the_checkpoints_tokenizer(corpus, tmp_path):
    """The kimi layout's tiktoken merges (ids past the specials: four spaces, two newlines) tokenize
    the text into fewer ids than the byte-level layout."""
    streams = {}
    for fmt in TOKENIZER_FORMATS:
        write_tokenizer(tmp_path / fmt, fmt, get_preset(PRESET))
        streams[fmt] = load_corpus(corpus, load_tokenizer(tmp_path / fmt), EOS_ID, SPLIT).train
    assert int(streams["kimi"].max()) >= NUM_BYTES + len(SPECIAL_TOKENS) and int(streams["hf"].max()) == EOS_ID
    assert streams["kimi"].numel() < streams["hf"].numel()


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "kimi-k3-tiny"])
def test_the_prefill_forward_is_differentiable_in_every_weight(preset):
    """One backward through the serving forward (KDA chunk form, MLA, MoE, attention residuals)
    reaches every weight but the routers' correction bias, which only steers expert choice, and
    K3's first attention-residual mix, which has one source (nothing to weigh)."""
    model = KimiForCausalLM(get_preset(preset), dtype=torch.float32)
    init_random_weights(model, 0)
    windows = torch.randint(0, NUM_BYTES, (4, 33), generator=torch.Generator().manual_seed(0))
    step_loss(model, windows).backward()
    untouched = [name for name, p in model.named_parameters()
                 if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    unused = (".e_score_correction_bias", "model.layers.0.self_attention_res_")
    assert untouched and all(name.endswith(unused[0]) or name.startswith(unused[1]) for name in untouched), untouched


def test_training_lowers_the_loss_and_is_reproducible(corpus, tmp_path):
    draft, hidden = default_draft_preset(PRESET), default_hidden_preset(PRESET)
    first = train_checkpoint(PRESET, tmp_path / "a", corpus, QUICK, draft_preset=draft, hidden_preset=hidden)
    again = train_checkpoint(PRESET, tmp_path / "b", corpus, QUICK, draft_preset=draft, hidden_preset=hidden)
    train_checkpoint(PRESET, tmp_path / "c", corpus, QUICK.model_copy(update={"seed": 1, "steps": 1}))
    losses = first.target.losses
    assert len(losses) == QUICK.steps and len(first.draft.losses) == QUICK.draft_steps
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    assert first.target.held_out_loss < first.target.held_out_loss_init - 1.0
    assert first.draft.held_out_loss < first.draft.held_out_loss_init
    assert 0.0 <= first.draft.greedy_agreement <= 1.0
    assert len(first.hidden.losses) == QUICK.draft_steps and first.hidden.held_out_loss < first.hidden.held_out_loss_init
    assert 0.0 <= first.hidden.greedy_agreement <= 1.0
    for sub in ("", DRAFT_SUBDIR, HIDDEN_SUBDIR):
        a, b = ((tmp_path / d / sub / "model.safetensors").read_bytes() for d in "ab")
        assert a == b, sub
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert again.target.losses == losses and not (tmp_path / "c" / DRAFT_SUBDIR).exists()
    log = json.loads((tmp_path / "a" / TRAINING_LOG).read_text())
    assert log["losses"] == losses and log["config"]["steps"] == QUICK.steps
    assert log["held_out_loss"] == first.target.held_out_loss and log["held_out_files"]
    draft_log = json.loads((tmp_path / "a" / DRAFT_SUBDIR / TRAINING_LOG).read_text())
    assert draft_log["preset"] == draft and draft_log["target_preset"] == PRESET
    hidden_log = json.loads((tmp_path / "a" / HIDDEN_SUBDIR / TRAINING_LOG).read_text())
    assert hidden_log["preset"] == hidden and hidden_log["losses"] == first.hidden.losses


def test_the_written_checkpoint_scores_the_reported_held_out_loss(corpus, tmp_path):
    """kimi-k3-tiny stores its routed experts in MXFP4: the reported loss is that of the weights
    as written, loaded back through the serving loader."""
    tc = QUICK.model_copy(update={"steps": 2, "eval_windows": 2})
    report = train_checkpoint("kimi-k3-tiny", tmp_path / "k3", corpus, tc)
    held = load_corpus(corpus, load_tokenizer(tmp_path / "k3"), EOS_ID, tc).held_out
    loaded = held_out_loss(load_model(tmp_path / "k3"), eval_windows(held, tc), tc.batch_size)
    assert loaded == pytest.approx(report.target.held_out_loss, rel=1e-4)
    assert report.target.held_out_loss < report.target.held_out_loss_init


def test_the_trained_target_and_draft_serve_with_one_vocabulary(corpus, tmp_path):
    out, draft_out = tmp_path / "ckpt", tmp_path / "drafts" / "d"
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(out), "--train-on", str(corpus),
                 "--train-steps", "1", "--draft-steps", "1", "--tokenizer", "kimi", "--draft-out", str(draft_out)]) == 0
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (draft_out / name).read_bytes(), name
    target_cfg, draft_cfg = (KimiModelConfig.from_pretrained(d) for d in (out, draft_out))
    assert draft_cfg.num_hidden_layers < target_cfg.num_hidden_layers
    assert draft_cfg.vocab_size == target_cfg.vocab_size
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for ckpt in (out, draft_out):
        result = LLM(ckpt).generate(["def f1"], params)[0]
        assert len(result.token_ids) == 8 and isinstance(result.text, str)
    hidden = out / HIDDEN_SUBDIR
    for name in TOKENIZER_FILES:
        assert (out / name).read_bytes() == (hidden / name).read_bytes(), name
    spec = SpeculativeConfig(method="hidden", draft_model=hidden, num_draft_tokens=2)
    assert LLM(out, speculative=spec).generate(["def f1"], params)[0].token_ids == LLM(out).generate(
        ["def f1"], params)[0].token_ids


def test_bad_corpora_are_refused_naming_the_directory(corpus, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / "x.py").write_bytes(b"")
    (unreadable / "y.py").write_bytes(b"\x7fELF\x00")
    for root in (empty, unreadable):
        with pytest.raises(CorpusError, match=rf"--train-on {root}: no readable text file ending in \['.py'\]"):
            _corpus(root)
    with pytest.raises(CorpusError, match=f"{tmp_path / 'missing'}: no such directory"):
        _corpus(tmp_path / "missing")
    with pytest.raises(CorpusError, match=f"{corpus / 'a.py'}: not a directory"):
        _corpus(corpus / "a.py")
    with pytest.raises(CorpusError, match="fewer than seq_len"):
        train_checkpoint(PRESET, tmp_path / "x", corpus, QUICK.model_copy(update={"max_corpus_bytes": 20}))
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"),
                 "--train-on", str(tmp_path / "missing")]) == 2
    assert f"--train-on {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"),
                 "--train-on", str(empty)]) == 2
    assert str(empty) in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_draft_of_another_vocabulary_or_without_training_is_refused(corpus, tmp_path, capsys):
    with pytest.raises(ValueError, match="draft preset 'kimi-linear-48b' has vocab_size 163840"):
        train_checkpoint(PRESET, tmp_path / "x", corpus, QUICK, draft_preset="kimi-linear-48b")
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"),
                 "--draft-preset", "kimi-linear-tiny-draft"]) == 2
    assert "--draft-preset: only with --train-on" in capsys.readouterr().err
    with pytest.raises(ValueError, match="preset 'kimi-linear-tiny-draft' is not a hidden-state drafter"):
        train_checkpoint(PRESET, tmp_path / "x", corpus, QUICK, hidden_preset="kimi-linear-tiny-draft")
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"),
                 "--hidden-preset", "kimi-linear-tiny-hidden"]) == 2
    assert "--hidden-preset: only with --train-on" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"), "--train-on", str(corpus),
                 "--train-steps", "0"]) == 2
    assert main(["make-checkpoint", "--preset", PRESET, "--out", str(tmp_path / "y"), "--train-on", str(corpus),
                 "--draft-preset", "none", "--draft-out", str(tmp_path / "z")]) == 2
    assert f"--draft-out {tmp_path / 'z'}: no draft is trained" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
