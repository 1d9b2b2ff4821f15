"""helix_a2a forward on real gloo worlds == the single-process forward, for both tiny presets.

One world per (dp, cp) runs a whole scenario per preset; the tests below check its records:

- logits allclose (fp32; bit-equal in the world of one) at T = 33, 1, 3, 8, for a prompt chunk continuing a cached sequence,
  and in a run of multi-sequence decode steps whose blocks fill and cross block boundaries onto
  other CP ranks (tokens_per_block = 4);
- greedy tokens equal at every step;
- every decoder layer's output kept for a hidden-state drafter (``batch.hidden_capture``) holds
  all T rows on every CP rank (the token-sliced layers' gathered over the group) and equals the
  single-process one;
- each rank's MLA blocks are exactly its round-robin share and hold the single-process rows;
- each rank's KDA recurrent and conv state equal its head slice of the single-process state;
- the CP groups of a dp = 2 world run different requests, one of them idle in some steps
  (an empty step keeps the world's MoE all-to-all going);
- every mixer of the world forward runs inside the step host cache (one host read of the batch
  metadata per step, as in the single process).

Also: start-up errors for models that do not fit the world (no world needed).
"""

from __future__ import annotations

import pytest
import torch

from helixserve.cache_layout import cache_spec_for
from helixserve.kernels import _host
from helixserve.kvcache import CacheManager, local_logical_blocks
from helixserve.kvcache.pools import allocate_model_caches
from helixserve.launch.processes import run_local_world
from helixserve.models.loading import load_model
from helixserve.models.context import ForwardBatch
from helixserve.models.hidden_capture import HiddenCapture
from helixserve.models.kimi import KimiForCausalLM
from helixserve.models.sharding import HelixConfigError, check_helix_config
from helixserve.models.helix_load import load_helix_model
from helixserve.models.presets import get_preset
from helixserve.parallel import Mapping, init_parallel

TPB, NUM_BLOCKS, NUM_SLOTS = 4, 64, 8
WORLDS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)]  # (1, 1): the world of one, bit-equal
PRESETS = ("kimi-linear-tiny", "kimi-k3-tiny")
NUM_DECODE_STEPS = 9
# fp32 tolerances, relative to the largest reference magnitude. K3-tiny's random weights (sharp
# attention-residual softmaxes, SiTU) amplify rounding: its own fp32-vs-fp64 logits differ by
# ~2e-5, and the helix sums (o_proj partials, MoE combine, LSE merge) round differently.
LOGITS_RTOL, STATE_RTOL = 5e-4, 1e-4

# Per step, per sequence: number of new tokens (None: not in this step). Sequences of CP
# group d use tokens seeded by (d, seq); decode tokens are the reference's greedy choice.
# The opening steps cover T = 33, 1, 3 (< cp = 4), 8 (mixed prefill + decodes) and a prompt
# chunk continuing a cached sequence (n > 1 for a known sequence: more prompt tokens).
_OPENING = [{"a": 33}, {"a": 1}, {"b": 3}, {"a": 1, "b": 1, "c": 6}, {"a": 1, "c": 5}]
_DECODES = [{"a": 1, "b": 1, "c": 1}] * NUM_DECODE_STEPS


def _plan(dp_rank: int) -> list[dict[str, int]]:
    if dp_rank == 0:
        return _OPENING + _DECODES
    # the second CP group: different requests, idle in two steps, T = 8 and 33 at other times
    return [{}, {"d": 8}, {"e": 33}, {}, {"d": 1, "e": 4}] + [{"d": 1, "e": 1}] * NUM_DECODE_STEPS


