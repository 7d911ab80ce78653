"""One rank of an rlft launch, for launchers that start a script rather than a module:
`python launch/rank.py rlft.train_grpo --config X.yaml ...` runs like `python -m rlft.train_grpo ...`.
DeepSpeed's slurm launcher (`srun ... python SCRIPT`) is one; launch/_launch.sh picks it."""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this file belongs to
    sys.path.remove(str(Path(__file__).resolve().parent))  # not launch/ itself
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
