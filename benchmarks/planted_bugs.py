"""Do the correctness tests bite? Plant known bugs in a copy of the repository and list the tests
that fail for each (issue 15, item 11).

    python benchmarks/planted_bugs.py [--only NAME ...] [--tests FILE ...] [--keep] [--list]

The working tree's files (`git ls-files`: tracked, and untracked but not ignored, so uncommitted
work is tested as it stands) are copied once, at the start, into a snapshot, so edits made to the
tree meanwhile do not leak into the run. For each bug: copy the snapshot into a temporary folder,
apply the bug there as one textual replacement in the model code (the old text must occur exactly
once), check that Python started in the copy imports the copy's `pipeline` with the bug in it, run
the test files with pytest in the copy (cwd and PYTHONPATH point at it; conftest's `mpiexec` helper
runs jobs from it), and collect the tests that failed. A clean copy runs first: tests failing there
are not credited to any bug. The repository itself is never modified. Ends with a table, bug ->
tests that failed, or NOT CAUGHT; exit status 1 if any bug went uncaught or the clean run failed.

Not collected by pytest (no test_ prefix, outside tests/) and not part of CI: it runs the model
test files once per bug, ~30 s each on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_models.py", "tests/test_moe.py"]


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    file: str  # relative to the repository root
    old: str
    new: str
    module: str  # the module `file` is, to check the copy's version is the one imported


BUGS = [
    Bug("rope-base-x2", "RoPE base (rope_theta) doubled",
        "pipeline/models/rope.py", "        self.dims = dims\n",
        "        self.dims = dims\n        base = 2 * base\n", "pipeline.models.rope"),
    Bug("yarn-softmax-mscale-dropped", "MLA's YaRN softmax scale correction (mscale_all_dim) dropped",
        "pipeline/models/deepseek_v3.py",
        'self.scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2',
        "self.scale *= 1.0", "pipeline.models.deepseek_v3"),
    Bug("llama3-scaling-dropped", "llama3 RoPE frequency scaling dropped",
        "pipeline/models/rope.py", "inv_freq = _llama3_inv_freq(inv_freq, scaling)", "inv_freq = inv_freq",
        "pipeline.models.rope"),
    Bug("routing-bias-ignored", "DeepSeek routing ignores e_score_correction_bias",
        "pipeline/models/deepseek_v3.py", "choice = scores + self.e_score_correction_bias.astype(mx.float32)",
        "choice = scores", "pipeline.models.deepseek_v3"),
    Bug("routed-scaling-ignored", "routed_scaling_factor ignored",
        "pipeline/models/deepseek_v3.py", "return indices, weights * self.routed_scaling_factor",
        "return indices, weights", "pipeline.models.deepseek_v3"),
    Bug("wrong-groups-masked", "the best expert groups masked instead of the worst",
        "pipeline/models/deepseek_v3.py", "mx.argpartition(-group_scores, kth=self.topk_group - 1",
        "mx.argpartition(group_scores, kth=self.topk_group - 1", "pipeline.models.deepseek_v3"),
    Bug("group-score-top1", "an expert group scored by its best expert, not its top-2 sum",
        "pipeline/models/deepseek_v3.py", "group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)",
        "group_scores = grouped.max(axis=-1)", "pipeline.models.deepseek_v3"),
    Bug("mla-softmax-scale-off", "MLA softmax scale from the nope part of the head only",
        "pipeline/models/deepseek_v3.py", "self.scale = q_head_dim ** -0.5",
        "self.scale = self.qk_nope_head_dim ** -0.5", "pipeline.models.deepseek_v3"),
    Bug("last-rank-skips-a-layer", "the last rank skips its last layer",
        "pipeline/models/stage_slice.py", "for j, layer in enumerate(self.layers):",
        "for j, layer in enumerate(self.layers[:-1] if self.start and self.end == self.config.num_hidden_layers "
        "else self.layers):", "pipeline.models.stage_slice"),
    Bug("yarn-rotation-factor-dropped", "YaRN's attention factor on the rotated features dropped (Qwen-style YaRN)",
        "pipeline/models/rope.py", "return x * self.attention_factor if self.attention_factor != 1.0 else x",
        "return x", "pipeline.models.rope"),
    Bug("int4-offset-off", "compressed-tensors INT4 zero offset 7 instead of 8",
        "pipeline/checkpoints/format_adapters.py", "return packed.view(mx.uint32), scale, -8 * scale",
        "return packed.view(mx.uint32), scale, -7 * scale", "pipeline.checkpoints.format_adapters"),
]


def copy_repository(destination: Path) -> None:
    """The working tree's files that git knows or would add (not ignored ones: no caches, weights)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = REPO / rel
        if source.is_file():  # a tracked file deleted in the working tree is skipped
            target = destination / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def plant(copy: Path, bug: Bug) -> None:
    path = copy / bug.file
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(f"error: bug {bug.name}: the text to replace occurs {count} times in {bug.file} "
                         f"(expected once): update BUGS to the current code")
    path.write_text(text.replace(bug.old, bug.new))


