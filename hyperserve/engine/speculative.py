"""Speculative decoding: proposers, and how many tokens each request speculates.

At the end of a step every decoding request may get draft tokens (`Request.spec_token_ids`):
Speculator decides which requests draft and how many, a proposer drafts them.
The next step schedules them as extra tokens to compute, so one target forward pass verifies
every request's drafts beside other requests' prefill chunks and plain decodes; ModelRunner then
accepts or rejects them (rejection_sampler) and the scheduler rolls back what was rejected.

A request that brings a prediction of its answer (`SamplingParams.prediction`, OpenAI's Predicted
Outputs) drafts from it first, wherever its answer stands in it (`predicted_continuation`), with or
without a method.

Proposers:
  NgramProposer   prompt lookup: the continuation of the latest earlier occurrence of the last
                  n tokens (prompt and output, then earlier requests' answers: OutputHistory);
                  no model, no cost
  ModelProposer   a small model run through the same runner machinery, either a separate draft
                  model with its own KV tensors addressed by the target's block tables, or the
                  target's own first layers plus its LM head ("self"), which reads and writes the
                  target's KV for those layers (the verify pass rewrites the drafted slots)
"""

from __future__ import annotations

import array
import functools
import hashlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hyperserve.config import SpeculativeConfig
from hyperserve.engine.model_runner import ModelRunner, SeqChunk
from hyperserve.engine.rejection_sampler import draw
from hyperserve.engine.request import Acceptance, Prediction, Request
from hyperserve.engine.sampler import sampling_probs

if TYPE_CHECKING:
    from hyperserve.engine.kv_cache_manager import KVCacheManager
    from hyperserve.layers.attention import KVCache
    from hyperserve.models.llama import LlamaForCausalLM

PROBE_EVERY = 16  # a request that stopped speculating proposes one token this often, to re-measure
MAX_STEP_DRAFTS = 16  # a grammar's forced tokens or a prediction's drafted per step (17 rows at most)
PREDICTION_NGRAM = 8  # the longest end of an answer looked up in its prediction
# A row's cost where no method timed it: about what AVX2 CPUs measure (0.14-0.31), more than a
# GPU's, so that a prediction the answer does not follow costs little anywhere.
DEFAULT_VERIFY_COST = 0.25


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, V] the draft's distributions; None: deterministic proposals
    acceptance: Acceptance | None = None  # what its verification updates (None: the request's own)
    # where the drafts came from, as /metrics counts them: "text" (the request's own prompt and
    # output), "history" (earlier answers), "draft" or "self" (a model); the engine's "grammar"
    source: str = "text"


def num_tokens_to_propose(acceptance: Acceptance, max_tokens: int, draft_cost: float,
                          verify_cost: float) -> int:
    """The k that maximises expected tokens per unit of cost: with per-token acceptance a, a step
    emits (1 - a^(k+1)) / (1 - a) tokens and costs 1 + k * (draft_cost + verify_cost), where
    verify_cost is what one more token costs a step (ModelRunner.verify_row_cost, measured)."""
    if max_tokens < 1:
        return 0
    a = acceptance.rate
    best_k, best = 0, 1.0
    for k in range(1, max_tokens + 1):
        value = (1 - a ** (k + 1)) / (1 - a) / (1 + k * (draft_cost + verify_cost))
        if value > best:
            best_k, best = k, value
    if best_k == 0 and acceptance.steps_without >= PROBE_EVERY:
        return 1
    return best_k


class Proposer(Protocol):
    draft_cost: float  # one proposed token's cost relative to a target decode step
    # True: propose() is given each request's limit and picks k itself; False: it is given k
    sizes_proposals: bool

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]: ...

    def finished(self, request: Request) -> None:
        """A request's answer is complete (what a proposer may learn from)."""


@functools.lru_cache(maxsize=4096)
def _scope_tag(scope: str) -> int:
    """64 bits of a scope's hash, the top of its OutputHistory keys (0: the empty scope); kept, as
    every lookup of every step asks for its request's."""
    return int.from_bytes(hashlib.blake2b(scope.encode(), digest_size=8).digest()) if scope else 0


