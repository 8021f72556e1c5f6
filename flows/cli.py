"""The `eagle3` command.

    eagle3 run (--preset tiny|demo | --config FILE.yaml) [--set key=value ...] [--run-dir DIR]
    eagle3 demo [--run-dir DIR]              same as: eagle3 run --preset demo
    eagle3 sweep (--preset tiny|demo | --config FILE.yaml) --grid train.learning_rate=3e-4,1e-3 [--grid ...]
                 [--set key=value ...] [--run-dir DIR] [--on-workers]
                                             one extraction, one train->export->evaluate per point
    eagle3 gpu-cleanup [--mode own|match|all] [--allow-all] [--dry-run] [--json] [--run-dir DIR] [--stop-warm-engines]
    eagle3 nightly (--preset tiny|demo | --config FILE.yaml) [--incoming DIR] [--registry DIR] [--set key=value ...]
    eagle3 deploy [--timezone TZ] [--cron CRON] [--incoming DIR] [--registry DIR]
    eagle3 serve [--port 4200] [--api-url URL] [deploy options]
    eagle3 train-node --spec SPEC.json --node-rank R   join, from another machine, a train stage with train.nnodes > 1
    eagle3 online-capture --buffer DIR --model DIR [--backend vllm|hf]   capture for a trainer with online.producer=remote
    eagle3 engine start|list|stop            keep the target loaded in a warm engine (flows/engine_cli.py)
    eagle3 doctor                            the versions found (python, torch, vLLM, ...), whether each is supported,
                                             what will not work with them; exit 1 when something needed is missing

`run` and `nightly` print one line per stage (stage, state, seconds, artifact), a progress bar
for the long stages, then the result table, write <run-dir>/summary.json and exit non-zero when
the flow failed. What the engines and libraries print goes to <run-dir>/logs/engine.log (and the
Prefect run log), not to the console. Errors are one `error:` line naming the value and the
setting (the file and line for a YAML file), and the log that holds the details; `--verbose`
shows the engines' output, Prefect's own log and tracebacks on the console too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from flows import engine_cli
from flows.local_server import ServerStartError
from tasks import console


def _docs(*pages: str) -> str:
    """The last line of a command's --help: the docs pages that explain it (docs/ in the checkout; `make docs`
    builds them into a site)."""
    return "docs: " + ", ".join(f"docs/{page}" for page in pages)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description="Train EAGLE-3 draft heads for vLLM targets.",
                                     epilog=_docs("index.md"))
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the train_eagle3 flow", epilog=_docs("your-target.md", "settings.md"))
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "demo"], help="a built-in configuration")
    source.add_argument("--config", type=Path, help="a YAML file of settings (docs/your-target.md)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override one setting, e.g. train.steps=100")
    run.add_argument("--run-dir", help="folder of this run (default: the preset's, e.g. runs/demo)")
    run.add_argument("--verbose", action="store_true", help="show Prefect's log on the console")
    sweep = sub.add_parser("sweep", help="one extraction, then train -> export -> evaluate per grid point",
                           epilog=_docs("sweeps.md"))
    source = sweep.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "demo"], help="a built-in configuration")
    source.add_argument("--config", type=Path, help="a YAML file of settings (docs/your-target.md)")
    sweep.add_argument("--grid", action="append", required=True, metavar="KEY=V1,V2,...",
                       help="a setting under train., vocab. or eval. and its values; the points are every combination")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one setting for every point, e.g. train.steps=100")
    sweep.add_argument("--run-dir", help="folder of the sweep (default: the preset's with -sweep, e.g. runs/tiny-sweep)")
    sweep.add_argument("--on-workers", action="store_true",
                       help="run the points side by side, each a train-eagle3 flow run on the gpu work pool of the "
                            "configured Prefect server (artifact_root: a URL or a folder every worker mounts)")
    sweep.add_argument("--verbose", action="store_true", help="show Prefect's log on the console")
    demo = sub.add_parser("demo", help="run the embedded default (SmolLM2-135M-Instruct)", epilog=_docs("getting-started.md"))
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    demo.add_argument("--verbose", action="store_true")
    nightly = sub.add_parser("nightly", help="run the nightly-eagle3 flow once (incremental retrain + promotion gate)",
                             epilog=_docs("prefect.md"))
    source = nightly.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["tiny", "demo"], help="pipeline settings of a built-in configuration")
    source.add_argument("--config", type=Path, help="a YAML file of NightlyConfig settings")
    nightly.add_argument("--incoming", help="folder or fsspec URL of dated files YYYY-MM-DD*.jsonl (= --set incoming=...)")
    nightly.add_argument("--registry", help="registry folder or fsspec URL (= --set publish.registry=...)")
    nightly.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override one setting, e.g. publish.tolerance=0.05 or pipeline.train.steps=100")
    nightly.add_argument("--run-dir", help="folder of this run (= --set pipeline.run_dir=...)")
    nightly.add_argument("--verbose", action="store_true", help="show Prefect's log on the console")
    deploy = sub.add_parser("deploy", help="create the gpu work pool and concurrency limit, register the deployments",
                            epilog=_docs("prefect.md", "several-machines.md"))
    serve = sub.add_parser("serve", help="one machine: Prefect server on 127.0.0.1 + deployments + a worker; Ctrl-C stops all",
                           epilog=_docs("prefect.md"))
    for p in (deploy, serve):
        p.add_argument("--timezone", default="UTC", help="timezone of the nightly schedule, e.g. Europe/Paris")
        p.add_argument("--cron", default="0 2 * * *", help="schedule of nightly-eagle3 (default 02:00 every day)")
        p.add_argument("--incoming", default="data/incoming", help="where dated conversation files arrive (nightly)")
        p.add_argument("--registry", default="registry", help="where promoted drafts are published (nightly)")
        p.add_argument("--machines", type=int, default=1,
                       help="GPU machines with a worker on the gpu pool: the pool runs this many flow runs at once")
    serve.add_argument("--port", type=int, default=4200, help="port of the Prefect server (UI and API)")
    serve.add_argument("--api-url", help="use this running Prefect server instead of starting one")
    deploy.add_argument("--api-url", help="the Prefect server (default: PREFECT_API_URL or the active profile's)")
    serve.add_argument("--log-dir", type=Path, default=Path("runs/serve"), help="where the server and worker logs go")
    gpu = sub.add_parser("gpu-cleanup", help="find and stop processes holding the GPUs, then verify with NVML",
                         epilog=_docs("getting-started.md", "several-gpus.md"))
    gpu.add_argument("--mode", choices=["own", "match", "all"], default="own")
    gpu.add_argument("--allow-all", action="store_true", help="confirm --mode all")
    gpu.add_argument("--dry-run", action="store_true")
    gpu.add_argument("--json", action="store_true", help="print the report as JSON")
    gpu.add_argument("--run-dir", default=".", help="run folder whose own processes mode 'own' may stop")
    gpu.add_argument("--stop-warm-engines", action="store_true",
                     help="also stop live warm engines (left alone otherwise: `eagle3 engine stop` stops them too)")
    node = sub.add_parser("train-node", help="run one more machine of a training with train.nnodes > 1 (the train "
                          "stage on node 0 prints this command while it waits)", epilog=_docs("several-machines.md"))
    node.add_argument("--spec", type=Path, required=True, help="the launch spec node 0 wrote, on the shared folder")
    node.add_argument("--node-rank", type=int, required=True, help="this machine's node: 1 .. train.nnodes-1")
    capture = sub.add_parser("online-capture", add_help=False, epilog=_docs("online-training.md"),
                             help="capture for a train stage with online.producer=remote, on the machine that holds the "
                             "target: --buffer DIR --model DIR [--backend vllm|hf] [--dtype D] (--help: all options)")
    del capture  # its options are capture_worker's own: main() hands the arguments over before parsing
    engine_cli.add_parser(sub, _docs)
    sub.add_parser("doctor", help="print the versions found (python, torch, vllm, transformers, prefect, speculators, CPU "
                   "flags), whether each is supported, and what will not work with them", epilog=_docs("vllm-versions.md"))
    return parser


def _train_node(args: argparse.Namespace) -> int:
    from eagle3.train.launch import join_training
    from eagle3.train.config import TrainError

    try:
        join_training(args.spec, args.node_rank)
    except TrainError as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return 130
    return 0


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


# what _quiet_console sets in this process's environment (tests put it back after a test that ran main in-process)
QUIET_CONSOLE_ENV = ("PREFECT_LOGGING_EXTRA_LOGGERS", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",
                     "PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL")


def _quiet_console(verbose: bool) -> None:
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eagle3")  # the library's logging in the run log
    console.set_engine_echo(verbose)  # engines' lines: engine.log and the run log; the console only if asked
    if not verbose:
        # Prefect logs still reach the server/UI; the console shows our stage lines only.
        for name in QUIET_CONSOLE_ENV[1:]:
            os.environ.setdefault(name, "CRITICAL")


def _print_outcome(state, run_dir: str, verbose: bool) -> int:  # noqa: ANN001 - a prefect State
    from eagle3.ops.summary import read_summary

    summary_path = Path(run_dir) / "summary.json"
    if summary_path.is_file():
        summary = read_summary(summary_path)
        print()
        print(summary.to_markdown())
        print(f"\nsummary: {summary_path}", flush=True)  # before an error line on stderr
    if state.is_failed():
        return _fail_run(state.result(raise_on_failure=False), run_dir, verbose)
    return 0


def _fail_run(error: object, run_dir: str, verbose: bool) -> int:
    """The one `error:` line of a failed run, with the log that holds the details (the traceback
    goes there; a failed stage's is already there, see flows.runner)."""
    from flows.runner import StageFailed, log_traceback
    from tasks.output import ENGINE_LOG

    log = Path(run_dir) / "logs" / ENGINE_LOG
    if isinstance(error, BaseException):
        if not isinstance(error, StageFailed):
            log_traceback(log, "flow", error)
        if verbose:
            traceback.print_exception(error)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return _fail(f"{first} (details: {log})" if log.is_file() else first)


def _prefect_api(run_dir: str) -> None:
    """No Prefect server configured: start a temporary one of our own (flows.local_server says why
    not Prefect's ephemeral one). Must run before anything imports prefect."""
    from flows.local_server import configured_api_url, start_temporary_server

    if configured_api_url():
        return
    log = Path(run_dir) / "logs" / "prefect-server.log"
    url = start_temporary_server(log)
    print(f"eagle3: no Prefect server configured; a temporary one for this run at {url} (log {log})", flush=True)


def _interrupted(run_dir: str) -> int:
    print(f"interrupted: the stages that finished are kept; run the same command again to resume ({run_dir})",
          file=sys.stderr, flush=True)
    return 130


def _server_configured() -> bool:
    from flows.local_server import configured_api_url

    return bool(configured_api_url())


def _storage_problem(url: str | None, local: Path) -> str | None:
    """A URL artifact root that cannot be written, found before a server starts or a target loads."""
    from eagle3.storage import StorageError, open_root

    try:
        open_root(url, local)
    except StorageError as err:
        return str(err)
    return None


def _on_workers_problem(artifact_root: str | None) -> str | None:
    """Why `eagle3 sweep --on-workers` could not work here, found before any work: the workers must reach the
    artifacts, and a temporary server has no workers."""
    from eagle3.config import shared_root_problem

    if (problem := shared_root_problem(artifact_root, "--on-workers runs the points", "leave out --on-workers")):
        return problem
    if not _server_configured():
        return ("--on-workers runs the points as flow runs on your workers' Prefect server, but no server is configured "
                "(a temporary one has no workers): set PREFECT_API_URL to it, or leave out --on-workers")
    return None


def _run(args: argparse.Namespace) -> int:
    _quiet_console(args.verbose)
    from eagle3.config import ConfigError, build_config

    preset = "demo" if args.command == "demo" else args.preset
    try:
        config = build_config(preset, getattr(args, "config", None), args.overrides, args.run_dir)
    except ConfigError as err:
        return _fail(str(err), 2)
    if (problem := _storage_problem(config.artifact_url, config.artifacts)) is not None:
        return _fail(problem, 2)
    if config.extract.parts > 1 and not _server_configured():
        return _fail(f"extract.parts={config.extract.parts} runs the parts as flow runs on your workers' Prefect server, "
                     "but no server is configured (a temporary one has no workers): set PREFECT_API_URL to it, or "
                     "extract.parts=1", 2)
    try:
        _prefect_api(config.run_dir)
        from flows.train_eagle3 import train_eagle3
        from tasks.gpu_slot import ensure_gpu_limit

        ensure_gpu_limit()  # the setup of `eagle3 deploy`, for a server (or a temporary one) that never had it
        print(f"eagle3: run dir {config.run_dir}; target {config.target.model}", flush=True)
        state = train_eagle3(config, return_state=True)
    except KeyboardInterrupt:
        return _interrupted(config.run_dir)
    except ServerStartError as err:
        return _fail(str(err))
    return _print_outcome(state, config.run_dir, args.verbose)


def _sweep(args: argparse.Namespace) -> int:
    _quiet_console(args.verbose)
    from eagle3.config import ConfigError, build_config
    from eagle3.ops.sweep import SWEEP_MD, default_run_dir, expand_points, parse_grid

    try:
        base = build_config(args.preset, args.config, args.overrides, args.run_dir)
        if args.run_dir is None:
            base = base.model_copy(update={"run_dir": default_run_dir(base.run_dir)})
        grid = parse_grid(args.grid)
        points = expand_points(base, grid)  # every point validated before any work
    except ConfigError as err:
        return _fail(str(err), 2)
    if (problem := _storage_problem(base.artifact_url, base.artifacts)) is not None:
        return _fail(problem, 2)
    if args.on_workers and (problem := _on_workers_problem(base.artifact_root)) is not None:
        return _fail(problem, 2)
    try:
        _prefect_api(base.run_dir)
        from flows.sweep import sweep_eagle3
        from tasks.gpu_slot import ensure_gpu_limit

        ensure_gpu_limit()
        print(f"eagle3 sweep: run dir {base.run_dir}; target {base.target.model}; {len(points)} points over one "
              "extraction", flush=True)
        state = sweep_eagle3(base, grid, on_workers=args.on_workers, return_state=True)
    except KeyboardInterrupt:
        return _interrupted(base.run_dir)
    except ServerStartError as err:
        return _fail(str(err))
    report = Path(base.run_dir) / SWEEP_MD
    if report.is_file():
        print("\n" + report.read_text().rstrip() + f"\n\nsweep report: {report}")
    return _print_outcome(state, base.run_dir, args.verbose)


def _nightly(args: argparse.Namespace) -> int:
    _quiet_console(args.verbose)
    from eagle3.config import ConfigError
    from eagle3.ops.nightly import build_nightly_config

    overrides = list(args.overrides)
    overrides += [f"incoming={args.incoming}"] if args.incoming else []
    overrides += [f"publish.registry={args.registry}"] if args.registry else []
    try:
        config = build_nightly_config(args.preset, args.config, overrides, args.run_dir)
    except ConfigError as err:
        return _fail(str(err), 2)
    if (problem := _storage_problem(config.pipeline.artifact_url, config.pipeline.artifacts)) is not None:
        return _fail(problem, 2)
    try:
        _prefect_api(config.pipeline.run_dir)
        from flows.nightly import nightly_eagle3
        from tasks.gpu_slot import ensure_gpu_limit

        ensure_gpu_limit()
        print(f"eagle3 nightly: run dir {config.pipeline.run_dir}; incoming {config.incoming}; registry "
              f"{config.publish.registry}", flush=True)
        state = nightly_eagle3(config, return_state=True)
    except KeyboardInterrupt:
        return _interrupted(config.pipeline.run_dir)
    except ServerStartError as err:
        return _fail(str(err))
    gate = Path(config.pipeline.run_dir) / "nightly.json"
    code = _print_outcome(state, config.pipeline.run_dir, args.verbose)
    if gate.is_file() and isinstance(json.loads(gate.read_text()).get("gate"), dict):
        decision = json.loads(gate.read_text())["gate"]
        print(f"gate: {'promoted' if decision['promoted'] else 'not promoted'}: {decision['reason']}")
    return code


def _deploy(args: argparse.Namespace) -> int:
    from flows.deploy import DeployError, DeploySettings, deploy, serve

    settings = DeploySettings(timezone=args.timezone, cron=args.cron, incoming=args.incoming, registry=args.registry,
                              machines=args.machines)
    try:
        if args.command == "serve":
            return serve(settings, port=args.port, api_url=args.api_url, log_dir=args.log_dir)
        from prefect.settings import PREFECT_API_URL

        if not (args.api_url or PREFECT_API_URL.value()):
            return _fail("eagle3 deploy needs a Prefect server: set PREFECT_API_URL or --api-url (or run `eagle3 serve`)", 2)
        deploy(settings, args.api_url)
    except DeployError as err:
        return _fail(str(err))
    print(f"eagle3 deploy: work pool 'gpu' ({args.machines} run(s) at a time), concurrency limit 'gpu', deployments "
          f"train-eagle3, nightly-eagle3 and extract-part (cron {args.cron!r}, {args.timezone}). Start a worker: "
          "prefect worker start --pool gpu")
    return 0


def _gpu_cleanup(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from eagle3.config import format_validation_error
    from eagle3.gpu.cleanup import GpuCleanupConfig, GpuCleanupError, cleanup_gpus, format_report_table

    try:
        config = GpuCleanupConfig(mode=args.mode, allow_all=args.allow_all, dry_run=args.dry_run,
                                  stop_warm_engines=args.stop_warm_engines)
    except ValidationError as err:
        return _fail(format_validation_error(err), 2)
    try:
        from eagle3.data.builtin_targets import default_cache_dir
        from eagle3.engine.registry import in_use_pids

        report = cleanup_gpus(config, Path(args.run_dir), warm=in_use_pids(default_cache_dir()))
    except GpuCleanupError as err:
        return _fail(str(err))
    print(json.dumps(report.to_dict(), indent=1) if args.json else format_report_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["online-capture"]:  # the capture worker's own arguments (eagle3.online.capture_worker)
        from eagle3.online.capture_worker import main as capture_main

        return capture_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except Exception as err:  # noqa: BLE001 - the user sees one line; --verbose (and the log) the traceback
        if getattr(args, "verbose", False):
            traceback.print_exc()
        hint = "" if getattr(args, "verbose", False) else " (--verbose shows the traceback)"
        message = str(err).splitlines()[0] if str(err) else ""
        return _fail(f"{type(err).__name__}: {message}{hint}")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("run", "demo"):
        return _run(args)
    if args.command == "nightly":
        return _nightly(args)
    if args.command == "sweep":
        return _sweep(args)
    if args.command in ("deploy", "serve"):
        return _deploy(args)
    if args.command == "train-node":
        return _train_node(args)

    if args.command == "engine":
        return engine_cli.run(args, _fail)
    if args.command == "doctor":
        from eagle3.ops import doctor

        return doctor.main()
    return _gpu_cleanup(args)


def console_main() -> NoReturn:
    """The `eagle3` command (pyproject's script, and `python -m flows.cli`): main, then a quick exit
    (eagle3.process_exit: Python's shutdown spent ~2.7 s collecting a run's heap)."""
    from eagle3.process_exit import exit_after

    exit_after(main)


if __name__ == "__main__":
    console_main()
