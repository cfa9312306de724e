//! Transformer plans (GPT-2, BERT, LLaMA, ViT) per Korthikanti et al. generalized to the element size.
