"""InputProcessor: a request's prompt and sampling parameters checked against the model before
the engine takes it. SamplingParams checks what it can alone; this checks what needs the model
(its vocabulary, context and tokenizer), and bounds every list a client sends, so that no
request costs the engine more than its own tokens. It touches no engine state: the server runs
it in a worker thread, before the request reaches the engine's loop."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from hyperserve.engine.structured_output import GrammarCompiler
from hyperserve.sampling_params import SamplingParams

MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS_ENTRIES = 16, 4096, 64, 1024


class ContextLengthError(ValueError):
    """The prompt (or prompt plus requested output) does not fit the model's context."""


@dataclass(frozen=True)
class InputProcessor:
    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int
    max_model_len: int  # prompt and output together
    grammars: GrammarCompiler

    def process_prompt(self, prompt: str | list[int],
                       truncate: int | None = None) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids; `truncate`: keep only its last
        this many tokens."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            text, ids = prompt, self.tokenizer(prompt).input_ids
        else:
            text, ids = None, list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if truncate is not None and len(ids) > truncate:
            text, ids = None, ids[-truncate:]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt is {len(ids)} tokens long; this model's context is "
                f"{self.max_model_len} tokens (max_model_len), prompt and output together"
            )
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        """Token ids in the vocabulary, lists within their bounds, and a grammar that compiles
        (compiled once: the engine's request takes it from the cache)."""
        vocab = self.vocab_size
        if len(params.stop) > MAX_STOP_STRINGS or sum(len(s) for s in params.stop) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        if len(params.allowed_token_ids or ()) > vocab:
            raise ValueError(f"allowed_token_ids takes at most the vocabulary's {vocab} ids")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"{name}: token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def prediction_ids(self, prediction: str | list[int] | None) -> list[int] | None:
        """A prediction's token ids (text tokenized without special tokens, as an answer's are), at
        most the context long; None for none."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prediction as token ids")
            ids = self.tokenizer(prediction, add_special_tokens=False).input_ids
        else:
            ids = list(prediction)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prediction: token ids must be integers in [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prediction is {len(ids)} tokens long, more than this model's context of "
                             f"{self.max_model_len} tokens")
        return ids or None
