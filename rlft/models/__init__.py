"""Models: where a run's model comes from and how it is read.

    loading.py  model paths (hub id, HF directory, .gguf, the offline default), checks, conversion of a
                GGUF file once into a cached HF directory, tokenizers
    gguf.py     reading a GGUF file once, fast: its config, tokenizer and weights
    families.py model families as records (embedding scale, rotary tables, final norm, logit transforms,
                tied embeddings, weight names, LoRA targets, vLLM); MODEL_FAMILIES, register_model_family
"""
