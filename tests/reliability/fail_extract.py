"""`eagle3` with a fake full disk in extract: `python -m tests.reliability.fail_extract N <eagle3 args>`.

The store's shard writes raise OSError(ENOSPC) once N shards of this process are written, the
fault tests/reliability/faults.py injects in the store's writes (a FAKE full disk), here in a CLI
run: extract fails after N shards, with the target loaded, which is what a warm engine outlives.
"""

from __future__ import annotations

import errno
import sys
import threading

from eagle3.capture import store


def fail_after(shards: int) -> None:
    real = store.StoreWriter.write_shard
    written = [0]
    lock = threading.Lock()

    def write_shard(self, index, samples):  # noqa: ANN001, ANN202 - StoreWriter.write_shard's own signature
        with lock:
            if written[0] >= shards:
                raise OSError(errno.ENOSPC, f"No space left on device (fake, after {shards} shards)")
            written[0] += 1
        return real(self, index, samples)

    store.StoreWriter.write_shard = write_shard


if __name__ == "__main__":
    fail_after(int(sys.argv[1]))
    from flows.cli import main

    sys.exit(main(sys.argv[2:]))
