"""How many examples the fuzz tests run, and how many they ran (for docs/results/fuzz.md).

``FUZZ_EXAMPLES=N`` runs N examples per test and op (the Triton interpreter's tests a fifth of it):
the CI default is small enough for the whole folder to finish in well under a minute on two cores.
``FUZZ_RANDOM=1`` draws new examples each run instead of CI's fixed ones (a failure prints the
``@reproduce_failure`` line that replays it). ``FUZZ_REPORT=PATH`` writes the counts of the run as
JSON when the session ends.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings

#: (test kind, op) -> examples run (one test-body call per example, shrinking included)
COUNTS: Counter[tuple[str, str]] = Counter()


def examples(default: int, share: float = 1.0) -> int:
    """``FUZZ_EXAMPLES`` times ``share`` when set, else ``default``."""
    env = os.environ.get("FUZZ_EXAMPLES", "").strip()
    return max(1, int(int(env) * share)) if env else default


def fuzz_settings(default: int, share: float = 1.0) -> Any:
    """Reproducible in CI: derandomized (the same examples every run), no example database, no deadline."""
    return settings(
        max_examples=examples(default, share),
        deadline=None,
        derandomize=os.environ.get("FUZZ_RANDOM", "") != "1",
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
