"""Multi-turn benchmark of kvstored (not a test): the article's workload against the real daemon,
with the GPU modelled. Workload: multi-turn conversations with a 12K-token first prompt and 4K more
tokens per turn, 8 turns, 20 s think time, at 16 to 256 simultaneous conversations. Compared: no
offload, RAM tier, RAM + fs, RAM + fs + S3, by modelled throughput and hit rate of reusable tokens.
Modelled: Qwen3.6-35B-A3B on 2x H100 (TP=2) by default, Llama-3.1-8B on one H100 with --model.

Workload (every parameter is a flag; defaults are the article's): each conversation sends a
12K-token prompt, then 7 more turns that each append 4K tokens (the answer plus the next
question) and resend the whole history: prompts of 12K, 16K, ... 40K tokens. Token ids are
synthetic and seeded per conversation; chunk keys come from kvstored_client.chunk_keys, so a
turn's prompt shares its leading keys with the previous turn's. Conversations start at random
times within one think time and think (uniformly 0.5-1.5x --think-s) between turns.

Modelled model and GPU (--model; printed as a "model" block with the basis of every number, and
in the JSON): KV bytes per token from the attention layers' shapes; the prefill rate from the
FLOPs per token (2 x active parameters + attention at the workload's mean context) against the
GPUs' bf16 dense peak at an assumed MFU; the GPU prefix cache from HBM x gpu_memory_utilization
minus the weights and a runtime reserve, divided by the KV bytes per token.
- qwen3.6-35b-a3b (default): hybrid attention, 10 of 40 layers attend with 2 KV heads of dim 256:
  20 KiB of KV per token; ~3B active parameters; 2x H100 SXM (TP=2); prefill 50,000 tokens/s;
  GPU cache ~3.3M tokens (~80 conversations at their 40K-token last turn).
- llama-3.1-8b: 32 layers x 8 KV heads x 128: 128 KiB per token; one H100; 16,000 tokens/s; GPU
  cache ~0.4M tokens (~10 conversations).
--model-kv-bytes-per-token, --prefill-tokens-per-s, --gpu-tokens / --gpu-conversations override
the preset's figures (the GPU cache, derived in bytes, follows an overridden KV size).

Modelled GPU (a discrete-event simulation on a model clock):
- a prefix cache of that many tokens, LRU over chunks. A turn's chunks are touched tail first,
  so a conversation's prefix is the last of it to go (vLLM frees blocks in that order);
- a prefill cost per token (the prefill rate) for every prompt token not already cached (the new
  tokens of the turn and every reusable token that missed);
- loads from kvstored go through a loader that runs beside the GPU (vLLM loads KV
  asynchronously and keeps computing other requests); --serial-loads puts them on the GPU's
  timeline instead. Each resource is first-come first-served.
Every offloaded chunk really goes through the daemon (client library, pool mapping):
- when the GPU cache evicts chunks, they are stored into kvstored (Client.store, real bytes);
- on a turn, the reusable chunks that are not on the GPU are looked up (Client.lookup: hits per
  tier from the per-key tier kinds) and loaded (Client.load, one call per run of chunks from the
  same tier, each timed). The loader's service time is the measured lookup time plus, per load
  call, its fixed cost (measured at the start of each run with a 4 KiB chunk) and its bytes times
  the tier's cost per byte times the byte scale (below). The cost per byte is the running median,
  over the tier's last 64 load calls, of (measured time - fixed cost) / bytes: taken from the
  daemon's own transfers, never a constant, with the noise of a shared machine filtered out.
  Stores are not charged (engines offload in the background) but are timed and reported.
- misses (chunks the daemon does not have, or lost between lookup and load) are prefilled.
Configurations (a table, CONFIGS): no offload (no daemon), RAM tier only, RAM + fs, RAM + fs +
S3 (fs smaller in that configuration so the object store serves the overflow). One fresh daemon
(and fs directory, and bucket) per configuration and conversation count.

Scaling (printed with the results): the bytes that really move are --kv-bytes-per-token (default
512), so a 4096-token chunk is 2 MiB (80 MiB for Qwen3.6-35B-A3B, 512 MiB for Llama-3.1-8B);
the measured cost per byte is charged for the full-size model's bytes (x40 for Qwen, x256 for
Llama; the fixed cost of a call is charged once, unscaled). The RAM tier and the fs tier are
sized in conversations at their final 40K-token history: RAM 128 (2.5 GiB at the scaled size;
100 GiB of host RAM at Qwen's size), fs 512 (RAM + fs) or 128 (RAM + fs + S3), S3 unbounded.

Physical limits (measured at the start and at the end of the sweep, printed beside the ratios):
memcpy of 2 MiB pieces (one thread: what a RAM-tier load copies), raw O_DIRECT preadv of 2 MiB
files on the fs tier's filesystem with the fs tier's 8 threads, both streaming and in batches of
one load call's chunks one after another (the loader's pattern), and raw aiobotocore GETs of
2 MiB objects against the same S3 server (16 in flight, the S3 tier's concurrency). The output
also prints what a token loaded from each tier costs relative to recomputing it (break-even:
KV bytes per token x prefill rate, 0.95 GiB/s for Qwen, 1.95 GiB/s for Llama), the load average
over the sweep, and, when a target misses, what fs load rate the targets would need.

Metrics per configuration and conversation count: hit rate per tier as a share of the reusable
tokens (tokens of the previous turn's prompt, the only ones a cache can serve: at most 81% of
all prompt tokens with the default shape), bytes moved per tier (client side, and the daemon's
own Stats counters), measured load GiB/s per tier, modelled throughput (prompt tokens per
modelled second, decode not modelled) and time to first token p50/p99 (arrival to end of
prefill, modelled seconds). Targets at the largest count (rows with PASS/MISS, as in the other
benchmarks' JSON): RAM + fs >= 2x no offload and >= 1.5x RAM alone, hit rate >= 90%. Token ids,
start times and think times are seeded per conversation; the order in which turns are served
depends on the measured load times, so figures with offload move from run to run (no offload is
exactly reproducible).

Several nodes (--nodes N, bench/multiturn_nodes.py): N real daemons, one per modelled GPU node,
each turn of a conversation routed round-robin to the next node; no offload, islands (RAM + fs),
RAM + fs + peers, RAM + fs + a shared S3 bucket; hit rates per tier, PEER included.

Usage: .venv/bin/python bench/multiturn.py [--model qwen3.6-35b-a3b|llama-3.1-8b]
           [--conversations 16,32,64,128,192,256] [--configs none,ram,ram+fs,ram+fs+s3]
           [--s3 auto|radosgw|moto] [--json PATH] [--plot PATH] [--dry-run] [--nodes N]
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import heapq
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import (  # noqa: E402
    GIB, MIB, REPO, Daemon, Row, load_average, machine_info, populate, print_aligned, write_json,
)
from compare import apply_nt_threshold, nt_threshold_arg  # noqa: E402

TIERS = ("gpu", "ram", "fs", "s3")  # where a reusable chunk was found
VOCAB = 128_256  # token ids are synthetic (only their hashes matter): any vocabulary size will do
HEADER = 48  # bytes of each stored chunk that identify it: key (32) + conversation (8) + index (8)
TARGET_HIT = 0.90  # RAM + fs at the largest count: overall hit rate of reusable tokens
TARGET_VS_NONE = 2.0  # RAM + fs at the largest count: modelled throughput vs no offload
TARGET_VS_RAM = 1.5  # RAM + fs at the largest count: modelled throughput vs the RAM tier alone
COST_WINDOW = 64  # load calls per tier over which the cost per byte is a running median
FS_IO_THREADS = 8  # the fs tier's default io_threads: the raw O_DIRECT baseline uses as many
S3_INFLIGHT = 16  # the S3 tier's default max_concurrency: the raw GET baseline keeps as many in flight


# -- configurations: which kvstored tiers sit under the modelled GPU ------------------------------


@dataclass(frozen=True)
class Config:
    """One configuration of the comparison. `lower` lists the kvstored tiers under the RAM tier,
    in chain order, each with the Sizes field that bounds it; a new tier kind (a peer) is a new
    row here plus an entry in TIER_SPECS."""

    key: str
    label: str
    lower: tuple[tuple[str, str], ...] = ()
    offload: bool = True  # False: no daemon, the GPU's own prefix cache only

    @property
    def tiers(self) -> tuple[str, ...]:
        """Where a hit can come from."""
        return ("gpu",) + (("ram", *(kind for kind, _ in self.lower)) if self.offload else ())

    def uses(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.lower)


CONFIGS = (
    Config("none", "no offload", offload=False),
    Config("ram", "RAM"),
    Config("ram+fs", "RAM + fs", (("fs", "fs_bytes"),)),
    Config("ram+fs+s3", "RAM + fs + S3", (("fs", "s3_fs_bytes"), ("s3", "s3_bytes"))),
)
CONFIG_BY_KEY = {c.key: c for c in CONFIGS}
CONFIG_LABELS = {c.key: c.label for c in CONFIGS}


# -- parameters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    initial_tokens: int = 12 * 1024
    turn_tokens: int = 4 * 1024
    turns: int = 8
    think_s: float = 20.0
    chunk_tokens: int = 4096
    seed: int = 0

    def prompt_tokens(self, turn: int) -> int:
        """Tokens sent at turn 1..turns: the whole history."""
        return self.initial_tokens + (turn - 1) * self.turn_tokens

    @property
    def final_tokens(self) -> int:
        return self.prompt_tokens(self.turns)

    def reusable_chunks(self, turn: int) -> int:
        """Full chunks of the previous turn's prompt: what a cache can serve at this turn."""
        return 0 if turn == 1 else self.prompt_tokens(turn - 1) // self.chunk_tokens

    @property
    def tokens_per_conversation(self) -> int:
        return sum(self.prompt_tokens(t) for t in range(1, self.turns + 1))

    @property
    def reusable_per_conversation(self) -> int:
        return sum(self.reusable_chunks(t) for t in range(1, self.turns + 1)) * self.chunk_tokens

    @property
    def mean_new_token_context(self) -> float:
        """Mean position of the tokens a turn computes when its history is cached (turn 1: all of
        it; later turns: the appended tokens), weighted by tokens: the context their attention
        spans (20,480 with the default shape)."""
        total = weighted = 0.0
        for turn in range(1, self.turns + 1):
            start = self.prompt_tokens(turn - 1) if turn > 1 else 0
            end = self.prompt_tokens(turn)
            total += end - start
            weighted += (end - start) * (start + end) / 2
        return weighted / total


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: int
    bf16_dense_flops: float


# H100 SXM5 80 GB: nvidia-smi reports 81,559 MiB; 989 TFLOP/s bf16 dense (1,979 is with sparsity)
H100 = Gpu("H100 SXM 80 GB", 81_559 * MIB, 989e12)


