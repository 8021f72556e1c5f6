from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server + database for every flow test (about 8 s, once), set up as
    `eagle3 deploy` sets up a real one: with the global concurrency limit `gpu`."""
    from prefect.testing.utilities import prefect_test_harness

    from tasks.gpu_slot import ensure_gpu_limit

    with prefect_test_harness(server_startup_timeout=120):
        ensure_gpu_limit()
        yield
