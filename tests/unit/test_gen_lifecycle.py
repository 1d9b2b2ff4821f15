"""The gen world's request state machine (:mod:`helixserve.engine.spmd.lifecycle`): every legal
move, illegal moves raising :class:`IllegalTransitionError` and changing nothing, duplicate ids,
and which states are live (count against their group's load)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from helixserve.engine.spmd.lifecycle import (Aborted, Added, DecodingStarted, Dispatched, Finished,
                                              GenRequestLife, GenState, IllegalTransitionError, Released)

A, RX, D, H, F = (GenState.AWAITING_CACHE, GenState.RECEIVING, GenState.DECODING, GenState.HELD,
                  GenState.FINISHED)
PATH = {A: [], RX: [Dispatched("r")], D: [Dispatched("r"), DecodingStarted("r")],
        H: [Dispatched("r"), DecodingStarted("r"), Finished("r", keeps_cache=True)]}


def life_in(state: GenState, hold_cache: bool = True) -> GenRequestLife:
    life = GenRequestLife()
    life.apply(Added("r", dp_rank=1, cost=40, has_kv=True, hold_cache=hold_cache))
    for event in PATH[state]:
        life.apply(event)
    assert life.state_of("r") is state
    return life


LEGAL = [
    (A, Dispatched("r"), RX), (A, Finished("r"), F), (A, Aborted("r"), F),
    (RX, DecodingStarted("r"), D), (RX, Finished("r"), F), (RX, Aborted("r"), F),
    (D, Finished("r"), F), (D, Finished("r", keeps_cache=True), H), (D, Aborted("r"), F),
    (H, Released("r"), F), (H, Aborted("r"), F),
]


@pytest.mark.parametrize("state,event,after", LEGAL, ids=[f"{s.name}-{type(e).__name__}" for s, e, _ in LEGAL])
def test_legal_transitions(state, event, after):
    life = life_in(state)
    assert life.apply(event) == (state, after)
    assert life.state_of("r") is (None if after is F else after)
    assert life.num_live == int(after.is_live)


ILLEGAL = [
    (A, DecodingStarted("r")), (A, Released("r")),
    (RX, Dispatched("r")), (RX, Released("r")),
    (D, Dispatched("r")), (D, DecodingStarted("r")), (D, Released("r")),
    (H, Finished("r")), (H, Dispatched("r")), (H, DecodingStarted("r")),
]


@pytest.mark.parametrize("state,event", ILLEGAL, ids=[f"{s.name}-{type(e).__name__}" for s, e in ILLEGAL])
def test_illegal_transitions_raise_and_change_nothing(state, event):
    life = life_in(state)
    with pytest.raises(IllegalTransitionError, match=re.escape(f"'r' is {state.value}: {type(event).__name__}")):
        life.apply(event)
    assert life.state_of("r") is state


@pytest.mark.parametrize("event", [Dispatched("x"), Finished("x"), Aborted("x"), Released("x")],
                         ids=lambda e: type(e).__name__)
def test_an_unknown_request_cannot_move(event):
    with pytest.raises(IllegalTransitionError, match="not in the world"):
        GenRequestLife().apply(event)


@pytest.mark.parametrize("state", [A, RX, D, H])
def test_a_duplicate_id_is_refused_and_the_holder_is_untouched(state):
    life = life_in(state)
    before = life.get("r")
    with pytest.raises(ValueError, match="already in the world"):
        life.apply(Added("r", dp_rank=0, cost=1))
    assert life.get("r") is before and before.dp_rank == 1 and before.state is state


def test_a_request_without_kv_starts_decoding_and_an_id_is_free_once_finished():
    life = GenRequestLife()
    assert life.apply(Added("plain", dp_rank=0, cost=9)) == (None, D)
    assert life.apply(Finished("plain", keeps_cache=True)) == (D, F)  # not hold_cache: not held
    assert "plain" not in life
    assert life.apply(Added("plain", dp_rank=0, cost=9, has_kv=True)) == (None, A)


def test_live_states_and_ids():
    life = GenRequestLife()
    for i, state in enumerate((A, RX, D, H)):
        life.apply(Added(f"r{i}", dp_rank=0, cost=1, has_kv=True, hold_cache=True))
        for event in PATH[state]:
            life.apply(dataclasses.replace(event, request_id=f"r{i}"))
    assert life.live_ids() == ["r0", "r1", "r2"] and life.num_live == 3
    assert [e.request_id for e in life.in_state(H)] == ["r3"]


def test_the_state_machine_imports_no_torch():
    source = (Path(__file__).resolve().parents[2] / "helixserve/engine/spmd/lifecycle.py").read_text()
    assert not re.search(r"^\s*(import\s+torch\b|from\s+torch\b)", source, re.MULTILINE)
    own = [line for line in source.splitlines() if line.startswith(("import ", "from ")) and "helixserve" in line]
    assert own == []  # bookkeeping only: nothing of the engine or the world
