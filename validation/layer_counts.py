#!/usr/bin/env python3
"""Exact per-layer parameter counts that transformers gives for config files.

Run it (no network, no GPU: every model is built on the meta device, so nothing is allocated and
nothing is fetched from the Hugging Face Hub):

    "$HOME/.cache/oomprobe-validation-venv/bin/python" validation/layer_counts.py

It reads
  1. tests/fixtures/configs/*.json (all but param_counts*.json and layer_counts*.json),
  2. tests/fixtures/configs/holdout/*.json,
  3. transformers' default config of each model type in DEFAULT_TYPES (the config class built
     with no arguments, AutoConfig.for_model(t)),
and writes
  tests/fixtures/configs/layer_counts.json          {"configs": {...}, "defaults": {...}}
  tests/fixtures/configs/holdout/layer_counts.json  {"configs": {...}}   (holdout only)
  tests/fixtures/configs/defaults/<model_type>.json config.to_dict() of each default config,
                                                    readable as a config.json.

A config with text_config (multimodal wrapper: gemma3, llama4, mistral3, qwen3_5, gemma4, ...)
is built as the full model (the class in "architectures", else AutoModelForImageTextToText,
else AutoModelForCausalLM, else AutoModel) so the vision tower and projector are counted, and
its text config is also built alone as a CausalLM ("text_alone_params"). A config that fails
to build gets {"error": "..."} instead of counts. See NOTES for the counting rules.
"""
import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM,
                          AutoModelForImageTextToText)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "tests" / "fixtures" / "configs"
HOLDOUT_DIR = CONFIG_DIR / "holdout"
DEFAULTS_DIR = CONFIG_DIR / "defaults"
OUT = CONFIG_DIR / "layer_counts.json"
OUT_HOLDOUT = HOLDOUT_DIR / "layer_counts.json"
BUILD_TIMEOUT_S = 20

DEFAULT_TYPES = [
    "deepseek_v3", "deepseek_v2", "glm4_moe", "glm_moe_dsa", "gpt_oss", "llama4", "llama4_text",
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h",
    "bamba", "mamba2", "granitemoehybrid", "granitemoe", "granitemoeshared", "granite", "gemma3",
    "gemma3_text", "gemma4", "gemma4_text", "olmo2", "olmo3", "cohere", "cohere2", "minimax_m2",
    "mistral3", "ministral3", "ministral", "smollm3", "falcon_h1", "jamba",
]

# model_type values that are not transformers types, and the type they are built as.
TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}

NOTES = (
    "params = sum(p.numel() for p in model.parameters()) of the full model (a tied tensor once). "
    "text_params = the language model inside it (the submodule named *language_model, else the "
    "whole model) plus lm_head when lm_head is neither tied nor inside it; "
    "vision_params = params - text_params "
    "(vision tower + projector; 0 for text-only). text_alone_params = the text config built alone "
    "with AutoModelForCausalLM (multimodal only). embed = get_input_embeddings().weight; "
    "lm_head = get_output_embeddings().weight, 0 when it is the same tensor as embed (tied). "
    "final_norm = parameters of the *Norm* children of the module that holds the decoder layers. "
    "other = text_params - embed - lm_head - final_norm - sum(layers.params) (e.g. extra "
    "embeddings). layers = the nn.ModuleList of decoder layers (the 'layers' ModuleList with the "
    "most parameters inside the language model); each layer's direct children with parameters "
    "are classified by class name: 'Norm' -> norms; 'Attention'/'Mamba'/'DeltaNet'/'Mixer' -> "
    "mixer; 'MLP'/'MoE'/'Moe'/'Experts'/'FeedForward' -> mlp (checked in that order, so "
    "GraniteMoeAttention is a mixer and GraniteMoeRMSNorm a norm); norms = layer params - mixer "
    "- mlp (so it also holds any unclassified child or direct parameter, listed in "
    "'other_children'). A layer with two mixers (falcon_h1: mamba + self_attn) sums them and "
    "joins the class names with '+'. active_params = params - sum over layers of "
    "(num_experts - top_k) * routed_experts / num_experts, where routed_experts = params of the "
    "submodule named 'experts' in the layer (stacked expert weights or a ModuleList; shared "
    "experts and the router are outside it and count as active), num_experts = the experts "
    "module's num_experts attribute, else len() of a ModuleList, else the first dim of its first "
    "parameter; top_k = the text config's num_experts_per_tok / top_k / moe_topk / "
    "num_experts_per_token (when the config has none, e.g. the default deepseek_v2 config, the "
    "experts count as all active). buffers_not_counted = persistent buffers (in state_dict, not in "
    "parameters()) of layer 0 and of the first layer of each distinct (mixer_class, mlp_class) "
    "kind, keyed 'layerN', name -> numel; persistent_buffers_total = numel of every persistent "
    "buffer of the full model. MTP / next-n layers (deepseek num_nextn_predict_layers) are not "
    "built by transformers and not counted. Configs are built with "
    "CONFIG_MAPPING[model_type].from_dict(raw), as AutoConfig.from_pretrained does; kimi_k2 is "
    "built as deepseek_v3."
)


class BuildTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise BuildTimeout(f"timed out after {BUILD_TIMEOUT_S} s")


def jsonable(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if hasattr(v, "to_dict"):
        try:
            return jsonable(v.to_dict())
        except Exception:
            pass
    return repr(v)


def count(module):
    return sum(p.numel() for p in module.parameters())


def is_multimodal(cfg):
    sub = getattr(cfg, "sub_configs", None) or {}
    return "text_config" in sub or getattr(cfg, "text_config", None) is not None


def text_config_of(cfg):
    tc = getattr(cfg, "text_config", None)
    return tc if tc is not None else cfg


def make_config(raw):
    """(config, note). kimi_k2 -> deepseek_v3. A multimodal config (with text_config) whose
    top-level model_type is not the config type of its architectures class (e.g. a converted
    Mistral3ForConditionalGeneration config labelled "ministral3") is built with that class's
    config type instead, and the note says so."""
    d = dict(raw)
    note = None
    mt = d.get("model_type")
    if mt in TYPE_ALIASES:
        d["model_type"] = TYPE_ALIASES[mt]
        note = f"model_type {mt} is not a transformers type; built as {d['model_type']}"
        mt = d["model_type"]
    if "text_config" in d:
        for arch in d.get("architectures") or []:
            klass = getattr(transformers, arch, None)
            arch_type = getattr(getattr(klass, "config_class", None), "model_type", None)
            if arch_type and arch_type != mt and arch_type in CONFIG_MAPPING:
                note = (f"top-level model_type {mt!r} is not the config type of {arch} "
                        f"({arch_type!r}); built with model_type {arch_type!r}")
                d["model_type"] = mt = arch_type
                break
    return CONFIG_MAPPING[mt].from_dict(d), note


def build_full(cfg):
    """The full model: architectures class, else image-text-to-text, else causal LM, else base."""
    tried = []
    for arch in (getattr(cfg, "architectures", None) or []):
        klass = getattr(transformers, arch, None)
        if klass is None:
            tried.append(f"{arch}: not in transformers")
            continue
        try:
            with torch.device("meta"):
                return klass._from_config(cfg)
        except Exception as e:  # noqa: BLE001
            tried.append(f"{arch}: {type(e).__name__}: {e}")
    autos = ([AutoModelForImageTextToText, AutoModelForCausalLM, AutoModel] if is_multimodal(cfg)
             else [AutoModelForCausalLM, AutoModel])
    for auto in autos:
        try:
            with torch.device("meta"):
                return auto.from_config(cfg)
        except Exception as e:  # noqa: BLE001
            tried.append(f"{auto.__name__}: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(tried))


def find_named(model, suffix):
    for name, mod in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            return name, mod
    return None, None


def find_layers(root):
    """(path, ModuleList) of the decoder layers: the 'layers' ModuleList with most params."""
    best = None
    for name, mod in root.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            key = (name.split(".")[-1] == "layers", count(mod))
            if best is None or key > best[0]:
                best = (key, name, mod)
    if best is None:
        raise RuntimeError("no ModuleList of layers found")
    return best[1], best[2]


def classify(cls_name):
    if "Norm" in cls_name:
        return "norms"
    if any(s in cls_name for s in ("Attention", "Mamba", "DeltaNet", "Mixer")):
        return "mixer"
    if any(s in cls_name for s in ("MLP", "MoE", "Moe", "Experts", "FeedForward")):
        return "mlp"
    return None


def persistent_buffers(module):
    out = {}
    for mname, mod in module.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is None or bname in mod._non_persistent_buffers_set:
                continue
            out[f"{mname}.{bname}" if mname else bname] = buf.numel()
    return out


def num_experts_of(experts, tcfg):
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(experts, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(tcfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    p = next(experts.parameters(), None)
    return p.shape[0] if p is not None and p.dim() >= 1 else None


def top_k_of(tcfg):
    for attr in ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token"):
        v = getattr(tcfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v, attr
    return None, None


def analyse_layer(layer, tcfg):
    parts = {"mixer": 0, "mlp": 0}
    classes = {"mixer": [], "mlp": []}
    other = {}
    for name, child in layer.named_children():
        n = count(child)
        if n == 0:
            continue
        kind = classify(type(child).__name__)
        if kind in parts:
            parts[kind] += n
            classes[kind].append(type(child).__name__)
        elif kind is None:
            other[name] = {"class": type(child).__name__, "params": n}
    direct = sum(p.numel() for p in layer.parameters(recurse=False))
    if direct:
        other["(direct parameters)"] = {"class": None, "params": direct}
    total = count(layer)
    entry = {
        "params": total,
        "mixer": parts["mixer"],
        "mlp": parts["mlp"],
        "norms": total - parts["mixer"] - parts["mlp"],
        "mixer_class": "+".join(classes["mixer"]) or None,
        "mlp_class": "+".join(classes["mlp"]) or None,
    }
    if other:
        entry["other_children"] = other
    ename, experts = find_named(layer, "experts")
    inactive = 0
    if experts is not None:
        ne = num_experts_of(experts, tcfg)
        k, _ = top_k_of(tcfg)
        routed = count(experts)
        entry["routed_experts"] = {"path": ename, "params": routed, "num_experts": ne, "top_k": k}
        if not k:
            entry["routed_experts"]["note"] = "no top_k in the config: counted as all active"
        if ne and k:
            inactive = (ne - k) * routed // ne
            if (ne - k) * routed % ne:
                entry["routed_experts"]["inexact_division"] = True
    return entry, inactive


def analyse(cfg, model, text_alone=None):
    tcfg = text_config_of(cfg)
    params = count(model)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    lm_head = 0 if (out is None or tied) else out.weight.numel()
    lm_name, lm = find_named(model, "language_model")
    if lm is not None and count(lm) > 0:
        inside = out is not None and any(q is out.weight for q in lm.parameters())
        text_root, text_params = lm, count(lm) + (0 if inside else lm_head)
    else:
        text_root, text_params = model, params
    layers_path, layers = find_layers(text_root)
    # the module holding the layers: its *Norm* children are the final norm
    holder = text_root
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    if parent_path:
        holder = text_root.get_submodule(parent_path)
    final_norm = sum(count(c) for c in holder.children() if "Norm" in type(c).__name__)
    layer_entries, inactive_total, kinds = [], 0, {}
    for i, layer in enumerate(layers):
        e, inactive = analyse_layer(layer, tcfg)
        layer_entries.append(e)
        inactive_total += inactive
        kinds.setdefault((e["mixer_class"], e["mlp_class"]), i)
    rep = sorted(set([0] + list(kinds.values())))
    shapes = {f"layer{i}": {n: list(p.shape) for n, p in layers[i].named_parameters()}
              for i in rep}
    buffers = {f"layer{i}": persistent_buffers(layers[i]) for i in rep}
    layers_sum = sum(e["params"] for e in layer_entries)
    has_experts = any("routed_experts" in e for e in layer_entries)
    k, k_attr = top_k_of(tcfg) if has_experts else (None, None)
    entry = {
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "params": params,
        "text_params": text_params,
        "vision_params": params - text_params,
        "active_params": params - inactive_total,
        "embed": emb.numel(),
        "lm_head": lm_head,
        "tied": tied,
        "final_norm": final_norm,
        "other": text_params - emb.numel() - lm_head - final_norm - layers_sum,
        "num_layers": len(layers),
        "layers_path": (f"{lm_name}.{layers_path}" if lm is not None and text_root is lm
                        else layers_path),
        "top_k": k,
        "top_k_attr": k_attr if has_experts else None,
        "layer_kinds": {f"{a}|{b}": i for (a, b), i in kinds.items()},
        "buffers_not_counted": buffers,
        "persistent_buffers_total": sum(persistent_buffers(model).values()),
        "layers": layer_entries,
        "layer0_param_shapes": shapes,
    }
    if text_alone is not None:
        entry.update(text_alone)
    return entry


def build_and_analyse(raw):
    """raw: a config dict (or a config object). Returns the record or {"error": ...}."""
    t0 = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(BUILD_TIMEOUT_S)
    try:
        cfg, note = (raw, None) if not isinstance(raw, dict) else make_config(raw)
        model = build_full(cfg)
        text_alone = None
        if is_multimodal(cfg):
            try:
                with torch.device("meta"):
                    tm = AutoModelForCausalLM.from_config(text_config_of(cfg))
                text_alone = {"text_alone_class": type(tm).__name__,
                              "text_alone_params": count(tm)}
                del tm
            except Exception as e:  # noqa: BLE001
                text_alone = {"text_alone_error": f"{type(e).__name__}: {e}"}
        entry = analyse(cfg, model, text_alone)
        if note:
            entry["note"] = note
        del model
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        entry = {"error": f"{type(e).__name__}: {e}{where}"[:2000]}
        if isinstance(raw, dict):
            entry["model_type"] = raw.get("model_type")
    finally:
        signal.alarm(0)
    entry["build_seconds"] = round(time.time() - t0, 2)
    return entry


def show(name, e):
    if "error" in e:
        print(f"{name:28s} ERROR {e['error'][:160]}", flush=True)
    else:
        print(f"{name:28s} {e['model_type']:18s} {e['class']:40s} params={e['params']:>16,d} "
              f"active={e['active_params']:>16,d} vision={e['vision_params']:>14,d} "
              f"({e['build_seconds']} s)", flush=True)


def run_dir(d):
    results = {}
    for path in sorted(d.glob("*.json")):
        if path.name.startswith(("param_counts", "layer_counts")):
            continue
        raw = json.loads(path.read_text())
        e = build_and_analyse(raw)
        results[path.stem] = e
        show(path.stem, e)
    return results


def run_defaults():
    DEFAULTS_DIR.mkdir(exist_ok=True)
    results = {}
    for t in DEFAULT_TYPES:
        try:
            cfg = AutoConfig.for_model(t)
        except Exception as e:  # noqa: BLE001
            results[t] = {"model_type": t, "error": f"config: {type(e).__name__}: {e}"}
            show(t, results[t])
            continue
        d = jsonable(cfg.to_dict())
        (DEFAULTS_DIR / f"{t}.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
        e = build_and_analyse(cfg)
        e["config_file"] = f"tests/fixtures/configs/defaults/{t}.json"
        results[t] = e
        show(t, e)
    return results


def header():
    return {
        "generated_by": "validation/layer_counts.py",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "notes": NOTES,
    }


def dump(path, doc):
    # Infinity/NaN (allowed by json.dumps) can appear in config-derived values; the fixtures
    # already contain them.
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path.relative_to(REPO)}", flush=True)


def main():
    only = set(sys.argv[1:])  # optional: "holdout" (holdout only) or "configs" (main file only)
    if not only or "holdout" in only:
        dump(OUT_HOLDOUT, {**header(), "configs": run_dir(HOLDOUT_DIR)})
    if not only or "configs" in only:
        doc = {**header(), "configs": run_dir(CONFIG_DIR), "defaults": run_defaults()}
        dump(OUT, doc)


if __name__ == "__main__":
    main()
