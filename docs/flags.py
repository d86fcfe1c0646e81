"""Write the flag synopses and the flag reference of the docs from the commands' own parsers.

    python docs/flags.py          # rewrite docs/flags.md and every synopsis block
    python docs/flags.py --check  # exit 1 naming the files that are out of date (tests/test_docs.py)

Run it after adding or changing a flag. It writes
- docs/flags.md whole: for every command of `pipeline.cli.build_parser()` and for launch/run.py,
  its synopsis and a table of its flags (default, help text);
- in README.md and docs/*.md, the synopsis between `<!-- synopsis: NAME -->` and
  `<!-- /synopsis -->`, where NAME is a command (`generate`) or `launch/run.py`.

A synopsis lists what the parser takes, in its order: `--flag VALUE` (the flag's metavar, else its
choices as `a|b`, else its name), `[...]` when optional, `[...]...` when repeatable, and for
commands that run under MPI the `mpiexec -n N` in front. It is our own rendering, not argparse's
usage text, which changes from one Python version to the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

REFERENCE = REPO / "docs" / "flags.md"
LAUNCHER = "launch/run.py"
WIDTH = 100
BLOCK = re.compile(r"(<!-- synopsis: (?P<name>[^ ]+) -->\n)(?P<body>.*?)(<!-- /synopsis -->)", re.S)


def pipeline_parsers() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """Each command of `python -m pipeline` -> (how it is started, its parser), in --help's order."""
    from pipeline import cli

    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    local = set(getattr(cli, "LOCAL", ()))
    return {name: (("" if name in local else "mpiexec -n N ") + f"python -m pipeline {name}", sub)
            for name, sub in subparsers.choices.items()}


def launcher_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("launch_run", REPO / LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def all_parsers() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    return {**pipeline_parsers(), LAUNCHER: (LAUNCHER, launcher_parser())}


def value_name(action: argparse.Action) -> str:
    if action.metavar:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices:
        return "|".join(map(str, action.choices))
    return action.dest.upper()


def words(parser: argparse.ArgumentParser) -> list[str]:
    """The synopsis's words, one per argument, e.g. `--prompt TEXT`, `[--stop STR]...`."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:  # a positional argument
            out.append(f"{value_name(action)} ..." if action.nargs == argparse.REMAINDER else value_name(action))
            continue
        word = "|".join(action.option_strings)
        if action.nargs != 0:
            word += f" {value_name(action)}"
        if not action.required:
            word = f"[{word}]"
        if isinstance(action, argparse._AppendAction):
            word += "..."
        out.append(word)
    return out


def synopsis(start: str, parser: argparse.ArgumentParser) -> str:
    """The synopsis wrapped at WIDTH columns, later lines indented by four spaces."""
    lines, line = [], start
    for word in words(parser):
        if len(line) + 1 + len(word) > WIDTH and line.strip():
            lines.append(line)
            line = "   "
        line += " " + word
    return "\n".join(lines + [line]) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{value_name(action)}`"
        if action.option_strings and action.nargs != 0:
            name += f" `{value_name(action)}`"
        default = action.default
        if action.required:
            shown = "required"
        elif default is None or default is False or default == [] or default == argparse.SUPPRESS or action.nargs == 0:
            shown = ""
        else:
            shown = f"`{default:g}`" if isinstance(default, float) else f"`{default}`"
        what = action.help % {**vars(action), "prog": parser.prog} if action.help else ""  # as argparse expands it
        if isinstance(action, argparse._AppendAction) and "repeat" not in what:
            what += " (repeatable)"
        rows.append(f"| {name} | {shown} | {_cell(what)} |")
    return rows


def reference() -> str:
    """docs/flags.md."""
    parts = ["# Flags of every command",
             "",
             "Generated by `python docs/flags.py` from the commands' parsers: do not edit by hand; change",
             "a flag's help in its parser and rerun it (`tests/test_docs.py` fails while this file is stale).",
             "Installed with pip, `pipeline` is the same program as `python -m pipeline` (e.g.",
             "`pipeline plan --help`).",
             ""]
    for name, (start, parser) in all_parsers().items():
        about = parser.description or ""
        parts += [f"## {name}", "", "```sh", synopsis(start, parser).rstrip("\n"), "```", ""]
        if about:
            parts += [_cell(about), ""]
        parts += flag_rows(parser) + [""]
    return "\n".join(parts)


def with_synopses(text: str, parsers: dict, source: Path) -> str:
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in parsers:
            raise SystemExit(f"{source}: <!-- synopsis: {name} --> names no command (known: {', '.join(parsers)})")
        start, parser = parsers[name]
        return f"{match[1]}```sh\n{synopsis(start, parser)}```\n{match[4]}"

    return BLOCK.sub(fill, text)


def rendered() -> dict[Path, str]:
    """Every generated file's text as it should be now."""
    parsers = all_parsers()
    out = {REFERENCE: reference()}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if path == REFERENCE:
            continue
        text = path.read_text()
        new = with_synopses(text, parsers, path)
        if new != text or BLOCK.search(text):
            out[path] = new
    return out


def stale() -> list[Path]:
    return [path for path, text in rendered().items() if not path.is_file() or path.read_text() != text]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which files are out of date (exit 1)")
    args = parser.parse_args()
    if args.check:
        old = stale()
        for path in old:
            print(f"out of date: {path.relative_to(REPO)} (run: python docs/flags.py)")
        return 1 if old else 0
    for path, text in rendered().items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
