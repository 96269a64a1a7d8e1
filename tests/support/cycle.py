"""The cycle model, whose output is known exactly, and its one oracle `CycleText`.

The cycle model (fixture `cycle_model_dir`) is the tiny Llama rewired so that
its output is exact: every layer adds nothing (o_proj and down_proj are zero),
each token of CYCLE_TEXT embeds as its own unit vector, and lm_head maps that
vector to the next token of the cycle. After any cycle token the greedy (and,
at logit margin 40, the sampled) continuation is the rest of the cycle, over
and over. CYCLE_TEXT spells multi-byte characters one byte-level token at a
time, so streams of it test incremental detokenization and stop strings at
known positions, and every request that survives a storm, a burst or a fault
can be checked character for character.
"""

from __future__ import annotations

from pathlib import Path

CYCLE_TEXT = "\nAb😀 日é!"


def cycle_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False)
    assert len(set(ids)) == len(ids), "the cycle needs distinct tokens"
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the cycle should split a character"
    return ids


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


def build_cycle_head(cycle_dir: Path, out_dir: Path, leave_out: tuple[int, ...] = ()) -> Path:
    """An EAGLE head that drafts the cycle model's continuation exactly, except that tokens in
    `leave_out` are outside its draft vocabulary (a draft that should be one of them is wrong).

    fc passes the token's embedding through (g_p ~ embed(x_{p+1}) = e_i, the layer adds
    nothing), and the target's lm_head maps e_i to the token after x_{p+1}: x_{p+2}.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from models.eagle_head import new_head, save_head

    model = AutoModelForCausalLM.from_pretrained(cycle_dir, dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    head = new_head(model, torch.tensor([t for t in range(vocab) if t not in leave_out]))
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        # [embed(x_{p+1}) ; h_p] -> embed(x_{p+1}) scaled as the target's RMSNorm scales it (by
        # sqrt(hidden)), so the head's logits have the target's margin and sampled drafts are right too.
        head.fc.weight[:, :hidden] = hidden**0.5 * torch.eye(hidden)
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    save_head(head, out_dir, dtype=torch.float32)
    return out_dir


class CycleText:
    """The exact text the cycle model writes after a prompt ending in a cycle token."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.ids = cycle_ids(self.tokenizer)

    def next_ids(self, prompt_ids: list[int], num_tokens: int) -> list[int]:
        start = self.ids.index(prompt_ids[-1]) + 1
        return [self.ids[(start + i) % len(self.ids)] for i in range(num_tokens)]

    def expected(self, prompt: str, num_tokens: int) -> str:
        """Completions endpoint (the prompt is tokenized as is)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.tokenizer.decode(self.next_ids(ids, num_tokens))

    def expected_chat(self, num_tokens: int) -> str:
        """Chat endpoint: the template ends in "\\n", so the reply starts "Ab😀"."""
        return self.tokenizer.decode(self.next_ids(self.tokenizer.encode("\n"), num_tokens))

    def chars(self, num_chars: int) -> str:
        """The first `num_chars` characters written after "\\n" (a chat reply, or a completion of "\\n")."""
        whole_cycles = num_chars // len(CYCLE_TEXT) + 2
        text = self.expected_chat(whole_cycles * len(self.ids))  # whole cycles: no character cut in two
        assert text.startswith(CYCLE_TEXT[1:] + CYCLE_TEXT) and len(text) >= num_chars, text
        return text[:num_chars]
