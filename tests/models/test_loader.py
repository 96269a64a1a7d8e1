"""models.loader: local dirs, Hub ids offline, the GGUF conversion cache, draft checks."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import logging
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import cpu_kernels, gguf_cache, loader, quantized, weights
from models.loader import (
    DEFAULT_MODEL_ID,
    LoadedModel,
    ModelConfig,
    ModelLoadError,
    check_draft_compatible,
    load_model,
    resolve_device,
    resolve_dtype,
)
from tests.support.tiny_models import build_draft_from, build_tiny_model, build_tokenizer

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    llama = build_tiny_model(root / "llama", "llama")
    return {
        "llama": llama,
        "qwen2": build_tiny_model(root / "qwen2", "qwen2"),
        "llama-draft": build_draft_from(llama, root / "llama-draft"),
    }


def _logits(loaded: LoadedModel, text: str = PROMPT) -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids.to(loaded.device)
    with torch.no_grad():
        return loaded.model(ids).logits  # [1, seq, vocab]


def test_config_rejects_unknown_dtype_and_device():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        ModelConfig(dtype="fp8")
    with pytest.raises(ValueError, match="device must be"):
        ModelConfig(device="tpu")
    with pytest.raises(ValueError, match="model must be"):
        ModelConfig(model=" ")
    assert ModelConfig(cache_dir="~/x").cache_dir == Path.home() / "x"


def test_resolve_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_resolve_dtype(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype("float32", cuda) is torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", cuda) is torch.bfloat16
    monkeypatch.setattr(loader, "_cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(loader, "_cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) is torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", cpu)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_local_directory_matches_plain_transformers(tiny_dirs, arch):
    path = tiny_dirs[arch]
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert loaded.model_id == str(path)
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype is loaded.dtype is torch.float32
    assert loaded.device == torch.device("cpu")
    assert loaded.vocab_size == len(loaded.tokenizer) == reference.config.vocab_size
    assert loaded.max_position_embeddings == 512
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(_logits(loaded), reference(ids).logits)


def test_dtype_is_applied(tiny_dirs):
    loaded = load_model(ModelConfig(model=str(tiny_dirs["llama"]), dtype="bfloat16", device="cpu"))
    assert loaded.dtype is torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_eos_ids_are_the_union_of_generation_config_and_tokenizer(tiny_dirs, tmp_path):
    path = build_draft_from(tiny_dirs["llama"], tmp_path / "multi-eos")
    gen_config = path / "generation_config.json"
    gen_config.write_text(gen_config.read_text().replace('"eos_token_id": 2', '"eos_token_id": [0, 2, 0]'))
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))
    assert loaded.eos_token_ids == [0, 2]


def test_missing_local_directory_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no such local directory") as info:
        load_model(ModelConfig(model=missing, device="cpu"))
    assert missing in str(info.value)
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(ModelConfig(model=str(tmp_path / "x.gguf"), device="cpu"))


def test_unknown_hub_id_offline_names_the_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="specd-tests/no-such-model") as info:
        load_model(ModelConfig(model="specd-tests/no-such-model", device="cpu"))
    assert "HF_HUB_OFFLINE" in str(info.value)


# --- draft compatibility ---------------------------------------------------


@pytest.fixture(scope="module")
def target_and_draft(tiny_dirs) -> tuple[LoadedModel, LoadedModel]:
    target = load_model(ModelConfig(model=str(tiny_dirs["llama"]), dtype="float32", device="cpu"))
    draft = load_model(ModelConfig(model=str(tiny_dirs["llama-draft"]), dtype="float32", device="cpu"))
    return target, draft


def test_draft_with_same_tokenizer_is_compatible(target_and_draft):
    target, draft = target_and_draft
    assert check_draft_compatible(target, draft) is None  # accepted: it raises on a mismatch
    # Padded output embeddings (more rows than tokenizer ids) are accepted.
    assert check_draft_compatible(target, dataclasses.replace(draft, vocab_size=draft.vocab_size + 64)) is None
    # The same draft one row short of the tokenizer's largest id is refused: the check is live.
    max_id = max(draft.tokenizer.get_vocab().values())
    with pytest.raises(ValueError, match=f"the draft embeds only {max_id} tokens"):
        check_draft_compatible(target, dataclasses.replace(draft, vocab_size=max_id))


def test_draft_with_other_vocabulary_is_refused(target_and_draft):
    target, draft = target_and_draft
    other = dataclasses.replace(draft, model_id="other-draft", tokenizer=build_tokenizer(vocab_size=300))
    with pytest.raises(ValueError, match="draft model other-draft is incompatible with target .*: tokenizer"):
        check_draft_compatible(target, other)


def test_draft_with_other_eos_is_refused(target_and_draft):
    target, draft = target_and_draft
    tokenizer = copy.deepcopy(draft.tokenizer)
    tokenizer.eos_token = "<|endoftext|>"
    with pytest.raises(ValueError, match="eos_token_id differs"):
        check_draft_compatible(target, dataclasses.replace(draft, tokenizer=tokenizer))
    with pytest.raises(ValueError, match="eos token ids differ"):
        check_draft_compatible(target, dataclasses.replace(draft, eos_token_ids=[2, 0]))


def test_draft_too_small_for_the_tokenizer_is_refused(target_and_draft):
    target, draft = target_and_draft
    with pytest.raises(ValueError, match="the draft embeds only 100 tokens"):
        check_draft_compatible(target, dataclasses.replace(draft, vocab_size=100))


# --- GGUF conversion cache: a stand-in converter keeps these fast ---------


@pytest.fixture
def fake_gguf(tiny_dirs, tmp_path, monkeypatch) -> dict:
    """A `.gguf` path whose "conversion" yields the tiny Qwen2 (tied embeddings)."""
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    calls = []

    def convert(source: Path):
        calls.append(source)
        model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"], dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(tiny_dirs["qwen2"])

    monkeypatch.setattr(gguf_cache, "_gguf_to_hf", convert)
    cfg = ModelConfig(model=str(path), dtype="float32", device="cpu", cache_dir=tmp_path / "cache")
    return {"cfg": cfg, "calls": calls, "models_dir": tmp_path / "cache" / "models"}


def _cache_entries(models_dir: Path) -> list[Path]:
    return sorted(models_dir.iterdir())


def test_gguf_conversion_is_cached_and_reused(fake_gguf, tiny_dirs):
    first = load_model(fake_gguf["cfg"])
    second = load_model(fake_gguf["cfg"])

    assert len(fake_gguf["calls"]) == 1
    [entry] = _cache_entries(fake_gguf["models_dir"])  # no temp dir left behind
    assert entry.name.startswith("tiny-") and (entry / "specd-cache.json").is_file()
    # A complete transformers model directory: other tools pick the class from config.json.
    assert json.loads((entry / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert first.model_id == fake_gguf["cfg"].model
    model = second.model
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    reference = load_model(ModelConfig(model=str(tiny_dirs["qwen2"]), dtype="float32", device="cpu"))
    assert torch.equal(_logits(second), _logits(reference))


@pytest.mark.parametrize("damage", ["truncate weights", "drop marker", "drop codes"])
def test_broken_gguf_cache_is_rebuilt(fake_gguf, damage):
    load_model(dataclasses.replace(fake_gguf["cfg"], weights="int8"))
    [entry] = _cache_entries(fake_gguf["models_dir"])
    if damage == "truncate weights":
        (entry / "model.safetensors").write_bytes(b"\0" * 16)
    elif damage == "drop marker":
        (entry / "specd-cache.json").unlink()
    else:  # a packed cache without its codes must not load as a transformers directory (random layers)
        if not (entry / "quantized.safetensors").is_file():
            pytest.skip("specd's int4/int8 kernels are not built here: the cache is dense")
        (entry / "quantized.safetensors").unlink()

    loaded = load_model(dataclasses.replace(fake_gguf["cfg"], weights="int8"))
    assert len(fake_gguf["calls"]) == 2
    assert _cache_entries(fake_gguf["models_dir"]) == [entry]
    assert torch.isfinite(_logits(loaded)).all()


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOMEM, "Cannot allocate memory"), RuntimeError("Error while deserializing: Cannot allocate memory "
     "(os error 12)"), RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")],
)  # fmt: skip
def test_an_allocation_failure_keeps_the_cache(fake_gguf, monkeypatch, failure):
    """Out of memory while reading a good cache says so; it does not delete the cache and convert again."""
    load_model(fake_gguf["cfg"])
    [entry] = _cache_entries(fake_gguf["models_dir"])

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(loader, "_load_converted", fail)
    with pytest.raises(type(failure)):
        load_model(fake_gguf["cfg"])
    assert len(fake_gguf["calls"]) == 1 and _cache_entries(fake_gguf["models_dir"]) == [entry]
    assert (entry / "specd-cache.json").is_file()


def test_a_load_cut_short_by_the_exit_keeps_the_cache(fake_gguf, monkeypatch):
    """A server stopped while it loads: its main thread returns, and the load thread's read of a good
    cache fails in a thread pool that refuses work. The failure is raised; the cache stays, unconverted."""
    load_model(fake_gguf["cfg"])
    [entry] = _cache_entries(fake_gguf["models_dir"])
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    monkeypatch.setattr(loader.threading, "main_thread", lambda: finished)

    def fail(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(loader, "_load_converted", fail)
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        load_model(fake_gguf["cfg"])
    assert len(fake_gguf["calls"]) == 1 and _cache_entries(fake_gguf["models_dir"]) == [entry]
    assert (entry / "specd-cache.json").is_file()


@pytest.mark.parametrize("fmt", ["int8", "int6", "int4"])
def test_a_quantized_conversion_is_cached_packed_and_serves_the_same_model(fake_gguf, tiny_dirs, fmt):
    if not quantized.kernels_available() and not cpu_kernels.load(fake_gguf["cfg"].cache_dir):
        pytest.skip("specd's weight-only kernels are not built here")
    cfg = dataclasses.replace(fake_gguf["cfg"], weights=fmt, tune_kernels=False)
    first, second = load_model(cfg), load_model(cfg)

    assert len(fake_gguf["calls"]) == 1
    [entry] = _cache_entries(fake_gguf["models_dir"])
    assert entry.name.endswith(f"-{fmt}")
    layers = weights.load_layers(entry / "quantized.safetensors")
    assert layers and {layer.fmt for layer in layers.values()} == {fmt}
    with safe_open(str(entry / "model.safetensors"), framework="pt") as f:
        dense = set(f.keys())
    assert not dense & {f"{name}.weight" for name in layers}  # stored once, as codes
    assert "model.embed_tokens.weight" in dense
    # What a load that quantizes the float checkpoint serves, bit for bit (float32).
    reference = load_model(ModelConfig(str(tiny_dirs["qwen2"]), dtype="float32", device="cpu", weights=fmt,
                                       tune_kernels=False))  # fmt: skip
    assert torch.equal(_logits(first), _logits(reference)) and torch.equal(_logits(second), _logits(reference))
    model = second.model
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    modules = dict(model.named_modules())
    served = {name: modules[name].quantized_weight for name in layers if modules[name].quantized_weight}
    assert any(name.endswith("o_proj") for name in served)  # q/k/v and gate/up are fused: theirs moved
    for name, kept in served.items():
        assert all(torch.equal(a, b) for a, b in zip(kept.tensors, layers[name].tensors, strict=True))


def test_failed_conversion_leaves_no_cache(fake_gguf, monkeypatch):
    def crash(model, tokenizer, out: Path, layers=None):
        (out / "config.json").write_text("{")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_cache, "_save_converted", crash)
    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        load_model(fake_gguf["cfg"])
    assert _cache_entries(fake_gguf["models_dir"]) == []


# --- the real default model ------------------------------------------------


def test_default_smollm2_gguf_converts_once_then_loads_from_cache(tmp_path, monkeypatch, caplog):
    """~20 s: the one real GGUF conversion in the suite."""
    converted_logits = []
    convert = gguf_cache._gguf_to_hf

    def spy(path: Path):
        model, tokenizer = convert(path)
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            converted_logits.append(model(ids).logits)
        return model, tokenizer

    monkeypatch.setattr(gguf_cache, "_gguf_to_hf", spy)
    # Weights, not kernels: the tuned GEMM layouts would change the last bits of the logits, and
    # quantized layers round their input rows to int8 (dense weights: the file's values as converted).
    cfg = ModelConfig(dtype="float32", device="cpu", cache_dir=tmp_path, tune_kernels=False, weights="bf16")
    with caplog.at_level(logging.INFO, logger="specd.models"):
        first = load_model(cfg)
        second = load_model(cfg)

    assert len(converted_logits) == 1
    assert sum("converting GGUF" in r.message for r in caplog.records) == 1
    assert sum(r.message.startswith(f"loaded {DEFAULT_MODEL_ID} in ") for r in caplog.records) == 2
    assert torch.equal(_logits(first), converted_logits[0])
    assert torch.equal(_logits(second), converted_logits[0])

    assert second.model_id == DEFAULT_MODEL_ID
    assert (second.vocab_size, second.max_position_embeddings) == (49152, 8192)
    assert second.tokenizer.chat_template
    assert second.tokenizer.convert_tokens_to_ids("<|im_end|>") in second.eos_token_ids
    model = second.model
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_tied_output_projection_is_stored_under_the_embeddings_name(tiny_llama_dir):
    """Loaders that re-tie `lm_head` from `model.embed_tokens` (vLLM) must find the embedding."""
    from transformers import AutoModelForCausalLM

    from models.gguf_cache import checkpoint_tensors

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    tensors = checkpoint_tensors(model)
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    assert len(tensors) == len({t.data_ptr() for t in model.state_dict().values()})
