"""Speculative decoding against plain decoding: identical greedy tokens, the target's distribution
when sampling, and no KV left behind by rejected tokens."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hyperserve import LLM, SamplingParams
from hyperserve.engine import model_runner, rejection_sampler
from hyperserve.engine.speculative import NgramProposer, OutputHistory
from tests.conftest import DEVICES, EXACT, assert_same_outputs, tiny_config

NUM_BLOCKS = 200


# ---- the real model: greedy output is token-identical ---------------------------------------

@pytest.fixture(scope="module")
def grounded_prompts(smollm2_tokenizer, chat_prompt_ids):
    """Input-grounded requests (the output repeats the input, so prompt lookup hits) and open chat."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3
    grounded = [
        [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}],
        [{"role": "user",
          "content": "Copy this sentence: The quick brown fox jumps over the lazy dog. " * 3}],
    ]
    ids = [list(smollm2_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)) for m in grounded]
    return ids + chat_prompt_ids[:3]


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(num_kv_blocks=NUM_BLOCKS, max_model_len=1024, **EXACT)


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [{"method": "ngram", "num_tokens": 5},
                                         {"method": "self", "num_tokens": 3, "num_layers": 28}],
                         ids=["ngram", "self"])
def test_greedy_output_is_identical_with_speculation(speculative, plain_llm, grounded_prompts):
    params = [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=37),
        SamplingParams(temperature=0, max_tokens=40, stop=["\n"]),
    ]
    expected = plain_llm.generate(grounded_prompts, params, use_tqdm=False)
    llm = LLM(num_kv_blocks=NUM_BLOCKS, max_model_len=1024,
              speculative={**speculative, "max_batch": 8, "verify_cost": 0.1}, **EXACT)
    outputs = llm.generate(grounded_prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, expected, logprobs_of=1, tolerance=1e-3)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0, "speculation should have been accepted at least once"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts should have been rejected"
    assert sum(o.metrics.num_draft_tokens for o in outputs) == stats.num_draft_tokens
    assert llm.engine.kv_cache.num_free_blocks == NUM_BLOCKS


# ---- a tiny random model: the sampled distribution is the target's --------------------------

VOCAB = 6
PROMPT = [1, 3, 0, 1, 3, 0, 1]  # repeats, so prompt lookup proposes too


def _exact_joint(hf_model, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """The target's probability of every continuation of `length` tokens, by enumeration."""
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=length):
            logits = hf_model(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1 :]
            probs = torch.softmax(logits.float(), dim=-1)
            joint[seq] = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
    return joint


def _sampled_joint(llm: LLM, num_samples: int, length: int) -> dict[tuple[int, ...], float]:
    params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, n=num_samples, seed=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    counts: dict[tuple[int, ...], float] = {}
    for c in out.outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1 / num_samples
    return counts


def _total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(key, 0) - q.get(key, 0)) for key in set(p) | set(q))


@pytest.fixture
def tiny_target(save_hf_model, tmp_path_factory):
    """A random target and, saved beside it, a draft: the target's first layer and its LM head
    scaled by 3, so q is close to a sharpened p (accepted often, different enough to matter)."""
    hf_model, path = save_hf_model(tiny_config("llama", vocab_size=VOCAB), seed=1)
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1)
    with torch.no_grad():
        draft.lm_head.weight.mul_(3)
    draft_dir = str(tmp_path_factory.mktemp("draft"))
    draft.save_pretrained(draft_dir)
    return hf_model, path, draft_dir


def _speculative_llm(path: str, speculative: dict, device: str = "cpu") -> LLM:
    return LLM(model=path, num_kv_blocks=2048, block_size=4, max_model_len=64, max_num_seqs=512,
               device=device, dtype="float32", max_num_batched_tokens=4096,
               speculative={"num_tokens": 3, "max_batch": 10**6, "verify_cost": 0.1, **speculative})


LENGTH, SAMPLES = 3, 3000


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_follow_the_targets_distribution(method, device, tiny_target):
    hf_model, path, draft_dir = tiny_target
    speculative = {"method": method, "model": draft_dir} if method == "draft" else {"method": method}
    llm = _speculative_llm(path, speculative, device)
    tv = _total_variation(_sampled_joint(llm, SAMPLES, LENGTH), _exact_joint(hf_model, PROMPT, LENGTH))
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # 216 outcomes, 3000 samples: sampling noise alone gives a TV near 0.06; naive acceptance 0.4.
    assert tv < 0.12, f"total variation {tv:.3f} from the target's distribution"
    assert llm.engine.kv_cache.num_free_blocks == 2048


