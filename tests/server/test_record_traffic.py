"""`specd serve --record-traffic FILE`: one JSON line per finished request, readable by `train-draft`."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import httpx

from server.traffic import TrafficLog
from tests.support.server import finish_server, serve_args, start_server
from training.prompts import read_prompt_file


def test_every_finished_request_is_one_line_train_draft_reads(tiny_llama_dir, tmp_path):
    traffic = tmp_path / "traffic" / "requests.jsonl"  # the directory is created
    args = serve_args(model=tiny_llama_dir, dtype="float32", device="cpu", record_traffic=traffic)
    server = start_server(args, tmp_path, "record-traffic")
    try:
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as http:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
            chat = http.post("/chat/completions", json={"model": str(tiny_llama_dir), "messages": messages,
                                                        "max_tokens": 8, "temperature": 0}).json()  # fmt: skip
            body = {"model": str(tiny_llama_dir), "prompt": ["The quick", "def add"], "max_tokens": 5, "stream": True}
            with http.stream("POST", "/completions", json=body) as stream:
                events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    finally:
        finish_server(server)  # SIGTERM: queued lines are written before the process exits

    lines = [json.loads(line) for line in traffic.read_text().splitlines()]
    assert len(lines) == 2
    chat_line, text_line = sorted(lines, key=lambda line: line["endpoint"])
    assert chat_line["endpoint"] == "/v1/chat/completions" and chat_line["id"] == chat["id"]
    assert chat_line["messages"] == messages
    assert chat_line["outputs"] == [
        {"text": chat["choices"][0]["message"]["content"], "finish_reason": chat["choices"][0]["finish_reason"]}
    ]
    assert chat_line["model"] == str(tiny_llama_dir) and chat_line["time"].endswith("+00:00")
    streamed = ["", ""]
    for event in events:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert text_line["prompt"] == ["The quick", "def add"]
    assert [o["text"] for o in text_line["outputs"]] == streamed
    assert all(o["finish_reason"] == "length" for o in text_line["outputs"])

    prompts = read_prompt_file(traffic)
    assert [p.messages for p in prompts if p.messages] == [messages]
    assert sorted(p.text for p in prompts if p.text is not None) == ["The quick", "def add"]  # sent raw, as served


def test_a_file_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    log = TrafficLog(tmp_path, "model")  # a directory: every append fails
    gen = SimpleNamespace(choices=[SimpleNamespace(text="hi", finish_reason="stop")])
    with caplog.at_level(logging.ERROR, logger="specd.server"):
        record = log.recorder("/v1/completions", "cmpl-1", {"prompt": "x"})
        record(gen)  # type: ignore[arg-type]
        record(gen)  # type: ignore[arg-type]
        log.close()
    failures = [r for r in caplog.records if "cannot append" in r.getMessage()]
    assert len(failures) == 1  # once per run of failures, not once per request
