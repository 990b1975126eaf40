"""The real Qwen tokenizer of SDAR / Dream for tests: built offline from the dashscope wheel's ranks into
~/.cache/megadare/tokenizers (megadare.data.qwen_tokenizer), once per machine, a few seconds; and an independent
encoder of the same ranks (tiktoken, OpenAI's BPE implementation) to check ids against."""

from __future__ import annotations

import functools
import re
import unicodedata

from megadare.data.qwen_tokenizer import QWEN_PATTERN, cached_qwen_tokenizer, qwen_ranks


@functools.cache
def qwen_dir(family: str = "sdar") -> str:
    return cached_qwen_tokenizer(family)


@functools.cache
def _tiktoken():
    import tiktoken

    return tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=qwen_ranks(), special_tokens={})


def tiktoken_ids(text: str) -> list[int]:
    """Qwen's ids of ``text`` by tiktoken: NFC first, as Qwen2's normaliser does; no special tokens."""
    return _tiktoken().encode_ordinary(unicodedata.normalize("NFC", text))


IM_START, IM_END, NL, USER, ASSISTANT, SYSTEM = 151644, 151645, 198, 872, 77091, 8948


def sdar_user_prompt(content: str) -> list[int]:
    """SDAR's (Qwen3's) template for one user turn + the generation prompt, assembled by hand:
    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n."""
    return [IM_START, USER, NL] + tiktoken_ids(content) + [IM_END, NL, IM_START, ASSISTANT, NL]


THINK, END_THINK = 151667, 151668
CHAT_SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<think>": THINK, "</think>": END_THINK}


def chat_text_ids(text: str) -> list[int]:
    """Qwen's ids of a rendered chat text: the chat's special tokens by their ids, the text between them by
    tiktoken (Qwen2's tokenizer splits added tokens out first, then encodes each piece)."""
    pieces = re.split("(" + "|".join(map(re.escape, CHAT_SPECIALS)) + ")", text)
    return [i for piece in pieces for i in ([CHAT_SPECIALS[piece]] if piece in CHAT_SPECIALS else tiktoken_ids(piece))]
