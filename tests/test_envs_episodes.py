"""The multi-turn driver (rlft/envs/episodes.py) on a scripted engine with Qwen2.5's real tokenizer and
chat template: the appended tokens are the template's, the masks cover exactly the model's tokens, one
engine call per turn, the caps on turns and tokens.

`ScriptedEngine` is a test engine for the driver's logic only: it answers each prompt with scripted
text, cut as vLLM cuts a completion (stop string, eos, max_tokens); the real engine's path is
tests/test_envs_hf_episodes.py."""
from __future__ import annotations

import json

import pytest
import torch

from rlft.batching.batch import build_rollout_batch
from rlft.data.prompts import Prompt
from rlft.engines.base import Completion, RolloutEngine, SamplingSpec
from rlft.envs.base import Environment, EpisodeStart, StepResult
from rlft.envs.calculator import CALCULATOR_TOOL, CalculatorEnvironment
from rlft.envs.episodes import EpisodeResult, open_episodes, reply_token_ids, run_episodes
from rlft.envs.metrics import episode_metrics, episode_sample

PROMPT = Prompt("chat", answer_format="boxed")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tiny_models import qwen_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def fake_logprob(token: int) -> float:
    """A distinct, deterministic 'log-prob' per token id."""
    return -((token * 7919) % 1000) / 1000 - 0.001