def environment(copy: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_the_copy(copy: Path, bug: Bug | None) -> None:
    """`pipeline` (and the bug's module) as imported in the copy come from the copy, bug included."""
    module = bug.module if bug else "pipeline"
    probe = (f"import importlib, inspect, pipeline; m = importlib.import_module({module!r}); "
             f"print(pipeline.__file__); print(inspect.getsourcefile(m)); "
             f"print({bug.new if bug else ''!r} in inspect.getsource(m))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=environment(copy), capture_output=True,
                         text=True, check=True).stdout.split("\n")
    package, source, planted = out[0], out[1], out[2] == "True"
    if not (package.startswith(str(copy)) and source.startswith(str(copy)) and planted):
        raise SystemExit(f"error: in {copy}, `pipeline` comes from {package} and {module} from {source} "
                         f"(bug in it: {planted}): the copy is not what runs")


def failed_tests(copy: Path, tests: list[str]) -> tuple[list[str], float, str]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                            cwd=copy, env=environment(copy), capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, flags=re.M)
    return sorted(set(failed)), time.monotonic() - start, result.stdout[-3000:]


def run_one(snapshot: Path, bug: Bug | None, tests: list[str], keep: bool) -> tuple[list[str], float, str]:
    copy = Path(tempfile.mkdtemp(prefix=f"planted-{bug.name if bug else 'clean'}-"))
    try:
        shutil.copytree(snapshot, copy, dirs_exist_ok=True)
        if bug:
            plant(copy, bug)
        check_imports_the_copy(copy, bug)
        return failed_tests(copy, tests)
    finally:
        if keep:
            print(f"  kept {copy}", file=sys.stderr)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="plant only these bugs")
    parser.add_argument("--tests", nargs="+", default=TESTS, metavar="FILE", help=f"test files (default {TESTS})")
    parser.add_argument("--keep", action="store_true", help="keep the copies (their paths go to stderr)")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args()
    if args.list:
        for bug in BUGS:
            print(f"{bug.name:30s} {bug.what}")
        return 0
    bugs = [b for b in BUGS if not args.only or b.name in args.only]
    unknown = set(args.only or ()) - {b.name for b in BUGS}
    if unknown:
        raise SystemExit(f"error: unknown bug(s) {', '.join(sorted(unknown))}: see --list")

    with tempfile.TemporaryDirectory(prefix="planted-snapshot-") as snapshot:
        copy_repository(Path(snapshot))
        baseline, seconds, tail = run_one(Path(snapshot), None, args.tests, args.keep)
        print(f"clean copy: {len(baseline)} failed ({seconds:.0f} s)", flush=True)
        if baseline:
            print(tail + "\nerror: the clean copy fails: " + ", ".join(baseline), file=sys.stderr)
        rows, uncaught = [], []
        for bug in bugs:
            failed, seconds, _ = run_one(Path(snapshot), bug, args.tests, args.keep)
            caught = [t for t in failed if t not in baseline]
            print(f"{bug.name}: {len(caught)} failed ({seconds:.0f} s)", flush=True)
            rows.append((bug, caught))
            if not caught:
                uncaught.append(bug.name)

    print("\n| bug | planted in | tests that failed |\n|---|---|---|")
    for bug, caught in rows:
        shown = ", ".join(t.split("/")[-1] for t in caught) if caught else "**NOT CAUGHT**"
        print(f"| {bug.name}: {bug.what} | {bug.file} | {len(caught)}: {shown} |")
    return 1 if uncaught or baseline else 0


if __name__ == "__main__":
    sys.exit(main())
