"""The engine on one device and dtype, checked against transformers: the GPU check's stage 3.

Each check compares with a computation outside the engine and returns its figures and `ok`
rather than raising, so one failure does not hide the others:
- greedy tokens equal transformers' `generate` on the same device and dtype (bf16 near-ties
  apart, as below);
- sampled, top-k and explicit-id logprobs within `ATOL` of a float64 forward on CPU
  (tests/reference.py), asked only of float32: bf16 logits are themselves further off;
- 16 concurrent requests give each one's tokens alone (and, in float32, its logprobs), bf16
  near-ties apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend import default_model
from backend.engine import Engine
from backend.model_runner import ModelRunner, resolve_dtype
from backend.outputs import StepOutput, merge_outputs
from backend.params import GenerationParams
from tests.reference import reference_greedy, reference_logprobs, tokenizer
from tests.sinks import RecordingSink

ATOL = 1e-4
BF16_TIE_MARGIN = 0.25
"""Nats: a bf16 greedy choice closer than this may flip with the batch (check_concurrent)."""
CONCURRENT = 16
EXPLICIT_IDS = [0, 5, 17, 999]
WAIT_S = 60.0


def run_requests(engine: Engine, requests: list[GenerationParams]) -> list[StepOutput]:
    """Submit all at once; each request's outputs merged into one."""
    sinks = [RecordingSink() for _ in requests]
    for params, sink in zip(requests, sinks, strict=True):
        engine.submit(params, sink)
    for sink in sinks:
        if not sink.done.wait(WAIT_S):
            raise TimeoutError(f"a request did not finish in {WAIT_S:.0f} s")
        if sink.error is not None:
            raise RuntimeError(sink.error)
    return [merge_outputs(sink.outputs) for sink in sinks]


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    """Starts of the memorised passage (long, confident continuations) and random ids."""
    passage = tokenizer(model_dir)(default_model.PASSAGE)["input_ids"]
    rng = np.random.default_rng(0)
    vocab = len(tokenizer(model_dir))
    return [
        passage[: 3 + 2 * i] if i % 2 == 0 else rng.integers(0, vocab, 2 + 5 * i).tolist()
        for i in range(count)
    ]


def _divergence(reference: list[int], out: StepOutput) -> tuple[int, float] | None:
    """None if `out` starts with `reference`; else the step where they part and `out`'s top-2
    logprob margin there."""
    for step, (expected, token) in enumerate(zip(reference, out.token_ids, strict=False)):
        if expected != token:
            return step, float(out.top_logprobs[step, 0] - out.top_logprobs[step, 1])
    return None


def check_greedy(
    engine: Engine,
    model_dir: Path,
    prompt_list: list[list[int]],
    max_tokens: int,
    tie_margin: float,
) -> dict[str, Any]:
    """Engine greedy vs `generate` on the same device and dtype, up to the first EOS `generate`
    stops at; a parting at a near-tie (see check_concurrent) is counted apart."""
    runner = engine.runner
    requests = [
        GenerationParams(
            prompt_ids=p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2
        )
        for p in prompt_list
    ]
    outputs = run_requests(engine, requests)
    margins: list[float] = []
    for params, out in zip(requests, outputs, strict=True):
        expected = reference_greedy(
            model_dir, params.prompt_ids, max_tokens, str(runner.device), runner.dtype
        )
        parting = _divergence(expected, out)
        if parting is not None:
            margins.append(parting[1])
    mismatches = sum(m >= tie_margin for m in margins)
    return {
        "requests": len(requests),
        "mismatches": mismatches,
        "near_tie_mismatches": len(margins) - mismatches,
        "mismatch_margins": margins,
        "ok": mismatches == 0,
    }


