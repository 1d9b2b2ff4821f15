"""What the ctx world e2e modules share: the :class:`Deployment` options of a ctx world of tp 2
serving a gen world over UCX beside the single-process baseline, greedy requests to its
servers, and the check that nothing is held or allocated on any ctx or gen rank."""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch

from helixserve.config import RestartPolicy
from helixserve.parallel.ports import free_ports
from tests.e2e.conftest import MODEL, Deployment, http, wait_until

TP = 2
TPB = 4  # the Deployment's cache.tokens_per_block
PICKUP_S = 6.0


def port_pair() -> int:
    """A port p with p and p + 1 free (the ctx world's two KV senders)."""
    for _ in range(100):
        (port,) = free_ports(1)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def ctx_world_options(dp: int, cp: int) -> dict[str, Any]:
    """A ctx world of tp :data:`TP` (restarted in place, holds kept :data:`PICKUP_S`) serving a gen
    world of ``dp`` x ``cp`` over UCX, with the single-process baseline gen worker; a small step
    budget (16 tokens), so that longer prompts prefill in several chunks."""
    return {"baseline_gen": True,
            "ctx": {"tp": TP, "transceiver_port": port_pair(), "collective_timeout_s": 30,
                    "pickup_timeout_s": PICKUP_S, "world_restart": RestartPolicy(max_restarts=3, backoff_s=0.2)},
            "gen": {"dp": dp, "cp": cp, "kv_source": "ucx"},
            "scheduler": {"max_num_batched_tokens": 16}}


def http_status(url: str) -> int | None:
    try:
        return http("GET", url, timeout=5)[0]
    except OSError:
        return None


def seeded_prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request_body(tokens: list[int], **extra: Any) -> dict:
    return {"model": MODEL, "prompt": tokens, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def complete(url: str, tokens: list[int], **extra: Any) -> tuple[int, dict]:
    return http("POST", f"{url}/v1/completions", request_body(tokens, **extra), timeout=120)


def complete_at_once(url: str, prompts: list[list[int]]) -> list[tuple[int, dict]]:
    """:func:`complete` of every prompt, each from its own thread, all started at once."""
    got: dict[int, tuple[int, dict]] = {}
    threads = [threading.Thread(target=lambda i=i, p=p: got.update({i: complete(url, p)}))
               for i, p in enumerate(prompts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(130)
    return [got.get(i, (0, {"error": "no answer within 130 s"})) for i in range(len(prompts))]


def greedy_text(url: str, tokens: list[int]) -> str:
    code, answer = complete(url, tokens)
    assert code == 200, answer
    return answer["choices"][0]["text"]


def rank_used(url: str) -> list[float]:
    """Every rank's used cache blocks and state slots (``/metrics``)."""
    lines = http("GET", f"{url}/metrics")[1].splitlines()
    gauges = ("helixserve_worker_rank_cache_blocks_used{", "helixserve_worker_rank_state_slots_used{")
    return [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(gauges)]


def wait_idle(d: Deployment, timeout: float = 10) -> None:
    """Until nothing is held or allocated on any rank of any ctx worker and of the gen worker."""
    urls = [*d.ctx_urls, d.gen_url]
    wait_until(lambda: d.is_idle() and not any(any(rank_used(url)) for url in urls),
               timeout, "nothing held or allocated on any ctx or gen rank",
               state=lambda: (d.stats("ctx"), d.stats("gen"), [rank_used(url) for url in urls]))
