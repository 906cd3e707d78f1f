# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The multi-turn benchmark's workload, configurations and modelled model (presets, derived figures)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.report import GIB, MIB, fmt_bytes

TIERS = ("gpu", "ram", "fs", "s3")  # where a reusable chunk was found
VOCAB = 128_256  # token ids are synthetic (only their hashes matter): any vocabulary size will do
HEADER = 48  # bytes of each stored chunk that identify it: key (32) + conversation (8) + index (8)
# RAM + fs at the largest count: hit rate of reusable tokens, modelled throughput vs no offload and vs RAM alone
TARGET_HIT = 0.90
TARGET_VS_NONE = 2.0
TARGET_VS_RAM = 1.5
COST_WINDOW = 64  # load calls per tier over which the cost per byte is a running median
FS_IO_THREADS = 8  # the fs tier's default io_threads: the raw O_DIRECT baseline uses as many
S3_INFLIGHT = 16  # the S3 tier's default max_concurrency: the raw GET baseline keeps as many in flight


@dataclass(frozen=True)
class Config:
    """One configuration (with --nodes: a set-up of every node). `lower`: the tiers under RAM, in chain
    order, each with the Sizes field that bounds it ("" for the peer tier, which holds nothing itself)."""

    key: str
    label: str
    lower: tuple[tuple[str, str], ...] = ()
    offload: bool = True  # False: no daemon, the GPU's own prefix cache only
    daemon_args: tuple[str, ...] = ()  # more `kvstored serve` flags
    write_through: bool = False  # copy every stored chunk down at once (a shared bucket sees it)
    directory: bool = False  # the peer tier finds holders in the fleet directory (Redis Cluster), no static peers
    pooled: bool = False  # one daemon with the fleet's RAM and lower tiers, every node's loader on it

    @property
    def tiers(self) -> tuple[str, ...]:
        """Where a hit can come from."""
        return ("gpu",) + (("ram", *(kind for kind, _ in self.lower)) if self.offload else ())

    def uses(self, kind: str) -> bool:
        return kind in (k for k, _ in self.lower)


CONFIGS = (
    Config("none", "no offload", offload=False),
    Config("ram", "RAM"),
    Config("ram+fs", "RAM + fs", (("fs", "fs_bytes"),)),
    Config("ram+fs+s3", "RAM + fs + S3", (("fs", "s3_fs_bytes"), ("s3", "s3_bytes"))),
)
# --slow-disk: RAM alone against RAM + a disk slower than recomputing, with the recompute gate and without
NO_GATE = Config(
    "ram+fs-nogate", "RAM + fs, gate off", (("fs", "fs_bytes"),), daemon_args=("--recompute-gate", "false")
)
SLOW_DISK = (CONFIGS[1], CONFIGS[2], NO_GATE)
CONFIG_BY_KEY = {c.key: c for c in (*CONFIGS, NO_GATE)}
CONFIG_LABELS = {c.key: c.label for c in CONFIG_BY_KEY.values()}


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
    def mean_new_token_context(self) -> float:
        """Mean position of the tokens a turn computes with its history cached (turn 1: all of it), weighted
        by tokens: the context their attention spans (20,480 with the default shape)."""
        spans = [(self.prompt_tokens(t - 1) if t > 1 else 0, self.prompt_tokens(t)) for t in range(1, self.turns + 1)]
        return sum((end - start) * (start + end) / 2 for start, end in spans) / sum(e - s for s, e in spans)


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

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.params * self.weight_bytes_per_param / self.gpus

    @property
    def kv_bytes_per_gpu(self) -> float:
        """vLLM's KV cache per GPU: HBM x gpu_memory_utilization - the weights' share - the runtime reserve."""
        hbm = self.gpu.hbm_bytes
        return hbm * self.gpu_memory_utilization - self.weight_bytes_per_gpu - hbm * self.runtime_reserve


