"""`mcore-rl-serve` command line: SGLang's launch flags (those that apply) -> a LocalEngine behind the HTTP app."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from aiohttp import web

from mcore_rl.api_key import ApiKeyError
from mcore_rl.rollout.local.engine import LocalEngine
from mcore_rl.rollout.server import auth, weight_update
from mcore_rl.rollout.server.app import build_app
from mcore_rl.rollout.server.state import Limits

log = logging.getLogger("mcore_rl.serve")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="SGLang-compatible HTTP server over the mcore-rl local engine")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    auth.add_arguments(p)
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    p.add_argument("--max-samples-per-request", type=int, default=Limits.max_samples_per_request)
    p.add_argument("--max-queued-samples", type=int, default=Limits.max_queued_samples)
    p.add_argument("--weight-group-timeout-s", type=float, default=weight_update.GROUP_TIMEOUT_S,
                   help="rendezvous and broadcast timeout of a joined weight-update group")  # fmt: skip
    # SGLang's flags, accepted so one launcher command line fits both servers. This engine is always seeded
    # per sample, and releases memory without a saver; both are reported in /server_info.
    p.add_argument("--tp-size", type=int, default=1, choices=[1])
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--log-requests", action="store_true", help="log every generated sample (json lines)")
    p.add_argument("--log-requests-target", default="stdout",
                   help="stdout or a directory (SGLang's flag): DIR/requests-PORT.jsonl")  # fmt: skip
    p.add_argument("--is-embedding", action="store_true",
                   help="serve an HF *ForSequenceClassification folder on /classify and /encode (SGLang's flag)")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:  # before the model loads: a key file others can read is refused with one line, exit 2
        key = auth.server_api_key(args)
    except ApiKeyError as exc:
        print(f"mcore-rl-serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    info = {
        "model_path": args.model_path, "host": args.host, "port": args.port, "tp_size": args.tp_size,
        "dp_size": 1, "device": args.device, "dtype": args.dtype, "version": "mcore-rl-serve/0.1",
        "enable_memory_saver": args.enable_memory_saver,
        "enable_deterministic_inference": args.enable_deterministic_inference,
    }  # fmt: skip
    limits = Limits(args.max_body_bytes, args.max_samples_per_request, args.max_queued_samples)
    log.info("mcore-rl-serve: http://%s:%d  model=%s  auth=%s", args.host, args.port, args.model_path,
             "on" if key else "off")  # fmt: skip
    web.run_app(_app(args, info, limits, key), host=args.host, port=args.port, print=None,
                handler_cancellation=True)  # fmt: skip


def _app(args: argparse.Namespace, info: dict, limits: Limits, key: str | None) -> web.Application:
    """The generation server over a LocalEngine, or with --is-embedding the /classify server over a reward model."""
    kw = dict(device=args.device, dtype=args.dtype, num_threads=args.num_threads, max_batch_size=args.max_batch_size,
              weight_version=args.weight_version)  # fmt: skip
    if args.is_embedding:
        from mcore_rl.rollout.server.classify import build_embedding_app
        from mcore_rl.rollout.server.reward_model import RewardModelServer

        try:
            server = RewardModelServer(args.model_path, **kw)
        except (OSError, ValueError) as exc:
            print(f"mcore-rl-serve: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return build_embedding_app(server, {**info, "is_embedding": True}, limits=limits, api_key=key)
    engine = LocalEngine(args.model_path, seed=args.seed, **kw)
    return build_app(engine, info, limits=limits, api_key=key, weight_group_timeout_s=args.weight_group_timeout_s,
                     request_log=_request_log(args))  # fmt: skip


def _request_log(args: argparse.Namespace) -> str | None:
    if not args.log_requests:
        return None
    if args.log_requests_target == "stdout":
        return "stdout"
    folder = Path(args.log_requests_target)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"requests-{args.port}.jsonl")


if __name__ == "__main__":
    main()
