"""Command line: ``aotx serve|device|broker|gateway``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import ids
from .config import ConfigError, Settings, log_level
from .mailbox import DEFAULT_MAILBOXES, SCAN_ALL
from .paths import PathError, RuntimePaths, for_state_dir
from .wire import MAX_PAYLOAD

if TYPE_CHECKING:  # (the gateway's modules load only where a command needs them)
    from .gateway.credentials import CredentialStore, PrincipalGrant


def _state_dir(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--state-dir", default=default,
                   help="state folder (default: $AOTX_STATE_DIR or ./state)")


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high``, else the option's error
    (a value the device's fields cannot hold would fail later, less clearly)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high}")
        return value
    return parse


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be above 0 and at most 1")
    return value


def _log_level(text: str) -> str:
    try:
        return log_level(text, "--log-level")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


U32 = (1 << 32) - 1


def _device_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retention-seconds", type=_int_in(1, U32), default=900,
                   help="keep terminal results this long (default 900)")
    p.add_argument("--retention-requests", type=_int_in(1, U32), default=4096,
                   help="keep at most this many terminal results per principal, oldest "
                        "reclaimed first (default 4096)")
    p.add_argument("--max-active", type=_int_in(1, U32), default=1024,
                   help="queued + running requests the device accepts (default 1024)")
    p.add_argument("--window-bytes", type=_int_in(1, MAX_PAYLOAD), default=32768,
                   help=f"largest output window one read returns (default 32768, at most "
                        f"{MAX_PAYLOAD}: one packet)")
    p.add_argument("--media-pool-bytes", type=_int_in(1, (1 << 63) - 1), default=1 << 30,
                   help="bytes all media sources may hold together (default 1 GiB)")
    p.add_argument("--principal-share", type=_share, default=0.5,
                   help="the part of the active requests and of the media pool one "
                        "principal may hold unless its grant says (default 0.5)")
    p.add_argument("--memory-budget", type=_int_in(0, (1 << 63) - 1), default=0,
                   help="bytes the loaded models' estimated memory may take together; "
                        "models loaded on first use are unloaded to stay within it "
                        "(default 0: three quarters of the machine's memory)")
    p.add_argument("--load-wait-seconds", type=_int_in(1, U32), default=120,
                   help="how long a request waits for memory to load its model before "
                        "503 (default 120)")
    p.add_argument("--device-id", type=_int_in(0, ids.MAX_DEVICE_ID), default=0,
                   help="this device's number among several behind one router, 0 to "
                        "65535: the first four digits of its request ids (default 0; "
                        "docs/scale-out.md)")


def _byte_offset(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be a byte offset, 0 or more")
    return value


def build_parser(settings: Settings | None = None) -> argparse.ArgumentParser:
    settings = settings or Settings()
    parser = argparse.ArgumentParser(prog="aotx", description="Local LLM inference service")
    parser.add_argument("--log-level", type=_log_level, default=settings.log_level,
                        help="DEBUG, INFO, WARNING, ERROR or CRITICAL")
    sub = parser.add_subparsers(dest="command", required=True)
    state = settings.state_dir

    s = sub.add_parser("serve", help="start device, broker and gateway, supervised")
    _state_dir(s, state)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_int_in(1, 65535), default=8000)
    s.add_argument("--models", help="models file (default: STATE_DIR/models.toml)")
    s.add_argument("--models-dir", help="folder of GGUF models loaded on first use "
                                        "(default: STATE_DIR/models)")
    s.add_argument("--mailboxes", type=_int_in(1, SCAN_ALL - 1), default=DEFAULT_MAILBOXES)
    _device_limits(s)

    d = sub.add_parser("device", help="run the device runtime alone")
    _state_dir(d, state)
    d.add_argument("--models", help="models file (default: STATE_DIR/models.toml)")
    d.add_argument("--models-dir", help="folder of GGUF models loaded on first use "
                                        "(default: STATE_DIR/models)")
    d.add_argument("--mailboxes", type=_int_in(1, SCAN_ALL - 1), default=DEFAULT_MAILBOXES)
    _device_limits(d)

    b = sub.add_parser("broker", help="run the broker alone")
    _state_dir(b, state)
    b.add_argument("--mailboxes", type=_int_in(1, SCAN_ALL - 1), default=DEFAULT_MAILBOXES)

    g = sub.add_parser("gateway", help="run the HTTP gateway alone")
    _state_dir(g, state)
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_int_in(1, 65535), default=8000)
    _token_parsers(sub, state)
    sb = sub.add_parser("submit", help="submit a prompt; print its id (and follow it)")
    _state_dir(sb, state)
    sb.add_argument("prompt")
    sb.add_argument("--model", default="smollm2")
    sb.add_argument("--max-tokens", type=int)
    sb.add_argument("--temperature", type=float)
    sb.add_argument("--follow", action="store_true", help="stream the output as it comes")
    sb.add_argument("--url")
    sb.add_argument("--token")
    fo = sub.add_parser("follow", help="stream a request's output (re-attach by id)")
    _state_dir(fo, state)
    fo.add_argument("id")
    fo.add_argument("--cursor", type=_byte_offset, default=0,
                    help="the byte offset to follow from (default 0)")
    fo.add_argument("--url")
    fo.add_argument("--token")
    ch = sub.add_parser("chat", help="interactive chat (history kept for the session)")
    _state_dir(ch, state)
    ch.add_argument("--model", default="smollm2")
    ch.add_argument("--max-tokens", type=int, default=256)
    ch.add_argument("--system", help="a system message for the whole session")
    ch.add_argument("--url")
    ch.add_argument("--token")
    st = sub.add_parser("status", help="print a summary of a running service")
    _state_dir(st, state)
    st.add_argument("--url", help="gateway URL (default: STATE_DIR/run/gateway.url)")
    st.add_argument("--token", help="bearer token (default: STATE_DIR/admin.token)")
    gr = sub.add_parser("grant", help="grants")
    gsub = gr.add_subparsers(dest="grant_command", required=True)
    gs = gsub.add_parser("show", help="show grant definitions and what the device holds")
    _state_dir(gs, state)
    from . import models_cli

    models_cli.add_parsers(sub, state, _state_dir)
    return parser


def _token_parsers(sub: Any, state: str) -> None:
    t = sub.add_parser("token", help="manage bearer tokens")
    tsub = t.add_subparsers(dest="token_command", required=True)
    tc = tsub.add_parser("create", help="create a token; prints it as the last line")
    _state_dir(tc, state)
    tc.add_argument("--principal", required=True)
    tc.add_argument("--actions", default="submit,read,cancel,media",
                    help="comma list of: submit, read, cancel, media, telemetry, "
                         "policy-read, policy-control, admin")
    tc.add_argument("--models", default="*", help="comma list of model aliases, * for all")
    tc.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                    help="active, output_tokens, input_bytes, media_sources, media_bytes, rate")
    tc.add_argument("--memory", action="store_true",
                    help="enable automatic memory for this principal (off unless given)")
    tl = tsub.add_parser("list", help="list tokens (never their values)")
    _state_dir(tl, state)
    tr = tsub.add_parser("revoke", help="revoke a token by id")
    _state_dir(tr, state)
    tr.add_argument("id", type=int)


def _token_command(args: argparse.Namespace, state_dir: str) -> int:
    from .gateway.credentials import (
        ADMIN,
        CredentialError,
        CredentialStore,
        parse_actions,
        parse_limits,
    )

    store = CredentialStore(state_dir)
    try:
        if args.token_command == "create":
            models = tuple(m.strip() for m in args.models.split(",") if m.strip())
            if not models:  # "" reads as none, and a grant of no model serves nothing
                raise CredentialError("--models: name at least one model alias, or *")
            if args.principal == ADMIN:  # a new grant would last until the next start
                raise CredentialError(f"{ADMIN} is the service's own principal, its grant "
                                      "set at every start; create another principal")
            before = _grant_of(store, args.principal)
            tid, token = store.create_token(args.principal, parse_actions(args.actions), models,
                                            parse_limits(args.limit), args.memory)
            if before is not None:  # docs/security.md: "Several tokens, one grant"
                print(f"aotx: principal {args.principal}: " + (
                    "grant unchanged (one more token for it)" if before == _grant_of(
                        store, args.principal) else "grant replaced: its earlier requests "
                    "and responses are no longer readable, and its running ones stop"),
                    file=sys.stderr)
            print(f"token {tid} for principal {args.principal}; shown once, store it now:")
            print(token)
        elif args.token_command == "list":
            for t in store.tokens():
                state = "revoked" if t["revoked"] else "live"
                print(f"{t['id']}\t{t['principal']}\t{state}")
        elif args.token_command == "revoke":
            if not store.revoke(args.id):
                print(f"aotx: no live token {args.id}", file=sys.stderr)
                return 1
            print(f"token {args.id} revoked")
    except CredentialError as exc:
        print(f"aotx: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()
    return 0


def _grant_of(store: CredentialStore, principal: str) -> PrincipalGrant | None:
    """The principal's grant definition as the credential store holds it, if any."""
    return next((p for p in store.principals() if p.name == principal), None)


