"""Data: tokenizers, record files (with each record's file:row), SFT / RL prompt / preference records in megadare's
and verl / DARE's schemas, and deterministic synthetic tasks."""

from __future__ import annotations

from megadare.data.sft_data import (
    OVERLONG_CHOICES,
    DataError,
    SFTExample,
    build_sft_examples,
    load_records,
    record_to_example,
)
from megadare.data.files import load_many, load_rows
from megadare.data.preference_data import PreferenceExample, load_preference_examples
from megadare.data.synthetic import addition_task, exact_match
from megadare.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "DataError",
    "SFTExample",
    "OVERLONG_CHOICES",
    "load_records",
    "load_rows",
    "load_many",
    "PreferenceExample",
    "load_preference_examples",
    "record_to_example",
    "build_sft_examples",
    "addition_task",
    "exact_match",
]
