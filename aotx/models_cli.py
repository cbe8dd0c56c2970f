"""``aotx models``: list the models of a running service with their residency, load or
unload one (the admin routes of gateway/routes_models.py), fetch one (``aotx pull``), and
remove one of the models folder's files (``rm``: only when no live grant names it and
the service, if it runs, has it unloaded)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


def add_parsers(sub: Any, state: str, state_dir: Any) -> None:
    """``aotx pull`` and ``aotx models ...`` (``state_dir(parser, default)`` adds
    --state-dir)."""
    pull_parser(sub.add_parser("pull", help="fetch a GGUF model into the models folder"),
                state, state_dir)
    m = sub.add_parser("models", help="list, load, unload, pull and remove models")
    msub = m.add_subparsers(dest="models_command", required=True)
    for name, what in (("list", "the models and their state (loaded, unloaded, ...)"),
                       ("load", "load a model loaded on first use now"),
                       ("unload", "unload a model once its requests end"),
                       ("rm", "remove a model's file from the models folder")):
        p = msub.add_parser(name, help=what)
        state_dir(p, state)
        p.add_argument("--url", help="gateway URL (default: STATE_DIR/run/gateway.url)")
        p.add_argument("--token", help="bearer token (default: STATE_DIR/admin.token)")
        if name != "list":
            p.add_argument("alias")
        if name == "unload":
            p.add_argument("--cancel", action="store_true",
                           help="cancel its running and queued requests first")
        if name == "rm":
            p.add_argument("--models-dir", help="default: STATE_DIR/models")
    pull_parser(msub.add_parser("pull", help="the same as aotx pull"), state, state_dir)


def pull_parser(p: argparse.ArgumentParser, state: str, state_dir: Any) -> None:
    state_dir(p, state)
    p.add_argument("ref", help="owner/repo[:QUANT or :FILE.gguf] (Hugging Face), or an https "
                               "URL of a .gguf file")
    p.add_argument("--mmproj", action="store_true", help="also fetch the model's projector")
    p.add_argument("--models-dir", help="default: STATE_DIR/models")


def pull(args: argparse.Namespace, state_dir: str) -> int:
    from .pull import PullError
    from .pull import pull as fetch

    try:
        placed = fetch(args.ref, args.models_dir or os.path.join(state_dir, "models"),
                       mmproj=args.mmproj)
    except PullError as exc:
        print(f"aotx pull: {exc}", file=sys.stderr)
        return 1
    for path in placed:
        print(path)
    return 0


def run(args: argparse.Namespace, state_dir: str, run_dir: str) -> int:
    import httpx

    if args.models_command == "pull":
        return pull(args, state_dir)
    if args.models_command == "rm":
        return remove(args, state_dir, run_dir)
    try:
        with _client(args, state_dir, run_dir) as c:
            if args.models_command == "list":
                r = c.get("/aotx/v1/models")
            else:
                body = {"cancel": True} if getattr(args, "cancel", False) else None
                r = c.post(f"/aotx/v1/models/{args.alias}/{args.models_command}", json=body)
    except (OSError, httpx.HTTPError) as exc:
        print(f"aotx models: no running service answers in {state_dir}: {exc}", file=sys.stderr)
        return 1
    if r.status_code >= 400:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        print(f"aotx models: {r.status_code} {why}", file=sys.stderr)
        return 1
    if args.models_command == "list":
        print(table(r.json()))
    else:
        e = r.json()
        print(f"{e['alias']}: {e['status']['value']}"
              + (" (unloads once its requests end)" if e["unload_asked"] else ""))
    return 0


def _client(args: argparse.Namespace, state_dir: str, run_dir: str) -> httpx.Client:
    """A client of the running service (OSError when none is found)."""
    import httpx

    url = args.url or open(os.path.join(run_dir, "gateway.url")).read().strip()
    token = args.token or open(os.path.join(state_dir, "admin.token")).read().strip()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                        timeout=30)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def table(doc: dict[str, Any]) -> str:
    """``aotx models list``'s text, as ``ollama ps`` prints: a row per model."""
    rows = [("ALIAS", "STATE", "SIZE", "MEMORY", "UNTIL")]
    for m in doc["models"]:
        s = m["status"]
        until = ("pinned" if s["keep_alive"] < 0 else
                 f"{s['expires_in']:.0f} s idle" if s["expires_in"] is not None else "")
        state = s["value"] + (f": {s['reason']}" if s["reason"] else "")
        rows.append((m["alias"], state, _mib(s["file_bytes"]), _mib(s["memory_bytes"]), until))
    for u in doc.get("unassigned") or ():
        rows.append((u["alias"], f"no role: {u['reason']}", _mib(u["file_bytes"]), "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[4]
             for r in rows]
    lines.append(f"memory budget {_mib(doc['budget_bytes'])}, {_mib(doc['used_bytes'])} "
                 "estimated in use")
    return "\n".join(line.rstrip() for line in lines)


def remove(args: argparse.Namespace, state_dir: str, run_dir: str) -> int:
    """Remove the models folder's model ``args.alias`` (its file, or its folder with its
    projector): refused while a live grant names it, or the running service has it
    loaded or loading."""
    from .device.catalog import scan
    from .gateway.credentials import CredentialStore

    folder = args.models_dir or os.path.join(state_dir, "models")
    found = next((f for f in scan(folder)[0] if f.alias == args.alias), None)
    if found is None:
        print(f"aotx models rm: the models folder {folder} holds no model {args.alias!r}",
              file=sys.stderr)
        return 1
    store = CredentialStore(state_dir)
    try:
        users = [g.name for g in store.snapshot()[1].values() if args.alias in g.models]
    finally:
        store.close()
    if users:
        print(f"aotx models rm: the grants of {', '.join(users)} name {args.alias}; revoke "
              "their tokens or change their models first", file=sys.stderr)
        return 1
    state = _served_state(args, state_dir, run_dir)
    if state == "unknown":
        print("aotx models rm: the running service did not say whether the model is "
              "loaded; refusing to remove its file", file=sys.stderr)
        return 1
    if state not in (None, "unloaded", "failed"):
        print(f"aotx models rm: {args.alias} is {state}; unload it first "
              f"(aotx models unload {args.alias})", file=sys.stderr)
        return 1
    parent = os.path.dirname(found.path)
    if os.path.realpath(parent) != os.path.realpath(folder):  # a model folder: all of it
        shutil.rmtree(parent)
        print(f"removed {parent}")
        return 0
    for path in (found.path, found.mmproj):
        if path:
            os.remove(path)
            print(f"removed {path}")
    return 0


def _served_state(args: argparse.Namespace, state_dir: str, run_dir: str) -> str | None:
    """The model's state in the running service; None when no service runs (or it does
    not list the model); "unknown" when one answers but does not say."""
    import httpx

    try:
        with _client(args, state_dir, run_dir) as c:
            r = c.get("/aotx/v1/models")
    except (OSError, httpx.ConnectError):  # no gateway.url, or nothing listens there
        return None
    except httpx.HTTPError:
        return "unknown"
    try:
        listed = r.json()["models"] if r.status_code == 200 else None
    except (ValueError, KeyError):
        listed = None
    if listed is None:
        return "unknown"
    return next((m["status"]["value"] for m in listed if m["alias"] == args.alias), None)
