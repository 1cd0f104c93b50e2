"""Structured outputs with xgrammar: a `StructuredOutput` compiled for the model's tokenizer, off
the engine thread and cached, and the per-row matchers and token bitmask the engine samples
through (docs/design.md, "Structured outputs").

A compile runs on a worker thread, so a large schema never holds up the engine's steps; the
engine keeps a request out of the batch until its grammar is ready. Compiled grammars are kept
in a bounded LRU keyed by the spec (the tokenizer is fixed per engine).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import xgrammar as xgr

from backend.structured_output import CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX, StructuredOutput

COMPILE_THREADS = 4
"""Compiles at once (xgrammar releases the GIL while it compiles, and one compiler serves
several threads, as vLLM's pool uses it): a schema that takes seconds holds one thread, and the
next requests' grammars compile beside it instead of timing out behind it."""


@dataclass(frozen=True)
class GrammarStats:
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF whose only sentences are `choices` (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer; `compile` returns at once with a future."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        cache_size: int,
        disable_any_whitespace: bool = False,
    ) -> None:
        """`disable_any_whitespace`: JSON kinds without free whitespace for every spec."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._disable_any_whitespace = disable_any_whitespace
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="llm-grammar")
        self._stats = GrammarStats()

    @property
    def stats(self) -> GrammarStats:
        return self._stats

    def compile(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The spec's compiled grammar, cached or on its way; a spec that does not compile
        fails its future with ValueError (and is not cached)."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self._stats = _add(self._stats, cache_hits=1)
                return cached
            future = self._worker.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(spec, done))
        return future

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """One request's position in its grammar."""
        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        started = time.perf_counter()
        try:
            compiled = self._build(spec)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            # vLLM converts Lark grammars to EBNF; this server takes EBNF only, and says so to
            # a grammar with no `::=` rule, which vLLM's `grammar_is_likely_lark` reads as Lark.
            lark = spec.kind == GRAMMAR and "::=" not in spec.value
            hint = " (EBNF (GBNF) is expected, not Lark)" if lark else ""
            raise ValueError(f"{spec.kind} does not compile{hint}: {_first_line(exc)}") from None
        finally:
            with self._lock:
                self._stats = _add(
                    self._stats, compiles=1, compile_seconds=time.perf_counter() - started
                )
        return compiled

    def _build(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        any_whitespace = not (spec.disable_any_whitespace or self._disable_any_whitespace)
        if spec.kind == JSON:
            return self._compiler.compile_json_schema(spec.value, any_whitespace=any_whitespace)
        if spec.kind == JSON_OBJECT:
            schema = json.dumps({"type": "object"})
            return self._compiler.compile_json_schema(schema, any_whitespace=any_whitespace)
        if spec.kind == REGEX:
            return self._compiler.compile_regex(spec.value)
        if spec.kind == CHOICE:
            return self._compiler.compile_grammar(choice_grammar(spec.value))
        assert spec.kind == GRAMMAR
        return self._compiler.compile_grammar(spec.value)

    def _forget_failed(self, spec: StructuredOutput, done: Future[xgr.CompiledGrammar]) -> None:
        if done.cancelled() or done.exception() is not None:
            with self._lock:
                if self._cache.get(spec) is done:
                    del self._cache[spec]


class TokenBitmask:
    """The batch's allowed-token bitmask, [slots, ceil(V / 32)] int32, filled per step for the
    constrained rows only and applied to those rows of the sampling logits."""

    def __init__(self, num_slots: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bits = xgr.allocate_token_bitmask(num_slots, vocab_size)

    def fill(self, matchers: list[tuple[int, xgr.GrammarMatcher]]) -> RowMask:
        for row, matcher in matchers:
            matcher.fill_next_token_bitmask(self._bits, row)
        return RowMask(self._bits, [row for row, _ in matchers], self.vocab_size)


@dataclass(frozen=True)
class RowMask:
    """This step's bitmask and the rows it constrains."""

    bits: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """-inf, in place, on the ids the rows' grammars do not allow next.

        On CPU, by 32-id words: a grammar's mask is mostly whole words allowed or refused (in a
        JSON-schema batch, 29 % and 69 % of them), so refused words are filled at once and only
        the few mixed ones are unpacked. xgrammar's CPU kernel visits every id instead: 1.7-1.9
        ms against 0.7 ms for [16, 32000] here (docs/design.md, "Structured outputs"). Its
        kernel stays for CUDA and for a vocabulary that is not a multiple of 32: it refuses a
        bitmask on another device than the logits, and launches on the current device."""
        if logits.device.type != "cpu" or logits.shape[-1] % 32:
            # A blocking copy, as the next step refills `bits` (vLLM copies it over too).
            bits = self.bits[: logits.shape[0]].to(logits.device)
            on_device = torch.cuda.device(logits.device) if logits.is_cuda else nullcontext()
            with on_device:
                xgr.apply_token_bitmask_inplace(
                    logits, bits, vocab_size=self.vocab_size, indices=self.rows
                )
            return
        by_word = logits.view(logits.shape[0], -1, 32)
        rows = torch.tensor(self.rows)
        words = self.bits[rows, : by_word.shape[1]]
        row, word = (words == 0).nonzero(as_tuple=True)
        by_word[rows[row], word] = float("-inf")
        row, word = ((words != 0) & (words != -1)).nonzero(as_tuple=True)
        if row.numel():
            allowed = (words[row, word].unsqueeze(-1) >> _BIT_SHIFTS) & 1
            block = by_word[rows[row], word]
            block.masked_fill_(allowed == 0, float("-inf"))
            by_word[rows[row], word] = block


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
"""Bit i of a bitmask word is id 32 * word + i (xgrammar's layout)."""


def _add(stats: GrammarStats, **deltas: float) -> GrammarStats:
    return replace(stats, **{name: getattr(stats, name) + d for name, d in deltas.items()})


def _first_line(exc: Exception) -> str:
    """xgrammar prefixes a timestamp and a C++ source location: keep the message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, _, message = text.partition(": ")
    return message or text
