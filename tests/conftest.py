"""Fixtures: one shared service for the end-to-end tests (and the ``openai`` client on
it), a service of its own for tests that restart it, and the ``e2e`` marker on every test under ``tests/e2e`` (the tests that
load the real model), so that ``pytest -m "not e2e"`` runs without one."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import openai
import pytest

from .helpers import Service, make_service, running_service

E2E = pathlib.Path(__file__).parent / "e2e"
VLLM = pathlib.Path(__file__).parent / "vllm"  # (they load the real model too)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parents = pathlib.Path(str(item.path)).parents
        if E2E in parents or VLLM in parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def service() -> Iterator[Service]:
    """One shared service for the end-to-end tests that do not restart it."""
    with running_service() as svc:
        yield svc


@pytest.fixture(scope="session")
def oai(service: Service) -> openai.OpenAI:
    """The official ``openai`` client on the shared service (no retries: a test sees the
    first answer)."""
    return openai.OpenAI(base_url=service.url + "/v1", api_key=service.token, max_retries=0,
                         timeout=120)


@pytest.fixture
def fresh_service() -> Iterator[Service]:
    """A service of its own, for tests that restart or kill components."""
    svc = make_service()
    try:
        yield svc
    finally:
        svc.stop()
        shutil.rmtree(svc.state_dir, ignore_errors=True)
