"""The config.json a `--model` names, read without its weights: a model folder's, a GGUF file's
metadata, a config.json file, or one of the real published configs bundled in planner/configs/."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoints.model_files import find
from ..models.config import ModelConfig, read_config_json
from ..util.errors import UserError

CONFIG_DIR = Path(__file__).with_name("configs")


def bundled_configs() -> dict[str, Path]:
    """The real configurations shipped in pipeline/planner/configs, by lower-case name."""
    return {p.stem.lower(): p for p in sorted(CONFIG_DIR.glob("*.json"))}


def load_config(spec: str | Path) -> ModelConfig:
    """A model folder, a GGUF file (its metadata), a config.json file, or the name of a bundled config
    (e.g. DeepSeek-V3.1)."""
    model = find(spec)
    if model is not None and model.format == "gguf":
        return model.open().model_config()
    if model is not None:
        return _with_vision_config(read_config_json(model.path))
    path = Path(spec)
    if not path.is_file():
        path = bundled_configs().get(str(spec).lower().removesuffix(".json"))
        if path is None:
            names = ", ".join(p.stem for p in bundled_configs().values())
            raise UserError(f"--model {spec}: not a model folder, a config.json file or a bundled config "
                            f"({names})")
    try:
        return _with_vision_config(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None


def _with_vision_config(raw: dict) -> ModelConfig:
    """The config, its multimodal wrapper's vision_config kept beside the language model's keys (the
    planner names the vision tower a checkpoint holds and no rank loads: Qwen3.5's)."""
    config = ModelConfig.from_dict(raw)
    if "text_config" in raw and raw.get("vision_config") and "vision_config" not in config.raw:
        config.raw["vision_config"] = raw["vision_config"]
    return config
