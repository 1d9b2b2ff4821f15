"""The ``helixserve`` command.

Subcommands: ``make-checkpoint`` (write a preset checkpoint), ``plan`` (GPUs and memory per role),
``generate`` (run the engine on a prompt), ``serve-ctx`` / ``serve-gen`` (one worker), ``router``
(the front door) and ``launch`` (router + workers on this machine from one YAML). Heavy imports happen inside each subcommand so
``helixserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence

from helixserve.config_speculative import SpeculativeConfig  # (a torch-free leaf)
from helixserve.training.config import TrainingConfig  # (torch-free)

logger = logging.getLogger("helixserve")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    if args.train_on is not None:
        return _train_checkpoint(args)
    given = [f"--{name.replace('_', '-')}" for name in ("train_steps", "draft_preset", "draft_out", "draft_steps",
                                                        "hidden_preset", "hidden_out") if getattr(args, name) is not None]
    if given:
        flags = ", ".join(given)
        raise ValueError(f"{flags}: only with --train-on (a random-weight checkpoint is not trained)")
    from helixserve.models.presets import make_checkpoint

    make_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype, tokenizer=args.tokenizer)
    print(f"wrote {args.preset} checkpoint to {args.out}")
    return 0


def _train_checkpoint(args: argparse.Namespace) -> int:
    from helixserve.training.checkpoint import default_draft_preset, default_hidden_preset, train_checkpoint

    draft = default_draft_preset(args.preset) if args.draft_preset is None else args.draft_preset
    if draft in (None, "none") and args.draft_out is not None:
        raise ValueError(f"--draft-out {args.draft_out}: no draft is trained for {args.preset} (name --draft-preset)")
    hidden = default_hidden_preset(args.preset) if args.hidden_preset is None else args.hidden_preset
    if hidden in (None, "none") and args.hidden_out is not None:
        raise ValueError(f"--hidden-out {args.hidden_out}: no hidden drafter is trained for {args.preset} "
                         "(name --hidden-preset)")
    given = {"steps": args.train_steps, "draft_steps": args.draft_steps}
    tc = TrainingConfig(seed=args.seed, tokenizer=args.tokenizer, dtype=args.dtype,
                        **{k: v for k, v in given.items() if v is not None})
    report = train_checkpoint(args.preset, args.out, args.train_on, tc, None if draft == "none" else draft,
                              args.draft_out, None if hidden == "none" else hidden, args.hidden_out)
    for m in filter(None, (report.target, report.draft, report.hidden)):
        held = "" if m.held_out_loss is None else f"; held-out loss {m.held_out_loss_init:.3f} -> {m.held_out_loss:.3f}"
        agree = "" if m.greedy_agreement is None else f"; greedy agreement with the target {m.greedy_agreement:.1%}"
        print(f"trained {m.preset} for {len(m.losses)} steps in {m.seconds:.0f} s "
              f"(loss {m.losses[0]:.3f} -> {m.losses[-1]:.3f}{held}{agree}); wrote {m.out_dir}")
    if draft is None:
        print(f"no draft: {args.preset} has no default draft preset (name one with --draft-preset)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from helixserve.engine.llm import LLM
    from helixserve.engine.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    speculative = None
    if args.speculative is not None:
        speculative = SpeculativeConfig(method=args.speculative, num_draft_tokens=args.num_draft_tokens,
                                        draft_model=args.draft_model,
                                        draft_tensor_parallel_size=args.draft_tensor_parallel_size)
    if args.dp * args.cp > 1:
        from helixserve.launch.offline import generate_on_world

        result = generate_on_world(args.model, args.prompt, args.prompt_ids, params, dp=args.dp, cp=args.cp,
                                   dtype=args.dtype, load_format=args.load_format, enforce_eager=args.enforce_eager,
                                   speculative=speculative)
    else:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
                  load_format=args.load_format, speculative=speculative)
        prompt = args.prompt_ids if args.prompt_ids is not None else args.prompt
        result = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason, "prompt_token_ids": result.prompt_token_ids}))
    else:
        print(result.text)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from helixserve.planning.report import run, table

    plan = run(args)
    print(json.dumps(plan, indent=2) if args.json else table(plan))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helixserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-checkpoint", help="write a preset checkpoint (config, weights, tokenizer)")
    mk.add_argument("--preset", required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    mk.add_argument("--tokenizer", choices=["hf", "kimi"], default="hf",
                    help="hf: tokenizer.json; kimi: tiktoken.model + tokenizer_config.json + "
                         "chat_template.jinja + generation_config.json, as Moonshot publishes")
    mk.add_argument("--train-on", default=None, metavar="DIR",
                    help="train the preset on the .py files under DIR (e.g. Python's standard library), "
                         "tokenized with the checkpoint's tokenizer, instead of writing random weights; "
                         "a share of the files is held out and scored before and after")
    mk.add_argument("--train-steps", type=int, default=None,
                    help=f"training steps with --train-on (default {TrainingConfig.model_fields['steps'].default})")
    mk.add_argument("--draft-preset", default=None, metavar="NAME",
                    help="with --train-on: the draft model trained against the target on the same text "
                         "(default: the preset's two-layer cut, e.g. kimi-linear-tiny-draft; none: no draft)")
    mk.add_argument("--draft-out", default=None, metavar="DIR", help="the draft's checkpoint (default: OUT/draft)")
    mk.add_argument("--draft-steps", type=int, default=None,
                    help="each drafter's training steps (default: --train-steps)")
    mk.add_argument("--hidden-preset", default=None, metavar="NAME",
                    help="with --train-on: the hidden-state drafter trained against the target on the same text "
                         "(default: the preset's, e.g. kimi-linear-tiny-hidden; none: no hidden drafter)")
    mk.add_argument("--hidden-out", default=None, metavar="DIR",
                    help="the hidden drafter's checkpoint (default: OUT/hidden)")
    mk.set_defaults(func=_cmd_make_checkpoint)

    gen = sub.add_parser("generate", help="generate from a prompt with the built-in engine")
    gen.add_argument("--model", required=True, help="checkpoint directory (--load-format dummy: or a preset name)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", type=_parse_ids)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    gen.add_argument("--device", default="cpu", help="cpu or cuda[:N] (CUDA: bf16 by default, decode in CUDA graphs)")
    gen.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                     help="dummy: seeded random weights at the model's shapes, no weight file read")
    gen.add_argument("--enforce-eager", action="store_true",
                     help="decode without CUDA graphs (model.enforce_eager)")
    gen.add_argument("--dp", type=int, default=1)
    gen.add_argument("--cp", type=int, default=1)
    gen.add_argument("--speculative", choices=["ngram", "draft", "hidden"], default=None,
                     help="speculative decoding: draft tokens by prompt lookup (ngram), a draft model (draft) or a "
                          "drafter reading the target's hidden states (hidden, EAGLE-3 class)")
    gen.add_argument("--draft-model", default=None, metavar="DIR",
                     help="--speculative draft or hidden: the drafter checkpoint (the target's vocabulary)")
    gen.add_argument("--num-draft-tokens", type=int, default=3, help="draft tokens per step (1-7)")
    gen.add_argument("--draft-tensor-parallel-size", type=int, default=1, metavar="N",
                     help="--speculative draft or hidden with --cp: 1 runs the drafter on each CP group's leader, "
                          "the cp splits its heads over the group (speculative.draft_tensor_parallel_size)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_cmd_generate)
    _add_server_commands(sub)
    from helixserve.planning.report import add_arguments

    plan = sub.add_parser("plan", help="GPUs and memory per role for a model (no GPU needed)")
    add_arguments(plan)
    plan.set_defaults(func=_cmd_plan)
    return parser


def _load_deployment(args: argparse.Namespace):  # -> DeploymentConfig
    from helixserve.config import DeploymentConfig

    if args.config is None and getattr(args, "model", None) is None:
        raise ValueError("give a deployment config (-c FILE) or --model DIR")
    deploy = DeploymentConfig.from_yaml(args.config) if args.config else DeploymentConfig(model={"path": args.model})
    if getattr(args, "model", None):
        deploy = deploy.model_copy(update={"model": deploy.model.model_copy(update={"path": args.model})})
    return deploy


def _worker_config(deploy, role: str, args: argparse.Namespace):
    workers = deploy.ctx if role == "ctx" else deploy.gen
    if not 0 <= args.index < len(workers):
        raise ValueError(f"--index {args.index}: the config has {len(workers)} {role} workers")
    server = workers[args.index]
    return server.model_copy(update={"port": args.port}) if args.port else server


def _cmd_serve_ctx(args: argparse.Namespace) -> int:
    """One ctx worker. With tp > 1 its world's ranks are spawned here, unless srun / torchrun
    started this command as tp tasks: then task 0 serves HTTP and the others are its world ranks."""
    from helixserve.ctx_server.app import build_ctx_app
    from helixserve.ctx_server.world import run_ctx_rank
    from helixserve.serving.http import serve

    deploy = _load_deployment(args)
    server = _worker_config(deploy, "ctx", args)
    env = _launcher_rank(server.tp > 1)
    if env is not None and env.rank != 0:
        run_ctx_rank(deploy, server, env)
        return 0
    app = build_ctx_app(deploy, server, env)  # tp > 1: this process is rank 0 of the ctx world
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # see _cmd_serve_gen
    serve(app, server.host, server.port, args.log_level, deploy.shutdown.connections_grace_s,
          server.connections)
    return _worker_exit_code("serve-ctx", app)


def _worker_exit_code(command: str, app) -> int:  # noqa: ANN001 (a FastAPI app)
    """1 (the cause on stderr) when the worker stopped itself because its world failed for good
    or its warm-up failed; else 0."""
    world = getattr(app.state, "world", None)
    code = world.exit_code if world is not None else None
    if code:  # its world failed for good: whatever started this worker should restart it
        print(f"helixserve {command}: the {world.role} world failed for good: {world.failure()}", file=sys.stderr)
        return code
    worker = app.state.worker
    if not worker.exit_code:
        return 0
    print(f"helixserve {command}: the worker stopped: {worker.warm_up.failure()}", file=sys.stderr)
    return worker.exit_code


def _launcher_rank(runs_world: bool):  # -> DistEnv | None
    """This worker's srun / torchrun rank when it runs a world that a launcher started as several
    tasks; None when one task (e.g. the launcher's own srun step) or none: the ranks are spawned here."""
    from helixserve.config import dist_env

    env = dist_env() if runs_world else None
    return env if env is not None and env.world_size > 1 else None


def _cmd_serve_gen(args: argparse.Namespace) -> int:
    """One gen worker. Its SPMD world's ranks are spawned here, unless srun / torchrun started
    this command as dp x cp tasks: then task 0 serves HTTP and the others are its world ranks."""
    from helixserve.gen_server.app import build_gen_app, run_gen_rank
    from helixserve.serving.http import serve

    deploy = _load_deployment(args)
    server = _worker_config(deploy, "gen", args)
    env = _launcher_rank(server.runs_world)
    if env is not None and env.rank != 0:
        run_gen_rank(deploy, server, env)
        return 0
    app = build_gen_app(deploy, server, env)
    # uvicorn re-raises the SIGTERM it shut down for once it restored this handler: a no-op, so
    # that this function returns (exit code 0, or 1 when the world failed for good or the warm-up
    # failed, and the worker stopped itself with that SIGTERM) instead of dying of the signal
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    serve(app, server.host, server.port, args.log_level, deploy.shutdown.connections_grace_s,
          server.connections)
    return _worker_exit_code("serve-gen", app)


def _cmd_router(args: argparse.Namespace) -> int:
    from helixserve.router.app import build_router_app_from
    from helixserve.serving.http import serve

    deploy = _load_deployment(args)
    if args.port:
        deploy = deploy.model_copy(update={"router": deploy.router.model_copy(update={"port": args.port})})
    serve(build_router_app_from(deploy), deploy.router.host, deploy.router.port, args.log_level,
          deploy.shutdown.connections_grace_s, deploy.router.connections)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from helixserve.launch.local import launch

    return launch(args.config, model=args.model, port=args.port, log_level=args.log_level,
                  ready_timeout_s=args.ready_timeout, restart=args.restart, max_restarts=args.max_restarts)


def _add_server_commands(sub) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    for name, func, help_text in (("serve-ctx", _cmd_serve_ctx, "run one context (prefill) worker"),
                                  ("serve-gen", _cmd_serve_gen, "run one generation (decode) worker")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("-c", "--config", help="deployment YAML")
        p.add_argument("--model", help="checkpoint directory (overrides the config's model.path)")
        p.add_argument("--index", type=int, default=0, help="which worker of the config's list")
        p.add_argument("--port", type=int, default=None, help="override the worker's port")
        p.set_defaults(func=func)
    rt = sub.add_parser("router", help="run the OpenAI front door")
    rt.add_argument("-c", "--config", help="deployment YAML")
    rt.add_argument("--model", help="checkpoint directory (its name is the served model name)")
    rt.add_argument("--port", type=int, default=None)
    rt.set_defaults(func=_cmd_router)
    la = sub.add_parser("launch", help="start router + ctx + gen workers here; Ctrl-C stops all")
    la.add_argument("-c", "--config", default=None, help="deployment YAML (default: local tiny model)")
    la.add_argument("--model", default=None, help="checkpoint directory (made if missing and tiny)")
    la.add_argument("--port", type=int, default=None, help="router port")
    la.add_argument("--ready-timeout", type=float, default=None,
                    help="seconds to wait for /ready (default: the config's launch.ready_timeout_s)")
    la.add_argument("--no-restart", dest="restart", action="store_false", default=None,
                    help="stop everything when a process exits (default: restart it, see launch.restart)")
    la.add_argument("--max-restarts", type=int, default=None,
                    help="restarts allowed per process within launch.restart.window_s (default: the config's)")
    la.set_defaults(func=_cmd_launch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"helixserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
