"""`--weights`: which layers a format quantizes, the model each serves, and speculation lossless
with respect to it (a quantized layer's dense weight holds its codes' values, so every step size
computes one model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import linear_kernels
from models.forward import lean_forward
from models.linear_kernels import QUANTIZED, KernelTable, TunedLinear, linear_layers
from models.loader import ModelConfig, default_gguf_path, load_model
from models.quantized import INT4, INT4K, INT6, INT8, Int4KWeight, Int4Weight, Int6Weight, Int8Weight, footprint
from models.weights import (
    OUTPUT,
    WEIGHTS,
    draft_formats,
    gguf_format,
    gguf_plan,
    packing_name,
    plan_for,
    quantize_layers,
    uniform_plan,
)
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from worker.builder import build_runner
from worker.runner import RunnerConfig

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "A B C D A B C D A B", "Hello world! Hello"]


def load(model_dir, weights: str, **kwargs):
    return load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu", weights=weights, **kwargs))


@pytest.mark.parametrize("fmt,kind", [("int8", Int8Weight), ("int6", Int6Weight), ("int4", Int4Weight)])
def test_a_format_quantizes_every_decoder_product_and_the_output_projection_in_int8(tiny_llama_dir, fmt, kind):
    loaded = load(tiny_llama_dir, fmt, tune_kernels=False)
    model, lean = loaded.model, lean_forward(loaded.model)
    assert lean is not None and loaded.weights == fmt
    for layer in lean.layers:
        # q, k and v stack into one copy where torch's int4 layout allows (k and v of 32 rows do
        # not fill its 64-row blocks here: one call each, one format)
        assert layer.qkv.quantized_weight.fmt == fmt and isinstance(layer.gate_up.quantized_weight, kind)
        assert isinstance(layer.o_proj.quantized_weight, kind) and isinstance(layer.down_proj.quantized_weight, kind)
        assert layer.qkv.table.layout(1) == QUANTIZED  # untimed: small steps still take the weight-only kernel
    assert isinstance(model.get_output_embeddings().quantized_weight, Int8Weight)
    dense_bytes, quantized_bytes = footprint(model, lean.fused_copies())
    assert 0 < quantized_bytes < dense_bytes


def test_bf16_and_auto_on_a_float_checkpoint_keep_every_weight_dense(tiny_llama_dir):
    for weights in ("bf16", "auto"):
        model = load(tiny_llama_dir, weights, tune_kernels=False).model
        assert not any(getattr(m, "quantized_weight", None) for m in model.modules())
        assert all(type(m) is nn.Linear for m in linear_layers(model))
    with pytest.raises(ValueError, match="weights must be one of"):
        ModelConfig(weights="int2")
    assert WEIGHTS == ("auto", "bf16", "int8", "int6", "int4")


def test_auto_on_a_gguf_keeps_each_quantized_tensor_in_its_nearest_format():
    plan = gguf_plan(default_gguf_path())  # SmolLM2-135M Q4_1: every layer 4-bit, the output tied to the embedding
    assert plan and set(plan.values()) == {INT4} and OUTPUT not in plan
    assert all(name.startswith("model.layers.") for name in plan)
    assert "model.layers.0.self_attn.q_proj" in plan and "model.layers.29.mlp.down_proj" in plan


def test_each_gguf_type_is_kept_in_the_format_that_holds_its_values():
    assert gguf_format("Q4_K") == INT4K  # its own blocks (`Int4KWeight`)
    assert [gguf_format(kind) for kind in ("Q4_0", "Q4_1", "Q3_K", "IQ4_XS")] == [INT4] * 4
    assert gguf_format("Q6_K") == gguf_format("Q5_0") == INT6  # codes times a scale
    assert gguf_format("Q5_1") == gguf_format("Q5_K") == gguf_format("Q8_0") == INT8  # a minimum, or 8 bits
    assert gguf_format("F16") is None and gguf_format("F32") is None and gguf_format("BF16") is None
    # the output projection: 6 bits or more as the file has it, a 4-bit one in int8
    assert gguf_format("Q6_K", output=True) == INT6 and gguf_format("Q4_K", output=True) == INT8


class ThreeLayers(nn.Module):
    """Linear layers of 512 inputs (whole Q4_K super-blocks) and the embedding accessors
    `quantize_layers` asks for."""

    def __init__(self):
        super().__init__()
        self.embed, self.kept, self.reordered = nn.Embedding(8, 512), nn.Linear(512, 40), nn.Linear(512, 40)
        self.head = nn.Linear(512, 8)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_a_q4_k_layer_is_read_from_its_blocks_where_they_hold_its_values(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from gguf.quants import GGMLQuantizationType, dequantize

    from tests.support.q4_k import q4_k_blocks

    blocks = q4_k_blocks(40, 512)
    model = ThreeLayers()
    values = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_K).copy())
    with torch.no_grad():
        model.kept.weight.copy_(values)
        model.reordered.weight.copy_(values.roll(1, dims=0))  # as transformers permutes a Llama GGUF's q and k
    tensor = SimpleNamespace(name="q4_k", tensor_type=SimpleNamespace(name="Q4_K"), data=blocks)
    monkeypatch.setattr("models.weights._gguf_tensors", lambda path: {"kept": tensor, "reordered": tensor})
    layers = quantize_layers(model, {"kept": INT4K, "reordered": INT4K}, tmp_path / "model.gguf")
    assert isinstance(layers["kept"], Int4KWeight) and torch.equal(layers["kept"].dense(torch.float32), values)
    assert isinstance(layers["reordered"], Int4Weight)  # requantized from its values instead
    assert isinstance(quantize_layers(model, {"kept": INT4K})["kept"], Int4Weight)  # no file to read


def test_the_plan_for_each_choice(tiny_llama_dir):
    model = load(tiny_llama_dir, "bf16", tune_kernels=False).model
    cpu = torch.device("cpu")
    assert plan_for("bf16", model, default_gguf_path(), cpu) == {}
    assert plan_for("auto", model, None, cpu) == {}
    plan = uniform_plan(model, INT4)
    assert plan[OUTPUT] == INT8 and sum(v == INT4 for v in plan.values()) == 7 * 4  # 7 linear layers x 4 layers
    assert plan_for("int4", model, None, cpu) == plan
    assert plan_for("int4", model, None, cpu, output=INT4) == {**plan, OUTPUT: INT4}
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied: the output stays dense
    assert OUTPUT not in uniform_plan(model, INT4)


def test_a_draft_model_reads_the_fewest_bytes_by_default():
    cpu = torch.device("cpu")
    assert draft_formats("auto", cpu) == (INT4, INT4)  # the output projection too
    assert draft_formats("int8", cpu) == (INT8, INT8) and draft_formats("bf16", cpu) == ("bf16", None)
    assert draft_formats("auto", torch.device("cuda")) == ("bf16", None)  # no weight-only kernels there
    # a packed cache per output format; the target's own choices keep their names
    assert packing_name("int4", None) == packing_name("int4", INT8) == "int4"
    assert packing_name("int4", INT4) == "int4-int4-output" and packing_name("auto", None) == "auto"


def test_a_draft_model_loads_in_its_own_format(tiny_llama_dir, tiny_draft_dir):
    target = load(tiny_llama_dir, "auto", tune_kernels=False)  # a float checkpoint: dense
    runner = build_runner(target, RunnerConfig(max_num_seqs=2, max_model_len=64), ProposerConfig("draft_model",
                          str(tiny_draft_dir)))  # fmt: skip
    draft = runner.proposer.draft.model
    assert isinstance(draft.get_output_embeddings().quantized_weight, Int4Weight)
    assert lean_forward(draft).layers[0].gate_up.quantized_weight.fmt == INT4
    assert not any(getattr(m, "quantized_weight", None) for m in target.model.modules())


@pytest.mark.parametrize("fmt", ["int8", "int6", "int4"])
def test_every_step_size_serves_one_model(tiny_llama_dir, fmt):
    """One token through the weight-only kernels, the same tokens in one dense forward: the
    quantized model either way (rounding apart)."""
    loaded = load(tiny_llama_dir, fmt, tune_kernels=False)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.inference_mode():
        dense = loaded.model(input_ids=ids).logits[0, -1]
        for layer in linear_layers(loaded.model):
            if isinstance(layer, TunedLinear) and layer.quantized_weight is not None:
                layer.kernel_table = KernelTable((QUANTIZED,) * 45, (1.0,) * 45)
        # transformers' forward on the same layers, now all through the weight-only kernel
        # (fused members keep none: the output projection and o/down run weight-only)
        weight_only = loaded.model(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(weight_only, dense, rtol=1e-3, atol=1e-3)
    reference = load(tiny_llama_dir, "bf16", tune_kernels=False).model
    with torch.inference_mode():
        float_logits = reference(input_ids=ids).logits[0, -1]
    assert (dense - float_logits).abs().max() > 0  # the served model is the quantized one
    # close to the float model all the same (random weights: no structure for 4 bits to keep)
    bound = {"int8": 0.999, "int6": 0.99, "int4": 0.95}[fmt]
    assert torch.nn.functional.cosine_similarity(dense, float_logits, dim=0) > bound


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_serving_frees_the_dense_weights_no_step_reads_and_serves_the_same_model(tiny_llama_dir, tiny_draft_dir, fmt):
    # float32 with quantized layers runs the weight-only kernel at every step size: no step reads
    # the dense copies of the quantized products (the output projection's included).
    kept = load(tiny_llama_dir, fmt, tune_kernels=False)
    freed = load(tiny_llama_dir, fmt, tune_kernels=False, keep_dense_weights=False)
    lean = lean_forward(freed.model)
    dropped = 0
    for layer in lean.layers:
        for product in (layer.qkv, layer.gate_up):
            assert product.weight.is_meta and all(member.weight.is_meta for member in product.members)
            dropped += product.weight.numel() * product.weight.element_size()
        for module in (layer.o_proj, layer.down_proj):
            assert module.weight.is_meta
            dropped += module.weight.numel() * module.weight.element_size()
    output = freed.model.get_output_embeddings()
    assert output.weight.is_meta and not freed.model.get_input_embeddings().weight.is_meta
    dropped += output.weight.numel() * output.weight.element_size()
    kept_dense, kept_quantized = footprint(kept.model, lean_forward(kept.model).fused_copies())
    freed_dense, freed_quantized = footprint(freed.model, lean.fused_copies())
    assert freed_quantized == kept_quantized and kept_dense - freed_dense == dropped
    with pytest.raises(RuntimeError, match="freed"):  # transformers' own forward would read them
        freed.model(input_ids=torch.tensor([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match="freed"):  # so would a table with a dense layout
        lean.layers[0].gate_up.use_table(linear_kernels.UNTUNED_QUANTIZED)
    tokenizer = kept.tokenizer
    config = SchedulerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256,
                             eos_token_ids=kept.eos_token_ids, spec=SpecConfig(num_speculative_tokens=4))  # fmt: skip

    def generate(target) -> list[list[int]]:  # the draft model loads as its target did
        runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=256),
                              ProposerConfig("draft_model", str(tiny_draft_dir)))  # fmt: skip
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculation=True)
        done = run_offline(runner, config, [Request(f"r{i}", tokenizer(p).input_ids, params) for i, p in
                                            enumerate(PROMPTS)])  # fmt: skip
        assert all(c.error is None for c in done) and sum(c.num_draft_tokens for c in done) > 0
        return [c.token_ids for c in done]

    assert generate(freed) == generate(kept)


@pytest.mark.parametrize("fmt", ["int8", "int6", "int4"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_is_lossless_with_respect_to_the_quantized_model(tiny_llama_dir, tiny_draft_dir, fmt, method):
    # Untimed: decode steps of 1-4 rows run the weight-only kernels, verify steps the dense product.
    target = load(tiny_llama_dir, fmt, tune_kernels=False)
    assert lean_forward(target.model).layers[0].gate_up.table.layout(1) == QUANTIZED
    tokenizer = target.tokenizer
    config = SchedulerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256,
                             eos_token_ids=target.eos_token_ids, spec=SpecConfig(num_speculative_tokens=4))  # fmt: skip

    def generate(proposer: ProposerConfig, speculation: bool) -> list[list[int]]:
        runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=256), proposer)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculation=speculation)
        done = run_offline(runner, config, [Request(f"r{i}", tokenizer(p).input_ids, params) for i, p in
                                            enumerate(PROMPTS)])  # fmt: skip
        assert all(c.error is None for c in done)
        if speculation:
            assert sum(c.num_draft_tokens for c in done) > 0
        return [c.token_ids for c in done]

    draft = str(tiny_draft_dir) if method == "draft_model" else None
    assert generate(ProposerConfig(method, draft), True) == generate(ProposerConfig("none"), False)
