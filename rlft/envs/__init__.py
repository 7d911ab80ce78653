"""Environments: episodes of one or several turns, where the model may call tools between turns.

    base.py        the interface: Environment opens an episode (EpisodeStart: chat messages, tools,
                   state) and answers each turn (StepResult: messages to append, or the end with an
                   optional reward); SingleTurnEnvironment
    registry.py    the choices by name (single_turn, calculator, tools) or module:Class; make_environment
                   builds and checks one at start (one-line EnvironmentSpecError)
    tools.py       Tool: one tool's record (name, JSON schema, run within time and size limits, reply
                   format); tool_from_function (a typed, documented function), TOOLS, run_tool_call
    tool_environment.py  ToolEnvironment: the model calls any of a list of tools, dispatched by name
    guard.py       every environment's calls bounded: a deadline per call, a cap on a reply's size
    calculator.py  exact, bounded arithmetic on Python's ast (never eval), the calculator tool and
                   CalculatorEnvironment (the tool environment with it)
    tool_calls.py  reading <tool_call>{json}</tool_call> calls out of a turn
    tool_block.py  tools described in the system message for a chat template that drops them
    episodes.py    run_episodes, every rollout over any engine (one turn or several): tokens, response
                   masks, log-probs, caps (EpisodeResult); the batch takes the masks (build_rollout_batch's
                   response_mask), so the loss sees only the model's tokens
    rollouts.py    RolloutRow (example, prompt, episode) and play_rows: the one row training,
                   evaluation and SFT targets read
    metrics.py     per-step metrics and readable samples of episodes (calls, well-formed, void turns)
    turns.py       what a turn is: a call, an answer, or void (neither); well-formed calls
    traces.py      sft.solution_form: GSM8K's <<expr=result>> annotations as tool calls answered by the
                   environment's tool (tool_calls), or stripped on the same rows (plain_checked)
    rollout_options.py  environment.void_turns, reward.tool_reward, environment.demonstrations: their
                   records, the void-turn mask, the capped well-formed-call reward, the config checks
    demonstrations.py  a worked tool episode before the question, annealed to none over N steps
    sft_targets.py SFT targets holding tool calls and <tool_response> replies, tokenised as the episode
                   they describe (the replies as the chat template's tokens, out of the loss)
"""