class _Side:
    """One model with its cache manager and pools (helix rank or single-process reference)."""

    def __init__(self, model, cp_rank: int, cp: int, kda_heads: int) -> None:
        self.model = model
        self.device = model.lm_head.weight.device
        spec = cache_spec_for(model.cfg, model.dtype, TPB, kda_num_heads=kda_heads)
        self.caches = allocate_model_caches(spec, NUM_BLOCKS, NUM_SLOTS, self.device)
        self.manager = CacheManager(NUM_BLOCKS, NUM_SLOTS, TPB, cp_rank=cp_rank, cp_size=cp)

    def batch(self, seqs: list[tuple[str, list[int], int]], all_rows: bool) -> ForwardBatch:
        ids, pos, cu, tables, slots, last = [], [], [0], [], [], []
        for rid, tokens, context in seqs:
            if rid not in self.manager:
                self.manager.allocate(rid, context + len(tokens))
            handle = self.manager.get(rid)
            self.manager.extend(handle, context + len(tokens))
            ids += tokens
            pos += range(context, context + len(tokens))
            cu.append(cu[-1] + len(tokens))
            last.append(cu[-1] - 1)
            tables.append(handle.block_table(16))
            slots.append(handle.slot)
        as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)
        return ForwardBatch(as_long(ids), as_long(pos), as_long(cu), as_long([c for _, _, c in seqs]),
                            torch.tensor(tables, dtype=torch.int32, device=self.device), as_long(slots),
                            None if all_rows else as_long(last))


