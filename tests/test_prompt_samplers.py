"""The order prompts are drawn in (data.sampler): uniform exactly as before, and the difficulty order
that rests always-solved and never-solved prompts, kept per prompt from the rollouts' rewards."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rlft.config import ConfigError, load_config
from rlft.data import PromptSampler
from rlft.data.prompt_samplers import PROMPT_SAMPLERS, DifficultySampler, pass_rates
from rlft.roles.prompt_source import PromptSource

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "launch" / "configs" / "grpo_cpu_tiny.yaml"
GSM8K = REPO / "tests" / "fixtures" / "gsm8k"


def take(sampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_uniform_is_the_default_and_draws_the_order_it_always_has():
    cfg = load_config(TINY, [f"data.source={GSM8K}", "data.train_size=10"])
    assert cfg.data.sampler == "uniform"
    source = PromptSource(cfg, None, 3)  # no prompt-length limit: no tokenizer needed
    drawn = [[ex.index for ex in source.next_examples()] for _ in range(7)]
    assert drawn == take(PromptSampler(10, 3, seed=0), 7)
    source.observe(source.next_examples(), [{"answer_reward": 1.0}] * 6)  # the uniform order ignores rewards
    assert source.metrics() == {}
    assert source.state_dict() == {"epoch": 2, "position": 6, "seed": 0, "num_examples": 10, "shuffle": True,
                                   "batch_size": 3, "drawn_ahead": [], "drawn_ahead_epoch_ends": []}
    assert PROMPT_SAMPLERS["uniform"].learns_from_rewards is False


def test_rounds_of_any_size_take_the_orders_prompts_in_turn_and_resume_mid_batch():
    """grpo.oversample: a round takes as many prompts as it asks for, from the order's batches in turn; what
    it leaves of a batch waits for the next round, also across a checkpoint; an epoch counts as taken when
    a round takes its last prompt."""
    cfg = load_config(TINY, [f"data.source={GSM8K}", "data.train_size=10"])
    stream = [i for batch in take(PromptSampler(10, 3, seed=0), 12) for i in batch]  # 3 whole batches an epoch
    source = PromptSource(cfg, None, 3)
    sizes = [5, 1, 2, 4, 1]
    drawn = [[ex.index for ex in source.next_examples(n)] for n in sizes]
    assert [i for r in drawn for i in r] == stream[:13]
    # 13 taken: the epoch of 9 ended in the fourth round; the fifth round's batch left two waiting.
    assert source.epochs_taken == 1
    state = source.state_dict()
    assert state["drawn_ahead"] == stream[13:15] and state["drawn_ahead_epoch_ends"] == []
    resumed = PromptSource(cfg, None, 3)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as the checkpoint stores it
    assert [ex.index for ex in resumed.next_examples(7)] == stream[13:20] == \
        [ex.index for ex in source.next_examples(7)]
    # Both took the second epoch's last prompt (the 18th) in that round; the resumed one counts from its start.
    assert (source.epochs_taken, resumed.epochs_taken) == (2, 1)
    # The third ends with the 27th, whichever round takes it.
    source.next_examples(6)
    assert source.epochs_taken == 2
    assert [ex.index for ex in source.next_examples(1)] == stream[26:27] and source.epochs_taken == 3
    # A checkpoint from before rounds had sizes holds no drawn-ahead prompts: it resumes at the batch.
    old = PromptSource(cfg, None, 3)
    old.load_state_dict({"epoch": 0, "position": 3, "seed": 0, "num_examples": 10, "shuffle": True, "batch_size": 3})
    assert [ex.index for ex in old.next_examples()] == stream[3:6]


def test_pass_rates_of_groups_laid_out_one_after_another():
    grades = [{"answer_reward": r} for r in (1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0)]
    assert pass_rates(grades, 3) == [1.0, 0.25, 0.0]
    # A shaped or custom reward counts as right only where its answer_reward is 1.
    assert pass_rates([{"answer_reward": 0.25, "reward": 1.0}, {"answer_reward": 1.0, "reward": 1.0}], 1) == [0.5]


def test_solved_and_unsolved_prompts_rest_then_come_back():
    s = DifficultySampler(10, 2, seed=3, rest_epochs=1, revisit_prob=0.0)
    epoch0 = take(s, 5)
    assert sorted(sum(epoch0, [])) == list(range(10)) and s.epoch_done
    assert s.metrics()["sampler/active_pool"] == 10 and s.metrics()["sampler/seen"] == 0
    # Rewards of epoch 0: 0-3 always right, 4-5 never, the rest mixed.
    for batch in epoch0:
        s.observe(batch, [1.0 if i < 4 else 0.0 if i < 6 else 0.5 for i in batch])
    m = s.metrics()
    assert (m["sampler/solved_pool"], m["sampler/unsolved_pool"], m["sampler/active_pool"]) == (4, 2, 4)
    assert m["sampler/seen"] == 10 and m["sampler/pass_rate_mean"] == pytest.approx((4 + 4 * 0.5) / 10)
    # Epoch 1 draws only the 4 active prompts (2 batches); the rested ones sit it out.
    epoch1 = take(s, 2)
    assert sorted(sum(epoch1, [])) == [6, 7, 8, 9] and s.epoch == 1 and s.epoch_done
    for batch in epoch1:
        s.observe(batch, [0.5] * len(batch))
    # Their rest (one epoch after the one that drew them) is over: epoch 2 draws all 10 again.
    epoch2 = take(s, 5)
    assert sorted(sum(epoch2, [])) == list(range(10)) and s.epoch == 2
    assert s.metrics()["sampler/active_pool"] == 10 and s.metrics()["sampler/revisited"] == 0


def test_resting_prompts_are_revisited_with_their_probability():
    def resting_drawn(prob: float, seed: int = 0) -> tuple[int, int]:
        s = DifficultySampler(200, 10, seed=seed, rest_epochs=5, revisit_prob=prob)
        for batch in take(s, 20):
            s.observe(batch, [1.0 if i < 150 else 0.5 for i in batch])
        s.next_batch()  # epoch 1 begins
        return s.revisited, len([i for i in s.order if i < 150])

    assert resting_drawn(0.0) == (0, 0)
    assert resting_drawn(1.0) == (150, 150)
    revisited, drawn = resting_drawn(0.2)
    assert revisited == drawn and 15 <= revisited <= 45  # ~30 of 150: Binomial(150, 0.2) within 3 sd
    assert resting_drawn(0.2) == resting_drawn(0.2) != resting_drawn(0.2, seed=1)  # seeded


def test_too_few_active_prompts_are_filled_with_those_due_back_soonest():
    s = DifficultySampler(6, 4, seed=0, rest_epochs=3, revisit_prob=0.0)
    s.observe(s.next_batch(), [1.0, 1.0, 1.0, 1.0])   # epoch 0: 4 rest until epoch 4
    assert s.metrics()["sampler/solved_pool"] == 4
    epoch1 = s.next_batch()  # the 2 prompts epoch 0 left over, and 2 resting ones to fill the batch
    assert s.epoch == 1 and len(epoch1) == 4 and s.revisited == 2
    assert set(epoch1) >= {i for i in range(6) if s.groups[i] == 0}
    # Never-solved prompts too: with every prompt resting, a batch is still drawn in full.
    t = DifficultySampler(3, 2, seed=0, rest_epochs=2, revisit_prob=0.0)
    t.observe(t.next_batch(), [0.0, 0.0])
    t.observe(t.next_batch(), [0.0, 0.0])
    assert len(t.next_batch()) == 2


def test_resting_spends_the_rollouts_on_prompts_that_teach():
    """A simulated policy: of 40 prompts, 20 it always solves, 10 it never does, 10 it solves half the
    time (groups of 8).  A group teaches when its rewards differ; the difficulty order draws far more
    of those per step than the uniform order does, for the same number of prompts drawn."""
    truth = [1.0] * 20 + [0.0] * 10 + [0.5] * 10

    def teaching_share(sampler, steps: int = 100) -> float:
        rng, teaching, drawn = random.Random(7), 0, 0
        for _ in range(steps):
            batch = sampler.next_batch()
            rates = [sum(rng.random() < truth[i] for _ in range(8)) / 8 for i in batch]
            teaching += sum(0 < r < 1 for r in rates)
            drawn += len(batch)
            if hasattr(sampler, "observe"):
                sampler.observe(batch, rates)
        return teaching / drawn

    uniform = teaching_share(PromptSampler(40, 4, seed=0))
    difficulty = teaching_share(DifficultySampler(40, 4, seed=0, rest_epochs=4, revisit_prob=0.05))
    assert uniform == pytest.approx(0.25, abs=0.05)  # 10 of 40, less the rare all-equal group of 8
    assert difficulty > 2 * uniform, (uniform, difficulty)


def test_a_resumed_difficulty_order_draws_what_the_run_would_have():
    def run(sampler, steps: int, seed: int = 5) -> list[list[int]]:
        rng, out = random.Random(seed + sampler.epoch * 1000 + sampler.position), []
        for _ in range(steps):
            batch = sampler.next_batch()
            sampler.observe(batch, [rng.choice((0.0, 0.5, 1.0)) for _ in batch])
            out.append(batch)
        return out

    original = DifficultySampler(11, 3, seed=2, rest_epochs=1, revisit_prob=0.3)
    run(original, 7)
    state = json.loads(json.dumps(original.state_dict()))  # survives the checkpoint's JSON
    assert state["sampler"] == "difficulty" and len(state["pass_rate"]) == 11
    expected = run(original, 9)
    resumed = DifficultySampler(11, 3, seed=2, rest_epochs=1, revisit_prob=0.3)
    resumed.load_state_dict(state)
    assert run(resumed, 9) == expected
    assert resumed.state_dict() == original.state_dict()
    with pytest.raises(ValueError, match="seed"):
        DifficultySampler(11, 3, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved by the uniform sampler, not the difficulty one"):
        DifficultySampler(11, 3, seed=2).load_state_dict(PromptSampler(11, 3, seed=2).state_dict())


def test_the_difficulty_order_through_the_prompt_source():
    cfg = load_config(TINY, [f"data.source={GSM8K}", "data.train_size=10", "data.sampler=difficulty",
                             "data.difficulty.rest_epochs=2", "data.difficulty.revisit_prob=0"])
    source = PromptSource(cfg, None, 5)
    drawn = source.next_examples()
    # Groups of 2 (grpo.group_size): the first two prompts solved twice, the next never, the rest once.
    rewards = [1, 1, 1, 1, 0, 0, 1, 0, 0, 1]
    source.observe(drawn, [{"answer_reward": float(r)} for r in rewards])
    assert source.metrics()["sampler/solved_pool"] == 2 and source.metrics()["sampler/unsolved_pool"] == 1
    rested = {ex.index for ex in drawn[:3]}
    later = [ex.index for _ in range(3) for ex in source.next_examples()]  # the rest of epoch 0, then epoch 1
    assert not rested & set(later[5:]), later


def test_a_difficulty_order_says_when_prompts_come_round(caplog):
    """The difficulty order acts from its second pass over the prompts: the log says after how many
    steps, and warns when schedule.steps cannot get there even with every round of dynamic sampling."""
    import logging

    from rlft.roles.prompt_source import note_second_pass

    caplog.set_level(logging.INFO, logger="rlft")
    cfg = load_config(TINY, [f"data.source={GSM8K}", "data.train_size=10", "data.sampler=difficulty",
                             "schedule.steps=3"])
    PromptSource(cfg, None, 5)  # 2 batches a pass, 3 steps: it comes round
    assert "the first pass draws the 10 training prompts once each; prompts rest from the second pass, after 2 steps" \
        in caplog.text and "WARNING" not in caplog.text
    # GSM8K's 7473 training prompts at 32 a step: 233 steps a pass, at least 59 with 4 rounds of dynamic sampling.
    many = load_config(TINY, [f"data.source={GSM8K}", "data.sampler=difficulty", "schedule.steps=58",
                              "grpo.dynamic_sampling=true", "grpo.max_sampling_rounds=4"])
    caplog.clear()
    assert note_second_pass(many, 7473, 32)
    assert ("schedule.steps (58) draws at most 7424 prompts (32 a step x 4 rounds): no prompt comes round, so the "
            "order is the uniform one in effect") in caplog.text
    caplog.clear()
    assert not note_second_pass(load_config(TINY, [f"data.source={GSM8K}", "data.sampler=difficulty", "schedule.steps=59",
                                                   "grpo.dynamic_sampling=true"]), 7473, 32)
    assert "after 233 steps (59 if every step takes all 4 rounds of dynamic sampling)" in caplog.text


def test_the_sampler_settings_are_checked():
    base = [f"data.source={GSM8K}"]
    for overrides, message in [
        (["data.sampler=hardest"], "data.sampler: must be one of uniform, difficulty, got 'hardest'"),
        (["data.sampler=difficulty", "data.difficulty.rest_epochs=-1"], "data.difficulty.rest_epochs: must be >= 0"),
        (["data.sampler=difficulty", "data.difficulty.revisit_prob=1.5"], "data.difficulty.revisit_prob: must be in [0, 1]"),
        (["data.sampler=difficulty", "grpo.group_size=1", "optim.rollout_batch_size=2", "grpo.loss_type=no_baseline"],
         "data.sampler: difficulty rests prompts whose group was all right or all wrong, which a group of one"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(TINY, [*base, *overrides])
        assert str(err.value).startswith(message), (overrides, str(err.value))


def test_sft_is_told_that_it_draws_uniformly():
    from rlft.config import config_warnings

    cfg = load_config(TINY, [f"data.source={GSM8K}", "data.sampler=difficulty"])
    assert any("SFT has no rollouts and draws its rows uniformly" in w for w in config_warnings(cfg, rollouts=False))
    assert not any("SFT" in w for w in config_warnings(cfg, rollouts=True))


@pytest.mark.timeout(120)
def test_a_prompt_order_that_fails_or_hands_out_no_positions_stops_in_one_line(monkeypatch):
    # A plugin's order: before, an empty batch had the step draw for ever, a negative position drew a row
    # from the end of the data, and an exception named nothing of data.sampler.
    from rlft.data.prompt_samplers import PromptSamplerError, SamplerChoice, register_prompt_sampler

    class Broken(PromptSampler):
        def __init__(self, n, batch, seed, hands_out):
            super().__init__(n, batch, seed)
            self.hands_out = hands_out

        def next_batch(self):
            if self.hands_out == "raise":
                raise KeyError("pool")
            return self.hands_out

    monkeypatch.setenv("RANK", "3")
    base = [f"data.source={GSM8K}", "data.train_size=10", "data.sampler=_test_broken"]
    cases = [([], "[]"), ([1, -2, 3], "[1, -2, 3]"), ([1, 2, 10], "[1, 2, 10]"), (None, "None"), ("raise", None)]
    try:
        for hands_out, shown in cases:
            PROMPT_SAMPLERS.pop("_test_broken", None)
            register_prompt_sampler(SamplerChoice("_test_broken", learns_from_rewards=False, description="broken",
                                                  build=lambda n, batch, seed, data: Broken(n, batch, seed, hands_out)))
            source = PromptSource(load_config(TINY, base), None, 3)
            with pytest.raises(PromptSamplerError) as info:
                source.next_examples()
            expected = ("data.sampler _test_broken: next_batch() raised KeyError: 'pool' (rank 3)" if shown is None else
                        f"data.sampler _test_broken: next_batch() returned '{shown}', not a non-empty list of prompt "
                        f"positions in [0, 10) (rank 3)")
            assert str(info.value) == expected
        hands_out = (2, 0, 1)  # a tuple of positions is as good as a list
        PROMPT_SAMPLERS.pop("_test_broken")
        register_prompt_sampler(SamplerChoice("_test_broken", learns_from_rewards=False, description="broken",
                                              build=lambda n, batch, seed, data: Broken(n, batch, seed, hands_out)))
        assert [ex.index for ex in PromptSource(load_config(TINY, base), None, 3).next_examples()] == [2, 0, 1]
    finally:
        PROMPT_SAMPLERS.pop("_test_broken", None)


@pytest.mark.timeout(120)
def test_an_order_that_learns_from_rewards_is_checked_where_it_hears_them_and_reports(monkeypatch):
    # Before, a plugin's observe() that raised surfaced as a traceback from inside the rollout role, and a
    # metrics() key like "loss" silently overwrote the step's own figure in steps.jsonl.
    from rlft.data.prompt_samplers import PromptSamplerError, SamplerChoice, register_prompt_sampler

    class Learning(DifficultySampler):
        fault = None

        def observe(self, positions, pass_rates):
            if self.fault == "observe":
                raise ZeroDivisionError("no groups yet")
            super().observe(positions, pass_rates)

        def metrics(self):
            return self.fault if isinstance(self.fault, (dict, list)) else super().metrics()

    monkeypatch.setenv("RANK", "2")
    base = [f"data.source={GSM8K}", "data.train_size=10", "data.sampler=_test_learning"]
    register_prompt_sampler(SamplerChoice("_test_learning", learns_from_rewards=True, description="learning",
                                          build=lambda n, batch, seed, data: Learning(n, batch, seed)))
    try:
        source = PromptSource(load_config(TINY, base), None, 5)
        drawn = source.next_examples()
        grades = [{"answer_reward": float(r)} for r in [1, 1, 1, 1, 0, 0, 1, 0, 0, 1]]
        source.observe(drawn, grades)  # sound: as the difficulty order
        assert source.metrics()["sampler/solved_pool"] == 2.0
        cases = [("observe", "data.sampler _test_learning: observe() raised ZeroDivisionError: no groups yet (rank 2)"),
                 ({"loss": 0.5}, "data.sampler _test_learning: metrics() returned the key 'loss': its figures are "
                                 "named sampler/... (rank 2)"),
                 ({"sampler/x": float("nan")}, "data.sampler _test_learning: metrics() returned 'nan' for sampler/x, "
                                               "not a finite number (rank 2)"),
                 ({"sampler/x": "many"}, "data.sampler _test_learning: metrics() returned 'many' for sampler/x, "
                                         "not a finite number (rank 2)"),
                 ([1.0], "data.sampler _test_learning: metrics() returned '[1.0]', not a dict (rank 2)")]
        for fault, message in cases:
            source.order.fault = fault
            with pytest.raises(PromptSamplerError) as info:
                source.observe(drawn, grades) if fault == "observe" else source.metrics()
            assert str(info.value) == message
        source.order.fault = {"sampler/x": 3}
        assert source.metrics() == {"sampler/x": 3.0}
    finally:
        PROMPT_SAMPLERS.pop("_test_learning", None)


def test_a_new_prompt_order_is_one_registered_record():
    # An order of the user's (a plugin's register_prompt_sampler call): each epoch the rows backwards.
    from rlft.data.prompt_samplers import SamplerChoice, register_prompt_sampler

    class Backwards(PromptSampler):
        def epoch_order(self, epoch: int) -> list[int]:
            return list(range(self.num_examples))[::-1]

    base = [f"data.source={GSM8K}", "data.train_size=10", "data.sampler=_test_backwards"]
    with pytest.raises(ConfigError, match="^data.sampler: must be one of uniform, difficulty, got '_test_backwards'$"):
        load_config(TINY, base)
    register_prompt_sampler(SamplerChoice("_test_backwards", learns_from_rewards=False, description="backwards",
                                          build=lambda n, batch, seed, data: Backwards(n, batch, seed)))
    try:
        source = PromptSource(load_config(TINY, base), None, 3)
        assert [[ex.index for ex in source.next_examples()] for _ in range(4)] == [
            [9, 8, 7], [6, 5, 4], [3, 2, 1], [9, 8, 7]]  # 10 rows in batches of 3: row 0 left out of each epoch
        with pytest.raises(ValueError, match="'uniform' is already registered"):
            register_prompt_sampler(SamplerChoice("uniform", learns_from_rewards=False, build=None, description=""))
    finally:
        PROMPT_SAMPLERS.pop("_test_backwards")
