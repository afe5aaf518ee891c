"""Tokenizers: both backends, chat templates, EOS ids, UTF-8-safe streaming."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ASSET

from pocket_mlx.engine.tokenizer import Tokenizer
from pocket_mlx.errors import PocketError

TEXTS = ["床前明月光，疑是地上霜。举头望明月，低头思故乡。", "Fortune 🍀🎉 smiles on the bold 👩‍🚀!",
         "def f(x):\n    return x  # 注释 ✓\n"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(ASSET, json.loads((ASSET / "config.json").read_text()))


def stream(tokenizer, ids):
    d = tokenizer.detokenizer()
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_half_a_character(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    # Multi-byte characters really are split across tokens here, so the test means something.
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids) or text.isascii()


def test_eos_ids_from_config_generation_config_and_tokenizer(tok):
    assert set(tok.eos_token_ids) == {8191, 8189}
    assert tok.token_to_id("<|im_end|>") == 8191


def test_chat_template_from_jinja_file_and_from_tokenizer_config(tok, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / f, tmp_path / f)  # no chat_template.jinja: the config's template
    assert Tokenizer(tmp_path).apply_chat_template(msgs) == text


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(PocketError, match="no tokenizer"):
        Tokenizer(tmp_path)


def test_sentencepiece_backend(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 50 + ["In the beginning God created the heaven."] * 50))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=400,
        character_coverage=0.98, byte_fallback=True, model_type="bpe",
        eos_id=2, bos_id=1, unk_id=0, normalization_rule_name="identity",
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True,
         "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"}))
    t = Tokenizer(tmp_path)
    ids = t.encode(TEXTS[0])
    assert ids[0] == 1  # bos added as the config asks
    assert t.decode(ids) == TEXTS[0]
    assert "".join(stream(t, ids)) == TEXTS[0]
    assert 2 in t.eos_token_ids
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"
