"""Training prompts: the three accepted line shapes, and a shipped set kept apart from the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.tiny_models import build_tokenizer
from training.prompts import TrainingPrompt, read_prompt_file, read_prompt_files, shipped_prompt_files


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_messages_and_traffic_records(tmp_path):
    path = write_lines(tmp_path / "mine.jsonl", [
        {"prompt": "Tell me a joke."},
        {"messages": [{"role": "developer", "content": "Be kind."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                      {"role": "assistant", "content": "Hello!"}]},  # a chat log: its answer is dropped
        {"time": "t", "model": "m", "endpoint": "/v1/completions", "id": "cmpl-1", "prompt": ["a b", "c d"],
         "outputs": [{"text": "x", "finish_reason": "stop"}] * 2},
        {"time": "t", "model": "m", "endpoint": "/v1/chat/completions", "id": "chatcmpl-1",
         "messages": [{"role": "user", "content": "Why?"}], "outputs": []},
        "not json",
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        "",
    ])  # fmt: skip
    prompts = read_prompt_file(path)
    assert prompts == [
        TrainingPrompt(messages=[{"role": "user", "content": "Tell me a joke."}]),
        TrainingPrompt(messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi\nthere"}]),
        TrainingPrompt(text="a b"),
        TrainingPrompt(text="c d"),
        TrainingPrompt(messages=[{"role": "user", "content": "Why?"}]),
    ]


def test_a_file_without_prompts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompt_file(write_lines(tmp_path / "empty.jsonl", [{"text": "wrong key"}]))


def test_render_applies_the_chat_template_only_to_chats():
    tokenizer = build_tokenizer()
    chat = TrainingPrompt(messages=[{"role": "user", "content": "Hello"}]).render(tokenizer)
    assert tokenizer.decode(chat) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(TrainingPrompt(text="Hello").render(tokenizer)) == "Hello"


def test_the_shipped_set_is_large_varied_and_shares_nothing_with_the_benchmark_sets():
    files = shipped_prompt_files()
    assert len(files) >= 4
    prompts = read_prompt_files(files)
    assert len(prompts) >= 250
    texts = {json.dumps(p.messages) for p in prompts}
    assert len(texts) == len(prompts)  # no duplicates
    shipped = {m["content"].strip().lower() for p in prompts for m in p.messages or []}
    benchmark = set()
    for path in (REPO / "benchmarks" / "prompt_sets").glob("*.jsonl"):
        benchmark |= {json.loads(line)["prompt"].strip().lower() for line in path.read_text().splitlines() if line}
    assert len(benchmark) >= 200 and not shipped & benchmark
