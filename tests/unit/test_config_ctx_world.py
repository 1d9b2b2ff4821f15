"""The ctx world's config: ``ctx[i].tp`` and ``ctx[i].ep`` (resolved once to tp), bounds, ep != tp
and speculative decoding in a world refused with the offending values named; each rank's KV
sender port (``transceiver_port + rank``) reserved and allowed to gen."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helixserve.config import CtxServerConfig, DeploymentConfig


@pytest.mark.parametrize("tp", [1, 2, 16])
def test_ep_defaults_to_tp_resolved_once(tp):
    server = CtxServerConfig(tp=tp)
    assert (server.tp, server.ep, server.world_size) == (tp, tp, tp)
    assert CtxServerConfig.model_validate(server.model_dump()) == server  # a dump reloads as itself


def test_a_deployment_yaml_gives_each_ctx_worker_its_world(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("model: {path: ckpt}\nctx:\n  - {tp: 2, port: 8101, transceiver_port: 18101}\n"
                    "  - {port: 8102, transceiver_port: 18103}\n")
    deploy = DeploymentConfig.from_yaml(path)
    assert [(w.tp, w.ep) for w in deploy.ctx] == [(2, 2), (1, 1)]


@pytest.mark.parametrize("fields,match", [
    ({"tp": 0}, "tp"),
    ({"tp": -1}, "tp"),
    ({"tp": 2, "ep": 0}, "ep"),
    ({"tp": 2, "ep": 4}, r"ctx.ep=4 must equal ctx.tp=2"),
    ({"tp": 4, "ep": 1}, r"ctx.ep=1 must equal ctx.tp=4"),
    ({"ep": 2}, r"ctx.ep=2 must equal ctx.tp=1"),
    ({"tp": 2, "speculative": {"method": "ngram"}}, r"ctx.speculative is not supported in a ctx world \(tp=2\)"),
    ({"tp": 2, "bogus": 1}, "bogus"),
])
def test_bad_world_refused_naming_the_value(fields, match):
    with pytest.raises(ValidationError, match=match):
        CtxServerConfig(**fields)


def test_speculative_stays_allowed_at_one_rank():
    assert CtxServerConfig(tp=1, speculative={"method": "ngram"}).speculative is not None


def _deploy(model, tp: int, kv_source: str) -> DeploymentConfig:
    return DeploymentConfig.model_validate({
        "model": {"path": str(model)}, "ctx": [{"tp": tp}], "gen": [{"dp": 1, "cp": 1, "kv_source": kv_source}]})


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_of_a_ctx_world_has_its_transceiver_port_which_gen_may_dial(tp):
    deploy = DeploymentConfig.model_validate({
        "model": {"path": "ckpt"}, "ctx": [{"tp": tp, "transceiver_port": 18300}, {"port": 8101, "transceiver_port": 18400}]})
    ranks = [("127.0.0.1", 18300 + r) for r in range(tp)]
    assert deploy.ctx[0].transceiver_endpoints == ranks
    assert deploy.ctx_transceivers == frozenset([*ranks, ("127.0.0.1", 18400)])
    assert set(ranks) <= set(deploy.listen_addresses())


def test_a_ctx_world_whose_rank_ports_collide_or_overflow_is_refused_naming_them():
    with pytest.raises(ValidationError, match=r"ports used twice in the deployment: \['127.0.0.1:18301'\]"):
        DeploymentConfig.model_validate({"model": {"path": "ckpt"}, "ctx": [
            {"tp": 2, "transceiver_port": 18300}, {"port": 8101, "transceiver_port": 18301}]})
    with pytest.raises(ValidationError, match=r"transceiver_port=65535: a ctx world of tp=2 listens on ports up to"):
        CtxServerConfig(tp=2, transceiver_port=65535)
    assert CtxServerConfig(tp=1, transceiver_port=65535).transceiver_endpoints == [("127.0.0.1", 65535)]


def test_a_ctx_world_whose_heads_do_not_divide_is_refused_before_any_rank_starts(tiny_checkpoints):
    from helixserve.ctx_server.app import build_ctx_app
    from helixserve.models.sharding import HelixConfigError

    deploy = _deploy(tiny_checkpoints["kimi-k3-tiny"], 3, "recompute")
    with pytest.raises(HelixConfigError, match=r"KDA num_heads=4 is not divisible by cp=3"):
        build_ctx_app(deploy, deploy.ctx[0])
