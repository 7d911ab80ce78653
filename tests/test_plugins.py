"""`plugins:` the user's modules are imported before the config is checked, so the choices they register
are accepted by name; a plugin that cannot be imported is one config error naming it."""
from __future__ import annotations

import textwrap

import pytest

from rlft.config import ConfigError, build_config

PLUGIN = textwrap.dedent('''
    import torch

    from rlft.grpo import register_policy_loss
    from rlft.reward.formats import AnswerFormat, register_answer_format

    @register_policy_loss("sign_only_{tag}", uses_ratio=False)
    def sign_only(policy_log_probs, *, advantages, **_):
        """-sign(A) * logp: only the direction of each response's advantage."""
        return -torch.sign(advantages) * policy_log_probs, {}

    def _split(response):
        lines = [line for line in response.strip().splitlines() if line.strip()]
        return (bool(lines), lines[-1].strip() if lines else None)

    register_answer_format(AnswerFormat("last_line_{tag}", _split, stop=(), instruction="Answer on the last line.",
                                        sft_target=lambda reasoning, final, cont: reasoning + "\\n" + final,
                                        description="the last line"))
''')


def write_plugin(path, tag: str):
    path.write_text(PLUGIN.replace("{tag}", tag))
    return path


def test_a_plugin_file_makes_its_loss_and_answer_format_known_to_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"^grpo\.loss_type: "):
        build_config({}, ["grpo.loss_type=sign_only_a"])
    plugin = write_plugin(tmp_path / "my_choices.py", "a")
    cfg = build_config({}, [f"plugins=[{plugin}]", "grpo.loss_type=sign_only_a", "reward.answer_format=last_line_a"])
    assert cfg.grpo.loss_type == "sign_only_a" and cfg.reward.answer_format == "last_line_a"
    assert cfg.plugins == [str(plugin.resolve())]
    # A config loaded again (every rank, the launch's checks) does not import it twice.
    again = build_config({"plugins": [str(plugin)]}, ["grpo.loss_type=sign_only_a"])
    assert again.grpo.loss_type == "sign_only_a"


def test_the_plugins_loss_is_the_one_the_maths_computes(tmp_path):
    import torch

    from rlft.grpo import compute_policy_gradient_loss

    build_config({}, [f"plugins=[{write_plugin(tmp_path / 'maths.py', 'b')}]"])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    adv = torch.tensor([[3.0], [-0.1]])
    loss, _ = compute_policy_gradient_loss(logp, "sign_only_b", advantages=adv)
    assert torch.equal(loss, torch.tensor([[1.0, 2.0], [-0.5, -0.25]]))


def test_a_module_name_on_the_path_is_a_plugin(tmp_path, monkeypatch):
    pkg = tmp_path / "team_rl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_plugin(pkg / "choices.py", "c")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config({}, ["plugins=[team_rl.choices]", "grpo.loss_type=sign_only_c"])
    assert cfg.plugins == ["team_rl.choices"]


@pytest.mark.parametrize("entry, message", [
    ("nowhere_to_be_found", r"^plugins\[0\]: cannot import nowhere_to_be_found: ModuleNotFoundError: .*PYTHONPATH"),
    ("./missing_plugin.py", r"^plugins\[0\]: .*missing_plugin\.py is not a file$"),
    ("not a module", r"^plugins\[0\]: 'not a module' is neither a module name"),
])
def test_a_plugin_that_cannot_be_found_is_one_config_error(entry, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"plugins": [entry]})


def test_a_plugin_that_fails_at_import_is_one_line_naming_it(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import math\nraise RuntimeError('no licence key for the reward service')\n")
    with pytest.raises(ConfigError) as e:
        build_config({"plugins": [str(broken)]})
    assert str(e.value) == (f"plugins[0]: importing {broken} failed: RuntimeError: no licence key for the reward "
                            f"service")
    # Nothing of it stays half-imported: fixed, the same file loads.
    broken.write_text("VALUE = 1\n")
    assert build_config({"plugins": [str(broken)]}).plugins == [str(broken)]


def test_a_plugin_whose_import_never_finishes_is_stopped_naming_it(tmp_path, monkeypatch):
    import time

    import rlft.config.plugins as plugins

    monkeypatch.setattr(plugins, "PLUGIN_IMPORT_TIMEOUT_S", 0.5)
    stuck = tmp_path / "waits_for_a_server.py"
    stuck.write_text("import time\nwhile True:\n    try:\n        time.sleep(60)\n    except Exception:\n        pass\n")
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        build_config({"plugins": [str(stuck)]})
    assert time.monotonic() - start < 5
    assert str(e.value) == f"plugins[0]: importing {stuck} did not finish within 0.5 s"
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^plugins\[0\]: importing waits_for_a_server did not finish within 0.5 s$"):
        build_config({"plugins": ["waits_for_a_server"]})
