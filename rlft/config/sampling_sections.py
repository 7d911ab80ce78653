"""The config's `sampling:` section: the engines' sampling parameters (their defaults are
`rlft.engines.base.SamplingSpec`'s), and each registered engine's own settings, `sampling.<engine name>`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlft.config.errors import ConfigError
from rlft.engines.base import SamplingSpec

_SPEC = SamplingSpec()  # the engines' sampling defaults are the config's

@dataclass
class SamplingConfig:
    # The engines' sampling parameters (vLLM's semantics, and the defaults of
    # rlft.engines.base.SamplingSpec), then what only the run needs.
    # A registered engine (rlft/engines/), or auto: the first one usable for the model and device (vLLM
    # when it is installed and supported, else HF generate), settled at start; config.yaml names it.
    backend: str = "auto"
    temperature: float = _SPEC.temperature
    top_p: float = _SPEC.top_p
    min_tokens: int = _SPEC.min_tokens
    max_tokens: int = _SPEC.max_tokens
    stop: list[str] | None = None  # null = the answer format's (r1_tags: </answer>; boxed, gsm8k: none)
    include_stop_str_in_output: bool = _SPEC.include_stop_str_in_output
    repetition_penalty: float = _SPEC.repetition_penalty
    eval_temperature: float = 0.0  # evaluation is greedy by default
    eval_max_tokens: int | None = None  # None = max_tokens
    # Then each engine's own settings, `sampling.<engine name>: {...}` (vLLM's among them), a section
    # whose dataclass the engine's record declares (rlft.engines.records.Backend.settings): built and
    # checked with the rest when the config is loaded, read by that record alone.

    def __post_init__(self):
        for name, section in engine_sections().items():
            if name not in self.__dict__:
                setattr(self, name, section())

    def __getattr__(self, name: str):
        # A section registered after this object was made (a plugin's engine): its defaults.
        section = engine_sections().get(name) if not name.startswith("_") else None
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        setattr(self, name, section())
        return self.__dict__[name]

    def engine_settings(self) -> dict:
        """Every registered engine's settings section, by engine name."""
        return {name: getattr(self, name) for name in engine_sections()}


def engine_sections() -> dict[str, type]:
    """`sampling.<name>` -> the settings dataclass of the engine of that name, for every registered
    engine that declares one (its record's `settings`)."""
    from rlft.engines.records import BACKENDS

    sections = {name: record.settings for name, record in BACKENDS.items() if record.settings is not None}
    taken = sorted(set(sections) & {f.name for f in dataclasses.fields(SamplingConfig)})
    if taken:
        raise ConfigError(f"sampling.{taken[0]}: an engine named {taken[0]} declares settings, whose section would "
                          f"hide the sampling setting of that name; register the engine under another name")
    return sections
