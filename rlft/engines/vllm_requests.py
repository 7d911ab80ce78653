"""vLLM requests: a :class:`SamplingSpec` as ``SamplingParams`` (:func:`params_of`), an output as a
:class:`Completion` (:func:`completion_of`, :func:`decode_texts`), and requests that join vLLM's running
batch as they are made (:func:`run_continuous`): a multi-turn episode's next turn goes in the moment its
environment has answered, instead of waiting for every other episode's turn
(:func:`rlft.envs.episodes.run_episodes`; ``VLLMEngine.generate_continuous``).

``LLM.generate`` takes a list of requests and returns when all are done; here ``LLMEngine.add_request``
and ``LLMEngine.step`` drive the same engine, so a follow-up request is scheduled in the very next step
beside the requests still running (continuous batching), and its prompt's cached blocks are reused.
"""
from __future__ import annotations

from collections.abc import Callable

from rlft.engines.base import Completion, SamplingSpec


def decode_texts(tokenizer, completions: list[Completion]) -> None:
    """Fill in the text of completions sampled with ``detokenize=False``: one batched decode, without
    special tokens, as vLLM's own detokenizer writes it (there is no stop string to cut at).

    vLLM's incremental detokenizer holds back text that ends in U+FFFD (an incomplete UTF-8
    character that a later token may complete) and never emits what is still held at the end; so
    a text ending in U+FFFD is cut back to the longest token prefix whose text does not."""
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    for c, text in zip(completions, texts, strict=True):
        k = len(c.token_ids)
        while text.endswith("\ufffd") and k > 0:
            k -= 1
            text = tokenizer.decode(c.token_ids[:k], skip_special_tokens=True)
        c.text = text


def params_of(spec: SamplingSpec, seed: int | None):
    """``spec`` as vLLM's ``SamplingParams`` (``seed``: the request's; its j-th sample gets seed + j)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=spec.n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        min_tokens=spec.min_tokens,
        max_tokens=spec.max_tokens,
        stop=list(spec.stop),
        include_stop_str_in_output=spec.include_stop_str_in_output,
        repetition_penalty=spec.repetition_penalty,
        logprobs=0 if spec.logprobs else None,  # 0: the sampled token's alone
        # vLLM finds stop strings in the text it detokenises as it goes (and refuses stop strings
        # without it); with none, one batched decode afterwards gives the same text for less.
        detokenize=bool(spec.stop),
        seed=seed,
    )


def completion_of(output) -> Completion:
    """vLLM ``CompletionOutput`` -> :class:`Completion`. vLLM reports eos as ``"stop"`` with
    ``stop_reason`` ``None`` (tokenizer eos) or an int (a generation-config eos id)."""
    reason = output.finish_reason
    if reason == "stop" and not isinstance(output.stop_reason, str):
        reason = "eos"
    elif reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with {reason!r} (stop_reason={output.stop_reason!r})")
    logprobs = None
    if output.logprobs is not None:  # one {token id: Logprob} per generated token
        logprobs = [float(position[token].logprob) for position, token in zip(output.logprobs, output.token_ids)]
    return Completion(token_ids=list(output.token_ids), text=output.text, finish_reason=reason, logprobs=logprobs)



def run_continuous(llm, prompt_token_ids: list[list[int]], spec: SamplingSpec,
        follow: Callable[[int, Completion], tuple[list[int], SamplingSpec] | None], adapter: dict) -> None:
    """``spec.n`` completions of each prompt (seeded as ``VLLMEngine.generate`` seeds them), and then whatever
    ``follow`` asks next: ``follow(key, completion)`` receives each completion (key ``i * n + j`` for
    the j-th of prompt i's group, given when the group has finished; a later request keeps its key)
    and returns that key's next request, ``(token_ids, spec with n = 1)``, or None.  A request joins
    the engine's running batch the moment it is made (vLLM's continuous batching), so an episode's
    next turn never waits for another episode's turn; with prefix caching its prompt's blocks from the
    previous turn are reused.  Any exception (from ``follow`` too) aborts the requests still running.
    ``llm``: a ``vllm.LLM``; ``adapter``: ``add_request``'s ``lora_request`` (empty without one)."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    running: dict[str, tuple[int, int, bool]] = {}  # request id -> (first key, n, detokenised by vLLM)
    serial = iter(range(1 << 62))

    def submit(key: int, ids: list[int], s: SamplingSpec, seed: int | None) -> None:
        if not ids:
            raise ValueError(f"request {key} is empty")
        params = params_of(s, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        rid = f"rlft-{key}-{next(serial)}"
        # Outputs carry the id given here (newer vLLMs suffix it inside and return that; unused).
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)), params, **adapter)
        running[rid] = (key, s.n, bool(s.stop))

    try:
        for i, prompt in enumerate(prompt_token_ids):
            submit(i * spec.n, prompt, spec, None if spec.seed is None else spec.seed + i * spec.n)
        while running:
            if not engine.has_unfinished_requests():  # never spin on requests the engine does not hold
                raise RuntimeError(f"vLLM holds none of the {len(running)} requests still awaited "
                                   f"({sorted(running)[:3]} ...)")
            for out in engine.step():
                if not out.finished or out.request_id not in running:
                    continue
                first, n, detokenized = running.pop(out.request_id)
                outputs = sorted(out.outputs, key=lambda o: o.index)
                if len(outputs) != n:
                    raise RuntimeError(f"vLLM finished request {out.request_id} with {len(outputs)} "
                                       f"completions, expected {n}")
                for j, o in enumerate(outputs):
                    completion = completion_of(o)
                    if not detokenized:
                        decode_texts(tokenizer, [completion])
                    nxt = follow(first + j, completion)
                    if nxt is not None:
                        ids, s = nxt
                        if s.n != 1:
                            raise ValueError(f"a follow-up request samples one completion, got n={s.n}")
                        s.validate()
                        submit(first + j, ids, s, s.seed)
    except BaseException:
        if running:
            engine.abort_request(list(running))
        raise
