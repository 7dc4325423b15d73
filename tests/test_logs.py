"""`--log-format json`: one JSON object a line, the same message text, no traceback text."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from mrtr_keys.logs import _Handler, configure_logging
from tests.fixtures.audit import cli


@pytest.fixture
def clean_root() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    yield
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    root.setLevel(level)


def test_json_lines_carry_level_logger_message_and_only_the_exception_type(
    clean_root: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert configure_logging("json") == "json"
    log = logging.getLogger("mrtr_keys.service")
    log.warning("key ring not reloaded, still serving generation %d", 7)
    try:
        raise ValueError("input the user sent: do-not-log")
    except ValueError:
        log.exception("request failed")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["level"] == "WARNING" and first["logger"] == "mrtr_keys.service"
    assert first["message"] == "key ring not reloaded, still serving generation 7"
    assert first["time"].endswith("Z") and isinstance(first["pid"], int)
    assert second["exc_type"] == "ValueError" and "do-not-log" not in json.dumps(second)
    configure_logging("text")  # a second call switches the format of the same handler
    log.warning("plain again")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" WARNING mrtr_keys.service: plain again")


def test_an_unknown_log_format_is_a_one_line_usage_error(keystore_path) -> None:
    r = cli("--log-format", "yaml", "keys", "list", keystore=keystore_path)
    assert r.code == 2 and r.err == "mrtr-keys: --log-format must be text or json (got 'yaml')\n"
