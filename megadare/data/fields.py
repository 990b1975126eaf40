"""Fields of a record: dotted keys into nested fields, conversations, and which schema a record is in.

Config keys name fields by dotted paths (``rewards.answer_key=reward_model.ground_truth``,
``data.prompt_key=extra_info.question``). With the default keys, records in the verl / DARE schema need no
override:

===========  ==============================================================================================
schema       fields read (defaults first, DARE's nested fields when the defaults are absent)
===========  ==============================================================================================
RL           prompt: ``prompt_ids`` | ``messages`` | ``prompt`` (text, or verl's list of messages);
             gold: ``answer``, else ``reward_model.ground_truth``
SFT          ``messages`` (ending with the response) | ``prompt`` + ``response``, else DARE's SFT recipe fields
             ``extra_info.question`` + ``extra_info.answer``
preference   ``prompt`` (text or messages) + ``chosen`` + ``rejected`` (text or one assistant message each)
===========  ==============================================================================================

A prompt given as messages may end with an assistant message: a prefill, rendered through the chat template as the
start of the assistant's turn, so the response continues it. A verl / DARE row is rendered as verl renders it
instead (``verl/utils/dataset/rl_dataset.py``: ``apply_chat_template(prompt, add_generation_prompt=True)``), so
the ids are DARE's: its trailing assistant message (DARE's MBPP ``[BEGIN]\\n``) is a closed turn and the response
starts a new one, scored alone. Errors are :class:`DataError` naming ``file:row``, the field and what was found.
"""

from __future__ import annotations

from typing import Any

from megadare.data.files import DataError
from megadare.data.tokenizer import Tokenizer

__all__ = [
    "MISSING",
    "get_field",
    "check_messages",
    "render_prompt",
    "prompt_messages",
    "response_text",
    "encode_text",
    "is_verl_row",
    "renders_as_verl",
    "DARE_GOLD",
    "GOLD_FALLBACKS",
    "PROMPT_FALLBACKS",
    "DARE_SFT_PROMPT",
    "DARE_SFT_RESPONSE",
]

MISSING: Any = object()
DARE_GOLD = "reward_model.ground_truth"
# Where other publishers' RL rows keep what the default keys name: verl / DARE's gold, dLLM-RL's math gold and code
# tests (rewards/registry.py reads dLLM-RL's rows by the same names), dLLM-RL's prompt.
GOLD_FALLBACKS = (DARE_GOLD, "ground_truth_answer", "test_method")
PROMPT_FALLBACKS = ("question", "problem")  # dLLM-RL, gsm8k; MATH-500
DARE_SFT_PROMPT, DARE_SFT_RESPONSE = "extra_info.question", "extra_info.answer"


def get_field(rec: dict, key: str) -> Any:
    """``rec[key]``, following dots into nested objects (a key holding the dots itself wins); MISSING if absent."""
    if key in rec:
        return rec[key]
    value: Any = rec
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles the Qwen-family chat templates render


def check_messages(msgs: Any, where: str, key: str, ends_with_response: bool = False) -> list[dict]:
    """A well-formed conversation: a non-empty list of {role, content} strings; with ``ends_with_response`` it ends
    with the assistant's response and has a message before it (SFT)."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of {{role, content}} messages")
    for n, msg in enumerate(msgs):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: field {key!r}[{n}] must be an object with 'role' and 'content'")
        for part in ("role", "content"):
            if part not in msg:
                raise DataError(f"{where}: field {key!r}[{n}] is missing {part!r}")
            if not isinstance(msg[part], str):
                raise DataError(f"{where}: field {key!r}[{n}].{part} must be a string")
        if msg["role"] not in CHAT_ROLES:
            raise DataError(
                f"{where}: field {key!r}[{n}].role is {msg['role']!r}; a chat template renders only "
                f"{', '.join(CHAT_ROLES)} (SDAR's and Dream's drop any other turn without a word): rename it "
                "(ShareGPT's human / gpt are user / assistant)"
            )
        if msg["role"] == "user" and not msg["content"].strip():
            raise DataError(
                f"{where}: field {key!r}[{n}].content: the user turn is empty (the model would see no question)"
            )
    if not ends_with_response:
        return msgs
    last = msgs[-1]["role"]
    if last != "assistant":
        raise DataError(
            f"{where}: field {key!r}: the last message must have role 'assistant' (the response), got {last!r}"
        )
    if len(msgs) < 2:
        raise DataError(f"{where}: field {key!r}: needs at least one message before the assistant response")
    return msgs


def prompt_messages(value: Any, where: str, key: str) -> list[dict]:
    """A prompt field as messages: text becomes one user message, a list is checked as a conversation."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {key!r}: the prompt is empty")
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        msgs = check_messages(value, where, key)
        if msgs[-1]["role"] == "assistant" and len(msgs) == 1:
            raise DataError(f"{where}: field {key!r}: a prompt needs a message before an assistant prefill")
        return msgs
    raise DataError(
        f"{where}: field {key!r} must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


def response_text(value: Any, where: str, key: str) -> str:
    """A response field as text: a string, or one assistant message (DARE's chosen / rejected)."""
    if isinstance(value, list):
        msgs = check_messages(value, where, key)
        if len(msgs) != 1 or msgs[0]["role"] != "assistant":
            raise DataError(
                f"{where}: field {key!r}: expected a string or one assistant message, got {[m['role'] for m in msgs]}"
            )
        value = msgs[0]["content"]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {key!r}: the response is empty")
    return value


def encode_text(tok: Tokenizer, text: str, where: str, field: str) -> list[int]:
    """``tok.encode(text)``; a tokenizer error becomes a DataError naming the field."""
    try:
        return list(tok.encode(text))
    except ValueError as e:
        raise DataError(f"{where}: field {field!r}: {e}") from e


def render_prompt(
    tok: Tokenizer, messages: list[dict], where: str, field: str, prefill: bool = True
) -> tuple[list[int], str]:
    """(prompt ids, prefill): the chat template up to the assistant's turn, which a trailing assistant message
    starts (its text is the prefill the response continues; "" when there is none). Without ``prefill`` every
    message is a closed turn and the generation prompt opens a new one, as verl renders (:func:`renders_as_verl`)."""
    continues = prefill and messages[-1]["role"] == "assistant"
    try:
        return list(tok.chat_prompt(messages, continue_final=continues)), messages[-1]["content"] if continues else ""
    except ValueError as e:
        raise DataError(f"{where}: field {field!r}: {e}") from e


def is_verl_row(rec: dict) -> bool:
    """A verl / DARE row: ``prompt`` is a list of messages and ``reward_model`` an object."""
    return isinstance(rec.get("prompt"), list) and isinstance(rec.get("reward_model"), dict)


def renders_as_verl(rec: dict, key: str) -> bool:
    """Whether the prompt in field ``key`` of ``rec`` is a verl / DARE row's, rendered as verl's RLHFDataset renders
    it: the whole message list with the generation prompt, a trailing assistant message closed
    (``rl_dataset.py:221`` of DARE @83ae8a3), so prompt ids and rewards match DARE's."""
    return key == "prompt" and is_verl_row(rec)
