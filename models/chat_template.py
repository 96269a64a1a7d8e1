"""A model's chat template, with ChatML for tokenizers that ship none: how chats become text,
the same for the server, `specd generate` and training."""

from __future__ import annotations

from typing import Any

# Used when a tokenizer has no chat template of its own.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_text(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The chat as the model's template renders it (the tokenizer's, else ChatML); `kwargs` go
    to the template (continue_final_message, chat_template_kwargs)."""
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=None if tokenizer.chat_template else CHATML_TEMPLATE,
        **kwargs,
    )
