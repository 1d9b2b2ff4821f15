"""K3 path vs a plain, unabsorbed reference written from kimi.md, reading the checkpoint directly.

transformers has no K3 model, so this reference recomputes the kimi-k3-tiny forward in the most
direct form: tensors by their original ``language_model.*`` names (MXFP4 experts decoded here),
fla's naive KDA recurrence, lower-bound gate and AttnRes (loaded by file path), MLA with keys and
values expanded per head (no absorption, no paged cache), per-token expert loops and the decoder
pseudo-code of kimi.md's AttnRes section written out literally.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helixserve.models.caches import SeqChunk, allocate_caches, build_batch
from helixserve.models.loading import load_model
from helixserve.models.presets import get_preset, make_checkpoint
from tests._testing import load_functions_from_source, load_module_by_path

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2)
    for j in range(packed.shape[1] * 2):
        code = (packed[:, j // 2].long() >> (4 * (j % 2))) & 0xF
        mag = torch.tensor(E2M1)[code & 7] * torch.where(code >= 8, -1.0, 1.0)
        out[:, j] = mag * 2.0 ** (scale[:, j // 32].float() - 127)
    return out


class K3Reference:
    def __init__(self, tensors: dict[str, torch.Tensor], cfg, fla_kda, fla_gate, fla_attnres) -> None:
        self.t = {k.removeprefix("language_model."): v.float() if v.is_floating_point() else v
                  for k, v in tensors.items()}
        self.cfg, self.fla_kda, self.fla_gate, self.fla_attnres = cfg, fla_kda, fla_gate, fla_attnres
        self.experts: dict[str, torch.Tensor] = {}

    def expert(self, name: str) -> torch.Tensor:
        if name not in self.experts:
            self.experts[name] = _decode_fp4(self.t[f"{name}.weight_packed"], self.t[f"{name}.weight_scale"])
        return self.experts[name]

    def w(self, name: str) -> torch.Tensor:
        return self.t[name]

    def rms(self, x: torch.Tensor, name: str, eps: float | None = None) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps if eps is None else eps
        return self.w(name) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def situ_mlp(self, x, gate_w, up_w, down_w) -> torch.Tensor:
        b, bl = self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta
        g, u = x @ gate_w.t(), x @ up_w.t()
        return (b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))) @ down_w.t()

    def kda(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        H, K = cfg.kda_num_heads, cfg.kda_head_dim

        def conv(name: str) -> torch.Tensor:
            y = F.conv1d((x @ self.w(f"{p}{name}_proj.weight").t()).t()[None], self.w(f"{p}{name}_conv1d.weight"),
                         padding=cfg.conv_kernel_size - 1, groups=H * K)[0, :, :T].t()
            return F.silu(y).view(1, T, H, K)

        q, k, v = conv("q"), conv("k"), conv("v")
        q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        f = (x @ self.w(f"{p}f_a_proj.weight").t() @ self.w(f"{p}f_b_proj.weight").t()).view(1, T, H, K)
        g = self.fla_gate(f, self.w(f"{p}A_log")[:H], self.w(f"{p}dt_bias"),
                          lower_bound=cfg.linear_attn_config.gate_lower_bound)
        beta = torch.sigmoid(x @ self.w(f"{p}b_proj.weight").t())[None]
        o, _ = self.fla_kda.naive_recurrent_kda(q, k, v, g, beta, scale=K**-0.5)
        gate = (x @ self.w(f"{p}g_proj.weight").t()).view(T, H, K)
        o = self.rms(o[0], f"{p}o_norm.weight") * torch.sigmoid(gate)
        return o.reshape(T, H * K) @ self.w(f"{p}o_proj.weight").t()

    def mla(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg, T, H = self.cfg, x.shape[0], self.cfg.num_attention_heads
        nope, rope, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q = self.rms(x @ self.w(f"{p}q_a_proj.weight").t(), f"{p}q_a_layernorm.weight", 1e-6)
        q = (q @ self.w(f"{p}q_b_proj.weight").t()).view(T, H, nope + rope)
        ckv = x @ self.w(f"{p}kv_a_proj_with_mqa.weight").t()
        c = self.rms(ckv[:, :r], f"{p}kv_a_layernorm.weight", 1e-6)
        kv = (c @ self.w(f"{p}kv_b_proj.weight").t()).view(T, H, nope + vd)
        k = torch.cat([kv[..., :nope], ckv[:, None, r:].expand(T, H, rope)], -1)
        scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., nope:]).reshape(T, H * vd)
        o = o * torch.sigmoid(x @ self.w(f"{p}g_proj.weight").t())
        return o @ self.w(f"{p}o_proj.weight").t()

    def moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        s = torch.sigmoid(x @ self.w(f"{p}gate.weight").t())
        ids = (s + self.w(f"{p}gate.e_score_correction_bias")).topk(cfg.num_experts_per_token, -1).indices
        weights = s.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        xl = x @ self.w(f"{p}routed_expert_down_proj.weight").t()
        routed = torch.zeros_like(xl)
        for t in range(x.shape[0]):
            for e, wt in zip(ids[t].tolist(), weights[t]):
                ws = [self.expert(f"{p}experts.{e}.{n}") for n in ("w1", "w3", "w2")]
                routed[t] += wt * self.situ_mlp(xl[t : t + 1], *ws)[0]
        y = self.rms(routed, f"{p}routed_expert_norm.weight") @ self.w(f"{p}routed_expert_up_proj.weight").t()
        return y + self.situ_mlp(x, *(self.w(f"{p}shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")))

    def attn_res(self, site: str, prefix: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        return self.fla_attnres.naive_attnres(
            self.w(f"{site}_proj.weight").flatten(), [*bank, prefix], self.w(f"{site}_norm.weight"),
            rms_eps=self.cfg.rms_norm_eps,
        )

    def forward(self, tokens: list[int]) -> torch.Tensor:
        cfg = self.cfg
        prefix = self.w("model.embed_tokens.weight")[torch.tensor(tokens)]
        bank: list[torch.Tensor] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = self.attn_res(p + "self_attention_res", prefix, bank) if bank else prefix
            if i % cfg.attn_res_block_size == 0:
                bank.append(prefix)
                prefix = None
            h = self.rms(x, p + "input_layernorm.weight")
            a = self.kda(p + "self_attn.", h) if cfg.is_kda_layer(i) else self.mla(p + "self_attn.", h)
            prefix = a if prefix is None else prefix + a
            x = self.attn_res(p + "mlp_res", prefix, bank)
            h = self.rms(x, p + "post_attention_layernorm.weight")
            if cfg.is_moe_layer(i):
                ffn = self.moe(p + "block_sparse_moe.", h)
            else:
                ffn = self.situ_mlp(h, *(self.w(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up", "down")))
            prefix = prefix + ffn
        h = self.attn_res("model.output_attn_res", prefix, bank)
        return self.rms(h, "model.norm.weight") @ self.w("lm_head.weight").t()


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return make_checkpoint("kimi-k3-tiny", tmp_path_factory.mktemp("k3ref"), seed=5)


def test_k3_forward_matches_unabsorbed_reference(k3_dir) -> None:
    cfg = get_preset("kimi-k3-tiny")
    assert cfg.num_attn_res_blocks >= 2 and math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size) == 3
    fla_kda = load_module_by_path("fla", "ops/kda/naive.py")
    fla_gate = load_functions_from_source(
        "fla", "ops/kda/gate.py", ["naive_kda_lowerbound_gate"], {"torch": torch, "F": F}
    )["naive_kda_lowerbound_gate"]
    fla_attnres = load_module_by_path("fla", "ops/attnres/naive.py")
    ref_model = K3Reference(load_file(str(k3_dir / "model.safetensors")), cfg, fla_kda, fla_gate, fla_attnres)
    tokens = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = ref_model.forward(tokens)
        model = load_model(k3_dir)
        ours = model(build_batch([SeqChunk(tokens, 0, 0)], 8, 4), allocate_caches(cfg, 8, 8, 1))
    max_diff = (ref - ours).abs().max().item()
    assert max_diff < 1e-4 * max(1.0, ref.abs().max().item()), max_diff
