"""Streams waiting together share one WAITS packet (docs/protocol.md, section 10.1): on
the real service, with the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures
import re

import openai

from ..helpers import Service

PROMPTS = ["Name three rivers.", "Count from one to nine.", "Describe a cat.",
           "What is rain?"]


def _counters(service: Service) -> tuple[float, float]:
    """(WAITs sent, packets sent) by the gateway, from /metrics."""
    with service.client() as c:
        text = c.get("/metrics").text
    waits = re.search(r"^aotx_gateway_waits_total (\S+)$", text, re.M)
    packets = re.search(r"^aotx_gateway_packets_total (\S+)$", text, re.M)
    assert waits and packets, text[-2000:]
    return float(waits.group(1)), float(packets.group(1))


def _stream(oai: openai.OpenAI, prompt: str) -> str:
    out = []
    for chunk in oai.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], stream=True,
            max_tokens=40, temperature=0):
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
    return "".join(out)


def test_concurrent_streams_share_wait_packets_and_keep_their_bytes(
        service: Service, oai: openai.OpenAI) -> None:
    """Four streams at once: each streams exactly the text it gives alone, and the
    gateway sent their WAITs in fewer packets than WAITs (one WAITS a decode step
    carries every stream's; alone, each WAIT is a packet of its own)."""
    alone = [_stream(oai, p) for p in PROMPTS]
    waits0, packets0 = _counters(service)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _stream(oai, p), PROMPTS))
    waits1, packets1 = _counters(service)
    assert together == alone and all(alone)
    waits, packets = waits1 - waits0, packets1 - packets0
    assert waits >= 40  # at least a WAIT a token of one stream
    assert waits >= 1.5 * packets, (waits, packets)
