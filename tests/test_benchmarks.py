"""Every benchmark script still runs after the package's modules move: a script with a command line
prints its --help (importing everything it imports at the top), a helper module imports. They are
not run: benchmarks print figures, tests assert correctness."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def has_command_line(path: Path) -> bool:
    """A script run as __main__ that parses arguments (argparse, directly or through common.arguments)."""
    text = path.read_text()
    return "__main__" in text and "parse_args" in text


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_imports_and_prints_help(script):
    if has_command_line(script):
        out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                             cwd=BENCHMARKS, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "usage:" in out.stdout
        return
    # A helper module or a worker started by another script: import it without running its main.
    code = ("import importlib.util, sys\n"
            f"sys.path.insert(0, {str(BENCHMARKS)!r})\n"
            f"spec = importlib.util.spec_from_file_location('benchmark_under_test', {str(script)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=BENCHMARKS, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_script_is_parsed():
    """The list above is every script, and each is valid Python."""
    assert len(SCRIPTS) > 20
    for script in SCRIPTS:
        ast.parse(script.read_text(), str(script))


def pipeline_names_used() -> list[tuple[str, str, str | None]]:
    """(script, module, name or None) for every `from pipeline... import name` (at any depth: most
    are inside functions) and every string naming a pipeline module (e.g. where a bug is planted)."""
    found = []
    for script in SCRIPTS:
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipeline":
                found += [(script.name, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(script.name, a.name, None) for a in node.names if a.name.split(".")[0] == "pipeline"]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if "import" in node.value and "pipeline" in node.value:  # code run in a subprocess
                    try:
                        code = ast.parse(node.value)
                    except SyntaxError:
                        code = None
                    for inner in ast.walk(code) if code else ():
                        if isinstance(inner, ast.ImportFrom) and (inner.module or "").split(".")[0] == "pipeline":
                            found += [(script.name, inner.module, a.name) for a in inner.names]
                for word in node.value.replace(",", " ").replace(";", " ").split():
                    if word.startswith("pipeline.") and all(part.isidentifier() for part in word.split(".")):
                        found.append((script.name, word, None))
    return found


def test_what_the_benchmarks_import_from_pipeline_exists():
    """Their imports of pipeline sit inside functions, so --help does not reach them: resolve each."""
    used = pipeline_names_used()
    assert len(used) > 30
    code = ("import importlib, sys\n"
            f"used = {used!r}\n"
            "missing = []\n"
            "for script, module, name in used:\n"
            "    try:\n"
            "        m = importlib.import_module(module)\n"
            "    except ImportError as e:\n"
            "        missing.append(f'{script}: {module} ({e})')\n"
            "        continue\n"
            "    if name is not None and not hasattr(m, name):\n"
            "        try:\n"
            "            importlib.import_module(f'{module}.{name}')\n"
            "        except ImportError:\n"
            "            missing.append(f'{script}: {module}.{name}')\n"
            "print('\\n'.join(missing))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""
