"""What a non-editable `pip install .` (the README's first command) ships: every file of the package
that is not Python (kernel sources, configs, templates, the chat page) must match setup.cfg's
package_data, or an installed copy cannot build its kernels or find its configs."""

from __future__ import annotations

import configparser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def package_data_globs() -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return [g.strip() for g in config["options.package_data"]["pipeline"].replace("\n", ",").split(",") if g.strip()]


def test_every_data_file_of_the_package_is_in_package_data():
    package = REPO / "pipeline"
    data = {p.relative_to(package).as_posix() for p in package.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    shipped = {p.relative_to(package).as_posix() for g in package_data_globs() for p in package.glob(g)}
    assert len(data) > 10
    assert sorted(data - shipped) == []


def test_every_package_data_glob_matches_a_file():
    package = REPO / "pipeline"
    assert [g for g in package_data_globs() if not list(package.glob(g))] == []
