"""The e2e fixtures (a real `prefect server start` on 127.0.0.1) for the kill tests."""

from tests.e2e.conftest import prefect_server  # noqa: F401
