"""Which models a models folder holds, and the role each model keeps across restarts.

The folder follows llama-server's router mode (``--models-dir``):

* a ``NAME.gguf`` directly in it is the model ``NAME``; ``mmproj-NAME.gguf`` beside it is
  its projector;
* a subfolder ``NAME/`` holding one model (a single file, or the first shard of a split
  one, ``*-00001-of-0000N.gguf``) and at most one projector (``mmproj*.gguf``) is the
  model ``NAME``: a multimodal or multi-shard model keeps its parts together.

Hidden files and folders (a download in progress) are not models.  What does not fit
these rules (a folder of two models, a projector without a model) is listed as
:class:`Skipped` with the reason, never dropped silently.

**Roles.**  A role is the bit of a grant's model mask (``wire``: 1..31).  A role given to
an alias is written to ``STATE/model-roles.json`` and kept: a model that is renamed,
removed or not declared this time keeps its role reserved, so that a grant's mask never
comes to name another model.  Aliases beyond the 31 roles get none and are listed as over
the limit (:func:`assign_roles`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..engine.spec import ModelSpec
from .models import ModelConfigError

log = logging.getLogger("aotx.models")

MAX_ROLE = 31
FOLDER_SLOTS = 8  # a models folder's chat model's sequences
ROLES_FILE = "model-roles.json"
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_NOT_ALIAS = re.compile(r"[^A-Za-z0-9\-_.:/]")


@dataclass(frozen=True)
class Found:
    """A model the folder holds: its alias, its file (a split model's first shard) and
    its projector."""

    alias: str
    path: str
    mmproj: str | None = None


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


def alias_of(name: str) -> str:
    """A file or folder name as an alias: ``.gguf`` and a shard suffix dropped, characters
    an alias may not hold replaced by ``-``, at most 128 characters."""
    stem = _SHARD.sub("", name)
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    return _NOT_ALIAS.sub("-", stem)[:128] or "-"


def _is_projector(name: str) -> bool:
    return name.lower().startswith("mmproj")


def _model_files(names: Iterable[str]) -> list[str]:
    """The model files among ``names``: GGUF files that are neither a projector nor a
    later shard of a split model."""
    out = []
    for name in sorted(names):
        if name.startswith(".") or not name.lower().endswith(".gguf") or _is_projector(name):
            continue
        shard = _SHARD.search(name)
        if shard is None or int(shard.group(1)) == 1:
            out.append(name)
    return out


def scan(folder: str) -> tuple[list[Found], list[Skipped]]:
    """The models in ``folder`` (none when it does not exist), in alias order."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except FileNotFoundError:
        return [], []
    found: list[Found] = []
    skipped: list[Skipped] = []
    files = {e.name for e in entries if e.is_file() and not e.name.startswith(".")}
    for name in _model_files(files):
        projector = next((p for p in (f"mmproj-{name}", f"mmproj-{alias_of(name)}.gguf")
                          if p in files), None)
        found.append(Found(alias_of(name), os.path.join(folder, name),
                           os.path.join(folder, projector) if projector else None))
    for e in entries:
        if e.is_dir() and not e.name.startswith("."):
            got = _subfolder(e.path)
            (found if isinstance(got, Found) else skipped).append(got)  # type: ignore[arg-type]
    for name in sorted(files):
        if (_is_projector(name) and name.lower().endswith(".gguf")
                and not any(f.mmproj and os.path.basename(f.mmproj) == name for f in found)):
            skipped.append(Skipped(os.path.join(folder, name), "a projector without its model "
                                   "(name it mmproj-MODEL.gguf, or put both in a folder)"))
    found.sort(key=lambda f: f.alias)
    unique: dict[str, Found] = {}
    for f in found:  # (stable: a file before a folder of the same alias)
        if f.alias in unique:
            skipped.append(Skipped(f.path, f"{unique[f.alias].path} has the alias "
                                           f"{f.alias} already"))
        else:
            unique[f.alias] = f
    return list(unique.values()), skipped


def _subfolder(path: str) -> Found | Skipped:
    names = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))]
    models = _model_files(names)
    projectors = sorted(n for n in names if _is_projector(n) and n.lower().endswith(".gguf"))
    if len(models) != 1:
        return Skipped(path, f"a model folder holds one model; this one holds {len(models)}")
    if len(projectors) > 1:
        return Skipped(path, f"a model folder holds at most one projector; this one holds "
                             f"{len(projectors)}")
    return Found(alias_of(os.path.basename(path)), os.path.join(path, models[0]),
                 os.path.join(path, projectors[0]) if projectors else None)


