"""Structured output: each constrained sequence carries a grammar matcher; every step, the rows it
samples get a token bitmask (1 = allowed) that the sampler applies before choosing.

The grammar engine is llguidance: it computes each step's mask lazily from the grammar's lexer
and an Earley parser over the tokenizer's trie (10-150 µs per mask for SmolLM2's 49k tokens), so
a new schema costs milliseconds rather than an ahead-of-time pass over the vocabulary, and its
wheel has no dependencies to pin (xgrammar's requires its own torch). It reads JSON schemas,
regexes, Lark and (through its converter) llama.cpp's GBNF.

JSON is constrained to one layout, `{"key": value, "key": [1, 2]}` (what `json.dumps` writes):
with free whitespace small models can pad a document with newlines until max_tokens. Objects whose
schema lists properties but does not say `additionalProperties` get none, as in OpenAI's strict
mode, and unbounded integers stay within ±(2^53 - 1) (`strict_schema`): the answer has the shape the
schema describes (still valid for the schema as written), and small models do not invent keys or
digits until max_tokens.

Masks are computed in a worker thread while the forward pass runs (llguidance releases the GIL).
For speculative decoding a draft row's mask is the grammar's state after the drafts before it;
rows after a draft the grammar rejects (or an EOS) get any mask, since no token is taken from them.

A reasoning model's constraint waits for its thinking (`Thinking`): rows inside it get any mask, and
the matcher starts at the token after </think>.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import llguidance
import llguidance.hf
import torch

from hyperserve.sampling_params import StructuredOutputs, Thinking

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar's text
CACHED_GRAMMARS = 256
MAX_SAFE_INTEGER = 2**53 - 1
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Phase(enum.Enum):
    """Where a reasoning model's output stands against its constraint (StructuredOutputs.thinking)."""

    MAY_THINK = "may_think"  # the first token: <think>, or the constrained answer's first token
    THINKING = "thinking"  # free text up to </think>
    ANSWER = "answer"  # the constraint applies


