"""Tokenizers behind one small interface: a byte-level one made in code, and an adapter for HF's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

ChatMessage = dict[str, Any]  # role and content, and for templates that know tools: tool_calls, tool_call_id


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders `tools`, assistant `tool_calls` and tool messages itself."""
        ...

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (specials: their text), for log probabilities."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte, plus a few specials. Used by the builtin models.

    Chat template (documented in README): each message becomes `<|role|>\\n{content}\\n`, then
    `<|assistant|>\\n` opens the reply; the whole prompt starts with BOS.
    """

    BOS = 256
    EOS = 257
    PAD = 258
    VOCAB_SIZE = 320  # room for specials, rounded up for friendlier matrix shapes

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.EOS})

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        # Ids outside the byte range (specials, unused slots) decode to nothing.
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    @property
    def knows_tools(self) -> bool:
        return False

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return [self.BOS, *self.encode(text)]

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""


class HFTokenizer:
    """Adapter over a transformers tokenizer with its chat template."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._byte_of_char: dict[str, int] | None = None  # built on first use, for byte-level BPE vocabularies

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer, for libraries that read the vocabulary themselves
        (the grammar compiler of structured outputs)."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """A byte-level BPE token (GPT-2's, Llama 3's, SmolLM2's) spells its bytes with one printable
        character each; other vocabularies give their decoded text."""
        piece = str(self._tokenizer.convert_ids_to_tokens(token_id))
        byte_of_char = self._byte_level_alphabet()
        if token_id in self._tokenizer.all_special_ids or not all(char in byte_of_char for char in piece):
            return str(self._tokenizer.decode([token_id])).encode("utf-8")
        return bytes(byte_of_char[char] for char in piece)

    def _byte_level_alphabet(self) -> dict[str, int]:
        if self._byte_of_char is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()}
        return self._byte_of_char

    @property
    def knows_tools(self) -> bool:
        return "tools" in str(self._tokenizer.chat_template or "")

    def encode_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]:
        if not self._tokenizer.chat_template:
            return ByteTokenizerTemplate.render(self, messages)
        ids = self._tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True,
            return_dict=False
        )
        return [int(t) for t in ids]


class ByteTokenizerTemplate:
    """The plain template for checkpoints that ship none."""

    @staticmethod
    def render(tokenizer: HFTokenizer, messages: Sequence[ChatMessage]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return tokenizer.encode(text)
