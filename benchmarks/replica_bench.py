"""specd replicas behind vllm-router: does routing keep what each replica cached?

    make router
    python -m benchmarks.replica_bench --policies round_robin,cache_aware

Three setups, each on fresh servers (cold caches), on the same traffic shape:

- `single`: one replica pinned to core 0, no router, half the conversations (its share);
- one row per `--policies` entry: two replicas pinned to cores 0 and 1 behind vllm-router
  with that policy, all the conversations (2x the load).

By default the client (this process) runs on the setup's cores too (`--client-cores
shared`): the same cores per replica in every setup, the client's and router's work
included, which is what scaling out by one machine per replica gives. With `free` the
client is not pinned: `single` then has a core of its own for the client that the
two-replica setups share with their replicas.

Traffic: `--conversations` multi-turn chats of `--turns` turns each (user messages from the
chat prompt set, every reply appended to the history, as chat clients do), all at once, then
repeated agent traffic: each of `--conversations` agents sends its one instruction
(agent prompt set) `--agent-repeats` times in a row, each repeat with a new task line, so
suffix decoding can draft from the agent's earlier outputs on the replica that holds them.
Replicas draft by suffix decoding (`--draft suffix`) so acceptance shows what a replica
remembers of earlier outputs. All requests are one tenant (no API key), as behind a router
that holds the key; a conversation id in each system prompt keeps their prefixes apart.

Reported per setup: TTFT p50/p99 of turn 1 and of the last turn, the prefix hit rate
(`cached_tokens` / prompt tokens over all requests), suffix acceptance (accepted / drafted
tokens) on the agent traffic, and output tokens/s (chat and agent phases together), with
each router row's throughput over `single`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.serve_client import load_prompts
from tests.support.router import Replica, completed_requests, router_binary, start_replicas, start_router
from tests.support.server import serve_args

MODEL = "specd"


@dataclass
class Tally:
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


async def turn(http: httpx.AsyncClient, messages: list[dict], max_tokens: int, tally: Tally, index: int) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, text = time.perf_counter(), None, ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                if choice["delta"].get("content") and first is None:
                    first = time.perf_counter()
                text += choice["delta"].get("content") or ""
            if usage := chunk.get("usage"):
                tally.prompt_tokens += usage["prompt_tokens"]
                tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                tally.output_tokens += usage["completion_tokens"]
    tally.ttft_by_turn.setdefault(index, []).append((first or time.perf_counter()) - start)
    return text


async def conversation(http, users: list[str], turns: int, max_tokens: int, tally: Tally) -> None:
    messages = [{"role": "system", "content": f"Conversation {uuid.uuid4().hex}. You are a helpful assistant."}]
    for t in range(turns):
        messages.append({"role": "user", "content": users[t % len(users)]})
        messages.append({"role": "assistant", "content": await turn(http, messages, max_tokens, tally, t)})


async def agent(http, instruction: str, repeats: int, max_tokens: int, tally: Tally) -> None:
    for r in range(repeats):
        messages = [{"role": "system", "content": f"Agent {uuid.uuid4().hex[:8]}. {instruction}"},
                    {"role": "user", "content": f"Task {r + 1}: do it again, in the same format."}]  # fmt: skip
        await turn(http, messages, max_tokens, tally, r)


def counters(replicas: list[Replica]) -> tuple[list[float], float, float]:
    """Per replica requests finished, and suffix draft tokens drafted / accepted over all replicas
    (from /metrics: a router may pass on only the OpenAI fields of a request, and with them
    drop `include_speculation`)."""
    served, drafted, accepted = [], 0.0, 0.0
    for replica in replicas:
        m = replica.metrics()
        served.append(completed_requests(m))
        drafted += m.value("specd_spec_decode_num_draft_tokens_total", method="suffix", default=0)
        accepted += m.value("specd_spec_decode_num_accepted_tokens_total", method="suffix", default=0)
    return served, drafted, accepted


async def drive(url: str, n: int, args: argparse.Namespace, replicas: list[Replica]) -> tuple[Tally, Tally]:
    chat_users = [p.text for p in load_prompts(["chat"])]
    instructions = [p.text for p in load_prompts(["agent"])]
    chat, agents = Tally(), Tally()
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(http, chat_users[i:] + chat_users[:i], args.turns, args.max_tokens, chat)
                               for i in range(n)))  # fmt: skip
        chat.seconds = time.perf_counter() - start
        _, drafted, accepted = counters(replicas)
        start = time.perf_counter()
        await asyncio.gather(*(agent(http, instructions[i % len(instructions)], args.agent_repeats,
                                     args.max_tokens, agents) for i in range(n)))  # fmt: skip
        agents.seconds = time.perf_counter() - start
    _, drafted_after, accepted_after = counters(replicas)
    agents.drafted, agents.accepted = int(drafted_after - drafted), int(accepted_after - accepted)
    return chat, agents


def replica_args(args: argparse.Namespace) -> list[str]:
    return serve_args(served_model_name=MODEL, draft="suffix", max_num_seqs=args.conversations,
                      max_model_len=4096, dtype=args.dtype)  # fmt: skip


async def run_setup(name: str, args: argparse.Namespace, out: Path) -> dict:
    cores = ["0"] if name == "single" else ["0", "1"]
    (out / name).mkdir(parents=True, exist_ok=True)
    replicas: list[Replica] = start_replicas(replica_args(args), out / name, cores)
    router = None
    own_cores = os.sched_getaffinity(0)
    if args.client_cores == "shared":  # the client (this process) on the replicas' cores only
        os.sched_setaffinity(0, {int(c) for c in cores})
    try:
        if name != "single":
            binary = router_binary()
            assert binary is not None
            router = start_router(replicas, name, out / name, binary)
        n = args.conversations // 2 if name == "single" else args.conversations
        chat, agents = await drive(router.url if router else replicas[0].url, n, args, replicas)
        served = counters(replicas)[0]
    finally:
        os.sched_setaffinity(0, own_cores)
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()
    last = args.turns - 1
    return {
        "setup": name, "replicas": len(replicas), "conversations": n, "served": served,
        "turn1_ttft": pct(chat.ttft_by_turn[0]), "last_ttft": pct(chat.ttft_by_turn[last]),
        "hit_rate": (chat.cached_tokens + agents.cached_tokens) / (chat.prompt_tokens + agents.prompt_tokens),
        "acceptance": agents.accepted / agents.drafted if agents.drafted else 0.0,
        "tok_s": (chat.output_tokens + agents.output_tokens) / (chat.seconds + agents.seconds),
    }  # fmt: skip


def pct(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def table(rows: list[dict], turns: int) -> str:
    base = next(r for r in rows if r["setup"] == "single")
    lines = [f"| setup | replicas | conversations | turn 1 TTFT p50 / p99 ms | turn {turns} TTFT p50 / p99 ms | "
             f"turn-{turns} p50 / single | prefix hit rate | hit rate / single | suffix acceptance | out tok/s | "
             "tok/s / single | requests per replica |", "|---" * 12 + "|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['replicas']} | {r['conversations']} | "
            f"{r['turn1_ttft'][0] * 1000:.0f} / {r['turn1_ttft'][1] * 1000:.0f} | "
            f"{r['last_ttft'][0] * 1000:.0f} / {r['last_ttft'][1] * 1000:.0f} | "
            f"{r['last_ttft'][0] / base['last_ttft'][0]:.2f} | {r['hit_rate']:.2f} | "
            f"{r['hit_rate'] / base['hit_rate']:.2f} | {r['acceptance']:.2f} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / base['tok_s']:.2f} | {' / '.join(str(int(x)) for x in r['served'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="round_robin,cache_aware",
                        help="vllm-router policies, one two-replica run each [round_robin,cache_aware]")  # fmt: skip
    parser.add_argument("--conversations", type=int, default=16, help="conversations (and agents) at once [16]")
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation [10]")
    parser.add_argument("--agent-repeats", type=int, default=5, help="requests per agent [5]")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply [32]")
    parser.add_argument("--dtype", default="auto", help="replicas' --dtype [auto]")
    parser.add_argument("--client-cores", choices=("shared", "free"), default="shared",
                        help="shared: the client runs on the replicas' cores, so every setup has the same cores "
                             "per replica (single: replica and client on core 0; two replicas: both cores for "
                             "replicas, client and router); free: the client is not pinned, which leaves "
                             "`single` a core to itself [shared]")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/replicas"), help="[%(default)s]")
    args = parser.parse_args(argv)
    if router_binary() is None:
        print("vllm-router is not installed: make router", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = [asyncio.run(run_setup(name, args, args.out_dir)) for name in ["single", *args.policies.split(",")]]
    report = (f"## specd replicas behind vllm-router\n\n{args.conversations} conversations x {args.turns} turns, "
              f"then {args.conversations} agents x {args.agent_repeats} requests; {args.max_tokens} tokens a reply, "
              f"greedy, --draft suffix, each replica pinned to one core (taskset), `single` at half the load, "
              f"client cores {args.client_cores}.\n\n"
              + table(rows, args.turns) + "\n")  # fmt: skip
    print(report)
    (args.out_dir / "replica_bench.md").write_text(report)
    (args.out_dir / "replica_bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
