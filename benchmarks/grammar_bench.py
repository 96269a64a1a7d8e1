"""The grammar engines side by side on the served vocabularies: llguidance (what specd uses)
and xgrammar (the other engine vLLM ships), on the structured benchmark's schemas.

    python -m benchmarks.grammar_bench --install-xgrammar        # SmolLM2's vocabulary
    python -m benchmarks.grammar_bench --model qwen2.5-coder-1.5b-instruct

xgrammar is not a dependency of specd (its wheel declares torch, triton and apache-tvm-ffi):
`--install-xgrammar` puts it and apache-tvm-ffi, without their dependencies, into a directory
of their own under specd's cache and imports it from there.

Per engine: tokenizer set-up (once per server); compiling the 12 schemas of
`prompt_sets/structured.jsonl` (first time, not cached); and walking one valid document per
schema token by token, timing the token mask at each position and the commit of each token.
A document is the schema's own example, made by a walk of llguidance's matcher: the first
allowed token in vocabulary order, and at every fourth token a bare quote or bracket where one
is allowed (strings end, arrays stop at their fewest items), so it depends on nothing but the schema and the vocabulary.
Single-threaded, one row at a time. Where xgrammar refuses a token of a document, the rest of
that document is not timed for it ("documents refused": the engines read the schema apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import AutoTokenizer

from benchmarks.common import table
from benchmarks.structured_bench import load_tasks
from models.grammar import allowed_tokens, json_schema_grammar
from models.loader import ModelConfig, default_cache_dir, local_model_dir

XGRAMMAR = ("xgrammar==0.2.8", "apache-tvm-ffi")
DOC_TOKENS = 256  # the walk stops here if the document has not ended


def xgrammar_dir(cache_dir: Path) -> Path:
    return cache_dir / "peers" / "xgrammar"


def install_xgrammar(target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    *XGRAMMAR], check=True)  # fmt: skip


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def documents(ll_tokenizer, schemas: list[dict], vocab_size: int, tokenizer) -> list[list[int]]:
    """One valid token sequence per schema (see the module docstring)."""
    texts = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    docs = []
    for schema in schemas:
        matcher = llguidance.LLMatcher(ll_tokenizer, json_schema_grammar(schema, any_whitespace=False))
        mask = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)
        tokens: list[int] = []
        while not matcher.is_stopped() and len(tokens) < DOC_TOKENS:
            llguidance.torch.fill_next_token_bitmask(matcher, mask[None], 0)
            choices = [t for t in allowed_tokens(mask[None], vocab_size)[0].nonzero().flatten().tolist()
                       if t != ll_tokenizer.eos_token]  # fmt: skip
            if not choices:
                break
            # Every fourth token is a bare quote where one is allowed (it ends a string), else a
            # bare bracket: strings stay a few tokens long, arrays stop at their fewest items and
            # the document ends.
            closing = []
            if len(tokens) % 4 == 3:
                closing = [t for t in choices if texts[t] == '"'] or [t for t in choices if texts[t] in ("]", "}")]
            token = (closing or choices)[0]
            tokens.append(token)
            matcher.consume_token(token)
        docs.append(tokens)
    return docs


def time_llguidance(tokenizer, schemas: list[dict], docs: list[list[int]], vocab_size: int) -> dict:
    started = time.perf_counter()
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - started
    grammars = [json_schema_grammar(s, any_whitespace=False) for s in schemas]
    started = time.perf_counter()
    for grammar in grammars:
        llguidance.LLMatcher.validate_grammar(grammar, ll)
    compile_s = time.perf_counter() - started
    mask = torch.zeros((1, bitmask_words(vocab_size)), dtype=torch.int32)
    masks, commits = [], []
    for grammar, doc in zip(grammars, docs):
        matcher = llguidance.LLMatcher(ll, grammar)
        for token in doc:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            t1 = time.perf_counter()
            matcher.consume_token(token)
            commits.append(time.perf_counter() - t1)
            masks.append(t1 - t0)
    return {"setup_s": setup, "compile_ms": compile_s * 1e3, "masks": masks, "commits": commits, "refused": 0}


def time_xgrammar(xgr, tokenizer, schemas: list[dict], docs: list[list[int]], vocab_size: int) -> dict:
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = [  # compact, as specd's JSON grammars are
        compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":")) for s in schemas
    ]
    compile_s = time.perf_counter() - started
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    masks, commits, refused = [], [], 0
    for grammar, doc in zip(compiled, docs):
        matcher = xgr.GrammarMatcher(grammar)
        for token in doc:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            t1 = time.perf_counter()
            accepted = matcher.accept_token(token)
            commits.append(time.perf_counter() - t1)
            masks.append(t1 - t0)
            if not accepted:  # the engines read a schema differently: the rest of this document is not timed
                refused += 1
                break
    return {"setup_s": setup, "compile_ms": compile_s * 1e3, "masks": masks, "commits": commits, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="whose tokenizer: a catalogue name, directory or .gguf [SmolLM2]")
    p.add_argument("--install-xgrammar", action="store_true", help="pip-install xgrammar into specd's cache first")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(local_model_dir(ModelConfig(model=args.model)))
    vocab_size = len(tokenizer)
    schemas = [task.schema for task in load_tasks()]
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    docs = documents(ll, schemas, vocab_size, tokenizer)
    results = {"llguidance": time_llguidance(tokenizer, schemas, docs, vocab_size)}
    target = xgrammar_dir(default_cache_dir())
    if args.install_xgrammar and not (target / "xgrammar").is_dir():
        install_xgrammar(target)
    if (target / "xgrammar").is_dir():
        sys.path.insert(0, str(target))
        import xgrammar  # XGRAMMAR[0], from its own directory

        results["xgrammar 0.2.8"] = time_xgrammar(xgrammar, tokenizer, schemas, docs, vocab_size)
    else:
        print(f"xgrammar not installed at {target} (--install-xgrammar): llguidance only", file=sys.stderr)
    rows = []
    for name, r in results.items():
        masks, commits = sorted(r["masks"]), r["commits"]
        p99 = masks[int(0.99 * (len(masks) - 1))]
        mean_ms = statistics.mean(masks) * 1e3
        rows.append([name, f"{r['setup_s']:.2f}", f"{r['compile_ms']:.1f}", f"{mean_ms:.3f}", f"{p99 * 1e3:.3f}",
                     f"{statistics.mean(commits) * 1e6:.1f}", len(masks), r["refused"]])  # fmt: skip
    name = args.model or "SmolLM2-135M-Instruct"
    ended = sum(len(doc) < DOC_TOKENS for doc in docs)
    print(f"# Grammar engines on {name}'s vocabulary ({vocab_size} ids), {len(schemas)} schemas, "
          f"{sum(map(len, docs))} tokens walked ({ended} documents complete), one thread\n")  # fmt: skip
    headers = ["engine", "tokenizer set-up s", f"compile {len(schemas)} schemas ms", "mask ms/token (mean)",
               "mask ms/token (p99)", "commit us/token", "tokens timed", "documents refused"]  # fmt: skip
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
