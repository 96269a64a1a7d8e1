"""The structured-outputs benchmark at CI size: a real specd on the tiny model, every variant and
kind. It checks the table and JSON hold what the docs promise and that every structured reply
that ended by `stop` validated; it asserts nothing about speed."""

from __future__ import annotations

import json

from benchmarks import structured_bench
from tests.support.server import finish_server, serve_args, start_server


def test_every_variant_and_kind_runs_and_stopped_replies_validate(tmp_path, tiny_llama_dir):
    """Short prompts and small schemas the tiny model (512-token context) completes in a few tokens."""
    small = [
        ("flag", "extraction", "The light is on. Is it on?", {"type": "boolean"}),
        ("pick", "extraction", "Colour: red. Which colour?", {"enum": ["red", "green"]}),
        ("size", "generation", "Pick a size.", {"enum": ["small", "large"]}),
        ("yes", "generation", "Say yes or no.", {"type": "boolean"}),
    ]
    prompts = tmp_path / "tasks.jsonl"
    rows = [
        {"id": i, "kind": k, "prompt": p, "schema": {"type": "object", "properties": {"v": v}, "required": ["v"],
                                                     "additionalProperties": False}}
        for i, k, p, v in small
    ]  # fmt: skip
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out_dir = tmp_path / "out"
    server = start_server(serve_args(model=tiny_llama_dir, dtype="float32", device="cpu"), tmp_path, "tiny")
    try:  # the server as its own peer too: a peer's variant sends the schema without specd's fields
        code = structured_bench.main([
            "--base-url", server.url, "--peer", f"twin={server.url}", "--prompts", str(prompts),
            "--concurrency", "1,2", "--num-requests", "2", "--max-tokens", "24", "--out-dir", str(out_dir),
        ])  # fmt: skip
    finally:
        finish_server(server)
    assert code == 0
    saved = json.loads((out_dir / "structured_bench.json").read_text())
    runs, lengths = saved["runs"], saved["meta"]["structured_lengths"]
    assert set(lengths) == {i for i, *_ in small} and all(n >= 1 for n in lengths.values())
    seen = {(r["kind"], r["load"], r["variant"]) for r in runs}
    variants = (*structured_bench.VARIANTS, "twin-json")
    assert seen == {(k, c, v) for k in ("extraction", "generation") for c in (1, 2) for v in variants}
    for run in runs:
        assert run["num_completed"] == run["num_requests"] == 2 and not run["errors"], run
        if run["variant"] in structured_bench.SPECULATION_OFF:
            assert run["drafted_tokens"] == 0, run  # speculation off: the baselines
        if run["variant"] in structured_bench.FREE:
            assert run["num_valid"] is None
            if run["variant"] == "free-same":  # each reply as long as its task's structured one
                kind = [i for i, k, *_ in small if k == run["kind"]]
                assert run["num_output_tokens"] == sum(lengths[i] for i in kind), (run, lengths)
        else:
            # The grammar ends only on a valid document, and these schemas end within the budget.
            assert run["num_valid"] == run["num_stopped"] == 2, run
    text = (out_dir / "structured_bench.md").read_text()
    assert "| kind | streams | variant | tok/s | /json-off | /free-same |" in text
    assert text.count("| extraction |") == 10 and text.count("| generation |") == 10


def test_it_starts_its_own_server(tmp_path, tiny_llama_dir):
    prompts = tmp_path / "tasks.jsonl"
    schema = {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"]}
    prompts.write_text("".join(json.dumps({"id": k, "kind": k, "prompt": "Yes?", "schema": schema}) + "\n"
                               for k in ("extraction", "generation")))  # fmt: skip
    code = structured_bench.main([
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--prompts", str(prompts), "--concurrency", "1",
        "--num-requests", "1", "--max-tokens", "16", "--out-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0 and "| generation | 1 | json-auto |" in (tmp_path / "out" / "structured_bench.md").read_text()


def test_the_prompt_set_validates_against_its_own_schemas():
    """Each task's schema is a valid JSON schema that needs an object, and the kinds are the two named."""
    import jsonschema

    tasks = structured_bench.load_tasks()
    assert {t.kind for t in tasks} == {"extraction", "generation"} and len({t.id for t in tasks}) == len(tasks)
    for task in tasks:
        jsonschema.Draft202012Validator.check_schema(task.schema)
        assert task.schema["type"] == "object"
