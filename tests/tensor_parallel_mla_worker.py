"""tests/tensor_parallel_worker.py with one planted bug in the MLA split (tests/test_tensor_parallel_mla.py):

    PLANT=kv_b|o_proj|expert|indexer mpiexec -n T python tests/tensor_parallel_mla_worker.py FOLDER OUT.npy ID,ID,...

kv_b: each member's kv_b_proj rows one head off (the next head's, the last member's the previous one's);
o_proj: its o_proj input columns one head off likewise; expert: member 1's slice of every routed
expert's intermediate features 16 features early (as long as the right one, so it loads); indexer
(V3.2): each member's indexer scores with its own share of the indexer's heads only (the others'
weights zero), as if the indexer were split by heads and never summed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pipeline  # noqa: F401 -- first, as a real run (BLAS binding)

import mlx.core as mx

from pipeline.models import tensor_parallel_mla as mla

sys.path.insert(0, str(Path(__file__).parent))
from tensor_parallel_worker import main  # noqa: E402

right = mla.cut


def planted(module, part, array, config, shard, tools):
    plant = os.environ["PLANT"]
    cut_rows, cut_columns, mlp_share = tools.cut_rows, tools.cut_columns, tools.mlp_share
    d = dict(nope=int(config.raw["qk_nope_head_dim"]), v=int(config.raw["v_head_dim"]))
    n = config.num_attention_heads
    h0, h1 = mla.heads_of(config, shard, tools)
    step = 1 if h1 < n else -1  # one head off, within the heads
    if plant == "kv_b" and module == "self_attn.kv_b_proj":
        per = d["nope"] + d["v"]
        return [(module, cut_rows(array, part, ((h0 + step) * per, (h1 + step) * per)))]
    if plant == "o_proj" and module == "self_attn.o_proj" and part != "bias":
        return [(module, cut_columns(module, array, part, ((h0 + step) * d["v"], (h1 + step) * d["v"]), n * d["v"]))]
    if plant == "expert" and shard.member == 1 and module.startswith("mlp.switch_mlp."):
        moe = int(config.raw["moe_intermediate_size"])
        e0, e1 = mlp_share(moe, shard)
        wrong = (e0 - 16, e1 - 16)
        if module.endswith("down_proj"):
            return [(module, cut_columns(module, array, part, wrong, moe))]
        return [(module, cut_rows(array, part, wrong))]
    if plant == "indexer" and module == "self_attn.indexer.weights_proj":  # the indexer's heads split, never summed
        heads = int(config.raw["index_n_heads"])
        h0, h1 = tools.even_split(heads, shard.size, shard.member)
        keep = mx.zeros((heads, 1)).at[h0:h1].add(1.0)
        return [(module, array * keep.astype(array.dtype))]
    return right(module, part, array, config, shard, tools)


if __name__ == "__main__":
    mla.cut = planted
    main()
