"""The transformers hook against a stub Trainer whose steps raise PyTorch's CPU OOM above a set
batch (torch replaced by a stand-in: no torch in CI). The Lightning hook subclasses Lightning's
own finder and is run for real by validation/batch_finder.py."""

import pickle
import sys
import types

import pytest

import oomprobe
from oomprobe.transformers import find_batch_size, step_flags

FLAGS = dict(model="tiny-gpt", memory="512MiB")


@pytest.fixture
def fake_torch(monkeypatch):
    torch = types.ModuleType("torch")

    def save(obj, path):
        with open(path, "wb") as f:
            pickle.dump(obj, f)

    def load(path, map_location=None, weights_only=False):
        with open(path, "rb") as f:
            return pickle.load(f)

    torch.save, torch.load = save, load
    torch.cuda = types.SimpleNamespace(is_available=lambda: False, empty_cache=lambda: None)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


class Model:
    config = None  # FLAGS names the model

    def __init__(self):
        self.weights = {"w": 1.0}
        self.grads = None

    def parameters(self):
        yield types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))

    def state_dict(self):
        return dict(self.weights)

    def load_state_dict(self, d):
        self.weights = dict(d)

    def zero_grad(self, set_to_none=True):
        self.grads = None


class Trainer:
    def __init__(self, edge):
        self.edge = edge
        self.model = Model()
        self.optimizer = None
        self.lr_scheduler = "scheduler"
        self.train_dataset = [{"input_ids": [i]} for i in range(10)]
        self.data_collator = lambda xs: {"input_ids": [x["input_ids"] for x in xs]}
        self.batches = []  # every training_step's batch size

    def create_optimizer(self):
        def step():
            self.model.weights["w"] -= 0.1

        self.optimizer = types.SimpleNamespace(step=step)

    def training_step(self, model, inputs):
        b = len(inputs["input_ids"])
        self.batches.append(b)
        if b > self.edge:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: "
                               f"can't allocate memory: you tried to allocate {b << 20} bytes.")
        model.grads = b


@pytest.mark.parametrize("off,trials", [(0, 2), (1, 3), (-1, 2), (-3, 5), (6, 7)])
def test_find_batch_size_brackets_the_edge(fake_torch, off, trials):
    predicted = oomprobe.max_batch(tensors_only=True, **step_flags(None, "cpu"), **FLAGS)
    trainer = Trainer(edge=predicted + off)
    found = find_batch_size(trainer, steps_per_trial=2, **FLAGS)
    assert found.predicted == predicted
    assert (found.batch, found.first_fail) == (predicted + off, predicted + off + 1)
    assert found.real_steps == trials
    # A trial that fits runs steps_per_trial steps; one that fails stops at its first.
    fitted = [b for b, ok in found.steps if ok]
    assert sorted(trainer.batches) == sorted([b for b in fitted for _ in range(2)]
                                             + [b for b, ok in found.steps if not ok])
    # The weights the trials moved are back, and train() will make its own optimizer.
    assert trainer.model.weights == {"w": 1.0}
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    assert trainer.model.grads is None


def test_find_batch_size_needs_a_memory_on_a_cpu(fake_torch):
    with pytest.raises(ValueError, match="memory= is needed for a cpu device"):
        find_batch_size(Trainer(edge=4), model="tiny-gpt")


def test_other_errors_are_not_ooms(fake_torch):
    trainer = Trainer(edge=10**6)
    trainer.training_step = lambda model, inputs: (_ for _ in ()).throw(KeyError("labels"))
    with pytest.raises(KeyError):
        find_batch_size(trainer, **FLAGS)
    assert trainer.model.weights == {"w": 1.0}


def test_step_flags_follow_the_trainers_arguments():
    args = types.SimpleNamespace(optim="adamw_torch", bf16=True, fp16=False)
    assert step_flags(args, "cuda") == {"grads": "free", "outputs": "dropped",
                                        "optimizer_impl": "foreach", "precision": "amp-bf16"}
    assert step_flags(None, "cpu") == {"grads": "free", "outputs": "dropped",
                                       "optimizer_impl": "fused", "autocast_device": "cpu",
                                       "dropout_mask": "input"}
    # Each is a flag the binary takes: the prediction runs with them.
    assert oomprobe.max_batch(tensors_only=True, **step_flags(args, "cuda"), **FLAGS) >= 1
    # transformers' own AdamW (optim="adamw_hf", before transformers 5): one temporary.
    hf = types.SimpleNamespace(optim="adamw_hf", bf16=False, fp16=False)
    assert step_flags(hf, "cuda")["optimizer_impl"] == "transformers"
    assert oomprobe.max_batch(tensors_only=True, **step_flags(hf, "cuda"), **FLAGS) >= 1


def test_layout_flags_follow_the_strategy_and_the_arguments():
    from oomprobe import _layout

    class DDPStrategy:
        _ddp_kwargs = {"bucket_cap_mb": 50, "gradient_as_bucket_view": True}

    class FSDPStrategy:
        sharding_strategy = types.SimpleNamespace(name="SHARD_GRAD_OP")

    class DeepSpeedStrategy:
        config = {"zero_optimization": {"stage": 3}}

    trainer = types.SimpleNamespace(world_size=8, strategy=DDPStrategy())
    assert _layout.lightning(trainer) == {"gpus": 8, "ddp": 50, "bucket_view": "on"}
    trainer.strategy = FSDPStrategy()
    assert _layout.lightning(trainer) == {"gpus": 8, "fsdp": "shard-grad-op"}
    trainer.strategy = DeepSpeedStrategy()
    assert _layout.lightning(trainer) == {"gpus": 8, "zero": 3}
    assert _layout.lightning(types.SimpleNamespace(world_size=1, strategy=None)) == {}

    args = types.SimpleNamespace(world_size=4, fsdp=["full_shard", "auto_wrap"])
    assert _layout.transformers(args) == {"gpus": 4, "fsdp": "full"}
    args = types.SimpleNamespace(world_size=4, fsdp="", ddp_bucket_cap_mb=None)
    assert _layout.transformers(args) == {"gpus": 4, "ddp": 25}
    assert _layout.transformers(types.SimpleNamespace(world_size=1)) == {}
    # Each is a set of flags the binary takes.
    for flags in ({"gpus": 8, "ddp": 50, "bucket_view": "on"}, {"gpus": 8, "fsdp": "shard-grad-op"},
                  {"gpus": 4, "fsdp": "full"}):
        assert oomprobe.max_batch(tensors_only=True, **flags, **FLAGS) >= 1
