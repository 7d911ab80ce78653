"""Build-time packaging that pyproject.toml cannot express: the DeepSpeed JSON configs live at the
top level (ds_configs/, beside launch/, where users edit them), and a wheel carries them as the
package data rlft/ds_configs/*.json, where an installed rlft finds them (rlft/ds_configs.py)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithDeepSpeedConfigs(build_py):
    """build_py, plus ds_configs/*.json mapped to rlft/ds_configs/*.json in the build."""

    def run(self):
        super().run()
        for source in sorted((HERE / "ds_configs").glob("*.json")):
            target = Path(self.build_lib) / "rlft" / "ds_configs" / source.name
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))


setup(cmdclass={"build_py": BuildWithDeepSpeedConfigs})
