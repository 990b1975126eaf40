"""The Qwen byte-level BPE of SDAR / TraDo and Dream, built offline from the ranks the ``dashscope`` wheel ships.

Qwen2, Qwen2.5 and Qwen3 (hence SDAR / TraDo, which are Qwen3 weights, and Dream, Qwen2.5 weights) share one
byte-level BPE: 151,643 ranked byte strings, split first by Qwen's regex, NFC-normalised, then merged by rank, with
the family's added tokens from 151643 on. The ``dashscope`` package on PyPI (Apache-2.0, Alibaba Cloud) ships those
ranks as ``dashscope/resources/qwen.tiktoken`` (base64 bytes and rank per line). No model hub is needed:

* the vocabulary maps each rank's bytes through GPT-2's byte-to-unicode table;
* each merge is the pair that rank-ordered BPE over the token's own bytes, restricted to lower ranks, ends with
  (how minbpe's ``recover_merges`` rebuilds GPT-4's merges; tiktoken issue #60). transformers'
  ``TikTokenConverter`` lists every split of every token instead (294,166 merges, relying on ``ignore_merges``);
  this recipe gives the publishers' ``merges.txt`` itself (151,387 merges);
* ``vocab.json`` and ``merges.txt`` come out byte for byte as SDAR and Dream publish them (the test suite checks
  their git blob ids against the publishers' files), ``tokenizer.json`` is the ``tokenizers`` model over them with
  Qwen2's normaliser / pre-tokeniser / decoder, and ``tokenizer_config.json`` carries the family's specials, eos /
  pad / mask and chat template, field for field as the family's checkpoints have them (the chat templates are the
  publishers', in ``chat_templates/``: SDAR-*-Chat's ``chat_template.jinja`` and Dream-v0-Instruct-7B's).

``cached_qwen_tokenizer(family)`` builds once into ``~/.cache/megadare/tokenizers`` (a few seconds) and returns
the directory; ``megadare data tokenizer OUT --family sdar`` writes one where a user wants it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import shutil
from importlib import resources
from typing import Optional

from megadare.data.files import DataError
from megadare.files import owned_tempdir

__all__ = [
    "FAMILIES",
    "QWEN_PATTERN",
    "QWEN_RANKS",
    "qwen_ranks_path",
    "qwen_ranks",
    "qwen_merges",
    "write_qwen_tokenizer",
    "cached_qwen_tokenizer",
]

QWEN_RANKS = 151643
# Qwen's pre-tokeniser (dashscope/tokenizers/qwen_tokenizer.py PAT_STR; Qwen2's tokenizer.json Split): digits one by
# one, unlike cl100k's \p{N}{1,3}
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BUILD_VERSION = 1  # part of the cache key: bump when the files written change

# (content, special) from 151643 on, as the publishers' tokenizer_config.json added_tokens_decoder has them
_QWEN2_ADDED = [
    (t, True)
    for t in (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
] + [
    (t, False)
    for t in (
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    )
]
_QWEN2_SPECIAL = [t for t, special in _QWEN2_ADDED if special and t != "<|endoftext|>"]

# family -> its checkpoints' tokenizer files (SDAR-1dot7B/4B/8B-Chat; Dream-v0-Instruct-7B). SDAR's mask token is
# "<|MASK|>" = 151669 (tokenizer_config.json; its added_tokens.json / special_tokens_map.json spell it "<MASK>",
# which nothing reads when tokenizer_config.json has added_tokens_decoder). Dream ships no tokenizer.json: its
# DreamTokenizer (remote code, Qwen2Tokenizer copied) reads vocab.json + merges.txt, and so does the layout here.
FAMILIES: dict[str, dict] = {
    "sdar": {
        "added": _QWEN2_ADDED
        + [(t, False) for t in ("<tool_response>", "</tool_response>", "<think>", "</think>", "<|MASK|>")],
        "config": {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": _QWEN2_SPECIAL + ["<|MASK|>"],
            "auto_map": {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]},
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "mask_token": "<|MASK|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
        "template": "sdar.jinja",
        "template_file": True,
        "tokenizer_json": True,
    },
    "dream": {
        "added": _QWEN2_ADDED + [("<|beginoftext|>", True), ("<|mask|>", True)],
        "config": {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
            "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
            "bos_token": "<|beginoftext|>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "mask_token": "<|mask|>",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "DreamTokenizer",
            "unk_token": None,
        },
        "template": "dream.jinja",
        "template_file": False,
        "tokenizer_json": False,
    },
}


def qwen_ranks_path() -> str:
    """Where the installed ``dashscope`` package keeps ``qwen.tiktoken`` (found without importing dashscope)."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the Qwen vocabulary comes from the dashscope wheel (dashscope/resources/qwen.tiktoken): "
            "pip install dashscope (it is in megadare's dev extra: pip install -e '.[dev]')"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "resources", "qwen.tiktoken")
    if not os.path.isfile(path):
        raise DataError(
            f"{path}: missing; this dashscope version does not ship the Qwen ranks (dashscope 1.x and "
            "2.x do: pip install -U dashscope)"
        )
    return path