def _grant_show(state_dir: str, socket_path: str) -> int:
    from . import wire
    from .gateway.credentials import CredentialStore, action_names

    store = CredentialStore(state_dir)
    live, _ = store.snapshot()
    holders = set(live.values())
    print("principal\tid\tactions\tmodels\tlimits\tmemory\ttokens")
    for p in store.principals():
        limits = ",".join(f"{k}={v}" for k, v in sorted(p.limits.items())) or "-"
        print(f"{p.name}\t{p.id}\t{','.join(action_names(p.actions)) or '-'}\t"
              f"{','.join(p.models)}\t{limits}\t{'on' if p.memory else 'off'}\t"
              f"{'live' if p.id in holders else 'none'}")
    store.close()
    if os.path.exists(socket_path):
        import socket as _socket

        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        s.settimeout(5)
        try:
            s.connect(socket_path)
            cursor, first = 0, True
            while True:  # a page (GRANT_PAGE rows) at a time
                s.send(wire.encode_packet(wire.Header(op=wire.Op.GRANT_READ, tag=1,
                                                      cursor=cursor)))
                h, body = wire.decode_packet(s.recv(wire.MAX_PACKET))
                if first:
                    print(f"\ndevice (epoch {h.epoch}):\n"
                          "principal id\trevision\tactions\tmodel mask")
                    first = False
                page = wire.decode_grants(body, h.total) if h.status == 200 else []
                for g in page:
                    print(f"{g.principal}\t{g.revision}\t"
                          f"{','.join(action_names(g.actions)) or '-'}\t{g.model_mask:#x}")
                if len(page) < wire.GRANT_PAGE:
                    break
                cursor = page[-1].principal + 1
        except OSError as exc:
            print(f"\ndevice not reachable: {exc}")
        finally:
            s.close()
    return 0


