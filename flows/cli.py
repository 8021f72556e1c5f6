"""The `eagle3` command.

    eagle3 run (--preset tiny|demo | --config FILE.yaml) [--set key=value ...] [--run-dir DIR]
    eagle3 demo [--run-dir DIR]              same as: eagle3 run --preset demo
    eagle3 gpu-cleanup [--mode own|match|all] [--allow-all] [--dry-run] [--json] [--run-dir DIR]

`run` prints one line per stage (stage, state, seconds, artifact), then the result table,
writes <run-dir>/summary.json and exits non-zero when the flow failed. Errors are one line
naming the value and the setting; `--verbose` also shows Prefect's own log on the console.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft heads for vLLM targets.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the train_eagle3 flow")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "demo"], help="a built-in configuration")
    source.add_argument("--config", type=Path, help="a YAML file of settings (README: Configuration)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one setting, e.g. train.steps=100")
    run.add_argument("--run-dir", help="folder of this run (default: the preset's, e.g. runs/demo)")
    run.add_argument("--verbose", action="store_true", help="show Prefect's log on the console")
    demo = sub.add_parser("demo", help="run the embedded default (SmolLM2-135M-Instruct)")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    demo.add_argument("--verbose", action="store_true")
    gpu = sub.add_parser("gpu-cleanup", help="find and stop processes holding the GPUs, then verify with NVML")
    gpu.add_argument("--mode", choices=["own", "match", "all"], default="own")
    gpu.add_argument("--allow-all", action="store_true", help="confirm --mode all")
    gpu.add_argument("--dry-run", action="store_true")
    gpu.add_argument("--json", action="store_true", help="print the report as JSON")
    gpu.add_argument("--run-dir", default=".", help="run folder whose own processes mode 'own' may stop")
    return parser


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _run(args: argparse.Namespace) -> int:
    if not args.verbose:
        # Prefect logs still reach the server/UI; the console shows our stage lines only.
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "CRITICAL")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "CRITICAL")
    from eagle3.config import ConfigError, build_config

    preset = "demo" if args.command == "demo" else args.preset
    try:
        config = build_config(preset, getattr(args, "config", None), args.overrides, args.run_dir)
    except ConfigError as err:
        return _fail(str(err), 2)
    from flows.train_eagle3 import train_eagle3

    print(f"eagle3: run dir {config.run_dir}; target {config.target.model}", flush=True)
    state = train_eagle3(config, return_state=True)
    summary_path = Path(config.run_dir) / "summary.json"
    from eagle3.summary import read_summary

    if summary_path.is_file():
        summary = read_summary(summary_path)
        print()
        print(summary.to_markdown())
        print(f"\nsummary: {summary_path}")
    if state.is_failed():
        error = state.result(raise_on_failure=False)
        return _fail(str(error).splitlines()[0] if str(error) else type(error).__name__)
    return 0


def _gpu_cleanup(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from eagle3.config import format_validation_error
    from eagle3.gpu import GpuCleanupConfig, GpuCleanupError, cleanup_gpus, format_report_table

    try:
        config = GpuCleanupConfig(mode=args.mode, allow_all=args.allow_all, dry_run=args.dry_run)
    except ValidationError as err:
        return _fail(format_validation_error(err), 2)
    try:
        report = cleanup_gpus(config, Path(args.run_dir))
    except GpuCleanupError as err:
        return _fail(str(err))
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_report_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("run", "demo"):
        return _run(args)
    return _gpu_cleanup(args)


if __name__ == "__main__":
    sys.exit(main())
