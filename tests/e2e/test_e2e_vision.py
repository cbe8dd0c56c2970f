"""Image and audio input end to end (issue 5): the real model, a real projector, libmtmd.

No small vision or audio model is installable here, so the projector is built
by ``tests/e2e/tiny_mmproj.py``: random weights in the exact GGUF layout llama.cpp
loads (a LLaVA-style image encoder, 16 positions per image, and an Ultravox-
style Whisper audio encoder, 25 positions per 30 s).  Its embeddings mean
nothing, but every part of the path is the real one: upload, lease, libmtmd
decoding and preprocessing the bytes, the encoder, the embeddings decoded into
the request's own KV sequence between other streams' steps, and sampling.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import struct
import tempfile
import time
import wave
from collections.abc import Iterator

import httpx
import pytest

from aotx.device.models import default_model_path

from ..helpers import Service, png, running_service
from .test_e2e_grants import client, mint
from .test_e2e_media import upload
from .tiny_mmproj import main as build_mmproj

IMAGE_POSITIONS = 16
AUDIO_POSITIONS = 25


def tone(seconds: float, hz: float = 440.0, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * hz * i / rate)))
                               for i in range(int(seconds * rate))))
    return buf.getvalue()


@pytest.fixture(scope="module")
def vsvc() -> Iterator[Service]:
    folder = tempfile.mkdtemp(prefix="aotx-mmproj-")
    mmproj = os.path.join(folder, "tiny-av.gguf")
    # An ffprobe/ffmpeg first on the device's PATH that records being run: libmtmd
    # must never hand undecodable bytes to them.
    bindir = os.path.join(folder, "bin")
    os.mkdir(bindir)
    for name in ("ffprobe", "ffmpeg"):
        with open(os.path.join(bindir, name), "w") as f:
            f.write(f"#!/bin/sh\ntouch {folder}/ran-{name}\nexit 1\n")
        os.chmod(os.path.join(bindir, name), 0o755)
    build_mmproj([mmproj, "--audio"])
    models = f"""
[default]
alias = "smollm2"
slots = 4
context = 2048
mmproj = "{mmproj}"

