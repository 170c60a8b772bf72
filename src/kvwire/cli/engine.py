"""``kvwire engine``: the engine model behind vLLM's OpenAI-compatible HTTP API, publishing
real KV events (docs/engine.md).

Wired into ``kvwire`` by :mod:`kvwire.cli.main` through :func:`register` / :func:`run`;
``python -m kvwire.cli.engine ...`` runs it directly.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from .options import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    add_chat_template,
    add_kv_transfer,
    add_log_level,
    configure_logging,
    count,
    nonnegative,
    port,
    positive,
    positive_int,
    transfer_cost,
)

__all__ = ["add_arguments", "main", "options_from_args", "register", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..wire.events import DIALECTS

    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (0: any free one)")
    p.add_argument("--events", default="tcp://*:5557", metavar="ENDPOINT",
                   help="KV events PUB endpoint; DP rank r binds port + r ('none': no events)")
    p.add_argument("--replay", default=None, metavar="ENDPOINT",
                   help="replay/INFO/SNAPSHOT endpoint (port + rank likewise; default none)")
    p.add_argument("--topic", default="", help="KV events topic (default empty)")
    p.add_argument("--dialect", choices=DIALECTS, default="vllm",
                   help="bytes of which engine to publish (default vllm: vLLM 0.33)")
    p.add_argument("--publisher", choices=("kvwire", "reference"), default="kvwire",
                   help="kvwire: heartbeats and snapshots; reference: as vLLM's own (neither)")
    p.add_argument("--model", default="kvwire-engine", metavar="NAME",
                   help="served model name (default kvwire-engine)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face model directory with tokenizer.json (default: built-in)")
    add_chat_template(p, "the engine")
    p.add_argument("--lora", action="append", default=[], metavar="NAME",
                   help="a LoRA adapter name to serve (repeat); its blocks hash apart")
    p.add_argument("--dp-size", type=positive_int, default=1, metavar="N",
                   help="data-parallel ranks (one engine model and publisher each)")
    p.add_argument("--speed", type=positive, default=1.0, metavar="X",
                   help="run the model's clock X times faster than wall time (default 1)")
    d = p.add_argument_group("disaggregated serving (prefill/decode pairs)")
    d.add_argument("--role", choices=("prefill", "decode", "both"), default="both",
                   help="prefill: computes prompts and holds their KV for a decode engine; "
                        "decode: takes a prompt's KV from a prefill engine; both (default): "
                        "either, or neither")
    d.add_argument("--kv-port", type=port, default=None, metavar="P",
                   help="the KV side channel between engines (HTTP/1.1; 0: any free port; "
                        "default: any free port for a prefill or decode role, else none)")
    d.add_argument("--bootstrap-port", type=port, default=None, metavar="P",
                   help="SGLang's bootstrap server (default 8998 on a prefill engine; a "
                        "both engine has one only when given)")
    add_kv_transfer(d, "transfer")
    m = p.add_argument_group("model")
    m.add_argument("--num-gpu-blocks", type=positive_int, default=28_000)
    m.add_argument("--block-size", type=positive_int, default=16)
    m.add_argument("--max-model-len", type=positive_int, default=32768)
    m.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    m.add_argument("--max-num-seqs", type=positive_int, default=256)
    m.add_argument("--cpu-blocks", type=count, default=0, help="CPU offload tier")
    m.add_argument("--step-base-ms", type=positive, default=5.0)
    m.add_argument("--step-prefill-token-us", type=nonnegative, default=50.0)
    m.add_argument("--step-decode-seq-us", type=nonnegative, default=30.0)
    m.add_argument("--step-context-token-ns", type=nonnegative, default=0.0)
    m.add_argument("--seed", type=int, default=0)
    add_log_level(p)


def options_from_args(args: argparse.Namespace):
    """The :class:`EngineOptions` the flags say (ValueError on a bad combination)."""
    from ..engine import EngineConfig, StepCost
    from ..engine.server.app import EngineOptions

    cost = StepCost(args.step_base_ms * 1e-3, args.step_prefill_token_us * 1e-6,
                    args.step_decode_seq_us * 1e-6, args.step_context_token_ns * 1e-9)
    transfer = transfer_cost(args)
    cfg = EngineConfig(num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, cpu_blocks=args.cpu_blocks, cost=cost,
                       seed=args.seed, role=args.role, lease_s=args.kv_lease_s,
                       transfer=transfer, load_failure=args.kv_load_failure,
                       recompute_blocks=args.kv_recompute_blocks)
    events = None if args.events.lower() in ("", "none") else args.events
    return EngineOptions(model=args.model, loras=list(args.lora), config=cfg,
                         max_model_len=args.max_model_len, dp_size=args.dp_size,
                         speed=args.speed, events=events, replay=args.replay, topic=args.topic,
                         dialect=args.dialect, publisher=args.publisher,
                         kv_port=args.kv_port, bootstrap_port=args.bootstrap_port)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``engine`` subcommand to ``kvwire``'s subparsers."""
    p = subparsers.add_parser(
        "engine", help="the engine model behind vLLM's HTTP API, publishing KV events",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="exit status: 0 stopped by SIGINT/SIGTERM; 1 cannot listen or bind; 2 a bad "
        "flag or tokenizer")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


async def _serve(app, host: str, port_: int) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    got: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
    try:
        bound = await app.start(host, port_)
    except (OSError, ValueError) as e:
        print(f"kvwire engine: cannot start: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    pd = app.pd
    side = "" if pd is None else (
        f" role={app.opts.config.role} kv=http://{host}:{pd.kv_port}"
        + (f" bootstrap_port={pd.bootstrap_port}" if pd.bootstrap_port is not None else ""))
    print(f"kvwire engine: serving http://{host}:{bound} model={app.opts.model} "
          f"events={','.join(app.event_endpoints) or 'none'} "
          f"replay={','.join(e or '-' for e in app.replay_endpoints) or 'none'}{side}",
          flush=True)
    await stop.wait()
    await app.stop()
    _say(f"kvwire engine: stopped ({got[0].name}), events flushed")
    return EXIT_OK


def _say(line: str) -> None:
    """A last line on stdout, which a parent (kvwire fleet) relays; if that parent is gone
    (its pipe is broken) the line is dropped quietly rather than raising at exit."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, ValueError):
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run(args: argparse.Namespace) -> int:
    configure_logging(args)
    try:
        opts = options_from_args(args)
        from ..tokenize import load_tokenizer

        tok = load_tokenizer(args.tokenizer, chat_template=args.chat_template,
                             content_format=args.chat_template_content_format)
        from ..engine.server.app import EngineApp

        app = EngineApp(opts, tok)
    except ValueError as e:  # TokenizerError too
        print(f"kvwire engine: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    from ..http1.server import run_loop

    return run_loop(_serve(app, args.host, args.port))  # (on uvloop when installed)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="kvwire engine", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
