"""Tiny chat models taught whole tool episodes, for the tests of evaluation and training with tools.

    model = tiny_tool_model(root)                      # Qwen2.5's chat template over a ~1k-token BPE
    rows = [script_episode(env, tok, "What is 3 plus 4?", [CALL.format("3 + 4"), "\\\\boxed{7}"])]
    teach_episodes(model, rows, steps=150)             # fits the model's turns, not the tool's replies

An episode is scripted as the model's turns; the environment's own ``step`` answers each turn but the
last, and its replies go in as the chat template's tokens (``reply_token_ids``), exactly as
``run_episodes`` inserts them.  The last turn ends with eos (``<|im_end|>``).
"""
from __future__ import annotations

import copy
from pathlib import Path

from tiny_models import tiny_chat_tokenizer_dir, tiny_model_dir

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def tiny_tool_model(root: Path, num_layers: int = 2, seed: int = 0) -> str:
    """A tiny random Llama over :func:`tiny_models.tiny_chat_tokenizer_dir` (written under ``root``).  A
    Llama, since transformers loads the tokenizer of a ``qwen2`` model as Qwen2's, with Qwen's own
    pre-tokenizer, which the tiny vocabulary was not trained for."""
    tokenizer = tiny_chat_tokenizer_dir(Path(root) / "tokenizer")
    return tiny_model_dir(Path(root) / "model", family="llama", num_layers=num_layers, seed=seed,
                          tokenizer_dir=tokenizer)


def script_episode(env, tok, question: str, turns: list[str], ground_truth: str = "0"):
    """``(prompt_ids, response_ids, response_mask)`` of an episode of ``env`` on ``question`` in which the
    model writes ``turns`` (the environment answers every turn but the last)."""
    from rlft.envs.episodes import reply_token_ids

    start = env.open(question, ground_truth)
    state, history = copy.deepcopy(start.state), list(start.messages)
    ids, mask = [], []
    for i, text in enumerate(turns):
        turn = tok(text, add_special_tokens=False)["input_ids"]
        ids += turn
        mask += [1] * len(turn)
        if i == len(turns) - 1:
            ids.append(tok.eos_token_id)
            mask.append(1)
            break
        result = env.step(state, text)
        assert not result.done, f"the environment ended the episode after turn {i + 1}: {text!r}"
        reply = reply_token_ids(tok, history, start.tools, result.messages)
        history += [{"role": "assistant", "content": text}, *result.messages]
        ids += reply
        mask += [0] * len(reply)
    return start.token_ids(tok), ids, mask


def teach_episodes(model_dir: str, rows: list[tuple], *, steps: int = 150, lr: float = 3e-3, seed: int = 0,
                   weights: list[float] | None = None) -> float:
    """Fit the model at ``model_dir`` (in place) to ``rows`` (from :func:`script_episode`): the weighted
    mean cross-entropy of every model token, the inserted ones left out.  Rows that share a prompt and
    differ from some token on are learnt as branches there, as likely as their ``weights`` (default:
    equally).  Returns the final loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlft.batching.batch import build_rollout_batch
    from rlft.roles.reference import sequence_logprobs

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = build_rollout_batch([r[0] for r in rows], [r[1] for r in rows], pad_token_id=tok.pad_token_id,
                                response_mask=[r[2] for r in rows])
    mask = batch.response_mask * torch.tensor(weights or [1.0] * len(rows), dtype=torch.float32)[:, None]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = -(sequence_logprobs(model, batch.input_ids, batch.attention_mask) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return float(loss.detach())
