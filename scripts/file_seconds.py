"""tests/file_seconds.json from a pytest log with `--durations=0`: each test file's seconds (setup, call and teardown
of its tests, summed), files of 20 s or more, longest first. tests/conftest.py hands the files to make test's
processes in that order.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=0 tests > /tmp/log
    python3 scripts/file_seconds.py /tmp/log > tests/file_seconds.json
"""

from __future__ import annotations

import collections
import json
import re
import sys

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)::")


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 scripts/file_seconds.py PYTEST_LOG (a log of pytest --durations=0)")
    seconds: collections.Counter[str] = collections.Counter()
    with open(sys.argv[1]) as log:
        for line in log:
            match = LINE.match(line)
            if match:
                seconds[match.group(2)] += float(match.group(1))
    if not seconds:
        raise SystemExit(f"{sys.argv[1]}: no duration lines; run pytest with --durations=0")
    json.dump({name: round(s) for name, s in seconds.most_common() if s >= 20}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