def qwen_ranks(path: Optional[str] = None) -> dict[bytes, int]:
    """The 151,643 ranked byte strings of ``qwen.tiktoken``; ranks must run 0..151642 without a gap."""
    path = path or qwen_ranks_path()
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN_RANKS or sorted(ranks.values()) != list(range(QWEN_RANKS)):
        raise DataError(f"{path}: expected ranks 0..{QWEN_RANKS - 1} once each, found {len(ranks)} tokens")
    return ranks


def qwen_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Each multi-byte token's merge: rank-ordered BPE over its bytes using only lower ranks ends in two parts."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = min(((ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) != 2:
            raise DataError(f"qwen.tiktoken: token {token!r} (rank {rank}) is not a merge of two lower ranks")
        merges.append((parts[0], parts[1]))
    return merges


@functools.lru_cache(maxsize=1)
def _byte_strings(ranks_path: str, mtime: float) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json's and merges.txt's strings: bytes through GPT-2's byte-to-unicode table (kept for the next
    family built in this process: the merges take a couple of seconds)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # heavy: transformers

    ranks = qwen_ranks(ranks_path)
    table = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {text(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    return vocab, [(text(a), text(b)) for a, b in qwen_merges(ranks)]


def _backend(vocab: dict[str, int], merges: list[tuple[str, str]], added: list[tuple[str, bool]]):
    """tokenizer.json: Qwen2's BPE, NFC normaliser, regex split + byte-level pre-tokeniser, byte-level decoder."""
    from tokenizers import (  # heavy: tokenizers
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for n, (content, special) in enumerate(added):
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != QWEN_RANKS + n:
            raise DataError(f"added token {content!r} got id {tok.token_to_id(content)}, not {QWEN_RANKS + n}")
    return tok


def _config_files(family: str) -> dict[str, object]:
    """tokenizer_config.json, special_tokens_map.json and added_tokens.json of the family's checkpoints."""
    spec = FAMILIES[family]
    template = (resources.files("megadare.data") / "chat_templates" / spec["template"]).read_text(encoding="utf-8")
    added = spec["added"]
    decoder = {
        str(QWEN_RANKS + n): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for n, (t, special) in enumerate(added)
    }
    cfg = dict(spec["config"], added_tokens_decoder=decoder, chat_template=template)
    token = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    special_map = {
        "additional_special_tokens": cfg["additional_special_tokens"],
        **{k: dict(token, content=cfg[k]) for k in ("bos_token", "eos_token", "mask_token", "pad_token") if cfg.get(k)},
    }
    files: dict[str, object] = {
        "tokenizer_config.json": cfg,
        "special_tokens_map.json": special_map,
        "added_tokens.json": {t: QWEN_RANKS + n for n, (t, _) in enumerate(added)},
    }
    if spec["template_file"]:
        files["chat_template.jinja"] = template
    return files


def write_qwen_tokenizer(out: str, family: str = "sdar", ranks_path: Optional[str] = None) -> str:
    """Write the family's tokenizer files as its checkpoints hold them (vocab.json, merges.txt, tokenizer_config.json,
    special_tokens_map.json, added_tokens.json; SDAR also tokenizer.json and chat_template.jinja) into ``out``
    (created if missing; refused when it already holds one of them). Returns ``out``."""
    if family not in FAMILIES:
        raise DataError(f"no Qwen tokenizer layout for family {family!r}; one of {', '.join(FAMILIES)}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"{out}: is a file, not a directory; name a new directory for the tokenizer files")
    configs = _config_files(family)
    names = ["vocab.json", "merges.txt"] + ["tokenizer.json"] * FAMILIES[family]["tokenizer_json"] + list(configs)
    if os.path.lexists(out) and not os.path.isdir(out):
        raise DataError(f"{out}: is a file, not a directory; write the tokenizer into a new directory")
    present = [n for n in names if os.path.exists(os.path.join(out, n))]
    if present:
        raise DataError(f"{out}: already holds {', '.join(present)}; not replacing them (write into a new directory)")
    ranks_path = ranks_path or qwen_ranks_path()
    vocab, merges = _byte_strings(ranks_path, os.path.getmtime(ranks_path))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")))
    with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    if FAMILIES[family]["tokenizer_json"]:
        _backend(vocab, merges, FAMILIES[family]["added"]).save(os.path.join(out, "tokenizer.json"))
    for name, content in configs.items():
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False))
    return out


def _cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megadare", "tokenizers")


def cached_qwen_tokenizer(family: str = "sdar", cache_dir: Optional[str] = None) -> str:
    """The family's tokenizer directory under the cache (``~/.cache/megadare/tokenizers``), built on first use.
    The key is the sha256 of the installed ``qwen.tiktoken`` and the builder's version; the directory appears
    whole (built beside it, then renamed)."""
    path = qwen_ranks_path()
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    root = cache_dir or _cache_root()
    target = os.path.join(root, f"qwen-{family}-{digest}-v{BUILD_VERSION}")
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = owned_tempdir(f".qwen-{family}.", root)  # what builds killed mid-way left goes
    try:
        write_qwen_tokenizer(tmp, family, path)
        os.rename(tmp, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):  # not another process's build
            raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return target
