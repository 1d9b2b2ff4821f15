"""Validated configuration: one pydantic model per role, loaded from one YAML file.

Only this module reads the environment. Roles: the model to load, the caches, the single-process
engine, the KV transceiver (:class:`~helixserve.config_transceiver.TransceiverConfig`, torch-free)
and the servers (ctx worker, gen worker: :mod:`helixserve.config_workers`; router) gathered in
one :class:`DeploymentConfig`;
process lifecycles (restarts, shutdown, the launchers' and offline worlds' waits) in
:mod:`helixserve.config_lifecycle` and an HTTP server's client connections in
:mod:`helixserve.config_http`, re-exported here. Every wait's default is set once, here or
there (``tests/unit/test_layering_timeouts.py`` checks that none is written elsewhere).
"""

from __future__ import annotations

import importlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Literal

import yaml
from pydantic import Field, SecretStr, model_validator

from helixserve.config_env import (RESERVED_PORTS_ENV, DistEnv, SlurmEnv, dist_env_from,  # noqa: F401 (re-exported)
                                   reserved_ports_from, slurm_env_from, with_reserved_ports)
from helixserve.config_http import UPSTREAM_KEEPALIVE_S, ConnectionsConfig, WorkerConnectionsConfig  # noqa: F401 (re-exported)
from helixserve.config_lifecycle import (LaunchConfig, RestartPolicy, ShutdownConfig,  # noqa: F401 (re-exported)
                                         SlurmJobConfig, Strict, WorldRunConfig)
from helixserve.config_speculative import SpeculativeConfig  # noqa: F401 (re-exported)
from helixserve.config_transceiver import DEFAULT_KV_TRANSFER_TIMEOUT_MS, TransceiverConfig
from helixserve.config_workers import CtxServerConfig, GenServerConfig  # noqa: F401 (re-exported)

DType = Literal["float32", "bfloat16", "float16"]
INTERNAL_SECRET_ENV = "HELIXSERVE_INTERNAL_SECRET"
INTERNAL_SECRET_FILE_ENV = "HELIXSERVE_INTERNAL_SECRET_FILE"
API_KEYS_ENV = "HELIXSERVE_API_KEYS"  # comma-separated: the router's keys, kept out of the YAML


_Strict = Strict


class ModelSpec(_Strict):
    """Which checkpoint to serve and how to hold it."""

    path: Path
    dtype: DType | None = None  # None: the checkpoint's torch_dtype
    device: str = "cpu"
    served_name: str | None = None  # name in the API; default: the directory name
    # routed experts of an MXFP4 checkpoint: "packed" keeps the FP4 bytes on the GPU (the grouped
    # GEMM dequantizes in registers), "dense" dequantizes at load, "auto" packs on CUDA in bf16
    experts: Literal["auto", "packed", "dense"] = "auto"
    # decode steps run eagerly, no CUDA graphs captured (vLLM's name)
    enforce_eager: bool = False
    # "dummy": seeded random weights at the real shapes, made on the device, no weight file read;
    # ``path`` a checkpoint directory (its config.json) or a preset name (vLLM's name)
    load_format: Literal["auto", "dummy"] = "auto"
    # batch-invariant kernels where they choose a reduction order (kernels.set_batch_invariant)
    deterministic: bool = False

    @property
    def name(self) -> str:
        return self.served_name or self.path.name


class CacheConfig(_Strict):
    """Paged MLA cache and KDA state slots."""

    tokens_per_block: int = Field(16, ge=1, le=4096)
    memory_budget_mib: float = Field(256.0, gt=0)
    max_num_seqs: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's max positions
    # one GPU's memory: a rank whose weights + pools + activations + graph pools exceed it refuses
    # to start (None: on CUDA the device's total memory, on the CPU no check)
    gpu_memory_gib: float | None = Field(None, gt=0)
    # reuse the cache of a prompt's prefix another request computed: MLA blocks by content (a hash
    # chain over their tokens and the request's cache_salt) and KDA state checkpoints
    # (kvcache.prefix_manager); single-process engines, ctx workers and gen worlds (each CP group
    # caches its own prefixes: kvcache.group_prefix); a request whose cache a KV transfer filled
    # publishes nothing (vLLM's enable_prefix_caching)
    prefix_caching: bool = False
    # a prefill saves the KDA recurrent + conv state every this many blocks (and at the last full
    # block before the prompt's last token), taken inside the prefill chunk that covers it
    state_checkpoint_blocks: int = Field(64, ge=1, le=1 << 20)
    # KDA state checkpoints kept (LRU), each the size of a state slot, taken from
    # memory_budget_mib beside the slots; used only with prefix_caching (None: as many as fit in
    # 1/16 of memory_budget_mib, at least 1 and at most 32: planning.memory.checkpoint_slot_count)
    state_checkpoint_slots: int | None = Field(None, ge=1, le=1 << 20)
    # block-stored / block-removed events a prefix-caching worker keeps for the router's
    # cache-aware policy (GET /v1/prefix_events); a router further behind resyncs
    prefix_events_capacity: int = Field(16384, ge=1, le=1 << 24)


