"""Peer servers for `serve_bench`: the engines a specd user would pick instead, on the same model.

- `transformers`: `transformers serve --continuous-batching` from specd's own environment
  (plain decoding; it refuses `ignore_eos` and continuous usage, so its requests may stop early).
- `vllm`: `vllm serve` from a virtual environment of its own (`--peer-python`), plain decoding,
  plus one server per n-gram draft length in `--peer-ngram-k` (`--speculative-config` with
  method ngram). It takes `ignore_eos` and continuous usage as specd does, so both generate
  the same tokens, and its Prometheus counters give its acceptance.

Every peer serves the model directory specd serves (a GGUF is converted once into specd's
cache; its config.json names the architecture), in the dtype specd resolves, with the same
`--max-model-len`, on 127.0.0.1 and a free port. All servers start before the first run and
stay up, so specd's modes and the peers' interleave load by load, in rotating order, and every
ratio compares runs of one time window (`serve_bench.benchmark`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.metrics import Metrics
from tests.support.server import ServerError, SpecdServer

PEERS = ("transformers", "vllm")
# vLLM's counters, under serve_bench's names for specd's (`serve_bench.COUNTERS`).
VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
}
# n-gram lookup windows as specd's n-gram proposer uses them (speculation.config.ProposerConfig).
NGRAM_MIN, NGRAM_MAX = 1, 4


def served_model(args: argparse.Namespace) -> tuple[Path, str, str]:
    """(model directory, device, dtype) specd serves for these benchmark arguments."""
    from models.loader import ModelConfig, load_model, local_model_dir, resolve_device, resolve_dtype

    config = ModelConfig(args.model)
    model_dir = local_model_dir(config)
    if model_dir is None or not (model_dir / "config.json").exists():
        # A GGUF not converted yet: loading it once writes specd's cached directory.
        load_model(ModelConfig(args.model, tune_kernels=False))
        model_dir = local_model_dir(config)
    if model_dir is None:
        raise ServerError(f"--peer needs a local model directory or GGUF, got {args.model!r}")
    device = resolve_device(args.device or "auto")
    return model_dir, str(device), str(resolve_dtype(args.dtype or "auto", device)).removeprefix("torch.")


class TransformersServe(SpecdServer):
    """`transformers serve --continuous-batching` on the model directory specd serves."""

    name = "transformers serve"
    ready_path = "/health"

    def __init__(self, args: argparse.Namespace, log_path: Path):
        self.model_dir, self.device, self.dtype = served_model(args)
        super().__init__([], log_path)

    def command(self, args: list[str]) -> list[str]:
        return [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype, "--device", self.device,
                "--log-level", "warning", str(self.model_dir)]  # fmt: skip


class VllmServe(SpecdServer):
    """`vllm serve` from its own environment; `ngram_k` > 0 drafts that many tokens by prompt lookup."""

    name = "vllm serve"
    ready_path = "/health"

    def __init__(self, args: argparse.Namespace, log_path: Path, ngram_k: int = 0):
        self.model_dir, self.device, self.dtype = served_model(args)
        self.python = Path(args.peer_python)
        self.max_model_len = args.max_model_len
        self.max_num_seqs = args.max_num_seqs or max([16, *args.concurrency])
        self.ngram_k = ngram_k
        super().__init__([], log_path, env={"VLLM_CPU_KVCACHE_SPACE": str(args.peer_kv_gib)})

    @property
    def speculative_config(self) -> dict | None:
        if not self.ngram_k:
            return None
        return {"method": "ngram", "num_speculative_tokens": self.ngram_k,
                "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": NGRAM_MAX}  # fmt: skip

    def command(self, args: list[str]) -> list[str]:
        command = [str(self.python.with_name("vllm")), "serve", str(self.model_dir), "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                   "--max-num-seqs", str(self.max_num_seqs),
                   "--served-model-name", "peer"]  # fmt: skip
        if self.speculative_config:
            command += ["--speculative-config", json.dumps(self.speculative_config)]
        return command


@dataclass
class Peer:
    """One peer server as a serve_bench mode: its name in the tables and its process."""

    mode: str  # "transformers", "vllm", "vllm-ngram-k5"
    server: SpecdServer

    @property
    def takes_specd_fields(self) -> bool:
        """It accepts `ignore_eos` and continuous usage stats (vLLM does, transformers serve does not)."""
        return isinstance(self.server, VllmServe)

    @property
    def label(self) -> str:
        server = self.server
        if isinstance(server, VllmServe):
            spec = f", n-gram K={server.ngram_k}" if server.ngram_k else ""
            return f"vllm serve ({server.dtype}{spec})"
        return f"transformers serve --continuous-batching ({getattr(server, 'dtype', '?')})"


def start_peers(args: argparse.Namespace, out_dir: Path) -> list[Peer]:
    """The peer servers `args` asks for, started (not yet ready)."""
    if args.peer == "transformers":
        return [Peer("transformers", TransformersServe(args, out_dir / "peer-transformers.log"))]
    if args.peer != "vllm":
        return []
    peers = []
    for k in [0, *args.peer_ngram_k]:
        mode = f"vllm-ngram-k{k}" if k else "vllm"
        if k and "on" not in args.modes and "auto" not in args.modes:
            continue  # no specd mode speculates: nothing to set n-gram peers beside
        if not k and "off" not in args.modes:
            continue
        peers.append(Peer(mode, VllmServe(args, out_dir / f"peer-{mode}.log", k)))
        if len(peers) == 1:
            # The first start compiles the model (minutes on 2 cores) into vLLM's cache; the
            # others then load it, rather than compiling the same graphs side by side.
            peers[0].server.wait_ready(args.ready_timeout)
    return peers


async def scrape_peer(client: httpx.AsyncClient, peer: Peer) -> dict[str, float]:
    """vLLM's speculation counters (none for transformers serve)."""
    if not isinstance(peer.server, VllmServe):
        return {}
    metrics = Metrics((await client.get("/metrics")).text)
    return {key: metrics.value(name, default=0.0) for name, key in VLLM_COUNTERS.items()}


async def wait_peer_idle(client: httpx.AsyncClient, peer: Peer, timeout: float = 60.0) -> None:
    """Until the peer runs and queues nothing (vLLM's gauges), or a second for a peer without them."""
    if not isinstance(peer.server, VllmServe):
        await asyncio.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = Metrics((await client.get("/metrics")).text)
        busy = metrics.value("vllm:num_requests_running", default=0.0) + metrics.value(
            "vllm:num_requests_waiting", default=0.0
        )
        if busy == 0:
            return
        await asyncio.sleep(0.2)
