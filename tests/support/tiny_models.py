"""Tiny random HF models and a locally trained tokenizer: no download.

Each builder saves a complete model directory (config, weights, tokenizer,
chat template) so tests go through the same loading path as `--model DIR`.
The chat template is the product's own fallback (server/serving_chat.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from models.chat_template import CHATML_TEMPLATE

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Hello world! How are you today? I am fine, thank you.",
    "Caf\u00e9 na\u00efve \u2014 \u00fcber \u65e5\u672c\u8a9e \U0001f600 emoji and accents.",
    "for i in range(10):\n    print(i * i)\n",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z 0 1 2 3 4 5 6 7 8 9",
] * 20

# architecture -> (config class, model class, default layers, default seed, what differs in the config)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, 4, 0, {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 3, 1, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _save(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_model(
    path: Path, architecture: str = "llama", num_layers: int | None = None, seed: int | None = None
) -> Path:
    """A random `architecture` model (see ARCHITECTURES: llama, 4 layers, seed 0; qwen2, 3 layers, seed 1),
    hidden size 64, 4 heads, 512 positions, with sharpened logits, saved to `path`."""
    config_class, model_class, default_layers, default_seed, specific = ARCHITECTURES[architecture]
    tokenizer = build_tokenizer()
    torch.manual_seed(default_seed if seed is None else seed)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=default_layers if num_layers is None else num_layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **specific,
    )
    model = model_class(config)
    _scale_up_logits(model)
    return _save(model, tokenizer, path)


def build_draft_from(target_dir: Path, path: Path, num_layers: int = 1) -> Path:
    """A draft that is the target with only its first layers: same vocab, cheap, often right."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    return _save(model, tokenizer, path)


def build_head(
    target_dir: Path, path: Path, seed: int = 0, draft_vocab: list[int] | None = None, fused: bool = False
) -> Path:
    """An untrained EAGLE head for the model in `target_dir` (`models.eagle_head.new_head`, draft
    vocabulary `draft_vocab`, default every token; `fused`: over the fused layers' states, else the
    last hidden state), its weights perturbed by a seeded generator so its drafts depend on features
    and tokens and are neither trivial nor always right; saved in float32 with `save_head`."""
    from models.eagle_head import TRAINED, fused_feature_layers, new_head, save_head

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(vocab) if draft_vocab is None else torch.tensor(sorted(draft_vocab))
    head = new_head(model, ids, fused_feature_layers(model.config.num_hidden_layers) if fused else None)
    generator = torch.Generator().manual_seed(seed)
    hidden, embed_std = head.config.hidden_size, float(model.get_input_embeddings().weight.detach().std())
    with torch.no_grad():
        # A token path as strong as the feature path (embeddings are ~0.02, final hidden states ~1).
        head.fc.weight[:, :hidden] += torch.randn(hidden, hidden, generator=generator) / (embed_std * hidden**0.5)
        for name, weight in head.named_parameters():
            if name.startswith(TRAINED) and weight.dim() == 2:
                weight.add_(torch.randn(weight.shape, generator=generator) * 0.5 / weight.shape[1] ** 0.5)
    save_head(head, path, dtype=torch.float32)
    return path


def _scale_up_logits(model) -> None:
    """Random init gives near-uniform logits; sharpen them so greedy argmax is
    well separated (exactness tests then compare real decisions, not ties)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
