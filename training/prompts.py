"""Prompts to train a draft head on: the shipped set, or a user's own JSONL file.

One JSON object a line, in any of three shapes:

    {"prompt": "text"}                      one user message (the chat template is applied)
    {"messages": [{"role": ..., "content": ...}, ...]}        a chat (a chat log's trailing
                                            assistant turns are dropped: the target answers)
    a `specd serve --record-traffic` line   chat requests hold "messages"; text completions hold
                                            "prompt" (a string or a list) and are sent raw, as served

The shipped set (training/prompts/*.jsonl) is written for training and shares no
prompt with the benchmark sets in benchmarks/prompt_sets/, which stay held out.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.chat_template import chat_text

logger = logging.getLogger("specd.training")

SHIPPED_DIR = Path(__file__).parent / "prompts"
COMPLETIONS_ENDPOINT = "/v1/completions"  # a traffic record's text completions: sent raw, as served


@dataclass
class TrainingPrompt:
    """A chat to answer (`messages`), or a raw text prompt (`text`) sent without a template."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None

    def render(self, tokenizer) -> list[int]:
        """Token ids the target is prompted with, exactly as the server would build them."""
        if self.messages is None:
            return tokenizer.encode(self.text or "")
        text = chat_text(tokenizer, self.messages)
        return tokenizer.encode(text, add_special_tokens=False)


def shipped_prompt_files() -> list[Path]:
    return sorted(SHIPPED_DIR.glob("*.jsonl"))


def read_prompt_files(paths: list[Path]) -> list[TrainingPrompt]:
    prompts: list[TrainingPrompt] = []
    for path in paths:
        prompts += read_prompt_file(path)
    return prompts


def read_prompt_file(path: Path) -> list[TrainingPrompt]:
    """Every prompt in `path`; lines that hold none are skipped with a warning (chat logs are messy)."""
    prompts: list[TrainingPrompt] = []
    skipped = 0
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                found = parse_record(json.loads(line))
            except (json.JSONDecodeError, TypeError, ValueError) as exc:
                logger.debug("%s:%d: %s", path, number, exc)
                found = []
            skipped += not found
            prompts += found
    if skipped:
        logger.warning("%s: skipped %d lines that hold no usable prompt", path, skipped)
    if not prompts:
        raise ValueError(f"{path} holds no prompts (expected JSON lines with 'prompt' or 'messages')")
    return prompts


def parse_record(record: Any) -> list[TrainingPrompt]:
    """The prompts in one JSON line (a text completion of several prompts gives several)."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if "messages" in record:
        messages = _chat(record["messages"])
        return [TrainingPrompt(messages=messages)] if messages else []
    prompt = record.get("prompt")
    raw = record.get("endpoint") == COMPLETIONS_ENDPOINT
    texts: list[Any] = prompt if isinstance(prompt, list) else [prompt]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("'prompt' must be a string or a list of strings")
    return [
        TrainingPrompt(text=t) if raw else TrainingPrompt(messages=[{"role": "user", "content": t}])
        for t in texts
        if t.strip()
    ]


def _chat(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    chat = [{"role": _role(m["role"]), "content": _text(m.get("content"))} for m in messages]
    while chat and chat[-1]["role"] == "assistant":
        chat.pop()
    return chat if any(m["role"] == "user" for m in chat) else []


def _role(role: Any) -> str:
    if not isinstance(role, str):
        raise ValueError("a message's 'role' must be a string")
    return "system" if role == "developer" else role


def _text(content: Any) -> str:
    """A message's text: a string, or the text of its content parts (OpenAI's list form)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise ValueError("a message's 'content' must be a string or a list of parts")
