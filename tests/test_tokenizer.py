"""ByteTokenizer, the HF tokenizer files written for synthetic checkpoints, and chat encoding."""
from __future__ import annotations

import pytest

from ds4.tokenizer import (ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, ByteTokenizer, HFTokenizer,
                           encode_chat, load_tokenizer, write_tokenizer_files)

TEXTS = ["Hello, world!", "  two  spaces\tand\nnewlines\n", "héllo 世界 🙂", "", "a<think>b</think>c",
         f"{BOS}sys{USER}hi{ASSISTANT}{THINK_END}ok{EOS}"]


def test_byte_roundtrip():
    tok = ByteTokenizer(512)
    for s in TEXTS:
        ids = tok.encode(s)
        assert all(0 <= i < 262 for i in ids)
        assert tok.decode(ids, skip_special=False) == s
    assert tok.encode("AB") == [6 + 65, 6 + 66]
    assert tok.decode(tok.encode("héllo", add_bos=True)) == "héllo"


def test_byte_special_tokens():
    tok = ByteTokenizer(300)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.encode(BOS + EOS + USER + ASSISTANT + THINK_START + THINK_END) == [0, 1, 2, 3, 4, 5]
    assert tok.encode("x", add_bos=True) == [0, 6 + ord("x")]
    ids = tok.encode(f"{USER}hi{ASSISTANT}")
    assert ids == [2, 6 + ord("h"), 6 + ord("i"), 3]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == f"{USER}hi{ASSISTANT}"
    assert tok.decode([6 + ord("a"), 300, 6 + ord("b")]) == "ab"  # unused ids print nothing


def test_byte_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size >= 262"):
        ByteTokenizer(200)
    with pytest.raises(ValueError, match="vocab_size >= 262"):
        load_tokenizer(None, 100)


def test_load_tokenizer_fallback(tmp_path):
    assert isinstance(load_tokenizer(None, 512), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path, 512), ByteTokenizer)  # no tokenizer files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    return d


def test_autotokenizer_agrees_with_byte_tokenizer(hf_dir):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    assert auto.bos_token_id == 0 and auto.eos_token_id == 1 and len(auto) == 262
    byte = ByteTokenizer(512)
    for s in TEXTS:
        assert auto.encode(s, add_special_tokens=False) == byte.encode(s), s
    hf = load_tokenizer(hf_dir, 512)
    assert isinstance(hf, HFTokenizer) and (hf.bos_id, hf.eos_id) == (0, 1)
    for s in TEXTS:
        ids = hf.encode(s, add_bos=True)
        assert ids == byte.encode(s, add_bos=True)
        assert hf.decode(ids) == byte.decode(ids)
        assert hf.decode(ids, skip_special=False) == byte.decode(ids, skip_special=False)


def test_hf_tokenizer_larger_than_model_vocab(hf_dir):
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        load_tokenizer(hf_dir, 261)


def test_chat_single_turn():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert encode_chat(msgs) == f"{BOS}Be brief.{USER}Hi?{ASSISTANT}{THINK_END}"
    assert encode_chat(msgs, thinking=True) == f"{BOS}Be brief.{USER}Hi?{ASSISTANT}{THINK_START}"
    assert encode_chat(msgs[1:]) == f"{BOS}{USER}Hi?{ASSISTANT}{THINK_END}"


def test_chat_multi_turn():
    msgs = [{"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "add"},
            {"role": "user", "content": "and 2+2?"}]
    assert encode_chat(msgs) == f"{BOS}{USER}1+1?{ASSISTANT}{THINK_END}2{EOS}{USER}and 2+2?{ASSISTANT}{THINK_END}"
    # earlier reasoning is dropped; only the last user turn opens <think>
    assert encode_chat(msgs, thinking=True) == \
        f"{BOS}{USER}1+1?{ASSISTANT}{THINK_END}2{EOS}{USER}and 2+2?{ASSISTANT}{THINK_START}"
    # an assistant turn after the last user turn keeps its reasoning in thinking mode
    msgs2 = msgs[:2]
    assert encode_chat(msgs2, thinking=True) == f"{BOS}{USER}1+1?{ASSISTANT}{THINK_START}add{THINK_END}2{EOS}"
    assert encode_chat(msgs2) == f"{BOS}{USER}1+1?{ASSISTANT}{THINK_END}2{EOS}"
    with pytest.raises(ValueError, match="unsupported role"):
        encode_chat([{"role": "tool", "content": "x"}])


def test_chat_ids_via_tokenizer():
    tok = ByteTokenizer(512)
    ids = tok.encode(tok.encode_chat([{"role": "user", "content": "hi"}]))
    assert ids == [0, 2, 6 + ord("h"), 6 + ord("i"), 3, 5]


def test_chat_consecutive_user_turns_merge():
    """encode_messages' merge_tool_messages step makes consecutive user turns one turn, joined by a blank line."""
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_chat(msgs) == f"{BOS}{USER}a\n\nb{ASSISTANT}{THINK_END}"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "r1", "reasoning_content": "t1"},
            {"role": "user", "content": "q2a"}, {"role": "user", "content": "q2b"}]
    assert encode_chat(msgs, thinking=True) == \
        f"{BOS}S{USER}q1{ASSISTANT}{THINK_END}r1{EOS}{USER}q2a\n\nq2b{ASSISTANT}{THINK_START}"


@pytest.mark.parametrize("bad", ["hi", [("user", "hi")], [{"role": "user", "content": ["hi"]}],
                                 [{"content": "hi"}]])
def test_chat_bad_messages(bad):
    with pytest.raises(ValueError, match="encode_chat"):
        encode_chat(bad)


def test_decode_joins_bytes_around_skipped_ids(hf_dir):
    """A skipped special id or an unused id between the bytes of one character: both tokenizers print it whole."""
    pytest.importorskip("transformers")
    hf, byte = load_tokenizer(hf_dir, 512), ByteTokenizer(512)
    e = [6 + b for b in "é".encode()]
    for mid in (1, 3, 5, 300):
        ids = [e[0], mid, e[1]]
        assert byte.decode(ids) == hf.decode(ids) == "é", mid
        assert byte.decode(ids, skip_special=False) == hf.decode(ids, skip_special=False)
