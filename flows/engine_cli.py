"""`eagle3 engine start|list|stop`: a warm engine for a user who wants one up (eagle3.engine).

    eagle3 engine start (--preset tiny|demo | --config FILE.yaml) [--set key=value ...] [--keep-warm-s S]
    eagle3 engine list [--json]
    eagle3 engine stop [FINGERPRINT ...] [--all]

`start` loads the target of that configuration into an engine process (or finds it up), exactly
the engine a run of the same configuration attaches to, and returns; the engine stays up until
`stop`, or until it has been idle (no run attached) for --keep-warm-s. Runs only detach from an
engine started here (they never stop it). `stop` with no fingerprint stops every engine of this
machine: through its socket when it answers, else SIGTERM then SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

USER_KEEP_WARM_S = 1800.0


def add_parser(sub: argparse._SubParsersAction, docs: Callable[..., str]) -> None:
    engine = sub.add_parser("engine", help="keep the target loaded in a warm engine that runs attach to",
                            epilog=docs("getting-started.md"))
    verbs = engine.add_subparsers(dest="verb", required=True)
    start = verbs.add_parser("start", help="load the target of a configuration into a warm engine (or find it up)",
                             epilog=docs("getting-started.md"))
    source = start.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "demo"], help="a built-in configuration")
    source.add_argument("--config", type=Path, help="a YAML file of settings (docs/your-target.md)")
    start.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one setting, e.g. target.dtype=bfloat16 (the engine's settings must match the runs')")
    start.add_argument("--keep-warm-s", type=float, default=None,
                       help=f"seconds the engine waits idle before it exits (default: target.keep_warm_s, else {USER_KEEP_WARM_S:g})")
    listing = verbs.add_parser("list", help="the warm engines of this machine", epilog=docs("getting-started.md"))
    listing.add_argument("--json", action="store_true", help="print the engines' records as JSON")
    stop = verbs.add_parser("stop", help="stop warm engines (all of this machine's when none is named)",
                            epilog=docs("getting-started.md"))
    stop.add_argument("fingerprints", nargs="*", metavar="FINGERPRINT", help="engine fingerprints (or prefixes) from `list`")
    stop.add_argument("--all", action="store_true", help="every warm engine of this machine (the default with no fingerprint)")


def run(args: argparse.Namespace, fail: Callable[[str, int], int]) -> int:
    from eagle3.data.builtin_targets import default_cache_dir

    cache = default_cache_dir()
    if args.verb == "start":
        return _start(args, cache, fail)
    if args.verb == "list":
        return _list(cache, args.json)
    return _stop(cache, args.fingerprints, fail)


def _start(args: argparse.Namespace, cache: Path, fail: Callable[[str, int], int]) -> int:
    from eagle3 import stages
    from eagle3.config import ConfigError, build_config
    from eagle3.data.target import read_target_info, resolve_model_dir
    from eagle3.engine.client import EngineError, attach_or_start

    try:
        config = build_config(args.preset, args.config, args.overrides)
    except ConfigError as err:
        return fail(str(err), 2)
    keep = args.keep_warm_s if args.keep_warm_s is not None else (config.target.keep_warm_s or USER_KEEP_WARM_S)
    info = read_target_info(config.target, resolve_model_dir(config.target, config.builtin_cache))
    spec = stages.spec_from_info(config.target, info, None)
    try:
        engine, event = attach_or_start(spec, info.content_fingerprint, cache, keep, owner="user")
    except EngineError as err:
        return fail(str(err), 1)
    engine.release(stop=False)
    keep = engine.info.get("keep_warm_s", keep)  # an engine already up keeps its own
    how = (f"loaded in {event['seconds']:.1f} s" if event["event"] == "loaded"
           else f"already up (loaded {time.time() - event['loaded_at']:.0f} s ago)")
    print(f"engine {event['engine']} pid {engine.pid}: {spec.model_dir} {how}; exits after {keep:g} s idle "
          f"(owner {engine.owner}); log {engine.home.log}")
    return 0


def _list(cache: Path, as_json: bool) -> int:
    from eagle3.engine.client import stop_engine
    from eagle3.engine.registry import live_engines

    engines = [info for _, info in live_engines(cache)]
    if as_json:
        print(json.dumps(engines, indent=1))
        return 0
    if not engines:
        print(f"no warm engine on this machine ({cache / 'engines'})")
        return 0
    print(f"{'engine':20}  {'pid':>7}  {'owner':5}  {'loaded':>8}  {'load s':>6}  {'keep s':>6}  model")
    for info in engines:
        age = f"{time.time() - info.get('loaded_at', time.time()):.0f}s ago"
        print(f"{info['fingerprint']:20}  {info['pid']:>7}  {info.get('owner', '?'):5}  {age:>8}  "
              f"{info.get('load_seconds', 0):>6.1f}  {info.get('keep_warm_s', 0):>6g}  {info['spec']['model_dir']}")
    return 0


def _stop(cache: Path, wanted: list[str], fail: Callable[[str, int], int]) -> int:
    from eagle3.engine.client import stop_engine
    from eagle3.engine.registry import live_engines

    engines = [(home, info) for home, info in live_engines(cache) if not wanted or any(home.fingerprint.startswith(w) for w in wanted)]
    if wanted and not engines:
        return fail(f"no live warm engine matches {', '.join(wanted)}; `eagle3 engine list` shows them", 1)
    for home, info in engines:
        print(f"engine {home.fingerprint} pid {info['pid']}: {stop_engine(home, info)}")
    if not engines:
        print("no warm engine on this machine")
    return 0
