"""``make deps-audit``: known vulnerabilities in the locked dependencies (issue 39, deliverable 2).

* Python: pip-audit over requirements/all.txt (uv.lock's every extra and group, exported with hashes), against
  the OSV database (``--osv-url``, default https://api.osv.dev/v1/query), without resolving or installing anything
  (``--disable-pip``: the versions are the locked ones).
* TypeScript: ``npm audit --omit=dev`` over clients/typescript/package-lock.json (what the package brings into a
  user's install), against the npm registry's advisory endpoint (``--npm-registry``, default npm's own).

A finding fails (exit 1) unless osv-scanner.toml holds a reviewed exception for its id or one of its aliases
(osv-scanner's format: ``[[IgnoredVulns]]`` with ``id``, ``ignoreUntil`` and ``reason``; here reason and
ignoreUntil are required). An exception past its ignoreUntil fails too, found or not, until someone reviews it
again. A vulnerability service that cannot be reached (refused, unresolvable, silent past ``--timeout``, too
slow to finish within ``--deadline``, or answering an error) is one line, ``not scanned``, and does not fail: CI
must not turn red because a registry is down, so a run that scanned says so with its package count.

``python tools/deps_audit.py [--requirements FILE] [--npm-dir DIR] [--ignore FILE] [--osv-url URL]
[--npm-registry URL] [--timeout SECONDS] [--deadline SECONDS] [--today YYYY-MM-DD]``: exit 0 clean (or not
scanned), 1 a finding, an expired exception or a tool's failure, 2 a bad exception file or command line (a URL
that is not http(s), a time that is not positive, a file or directory that is not there: a typo must not pass as
"not scanned").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[1]
OSV_URL = "https://api.osv.dev/v1/query"
# what pip-audit prints when OSV could not be asked or did not answer (refused, unresolvable, silent, an HTTP
# error), as opposed to a finding or a bug; and npm's error codes for the same
PY_UNREACHABLE = re.compile(r"requests\.exceptions\.\w+|ServiceError|ConnectionError|Could not connect")
NPM_UNREACHABLE = re.compile(
    r"E(CONNREFUSED|NOTFOUND|AI_AGAIN|TIMEDOUT|CONNRESET|SOCKETTIMEDOUT|HOSTUNREACH|NETUNREACH)|network timeout|"
    r"socket hang up"
)


class BadExceptions(Exception):
    """osv-scanner.toml cannot be used (one line)."""


@dataclass(frozen=True)
class Exception_:
    id: str
    until: dt.date
    reason: str


@dataclass
class Finding:
    ecosystem: str
    package: str
    version: str
    ids: list[str]
    fixed: str
    summary: str
    excepted: Exception_ | None = None

    def line(self) -> str:
        aliases = f" ({', '.join(self.ids[1:])})" if len(self.ids) > 1 else ""
        head = f"deps-audit: {self.ecosystem}: {self.package} {self.version}: {self.ids[0]}{aliases}"
        if self.excepted is not None:
            e = self.excepted
            return f"{head}: excepted until {e.until} ({e.reason})"
        return f"{head}, fixed in {self.fixed or 'no release yet'}: {_short(self.summary)}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    not_scanned: list[str] = field(default_factory=list)


def _short(text: str, limit: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_exceptions(path: Path) -> list[Exception_]:
    """The reviewed exceptions of an osv-scanner.toml; BadExceptions for a missing id, reason or date."""
    if not path.exists():
        return []
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BadExceptions(f"{path.name}: not TOML: {exc}") from None
    out = []
    for n, entry in enumerate(doc.get("IgnoredVulns", []), 1):
        where = f"{path.name}: IgnoredVulns entry {n}"
        unknown = set(entry) - {"id", "ignoreUntil", "reason"}
        if unknown:
            raise BadExceptions(f"{where}: unknown key {sorted(unknown)[0]!r} (id, ignoreUntil, reason)")
        if not isinstance(entry.get("id"), str) or not entry["id"].strip():
            raise BadExceptions(f"{where}: no id")
        if not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
            raise BadExceptions(f"{where} ({entry['id']}): no reason (say why it is safe to ship for now)")
        until = entry.get("ignoreUntil")
        if isinstance(until, dt.datetime):
            until = until.date()
        if not isinstance(until, dt.date):
            raise BadExceptions(f"{where} ({entry['id']}): ignoreUntil must be a date (ignoreUntil = 2027-01-31)")
        out.append(Exception_(entry["id"].strip(), until, " ".join(entry["reason"].split())))
    return out


def _last_line(text: str, pattern: re.Pattern[str] | None = None) -> str:
    """The last line of `text` (that matches `pattern`, if given), or "" if none."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next((_short(x, 160) for x in reversed(lines) if pattern is None or pattern.search(x)), "")


