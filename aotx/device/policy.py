"""The resident policy: automatic memory.

Sources
    A completed request of a principal whose grant enables memory (grant flag
    bit 0), on a qualified model role, that did not opt out (``"memory":
    "off"``), is appended to the per-device *source log* (its user messages and
    the model's answer).  The *source frontier* is how many log entries the
    policy has finished with.

Work when quiet
    When no foreground request is queued or running, the policy takes the next
    source and asks the qualified model to extract durable facts with
    :data:`EXTRACTION_PROMPT` (temperature 0).  Each answer line is a candidate
    fact; :func:`decide` keeps or discards it.  Kept facts are saved as a new
    *generation* of the principal's memory lineage (``DIR/memory/<principal>/``):
    written to a temporary file, fsynced, renamed, the folder fsynced; each file
    carries a SHA-256 of its facts and the loader skips files whose checksum
    fails, so a crash mid-save leaves the previous generation readable.  The
    last :data:`KEEP_GENERATIONS` generations are kept.

    The extraction runs as a *background* request in the scheduler: a foreground
    admission cancels it at the next step (state back to quiet, reason
    foreground, interrupted + 1) and the source is retried later.

Use
    A later request of the same principal on a qualified role gets its facts as
    a system message: appended to the request's first system message, or
    inserted as a new first message when there is none (see :func:`inject`).

Controls
    pause / resume / stop / review-on / review-off, each with the expected control
    revision (stale -> 409).  With review on, decisions wait as *pending* (state
    recording) until approved or rejected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field

from .. import wire
from ..wire import PolicyReason, PolicyState

log = logging.getLogger("aotx.policy")

#: (model SHA-256, chat template SHA-256): profiles qualified for automatic memory.
QUALIFIED_PROFILES = {
    ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
     "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788"),
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


def qualified(model_sha256: bytes, template_source: str) -> bool:
    tmpl = hashlib.sha256(template_source.encode()).hexdigest()
    return (model_sha256.hex(), tmpl) in QUALIFIED_PROFILES


_STOP = frozenset("""that this with from have they their there about what when where which
while would could should your yours user users them then than were been being into over
also just like some such only very much more most many lives live""".split()) - {"live", "lives"}
_FIRST_PERSON = frozenset({"i", "i'm", "im", "my", "me", "mine", "i've", "ive", "myself"})


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z][A-Za-z'\-]*", text)


def decide(line: str, existing: list[str], source: str) -> str | None:
    """Keep (return the normalised fact) or discard (None) one candidate line.

    A small model embellishes, so a fact is kept only when the source backs it:
    the user spoke in the first person; at least two of the fact's content
    words (compared by their first four letters) occur in what the user said;
    every capitalised name in the fact occurs there too; and it is new.
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
    if sum(1 for w in content if w[:4] in stems) < 2:
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


@dataclass
class PolicyCore:
    """The policy's state and counters (the seed's 160-byte status)."""

    root: str
    enabled: bool
    state: PolicyState = PolicyState.QUIET
    reason: PolicyReason = PolicyReason.QUIET
    review: bool = False
    control_revision: int = 1
    frontier: int = 0
    completed: int = 0
    interrupted: int = 0
    refused: int = 0
    decisions: int = 0
    saved_generation: int = 0
    max_ns: int = 0
    last_ns: int = 0
    written_bytes: int = 0
    result_bytes: int = 0
    result_status: int = 0
    log: list[Source] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    next_pending: int = 1
    active: object = None  # the background extraction request, when one runs
    active_started: int = 0
    # The principal of the running extraction's source erased its memory meanwhile:
    # the extraction's result is dropped, not saved.
    discard_active: bool = False

    def forget(self, principal: int) -> None:
        """Drop a principal's unprocessed sources and pending facts (memory erase), so
        that nothing from before the erase is saved after it."""
        start = self.frontier + (1 if self.active is not None else 0)
        self.log[start:] = [s for s in self.log[start:] if s.principal != principal]
        if self.active is not None and self.log[self.frontier].principal == principal:
            self.discard_active = True
        self.pending = [p for p in self.pending if p.principal != principal]

    def __post_init__(self) -> None:
        if not self.enabled:
            self.state, self.reason = PolicyState.OFF, PolicyReason.DISABLED

    def status(self) -> wire.PolicyStatus:
        return wire.PolicyStatus(
            mode=MODE_AUTOMATIC_MEMORY, state=self.state, review_enabled=int(self.review),
            pending=len(self.pending), active_rows=int(self.active is not None),
            result_status=self.result_status, control_revision=self.control_revision,
            source_frontier=self.frontier, completed=self.completed,
            interrupted=self.interrupted, refused=self.refused, decision=self.decisions,
            saved_generation=self.saved_generation, max_ns=self.max_ns, last_ns=self.last_ns,
            written_bytes=self.written_bytes, result_bytes=self.result_bytes, reason=self.reason)

    def control(self, action: wire.PolicyAction, expected: int) -> int:
        """Apply a control; returns an HTTP-like status (200, 409)."""
        if expected != self.control_revision:
            return 409
        if not self.enabled:
            return 409
        A = wire.PolicyAction
        if action is A.PAUSE and self.state is not PolicyState.STOPPED:
            self.state, self.reason = PolicyState.PAUSED, PolicyReason.PAUSED
        elif action is A.RESUME and self.state in (PolicyState.PAUSED, PolicyState.STOPPED):
            self.state = PolicyState.RECORDING if self.pending else PolicyState.QUIET
            self.reason = PolicyReason.QUIET
        elif action is A.STOP:
            self.state, self.reason = PolicyState.STOPPED, PolicyReason.PAUSED
        elif action is A.REVIEW_ON:
            self.review = True
        elif action is A.REVIEW_OFF:
            self.review = False
        self.control_revision += 1
        return 200

    def lineage(self, principal: int) -> Lineage:
        return Lineage(self.root, principal)

    def save(self, principal: int, new: list[str]) -> None:
        lin = self.lineage(principal)
        _, facts = lin.latest()
        merged = facts + [f for f in new if f not in facts]
        if len(merged) > MAX_FACTS:
            self.refused += 1
            self.reason = PolicyReason.CAPACITY
            self.result_status = 507
            return
        gen, written = lin.save(merged)
        self.saved_generation += 1
        self.written_bytes += written
        self.result_status = 200
        log.info("event=memory.saved principal=%d generation=%d facts=%d", principal, gen,
                 len(merged))