class OutputHistory:
    """Earlier requests' answers, looked up beside a request's own text: agents, templated tasks
    and repeated questions write the same phrasing again across requests (the idea
    of SuffixDecoding, arXiv 2411.04975). A window of the latest answers, `capacity` tokens (a
    64th more before the oldest go, whole); each answer follows its prompt's last `ngram_max`
    tokens (so its opening can be drafted) and ends with a separator that no continuation crosses.
    Answers are found only by requests of their own scope (tenant: Request.scope), whose hash is
    part of every key: a shared window, separate indexes.

    Indexed as zlib indexes its window: the latest position after each key (the `ngram_min` tokens
    before it) and, per position, the previous one after the same key. A lookup walks the latest
    few, grows each match backwards and takes the longest. Integers in arrays and a dict of ints:
    nothing for Python's garbage collector to walk, which took 100 ms pauses over an index of
    lists and tuples."""

    SEPARATOR = -1
    POSITIONS_PER_KEY = 8

    def __init__(self, capacity: int, ngram_min: int, ngram_max: int) -> None:
        self.capacity, self.ngram_min, self.ngram_max = capacity, ngram_min, ngram_max
        # matches are grown this far: a repeated answer's run, apart from chance ones
        self.longest = 4 * ngram_max
        self.clear()

    def clear(self) -> None:
        self.tokens = array.array("i")  # the window: tokens[i] is position base + i of all ever added
        self.earlier = array.array("q")  # per position: the previous one after the same key (-1: none)
        self.base = 0
        self.lengths: deque[int] = deque()  # of the answers in the window, oldest first
        self.scopes: deque[str] = deque()  # and their scopes
        self.latest: dict[int, int] = {}  # key -> the latest position after it

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int], scope: str = "") -> None:
        start = self.base + len(self.tokens)
        answer = [*prompt_token_ids[-self.ngram_max:], *output_token_ids]
        earlier = [-1] * (len(answer) + 1)
        keys = self._keys(answer[:-1], scope)  # each position but the last
        for position, key in enumerate(keys, start + self.ngram_min):
            earlier[position - start] = self.latest.get(key, -1)
            self.latest[key] = position
        self.tokens.extend(answer)
        self.tokens.append(self.SEPARATOR)
        self.earlier.extend(earlier)
        self.lengths.append(len(answer) + 1)
        self.scopes.append(scope)
        if len(self.tokens) > self.capacity + self.capacity // 64:
            self._evict()

    def _keys(self, answer: list[int], scope: str) -> list[int]:
        """The key of each position after the first ngram_min tokens, to the end: those tokens
        packed in one integer, above them 64 bits of the scope's hash (none for the empty scope)."""
        n = self.ngram_min
        keys = [_scope_tag(scope)] * (len(answer) - n + 1)
        for j in range(n):
            keys = [(key << 32) | token for key, token in zip(keys, answer[j : len(answer) - n + 1 + j])]
        return keys

    def _evict(self) -> None:
        """Drop the oldest answers (all but the latest) until the window fits `capacity`, and the
        keys whose latest position went with them: work in proportion to what goes."""
        lengths, scopes = [], []
        while len(self.lengths) > 1 and len(self.tokens) - sum(lengths) > self.capacity:
            lengths.append(self.lengths.popleft())
            scopes.append(self.scopes.popleft())
        first, dropped = self.base + sum(lengths), 0
        for length, scope in zip(lengths, scopes):
            answer = self.tokens[dropped : dropped + length - 2].tolist()
            for key in self._keys(answer, scope):  # as add() took them
                if self.latest.get(key, first) < first:
                    del self.latest[key]
            dropped += length
        del self.tokens[:dropped]
        del self.earlier[:dropped]
        self.base = first

    def lookup(self, tokens: list[int], k: int, scope: str = "") -> tuple[int, list[int]]:
        """(match length, up to k tokens that followed it) for the longest match of the suffix of
        `tokens` (ngram_min to `longest` tokens) in the scope's answers, the latest among equals;
        (0, []) if none."""
        if len(tokens) < self.ngram_min:
            return 0, []
        best, best_at, longest = 0, 0, min(self.longest, len(tokens))
        at = self.latest.get(self._keys(tokens[-self.ngram_min:], scope)[0], -1)
        for _ in range(self.POSITIONS_PER_KEY):
            if at < self.base:
                break
            n, i = self.ngram_min, at - self.base
            while n < longest and i - n > 0 and self.tokens[i - n - 1] == tokens[-n - 1]:
                n += 1
            if n > best:
                best, best_at = n, i
            at = self.earlier[i]
        if not best:
            return 0, []
        continuation = self.tokens[best_at : best_at + k].tolist()
        if self.SEPARATOR in continuation:
            continuation = continuation[: continuation.index(self.SEPARATOR)]
        return (best, continuation) if continuation else (0, [])


