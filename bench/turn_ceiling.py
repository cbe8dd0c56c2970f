"""The ceiling of a later turn's time to first token: the engine alone, with no server,
evaluating multi-turn conversations' new tokens (``bench_multiturn.py --ceiling`` runs
this file as a process of its own, loaded once for the whole run).

It reads jobs on stdin, one JSON object a line: ``{"turns": [[question of user u at turn
t, ...] for each turn], "system": "...", "max_tokens": N}``, and answers one JSON line per
job: for each KV layout below, three lists of seconds, one entry per later turn:

* ``alone``: one user's new tokens evaluated and its first token sampled, with nothing
  else to do (the least any server can take for that turn);
* ``one_by_one``: the users' turns that arrive together (the benchmark's users send
  their next turns when their replies end, which is within a step of each other),
  evaluated one after another shortest first: each one's TTFT is the sum of the
  ``alone`` times up to its own;
* ``together``: the same turns in one ``llama_decode``: each one's TTFT is that call's.

Layouts: ``streams`` (aotx's default: a KV stream per sequence, flash attention),
``streams_no_fa`` (the same without flash attention: ``flash_attention = false``) and
``pool`` (one KV pool for all sequences, flash attention: llama-server's layout; 16,384
cells, so that 16 users' five turns fit).

Each conversation is the benchmark's: the system prompt, then each turn's question and
the greedy reply of ``max_tokens`` (generated here, untimed, all users together); a
turn's new tokens are the rendered chat's tokens after the longest prefix the user's
sequence already holds, as a server with a prompt cache finds them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from aotx.device.prompt import split, text_tokens
from aotx.device.template import ChatTemplate
from aotx.engine.fair import common_prefix
from aotx.engine.interface import BatchEntry
from aotx.engine.llama.engine import LlamaEngine
from aotx.engine.llama.sampling import Sampler
from bench import common

LAYOUTS = {"streams": {}, "streams_no_fa": {"flash_attention": False},
           "pool": {"unified": True, "kv_cells": 16384}}
GREEDY = Sampler(0.0, 1.0, 0)


class Conversations:
    """One engine's users: what each sequence holds, and each user's history."""

    def __init__(self, engine: LlamaEngine, template: ChatTemplate, users: int,
                 system: str) -> None:
        self.e, self.t = engine, template
        for q in range(engine.config.slots):
            engine.clear_sequence(q)
        self.held: list[list[int]] = [[] for _ in range(users)]
        self.history: list[list[dict[str, str]]] = [
            [{"role": "system", "content": system}] for _ in range(users)]

    def prompt(self, u: int, question: str) -> tuple[list[int], int]:
        """User u's next prompt and how many of its tokens the sequence holds (the rest
        cut away, as a server reusing the sequence does)."""
        self.history[u].append({"role": "user", "content": question})
        tokens = text_tokens(self.e, split(self.t, self.history[u], self.e.specials),
                             add_special=self.e.add_bos)
        keep = min(common_prefix(self.held[u], tokens), len(tokens) - 1)
        assert self.e.trim_sequence(u, keep)
        self.held[u] = self.held[u][:keep]
        return tokens, keep

    def entries(self, u: int, tokens: list[int], keep: int) -> list[BatchEntry]:
        return [BatchEntry(tokens[i], i, u, i == len(tokens) - 1)
                for i in range(keep, len(tokens))]

    def evaluate(self, jobs: list[tuple[int, list[int], int]]) -> tuple[float, list[int]]:
        """Evaluate these users' new tokens in one decode (batches of the engine's size)
        and sample each one's first token: (seconds, first tokens)."""
        entries = [x for u, tokens, keep in jobs for x in self.entries(u, tokens, keep)]
        firsts: list[int] = []
        t0 = time.perf_counter()
        for s in range(0, len(entries), self.e.n_batch):
            part = entries[s:s + self.e.n_batch]
            assert self.e.decode(part) == 0
            firsts += [self.e.sample(GREEDY, i) for i, x in enumerate(part) if x.logits]
        return time.perf_counter() - t0, firsts

    def reply(self, jobs: list[tuple[int, list[int], int]], max_tokens: int) -> None:
        """Evaluate the prompts and generate every user's greedy reply together."""
        _, cur = self.evaluate(jobs)
        pos = {u: len(tokens) for u, tokens, _ in jobs}
        out: dict[int, list[int]] = {u: [c] for (u, _, _), c in zip(jobs, cur, strict=True)}
        for u, tokens, _ in jobs:
            self.held[u] = list(tokens)
        for _ in range(max_tokens - 1):
            live = [u for u in out if not self.e.is_eog(out[u][-1])]
            if not live:
                break
            assert self.e.decode([BatchEntry(out[u][-1], pos[u], u, True) for u in live]) == 0
            for i, u in enumerate(live):
                self.held[u].append(out[u][-1])
                pos[u] += 1
                out[u].append(self.e.sample(GREEDY, i))
        for u, gen in out.items():
            text = b"".join(self.e.piece(x) for x in gen if not self.e.is_eog(x))
            self.history[u].append({"role": "assistant",
                                    "content": text.decode("utf-8", "replace")})


def later_turns(engine: LlamaEngine, template: ChatTemplate, job: dict[str, Any]
                ) -> dict[str, list[float]]:
    turns: list[list[str]] = job["turns"]
    conv = Conversations(engine, template, len(turns[0]), job["system"])
    out: dict[str, list[float]] = {"alone": [], "one_by_one": [], "together": []}
    for t, questions in enumerate(turns):
        jobs = [(u, *conv.prompt(u, q)) for u, q in enumerate(questions)]
        if t:
            alone = []
            for u, tokens, keep in jobs:
                alone.append(conv.evaluate([(u, tokens, keep)])[0])
                assert engine.trim_sequence(u, keep)
            together, _ = conv.evaluate(jobs)
            for u, _, keep in jobs:
                assert engine.trim_sequence(u, keep)
            out["alone"] += alone
            done = 0.0
            for s in sorted(alone):
                done += s
                out["one_by_one"].append(done)
            out["together"] += [together] * len(jobs)
        conv.reply(jobs, job["max_tokens"])
    return out


def main() -> None:
    engines = {name: common.engine(**kw) for name, kw in LAYOUTS.items()}  # type: ignore[arg-type]
    template = ChatTemplate(next(iter(engines.values())).metadata("tokenizer.chat_template"))
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps({name: later_turns(e, template, job) for name, e in engines.items()}),
              flush=True)
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
