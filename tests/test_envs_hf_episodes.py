"""Episodes on the real HF engine (rlft/engines/hf_engine.py) with a tiny Qwen2 model over Qwen2.5's real
tokenizer: single-turn episodes are the engine's own completions, the engine's per-turn log-probs of a
two-turn episode are the trainer's log-probs of the whole episode as one sequence, and a model that has
learnt one episode calls the calculator, gets its result as inserted tokens and answers."""
from __future__ import annotations

import pytest
import torch

from rlft.batching.batch import build_rollout_batch
from rlft.data.prompts import Prompt
from rlft.engines.base import SamplingSpec
from rlft.engines.hf_engine import HFEngine
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.episodes import open_episodes, reply_token_ids, run_episodes
from rlft.envs.registry import make_environment
from rlft.reward.formats import get_answer_format
from rlft.roles.reference import sequence_logprobs
from tiny_models import qwen_tokenizer_dir, tiny_model_dir

# The question alone as the user message: short prompts keep the tiny model's steps cheap.
PROMPT = Prompt(messages=(("user", "{question}"),), answer_format="boxed")
QUESTIONS = ["What is 48 / 2 + 3?", "Tom has 3 apples and buys 4 more. How many does he have?"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 whose vocabulary is the Qwen2.5 tokenizer's (untied head)."""
    return tiny_model_dir(tmp_path_factory.mktemp("qwen_tiny"), family="qwen2", num_layers=2,
                          tie_word_embeddings=False, tokenizer_dir=qwen_tokenizer_dir())


@pytest.fixture(scope="module")
def engine(model_dir, tok):
    return HFEngine(model_dir, dtype="float32", tokenizer=tok)


def test_single_turn_episodes_are_the_engines_completions(engine, tok):
    env = make_environment("single_turn", PROMPT)
    starts, prompt_ids = open_episodes(env, QUESTIONS, ["27", "7"], tok)
    assert prompt_ids == PROMPT.encode(QUESTIONS, tok)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8, stop=["</answer>"], seed=3, logprobs=True)
    direct = engine.generate(prompt_ids, spec)
    groups = run_episodes(engine, prompt_ids, starts, spec, tok, env, max_turns=4, max_episode_tokens=100)
    for group, completions in zip(groups, direct):
        for r, c in zip(group, completions, strict=True):
            assert r.token_ids == c.token_ids and r.logprobs == c.logprobs
            assert (r.text, r.finish_reason) == (c.text, c.finish_reason)
            assert r.response_mask == [1] * len(c.token_ids) and r.num_turns == 1 and r.tool_calls == 0
    assert len({tuple(r.token_ids) for g in groups for r in g}) == 4  # sampled: the four differ


class ReplyOnce(Environment):
    """Answers the first turn with a tool message, whatever it says; ends the episode after the second."""

    def open(self, question, ground_truth):
        return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)), state={"turns": 0})

    def step(self, state, text):
        state["turns"] += 1
        if state["turns"] == 2:
            return StepResult.end()
        return StepResult.reply([{"role": "tool", "content": "42"}], tool_calls=1)


