"""The ``helixserve`` command.

Subcommands: ``make-checkpoint`` (write a preset checkpoint), ``generate`` (run the engine on a
prompt). Heavy imports happen inside each subcommand so ``helixserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

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
    from helixserve.models.presets import make_checkpoint

    make_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} checkpoint to {args.out}")
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
    if args.dp * args.cp > 1:
        from helixserve.engine.world_llm import generate_on_world

        result = generate_on_world(args.model, args.prompt, args.prompt_ids, params, dp=args.dp, cp=args.cp)
    else:
        llm = LLM(args.model, dtype=args.dtype)
        prompt = args.prompt_ids if args.prompt_ids is not None else args.prompt
        result = llm.generate([prompt], params)[0]
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason, "prompt_token_ids": result.prompt_token_ids}))
    else:
        print(result.text)
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
    mk.set_defaults(func=_cmd_make_checkpoint)

    gen = sub.add_parser("generate", help="generate from a prompt with the built-in engine")
    gen.add_argument("--model", required=True, help="checkpoint directory")
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
    gen.add_argument("--dp", type=int, default=1)
    gen.add_argument("--cp", type=int, default=1)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_cmd_generate)
    return parser


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
