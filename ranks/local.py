"""In-process generation on one device: prefill in chunks, then decode one column at a time.

This is what ``tandem generate`` runs until the multi-process runtime takes over; it is also the
simplest complete user of the layer program (state allocation, chunked prefill, sampling, stop).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Iterator

import torch

from ranks.kvcache import PAGE_SIZE
from ranks.model import Batch, HybridModel
from ranks.sampler import SeqSampler, sample_rows
from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class LocalGenerator:
    """Generates for one sequence at a time with a model held in this process."""

    def __init__(self, model: HybridModel, prefill_chunk: int = 256, kv_dtype: str = "bf16"):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model, self.prefill_chunk, self.kv_dtype = model, prefill_chunk, kv_dtype

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", **kwargs) -> "LocalGenerator":
        return cls(HybridModel.from_dir(model_dir, dtype=dtype, device=device), **kwargs)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> Iterator[int]:
        """Yield sampled token ids until max_new_tokens, an EOS / stop id, or the context limit."""
        spec = self.model.spec
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {spec.vocab_size})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {spec.vocab_size})")
        room = spec.max_position_embeddings - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                             f"{spec.max_position_embeddings}")
        budget = min(params.max_new_tokens, room)
        total = len(prompt_ids) + budget
        pages = -(-total // PAGE_SIZE)
        state = self.model.new_state(num_slots=1, num_pages=pages, kv_dtype=self.kv_dtype)
        table = torch.arange(pages, dtype=torch.int32)[None]
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        sampler = SeqSampler(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             min_p=params.min_p, presence_penalty=params.presence_penalty,
                             frequency_penalty=params.frequency_penalty,
                             repetition_penalty=params.repetition_penalty,
                             seed=params.seed if params.seed is not None else random.randrange(2**62),
                             prompt_len=len(prompt_ids), banned=params.banned_token_ids,
                             bias=params.logit_bias)
        sampler.observe(list(prompt_ids), 0)

        ids = torch.tensor(prompt_ids, dtype=torch.int64)
        logits = None
        for at in range(0, len(prompt_ids), self.prefill_chunk):
            chunk = ids[at:at + self.prefill_chunk]
            out = self.model.forward(Batch(chunk, [len(chunk)], [at], [0], table), state, logits="last")
            logits = out.logits
        position = len(prompt_ids)
        for step in range(budget):
            # the same keyed sampler the rank processes use: same seed, same text at any tp
            token = sample_rows(logits.float().cpu(), [sampler], [position], rank=0, tp=1, gather=None)[0]
            yield token
            if token in stops or step == budget - 1:
                return
            sampler.observe([token], position)
            out = self.model.forward(Batch(torch.tensor([token]), [1], [position], [0], table), state,
                                     logits="last")
            logits = out.logits
            position += 1
