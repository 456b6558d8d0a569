"""Importer fixtures: tiny random ``transformers`` models of each family (``core/tests/models/tiny_models.py``),
the paged-cache harness of the flat tests (``core/tests/flat/paged_harness.py``) and one CPU runtime for the session."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
sys.path.insert(0, str(Path(__file__).parent.parent / "flat"))
sys.path.insert(0, str(Path(__file__).parent.parent))

import cpu_runtime_fixtures

# the shared CPU fixtures, registered for this package (one_thread is autouse here only)
cpu_runtime = cpu_runtime_fixtures.cpu_runtime
one_thread = cpu_runtime_fixtures.one_thread
