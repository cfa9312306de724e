"""The batch for transformers' `Trainer`: oomprobe's prediction, checked with real steps.

    from oomprobe.transformers import find_batch_size
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    found = find_batch_size(trainer, seq=1024, memory="24GiB")
    trainer.args.per_device_train_batch_size = found.batch
    trainer.train()

In place of `auto_find_batch_size` (Accelerate's halving from the configured batch), it
predicts from `trainer.model.config` and runs trials at the prediction and above it until a
fitting batch sits next to a failing one (`oomprobe.verify.bracket`). A trial is
`steps_per_trial` real optimizer steps through `trainer.training_step` on a batch collated
from the training set. The weights are saved to a temporary file first and loaded back after;
the optimizer made for the trials is dropped, so `train()` makes a fresh one. Duck-typed over
the Trainer: neither transformers nor oomprobe's Lightning hook is imported.
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Any, Optional

from . import _device, _layout, max_batch
from .verify import Bracket, bracket

__all__ = ["find_batch_size"]


def step_flags(args: Any, device_type: str) -> dict:
    """How transformers' Trainer runs a step, as oomprobe's flags: `compute_loss` hands back the
    loss only (the logits go before the backward), `model.zero_grad()` after the optimizer
    step, AdamW fused (TrainingArguments' default optim on torch >= 2.8), the precision of
    `bf16=`/`fp16=` (autocast); on a CPU, the CPU's kernels and dropout noise."""
    flags = {"grads": "free", "outputs": "dropped"}
    optim = getattr(args, "optim", "adamw_torch_fused")
    optim = getattr(optim, "value", optim)  # an OptimizerNames member, or its string
    if optim == "adamw_torch_fused":
        flags["optimizer_impl"] = "fused"
    elif optim == "adamw_torch":
        flags["optimizer_impl"] = "for-loop" if device_type == "cpu" else "foreach"
    elif optim == "adamw_hf":  # transformers' own AdamW (before transformers 5)
        flags["optimizer_impl"] = "transformers"
    if getattr(args, "bf16", False):
        flags["precision"] = "amp-bf16"
    elif getattr(args, "fp16", False):
        flags["precision"] = "amp-fp16"
    if device_type == "cpu":
        flags.update(_device.CPU_FLAGS)
    flags.update(_layout.transformers(args))
    return flags


def _collate(trainer: Any, b: int) -> Any:
    ds = trainer.train_dataset
    n = len(ds)
    return trainer.data_collator([ds[i % n] for i in range(b)])


def _clear(trainer: Any) -> None:
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def find_batch_size(
    trainer: Any,
    *,
    steps_per_trial: int = 2,
    limit: Optional[int] = None,
    memory: Any = None,
    tensors_only: Optional[bool] = None,
    **flags: Any,
) -> Bracket:
    """The verified max `per_device_train_batch_size` for `trainer`, as a Bracket (`.batch`,
    `.predicted`, `.steps`, `.real_steps`). `flags` are oomprobe's (`seq=`, `lora=`, ...;
    `config=` or `model=` override the model's config). Without `memory=` on a CUDA device the
    card's memory and what lives outside PyTorch on it are read from torch."""
    import torch

    model = trainer.model
    device = next(model.parameters()).device
    flags = {**step_flags(getattr(trainer, "args", None), device.type), **flags}
    if "model" not in flags and "config" not in flags:
        flags["config"] = model.config
    flags.update(_device.memory_flags(device, memory, flags))
    predicted = max_batch(tensors_only=_device.tensors_only(device, tensors_only), **flags)

    if getattr(trainer, "optimizer", None) is None:
        trainer.create_optimizer()
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = 1

    def step(b: int) -> None:
        inputs = _collate(trainer, b)
        try:
            for _ in range(steps_per_trial):
                trainer.training_step(model, inputs)
                trainer.optimizer.step()
                model.zero_grad(set_to_none=True)
        finally:
            del inputs
            _clear(trainer)

    fd, saved = tempfile.mkstemp(prefix="oomprobe-weights-", suffix=".pt")
    os.close(fd)
    try:
        torch.save(model.state_dict(), saved)
        return bracket(predicted, step, limit=limit)
    finally:
        model.load_state_dict(torch.load(saved, map_location=device, weights_only=True))
        os.unlink(saved)
        trainer.optimizer = None
        trainer.lr_scheduler = None
        _clear(trainer)
