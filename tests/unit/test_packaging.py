"""The metadata a user (or a packager) reads: the license text, who makes it, where it lives."""

from __future__ import annotations

import tomllib

from tests.helpers import REPO


def test_the_license_file_is_the_apache_2_0_text_pyproject_declares() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "9. Accepting Warranty or Additional Liability." in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_authors_and_urls() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["authors"] == [{"name": "cuctxd developers"}]
    assert set(project["urls"]) >= {"Homepage", "Repository", "Issues"}
    assert all(url.startswith("https://github.com/cuctxd/cuctxd") for url in project["urls"].values())
