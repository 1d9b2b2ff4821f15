"""The workers' server settings (torch-free leaf of :mod:`helixserve.config`, re-exported there):
one context (prefill) worker, one generation (decode) worker."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from helixserve.config_http import WorkerConnectionsConfig
from helixserve.config_lifecycle import RestartPolicy, Strict
from helixserve.config_speculative import SpeculativeConfig


class WorldWorkerConfig(Strict):
    """The waits and restarts of a worker that drives a world: a gen worker's, a ctx worker's of
    ``tp > 1`` (:mod:`helixserve.serving.world_core`)."""

    collective_timeout_s: float = Field(60.0, gt=0, description="a world collective waiting longer fails")
    world_restart: RestartPolicy = Field(RestartPolicy(), description=(
        "a world whose rank died (or whose collective failed) is restarted in place under this policy; "
        "past it, or when srun / torchrun started the ranks, the worker exits non-zero"))
    heartbeat_s: float = Field(2.0, gt=0, description=(
        "longest idle gap between world steps: a dead srun rank shows within it"))
    world_stop_grace_s: float = Field(10.0, gt=0, description=(
        "a healthy world's spawned ranks get this long to exit after the shutdown plan, then SIGKILL"))
    failed_world_grace_s: float = Field(2.0, gt=0, description=(
        "a failed world's surviving spawned ranks get this long to exit, then SIGKILL"))
    restart_join_timeout_s: float = Field(60.0, gt=0, description=(
        "a worker shutting down waits this long for a world restart in progress"))


class CtxServerConfig(WorldWorkerConfig):
    """One context (prefill) worker: HTTP server over one engine; holds prefills for its gen worker.

    ``tp > 1``: the worker is a world of ``tp`` ranks laid out as the gen world's helix layout
    dp 1 x cp tp (KDA heads and MLA value heads tensor-parallel over the ranks, MLA latent pages
    dealt round-robin, experts over ``ep`` = every rank); this process is rank 0 and runs the
    scheduler and the HTTP server. Whether the model's heads and experts divide is checked at
    start-up and by ``helixserve plan -c`` (the config does not read the checkpoint).
    """

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    max_queue_len: int = Field(64, ge=0)  # requests waiting beyond the running slots; then 429
    pickup_timeout_s: float = Field(30.0, gt=0)  # hold deadline: a held prefill no gen worker fetched by then is freed
    release_grace_s: float = Field(1.0, gt=0, description=(
        "a router's release of a picked-up prefill waits this long for the gen ranks' acknowledgements"))
    transceiver_host: str = "127.0.0.1"  # the ctx transceiver's control endpoint, sent to gen
    transceiver_port: int = Field(18100, ge=1, le=65535, description=(
        "the KV sender's control plane port; a ctx world's rank r listens on transceiver_port + r"))
    device: str | None = None  # overrides model.device for this worker (e.g. "cuda:0")
    # one short request through the engine before /ready answers 200 (serving/warm_up.py)
    warm_up: bool = True
    warm_up_timeout_s: float = Field(600.0, gt=0, description=(
        "a warm-up taking longer fails: /health answers 503 and the worker exits 1"))
    connections: WorkerConnectionsConfig = WorkerConnectionsConfig()
    speculative: SpeculativeConfig | None = Field(None, description=(
        "speculative decoding in this worker's engine (None: off); a ctx worker of one rank only. With "
        "method hidden the drafter runs over each prompt here and its prompt cache travels with the request "
        "to a gen worker running the same drafter (its CP group's leader drafts as an aggregated engine)"))
    tp: int = Field(1, ge=1, description=(
        "ranks of this ctx worker's world: KDA heads and MLA value heads tensor-parallel over them, "
        "MLA latent pages dealt round-robin (block b on rank b % tp), the helix layout dp 1 x cp tp; "
        "this process is rank 0 and spawns ranks 1 .. tp-1"))
    ep: int | None = Field(None, ge=1, description=(
        "expert-parallel ranks of the ctx world (None: tp); must equal tp (experts over every rank)"))

    @model_validator(mode="after")
    def _check_world(self) -> CtxServerConfig:
        if self.ep is None:
            object.__setattr__(self, "ep", self.tp)  # resolved once: experts over every rank
        if self.ep != self.tp:
            raise ValueError(f"ctx.ep={self.ep} must equal ctx.tp={self.tp}: a ctx world runs expert "
                             "parallelism over every rank (the gen world's Mapping)")
        if self.speculative is not None and self.tp > 1:
            raise ValueError(f"ctx.speculative is not supported in a ctx world (tp={self.tp}): it runs in "
                             "a ctx worker of one rank only (tp: 1)")
        if self.transceiver_port + self.tp - 1 > 65535:
            raise ValueError(f"ctx.transceiver_port={self.transceiver_port}: a ctx world of tp={self.tp} "
                             f"listens on ports up to transceiver_port + {self.tp - 1}, above 65535")
        return self

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def transceiver_endpoints(self) -> list[tuple[str, int]]:
        """``(transceiver_host, port)`` of each rank's KV sender, in rank order."""
        return [(self.transceiver_host, self.transceiver_port + r) for r in range(self.tp)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class GenServerConfig(WorldWorkerConfig):
    """One generation (decode) worker: HTTP server on gen rank 0 of a dp x cp world.

    ``kv_source``: how ``generation_only`` requests get their prompt state. ``ucx``: every rank of
    the request's CP group receives its shard from the ctx worker's transceiver (the data path);
    ``recompute``: gen re-prefills the prompt (a fallback; nothing is transferred). A ``ucx``
    worker, or any dp x cp > 1, runs the SPMD helix world (one rank when dp = cp = 1).
    """

    host: str = "127.0.0.1"
    port: int = Field(8200, ge=1, le=65535)
    max_queue_len: int = Field(64, ge=0)
    dp: int = Field(1, ge=1)
    cp: int = Field(2, ge=1)
    kv_source: Literal["ucx", "recompute"] = "ucx"
    device: str | None = None  # overrides model.device for this worker (e.g. "cuda:1")
    # one short request through the engine (the world) before /ready answers 200 (serving/warm_up.py)
    warm_up: bool = True
    warm_up_timeout_s: float = Field(600.0, gt=0, description=(
        "a warm-up taking longer fails: /health answers 503 and the worker exits 1"))
    connections: WorkerConnectionsConfig = WorkerConnectionsConfig()
    speculative: SpeculativeConfig | None = Field(None, description=(
        "speculative decoding in this worker's engine (None: off); in a world each CP group's leader drafts "
        "(a draft model or hidden-state drafter on full rows) and verifies, every rank runs the verify rows on "
        "its shard; a drafter with draft_tensor_parallel_size = cp runs on every rank, its heads split"))

    @model_validator(mode="after")
    def _check_draft_tp(self) -> GenServerConfig:
        tp = 1 if self.speculative is None else self.speculative.draft_tensor_parallel_size
        if tp not in (1, self.cp):
            raise ValueError(f"speculative.draft_tensor_parallel_size={tp} must be 1 (each CP group's leader) or "
                             f"gen.cp={self.cp} (the drafter's heads over the CP group)")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def runs_world(self) -> bool:
        """Whether this worker drives the SPMD world (else a single-process engine)."""
        return self.world_size > 1 or self.kv_source == "ucx"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
