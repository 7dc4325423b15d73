"""Which release reads which ring feature (`mrtr_keys.ring.compat`): the one comparison the ring changes use
before they write a ring a live instance might refuse (our own rule: the ring reader is strict)."""

from __future__ import annotations

import pytest

from mrtr_keys.ring import compat


@pytest.fixture
def feature(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(compat.READS_SINCE, "key state example", "0.2.0")
    return "key state example"


@pytest.mark.parametrize(
    ("version", "reads"),
    [("0.2.0", True), ("0.2.1", True), ("0.10.0", True), ("1.0.0rc1", True), ("0.1.0", False), ("0.1.9+local", False)],
)
def test_a_release_reads_a_feature_from_the_release_that_added_it(feature: str, version: str, reads: bool) -> None:
    assert compat.can_read(version, feature) is reads


@pytest.mark.parametrize("version", [None, "", "dev", "2", "1.2", 3])
def test_an_instance_with_no_readable_version_counts_as_too_old(feature: str, version: object) -> None:
    assert compat.can_read(version, feature) is False