[[model]]
alias = "plain"
path = "{default_model_path()}"
slots = 1
context = 512
"""
    try:
        with running_service(models=models,
                             env={"PATH": bindir + os.pathsep + os.environ["PATH"]}) as svc:
            svc.ffmpeg_marks = [os.path.join(folder, f"ran-{n}")  # type: ignore[attr-defined]
                                for n in ("ffprobe", "ffmpeg")]
            yield svc
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ask(c: httpx.Client, parts: list[dict[str, str]], model: str = "smollm2",
        max_tokens: int = 12) -> httpx.Response:
    return c.post("/aotx/v1/requests", json={"model": model, "max_tokens": max_tokens,
                                             "temperature": 0,
                                             "messages": [{"role": "user", "content": parts}]})


def finish(c: httpx.Client, rid: str) -> dict:
    deadline = time.monotonic() + 120
    while True:
        doc = c.get(f"/aotx/v1/requests/{rid}").json()
        if doc["state"] in ("completed", "failed", "cancelled"):
            return doc
        assert time.monotonic() < deadline
        time.sleep(0.05)


def text_of(doc: dict) -> bytes:
    import base64

    return base64.b64decode(doc["output"]["bytes"])


def test_capabilities_list_the_projector_modalities(vsvc: Service) -> None:
    with client(vsvc, vsvc.token) as c:
        models = {m["alias"]: m for m in c.get("/aotx/v1/capabilities").json()["models"]}
    assert models["smollm2"]["input_modalities"] == ["text", "image", "audio"]
    assert models["plain"]["input_modalities"] == ["text"]
    # The seed's qualification names the processors too: the same model file and
    # template with a projector is not the qualified profile; without one it is.
    assert models["smollm2"]["automatic_memory"] is False
    assert models["plain"]["automatic_memory"] is True


def test_an_image_is_encoded_and_conditions_the_answer(vsvc: Service) -> None:
    with client(vsvc, mint(vsvc, "iris")) as c:
        a, b = upload(c, png(1, 24)).json(), upload(c, png(90, 24)).json()
        question = [{"type": "text", "text": "What is in this picture?"}]

        def run(src: dict) -> dict:
            r = ask(c, [{"type": "input_image", "digest": src["digest"]}, *question])
            assert r.status_code == 202, r.text
            assert r.json()["media"] == [{"id": src["id"], "digest": src["digest"]}]
            doc = finish(c, r.json()["id"])
            assert doc["state"] == "completed", doc
            return doc

        plain = ask(c, question)
        assert plain.status_code == 202
        text_only = finish(c, plain.json()["id"])
        first, again, other = run(a), run(a), run(b)
    # the image takes its 16 positions in the prompt, on top of the same text
    assert first["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + IMAGE_POSITIONS
    assert text_of(first) and text_of(first) == text_of(again)  # deterministic at temperature 0
    assert text_of(first) != text_of(other)  # a different image, a different answer


def test_audio_is_encoded(vsvc: Service) -> None:
    with client(vsvc, mint(vsvc, "aldo")) as c:
        src = upload(c, tone(1.0), "audio/wav").json()
        assert src["kind"] == "audio" and src["state"] == "ready"
        r = ask(c, [{"type": "input_audio", "digest": src["digest"]},
                    {"type": "text", "text": "What do you hear?"}])
        assert r.status_code == 202, r.text
        doc = finish(c, r.json()["id"])
        assert doc["state"] == "completed" and text_of(doc)
        bare = finish(c, ask(c, [{"type": "text", "text": "What do you hear?"}]).json()["id"])
        assert doc["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"] + AUDIO_POSITIONS


def test_the_media_marker_written_in_text_stays_text(vsvc: Service) -> None:
    """The marker that stands for a media part in the rendered prompt, written by the user,
    is text: only the real image becomes an image (issue 19)."""
    words = [{"type": "text", "text": "Is <__media__> a picture? <__media__>"}]
    with client(vsvc, mint(vsvc, "mark")) as c:
        src = upload(c, png(11, 16)).json()
        r = ask(c, [{"type": "input_image", "digest": src["digest"]}, *words])
        assert r.status_code == 202, r.text
        doc = finish(c, r.json()["id"])
        assert doc["state"] == "completed", doc
        text_only = finish(c, ask(c, words).json()["id"])
        unmarked = finish(c, ask(c, [{"type": "text", "text": "Is  a picture? "}]).json()["id"])
        # with the text after the image and before it: one image's positions either way
        before = ask(c, [*words, {"type": "input_image", "digest": src["digest"]},
                         {"type": "text", "text": "?"}])
        assert before.status_code == 202, before.text
        assert finish(c, before.json()["id"])["state"] == "completed"
    assert text_only["state"] == "completed"
    assert doc["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + IMAGE_POSITIONS
    # the two marker texts cost several tokens each
    assert text_only["usage"]["prompt_tokens"] >= unmarked["usage"]["prompt_tokens"] + 2 * 3


def test_a_leased_source_cannot_be_removed_until_the_request_ends(vsvc: Service) -> None:
    with client(vsvc, mint(vsvc, "lena")) as c:
        src = upload(c, png(5, 16)).json()
        r = ask(c, [{"type": "input_image", "digest": src["digest"]},
                    {"type": "text", "text": "Write a long story about this picture."}],
                max_tokens=400)
        assert r.status_code == 202
        rid = r.json()["id"]
        held = c.delete(f"/aotx/v1/media/{src['id']}")
        assert held.status_code == 409, held.text
        assert c.get(f"/aotx/v1/media/{src['id']}").json()["leases"] == 1
        assert c.post(f"/aotx/v1/requests/{rid}/cancel").status_code == 202
        assert finish(c, rid)["state"] == "cancelled"
        assert c.get(f"/aotx/v1/media/{src['id']}").json()["leases"] == 0
        assert c.delete(f"/aotx/v1/media/{src['id']}").status_code == 204


def test_images_run_beside_text_streams(vsvc: Service) -> None:
    """A text stream keeps decoding while other requests' images are encoded."""
    with client(vsvc, mint(vsvc, "mona")) as c:
        srcs = [upload(c, png(20 + i, 16)).json() for i in range(3)]
        story = ask(c, [{"type": "text", "text": "Tell me a story."}], max_tokens=60).json()["id"]
        looks = [ask(c, [{"type": "input_image", "digest": s["digest"]},
                         {"type": "text", "text": "Describe it."}], max_tokens=8).json()["id"]
                 for s in srcs]
        docs = [finish(c, rid) for rid in [story, *looks]]
    assert [d["state"] for d in docs] == ["completed"] * 4


def test_refusals_name_the_model_and_the_modality(vsvc: Service) -> None:
    with client(vsvc, mint(vsvc, "rex")) as c:
        src = upload(c, png(7, 16)).json()
        image = {"type": "input_image", "digest": src["digest"]}
        r = ask(c, [image, {"type": "text", "text": "hi"}], model="plain")
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "model plain does not accept image input"
        # a prompt must end in text (the template always adds the assistant's turn,
        # so only a template without one can end in an image; smollm2's adds it)
        ok = ask(c, [image])
        assert ok.status_code == 202
        # bytes with a PNG signature that do not decode: ready as a source, 400 at use
        broken = upload(c, png(8, 16)[:40] + b"\x00" * 64).json()
        assert broken["state"] == "ready"
        r = ask(c, [{"type": "input_image", "digest": broken["digest"]},
                    {"type": "text", "text": "hi"}])
        assert r.status_code == 400 and "could not be decoded" in r.json()["error"]["message"]
        assert not any(os.path.exists(p) for p in vsvc.ffmpeg_marks)  # type: ignore[attr-defined]
        assert c.get(f"/aotx/v1/media/{broken['id']}").json()["leases"] == 0
        # text requests to the same model keep working
        assert finish(c, ask(c, [{"type": "text", "text": "hi"}]).json()["id"])["state"] == \
            "completed"
        # and so do images after the refusal
        assert finish(c, ok.json()["id"])["state"] == "completed"


