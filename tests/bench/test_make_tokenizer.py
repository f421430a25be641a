"""bench/make_tokenizer.py: a BPE trained offline, padded to a given vocabulary size, that the
training example loads as a local tokenizer folder."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "fp8boost" / "data" / "sample.txt"


def test_padded_vocabulary_roundtrips_text_and_never_emits_padding(tmp_path):
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import make_tokenizer
        from data import HFTokenizer
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.path.remove(str(ROOT / "examples"))
    info = make_tokenizer.build(SAMPLE, 3000, tmp_path / "tok", bpe_vocab=800)
    assert info["vocab"] == 3000 and info["learned"] <= 800
    tok = HFTokenizer(tmp_path / "tok")  # what examples/train_llama.py --tokenizer loads
    assert tok.vocab_size == 3000
    ids = tok.encode_file(SAMPLE)
    assert int(ids.max()) < info["learned"]  # text never maps to a padding token
    text = SAMPLE.read_text(encoding="utf-8")[:2000]
    assert tok.decode(tok.tok(text, add_special_tokens=False)["input_ids"]) == text
    assert json.loads((tmp_path / "tok" / "MADE_BY.json").read_text())["vocab"] == 3000
