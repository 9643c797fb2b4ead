"""The engine's log-probabilities in OpenAI's three shapes: chat's `logprobs.content`, the legacy
completions' parallel lists, and vLLM's `prompt_logprobs`. Each token's entries hold the top-N
and the sampled token, which may rank below N."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperserve.outputs import Logprob, RequestOutput, TokenLogprobs


def top(entries: TokenLogprobs, num: int) -> list[Logprob]:
    return sorted(entries.values(), key=lambda e: e.rank)[:num]


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs], num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        sampled = entries[token_id]
        content.append({
            "token": sampled.decoded_token, "logprob": sampled.logprob,
            "bytes": list(sampled.decoded_token.encode()),
            "top_logprobs": [{"token": e.decoded_token, "logprob": e.logprob,
                              "bytes": list(e.decoded_token.encode())} for e in top(entries, num_top)],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], logprobs: list[TokenLogprobs | None], num_top: int,
                        decode: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs. An entry is None for a prompt's first token, which nothing
    predicts (its text comes from `decode`); `offset`: where the first token starts in the text."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entries in zip(token_ids, logprobs):
        if entries is None:
            tokens.append(decode(token_id))
            values.append(None)
            tops.append(None)
        else:
            sampled = entries[token_id]
            tokens.append(sampled.decoded_token)
            values.append(sampled.logprob)
            tops.append({e.decoded_token: e.logprob for e in top(entries, num_top)})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: its logprob,
    rank and text} for the prompt's own token and the most likely ones."""
    if output.prompt_logprobs is None:
        return None
    return [None if entries is None else {str(token_id): {"logprob": e.logprob, "rank": e.rank,
                                                           "decoded_token": e.decoded_token}
                                          for token_id, e in entries.items()}
            for entries in output.prompt_logprobs]
