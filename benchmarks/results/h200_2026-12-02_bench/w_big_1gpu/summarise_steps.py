"""The W-big run's medians, from its steps.jsonl, by the function rlft.bench itself uses (the run was
cut before the bench wrote its own bench.json)."""
import json
import sys

from rlft.bench import metrics

steps = metrics.read_steps(sys.argv[1])
# random-1.5b: 1,543,714,304 parameters, 28 layers, hidden 1536, bf16; W-big: 64 x 8 sequences
s = metrics.summarise_steps(steps, params=1543714304, num_layers=28, hidden_size=1536, weight_bytes=2 * 1543714304,
                            sequences_per_step=512, peak_flops=790e12, passes=1.0)
json.dump(s, sys.stdout, indent=1, default=str)
