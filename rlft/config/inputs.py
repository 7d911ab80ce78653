"""The run's inputs, checked at launch where the ranks found them only after loading a model.

* the data (:func:`check_data_source`): a ``data.source`` path that does not exist; a dataset
  directory without the train or eval split (a typo in ``data.train_split``/``data.eval_split``,
  the splits it has named); a split whose file holds no row at all; a parquet file without the
  question column; a ``reasoning_gym:`` task or option the generator does not know;
* the environment (:func:`check_environment_builds`): built with its options and one probe episode
  opened, as every rank will (an unknown option, a constructor or ``open`` that fails or hangs);
* the model directory (:func:`check_model_files`): no tokenizer files, weights that cannot be read
  (a safetensors file whose header is not one, an index naming files that are not there);
* the trackers (:func:`check_trackers`): Weights & Biases online without credentials;
* the output directory (:func:`check_output_dir`): a file, under a file, or where nothing may be written.

Each raises :class:`~rlft.config.ConfigError` with one line naming the key.  Nothing here imports torch.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from rlft.common import unwritable_directory
from rlft.config.schema import ConfigError, RunConfig

# Any of these makes a directory's tokenizer loadable (fast tokenizer, sentencepiece, BPE / WordPiece vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def _split_names(directory: Path) -> list[str]:
    names = set()
    for base in (directory, directory / "main"):
        for p in base.glob("*"):
            if p.suffix in (".jsonl", ".parquet", ".csv"):
                names.add(p.stem.split("-")[0] if p.suffix == ".parquet" else p.stem)
    return sorted(names)


def _parquet_rows_and_columns(path: Path) -> tuple[int, list[str]]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path)
    return meta.metadata.num_rows, list(meta.schema_arrow.names)


def _check_split_file(d, key: str, split: str, file: Path) -> None:
    """A split file with rows, and (parquet) the mapped columns."""
    if file.stat().st_size == 0 and key != "data.train_split":  # the training rows' own check names that one
        raise ConfigError(f"{key}: the {split!r} split of {d.source} is an empty file ({file})")
    if file.suffix != ".parquet":
        if key == "data.eval_split":
            _check_eval_rows(d, split, file)
        return  # .jsonl / .csv: their first rows' fields are read by rlft.data.rows.check_local_fields
    try:
        rows, columns = _parquet_rows_and_columns(file)
    except Exception as err:  # noqa: BLE001 - any unreadable file: one line
        raise ConfigError(f"data.source: {file} cannot be read as parquet ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:160]})") from None
    if rows == 0:
        raise ConfigError(f"{key}: the {split!r} split of {d.source} has no rows ({file})")
    if d.adapter is None:
        for field in ("question", "gold"):
            name = getattr(d.fields, field)
            if name not in columns:
                raise ConfigError(f"data.fields.{field}: {file} has no column {name!r}; its columns are: "
                                  f"{', '.join(columns) or 'none'}")


def _check_eval_rows(d, split: str, file: Path) -> None:
    """The eval split's first rows hold at least one usable problem (the training rows have their own
    check): an evaluation of none fails on the evaluator's rank after the models are loaded."""
    from collections import Counter

    from rlft.data.rows import RowMapping, first_rows

    rows = first_rows(file)
    if rows is None:
        return
    reader, skipped = RowMapping.of(d).reader(str(file)), Counter()
    try:
        if any(reader.example(row, i, skipped) is not None for i, row in enumerate(rows)):
            return
    except ValueError:
        return  # an adapter's own error: check_local_fields names it
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or f"{len(rows)} rows, none a JSON object"
    raise ConfigError(f"data.eval_split: none of the first {len(rows)} rows of the {split!r} split ({file}) is a usable "
                      f"problem (skipped: {reasons})")


def check_data_source(cfg: RunConfig) -> None:
    """The data source exists and holds both splits with rows (see the module docstring)."""
    from rlft.common import looks_like_hub_id
    from rlft.data.rows import is_generated
    from rlft.data.sources import split_files

    d = cfg.data
    if is_generated(d.source):
        check_generated_source(d.source)
        return
    path = Path(d.source).expanduser()
    if not path.exists():
        if looks_like_hub_id(d.source):
            return  # the hub: checked where it is fetched
        raise ConfigError(f"data.source: {d.source} does not exist (expected a .jsonl/.parquet/.csv file, a dataset "
                          f"directory holding {d.train_split} and {d.eval_split} splits, a hub id like "
                          f"'openai/gsm8k', gsm_symbolic or reasoning_gym:TASK)")
    if path.is_file():
        _check_split_file(d, "data.source", path.stem, path)
        return
    for key, split in (("data.train_split", d.train_split), ("data.eval_split", d.eval_split)):
        files = split_files(path, split)
        if not files:
            have = _split_names(path)
            raise ConfigError(f"{key}: no {split!r} split in {path} (expected {split}.jsonl, {split}.parquet, "
                              f"{split}-*.parquet or {split}.csv); it has: {', '.join(have) or 'no split files'}")
        _check_split_file(d, key, split, files[0])


