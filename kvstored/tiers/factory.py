"""Build the configured lower tiers, each with its bounded I/O queue."""

from __future__ import annotations

from kvstored.config import FsTierConfig, S3TierConfig, TierConfig
from kvstored.io.scheduler import TierQueue
from kvstored.tiers.base import SecondaryTier
from kvstored.tiers.lower import LowerTier


def build_tier(cfg: TierConfig) -> SecondaryTier:
    match cfg:
        case FsTierConfig():
            from kvstored.tiers.fs import FsTier

            return FsTier(cfg.name, cfg.root, cfg.bytes, admission=cfg.admission, io_threads=cfg.io_threads,
                          direct_io=cfg.direct_io)
        case S3TierConfig():
            from kvstored.tiers.s3 import S3Tier  # aiobotocore is only imported when used

            return S3Tier(cfg.name, cfg.bucket, prefix=cfg.prefix, endpoint_url=cfg.endpoint_url, region=cfg.region,
                          access_key=cfg.access_key, secret_key=cfg.secret_key, capacity_bytes=cfg.bytes,
                          max_concurrency=cfg.concurrency, timeout_s=cfg.timeout_s, admission=cfg.admission,
                          negative_cache_s=cfg.negative_cache_s, breaker_failures=cfg.breaker_failures,
                          breaker_reset_s=cfg.breaker_reset_s, create_bucket=cfg.create_bucket)
    raise TypeError(f"no tier for {cfg!r}")


def build_lower_tiers(configs: tuple[TierConfig, ...]) -> list[LowerTier]:
    return [LowerTier(build_tier(cfg), TierQueue(cfg.name, cfg.concurrency, cfg.max_backlog)) for cfg in configs]
