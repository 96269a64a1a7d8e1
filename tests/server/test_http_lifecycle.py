"""Process lifecycle: SIGTERM drains running streams and exits 0; the default SmolLM2 end to end."""

from __future__ import annotations

import json
import signal

import httpx
import openai

from tests.support.server import SpecdServer, finish_server, serve_args, start_server


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_llama_dir, tmp_path):
    server = SpecdServer(serve_args(model=tiny_llama_dir, dtype="float32", shutdown_timeout=60), tmp_path / "log")
    try:
        server.wait_ready()
        body = {"model": str(tiny_llama_dir), "prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    server.process.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert sum(len(c["choices"][0]["text"]) for c in chunks) > 0
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut
        assert server.process.wait(timeout=60) == 0
    finally:
        server.kill()
    log = server.log()
    assert "Traceback" not in log and "Shutting down" in log


def test_a_model_that_cannot_load_exits_1_with_a_message(tmp_path):
    server = SpecdServer(serve_args(model=tmp_path / "missing"), tmp_path / "log")
    try:
        assert server.process.wait(timeout=120) == 1
    finally:
        server.kill()
    assert "cannot start" in server.log() and "no such local directory" in server.log()


def test_default_smollm2_streams_a_chat_reply(specd_cache_dir, tmp_path):
    """No --model: the bundled GGUF is converted once into --cache-dir, then served."""
    server = start_server(serve_args(cache_dir=specd_cache_dir, max_num_seqs=2, max_model_len=512), tmp_path, "smollm2")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        assert model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip()
        assert chunks[-1].usage.completion_tokens > 0
    finally:
        finish_server(server)


def test_a_draft_with_another_tokenizer_stops_start_up(tiny_llama_dir, tiny_draft_dir, tmp_path):
    """The server never starts with a draft whose vocabulary differs: exit 1, and the log says why."""
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_models import build_tokenizer

    bad = tmp_path / "bad-draft"
    AutoModelForCausalLM.from_pretrained(tiny_draft_dir).save_pretrained(bad)
    build_tokenizer(vocab_size=300).save_pretrained(bad)
    server = SpecdServer(serve_args(model=tiny_llama_dir, draft_model=bad, dtype="float32"), tmp_path / "log")
    try:
        assert server.process.wait(timeout=120) == 1
        assert "incompatible" in server.log() and "tokenizer" in server.log()
        assert "Traceback" not in server.log()
    finally:
        server.kill()
