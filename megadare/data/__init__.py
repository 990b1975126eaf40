"""SFT data: tokenizers, record loading and tokenization, and deterministic synthetic tasks."""
from __future__ import annotations

from megadare.data.sft_data import (
    OVERLONG_CHOICES,
    DataError,
    SFTExample,
    build_sft_examples,
    load_records,
    record_to_example,
)
from megadare.data.synthetic import addition_task, exact_match, write_jsonl
from megadare.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "DataError",
    "SFTExample",
    "OVERLONG_CHOICES",
    "load_records",
    "record_to_example",
    "build_sft_examples",
    "addition_task",
    "write_jsonl",
    "exact_match",
]