def _public(url: str) -> str:
    """`url` as it may be shown: without its user information and query (a mirror's credentials or token)."""
    parts = urlsplit(url)
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _scrub(text: str, url: str | None) -> str:
    """`text` (a tool's error) without the credentials of `url` in it."""
    parts = urlsplit(url or "")
    for secret in (parts.password, parts.username, parts.query):
        if secret:
            text = text.replace(secret, "***")
    return text


def audit_python(requirements: Path, osv_url: str, timeout: int, deadline: float, report: Report) -> bool:
    """pip-audit over `requirements` (`timeout` seconds for each answer, `deadline` for all of them); False if the
    service was not reached or not done in time (one line in the report)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "audit.json"
        argv = [sys.executable, "-m", "pip_audit", "--requirement", str(requirements), "--require-hashes"]
        argv += ["--disable-pip", "--vulnerability-service", "osv", "--osv-url", osv_url, "--timeout", str(timeout)]
        argv += ["--progress-spinner", "off", "--aliases", "on", "--format", "json", "--output", str(out)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=deadline)
        except subprocess.TimeoutExpired:
            return _not_scanned(
                report, "python", f"{_public(osv_url)} did not answer for every package within {deadline:g} s"
            )
        result = json.loads(out.read_text()) if out.exists() and out.stat().st_size else None
    if result is None:
        why = _scrub(_last_line(done.stderr, PY_UNREACHABLE), osv_url)
        if not why:
            raise RuntimeError(f"pip-audit failed (exit {done.returncode}): {_scrub(_last_line(done.stderr), osv_url)}")
        return _not_scanned(report, "python", f"{_public(osv_url)} cannot be reached ({why})")
    deps = result["dependencies"]
    for dep in deps:
        for vuln in dep.get("vulns", []):
            ids = [vuln["id"], *vuln.get("aliases", [])]
            fixed = ", ".join(vuln.get("fix_versions", []))
            report.findings.append(Finding("python", dep["name"], dep["version"], ids, fixed, vuln["description"]))
    skipped = [d["name"] for d in deps if "skip_reason" in d]
    counted = f"{len(deps) - len(skipped)} locked packages ({_shown(requirements)})"
    if skipped:
        counted += f", {len(skipped)} not audited ({', '.join(skipped[:5])})"
    report.lines.append(f"deps-audit: python: {counted} checked against {_public(osv_url)}")
    return True


def audit_npm(package_dir: Path, registry: str | None, timeout: int, deadline: float, report: Report) -> bool:
    """``npm audit --omit=dev`` in `package_dir`; False if the registry was not reached (one line)."""
    npm = shutil.which("npm")
    if npm is None:
        return _not_scanned(report, "npm", "npm is not on PATH")
    argv = [npm, "audit", "--omit=dev", "--json", f"--fetch-timeout={timeout * 1000}", "--fetch-retries=0"]
    if registry:
        argv.append(f"--registry={registry}")
    shown = _public(registry) if registry else "the npm registry"
    try:
        done = subprocess.run(argv, cwd=package_dir, capture_output=True, text=True, check=False, timeout=deadline)
    except subprocess.TimeoutExpired:
        return _not_scanned(report, "npm", f"{shown} did not answer within {deadline:g} s")
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        result = {"error": {"summary": done.stderr}}
    if "error" in result or "message" in result:
        error = result.get("error", {})
        code = str(error.get("code") or result.get("code") or "")
        text = _short(" ".join(str(x) for x in (result.get("message") or error.get("summary"), code) if x), 160)
        text = _scrub(text, registry)
        if not NPM_UNREACHABLE.search(text) and "statusCode" not in result:  # neither the network nor an HTTP error
            raise RuntimeError(
                f"npm audit failed (exit {done.returncode}): {text or _scrub(_last_line(done.stderr), registry)}"
            )
        return _not_scanned(report, "npm", f"{shown} cannot be reached ({text})")
    for name, vuln in result.get("vulnerabilities", {}).items():
        for via in vuln.get("via", []):
            if not isinstance(via, dict):  # a package vulnerable only through another one: listed under that one
                continue
            ghsa = str(via.get("url", "")).rsplit("/", 1)[-1]
            ids = [ghsa] if ghsa.startswith("GHSA-") else []
            ids.append(f"npm-advisory-{via.get('source')}")
            fixed = "" if vuln.get("fixAvailable") in (None, False) else "a newer release (npm audit fix)"
            version = _installed_version(package_dir, name)
            report.findings.append(
                Finding("npm", name, version, ids, fixed, f"{via.get('title', '')} ({via.get('range', '')})")
            )
    runtime = result.get("metadata", {}).get("dependencies", {}).get("prod", 1) - 1  # less the package itself
    report.lines.append(
        f"deps-audit: npm: {runtime} runtime packages of {_shown(package_dir / 'package-lock.json')} checked"
        f" (npm audit --omit=dev, {shown})"
    )
    return True


def _not_scanned(report: Report, ecosystem: str, why: str) -> bool:
    report.lines.append(f"deps-audit: {ecosystem}: not scanned: {why}")
    report.not_scanned.append(ecosystem)
    return False


def _shown(path: Path) -> str:
    """`path` relative to the repository when it is inside it."""
    return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)


def _installed_version(package_dir: Path, name: str) -> str:
    lock = json.loads((package_dir / "package-lock.json").read_text())
    return str(lock.get("packages", {}).get(f"node_modules/{name}", {}).get("version", "?"))


def judge(report: Report, exceptions: list[Exception_], today: dt.date) -> int:
    """Match findings to exceptions, add the verdict lines; 0 if nothing unreviewed and nothing expired."""
    by_id = {e.id: e for e in exceptions}
    used: set[str] = set()
    for finding in report.findings:
        match = next((by_id[i] for i in finding.ids if i in by_id), None)
        if match is not None and match.until >= today:
            finding.excepted = match
            used.add(match.id)
        report.lines.append(finding.line())
    expired = [e for e in exceptions if e.until < today]
    for e in expired:
        report.lines.append(
            f"deps-audit: the exception for {e.id} in osv-scanner.toml expired on {e.until} ({e.reason}):"
            " review it (fix, or a new ignoreUntil with its reason)"
        )
    open_ = [f for f in report.findings if f.excepted is None]
    if open_:
        report.lines.append(
            f"deps-audit: {len(open_)} known {'vulnerability' if len(open_) == 1 else 'vulnerabilities'} not"
            " reviewed: upgrade (make lock LOCK_ARGS='--upgrade-package NAME'), or add a reviewed exception to"
            " osv-scanner.toml (id, ignoreUntil, reason)"
        )
    elif not expired:
        excepted = len(report.findings)
        verdict = "no known vulnerability" + (f" but the {excepted} excepted above" if excepted else "")
        if report.not_scanned:
            verdict += f" in what was scanned ({' and '.join(report.not_scanned)} not scanned)"
        report.lines.append(f"deps-audit: {verdict}")
    return 1 if open_ or expired else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line and exit 2 (argparse prints its usage first)."""
        self.exit(2, f"deps-audit: {message}\n")


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _existing(kind: str) -> Callable[[str], Path]:
    def parse(text: str) -> Path:
        path = Path(text)
        if not (path.is_dir() if kind == "directory" else path.is_file()):
            raise argparse.ArgumentTypeError(f"{text} is not a {kind}")
        return path

    return parse


