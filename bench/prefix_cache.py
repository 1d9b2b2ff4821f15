"""Prefix caching on one engine: a multi-turn chat workload, caching off against on, same run.

Workload (``multi_turn``): conversations share one system prompt; every turn appends a user
message to the conversation so far (system prompt, earlier turns, the assistant's replies) and
generates a greedy reply, which joins the conversation. Requests run one at a time, each on the
engine with caching off and then on the one with caching on (load drifting during the run falls
on both alike), the conversations taking turns (turn 1 of every conversation, then turn 2, ...), so a turn finds the
system prompt and its own conversation in the cache as far as the LRU kept them. Per request:
TTFT (``add_request`` to the first token) and prefill tokens computed (prompt tokens minus those
found cached). ``long_prefix``: one prompt of ``--prefix-tokens`` tokens prefilled once, then the
same prefix with ``--new-tokens`` new ones: its TTFT with caching off and on (the "4k cached
prefix, 64 new tokens" case on the GPU). ``floor``: the best TTFT of a fresh prompt of as many
tokens as the cached request computes (one prefill step over no context), measured in the same
run: the cached request's TTFT cannot go under it, so where a step's fixed cost dominates (a small
model, eager prefill) it bounds the on/off ratio.

The ratios are on / off of the same run; every row says whether the greedy tokens were equal.

    python bench/prefix_cache.py [--quick] [--out FILE] [--preset P] [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    sys.modules.setdefault("triton", None)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import base_parser, machine_info, markdown_table, write_json  # noqa: E402

from helixserve.config import CacheConfig, SchedulerConfig  # noqa: E402
from helixserve.engine.llm import LLM  # noqa: E402
from helixserve.engine.request import SamplingParams  # noqa: E402
from helixserve.models.presets import make_checkpoint  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_one(llm: LLM, rid: str, prompt: list[int], params: SamplingParams, device: str) -> dict[str, Any]:
    """One request alone: its TTFT, prefill tokens computed and tokens."""
    engine = llm.engine
    sync(device)
    start = time.perf_counter()
    request = engine.add_request(rid, prompt, params)
    while request.num_output_tokens == 0 and engine.has_unfinished_requests():
        engine.step()
    sync(device)
    ttft = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return {"ttft_s": ttft, "prefill_tokens": len(prompt) - (request.num_cached_tokens or 0),
            "tokens": list(request.output_token_ids)}


def multi_turn(llms: dict[str, LLM], shape: dict[str, int], vocab: int, device: str) -> dict[str, list[dict]]:
    """Each request runs on every engine in turn (caching off, then on), so load that drifts
    during the run falls on both alike; the conversation goes on with caching off's reply."""
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(shape["system_tokens"])]
    conversations = [list(system) for _ in range(shape["conversations"])]
    params = SamplingParams(max_tokens=shape["reply_tokens"], temperature=0.0, ignore_eos=True)
    out: dict[str, list[dict]] = {key: [] for key in llms}
    for turn in range(shape["turns"]):
        for c, conversation in enumerate(conversations):
            conversation.extend(rng.randrange(vocab) for _ in range(shape["user_tokens"]))
            for key, llm in llms.items():
                out[key].append({"turn": turn, **run_one(llm, f"{key}-{turn}-{c}", list(conversation), params, device)})
            conversation.extend(out["off"][-1]["tokens"])
    return out


def prefill_floor(llm: LLM, new_tokens: int, vocab: int, device: str, repeats: int = 3) -> float:
    """The best TTFT (ms) of a fresh ``new_tokens``-token prompt: one prefill step of as many rows
    as a cached request computes, over no context; what a cached request's TTFT cannot go under."""
    rng = random.Random(2)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return min(1e3 * run_one(llm, f"floor-{i}", [rng.randrange(vocab) for _ in range(new_tokens)], params,
                             device)["ttft_s"] for i in range(repeats))


