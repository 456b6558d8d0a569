"""Mutants of the sampler: providers of ``sample`` that ignore, misapply or leak their arguments.

One platform plugin holds them all (one ``vllm-port certify`` run). Each is the reference's
algorithm with one realistic bug; bitwise mutants keep the contract's noise where the bug is
elsewhere, statistical ones (declared ``equivalence="statistical"``) draw with a generator of their
own keyed by the request's seed, as a vendor sampler would. Each claims one dtype to keep the run
short.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

SOURCE = '''
import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.sampling import check_sample, filled_truncation, gumbel_noise, hash32


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="mutant-sampling", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def _checked(logits, temperature, top_k, top_p, seeds):
    """The contract's input check, then top_k/top_p as tensors (None: no row truncates by it)."""
    check_sample(logits, temperature, top_k, top_p, seeds)
    return filled_truncation(top_k, top_p, logits.shape[0], logits.device)


def _scores(logits, temperature):
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]


def _keep(scores, top_k, top_p, top_p_first=False):
    """What top-k then top-p keep (top-p over the full distribution if ``top_p_first``)."""
    vocab = scores.shape[1]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    in_k = torch.arange(vocab)[None, :] < torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)[:, None]
    probs = torch.softmax(ordered if top_p_first else ordered.masked_fill(~in_k, float("-inf")), dim=-1)
    keep = in_k & ((probs.cumsum(dim=-1) - probs) < top_p[:, None])
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(1, order, keep)


def _draw(logits, temperature, scores, keep, noise):
    drawn = (scores.masked_fill(~keep, float("-inf")) + noise).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def _own_noise(seeds, vocab, rows_too=False):
    """Gumbel noise from a counter-based generator other than the contract's, keyed by the seed (and the row)."""
    key = hash32(((seeds ^ (seeds >> 29)) & 0xFFFFFFFF) ^ 0x2545F491)
    if rows_too:
        key = hash32(key ^ torch.arange(len(seeds)))
    ids = (torch.arange(vocab) * 0x9E3779B1) & 0xFFFFFFFF
    bits = hash32(hash32(key[:, None] ^ ids[None, :]) ^ 0x68E31DA4) >> 8
    return -torch.log(-torch.log((bits.float() + 0.5) / 2**24))


def global_rng(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    noise = -torch.log(-torch.log(torch.rand(scores.shape).clamp(1e-7, 1 - 1e-7)))  # the seeds never read
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), noise)


def row_shifted_seed(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    noise = gumbel_noise(seeds + torch.arange(len(seeds)), logits.shape[1])  # the row index as an offset
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), noise)


def neighbour_seed(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    noise = gumbel_noise(seeds + seeds.roll(1), logits.shape[1])  # request i-1's seed mixed into request i's
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), noise)