def main(argv: list[str]) -> int:
    parser = _Parser(prog="deps-audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requirements", type=_existing("file"), default=REPO / "requirements" / "all.txt")
    parser.add_argument("--npm-dir", type=_existing("directory"), default=REPO / "clients" / "typescript")
    parser.add_argument("--ignore", type=Path, default=REPO / "osv-scanner.toml")
    parser.add_argument("--osv-url", type=_url, default=OSV_URL)
    parser.add_argument("--npm-registry", type=_url, default=None)
    parser.add_argument(
        "--timeout", type=_positive(int), default=15, help="seconds each service has to answer a request"
    )
    parser.add_argument(
        "--deadline", type=_positive(float), default=300, help="seconds each audit (all its requests) may take"
    )
    parser.add_argument("--today", type=dt.date.fromisoformat, default=dt.datetime.now(dt.UTC).date())
    args = parser.parse_args(argv)
    if not (args.npm_dir / "package-lock.json").is_file():
        parser.error(f"argument --npm-dir: {args.npm_dir} has no package-lock.json")
    try:
        exceptions = read_exceptions(args.ignore)
    except BadExceptions as exc:
        print(f"deps-audit: {exc}", file=sys.stderr)
        return 2
    report = Report()
    try:
        audit_python(args.requirements, args.osv_url, args.timeout, args.deadline, report)
        audit_npm(args.npm_dir, args.npm_registry, args.timeout, args.deadline, report)
    except RuntimeError as exc:
        print("\n".join(report.lines), flush=True)
        print(f"deps-audit: {exc}", file=sys.stderr)
        return 1
    code = judge(report, exceptions, args.today)
    print("\n".join(report.lines))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
