"""The Python API over the binary: flags as keyword arguments, configs in three forms, the CLI's
errors as ValueError. Runs the binary the wheel installed (or $OOMPROBE)."""

import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import pytest

import oomprobe
from oomprobe._cli import flag_args

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
OOM = REPO / "tests" / "fixtures" / "oom"


def cargo_version():
    text = (REPO / "Cargo.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def test_version_is_the_crates():
    assert oomprobe.version() == cargo_version()


def test_flag_args():
    assert flag_args({"lora": 16, "lora_targets": "all-linear", "json": True, "gpu": None,
                      "seq": 1024, "batch_of": [1, 2], "x": False}) == [
        "--lora", "16", "--lora-targets", "all-linear", "--json", "--seq", "1024",
        "--batch-of", "1,2"]


def test_estimate_is_the_clis_json():
    d = oomprobe.estimate(model="tiny-gpt", batch=4)
    assert d["workload"]["batch"] == 4
    assert d["breakdown"]["total"] > 0
    assert not d.get("boundaries")  # none without a memory


def test_keyword_flags_reach_the_cli():
    full = oomprobe.estimate(model="llama3-8b", seq=1024, batch=1)
    lora = oomprobe.estimate(model="llama3-8b", seq=1024, batch=1, lora=16,
                             lora_targets="all-linear", quant="nf4")
    assert lora["breakdown"]["total"] < full["breakdown"]["total"] / 4


def test_a_layout_is_keyword_flags():
    one = oomprobe.estimate(model="llama3-8b", seq=2048, batch=1)
    rank = oomprobe.estimate(model="llama3-8b", seq=2048, batch=1, gpus=8, tp=2,
                             sequence_parallel=True, fsdp="full")
    assert rank["notes"][0].startswith("per-rank plan: rank 0 of 8")
    assert rank["breakdown"]["total"] < one["breakdown"]["total"] / 4
    with pytest.raises(ValueError, match="--tp: tp 3 does not divide the 32 attention heads"):
        oomprobe.estimate(model="llama3-8b", tp=3)


def test_bad_arguments_raise_the_clis_line():
    with pytest.raises(ValueError, match=r"^oomprobe: --model: unknown model preset 'nope'") as e:
        oomprobe.estimate(model="nope")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unexpected argument '--no-such-flag'"):
        oomprobe.estimate(model="tiny-gpt", no_such_flag=3)


def test_config_as_path_dict_and_object(tmp_path):
    path = CONFIGS / "qwen2.5-0.5b.json"
    cfg = json.loads(path.read_text())
    by_path = oomprobe.estimate(config=path, seq=512, batch=2)
    by_str = oomprobe.estimate(config=str(path), seq=512, batch=2)
    by_dict = oomprobe.estimate(config=cfg, seq=512, batch=2)

    class PretrainedConfigLike:  # transformers' PretrainedConfig's serialisation
        def to_json_string(self, use_diff=True):
            assert use_diff is False
            return json.dumps(cfg)

    by_obj = oomprobe.estimate(config=PretrainedConfigLike(), seq=512, batch=2)
    assert by_path["breakdown"] == by_str["breakdown"] == by_dict["breakdown"] \
        == by_obj["breakdown"]
    assert by_path["param_count"] == 494_032_768  # Qwen2.5-0.5B's published count
    with pytest.raises(ValueError, match="PretrainedConfig"):
        oomprobe.estimate(config=42)


def test_max_batch_is_the_allocators_boundary():
    d = oomprobe.estimate(model="tiny-gpt", memory="1GiB")
    batch = next(b for b in d["boundaries"] if b["scenario"] == "batch")
    assert oomprobe.max_batch(model="tiny-gpt", memory="1GiB") == batch["max_reserved"]
    assert oomprobe.max_batch(model="tiny-gpt", memory="1GiB", tensors_only=True) == batch["max"]
    assert batch["max_reserved"] <= batch["max"]
    # More memory outside PyTorch leaves a smaller batch.
    assert oomprobe.max_batch(model="tiny-gpt", memory="1GiB", non_pytorch="256MiB") \
        < batch["max_reserved"]


def test_max_batch_needs_a_memory_and_room():
    with pytest.raises(ValueError, match="memory="):
        oomprobe.max_batch(model="tiny-gpt")
    with pytest.raises(ValueError, match="not even batch 1"):
        oomprobe.max_batch(model="llama3-8b", memory="1GiB")


def test_diagnose():
    d = oomprobe.diagnose(model="tiny-gpt", batch=4096, memory="1GiB")
    assert d["cause"] and d["remedies"]


def test_diagnose_oom_reads_a_pasted_message():
    text = (OOM / "011-pytorch16417-24g-small-req.txt").read_text()
    d = oomprobe.diagnose_oom("Traceback (most recent call last):\n" + text)
    (m,) = d["messages"]
    assert m["cause"] == "fragmentation"
    assert m["requested_bytes"] == 22 * 2**20


def test_binary_follows_OOMPROBE(monkeypatch, tmp_path):
    monkeypatch.setenv("OOMPROBE", str(tmp_path / "missing"))
    assert oomprobe.binary() == str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        oomprobe.version()


@pytest.mark.skipif(os.environ.get("OOMPROBE_WHEEL_TEST") != "1",
                    reason="only where scripts/test-python.sh installed the wheel")
def test_the_wheel_installed_binary_and_package():
    scripts = Path(sysconfig.get_path("scripts"))
    assert "OOMPROBE" not in os.environ
    assert Path(oomprobe.binary()) == scripts / "oomprobe"
    assert Path(oomprobe.__file__).is_relative_to(Path(sys.prefix))
    assert (Path(oomprobe.__file__).parent / "py.typed").is_file()
