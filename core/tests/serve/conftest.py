"""Serve test fixtures: the CPU runtime for the offline ``LLM`` that is the oracle of the server's outputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import cpu_runtime_fixtures

cpu_runtime = cpu_runtime_fixtures.cpu_runtime
one_thread = cpu_runtime_fixtures.one_thread