class NgramProposer:
    """Prompt lookup, with k chosen per proposal from how long the match is: the acceptance of a
    match's continuation rises steeply with its length (SmolLM2, greedy: 2 tokens 43%, 8 or more
    88-92% per drafted token), so one rate per request drafted too much after short matches and
    too little after long ones. Each match length keeps its own acceptance, shared by all requests."""

    draft_cost = 0.0
    sizes_proposals = True

    def __init__(self, ngram_min: int, ngram_max: int, verify_cost: float = 0.0,
                 history_tokens: int = 0) -> None:
        self.ngram_min, self.ngram_max, self.verify_cost = ngram_min, ngram_max, verify_cost
        self.acceptance = {n: Acceptance() for n in range(ngram_min, ngram_max + 1)}
        self.history = OutputHistory(history_tokens, ngram_min, ngram_max) if history_tokens else None
        # earlier answers' matches keep rates of their own, and one for runs as long as `longest`
        # (a repeated answer): they are not the request's own text
        lengths = (*range(ngram_min, ngram_max + 1), self.history.longest) if self.history is not None else ()
        self.history_acceptance = {n: Acceptance() for n in lengths}

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        proposals = []
        for request, limit in zip(requests, num_tokens):
            tokens = request.all_token_ids
            n, continuation = self.lookup(tokens, limit)
            acceptances, source = self.acceptance, "text"
            if self.history is not None:
                # earlier answers of its scope: a longer match wins, over a long own one only a repeated run
                m, earlier = self.history.lookup(tokens, limit, request.scope)
                if m > n and (n < self.ngram_max or m == self.history.longest):
                    # a run between ngram_max and longest shares ngram_max's rate
                    n = m if m <= self.ngram_max or m == self.history.longest else self.ngram_max
                    continuation, acceptances, source = earlier, self.history_acceptance, "history"
            if not continuation:
                proposals.append(Proposal([], None))
                continue
            acceptance = acceptances[n]
            k = num_tokens_to_propose(acceptance, len(continuation), self.draft_cost, self.verify_cost)
            acceptance.steps_without = 0 if k else acceptance.steps_without + 1
            proposals.append(Proposal(continuation[:k], None, acceptance, source))
        return proposals

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """The longest suffix (ngram_max tokens down to ngram_min) that occurred before, and the k
        tokens that followed its latest earlier occurrence; (0, []) if none did. The tokens as
        4-byte integers and bytes.rfind: a few C-speed searches, where NumPy window scans took
        0.35 ms of a 6 ms decode step."""
        data = array.array("i", tokens).tobytes()
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # the latest occurrence that ends before the suffix's last token
            if (at := find_tokens(data, data[-4 * n :], 0, len(tokens) - 1, latest=True)) >= 0:
                return n, tokens[at + n : at + n + k]
        return 0, []

    def finished(self, request: Request) -> None:
        if self.history is not None:
            self.history.add(request.prompt_token_ids, request.output_token_ids, request.scope)


class ModelProposer:
    """Drafts k tokens per request with a small model: first a catch-up pass over the tokens whose
    draft KV is missing (the last sampled token, or the whole prompt the first time), then k - 1
    one-token steps. Draft tokens are sampled with the request's own sampling parameters, so q is
    close to the target's p and acceptance is high."""

    sizes_proposals = False

    def __init__(self, runner: ModelRunner, kv_cache: KVCacheManager, model: LlamaForCausalLM,
                 kv_caches: list[KVCache], shares_target_kv: bool, draft_cost: float) -> None:
        self.runner, self.kv_cache, self.model, self.kv_caches = runner, kv_cache, model, kv_caches
        self.shares_target_kv = shares_target_kv
        self.source = "self" if shares_target_kv else "draft"
        self.draft_cost = draft_cost
        self.generator = torch.Generator(device=runner.device).manual_seed(1234)

    def finished(self, request: Request) -> None:
        """Nothing to learn: a model drafts from its weights."""

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        chunks = []
        for r in requests:
            start = (r.num_computed_tokens if self.shares_target_kv
                     else min(r.draft_num_computed, r.num_computed_tokens))
            chunks.append(SeqChunk(r.all_token_ids[start:], start, self.kv_cache.block_table(r.request_id),
                                   1))
        active = list(range(len(requests)))
        for step in range(max(num_tokens, default=0)):
            logits = self.runner.forward(chunks, self.model, self.kv_caches)
            rows = [(requests[i], drafts[i]) for i in active]
            batch = self.runner.sampling.build(rows)
            greedy, p = sampling_probs(logits, batch)
            greedy = greedy.tolist()
            next_active, chunks = [], []
            for row, i in enumerate(active):
                if requests[i].sampling_params.is_greedy:
                    token = greedy[row]
                else:
                    token = draw(p[row], self.generator)
                    probs[i].append(p[row])
                drafts[i].append(token)
                if step + 1 < num_tokens[i]:
                    r = requests[i]
                    table = self.kv_cache.block_table(r.request_id)
                    chunks.append(SeqChunk([token], r.num_tokens + step, table, 1))
                    next_active.append(i)
            active = next_active
        for r, k in zip(requests, num_tokens):
            r.draft_num_computed = r.num_tokens + k - 1  # d_k itself was never fed
        return [Proposal(d, torch.stack(q) if q else None, source=self.source) for d, q in zip(drafts, probs)]