def _endpoint(args: argparse.Namespace, state_dir: str, run_dir: str) -> tuple[str, str]:
    try:
        url = args.url or open(os.path.join(run_dir, "gateway.url")).read().strip()
        token = args.token or open(os.path.join(state_dir, "admin.token")).read().strip()
    except OSError as exc:
        raise SystemExit(f"aotx: no running service found in {state_dir}: {exc}") from None
    return url, token


def _follow(c: object, request_id: str, cursor: int = 0) -> int:
    from rich.console import Console

    from .client import Client, RequestState

    assert isinstance(c, Client)

    # While nothing has arrived yet (queued, prompt evaluation), show a spinner with the
    # request's state on stderr when it is a terminal; it goes away with the first byte.
    err = Console(stderr=True)
    status = err.status("waiting for the device…") if err.is_terminal else None
    if status is not None:
        status.start()
    try:
        for item in c.events(request_id, cursor):
            if isinstance(item, RequestState) and status is not None:
                status.update(f"{item.state}…")
            elif not isinstance(item, RequestState):
                if status is not None:
                    status.stop()
                    status = None
                break
        for text in c.text(request_id, cursor):
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        state = c.cancel(request_id)
        print(f"\n[cancel requested; state {state.state}]", file=sys.stderr)
        return 130
    finally:
        if status is not None:
            status.stop()
    state = c.wait(request_id)
    print(f"\n[{state.state}, finish {state.finish_reason}, "
          f"{state.usage['completion_tokens']} tokens]", file=sys.stderr)
    return 0 if state.state == "completed" else 1


