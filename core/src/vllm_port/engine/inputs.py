"""Prompts as vLLM's offline API takes them: text, token ids, or a dict naming which (device-free).

``LLM.generate`` takes each of::

    "The sea"                                  # text (needs the model's tokenizer.json)
    [1, 450, 7205]                             # token ids
    {"prompt": "The sea"}                      # TextPrompt
    {"prompt_token_ids": [1, 450, 7205]}       # TokensPrompt

The dict forms are vLLM's ``TextPrompt`` and ``TokensPrompt``: code written for vLLM passes them as
they are. A dict with other keys (``multi_modal_data``, ``mm_processor_kwargs``, ...) is refused per
request, naming the keys, rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

__all__ = ["PROMPT_KEYS", "Prompt", "TextPrompt", "TokensPrompt", "unpack_prompt"]


class TextPrompt(TypedDict):
    """A prompt as text: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


#: A prompt: text (needs the model's tokenizer.json), token ids, or one of those as a dict.
Prompt = str | Sequence[int] | TextPrompt | TokensPrompt

#: The keys a prompt dict may hold (exactly one of them).
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def unpack_prompt(prompt: Any) -> tuple[Any, str | None]:
    """A dict prompt's text or token ids (other prompts as they are), and what is wrong with the dict (or ``None``)."""
    if not isinstance(prompt, dict):
        return prompt, None
    keys = set(prompt)
    if len(keys) == 1 and keys <= set(PROMPT_KEYS):
        return prompt[next(iter(keys))], None
    return None, (
        f"a prompt dict holds the key(s) {sorted(map(str, keys))}; give exactly one of 'prompt' (text, a TextPrompt) "
        "or 'prompt_token_ids' (a list of ints, a TokensPrompt): other inputs (multi-modal data, ...) are not supported"
    )
