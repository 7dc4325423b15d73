"""Extract the shell blocks of README.md and docs/*.md, and the doc-test directives that go with them.

Conventions (for everyone writing docs):

* A fenced block marked ``sh`` is commands, and the doc test runs it (tests/docs/test_doc_commands.py).
  Output, transcripts (``$ command`` then its output), file listings and examples that are not
  commands are marked ``text`` (or ``json``, ``toml``, ``python``, ...): shown, not run.
* Every ``sh`` block of a page runs in order in one temporary directory with ``bash -euo pipefail``,
  ``.venv/bin`` first on PATH (so ``mrtr-keys`` and ``python`` are the project's), a fresh key ring
  at ``.mrtr/keyring.json`` (unless the page says ``no-ring``), and no ``MRTR_KEYS_*`` variables.
  A command ending in ``&`` keeps running until the page is done (then its process group is stopped).
* Directives are HTML comments, invisible on GitHub: ``<!-- doc-test: KEY=VALUE KEY ... -->``.
  Page-wide (anywhere on the page): ``services=openbao,moto,postgres`` (their variables are set:
  ``BAO_ADDR``/``BAO_TOKEN``/``VAULT_*``, ``AWS_*`` with ``KMS_KEY_ARN`` of a fresh key, ``PG_URL``),
  ``ports=8750,8000`` (each number is replaced by a free port in every block of the page), ``no-ring``,
  ``page-run-by=PATH`` (another test runs this page's blocks as written; PATH must name the page).
  For the next block only (the comment right above its fence): ``fresh`` (run it in an empty directory
  of its own, no ring: for ``mrtr-keys init`` examples), ``exit=N`` (the block must end with
  exit code N, e.g. 75 for "not yet"), ``run-by=PATH[,PATH]`` (a block other tests run as written,
  e.g. ``make test`` by .ci/run: the files must exist and name the page or hold the block's commands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
DIRECTIVE = re.compile(r"<!--\s*doc-test:\s*(?P<body>.*?)\s*-->")
RUN_LANGS = frozenset({"sh", "shell", "bash", "console-run"})


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    directives: dict[str, str]

    @property
    def runnable(self) -> list[Block]:
        return [b for b in self.blocks if b.lang in RUN_LANGS]


def parse_directives(body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in body.split():
        key, _, value = word.partition("=")
        out[key] = value
    return out


def parse_page(path: Path) -> Page:
    """Every fenced block of a Markdown page, with the directives that apply to it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    page_directives: dict[str, str] = {}
    pending: dict[str, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        d = DIRECTIVE.search(line)
        if d is not None:
            found = parse_directives(d.group("body"))
            page_directives.update({k: v for k, v in found.items() if k not in ("exit", "run-by", "fresh")})
            pending = found
            i += 1
            continue
        m = FENCE.match(line)
        if m is None:
            if line.strip():
                pending = None
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        lang = info.split()[0].lower() if info else ""
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", pending or {}))
        pending = None
        i = j + 1
    return Page(path, blocks, page_directives)


def pages() -> list[Page]:
    """README.md and every docs/*.md page (sorted), parsed."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [parse_page(p) for p in paths if p.exists()]
