"""The host-memory store of cached prefixes (engine/spill.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aotx.engine.fair import common_prefix
from aotx.engine.llama.spill import SPILL_MIN_TOKENS, SpillStore

PUBLIC = [1, 2, 3]


def saved(data: bytes) -> bytearray:
    return bytearray(data)  # (what LlamaEngine.save_sequence returns)


def test_the_longest_usable_entry_is_found_and_taken() -> None:
    s = SpillStore(1000)
    s.put([*PUBLIC, 10, 11, 12], owner=1, data=saved(b"a" * 100))
    s.put([*PUBLIC, 20, 21], owner=1, data=saved(b"b" * 100))
    key, n = s.best([*PUBLIC, 10, 11, 12, 13], 1, PUBLIC)
    assert n == 6
    e = s.take(key)
    assert e.data == b"a" * 100 and (s.bytes, len(s.entries)) == (100, 1)
    assert s.best([*PUBLIC, 10, 11], 1, PUBLIC)[1] == len(PUBLIC)  # only the other one left


def test_another_principal_gets_at_most_the_public_prefix() -> None:
    s = SpillStore(1000)
    s.put([*PUBLIC, 10, 11, 12], owner=1, data=saved(b"a" * 100))
    assert s.best([*PUBLIC, 10, 11, 12, 13], 2, PUBLIC)[1] == len(PUBLIC)


def test_the_budget_lets_the_oldest_go_and_an_extended_entry_is_superseded() -> None:
    s = SpillStore(250)
    s.put([5, 6], owner=1, data=saved(b"a" * 100))
    s.put([7, 8], owner=2, data=saved(b"b" * 100))
    s.put([9], owner=3, data=saved(b"c" * 100))  # over budget: [5, 6] goes
    assert [e.tokens for e in s.entries.values()] == [[7, 8], [9]] and s.bytes == 200
    s.put([7, 8, 9], owner=2, data=saved(b"d" * 100))  # extends owner 2's [7, 8]
    assert [e.tokens for e in s.entries.values()] == [[9], [7, 8, 9]]
    s.put([9, 1], owner=4, data=saved(b"e" * 100))  # another owner's: over budget, [9] goes
    assert [e.owner for e in s.entries.values()] == [2, 4]
    assert s.bytes == 200 and s.dropped == 3
    s.put([1], owner=5, data=saved(b"x" * 251))  # larger than the whole budget: not kept
    assert s.bytes <= 250 and not any(e.owner == 5 for e in s.entries.values())


def test_nothing_is_worth_spilling_without_a_budget_or_below_the_minimum() -> None:
    assert not SpillStore(0).worth(10_000)
    assert not SpillStore(1 << 20).worth(SPILL_MIN_TOKENS - 1)
    assert SpillStore(1 << 20).worth(SPILL_MIN_TOKENS)


def test_the_default_budget_is_an_eighth_of_the_available_memory_at_most_1_gib() -> None:
    from aotx.engine.llama.residency import available_bytes
    from aotx.engine.llama.spill import default_budget

    assert default_budget(0) == 0 and default_budget(12345) == 12345
    assert default_budget(-1) == min(1 << 30, available_bytes() // 8) > 0


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_is_the_first_difference(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n
    assert common_prefix(a + [9], a + [8]) == len(a) and common_prefix(a, a) == len(a)


def test_a_restore_must_save_more_evaluation_than_it_costs() -> None:
    s = SpillStore(1 << 20)
    s.put(list(range(100)), owner=1, data=saved(b"a"))
    s.put(list(range(1000, 3000)), owner=1, data=saved(b"b"))
    small, large = list(s.entries)
    assert s.worth_restoring(small, 4) and not s.worth_restoring(small, 3)
    assert not s.worth_restoring(large, 4) and s.worth_restoring(large, 2000 // 256)