class Speculator:
    """Which decoding requests get drafts at the end of a step, and how many. A constrained request
    whose grammar forces its next tokens drafts those (`_draft_forced`); a request with a
    prediction drafts from it where its answer follows it (`_draft_predicted`); the others get the
    proposer's drafts. Only forced tokens are drafted while the batch is large: then decode is
    compute-bound and verifying drafts costs about as much as decoding them. `verify_cost`: one
    more token's cost to a step (None: not timed, as without a method)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None, verify_cost: float | None,
                 kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config, self.proposer, self.verify_cost = config, proposer, verify_cost
        self.kv_cache, self.max_model_len = kv_cache, max_model_len
        self.forced_acceptance = Acceptance()  # forced drafts' verifications, apart from any proposer's
        # predictions' drafts by the length of the answer's end they continue (0: the answer's
        # start), as n-gram drafts are, shared by all requests: 0.9 at first from a match of 8 or
        # the start (the caller expects this text), 0.55 from one token (a word replaced, or chance)
        self.prediction_acceptance = [Acceptance(accepted=2 * (0.5 + 0.05 * n if n else 0.9))
                                      for n in range(PREDICTION_NGRAM + 1)]

    def finished(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.finished(request)

    def propose(self, running: list[Request]) -> None:
        """Set each decoding request's spec_token_ids (and the KV slots they need) for the next step."""
        spec, proposer = self.config, self.proposer
        small = len(running) <= spec.speculative_max_batch
        proposing = proposer is not None and small
        if not (small or spec.speculative_forced_tokens):
            return
        decoding = []
        for request in running:
            if request.num_computed_tokens != request.num_tokens - 1:
                continue  # still prefilling
            if spec.speculative_forced_tokens and request.grammar is not None and self._draft_forced(request):
                continue
            if small and request.prediction is not None and self._draft_predicted(request):
                continue
            decoding.append(request)
        if not proposing:
            return
        # A draft model writes its drafts' KV, so their slots come first (and what it did not
        # draft is trimmed); a proposer that sizes its own proposals (a lookup) gets slots after.
        sized_after = proposer.sizes_proposals
        requests, num_tokens = [], []
        for request in decoding:
            k = min(spec.num_speculative_tokens, self._room(request))
            if not sized_after:
                k = num_tokens_to_propose(request.acceptance, k, proposer.draft_cost, self.verify_cost)
            if k > 0 and (sized_after
                          or self.kv_cache.allocate_slots(request.request_id, request.num_tokens + k)):
                requests.append(request)
                num_tokens.append(k)
            else:
                request.acceptance.steps_without += 1
        if not requests:
            return
        for request, proposal in zip(requests, proposer.propose(requests, num_tokens)):
            end = request.num_tokens + len(proposal.token_ids)
            if not sized_after:
                self.kv_cache.trim(request.request_id, end)
            elif proposal.token_ids and not self.kv_cache.allocate_slots(request.request_id, end):
                continue  # the pool is short: no drafts this step
            request.spec_token_ids, request.spec_probs = proposal.token_ids, proposal.probs
            request.spec_acceptance = proposal.acceptance or request.acceptance
            request.spec_source = proposal.source
            request.acceptance.steps_without = 0

    def _room(self, request: Request) -> int:
        """Draft tokens the request may still take: its max_tokens and the context, less the token
        its verification adds."""
        room = self.max_model_len - request.num_tokens
        if request.sampling_params.max_tokens is not None:
            room = min(room, request.sampling_params.max_tokens - request.num_output_tokens - 1)
        return room

    def _draft_predicted(self, request: Request) -> bool:
        """Draft where the request's answer stands in its prediction, k by how often drafts after
        a match of this length were accepted; whether it has drafts (and the KV slots for them)."""
        limit = max(0, min(MAX_STEP_DRAFTS, self._room(request)))
        n, continuation = predicted_continuation(request.prediction, request.output_token_ids, limit)
        if not continuation:
            return False
        acceptance = self.prediction_acceptance[n]
        cost = DEFAULT_VERIFY_COST if self.verify_cost is None else self.verify_cost
        k = num_tokens_to_propose(acceptance, len(continuation), 0.0, cost)
        acceptance.steps_without = 0 if k else acceptance.steps_without + 1
        if not k or not self.kv_cache.allocate_slots(request.request_id, request.num_tokens + k):
            return False
        request.spec_token_ids, request.spec_probs = continuation[:k], None
        request.spec_acceptance = acceptance
        request.spec_source = "prediction"
        return True

    def _draft_forced(self, request: Request) -> bool:
        """Draft the tokens the request's grammar forces next, up to MAX_STEP_DRAFTS; whether it
        has any (and the KV slots for them). They are the grammar's own tokenization of forced
        text: the model may spell it otherwise, and verification then keeps its own tokens."""
        forced = request.grammar.forced_tokens()[: max(0, min(MAX_STEP_DRAFTS, self._room(request)))]
        if not forced or not self.kv_cache.allocate_slots(request.request_id,
                                                          request.num_tokens + len(forced)):
            return False
        request.spec_token_ids, request.spec_probs = forced, None
        request.spec_acceptance = self.forced_acceptance
        request.spec_source = "grammar"
        return True