@dataclass(eq=False)
class Grammar:
    """One sequence's position in its grammar, after the thinking that a reasoning model may do
    first (free text, with the matcher left at its start until </think>)."""

    matcher: llguidance.LLMatcher
    eos_token_id: int | None  # the end token the grammar allows once complete
    thinking: Thinking | None = None
    phase: Phase = Phase.ANSWER

    def __post_init__(self) -> None:
        if self.thinking is not None:
            self.phase = Phase.THINKING if self.thinking.open else Phase.MAY_THINK

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (then the matcher
        is in its error state for good)."""
        before, self.phase = self.phase, self._after(self.phase, token_id)
        if before is Phase.THINKING or self.phase is Phase.THINKING:
            return True
        return self.matcher.consume_token(token_id)

    def _after(self, phase: Phase, token_id: int) -> Phase:
        """The phase after `token_id`; the matcher consumes it unless either phase is THINKING."""
        if phase is Phase.THINKING:
            return Phase.ANSWER if token_id == self.thinking.end_id else Phase.THINKING
        if phase is Phase.MAY_THINK and token_id == self.thinking.start_id:
            return Phase.THINKING
        return Phase.ANSWER

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows nothing but, from here (none while the model may think)."""
        if self.phase is not Phase.ANSWER or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()

    @property
    def is_finished(self) -> bool:
        """Nothing can follow but the end: the sequence may stop here."""
        return self.phase is Phase.ANSWER and self.matcher.is_stopped()

    def fill_masks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row..first_row + len(drafts): the mask after each prefix of the drafts (all
        allowed while thinking)."""
        consumed, phase = 0, self.phase
        for j in range(len(drafts) + 1):
            row = bitmask[first_row + j]
            if phase is not Phase.THINKING:
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
                if phase is Phase.MAY_THINK:
                    start = self.thinking.start_id
                    row[start // 32] |= _bit(start % 32)
            if j == len(drafts):
                break
            token, before = drafts[j], phase
            phase = self._after(phase, token)
            if before is Phase.THINKING or phase is Phase.THINKING:
                continue
            if token == self.eos_token_id:  # the sequence ends there (and rollback does not count an EOS)
                break
            if not (int(row[token // 32]) >> (token % 32)) & 1 or not self.matcher.consume_token(token):
                break  # verification stops at this draft: later rows keep their all-allowed mask
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)


def _bit(position: int) -> int:
    """Bit `position` of an int32 mask word, as the signed value torch stores."""
    return -(2**31) if position == 31 else 1 << position


class GrammarCompiler:
    """Turns StructuredOutputs into matchers, compiling each distinct constraint once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    @cached_property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (its token trie); built once, ~0.3 s."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this model has none")
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id)

    def compile(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        """The constraint's compiled matcher, at the start; ValueError saying why if it cannot be
        (whatever the converters raise on hostile input: deep nesting, malformed grammars)."""
        try:
            key = constraint.key
        except (ValueError, RecursionError) as error:
            raise ValueError(f"cannot read the constraint: {error}") from error
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        if len(key[1]) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {key[0]} constraint is {len(key[1])} characters; at most {MAX_GRAMMAR_CHARS}")
        try:
            matcher = llguidance.LLMatcher(self.llg_tokenizer, _grammar(*key), log_level=0)
        except ValueError:
            raise
        except Exception as error:
            raise ValueError(f"cannot compile the {key[0]} constraint: {type(error).__name__}: {error}") from error
        if matcher.is_error():
            raise ValueError(f"cannot compile the {key[0]} constraint: {matcher.get_error()}")
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def grammar(self, constraint: StructuredOutputs) -> Grammar:
        return Grammar(self.compile(constraint).deep_copy(), self.eos_token_id, constraint.thinking)

    def start_masks(self, rows: list[tuple[Grammar | None, list[int]]]) -> Future | None:
        """Bitmasks [len(rows), ceil(V / 32)] int32 for rows (a grammar or None, and the drafts
        before the row), computed in the background; None when no row is constrained. Rows of one
        sequence are consecutive, first its own row, then one per draft."""
        if not any(grammar is not None for grammar, _ in rows):
            return None
        return self._masks.submit(self._fill, rows)

    def _fill(self, rows: list[tuple[Grammar | None, list[int]]]) -> torch.Tensor:
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for i, (grammar, drafts) in enumerate(rows):
            if grammar is not None and not drafts:  # a sequence's first row: fill it and its drafts' rows
                num_drafts = 0
                while i + num_drafts + 1 < len(rows) and rows[i + num_drafts + 1][0] is grammar:
                    num_drafts += 1
                grammar.fill_masks(bitmask, i, rows[i + num_drafts][1])
        return bitmask


def strict_schema(schema: Any) -> Any:
    """The JSON schema the grammar enforces: additionalProperties false wherever properties are
    listed and it is unset, and integers without bounds kept to I-JSON's interoperable range
    (±(2^53 - 1)), so a model cannot write digits until max_tokens. Both are subsets of what
    the schema allows."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) if key not in ("const", "enum", "default", "examples") else value
              for key, value in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    if strict.get("type") == "integer":
        if "minimum" not in strict and "exclusiveMinimum" not in strict:
            strict["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in strict and "exclusiveMaximum" not in strict:
            strict["maximum"] = MAX_SAFE_INTEGER
    return strict


def _grammar(kind: str, text: str) -> str:
    """llguidance's grammar text for a constraint."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(json.loads(text)), overrides=JSON_LAYOUT)
    if kind == "regex":  # \d, \w and \s as ASCII classes, as JSON schema patterns read them
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(text, 'dw')}/")
    try:
        return llguidance.grammar_from(kind, text)
    except ValueError as error:
        raise ValueError(f"cannot read the grammar: {error}") from error

