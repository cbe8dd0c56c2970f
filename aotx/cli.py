"""Command line: ``aotx serve|device|broker|gateway``."""

from __future__ import annotations

import argparse
import os
import sys

from .mailbox import DEFAULT_MAILBOXES
from .paths import PathError, for_state_dir


def _state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=os.environ.get("AOTX_STATE_DIR", "./state"),
                   help="state folder (default: $AOTX_STATE_DIR or ./state)")


def _device_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retention-seconds", type=int, default=900,
                   help="keep terminal results this long (default 900)")
    p.add_argument("--retention-requests", type=int, default=4096,
                   help="keep at most this many terminal results, oldest reclaimed first")
    p.add_argument("--max-active", type=int, default=1024,
                   help="queued + running requests the device accepts (default 1024)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aotx", description="Local LLM inference service")
    parser.add_argument("--log-level", default=os.environ.get("AOTX_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start device, broker and gateway, supervised")
    _state_dir(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--models", help="models file (default: STATE_DIR/models.toml)")
    s.add_argument("--mailboxes", type=int, default=DEFAULT_MAILBOXES)
    _device_limits(s)

    d = sub.add_parser("device", help="run the device runtime alone")
    _state_dir(d)
    d.add_argument("--models", help="models file (default: STATE_DIR/models.toml)")
    d.add_argument("--mailboxes", type=int, default=DEFAULT_MAILBOXES)
    _device_limits(d)

    b = sub.add_parser("broker", help="run the broker alone")
    _state_dir(b)
    b.add_argument("--mailboxes", type=int, default=DEFAULT_MAILBOXES)

    g = sub.add_parser("gateway", help="run the HTTP gateway alone")
    _state_dir(g)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .supervise import configure_logging

    configure_logging(args.log_level)
    paths = for_state_dir(args.state_dir)
    try:
        paths.ensure()
    except PathError as exc:
        print(f"aotx: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        from .supervise import serve

        device_args = ["--retention-seconds", str(args.retention_seconds),
                       "--retention-requests", str(args.retention_requests),
                       "--max-active", str(args.max_active)]
        return serve(paths, args.host, args.port, args.models, args.mailboxes, device_args)
    if args.command == "device":
        from . import device

        limits = device.DeviceLimits(retention_seconds=args.retention_seconds,
                                     retention_requests=args.retention_requests,
                                     max_active=args.max_active)
        device.run(paths, args.mailboxes, args.models, limits)
        return 0
    if args.command == "broker":
        from . import broker

        broker.run(paths, args.mailboxes)
        return 0
    if args.command == "gateway":
        from . import gateway

        gateway.run(paths, args.host, args.port)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