def predicted_continuation(prediction: Prediction, output: list[int], k: int) -> tuple[int, list[int]]:
    """(n, up to k tokens of the prediction that follow where the answer stands in it). While the
    answer is the prediction's beginning, what follows that (n = 0: the caller's own start, however
    short); else what follows the longest end of the answer, n tokens (PREDICTION_NGRAM down to
    one), found ending past the cursor (one token: within PREDICTION_NGRAM tokens of it), or found
    anywhere (two tokens or more); (0, []) where none is. The cursor moves there, so a prediction
    whose lines repeat is followed in order, and an answer that replaced a word picks the
    prediction up again after it."""
    if len(output) < PREDICTION_NGRAM and prediction.token_ids[: len(output)] == output:
        prediction.cursor = len(output)
        return 0, prediction.token_ids[prediction.cursor : prediction.cursor + k]
    tail = array.array("i", output[-PREDICTION_NGRAM:]).tobytes()
    for n in range(len(tail) // 4, 0, -1):
        end = tail[-4 * n :]
        # an answer that went on along the prediction ends past the cursor
        at = find_tokens(prediction.data, end, max(0, prediction.cursor + 1 - n))
        if n == 1 and at - prediction.cursor >= PREDICTION_NGRAM:
            at = -1  # one token is a word replaced, not text far ahead (a paraphrase's commas)
        if at < 0 and n >= 2:
            at = find_tokens(prediction.data, end, 0)
        if at >= 0:
            prediction.cursor = at + n
            return n, prediction.token_ids[prediction.cursor : prediction.cursor + k]
    return 0, []


def find_tokens(data: bytes, tokens: bytes, start: int, end: int | None = None, latest: bool = False) -> int:
    """The token index where `tokens` occur whole in `data` (both 4-byte integers) first, or
    `latest`, within token positions [start, end); -1 if nowhere. bytes.find and rfind search at C
    speed, a match that straddles token boundaries is skipped."""
    low, high = 4 * start, len(data) if end is None else 4 * end
    search = data.rfind if latest else data.find
    while (at := search(tokens, low, high)) >= 0 and at % 4:
        if latest:
            high = at + len(tokens) - 1
        else:
            low = at + 1
    return at // 4 if at >= 0 else -1


def build_proposer(config: SpeculativeConfig, runner: ModelRunner, kv_cache: KVCacheManager,
                   draft: LlamaForCausalLM | None, verify_cost: float) -> Proposer:
    if config.speculative_method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max, verify_cost, config.ngram_history_tokens)
    target = runner.model
    if config.speculative_method == "self":
        num_layers = target.config.num_hidden_layers
        n = min(config.self_draft_layers or num_layers // 2, num_layers)
        return ModelProposer(runner, kv_cache, target, runner.kv_caches[:n], shares_target_kv=True,
                             draft_cost=_cost(target, n) / _cost(target, num_layers))
    assert draft is not None
    draft_cost = _cost(draft, draft.config.num_hidden_layers) / _cost(target, target.config.num_hidden_layers)
    return ModelProposer(runner, kv_cache, draft, runner.allocate_kv_caches(draft.config),
                         shares_target_kv=False, draft_cost=draft_cost)


def _cost(model: LlamaForCausalLM, num_layers: int) -> float:
    """Weights read per decoded token with the first `num_layers` layers: what a CPU step costs."""
    per_layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return num_layers * per_layer + model.config.vocab_size * model.config.hidden_size  # + the LM head

