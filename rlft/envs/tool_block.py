"""Tools offered to a chat template that does not write them.

Chat models that were trained to call tools have a template that renders ``apply_chat_template(...,
tools=[...])`` into their prompt (Qwen2.5's ``# Tools`` system block).  Many templates take the argument
and drop it (SmolLM2's, and most models tuned without tools): the model would never see the tools it is
offered, and a tool run would train on episodes in which no call can be right.  Where the template
drops them, rlft writes the tools into the system message itself, in the ``<tools>`` /
``<tool_call>`` convention the calls are read in (`rlft/envs/tool_calls.py`), and gives the template
no ``tools``; the opening and every later turn's replies are rendered through :func:`template_input`,
so the prompt and the reply tokens agree.
"""
from __future__ import annotations

import json
from typing import Sequence

from rlft.common import log

_PROBE_NAME = "rlft_probe_tool"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "a probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_WRITES_TOOLS: dict[str, bool] = {}  # chat template text -> whether it writes the tools it is given


def template_writes_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template writes the tools it is given (a probe tool's name appears in
    its rendering of a one-message conversation); remembered per template text."""
    key = repr(getattr(tokenizer, "chat_template", None))
    if key not in _WRITES_TOOLS:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"}], tools=[_PROBE_TOOL],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails on tools does not write them
            text = ""
        _WRITES_TOOLS[key] = _PROBE_NAME in text
        if not _WRITES_TOOLS[key]:
            log.info("the chat template does not write the tools it is offered: rlft describes them in the "
                     "system message (<tools> ... </tools>, calls as <tool_call>{json}</tool_call>)")
    return _WRITES_TOOLS[key]


def tools_block(tools: Sequence[dict]) -> str:
    """The tools described in the ``<tools>`` / ``<tool_call>`` convention, one JSON spec a line."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call the functions below to help with the user's request. Their signatures "
            f"are inside <tools></tools>:\n<tools>\n{specs}\n</tools>\n\nTo call one, write a JSON object with "
            "its name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_input(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None) -> tuple[list[dict], list | None]:
    """``(messages, tools)`` as ``apply_chat_template`` should get them: unchanged where there are no
    tools or the template writes them; otherwise the tools block appended to the first system message
    (one is put first where there is none) and no ``tools``."""
    messages = list(messages)
    if not tools or template_writes_tools(tokenizer):
        return messages, (list(tools) if tools else None)
    block = tools_block(tools)
    if messages and messages[0].get("role") == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages, None
