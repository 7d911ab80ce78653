"""Whether a hub id (`org/name`) can be had before any rank tries: the local Hugging Face cache,
offline mode, and one short question to the hub.  Standard library only: `rlft.config.launch_plan` runs
it before torch or transformers are loaded.

A rank that loads an id the cache lacks while offline, or that cannot reach the hub, retries for a
minute and fails with a long traceback, leaving its output directory behind; `check_hub_model`
says so in one line instead."""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from rlft.config.schema import ConfigError

HUB_TIMEOUT_S = 10.0  # one question to the hub; a rank would retry for a minute
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps its downloads (`HF_HUB_CACHE`, `HF_HOME/hub`, or the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def cached_snapshot(hub_id: str) -> Path | None:
    """The cached snapshot of model `hub_id` holding a `config.json` (the `main` one first), else None."""
    repo = hub_cache_dir() / f"models--{hub_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    main = repo / "refs" / "main"
    candidates = [snapshots / main.read_text().strip()] if main.is_file() else []
    candidates += sorted(snapshots.glob("*")) if snapshots.is_dir() else []
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def offline_variable() -> str | None:
    """The variable that puts the hub libraries offline (`HF_HUB_OFFLINE=1`, ...), or None."""
    return next((v for v in _OFFLINE_VARIABLES if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")),
                None)


def check_hub_model(hub_id: str, key: str) -> None:
    """ConfigError (one line, naming `key`) when model `hub_id` is neither cached nor to be had from
    the hub: offline mode, an id the hub does not know (401/404), or a hub that cannot be reached."""
    if cached_snapshot(hub_id) is not None:
        return
    variable = offline_variable()
    if variable is not None:
        raise ConfigError(f"{key}: {hub_id} is not in the local Hugging Face cache ({hub_cache_dir()}) and {variable}="
                          f"{os.environ[variable]} keeps it from being downloaded: download it first (`hf download "
                          f"{hub_id}`), or give a local model directory")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    request = urllib.request.Request(f"{endpoint}/api/models/{hub_id}", method="HEAD",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=HUB_TIMEOUT_S):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 404):
            raise ConfigError(f"{key}: {hub_id} is no model the Hugging Face hub ({endpoint}) knows (HTTP {e.code}): "
                              f"check the id, set HF_TOKEN for a private model, or give a local model "
                              f"directory") from None
        return  # the hub answered otherwise (busy, rate-limited): the ranks' download will say
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConfigError(f"{key}: {hub_id} is not in the local Hugging Face cache ({hub_cache_dir()}) and the hub "
                          f"({endpoint}) cannot be reached ({' '.join(str(reason).split())}): download it where the "
                          f"hub can be reached, or give a local model directory") from None
