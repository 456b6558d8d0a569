"""Asynchronous scheduling: the host schedules and launches step N+1 before it reads step N's tokens.

``LLM(async_scheduling=True)`` (vLLM's name). A synchronous step waits for the device at its end
(the sampled ids, read once) and only then schedules the next, so the device idles while the host
updates the requests, detokenises, schedules and uploads the next step's inputs. With a step ahead:

1. step N is launched (:meth:`~.runner.ModelRunner.launch`): its sampled ids stay on the device;
2. :meth:`~.scheduler.Scheduler.commit` advances step N's sequences, each sampling one holding a
   :data:`~.scheduler.PLACEHOLDER` as its newest token, and the scheduler schedules step N+1;
3. step N+1 is launched with a :class:`~.runner.StepFeed` that writes step N's sampled ids into the
   placeholders' input positions on the device (:func:`feed_rows`);
4. only then is step N's result read (the host waits for step N, while step N+1 is queued behind it),
   and ``update(..., committed=True)`` puts the tokens in place and stops the requests that end there.

Outputs are the synchronous engine's, token for token: the same batches, seeds and kernels; a request
that stops at step N still has a row in step N+1, whose token is dropped (its blocks go back to the
pool when step N's result is read; the row only writes its own, and the device runs the steps in order).

A step is run ahead only where nothing needs the host to know step N's tokens first
(:func:`can_run_ahead`): no logits processing (penalties, ``min_p``, biases, bans: their inputs are the
output tokens), no logprobs, no parallel samples (``n > 1``: the forks happen at the update), and room
for one more position in every sampling sequence (``max_model_len``). Elsewhere the step is synchronous.
"""

from __future__ import annotations

from .scheduler import PLACEHOLDER, SchedulerOutput, StepBatch

__all__ = ["can_run_ahead", "feed_rows"]


def can_run_ahead(out: SchedulerOutput, batch: StepBatch, max_model_len: int) -> bool:
    """Whether the step after ``out`` can be scheduled before ``out``'s tokens are read."""
    if batch.processing or batch.logprobs or batch.prompt_logprobs:
        return False
    for i, seq in enumerate(out.seqs):
        if seq.forks or seq.params.n > 1:
            return False
        if out.samples(i) and seq.num_tokens >= max_model_len:  # no position left for the placeholder's token
            return False
    return True


def feed_rows(committed: SchedulerOutput, following: SchedulerOutput) -> tuple[list[int], list[int]]:
    """Where ``following``'s batch takes ``committed``'s sampled ids: ``(input positions, sampled rows)``.

    ``committed`` is the step :meth:`~.scheduler.Scheduler.commit` advanced (its sampling rows are one
    per sampling sequence, in step order: no forks); ``following`` the step scheduled after it.

    :raises RuntimeError: when a placeholder in ``following``'s inputs has no sampled row (an engine bug:
        the model would read an id no one sampled).
    """
    assert committed.committed is not None
    row_of: dict[int, int] = {}
    row = 0
    for seq, sampling in zip(committed.seqs, committed.committed, strict=True):
        if sampling:
            row_of[id(seq)] = row
            row += 1
    positions: list[int] = []
    rows: list[int] = []
    offset = 0
    for seq, n in zip(following.seqs, following.num_new_tokens, strict=True):
        start, last = seq.num_computed_tokens, seq.num_tokens - 1  # a placeholder is only ever the newest token
        if start <= last < start + n and seq.token_ids[last] == PLACEHOLDER:
            if id(seq) not in row_of:
                raise RuntimeError(
                    f"request {seq.request_id}: input position {last} holds a placeholder no step sampled"
                )
            positions.append(offset + last - start)
            rows.append(row_of[id(seq)])
        offset += n
    return positions, rows
