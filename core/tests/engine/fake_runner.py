"""A device-free stand-in for the model runner: it checks what a real cache would hold.

``FakeRunner`` keeps the token each cache slot holds (device blocks and swap blocks), carries out
the step's swaps, writes the step's tokens, and then checks that every position a sequence attends
to holds that sequence's token: a prefix hit on the wrong block, a swap to the wrong place or a
block reused too early shows as a wrong token. Its "model" makes the next token from the whole
context, so a request's output depends on its own tokens only, as with a real model.
"""

from __future__ import annotations

import hashlib

from vllm_port.engine.scheduler import SchedulerOutput, StepBatch

VOCAB = 97


def next_token(context: list[int]) -> int:
    """The fake model's greedy token after ``context`` (a pure function of it)."""
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}  # device slot -> token
        self.swap_slots: dict[int, int] = {}
        self.steps: list[StepBatch] = []

    def _move(self, src: dict[int, int], dst: dict[int, int], pairs: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for a, b in pairs:
            for i in range(bs):
                if a * bs + i in src:
                    dst[b * bs + i] = src[a * bs + i]
                else:
                    dst.pop(b * bs + i, None)

    def execute(self, out: SchedulerOutput) -> list[int]:
        batch = out.batch(self.block_size)
        self.steps.append(batch)
        self._move(self.slots, self.slots, batch.copies)
        self._move(self.slots, self.swap_slots, batch.swap_out)
        self._move(self.swap_slots, self.slots, batch.swap_in)
        for slot, token in zip(batch.slot_mapping, batch.input_ids, strict=True):
            self.slots[slot] = token
        sampled = []
        for i, seq in enumerate(out.seqs):
            end = batch.seq_lens[i]
            table = batch.block_tables[i]
            seen = [
                self.slots.get(table[p // self.block_size] * self.block_size + p % self.block_size) for p in range(end)
            ]
            assert seen == seq.token_ids[:end], f"{seq.request_id}: the cache holds {seen}, not {seq.token_ids[:end]}"
            # a row per sample: a request's samples waiting to fork draw from the same context
            sampled += [next_token(seq.token_ids[:end])] * batch.sample_rows.count(i)
        return sampled
