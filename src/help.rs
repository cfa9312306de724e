//! The examples each command's `--help` ends with (every line is checked to parse in tests).

pub const DEVICES: &str = "\
Examples:
  oomprobe devices                  # every adapter, with memory and buffer limits
  oomprobe devices --json           # the same as JSON, for scripts";

pub const ESTIMATE: &str = "\
Examples:
  oomprobe estimate --model gpt2 --batch 8 --seq 1024
  oomprobe estimate --model llama3-8b --seq 2048 --memory 80GiB   # grouped-query, SDPA, bf16
  oomprobe estimate --config config.json --attention eager      # a Hugging Face config.json
  oomprobe estimate --model mixtral-8x7b --mode inference --memory 96GiB
  oomprobe estimate --model llama3-8b --lora 16 --quant nf4 --seq 2048 --memory 24GiB   # QLoRA
  oomprobe estimate --model llama-13b --precision mixed --optimizer adam
  oomprobe estimate --model gpt2 --precision fp16 --memory 24GiB --json
  oomprobe estimate --model vit-l16 --batch 32 --precision amp-fp16   # torch.autocast
  oomprobe estimate --snapshot snap.pickle --memory 24GiB   # a PyTorch memory snapshot
  oomprobe estimate --model gpt2 --export-snapshot plan.pickle  # for PyTorch's memory viewer
  oomprobe estimate --model gpt2 --gpu rtx4090 --out step.html  # the step drawn, by role";

pub const PROBE: &str = "\
Examples:
  oomprobe probe                                  # the default suite on the default device
  oomprobe probe --budget 512MiB                  # emulate a 512 MiB card
  oomprobe probe --model gpt2 --scenario batch    # your workload's real max batch
  oomprobe probe --scenario seq --out seq.html    # one scenario, an HTML report
  oomprobe probe --model resnet50 --at 64         # does batch 64 fit?
  oomprobe probe --backend cuda --device 1 --json
  oomprobe probe --snapshot snap.pickle --budget 24GiB      # replay a PyTorch memory snapshot
  oomprobe probe --snapshot b1.pickle --snapshot b2.pickle --batch-of 1,2   # its max batch";

pub const DIAGNOSE: &str = "\
Examples:
  oomprobe diagnose --model gpt2 --seq 16384 --attention eager --memory 40GiB
  oomprobe diagnose --model qwen2.5-7b --seq 4096 --memory 24GiB
  oomprobe diagnose --config cases/llama13b-full-training-80gb.toml --json
  oomprobe diagnose --snapshot snap.pickle
  oomprobe diagnose --snapshot snap.pickle --memory 24GiB
  oomprobe diagnose --oom -       # in a pipe: python train.py 2>&1 | oomprobe diagnose --oom -
  oomprobe diagnose --oom train.log   # every OOM message in a log: its figures and cause
  oomprobe diagnose --oom train.log --model gpt2 --batch 16 --json";

pub const COMPARE: &str = "\
Examples:
  oomprobe compare a100.json h100.json
  oomprobe compare runs/*.json --format html --out fleet.html";

pub const COMPLETIONS: &str = "\
Examples:
  oomprobe completions bash > ~/.local/share/bash-completion/completions/oomprobe
  oomprobe completions zsh > ~/.zfunc/_oomprobe
  oomprobe completions fish > ~/.config/fish/completions/oomprobe.fish";

pub const MAN: &str = "\
Examples:
  oomprobe man > oomprobe.1 && man ./oomprobe.1
  oomprobe man --dir /usr/local/share/man/man1    # a page per command";

/// Every example command line above, without its comment (for tests and docs).
pub fn example_lines() -> Vec<&'static str> {
    [
        DEVICES,
        ESTIMATE,
        PROBE,
        DIAGNOSE,
        COMPARE,
        COMPLETIONS,
        MAN,
    ]
    .iter()
    .flat_map(|text| text.lines().skip(1))
    .map(|l| {
        let l = l.split(" # ").next().unwrap_or(l);
        let l = l.split(" > ").next().unwrap_or(l);
        l.split(" && ").next().unwrap_or(l).trim()
    })
    .collect()
}