def read_roles(state_dir: str) -> dict[str, int]:
    """The roles given so far (none when the file does not exist yet)."""
    try:
        with open(os.path.join(state_dir, ROLES_FILE)) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{ROLES_FILE} cannot be read ({exc}); refusing to guess roles, "
                         "which grants' model masks name") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and 1 <= v <= MAX_ROLE
            for k, v in data.items()) or len(set(data.values())) != len(data):
        raise ValueError(f"{ROLES_FILE} is not a map of aliases to distinct roles 1..{MAX_ROLE}")
    return data


def assign_roles(given: dict[str, int], aliases: Sequence[str]
                 ) -> tuple[dict[str, int], list[str]]:
    """Every alias's role: the one ``given`` names, else the lowest free one, in the order
    of ``aliases``; and the aliases left without one (every role is taken)."""
    roles = dict(given)
    taken = set(roles.values())
    over = []
    free = (r for r in range(1, MAX_ROLE + 1) if r not in taken)
    for alias in aliases:
        if alias in roles:
            continue
        role = next(free, None)
        if role is None:
            over.append(alias)
        else:
            roles[alias] = role
    return roles, over


def write_roles(state_dir: str, roles: dict[str, int]) -> None:
    """Keep ``roles`` (atomically: a torn file would leave roles to guess)."""
    path = os.path.join(state_dir, ROLES_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(sorted(roles.items(), key=lambda kv: kv[1])), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def settle_roles(state_dir: str, specs: Sequence[ModelSpec],
                 found: Sequence[ModelSpec] = ()) -> list[ModelSpec]:
    """``specs`` (the models file's) and ``found`` (the models folder's) with the roles
    their aliases were given before (new aliases take the lowest free roles, the models
    file's first, in order; on a first start that is 1, 2, ...), the assignment kept in
    the state folder.  A declared model beyond the roles stops the start
    (ModelConfigError); a found one is left out, and the log says so."""
    try:
        given = read_roles(state_dir)
    except ValueError as exc:
        raise ModelConfigError(str(exc)) from None
    roles, over = assign_roles(given, [s.alias for s in (*specs, *found)])
    declared_over = [a for a in over if a in {s.alias for s in specs}]
    if declared_over:
        raise ModelConfigError(f"at most {MAX_ROLE} models have roles; no role is left for "
                               f"{declared_over} (roles kept in {ROLES_FILE})")
    for alias in over:
        log.warning("event=models_dir.no_role alias=%s: all %d roles are given (%s)", alias,
                    MAX_ROLE, ROLES_FILE)
    if roles != given:
        write_roles(state_dir, roles)
    return [dataclasses.replace(s, role=roles[s.alias]) for s in (*specs, *found)
            if s.alias in roles]


def folder_specs(models_dir: str, declared: Sequence[ModelSpec]) -> list[ModelSpec]:
    """A spec for each model of ``models_dir`` the models file does not declare (by file
    or alias), loaded on demand, of the kind its file declares (decided when it is
    described: ondemand.listed): 8 slots of up to 4096 tokens sharing a KV pool sized to
    the model's training context (``kv_budget = "auto"``), as llama-server's router gives
    each model its trained context in one unified cache: a model that loads and unloads
    reserves what it uses, and its context is made 4x faster than 8 streams'."""
    found, skipped = scan(models_dir)
    for s in skipped:
        log.warning("event=models_dir.skipped path=%s reason=%s", s.path, s.reason)
    files = {os.path.realpath(s.path) for s in declared}
    aliases = {s.alias for s in declared}
    out = []
    for f in found:
        if os.path.realpath(f.path) in files:
            continue
        if f.alias in aliases:
            log.warning("event=models_dir.skipped path=%s reason=the models file declares "
                        "the alias %s for another file", f.path, f.alias)
            continue
        out.append(ModelSpec(alias=f.alias, path=f.path, role=0, slots=FOLDER_SLOTS, context=4096,
                             kv_budget=-1, mmproj=f.mmproj, on_demand=True, kind="auto"))
    return out
