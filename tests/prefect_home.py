"""A PREFECT_HOME whose Prefect database is already migrated, for tests that start a Prefect server in a home of
their own.

A server's first start in an empty PREFECT_HOME runs every one of Prefect's database migrations: 11.4 s to a healthy
server (10.7 s of CPU) against 4.9 s with a migrated database there (2-core EPYC, 2026-12-07). The migrated database
is made once per test process, by `prefect server database upgrade -y` (what a server's start runs first), and
copied into each home. The homes users start with, empty, stay tested as users meet them: tests/e2e/test_interrupt.py
runs the README's first command in an empty PREFECT_HOME.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


@functools.cache
def _migrated_database() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="eagle3-prefect-db-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | {"PREFECT_HOME": str(folder)}
    out = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and (folder / "prefect.db").is_file(), out.stdout[-2000:] + out.stderr[-2000:]
    return folder / "prefect.db"


def migrated_home(path: Path) -> Path:
    """`path` (created if missing) with a migrated, empty Prefect database in it; returns `path`. A database that is
    there already (a server may be using it) is left as it is."""
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "prefect.db").exists():
        shutil.copyfile(_migrated_database(), path / "prefect.db")
    return path
