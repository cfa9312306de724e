//! The workload's command-line arguments (`--model`, `--batch`, the layout and serving flags), as
//! strings: what a case file's `[workload]` table and `[[expect]]` runs hold too. Parsing them into a
//! Workload is `overrides`'s job.

use std::path::PathBuf;

use clap::Args;

/// The workload: a preset or config file plus overrides.
#[derive(Debug, Args, Clone, Default, PartialEq, Eq)]
pub struct WorkloadArgs {
    /// A preset (gpt2 gpt2-medium gpt2-large gpt2-xl bert-base bert-large vit-b16 vit-l16
    /// llama-7b llama-13b llama3-8b mistral-7b qwen2.5-7b qwen2.5-0.5b mixtral-8x7b gemma2-9b
    /// phi3-mini resnet50, plus tiny-gpt, tiny-cnn for tests), a Hugging Face model id
    /// (ORG/NAME, read offline from the local Hugging Face cache) or a folder with a config.json.
    #[arg(long, value_name = "NAME", allow_hyphen_values = true)]
    pub model: Option<String>,
    /// A Hugging Face config.json, or an oomprobe TOML case file.
    #[arg(long, value_name = "FILE", allow_hyphen_values = true)]
    pub config: Option<PathBuf>,
    /// With --model ORG/NAME: the cached revision (a branch, tag or commit) to read.
    #[arg(long, value_name = "REV", allow_hyphen_values = true)]
    pub revision: Option<String>,
    /// Samples per step (the batch size).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub batch: Option<String>,
    /// Tokens per sample (the sequence length; text models).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub seq: Option<String>,
    /// Transformer layers (ResNet: its depth, 14 26 50 101 152).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub layers: Option<String>,
    /// Hidden size (ResNet: the stem width).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub hidden: Option<String>,
    /// Attention (query) heads.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub heads: Option<String>,
    /// The MLP's width (intermediate_size; a mixture of experts: each expert's).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub ffn: Option<String>,
    /// Vocabulary size (classes for ViT and ResNet).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub vocab: Option<String>,
    /// Image side in pixels (ViT, ResNet).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub image: Option<String>,
    /// A plain parameter count for the params scenario, e.g. 7e9 or 7B.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub params: Option<String>,
    /// fp32 | fp16 | bf16 (model.half()/bfloat16()) | mixed (DeepSpeed/Megatron fp16: fp16
    /// weights, fp32 master + Adam) | amp-fp16 | amp-bf16 (torch.autocast: fp32 states).
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pub precision: Option<String>,
    /// adam | sgd | sgd-momentum | none (none = inference: weights only).
    #[arg(long, value_name = "O", allow_hyphen_values = true)]
    pub optimizer: Option<String>,
    /// eager (naive) | sdpa | flash: transformers' attn_implementation (default sdpa, as
    /// transformers picks; eager for Gemma 2).
    #[arg(long, value_name = "A", allow_hyphen_values = true)]
    pub attention: Option<String>,
    /// Key/value heads (grouped-query attention; 1 is multi-query). Default: the model's.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub kv_heads: Option<String>,
    /// Routed experts per layer of a mixture of experts (Mixtral, Qwen-MoE); `--ffn` sets each
    /// expert's width there.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub experts: Option<String>,
    /// Experts each token is routed to (top-k).
    #[arg(long, value_name = "K", allow_hyphen_values = true)]
    pub experts_per_token: Option<String>,
    /// cuda | cpu: whose autocast op lists and attention kernels the plan follows (cpu to
    /// compare with a run on the CPU).
    #[arg(long, value_name = "D", allow_hyphen_values = true)]
    pub autocast_device: Option<String>,
    /// none | full | sqrt | every:K | ops (torchtitan's op-level selective checkpointing: each
    /// layer checkpointed, its odd matmuls' and its attention kernel's outputs kept)
    #[arg(long, value_name = "C", allow_hyphen_values = true)]
    pub checkpoint: Option<String>,
    /// on | off: dropout masks stored for the backward pass.
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub dropout: Option<String>,
    /// ZeRO stage 0..3: per-device share of model states.
    #[arg(long, value_name = "STAGE", allow_hyphen_values = true)]
    pub zero: Option<String>,
    /// GPUs the job runs on (the world size: data-parallel × tp × pp × cp).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub gpus: Option<String>,
    /// train | inference (a forward under no_grad: weights, one layer's intermediates, outputs)
    /// | serve (a serving engine's KV cache: see --engine).
    #[arg(long, value_name = "M", allow_hyphen_values = true)]
    pub mode: Option<String>,
    /// free | keep | until-backward: gradients freed by zero_grad(set_to_none=True) after the
    /// step (PyTorch's default), kept between steps (gradient accumulation), or kept until the
    /// next backward begins (Lightning's closure: forward, zero_grad, backward).
    #[arg(long, value_name = "G", allow_hyphen_values = true)]
    pub grads: Option<String>,
    /// bool | input: what a dropout saves: native_dropout's 1-byte mask (CUDA) or the CPU's
    /// noise tensor in the input's type.
    #[arg(long, value_name = "M", allow_hyphen_values = true)]
    pub dropout_mask: Option<String>,
    /// kept | dropped | next: the loop holds the model's outputs (logits) until backward is
    /// done (`out = model(**batch)`), only the loss leaves the step (HF Trainer, Lightning), or
    /// the outputs and their graph live until the next step's forward returns (LitGPT's
    /// `logits = model(...)`).
    #[arg(long, value_name = "O", allow_hyphen_values = true)]
    pub outputs: Option<String>,
    /// steady | first: a steady-state step (optimizer state present) or the first step.
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    pub step: Option<String>,
    /// foreach | fused | for-loop | transformers: the optimizer implementation (its
    /// temporaries; transformers: its own AdamW, `optim="adamw_hf"`, one temporary).
    #[arg(long, value_name = "I", allow_hyphen_values = true)]
    pub optimizer_impl: Option<String>,
    /// on | off: torchtune's optimizer_in_bwd: each parameter's update runs in the backward, as
    /// soon as its gradient is made, and frees that gradient.
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub optimizer_in_backward: Option<String>,
    /// off | tensorwise | tensorwise-all-gather | rowwise: torchao's float8 training of the
    /// decoder layers' linears (tensorwise-all-gather: FSDP2 gathers their weights in float8).
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    pub float8: Option<String>,
    /// N: LitGPT's chunked head and loss (`lm_head_chunk_size=N`, `chunked_cross_entropy`):
    /// the logits in N-token chunks, handed to the loop in fp32 by Fabric's bf16-true, each
    /// chunk's cross-entropy over them with no further copy; 0 (the default): one head,
    /// transformers' loss.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub loss_chunk: Option<String>,
    /// X.Y: the PyTorch release the job runs (e.g. 1.10): where it kept more than today's, the
    /// plan follows it. Before 1.11 softmax saves its input too; before 2.0 zero_grad() keeps
    /// gradients (--grads keep), cuBLAS's workspace is outside PyTorch's pool and there is no
    /// SDPA (eager attention); before 1.13 kernels load eagerly (--cuda-modules eager); unless
    /// those flags are given [today's release].
    #[arg(long, value_name = "X.Y", allow_hyphen_values = true)]
    pub torch_version: Option<String>,
    /// on | off: BERT's eager attention adds a mask to the scores (transformers before 5
    /// always did; padded batches do), in the embeddings' type: under autocast the softmax
    /// reads fp32 [off].
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub attention_mask: Option<String>,
    /// mlm | seq-cls: BERT's head. seq-cls: transformers' BertForSequenceClassification (the
    /// pooler's dense and tanh over the first token, dropout and a classifier over
    /// --num-labels labels) in place of the masked-LM head [mlm; seq-cls where a config names
    /// BertForSequenceClassification].
    #[arg(long, value_name = "H", allow_hyphen_values = true)]
    pub head: Option<String>,
    /// N: the classifier's labels under --head seq-cls [a config's id2label, else 2, as
    /// transformers' num_labels].
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    pub num_labels: Option<String>,
    /// transformers | litgpt: whose model classes and LoRA build a decoder LLM's step
    /// [transformers + PEFT]. litgpt: LitGPT's GPT (fused qkv; k and v expanded to every head)
    /// and its LoRA (adapters in the model's type), with its fine-tuning scripts' defaults
    /// unless given: --loss-chunk 128, --outputs next, --kv-cache off, and under --quant
    /// --kbit-prep off, --quant-head on, --double-quant off (its bnb.nf4) and 4-bit weights
    /// quantized from fp16 (Lightning Fabric's: each dequantization makes an fp16 copy, then
    /// the bf16 one).
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    pub framework: Option<String>,
    /// SIZE: cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG's total, e.g. 32MiB; 0: none)
    /// [PyTorch's default: 8 MiB + 128 KiB, 32 MiB on a Hopper --gpu], allocated through the
    /// caching allocator at the first matmul and kept.
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub cublas_workspace: Option<String>,
    /// lazy | eager: how the CUDA stack loads its kernels (CUDA_MODULE_LOADING); eager (PyTorch
    /// before 1.13, CUDA before 11.7) holds about 1 GiB more outside PyTorch on a --gpu card.
    #[arg(long, value_name = "lazy|eager", allow_hyphen_values = true)]
    pub cuda_modules: Option<String>,
    /// fused | unfused: GELU as one op, or Hugging Face's gelu_new formula in separate ops.
    #[arg(long, value_name = "G", allow_hyphen_values = true)]
    pub gelu: Option<String>,
    /// on | off: Hugging Face's use_cache (each decoder layer's key and value kept).
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub kv_cache: Option<String>,
    /// LoRA rank r: PEFT adapters on a frozen base (only they train).
    #[arg(long, value_name = "R", allow_hyphen_values = true)]
    pub lora: Option<String>,
    /// q,k,v,o,gate,up,down (PEFT's module names, `_proj` optional) or all-linear [q,v].
    #[arg(long, value_name = "LIST", allow_hyphen_values = true)]
    pub lora_targets: Option<String>,
    /// lora_alpha: a scale only, no memory effect.
    #[arg(long, value_name = "A", allow_hyphen_values = true)]
    pub lora_alpha: Option<String>,
    /// lora_dropout P: above 0, each adapter keeps a dropped copy of its input and a mask.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pub lora_dropout: Option<String>,
    /// nf4 | fp4 | int8: a bitsandbytes-quantized frozen base (QLoRA with nf4).
    #[arg(long, value_name = "Q", allow_hyphen_values = true)]
    pub quant: Option<String>,
    /// on | off: bnb_4bit_use_double_quant [on with --quant nf4|fp4, as QLoRA recipes set it].
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub double_quant: Option<String>,
    /// bf16 | fp16 | fp32: bnb_4bit_compute_dtype [the precision's 16-bit type, fp32 for fp32].
    #[arg(long, value_name = "T", allow_hyphen_values = true)]
    pub quant_compute: Option<String>,
    /// X.Y[.Z]: the bitsandbytes version [0.44 or later]; before 0.44 each 4-bit linear keeps
    /// its input on the autograd context (`ctx.tensors`) for as long as the graph lives.
    #[arg(long, value_name = "VER", allow_hyphen_values = true)]
    pub bnb_version: Option<String>,
    /// on | off: the output head quantized too [off, as transformers loads it]; on as Lightning
    /// Fabric's BitsandbytesPrecision (LitGPT) converts every nn.Linear.
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub quant_head: Option<String>,
    /// on | off: PEFT's prepare_model_for_kbit_training (non-4-bit params in fp32,
    /// checkpointing) [on]; off as LitGPT and torchtune train a 4-bit base.
    #[arg(long, value_name = "on|off", allow_hyphen_values = true)]
    pub kbit_prep: Option<String>,
    #[command(flatten)]
    pub serve: super::serve::ServeArgs,
    #[command(flatten)]
    pub parallel: super::parallel::ParallelArgs,
}

