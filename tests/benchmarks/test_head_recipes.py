"""benchmarks.head_recipes: recipe specs, and one recipe end to end on a tiny target."""

import pytest

from benchmarks.head_recipes import parse_recipe, run_recipe
from models.eagle_head import fused_feature_layers
from models.kv_cache import text_config
from models.loader import ModelConfig, load_model
from training.data import DataConfig, build_sequences, split_held_out
from training.prompts import TrainingPrompt


def test_a_recipe_names_train_config_fields_and_the_extra_answers():
    assert parse_recipe("base") == ("base", {}, False)
    name, overrides, extra = parse_recipe("more:batch_tokens=4096,lr=0.002,extra=true")
    assert (name, overrides, extra) == ("more", {"batch_tokens": 4096, "lr": 0.002}, True)
    assert isinstance(overrides["batch_tokens"], int)
    assert parse_recipe("x:extra=1")[2] and not parse_recipe("x:extra=0")[2] and not parse_recipe("x:extra=false")[2]
    assert parse_recipe("hard:soft_targets=false")[1] == {"soft_targets": False}
    assert parse_recipe("soft:soft_targets=True")[1] == {"soft_targets": True}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bad:learning_rate=1", "unknown key"),
        ("bad:minutes=3", "unknown key"),  # the budget is the same for every recipe
        ("bad:feature_loss=0.1", "unknown key"),  # fused heads have no regression target
        ("bad:soft_targets=maybe", "true or false"),
        ("bad:extra=no-thanks", "true or false"),
        ("bad:lr=", "has no value"),
        ("bad:unroll=two", "not a number"),
    ],
)
def test_a_bad_recipe_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_recipe(spec)


def test_a_recipe_trains_and_is_scored_on_held_out_and_benchmark_answers(tiny_llama_dir):
    tiny_loaded = load_model(ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    layers = fused_feature_layers(text_config(tiny_loaded.model.config).num_hidden_layers)
    config = DataConfig(max_tokens=12)
    prompts = [TrainingPrompt(messages=[{"role": "user", "content": f"count to {i}"}]) for i in range(8)]
    shipped = build_sequences(tiny_loaded, prompts, config, None, layers)
    extra = build_sequences(tiny_loaded, prompts[:3], config, None, layers)
    data = {"shipped": shipped, "extra": extra, "eval": {"chat": shipped[:2]}, "layers": layers}
    train, held_out = split_held_out(shipped, 0.25, 0)
    row = run_recipe(tiny_loaded, data, held_out, train, "more", {"batch_tokens": 256}, True, 0.05, 2, seed=3)
    assert row["answer_tokens"] == sum(s.num_answer_tokens for s in train + extra)
    assert row["steps"] > 0 and row["settings"] == {"batch_tokens": 256, "extra": True}
    assert 0 <= row["held_out"] <= 2 and 0 <= row["chat"] <= 2 and row["benchmark_all"] == row["chat"]