MODELS = {
    m.key: m
    for m in (
        ModelSpec(
            key="qwen3.6-35b-a3b",
            name="Qwen3.6-35B-A3B bf16",
            gpu=H100,
            gpus=2,
            params=35e9,
            active_params=3e9,
            layers=40,
            attention_layers=10,
            q_heads=16,
            kv_heads=2,
            head_dim=256,
            mfu=0.25,
            mfu_basis="assumed: MoE prefill runs 8 of 256 small experts (width 512, hidden 2048) per token "
            "as grouped GEMMs of low arithmetic intensity, plus two all-reduces per layer at TP=2",
            prefill_tokens_per_s=50_000.0,
            prefill_basis="the estimate, rounded down (issue #13: ~50K for the pair)",
            not_per_token="the 30 Gated DeltaNet layers keep a fixed state per sequence instead (30 x (8,192 x 3 conv "
            "+ 32 heads x 128 x 128) x 2 B = 31 MiB in bf16), not per token: not modelled",
        ),
        ModelSpec(
            key="llama-3.1-8b",
            name="Llama-3.1-8B bf16",
            gpu=H100,
            gpus=1,
            params=8.03e9,
            active_params=8.03e9,
            layers=32,
            attention_layers=32,
            q_heads=32,
            kv_heads=8,
            head_dim=128,
            mfu=0.45,
            mfu_basis="assumed: dense bf16 prefill with FlashAttention on one GPU",
            prefill_tokens_per_s=16_000.0,
            prefill_basis="the estimate, rounded down (the figure this benchmark used before the seed's model)",
        ),
    )
}
DEFAULT_MODEL = "qwen3.6-35b-a3b"


class Transfer(enum.StrEnum):
    """How the engine moves chunks: as vLLM's tier (mode 1), through a registered region, or as the
    direct spec (mode 2), through the pool mapping."""

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
    transfer: Transfer = Transfer.REGION
    register_rates: bool = False  # tell the daemon the prefill rate (its recompute gate then applies)

    @property
    def gate_prefill_tokens_per_s(self) -> float:
        """The prefill rate to register, per token of the real (scaled) KV: the same break-even in bytes/s."""
        return self.prefill_tokens_per_s * self.byte_scale if self.register_rates else 0.0

    @property
    def byte_scale(self) -> float:
        return self.model_kv_bytes_per_token / self.kv_bytes_per_token

    @property
    def breakeven_gib_s(self) -> float:
        """KV bytes/token x prefill rate: a tier that loads slower costs more per token than recomputing."""
        return self.model_kv_bytes_per_token * self.prefill_tokens_per_s / GIB


@dataclass(frozen=True)
class Basis:
    """One modelled figure, its value as printed and where it comes from."""

    quantity: str
    value: str
    basis: str


