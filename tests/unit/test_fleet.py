"""The residency rule (device/fleet.py): each test fails when its part of the rule is
taken out."""

from __future__ import annotations

import pytest

from aotx.device.fleet import PINNED, NeverFits, Resident, default_budget, expired, plan_room

GB = 1 << 30
A, B = 1, 2  # principals


def model(role: int, gb: int, last_used: float, keep_alive: float = 300.0,
          **kw: object) -> Resident:
    return Resident(role, gb * GB, keep_alive, last_used=last_used, **kw)  # type: ignore[arg-type]


def roles(plan: list[Resident] | None) -> list[int] | None:
    return None if plan is None else [r.role for r in plan]


def test_room_is_made_least_recently_used_first_and_no_more_than_needed() -> None:
    loaded = [model(1, 4, last_used=30), model(2, 4, last_used=10), model(3, 4, last_used=20)]
    assert roles(plan_room(2 * GB, 16 * GB, loaded, A, now=1000)) == []  # fits beside them
    assert roles(plan_room(6 * GB, 16 * GB, loaded, A, now=1000)) == [2]  # the oldest alone
    assert roles(plan_room(10 * GB, 16 * GB, loaded, A, now=1000)) == [2, 3]


def test_a_pinned_model_is_never_unloaded() -> None:
    loaded = [model(1, 8, last_used=0, keep_alive=PINNED), model(2, 4, last_used=10)]
    assert roles(plan_room(8 * GB, 16 * GB, loaded, A, now=1000)) == [2]
    assert plan_room(12 * GB, 16 * GB, loaded, A, now=1000) is None  # waits
    assert expired(loaded, now=1e9) == [loaded[1]]


def test_a_busy_model_is_never_unloaded() -> None:
    loaded = [model(1, 8, last_used=0, busy=True), model(2, 8, last_used=10)]
    assert roles(plan_room(8 * GB, 16 * GB, loaded, A, now=1000)) == [2]
    loaded[1].busy = True
    assert plan_room(8 * GB, 16 * GB, loaded, A, now=1000) is None
    assert expired(loaded, now=1e9) == []


def test_another_principals_model_is_safe_within_its_keep_alive() -> None:
    """B's load cannot unload the model A used a minute ago (its keep-alive is five);
    A's own load can, and B's can once A's keep-alive has run out."""
    a_model = model(1, 8, last_used=940, users={A: (940, 300)})
    b_model = model(2, 8, last_used=990, users={B: (990, 300)})
    loaded = [a_model, b_model]
    assert roles(plan_room(8 * GB, 16 * GB, loaded, B, now=1000)) == [2]  # B's own, not A's
    assert roles(plan_room(8 * GB, 16 * GB, loaded, A, now=1000)) == [1]  # A's own
    b_model.users[A] = (995, 300)  # A used B's model too
    assert plan_room(8 * GB, 16 * GB, loaded, B, now=1000) is None
    assert roles(plan_room(8 * GB, 16 * GB, loaded, B, now=940 + 300)) == [1]


def test_keep_alive_zero_unloads_when_idle_and_a_model_larger_than_the_budget_never_fits() -> None:
    now = 1000.0
    loaded = [model(1, 1, last_used=now, keep_alive=0), model(2, 1, last_used=now - 299),
              model(3, 1, last_used=now - 301)]
    assert [r.role for r in expired(loaded, now)] == [1, 3]
    with pytest.raises(NeverFits):
        plan_room(17 * GB, 16 * GB, [], A, now)
    assert default_budget(32 * GB) == 24 * GB


def test_a_requests_keep_alive_holds_for_its_principal_only() -> None:
    """Ollama's per-request keep_alive: B's request asked 0 (unload once idle) and A's
    the model's 300 a minute ago: the model stays for A; once A's hold runs out it
    expires. A request's -1 pins it, against every load."""
    now = 1000.0
    m = model(1, 4, last_used=now, users={A: (now - 60, 300), B: (now, 0)})
    assert expired([m], now) == [] and m.protected_from(B, now)
    assert expired([m], now - 60 + 300) == [m]
    m.users = {B: (now, 0)}
    assert expired([m], now) == [m] and not m.protected_from(A, now)
    m.users = {A: (0, PINNED)}  # (an admin's request: ondemand.asked_keep_alive)
    assert expired([m], 1e9) == [] and m.protected_from(B, 1e9)
    assert m.protected_from(A, 1e9)  # pinned, for its pinner's own loads too
    unused = model(2, 4, last_used=now - 301)  # loaded by an admin: the model's own
    assert expired([unused], now) == [unused]
