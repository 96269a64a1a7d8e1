"""Settings precedence, the generated CLI, error mapping helpers, and `specd generate`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import build_parser, main
from server.config import Settings, load_settings
from server.errors import loc_to_param
from tests.support import REPO


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SPECD_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_precedence_cli_over_env_over_file_over_default(clean_env, tmp_path):
    config = tmp_path / "specd.yaml"
    config.write_text("port: 9001\nmax-num-seqs: 3\nmax_queue: 7\nallowed-origins: [http://a, http://b]\n")
    clean_env.setenv("SPECD_PORT", "9002")
    clean_env.setenv("SPECD_MAX_QUEUE", "8")
    clean_env.setenv("SPECD_SERVED_MODEL_NAME", "one, two")
    settings = load_settings({"max_queue": 9}, config)
    assert settings.port == 9002  # env beats file
    assert settings.max_num_seqs == 3  # file beats default
    assert settings.max_queue == 9  # command line beats env
    assert settings.allowed_origins == ["http://a", "http://b"]
    assert settings.served_model_name == ["one", "two"]
    assert settings.host == "127.0.0.1"


def test_config_file_from_env_and_unknown_keys_refused(clean_env, tmp_path):
    config = tmp_path / "specd.yaml"
    config.write_text("max-num-seqs: 2\n")
    clean_env.setenv("SPECD_CONFIG", str(config))
    assert load_settings().max_num_seqs == 2
    config.write_text("max-num-sqes: 2\n")
    with pytest.raises(ValueError, match="max_num_sqes"):
        load_settings()


def test_invalid_values_are_refused(clean_env):
    with pytest.raises(ValueError):
        Settings(num_speculative_tokens=99)
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        Settings(max_num_seqs=32, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="--draft-model"):
        Settings(draft="draft_model")


def test_every_setting_is_a_flag_with_help_and_fault_injection_is_hidden(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        if name == "enable_fault_injection":
            assert flag not in help_text
        else:
            assert flag in help_text and f"SPECD_{name.upper()}" in help_text, name
    for flag in ("--config", "--host", "--port", "--model", "--served-model-name", "--draft-model", "--draft",
                 "--draft-head", "--num-speculative-tokens", "--spec-disable-batch-size", "--max-num-seqs",
                 "--max-model-len",
                 "--max-queue", "--api-key", "--dtype", "--device", "--log-level", "--cache-dir",
                 "--max-num-batched-tokens", "--max-body-bytes", "--metrics-auth", "--allowed-origins",
                 "--shutdown-timeout"):  # fmt: skip
        assert flag in help_text


def test_flags_parse_into_settings(clean_env):
    args = build_parser().parse_args(
        ["serve", "--port", "1234", "--no-spec-adaptive", "--served-model-name", "a,b", "--enable-fault-injection"]
    )
    settings = load_settings({k: v for k, v in vars(args).items() if k in Settings.model_fields})
    assert (settings.port, settings.spec_adaptive, settings.served_model_name) == (1234, False, ["a", "b"])
    assert settings.enable_fault_injection


def test_bad_flag_value_exits_2_with_a_message(clean_env, capsys):
    assert main(["serve", "--num-speculative-tokens", "99", "--port", "1"]) == 2
    assert "--num-speculative-tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("loc", "param"),
    [
        (("body", "messages", 0, "content"), "messages[0].content"),
        (("body", "prompt", "list[int]", 0), "prompt"),
        (("body", "temperature"), "temperature"),
        (("body",), None),
    ],
)
def test_validation_locations_become_params(loc, param):
    assert loc_to_param(loc) == param


def test_generate_prints_a_completion(tiny_llama_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "generate",
            "Hello world",
            "--model",
            str(tiny_llama_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ],  # fmt: skip
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tokens in" in result.stderr


def test_speculative_tokens_default_depends_on_the_proposer():
    assert Settings().resolved_num_speculative_tokens == 10  # ngram drafts cost nothing to propose
    assert Settings(draft_model="some/draft").resolved_num_speculative_tokens == 4  # each draft token is a forward
    assert Settings(draft="draft_model", draft_model="d").resolved_num_speculative_tokens == 4
    assert Settings(draft_model="d", num_speculative_tokens=6).resolved_num_speculative_tokens == 6
    assert Settings(draft_head="h").resolved_num_speculative_tokens == 5  # a head's forward is one layer


def test_eagle_needs_a_head_unless_the_bundled_model_has_one(clean_env, tmp_path):
    import server.config

    with pytest.raises(ValueError, match="--draft eagle needs --draft-head DIR"):
        Settings(draft="eagle", model="some/model")
    clean_env.setitem(server.config.BUNDLED_OPTIONS, "draft_head", tmp_path / "missing")
    with pytest.raises(ValueError, match="the bundled model's default .* does not exist"):
        Settings(draft="eagle")
    clean_env.setitem(server.config.BUNDLED_OPTIONS, "draft_head", tmp_path)
    assert Settings(draft="eagle").resolved_draft_head == tmp_path  # the bundled model, and its head exists
    assert Settings(draft_head="h").resolved_draft == "eagle" and Settings().resolved_draft_head is None
    assert Settings(draft="eagle", model="m", draft_head="h").resolved_draft_head == Path("h")


def test_a_head_for_another_model_is_refused_at_start_up_with_the_reason(tiny_qwen2_dir, tiny_llama_head_dir):
    """`generate` builds what `serve` builds: a clean error and exit 1, not a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    args = ["generate", "Hello", "--model", str(tiny_qwen2_dir), "--draft", "eagle", "--draft-head",
            str(tiny_llama_head_dir), "--dtype", "float32", "--device", "cpu", "--max-tokens", "2"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", *args],
        cwd=REPO,
        env={**env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "specd: error: the draft head in" in result.stderr
    assert "trained for another model: architecture is 'Qwen2ForCausalLM'" in result.stderr
    assert "Traceback" not in result.stderr


def test_spec_cap_defaults_to_none_and_is_taken_as_given():
    assert Settings().spec_disable_batch_size is None  # no cap: the cost model decides per request
    assert Settings(spec_disable_batch_size=0).spec_disable_batch_size == 0
    assert Settings(spec_disable_batch_size=5).spec_disable_batch_size == 5


def test_kv_cache_memory_takes_bytes_units_or_a_fraction(clean_env):
    assert load_settings({"kv_cache_memory": "2GiB"}).kv_cache_memory == 2 * 2**30
    assert load_settings({"kv_cache_memory": "512MB"}).kv_cache_memory == 512e6
    assert load_settings({"kv_cache_memory": "0.5"}).kv_cache_memory == 0.5
    with pytest.raises(ValueError):
        load_settings({"kv_cache_memory": "lots"})
    with pytest.raises(ValueError):
        load_settings({"kv_cache_memory": "0"})
    settings = load_settings()
    assert (settings.prefix_caching, settings.block_size, settings.num_kv_blocks) == (True, 16, None)


@pytest.mark.parametrize(
    "flags, refused",
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "192.168.1.5"}, True),
        ({"host": "0.0.0.0", "allow_unauthenticated": True}, False),
        ({"host": "0.0.0.0", "api_key": "k" * 12}, False),
        ({"host": "127.0.0.1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "::1"}, False),
    ],
)
def test_a_keyless_server_binds_only_loopback_unless_told(clean_env, flags, refused):
    settings = Settings(model="m", **flags)
    if refused:
        with pytest.raises(ValueError, match="--allow-unauthenticated"):
            settings.check_exposure()
    else:
        settings.check_exposure()


def test_serve_refuses_a_keyless_public_bind_before_loading_anything(clean_env, capsys):
    assert main(["serve", "--model", "/nonexistent", "--host", "0.0.0.0"]) == 2
    assert "reachable from other machines and no API key is set" in capsys.readouterr().err


def test_a_keys_file_that_cannot_be_read_stops_serve_with_its_reason(clean_env, tmp_path, capsys):
    keys = tmp_path / "keys"
    keys.write_text("alpha short\n")
    keys.chmod(0o600)
    assert main(["serve", "--model", "/nonexistent", "--api-keys", str(keys)]) == 2
    assert "line 1: a key has 8+" in capsys.readouterr().err
