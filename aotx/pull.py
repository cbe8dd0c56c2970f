"""``aotx pull REF``: a GGUF model, and its projector when asked, fetched into the models
folder (``STATE/models`` unless ``--models-dir``), in the layout ``device/catalog.py``
reads.

``REF`` is what ``llama-server -hf`` takes: a Hugging Face repository ``owner/repo``,
optionally with ``:QUANT`` (the GGUF file whose name holds it, ``Q4_K_M`` when none is
given, as llama-server) or ``:FILE.gguf``; or an ``https://`` URL of a GGUF file.

Fetching goes through ``huggingface_hub`` (chosen over hand-written HTTP: the hub's
protocol, redirects to its CDN and Xet storage, ``HF_ENDPOINT``, ``HF_TOKEN``, retries and
progress bars are its own).  A transfer is kept in the folder's hidden ``.pull/`` until
it is whole, so a pull that stopped (interrupted, killed, a dropped connection) resumes
where it was when run again.  A file the hub knows the SHA-256 of (its LFS pointer) is
checked against it before it is put in place.

Where it goes: a single file as ``MODELS/FILE.gguf``; a model with a projector, or split
in shards, in a folder ``MODELS/ALIAS/`` that holds all its parts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from .device.catalog import alias_of

DEFAULT_QUANT = "Q4_K_M"  # llama-server's choice when a reference names none
STAGING = ".pull"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class PullError(Exception):
    pass


@dataclass(frozen=True)
class Ref:
    repo: str = ""  # owner/repo
    choose: str = ""  # a quantization or a file name ("" : the default quantization)
    url: str = ""  # an https URL instead of a repository


def parse_ref(ref: str) -> Ref:
    if ref.startswith(("https://", "http://")):
        if not urllib.parse.urlparse(ref).path.lower().endswith(".gguf"):
            raise PullError(f"{ref}: a URL must name a .gguf file")
        return Ref(url=ref)
    repo, _, choose = ref.partition(":")
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo):
        raise PullError(f"{ref!r} is neither owner/repo[:QUANT|:FILE.gguf] nor an https URL")
    return Ref(repo=repo, choose=choose)


def _is_projector(path: str) -> bool:
    return os.path.basename(path).lower().startswith("mmproj")


def choose_files(files: Sequence[str], choose: str, mmproj: bool) -> tuple[list[str], str | None]:
    """The repository files of the model ``choose`` names (every shard of a split one) and
    its projector (``mmproj``: the f16 one if there is one, else the first)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    models = [f for f in ggufs if not _is_projector(f)]
    if choose.lower().endswith(".gguf"):
        picked = [f for f in models if f == choose or os.path.basename(f) == choose]
    else:
        quant = (choose or DEFAULT_QUANT).lower()
        picked = [f for f in models if quant in os.path.basename(f).lower()]
        if not picked and not choose and models:
            picked = models[:1]  # no Q4_K_M: the first, as llama-server falls back
    if not picked:
        raise PullError(f"no GGUF model file matches {choose or DEFAULT_QUANT!r} among "
                        f"{[os.path.basename(f) for f in models] or 'no GGUF files'}")
    first = picked[0]
    shard = _SHARD.search(first)
    if shard:  # every shard of the first model that matched
        stem = first[:shard.start()]
        picked = [f for f in picked if f.startswith(stem) and _SHARD.search(f)]
    else:
        picked = [first]
    projectors = [f for f in ggufs if _is_projector(f)]
    projector = None
    if mmproj:
        if not projectors:
            raise PullError("the repository has no projector (mmproj*.gguf)")
        projector = next((p for p in projectors if "f16" in p.lower()), projectors[0])
    return picked, projector


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _place(parts: list[tuple[str, str]], models_dir: str, folder: str | None) -> list[str]:
    """Move each (staged file, name) into the models folder (in ``folder`` when given)."""
    target_dir = os.path.join(models_dir, folder) if folder else models_dir
    os.makedirs(target_dir, exist_ok=True)
    placed = []
    for staged, name in parts:
        target = os.path.join(target_dir, name)
        os.replace(staged, target)
        placed.append(target)
    return placed