def test_the_distribution_test_catches_naive_acceptance(tiny_target, monkeypatch):
    """Accepting a draft whenever it is the target's most likely token (instead of the rejection
    rule) skews the distribution; the test above must see it, or it proves nothing."""
    hf_model, path, draft_dir = tiny_target

    def naive(target_probs, draft_token_ids, draft_probs, generator):
        emitted = []
        for i, draft in enumerate(draft_token_ids):
            if draft != int(target_probs[i].argmax()):
                emitted.append(rejection_sampler.draw(target_probs[i], generator))
                return emitted
            emitted.append(draft)
        return emitted + [rejection_sampler.draw(target_probs[len(draft_token_ids)], generator)]

    monkeypatch.setattr(model_runner, "verify_sampled", naive)
    llm = _speculative_llm(path, {"method": "draft", "model": draft_dir})
    tv = _total_variation(_sampled_joint(llm, SAMPLES, LENGTH), _exact_joint(hf_model, PROMPT, LENGTH))
    assert tv > 0.12


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_output_is_identical_with_a_draft_model(device, tiny_target):
    _, path, draft_dir = tiny_target
    prompts = [PROMPT, [5, 4, 3, 2, 1, 0, 5, 4], [2] * 20, list(range(6)) * 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 17, 25)]
    params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5))
    plain = LLM(model=path, num_kv_blocks=256, block_size=4, max_model_len=64, device=device, dtype="float32")
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = _speculative_llm(path, {"method": "draft", "model": draft_dir}, device)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    for out, ref in zip(outputs[:3], expected):
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert [v.logprob for v in got.values()] == \
                pytest.approx([v.logprob for v in want.values()], abs=1e-4)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.kv_cache.num_free_blocks == 2048


# ---- pieces --------------------------------------------------------------------------------

def test_ngram_proposes_the_continuation_of_the_latest_match():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    assert proposer.lookup([5, 6, 7, 8, 1, 5, 6, 7, 9, 5, 6, 7], 2) == (3, [9, 5])  # latest of two matches
    assert proposer.lookup([1, 2, 3, 4], 3) == (0, [])  # no earlier occurrence of any suffix
    assert proposer.lookup([4, 1, 2, 9, 9, 2], 4) == (1, [9, 9, 2])  # falls back to the 1-gram "2"


def test_ngram_drafts_as_far_as_the_match_length_has_been_accepted():
    """Each match length has its own acceptance, learned from verification: a long match that was
    copied through gets long drafts, a short one that was not gets none (or a probe now and then)."""
    from hyperserve.engine.request import Request
    from hyperserve.sampling_params import SamplingParams

    copy = list(range(100, 120))
    proposer = NgramProposer(ngram_min=2, ngram_max=8, verify_cost=0.3)
    history = copy + [1, 2] + copy[:8]  # the last 8 tokens occurred before
    long_match = Request("long", history, SamplingParams(), 0.0)
    short_match = Request("short", [7, 8, 50, 51, 7, 8], SamplingParams(), 0.0)  # only "7 8" did
    for _ in range(20):  # what verification would report: long matches copied through, short ones not
        proposer.acceptance[8].observe(16, 16)
        proposer.acceptance[2].observe(2, 0)
    long_proposal, short_proposal = proposer.propose([long_match, short_match], [16, 16])
    assert long_proposal.token_ids == history[8:24] and long_proposal.acceptance is proposer.acceptance[8]
    assert short_proposal.token_ids == [] and short_proposal.acceptance is proposer.acceptance[2]
    proposer.acceptance[2].steps_without = 16
    assert proposer.propose([short_match], [16])[0].token_ids == [50]  # a probe of the short match