def _submit_or_follow(args: argparse.Namespace, state_dir: str, run_dir: str) -> int:
    import httpx

    from .client import AotxError, Client

    url, token = _endpoint(args, state_dir, run_dir)
    with Client(url, token) as c:
        try:
            if args.command == "follow":
                return _follow(c, args.id, args.cursor)
            params = {k: v for k, v in (("max_tokens", args.max_tokens),
                                        ("temperature", args.temperature)) if v is not None}
            adm = c.submit([{"role": "user", "content": args.prompt}], args.model, **params)
            print(adm.id, flush=True)
            return _follow(c, adm.id) if args.follow else 0
        except AotxError as exc:
            print(f"aotx: {exc.status} {exc.message}", file=sys.stderr)
            return 1
        except httpx.TransportError as exc:  # follow has retried for a minute already
            print(f"aotx: {url} is not answering: {exc}", file=sys.stderr)
            return 1


def _chat(args: argparse.Namespace, state_dir: str, run_dir: str) -> int:
    """A line-oriented chat: each turn is a native request followed over SSE.

    Ctrl-C while an answer streams cancels that request on the device and keeps
    the session; Ctrl-C or Ctrl-D at the prompt ends it.
    """
    import httpx

    from .client import AotxError, Client

    url, token = _endpoint(args, state_dir, run_dir)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(f"aotx chat on {url} with {args.model} (Ctrl-C cancels an answer, Ctrl-D quits)")
    with Client(url, token) as c:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line:
                continue
            history.append({"role": "user", "content": line})
            try:
                adm = c.submit(history, args.model, max_tokens=args.max_tokens)
            except (AotxError, httpx.TransportError) as exc:
                print(f"[{exc.status}: {exc.message}]" if isinstance(exc, AotxError)
                      else f"[{url} is not answering: {exc}]")
                history.pop()
                continue
            sys.stdout.write("bot> ")
            answer = []
            try:
                for text in c.text(adm.id):
                    answer.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
                print()
            except KeyboardInterrupt:
                state = c.cancel(adm.id)
                print(f"\n[cancelled on the device: {state.state}]")
            history.append({"role": "assistant", "content": "".join(answer)})


