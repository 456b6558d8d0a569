"""What ``top_p`` 1 given as a tensor drops: the tail the reference's float32 cumulative sum cuts (issue 30).

``sample_reference`` drops a token when the float32 mass before it reaches ``top_p``. At ``top_p`` 1 that should
keep every token, but the float32 sum can reach 1.0 before the end of a long vocabulary. A provider given ``None``
keeps the tail. This prints, for 8 rows of random bf16 logits at Llama-3's vocabulary, how many tokens top-p 1 drops
and their exact (float64) probability mass, at two logit scales. CPU, a second.

    python dev/experiments/probe_top_p_one_tail.py
"""

from __future__ import annotations

import torch

VOCAB = 128_256


def main() -> None:
    torch.manual_seed(0)
    for scale in (1.0, 4.0):
        scores = (torch.randn(8, VOCAB) * scale).bfloat16().float()
        ordered = scores.sort(dim=-1, descending=True, stable=True).values
        probs = torch.softmax(ordered, dim=-1)
        dropped = (probs.cumsum(dim=-1) - probs) >= 1.0  # the reference's rule at top_p = 1
        mass = (torch.softmax(ordered.double(), dim=-1) * dropped).sum(dim=-1)
        print(
            f"logits N(0, {scale:g}^2): tokens dropped per row {dropped.sum(dim=-1).tolist()}, "
            f"their mass at most {float(mass.max()):.2e}"
        )


if __name__ == "__main__":
    main()
