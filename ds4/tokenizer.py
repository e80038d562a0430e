"""Tokenizers and the DeepSeek-V4 chat encoding (spec §12).

`load_tokenizer(path, vocab_size)` returns the checkpoint's HF fast tokenizer when the directory
has tokenizer files (loaded offline, no remote code), else the built-in `ByteTokenizer`:

    id 0 `<｜begin▁of▁sentence｜>` (bos), 1 `<｜end▁of▁sentence｜>` (eos), 2 `<｜User｜>`,
    3 `<｜Assistant｜>`, 4 `<think>`, 5 `</think>`, then byte b -> id 6 + b (262 ids in all).

`write_tokenizer_files` writes the same tokenizer as `tokenizer.json` + `tokenizer_config.json`
(byte-level BPE without merges), so `AutoTokenizer` on a synthetic checkpoint gives exactly the
ByteTokenizer ids for any text.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
BYTE_OFFSET = len(SPECIAL_TOKENS)
BYTE_VOCAB = BYTE_OFFSET + 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _checked_messages(messages) -> list[dict]:
    """The conversation as encode_messages sees it after its merge_tool_messages step (for plain turns):
    consecutive user turns become one user turn whose texts are joined with a blank line."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError("encode_chat: messages must be a list of {'role', 'content'} dicts, "
                         f"got {type(messages).__name__}")
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"encode_chat: message {i} must be a dict with 'role' and 'content', "
                             f"got {type(m).__name__}")
        role = m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"encode_chat: unsupported role {role!r} (system, user, assistant)")
        for key in ("content", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"encode_chat: message {i} {key} must be a string, got {type(m[key]).__name__}")
        if role == "user" and out and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + (m.get("content") or "")}
        else:
            out.append({**m, "content": m.get("content") or ""})
    return out


def encode_chat(messages: list[dict], thinking: bool = False) -> str:
    """Prompt text for a conversation, as `encode_messages(..., thinking_mode)` of the official
    encoding_dsv4 builds it for plain system/user/assistant turns (no tools, drop_thinking):

    `<bos>{system}<｜User｜>{user}<｜Assistant｜></think>` in chat mode; thinking mode ends the last
    user turn with `<think>` instead. Earlier assistant turns are `{content}<eos>` after their
    `</think>` (their reasoning is dropped); an assistant turn after the last user turn keeps
    `{reasoning_content}</think>` in thinking mode. Consecutive user turns are one user turn, their
    texts joined with a blank line (the official merge_tool_messages step)."""
    messages = _checked_messages(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = BOS
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role == "system":
            out += content
        elif role == "user":
            out += USER + content
            if nxt in (None, "assistant"):
                out += ASSISTANT + (THINK_START if thinking and i >= last_user else THINK_END)
        else:  # assistant
            if thinking and i > last_user:
                out += (m.get("reasoning_content") or "") + THINK_END
            out += content + EOS
    return out


class ByteTokenizer:
    """Special tokens + one token per byte; needs vocab_size >= 262."""

    name = "byte"
    bos_id = 0
    eos_id = 1

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"the built-in byte tokenizer needs vocab_size >= {BYTE_VOCAB} "
                             f"({BYTE_OFFSET} special tokens + 256 bytes), the model has {vocab_size}; "
                             "use a checkpoint with tokenizer files")
        self.vocab_size = vocab_size
        self._special = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    def __len__(self) -> int:
        return BYTE_VOCAB

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for part in self._split.split(text):
            if part in self._special:
                ids.append(self._special[part])
            elif part:
                ids.extend(BYTE_OFFSET + b for b in part.encode("utf-8"))
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if BYTE_OFFSET <= i < BYTE_VOCAB:
                buf.append(i - BYTE_OFFSET)
                continue
            if 0 <= i < BYTE_OFFSET and not skip_special:
                if buf:
                    out.append(buf.decode("utf-8", errors="replace"))
                    buf = bytearray()
                out.append(SPECIAL_TOKENS[i])
            # skipped special ids and unused model ids (past the byte range) print nothing and, as in the HF
            # byte-level decoder, do not split the bytes around them
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: list[dict], thinking: bool = False) -> str:
        return encode_chat(messages, thinking)


class HFTokenizer:
    """A transformers tokenizer behind the ByteTokenizer interface (the chat encoder adds BOS)."""

    def __init__(self, tok, path: str):
        self.tok = tok
        self.name = f"hf:{path}"
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else tok.convert_tokens_to_ids(BOS)
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.convert_tokens_to_ids(EOS)

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if add_bos else []) + list(ids)

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def encode_chat(self, messages: list[dict], thinking: bool = False) -> str:
        return encode_chat(messages, thinking)


def has_tokenizer_files(path: str | os.PathLike | None) -> bool:
    return path is not None and any((Path(path).expanduser() / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """The checkpoint's tokenizer (offline, no remote code) or the built-in ByteTokenizer."""
    if not has_tokenizer_files(path):
        return ByteTokenizer(vocab_size)
    path = Path(path).expanduser()  # `~/ckpt`, as the weights' path takes it
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if len(tok) > vocab_size:
        raise ValueError(f"tokenizer at {path} has {len(tok)} tokens, more than the model's vocab_size {vocab_size}")
    return HFTokenizer(tok, str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table used by byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tokenizer_files(path: str | os.PathLike, model_max_length: int = 1048576) -> None:
    """Write the ByteTokenizer as HF `tokenizer.json` + `tokenizer_config.json` into `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab |= {chars[b]: BYTE_OFFSET + b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)


__all__ = ["BOS", "EOS", "USER", "ASSISTANT", "THINK_START", "THINK_END", "SPECIAL_TOKENS", "ByteTokenizer",
           "HFTokenizer", "load_tokenizer", "encode_chat", "write_tokenizer_files"]
