"""Zero pages handed back to the kernel (aotx.engine.llama.residency), on a real mapping."""

from __future__ import annotations

import ctypes
import mmap
import sys
import time

import pytest

from aotx.engine.llama.residency import (
    PAGE,
    ReleasingWhile,
    anonymous_mappings,
    new_regions,
    release_resident_zero_pages,
    release_zero_pages,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

PAGES = 8192 + 5  # more than one scan chunk (64 MiB), and not a whole number of them


def resident_bytes(start: int) -> int:
    """The Rss of the mapping that holds ``start`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


def anonymous(pages: int) -> tuple[mmap.mmap, int]:
    """A new private anonymous mapping of ``pages`` pages, and its address."""
    region = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, ctypes.addressof(ctypes.c_char.from_buffer(region))


def test_only_zero_pages_are_released_and_the_content_is_unchanged() -> None:
    before = anonymous_mappings()
    region, start = anonymous(PAGES)
    try:
        new = anonymous_mappings() - before
        assert any(lo <= start and start + PAGES * PAGE <= hi for lo, hi in new)
        region.write(bytes(PAGES * PAGE))  # every page written (resident), as memset does
        written = {0, 1, 4000, 8191, 8192, PAGES - 1}  # first, chunk edges, last
        for page in written:
            region[page * PAGE + 123] = 7
        resident = resident_bytes(start)  # the mapping may be merged with a neighbour
        assert resident >= PAGES * PAGE

        released = release_zero_pages({(start, start + PAGES * PAGE)}, PAGES * PAGE)

        assert released == (PAGES - len(written)) * PAGE
        assert resident - resident_bytes(start) >= released - 64 * 1024
        for page in written:
            assert region[page * PAGE + 123] == 7
        assert region[:PAGE].count(0) == PAGE - 1
        assert region[2 * PAGE:4000 * PAGE].count(0) == 3998 * PAGE  # reads as zeros
        region[3 * PAGE] = 9  # and a write backs the page again
        assert region[3 * PAGE] == 9
    finally:
        region.close()


def test_regions_under_the_threshold_are_left_alone() -> None:
    region, start = anonymous(16)
    try:
        region.write(bytes(16 * PAGE))
        assert release_zero_pages({(start, start + 16 * PAGE)}, 17 * PAGE) == 0
        assert resident_bytes(start) >= 16 * PAGE
    finally:
        region.close()


def test_a_mapping_merged_with_an_older_one_counts_only_for_its_new_part() -> None:
    before = {(100, 200), (300, 400)}
    after = {(50, 200), (300, 400), (500, 600), (250, 450)}  # grown down; new; around
    assert new_regions(before, after) == {(50, 100), (500, 600), (250, 300), (400, 450)}
    assert new_regions(before, before) == set()


def clear(start: int, pages: int) -> None:
    """Zeros from the second page on, about 1 MiB at a time, as llama.cpp's memset goes
    (the GIL released), a little slower than a scan."""
    for at in range(1, pages, 255):
        ctypes.memset(start + at * PAGE, 0, min(255, pages - at) * PAGE)
        if at % 2040 == 1:
            time.sleep(0.003)


def test_pages_are_handed_back_while_a_clear_runs() -> None:
    """ReleasingWhile: while another thread clears a new mapping of the size it watches,
    the pages the clear has written go back to the kernel as it goes; the first page (an
    allocator's header) stays, and the content reads unchanged."""
    pages = 16384  # 64 MiB
    with ReleasingWhile(pages * PAGE, pages * PAGE + 4 * PAGE, interval=0.001) as early:
        region, start = anonymous(pages)
        region[1] = 7  # a header, as malloc writes it
        clear(start, pages)
        deadline = time.monotonic() + 10  # (a loaded machine may run the thread late)
        while early.released < (pages - 1) * PAGE and time.monotonic() < deadline:
            time.sleep(0.005)
        assert early.released >= (pages - 1) * PAGE  # before the block ends
    try:
        assert resident_bytes(start) < pages * PAGE // 4  # (a merged neighbour counts too)
        assert region[1] == 7 and region[:PAGE].count(0) == PAGE - 1
        assert region[PAGE:].count(0) == (pages - 1) * PAGE
    finally:
        region.close()


def test_a_mapping_of_another_size_is_left_to_the_pass_after() -> None:
    """Only the KV buffer's own mapping is released while the context is created: other
    large allocations are filled right after they are zeroed."""
    pages = 4096  # 16 MiB, where 64 MiB are watched
    with ReleasingWhile(4 * pages * PAGE, 4 * pages * PAGE + 4 * PAGE,
                        interval=0.001) as early:
        region, start = anonymous(pages)
        clear(start, pages)
        time.sleep(0.05)
    try:
        assert early.released == 0 and resident_bytes(start) >= (pages - 1) * PAGE
    finally:
        region.close()


def test_a_resident_scan_leaves_pages_that_are_not_resident() -> None:
    region, start = anonymous(64)
    try:
        region[: 8 * PAGE] = bytes(8 * PAGE)  # 8 resident pages of zeros, 56 never touched
        assert release_resident_zero_pages({(start, start + 64 * PAGE)}, 64 * PAGE) == 8 * PAGE
        assert release_resident_zero_pages({(start, start + 64 * PAGE)}, 65 * PAGE) == 0
    finally:
        region.close()
