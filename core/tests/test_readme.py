"""The README's example runs as written, on the CPU platform: the README cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def _example(section: str) -> str:
    """The first ``python`` code block under the README heading that starts with ``section``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    block = re.search(r"```python\n(.*?)```", text[start : end if end >= 0 else None], re.S)
    assert block, f"README.md: no python block under '## {section}'"
    return block.group(1)


@pytest.mark.slow
def test_the_how_it_works_example_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PORT_DEVICE", "cpu")
    monkeypatch.delenv("VLLM_PORT_PLUGINS", raising=False)
    code = _example("How it works")
    scope: dict[str, object] = {}
    exec(compile(code, f"{README}: How it works", "exec"), scope)  # the README's own example
    x, weight, y = scope["x"], scope["weight"], scope["y"]
    want = torch.nn.functional.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps=1e-6).to(y.dtype)
    torch.testing.assert_close(y, want, rtol=1.6e-2, atol=1e-2)
    kv, swap, handle, pairs = scope["kv"], scope["swap"], scope["handle"], scope["pairs"]
    assert handle.done() and len(pairs) == 2
    for block, slot in pairs:  # bit for bit: a fresh cache holds whatever bits the memory had, NaN patterns included
        assert torch.equal(swap.blocks[slot].view(torch.int16), kv.blocks[block].view(torch.int16))
    kv.close()
    swap.close()


def test_the_generate_example_runs_with_the_bundled_model(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("VLLM_PORT_DEVICE", "cpu")
    code = _example("Generate")
    exec(compile(code, f"{README}: Generate", "exec"), {})  # the README's own example
    text = capsys.readouterr().out
    assert len(text.split()) >= 10, text  # 32 tokens of English words
