"""`specd train-draft` end to end on the tiny Llama: a head directory that serves it and only it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.eagle_head import HeadMismatch, fused_feature_layers, load_head, read_head_config
from models.loader import ModelConfig, load_model
from server.cli import build_parser, main


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-draft", "--help"])
    text = capsys.readouterr().out
    for flag in ("--out", "--prompts", "--eval-prompts", "--minutes", "--total-minutes", "--epochs", "--max-tokens",
                 "--draft-vocab", "--dtype", "--device", "--seed", "--model", "--no-shipped-prompts",
                 "--unroll", "--max-num-seqs"):  # fmt: skip
        assert flag in text


def test_train_draft_writes_a_head_for_its_model_only(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w} twice."}) + "\n" for w in "abcdefghijklmnop"))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello world!"}]}) + "\n")
    out = tmp_path / "head"
    code = main([
        "train-draft", "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
        "--out", str(out), "--prompts", str(prompts), "--no-shipped-prompts", "--eval-prompts", str(evals),
        "--max-tokens", "12", "--draft-vocab", "100", "--epochs", "2", "--minutes", "2", "--held-out", "0.25",
    ])  # fmt: skip
    assert code == 0
    record = read_head_config(out).training
    assert record["data"]["prompts"] == 16 and record["data"]["sequences_held_out"] == 4
    assert record["draft_vocab"]["size"] == 100 and 0 < record["draft_vocab"]["coverage_train"] <= 1
    assert len(record["held_out"]["per_position"]) == 4 and record["held_out_curve"][0]["step"] == 0
    assert list(record["eval_prompts"]) == ["eval.jsonl"] and record["eval_prompts"]["eval.jsonl"]["num_chains"] > 0
    # Files by base name: no path of this machine in a head that gets shared.
    assert record["data"]["prompt_files"] == ["mine.jsonl"] and str(tmp_path) not in json.dumps(record)
    assert set(record["phase_minutes"]) == {"load", "generate", "record", "train", "evaluate"}

    llama = load_model(ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    head = load_head(out, llama.model)
    assert head.config.draft_vocab_size == 100
    # Fused features by default: the layers are recorded, and the fuse layer is saved and loaded.
    assert head.config.feature_layers == fused_feature_layers(llama.model.config.num_hidden_layers)
    assert head.fuse is not None and "fuse.weight" in head.trainable_state()
    qwen = load_model(ModelConfig(model=str(tiny_qwen2_dir), dtype="float32", device="cpu"))
    with pytest.raises(HeadMismatch, match="trained for another model"):
        load_head(out, qwen.model)


def test_without_minutes_training_gets_what_the_total_budget_leaves(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w} twice."}) + "\n" for w in "abcdefgh"))
    out = tmp_path / "head"
    code = main([
        "train-draft", "--model", str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu",
        "--out", str(out), "--prompts", str(prompts), "--no-shipped-prompts", "--max-tokens", "8",
        "--draft-vocab", "50", "--epochs", "1", "--total-minutes", "3",
    ])  # fmt: skip
    assert code == 0
    record = read_head_config(out).training
    assert record["data"]["prompts_answered"] == record["data"]["prompts"] == 8  # well within half of 3 minutes
    training = record["training"]
    assert training["total_minutes"] == 3
    # The budget is the 3 minutes less what loading, answering and recording took (seconds here).
    spent = sum(v for k, v in record["phase_minutes"].items() if k in ("load", "generate", "record"))
    assert 3 - spent - 0.1 < training["budget_minutes"] <= 3


def test_training_minutes_are_the_flag_else_the_budget_left_else_a_floor():
    from training.pipeline import MIN_TRAIN_SHARE, TrainDraftConfig, _training_minutes
    from training.train import TrainConfig

    def config(minutes):
        return TrainDraftConfig(
            model=ModelConfig(), out=Path("h"), total_minutes=20, train=TrainConfig(minutes=minutes)
        )

    assert _training_minutes(config(6.5), seconds_left=60) == 6.5  # --minutes wins
    assert _training_minutes(config(None), seconds_left=11 * 60) == 11
    assert _training_minutes(config(None), seconds_left=30) == MIN_TRAIN_SHARE * 20  # data overran: the floor


def test_a_missing_prompt_file_is_an_error_not_a_traceback(tiny_llama_dir, tmp_path, capsys):
    code = main(["train-draft", "--model", str(tiny_llama_dir), "--out", str(tmp_path / "h"),
                 "--prompts", str(tmp_path / "missing.jsonl")])  # fmt: skip
    assert code == 1 and "missing.jsonl" in capsys.readouterr().err


def test_a_feature_loss_over_fused_features_is_an_error_before_loading(tmp_path, capsys):
    code = main(["train-draft", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "h"),
                 "--feature-loss", "1"])  # fmt: skip
    assert code == 1 and "--features last" in capsys.readouterr().err
