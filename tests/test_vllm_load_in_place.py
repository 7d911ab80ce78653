"""Which vLLM models take a weight update straight into their parameters, and which go through
vLLM's layer-wise reload (`rlft.engines.vllm_worker.weights_load_in_place`)."""
import torch
from vllm.model_executor.layers.linear import LinearBase

from rlft.engines.vllm_worker import weights_load_in_place

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")  # device objects only: no GPU needed


class Linear(LinearBase):
    """A vLLM linear layer of 4 inputs and 3 outputs whose ``weight`` holds ``numel`` elements (a
    kernel that repacked the weight elsewhere leaves fewer); built without vLLM's parallel groups."""

    def __init__(self, numel: int):
        torch.nn.Module.__init__(self)
        self.input_size, self.output_size = 4, 3
        self.weight = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)


def model(*numels: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(5, 4), *(Linear(n) for n in numels))


def test_an_unquantised_gpu_model_in_checkpoint_layout_loads_in_place():
    assert weights_load_in_place(model(12, 12), GPU, None)


def test_cpu_engines_quantised_models_and_repacked_weights_take_the_layerwise_reload():
    assert not weights_load_in_place(model(12, 12), CPU, None)  # oneDNN repacks after every load
    assert not weights_load_in_place(model(12, 12), GPU, "fp8")
    assert not weights_load_in_place(model(12, 0), GPU, None)  # one layer's weight lives elsewhere