def long_prefix(llms: dict[str, LLM], prefix_tokens: int, new_tokens: int, vocab: int, device: str
                ) -> dict[str, dict[str, Any]]:
    rng = random.Random(1)
    prefix = [rng.randrange(vocab) for _ in range(prefix_tokens)]
    first, second = prefix + [rng.randrange(vocab)], prefix + [rng.randrange(vocab) for _ in range(new_tokens)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for key, llm in llms.items():
        run_one(llm, f"{key}-long-first", first, params, device)
    return {key: run_one(llm, f"{key}-long-second", second, params, device) for key, llm in llms.items()}


def summary(requests: list[dict[str, Any]]) -> dict[str, float]:
    ttfts = [r["ttft_s"] for r in requests]
    return {"ttft_p50_ms": 1e3 * percentile(ttfts, 0.5), "ttft_p90_ms": 1e3 * percentile(ttfts, 0.9),
            "prefill_tokens": sum(r["prefill_tokens"] for r in requests), "requests": len(requests)}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--preset", default="kimi-k3-tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = ({"system_tokens": 256, "conversations": 4, "turns": 4, "user_tokens": 32, "reply_tokens": 8}
             if args.quick else
             {"system_tokens": 2048, "conversations": 8, "turns": 8, "user_tokens": 64, "reply_tokens": 16})
    prefix_tokens, new_tokens = (1024, 64) if args.quick else (4096, 64)
    cache_kw = {"tokens_per_block": 16, "max_num_seqs": 4, "memory_budget_mib": 1024 if args.device == "cpu" else 8192,
                "state_checkpoint_blocks": 64, "state_checkpoint_slots": 64}
    sched = SchedulerConfig(max_num_batched_tokens=2048)
    with tempfile.TemporaryDirectory() as tmp:
        on_cuda = args.device.startswith("cuda")
        path = args.preset if on_cuda else make_checkpoint(args.preset, Path(tmp) / args.preset, seed=0)
        load = {"load_format": "dummy"} if on_cuda else {}
        llms = {key: LLM(path, dtype=args.dtype, device=args.device, scheduler=sched, enforce_eager=not on_cuda,
                         cache=CacheConfig(prefix_caching=key == "on", **cache_kw), **load) for key in ("off", "on")}
        vocab = llms["off"].model_config.vocab_size
        # the tiny presets hold 4096 positions: the long prefix stays within them
        prefix_tokens = min(prefix_tokens, llms["off"].engine.scheduler.max_model_len - new_tokens - 16)
        for key, llm in llms.items():
            run_one(llm, f"{key}-warm", list(range(1, 65)), SamplingParams(max_tokens=2, temperature=0.0), args.device)
        llms["on"].engine.cache_manager.reset_prefix_cache()
        turns = multi_turn(llms, shape, vocab, args.device)
        longs = long_prefix(llms, prefix_tokens, new_tokens, vocab, args.device)
        floor = prefill_floor(llms["off"], new_tokens, vocab, args.device)
    results = {key: {"multi_turn": turns[key], "long_prefix": longs[key]} for key in ("off", "on")}
    off, on = results["off"], results["on"]
    equal = ([r["tokens"] for r in off["multi_turn"]] == [r["tokens"] for r in on["multi_turn"]]
             and off["long_prefix"]["tokens"] == on["long_prefix"]["tokens"])
    s_off, s_on = summary(off["multi_turn"]), summary(on["multi_turn"])
    rows = [{"metric": m, "off": s_off[m], "on": s_on[m], "on/off": s_on[m] / s_off[m]}
            for m in ("ttft_p50_ms", "ttft_p90_ms", "prefill_tokens")]
    lp = {k: 1e3 * results[k]["long_prefix"]["ttft_s"] for k in ("off", "on")}
    rows.append({"metric": f"long_prefix_ttft_ms ({prefix_tokens} cached + {new_tokens} new)",
                 "off": lp["off"], "on": lp["on"], "on/off": lp["on"] / lp["off"]})
    rows.append({"metric": f"floor: a fresh {new_tokens}-token prompt's ttft_ms (one prefill step), against the "
                           "long prefix's 'on'", "off": floor, "on": lp["on"], "on/off": lp["on"] / floor})
    print(f"{args.preset} on {args.device}, prefix_caching off vs on, {shape}, greedy tokens equal: {equal}")
    print(markdown_table(["metric", "off", "on", "on/off"], [[r["metric"], r["off"], r["on"], r["on/off"]] for r in rows]))
    write_json(args.out, {"machine": machine_info(), "preset": args.preset, "device": args.device, "shape": shape,
                          "cache": cache_kw, "tokens_equal": equal, "rows": rows,
                          "per_request": {k: [{kk: vv for kk, vv in r.items() if kk != "tokens"}
                                              for r in results[k]["multi_turn"]] for k in ("off", "on")}})


if __name__ == "__main__":
    main()
