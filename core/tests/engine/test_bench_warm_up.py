"""The benchmarks' warm-up makes every kind of step their timed runs make, so no kernel is first used on the clock."""

from llm_helpers import make_llm, prompts

from vllm_port.bench._decode import warm_up


def test_the_warm_up_runs_a_prefill_a_mixed_step_and_decode_steps(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime, max_num_batched_tokens=32)
    steps: list[tuple[int, ...]] = []
    launch = llm.runner.launch  # execute() launches too
    llm.runner.launch = lambda batch, *a, **k: steps.append(tuple(batch.query_lens)) or launch(batch, *a, **k)
    warm_up(llm, prompts([8] * 10, seed=2))  # four prompts fill a step: five are warmed up
    decode_rows = lambda rows: [n for n in rows if n == 1]  # noqa: E731
    assert steps[0] == (8, 8, 8, 8)  # the first step: prefill only
    assert any(decode_rows(rows) and len(decode_rows(rows)) < len(rows) for rows in steps), steps  # a mixed step
    assert all(n == 1 for n in steps[-1])  # the last: decode
    assert sum(n for rows in steps for n in rows) == 5 * 8 + 5 * 3  # five prompts, each then 3 decode steps
