"""Text in and out: a model's ``tokenizer.json`` through the ``tokenizers`` library, and incremental decoding.

Decoding token by token is not decoding each token alone: a byte-level token may carry half a
UTF-8 character, and SentencePiece-style decoders drop the space that starts a text. So the new
text of each token is the difference between decoding a short window of recent tokens with and
without it, and text is held back while it ends in an incomplete character.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError
from ..models.config import model_file, read_model_file

__all__ = ["MAX_TOKENIZER_BYTES", "TOKENIZER_FILE", "IncrementalDetokenizer", "Tokenizer", "open_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
#: The largest ``tokenizer.json`` read: those of 256k-token vocabularies are some 30 MB.
MAX_TOKENIZER_BYTES = 256 << 20
_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
_CONTEXT_TOKENS = 6  # prompt tokens that give the first output tokens their context (leading spaces)


class Tokenizer:
    """A ``tokenizer.json`` loaded with ``tokenizers``.

    The file must be a regular file of at most :data:`MAX_TOKENIZER_BYTES` (read once, then parsed
    from memory: a FIFO or device is refused before it is opened for reading).

    :raises ModelLoadError: when the file cannot be read or parsed (naming it).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self.path = Path(path)
        data = read_model_file(self.path, TOKENIZER_FILE, MAX_TOKENIZER_BYTES)
        try:
            self._tokenizer = _Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for every parse problem
            raise ModelLoadError(
                f"{self.path}: cannot load the tokenizer ({exc}); re-download or re-save it (tokenizers format)"
            ) from exc

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer | None:
        """The tokenizer of a model directory, or ``None`` when it has no ``tokenizer.json``."""
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(path) if path.exists() else None

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer adds (a beginning-of-sequence token)
        unless ``add_special_tokens`` is false (a chat template writes its own)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def open_tokenizer(
    model_dir: str | os.PathLike[str] | None, tokenizer: str | os.PathLike[str] | None = None
) -> Tokenizer | None:
    """The engine's tokenizer: ``tokenizer`` when given (a local directory holding a ``tokenizer.json``, or
    the file's path), else ``model_dir``'s own; ``None`` when neither has one (prompts are then token ids).

    :raises ModelLoadError: for a ``tokenizer`` that is not such a directory or file (naming it), or a
        ``tokenizer.json`` that links out of its directory.
    """
    if tokenizer is None:
        if model_dir is None:
            return None
        model_file(model_dir, TOKENIZER_FILE)  # refuses a tokenizer.json linking out of the directory
        return Tokenizer.from_model_dir(model_dir)
    path = Path(tokenizer)
    if path.is_dir():
        path = model_file(path, TOKENIZER_FILE)
    if not path.is_file():
        raise ModelLoadError(
            f"LLM(tokenizer={os.fspath(tokenizer)!r}): {path} is not a file; give a local directory holding a "
            "tokenizer.json, or the file's path (a hub id does not load: `huggingface-cli download ORG/NAME "
            "--local-dir DIR` first)"
        )
    return Tokenizer(path)


class IncrementalDetokenizer:
    """Text of a request's output, token by token, and its stop strings.

    The scheduler feeds it each output token (:meth:`feed`: it is the request's
    :class:`~vllm_port.engine.request.StopMatcher`); the engine takes the text now final (:meth:`take`).

    :param prompt_token_ids: the prompt; its last tokens give the first output token its context.
    :param stop: strings that end the output; text that could still become one is held back
        from :meth:`take`'s answer until it cannot (or until :meth:`flush`).
    :param include_stop: keep the stop string that ended the output in its text (vLLM's
        ``include_stop_str_in_output``); by default the text ends just before it.
    :param skip_special_tokens: leave special tokens (``<s>``, ``</s>``, ...) out of the text, as
        ``tokenizers``' ``decode`` does with the same flag.
    :param min_tokens: stop strings are looked for only once this many tokens were fed (``min_tokens``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        #: the stop string that ended the output (``None`` until one does)
        self.matched: str | None = None
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this are in ``text``
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # decoded output so far (cut before a stop string once one is found)
        self._emitted = 0  # characters of ``text`` handed out by add()
        self.stopped = False
        self.min_tokens = min_tokens
        self._fed = 0

    def feed(self, token_id: int) -> bool:
        """Decode one more output token; whether a stop string has appeared (:attr:`stopped`).

        The text then ends before the stop string, and later tokens add nothing.
        """
        self._fed += 1
        if not self.stopped:
            self._ids.append(token_id)
            self._append(self._new_text(final=False))
        return self.stopped

    def take(self) -> str:
        """The text that became final since the last :meth:`take` (may be empty)."""
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The rest of the text at the end of the request (incomplete characters included)."""
        if not self.stopped:
            self._append(self._new_text(final=True))
        return self._take(final=True)

    def _new_text(self, final: bool) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        before = decode(self._ids[self._prefix : self._read], skip)
        after = decode(self._ids[self._prefix :], skip)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _append(self, new: str) -> None:
        if not new:
            return
        start = max(len(self.text) - self._hold, 0)
        self.text += new
        if self._fed < self.min_tokens:
            return
        found = [(at, s) for s in self.stop if (at := self.text.find(s, start)) >= 0]
        if found:  # the earliest stop string wins
            at, self.matched = min(found, key=lambda hit: hit[0])
            self.text, self.stopped = self.text[: at + (len(self.matched) if self.include_stop else 0)], True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(len(self.text) - self._hold, self._emitted)
        out, self._emitted = self.text[self._emitted : end], end
        return out