/// `over`'s fields where set, else `base`'s.
pub fn merge(base: &WorkloadArgs, over: &WorkloadArgs) -> WorkloadArgs {
    macro_rules! pick {
        ($($f:ident),*) => { WorkloadArgs { $($f: over.$f.clone().or_else(|| base.$f.clone()),)* serve: super::serve::merge(&base.serve, &over.serve), parallel: super::parallel::ParallelArgs::merge(&base.parallel, &over.parallel) } };
    }
    pick!(
        model,
        config,
        revision,
        batch,
        seq,
        layers,
        hidden,
        heads,
        ffn,
        vocab,
        image,
        params,
        precision,
        optimizer,
        attention,
        checkpoint,
        dropout,
        zero,
        gpus,
        mode,
        grads,
        outputs,
        dropout_mask,
        step,
        optimizer_impl,
        optimizer_in_backward,
        float8,
        loss_chunk,
        torch_version,
        attention_mask,
        head,
        num_labels,
        framework,
        cublas_workspace,
        cuda_modules,
        gelu,
        kv_cache,
        kv_heads,
        experts,
        experts_per_token,
        autocast_device,
        lora,
        lora_targets,
        lora_alpha,
        lora_dropout,
        quant,
        double_quant,
        quant_compute,
        bnb_version,
        quant_head,
        kbit_prep
    )
}