def _status(args: argparse.Namespace, state_dir: str, run_dir: str) -> int:
    import httpx

    try:
        url = args.url or open(os.path.join(run_dir, "gateway.url")).read().strip()
        token = args.token or open(os.path.join(state_dir, "admin.token")).read().strip()
    except OSError as exc:
        print(f"aotx: no running service found in {state_dir}: {exc}", file=sys.stderr)
        return 1
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=10) as c:
            caps = c.get("/aotx/v1/capabilities")
            tele = c.get("/aotx/v1/telemetry")
            metrics = c.get("/metrics")
            policy = c.get("/aotx/v1/policy")
    except httpx.HTTPError as exc:
        print(f"aotx: {url} is not answering: {exc}", file=sys.stderr)
        return 1
    if caps.status_code != 200:
        print(f"aotx: capabilities answered {caps.status_code}: {caps.text}", file=sys.stderr)
        return 1
    cj = caps.json()
    print(f"aotx at {url}  runtime epoch {cj['runtime_epoch']}")
    for m in cj["models"]:
        print(f"  model {m['alias']} (role {m['role']}) sha256 {m['model_sha256'][:16]}... "
              f"inputs {','.join(m['input_modalities'])} automatic_memory {m['automatic_memory']}")
    lim = cj["limits"]
    print(f"  slots {lim['slots']}  context {lim['context_tokens']} tokens  "
          f"active requests <= {lim['active_requests']}")
    if metrics.status_code == 200:
        states = {}
        for line in metrics.text.splitlines():
            if line.startswith("aotx_requests{state="):
                name = line.split('"')[1]
                states[name] = int(float(line.rsplit(" ", 1)[1]))
        active = sum(v for k, v in states.items() if k in ("queued", "preparing", "running"))
        print(f"  requests: {active} active; by state "
              + (", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "none"))
    if tele.status_code == 200:
        t = tele.json()["sample"]
        print(f"  allocation {int(t['service_allocation_bytes']) / 2**20:.1f} MiB  "
              f"device tick {t['device_tick']}  clock {int(t['device_clock_ns']) / 1e9:.1f} s")
    if policy.status_code == 200:
        pj = policy.json()
        print(f"  policy: state {pj.get('state')} reason {pj.get('reason')}")
    else:
        print("  policy: not provided by this service")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_env()  # the one read of the environment
    except ConfigError as exc:
        print(f"aotx: {exc}", file=sys.stderr)
        return 2
    args = build_parser(settings).parse_args(argv)
    from .supervise import configure_logging

    configure_logging(args.log_level)
    paths = for_state_dir(args.state_dir)
    try:
        paths.ensure()
    except PathError as exc:
        print(f"aotx: {exc}", file=sys.stderr)
        return 2
    if args.command == "token":
        return _token_command(args, paths.state_dir)
    if args.command == "chat":
        return _chat(args, paths.state_dir, paths.run_dir)
    if args.command in ("submit", "follow"):
        return _submit_or_follow(args, paths.state_dir, paths.run_dir)
    if args.command == "status":
        return _status(args, paths.state_dir, paths.run_dir)
    if args.command == "grant":
        return _grant_show(paths.state_dir, paths.socket)
    if args.command in ("pull", "models"):
        from . import models_cli

        return (models_cli.pull(args, paths.state_dir) if args.command == "pull"
                else models_cli.run(args, paths.state_dir, paths.run_dir))
    return _component(args, paths, settings)


def _component(args: argparse.Namespace, paths: RuntimePaths, settings: Settings) -> int:
    """``serve`` (the supervisor) or one of the processes it starts."""
    if args.command == "serve":
        from .supervise import serve

        device_args = ["--retention-seconds", str(args.retention_seconds),
                       "--retention-requests", str(args.retention_requests),
                       "--max-active", str(args.max_active),
                       "--window-bytes", str(args.window_bytes),
                       "--media-pool-bytes", str(args.media_pool_bytes),
                       "--principal-share", str(args.principal_share),
                       "--device-id", str(args.device_id),
                       "--memory-budget", str(args.memory_budget),
                       "--load-wait-seconds", str(args.load_wait_seconds)]
        if args.models_dir:
            device_args += ["--models-dir", args.models_dir]
        return serve(paths, args.host, args.port, args.models, args.mailboxes, device_args,
                     log_level=args.log_level, settings=settings)
    if args.command == "device":
        from .device import runtime
        from .device.models import ModelConfigError
        from .device.state import DeviceLimits
        from .supervise import EX_CONFIG

        limits = DeviceLimits(retention_seconds=args.retention_seconds,
                              retention_requests=args.retention_requests,
                              max_active=args.max_active,
                              window_bytes=args.window_bytes,
                              media_total_bytes=args.media_pool_bytes,
                              principal_share=args.principal_share,
                              device_id=args.device_id, memory_budget=args.memory_budget,
                              load_wait_seconds=args.load_wait_seconds)
        try:
            runtime.run(paths, args.mailboxes, args.models, limits, settings, args.models_dir)
        except ModelConfigError as exc:  # its models file: starting again would not help
            print(f"aotx device: refused to start: {exc}", file=sys.stderr)
            return EX_CONFIG
    elif args.command == "broker":
        from .broker import server

        server.run(paths, args.mailboxes, settings.short_slice)
    elif args.command == "gateway":
        from .gateway import app

        app.run(paths, args.host, args.port, settings)
    else:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
