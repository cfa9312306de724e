#!/usr/bin/env python3
"""Exact parameter counts of the real Hugging Face configs in tests/fixtures/configs/.

For every <name>.json there, builds the model with transformers on the meta device (no memory,
no download), counts its parameters and writes tests/fixtures/configs/param_counts.json.

    "$HOME/.cache/oomprobe-validation-venv/bin/python" validation/param_counts.py

Counting rules:
  params    sum(p.numel() for p in model.parameters()); parameters() yields a tied tensor once,
            so a tied lm_head is not counted twice.
  embed     elements of the input embedding (model.get_input_embeddings()).
  lm_head   elements of the output projection, 0 when it is the same tensor as the embedding.
  layer0    decoder layer 0: "attn" = its self_attn module (q/k/v/o or fused qkv, biases,
            q_norm/k_norm), "mlp" = its mlp / block_sparse_moe module (experts, router gate,
            shared expert and its gate), "norms" = every parameter of the layer outside those two.
A multimodal config (one with text_config, e.g. model_type "gemma3") is reduced to its text
config and built as the text-only CausalLM; the JSON says so in "note".
"""
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "tests" / "fixtures" / "configs"
OUT = CONFIG_DIR / "param_counts.json"

# Counts the model card / paper / release post states, with where it says so.
PUBLISHED = {
    # Recalled from the model cards / papers named, not fetched in this run (no network here),
    # except qwen2.5-0.5b, whose card text was seen quoted in a public repository. The "HF
    # safetensors" figures are the hub's displayed parameter count for that repository.
    "llama3-8b": "8.03B (meta-llama/Llama-3.1-8B, HF safetensors count; Meta's card says 8B)",
    "mistral-7b": "7.25B (mistralai/Mistral-7B-v0.3, HF safetensors count; Mistral 7B paper "
                  "arXiv:2310.06825 says 7B)",
    "qwen2.5-7b": "7.61B total, 6.53B non-embedding (Qwen/Qwen2.5-7B model card)",
    "qwen2.5-0.5b": "0.49B total, 0.36B non-embedding (Qwen/Qwen2.5-0.5B model card)",
    "mixtral-8x7b": "46.7B total, 12.9B active per token (Mistral AI 'Mixtral of experts' post; "
                    "arXiv:2401.04088 says 47B total, 13B active)",
    "gemma2-9b": "9.24B (google/gemma-2-9b, HF safetensors count; Gemma 2 report "
                 "arXiv:2408.00118 table 2: 917,504,000 embedding + 8,324,201,984 non-embedding)",
    "gemma-2b": "2.51B (google/gemma-2b, HF safetensors count; Gemma report arXiv:2403.08295 "
                "table 2: 1,981,884,416 non-embedding)",
    "gemma3-1b": "1B (google/gemma-3-1b-it model card); Gemma 3 report arXiv:2503.19786 "
                 "table 1: 302M embedding + 698M non-embedding",
    "phi3-mini": "3.8B (microsoft/Phi-3-mini-4k-instruct model card; arXiv:2404.14219)",
    "qwen3-8b": "8.2B total, 6.95B non-embedding (Qwen/Qwen3-8B model card)",
    "qwen3-30b-a3b": "30.5B total, 3.3B activated, 29.9B non-embedding (Qwen/Qwen3-30B-A3B "
                     "model card)",
    "qwen1.5-moe-a2.7b": "14.3B total, 2.7B activated (Qwen/Qwen1.5-MoE-A2.7B model card and "
                         "Qwen blog 'Qwen1.5-MoE')",
}

# The config attributes transformers' modeling code reads for shapes, reported with the value
# the built config has (absent attributes are left out).
SHAPE_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias", "qkv_bias",
    "mlp_bias",
    "tie_word_embeddings", "num_local_experts", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers", "norm_topk_prob", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
    "query_pre_attn_scalar", "hidden_act", "hidden_activation", "torch_dtype", "dtype",
]


def jsonable(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def count(module):
    return sum(p.numel() for p in module.parameters())


def build(name, raw):
    note = None
    cfg_dict = dict(raw)
    if "text_config" in cfg_dict and cfg_dict.get("model_type") in ("gemma3",):
        cfg_dict = dict(cfg_dict["text_config"])
        cfg_dict.setdefault("model_type", "gemma3_text")
        note = "multimodal config: text_config only, built as Gemma3ForCausalLM (no vision tower)"
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return cfg, model, note


def layer0_split(model):
    layers = model.model.layers
    l0 = layers[0]
    attn = count(l0.self_attn)
    mlp_mod = getattr(l0, "mlp", None) or getattr(l0, "block_sparse_moe", None)
    mlp = count(mlp_mod) if mlp_mod is not None else 0
    norms = count(l0) - attn - mlp
    shapes = {n: list(p.shape) for n, p in sorted(l0.named_parameters())}
    return {"attn": attn, "mlp": mlp, "norms": norms, "class": type(l0).__name__,
            "mlp_class": type(mlp_mod).__name__ if mlp_mod is not None else None,
            "param_shapes": shapes}


def layer_kinds(model):
    """Distinct (attn, mlp, norms) per layer, with the layer indices that have each."""
    kinds = {}
    for i, layer in enumerate(model.model.layers):
        attn = count(layer.self_attn)
        mlp_mod = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        mlp = count(mlp_mod) if mlp_mod is not None else 0
        key = (attn, mlp, count(layer) - attn - mlp, type(mlp_mod).__name__)
        kinds.setdefault(key, []).append(i)
    return [{"attn": k[0], "mlp": k[1], "norms": k[2], "mlp_class": k[3], "layers": v}
            for k, v in kinds.items()]


def main():
    results = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        if path.name == OUT.name:
            continue
        name = path.stem
        raw = json.loads(path.read_text())
        cfg, model, note = build(name, raw)
        params = count(model)
        emb = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        tied = out is not None and out.weight is emb
        lm_head = 0 if (out is None or tied) else out.weight.numel()
        final_norm = count(model.model.norm) if hasattr(model.model, "norm") else 0
        layers_total = sum(count(l) for l in model.model.layers)
        other = params - emb.numel() - lm_head - final_norm - layers_total
        entry = {
            "model_type": cfg.model_type,
            "class": type(model).__name__,
            "params": params,
            "embed": emb.numel(),
            "lm_head": lm_head,
            "tied": tied,
            "final_norm": final_norm,
            "layers_total": layers_total,
            "other": other,
            "layer0": layer0_split(model),
            "layer_kinds": layer_kinds(model),
            "published": PUBLISHED.get(name, "not recorded"),
            "config_keys": {k: jsonable(getattr(cfg, k)) for k in SHAPE_KEYS if hasattr(cfg, k)},
            "raw_config_keys_absent_in_built_config": sorted(
                k for k in raw if not hasattr(cfg, k)),
        }
        if note:
            entry["note"] = note
        results[name] = entry
        print(f"{name:20s} {type(model).__name__:28s} params={params:>14,d} "
              f"embed={emb.numel():>12,d} lm_head={lm_head:>12,d}", flush=True)
        del model
    doc = {
        "generated_by": "validation/param_counts.py",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "models": results,
    }
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
