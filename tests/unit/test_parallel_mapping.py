"""Mapping math, row slicing and launcher-env parsing (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from helixserve.parallel.groups import dist_env_from, first_slurm_host
from helixserve.parallel.mapping import Mapping
from helixserve.parallel.row_split import (
    pad_rows,
    per_rank_token_counts,
    row_chunk,
    rows_for_rank,
    split_rows,
    valid_rows,
)

LAYOUTS = [(1, 2), (2, 1), (2, 2), (1, 4)]


@pytest.mark.parametrize("dp,cp", LAYOUTS)
def test_mapping_coordinates_and_groups(dp: int, cp: int) -> None:
    world = dp * cp
    maps = [Mapping(world, r, dp=dp, cp=cp) for r in range(world)]
    for m in maps:
        assert m.rank == m.dp_rank * cp + m.cp_rank  # CP groups are contiguous
        assert m.tp_rank == 0 and m.ep_rank == m.rank and m.ep == world
        assert m.cp_group_ranks == list(range(m.dp_rank * cp, (m.dp_rank + 1) * cp))
        assert m.dp_group_ranks == [d * cp + m.cp_rank for d in range(dp)]
        assert m.tp_group_ranks == [m.rank] and m.ep_group_ranks == list(range(world))
        assert m.rank in m.cp_group_ranks and m.rank in m.dp_group_ranks
        assert m.attention_dp == (dp > 1) and m.tp_group_shares_requests
        assert m.is_cp_leader == (m.cp_rank == 0)
    # every rank in exactly one CP group and one DP group; all ranks agree on the group lists
    all_cp, all_dp = maps[0].all_cp_groups(), maps[0].all_dp_groups()
    assert all(m.all_cp_groups() == all_cp and m.all_dp_groups() == all_dp for m in maps)
    assert sorted(r for g in all_cp for r in g) == list(range(world)) and len(all_cp) == dp
    assert sorted(r for g in all_dp for r in g) == list(range(world)) and len(all_dp) == cp
    assert all(m.cp_group_ranks in all_cp and m.dp_group_ranks in all_dp for m in maps)


@pytest.mark.parametrize("dp,cp", LAYOUTS)
def test_head_and_expert_sharding(dp: int, cp: int) -> None:
    world = dp * cp
    maps = [Mapping(world, r, dp=dp, cp=cp) for r in range(world)]
    for m in maps:
        group_heads = [h for r in m.cp_group_ranks for h in maps[r].local_heads(8)]
        assert group_heads == list(range(8))
        assert len(m.local_heads(8)) == 8 // cp
        full = m.mapping_for_full_rows()
        assert full.cp == 1 and full.rank == m.rank and full.ep == world
        assert full.local_heads(6) == range(6) and full.local_vocab(100) == range(100)
        assert full.local_experts(8) == m.local_experts(8)
    assert [e for m in maps for e in m.local_experts(8)] == list(range(8))


def test_mapping_errors_name_values() -> None:
    with pytest.raises(ValueError, match=r"dp=2 \* cp=2 \* tp=1 = 4 != world_size=3"):
        Mapping(3, 0, dp=2, cp=2)
    with pytest.raises(ValueError, match="tp=2 is not supported"):
        Mapping(4, 0, dp=1, cp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank=4 is outside \[0, world_size=4\)"):
        Mapping(4, 4, cp=4)
    with pytest.raises(ValueError, match="ep=2 != world_size=4"):
        Mapping(4, 0, cp=4, ep=2)
    with pytest.raises(ValueError, match="cp=0"):
        Mapping(4, 0, cp=0)
    m = Mapping(4, 1, dp=1, cp=4)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by cp=4"):
        m.local_heads(6)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        m.local_experts(6)
    with pytest.raises(ValueError, match="dp_rank=2"):
        m.rank_of(2, 0)
    with pytest.raises(ValueError, match="heads_tp .* needs dp=1, got dp=2"):
        Mapping(4, 0, dp=2, cp=2, heads_tp=True)


def test_a_draft_models_heads_tp_mapping_is_its_cp_group_alone() -> None:
    draft = Mapping(8, 7, dp=2, cp=4).for_draft_heads_tp()  # dp rank 1, cp rank 3
    assert draft == Mapping(4, 3, dp=1, cp=4, heads_tp=True)
    assert draft.local_heads(8) == range(6, 8)  # heads split over the group
    assert draft.local_experts(6) == range(6)  # every expert: replicated


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 8, 33])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_row_split(num_tokens: int, cp: int) -> None:
    chunk = row_chunk(num_tokens, cp)
    assert chunk == math.ceil(num_tokens / cp)
    counts = per_rank_token_counts(num_tokens, cp)
    assert sum(counts) == num_tokens and all(0 <= n <= chunk for n in counts)
    x = torch.arange(1, num_tokens + 1, dtype=torch.float32)[:, None].repeat(1, 3)
    pieces = []
    for r in range(cp):
        start, stop, num_valid = rows_for_rank(num_tokens, cp, r)
        assert stop - start == chunk and num_valid == counts[r]
        local = split_rows(x, cp, r)
        assert local.shape == (chunk, 3)
        assert torch.all(local[num_valid:] == 0)  # zero padding
        pieces.append(valid_rows(local, num_tokens, cp, r))
    assert torch.equal(torch.cat(pieces), x)


def test_row_split_examples_and_errors() -> None:
    assert per_rank_token_counts(5, 4) == [2, 2, 1, 0]
    assert per_rank_token_counts(1, 4) == [1, 0, 0, 0]
    assert rows_for_rank(3, 4, 3) == (3, 4, 0)
    assert pad_rows(torch.ones(2, 2), 3).tolist() == [[1, 1], [1, 1], [0, 0]]
    with pytest.raises(ValueError, match="cp_rank=4"):
        rows_for_rank(3, 4, 4)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        row_chunk(-1, 2)
    with pytest.raises(ValueError, match="num_rows=1"):
        pad_rows(torch.ones(2, 2), 1)
    with pytest.raises(ValueError, match=r"local rows 2 != ceil\(T=5 / cp=2\) = 3"):
        valid_rows(torch.ones(2, 1), 5, 2, 0)


def test_dist_env_torchrun_and_slurm() -> None:
    assert dist_env_from({"PATH": "/bin"}) is None
    env = dist_env_from(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    )
    assert env is not None and (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 4, 1, "torchrun")
    assert env.init_method == "tcp://h0:1234"
    slurm = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    env = dist_env_from({**slurm, "MASTER_ADDR": "a", "MASTER_PORT": "29400"})
    assert env is not None and (env.rank, env.world_size, env.launcher, env.init_method) == (2, 4, "slurm", "tcp://a:29400")
    env = dist_env_from({**slurm, "SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1", "SLURM_JOB_ID": "123"})
    assert env is not None and env.init_method == "tcp://gpu03:20123"
    # torchrun inside an srun allocation wins
    both = {**slurm, "RANK": "0", "WORLD_SIZE": "1"}
    assert dist_env_from(both).launcher == "torchrun"  # type: ignore[union-attr]
    assert first_slurm_host("node7") == "node7" and first_slurm_host("n[1-2]") == "n1"


def test_dist_env_joins_the_store_of_torchruns_agent() -> None:
    """torchrun's agent serves the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): every
    rank, rank 0 too, joins it through env:// instead of listening there itself."""
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    env = dist_env_from({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert env is not None and env.agent_store and env.init_method == "env://"
    for value in ("False", ""):
        env = dist_env_from({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": value})
        assert env is not None and not env.agent_store and env.init_method == "tcp://h0:1234"
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "a", "MASTER_PORT": "29400",
            "TORCHELASTIC_USE_AGENT_STORE": "True"}  # not torchrun's task: its own store
    assert dist_env_from(srun).init_method == "tcp://a:29400"  # type: ignore[union-attr]


def test_dist_env_errors_name_values() -> None:
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        dist_env_from({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"RANK=2 is outside \[0, WORLD_SIZE=2\)"):
        dist_env_from({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        dist_env_from({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="MASTER_PORT=70000"):
        dist_env_from({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"})