class SchedulerConfig(_Strict):
    """Continuous batching limits."""

    max_num_batched_tokens: int = Field(2048, ge=1)
    # enqueue the next decode step before reading this one's tokens back (the device runs it while
    # the host applies them); None = on where decode steps run as CUDA graphs
    overlap_decode: bool | None = None


class EngineConfig(_Strict):
    """Everything a single-process engine needs."""

    model: ModelSpec
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0


class RouterConfig(_Strict):
    """The public front door."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # which ctx / gen worker gets a request; cache_aware (ctx workers with cache.prefix_caching):
    # the ctx worker holding most of its prompt's prefix, weighed against load (docs/configuration.md)
    policy: Literal["round_robin", "least_loaded", "cache_aware"] = "round_robin"
    # cache_aware: the cached blocks one request in flight on a ctx worker weighs as much as
    # (score = prefix blocks the worker holds - this x its requests in flight)
    cache_aware_load_weight: float = Field(1.0, ge=0, le=1 << 20)
    # cache_aware: the fraction of a prompt's blocks a ctx worker must hold for the match to count
    # (SGLang's name; below it, e.g. only a chat template's opening, the least loaded worker)
    cache_threshold: float = Field(0.5, ge=0, le=1)
    # cache_aware: block keys the router remembers per ctx worker (least recently used out first;
    # about 100 bytes each)
    prefix_index_max_blocks: int = Field(1 << 18, ge=1, le=1 << 26)
    api_keys: tuple[str, ...] = ()  # empty: no auth; else "Authorization: Bearer <key>" on /v1/*
    ctx_urls: tuple[str, ...] = ()  # empty: the deployment's ctx workers
    gen_urls: tuple[str, ...] = ()  # empty: the deployment's gen workers
    health_check_interval_s: float = Field(1.0, gt=0)
    health_check_timeout_s: float = Field(2.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)  # longest a worker may take to answer / stream
    control_timeout_s: float = Field(5.0, gt=0, description=(
        "one /v1/abort or /v1/release call from the router to a worker"))
    max_inflight: int = Field(128, ge=1)  # requests forwarded to workers at once
    max_queue_len: int = Field(256, ge=0)  # requests waiting for an inflight slot; then 429
    connections: ConnectionsConfig = ConnectionsConfig()  # the clients' connections to the router


class SecurityConfig(_Strict):
    """Internal authentication between the deployment's own processes (docs/security.md).

    ``internal_secret`` is shared by the router, the workers and the gRPC control plane; clients
    never see it. It is never read from or written to the YAML (``exclude``): it comes from
    ``HELIXSERVE_INTERNAL_SECRET``, else from the file named by ``HELIXSERVE_INTERNAL_SECRET_FILE``
    or ``internal_secret_file`` (see :func:`resolve_security`); ``helixserve launch`` and the SLURM
    launcher generate one, compose reads it from an env file. Without a secret a worker serves no
    internal traffic (disaggregated requests, abort, release) unless ``allow_unauthenticated``
    (a hand-started dev deployment on a trusted machine only).
    """

    internal_secret_file: Path | None = None
    allow_unauthenticated: bool = False
    internal_secret: SecretStr | None = Field(None, exclude=True, repr=False)

    @property
    def secret(self) -> str | None:
        return self.internal_secret.get_secret_value() if self.internal_secret is not None else None


class LimitsConfig(_Strict):
    """What one request may bring, checked by the router and every worker before the work it
    would cost: a larger body is a 413 before it is parsed (``Content-Length``, or counted while a
    chunked body is read); a longer prompt a 400 ``context_length_exceeded`` before it is
    tokenized where its length or byte count proves it, else right after."""

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the context length (max_model_len)


class DeploymentConfig(_Strict):
    """One YAML file: the model, engine limits, every worker and the router."""

    model: ModelSpec
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0
    default_max_tokens: int | None = Field(256, ge=1)  # when a request sets none; None: context
    ctx: list[CtxServerConfig] = Field(default_factory=lambda: [CtxServerConfig()], min_length=1)
    gen: list[GenServerConfig] = Field(default_factory=lambda: [GenServerConfig()], min_length=1)
    router: RouterConfig = RouterConfig()
    security: SecurityConfig = SecurityConfig()
    limits: LimitsConfig = LimitsConfig()
    launch: LaunchConfig = LaunchConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    # ctx senders and gen receivers; kv_transfer_timeout_ms must stay finite (validated there)
    transceiver: TransceiverConfig = Field(
        default_factory=lambda: TransceiverConfig(kv_transfer_timeout_ms=DEFAULT_KV_TRANSFER_TIMEOUT_MS))

    def listen_addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) a process of this deployment listens on, as configured."""
        used = [(w.host, w.port) for w in (*self.ctx, *self.gen)] + [(self.router.host, self.router.port)]
        return used + [endpoint for w in self.ctx for endpoint in w.transceiver_endpoints]

    @model_validator(mode="after")
    def _check_cache_aware(self) -> DeploymentConfig:
        if self.router.policy == "cache_aware" and not self.cache.prefix_caching:
            raise ValueError("router.policy cache_aware routes by the prefixes ctx workers cache: "
                             "set cache.prefix_caching: true")
        return self

    @model_validator(mode="after")
    def _check_ports(self) -> DeploymentConfig:
        used = self.listen_addresses()
        dup = sorted({f"{h}:{p}" for h, p in used if used.count((h, p)) > 1})
        if dup:
            raise ValueError(f"ports used twice in the deployment: {dup}")
        return self

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(model=self.model, cache=self.cache, scheduler=self.scheduler, seed=self.seed)

    @property
    def ctx_urls(self) -> tuple[str, ...]:
        return self.router.ctx_urls or tuple(w.url for w in self.ctx)

    @property
    def gen_urls(self) -> tuple[str, ...]:
        return self.router.gen_urls or tuple(w.url for w in self.gen)

    @property
    def ctx_transceivers(self) -> frozenset[tuple[str, int]]:
        """Every ctx worker's KV senders (a ctx world's every rank's): all a gen may dial."""
        return frozenset(endpoint for w in self.ctx for endpoint in w.transceiver_endpoints)

    @classmethod
    def from_yaml(cls, path: str | Path) -> DeploymentConfig:
        """Load and validate (a relative ``model.path`` is relative to the working directory);
        the internal secret comes from the environment (:func:`resolve_security`)."""
        return resolve_security(cls.model_validate(load_yaml(path)))

    def with_internal_secret(self, secret: str | None) -> DeploymentConfig:
        """This config holding ``secret`` (``None`` or empty: none) in ``security`` and in the
        transceiver config (the gRPC control plane's callers and servers read it there)."""
        value = SecretStr(secret) if secret else None
        security = self.security.model_copy(update={"internal_secret": value})
        transceiver = self.transceiver.model_copy(update={"internal_secret": value})
        return self.model_copy(update={"security": security, "transceiver": transceiver})

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