def test_two_turn_logprobs_are_the_logprobs_of_the_episode_as_one_sequence(engine, tok):
    env = ReplyOnce(PROMPT)
    starts, prompt_ids = open_episodes(env, QUESTIONS, ["27", "7"], tok)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, stop=[], seed=5, logprobs=True)
    results = [r for g in run_episodes(engine, prompt_ids, starts, spec, tok, env, max_turns=3,
                                       max_episode_tokens=200) for r in g]
    reply = reply_token_ids(tok, starts[0].messages, None, [{"role": "tool", "content": "42"}])
    for r in results:
        assert r.num_turns == 2 and r.finish_reason in ("length", "eos")
        inserted = [t for t, m in zip(r.token_ids, r.response_mask) if not m]
        turn1_end = r.response_mask.index(0) - 1
        closed = r.token_ids[turn1_end] == tok.eos_token_id  # a turn that ended on eos closed itself
        assert inserted == reply[1:] if closed else inserted == reply
    # The trainer's view: prompt + episode as one sequence, the response mask on the model's tokens only.
    batch = build_rollout_batch([prompt_ids[i // 2] for i in range(4)], [r.token_ids for r in results],
                                pad_token_id=tok.pad_token_id, response_logprobs=[r.logprobs for r in results],
                                response_mask=[r.response_mask for r in results])
    with torch.no_grad():
        policy = sequence_logprobs(engine.model, batch.input_ids, batch.attention_mask)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) == sum(r.model_tokens for r in results) > 4 * 6
    torch.testing.assert_close(policy[mask], batch.sampler_logprobs[mask], atol=1e-4, rtol=0)
    # At the inserted tokens the engine reported 0.0, the model's log-probs are far from it.
    inserted = batch.attention_mask[:, 1:].bool() & ~mask
    inserted[:, :len(prompt_ids[0]) - 1] = False
    assert (policy[inserted] < -1).float().mean() > 0.9


def teach(model, prompt_ids: list[int], response: list[int], response_mask: list[int], steps: int = 150) -> int:
    """Fit ``model`` (in place) to produce ``response``'s model tokens after ``prompt_ids`` + the tokens before
    them, until greedy decoding reproduces each one with a logit margin of 0.5 (teacher-forced); the number
    of steps taken.  Only the layers and the head's rows of the tokens seen plus 4096 others are trained (the
    embeddings stay), which keeps a step cheap with a 151k vocabulary."""
    batch = build_rollout_batch([prompt_ids], [response], pad_token_id=0, response_mask=[response_mask])
    at, targets = batch.response_mask.bool(), batch.input_ids[:, 1:][batch.response_mask.bool()]
    generator = torch.Generator().manual_seed(0)
    rows = torch.unique(torch.cat([batch.input_ids.flatten(),
                                   torch.randint(0, model.lm_head.weight.shape[0], (4096,), generator=generator)]))
    where = {int(r): i for i, r in enumerate(rows)}
    head = torch.nn.Parameter(model.lm_head.weight.detach()[rows].clone())
    torch.manual_seed(0)
    opt = torch.optim.Adam([head, *(p for n, p in model.model.named_parameters() if "embed_tokens" not in n)], lr=3e-3)
    local = torch.tensor([where[int(t)] for t in targets])
    for step in range(1, steps + 1):
        hidden = model.model(input_ids=batch.input_ids, use_cache=False).last_hidden_state[:, :-1]
        loss = torch.nn.functional.cross_entropy(hidden[at] @ head.T, local)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.3 and step % 5 == 0:  # the full head's check only once it may pass
            with torch.no_grad():
                model.lm_head.weight[rows] = head
                hidden = model.model(input_ids=batch.input_ids, use_cache=False).last_hidden_state[:, :-1]
                logits = model.lm_head(hidden[at])
                target = logits.gather(-1, targets[:, None]).squeeze(-1)
                logits.scatter_(-1, targets[:, None], float("-inf"))
                if (target - logits.max(-1).values).min() > 0.5:
                    return step
    raise AssertionError(f"the model did not learn the episode in {steps} steps")


def test_a_model_that_learnt_an_episode_calls_the_calculator_on_the_hf_engine(model_dir, tok):
    from transformers import AutoModelForCausalLM

    env = make_environment("calculator", PROMPT)
    starts, prompt_ids = open_episodes(env, QUESTIONS[:1], ["27"], tok)
    turn1 = tok('<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2 + 3"}}\n</tool_call>',
                add_special_tokens=False)["input_ids"]
    reply = reply_token_ids(tok, starts[0].messages, starts[0].tools, [{"role": "tool", "content": "27"}])
    turn2 = tok("\\boxed{27}<|im_end|>", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teach(model, prompt_ids[0], turn1 + reply + turn2, [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2))

    engine = HFEngine(model.eval(), tokenizer=tok)
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=40, stop=[], logprobs=True)
    [[r]] = run_episodes(engine, prompt_ids, starts, spec, tok, env, max_turns=3, max_episode_tokens=200)
    # Turn 1 stopped at </tool_call> (the environment's stop string), the calculator's result went in
    # as the template's tokens, and turn 2 answered.
    assert r.transcript(tok) == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2 + 3"}}\n'
                                 "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n27\n</tool_response>"
                                 "<|im_end|>\n<|im_start|>assistant\n\\boxed{27}<|im_end|>")
    assert r.token_ids == turn1 + reply + turn2
    assert r.response_mask == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert (r.num_turns, r.tool_calls, r.tool_errors, r.finish_reason) == (2, 1, 0, "eos")
    assert r.messages[1] == {"role": "tool", "name": "calculator", "content": "27"}
    assert get_answer_format("boxed").split(r.text) == (True, "27")
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.response_mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(r.logprobs, r.response_mask) if m)
