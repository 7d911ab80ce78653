"""Environments: episodes of one or several turns, where the model may call tools between turns.

* :mod:`rlft.envs.base`        the interface: :class:`Environment` opens an episode
  (:class:`EpisodeStart`: chat messages, tools, state) and answers each turn (:class:`StepResult`:
  messages to append, or the end with an optional reward); :class:`SingleTurnEnvironment`
* :mod:`rlft.envs.registry`    the choices by name (``single_turn``, ``calculator``) or ``module:Class``;
  :func:`make_environment` builds and checks one at start (one-line :class:`EnvironmentSpecError`)
* :mod:`rlft.envs.calculator`  exact, bounded arithmetic on Python's ``ast`` (never eval), the calculator
  tool and :class:`CalculatorEnvironment`
* :mod:`rlft.envs.tool_calls`  reading ``<tool_call>{json}</tool_call>`` calls out of a turn
* :mod:`rlft.envs.episodes`    :func:`run_episodes`, the multi-turn rollout over any engine:
  tokens, model masks, log-probs, caps (:class:`EpisodeResult`)
* :mod:`rlft.envs.batching`    the training batch's response mask restricted to the model's tokens
* :mod:`rlft.envs.metrics`     per-step metrics and readable samples of episodes
"""