def derive_model(spec: ModelSpec, w: Workload, args: Any) -> tuple[Model, list[Basis], dict[str, float]]:
    """The simulation's figures from the preset, each with its basis, unless the flags in `args` give them.
    Returns the model, the basis lines and the derivation's numbers (for the JSON)."""
    ctx, hbm, gpus = w.mean_new_token_context, spec.gpu.hbm_bytes, spec.gpus
    kv = args.model_kv_bytes_per_token or spec.kv_bytes_per_token
    kv_basis = (
        f"{spec.attention_layers} of {spec.layers} layers attend x (K, V) x {spec.kv_heads} KV heads x "
        f"{spec.head_dim} dims x {spec.kv_dtype_bytes} B" + (f"; {spec.not_per_token}" if spec.not_per_token else "")
    )
    if args.model_kv_bytes_per_token:
        kv_basis = f"--model-kv-bytes-per-token (the preset's: {spec.kv_bytes_per_token:,} = {kv_basis})"
    flops = spec.flops_per_token(ctx)
    peak = gpus * spec.gpu.bf16_dense_flops
    estimate = peak * spec.mfu / flops
    rate = args.prefill_tokens_per_s or spec.prefill_tokens_per_s
    implied_mfu = rate * flops / peak
    arithmetic = (
        f"FLOPs/token = 2 x {spec.active_params / 1e9:g}B active params + {spec.attention_layers} attention "
        f"layers x 4 x {spec.q_heads} query heads x {spec.head_dim} dims x {ctx:,.0f} tokens of mean context "
        f"= {2 * spec.active_params / 1e9:.2f} + {spec.attention_flops_per_token(ctx) / 1e9:.2f} = "
        f"{flops / 1e9:.2f} GFLOP; {gpus} x {spec.gpu.bf16_dense_flops / 1e12:,.0f} TFLOP/s bf16 dense "
        f"x {100 * spec.mfu:.0f}% MFU ({spec.mfu_basis}) = {peak * spec.mfu / 1e12:,.0f} TFLOP/s -> "
        f"{estimate:,.0f} tokens/s"
    )
    prefill_basis = f"--prefill-tokens-per-s (the preset's estimate: {arithmetic})"
    if not args.prefill_tokens_per_s:
        prefill_basis = (
            f"{arithmetic}; {spec.prefill_basis}: {100 * implied_mfu:.1f}% MFU; the mean context "
            "is the workload's (one rate for every turn: a recomputed history attends over less)"
        )
    per_gpu = spec.kv_bytes_per_gpu
    derived = int(per_gpu * gpus // kv)
    capacity_basis = (
        f"per GPU: {spec.gpu_memory_utilization:g} (gpu_memory_utilization) x {hbm / GIB:.1f} GiB HBM - "
        f"{spec.weight_bytes_per_gpu / GIB:.1f} GiB weights ({spec.params / 1e9:g}B params x "
        f"{spec.weight_bytes_per_param} B / {gpus} GPU{'s' if gpus > 1 else ''}) - "
        f"{spec.runtime_reserve * hbm / GIB:.1f} GiB reserve ({100 * spec.runtime_reserve:.0f}% of HBM: activations, "
        f"CUDA graphs, NCCL, context) = {per_gpu / GIB:.1f} GiB; x {gpus} / {kv:,} B/token"
    )
    tokens = derived
    if args.gpu_tokens:
        tokens, capacity_basis = args.gpu_tokens, f"--gpu-tokens (derived: {derived:,}: {capacity_basis})"
    elif args.gpu_conversations:
        tokens = int(args.gpu_conversations * w.final_tokens)
        capacity_basis = f"--gpu-conversations {args.gpu_conversations:g} (derived: {derived:,}: {capacity_basis})"
    overrides = (args.model_kv_bytes_per_token, args.prefill_tokens_per_s, args.gpu_tokens or args.gpu_conversations)
    overridden = [name for name, v in zip(("KV bytes/token", "prefill", "GPU cache"), overrides) if v]
    on = f"{gpus}x {spec.gpu.name}" + (f" (TP={gpus})" if gpus > 1 else "")
    name = f"{spec.name} on {on}" + (f" ({', '.join(overridden)} overridden)" if overridden else "")
    m = Model(name, kv, args.kv_bytes_per_token, rate, tokens, args.serial_loads, spec.key, args.transfer)
    real = args.kv_bytes_per_token
    capacity_basis += f"; conversations at their last turn ({w.final_tokens:,} tokens)"
    basis = [
        Basis("KV bytes/token", f"{kv:,} B", kv_basis),
        Basis("prefill", f"{rate:,.0f} tokens/s", prefill_basis),
        Basis("GPU prefix cache", f"{tokens:,} tokens = {tokens / w.final_tokens:.1f} conversations", capacity_basis),
        Basis("break-even load rate", f"{m.breakeven_gib_s:.2f} GiB/s", "KV bytes/token x prefill rate"),
        Basis(
            "byte scale",
            f"x{m.byte_scale:g}",
            f"--kv-bytes-per-token {real} really move (a {w.chunk_tokens}-token chunk is "
            f"{fmt_bytes(w.chunk_tokens * real)} instead of {fmt_bytes(w.chunk_tokens * kv)})",
        ),
    ]
    numbers = {
        "mean_context_tokens": ctx,
        "flops_per_token": flops,
        "peak_flops": peak,
        "mfu_assumed": spec.mfu,
        "estimated_prefill_tokens_per_s": estimate,
        "implied_mfu": implied_mfu,
        "hbm_bytes_per_gpu": hbm,
        "weight_bytes_per_gpu": spec.weight_bytes_per_gpu,
        "reserve_bytes_per_gpu": spec.runtime_reserve * hbm,
        "kv_cache_bytes_per_gpu": per_gpu,
        "kv_cache_bytes": per_gpu * gpus,
        "derived_gpu_tokens": derived,
        "derived_gpu_conversations": derived / w.final_tokens,
        "breakeven_gib_s": m.breakeven_gib_s,
    }
    return m, basis, numbers


@dataclass(frozen=True)
class Sizes:
    ram_bytes: int
    fs_bytes: int
    s3_fs_bytes: int
    s3_bytes: int = 0  # 0: unbounded


@dataclass
class Plan:
    """A sweep's workload, modelled model (with its basis and derivation), tier sizes and counts."""

    w: Workload
    m: Model
    basis: list[Basis]
    derivation: dict[str, float]
    sizes: Sizes
    sizes_conv: dict[str, float]  # the sizes in conversations at their last turn
    counts: list[int]
    workdir: Path

    @property
    def chunk_bytes(self) -> int:
        return self.w.chunk_tokens * self.m.kv_bytes_per_token