def media_bytes(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("aotx_media_bytes "):
            return float(line.split()[1])
    raise AssertionError("no aotx_media_bytes in /metrics")


def test_openai_inline_image_and_audio(vsvc: Service) -> None:
    """OpenAI's inline parts on the standard route: data: URLs and input_audio, through the
    official client; each becomes an ephemeral source that goes when its request ends."""
    import base64

    from openai import BadRequestError, OpenAI

    client_ = OpenAI(base_url=vsvc.url + "/v1", api_key=vsvc.token, max_retries=0)
    image = "data:image/png;base64," + base64.b64encode(png(33, 20)).decode()
    question = {"type": "text", "text": "What is in this picture?"}
    with client(vsvc, vsvc.token) as c:
        before = media_bytes(c)
        plain = client_.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": [question]}])
        seen = client_.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, question]}])
        assert seen.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_POSITIONS
        assert seen.choices[0].message.content
        chunks = list(client_.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {
                    "data": base64.b64encode(tone(0.5)).decode(), "format": "wav"}},
                {"type": "text", "text": "What do you hear?"}]}]))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        deadline = time.monotonic() + 30  # a state to wait for, not a speed
        while media_bytes(c) != before:  # ephemeral: removed when their requests ended
            assert time.monotonic() < deadline, "inline media outlived its request"
            time.sleep(0.1)
        # the native route takes inline media too, and echoes the digest it leased
        r = ask(c, [{"type": "image_url", "image_url": {"url": image}}, question])
        assert r.status_code == 202 and r.json()["media"][0]["digest"].startswith("sha256:")
        assert r.json()["media"][0]["id"].startswith("src-")  # the ephemeral source's handle
        assert finish(c, r.json()["id"])["state"] == "completed"
    bad = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "data: URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,raw"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:text/html;base64,PGI+"}}, "image type"),
        ({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
         "magic"),
    ]
    for part, words in bad:
        with pytest.raises(BadRequestError) as err:
            client_.chat.completions.create(model="smollm2", max_tokens=4,
                                            messages=[{"role": "user", "content": [part]}])
        assert words in str(err.value), (part, str(err.value))
    with pytest.raises(BadRequestError, match="model plain does not accept image input"):
        client_.chat.completions.create(model="plain", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}])


def test_an_anthropic_image_block_and_its_count(vsvc: Service) -> None:
    """Anthropic's base64 image block on /v1/messages, through the official SDK: its
    positions are in the usage and in count_tokens alike."""
    import base64

    import anthropic

    claude = anthropic.Anthropic(base_url=vsvc.url, api_key=vsvc.token, max_retries=0)
    question = {"type": "text", "text": "What is in this picture?"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(34, 20)).decode()}}
    with_image = [{"role": "user", "content": [image, question]}]
    plain = claude.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": [question]}])
    seen = claude.messages.create(model="smollm2", max_tokens=8, extra_body={"temperature": 0},
                                  messages=with_image)
    assert seen.usage.input_tokens == plain.usage.input_tokens + IMAGE_POSITIONS
    assert seen.content and seen.content[0].type == "text"
    counted = claude.messages.count_tokens(model="smollm2", messages=with_image)
    assert counted.input_tokens == seen.usage.input_tokens
    # a tool's result with an image (a screenshot, a file read): the image is read too
    def turns(result: list[dict]) -> list[dict]:
        return [{"role": "user", "content": "Look at the file."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                   "name": "Read", "input": {"f": "a.png"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": result}, question]}]
    read = {"name": "Read", "input_schema": {"type": "object"}}
    text_only = claude.messages.count_tokens(model="smollm2", tools=[read], messages=turns(
        [{"type": "text", "text": "a.png"}]))
    shown = claude.messages.count_tokens(model="smollm2", tools=[read], messages=turns(
        [{"type": "text", "text": "a.png"}, image]))
    assert shown.input_tokens == text_only.input_tokens + IMAGE_POSITIONS
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="plain", max_tokens=4, messages=with_image)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as err:  # aotx fetches nothing
        claude.messages.create(model="smollm2", max_tokens=4, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "https://example.com/a.png"}}]}])
    assert "base64" in err.value.body["error"]["message"]
