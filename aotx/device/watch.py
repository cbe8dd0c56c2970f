"""The models folder looked at again while the device runs: a model put there (``aotx
pull``, a copy) is served without a restart, as llama-server's router and Ollama do.

Every :data:`PERIOD` seconds the control thread lists the folder (:meth:`Watch.tick`,
cheap: the names only).  A model it has not seen gets a role (kept by alias in the
state folder, as at start: device/catalog.py) and is described on a thread of its own
(a GGUF header read takes up to a second); the control thread then lists it as a model
loaded on first use (:meth:`Watch.take`), and INFO carries its row from then on.  A
new file is described once two looks found the same size and time (a copy in progress
is not a model yet): a model put there serves within about ten seconds.  A
model whose file is gone shows ``failed`` until it is back, when it is not loaded (a
loaded one keeps its mapping).  Files beyond the roles stay listed as unassigned.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence

from ..engine.spec import ModelSpec
from .catalog import FOLDER_SLOTS, folder_specs, settle_roles
from .models import ModelConfigError
from .ondemand import FAILED, Hasher, OnDemand, describe_all, file_identity
from .state import DeviceState

log = logging.getLogger("aotx.device")

#: Seconds between two looks at the folder.
PERIOD = 5.0
GONE = "the model's file is gone from the models folder"


class Watch:
    def __init__(self, folder: str, state_dir: str, declared: Sequence[ModelSpec],
                 ring: Callable[[], None]) -> None:
        self.folder, self.state_dir, self.declared = folder, state_dir, list(declared)
        self._ring = ring
        self._names: frozenset[str] | None = None  # the folder's listing at the last look
        self._seen: set[str] = set()  # aliases described or being described
        self._settling: dict[str, tuple[int, int]] = {}  # new files: their size and time
        self._done: queue.Queue[dict[int, OnDemand]] = queue.Queue()
        self.unassigned: list[tuple[str, str]] = []
        self.unassigned_known = False  # set once a look has computed the roles
        self.last = 0.0

    def listing(self) -> frozenset[str]:
        """The folder's entries and its subfolders' (what a change of models changes)."""
        names: set[str] = set()
        try:
            for e in os.scandir(self.folder):
                names.add(e.name)
                if e.is_dir():
                    names.update(f"{e.name}/{n}" for n in os.listdir(e.path))
        except OSError:
            pass
        return frozenset(names)

    def step(self, st: DeviceState, now: float) -> None:
        """List the models described since the last step, and look at the folder again
        when it is time (control thread, lock held)."""
        added = [od for od in self.take() if _installs(st.on_demand.get(od.spec.role), od)]
        for od in added:
            st.on_demand[od.spec.role] = od
            log.info("event=model.listed alias=%s role=%d state=%s", od.spec.alias,
                     od.spec.role, od.state)
        if added:
            st.on_demand = dict(sorted(st.on_demand.items()))
            Hasher(added, os.path.join(self.state_dir, "model-hashes.json")).start()
        if now - self.last >= PERIOD:
            known = ({m.spec.alias for m in st.models.values()}
                     | {od.spec.alias for od in st.on_demand.values()}
                     | {alias for alias, _ in st.unassigned})
            self.tick(now, st.on_demand, known)
            if self.unassigned_known:
                st.unassigned = self.unassigned

    def tick(self, now: float, on_demand: dict[int, OnDemand], known: set[str]) -> None:
        """Look at the folder (control thread, lock held): mark the models whose file is
        gone, and describe the new ones on a thread (``known``: every alias served)."""
        self.last = now
        for od in on_demand.values():
            # (one a request or an admin waits for is left to its load, which fails)
            if od.unclaimed() and not os.path.exists(od.spec.path):
                od.state, od.reason, od.failed_file = FAILED, GONE, (0, 0)
        self._redescribe(on_demand)
        names = self.listing()
        if names == self._names and not self._settling:
            return
        self._names = names
        found = folder_specs(self.folder, self.declared)
        present = {s.alias for s in found} | {od.spec.alias for od in on_demand.values()}
        self._settling = {a: v for a, v in self._settling.items() if a in present}
        self._seen |= known
        new = [s for s in found if s.alias not in self._seen and self._settled(s)]
        if not new:
            return
        try:
            specs = settle_roles(self.state_dir, self.declared, found)
        except ModelConfigError as exc:  # (the roles file became unreadable)
            log.warning("event=models_dir.rescan_failed error=%s", exc)
            return
        roles = {s.alias: s for s in specs}
        self.unassigned = [(s.alias, s.path) for s in found if s.alias not in roles]
        self.unassigned_known = True
        fresh = [roles[s.alias] for s in new if s.alias in roles]
        self._seen |= {s.alias for s in fresh}
        if fresh:
            log.info("event=models_dir.found models=%s", ",".join(s.alias for s in fresh))
            threading.Thread(target=self._describe, args=(fresh,), name="describe-models",
                             daemon=True).start()

    def _redescribe(self, on_demand: dict[int, OnDemand]) -> None:
        """Describe again the unloaded models whose file was replaced (another pull of
        the same name), once it has settled: their estimate, row and digest were the
        old file's."""
        declared = {s.alias for s in self.declared}
        changed = [od.spec if od.spec.alias in declared else  # (a folder's: its kind anew)
                   dataclasses.replace(od.spec, kind="auto", slots=FOLDER_SLOTS)
                   for od in on_demand.values()
                   if od.unclaimed() and od.described != (0, 0)
                   and file_identity(od.spec.path) not in ((0, 0), od.described)
                   and self._settled(od.spec)]
        if changed:
            log.info("event=models_dir.changed models=%s", ",".join(s.alias for s in changed))
            threading.Thread(target=self._describe, args=(changed,), name="describe-models",
                             daemon=True).start()

    def _settled(self, spec: ModelSpec) -> bool:
        """Whether a new model's file kept its size and time since the last look (a copy
        in progress is described once it has ended)."""
        now = file_identity(spec.path)
        if now == (0, 0):
            return False
        if self._settling.get(spec.alias) == now:
            del self._settling[spec.alias]
            return True
        self._settling[spec.alias] = now
        return False

    def _describe(self, specs: list[ModelSpec]) -> None:
        self._done.put(describe_all(specs))
        self._ring()

    def take(self) -> list[OnDemand]:
        """The models described since the last call (control thread)."""
        out: list[OnDemand] = []
        while True:
            try:
                out.extend(self._done.get_nowait().values())
            except queue.Empty:
                return out


def _installs(current: OnDemand | None, described: OnDemand) -> bool:
    """Whether a description is listed (lock held): a new model's, or a replaced file's
    while its model is still unloaded and nobody waits for it (else the next look
    describes it again); a replaced model keeps its counters."""
    if current is None:
        return True
    if current.spec.alias != described.spec.alias or not current.unclaimed():
        return False
    described.loads, described.load_seconds = current.loads, current.load_seconds
    described.evictions = current.evictions
    return True
