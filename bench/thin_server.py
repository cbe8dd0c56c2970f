"""The thinnest streaming chat server this benchmark's clients can be served by: the
ceiling that ``bench_serve.py --thin`` measures beside aotx and the peer.

    .venv/bin/python -m bench.thin_server --port P [--slots 16] [--context 4096]

One process: an asyncio HTTP/1.1 server (no framework: it reads one request, answers
``POST /v1/chat/completions`` with ``stream: true`` and closes) and one engine thread
running the same ``LlamaEngine`` as aotx's device, with the template prefix cached in
sequence 0 and copied to each new sequence, every arrived prompt evaluated in the next
step beside the running sequences' tokens (as llama-server batches them), greedy
sampling, and every step's tokens handed to the event loop in one call.  No IPC, no
authentication, no grants, no results kept, no limits checked, no stop strings: only
what every token must cost to reach a client of ``bench_serve`` (an SSE frame with its
JSON).  What this server loses against the engine alone doing the same requests is what
the clients on the same cores and their arrivals cost any server here; what aotx loses
against it is aotx's own path.  Not a server to use: it trusts its input.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import threading
import time
from dataclasses import dataclass, field

from aotx.device.loading import template_prefix
from aotx.device.template import ChatTemplate
from aotx.engine.interface import BatchEntry
from aotx.engine.llama.sampling import Sampler
from bench import common


@dataclass
class Stream:
    prompt: list[int]
    max_tokens: int
    out: asyncio.Queue[tuple[str, bool]]
    seq: int = -1
    n_past: int = 0
    sampled: int = 0
    last: int = -1
    text: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class Engine:
    """The engine thread: every step takes the arrived prompts and the running tokens."""

    def __init__(self, slots: int, context: int, loop: asyncio.AbstractEventLoop) -> None:
        # Sequence 0 holds the template prefix; 1..slots serve the streams.
        self.e = common.engine(slots=slots + 1,
                               slot_context=context, batch=512)
        self.template = ChatTemplate(self.e.metadata("tokenizer.chat_template"))
        self.prefix = template_prefix(self.e, self.template)
        assert self.e.decode([BatchEntry(t, i, 0, False) for i, t in enumerate(self.prefix)]) == 0
        self.free = list(range(1, slots + 1))
        self.sampler = Sampler(0.0, 1.0, 0)
        self.loop = loop
        self.arrived: list[Stream] = []
        self.running: list[Stream] = []
        self.cond = threading.Condition()
        threading.Thread(target=self.run, daemon=True).start()

    def submit(self, s: Stream) -> None:
        with self.cond:
            self.arrived.append(s)
            self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.arrived and not self.running:
                    self.cond.wait()
                take = self.arrived[:len(self.free)]
                del self.arrived[:len(take)]
            entries, samples = self._plan(take)
            assert self.e.decode(entries) == 0
            self._emit(samples)

    def _plan(self, take: list[Stream]) -> tuple[list[BatchEntry], list[tuple[Stream, int]]]:
        """The step's batch, in ascending sequence order (llama.cpp splits a batch of
        one stream per sequence into the fewest micro-batches then)."""
        parts: list[tuple[Stream, list[BatchEntry]]] = []
        for s in self.running:
            parts.append((s, [BatchEntry(s.last, s.n_past, s.seq, True)]))
            s.n_past += 1
        for s in take:
            s.seq = self.free.pop(0)
            self.e.clear_sequence(s.seq)
            n = len(self.prefix) if s.prompt[:len(self.prefix)] == self.prefix else 0
            if n:
                self.e.copy_sequence(0, s.seq)
            parts.append((s, [BatchEntry(t, i, s.seq, i == len(s.prompt) - 1)
                              for i, t in enumerate(s.prompt) if i >= n]))
            s.n_past = len(s.prompt)
            self.running.append(s)
        entries: list[BatchEntry] = []
        samples: list[tuple[Stream, int]] = []
        for s, part in sorted(parts, key=lambda p: p[0].seq):
            entries += part
            samples.append((s, len(entries) - 1))
        return entries, samples

    def _emit(self, samples: list[tuple[Stream, int]]) -> None:
        out: list[tuple[Stream, str, bool]] = []
        for s, idx in samples:
            tok = self.e.sample(self.sampler, idx)
            s.sampled += 1
            s.last = tok
            end = self.e.is_eog(tok) or s.sampled >= s.max_tokens
            piece = "" if self.e.is_eog(tok) else s.text.decode(self.e.piece(tok), final=end)
            out.append((s, piece, end))
            if end:
                self.running.remove(s)
                self.free.append(s.seq)
                self.free.sort()  # the lowest free sequence first, as aotx takes them
        self.loop.call_soon_threadsafe(_deliver, out)


def _deliver(out: list[tuple[Stream, str, bool]]) -> None:
    for s, piece, end in out:
        s.out.put_nowait((piece, end))


def frame(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def handle(engine: Engine, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if head.startswith(b"GET /health"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            return
        body = json.loads(await reader.readexactly(length))
        prompt = engine.e.tokenize(engine.template.render(body["messages"]), False)
        stream = Stream(prompt, int(body.get("max_tokens") or 128), asyncio.Queue())
        engine.submit(stream)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        rid, created = f"chatcmpl-{id(stream):x}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": "thin"}
        while True:
            piece, end = await stream.out.get()
            if piece:
                writer.write(frame({**base, "choices": [
                    {"index": 0, "delta": {"content": piece}, "finish_reason": None}]}))
            if end:
                writer.write(frame({**base, "choices": [], "usage": {
                    "prompt_tokens": len(prompt), "completion_tokens": stream.sampled,
                    "total_tokens": len(prompt) + stream.sampled}}))
                writer.write(b"data: [DONE]\n\n")
                return
    finally:
        writer.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    engine = Engine(args.slots, args.context, asyncio.get_running_loop())
    server = await asyncio.start_server(lambda r, w: handle(engine, r, w), "127.0.0.1", args.port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
