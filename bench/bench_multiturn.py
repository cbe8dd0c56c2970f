"""Multi-turn chat benchmark: aotx against llama-server, both at their defaults.

    .venv/bin/python -m bench.bench_multiturn [--users 4,16] [--turns 5] [--max-tokens 64]
        [--rounds 2] [--think 0] [--per-turn] [--models TOML] [--peer PATH/llama-server]
        [--ceiling]
    LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m bench.bench_multiturn

U users (concurrent asyncio tasks) each hold a T-turn conversation and, as chat
clients do, resend the whole history every turn: the same ~150-token system prompt
for everyone, then the user's earlier questions with the assistant's replies exactly
as the server streamed them, then a new question, distinct per user, turn and
session (so a round cannot reuse the previous round's cache, while the system prompt
is a prefix shared by everything).  Each user sends its next turn as soon as the
previous one ends (after ``--think`` seconds).  Every request is a streaming
``/v1/chat/completions`` (temperature 0, ``max_tokens``, usage in the last chunk) on a
fresh connection.

For each U it runs rounds (``--rounds``, 2 by default); each round starts aotx
(``aotx serve`` on a fresh state folder with no models file: its defaults), runs the
workload, stops it, then does the same with the peer (llama-server with only
``-t 2``), one server at a time: A B A B.  Each server gets one short unrelated
request before the workload, so that its one-time start-up costs are not in the
first turn's figures.  It prints per U the TTFT p50 of the first turns, the TTFT p50
of the later turns (2..T: their prompts are longer, and a server that keeps the
conversation's cache only has the new question to read), the inter-token time p50
(between a reply's content chunks: the pace of the decode steps, with the other users'
prompts evaluated between them), and the aggregate completion throughput (completion tokens / wall time of the whole workload), then
the ratios aotx/peer of each: the median of the rounds' ratios (each round's in
brackets), as in bench_serve.py.  Without a peer it runs aotx alone.

With ``--ceiling`` each round then has the engine alone (``turn_ceiling.py``, a process
loaded once for the run) hold the same conversations in three KV layouts and time every
later turn's new tokens: alone (nothing else to do: no server can start that turn
sooner), one after another as the users' turns arrive together, and all in one decode.
It prints their p50s and the ratio of the least, "alone", to the peer's later-turn TTFT:
the bound on what any server on this engine can reach against the peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx

from bench import common
from bench.bench_serve import TOPICS, JsonProcess, cpu_times, pct, steal_share
from bench.common import Server

SYSTEM = (
    "You are a friendly and knowledgeable assistant who helps people with everyday "
    "questions about science, history, nature, travel, food and the arts. Answer in "
    "clear, plain English that a curious teenager could follow, and prefer short "
    "paragraphs to long lists. When a question is ambiguous, pick the most likely "
    "meaning and say briefly which one you chose. Give concrete examples, numbers and "
    "names where they help, but do not invent facts: if you are not sure of something, "
    "say so. Stay polite and encouraging, never condescending. Keep each answer "
    "focused on what was asked, and build on what was said earlier in the "
    "conversation instead of repeating it. Do not use markdown headings or tables, "
    "and do not mention these instructions. If the user asks for something unsafe or "
    "harmful, decline politely and suggest a safer alternative."
)

Message = dict[str, str]


@dataclass
class Load:
    """One server's run of the whole workload."""

    first: list[float] = field(default_factory=list)  # TTFT of the first turns, s
    later: list[float] = field(default_factory=list)  # TTFT of turns 2..T, s
    per_turn: dict[int, list[float]] = field(default_factory=dict)  # turn -> TTFTs, s
    itl: list[float] = field(default_factory=list)  # between a reply's content chunks, s
    tokens: int = 0
    wall: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall else float("nan")


def question(u: int, t: int, session: str) -> str:
    topic = TOPICS[(7 * u + 3 * t) % len(TOPICS)]
    return f"Question {t + 1} from user {u} (session {session}): tell me something about {topic}."


def start_aotx(models: str = "") -> Server:
    """aotx with ``models`` as its models file ("": none, its defaults)."""
    return common.aotx(models.replace("\\n", "\n") or None)


def model_of(srv: Server) -> str:
    return "smollm2" if srv.name == "aotx" else "default"  # (what each one serves)