def resolve_security(deploy: DeploymentConfig, environ: Mapping[str, str] | None = None
                     ) -> DeploymentConfig:
    """Fill the internal secret: ``HELIXSERVE_INTERNAL_SECRET``, else the file named by
    ``HELIXSERVE_INTERNAL_SECRET_FILE``, else ``security.internal_secret_file`` (surrounding
    whitespace stripped); a config that already holds one keeps it. A named file that cannot be
    read is a clear error (never a silent fallback to no authentication)."""
    environ = os.environ if environ is None else environ
    if deploy.security.internal_secret is not None:
        return deploy
    secret = environ.get(INTERNAL_SECRET_ENV, "").strip()
    path = environ.get(INTERNAL_SECRET_FILE_ENV) or deploy.security.internal_secret_file
    if not secret and path:
        try:
            secret = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the internal secret file {path}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"the internal secret file {path} is empty")
    return deploy.with_internal_secret(secret or None)


def router_api_keys(router: RouterConfig, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys the router accepts: ``router.api_keys`` and every one in ``HELIXSERVE_API_KEYS``
    (comma-separated, whitespace stripped; compose's env file puts them there). Empty: no auth."""
    environ = os.environ if environ is None else environ
    from_env = (k.strip() for k in environ.get(API_KEYS_ENV, "").split(","))
    return tuple(dict.fromkeys((*router.api_keys, *(k for k in from_env if k))))


def ensure_internal_secret(deploy: DeploymentConfig) -> DeploymentConfig:
    """For a launcher: the secret from the environment or file (:func:`resolve_security`), else a
    fresh random one (``secrets.token_urlsafe``, 256 bits) for this deployment's life."""
    deploy = resolve_security(deploy)
    if deploy.security.internal_secret is None:
        deploy = deploy.with_internal_secret(secrets.token_urlsafe(32))
    return deploy


def child_environment(deploy: DeploymentConfig) -> dict[str, str]:
    """This process's environment plus the deployment's secret: what a launcher starts its
    processes with (the secret never goes into a config file, a command line or a plan), and
    the deployment's ports reserved, so that no child draws another's port for its own
    rendezvous before that one binds it (``config_env.reserved_ports_from``)."""
    env = with_reserved_ports(os.environ, {p for _, p in deploy.listen_addresses()})
    if deploy.security.secret:
        env[INTERNAL_SECRET_ENV] = deploy.security.secret
    return env


def reserved_ports() -> frozenset[int]:
    """The ports this process's launcher reserved (``HELIXSERVE_RESERVED_PORTS``): what
    ``parallel.ports.free_ports`` must never hand out here."""
    return reserved_ports_from(os.environ)


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a non-mapping document is a clear error."""
    data = yaml.safe_load(Path(path).read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}")
    return data


def slurm_env(environ: Mapping[str, str] | None = None) -> SlurmEnv:
    """The SLURM allocation this process runs in (``SLURM_*`` of ``environ``, default
    ``os.environ``), for the SLURM launcher. Raises ``ValueError`` outside a job."""
    return slurm_env_from(os.environ if environ is None else environ)


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The torchrun / srun rank of this process (``RANK`` / ``SLURM_PROCID`` ... of ``environ``,
    default ``os.environ``), or ``None`` when neither launched it; a gen worker under
    ``srun -n dp*cp`` is one world rank."""
    return dist_env_from(os.environ if environ is None else environ)


def import_without_env_default(module: str, name: str, default: str) -> ModuleType:
    """Import ``module``, which sets ``os.environ[name] = default`` when unset (ucxx does so with
    ``UCX_MEMTYPE_CACHE=n``), then remove that default again; a value that was set before stays."""
    was_set = name in os.environ
    imported = importlib.import_module(module)
    if not was_set and os.environ.get(name) == default:
        del os.environ[name]
    return imported


KERNEL_BACKENDS = ("auto", "reference")


def kernel_backend(environ: dict[str, str] | None = None) -> str:
    """``HELIXSERVE_KERNELS``: ``auto`` (GPU fast paths where installed) or ``reference`` (PyTorch
    references everywhere, e.g. to check a GPU run against the references)."""
    value = (os.environ if environ is None else environ).get("HELIXSERVE_KERNELS", "auto")
    if value not in KERNEL_BACKENDS:
        raise ValueError(f"HELIXSERVE_KERNELS must be one of {KERNEL_BACKENDS}, got {value!r}")
    return value


MLA_BACKENDS = ("auto", "triton", "flashmla")
FLASHMLA_LIB_ENV = "HELIXSERVE_FLASHMLA_LIB"


def mla_backend(environ: Mapping[str, str] | None = None) -> str:
    """``HELIXSERVE_MLA_BACKEND`` for MLA decode: ``auto`` (FlashMLA where it loads and fits, else
    Triton), ``triton`` (never FlashMLA) or ``flashmla`` (FlashMLA required: an error where it does not load)."""
    value = (os.environ if environ is None else environ).get("HELIXSERVE_MLA_BACKEND", "auto")
    if value not in MLA_BACKENDS:
        raise ValueError(f"HELIXSERVE_MLA_BACKEND must be one of {MLA_BACKENDS}, got {value!r}")
    return value


def flashmla_library(environ: Mapping[str, str] | None = None) -> Path:
    """``HELIXSERVE_FLASHMLA_LIB``, else where ``make flashmla`` writes it:
    ``~/.cache/helixserve/flashmla/libflashmla_dense.so``."""
    value = (os.environ if environ is None else environ).get(FLASHMLA_LIB_ENV, "")
    return Path(value).expanduser() if value else Path.home() / ".cache/helixserve/flashmla/libflashmla_dense.so"
