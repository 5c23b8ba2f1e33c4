"""`commctx-server`: run the rendezvous server until SIGTERM or SIGINT.

Configuration comes from flags, defaulting to COMMCTX_* environment variables;
this is the only place the server reads the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from .app import host_port, start_server

DEFAULTS = {"host": "0.0.0.0", "port": 50051, "lease_ttl_s": 10.0, "grace_s": 5.0, "log_level": "INFO"}


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ) -> argparse.Namespace:
    def default(name: str) -> object:
        return env.get(f"COMMCTX_{name.upper()}", DEFAULTS[name])

    p = argparse.ArgumentParser(prog="commctx-server", description="commctx rendezvous server")
    p.add_argument("--host", default=default("host"), help="address to listen on (COMMCTX_HOST; default %(default)s)")
    p.add_argument("--port", type=int, default=default("port"), help="port; 0 picks a free one (COMMCTX_PORT; default %(default)s)")
    p.add_argument("--lease-ttl-s", type=float, default=default("lease_ttl_s"),
                   help="member lease in seconds; clients renew at a third of it (COMMCTX_LEASE_TTL_S; default %(default)s)")
    p.add_argument("--grace-s", type=float, default=default("grace_s"),
                   help="on SIGTERM, how long in-flight calls may finish (COMMCTX_GRACE_S; default %(default)s)")
    p.add_argument("--log-level", default=default("log_level"), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   type=str.upper, help="(COMMCTX_LOG_LEVEL; default %(default)s)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} is out of range 0..65535")
    if not args.lease_ttl_s > 0:
        p.error(f"--lease-ttl-s {args.lease_ttl_s} must be positive")
    if args.grace_s < 0:
        p.error(f"--grace-s {args.grace_s} must not be negative")
    return args


async def serve(args: argparse.Namespace) -> None:
    server = await start_server(args.host, args.port, lease_ttl_s=args.lease_ttl_s)
    print(f"commctx-server listening on {host_port(args.host, server.port)}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("commctx.server").info("draining (grace %.1f s)", args.grace_s)
    # A second signal while draining exits at once.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, os._exit, 1)
    await server.stop(args.grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    # A job's joins arrive as one burst of short-lived objects; Python's default
    # gen-0 threshold (700) would run the collector thousands of times a burst.
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
