"""RestartBudget (launch's children, a gen worker's world): at most max_restarts within window_s,
exponential backoff capped; the clock is injected (a fake clock only sets the time)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helixserve.config import DeploymentConfig, RestartPolicy
from helixserve.launch.local import with_restart_overrides
from helixserve.launch.restarts import RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_max_restarts_within_the_window_then_gives_up():
    clock = Clock()
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=60, backoff_s=1, max_backoff_s=30), clock)
    assert [budget.next_delay() for _ in range(3)] == [1, 2, 4]  # budget - 1, budget: allowed
    assert budget.next_delay() is None  # budget + 1: give up
    assert budget.num_recent == 3 and budget.num_restarts == 3


def test_restarts_older_than_the_window_no_longer_count():
    clock = Clock()
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=60, backoff_s=1), clock)
    assert budget.next_delay() == 1
    clock.now += 30
    assert budget.next_delay() == 2
    clock.now += 30.5  # the first one is 60.5 s old: out of the window
    assert budget.num_recent == 1 and budget.next_delay() == 2
    assert budget.next_delay() is None
    assert budget.describe() == "restart 2 of at most 2 within 60 s"


def test_backoff_is_capped_and_zero_restarts_give_up_at_once():
    clock = Clock()
    budget = RestartBudget(RestartPolicy(max_restarts=10, backoff_s=1, max_backoff_s=5), clock)
    assert [budget.next_delay() for _ in range(5)] == [1, 2, 4, 5, 5]
    assert RestartBudget(RestartPolicy(max_restarts=0), clock).next_delay() is None


def test_policy_and_cli_overrides_are_validated(tmp_path):
    with pytest.raises(ValidationError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    deploy = DeploymentConfig(model={"path": tmp_path})
    assert deploy.launch.restart_children and deploy.launch.restart.max_restarts == 5
    assert deploy.gen[0].world_restart.max_restarts == 3
    off = with_restart_overrides(deploy, restart=False, max_restarts=2)
    assert not off.launch.restart_children and off.launch.restart.max_restarts == 2
    assert with_restart_overrides(deploy, None, None) == deploy
    with pytest.raises(ValidationError):
        with_restart_overrides(deploy, None, -1)
