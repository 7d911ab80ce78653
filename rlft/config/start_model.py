"""The starting checkpoint (`output.init_checkpoint`): refused, with how to make it, when it names no
model.  Checked by `rlft.config.launch_plan` before any rank starts and by every GRPO rank again; torch-free."""
from __future__ import annotations

from pathlib import Path

from rlft.common import looks_like_hub_id
from rlft.config.schema import ConfigError
from rlft.config.hub_cache import check_hub_model
from rlft.models.loading import DEFAULT_MODEL, ModelPathError, check_model_dir

SFT_CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"


def sft_hint(path: str) -> str:
    """How to make the starting checkpoint `path`: the SFT config that writes it, where one does."""
    import yaml

    for config in sorted(SFT_CONFIGS.glob("sft_*.yaml")):
        out = ((yaml.safe_load(config.read_text()) or {}).get("output") or {}).get("dir")
        if out and Path(out, "model") == Path(path):
            return (f"make it with supervised fine-tuning first: `bash launch/sft.sh launch/configs/{config.name}` "
                    f"(writes {path}), or point output.init_checkpoint at any HF model (a hub id or a local model "
                    f"directory), or set it to null to start from model.path")
    parent = Path(path).parent if Path(path).name == "model" else Path(path)
    return (f"make it with supervised fine-tuning first: `bash launch/sft.sh SFT_CONFIG output.dir={parent}` (writes "
            f"{parent}/model), or point output.init_checkpoint at any HF model (a hub id or a local model directory), "
            f"or set it to null to start from model.path")


def check_init_checkpoint(path: str | None) -> None:
    """Refuse an `output.init_checkpoint` that names no model, saying how to make one.

    Passes: None (start from model.path), a complete HF model directory, a .gguf file, the offline
    default model's name, and hub ids (`org/name`, unless a local directory `org` exists, which
    means a local path was meant) that are cached or to be had from the hub.  Raises ConfigError
    otherwise."""
    if path is None or path == DEFAULT_MODEL:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        try:
            check_model_dir(p)
        except ModelPathError as e:
            raise ConfigError(f"output.init_checkpoint: {e}; {sft_hint(path)}") from None
        return
    if p.is_file():
        if p.suffix == ".gguf":
            return
        raise ConfigError(f"output.init_checkpoint: {path} is a file, not a model directory or a .gguf; "
                          f"{sft_hint(path)}")
    if looks_like_hub_id(path):
        check_hub_model(path, "output.init_checkpoint")
        return
    raise ConfigError(f"output.init_checkpoint: {path} does not exist; {sft_hint(path)}")
