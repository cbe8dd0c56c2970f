"""Reusable media sources end to end (issue 5): upload, list, read, remove, isolation, refusal."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from ..helpers import Service, png, running_service, wav
from .test_e2e_grants import client, mint


@pytest.fixture(scope="module")
def msvc() -> Iterator[Service]:
    with running_service() as svc:
        yield svc


def upload(c: httpx.Client, data: bytes, ctype: str = "image/png") -> httpx.Response:
    return c.post("/aotx/v1/media", content=data, headers={"Content-Type": ctype})


def test_upload_read_dedupe_and_remove(msvc: Service) -> None:
    with client(msvc, mint(msvc, "ann")) as c:
        img = png(1)
        r = upload(c, img)
        assert r.status_code == 201, r.text
        src = r.json()
        assert src["schema"] == "aotx.media.v1" and src["state"] == "ready"
        assert src["id"].startswith("src-") and len(src["id"]) == 36
        assert src["digest"] == "sha256:" + hashlib.sha256(img).hexdigest()
        assert (src["kind"], src["content_type"], src["bytes"]) == ("image", "image/png",
                                                                    str(len(img)))
        assert src["leases"] == 0 and src["created"].endswith("Z")
        again = upload(c, img)  # the same bytes again: the existing source
        assert again.status_code == 200 and again.json()["id"] == src["id"]
        assert c.get(f"/aotx/v1/media/{src['id']}").json() == src
        assert c.delete(f"/aotx/v1/media/{src['id']}").status_code == 204
        assert c.get(f"/aotx/v1/media/{src['id']}").status_code == 404
        assert c.delete(f"/aotx/v1/media/{src['id']}").status_code == 404


def test_multi_packet_source_is_assembled_on_the_device(msvc: Service) -> None:
    with client(msvc, mint(msvc, "ben")) as c:
        big = wav(300_000)  # about 5 packets
        r = upload(c, big, "audio/wav")
        assert r.status_code == 201, r.text
        assert r.json()["digest"] == "sha256:" + hashlib.sha256(big).hexdigest()
        assert r.json()["bytes"] == str(len(big)) and r.json()["kind"] == "audio"


def test_list_pages_and_a_removal_in_between(msvc: Service) -> None:
    with client(msvc, mint(msvc, "cid")) as c:
        ids = [upload(c, png(100 + i)).json()["id"] for i in range(7)]
        upload(c, b"not a png at all", "image/png")  # refused: never listed
        first = c.get("/aotx/v1/media", params={"limit": 3}).json()
        assert first["schema"] == "aotx.media_list.v1"
        assert [s["id"] for s in first["data"]] == ids[:3] and first["next_cursor"]
        assert c.delete(f"/aotx/v1/media/{ids[4]}").status_code == 204  # change mid-pagination
        seen = [s["id"] for s in first["data"]]
        cursor = first["next_cursor"]
        while cursor:
            page = c.get("/aotx/v1/media", params={"limit": 3, "cursor": cursor}).json()
            seen += [s["id"] for s in page["data"]]
            cursor = page["next_cursor"]
        assert seen == ids[:4] + ids[5:]
        assert c.get("/aotx/v1/media", params={"cursor": "x"}).status_code == 400
        assert c.get("/aotx/v1/media", params={"limit": 0}).status_code == 400


def test_sources_are_private_to_their_principal(msvc: Service) -> None:
    with client(msvc, mint(msvc, "dee")) as d, client(msvc, mint(msvc, "eve")) as e:
        src = upload(d, png(7)).json()
        assert e.get(f"/aotx/v1/media/{src['id']}").status_code == 404
        assert e.delete(f"/aotx/v1/media/{src['id']}").status_code == 404
        assert src["id"] not in [s["id"] for s in e.get("/aotx/v1/media").json()["data"]]
        # eve uploading the same bytes gets her own source
        mine = upload(e, png(7))
        assert mine.status_code == 201 and mine.json()["id"] != src["id"]
        # a submission naming dee's digest is not eve's ready source
        r = e.post("/aotx/v1/requests", json={"model": "smollm2", "messages": [
            {"role": "user", "content": [{"type": "input_image", "digest": src["digest"]}]}]})
        assert r.status_code == 400  # the default model has no image input
        assert "smollm2" in r.json()["error"]["message"] and "image" in r.json()["error"]["message"]
        assert d.get(f"/aotx/v1/media/{src['id']}").status_code == 200


def test_refusals(msvc: Service) -> None:
    with client(msvc, mint(msvc, "fin", "--limit", "media_bytes=20000",
                           "--limit", "media_sources=2")) as c:
        r = upload(c, b"GIF89a-but-called-png", "image/png")
        assert r.status_code == 400 and r.json()["error"]["code"] == "media_refused"
        sid = r.json()["error"]["message"].split()[2]
        refused = c.get(f"/aotx/v1/media/{sid}").json()
        assert refused["state"] == "refused" and "magic" in refused["reason"]
        assert upload(c, png(1), "text/plain").status_code == 415
        assert upload(c, png(1), "").status_code == 415
        assert upload(c, b"", "image/png").status_code == 400
        over = upload(c, wav(30_000), "audio/wav")
        assert over.status_code == 413
        assert c.get("/aotx/v1/media").json()["data"] == []  # nothing partial left behind
        assert upload(c, png(1)).status_code == 201
        assert upload(c, png(2)).status_code == 201
        assert upload(c, png(3)).status_code == 413  # media_sources=2
    with client(msvc, mint(msvc, "gil", "--actions", "submit,read")) as c:
        assert upload(c, png(1)).status_code == 403
        assert c.get("/aotx/v1/media").status_code == 403
    # text requests keep working while media is refused
    with client(msvc, msvc.token) as c:
        r = c.post("/aotx/v1/requests", json={"model": "smollm2", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 202


def test_interrupted_upload_leaves_no_source(msvc: Service) -> None:
    token = mint(msvc, "hob")
    data = wav(200_000)
    s = socket.create_connection(("127.0.0.1", msvc.port))
    s.sendall(b"POST /aotx/v1/media HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Authorization: Bearer " + token.encode() + b"\r\nContent-Type: audio/wav\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data[:150_000])
    time.sleep(0.5)
    s.close()  # half way
    time.sleep(0.5)
    with client(msvc, token) as c:
        assert c.get("/aotx/v1/media").json()["data"] == []
        assert upload(c, data, "audio/wav").status_code == 201  # a full upload still works


def test_a_declared_size_past_the_limit_is_refused_before_the_body(msvc: Service) -> None:
    """A Content-Length over the device's media_bytes is a 413 at once, with none of the
    body sent (it was read until 64 MiB had passed); a bad list cursor names a position."""
    with client(msvc, msvc.token) as c:
        limit = int(c.get("/aotx/v1/capabilities").json()["limits"]["media_bytes"])
        r = c.get("/aotx/v1/media", params={"cursor": "x"})
        assert r.status_code == 400 and "list position" in r.json()["error"]["message"]
    s = socket.create_connection(("127.0.0.1", msvc.port))
    s.settimeout(10)
    s.sendall(b"POST /aotx/v1/media HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
              + msvc.token.encode() + b"\r\nContent-Type: image/png\r\nContent-Length: "
              + str(limit + 1).encode() + b"\r\n\r\n")
    answer = b""
    while chunk := s.recv(65536):  # the head and the body can come in two reads
        answer += chunk
    s.close()
    assert answer.startswith(b"HTTP/1.1 413") and b"may have at most" in answer
