"""The prompt-length checks count what the engine receives on an episode's first turn: the environment's
whole opening (the calculator's tool schema, written by the chat template; the demonstration of
`environment.demonstrations: annealed`), and the episode's whole budget after it.  A tiny Llama over a
tiny BPE with Qwen2.5's chat template, the HF engine on CPU, the GSM8K fixture."""
from __future__ import annotations

import pytest

from conftest import GSM8K_FIXTURE
from rlft.engines.hf_engine import HFEngine
from test_preflight import TINY, accepted, refusal

CALCULATOR = [f"data.source={GSM8K_FIXTURE}", "environment.name=calculator", "data.prompt_template=chat",
              "reward.answer_format=boxed"]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    from tool_episodes import tiny_tool_model

    return tiny_tool_model(tmp_path_factory.mktemp("tool"))  # max_position_embeddings 2048


@pytest.fixture(scope="module")
def tok(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


class RecordingEngine(HFEngine):
    """The HF engine, keeping the prompts of every generate call it answers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompt_token_ids, spec):
        self.prompts.append([list(p) for p in prompt_token_ids])
        return super().generate(prompt_token_ids, spec)


def driver_environment(cfg):
    """The calculator, with the demonstration in front at step 1 where they anneal (built here by hand)."""
    from rlft.data.prompts import prompt_of
    from rlft.envs.demonstrations import DemonstratedEnvironment
    from rlft.envs.registry import make_environment
    from rlft.envs.rollout_options import DEMONSTRATION_SCHEDULES

    env, e = make_environment("calculator", prompt_of(cfg)), cfg.environment
    return DemonstratedEnvironment(env, e.demonstrations, 4) if DEMONSTRATION_SCHEDULES[e.demonstrations].annealed else env


def test_the_longest_prompt_is_the_first_turn_prompt_the_engine_receives(tool_model, tok):
    from rlft.config import load_config
    from rlft.data.prompts import prompt_of
    from rlft.engines.base import SamplingSpec
    from rlft.envs.demonstrations import demonstration_step
    from rlft.envs.rollouts import play_rows
    from rlft.roles.prompt_source import PromptSource

    engine = RecordingEngine(tool_model, dtype="float32", tokenizer=tok)
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=1, min_tokens=0, seed=0)
    longest = {}
    for demonstrations in ("none", "annealed"):
        cfg = load_config(None, [*CALCULATOR, f"environment.demonstrations={demonstrations}",
                                 "environment.demonstration_steps=4"])
        source = PromptSource(cfg, tok, 2, max_prompt_tokens=2048)
        env = driver_environment(cfg)
        demonstration_step(env, 1)  # the first step: every prompt carries it
        engine.prompts.clear()
        play_rows(engine, env, source.examples, spec, tok, max_turns=1, max_episode_tokens=1)
        (received,) = engine.prompts  # one engine call: every episode's first turn
        assert len(received) == len(source.examples) == 64
        longest[demonstrations] = source.longest_prompt(tok, cfg)
        assert longest[demonstrations] == max(len(p) for p in received)
    plain = max(len(p) for p in prompt_of(cfg).encode([ex.question for ex in source.examples], tok))
    assert plain < longest["none"] < longest["annealed"]
    # The tool schema's tokens, and the demonstration's on top (the same question's two openings).
    q = source.examples[0].question
    with_tool = len(driver_environment(load_config(None, CALCULATOR)).open(q, "0").token_ids(tok))
    assert with_tool - len(prompt_of(cfg).encode([q], tok)[0]) == longest["none"] - plain > 10
    assert longest["annealed"] - longest["none"] == len(driver_environment(cfg).open(q, "0").token_ids(tok)) - with_tool


def test_a_run_whose_first_turn_prompt_and_budget_overflow_the_model_is_refused(tool_model, tok, tmp_path, capsys):
    from rlft.config import load_config
    from rlft.runtime.build import prompt_limit

    common = [f"output.dir={tmp_path / 'out'}", f"model.path={tool_model}", *CALCULATOR, "sampling.max_tokens=64",
              "environment.demonstrations=annealed", "environment.demonstration_steps=4"]
    opening = len(driver_environment(load_config(TINY, common)).open("", "").token_ids(tok))
    assert 200 < opening < 1000
    room = 2048 - opening
    assert refusal(capsys, *common, f"environment.max_episode_tokens={room + 1}") == (
        f"environment.max_episode_tokens: the first-turn prompt takes at least {opening} tokens (environment "
        f"calculator's opening with its demonstration, before any question) and environment.max_episode_tokens "
        f"{room + 1} more: 2049 > the model's 2048 positions; lower environment.max_episode_tokens to at most {room} "
        f"minus the question's tokens")
    accepted(capsys, *common, f"environment.max_episode_tokens={room}")
    assert refusal(capsys, *common, "environment.max_episode_tokens=2048") == (
        "environment.max_episode_tokens: 2048 response tokens leave no room for a prompt in the model's 2048 positions")
    # On the ranks, the prompts' limit leaves the episode's whole budget.
    ranks = [*common, "sampling.backend=hf"]
    assert prompt_limit(load_config(TINY, [*ranks, "environment.max_episode_tokens=1500"]), tool_model,
                        evaluation=False) == 2048 - 1500
    assert prompt_limit(load_config(TINY, ranks), tool_model, evaluation=False) == 2048 - 64
