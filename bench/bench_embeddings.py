"""What a large embedding call costs the streams being generated, and what it costs alone.

    .venv/bin/python -m bench.bench_embeddings [--inputs 96] [--streams 2] [--rounds 2]

It starts ``aotx serve`` (the embedded SmolLM2, 4 slots, context 2048) and measures, each
round: ``--streams`` chat streams alone (tokens a second, the largest gap between two
tokens); the same streams while one ``/v1/embeddings`` call of ``--inputs`` sentences
(about 25 tokens each) runs (the gaps while it runs, and its time); and the call alone.
The engine thread runs one embedding decode after each decode step (engine/embedding.py:
at most 128 tokens while streams run, the whole context otherwise), so a stream's gap is
about one step plus one such decode.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

import httpx

from bench import common

PROMPT = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream(base: str, headers: dict[str, str], arrivals: list[float]) -> None:
    body = {"model": "smollm2", "messages": PROMPT, "max_tokens": 1000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers,
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.monotonic())


def embed(base: str, headers: dict[str, str], n: int) -> tuple[float, int]:
    texts = [f"Sentence {i}: the quick brown fox jumps over the lazy dog near the river "
             f"bank while {i} birds sing." for i in range(n)]
    t = time.monotonic()
    r = httpx.post(base + "/v1/embeddings", headers=headers, timeout=600,
                   json={"model": "smollm2", "input": texts, "encoding_format": "base64"})
    r.raise_for_status()
    return time.monotonic() - t, int(r.json()["usage"]["prompt_tokens"])


def streams(base: str, headers: dict[str, str], n: int, during: int = 0) -> dict[str, float]:
    """``n`` streams; with ``during``, an embedding call of that many inputs once every
    stream has its first token: the gaps counted are those while it runs."""
    arrivals: list[list[float]] = [[] for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(base, headers, a)) for a in arrivals]
    for t in threads:
        t.start()
    while not all(arrivals):
        time.sleep(0.01)
    t0, seconds, tokens = time.monotonic(), 0.0, 0
    if during:
        seconds, tokens = embed(base, headers, during)
    t1 = time.monotonic()
    for t in threads:
        t.join()
    window = [[x for x in a if x >= t0 and (not during or x <= t1)] for a in arrivals]
    gaps = [b - a for w in window for a, b in zip([t0, *w], w, strict=False)]
    # each stream's pace over the time it ran within the window (a stream may end first)
    spans = [w[-1] - t0 for w in window if w]
    return {"tok_s_per_stream": sum(map(len, window)) / sum(spans),
            "gap_p50": statistics.median(gaps), "gap_max": max(gaps),
            "stream_s": statistics.mean(spans), "embed_s": seconds,
            "embed_tok_s": tokens / seconds if seconds else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=96)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with common.serving(common.slots_file(4)) as srv:
        base, headers = srv.url, srv.headers
        embed(base, headers, 4)  # warm
        for _ in range(args.rounds):
            seconds, tokens = embed(base, headers, args.inputs)
            print(json.dumps({
                "alone": streams(base, headers, args.streams),
                "with_embedding": streams(base, headers, args.streams, args.inputs),
                "embedding_alone": {"embed_s": seconds, "embed_tok_s": tokens / seconds,
                                    "inputs": args.inputs, "tokens": tokens},
                "load": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
