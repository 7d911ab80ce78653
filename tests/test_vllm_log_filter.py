"""vLLM's "Failed to load weights" warning is dropped only for layers an update cannot name."""
import logging

import torch

from rlft.engines.vllm_worker import ExpectedUnloadedFilter, layers_without_own_weights


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2))


class LMHead(torch.nn.Module):
    def __init__(self, weight=None):
        super().__init__()
        self.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(3, 2))


class Toy(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(3, 2)
        self.rotary = Rotary()
        self.proj = torch.nn.Linear(2, 2)
        self.lm_head = LMHead(self.embed.weight if tied else None)


def record(name: str) -> logging.LogRecord:
    return logging.LogRecord("vllm.reload", logging.WARNING, __file__, 1, "%s: Failed to load weights", (name,), None)


def test_tied_head_and_buffer_only_layers_are_expected_unloaded():
    tied = layers_without_own_weights(Toy(tied=True))
    assert {"Rotary", "LMHead"} <= tied and not {"Embedding", "Linear"} & tied
    untied = layers_without_own_weights(Toy(tied=False))
    assert "Rotary" in untied and "LMHead" not in untied


def test_the_filter_drops_only_those_layers_warnings():
    f = ExpectedUnloadedFilter(layers_without_own_weights(Toy(tied=True)))
    assert not f.filter(record("Rotary")) and not f.filter(record("LMHead"))
    assert f.filter(record("Linear"))  # a real layer that missed its weights still warns
    other = logging.LogRecord("vllm.reload", logging.WARNING, __file__, 1, "something else %s", ("Rotary",), None)
    assert f.filter(other)


def test_while_an_update_is_partial_every_layer_left_out_is_expected():
    f = ExpectedUnloadedFilter(layers_without_own_weights(Toy(tied=True)))
    f.partial = True
    assert not f.filter(record("Linear")) and not f.filter(record("Rotary"))
    f.partial = False
    assert f.filter(record("Linear"))
