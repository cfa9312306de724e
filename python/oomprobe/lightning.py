"""A Lightning callback that asks oomprobe for the max batch, then checks it with real steps.

    from oomprobe.lightning import BatchSizeFinder
    trainer = Trainer(callbacks=[BatchSizeFinder(seq=1024, memory="24GiB")])

It subclasses Lightning's own `BatchSizeFinder`. After a warm-up trial at batch 1 (so what
lives outside the tensors exists when the memory is read) it predicts the max batch from the
module's config (`config=` or `model=`, else `pl_module.config` or `pl_module.model.config`),
runs one trial at the prediction and one at prediction + 1, and walks by one until a fitting batch sits
next to a failing one (`oomprobe.verify.bracket`). A trial is `steps_per_trial` optimizer
steps, as in Lightning. When the workload cannot be expressed (no config, no memory on a CPU,
a config oomprobe refuses), it falls back to Lightning's own search and says why in
`fallback_reason`. Needs lightning (2.6); `import oomprobe` does not.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder as _LightningFinder
from lightning.pytorch.tuner import batch_size_scaling as _bs
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_setattr

from . import _device, _layout, max_batch
from .verify import Bracket, bracket

__all__ = ["BatchSizeFinder", "step_flags"]

Memory = Union[str, int, Callable[["pl.Trainer", "pl.LightningModule"], Union[str, int]], None]


# Lightning's Trainer(precision=...) as oomprobe's --precision.
_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16",
              "bf16-true": "bf16", "16-true": "fp16"}


def step_flags(trainer: Any, device_type: str) -> dict:
    """How Lightning runs a step, as oomprobe's flags: its closure runs the forward, then
    zero_grad, then the backward (the last step's gradients live through the forward); the
    training_step hands back the loss only; the precision plugin's type; on a CPU, the CPU's
    kernels and dropout noise, and torch's CPU default Adam (for-loop)."""
    flags = {"grads": "until-backward", "outputs": "dropped"}
    precision = _PRECISION.get(str(getattr(trainer, "precision", "32-true")))
    if precision:
        flags["precision"] = precision
    if device_type == "cpu":
        flags.update(_device.CPU_FLAGS, optimizer_impl="for-loop")
    flags.update(_layout.lightning(trainer))
    return flags


def _module_config(pl_module: Any) -> Any:
    for owner in (pl_module, getattr(pl_module, "model", None)):
        cfg = getattr(owner, "config", None)
        if cfg is not None and (hasattr(cfg, "to_json_string") or isinstance(cfg, dict)):
            return cfg
    return None


class BatchSizeFinder(_LightningFinder):
    """Lightning's BatchSizeFinder, started from oomprobe's prediction.

    Arguments other than Lightning's (`mode`, `steps_per_trial`, `init_val`, `max_trials`,
    `batch_arg_name`, `max_val`) are oomprobe's flags, as `oomprobe.max_batch` takes them:
    `model=` or `config=`, `seq=`, `memory=` (a size, or a callable of (trainer, module) that
    returns one, e.g. to subtract a baseline measured after the warm-up), `lora=`, ....
    `warmup=True` runs one trial at batch 1 before the memory is read. After the search:
    `optimal_batch_size`, `predicted`, `bracket` (every trial after the warm-up),
    `warmup_trials` and `fallback_reason`.
    """

    def __init__(
        self,
        *,
        mode: str = "binsearch",
        steps_per_trial: int = 2,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        max_val: int = 8192,
        memory: Memory = None,
        tensors_only: Optional[bool] = None,
        warmup: bool = True,
        **flags: Any,
    ) -> None:
        super().__init__(
            mode=mode,
            steps_per_trial=steps_per_trial,
            init_val=init_val,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
            margin=0.0,
            max_val=max_val,
        )
        self._memory = memory
        self._tensors_only = tensors_only
        self._warmup = warmup
        self.warmup_trials = 0
        self._flags = flags
        self.predicted: Optional[int] = None
        self.bracket: Optional[Bracket] = None
        self.fallback_reason: Optional[str] = None

    def predict(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> int:
        """oomprobe's max batch for this module on its device; ValueError when it cannot say."""
        flags = {**step_flags(trainer, pl_module.device.type), **self._flags}
        if "model" not in flags and "config" not in flags:
            cfg = _module_config(pl_module)
            if cfg is None:
                raise ValueError("no model= or config= given and the module has no config")
            flags["config"] = cfg
        memory = self._memory(trainer, pl_module) if callable(self._memory) else self._memory
        flags.update(_device.memory_flags(pl_module.device, memory, flags))
        tensors_only = _device.tensors_only(pl_module.device, self._tensors_only)
        return max_batch(tensors_only=tensors_only, **flags)

    def scale_batch_size(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.state.fn != "fit":
            self.fallback_reason = f"oomprobe predicts training steps, not {trainer.state.fn}"
            return super().scale_batch_size(trainer, pl_module)
        with _Trials(trainer, self._batch_arg_name, self._steps_per_trial, self._max_val) as t:
            if self._warmup:
                # One trial at batch 1 first: the threads, the allocator's pools and (on CUDA)
                # the cuBLAS workspaces exist when the memory outside the tensors is measured.
                try:
                    t.step(1)
                    self.warmup_trials = 1
                except BaseException as e:  # noqa: BLE001 - only OOM is an outcome
                    if not is_oom_error(e):
                        raise
                    self.bracket = Bracket(batch=0, first_fail=1, predicted=0, steps=[(1, False)])
            if self.bracket is None:
                try:
                    self.predicted = self.predict(trainer, pl_module)
                except (ValueError, FileNotFoundError) as e:
                    self.fallback_reason = str(e)
                else:
                    self.bracket = bracket(self.predicted, t.step, limit=t.limit,
                                           oom=is_oom_error)
        if self.bracket is None:
            return super().scale_batch_size(trainer, pl_module)
        self.optimal_batch_size = self.bracket.batch
        lightning_setattr(pl_module, self._batch_arg_name, max(1, self.bracket.batch))
        if self._early_exit:
            from lightning.pytorch.utilities.exceptions import _TunerExitException

            raise _TunerExitException()


class _Trials:
    """Trials run as Lightning's finder runs them: its loop, `steps_per_trial` optimizer steps
    each, from a checkpoint saved on entry and restored on exit."""

    def __init__(self, trainer: "pl.Trainer", arg: str, steps_per_trial: int, max_val: int):
        self.trainer, self.arg, self.steps_per_trial = trainer, arg, steps_per_trial
        self.limit = max_val
        self.ckpt = os.path.join(trainer.default_root_dir, ".oomprobe_scale_batch_size.ckpt")

    def __enter__(self) -> "_Trials":
        trainer = self.trainer
        loop = trainer._active_loop
        loop.setup_data()
        try:
            # A batch the data cannot fill would "fit" at the data's size: stop there.
            self.limit = min(self.limit, loop._combined_loader._dataset_length())
        except NotImplementedError:  # iterable datasets
            pass
        trainer.save_checkpoint(self.ckpt)
        # Lightning's module-level helpers (double-underscore names, so fetched by name).
        self.params = getattr(_bs, "__scale_batch_dump_params")(trainer)
        getattr(_bs, "__scale_batch_reset_params")(trainer, self.steps_per_trial)
        if trainer.progress_bar_callback:
            trainer.progress_bar_callback.disable()
        return self

    def step(self, b: int) -> None:
        trainer = self.trainer
        garbage_collection_cuda()
        _bs._reset_progress(trainer)
        lightning_setattr(trainer.lightning_module, self.arg, b)
        _bs._reset_dataloaders(trainer)
        try:
            _bs._try_loop_run(trainer, self.params)
        finally:
            garbage_collection_cuda()

    def __exit__(self, *exc: Any) -> None:
        trainer = self.trainer
        getattr(_bs, "__scale_batch_restore_params")(trainer, self.params)
        if trainer.progress_bar_callback:
            trainer.progress_bar_callback.enable()
        trainer._checkpoint_connector.restore(self.ckpt)
        trainer.strategy.remove_checkpoint(self.ckpt)
