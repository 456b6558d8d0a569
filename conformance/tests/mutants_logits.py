"""Mutants of the logits processors and logprobs: providers of ``process_logits`` and ``top_logprobs`` with one bug.

One platform plugin holds them all (one ``vllm-port certify`` run, its own batch: the sampler's
distribution tests stay out of it). Each provider is a correct implementation but for one realistic
bug in one argument, refused by the op check on the hand sample that varies that argument.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

SOURCE = """
import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.logits import check_process_logits, check_top_logprobs


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="mutant-logits", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def _process(logits, bias, counts, prompt, rep, freq, pres, temperature, min_p, bug):
    check_process_logits(logits, bias, counts, prompt, rep, freq, pres, temperature, min_p)
    x = logits.float() + (0 if bug == "bias ignored" else bias)
    seen = counts > 0
    r = rep[:, None]
    if bug == "repetition divides every logit":
        penalised = x / r
    else:
        penalised = torch.where(x > 0, x / r, x * r)
    x = torch.where(seen if bug == "repetition on the output only" else seen | prompt, penalised, x)
    times = seen.float() if bug == "frequency counted once" else counts.float()
    x = x - freq[:, None] * times - pres[:, None] * seen * (-1 if bug == "presence rewards" else 1)
    use = (temperature > 0) & (min_p > 0)
    divisor = 1.0 if bug == "min_p before temperature" else torch.where(use, temperature, 1.0)[:, None]
    ratio = ((x - x.amax(dim=-1, keepdim=True)) / divisor).exp()
    return x.masked_fill((ratio < min_p[:, None]) & use[:, None], float("-inf"))


def _logprobs(logits, token_ids, num_top, bug):
    check_top_logprobs(logits, token_ids, num_top)
    lp = torch.log_softmax(logits if bug == "log-softmax in the logits' dtype" else logits.float(), dim=-1).float()
    own = lp.gather(1, token_ids.long()[:, None])
    rank = (lp > own).sum(dim=-1, keepdim=True) + (0 if bug == "rank counted from 0" else 1)
    top, order = lp.topk(num_top, dim=-1, largest=bug != "top logprobs smallest first")
    return torch.cat((own, top), dim=1), torch.cat((rank, order), dim=1)


def _mutant(op, name, bug):
    if op == "process_logits":
        def fn(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty, presence_penalty,
               temperature, min_p):
            return _process(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty,
                            presence_penalty, temperature, min_p, bug)
    else:
        def fn(logits, token_ids, num_top):
            return _logprobs(logits, token_ids, num_top, bug)
    dtype = torch.bfloat16 if "dtype" in bug else torch.float32
    return Provider(op, name, fn, dtypes=frozenset({dtype}))


BUGS = {
    "bias_ignored_process_logits": ("process_logits", "bias ignored"),
    "repetition_output_only_process_logits": ("process_logits", "repetition on the output only"),
    "repetition_divides_all_process_logits": ("process_logits", "repetition divides every logit"),
    "frequency_once_process_logits": ("process_logits", "frequency counted once"),
    "presence_rewards_process_logits": ("process_logits", "presence rewards"),
    "min_p_untempered_process_logits": ("process_logits", "min_p before temperature"),
    "bf16_log_softmax_top_logprobs": ("top_logprobs", "log-softmax in the logits' dtype"),
    "rank_from_zero_top_logprobs": ("top_logprobs", "rank counted from 0"),
    "smallest_first_top_logprobs": ("top_logprobs", "top logprobs smallest first"),
}


@hookimpl
def vllm_port_providers():
    return [_mutant(op, name, bug) for name, (op, bug) in BUGS.items()]
"""


def _refused(name: str, op: str, bug: str, case: str, *says: str, dtype: str = "float32") -> Mutant:
    """A mutant refused by its op's check against the reference, on ``case``."""
    check = f"test_ops::test_provider_matches_reference[{op}-{name}-{dtype}]"
    return Mutant(name, bug, "sampling", check, (f"case {case!r}", *says))


GROUPS = [
    MutantGroup(
        "mutant-logits",
        SOURCE,
        (
            _refused("bias_ignored_process_logits", "process_logits", "ignores the bias (logit_bias, bans)",
                     "bias and bans", "banned (-inf) or kept unlike the reference"),
            _refused("repetition_output_only_process_logits", "process_logits",
                     "applies the repetition penalty to output tokens only, not the prompt's",
                     "repetition penalty per row", "in prompt True"),
            _refused("repetition_divides_all_process_logits", "process_logits",
                     "divides every seen token's logit by the repetition penalty, negative ones too",
                     "repetition penalty per row", "values off"),
            _refused("frequency_once_process_logits", "process_logits",
                     "subtracts the frequency penalty once per token, not once per occurrence",
                     "frequency penalty per row", "values off"),
            _refused("presence_rewards_process_logits", "process_logits", "adds the presence penalty instead of subtracting it",
                     "presence penalty per row", "values off"),
            _refused("min_p_untempered_process_logits", "process_logits",
                     "compares min_p with the probabilities before the temperature", "min_p per row",
                     "banned (-inf) or kept unlike the reference"),
            _refused("bf16_log_softmax_top_logprobs", "top_logprobs", "computes log_softmax in bfloat16, not float32",
                     "top 1", "logprob is", dtype="bfloat16"),
            _refused("rank_from_zero_top_logprobs", "top_logprobs", "counts ranks from 0 (the most likely token gets 0)",
                     "sampled token only", "rank is"),
            _refused("smallest_first_top_logprobs", "top_logprobs", "returns the smallest logprobs as the top ones",
                     "top 1", "is not among the 1 largest"),
        ),
    )
]  # fmt: skip
