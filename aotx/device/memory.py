"""Automatic memory's parts that hold no state of the policy: what qualifies a model,
which extracted lines become facts (:func:`decide`), how facts enter a prompt
(:func:`inject`), and a principal's memory on disk (:class:`Lineage`).

A principal's facts are saved as *generations* of its lineage
(``DIR/memory/<principal>/gen-<N>.json``): written to a temporary file, fsynced,
renamed, the folder fsynced; each file carries a SHA-256 of its facts and the loader
skips files whose checksum fails, so a crash mid-save leaves the previous generation
readable.  The last :data:`KEEP_GENERATIONS` generations are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass

log = logging.getLogger("aotx.policy")

#: How the policy makes its sources and reads them: the user's own words of a completed
#: text request, at most MAX_SOURCE_CHARS, asked of the model with EXTRACTION_PROMPT and
#: decided line by line by :func:`decide`.  Its name carries the extraction prompt's
#: SHA-256 (first 16 hex digits): a changed prompt is another profile, not yet qualified.
SOURCE_PROFILE_NAME = "user-words/v1"
#: The profiles qualified for automatic memory, exactly as the seed asks: the loaded model
#: file (SHA-256), its wrapper (the chat template's SHA-256), its processors (the
#: projector file's SHA-256, or "" for none) and the source profile.
QUALIFIED_PROFILES = {
    ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
     "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
     "", "user-words/v1:5bb26dc85d46c9b7"),
}
MODE_AUTOMATIC_MEMORY = 1
KEEP_GENERATIONS = 5
MAX_FACTS = 64
MAX_FACT_CHARS = 200
MAX_SOURCE_CHARS = 2000
EXTRACTION_MAX_TOKENS = 64

#: The extraction prompt (system message); the user message is what the user said.
EXTRACTION_PROMPT = (
    "List the durable facts that the user states about themselves in the conversation "
    "below (name, home, work, family, preferences). Write each fact as a short sentence "
    "about 'The user' on its own line starting with '- '. If there are none, write NONE.")


def source_profile() -> str:
    """The source profile in use (its name and its extraction prompt's digest)."""
    return f"{SOURCE_PROFILE_NAME}:{hashlib.sha256(EXTRACTION_PROMPT.encode()).hexdigest()[:16]}"


def qualified(model_sha256: bytes, template_source: str, projector_sha256: bytes | None = None,
              profile: str | None = None) -> bool:
    """Is this exact model, template, projector and source profile qualified?"""
    tmpl = hashlib.sha256(template_source.encode()).hexdigest()
    key = (model_sha256.hex(), tmpl, projector_sha256.hex() if projector_sha256 else "",
           profile if profile is not None else source_profile())
    return key in QUALIFIED_PROFILES


_STOP = frozenset("""that this with from have they their there about what when where which
while would could should your yours user users them then than were been being into over
also just like some such only very much more most many lives live user's""".split()) \
    - {"live", "lives"}
_FIRST_PERSON = frozenset({"i", "i'm", "im", "my", "me", "mine", "i've", "ive", "myself"})


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z][A-Za-z'\-]*", text)


def decide(line: str, existing: list[str], source: str) -> str | None:
    """Keep (return the normalised fact) or discard (None) one candidate line.

    A small model embellishes, so a fact is kept only when the source backs it:
    the user spoke in the first person; at least two, and two thirds, of the fact's
    content words (compared by their first four letters) occur in what the user said
    ("My favourite sport is tennis" backs no "professional tennis coach" who shares
    "a passion for the sport"); every capitalised name in the fact occurs there too;
    and it is new.
    """
    text = re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", line).strip()
    fact = " ".join(text.split()).rstrip(" ,;")
    if not 8 <= len(fact) <= MAX_FACT_CHARS or fact.upper().startswith("NONE"):
        return None
    said = [w.lower() for w in _words(source)]
    if not _FIRST_PERSON & set(said):
        return None
    stems = {w[:4] for w in said if len(w) >= 4}
    content = [w.lower() for w in _words(fact) if len(w) >= 4 and w.lower() not in _STOP]
    backed = sum(1 for w in content if w[:4] in stems)
    if backed < 2 or 3 * backed < 2 * len(content):
        return None
    names = [w for w in _words(fact)[1:] if w[0].isupper() and w.lower() not in ("i", "i'm")]
    if any(n.lower() not in said for n in names):
        return None
    if fact.lower() in (f.lower() for f in existing):
        return None
    return fact


def inject(messages: list[dict[str, str]], facts: list[str]) -> list[dict[str, str]]:
    """Put saved facts into the message array, before the chat template runs."""
    if not facts:
        return messages
    block = "Known facts about the user:\n" + "\n".join(f"- {f}" for f in facts)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{block}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


class Lineage:
    """One principal's memory generations on disk."""

    def __init__(self, root: str, principal: int) -> None:
        self.dir = os.path.join(root, str(principal))

    def _files(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if n.startswith("gen-") and n.endswith(".json"):
                try:
                    out.append((int(n[4:-5]), os.path.join(self.dir, n)))
                except ValueError:
                    continue
        return sorted(out)

    def latest(self) -> tuple[int, list[str]]:
        """(generation, facts) of the newest intact generation; (0, []) when none."""
        for gen, path in reversed(self._files()):
            try:
                with open(path, "rb") as f:
                    doc = json.loads(f.read())
                facts = doc["facts"]
                if doc["generation"] == gen and doc["sha256"] == _checksum(facts):
                    return gen, list(facts)
                log.warning("event=memory.corrupt path=%s", path)
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("event=memory.unreadable path=%s", path)
        return 0, []

    def save(self, facts: list[str]) -> tuple[int, int]:
        """Write a new generation atomically; return (generation, bytes written)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        files = self._files()
        gen = (files[-1][0] if files else 0) + 1
        data = json.dumps({"generation": gen, "facts": facts, "sha256": _checksum(facts),
                           "saved_at": time.time()}, indent=1).encode()
        path = os.path.join(self.dir, f"gen-{gen:08d}.json")
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(self.dir)
        for _, old in files[:max(0, len(files) + 1 - KEEP_GENERATIONS)]:
            os.unlink(old)
        return gen, len(data)

    def erase(self) -> int:
        removed = 0
        for _, path in self._files():
            os.unlink(path)
            removed += 1
        if os.path.isdir(self.dir):
            for n in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, n))
            _fsync_dir(self.dir)
        return removed


def _checksum(facts: list[str]) -> str:
    return hashlib.sha256(json.dumps(facts, ensure_ascii=False).encode()).hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Source:
    principal: int
    role: int
    text: str


@dataclass
class Pending:
    id: int
    principal: int
    fact: str