def check_generated_source(source: str) -> None:
    """A ``reasoning_gym:TASK?options`` source whose task and options the generator takes (one problem
    is generated); ``gsm_symbolic`` is rlft's own default and passes."""
    from rlft.data.generated import GSM_SYMBOLIC, parse_reasoning_gym_source

    try:
        task, options = parse_reasoning_gym_source(source)
    except ValueError as err:
        raise ConfigError(f"data.source: {err}") from None
    if task == GSM_SYMBOLIC and not options:
        return
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.source: {source} needs the package reasoning_gym, which is not installed") from None
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **options)
    except Exception as err:  # noqa: BLE001 - an unknown task or option: one line
        text = " ".join(str(err).split())[:200]
        raise ConfigError(f"data.source: reasoning_gym refuses task {task!r} with options {options} "
                          f"({type(err).__name__}: {text})") from None


def check_environment_builds(cfg: RunConfig) -> None:
    """The environment is built with its options and opens a probe episode, as on every rank."""
    from rlft.data.prompts import prompt_of
    from rlft.envs.registry import EnvironmentSpecError, make_environment

    e = cfg.environment
    try:
        make_environment(e.name, prompt_of(cfg), e.options, tools=e.tools)
    except EnvironmentSpecError as err:
        raise ConfigError(f"environment.options: {err}" if "could not be built" in str(err)
                          else f"environment.name: {err}") from None


def _weights_readable(path: Path) -> str | None:
    """Why the weights in ``path`` cannot be read, or None."""
    for index in sorted(path.glob("*.index.json")):
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is not a weight index (no weight_map)"
        missing = sorted(n for n in names if not (path / n).is_file())
        if missing:
            return f"{index.name} names {len(missing)} missing file(s): {', '.join(missing[:3])}"
    for file in sorted(path.glob("*.safetensors")):
        try:
            with open(file, "rb") as f:
                raw = f.read(8)
                (size,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
                if size is None or size > min(_MAX_SAFETENSORS_HEADER, file.stat().st_size - 8):
                    return f"{file.name} is not a safetensors file (its header is cut or missing)"
                json.loads(f.read(size))
        except (OSError, ValueError) as err:
            return f"{file.name} cannot be read ({type(err).__name__})"
    for file in sorted(path.glob("pytorch_model*.bin")):
        if file.stat().st_size == 0:
            return f"{file.name} is empty"
    return None


def check_model_files(spec: str, key: str) -> None:
    """A local model directory has tokenizer files and weights that can be read."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        return
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}: {spec} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): save the "
                          f"tokenizer with the model (tokenizer.save_pretrained)")
    why = _weights_readable(path)
    if why:
        raise ConfigError(f"{key}: the weights in {spec} cannot be read: {why}")


def check_gguf_file(spec: str, key: str) -> None:
    """A ``.gguf`` model file starts with GGUF's magic (a download that went wrong is an HTML page)."""
    try:
        with open(Path(spec).expanduser(), "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ConfigError(f"{key}: {spec} cannot be read ({type(err).__name__})") from None
    if magic != b"GGUF":
        raise ConfigError(f"{key}: {spec} is not a GGUF file (it does not start with 'GGUF', but {magic!r})")


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = (os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_trackers(cfg: RunConfig) -> None:
    """Weights & Biases online needs credentials (WANDB_API_KEY or `wandb login`'s netrc entry):
    without them, rank 0 would stop at its first report."""
    r = cfg.reporting
    if "wandb" in r.trackers and r.wandb_mode == "online" and not _has_wandb_credentials():
        raise ConfigError("reporting.wandb_mode: online, but no Weights & Biases credentials here (WANDB_API_KEY "
                          "or `wandb login`): log in, or use reporting.wandb_mode=offline and `wandb sync` later")


def check_sft_examples(cfg: RunConfig) -> None:
    """SFT: the first rows of a local training file hold at least one usable pair (a worked solution
    the run's prompt can turn into a target); the ranks would refuse it only after loading the model."""
    from collections import Counter

    from rlft.data.prompts import format_sft_target, prompt_of
    from rlft.data.rows import RowMapping, first_rows, is_generated
    from rlft.data.sources import split_files

    d = cfg.data
    path = Path(d.source).expanduser()
    if is_generated(d.source) or not path.exists():
        return
    files = [path] if path.is_file() else split_files(path, d.train_split)
    rows = first_rows(files[0]) if files else None
    if not rows:
        return  # other files, or none: the training rows' own check names them
    reader, skipped, prompt = RowMapping.of(d).reader(str(files[0])), Counter(), prompt_of(cfg)
    for index, row in enumerate(rows):
        example = reader.example(row, index, skipped)
        if example is None:
            continue
        if example.solution and format_sft_target(example.solution, prompt) is not None:
            return
        skipped["no_solution"] += 1
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items()))
    raise ConfigError(f"data.source: no usable SFT example in the first {len(rows)} rows of {files[0]} (skipped: "
                      f"{reasons}); rows need a worked solution ending in '#### <number>' (data.fields.gold with "
                      f"data.fields.gold_kind gsm8k or boxed)")


def check_output_dir(cfg: RunConfig) -> None:
    """``output.dir`` can be made and written: not a file, under no file, in a writable directory."""
    out = Path(cfg.output.dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {cfg.output.dir} is a file, not a directory: name a directory for the run")
    problem = unwritable_directory(cfg.output.dir)
    if problem is not None:
        raise ConfigError(f"output.dir: {problem}")
