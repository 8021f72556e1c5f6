"""The docs a user finds their way in (issue 24): the README as a front page, docs/ as an mkdocs site,
generated pages that cannot drift from the code, and a troubleshooting page that names every kind of
`error:` line the CLI prints for a bad setting or file.

- `mkdocs build --strict` passes: no broken link between pages, no page left out of the nav, every link
  from a page to a repository file (a test, a benchmark) names a file that exists (docs/hooks.py).
- docs/settings.md is what `python -m eagle3.ops.settings_reference` prints: a setting added to a config
  model without regenerating the page fails here. Its "changing it recomputes" column is computed from
  the stages' own fingerprint functions; a few rows a user relies on are asserted by name.
- README.md stays a front page (at most 200 lines) and each of its links resolves to a file.
- The troubleshooting page: each bad setting or file below is given to the real CLI (one process, the
  README's first way: no Prefect server configured), which must print one `error:` line holding the
  kind's fixed phrase, and the page must quote that phrase. The checks that need a target are called
  as the stages call them.
- Each `eagle3` command's --help ends with the docs page that explains it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_the_site_builds_strictly(tmp_path: Path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "settings" / "index.html").is_file()
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def test_the_settings_reference_is_what_the_code_generates():
    from eagle3.ops.settings_reference import markdown

    assert (DOCS / "settings.md").read_text() == markdown(), (
        "docs/settings.md is stale: run `make settings-reference` "
        "(python -m eagle3.ops.settings_reference > docs/settings.md)")


def _recompute_column(setting: str) -> str:
    row = next(line for line in (DOCS / "settings.md").read_text().splitlines() if line.startswith(f"| `{setting}` |"))
    return row.rstrip(" |").rsplit(" | ", 1)[-1]


@pytest.mark.parametrize(("setting", "recomputes"), [
    ("train.steps", "`train` on"),
    ("train.compile", "nothing"),  # RUNTIME_ONLY: how fast, not what
    ("train.num_processes", "nothing"),
    ("train.devices", "nothing"),  # placement: where, not what
    ("target.devices", "nothing"),
    ("target.kv_cache_gib", "nothing"),
    ("target.dtype", "`stage_target` on"),
    ("data.max_tokens", "`prepare_data` on"),
    ("extract.parts", "nothing"),  # the fan-out: the same store either way
    ("vocab.draft_vocab_size", "`vocab` on"),
    ("eval.served", "`evaluate` on"),
    ("gpu.mode", "nothing"),  # gpu_cleanup is never cached
])
def test_the_reference_says_what_a_change_recomputes(setting: str, recomputes: str):
    assert _recompute_column(setting) == recomputes


def test_every_setting_of_every_section_is_in_the_reference():
    from eagle3.config import PipelineConfig
    from eagle3.ops.settings_reference import leaf_fields

    page = (DOCS / "settings.md").read_text()
    missing = [path for path, _ in leaf_fields(PipelineConfig) if f"| `{path}` |" not in page]
    assert not missing, f"docs/settings.md lacks {missing}: run `make settings-reference`"


# -- the README ------------------------------------------------------------------------------------------------
def _links(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # no links inside code blocks
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z][a-z0-9+.-]*:", m)]


def test_the_readme_is_a_front_page_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make test" in readme and "make demo" in readme  # CI runs the README's test command
    links = _links(readme)
    assert any(link.startswith("docs/") for link in links)
    broken = [link for link in links if not (REPO / link.split("#")[0]).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


# -- troubleshooting -------------------------------------------------------------------------------------------
# (kind, arguments of `eagle3`, the phrase the error line holds and the page must quote). {tmp} is a folder of files.
CLI_ERRORS = [
    ("unknown setting", ["run", "--preset", "tiny", "--set", "train.stepz=5"], "unknown setting"),
    ("wrong type", ["run", "--preset", "tiny", "--set", "train.steps=many"], "Input should be"),
    ("impossible combination", ["run", "--preset", "tiny", "--set", "data.max_tokens=400"],
     "must be below target.max_model_len"),
    ("--set without a value", ["run", "--preset", "tiny", "--set", "train.steps"], "expected key=value"),
    ("--set value not YAML", ["run", "--preset", "tiny", "--set", "train.steps={a: [1"], "the value is not valid YAML"),
    ("--config missing", ["run", "--config", "{tmp}/missing.yaml"], "no such file"),
    ("--config not YAML", ["run", "--config", "{tmp}/bad.yaml"], "not valid YAML"),
    ("--config not a mapping", ["run", "--config", "{tmp}/list.yaml"], "expected a mapping of settings"),
    ("--grid bad value", ["sweep", "--preset", "tiny", "--grid", "train.learning_rate=1e-3,fast"], "--grid"),
    ("--grid outside train/vocab/eval", ["sweep", "--preset", "tiny", "--grid", "target.dtype=float32,bfloat16"],
     "cannot vary within one sweep"),
    ("artifact root unreachable", ["run", "--preset", "tiny", "--set", "artifact_root=ftp://127.0.0.1:1/x"],
     "the artifact root cannot be written"),
    ("parts without a shared root", ["run", "--preset", "tiny", "--set", "extract.parts=2"], "artifact_root is not set"),
    ("parts with a relative root", ["run", "--preset", "tiny", "--set", "extract.parts=2", "--set", "artifact_root=rel"],
     "is a relative path"),
    ("parts without a server", ["run", "--preset", "tiny", "--set", "extract.parts=2", "--set", "artifact_root={tmp}/a"],
     "no server is configured"),
    ("deploy without a server", ["deploy"], "eagle3 deploy needs a Prefect server"),
    ("gpu-cleanup --mode all", ["gpu-cleanup", "--mode", "all"], "needs allow_all=True to confirm"),
]

_PROVOKE = """
import contextlib, io, json, sys
from flows.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append({"code": code, "lines": [l for l in err.getvalue().splitlines() if l.startswith("error:")]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every CLI_ERRORS row's exit code and `error:` lines, from one `eagle3` process per row set."""
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "bad.yaml").write_text("train: {steps: 5\ndata: x: y\n")
    (tmp / "list.yaml").write_text("- train\n- steps\n")
    argvs = [[a.replace("{tmp}", str(tmp)) for a in argv] for _, argv, _ in CLI_ERRORS]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp / "prefect-home")  # no profile: no Prefect server configured
    out = subprocess.run([sys.executable, "-c", _PROVOKE, json.dumps(argvs)], cwd=tmp, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("index", range(len(CLI_ERRORS)), ids=[kind for kind, _, _ in CLI_ERRORS])
def test_troubleshooting_names_each_error_the_cli_prints_for_bad_input(cli_errors: list[dict], index: int):
    kind, argv, phrase = CLI_ERRORS[index]
    result = cli_errors[index]
    assert result["code"] == 2 and len(result["lines"]) == 1, (argv, result)
    assert phrase in result["lines"][0], (kind, result["lines"][0])
    assert phrase in (DOCS / "troubleshooting.md").read_text(), f"docs/troubleshooting.md does not name {kind!r}: {phrase!r}"


def _target_errors(tmp: Path) -> list[tuple[str, str, str]]:
    """(kind, the message a stage fails with, its phrase): the checks that need a target, called as the stages
    call them (the CLI prints them as `error: <stage>: <message>`)."""
    from eagle3.config import ConfigError, build_config, check_against_target
    from eagle3.data.conversations import DataError, source_files
    from eagle3.data.target import TargetConfig, TargetConfigError, TargetInfo, read_target_info, resolve_model_dir

    folder = tmp / "llama"  # a target folder whose config.json the parallel checks read
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    out = []
    for kind, call, phrase in [
        ("target folder missing", lambda: resolve_model_dir(TargetConfig(model=str(tmp / "nope")), tmp), "no such folder"),
        ("target without config.json", lambda: read_target_info(TargetConfig(model=str(tmp)), tmp), "no config.json"),
        ("data file missing", lambda: source_files(str(tmp / "chats.jsonl")), "no such file"),
        ("settings that need the target", lambda: check_against_target(
            build_config("tiny", overrides=["vocab.draft_vocab_size=5000"]),
            TargetInfo(str(folder), "LlamaForCausalLM", None, 4, 64, 1000, [2, 3], "x")),
         "is larger than the target's vocabulary"),
        ("aux layer ids out of range", lambda: check_against_target(
            build_config("tiny"), TargetInfo(str(folder), "LlamaForCausalLM", None, 4, 64, 1000, [2, 9], "x")),
         "are out of range for a target with"),
    ]:
        with pytest.raises((ConfigError, DataError, TargetConfigError)) as err:
            call()
        out.append((kind, str(err.value), phrase))
    return out


def test_troubleshooting_names_the_errors_of_a_bad_target_or_data_file(tmp_path: Path):
    page = (DOCS / "troubleshooting.md").read_text()
    for kind, message, phrase in _target_errors(tmp_path):
        assert phrase in message, (kind, message)
        assert phrase in page, f"docs/troubleshooting.md does not name {kind!r}: {phrase!r}"


# -- the CLI's help --------------------------------------------------------------------------------------------
def _commands() -> dict[str, object]:
    """'eagle3' and each of its subcommands -> its argparse parser."""
    from flows.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {"eagle3": parser, **{f"eagle3 {name}": p for name, p in sub.choices.items()}}


@pytest.mark.parametrize("command", sorted(_commands()))
def test_each_commands_help_ends_with_its_docs_page(command: str):
    last = _commands()[command].format_help().rstrip().splitlines()[-1]
    assert last.startswith("docs: docs/"), last
    pages = [page.strip() for page in last.removeprefix("docs: ").split(",")]
    assert all((REPO / page).is_file() for page in pages), pages
