"""`plan` of an MLX GLM-5 folder (mlx-lm's conversion: MLA's kv_b_proj split per head into `embed_q` and
`unembed_out`, each 4-bit): the loader joins the two back into a float kv_b_proj (format_adapters.py) and
the attention keeps its absorbed halves in the activation dtype, so the planner counts kv_b_proj in
floats, not at the folder's bits. Per rank, the bytes `plan` counts equal the weights a loaded Stage
holds, in float32 and bfloat16, packed and dequantized (--weights-in-memory), and with --int8-activations'
repack; the same for a DeepSeek V3 folder whose kv_b_proj is stored MLX-quantized whole, and under
--quantize (the attention dequantizes a re-quantized kv_b_proj too)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from pipeline.checkpoints.format_adapters import Requantize
from pipeline.checkpoints.safetensors_checkpoint import Checkpoint
from pipeline.models.config import ModelConfig
from pipeline.planner.shapes import architecture
from pipeline.planner.stored_formats import checkpoint_format
from pipeline.planner.weights_bytes import Precision, model_bytes
from pipeline.runtime.stage import Stage

RANGES = ((0, 2), (2, 5))  # rank 1 begins at a shared-indexer layer


@pytest.fixture(scope="module")
def glm_mlx(tmp_path_factory):
    from safetensors.torch import load_file
    from test_new_family_formats import (BITS, GROUP, glm_mlx_name, glm_split_kv_b, linear_weight, make_glm,
                                         to_mlx, write_folder)

    root = tmp_path_factory.mktemp("plan_glm_mlx")
    make_glm(root / "source")
    hf = load_file(str(root / "source" / "model.safetensors"))
    published, _ = to_mlx(hf, glm_mlx_name, lambda n, t: linear_weight(n, t) and not n.endswith("mlp.gate.weight"),
                          lambda n: False, special=glm_split_kv_b(heads=4, nope=32))
    assert "model.layers.2.self_attn.embed_q.scales" in published
    config = json.loads((root / "source" / "config.json").read_text())
    write_folder(root / "mlx", published, root / "source", {**config, "quantization": {"group_size": GROUP, "bits": BITS}})
    return root / "mlx", root / "source"


def planned_and_held(folder, dtype: str, ranges=RANGES, dense=False, int8=False, quantize=None):
    from pipeline.checkpoints.int8_repack import use_int8

    config = ModelConfig.from_folder(folder)
    mb = model_bytes(architecture(config), Precision(checkpoint_format(config), dtype, quantize, 32, dense=dense,
                                                     int8=int8))
    out = []
    for rank, (start, end) in enumerate(ranges):
        stage = Stage.load(config, Checkpoint(folder), (start, end), has_ends=rank == 0, dtype=getattr(mx, dtype),
                           dense=dense, requantize=Requantize(quantize, 32) if quantize else None,
                           **({"int8_in_place": False} if int8 else {}))
        if int8:
            use_int8(stage.model, tied_head=bool(config.tie_word_embeddings))
        out.append((sum(mb.layers[start:end]) + (mb.ends if rank == 0 else 0), stage.weight_nbytes))
    return out


@pytest.mark.parametrize("dtype,dense,int8", [("float32", False, False), ("bfloat16", False, False),
                                              ("bfloat16", True, False), ("float32", False, True)])
def test_plan_of_an_mlx_glm_folder_counts_what_the_stages_hold(glm_mlx, dtype, dense, int8):
    folder, _ = glm_mlx
    for rank, (planned, held) in enumerate(planned_and_held(folder, dtype, dense=dense, int8=int8)):
        assert planned == held, (rank, planned, held)


def test_plan_of_a_float_glm_folder_under_quantize_counts_kv_b_in_floats(glm_mlx):
    _, source = glm_mlx
    for rank, (planned, held) in enumerate(planned_and_held(source, "float32", quantize=4)):
        assert planned == held, (rank, planned, held)