@dataclass(frozen=True)
class ModelSpec:
    """A modelled model on its GPUs: the shapes and assumptions every derived figure comes from."""

    key: str  # the --model value
    name: str
    gpu: Gpu
    gpus: int  # tensor parallel
    params: float  # all weights live in HBM
    active_params: float  # per token
    layers: int
    attention_layers: int  # layers with a per-token KV cache
    q_heads: int
    kv_heads: int
    head_dim: int
    mfu: float  # assumed model FLOPs utilization of prefill
    mfu_basis: str
    prefill_tokens_per_s: float  # the preset's figure: the MFU estimate, rounded
    prefill_basis: str
    not_per_token: str = ""  # state the per-token KV figure leaves out
    kv_dtype_bytes: int = 2  # bf16
    weight_bytes_per_param: int = 2  # bf16
    gpu_memory_utilization: float = 0.9  # vLLM's default
    runtime_reserve: float = 0.10  # share of HBM for activations, CUDA graphs, NCCL and the CUDA context

    @property
    def kv_bytes_per_token(self) -> int:
        return self.attention_layers * 2 * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    def attention_flops_per_token(self, context: float) -> float:
        """QK^T and AV over `context` earlier tokens: 2 matmuls x 2 FLOPs x query heads x head dim."""
        return self.attention_layers * 4 * self.q_heads * self.head_dim * context

    def flops_per_token(self, context: float) -> float:
        return 2 * self.active_params + self.attention_flops_per_token(context)

    def estimated_prefill(self, context: float) -> float:
        return self.gpus * self.gpu.bf16_dense_flops * self.mfu / self.flops_per_token(context)

    def implied_mfu(self, prefill_tokens_per_s: float, context: float) -> float:
        return prefill_tokens_per_s * self.flops_per_token(context) / (self.gpus * self.gpu.bf16_dense_flops)

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.params * self.weight_bytes_per_param / self.gpus

    @property
    def kv_bytes_per_gpu(self) -> float:
        """What vLLM leaves for the KV cache on each GPU: HBM x gpu_memory_utilization, minus the
        weights' share and the runtime reserve."""
        hbm = self.gpu.hbm_bytes
        return hbm * self.gpu_memory_utilization - self.weight_bytes_per_gpu - hbm * self.runtime_reserve


MODELS = {m.key: m for m in (
    ModelSpec(
        key="qwen3.6-35b-a3b", name="Qwen3.6-35B-A3B bf16", gpu=H100, gpus=2, params=35e9, active_params=3e9,
        layers=40, attention_layers=10, q_heads=16, kv_heads=2, head_dim=256,
        mfu=0.25, mfu_basis="assumed: MoE prefill runs 8 of 256 small experts (width 512, hidden 2048) per token "
                            "as grouped GEMMs of low arithmetic intensity, plus two all-reduces per layer at TP=2",
        prefill_tokens_per_s=50_000.0, prefill_basis="the estimate, rounded down (issue #13: ~50K for the pair)",
        not_per_token="the 30 Gated DeltaNet layers keep a fixed state per sequence instead (30 x (8,192 x 3 conv "
                      "+ 32 heads x 128 x 128) x 2 B = 31 MiB in bf16), not per token: not modelled",
    ),
    ModelSpec(
        key="llama-3.1-8b", name="Llama-3.1-8B bf16", gpu=H100, gpus=1, params=8.03e9, active_params=8.03e9,
        layers=32, attention_layers=32, q_heads=32, kv_heads=8, head_dim=128,
        mfu=0.45, mfu_basis="assumed: dense bf16 prefill with FlashAttention on one GPU",
        prefill_tokens_per_s=16_000.0, prefill_basis="the estimate, rounded down (the figure this benchmark "
                                                     "used before the seed's model)",
    ),
)}
DEFAULT_MODEL = "qwen3.6-35b-a3b"


class Transfer(enum.Enum):
    """How the modelled engine moves chunks to and from kvstored: as vLLM's tier (mode 1) does,
    through a registered region (StoreFromRegion, LoadToRegion after a REGION lookup), or as the
    direct spec (mode 2) does, through the pool mapping (Reserve/Commit, Acquire/Release)."""

    REGION = "region"
    POOL = "pool"


@dataclass(frozen=True)
class Model:
    """What the simulation uses: the figures below, derived from a ModelSpec or overridden."""

    model_name: str
    model_kv_bytes_per_token: int
    kv_bytes_per_token: int  # what really moves
    prefill_tokens_per_s: float
    gpu_tokens: int
    serial_loads: bool = False
    model_key: str = ""
    transfer: Transfer = field(default_factory=lambda: Transfer.REGION)

    @property
    def byte_scale(self) -> float:
        return self.model_kv_bytes_per_token / self.kv_bytes_per_token


@dataclass(frozen=True)
class Basis:
    """One modelled figure, its value as printed and where it comes from."""

    quantity: str
    value: str
    basis: str