def test_a_lookup_takes_kv_slots_only_for_the_drafts_it_proposes(tiny_target):
    """Slots for n-gram drafts are allocated after the lookup, for its proposal's length: taking
    them for the most drafts a step allows (16) and trimming allocated and freed a block at most
    steps, and a short pool could refuse drafts that fit."""
    _, path, _ = tiny_target
    llm = _speculative_llm(path, {"method": "ngram", "num_tokens": 16})
    engine, asked, checked = llm.engine, [], []
    allocate, propose = engine.kv_cache.allocate_slots, engine.speculator.propose

    def spy(request_id, num_tokens, prefix=None):
        asked.append(num_tokens)
        return allocate(request_id, num_tokens, prefix)

    def proposing(running) -> None:  # what Speculator.propose asks the pool for, against what it proposed
        asked.clear()
        engine.kv_cache.allocate_slots = spy
        try:
            propose(running)
        finally:
            engine.kv_cache.allocate_slots = allocate
        for request in engine.scheduler.running:
            checked.append(all(n <= request.num_tokens + len(request.spec_token_ids) for n in asked))

    engine.speculator.propose = proposing
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # repeats: lookups find matches
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert checked and all(checked)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0


def test_ngram_lookup_matches_a_plain_search_on_random_tokens():
    """Against the obvious search, on short alphabets (many partial matches) and ids whose bytes
    repeat (0, 256, 65536: a byte search could match across token boundaries)."""
    def reference(tokens: list[int], k: int, shortest: int, longest: int) -> list[int]:
        for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):
                if tokens[start : start + n] == tokens[-n:]:
                    return tokens[start + n : start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        shortest = rng.randint(1, 3)
        longest = rng.randint(shortest, 5)
        alphabet = rng.choice([[0, 1], [0, 1, 2, 3, 4], [0, 256, 65536, 1], list(range(20))])
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 5)
        found = NgramProposer(shortest, longest).lookup(tokens, k)[1]
        assert found == reference(tokens, k, shortest, longest)


def test_history_drafts_what_followed_the_longest_match_in_earlier_answers():
    history = OutputHistory(capacity=1000, ngram_min=2, ngram_max=4)
    history.add([1, 2, 3], [10, 11, 12, 13])
    history.add([4, 5, 6], [20, 10, 11, 14, 15])
    # the longer match, not the latest; no separator
    assert history.lookup([7, 2, 3, 10, 11], 5) == (4, [12, 13])
    assert history.lookup([9, 10, 11], 5) == (2, [14, 15])  # equally long: the latest
    assert history.lookup([0, 4, 5, 6], 2) == (3, [20, 10])  # an answer's opening, after its prompt's end
    assert history.lookup([10, 99], 3) == (0, [])
    history.add([1, 2, 3], [30, 31], scope="tenant a")  # found by its own scope's lookups alone
    assert history.lookup([2, 3], 2, "tenant a") == (2, [30, 31])
    assert history.lookup([2, 3], 2) == (2, [10, 11])
    assert history.lookup([2, 3], 2, "tenant b") == (0, [])


def test_history_lookup_matches_a_plain_search_as_its_window_slides():
    """Against the obvious search over the window it keeps (the latest 8 occurrences of the last
    ngram_min tokens in answers of the lookup's scope, each grown backwards as far as it matches,
    up to `longest`), while answers of three scopes are added and the oldest evicted."""
    def reference(history: OutputHistory, tokens: list[int], k: int, scope: str) -> tuple[int, list[int]]:
        window, n_min = history.tokens.tolist(), history.ngram_min
        owner = [s for length, s in zip(history.lengths, history.scopes) for _ in range(length)]
        ends = [i for i in range(n_min, len(window))
                if window[i - n_min : i] == tokens[-n_min:] and owner[i] == scope
                and OutputHistory.SEPARATOR not in window[i - n_min : i + 1]]
        ends = ends[-OutputHistory.POSITIONS_PER_KEY:]
        best, best_at = 0, 0
        for i in reversed(ends):
            n = n_min
            while n < min(history.longest, len(tokens)) and i - n > 0 and window[i - n - 1] == tokens[-n - 1]:
                n += 1
            if n > best:
                best, best_at = n, i
        continuation = window[best_at : best_at + k] if best else []
        if OutputHistory.SEPARATOR in continuation:
            continuation = continuation[: continuation.index(OutputHistory.SEPARATOR)]
        return (best, continuation) if continuation else (0, [])

    rng = random.Random(0)
    for _ in range(200):
        history = OutputHistory(capacity=rng.choice([20, 60, 400]), ngram_min=rng.randint(1, 3), ngram_max=4)
        alphabet = rng.choice([[0, 1, 2], list(range(6)), list(range(30))])
        for _ in range(30):
            history.add([rng.choice(alphabet) for _ in range(rng.randint(0, 6))],
                        [rng.choice(alphabet) for _ in range(rng.randint(0, 25))], rng.choice(["", "a", "b"]))
            bound = history.capacity + history.capacity // 64
            assert len(history.tokens) <= bound or len(history.lengths) == 1
            assert sum(history.lengths) == len(history.tokens)
            assert min(history.latest.values(), default=history.base) >= history.base  # no key left behind
            tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 20))]
            k, scope = rng.randint(1, 6), rng.choice(["", "a", "b"])
            assert history.lookup(tokens, k, scope) == reference(history, tokens, k, scope)


