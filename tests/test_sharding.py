"""Tensor-parallel split: N shards with a summing all-reduce equal the whole model.

The shards run in threads of this process with an in-process all-reduce (fixed rank order), in
float64 so that any difference above rounding is a slicing bug. The process version with the
shared-memory mailbox is tested in test_engine.py.
"""

import json
import threading

import pytest
import torch

from ranks.model import Batch, HybridModel
from ranks.sharding import ShardError, check_tp, load_shard
from ranks.weights import Checkpoint, write_checkpoint
from tests.util import page_table, random_weights, rel, tiny_config
from runtime.config import spec_from_hf


class ThreadAllReduce:
    """Sum over `tp` threads in rank order; every thread gets the same tensor."""

    def __init__(self, tp: int):
        self.tp, self.parts, self.barrier = tp, [None] * tp, threading.Barrier(tp)

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = self.parts[0].clone()
            for r in range(1, self.tp):
                total += self.parts[r]
            self.barrier.wait()
            return total
        return all_reduce


def _checkpoint(tmp_path, cfg: dict, seed: int, per_expert: bool) -> tuple:
    spec = spec_from_hf(cfg)
    write_checkpoint(tmp_path, random_weights(spec, seed), prefix="model.",
                     split_experts=per_expert)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return spec, Checkpoint(tmp_path)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", ["dense", "moe-fused", "moe-per-expert", "dense-tied"])
def test_shards_with_all_reduce_equal_the_whole_model(tmp_path, variant, tp, seed):
    moe = variant.startswith("moe")
    cfg = tiny_config(moe, tie_word_embeddings=variant.endswith("tied"), num_attention_heads=8,
                      num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
    if tp == 4 and moe:
        cfg.update(shared_expert_intermediate_size=48)
    spec, ckpt = _checkpoint(tmp_path, cfg, seed, per_expert=variant == "moe-per-expert")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (150,), generator=gen)
    table = page_table(1, 4)

    whole = HybridModel(spec, load_shard(ckpt, spec, 0, 1, dtype=torch.float64))
    state = whole.new_state(1, 4)
    want = whole.forward(Batch(ids[:140], [140], [0], [0], table), state, logits="all").logits
    hidden = torch.randn(140, spec.hidden_size, generator=gen, dtype=torch.float64)
    want_mtp = whole.mtp_forward(Batch(ids[1:141], [140], [0], [0], table), hidden, state).logits

    reduce = ThreadAllReduce(tp)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            shard = HybridModel(spec, load_shard(ckpt, spec, rank, tp, dtype=torch.float64), tp=tp,
                                all_reduce=reduce.for_rank(rank))
            st = shard.new_state(1, 4)
            logits = shard.forward(Batch(ids[:140], [140], [0], [0], table), st, logits="all").logits
            mtp = shard.mtp_forward(Batch(ids[1:141], [140], [0], [0], table), hidden, st).logits
            results[rank] = (logits, mtp)
        except BaseException as e:       # surfaced below; a dead thread would hang the barrier
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    got = torch.cat([results[r][0] for r in range(tp)], dim=-1)       # vocabulary shards side by side
    got_mtp = torch.cat([results[r][1] for r in range(tp)], dim=-1)
    assert got.shape == want.shape
    assert rel(got, want) < 1e-10
    assert rel(got_mtp, want_mtp) < 1e-10


@pytest.mark.parametrize("field,value,tp", [
    ("num_key_value_heads", 2, 4),
    ("linear_num_key_heads", 2, 4),
    ("vocab_size", 250, 4),
    ("intermediate_size", 130, 4),
    ("num_attention_heads", 6, 4),
])
def test_tp_that_does_not_divide_is_refused_with_the_numbers(field, value, tp):
    base = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
    if field == "num_attention_heads":
        base["num_key_value_heads"] = 2
    spec = spec_from_hf(tiny_config(False, **{**base, field: value}))
    with pytest.raises(ShardError) as e:
        check_tp(spec, tp)
    assert f"tp {tp}" in str(e.value) and field in str(e.value) and str(value) in str(e.value)
