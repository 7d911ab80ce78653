"""The policy's DeepSpeed JSON: the templates in ds_configs/ (a checkout) or inside an installed
wheel, a config's own JSON (`deepspeed_config`), and the values the YAML overrides in them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlft.config import ConfigError, load_config
from rlft.roles.policy import CHECKOUT_DS_CONFIGS, deepspeed_config, ds_config_dir

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = ["pipeline_bf16.json", "pipeline_fp32.json"]


def test_a_checkout_reads_the_templates_beside_launch():
    assert CHECKOUT_DS_CONFIGS == REPO / "ds_configs" and ds_config_dir() == CHECKOUT_DS_CONFIGS
    assert sorted(p.name for p in ds_config_dir().glob("*.json")) == TEMPLATES
    cfg = load_config(None, ["optim.train_micro_batch_size=4", "optim.grad_clip=0.5", "model.activation_checkpointing=true"])
    ds = deepspeed_config(cfg, bf16=True, gradient_accumulation_steps=7)
    assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"] == {"stage": 1}
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (4, 7, 0.5)
    assert ds["pipeline"]["activation_checkpoint_interval"] == 1
    assert "bf16" not in deepspeed_config(cfg, bf16=False, gradient_accumulation_steps=1)


def test_a_config_may_name_its_own_json(tmp_path):
    own = tmp_path / "zero0.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 0}, "gradient_clipping": 9.0, "steps_per_print": 5}))
    cfg = load_config(None, [f"deepspeed_config={own}", "optim.grad_clip=2.0"])
    ds = deepspeed_config(cfg, bf16=True, gradient_accumulation_steps=4)  # its own JSON, whatever the dtype
    assert ds["zero_optimization"] == {"stage": 0} and ds["steps_per_print"] == 5 and "bf16" not in ds
    assert ds["gradient_clipping"] == 2.0 and ds["gradient_accumulation_steps"] == 4  # the YAML's values win
    assert ds["pipeline"] == {"activation_checkpoint_interval": 0}
    with pytest.raises(ConfigError, match=r"deepspeed_config: cannot read .*missing.json as JSON"):
        load_config(None, [f"deepspeed_config={tmp_path / 'missing.json'}"])
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="deepspeed_config: .*list.json must hold a JSON object, got list"):
        load_config(None, [f"deepspeed_config={tmp_path / 'list.json'}"])
    # JSON, like YAML, keeps the last of a key written twice: the first one's setting would vanish.
    (tmp_path / "twice.json").write_text('{"zero_optimization": {"stage": 0}, "steps_per_print": 5, '
                                         '"zero_optimization": {"stage": 1}}')
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"deepspeed_config={tmp_path / 'twice.json'}"])
    assert str(err.value) == (f"deepspeed_config: cannot read {tmp_path / 'twice.json'} as JSON (the key "
                              f"'zero_optimization' is written twice in one object (the second would silently "
                              f"replace the first))")


def test_an_installed_wheel_carries_the_templates_and_finds_them(tmp_path):
    # Build the wheel from a copy of this checkout's sources (setuptools leaves build/ behind) --
    # setup.py maps ds_configs/ into the package -- then unpack it elsewhere and ask that copy of
    # rlft where its templates are.
    src = tmp_path / "src"
    for name in ("rlft", "ds_configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("rlft-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert sorted(n for n in z.namelist() if n.endswith(".json")) == [f"rlft/ds_configs/{t}" for t in TEMPLATES]
        z.extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    found = subprocess.run([sys.executable, "-c", "from rlft.roles.policy import ds_config_dir; "
                            "d = ds_config_dir(); print(d); print(sorted(p.name for p in d.glob('*.json')))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    where, names = found.stdout.splitlines()
    assert Path(where) == tmp_path / "site" / "rlft" / "ds_configs" and names == str(TEMPLATES)


def test_deepspeeds_muon_module_is_imported_without_inductors_compiler():
    """DeepSpeed's ZeRO check imports its Muon module, whose import-time ``torch.compile`` wrappers import
    inductor's compiler (1 to 2 s of CPU per policy rank).  rlft imports the module first with dynamo off:
    the compiler stays unloaded, the functions stay plain, the environment is as it was, and
    ``torch.compile`` still wraps functions afterwards.  In a fresh interpreter, as a rank is."""
    code = """
import os, sys
import torch, transformers.masking_utils, deepspeed
from rlft.roles.policy import import_deepspeed_muon_uncompiled
os.environ["TORCHDYNAMO_DISABLE"] = "0"
import_deepspeed_muon_uncompiled()
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
print("compiler loaded:", "torch._inductor.compile_fx" in sys.modules)
print("plain function:", type(original_muon.muon_update).__name__)
print("environment:", os.environ["TORCHDYNAMO_DISABLE"])
f = lambda x: x + 1
print("wraps after:", torch.compile(f) is not f, "torch._inductor.compile_fx" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-4:] == ["compiler loaded: False", "plain function: function", "environment: 0",
                                           "wraps after: True True"], out.stdout
