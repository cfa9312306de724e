"""A framework's parallel strategy as oomprobe's layout flags (each rank is planned), read from
the objects' attributes only: no torch, Lightning or transformers to import."""

from __future__ import annotations

from typing import Any

# FSDP1's sharding strategies (Lightning's FSDPStrategy) as oomprobe's --fsdp.
_FSDP = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "shard-grad-op", "HYBRID_SHARD": "hybrid",
         "_HYBRID_SHARD_ZERO2": "hybrid", "NO_SHARD": "none"}


def lightning(trainer: Any) -> dict:
    """The Trainer's strategy over its world size as oomprobe's layout flags (each rank is
    planned): DDP with its bucket_cap_mb and gradient_as_bucket_view, FSDP's sharding strategy,
    DeepSpeed's ZeRO stage. One device, or a strategy oomprobe does not model, adds nothing."""
    world = int(getattr(trainer, "world_size", 1) or 1)
    strategy = getattr(trainer, "strategy", None)
    if world <= 1 or strategy is None:
        return {}
    name = type(strategy).__name__
    if name.startswith("DDP"):
        kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
        flags = {"gpus": world, "ddp": kwargs.get("bucket_cap_mb", 25)}
        if kwargs.get("gradient_as_bucket_view"):
            flags["bucket_view"] = "on"
        return flags
    if name == "FSDPStrategy":
        kind = getattr(getattr(strategy, "sharding_strategy", None), "name", "FULL_SHARD")
        return {"gpus": world, "fsdp": _FSDP.get(kind, "full")}
    if name == "DeepSpeedStrategy":
        config = getattr(strategy, "config", None) or {}
        stage = int(config.get("zero_optimization", {}).get("stage", 0))
        return {"gpus": world, "zero": stage} if stage else {"gpus": world}
    return {}


def transformers(args: Any) -> dict:
    """TrainingArguments over their world size as oomprobe's layout flags (each rank is
    planned): `fsdp=` (full_shard, shard_grad_op, hybrid_shard), a DeepSpeed config's ZeRO
    stage, else DDP with `ddp_bucket_cap_mb`. One process adds nothing."""
    world = int(getattr(args, "world_size", 1) or 1)
    if world <= 1:
        return {}
    fsdp = getattr(args, "fsdp", None) or []
    options = [getattr(o, "value", o) for o in (fsdp.split() if isinstance(fsdp, str) else fsdp)]
    for opt, kind in (("full_shard", "full"), ("shard_grad_op", "shard-grad-op"),
                      ("hybrid_shard", "hybrid"), ("hybrid_shard_zero2", "hybrid")):
        if opt in options:
            return {"gpus": world, "fsdp": kind}
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None or getattr(args, "deepspeed", None):
        config = getattr(ds, "config", None) or {}
        stage = int(config.get("zero_optimization", {}).get("stage", 0))
        return {"gpus": world, "zero": stage} if stage else {"gpus": world}
    return {"gpus": world, "ddp": getattr(args, "ddp_bucket_cap_mb", None) or 25}
