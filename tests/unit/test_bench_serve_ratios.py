"""``bench/serve.py --repeats``: the ratios table over alternating rounds (a pure function of the
rows; speed figures stay in bench/)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from serve import ratios  # noqa: E402


def _row(mode: str, conc: int, round_: int, tok_s: float, ttft: float, kv: float | None = None) -> dict:
    row = {"mode": mode, "concurrency": conc, "round": round_, "output_tok_s": tok_s, "ttft_p50_ms": ttft}
    if kv is not None:
        row["kv_transfer_ms"] = kv
    return row


def test_ratios_pair_each_round_and_take_medians() -> None:
    rows = [
        _row("disagg", 16, 0, 900.0, 56.0, 2.0), _row("agg", 16, 0, 1000.0, 50.0),   # 0.90, bound 54.6: missed
        _row("disagg", 16, 1, 1100.0, 54.0, 2.0), _row("agg", 16, 1, 1000.0, 50.0),  # 1.10, met
        _row("disagg", 16, 2, 700.0, 40.0, 4.0), _row("agg", 16, 2, 1000.0, 50.0),   # 0.70, met
        _row("disagg", 64, 0, 500.0, 10.0, 1.0),  # no agg in its round: not a pair
    ]
    (level,) = ratios(rows)
    assert level["concurrency"] == 16 and level["rounds"] == 3
    assert level["tok_s_ratio"] == pytest.approx(0.9)
    assert (level["tok_s_ratio_min"], level["tok_s_ratio_max"]) == pytest.approx((0.7, 1.1))
    assert level["disagg_ttft_p50_ms"] == 54.0 and level["agg_ttft_p50_ms"] == 50.0
    assert level["kv_transfer_ms"] == 2.0 and level["ttft_bound_met"] == "2/3"


def test_an_even_number_of_rounds_takes_the_middle_pair_mean() -> None:
    rows = [_row("disagg", 1, r, t, 10.0, 0.0) for r, t in enumerate((800.0, 1000.0))]
    rows += [_row("agg", 1, r, 1000.0, 10.0) for r in range(2)]
    (level,) = ratios(rows)
    assert level["tok_s_ratio"] == pytest.approx(0.9) and level["ttft_bound_met"] == "2/2"