def check_logprobs(
    engine: Engine, model_dir: Path, prompt_list: list[list[int]], max_tokens: int, top_k: int = 5
) -> dict[str, Any]:
    """Sampled (temperature 1, seeded), top-k and explicit-id logprobs vs a float64 forward.

    Top-k is checked by value: the returned ids' logprobs are the reference's at those ids, and
    they are the reference's k largest (a near-tie may order ids differently, not values).
    """
    requests = [
        GenerationParams(
            prompt_ids=p,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            logprobs=top_k,
            logprob_token_ids=EXPLICIT_IDS,
        )
        for i, p in enumerate(prompt_list)
    ]
    outputs = run_requests(engine, requests)
    worst = {"sampled": 0.0, "top_k": 0.0, "explicit": 0.0}
    for params, out in zip(requests, outputs, strict=True):
        ref = reference_logprobs(model_dir, params.prompt_ids, out.token_ids)
        steps = np.arange(len(out.token_ids))
        top_values = -np.sort(-ref, axis=1)[:, :top_k]
        errors = {
            "sampled": out.logprobs - ref[steps, out.token_ids],
            "top_k": np.concatenate(
                [
                    out.top_logprobs - np.take_along_axis(ref, out.top_ids.astype(np.int64), 1),
                    out.top_logprobs - top_values,
                ]
            ),
            "explicit": out.token_id_logprobs - ref[:, EXPLICIT_IDS],
        }
        for name, error in errors.items():
            worst[name] = max(worst[name], float(np.abs(error).max()))
    return {
        "requests": len(requests),
        **{f"worst_{name}": value for name, value in worst.items()},
        "ok": max(worst.values()) <= ATOL,
    }


def check_concurrent(
    engine: Engine, prompt_list: list[list[int]], max_tokens: int, tie_margin: float
) -> dict[str, Any]:
    """All requests in one batch vs each alone: the same tokens and logprobs.

    A batch changes the order of reductions; in float32 that moves logprobs far below ATOL, in
    bf16 by up to ~0.1, which can flip a greedy choice whose top-2 margin (alone) is smaller. So a
    divergence at a step whose margin is below `tie_margin` (0 in float32) is counted apart, as a
    near-tie, and the logprobs are compared up to the first divergence, against ATOL in float32.
    """
    requests = [
        GenerationParams(
            prompt_ids=p,
            max_tokens=max_tokens + i % 4,  # rows leave the batch at different steps
            temperature=0.0,
            ignore_eos=True,
            logprobs=2,
        )
        for i, p in enumerate(prompt_list)
    ]
    alone = [run_requests(engine, [params])[0] for params in requests]
    together = run_requests(engine, requests)
    margins: list[float] = []  # alone, at each request's first divergence
    worst = 0.0
    for one, many in zip(alone, together, strict=True):
        parting = _divergence(many.token_ids, one)
        end = len(one.token_ids) if parting is None else parting[0]
        if parting is not None:
            margins.append(parting[1])
        if end:
            worst = max(worst, float(np.abs(many.logprobs[:end] - one.logprobs[:end]).max()))
    divergences = sum(m >= tie_margin for m in margins)
    return {
        "requests": len(requests),
        "divergences": divergences,
        "near_tie_divergences": len(margins) - divergences,
        "divergence_margins": margins,
        "worst_logprob_difference": worst,
        "ok": divergences == 0 and (worst <= ATOL or tie_margin > 0),
    }


def check_engine(model_dir: Path, device: str, dtype: str, quick: bool) -> dict[str, Any]:
    """Every check on one engine; `dtype` as `ModelRunner` takes it."""
    runner = ModelRunner(str(model_dir), device=device, dtype=dtype, max_num_seqs=CONCURRENT)
    engine = Engine(runner)
    engine.start()
    max_tokens = 8 if quick else 24
    try:
        is_fp32 = resolve_dtype(dtype, torch.device(device)) == torch.float32
        tie_margin = 0.0 if is_fp32 else BF16_TIE_MARGIN
        results: dict[str, Any] = {
            "greedy": check_greedy(engine, model_dir, prompts(model_dir, 4), max_tokens, tie_margin)
        }
        if is_fp32:
            results["logprobs"] = check_logprobs(
                engine, model_dir, prompts(model_dir, 4), max_tokens
            )
        results["concurrent"] = check_concurrent(
            engine, prompts(model_dir, CONCURRENT), max_tokens, tie_margin
        )
    finally:
        engine.stop()
    return results
