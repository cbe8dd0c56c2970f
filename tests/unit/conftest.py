"""Unit-test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aotx.device.runtime import Device
from aotx.engine.llama.scheduler import Scheduler

from .devices import scripted_device


@pytest.fixture
def device() -> Iterator[tuple[Device, Scheduler]]:
    with scripted_device() as pair:
        yield pair