def pull(ref: str, models_dir: str, mmproj: bool = False) -> list[str]:
    """Fetch ``ref`` into ``models_dir``; the paths placed."""
    r = parse_ref(ref)
    staging = os.path.join(models_dir, STAGING)
    os.makedirs(staging, exist_ok=True)
    if r.url:
        if mmproj:
            raise PullError("a URL names one file: pull its projector by its own URL")
        name = os.path.basename(urllib.parse.urlparse(r.url).path)
        return _place([(_fetch_url(r.url, staging, name), name)], models_dir, None)
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        listed = {f.path: f for f in api.list_repo_tree(r.repo, recursive=True)
                  if hasattr(f, "size")}
    except Exception as exc:  # the hub's errors (HTTP, not found, gated) all say why
        raise PullError(f"{r.repo}: {exc}") from None
    files, projector = choose_files(list(listed), r.choose, mmproj)
    wanted = files + ([projector] if projector else [])
    staged = [(_fetch_hub(r.repo, f, staging, listed[f]), os.path.basename(f)) for f in wanted]
    folder = None
    if projector or len(files) > 1:
        folder = alias_of(os.path.basename(files[0]))
    placed = _place(staged, models_dir, folder)
    shutil.rmtree(os.path.join(staging, r.repo.split("/")[0]), ignore_errors=True)
    return placed


def _fetch_hub(repo: str, filename: str, staging: str, info: object) -> str:
    """One repository file in ``staging/owner/repo/``, resumed from an earlier pull's part;
    checked against the SHA-256 of its LFS pointer.  (``hf_hub_download`` resumes only
    within one run since huggingface_hub 1.x: each run writes a temporary file of its own.)"""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    # (documented public API, not re-exported for type checkers)
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

    url = hf_hub_url(repo, filename)
    try:
        meta = get_hf_file_metadata(url)
    except Exception as exc:  # the hub's errors (HTTP, not found, gated) all say why
        raise PullError(f"{repo}/{filename}: {exc}") from None
    headers = build_hf_headers()
    # a signed CDN location gets no token, as huggingface_hub does
    if urllib.parse.urlparse(meta.location).netloc != urllib.parse.urlparse(url).netloc:
        headers.pop("authorization", None)
    tag = re.sub(r"[^0-9A-Za-z]", "", meta.etag or "")[:16]
    path = os.path.join(staging, repo, f"{filename}.{tag}.part")
    _resume(meta.location, path, headers, meta.size)
    lfs = getattr(info, "lfs", None)
    want = getattr(lfs, "sha256", None) or (lfs.get("sha256") if isinstance(lfs, dict) else None)
    if want and _SHA256.match(str(want)):
        got = _sha256(path)
        if got != want:
            os.remove(path)
            raise PullError(f"{repo}/{filename}: SHA-256 {got}, the hub says {want}; removed")
    return path


def _resume(url: str, path: str, headers: dict[str, str], size: int | None) -> None:
    """Fetch ``url`` into ``path``, from the bytes ``path`` already holds."""
    from huggingface_hub.file_download import http_get

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        held = f.seek(0, os.SEEK_END)  # (not append mode: http_get rewinds a refused range)
        if size is not None and held > size:
            f.truncate(0)
            held = f.seek(0)
        if size is None or held < size:
            try:
                http_get(url, f, resume_size=held, headers=headers, expected_size=size,
                         displayed_filename=os.path.basename(path).split(".part")[0])
            except Exception as exc:
                raise PullError(f"{url}: {exc}") from None


def _fetch_url(url: str, staging: str, name: str) -> str:
    """A URL's file, resumed from what an earlier pull left in ``staging``."""
    path = os.path.join(staging, name + ".part")
    _resume(url, path, {}, None)
    return path
