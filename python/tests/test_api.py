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
from oomprobe._cli import BARE, ON_OFF, SWITCHES, flag_args, _refusal

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
OOM = REPO / "tests" / "fixtures" / "oom"


def cargo_version():
    text = (REPO / "Cargo.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def test_version_is_the_crates():
    assert oomprobe.version() == cargo_version()


def test_flag_args():
    assert flag_args({"lora": 16, "lora_targets": "all-linear", "gpu": None, "seq": 1024,
                      "batch_of": [1, 2], "config": Path("c.json"), "dropout": False,
                      "sequence_parallel": True, "ddp": True, "offload": None}) == [
        "--lora", "16", "--lora-targets", "all-linear", "--seq", "1024", "--batch-of", "1,2",
        "--config", "c.json", "--dropout", "off", "--sequence-parallel", "on", "--ddp"]
    assert flag_args({"ddp": False}) == []
    # Several snapshots are the flag once each (a file name may hold a comma), with lenient bare.
    assert flag_args({"snapshot": ["a,1.pickle", Path("b.pickle")], "batch_of": (1, 2),
                      "lenient": True}) == [
        "--snapshot", "a,1.pickle", "--snapshot", "b.pickle", "--batch-of", "1,2", "--lenient"]


def test_two_snapshots_scale_through_the_api():
    fx = Path(__file__).resolve().parents[2] / "tests/fixtures/snapshots"
    d = oomprobe.estimate(snapshot=[fx / "gpt2-tiny-b1.pickle", fx / "gpt2-tiny-b2.pickle"],
                          batch_of=[1, 2])
    assert d["devices"], d


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


# Issue 48, finding 9: the API's errors, each checked before the binary runs or mapped from the
# CLI's one refusal line.

def test_diagnose_oom_takes_bytes_and_refuses_other_types():
    text = (OOM / "011-pytorch16417-24g-small-req.txt").read_text()
    by_str = oomprobe.diagnose_oom(text)
    assert oomprobe.diagnose_oom(text.encode()) == by_str
    assert oomprobe.diagnose_oom(bytearray(text.encode())) == by_str
    # Invalid UTF-8 is replaced, as the CLI reads any log.
    assert oomprobe.diagnose_oom(b"\xc3\x28 junk \xff\n" + text.encode())["messages"]
    with pytest.raises(TypeError, match=r"diagnose_oom\(\): text= takes a str or bytes, not int"):
        oomprobe.diagnose_oom(123)
    with pytest.raises(TypeError, match="read the file first"):
        oomprobe.diagnose_oom(OOM / "011-pytorch16417-24g-small-req.txt")


def test_max_batch_takes_one_card():
    for gpu in ("list", "all"):
        with pytest.raises(ValueError, match=f"gpu='{gpu}' is no card: max_batch takes one card"):
            oomprobe.max_batch(model="gpt2", gpu=gpu)
    d = oomprobe.estimate(model="tiny-gpt", gpu="t4")
    batch = next(b for b in d["boundaries"] if b["scenario"] == "batch")
    assert oomprobe.max_batch(model="tiny-gpt", gpu="t4") == batch["max_reserved"]


def test_booleans_are_no_sizes_or_counts():
    for key in ("memory", "batch", "gpus", "microbatches"):
        with pytest.raises(TypeError, match=rf"^estimate\(\): {key}= takes a value, not True"):
            oomprobe.estimate(model="tiny-gpt", **{key: True})
    with pytest.raises(TypeError, match=r"^diagnose\(\): model= takes a value, not True"):
        oomprobe.diagnose(model=True)
    with pytest.raises(TypeError, match=r"^max_batch\(\): non_pytorch= takes a value"):
        oomprobe.max_batch(model="tiny-gpt", memory="1GiB", non_pytorch=False)
    # Numbers and size strings are sizes; True/False are on/off where the flag reads on|off.
    assert oomprobe.max_batch(model="tiny-gpt", memory=2**30) \
        == oomprobe.max_batch(model="tiny-gpt", memory="1GiB")
    from fractions import Fraction  # a numbers.Real that is no int, as numpy's integers are
    assert flag_args({"batch": Fraction(4)}) == ["--batch", "4"]
    assert oomprobe.estimate(model="tiny-gpt", dropout=False) \
        == oomprobe.estimate(model="tiny-gpt", dropout="off")


def test_other_value_types_name_the_parameter():
    with pytest.raises(TypeError, match=r"^estimate\(\): batch= takes a str, a number or a path, not dict"):
        oomprobe.estimate(model="tiny-gpt", batch={"b": 1})
    with pytest.raises(TypeError, match=r"^diagnose\(\): batch_of= .* not bool"):
        oomprobe.diagnose(model="tiny-gpt", batch_of=[1, True])
    with pytest.raises(ValueError, match=r"^estimate\(\): model= holds a NUL"):
        oomprobe.estimate(model="tiny\0gpt")
    with pytest.raises(ValueError, match=r"^estimate\(\): model= cannot be a command-line argument"):
        oomprobe.estimate(model="\ud800")


def test_meta_flags_are_refused_before_the_binary_runs():
    for key in ("help", "version", "json"):
        with pytest.raises(TypeError, match=f"estimate\\(\\) got an unexpected keyword argument '{key}'"):
            oomprobe.estimate(model="tiny-gpt", **{key: True})
    with pytest.raises(TypeError, match="'oom'"):
        oomprobe.diagnose_oom("x", oom="log.txt")


def test_long_inputs_never_reach_the_argument_list():
    # A 10 MB log goes through stdin.
    text = (OOM / "011-pytorch16417-24g-small-req.txt").read_text()
    (m,) = oomprobe.diagnose_oom(text + "\n" + "step 1 loss 0.5 lr 1e-4\n" * 420_000)["messages"]
    assert m["requested_bytes"] == 22 * 2**20
    # No flag's value is that long: a ValueError naming it, not OSError (E2BIG).
    with pytest.raises(ValueError, match=r"^estimate\(\): model= is 10000000 bytes long"):
        oomprobe.estimate(model="x" * 10_000_000)


def test_a_refusal_is_the_clis_whole_line():
    with pytest.raises(ValueError) as e:
        oomprobe.estimate(model="tiny-gpt", memory="1GiB", alloc_conf="a\nb:1")
    assert str(e.value).startswith("oomprobe: --alloc-conf: unknown key 'a\\nb'")
    assert "\n" not in str(e.value) and "PyTorch's keys" in str(e.value)
    # Warnings come before the refusal: the refusal is the last line.
    assert _refusal("oomprobe: warning: w\noomprobe: --batch: bad\n") == "oomprobe: --batch: bad"


def test_the_bool_tables_are_the_clis():
    """ON_OFF and BARE are the flags the CLI's help shows as <on|off> and [<...>]."""
    import subprocess
    on_off, bare, switches = set(), set(), set()
    for cmd in ("estimate", "diagnose"):
        help_text = subprocess.run([oomprobe.binary(), cmd, "--help"], capture_output=True,
                                   text=True, check=True).stdout
        for flag, optional, value in re.findall(r"^\s+--([a-z-]+) (\[)?<([^>]+)>", help_text, re.M):
            key = flag.replace("-", "_")
            if value == "on|off":
                on_off.add(key)
            elif optional:
                bare.add(key)
        switches |= {f.replace("-", "_") for f in re.findall(r"^\s+--([a-z-]+)$", help_text, re.M)}
    assert on_off == ON_OFF
    assert bare == BARE
    assert SWITCHES <= switches, switches


def test_max_batch_names_the_way_out_when_nothing_fits():
    # Llama-3-8B at 2048 on one RTX 4090 does not fit at batch 1 (issue 47): the error the
    # Lightning and transformers hooks raise carries diagnose's fastest way out.
    with pytest.raises(ValueError) as e:
        oomprobe.max_batch(model="llama3-8b", seq=2048, gpu="rtx4090")
    assert "not even batch 1 fits" in str(e.value)
    assert "way out" in str(e.value) and "--lora 16" in str(e.value), str(e.value)


def test_diagnose_returns_the_ways_out():
    d = oomprobe.diagnose(model="llama3-8b", seq=2048, gpu="rtx4090")
    ways = d["ways"]["ways"]
    assert len(ways) >= 3 and all(w["fits"] for w in ways)
    assert ways[0]["relative_cost"] == 1.0