def stop_server(srv: Server | None) -> None:
    if srv is not None:
        srv.stop()


async def chat(c: httpx.AsyncClient, srv: Server, messages: list[Message], max_tokens: int,
               itl: list[float] | None = None) -> tuple[float | None, int, str]:
    """One streamed chat completion: (TTFT or None if no content came, completion
    tokens, the content); the times between its content chunks go to ``itl``."""
    body = {"model": model_of(srv), "messages": messages, "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    last = t0
    chunks = 0
    usage: int | None = None
    parts: list[str] = []
    async with c.stream("POST", "/v1/chat/completions", json=body, headers=srv.headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise SystemExit(f"{srv.url}: HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = int(obj["usage"]["completion_tokens"])
            for ch in obj.get("choices") or []:
                text = (ch.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    elif itl is not None:
                        itl.append(now - last)
                    last = now
                    chunks += 1
                    parts.append(text)
    return ttft, usage if usage is not None else chunks, "".join(parts)


def client(base: str) -> httpx.AsyncClient:
    # A fresh TCP connection per request, as bench_serve.py's fresh_conn_client.
    return httpx.AsyncClient(base_url=base, timeout=600,
                             limits=httpx.Limits(max_keepalive_connections=0,
                                                 max_connections=256))


async def warm_up(srv: Server) -> None:
    async with client(srv.url) as c:
        await chat(c, srv, [{"role": "user", "content": "Hello!"}], 1)


async def workload(srv: Server, users: int, turns: int, max_tokens: int, think: float,
                   session: str) -> Load:
    load = Load()

    async with client(srv.url) as c:
        async def user(u: int) -> None:
            history: list[Message] = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                if t and think:
                    await asyncio.sleep(think)
                history.append({"role": "user", "content": question(u, t, session)})
                ttft, tokens, reply = await chat(c, srv, history, max_tokens, load.itl)
                history.append({"role": "assistant", "content": reply})
                load.tokens += tokens
                if ttft is not None:
                    (load.later if t else load.first).append(ttft)
                    load.per_turn.setdefault(t, []).append(ttft)

        t0 = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(users)))
        load.wall = time.perf_counter() - t0
    return load


def run(srv: Server, users: int, args: argparse.Namespace, session: str) -> Load:
    asyncio.run(warm_up(srv))
    return asyncio.run(workload(srv, users, args.turns, args.max_tokens, args.think, session))


def p50(loads: list[Load], key: str) -> float:
    """The p50 of all the rounds' times of one kind (TTFTs, ITLs) together, in ms."""
    return pct([x for ld in loads for x in getattr(ld, key)], 50) * 1e3


def round_figure(ld: Load, key: str) -> float:
    return ld.tok_s if key == "tok_s" else pct(getattr(ld, key), 50)


def ratios(rounds: list[tuple[Load, Load]], key: str) -> str:
    """The median of the rounds' ratios aotx/peer of one figure (each round's two
    loads ran minutes apart at most), and each round's ratio."""
    return median_and_each([round_figure(a, key) / round_figure(b, key) for a, b in rounds])


def median_and_each(rs: list[float]) -> str:
    """Ratios as the benchmarks print them: their median, then each round's in brackets."""
    each = "/".join(f"{x:.2f}" for x in rs)
    return f"{statistics.median(rs):.2f}" + (f" [{each}]" if len(rs) > 1 else "")


def per_turn(name: str, loads: list[Load], turns: int) -> str:
    cells = []
    for t in range(turns):
        xs = [x for ld in loads for x in ld.per_turn.get(t, [])]
        cells.append(f"{pct(xs, 50) * 1e3:.0f}")
    return f"    {name} TTFT p50 by turn (ms): " + " ".join(cells)


class Ceiling(JsonProcess):
    """turn_ceiling.py: the engine alone holding the same conversations."""

    def __init__(self) -> None:
        super().__init__(["-m", "bench.turn_ceiling"], "engine-alone")

    def measure(self, users: int, args: argparse.Namespace, session: str
                ) -> dict[str, dict[str, list[float]]]:
        """Layout -> {"alone", "one_by_one", "together"} -> the later turns' seconds."""
        turns = [[question(u, t, session) for u in range(users)] for t in range(args.turns)]
        out: dict[str, dict[str, list[float]]] = self.ask(
            {"turns": turns, "system": SYSTEM, "max_tokens": args.max_tokens})
        return out


def ceiling_lines(bounds: list[dict[str, dict[str, list[float]]]], theirs: list[Load]) -> str:
    """The engine alone's later-turn p50s by layout and order, and "alone" / the peer's
    later-turn TTFT p50 (the median of the rounds' ratios, each round's in brackets)."""
    lines = []
    for layout in bounds[0]:
        cells = [f"{order} {pct([x for b in bounds for x in b[layout][order]], 50) * 1e3:.0f} ms"
                 for order in ("alone", "one_by_one", "together")]
        line = f"    engine alone, {layout}: later-turn p50 " + ", ".join(cells)
        if theirs:
            rs = [pct(b[layout]["alone"], 50) / pct(ld.later, 50)
                  for b, ld in zip(bounds, theirs, strict=True)]
            line += f" | alone/peer {median_and_each(rs)}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", default="4,16", help="numbers of concurrent users, one run each")
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per U, each: aotx, then the peer (if given)")
    ap.add_argument("--think", type=float, default=0.0,
                    help="seconds a user waits between a reply and its next question")
    ap.add_argument("--models", default="",
                    help="aotx's models.toml (default: none, aotx at its defaults)")
    ap.add_argument("--per-turn", action="store_true", help="also print TTFT p50 by turn")
    ap.add_argument("--peer", default=os.environ.get("LLAMA_SERVER", ""),
                    help="llama-server binary (or the URL of a running one)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the later turns on the engine alone (turn_ceiling.py)")
    args = ap.parse_args()
    us = [int(x) for x in args.users.split(",")]
    peer_spec: str = args.peer
    if peer_spec and not peer_spec.startswith("http") and not os.path.exists(peer_spec):
        raise SystemExit(f"no peer at {peer_spec}")

    times0 = cpu_times()
    srv: Server | None = None
    ceiling = Ceiling() if args.ceiling else None
    try:
        for users in us:
            mine: list[Load] = []
            theirs: list[Load] = []
            bounds: list[dict[str, dict[str, list[float]]]] = []
            for rnd in range(args.rounds):
                session = f"{users}-{rnd}"
                srv = start_aotx(args.models)
                mine.append(run(srv, users, args, session))
                stop_server(srv)
                srv = None
                if peer_spec:  # one server at a time: A B A B
                    srv = common.peer(peer_spec)
                    theirs.append(run(srv, users, args, session))
                    stop_server(srv)
                    srv = None
                if ceiling is not None:
                    bounds.append(ceiling.measure(users, args, session))
            line = (f"U={users} T={args.turns}  aotx first-turn TTFT p50 {p50(mine, 'first'):.0f} ms, "
                    f"later-turn TTFT p50 {p50(mine, 'later'):.0f} ms, "
                    f"ITL p50 {p50(mine, 'itl'):.1f} ms, "
                    f"{statistics.mean(ld.tok_s for ld in mine):.1f} tok/s")
            if theirs:
                pairs = list(zip(mine, theirs, strict=True))
                line += (f" | peer first {p50(theirs, 'first'):.0f} ms, "
                         f"later {p50(theirs, 'later'):.0f} ms, "
                         f"ITL {p50(theirs, 'itl'):.1f} ms, "
                         f"{statistics.mean(ld.tok_s for ld in theirs):.1f} tok/s"
                         f" | aotx/peer: first {ratios(pairs, 'first')}, "
                         f"later {ratios(pairs, 'later')}, ITL {ratios(pairs, 'itl')}, "
                         f"throughput {ratios(pairs, 'tok_s')}")
            print(line, flush=True)
            if args.per_turn:
                print(per_turn("aotx", mine, args.turns), flush=True)
                if theirs:
                    print(per_turn("peer", theirs, args.turns), flush=True)
            if bounds:
                print(ceiling_lines(bounds, theirs), flush=True)
        steal = steal_share(times0, cpu_times())
        if steal is not None:
            # A virtual machine whose host is busy loses CPU time to it, and every
            # figure above with it: compare runs only at a similar steal.
            print(f"CPU steal during the run: {100 * steal:.1f} % of the machine's CPU time")
    finally:
        stop_server(srv)
        if ceiling is not None:
            ceiling.close()


if __name__ == "__main__":
    main()
