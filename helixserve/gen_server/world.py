"""The gen worker's engine when it drives the SPMD helix world (``GenServerConfig.runs_world``):
the world every role runs (:mod:`helixserve.serving.world_core`: rank 0 here, the other ranks
spawned here or started by srun / torchrun, restarts under ``gen[].world_restart``), laid out
dp x cp.

Under ``srun -n dp*cp`` (the SLURM launcher's gen step) or torchrun, every task runs
``helixserve serve-gen``: task 0 is rank 0 and serves HTTP, every other task runs
:func:`~helixserve.serving.world_core.serve_world_rank` (joins, loads its shard, runs plans until rank 0 shuts the world down).
"""

from __future__ import annotations

import logging

import torch

from helixserve.config import DeploymentConfig, GenServerConfig
from helixserve.engine.llm import resolve_dtype
from helixserve.engine.world_rank import ShardReceiverFactory, WorldOptions, pick_backend
from helixserve.models.dummy import model_config_of
from helixserve.parallel import DistEnv
from helixserve.protocol import KVLayout
from helixserve.serving.loading import drafter_prompt_layout
from helixserve.serving.world_core import start_served_world
from helixserve.serving.world_supervisor import ServedWorld
from helixserve.transceiver.layout import layout_for

logger = logging.getLogger(__name__)


def world_layout(deploy: DeploymentConfig, server: GenServerConfig, options: WorldOptions) -> KVLayout:
    """The world's cache layout with global head counts (what a ctx worker of the same
    checkpoint, dtype and block size advertises)."""
    backend = pick_backend(server.world_size, options.backend)
    dtype = resolve_dtype(options.dtype, torch.device("cuda" if backend == "nccl" else "cpu"))
    cfg = model_config_of(deploy.model.path, deploy.model.load_format)
    return layout_for(cfg, dtype, deploy.cache.tokens_per_block, deploy.model.name,
                      drafter_prompt_layout(server.speculative, dtype))


def start_gen_world(deploy: DeploymentConfig, server: GenServerConfig, options: WorldOptions,
                    kv_receiver_factory: ShardReceiverFactory | None, env: DistEnv | None = None) -> ServedWorld:
    """This process as rank 0: of the srun / torchrun world ``env`` describes when it has
    ``dp * cp`` ranks, else of a world whose other ranks are spawned here."""
    return start_served_world(deploy, server, "gen", server.dp, server.cp, options, kv_receiver_factory, env)