def derive_model(spec: ModelSpec, w: Workload, kv_bytes_per_token: int, serial_loads: bool,
                 model_kv_bytes_per_token: int | None = None, prefill_tokens_per_s: float | None = None,
                 gpu_tokens: int | None = None, gpu_conversations: float | None = None
                 ) -> tuple[Model, list[Basis], dict[str, float]]:
    """The simulation's figures from the preset, each with its basis; None: derive it. Returns the
    model, the basis lines and the derivation's numbers (for the JSON)."""
    ctx = w.mean_new_token_context
    gpus = f"{spec.gpus}x {spec.gpu.name}" + (f" (TP={spec.gpus})" if spec.gpus > 1 else "")
    kv = spec.kv_bytes_per_token
    kv_basis = (f"{spec.attention_layers} of {spec.layers} layers attend x (K, V) x {spec.kv_heads} KV heads x "
                f"{spec.head_dim} dims x {spec.kv_dtype_bytes} B" + (f"; {spec.not_per_token}"
                                                                    if spec.not_per_token else ""))
    if model_kv_bytes_per_token:
        kv_basis = f"--model-kv-bytes-per-token (the preset's: {kv:,} = {kv_basis})"
        kv = model_kv_bytes_per_token
    flops = spec.flops_per_token(ctx)
    peak = spec.gpus * spec.gpu.bf16_dense_flops
    estimate = spec.estimated_prefill(ctx)
    rate = prefill_tokens_per_s or spec.prefill_tokens_per_s
    arithmetic = (f"FLOPs/token = 2 x {spec.active_params / 1e9:g}B active params + {spec.attention_layers} attention "
                  f"layers x 4 x {spec.q_heads} query heads x {spec.head_dim} dims x {ctx:,.0f} tokens of mean context "
                  f"= {2 * spec.active_params / 1e9:.2f} + {spec.attention_flops_per_token(ctx) / 1e9:.2f} = "
                  f"{flops / 1e9:.2f} GFLOP; {spec.gpus} x {spec.gpu.bf16_dense_flops / 1e12:,.0f} TFLOP/s bf16 dense "
                  f"x {100 * spec.mfu:.0f}% MFU ({spec.mfu_basis}) = {peak * spec.mfu / 1e12:,.0f} TFLOP/s -> "
                  f"{estimate:,.0f} tokens/s")
    if prefill_tokens_per_s:
        prefill_basis = f"--prefill-tokens-per-s (the preset's estimate: {arithmetic})"
    else:
        prefill_basis = (f"{arithmetic}; {spec.prefill_basis}: {100 * spec.implied_mfu(rate, ctx):.1f}% MFU; "
                         f"the mean context is the workload's (one rate for every turn: a recomputed history "
                         f"attends over less)")
    per_gpu = spec.kv_bytes_per_gpu
    budget = per_gpu * spec.gpus
    hbm = spec.gpu.hbm_bytes
    derived_tokens = int(budget // kv)
    capacity_arithmetic = (
        f"per GPU: {spec.gpu_memory_utilization:g} (gpu_memory_utilization) x {hbm / GIB:.1f} GiB HBM - "
        f"{spec.weight_bytes_per_gpu / GIB:.1f} GiB weights ({spec.params / 1e9:g}B params x "
        f"{spec.weight_bytes_per_param} B / {spec.gpus} GPU{'s' if spec.gpus > 1 else ''}) - "
        f"{spec.runtime_reserve * hbm / GIB:.1f} GiB reserve ({100 * spec.runtime_reserve:.0f}% of HBM: activations, "
        f"CUDA graphs, NCCL, context) = {per_gpu / GIB:.1f} GiB; x {spec.gpus} / {kv:,} B/token")
    if gpu_tokens:
        tokens, capacity_basis = gpu_tokens, f"--gpu-tokens (derived: {derived_tokens:,}: {capacity_arithmetic})"
    elif gpu_conversations:
        tokens = int(gpu_conversations * w.final_tokens)
        capacity_basis = f"--gpu-conversations {gpu_conversations:g} (derived: {derived_tokens:,}: {capacity_arithmetic})"
    else:
        tokens, capacity_basis = derived_tokens, capacity_arithmetic
    overridden = [flag for flag, v in (("KV bytes/token", model_kv_bytes_per_token), ("prefill", prefill_tokens_per_s),
                                       ("GPU cache", gpu_tokens or gpu_conversations)) if v]
    name = f"{spec.name} on {gpus}" + (f" ({', '.join(overridden)} overridden)" if overridden else "")
    m = Model(name, kv, kv_bytes_per_token, rate, tokens, serial_loads, spec.key)
    basis = [
        Basis("KV bytes/token", f"{kv:,} B", kv_basis),
        Basis("prefill", f"{rate:,.0f} tokens/s", prefill_basis),
        Basis("GPU prefix cache", f"{tokens:,} tokens = {tokens / w.final_tokens:.1f} conversations",
              f"{capacity_basis}; conversations at their last turn ({w.final_tokens:,} tokens)"),
        Basis("break-even load rate", f"{kv * rate / GIB:.2f} GiB/s",
              "KV bytes/token x prefill rate: a tier that loads slower costs more per token than recomputing"),
        Basis("byte scale", f"x{m.byte_scale:g}",
              f"--kv-bytes-per-token {kv_bytes_per_token} really move (a {w.chunk_tokens}-token chunk is "
              f"{fmt_bytes(w.chunk_tokens * kv_bytes_per_token)} instead of {fmt_bytes(w.chunk_tokens * kv)}); each "
              f"tier's measured cost per byte is charged x{m.byte_scale:g}"),
    ]
    numbers = {"mean_context_tokens": ctx, "flops_per_token": flops, "peak_flops": peak, "mfu_assumed": spec.mfu,
               "estimated_prefill_tokens_per_s": estimate, "implied_mfu": spec.implied_mfu(rate, ctx),
               "hbm_bytes_per_gpu": hbm, "weight_bytes_per_gpu": spec.weight_bytes_per_gpu,
               "reserve_bytes_per_gpu": spec.runtime_reserve * hbm, "kv_cache_bytes_per_gpu": per_gpu,
               "kv_cache_bytes": budget, "derived_gpu_tokens": derived_tokens,
               "derived_gpu_conversations": derived_tokens / w.final_tokens,
               "breakeven_gib_s": kv * rate / GIB}
    return m, basis, numbers


@dataclass(frozen=True)
class Sizes:
    ram_bytes: int
    fs_bytes: int
    s3_fs_bytes: int
    s3_bytes: int = 0  # 0: unbounded


# -- the modelled GPU prefix cache ---------------------------------------------------------------


class GpuCache:
    """Chunks resident on the modelled GPU, least recently used first."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity = capacity_chunks
        self._lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self._lru:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[bytes], conv: int) -> list[tuple[bytes, int, int]]:
        """Make the prompt's chunks resident (tail first, so the prefix is most recent); returns
        the evicted chunks as (key, conversation, index)."""
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            if key in self._lru:
                self._lru.move_to_end(key)
            else:
                self._lru[key] = (conv, index)
        evicted = []
        while len(self._lru) > self.capacity:
            key, (c, i) = self._lru.popitem(last=False)
            evicted.append((key, c, i))
        return evicted


# -- kvstored as the modelled engine's offload target --------------------------------------------


@dataclass
class LoadResult:
    hits: dict[str, int]  # chunks loaded, per tier
    seconds: dict[str, float]  # measured load time, per tier
    lookup_s: float
    looked_up: int  # chunks the lookup reported as a prefix hit
    loaded: int
    segments: list[tuple[str, float, int]]  # one per load call: (tier, measured seconds, chunks loaded)


class Offload:
    """The modelled engine's connection to kvstored: stores GPU evictions, looks up and loads."""

    TIER_NAMES = {1: "ram", 2: "fs", 3: "s3", 4: "peer"}

    def __init__(self, socket: Path, chunk_bytes: int, chunk_tokens: int, max_chunks: int, seed: int,
                 transfer: Transfer = Transfer.REGION) -> None:
        from kvstored_client import Client, NamespaceSpec

        self.client = Client(socket, deadline_s=120.0, client_name="bench-multiturn")
        self.ns = self.client.register_namespace(NamespaceSpec(
            model="bench/multiturn", dtype="scaled-bf16", chunk_bytes=chunk_bytes, layout="sim",
            block_tokens=chunk_tokens))
        self.chunk_bytes = chunk_bytes
        self.transfer = transfer
        rng = np.random.default_rng(seed)
        self._noise = populate(rng.integers(0, 256, chunk_bytes, dtype=np.uint8))
        span = max_chunks * chunk_bytes
        self._region = self._region_path = None
        if transfer is Transfer.REGION:  # one shared file: stores' chunks, then loads', then the call floor's
            fd, path = tempfile.mkstemp(prefix="kvstored-bench-multiturn-", dir="/dev/shm")
            os.ftruncate(fd, 2 * span + 4096)
            os.close(fd)
            self._region_path = Path(path)
            whole = populate(np.memmap(path, dtype=np.uint8, mode="r+"))
            self._staging, self._out, self._floor_out = whole[:span], whole[span:2 * span], whole[2 * span:]
            self._region = self.client.register_region(path)
        else:
            self._staging = populate(np.empty(span, dtype=np.uint8))
            self._out = populate(np.empty(span, dtype=np.uint8))
            self._floor_out = populate(np.empty(4096, dtype=np.uint8))
        self.max_chunks = max_chunks
        self.call_floor_s = self._calibrate_call_floor()
        self.store_s = 0.0
        self.store_counts = {"stored": 0, "already_present": 0, "dropped": 0}
        self.corrupt = 0

    def _calibrate_call_floor(self, calls: int = 40) -> float:
        """The fixed cost of one load call (Acquire + Release RPCs, or one LoadToRegion, and client
        bookkeeping), measured with a 4 KiB chunk in a namespace of its own: charged once per
        call, as measured, while the rest of a load's time is charged per byte."""
        from kvstored_client import NamespaceSpec

        ns = self.client.register_namespace(NamespaceSpec(model="bench/multiturn-call-floor", dtype="u8",
                                                          chunk_bytes=4096))
        key = b"\x01" * 32
        self._floor_out[:] = 1
        self._store(ns, [key], self._floor_out, 2 * self.max_chunks * self.chunk_bytes)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            if self._load(ns, [key], self._floor_out, 2 * self.max_chunks * self.chunk_bytes) != 1:
                raise RuntimeError("call-floor calibration: the 4 KiB chunk did not load")
            times.append(time.perf_counter() - t0)
        self.client.delete(ns, [key])
        return float(np.median(times[calls // 4:]))

    def _store(self, ns, keys: Sequence[bytes], buf: np.ndarray, region_offset: int):
        """Store len(keys) chunks held in `buf` (which, in region mode, is the region at `region_offset`)."""
        if self._region is None:
            return self.client.store(ns, keys, buf)
        cb = ns.chunk_bytes
        return self.client.store_from_region(ns, self._region, keys, [region_offset + i * cb for i in range(len(keys))])

    def _load(self, ns, keys: Sequence[bytes], out: np.ndarray, region_offset: int) -> int:
        if self._region is None:
            return self.client.load(ns, keys, out)
        cb = ns.chunk_bytes
        return self.client.load_to_region(ns, self._region, keys, [region_offset + i * cb for i in range(len(keys))])

    @property
    def _load_into(self):
        from kvstored_client import LoadInto

        return LoadInto.REGION if self._region is not None else LoadInto.POOL

    @property
    def namespace_id(self) -> str:
        return self.ns.namespace_id

    def close(self) -> None:
        self.client.close()
        if self._region_path is not None:
            self._region_path.unlink(missing_ok=True)

    def stats(self) -> dict[str, dict[str, int]]:
        fields = ("read_bytes", "written_bytes", "loaded_chunks", "stored_chunks", "hits", "lookups", "evictions",
                  "promotions", "writebacks", "dropped_dirty", "dropped_backpressure", "errors", "checksum_failures",
                  "rejected_full", "used_bytes", "chunks")
        out = {}
        for tier in self.client.stats().tiers:
            out[tier.name] = {f: int(getattr(tier, f)) for f in fields}
        return out

    def store(self, evicted: Sequence[tuple[bytes, int, int]]) -> None:
        """Store the chunks the GPU evicted, with real (scaled) bytes: a header naming the chunk,
        then noise."""
        cb = self.chunk_bytes
        for start in range(0, len(evicted), self.max_chunks):
            batch = evicted[start:start + self.max_chunks]
            n = len(batch)
            buf = self._staging[:n * cb].reshape(n, cb)
            buf[:, HEADER:] = self._noise[HEADER:]
            for row, (key, conv, index) in enumerate(batch):
                buf[row, :HEADER] = np.frombuffer(_header(key, conv, index), dtype=np.uint8)
            t0 = time.perf_counter()
            result = self._store(self.ns, [k for k, _, _ in batch], buf, 0)
            self.store_s += time.perf_counter() - t0
            self.store_counts["stored"] += result.stored
            self.store_counts["already_present"] += result.already_present
            self.store_counts["dropped"] += result.dropped

    def lookup_load(self, keys: Sequence[bytes], conv: int, first_index: int) -> LoadResult:
        """Look the keys up; load the leading hits, one timed call per run of the same tier."""
        t0 = time.perf_counter()
        found = self.client.lookup(self.ns, keys, load_into=self._load_into)
        lookup_s = time.perf_counter() - t0
        hits = {name: 0 for name in TIERS}
        seconds = {name: 0.0 for name in TIERS}
        n = min(found.prefix_hits, self.max_chunks)
        tiers = [self.TIER_NAMES.get(int(t), "peer") for t in found.tiers[:n]]
        loaded = 0
        segments = []
        cb = self.chunk_bytes
        while loaded < n:
            start, tier = loaded, tiers[loaded]
            end = start
            while end < n and tiers[end] == tier:
                end += 1
            t1 = time.perf_counter()
            got = self._load(self.ns, keys[start:end], self._out[start * cb:end * cb],
                             self.max_chunks * cb + start * cb)
            elapsed = time.perf_counter() - t1
            seconds[tier] = seconds.get(tier, 0.0) + elapsed
            for i in range(start, start + got):  # wrong bytes are counted, never served as a hit
                if bytes(self._out[i * cb:i * cb + HEADER]) != _header(keys[i], conv, first_index + i):
                    self.corrupt += 1
                    break
                loaded += 1
            hits[tier] = hits.get(tier, 0) + loaded - start
            segments.append((tier, elapsed, loaded - start))
            if loaded < end:
                break  # evicted between lookup and load (or corrupt): the rest is prefilled
        return LoadResult(hits, seconds, lookup_s, n, loaded, segments)


def _header(key: bytes, conv: int, index: int) -> bytes:
    return key + conv.to_bytes(8, "little") + index.to_bytes(8, "little")


# -- one run: a configuration at a number of conversations ---------------------------------------


@dataclass
class TurnRecord:
    conv: int
    turn: int
    arrive: float
    prompt_tokens: int
    reusable_chunks: int
    hits: dict[str, int]
    load_s: float = 0.0  # charged to the loader
    prefill_s: float = 0.0
    done: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured, per tier


@dataclass
class RunResult:
    config: str
    conversations: int
    turns: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)  # share of reusable tokens, per tier
    hit_rate_overall: float = 0.0
    cached_share_of_prompt: float = 0.0
    throughput_tokens_s: float = 0.0
    makespan_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    gpu_busy: float = 0.0  # share of the makespan
    loader_busy: float = 0.0
    gpu_busy_s: float = 0.0  # modelled seconds
    loader_busy_s: float = 0.0
    charged_s: dict[str, float] = field(default_factory=dict)  # modelled loader seconds per tier (fixed + bytes)
    charged_fixed_s: dict[str, float] = field(default_factory=dict)  # of which the load calls' fixed cost
    lookup_s: float = 0.0  # measured lookup time, all turns (on the loader's timeline)
    think_floor_s: float = 0.0  # the latest start + think times of a conversation: no makespan is shorter
    loaded_bytes: dict[str, int] = field(default_factory=dict)  # scaled bytes really loaded, per tier
    load_seconds: dict[str, float] = field(default_factory=dict)  # measured, per tier
    load_gib_s: dict[str, float] = field(default_factory=dict)  # measured: bytes / time of the load calls
    marginal_gib_s: dict[str, float] = field(default_factory=dict)  # median per-byte cost, per call floor removed
    lookup_ms_p50: float = 0.0
    lookups: int = 0
    load_calls: int = 0
    load_call_floor_ms: float = 0.0  # fixed cost of one load call, measured at the start of the run
    load_shortfall_chunks: int = 0  # looked up as hits but gone at load time
    store: dict[str, Any] = field(default_factory=dict)
    daemon: dict[str, dict[str, int]] = field(default_factory=dict)  # Stats deltas per tier
    corrupt_chunks: int = 0
    wall_s: float = 0.0
    load_average: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the run's start and end
    skipped: str = ""


class Simulation:
    def __init__(self, workload: Workload, model: Model, conversations: int, offload: Offload | None) -> None:
        self.w = workload
        self.m = model
        self.n = conversations
        self.offload = offload
        self.gpu = GpuCache(model.gpu_tokens // workload.chunk_tokens)
        ns_id = offload.namespace_id if offload else "no-offload"
        self.keys = [_conversation_keys(workload, c, ns_id) for c in range(conversations)]
        # per conversation, fixed in advance: its start time and its think times (the order in
        # which turns are served depends on measured load times; these do not)
        rng = np.random.default_rng([workload.seed, 1])
        self.starts = rng.uniform(0.0, workload.think_s, conversations) if workload.think_s > 0 else \
            np.zeros(conversations)
        self.thinks = rng.uniform(0.5, 1.5, (conversations, workload.turns)) * workload.think_s
        self.records: list[TurnRecord] = []
        self.lookup_s: list[float] = []
        self.load_calls = 0
        self.shortfall = 0
        self.cost_per_byte: dict[str, deque[float]] = {}
        self.all_costs: dict[str, list[float]] = {}
        self.charged: dict[str, float] = {}
        self.charged_fixed: dict[str, float] = {}

    def run(self) -> list[TurnRecord]:
        events: list[tuple[float, int, str, Any]] = []
        seq = 0

        def push(t: float, kind: str, payload: Any) -> None:
            nonlocal seq
            heapq.heappush(events, (t, seq, kind, payload))
            seq += 1

        for conv in range(self.n):
            push(float(self.starts[conv]), "arrive", (conv, 1))
        loader_q: list[TurnRecord] = []
        gpu_q: list[TurnRecord] = []
        loader_busy = gpu_busy = False
        self.busy = {"loader": 0.0, "gpu": 0.0}
        now = 0.0

        def start_loader() -> None:  # loads beside compute
            nonlocal loader_busy
            if loader_busy or not loader_q:
                return
            rec = loader_q.pop(0)
            load_s = self.serve_load(rec)
            loader_busy = True
            self.busy["loader"] += load_s
            push(now + load_s, "loaded", rec)

        def start_gpu() -> None:
            nonlocal gpu_busy
            if gpu_busy or not gpu_q:
                return
            rec = gpu_q.pop(0)
            service = rec.prefill_s
            if self.m.serial_loads:  # the GPU waits for its own loads
                service = self.serve_load(rec) + rec.prefill_s
            gpu_busy = True
            self.busy["gpu"] += service
            push(now + service, "computed", rec)

        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                conv, turn = payload
                rec = TurnRecord(conv, turn, now, self.w.prompt_tokens(turn), self.w.reusable_chunks(turn), {})
                if self.m.serial_loads:
                    gpu_q.append(rec)
                    start_gpu()
                else:
                    loader_q.append(rec)
                    start_loader()
            elif kind == "loaded":
                loader_busy = False
                gpu_q.append(payload)
                start_loader()
                start_gpu()
            elif kind == "computed":
                gpu_busy = False
                rec = payload
                rec.done = now
                self.records.append(rec)
                if rec.turn < self.w.turns:
                    push(now + float(self.thinks[rec.conv, rec.turn]), "arrive", (rec.conv, rec.turn + 1))
                start_gpu()
                start_loader()
        self.makespan = now
        return self.records

    def charge(self, tier: str, seconds: float, chunks: int) -> float:
        """Modelled time of one load call: its fixed cost (measured at start) once, plus its bytes
        times the tier's cost per byte x the byte scale. The cost per byte is the median over the
        tier's last COST_WINDOW calls (this one included) of (measured time - fixed cost) / bytes:
        the daemon's own transfers, with the noise of a shared machine filtered out."""
        self.load_calls += 1
        assert self.offload is not None
        floor = self.offload.call_floor_s
        if chunks == 0:
            charged = fixed = seconds  # a call that found nothing: its time as measured
        else:
            nbytes = chunks * self.offload.chunk_bytes
            window = self.cost_per_byte.setdefault(tier, deque(maxlen=COST_WINDOW))
            window.append(max(0.0, seconds - floor) / nbytes)
            self.all_costs.setdefault(tier, []).append(window[-1])
            fixed = floor
            charged = floor + float(np.median(window)) * nbytes * self.m.byte_scale
        self.charged[tier] = self.charged.get(tier, 0.0) + charged
        self.charged_fixed[tier] = self.charged_fixed.get(tier, 0.0) + fixed
        return charged

    hit_tiers: tuple[str, ...] = TIERS  # where a reusable chunk can be found

    def serve_load(self, rec: TurnRecord) -> float:
        """The turn reaches the loader: GPU prefix, then kvstored for the rest; the prompt becomes
        resident on the GPU and what that evicts is stored into kvstored (store_after). Returns
        the load time to charge (0 when nothing comes from kvstored)."""
        w = self.w
        keys = self.keys[rec.conv][:rec.prompt_tokens // w.chunk_tokens]
        reusable = keys[:rec.reusable_chunks]
        on_gpu = self.gpu.prefix_hits(reusable)
        hits = dict.fromkeys(self.hit_tiers, 0)
        hits["gpu"] = on_gpu
        load_s = 0.0
        if self.offload is not None and on_gpu < len(reusable):
            res = self.offload.lookup_load(reusable[on_gpu:], rec.conv, on_gpu)
            self.lookup_s.append(res.lookup_s)
            self.shortfall += res.looked_up - res.loaded
            for tier, count in res.hits.items():
                hits[tier] = hits.get(tier, 0) + count
            lookup_s, segments = self._segments(res.lookup_s, res.segments)
            load_s = lookup_s + sum(self.charge(*seg) for seg in segments)
            rec.load_seconds = res.seconds
        rec.hits = hits
        cached = sum(hits.values())
        rec.prefill_s = (rec.prompt_tokens - cached * w.chunk_tokens) / self.m.prefill_tokens_per_s
        rec.load_s = load_s
        self.store_after(keys, rec.conv, cached)
        return load_s

    def _segments(self, lookup_s: float, segments: Sequence[tuple[str, float, int]]
                  ) -> tuple[float, Sequence[tuple[str, float, int]]]:
        """The measured lookup and load calls, as they are charged (here: as measured)."""
        return lookup_s, segments

    def store_after(self, keys: Sequence[bytes], conv: int, cached: int) -> None:
        """The prompt becomes resident on the GPU: what that evicts is stored into kvstored."""
        evicted = self.gpu.admit(keys, conv)
        if self.offload is not None and evicted:
            self.offload.store(evicted)


def _conversation_keys(w: Workload, conv: int, namespace_id: str) -> list[bytes]:
    from kvstored_client import chunk_keys

    tokens = np.random.default_rng([w.seed, conv, 0]).integers(0, VOCAB, w.final_tokens, dtype=np.int64)
    return chunk_keys(tokens, w.chunk_tokens, namespace_id)


def summarize(config: str, sim: Simulation, offload: Offload | None, before: dict | None,
              after: dict | None) -> RunResult:
    w, recs = sim.w, sim.records
    r = RunResult(config, sim.n)
    r.turns = len(recs)
    r.prompt_tokens = sum(x.prompt_tokens for x in recs)
    r.reusable_tokens = sum(x.reusable_chunks for x in recs) * w.chunk_tokens
    r.hit_tokens = {t: sum(x.hits.get(t, 0) for x in recs) * w.chunk_tokens for t in TIERS}
    r.hit_rate = {t: (v / r.reusable_tokens if r.reusable_tokens else 0.0) for t, v in r.hit_tokens.items()}
    r.hit_rate_overall = sum(r.hit_rate.values())
    r.cached_share_of_prompt = sum(r.hit_tokens.values()) / r.prompt_tokens
    r.makespan_s = sim.makespan
    r.think_floor_s = float(np.max(sim.starts + sim.thinks[:, 1:].sum(axis=1)))
    r.throughput_tokens_s = r.prompt_tokens / sim.makespan
    ttft = np.array([x.done - x.arrive for x in recs])
    r.ttft_p50_s, r.ttft_p99_s = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
    r.gpu_busy = sim.busy["gpu"] / sim.makespan
    r.loader_busy = sim.busy["loader"] / sim.makespan
    r.gpu_busy_s, r.loader_busy_s = sim.busy["gpu"], sim.busy["loader"]
    r.charged_s, r.charged_fixed_s = dict(sim.charged), dict(sim.charged_fixed)
    r.lookup_s = float(sum(sim.lookup_s))
    if offload is not None:
        cb = offload.chunk_bytes
        secs: dict[str, float] = {}
        for x in recs:
            for t, s in x.load_seconds.items():
                secs[t] = secs.get(t, 0.0) + s
        r.loaded_bytes = {t: r.hit_tokens[t] // w.chunk_tokens * cb for t in TIERS if t != "gpu"}
        r.load_seconds = {t: secs.get(t, 0.0) for t in r.loaded_bytes}
        r.load_gib_s = {t: (r.loaded_bytes[t] / GIB / r.load_seconds[t]) for t in r.loaded_bytes
                        if r.load_seconds[t] > 0 and r.loaded_bytes[t] > 0}
        # a median per-byte cost of 0 (calls no slower than the fixed cost measured at the start): no rate
        r.marginal_gib_s = {t: 1 / float(np.median(c)) / GIB for t, c in sim.all_costs.items()
                            if c and np.median(c) > 0}
        r.lookups = len(sim.lookup_s)
        r.lookup_ms_p50 = float(np.percentile(sim.lookup_s, 50) * 1e3) if sim.lookup_s else 0.0
        r.load_shortfall_chunks = sim.shortfall
        r.load_calls = sim.load_calls
        r.load_call_floor_ms = offload.call_floor_s * 1e3
        stored_bytes = offload.store_counts["stored"] * cb
        r.store = {**offload.store_counts, "seconds": offload.store_s,
                   "gib_s": stored_bytes / GIB / offload.store_s if offload.store_s else 0.0}
        r.corrupt_chunks = offload.corrupt
        if before is not None and after is not None:
            r.daemon = {name: {k: v - before.get(name, {}).get(k, 0) if k not in ("used_bytes", "chunks") else v
                               for k, v in vals.items()} for name, vals in after.items()}
    return r


# -- tiers: fs directory, S3 server ---------------------------------------------------------------


class S3Server:
    """An S3 endpoint on loopback for the RAM + fs + S3 configuration, from tests/support/s3.py:
    a throwaway Ceph radosgw (memstore OSD) when Ceph is installed, else moto_server (in RAM)."""

    def __init__(self, kind: str, memstore_bytes: int) -> None:
        self.kind = kind
        self.memstore_bytes = memstore_bytes
        self.endpoint = ""
        self.access_key = self.secret_key = ""
        self.region = "us-east-1"
        self._server: Any = None
        self._buckets = 0

    def start(self) -> "S3Server":
        sys.path.insert(0, str(REPO))
        from tests.support.s3 import MotoServer, RadosGW

        errors = []
        for kind in (["radosgw", "moto"] if self.kind == "auto" else [self.kind]):
            server = RadosGW(memstore_bytes=self.memstore_bytes) if kind == "radosgw" else MotoServer()
            try:
                ep = server.start()
            except Exception as exc:  # noqa: BLE001 - try the next kind, report all
                errors.append(f"{kind}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
                with contextlib.suppress(Exception):
                    server.stop()
                continue
            self._server, self.kind = server, kind
            self.endpoint, self.access_key, self.secret_key, self.region = (
                ep.url, ep.access_key, ep.secret_key, ep.region)
            return self
        raise RuntimeError("no S3 server: " + "; ".join(errors))

    def _client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name=self.region)

    def new_bucket(self) -> str:
        self._buckets += 1
        name = f"kvstored-bench-{os.getpid()}-{self._buckets}"
        self._client().create_bucket(Bucket=name)
        return name

    def empty_bucket(self, name: str) -> None:
        """Delete the run's objects (radosgw keeps them in the memstore OSD, in RAM)."""
        s3 = self._client()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                s3.delete_objects(Bucket=name, Delete={"Objects": objects, "Quiet": True})
        s3.delete_bucket(Bucket=name)

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.stop()
            self._server = None


class TierResources:
    """What the tiers under RAM need for one run (an fs root, an S3 bucket): created when a spec
    asks for them, removed by close()."""

    def __init__(self, workdir: Path, tag: str, s3: S3Server | None) -> None:
        self.workdir, self.tag, self.s3 = workdir, tag, s3
        self.fs_roots: list[Path] = []
        self.buckets: list[str] = []

    def fs_root(self) -> Path:
        root = Path(tempfile.mkdtemp(prefix=f"fs-{self.tag}-", dir=self.workdir))
        self.fs_roots.append(root)
        return root

    def bucket(self) -> str:
        if self.s3 is None:
            raise RuntimeError("no S3 server")
        name = self.s3.new_bucket()
        self.buckets.append(name)
        return name

    def close(self) -> None:
        for root in self.fs_roots:
            shutil.rmtree(root, ignore_errors=True)
        for name in self.buckets:
            if self.s3 is not None:
                with contextlib.suppress(Exception):
                    self.s3.empty_bucket(name)


def _fs_spec(res: TierResources, nbytes: int) -> str:
    return f"kind=fs,root={res.fs_root()},bytes={nbytes}"


def _s3_spec(res: TierResources, nbytes: int) -> str:
    bucket = res.bucket()
    s3 = res.s3
    assert s3 is not None
    return (f"kind=s3,bucket={bucket},endpoint_url={s3.endpoint},region={s3.region},access_key={s3.access_key},"
            f"secret_key={s3.secret_key},bytes={nbytes}")


TIER_SPECS = {"fs": _fs_spec, "s3": _s3_spec}  # a tier kind under RAM -> its --tiers value for one run


def tier_args(config: Config, sizes: Sizes, res: TierResources) -> list[str]:
    args: list[str] = []
    for kind, size_field in config.lower:
        args += ["--tiers", TIER_SPECS[kind](res, getattr(sizes, size_field))]
    return args


class BenchDaemon(Daemon):
    """_common.Daemon that keeps the log's last lines when start-up fails (stop() removes it)."""

    failure_log = ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        self.failure_log = self.log_tail(8)
        return super().stop(timeout_s)


def run_one(config: Config, conversations: int, w: Workload, m: Model, sizes: Sizes, workdir: Path,
            s3: S3Server | None) -> RunResult:
    t0 = time.perf_counter()
    load0 = load_average()
    r = _run_one(config, conversations, w, m, sizes, workdir, s3)
    r.wall_s = time.perf_counter() - t0
    r.load_average = (load0, load_average())
    return r


def _run_one(config: Config, conversations: int, w: Workload, m: Model, sizes: Sizes, workdir: Path,
             s3: S3Server | None) -> RunResult:
    if not config.offload:
        sim = Simulation(w, m, conversations, None)
        sim.run()
        return summarize(config.key, sim, None, None, None)
    res = TierResources(workdir, f"{config.key.replace('+', '-')}-{conversations}", s3)
    try:
        extra = ["--metrics-addr", "off", *tier_args(config, sizes, res)]
    except Exception as exc:  # noqa: BLE001 - a tier whose resources cannot be made: say so, go on
        res.close()
        return RunResult(config.key, conversations, skipped=f"tier set-up failed: {exc}")
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    daemon = BenchDaemon(sizes.ram_bytes, extra_args=extra)
    try:
        daemon.start()
    except Exception as exc:  # noqa: BLE001 - a tier that is not ready yet: say so, go on
        res.close()
        return RunResult(config.key, conversations, skipped=f"daemon did not start: {exc}: {daemon.failure_log}")
    offload = None
    try:
        offload = Offload(daemon.socket, chunk_bytes, w.chunk_tokens, w.final_tokens // w.chunk_tokens, w.seed,
                          m.transfer)
        before = offload.stats()
        sim = Simulation(w, m, conversations, offload)
        sim.run()
        after = offload.stats()
        return summarize(config.key, sim, offload, before, after)
    finally:
        if offload is not None:
            offload.close()
        daemon.stop()
        res.close()


# -- physical limits of this machine ---------------------------------------------------------------


@dataclass
class Limits:
    """What the hardware under each tier gives on this machine, GiB/s, one sample per round (rounds
    at the start and at the end of the sweep): the ceilings the tiers' load rates are read against."""

    memcpy: list[float] = field(default_factory=list)  # 2 MiB pieces, one thread
    odirect_stream: list[float] = field(default_factory=list)  # preadv, FS_IO_THREADS threads, all queued
    odirect_batched: list[float] = field(default_factory=list)  # the same, one load call's chunks at a time
    s3_get: list[float] = field(default_factory=list)  # aiobotocore GETs, S3_INFLIGHT in flight
    batch_chunks: int = 0
    notes: list[str] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        samples = getattr(self, name)
        return float(np.median(samples)) if samples else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "medians": {k: self.median(k) for k in
                                            ("memcpy", "odirect_stream", "odirect_batched", "s3_get")}}


def measure_memcpy(chunk_bytes: int, total: int, rounds: int) -> list[float]:
    src = populate(np.ones(total, dtype=np.uint8))
    dst = populate(np.empty(total, dtype=np.uint8))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for a in range(0, total, chunk_bytes):
            np.copyto(dst[a:a + chunk_bytes], src[a:a + chunk_bytes])
        out.append(total / GIB / (time.perf_counter() - t0))
    return out


def measure_odirect(workdir: Path, chunk_bytes: int, batch: int, total: int, rounds: int
                    ) -> tuple[list[float], list[float]]:
    """Raw O_DIRECT reads of one file per chunk on the fs tier's filesystem, FS_IO_THREADS threads:
    every chunk queued at once (streaming), and `batch` chunks at a time, one batch after another
    (the loader's pattern: one load call of a turn's chunks at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    n = total // chunk_bytes
    root = Path(tempfile.mkdtemp(prefix="raw-odirect-", dir=workdir))
    buf = mmap.mmap(-1, n * chunk_bytes)  # page-aligned, as O_DIRECT needs
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 7
    view = memoryview(buf)
    paths = [str(root / f"{i:05d}.raw") for i in range(n)]

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            if os.pwrite(fd, view[i * chunk_bytes:(i + 1) * chunk_bytes], 0) != chunk_bytes:
                raise RuntimeError("short O_DIRECT write")
        finally:
            os.close(fd)

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            if os.preadv(fd, [view[i * chunk_bytes:(i + 1) * chunk_bytes]], 0) != chunk_bytes:
                raise RuntimeError("short O_DIRECT read")
        finally:
            os.close(fd)

    stream: list[float] = []
    batched: list[float] = []
    try:
        with ThreadPoolExecutor(FS_IO_THREADS, thread_name_prefix="raw-odirect") as pool:
            list(pool.map(write, range(n)))
            for _ in range(rounds):
                t0 = time.perf_counter()
                list(pool.map(read, range(n)))
                stream.append(n * chunk_bytes / GIB / (time.perf_counter() - t0))
                t0 = time.perf_counter()
                for start in range(0, n, batch):
                    list(pool.map(read, range(start, min(n, start + batch))))
                batched.append(n * chunk_bytes / GIB / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        view.release()
        del arr
        buf.close()
    return stream, batched


def measure_s3_get(s3: S3Server, chunk_bytes: int, objects: int, rounds: int) -> list[float]:
    """Raw GETs of `objects` objects of chunk_bytes from the sweep's S3 server, S3_INFLIGHT in flight
    (aiobotocore, as the S3 tier uses; bodies read, not verified)."""
    import asyncio

    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    bucket = s3.new_bucket()
    config = AioConfig(max_pool_connections=S3_INFLIGHT, retries={"total_max_attempts": 1},
                       s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                       response_checksum_validation="when_required")
    body = os.urandom(chunk_bytes)
    out: list[float] = []

    async def run() -> None:
        slots = asyncio.Semaphore(S3_INFLIGHT)
        async with get_session().create_client(
                "s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                aws_secret_access_key=s3.secret_key, region_name=s3.region, config=config) as client:

            async def put(i: int) -> None:
                async with slots:
                    await client.put_object(Bucket=bucket, Key=f"raw/{i:05d}", Body=body)

            async def get(i: int) -> None:
                async with slots:
                    response = await client.get_object(Bucket=bucket, Key=f"raw/{i:05d}")
                    async with response["Body"] as stream:
                        if len(await stream.read()) != chunk_bytes:
                            raise RuntimeError("short GET")

            await asyncio.gather(*(put(i) for i in range(objects)))
            for _ in range(rounds):
                t0 = time.perf_counter()
                await asyncio.gather(*(get(i) for i in range(objects)))
                out.append(objects * chunk_bytes / GIB / (time.perf_counter() - t0))

    try:
        asyncio.run(run())
    finally:
        with contextlib.suppress(Exception):
            s3.empty_bucket(bucket)
    return out


def measure_limits(limits: Limits, workdir: Path, chunk_bytes: int, batch: int, s3: S3Server | None,
                   total: int = 256 * MIB, rounds: int = 3) -> None:
    """One round of every limit measurement (appended to `limits`); a measurement that fails is noted."""
    limits.batch_chunks = batch
    limits.memcpy += measure_memcpy(chunk_bytes, total, rounds)
    try:
        stream, batched = measure_odirect(workdir, chunk_bytes, batch, total, rounds)
        limits.odirect_stream += stream
        limits.odirect_batched += batched
    except OSError as exc:  # a filesystem without O_DIRECT (tmpfs): no raw figure, said so
        limits.notes.append(f"raw O_DIRECT on {workdir}: {exc}")
    if s3 is not None:
        try:
            limits.s3_get += measure_s3_get(s3, chunk_bytes, 48, rounds)
        except Exception as exc:  # noqa: BLE001 - the tiers' figures stand without it
            limits.notes.append(f"raw S3 GET: {type(exc).__name__}: {exc}")


# -- reporting ------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def scaling_lines(w: Workload, m: Model, sizes: Sizes, ram_conv: float, fs_conv: float,
                  s3_fs_conv: float) -> list[str]:
    full = m.byte_scale

    def size(nbytes: int) -> str:
        return f"{fmt_bytes(nbytes)}; {fmt_bytes(nbytes * full)} at full size"

    return [
        f"workload: {w.initial_tokens}-token first prompt + {w.turn_tokens} tokens per turn, {w.turns} turns "
        f"(last prompt {w.final_tokens} tokens), think time {w.think_s:g} s (uniform 0.5-1.5x), "
        f"chunks of {w.chunk_tokens} tokens, seed {w.seed}; loads "
        f"{'on the GPU timeline' if m.serial_loads else 'beside compute (async loader)'}",
        f"scaled: KV bytes/token {m.model_kv_bytes_per_token:,} -> {m.kv_bytes_per_token} (1/{m.byte_scale:g}); "
        f"chunk {fmt_bytes(w.chunk_tokens * m.model_kv_bytes_per_token)} -> "
        f"{fmt_bytes(w.chunk_tokens * m.kv_bytes_per_token)}; each tier's measured cost per byte x{m.byte_scale:g} "
        f"charges the full-size bytes (lookups and the fixed cost of a load call: as measured)",
        f"sized in conversations at their last turn ({w.final_tokens} tokens): GPU "
        f"{m.gpu_tokens / w.final_tokens:.1f} ({m.gpu_tokens:,} tokens = "
        f"{fmt_bytes(m.gpu_tokens * m.model_kv_bytes_per_token)}), RAM tier {ram_conv:g} ({size(sizes.ram_bytes)}), "
        f"fs {fs_conv:g} ({size(sizes.fs_bytes)}); in RAM + fs + S3: fs {s3_fs_conv:g} ({size(sizes.s3_fs_bytes)}), "
        f"S3 {'unbounded' if not sizes.s3_bytes else size(sizes.s3_bytes)}",
    ]


def model_lines(m: Model, basis: Sequence[Basis]) -> list[str]:
    width = max(len(b.quantity) for b in basis)
    vwidth = max(len(b.value) for b in basis)
    return [f"model: {m.model_name} (--model {m.model_key})"] + [
        f"  {b.quantity:<{width}}  {b.value:>{vwidth}}  {b.basis}" for b in basis]


def limit_lines(limits: Limits) -> list[str]:
    def fmt(name: str) -> str:
        samples = getattr(limits, name)
        if not samples:
            return "not measured"
        return f"{np.median(samples):.2f} GiB/s (median of {len(samples)}; {min(samples):.2f}-{max(samples):.2f})"

    lines = [
        f"memcpy, 2 MiB pieces, one thread (a RAM-tier load's copy): {fmt('memcpy')}",
        f"raw O_DIRECT read, 2 MiB files, {FS_IO_THREADS} threads, streaming: {fmt('odirect_stream')}",
        f"raw O_DIRECT read, the same, {limits.batch_chunks}-chunk batches one at a time (the loader's pattern): "
        f"{fmt('odirect_batched')}",
        f"raw aiobotocore GET, 2 MiB objects, {S3_INFLIGHT} in flight: {fmt('s3_get')}",
    ]
    return lines + [f"note: {n}" for n in limits.notes]


def print_results(results: list[RunResult], file=None) -> None:
    file = file or sys.stdout
    base = {r.conversations: r.throughput_tokens_s for r in results if r.config == "none" and not r.skipped}
    header = ["config", "convs", "hit gpu", "ram", "fs", "s3", "overall", "tokens/s", "vs none", "TTFT p50",
              "p99", "gpu busy", "loader", "loaded ram/fs/s3", "GiB/s ram/fs/s3 (marginal)", "wall"]
    rows = [header]
    for r in results:
        if r.skipped:
            rows.append([CONFIG_LABELS[r.config], str(r.conversations), "skipped"] + [""] * (len(header) - 3))
            continue
        ratio = r.throughput_tokens_s / base[r.conversations] if base.get(r.conversations) else None
        loaded = "/".join(fmt_bytes(r.loaded_bytes.get(t, 0)) for t in ("ram", "fs", "s3")) if r.loaded_bytes else "-"
        gib = "-"
        if r.loaded_bytes:
            gib = "/".join(f"{r.load_gib_s[t]:.2f}" if t in r.load_gib_s else "-" for t in ("ram", "fs", "s3"))
            gib += " (" + "/".join(f"{r.marginal_gib_s[t]:.2f}" if t in r.marginal_gib_s else "-"
                                   for t in ("ram", "fs", "s3")) + ")"
        rows.append([
            CONFIG_LABELS[r.config], str(r.conversations),
            *(f"{100 * r.hit_rate[t]:.1f}%" for t in TIERS), f"{100 * r.hit_rate_overall:.1f}%",
            f"{r.throughput_tokens_s:,.0f}", f"{ratio:.2f}x" if ratio else "", f"{r.ttft_p50_s:.2f} s",
            f"{r.ttft_p99_s:.2f} s", f"{100 * r.gpu_busy:.0f}%", f"{100 * r.loader_busy:.0f}%", loaded, gib,
            f"{r.wall_s:.0f} s",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.rjust(wd) if 1 <= j <= 15 and j != 13 else c.ljust(wd)
                        for j, (c, wd) in enumerate(zip(row, widths))).rstrip(), file=file)
        if i == 0:
            print("  ".join("-" * wd for wd in widths), file=file)
    print("hit rates: shares of the reusable tokens (the previous turn's prompt); tokens/s, TTFT, busy: modelled; "
          "loaded: scaled bytes really moved; GiB/s: their measured rate (marginal: median per-byte cost of the "
          "load calls, fixed call cost removed; what the model charges, x the byte scale)", file=file)


def daemon_lines(results: list[RunResult]) -> list[str]:
    lines = []
    for r in results:
        if r.skipped or not r.daemon or not (r.lookups or any(r.store.get(k) for k in ("stored", "already_present"))):
            continue
        parts = []
        for name, d in r.daemon.items():
            extra = [f"{k} {d[k]}" for k in ("dropped_dirty", "dropped_backpressure", "errors", "checksum_failures",
                                               "rejected_full") if d.get(k)]
            if name == "ram":  # the RAM tier counts chunks, not bytes
                parts.append(f"ram: {d['loaded_chunks']} chunks leased, {d['stored_chunks']} stored"
                             + (f", promotions {d['promotions']}" if d.get("promotions") else "")
                             + (f", write-backs {d['writebacks']}" if d.get("writebacks") else "")
                             + (f", evictions {d['evictions']}" if d.get("evictions") else "")
                             + "".join(f", {e}" for e in extra))
                continue
            parts.append(f"{name}: read {fmt_bytes(d['read_bytes'])} written {fmt_bytes(d['written_bytes'])}"
                         + (f" promotions {d['promotions']}" if d.get("promotions") else "")
                         + (f" evictions {d['evictions']}" if d.get("evictions") else "")
                         + ("".join(f", {e}" for e in extra)))
        st = r.store
        lines.append(f"{CONFIG_LABELS[r.config]:>13} {r.conversations:>4}: " + "; ".join(parts)
                     + f" | client stores {st['stored']} new, {st['already_present']} present, {st['dropped']} "
                       f"dropped, {st['gib_s']:.2f} GiB/s | lookup p50 {r.lookup_ms_p50:.2f} ms, load call floor "
                       f"{r.load_call_floor_ms:.2f} ms x {r.load_calls}"
                     + (f" | {r.load_shortfall_chunks} chunks gone between lookup and load"
                        if r.load_shortfall_chunks else "")
                     + (f" | CORRUPT {r.corrupt_chunks}" if r.corrupt_chunks else ""))
    return lines


def cost_lines(results: list[RunResult], m: Model, limits: Limits) -> list[str]:
    """What a token served from each tier costs, relative to recomputing it: the break-even
    bandwidth (KV bytes per token x prefill rate) over the tier's measured marginal rate, and over
    the raw device's rate beneath it."""
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    lines = [f"break-even load bandwidth ({m.model_kv_bytes_per_token:,} KV bytes/token x "
             f"{m.prefill_tokens_per_s:,.0f} prefill tokens/s): {breakeven:.2f} GiB/s -- a tier slower than that "
             f"costs more per token than recomputing"]
    raw = {"ram": ("memcpy", limits.median("memcpy")), "fs": ("raw O_DIRECT, streaming", limits.median("odirect_stream")),
           "s3": ("raw GET", limits.median("s3_get"))}
    for config in CONFIGS:
        rs = [r for r in results if r.config == config.key and not r.skipped and r.marginal_gib_s]
        if not rs:
            continue
        r = max(rs, key=lambda x: x.conversations)
        parts = []
        for t in ("ram", "fs", "s3"):
            if t not in r.marginal_gib_s:
                continue
            part = f"{t} {r.marginal_gib_s[t]:.2f} GiB/s = {breakeven / r.marginal_gib_s[t]:.2f}x a recompute"
            name, rate = raw[t]
            if rate:
                part += f" ({name} {rate:.2f} GiB/s would be {breakeven / rate:.2f}x)"
            parts.append(part)
        lines.append(f"{config.label} at {r.conversations}: " + "; ".join(parts))
    return lines


def _tier_limit(tier: str, r: RunResult | None, limits: Limits, breakeven: float) -> str:
    """The tier's measured marginal load rate in `r` beside the raw rate of the hardware under it."""
    if r is None or tier not in r.load_gib_s:
        got = f"{tier} loads not measured"
    else:
        rate = r.marginal_gib_s.get(tier)
        got = (f"{tier} loads {r.load_gib_s[tier]:.2f} GiB/s all-in, "
               + (f"{rate:.2f} marginal (charged)" if rate else "only their fixed cost charged"))
    if tier == "ram":
        raw = limits.median("memcpy")
        return got + (f" vs memcpy {raw:.2f}" if raw else "")
    if tier == "fs":
        stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
        return got + (f" vs raw O_DIRECT {batched:.2f} (<= {limits.batch_chunks}-chunk calls) / {stream:.2f} "
                      f"(streaming)" if stream and batched else "") + f"; break-even {breakeven:.2f}"
    raw = limits.median("s3_get")
    return got + (f" vs raw GET {raw:.2f}" if raw else "") + f"; break-even {breakeven:.2f}"


def _busy(r: RunResult) -> str:
    return f"; loader busy {100 * r.loader_busy:.0f}%, GPU {100 * r.gpu_busy:.0f}%"


def target_rows(results: list[RunResult], m: Model, limits: Limits, sizes_conv: dict[str, float]
                ) -> list[dict[str, Any]]:
    """The targets at the largest count, and the informational ratios, as rows: name, value, baseline,
    ratio, target, status (as the other benchmarks' JSON) and `limit`: what bounds it on this machine."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return []
    top = counts[-1]
    none, ram, fs, s3 = (runs.get((c, top)) for c in ("none", "ram", "ram+fs", "ram+fs+s3"))
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float, unit: str, baseline_name: str, baseline: float | None, target: float | None,
            limit: str) -> None:
        rows.append({**Row(name, value, unit, baseline_name, baseline, target).to_json(), "limit": limit})

    if fs is not None:
        capacity = (f"capacity: GPU {sizes_conv['gpu']:.0f} + RAM {sizes_conv['ram']:g} + fs {sizes_conv['fs']:g} "
                    f"conversations for {top}")
        add(f"RAM + fs hit rate, {top} conversations", fs.hit_rate_overall, "share", "all reusable tokens", 1.0,
            TARGET_HIT, capacity)
        fs_limit = _tier_limit("fs", fs, limits, breakeven) + _busy(fs)
        if none is not None:
            add(f"RAM + fs vs no offload, {top} conversations", fs.throughput_tokens_s, "tokens/s", "no offload",
                none.throughput_tokens_s, TARGET_VS_NONE, fs_limit)
        if ram is not None:
            add(f"RAM + fs vs RAM alone, {top} conversations", fs.throughput_tokens_s, "tokens/s", "RAM alone",
                ram.throughput_tokens_s, TARGET_VS_RAM, fs_limit)
    if ram is not None and none is not None:
        add(f"RAM vs no offload, {top} conversations", ram.throughput_tokens_s, "tokens/s", "no offload",
            none.throughput_tokens_s, None, _tier_limit("ram", ram, limits, breakeven) + _busy(ram))
    if s3 is not None and none is not None:
        add(f"RAM + fs + S3 vs no offload, {top} conversations", s3.throughput_tokens_s, "tokens/s", "no offload",
            none.throughput_tokens_s, None, _tier_limit("s3", s3, limits, breakeven) + _busy(s3))
    tier_rows = (("ram", ram, "memcpy, 2 MiB pieces", "memcpy"),
                 ("fs", fs, f"raw O_DIRECT read, {limits.batch_chunks}-chunk batches", "odirect_batched"),
                 ("s3", s3, f"raw GET, {S3_INFLIGHT} in flight", "s3_get"))
    for tier, r, raw_name, raw_key in tier_rows:
        if r is not None and tier in r.load_gib_s:
            marginal = r.marginal_gib_s.get(tier)
            add(f"{tier} tier loads, all-in ({CONFIG_LABELS[r.config]}, {top})", r.load_gib_s[tier], "GiB/s",
                raw_name, limits.median(raw_key), None,
                (f"marginal {marginal:.2f} GiB/s (fixed cost per call removed: what the model charges)" if marginal
                 else "no per-byte cost above the fixed cost per call") + f"; break-even {breakeven:.2f} GiB/s")
    return rows


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{100 * v:.1f}%"
    if unit == "tokens/s":
        return f"{v:,.0f} tokens/s"
    return f"{v:.2f} {unit}"


def print_rows(rows: Sequence[dict[str, Any]], file=None) -> None:
    table = [["measurement", "value", "baseline", "", "ratio", "target", "result", "bounded by (this machine)"]]
    for r in rows:
        table.append([r["name"], _fmt_value(r["value"], r["unit"]), r["baseline_name"],
                      _fmt_value(r["baseline"], r["unit"]), f"{r['ratio']:.2f}x" if r["ratio"] is not None else "",
                      f">= {r['target']:.2f}x" if r["target"] is not None else "", r["status"] or "(info)", r["limit"]])
    print_aligned(table, right={1, 3, 4}, file=file)


def bound_lines(results: list[RunResult], m: Model, limits: Limits) -> list[str]:
    """What bounds RAM + fs at the largest count, with numbers: where the loader's modelled time went,
    the fs load rate the targets would need, and whether this machine's disk could deliver it. The
    needed rate assumes the loader stays busy for the same share of the (shorter) makespan as in
    this run; with a loader busy all the time (a bound no run reaches) it is lower, printed too."""
    runs = {(r.config, r.conversations): r for r in results if not r.skipped}
    counts = sorted({r.conversations for r in results})
    if not counts:
        return []
    top = counts[-1]
    none, ram, fs = (runs.get((c, top)) for c in ("none", "ram", "ram+fs"))
    if fs is None or none is None or not fs.loaded_bytes:
        return []
    breakeven = m.model_kv_bytes_per_token * m.prefill_tokens_per_s / GIB
    fs_full = fs.loaded_bytes.get("fs", 0) * m.byte_scale
    fs_charged = fs.charged_s.get("fs", 0.0)
    other = fs.loader_busy_s - (fs_charged - fs.charged_fixed_s.get("fs", 0.0))  # everything but fs bytes
    goal = min([none.makespan_s / TARGET_VS_NONE] + ([ram.makespan_s / TARGET_VS_RAM] if ram is not None else []))
    lines = [
        f"RAM + fs at {top}: makespan {fs.makespan_s:,.0f} modelled s; the loader was busy {fs.loader_busy_s:,.0f} s "
        f"({100 * fs.loader_busy:.0f}%: fs {fs_charged:,.0f} s for {fmt_bytes(fs_full)} at full size, "
        + ", ".join(f"{t} {fs.charged_s[t]:,.0f} s" for t in fs.charged_s if t != "fs")
        + f", lookups {fs.lookup_s:,.1f} s), the GPU {fs.gpu_busy_s:,.0f} s ({100 * fs.gpu_busy:.0f}%)",
        f"for >= {TARGET_VS_NONE:g}x no offload ({none.makespan_s:,.0f} s)"
        + (f" and >= {TARGET_VS_RAM:g}x RAM alone ({ram.makespan_s:,.0f} s)" if ram is not None else "")
        + f", the makespan must be <= {goal:,.0f} s",
    ]
    if fs.think_floor_s >= goal:
        return lines + [f"the conversations' own start and think times take {fs.think_floor_s:,.0f} s: no cache "
                        f"reaches that at {top} conversations"]
    if fs.gpu_busy_s >= goal:
        return lines + [f"the GPU's own compute ({fs.gpu_busy_s:,.0f} s) exceeds that: the hit rate bounds the ratio, "
                        f"not the disk"]
    if not fs_full:
        return lines + ["the fs tier served nothing at this count: the workload's pace bounds the ratio"]
    util = max(fs.loader_busy, 1e-9)
    room, room_full = util * goal - other, goal - other
    if room_full <= 0:
        return lines + [f"the loader's other work ({other:,.0f} s) alone exceeds that: loads from RAM and lookups "
                        f"bound the ratio"]
    needed_full = fs_full / room_full / GIB
    needed = fs_full / room / GIB if room > 0 else float("inf")
    fs_rate = fs.marginal_gib_s.get("fs")
    stream, batched = limits.median("odirect_stream"), limits.median("odirect_batched")
    raw = max(x for x in (stream, batched, 0.0) if x is not None)
    lines.append(
        f"so fs loads would need >= {needed:.2f} GiB/s at full size ({fs_full / GIB:,.0f} GiB with the loader busy "
        f"{100 * util:.0f}% of {goal:,.0f} s, beside {other:,.0f} s of other loader work; >= {needed_full:.2f} with it "
        f"busy all the time); measured: " + (f"{fs_rate:.2f}" if fs_rate else "-") + " GiB/s (marginal) through the "
        "daemon; raw O_DIRECT read here: " + (f"{batched:.2f} in <= {limits.batch_chunks}-chunk calls, {stream:.2f} "
                                             f"streaming" if stream and batched else "not measured")
        + f"; break-even {breakeven:.2f}")
    if raw and needed > raw:
        lines.append(f"this machine's disk is the limit: raw O_DIRECT reads ({raw:.2f} GiB/s at best) fall short of the "
                     f"{needed:.2f} GiB/s the targets need")
    elif fs_rate and needed > fs_rate:
        lines.append(f"the disk could do it (raw {raw:.2f} GiB/s): the fs tier's load path ({fs_rate:.2f}) is the gap")
    else:
        lines.append("the fs load rate suffices on paper: queueing between the loader and the GPU is the gap")
    return lines


def load_summary(results: list[RunResult], start: float, end: float) -> dict[str, float]:
    samples = [start, end] + [x for r in results if not r.skipped for x in r.load_average]
    return {"start": start, "end": end, "min": min(samples), "max": max(samples), "mean": float(np.mean(samples))}


# -- main -----------------------------------------------------------------------------------------


def parse_counts(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None (the flag's help says what is derived instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    import multiturn_nodes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    g = ap.add_argument_group("workload")
    g.add_argument("--initial-tokens", type=int, default=12 * 1024, help="first prompt of every conversation")
    g.add_argument("--turn-tokens", type=int, default=4 * 1024, help="tokens each turn appends to the history")
    g.add_argument("--turns", type=int, default=8, help="turns per conversation")
    g.add_argument("--think-s", type=float, default=20.0,
                   help="mean think time between turns, modelled seconds (uniform 0.5-1.5x)")
    g.add_argument("--conversations", default="16,32,64,128,192,256", help="simultaneous conversations to sweep")
    g.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per kvstored chunk (x --kv-bytes-per-token: 2 MiB, as in bench/compare.py)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("modelled GPU and model")
    g.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS),
                   help="the modelled model and GPUs: qwen3.6-35b-a3b (the seed's: 2x H100, TP=2, 20 KiB of KV per "
                        "token, 50,000 prefill tokens/s) or llama-3.1-8b (one H100, 128 KiB per token, 16,000 "
                        "tokens/s); every figure derived from it is printed with its basis")
    g.add_argument("--model-kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per token of the modelled model (default: the model's, from its attention layers)")
    g.add_argument("--kv-bytes-per-token", type=int, default=512,
                   help="KV bytes per token that really move through kvstored (the scale)")
    g.add_argument("--prefill-tokens-per-s", type=float, default=None,
                   help="modelled prefill rate (default: the model's, from FLOPs per token, the GPUs' bf16 peak and "
                        "an assumed MFU)")
    g.add_argument("--gpu-conversations", type=float, default=None,
                   help="GPU prefix cache capacity, in conversations at their last turn (default: derived from HBM "
                        "minus weights)")
    g.add_argument("--gpu-tokens", type=int, default=None,
                   help="GPU prefix cache capacity in tokens (overrides --gpu-conversations)")
    g.add_argument("--serial-loads", action="store_true",
                   help="loads on the GPU's timeline instead of beside it (a pessimistic engine)")
    g.add_argument("--transfer", type=Transfer, choices=list(Transfer), default=Transfer.REGION,
                   metavar="{region,pool}",
                   help="how the engine moves chunks: region (vLLM's kvstored tier, mode 1: StoreFromRegion, "
                        "LoadToRegion) or pool (the direct spec, mode 2: pool mapping)")
    g = ap.add_argument_group("kvstored tiers")
    g.add_argument("--configs", default=None,
                   help=f"among {', '.join(c.key for c in CONFIGS)} (default: all; with --nodes: "
                        f"{', '.join(multiturn_nodes.CONFIG_KEYS)})")
    g.add_argument("--ram-conversations", type=float, default=None,
                   help=f"RAM tier size, in conversations (default: 128; with --nodes: "
                        f"{multiturn_nodes.RAM_CONVERSATIONS:g} per node)")
    g.add_argument("--fs-conversations", type=float, default=512,
                   help="fs tier size in RAM + fs, in conversations (with --nodes: per node, also with peers)")
    g.add_argument("--s3-fs-conversations", type=float, default=128,
                   help="fs tier size in RAM + fs + S3, in conversations (smaller: S3 takes the overflow)")
    g.add_argument("--s3", default="auto", choices=("auto", "radosgw", "moto"),
                   help="S3 server: radosgw via tests/support/s3.py, moto_server, or auto (radosgw, else moto)")
    g.add_argument("--workdir", default=str(REPO / "results" / "tmp"),
                   help="fs tier roots and the raw O_DIRECT files go under here (each removed after use)")
    g.add_argument("--no-limits", action="store_true",
                   help="skip measuring memcpy, raw O_DIRECT and raw S3 GET (the physical limits)")
    g = ap.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="write the chart (PNG) here")
    g.add_argument("--dry-run", action="store_true",
                   help="print the model, the sizes and the scaling (and write them with --json), run nothing")
    nt_threshold_arg(g)
    multiturn_nodes.add_arguments(ap)
    return ap


def setup(ap: argparse.ArgumentParser, args: argparse.Namespace
          ) -> tuple[Workload, Model, list[Basis], dict[str, float], Sizes, dict[str, float]]:
    """The workload, the modelled model (with its basis and derivation) and the tier sizes from the
    flags; argparse errors for what does not fit together."""
    w = Workload(args.initial_tokens, args.turn_tokens, args.turns, args.think_s, args.chunk_tokens, args.seed)
    if w.final_tokens // w.chunk_tokens < 1:
        ap.error("--chunk-tokens is larger than the last prompt")
    for flag in ("model_kv_bytes_per_token", "prefill_tokens_per_s", "gpu_tokens", "gpu_conversations"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    m, basis, derivation = derive_model(
        MODELS[args.model], w, args.kv_bytes_per_token, args.serial_loads, args.model_kv_bytes_per_token,
        args.prefill_tokens_per_s, args.gpu_tokens, args.gpu_conversations)
    m = replace(m, transfer=args.transfer)
    if m.gpu_tokens < w.final_tokens:
        ap.error(f"the GPU cache ({m.gpu_tokens:,} tokens) must hold at least one whole prompt ({w.final_tokens:,})")
    conv_bytes = w.final_tokens * m.kv_bytes_per_token
    sizes = Sizes(ram_bytes=int(args.ram_conversations * conv_bytes), fs_bytes=int(args.fs_conversations * conv_bytes),
                  s3_fs_bytes=int(args.s3_fs_conversations * conv_bytes))
    sizes_conv = {"gpu": m.gpu_tokens / w.final_tokens, "ram": args.ram_conversations, "fs": args.fs_conversations,
                  "s3_fs": args.s3_fs_conversations}
    return w, m, basis, derivation, sizes, sizes_conv


def main(argv: list[str] | None = None) -> int:
    import multiturn_nodes

    ap = build_parser()
    args = ap.parse_args(argv)
    apply_nt_threshold(args.nt_threshold)
    if args.ram_conversations is None:
        args.ram_conversations = multiturn_nodes.RAM_CONVERSATIONS if args.nodes > 1 else 128.0
    if args.nodes > 1:
        return multiturn_nodes.main(ap, args, argv)
    keys = [c.strip() for c in (args.configs or ",".join(CONFIG_BY_KEY)).split(",") if c.strip()]
    bad = [c for c in keys if c not in CONFIG_BY_KEY]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; choose among {', '.join(CONFIG_BY_KEY)}")
    configs = [CONFIG_BY_KEY[c] for c in keys]
    w, m, basis, derivation, sizes, sizes_conv = setup(ap, args)
    counts = parse_counts(args.conversations)
    workdir = Path(args.workdir)

    info = machine_info()
    load_start = load_average()
    print(f"kvstored multi-turn benchmark -- {info['cpu_model']}, {info['cpus']} CPUs, {info['mem_total_gib']} GiB, "
          f"kernel {info['kernel']}, git {info['git']}, load average {load_start:.2f}, "
          f"GLIBC_TUNABLES={info['glibc_tunables'] or '(none)'}")
    model_text = model_lines(m, basis)
    for line in model_text:
        print("  " + line)
    scale = scaling_lines(w, m, sizes, args.ram_conversations, args.fs_conversations, args.s3_fs_conversations)
    for line in scale:
        print("  " + line)
    max_bytes = max(counts) * w.reusable_per_conversation * m.kv_bytes_per_token
    print(f"  at {max(counts)} conversations: {fmt_bytes(max_bytes)} of reusable KV loaded at most (scaled), "
          f"{max(counts) * w.tokens_per_conversation:,} prompt tokens", flush=True)

    doc: dict[str, Any] = {
        "benchmark": "multiturn",
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "machine": info,
        "workload": asdict(w),
        "model": {**asdict(m), "transfer": m.transfer.value, "byte_scale": m.byte_scale,
                  "spec": asdict(MODELS[args.model]),
                  "derivation": derivation, "basis": [asdict(b) for b in basis]},
        "configs": [{"key": c.key, "label": c.label, "tiers": list(c.tiers)} for c in configs],
        "sizes": asdict(sizes),
        "sizes_in_conversations": sizes_conv,
        "scaling": scale,
    }
    if args.dry_run:
        if args.json:
            write_json(args.json, doc)
            print(f"JSON written to {args.json}")
        return 0

    workdir.mkdir(parents=True, exist_ok=True)
    s3 = None
    s3_note = ""
    if any(c.uses("s3") for c in configs):
        # radosgw keeps objects in a memstore OSD (RAM): room for the largest run's write-downs
        memstore = int(max(counts) * w.final_tokens * m.kv_bytes_per_token * 1.5) + GIB
        try:
            s3 = S3Server(args.s3, memstore).start()
            s3_note = ("S3: Ceph radosgw (memstore OSD) on loopback" if s3.kind == "radosgw"
                       else "S3: moto_server (in RAM) on loopback")
        except RuntimeError as exc:
            s3_note = f"S3 configuration skipped: {exc}"
        print("  " + s3_note, flush=True)

    limits = Limits()
    chunk_bytes = w.chunk_tokens * m.kv_bytes_per_token
    batch = w.final_tokens // w.chunk_tokens  # one load call carries at most a turn's reusable chunks
    results: list[RunResult] = []
    t_start = time.perf_counter()
    try:
        if not args.no_limits:
            measure_limits(limits, workdir, chunk_bytes, batch, s3)
        for n in counts:
            for config in configs:
                if config.uses("s3") and s3 is None:
                    r = RunResult(config.key, n, skipped=s3_note)
                else:
                    r = run_one(config, n, w, m, sizes, workdir, s3)
                results.append(r)
                status = r.skipped or (f"hit {100 * r.hit_rate_overall:.1f}%  {r.throughput_tokens_s:,.0f} tokens/s  "
                                       f"TTFT p50 {r.ttft_p50_s:.2f} s p99 {r.ttft_p99_s:.2f} s  wall {r.wall_s:.1f} s  "
                                       f"load {r.load_average[1]:.1f}")
                print(f"  [{time.perf_counter() - t_start:6.0f} s] {config.label:>13} x {n:>3}: {status}",
                      flush=True)
        if not args.no_limits:
            measure_limits(limits, workdir, chunk_bytes, batch, s3)
    finally:
        if s3 is not None:
            s3.stop()
    total_s = time.perf_counter() - t_start
    load = load_summary(results, load_start, load_average())

    print()
    print_results(results)
    print()
    print("daemon counters per run (Stats deltas; bytes are the scaled bytes):")
    for line in daemon_lines(results):
        print("  " + line)
    print()
    print("physical limits of this machine (measured at the start and at the end of the sweep):")
    for line in limit_lines(limits):
        print("  " + line)
    print()
    print("cost of a token loaded from each tier (marginal rate, at the largest count measured):")
    costs = cost_lines(results, m, limits)
    for line in costs:
        print("  " + line)
    print()
    print("what bounds RAM + fs at the largest count:")
    bounds = bound_lines(results, m, limits)
    for line in bounds:
        print("  " + line)
    print()
    rows = target_rows(results, m, limits, sizes_conv)
    print(f"targets and ratios ({m.model_name}; load average over the sweep {load['min']:.1f}-{load['max']:.1f}, "
          f"mean {load['mean']:.1f}, on {info['cpus']} CPUs):")
    print_rows(rows)
    print(f"sweep took {total_s:.0f} s; load average {load['start']:.2f} at start, {load['end']:.2f} at end")

    doc.update({
        "s3_server": s3_note,
        "s3_endpoint": s3.endpoint if s3 is not None else "",
        "results": [asdict(r) for r in results],
        "rows": rows,
        "targets": [{"text": f"{r['name']}: {r['ratio']:.2f}x (target >= {r['target']:g}x)", "met": r["status"] == "PASS"}
                    for r in rows if r["target"] is not None],
        "limits": limits.to_json(),
        "tier_costs": costs,
        "bounds": bounds,
        "load_average": load,
        "sweep_s": total_s,
    })
    write_outputs(doc, args.json, args.plot)
    return 0


def write_outputs(doc: dict[str, Any], json_path: str | None, plot_path: str | None) -> None:
    """The run's JSON and chart, where asked for (the multi-node mode writes its own the same way)."""
    if json_path:
        write_json(json_path, doc)
        print(f"JSON written to {json_path}")
    if plot_path:
        from plot import plot_multiturn

        plot_multiturn(doc, plot_path)
        print(f"plot written to {plot_path}")


if __name__ == "__main__":
    sys.modules.setdefault("multiturn", sys.modules[__name__])  # multiturn_nodes imports this module, not a copy
    sys.exit(main())