def _tokens(dp_rank: int, rid: str, n: int, offset: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(100_000 * dp_rank + 1000 * offset + ord(rid))
    return torch.randint(0, 512, (n,), generator=gen).tolist()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _check_state(helix: _Side, ref: _Side, rids: list[str], mapping: Mapping) -> tuple[float, bool]:
    """Max relative KDA state/conv error vs the reference head slice; MLA blocks == round-robin share + rows."""
    cfg = ref.model.cfg
    heads = mapping.local_heads(cfg.kda_num_heads)
    K, H = cfg.kda_head_dim, cfg.kda_num_heads
    err, blocks_ok = 0.0, True
    for rid in rids:
        h_handle, r_handle = helix.manager.get(rid), ref.manager.get(rid)
        for layer in cfg.kda_layer_ids:
            mine = helix.caches.kda_state[layer][h_handle.slot]
            full = ref.caches.kda_state[layer][r_handle.slot][heads.start:heads.stop]
            err = max(err, _rel_err(mine, full))
            conv_full = ref.caches.conv_state[layer][r_handle.slot].view(3, H * K, -1)[:, heads.start * K:heads.stop * K]
            err = max(err, _rel_err(helix.caches.conv_state[layer][h_handle.slot], conv_full.reshape(-1, conv_full.shape[-1])))
        n = h_handle.num_tokens
        owned = local_logical_blocks(n, TPB, mapping.cp_rank, mapping.cp)
        table, ref_table = h_handle.block_table(16), r_handle.block_table(16)
        blocks_ok &= [b for b in range(16) if table[b] >= 0] == owned
        for layer in cfg.mla_layer_ids:
            for b in owned:
                rows = min(TPB, n - b * TPB)
                mine = helix.caches.mla_kv[layer][table[b], :rows]
                blocks_ok &= _rel_err(mine, ref.caches.mla_kv[layer][ref_table[b], :rows]) <= STATE_RTOL
    return err, blocks_ok


def _scenario(model: KimiForCausalLM, ref_model, mapping: Mapping) -> list[dict]:
    cfg = ref_model.cfg
    helix = _Side(model, mapping.cp_rank, mapping.cp, cfg.kda_num_heads // mapping.cp)
    ref = _Side(ref_model, 0, 1, cfg.kda_num_heads)
    context: dict[str, int] = {}
    next_token: dict[str, int] = {}
    records = []
    host_cache_seen: list[bool] = []  # per mixer call through Module.__call__ (KDA, MLA at cp = 1)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: host_cache_seen.append(_host._step_lists.get() is not None))
    for step, work in enumerate(_plan(mapping.dp_rank)):
        if not work:
            model.empty_step()
            records.append({"T": 0})
            continue
        seqs = []
        for rid, n in work.items():
            fresh = rid not in context or n > 1
            tokens = _tokens(mapping.dp_rank, rid, n, context.get(rid, 0)) if fresh else [next_token[rid]]
            seqs.append((rid, tokens, context.get(rid, 0)))
        all_rows = step % 2 == 0
        host_cache_seen.clear()
        batches = helix.batch(seqs, all_rows), ref.batch(seqs, all_rows)
        for batch in batches:  # every layer's output kept, as for a hidden-state drafter
            batch.hidden_capture = HiddenCapture(tuple(range(cfg.num_hidden_layers)))
        got = model(batches[0], helix.caches)
        want = ref_model(batches[1], ref.caches)
        got_features, want_features = (b.hidden_capture.features() for b in batches)
        if all_rows:
            ends = torch.tensor([sum(len(s[1]) for s in seqs[: i + 1]) - 1 for i in range(len(seqs))], device=got.device)
            got_last, want_last = got[ends], want[ends]
        else:
            got_last, want_last = got, want
        for (rid, tokens, ctx), row in zip(seqs, want_last.argmax(-1).tolist()):
            context[rid] = ctx + len(tokens)
            next_token[rid] = row
        state_err, blocks_ok = _check_state(helix, ref, list(context), mapping)
        records.append({
            "T": sum(len(s[1]) for s in seqs),
            "err": (got - want).abs().max().item(),
            "scale": want.abs().max().item(),
            "tokens_equal": got_last.argmax(-1).tolist() == want_last.argmax(-1).tolist(),
            "capture_err": _rel_err(got_features, want_features),
            "state_err": state_err,
            "blocks_ok": blocks_ok,
            "host_cache": bool(host_cache_seen) and all(host_cache_seen),
        })
    return records


def _world(rank: int, world_size: int, init_method: str, dp: int, cp: int, ckpts: dict[str, str],
           backend: str = "gloo") -> dict:
    torch.manual_seed(0)
    mapping = Mapping(world_size, rank, dp=dp, cp=cp)
    groups = init_parallel(mapping, init_method, backend=backend, local_rank=rank, timeout_s=60)
    try:
        out = {}
        for preset, path in ckpts.items():
            model = load_helix_model(path, mapping, device=groups.device).bind(groups)
            out[preset] = _scenario(model, load_model(path, device=groups.device), mapping)
        return out
    finally:
        groups.destroy()


_RESULTS: dict[tuple[int, int], list[dict]] = {}


@pytest.fixture(scope="module")
def world_results(tiny_checkpoints):
    def get(dp: int, cp: int) -> list[dict]:
        if (dp, cp) not in _RESULTS:
            ckpts = {p: str(tiny_checkpoints[p]) for p in PRESETS}
            _RESULTS[(dp, cp)] = run_local_world(_world, dp * cp, dp, cp, ckpts, timeout_s=240)
        return _RESULTS[(dp, cp)]
    return get


@pytest.mark.parametrize("dp,cp", WORLDS)
def test_helix_forward_equals_single_process(world_results, dp: int, cp: int) -> None:
    _check_records(world_results(dp, cp), dp, exact=dp * cp == 1)


@pytest.mark.gpu
def test_helix_forward_nccl_equals_single_process(tiny_checkpoints) -> None:
    """The same scenario on 2 GPUs over NCCL (cp = 2), fp32."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ckpts = {p: str(tiny_checkpoints[p]) for p in PRESETS}
    _check_records(run_local_world(_world, 2, 1, 2, ckpts, "nccl", timeout_s=300), 1)


def _check_records(per_rank: list[dict], dp: int, exact: bool = False) -> None:
    seen_T = set()
    for rank, by_preset in enumerate(per_rank):
        for preset, records in by_preset.items():
            for step, rec in enumerate(records):
                seen_T.add(rec["T"])
                if rec["T"] == 0:
                    continue
                where = f"{preset} rank {rank} step {step} T={rec['T']}"
                assert rec["err"] <= (0.0 if exact else LOGITS_RTOL * max(1.0, rec["scale"])), \
                    f"{where}: logits differ by {rec['err']:.3e}"
                assert rec["tokens_equal"], f"{where}: greedy tokens differ"
                assert rec["capture_err"] <= (0.0 if exact else LOGITS_RTOL), \
                    f"{where}: kept layer outputs differ by {rec['capture_err']:.3e}"
                assert rec["state_err"] <= STATE_RTOL, f"{where}: KDA state differs by {rec['state_err']:.3e}"
                assert rec["blocks_ok"], f"{where}: MLA blocks are not the round-robin share / rows differ"
                assert rec["host_cache"], f"{where}: a mixer ran outside step_host_cache"
    assert {1, 3, 8, 33} <= seen_T
    if dp > 1:
        assert 0 in seen_T  # an idle CP group ran empty steps


def _mapping(dp: int, cp: int) -> Mapping:
    return Mapping(dp * cp, 0, dp=dp, cp=cp)


def test_config_errors_are_clear() -> None:
    cfg = get_preset("kimi-k3-tiny")
    check_helix_config(cfg, _mapping(2, 2))
    with pytest.raises(HelixConfigError, match=r"KDA num_heads=4 is not divisible by cp=3"):
        check_helix_config(cfg, _mapping(1, 3))
    with pytest.raises(HelixConfigError, match=r"num_experts=8 is not divisible by the world size 6"):
        check_helix_config(cfg, _mapping(3, 2))
    odd = cfg.model_copy(update={"moe_layer_freq": 2})  # layers 2, 4 MoE; 3, 5 dense
    with pytest.raises(HelixConfigError, match=r"layers \[3, 5\] are not MoE but come after the first MoE layer 2"):
        check_helix_config(odd, _mapping(1, 2))
    mla_odd = cfg.model_copy(update={"num_attention_heads": 6, "num_key_value_heads": 6})
    with pytest.raises(HelixConfigError, match=r"MLA num_attention_heads=6 is not divisible by cp=4"):
        check_helix_config(mla_odd, _mapping(1, 4))


def test_load_rejects_indivisible_world_before_reading(tiny_checkpoints) -> None:
    with pytest.raises(HelixConfigError, match="not divisible by cp=3"):
        load_helix_model(tiny_checkpoints["kimi-linear-tiny"], Mapping(3, 0, cp=3))


@pytest.mark.parametrize("preset", PRESETS)
def test_sharded_load_equals_slicing_the_full_model(tiny_checkpoints, tmp_path, preset: str) -> None:
    """Lazy per-rank reads (get_slice, local experts only) == slicing a full load; also for a
    checkpoint layout that takes the read-whole fallback (fused conv1d names); (2, 1): cp = 1 keeps MLA's kv_b_proj."""
    from safetensors.torch import load_file, save_file

    from helixserve.models.helix_load import shard_state_dict

    path = tiny_checkpoints[preset]
    full = load_model(path).state_dict()
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".q_conv1d.weight")]:
        base = name.removesuffix(".q_conv1d.weight")
        tensors[f"{base}.conv1d.weight"] = torch.cat([tensors.pop(f"{base}.{p}_conv1d.weight") for p in "qkv"])
    save_file(tensors, fused / "model.safetensors")
    cases = [(2, 2, rank, path) for rank in range(4)] + [(1, 4, 3, path), (2, 1, 1, path), (2, 2, 1, fused)]
    for dp, cp, rank, source in cases:
        mapping = Mapping(dp * cp, rank, dp=dp, cp=cp)
        want = shard_state_dict(full, get_preset(preset), mapping).state_dict()
        got = load_helix_model(source, mapping).state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"{source.name} rank {rank}/{dp}x{cp}: {name}"
