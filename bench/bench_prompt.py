"""Prompt tokenization time on the embedded model: what admission spends on a chat prompt.

    .venv/bin/python -m bench.bench_prompt [--prompts 2000] [--rounds 5]

``whole`` is the path the device took before issue 19 (render the template, tokenize the
rendering with every special-token text parsed); ``pieces`` is today's (render, tell the
markup from the messages' text, tokenize the pieces: ``device.prompt``).  Each prompt is
a system message and a user message that differs every time (so its run of text misses
the cache, as real traffic does); then a ten-message chat.  Prints the best round's
microseconds per prompt.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from aotx.device.prompt import split, text_tokens
from aotx.device.template import ChatTemplate
from bench import common

Messages = list[dict[str, str]]


def per_prompt(run: Callable[[Messages], list[int]], chats: list[Messages], rounds: int) -> float:
    for msgs in chats[:200]:
        run(msgs)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for msgs in chats:
            run(msgs)
        best = min(best, (time.perf_counter() - t0) / len(chats))
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    engine = common.engine(slots=1, slot_context=256,
                           batch=32, threads=1, poll=-1)
    template = ChatTemplate(engine.metadata("tokenizer.chat_template") or "",
                            bos_token=engine.token_text(int(engine.metadata(
                                "tokenizer.ggml.bos_token_id") or 0)),
                            eos_token=engine.token_text(engine.eos))

    def whole(msgs: Messages) -> list[int]:
        return engine.tokenize(template.render(msgs), False)

    def pieces(msgs: Messages) -> list[int]:
        return text_tokens(engine, split(template, msgs, engine.specials), False)

    def fresh(k: int) -> list[Messages]:  # a user message the caches have not seen
        return [[{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                 {"role": "user", "content": f"Write a short story about topic {k + q}, "
                                             f"with a dragon named D{(k + q) * 7}."}]
                for q in range(args.prompts)]

    chat = [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"turn {i}: " + "words " * 30} for i in range(10)]
    for k, (name, run) in enumerate((("whole", whole), ("pieces", pieces))):
        short = per_prompt(run, fresh(k * 10 * args.prompts), args.rounds)
        long = per_prompt(run, [chat] * 500, args.rounds)
        print(f"{name:6s}: {short:6.0f} us per two-message prompt, {long:6.0f} us per "
              f"ten-message chat ({len(run(chat))} tokens)")
    engine.close()


if __name__ == "__main__":
    main()
