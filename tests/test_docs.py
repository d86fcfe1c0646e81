"""The docs a reader follows: flag synopses generated from the parsers and current (docs/flags.py),
each synopsis agreeing with the usage `--help` prints, the console script naming itself, README
links that lead somewhere, and the README's test command being what CI runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("docs_flags", REPO / "docs" / "flags.py")
flags_doc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(flags_doc)


def test_generated_docs_are_current():
    """Someone who adds or changes a flag reruns `python docs/flags.py`; until then this fails."""
    stale = [str(path.relative_to(REPO)) for path in flags_doc.stale()]
    assert not stale, f"out of date: {stale}; run: python docs/flags.py"


def _usage_flags(usage: str) -> dict[str, bool]:
    """Each option in argparse's own usage text -> whether it is required (outside brackets)."""
    usage = " ".join(usage.split())
    flags, depth = {}, 0
    for token in re.findall(r"\[|\]|--?[A-Za-z][\w-]*", usage):
        if token in "[]":
            depth += 1 if token == "[" else -1
        elif token != "-h" and token != "--help":
            flags.setdefault(token, depth == 0)
    return flags


def _synopsis_flags(synopsis: str) -> dict[str, bool]:
    """Each option of our synopsis (the first of its names, as argparse's usage shows it) ->
    whether it is required (outside brackets)."""
    flags = {}
    for bracketed, bare in re.findall(r"\[([^\]]*)\]|(\S+)", synopsis):
        names = (bracketed or bare).split(" ")[0].split("|")
        if names[0].startswith("-"):
            flags[names[0]] = not bracketed
            if names[1:2] == ["--no-" + names[0][2:]]:  # --flag|--no-flag: argparse's usage shows both
                flags[names[1]] = not bracketed
    return flags


@pytest.mark.parametrize("name", list(flags_doc.all_parsers()))
def test_synopsis_has_the_flags_help_shows(name):
    """Against argparse's usage line (what --help prints): the same flags, in the same order,
    the same ones required."""
    start, parser = flags_doc.all_parsers()[name]
    ours = _synopsis_flags(flags_doc.synopsis(start, parser).replace(start, "", 1))
    theirs = _usage_flags(parser.format_usage().split(parser.prog, 1)[1])
    assert list(ours) == list(theirs) and ours == theirs, (ours, theirs)


def test_repeatable_flags_are_shown_repeatable():
    start, parser = flags_doc.all_parsers()["generate"]
    assert re.search(r"\[--stop \S+\]\.\.\.", flags_doc.synopsis(start, parser))


def test_a_stale_synopsis_is_found_and_rewritten(tmp_path):
    """The check can fail: a synopsis block missing a flag is rewritten with it."""
    start, parser = flags_doc.all_parsers()["generate"]
    text = f"intro\n<!-- synopsis: generate -->\n```sh\n{start} --prompt TEXT\n```\n<!-- /synopsis -->\nend\n"
    new = flags_doc.with_synopses(text, flags_doc.all_parsers(), tmp_path / "x.md")
    assert new != text and "[--max-tokens" in new and new.startswith("intro\n") and new.endswith("end\n")
    assert flags_doc.with_synopses(new, flags_doc.all_parsers(), tmp_path / "x.md") == new


@pytest.mark.parametrize("how, expected", [("console script", "usage: pipeline plan"),
                                           ("module", "usage: python -m pipeline plan")])
def test_help_names_the_program_as_it_was_started(how, expected):
    script = Path(sys.executable).parent / "pipeline"
    if how == "console script" and not script.is_file():
        pytest.skip(f"no `pipeline` console script beside {sys.executable} (pip install -e .)")
    argv = [str(script)] if how == "console script" else [sys.executable, "-m", "pipeline"]
    result = subprocess.run([*argv, "plan", "--help"], capture_output=True, text=True, timeout=60,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(expected), result.stdout[:200]


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_lead_somewhere(path):
    """Every relative link and image names a file or folder of the repository, and every
    #anchor a heading of the file it points into."""
    text = path.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)]
            if anchor not in headings:
                broken.append(target)
    assert not broken, broken


def test_readme_is_short_and_points_nowhere_private():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < 12.5 * 1024, len(text.encode())  # the project rule: under 12.5 KB
    for private in (r"\bissue \d+", r"\+dirty", r"this machine", r"#\d{2,}\b"):
        assert not re.search(private, text, re.I), private


def test_ci_runs_the_readme_test_command():
    """.ci/run finds the README's test command the way CI will: exactly one line, and it runs the
    whole suite with skips listed (-rs)."""
    result = subprocess.run(["bash", "-c", 'source <(sed -n "/^find_test_command()/,/^}/p" .ci/run); '
                                           "find_test_command"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    readme = (REPO / "README.md").read_text().splitlines()
    assert readme.count(line) == 1
    assert 'pip install -e ".[test]"' in line and line.endswith("python -m pytest -q -rs tests")
