"""Helpers for the HTTP tests: a real `specd serve` process, and the cycle model's text.

The cycle model (fixture `cycle_model_dir`) is the tiny Llama rewired so that
its output is exact: every layer adds nothing (o_proj and down_proj are zero),
each token of CYCLE_TEXT embeds as its own unit vector, and lm_head maps that
vector to the next token of the cycle. After any cycle token the greedy (and, at logit margin 40, the
sampled) continuation is the rest of the cycle, over and over. CYCLE_TEXT
spells multi-byte characters one byte-level token at a time, so streams of it
test incremental detokenization and stop strings at known positions.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CYCLE_TEXT = "\nAb😀 日é!"
API_KEY = "test-key"
START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpecdServer:
    """One `python -m server.cli serve` process; `stop()` sends SIGTERM and returns the exit code."""

    entry: tuple[str, ...] = ("-m", "server.cli")  # what `python` runs
    extra_env: dict[str, str] = {}

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.api_key = api_key
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        for key, value in self.extra_env.items():
            env.setdefault(key, value)
        command = [sys.executable, *self.entry, "serve", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"specd exited with {self.process.returncode} before it was ready:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"specd was not ready within {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"specd did not exit within {timeout}s of SIGTERM:\n{self.log()[-4000:]}")
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def start_server(args: list[str], tmp_path: Path, name: str, api_key: str | None = None) -> SpecdServer:
    server = SpecdServer(args, tmp_path / f"{name}.log", api_key)
    server.wait_ready()
    return server


def finish_server(server: SpecdServer) -> None:
    code = server.stop()
    assert code == 0, f"specd exited with {code} after SIGTERM:\n{server.log()[-4000:]}"
    assert "Traceback" not in server.log(), server.log()[-4000:]


def cycle_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False)
    assert len(set(ids)) == len(ids), "the cycle needs distinct tokens"
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the cycle should split a character"
    return ids


def cycle_output(num_chars: int, start: str = "A") -> str:
    """The first `num_chars` characters the cycle model writes after the cycle character before `start`."""
    text = CYCLE_TEXT[CYCLE_TEXT.index(start) :] + CYCLE_TEXT * (num_chars // len(CYCLE_TEXT) + 2)
    return text[:num_chars]


def build_cycle_model(tiny_dir: Path, out_dir: Path) -> Path:
    """Rewire the tiny Llama so that after any token of CYCLE_TEXT comes the next one.

    Attention and MLP outputs are zeroed, so the residual stream is the token's
    embedding alone: cycle token i embeds as the unit vector e_i, and lm_head
    row of token i+1 reads e_i with weight 5 (RMSNorm scales e_i to 8 e_i:
    a logit of 40 against 0 for every other token).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cycle = cycle_ids(tokenizer)
    if len(cycle) > model.config.hidden_size:
        raise ValueError("CYCLE_TEXT must have no more tokens than the hidden size")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        head = model.lm_head.weight  # [vocab, hidden]
        head.zero_()
        for position, token_id in enumerate(cycle):
            embed[token_id].zero_()
            embed[token_id, position] = 1.0
            head[cycle[(position + 1) % len(cycle)], position] = 5.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
