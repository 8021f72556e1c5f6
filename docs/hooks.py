"""mkdocs hook: links from a page to repository files outside docs/ (a test, a benchmark, a module).

The pages are plain Markdown that must read well on a code host, where `[the test](../tests/e2e/test_cli.py)`
opens the file. The site holds only docs/, so mkdocs would count such a link as broken. This hook checks
that the file exists (a missing one is a warning, which `mkdocs build --strict` turns into a failure) and
rewrites the link: to the file on the code host when mkdocs.yml sets `repo_url`, else to the path as code.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger("eagle3-links")

# [text](target) or [text](target#anchor), not an image (![..](..)); targets with a scheme are left alone
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def _outside_docs(page_src: str, target: str, docs_dir: Path, repo_root: Path) -> PurePosixPath | None:
    """The repository-relative path of `target` when it leaves docs/, else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None
    resolved = (docs_dir / PurePosixPath(page_src).parent / target).resolve()
    try:
        resolved.relative_to(docs_dir.resolve())
        return None
    except ValueError:
        pass
    try:
        return PurePosixPath(resolved.relative_to(repo_root.resolve()).as_posix())
    except ValueError:
        return None


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - mkdocs' hook signature
    docs_dir = Path(config["docs_dir"])
    repo_root = docs_dir.parent
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match) -> str:
        path = _outside_docs(page.file.src_uri, match["target"], docs_dir, repo_root)
        if path is None:
            return match[0]
        if not (repo_root / path).exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_uri, path)
            return match[0]
        if repo_url:
            return f"[{match['text']}]({repo_url}/blob/main/{path}{match['anchor'] or ''})"
        text = match["text"].strip("`")
        return f"`{text}`" if text == str(path) else f"{match['text']} (`{path}`)"

    return _LINK.sub(rewrite, markdown)
