"""`specd serve --record-traffic FILE`: one JSON line per finished request, readable by `train-draft`."""

from __future__ import annotations

import json
import logging
import os
import threading
from types import SimpleNamespace

import httpx
import pytest

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
            # ignore_eos: a sampled token of the random tiny model may be its EOS (finish_reason "stop")
            body = {"model": str(tiny_llama_dir), "prompt": ["The quick", "def add"], "max_tokens": 5, "stream": True,
                    "ignore_eos": True}  # fmt: skip
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
    assert chat_line["tenant"] == text_line["tenant"] == "default"  # no key: the one tenant
    assert traffic.stat().st_mode & 0o777 == 0o600  # user data: the owner's alone
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
        record = log.recorder("/v1/completions", "cmpl-1", "default", {"prompt": "x"})
        record(gen)  # type: ignore[arg-type]
        record(gen)  # type: ignore[arg-type]
        log.close()
    failures = [r for r in caplog.records if "cannot append" in r.getMessage()]
    assert len(failures) == 1  # once per run of failures, not once per request


GEN = SimpleNamespace(choices=[SimpleNamespace(text="out", finish_reason="stop")])


def test_a_symbolic_link_is_never_written_through(tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "traffic.jsonl"
    os.symlink(target, link)
    with caplog.at_level(logging.ERROR, logger="specd.server"):
        log = TrafficLog(link, "model")
        log.recorder("/v1/completions", "cmpl-1", "a", {"prompt": "x"})(GEN)  # type: ignore[arg-type]
        log.close()
    assert target.read_text() == ""  # O_NOFOLLOW: the link's target is untouched
    assert any("cannot append" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("planted", ["readable by others", "another user's"])
def test_a_file_someone_else_created_first_is_never_written(tmp_path, caplog, planted):
    """Appending would keep the planted file's owner and mode: its creator would read user data."""
    path = tmp_path / "traffic.jsonl"
    path.write_text("")
    if planted == "readable by others":
        path.chmod(0o644)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        path.chmod(0o600)
        os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="specd.server"):
        log = TrafficLog(path, "model")
        log.recorder("/v1/completions", "cmpl-1", "a", {"prompt": "secret"})(GEN)  # type: ignore[arg-type]
        log.close()
    assert path.read_text() == ""
    assert any("mode 600" in r.getMessage() for r in caplog.records)


def test_the_file_rotates_by_size_and_each_line_names_its_tenant(tmp_path):
    path = tmp_path / "traffic.jsonl"
    log = TrafficLog(path, "model", max_bytes=1000)
    for i in range(20):
        log.recorder("/v1/completions", f"cmpl-{i}", f"tenant-{i % 2}", {"prompt": "x" * 50})(GEN)  # type: ignore[arg-type]
    log.close()
    rotated = path.with_name("traffic.jsonl.1")
    assert path.stat().st_size <= 1000 and rotated.stat().st_size <= 1000
    lines = [json.loads(line) for f in (rotated, path) for line in f.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"cmpl-{i}" for i in range(20 - len(lines), 20)]  # newest kept, in order
    assert all(line["tenant"] == f"tenant-{int(line['id'][5:]) % 2}" for line in lines)
    assert rotated.stat().st_mode & 0o777 == 0o600


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path, monkeypatch):
    import server.traffic as traffic

    monkeypatch.setattr(traffic, "QUEUE_LINES", 4)
    log = TrafficLog(tmp_path / "t.jsonl", "model")
    stalled, release = threading.Event(), threading.Event()
    append = log._append

    def slow_append(entry):  # a disk that does not answer
        stalled.set()
        release.wait(10)
        append(entry)

    monkeypatch.setattr(log, "_append", slow_append)
    record = log.recorder("/v1/completions", "cmpl", "a", {"prompt": "x"})
    record(GEN)  # type: ignore[arg-type]
    assert stalled.wait(10)  # the writer holds the first line; 4 more fit the queue
    for _ in range(10):
        record(GEN)  # type: ignore[arg-type]  # returns at once whatever the writer does
    assert log.dropped == 6
    release.set()
    log.close()
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 5
