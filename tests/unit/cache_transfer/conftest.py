"""The `backend` fixture: every cache_transfer conformance test runs once per transport."""

from __future__ import annotations

import pytest
from transfer_helpers import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param
