from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server + database for every flow test (about 8 s, once)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