def temperature_twice(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(_scores(logits, temperature), temperature)  # once in the model runner, once here
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


def temperature_off_5pct(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature * 1.05)
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


def scores_in_bf16(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    divisor = torch.where(temperature > 0, temperature, 1.0).to(logits.dtype)
    scores = (logits / divisor[:, None]).float()  # divided in bfloat16: each score rounded to 8 bits
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


def top_k_plus_one(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    keep = _keep(scores, torch.where(top_k > 0, top_k + 1, top_k), top_p)  # `<=` where `<` was meant
    return _draw(logits, temperature, scores, keep, gumbel_noise(seeds, logits.shape[1]))


def top_p_ignored(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    keep = _keep(scores, top_k, torch.ones_like(top_p))
    return _draw(logits, temperature, scores, keep, gumbel_noise(seeds, logits.shape[1]))


def top_p_first(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    keep = _keep(scores, top_k, top_p, top_p_first=True)
    return _draw(logits, temperature, scores, keep, gumbel_noise(seeds, logits.shape[1]))


def greedy_last_max(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    drawn = (scores.masked_fill(~_keep(scores, top_k, top_p), float("-inf")) + gumbel_noise(seeds, logits.shape[1]))
    last_max = logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)  # ties go to the highest id
    return torch.where(temperature > 0, drawn.argmax(dim=-1), last_max)


def statistical_temperature_off(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature * 1.1)
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), _own_noise(seeds, logits.shape[1]))


def statistical_top_k_ignored(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    keep = _keep(scores, torch.zeros_like(top_k), top_p)
    return _draw(logits, temperature, scores, keep, _own_noise(seeds, logits.shape[1]))


def statistical_row_keyed(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    noise = _own_noise(seeds, logits.shape[1], rows_too=True)  # a Philox subsequence per batch row
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), noise)


def top_k_minus_one_is_one(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    scores = _scores(logits, temperature)
    k = torch.where(top_k == 0, logits.shape[1], top_k).clamp(min=1)  # only 0 means "all": -1 keeps one token
    return _draw(logits, temperature, scores, _keep(scores, k, top_p), gumbel_noise(seeds, logits.shape[1]))


def int64_top_k_as_int32(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    if top_k.dtype == torch.int64:  # read through an int32 pointer: the high words (0, "all") land between the ks
        top_k = top_k.contiguous().view(torch.int32)[: top_k.shape[0]]
    scores = _scores(logits, temperature)
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


def top_p_from_storage_start(logits, temperature, top_k, top_p, seeds):
    top_k, top_p = _checked(logits, temperature, top_k, top_p, seeds)
    top_p = top_p.as_strided(top_p.shape, top_p.stride(), 0)  # the engine's top_p is the second half of one upload
    scores = _scores(logits, temperature)
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


def untruncated_is_greedy(logits, temperature, top_k, top_p, seeds):
    check_sample(logits, temperature, top_k, top_p, seeds)
    if top_k is None and top_p is None:  # the fast path for "nothing truncates" forgets the noise: every row greedy
        return logits.argmax(dim=-1)
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    scores = _scores(logits, temperature)
    return _draw(logits, temperature, scores, _keep(scores, top_k, top_p), gumbel_noise(seeds, logits.shape[1]))


@hookimpl
def vllm_port_providers():
    f32, bf16 = frozenset({torch.float32}), frozenset({torch.bfloat16})
    bitwise = [
        ("global_rng_sample", global_rng, f32),
        ("row_shifted_seed_sample", row_shifted_seed, f32),
        ("neighbour_seed_sample", neighbour_seed, f32),
        ("temperature_twice_sample", temperature_twice, f32),
        ("temperature_off_5pct_sample", temperature_off_5pct, f32),
        ("bf16_scores_sample", scores_in_bf16, bf16),
        ("top_k_plus_one_sample", top_k_plus_one, f32),
        ("top_p_ignored_sample", top_p_ignored, f32),
        ("top_p_first_sample", top_p_first, f32),
        ("greedy_last_max_sample", greedy_last_max, bf16),
        ("top_k_minus_one_sample", top_k_minus_one_is_one, f32),
        ("int64_top_k_sample", int64_top_k_as_int32, f32),
        ("top_p_offset_sample", top_p_from_storage_start, f32),
        ("untruncated_greedy_sample", untruncated_is_greedy, f32),
    ]
    statistical = [
        ("statistical_temperature_sample", statistical_temperature_off, f32),
        ("statistical_top_k_ignored_sample", statistical_top_k_ignored, f32),
        ("statistical_row_keyed_sample", statistical_row_keyed, f32),
    ]
    return [Provider("sample", name, fn, dtypes=dtypes) for name, fn, dtypes in bitwise] + [
        Provider("sample", name, fn, dtypes=dtypes, equivalence="statistical") for name, fn, dtypes in statistical
    ]
'''


def _bitwise(name: str, bug: str, case: str, *says: str, dtype: str = "float32") -> Mutant:
    """A bitwise mutant, refused by the check of the reference's draws on ``case``."""
    check = f"test_sampling::test_sampler_equivalence[sample-{name}-{dtype}]"
    return Mutant(name, bug, "sampling", check, ("bitwise", f"case {case!r}", *says))


def _every_sampler(name: str, bug: str, case: str, *says: str) -> Mutant:
    """A mutant refused by the rules every sampler keeps (``sample.check``), as the ops check runs them."""
    check = f"test_ops::test_provider_matches_reference[sample-{name}-float32]"
    return Mutant(name, bug, "sampling", check, (f"case {case!r}", *says))


GROUPS = [
    MutantGroup(
        "mutant-sampling",
        SOURCE,
        (
            _every_sampler(
                "global_rng_sample",
                "draws its noise from torch's global generator: the per-request seeds are never read",
                "temperature",
                "two calls with the same seeds drew different tokens",
            ),
            _bitwise(
                "row_shifted_seed_sample",
                "adds the batch row to each seed (a Philox offset per row): a request's draw depends on its position",
                "temperature",
                "the reference draws",
            ),
            _every_sampler(
                "neighbour_seed_sample",
                "mixes the previous request's seed into each request's: one request's seed moves another's draw",
                "temperature",
                "its own seed unchanged",
            ),
            _bitwise(
                "temperature_twice_sample",
                "divides by the temperature twice (once in the runner, once in the kernel)",
                "temperature per row",
                "the reference draws",
            ),
            _bitwise(
                "temperature_off_5pct_sample",
                "scales by a temperature 5% too high",
                "temperature per row",
                "the reference draws",
            ),
            _bitwise(
                "bf16_scores_sample",
                "divides bf16 logits by the temperature in bf16, not float32 (each score rounded to 8 bits)",
                "large logits, low temperature",
                "the reference draws",
                dtype="bfloat16",
            ),
            _bitwise(
                "top_k_plus_one_sample",
                "keeps k + 1 tokens under top-k (`<=` for `<`)",
                "top-k per row",
                "which top-k/top-p exclude",
            ),
            _bitwise(
                "top_p_ignored_sample",
                "ignores top-p",
                "top-p per row",
                "which top-k/top-p exclude",
            ),
            _bitwise(
                "top_p_first_sample",
                "applies top-p to the full distribution before top-k, not to the top-k renormalised",
                "top-k then top-p",
                "which top-k/top-p exclude",
            ),
            _bitwise(
                "greedy_last_max_sample",
                "breaks greedy ties by the highest token id, not the lowest",
                "greedy, ties at the maximum",
                "is greedy (temperature 0)",
                dtype="bfloat16",
            ),
            _bitwise(
                "top_k_minus_one_sample",
                "only top_k 0 means all tokens: the engine's default -1 is clamped to 1 (greedy)",
                "engine defaults: top_k -1, top_p 1, greedy rows among sampled",
                "the reference draws",
            ),
            _bitwise(
                "int64_top_k_sample",
                "int64 top_k is read through an int32 pointer: the high words (0, all tokens) land between the ks",
                "256 rows: int64 index views of one buffer, every tensor at a storage offset",
                "the reference draws",
            ),
            _bitwise(
                "top_p_offset_sample",
                "top_p's storage offset is dropped (the engine's top_p is the second half of one float upload)",
                "256 rows: int32 index views of one buffer, every tensor at a storage offset",
                "the reference draws",
            ),
            _bitwise(
                "untruncated_greedy_sample",
                "its path for top_k and top_p None (nothing truncates) forgets the noise: sampled rows draw the argmax",
                "top_k and top_p None, greedy rows among sampled",
                "the reference draws",
            ),
            Mutant(
                "statistical_temperature_sample",
                "declared statistical; its own generator, a temperature 10% too high",
                "sampling",
                "test_sampling::test_sampler_equivalence[sample-statistical_temperature_sample-float32]",
                ("statistical", "case 'temperature 0.7'", "G-test"),
            ),
            Mutant(
                "statistical_top_k_ignored_sample",
                "declared statistical; its own generator, top-k ignored",
                "sampling",
                "test_sampling::test_sampler_equivalence[sample-statistical_top_k_ignored_sample-float32]",
                ("statistical", "case 'top-k 5'", "which temperature/top-k/top-p exclude"),
            ),
            _every_sampler(
                "statistical_row_keyed_sample",
                "declared statistical; keys its generator by (seed, batch row): a draw depends on its position",
                "temperature",
                "once the batch was reversed",
            ),
        ),
    )
]