def test_a_repeated_request_is_drafted_from_its_earlier_answer(tiny_target):
    """The same prompt again: its answer is drafted from the first one's (whole runs accepted),
    and the tokens are those of plain decoding; without history the repeat gains nothing."""
    _, path, _ = tiny_target
    prompts = [[1, 2, 3, 4, 5, 0], [5, 4, 3, 2, 1, 0], [2, 2, 4, 4, 1, 1]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _speculative_llm(path, {"method": "ngram", "num_tokens": 16})
    plain.engine.config.speculative.speculative_max_batch = 0  # no drafts: the reference tokens
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    accepted = {}
    for history_tokens in (0, 4096):
        llm = _speculative_llm(path, {"method": "ngram", "num_tokens": 16, "history_tokens": history_tokens})
        rounds = []
        for _ in range(2):
            stats = llm.engine.scheduler.spec_stats
            before = stats.num_accepted_tokens
            outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            assert [o.outputs[0].token_ids for o in outputs] == expected
            rounds.append(stats.num_accepted_tokens - before)
        accepted[history_tokens] = rounds
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.pool.num_blocks
    assert accepted[4096][1] > 1.4 * accepted[0][1]  # measured: 77 against 49 of 117 tokens
    # asked again by another tenant (cache_salt): drafted from its own text alone, as without history
    engine = llm.engine
    by_source = engine.scheduler.spec_stats.by_source
    assert by_source["history"][1] > 0 and by_source["text"][1] > 0  # /metrics' by-source counts
    before = engine.scheduler.spec_stats.num_accepted_tokens
    for i, prompt in enumerate(prompts):
        engine.add_request(f"other-{i}", prompt, params, cache_salt="another tenant")
        while not (done := [o for o in engine.step() if o.finished]):
            pass
        assert done[0].outputs[0].token_ids == expected[i]
    # measured: 52 (its rates per match length have learnt more than the plain engine's, 49)
    assert engine.scheduler.spec_stats.num_accepted_tokens - before < 1.15 * accepted[0][1]


def test_greedy_verification_stops_at_the_first_mismatch():
    assert rejection_sampler.verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted + bonus
    assert rejection_sampler.verify_greedy([4, 8, 6, 7], [4, 5, 6]) == [4, 8]  # second replaced


def test_drafts_follow_acceptance_and_what_one_more_token_costs_here(tiny_target):
    from hyperserve.engine.request import Acceptance
    from hyperserve.engine.speculative import num_tokens_to_propose

    sure, unsure = Acceptance(accepted=9.5, trials=10), Acceptance(accepted=4.4, trials=10)
    assert num_tokens_to_propose(sure, 8, 0.0, 0.1) == 8  # cheap verification: draft all that is allowed
    assert 1 < num_tokens_to_propose(sure, 8, 0.0, 0.5) < 8  # a fused CPU kernel's cost: fewer
    assert num_tokens_to_propose(unsure, 8, 0.0, 0.5) == 0  # 0.44 acceptance does not pay for it
    unsure.steps_without = 16
    assert num_tokens_to_propose(unsure, 8, 0.0, 0.5) == 1  # but is measured again now and then
    _, path, _ = tiny_target
    llm = _speculative_llm(path, {"method": "ngram", "verify_cost": None})
    assert 0 <= llm.engine.speculator.verify_cost < 10  # timed on this machine at start
