"""A request's seed folded to llama.cpp's 32 bits, and its choices' seeds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from aotx import seeds

SEED = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def test_small_seeds_are_themselves_and_minus_one_is_zero() -> None:
    assert [seeds.fold(s) for s in (0, 5, 2**32 - 2)] == [0, 5, 2**32 - 2]
    assert seeds.fold(-1) == seeds.fold(2**64 - 1) == 0
    assert [seeds.of_choice(7, i) for i in range(4)] == [7, 8, 9, 10]


@given(SEED)
def test_no_seed_folds_to_llama_cpp_s_random(seed: int) -> None:
    assert 0 <= seeds.fold(seed) < seeds.RANDOM32


@given(SEED, st.integers(min_value=2, max_value=64))
def test_a_request_s_choices_never_share_a_sampler_seed(seed: int, n: int) -> None:
    folded = [seeds.fold(seeds.of_choice(seed, i)) for i in range(n)]
    assert len(set(folded)) == n, (seed, folded)
    assert seeds.fold(seeds.of_choice(seed, 0)) == seeds.fold(seed)
    assert all(0 <= seeds.of_choice(seed, i) < 2**64 for i in range(n))
