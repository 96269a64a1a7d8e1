"""Every control and user-defined token of a GGUF's vocabulary is an added token of the tokenizer
specd converts from it, with the GGUF's id and kind, whatever the transformers release's own
conversion kept (5.17 kept only bos/eos/pad)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models import catalogue
from models.gguf_tokenizer import gguf_added_tokens, restore_added_tokens
from models.loader import ModelConfig, default_cache_dir, default_gguf_path, local_model_dir

QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5"])
def model(request) -> str | None:
    if request.param == "qwen2.5":
        if not catalogue.is_pulled(catalogue.CATALOGUE[QWEN], default_cache_dir()):
            pytest.skip(f"{QWEN} is not pulled (specd models pull {QWEN})")
        return QWEN
    return None  # the bundled default


def gguf_of(model: str | None):
    return default_gguf_path() if model is None else catalogue.resolve(model, default_cache_dir())


def test_the_converted_tokenizer_has_every_gguf_control_token(model):
    expected = gguf_added_tokens(gguf_of(model))
    assert any(special for _, _, special in expected)
    tokenizer = AutoTokenizer.from_pretrained(local_model_dir(ModelConfig(model=model)))
    for i, text, special in expected:
        assert tokenizer.added_tokens_decoder[i].content == text
        assert tokenizer.added_tokens_decoder[i].special == special
        assert tokenizer.encode(f"a{text}b", add_special_tokens=False).count(i) == 1


def test_restoring_puts_back_what_a_conversion_dropped(model, tmp_path):
    """A tokenizer saved without its added tokens (what 5.17's conversion gave) gets them back,
    each under its own id, and a complete one is left as it is."""
    tokenizer = AutoTokenizer.from_pretrained(local_model_dir(ModelConfig(model=model)))
    assert restore_added_tokens(tokenizer, gguf_of(model)) == 0
    expected = gguf_added_tokens(gguf_of(model))
    keep = {tokenizer.convert_tokens_to_ids(t) for t in (tokenizer.eos_token, tokenizer.pad_token) if t}
    dropped = [(i, text) for i, text, _ in expected if i not in keep]
    assert dropped
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] in keep]
    stripped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))
    i, text = dropped[-1]
    assert stripped.encode(text, add_special_tokens=False) != [i]
    assert restore_added_tokens(stripped, gguf_of(model)) == len(dropped)
    for i, text in dropped:
        assert stripped.encode(f"a{text}b", add_special_tokens=False).count(i) == 1
