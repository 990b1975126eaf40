"""Tokenizers behind one small protocol: a byte tokenizer for tiny test models, a UTF-8 byte counter for any text,
and a wrapper over HF's.

The SFT pipeline needs only ``encode``, ``decode``, ``chat_prompt`` (a conversation rendered up to and
including the assistant generation prompt) and four special ids: eos, pad and the diffusion mask token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

__all__ = ["Tokenizer", "ByteTokenizer", "Utf8ByteTokenizer", "HFTokenizer", "load_hf_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the generator need from a tokenizer."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    mask_token_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        ...

    def chat_prompt(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """Token ids of ``messages`` ({'role', 'content'} dicts) ending with the assistant generation prompt; with
        ``continue_final`` the last (assistant) message is the start of that turn, left open (a prefill)."""
        ...


class ByteTokenizer:
    """Deterministic ASCII byte tokenizer with a 256-id vocabulary, for tiny test models.

    Ids 0..127 are the ASCII bytes; 250/251/252 are the ``<|user|>``/``<|assistant|>``/``<|system|>`` role
    tokens, 253 is eos, 254 pad and 255 the mask token; 128..249 are unused. ``decode`` skips every id >= 250
    unless ``render_roles=True``, in which case role tokens come out as their strings (eos/pad/mask are
    still skipped).
    """

    vocab_size = 256
    USER, ASSISTANT, SYSTEM = 250, 251, 252
    eos_token_id = 253
    pad_token_id = 254
    mask_token_id = 255
    ROLE_IDS = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}
    ROLE_STRINGS = {USER: "<|user|>", ASSISTANT: "<|assistant|>", SYSTEM: "<|system|>"}

    def encode(self, text: str) -> list[int]:
        """ASCII code points of ``text``; a non-ASCII character raises ValueError naming it."""
        ids = []
        for pos, ch in enumerate(text):
            code = ord(ch)
            if code > 127:
                raise ValueError(f"ByteTokenizer handles ASCII only: character {ch!r} (U+{code:04X}) at position {pos}")
            ids.append(code)
        return ids

    def decode(self, ids: Sequence[int], render_roles: bool = False) -> str:
        """Text of ``ids``; special ids (>= 250) are skipped, role tokens rendered if ``render_roles``; the unused
        ids 128..249 (a model may sample them) decode to U+FFFD, as HF tokenizers render undecodable bytes."""
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i <= 127:
                out.append(chr(i))
            elif i in self.ROLE_STRINGS:
                if render_roles:
                    out.append(self.ROLE_STRINGS[i])
            elif 250 <= i < self.vocab_size:
                continue
            elif 128 <= i < 250:
                out.append("\ufffd")
            else:
                raise ValueError(f"ByteTokenizer: id {i} is outside the vocabulary (0..255)")
        return "".join(out)

    def chat_prompt(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """Each message as role token + content bytes + newline, then the assistant token; with ``continue_final``
        the last message (an assistant prefill) follows that token, with no newline after it."""
        if continue_final:
            if not messages or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final needs a last message with role 'assistant' (the prefill)")
            return self.chat_prompt(messages[:-1]) + self.encode(str(messages[-1].get("content", "")))
        ids: list[int] = []
        for n, msg in enumerate(messages):
            role = msg.get("role")
            if role not in self.ROLE_IDS:
                raise ValueError(
                    f"ByteTokenizer: message {n} has role {role!r}; expected one of {', '.join(self.ROLE_IDS)}"
                )
            ids.append(self.ROLE_IDS[role])
            ids.extend(self.encode(str(msg.get("content", ""))))
            ids.append(ord("\n"))
        ids.append(self.ASSISTANT)
        return ids


class Utf8ByteTokenizer(ByteTokenizer):
    """Any text as its UTF-8 bytes: ids 0..255 are the bytes, 256/257/258 the user/assistant/system role tokens,
    259 eos, 260 pad, 261 mask. It measures lengths of text in any script when no model's tokenizer is at hand
    (``megadare data inspect`` without ``--model``); no model is trained with it."""

    vocab_size = 262
    USER, ASSISTANT, SYSTEM, eos_token_id, pad_token_id, mask_token_id = range(256, 262)
    ROLE_IDS = dict(zip(ByteTokenizer.ROLE_IDS, (USER, ASSISTANT, SYSTEM)))  # the byte tokenizer's roles
    ROLE_STRINGS = dict(zip((USER, ASSISTANT, SYSTEM), ByteTokenizer.ROLE_STRINGS.values()))

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (a lone surrogate, which no UTF-8 text holds, raises ValueError)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], render_roles: bool = False) -> str:
        """Text of ``ids``: byte runs decoded as UTF-8 (invalid sequences as U+FFFD), role tokens rendered if
        ``render_roles``, eos / pad / mask skipped."""
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            if not 256 <= i < self.vocab_size:
                raise ValueError(f"Utf8ByteTokenizer: id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if render_roles and i in self.ROLE_STRINGS:
                out.append(self.ROLE_STRINGS[i])
        return "".join(out) + run.decode("utf-8", errors="replace")


# tokenizer classes that checkpoints name as remote code but that are a transformers class under another name:
# Dream-v0's tokenization_dream.py is Qwen2Tokenizer copied ("Copied from transformers...", the same BPE and files)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # one holds the vocabulary
LOCAL_TOKENIZER_CLASSES = {"DreamTokenizer": "Qwen2Tokenizer"}


def load_hf_tokenizer(path: str):
    """The transformers tokenizer of a checkpoint or tokenizer directory (tokenizer.json, or vocab.json +
    merges.txt, with tokenizer_config.json), local files only and no remote code. The class tokenizer_config.json
    names loads directly when transformers has it (a class in ``LOCAL_TOKENIZER_CLASSES`` as its twin): no detour
    through the model's config.json, whose remote ``model_type`` (sdar, Dream) transformers would warn about;
    anything else goes through ``AutoTokenizer``."""
    import transformers  # lazy: heavy import, optional for byte-level tests

    cfg_path = os.path.join(path, "tokenizer_config.json")
    name = None
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    cls = None
    if isinstance(name, str):  # the fast (tokenizers-backed) class where transformers 4.x has both
        local = LOCAL_TOKENIZER_CLASSES.get(name, name).removesuffix("Fast")
        cls = getattr(transformers, local + "Fast", None) or getattr(transformers, local, None)
    if cls is not None and hasattr(cls, "from_pretrained"):
        return cls.from_pretrained(path, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


class HFTokenizer:
    """A local Hugging Face tokenizer behind the ``Tokenizer`` protocol.

    ``mask_token_id`` comes from the caller (the model family knows it), or else from the tokenizer's own
    ``mask_token`` (a tokenizer directory without a model); eos and pad come from the tokenizer, pad falling back
    to eos. Nothing is downloaded and no remote code runs (:func:`load_hf_tokenizer`).
    """

    def __init__(self, path: str, mask_token_id: Optional[int] = None) -> None:
        self.path = path
        self.tok = load_hf_tokenizer(path)
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer at {path} defines no eos token")
        mask = self.tok.mask_token_id if mask_token_id is None else mask_token_id
        if mask is None:
            raise ValueError(
                f"tokenizer at {path} names no mask token (mask_token in tokenizer_config.json) and no "
                "model config gives one (config.json mask_token_id)"
            )
        pad = self.tok.pad_token_id
        self.eos_token_id: int = int(eos)
        self.pad_token_id: int = int(pad) if pad is not None else int(eos)
        self.mask_token_id: int = int(mask)
        self.vocab_size: int = len(self.tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS or other added special tokens."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """The conversation through the tokenizer's chat template, with the generation prompt appended; with
        ``continue_final`` the last (assistant) message is rendered open, its turn not closed (a prefill)."""
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"tokenizer at {self.path} has no chat template; cannot render chat prompts "
                "(add 'chat_template' to tokenizer_config.json)"
            )
        out: Any = self.tok.apply_chat_template(
            messages, add_generation_prompt=not continue_final, continue_final_message=continue_final, tokenize=True
        )
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # newer transformers return a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]