class ScriptedEngine(RolloutEngine):
    """``script(prompt_text, j) -> text`` for completion ``j`` of each prompt; the text is tokenised and
    cut at the token completing a stop string ("stop", kept), at eos ("eos", kept) or at
    ``max_tokens`` ("length").  ``calls`` records each call's prompts and spec."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_token_ids, spec):
        self.calls.append(([list(p) for p in prompt_token_ids], spec))
        return [[self.complete(self.script(self.tok.decode(p), j), spec) for j in range(spec.n)]
                for p in prompt_token_ids]

    def complete(self, text: str, spec: SamplingSpec) -> Completion:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        decode = lambda k: self.tok.decode(ids[:k], skip_special_tokens=True)  # noqa: E731
        reason, k = "length", min(len(ids), spec.max_tokens)
        for i in range(min(len(ids), spec.max_tokens)):
            if ids[i] == self.tok.eos_token_id:
                reason, k = "eos", i + 1
                break
            if any(s in decode(i + 1) for s in spec.stop):
                reason, k = "stop", i + 1
                break
        text = decode(k)
        if reason == "stop" and not spec.include_stop_str_in_output:
            text = text[:min(text.find(s) for s in spec.stop if s in text)]
        return Completion(ids[:k], text, reason, [fake_logprob(t) for t in ids[:k]] if spec.logprobs else None)

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def weights_checksum(self):
        raise NotImplementedError


def call(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def rounds(prompt_text: str) -> int:
    """How many tool rounds the conversation so far holds (0 on turn 1)."""
    return prompt_text.count("<|im_start|>user\n<tool_response>")


# A turn ends at its first </tool_call> (the environment's stop string): one call per turn.
TURN1 = "<think>\nHalf of 48 first.\n</think>\n\n" + call("48 / 2")
TURN2 = "Then add 3: " + call("24 + 3")
TURN3 = "<think>\nSo 27.\n</think>\n\nThe answer is \\boxed{27}.<|im_end|>"


def three_turns(prompt_text: str, j: int) -> str:
    return [TURN1, TURN2, TURN3][rounds(prompt_text)]


def run(tok, engine, questions=("What is 48 / 2 + 3?",), env=None, **kw):
    env = env or CalculatorEnvironment(PROMPT)
    starts, prompt_ids = open_episodes(env, list(questions), ["27"] * len(questions), tok)
    spec = kw.pop("spec", SamplingSpec(n=1, max_tokens=100, temperature=1.0, stop=[], seed=100))
    caps = {"max_turns": 4, "max_episode_tokens": 1000, **kw}
    groups = run_episodes(engine, prompt_ids, starts, spec, tok, env, **caps)
    return starts, prompt_ids, groups


def test_reply_tokens_are_what_the_template_writes(tok):
    history = PROMPT.chat_messages("What is 48 / 2?")
    one = reply_token_ids(tok, history, [CALCULATOR_TOOL], [{"role": "tool", "content": "24"}])
    assert one == ids_of(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert one[0] == tok.convert_tokens_to_ids("<|im_end|>") and one[-3:] == ids_of(tok, "<|im_start|>assistant\n")
    two = reply_token_ids(tok, history, [CALCULATOR_TOOL], [{"role": "tool", "content": "24"},
                                                             {"role": "tool", "content": "Error: division by zero"}])
    assert tok.decode(two) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response>\n<tool_response>\n"
                               "Error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_the_assistant_content_is_refused(tok):
    class Shouting:
        def apply_chat_template(self, conversation, **kw):
            return "".join(m["content"].upper() for m in conversation)

    with pytest.raises(ValueError, match="does not write an assistant message's content verbatim"):
        reply_token_ids(Shouting(), [{"role": "user", "content": "hi"}], None, [{"role": "tool", "content": "1"}])


class CalculatorTwice(CalculatorEnvironment):
    """Answers each call twice (two tool messages in one reply)."""

    def step(self, state, text):
        result = super().step(state, text)
        return result if result.done else StepResult.reply(result.messages * 2, tool_calls=result.tool_calls)


@pytest.mark.parametrize("env, tool_contents", [(CalculatorEnvironment(PROMPT), ["24", "27"]),
                                                (CalculatorTwice(PROMPT), ["24", "24", "27", "27"])])
def test_the_episodes_tokens_are_the_templates_rendering_of_the_conversation(tok, env, tool_contents):
    starts, prompt_ids, groups = run(tok, ScriptedEngine(tok, three_turns), env=env)
    r = groups[0][0]
    assert (r.num_turns, r.tool_calls, r.tool_errors, r.finish_reason) == (3, 2, 0, "eos")
    assert [m["content"] for m in r.messages if m["role"] == "tool"] == tool_contents
    assert [m["role"] for m in r.messages if m["role"] != "tool"] == ["assistant"] * 3
    assert r.text == "<think>\nSo 27.\n</think>\n\nThe answer is \\boxed{27}."
    # The whole conversation rendered by the template and tokenised at once: the same ids (the template
    # ends the last turn with "<|im_end|>\n"; the episode ends at the model's <|im_end|>).
    full = tok.apply_chat_template([*starts[0].messages, *r.messages], tools=[CALCULATOR_TOOL], tokenize=False)
    assert prompt_ids[0] + r.token_ids + ids_of(tok, "\n") == ids_of(tok, full)
    assert r.transcript(tok) == tok.decode(r.token_ids) and r.transcript(tok).endswith("\\boxed{27}.<|im_end|>")
    assert full.count("<tool_response>") == len(tool_contents)


def test_masks_and_logprobs_against_the_hand_built_episode(tok):
    _, _, groups = run(tok, ScriptedEngine(tok, three_turns))
    r = groups[0][0]
    t1, t3 = ids_of(tok, TURN1), ids_of(tok, TURN3)
    t2 = ids_of(tok, TURN2)
    g1 = ids_of(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n24\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
    g2 = ids_of(tok, "<|im_end|>\n<|im_start|>user\n<tool_response>\n27\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert r.token_ids == t1 + g1 + t2 + g2 + t3
    assert r.response_mask == [1] * len(t1) + [0] * len(g1) + [1] * len(t2) + [0] * len(g2) + [1] * len(t3)
    assert r.logprobs == ([fake_logprob(t) for t in t1] + [0.0] * len(g1) + [fake_logprob(t) for t in t2]
                          + [0.0] * len(g2) + [fake_logprob(t) for t in t3])
    assert r.model_tokens == len(t1) + len(t2) + len(t3)
    assert [tok.decode(ids_of(tok, x)) for x in r.turns] == [TURN1, TURN2, TURN3.replace("<|im_end|>", "")]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_the_batchs_response_mask_keeps_only_the_models_tokens(tok, padding_side):
    def script(prompt_text, j):
        if "short" in prompt_text:
            return "\\boxed{1}<|im_end|>"
        return [TURN1, TURN3][rounds(prompt_text)]

    _, prompt_ids, groups = run(tok, ScriptedEngine(tok, script), questions=("A short one?", "What is 48 / 2 + 3?"))
    results = [g[0] for g in groups]
    assert [r.num_turns for r in results] == [1, 2] and len(prompt_ids[0]) != len(prompt_ids[1])
    plain = build_rollout_batch(prompt_ids, [r.token_ids for r in results], pad_token_id=tok.pad_token_id,
                                padding_side=padding_side, response_logprobs=[r.logprobs for r in results])
    batch = build_rollout_batch(prompt_ids, [r.token_ids for r in results], pad_token_id=tok.pad_token_id,
                                padding_side=padding_side, response_logprobs=[r.logprobs for r in results],
                                response_mask=[r.response_mask for r in results])
    assert torch.equal(batch.response_mask, plain.response_mask * batch.response_mask)  # only ever removes
    for row, r in enumerate(results):
        cols = batch.response_mask[row].nonzero().squeeze(-1)
        assert batch.input_ids[row, cols + 1].tolist() == [t for t, m in zip(r.token_ids, r.response_mask) if m]
        sampled = [lp for lp, m in zip(r.logprobs, r.response_mask) if m]
        assert batch.sampler_logprobs[row, cols].tolist() == pytest.approx(sampled)
    assert batch.response_mask.sum().item() == sum(r.model_tokens for r in results)
    assert results[1].model_tokens < len(results[1].token_ids)
    with pytest.raises(ValueError, match="response_mask\\[1\\] has 3 values"):
        build_rollout_batch(prompt_ids, [r.token_ids for r in results], pad_token_id=tok.pad_token_id,
                            response_mask=[results[0].response_mask, [1, 1, 1]])


def test_one_engine_call_per_turn_group_first_then_one_completion_per_episode(tok):
    def script(prompt_text, j):
        if rounds(prompt_text) == 0:  # completion j of a group: j == 0 answers at once, others call
            return "\\boxed{27}<|im_end|>" if j == 0 else TURN1
        return TURN3

    engine = ScriptedEngine(tok, script)
    spec = SamplingSpec(n=3, max_tokens=100, temperature=1.0, stop=["</answer>"], seed=100,
                        include_stop_str_in_output=False)
    _, prompt_ids, groups = run(tok, engine, questions=("Q one: 48 / 2 + 3?", "Q two: 48 / 2 + 3?"), spec=spec)
    assert [len(g) for g in groups] == [3, 3]
    assert [[r.num_turns for r in g] for g in groups] == [[1, 2, 2], [1, 2, 2]]
    assert [[r.finish_reason for r in g] for g in groups] == [["eos"] * 3] * 2
    assert len(engine.calls) == 2
    (first_prompts, first), (later_prompts, later) = engine.calls
    assert first_prompts == prompt_ids and first.n == 3 and first.seed == 100
    assert first.stop == ["</answer>", "</tool_call>"] and first.include_stop_str_in_output
    assert later.n == 1 and later.seed == 100 + 6 and later.min_tokens == 0  # seeds 100..105 were turn 1's
    # The later call continues the four live episodes, each from its prompt and its tokens so far.
    live = [(i, r) for i, g in enumerate(groups) for r in g if r.num_turns == 2]
    n1 = len(ids_of(tok, TURN3))
    assert later_prompts == [prompt_ids[i] + r.token_ids[:-n1] for i, r in live]


class Counting(Environment):
    """Replies with how many turns this episode has taken; ends after three."""

    def open(self, question, ground_truth):
        return EpisodeStart(messages=tuple(self.prompt.chat_messages(question)), state={"turns": 0})

    def step(self, state, text):
        state["turns"] += 1
        if state["turns"] == 3:
            return StepResult.end(reward=0.5)
        return StepResult.reply([{"role": "tool", "content": f"turn {state['turns']}"}], tool_calls=1)


def test_each_episode_of_a_group_has_its_own_state(tok):
    env = Counting(PROMPT)
    engine = ScriptedEngine(tok, lambda p, j: f"step {j}<|im_end|>")
    starts, _, groups = run(tok, engine, env=env, spec=SamplingSpec(n=2, max_tokens=50, temperature=1.0, stop=[]))
    assert starts[0].state == {"turns": 0}  # the opening's state is copied, never changed
    for r in groups[0]:
        assert [m["content"] for m in r.messages if m["role"] == "tool"] == ["turn 1", "turn 2"]
        assert (r.num_turns, r.tool_calls, r.reward, r.finish_reason) == (3, 2, 0.5, "eos")
    # A turn that ended on eos is closed by the model's own <|im_end|>: the reply does not repeat it.
    r = groups[0][0]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first = ids_of(tok, "step 0<|im_end|>")
    assert r.token_ids[:len(first) + 1] == first + ids_of(tok, "\n") and r.token_ids.count(im_end) == 5


def always_calls(prompt_text, j):
    return f"Round {rounds(prompt_text)}: " + call("1 + 1")


def test_max_turns_ends_with_a_tool_call_unanswered(tok):
    _, _, groups = run(tok, ScriptedEngine(tok, always_calls), max_turns=2)
    r = groups[0][0]
    assert (r.num_turns, r.finish_reason, r.tool_calls) == (2, "max_turns", 2)
    assert [m["role"] for m in r.messages] == ["assistant", "tool", "assistant"]
    assert r.response_mask[-1] == 1 and r.text.startswith("Round 1: <tool_call>")
    assert r.token_ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    once = run(tok, ScriptedEngine(tok, always_calls), max_turns=1)[2][0][0]
    assert (once.num_turns, once.finish_reason, once.response_mask) == (1, "max_turns", [1] * len(once.token_ids))


def test_the_episodes_token_budget(tok):
    turn1 = [len(ids_of(tok, always_calls("", 0)))]
    reply = len(reply_token_ids(tok, PROMPT.chat_messages("q"), [CALCULATOR_TOOL], [{"role": "tool", "content": "2"}]))

    # The reply does not fit (with room for one more token): the episode ends after turn 1.
    budget = turn1[0] + reply
    r = run(tok, ScriptedEngine(tok, always_calls), max_episode_tokens=budget)[2][0][0]
    assert (r.num_turns, r.finish_reason, r.response_mask) == (1, "max_tokens", [1] * turn1[0])

    # Turn 2 gets what is left, and is cut there.
    budget = turn1[0] + reply + 5
    engine = ScriptedEngine(tok, always_calls)
    r = run(tok, engine, max_episode_tokens=budget)[2][0][0]
    assert engine.calls[1][1].max_tokens == 5
    assert (r.num_turns, r.finish_reason, len(r.token_ids)) == (2, "max_tokens", budget)
    cut = ids_of(tok, always_calls("<|im_start|>user\n<tool_response>", 0))[:5]
    assert r.token_ids[-5:] == cut and r.text == tok.decode(cut) == "Round 1: "

    # Turn 1 capped by the budget below spec.max_tokens: "max_tokens"; at spec.max_tokens: "length".
    r = run(tok, ScriptedEngine(tok, always_calls), max_episode_tokens=4)[2][0][0]
    assert (len(r.token_ids), r.finish_reason) == (4, "max_tokens")
    r = run(tok, ScriptedEngine(tok, always_calls), spec=SamplingSpec(n=1, max_tokens=4, stop=[]),
            max_episode_tokens=100)[2][0][0]
    assert (len(r.token_ids), r.finish_reason) == (4, "length")


def test_episodes_with_different_room_share_one_call_and_each_is_cut_to_its_own(tok):
    long_answer = "The sum is " + " + ".join(["1"] * 40) + " = 40.<|im_end|>"

    def script(prompt_text, j):
        if rounds(prompt_text) == 0:
            return ("Let me think about this for quite a while first. " * 2 if j == 1 else "") + call("1 + 1")
        return long_answer

    engine = ScriptedEngine(tok, script)
    spec = SamplingSpec(n=2, max_tokens=60, temperature=1.0, stop=[])
    _, _, groups = run(tok, engine, spec=spec, max_episode_tokens=90)
    short, long = groups[0]
    assert len(long.token_ids) > len(short.token_ids) - 40  # a longer first turn
    rooms = [90 - (len(r.token_ids) - len(ids_of(tok, r.turns[1]))) for r in (short, long)]
    assert rooms[0] > rooms[1] and engine.calls[1][1].max_tokens == min(60, rooms[0])
    for r, room in zip((short, long), rooms):
        assert (r.num_turns, r.finish_reason, len(r.token_ids)) == (2, "max_tokens", 90)
        assert r.token_ids[-room:] == ids_of(tok, long_answer)[:room]
        assert r.logprobs[-room:] == [fake_logprob(t) for t in ids_of(tok, long_answer)[:room]]
        assert r.text == tok.decode(ids_of(tok, long_answer)[:room])


def test_a_text_prompt_episode_cannot_take_a_second_turn(tok):
    class TextEnv(Counting):
        def open(self, question, ground_truth):
            return EpisodeStart(text=question, state={"turns": 0})

    with pytest.raises(ValueError, match="continued an episode opened with a text prompt"):
        run(tok, ScriptedEngine(tok, lambda p, j: "a<|im_end|>"), env=TextEnv(PROMPT))


def test_metrics_and_samples(tok):
    [x] = tok("x", add_special_tokens=False)["input_ids"]

    def episode(turns, calls, errors, reason, tokens, model):
        return EpisodeResult(token_ids=[x] * tokens, response_mask=[1] * model + [0] * (tokens - model), num_turns=turns,
                             tool_calls=calls, tool_errors=errors, finish_reason=reason)

    results = [episode(1, 0, 0, "eos", 10, 10), episode(3, 2, 1, "eos", 40, 30), episode(4, 4, 0, "max_turns", 50, 40)]
    m = episode_metrics(results, correct=[1.0, 0.0, 1.0])
    assert m["episodes/turns"] == pytest.approx(8 / 3) and m["episodes/tool_calls"] == 2.0
    assert m["episodes/tool_errors"] == pytest.approx(1 / 3) and m["episodes/tool_error_rate"] == pytest.approx(1 / 6)
    assert m["episodes/with_tool_call"] == pytest.approx(2 / 3)
    assert m["episodes/inserted_fraction"] == pytest.approx(20 / 100)
    assert m["episodes/accuracy_with_tool"] == 0.5 and m["episodes/accuracy_without_tool"] == 1.0
    assert m["episodes/finish/eos"] == pytest.approx(2 / 3) and m["episodes/finish/max_turns"] == pytest.approx(1 / 3)
    assert m["episodes/finish/length"] == 0.0
    assert "episodes/accuracy_without_tool" not in episode_metrics(results[1:], correct=[0.0, 1.0])
    # The transcript is decoded when a sample is logged: 40 "x" tokens, cut to 20 characters in the middle.
    assert episode_sample(results[1], tok, max_chars=20)["transcript"] == "x" * 10 + "\n[... 20 characters ...]\n" + "x" * 10
    assert episode_sample(results[0], tok)["transcript"] == "x" * 10
