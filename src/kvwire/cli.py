"""``kvwire`` command line: ``listen`` to any engine's KV events, run the ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from datetime import datetime, timezone

from .endpoint import EndpointError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, to_jsonable

__all__ = ["main"]


def _short(h: object) -> str:
    if isinstance(h, bytes):
        return h[:6].hex() + ".."
    return str(h)


def _hashes(hs: list) -> str:
    shown = ", ".join(_short(h) for h in hs[:4])
    return f"[{shown}{', ...' if len(hs) > 4 else ''}]"


def format_batch(seq: int, batch: KVEventBatch, replayed: bool = False) -> str:
    """Human-readable lines for one batch."""
    ts = datetime.fromtimestamp(batch.ts, timezone.utc).strftime("%H:%M:%S.%f")[:-3]
    head = (
        f"seq {seq}  rank {batch.data_parallel_rank}  {ts}Z  {len(batch.events)} events"
        + ("  (replayed)" if replayed else "")
    )
    lines = [head]
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            lines.append(
                f"  BlockStored   {len(ev.block_hashes)} blocks {_hashes(ev.block_hashes)} "
                f"parent {_short(ev.parent_block_hash)}  {len(ev.token_ids)} tokens  "
                f"block_size {ev.block_size}  medium {ev.medium}"
                + (f"  lora {ev.lora_name or ev.lora_id}" if ev.lora_id or ev.lora_name else "")
            )
        elif isinstance(ev, BlockRemoved):
            lines.append(
                f"  BlockRemoved  {len(ev.block_hashes)} blocks {_hashes(ev.block_hashes)} "
                f"medium {ev.medium}"
            )
        elif isinstance(ev, AllBlocksCleared):
            lines.append("  AllBlocksCleared")
    return "\n".join(lines)


def _cmd_listen(args: argparse.Namespace) -> int:
    from .listen import Listener

    def notice(msg: str) -> None:
        print(f"kvwire listen: {msg}", file=sys.stderr, flush=True)

    try:
        listener = Listener(
            args.endpoint, args.replay, args.topic, replay_timeout=args.replay_timeout,
            from_seq=args.from_seq, on_notice=notice,
        )
    except EndpointError as e:
        print(f"kvwire listen: {e}", file=sys.stderr)
        return 2
    out = sys.stdout
    try:
        with listener:
            for d in listener.run(count=args.count, duration=args.duration):
                if args.json:
                    obj = {"seq": d.seq, "stream": args.endpoint, **to_jsonable(d.batch)}
                    if d.replayed:
                        obj["replayed"] = True
                    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
                else:
                    out.write(format_batch(d.seq, d.batch, d.replayed) + "\n")
                out.flush()
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        return 0
    s = listener.stats
    notice(
        f"{s.delivered} batches, {s.gaps} gaps, {s.filled} filled from replay, "
        f"{s.missed} lost, {s.restarts} restarts, {s.bad_payloads} bad payloads"
    )
    if args.count is not None and s.delivered < args.count:
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    s = run_demo(steps=args.steps, capacity=args.capacity, rate=args.rate, seed=args.seed)
    print("\nkvwire demo summary")
    print(f"  engine steps            {s.steps}")
    print(f"  batches published       {s.batches_published} (+ heartbeats)")
    print(f"  batches delivered       {s.batches_delivered}")
    print(f"  blocks stored / removed {s.blocks_stored} / {s.blocks_removed}")
    print(f"  prefix-cache hit rate   {s.prefix_hit_rate:.1%}")
    print(f"  gaps / filled / lost    {s.gaps} / {s.filled_from_replay} / {s.lost}")
    print(f"  engine cache blocks     {s.engine_blocks}")
    print(f"  rebuilt by listener     {s.rebuilt_blocks} "
          f"({'exact match' if s.rebuilt_matches else 'MISMATCH'})")
    print(f"  wall time               {s.seconds:.1f} s")
    return 0 if s.rebuilt_matches else 1


def _cmd_keys(args: argparse.Namespace) -> int:
    from .curve import generate_keys

    public, secret = generate_keys(args.directory, args.name)
    print(f"public key: {public}  (give to peers)")
    print(f"secret key: {secret}  (mode 0600, keep private)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvwire", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = p.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("listen", help="print the KV events of a publisher")
    ls.add_argument("endpoint", help="live endpoint, e.g. tcp://10.0.0.5:5557 (bind if it has *)")
    ls.add_argument("--replay", metavar="ENDPOINT", help="replay endpoint used to fill seq gaps")
    ls.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    ls.add_argument("--json", action="store_true", help="one JSON object per batch on stdout")
    ls.add_argument("--count", type=int, metavar="N", help="exit 0 after N batches")
    ls.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    ls.add_argument("--from-seq", type=int, metavar="SEQ",
                    help="deliver from SEQ on (older ones from the replay buffer)")
    ls.add_argument("--replay-timeout", type=float, default=2.0, metavar="S")
    ls.set_defaults(func=_cmd_listen)

    ks = sub.add_parser("keys", help="generate a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    ks.add_argument("directory")
    ks.add_argument("name")
    ks.set_defaults(func=_cmd_keys)

    dm = sub.add_parser("demo", help="run an embedded engine and a live listener")
    dm.add_argument("--steps", type=int, default=3000)
    dm.add_argument("--capacity", type=int, default=4096, help="engine cache size in blocks")
    dm.add_argument("--rate", type=float, default=1000.0, help="engine steps per second")
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(name)s: %(levelname)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
