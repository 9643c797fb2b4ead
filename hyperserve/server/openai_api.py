"""OpenAI completions and chat completions on top of AsyncEngine, independent of transport.

`OpenAIServing.prepare_*` validates a request and turns it into engine inputs (raising APIError
for anything a client got wrong), tokenizing off the event loop; `stream_chunks` yields the chunk
objects both SSE and the WebSocket send; `collect` builds the non-streaming response. Engine
failures leave as APIError too: 500 for a request the engine failed, 503 once the engine is dead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from hyperserve.beam_search import BeamSearch, BeamSearchParams, candidates_of
from hyperserve.common.errors import APIError, unavailable
from hyperserve.engine.engine import EngineDeadError, PinLimitError
from hyperserve.engine.input_processor import ContextLengthError
from hyperserve.layers.lora import LoRARequest
from hyperserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from hyperserve.sampling_params import SamplingParams, StructuredOutputs
from hyperserve.security.config import cache_salt
from hyperserve.server import harmony, reasoning, tools
from hyperserve.server.async_engine import AsyncEngine, RequestFailedError, RequestStream
from hyperserve.server.disaggregation import RemotePrefill, encode_blocks
from hyperserve.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from hyperserve.server.protocol import (
    CacheRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    KVPrefillRequest,
    TokenizeRequest,
    Tool,
    new_id,
    now,
)
from hyperserve.server.settings import ServerSettings
from hyperserve.server.tool_calls import CallParser, ToolCallStream

KV_PIN_TTL_S = 60.0  # a prefill server's pin lives until its blocks are read; this bounds a stuck one


@dataclass
class Job:
    """One API request as engine requests: one per prompt, each with n samples."""

    kind: str  # "completion" | "chat"
    id: str
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    include_usage: bool
    chat_logprobs: bool = False
    tool_calls: CallParser | None = None  # chat with tools: how its answers are parsed for calls
    reasoning_parser: str | None = None  # chat: its thinking goes to reasoning_content (reasoning.py)
    harmony: harmony.HarmonyParser | None = None  # chat with GPT-OSS: its channels read (harmony.py)
    lora: LoRARequest | None = None  # the adapter `model` named
    echo: list[str] | None = None  # completions with `echo`: each prompt's text, which its answers start with
    prompt_logprobs: bool = False  # the response carries vLLM's `prompt_logprobs`
    cache_salt: str = ""  # its tenant: what it shares cached KV and n-gram drafts with (cache_salt())
    beam: BeamSearchParams | None = None  # answered by beam search, each round's beams a request
    finals: list[RequestOutput | None] = field(default_factory=list)
    streams: list[RequestStream] = field(default_factory=list)

    def close(self) -> None:
        """Abort whatever has not finished (a no-op once every stream has ended)."""
        for stream in self.streams:
            stream.close()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings,
                 adapters: dict[str, LoRARequest] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.model_name
        self.adapters = adapters if adapters is not None else {}  # LoRA adapters served as models, by name
        self.max_model_len = engine.engine.max_model_len
        self.max_sequences = settings.max_fanout_factor * engine.engine.config.scheduler.max_num_seqs
        tokenizer = engine.engine.tokenizer
        added = tokenizer.get_added_vocab() if tokenizer is not None else {}
        native = tools.detect_format(getattr(tokenizer, "chat_template", None))
        parser = settings.tool_call_parser
        self.tool_format = tools.FORMATS[parser] if parser is not None else native or tools.HERMES
        # GPT-OSS writes harmony (channels for its thinking, answer and calls), and its template renders tools
        self.harmony = harmony.speaks(tokenizer)
        # else the fallback prompt describes the format
        self.native_tools = native is self.tool_format or self.harmony
        self.tool_marker_id = added.get(self.tool_format.marker)
        # a special token is left out of the answer's text unless asked for, and the parser reads the
        # marker there
        self.tool_marker_special = (self.tool_marker_id is not None
                                    and tokenizer.added_tokens_decoder[self.tool_marker_id].special)
        # <think> and </think> as single tokens: usage then counts a reasoning model's thinking tokens, and
        # constraints apply after the thinking
        self.think_start_id, self.think_end_id = added.get(reasoning.START), added.get(reasoning.END)
        self.remote_prefill = None
        if settings.role in ("prefill", "decode"):
            reason = engine.engine.kv_transfer.unsupported()
            if reason is not None:
                raise ValueError(f"--role {settings.role}: this engine cannot move KV blocks: {reason}")
        if settings.role == "decode":
            self.remote_prefill = RemotePrefill(settings.prefill_url, settings.disagg_min_tokens,
                                                settings.prefill_timeout_s, settings.prefill_api_key)

    async def aclose(self) -> None:
        if self.remote_prefill is not None:
            await self.remote_prefill.close()

    # ---- requests -> jobs --------------------------------------------------------------------

    async def prepare_completion(self, request: CompletionRequest, scope: str | None = None) -> Job:
        """`scope`: the API key's (security), whose requests alone share cached KV with this one."""
        lora = await self._adapter(request.model)
        texts = request.prompts()
        self._check_fanout(len(texts), request.n)
        truncate = request.truncate_prompt_tokens
        prompts = await asyncio.to_thread(lambda: [self._prompt_ids(p, "prompt", truncate) for p in texts])
        params = await self._params(request, request.max_tokens if request.max_tokens is not None else 16,
                                    request.logprobs, prompts, self._constraint(request))
        echo = None
        if request.echo:  # the prompt's tokens get logprobs as the answer's do
            tokenizer = self._tokenizer(request.model)
            echo = [text if isinstance(text, str) and truncate is None else tokenizer.decode(ids)
                    for text, ids in zip(texts, prompts)]
            if request.logprobs is not None:
                params = replace(params, prompt_logprobs=max(request.logprobs, params.prompt_logprobs or 0))
        salt = cache_salt(scope, request.cache_salt)
        await self._prefill_remotely(prompts, lora, salt)
        return Job("completion", new_id("cmpl"), request.model or self.model_name, prompts, params,
                   request.priority, bool(request.stream_options and request.stream_options.include_usage),
                   lora=lora, echo=echo, prompt_logprobs=request.prompt_logprobs is not None,
                   cache_salt=salt, beam=request.beam_search_params(params.max_tokens))

    async def prepare_chat(self, request: ChatCompletionRequest, scope: str | None = None) -> Job:
        """`scope`: as prepare_completion's."""
        lora = await self._adapter(request.model)
        self._check_fanout(1, request.n)
        constraint = self._constraint(request)
        offered = request.tools if request.calls_tools else None
        if offered and constraint is not None:
            raise APIError(400, "response_format (or a guided_* constraint) cannot be combined with tools; "
                                "set tool_choice to 'none' or drop the constraint", param="response_format")
        if (offered and not self.harmony and self.tool_format.syntax == "xml"
                and (bad := tools.unreadable_xml_parameter(offered))):
            raise APIError(400, f"parameter name {bad!r} cannot be written in {self.tool_format.name}'s "
                                "XML tags (it holds '>' or a line break); rename it", param="tools")
        answer_header = ""  # harmony: the header the prompt writes for a constrained body
        if offered and self.harmony:
            constraint, answer_header = harmony.tool_constraint(offered, request.tool_choice)
        elif offered:
            constraint = tools.tool_constraint(offered, request.tool_choice, request.parallel_tool_calls,
                                               self.tool_format, self.tool_marker_id)
        elif constraint is not None and self.harmony:
            answer_header = harmony.header_for()
        ids = await asyncio.to_thread(self._chat_ids, request.messages, request.add_generation_prompt,
                                      offered, request.template_variables(), request.continue_final_message)
        if answer_header:
            ids = ids + self.engine.engine.tokenizer.encode(answer_header, add_special_tokens=False)
        ids = self._prompt_ids(ids, "messages", request.truncate_prompt_tokens)
        prompts = [ids]
        if constraint is not None and not self.harmony:
            constraint = self._after_thinking(constraint, ids)
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:  # bounded, so a forgotten max_tokens cannot hold a slot for the whole context
            max_tokens = min(self.settings.default_max_tokens, self.max_model_len - len(ids))
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = await self._params(request, max_tokens, logprobs, prompts, constraint)
        if (offered and self.tool_marker_special) or self.harmony:  # the markers are read in the text
            params = replace(params, skip_special_tokens=False)
        salt = cache_salt(scope, request.cache_salt)
        await self._prefill_remotely(prompts, lora, salt)
        return Job("chat", new_id("chatcmpl"), request.model or self.model_name, prompts, params,
                   request.priority, bool(request.stream_options and request.stream_options.include_usage),
                   chat_logprobs=request.logprobs,
                   tool_calls=(CallParser.offered(offered, request.calls_only, self.tool_format)
                               if offered and not self.harmony else None),
                   reasoning_parser=None if self.harmony else self.settings.reasoning_parser,
                   harmony=self._harmony_parser(offered, answer_header), lora=lora,
                   prompt_logprobs=request.prompt_logprobs is not None, cache_salt=salt,
                   beam=request.beam_search_params(params.max_tokens))

    def _harmony_parser(self, offered: list[Tool] | None, answer_header: str) -> harmony.HarmonyParser | None:
        if not self.harmony:
            return None
        return harmony.HarmonyParser(frozenset(tool.function.name for tool in offered or []), answer_header)

    async def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        """The ids the request would run (longer than the context is fine: this only counts)."""
        tokenizer = self._tokenizer(request.model)
        if request.messages is not None:
            ids = await asyncio.to_thread(self._chat_ids, request.messages, request.add_generation_prompt,
                                          request.tools)
        else:
            ids = await asyncio.to_thread(lambda: list(tokenizer(request.prompt).input_ids))
        strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        tokenizer, vocab = self._tokenizer(request.model), self.engine.engine.hf_config.vocab_size
        if not all(0 <= token < vocab for token in request.tokens):
            raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, request.tokens)}

    def _tokenizer(self, model: str | None):
        self._check_model(model)
        if self.engine.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="model")
        return self.engine.engine.tokenizer

    async def pin(self, request: CacheRequest, scope: str | None = None) -> dict[str, Any]:
        """Compute and pin a prefix's KV; the answer says how many tokens later requests (of the
        same key's scope and cache_salt) skip.
        Pins are admitted like completions (the same queue limit) and hold at most the engine's
        `max_pinned_fraction` of the KV pool, each for at most `max_pin_ttl_s`."""
        self._check_model(request.model)
        if request.ttl > self.settings.max_pin_ttl_s:
            raise APIError(400, f"ttl={request.ttl:g} s exceeds this server's maximum of "
                                f"{self.settings.max_pin_ttl_s:g} s (--max-pin-ttl-s)", param="ttl")
        if request.messages is not None:
            # No generation prompt: the rendered messages are a prefix of later conversations.
            prompt: str | list[int] = await asyncio.to_thread(self._chat_ids, request.messages, False)
            param = "messages"
        else:
            prompt, param = request.prompt, "prompt"
        ids = await asyncio.to_thread(self._prompt_ids, prompt, param)
        pin_id = await self._pin_prompt(ids, request.ttl, "cache", cache_salt(scope, request.cache_salt))
        pin = self.engine.engine.kv_cache.pins[pin_id]
        return {"id": pin_id, "object": "cache", "model": self.model_name, "prompt_tokens": len(ids),
                "cached_tokens": pin.num_tokens, "expires_at": int(pin.expires_at)}

    async def _pin_prompt(self, ids: list[int], ttl: float, kind: str, salt: str) -> str:
        """Compute a prompt's KV and pin it (admitted like a completion); returns the pin's id."""
        self._admit()
        pin_id = new_id(kind)
        stream = self._submit(pin_id, ids, SamplingParams(max_tokens=1), pin_ttl_s=ttl, cache_salt=salt)
        try:
            async for _ in stream:
                pass
        except PinLimitError as error:
            raise _pin_refused(str(error), error.retryable) from error
        except Exception as error:
            raise _api_error(error) from error
        finally:
            stream.close()
        if pin_id not in self.engine.engine.kv_cache.pins:  # other pins took the room while this was computed
            raise _pin_refused("pins hold as much of the KV pool as they may (max_pinned_fraction)", True)
        return pin_id

    async def prefill_kv(self, request: KVPrefillRequest) -> bytes:
        """--role prefill: a prompt's KV blocks from `skip_blocks` on, with their hashes
        (server/disaggregation.py); the pin that kept them is released once they are read."""
        self._check_model(request.model)
        if request.kv_identity != self.engine.engine.kv_identity:
            raise APIError(409, "this prefill server's KV does not fit the decode server's: they must run "
                                "the same model, dtype, quantization and block size", type_="conflict",
                           param="kv_identity")
        ids = await asyncio.to_thread(self._prompt_ids, request.prompt_token_ids, "prompt_token_ids")
        pin_id = await self._pin_prompt(ids, KV_PIN_TTL_S, "kv", request.cache_salt)

        def read(engine) -> tuple[list[bytes], dict]:
            try:
                skip = request.skip_blocks
                hashes = engine.kv_transfer.prefix_hashes(ids, request.cache_salt)[skip:]
                blocks = engine.kv_cache.pins[pin_id].block_ids[0][skip : skip + len(hashes)]
                return hashes, engine.kv_transfer.read_blocks(blocks) if blocks else {}
            finally:
                engine.unpin_prefix(pin_id)

        hashes, tensors = await self.engine.call(read)
        return await asyncio.to_thread(encode_blocks, hashes, tensors)  # a copy of tens of MB: off the loop

    async def _prefill_remotely(self, prompts: list[list[int]], lora: LoRARequest | None, salt: str) -> None:
        """--role decode: long prompts' KV from the prefill server first (not for adapters, whose
        KV the prefill server does not have)."""
        if self.remote_prefill is not None and lora is None:
            for prompt in prompts:
                await self.remote_prefill.prefill(self.engine, prompt, salt)

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                  offered: list[Tool] | None = None, template_kwargs: dict[str, Any] | None = None,
                  continue_final_message: bool = False) -> list[int]:
        rendered, tool_specs = tools.render_messages([m.for_template() for m in messages], offered,
                                                     self.native_tools, self.tool_format)
        try:
            return self.engine.engine.apply_chat_template(rendered, add_generation_prompt, tool_specs,
                                                          template_kwargs, continue_final_message)
        except ValueError as error:  # no template, unsupported content, roles the template rejects
            raise APIError(400, str(error), param="messages") from error

    def _after_thinking(self, constraint: StructuredOutputs, prompt_ids: list[int]) -> StructuredOutputs:
        """With a reasoning parser, the constraint lets the answer think first (reasoning.py)."""
        parser, start, end = self.settings.reasoning_parser, self.think_start_id, self.think_end_id
        if parser is None or start is None or end is None:
            return constraint
        decode = self.engine.engine.tokenizer.decode
        thinking = reasoning.thinking_before(parser, prompt_ids, start, end, decode)
        return replace(constraint, thinking=thinking)

    @staticmethod
    def _constraint(request) -> StructuredOutputs | None:
        try:
            return request.structured_outputs()
        except ValueError as error:
            raise APIError(400, str(error), param="response_format") from error

    def _check_fanout(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences:
            factor = self.settings.max_fanout_factor
            raise APIError(400, f"{num_prompts} prompt(s) x n={n} would run {num_prompts * n} sequences; "
                                f"one request may run at most {self.max_sequences} ({factor} x max_num_seqs)",
                           param="n" if n > 1 else "prompt", code="request_too_large")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model), loaded now, off the event loop:
        an adapter that cannot serve is a 400 before any engine work."""
        self._check_model(model)
        lora = self.adapters.get(model) if model is not None else None
        if lora is not None:
            try:
                await asyncio.to_thread(self.engine.engine.check_lora, lora)
            except ValueError as error:
                raise APIError(400, str(error), param="model") from error
        return lora

    def _prompt_ids(self, prompt: str | list[int], param: str, truncate: int | None = None) -> list[int]:
        try:
            return self.engine.engine.inputs.process_prompt(prompt, truncate)[1]
        except ContextLengthError as error:
            raise APIError(400, str(error), param=param, code="context_length_exceeded") from error
        except ValueError as error:
            raise APIError(400, str(error), param=param) from error

    async def _params(self, request, max_tokens: int | None, logprobs: int | None, prompts,
                      constraint: StructuredOutputs | None) -> SamplingParams:
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
        elif longest + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the completion)",
                param="max_tokens", code="context_length_exceeded",
            )
        inputs = self.engine.engine.inputs
        try:
            params = request.sampling_params(max_tokens, logprobs, constraint)
            # off the event loop: a new grammar compiles here (milliseconds; more for a large schema)
            await asyncio.to_thread(inputs.check_params, params)
        except ValueError as error:
            raise APIError(400, str(error), param="response_format" if constraint else None) from error
        try:  # tokenized off the event loop too; the engine then only checks the ids
            params.prediction = await asyncio.to_thread(inputs.prediction_ids, params.prediction)
        except ValueError as error:
            raise APIError(400, str(error), param="prediction") from error
        return params

    def start(self, job: Job, final_only: bool = False) -> None:
        """Admit the job and queue its requests, with no await in between (no admission races).
        `final_only`: the job is answered whole, so its requests report only when finished."""
        self._admit()
        job.finals = [None] * len(job.prompts)
        job.streams = []
        if job.beam is not None:
            return  # its rounds are submitted as run() goes
        try:
            for i, prompt in enumerate(job.prompts):
                job.streams.append(self._submit(f"{job.id}-{i}", prompt, job.params, job.priority,
                                                lora=job.lora, final_only=final_only,
                                                cache_salt=job.cache_salt))
        except APIError:
            job.close()
            raise

    def _admit(self) -> None:
        if self.engine.num_waiting >= self.settings.max_queue:
            raise APIError(429, f"the server is overloaded ({self.engine.num_waiting} requests waiting); "
                                "retry later", type_="rate_limit_error", headers={"Retry-After": "1"})

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
                pin_ttl_s: float | None = None, lora: LoRARequest | None = None,
                final_only: bool = False, cache_salt: str = "") -> RequestStream:
        try:
            return self.engine.submit(request_id, prompt, params, priority, pin_ttl_s, lora, final_only,
                                      cache_salt)
        except (EngineDeadError, RuntimeError) as error:
            raise _api_error(error) from error

    # ---- running jobs ------------------------------------------------------------------------

    async def run(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as the engine produces them, all prompts merged."""
        if job.beam is not None:
            async for item in self._run_beam_search(job):
                yield item
            return
        if len(job.streams) == 1:  # read directly: a task and a queue hop per token cost the event loop
            try:
                while True:
                    try:
                        item = await anext(job.streams[0])
                    except StopAsyncIteration:
                        return
                    except Exception as error:
                        item = error
                    yield 0, _received(job, 0, item)
            finally:
                job.close()
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    await merged.put((index, output))
            except Exception as error:
                await merged.put((index, error))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(job.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await merged.get()
                output = _received(job, index, item)
                remaining -= output.finished
                yield index, output
        finally:
            job.close()  # first and synchronously: under a cancelled scope every await raises again
            for task in tasks:
                task.cancel()

    async def _run_beam_search(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, its answers) of a beam-search job, in prompt order; every prompt searched
        at once."""
        tasks = [asyncio.create_task(self._beam_search(job, index)) for index in range(len(job.prompts))]
        try:
            for index, task in enumerate(tasks):
                try:
                    item = await task
                except Exception as error:
                    item = error
                yield index, _received(job, index, item)
        finally:
            job.close()  # the running round's requests
            for task in tasks:
                task.cancel()

    async def _beam_search(self, job: Job, index: int) -> RequestOutput:
        search = BeamSearch(job.prompts[index], job.beam, frozenset(self.engine.engine.eos_token_ids))
        step = job.beam.step_params()
        while not search.done:
            streams = [self._submit(f"{job.id}-{index}-{search.num_rounds}-{beam}", prompt, step,
                                    job.priority, lora=job.lora, final_only=True, cache_salt=job.cache_salt)
                       for beam, prompt in enumerate(search.round_prompts())]
            job.streams.extend(streams)
            search.advance([candidates_of(await _final(stream)) for stream in streams])
        tokenizer = self.engine.engine.tokenizer
        return search.output(f"{job.id}-{index}", tokenizer, job.params.skip_special_tokens)

    async def collect(self, job: Job) -> dict[str, Any]:
        async for _ in self.run(job):
            pass
        choices = []
        for prompt_index, final in enumerate(job.finals):
            for c in final.outputs:
                index = prompt_index * job.params.n + c.index
                choice = self._choice(job, index, c, c.text, c.logprobs or [], final=True,
                                      text_offset=len(job.echo[prompt_index]) if job.echo else 0)
                if job.echo:
                    self._echo(job, choice, prompt_index, final)
                if job.prompt_logprobs and job.kind == "completion":
                    choice["prompt_logprobs"] = prompt_logprobs(final)
                choices.append(choice)
        body = {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": now(), "model": job.model, "choices": choices, "usage": self.usage(job)}
        if job.prompt_logprobs and job.kind == "chat":
            body["prompt_logprobs"] = prompt_logprobs(job.finals[0])
        return body

    async def stream_chunks(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        text_offsets: dict[int, int] = {}  # completions' logprobs: where the next token's text starts
        tool_streams: dict[int, ToolCallStream] = {}
        reasoning_streams: dict[int, reasoning.ReasoningStream] = {}
        harmony_streams: dict[int, harmony.HarmonyStream] = {}
        created = now()
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        base = {"id": job.id, "object": obj, "created": created, "model": job.model}
        if job.kind == "chat":
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(job.prompts) * job.params.n)]
            yield {**base, "choices": first}
        # prompt_logprobs: the prompts whose scores went out, with their first chunk
        prompts_scored: set[int] = set()
        async for prompt_index, output in self.run(job):
            choices = []
            for c in output.outputs:
                index = prompt_index * job.params.n + c.index
                text_from, token_from = sent_text.get(index, 0), sent_tokens.get(index, 0)
                first = index not in sent_text
                if len(c.text) == text_from and len(c.token_ids) == token_from and not c.finished:
                    continue
                new_logprobs = (c.logprobs or [])[token_from:]
                text, calls, called, thought = c.text[text_from:], [], False, ""
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if job.reasoning_parser is not None:
                    thinking = reasoning_streams.setdefault(index, reasoning.stream(job.reasoning_parser))
                    thought, text = thinking.feed(text, final=c.finished)
                if job.tool_calls is not None:
                    stream = tool_streams.setdefault(index, job.tool_calls.stream())
                    text, calls = stream.feed(text, final=c.finished)
                    called = bool(stream.calls)
                if job.harmony is not None:
                    channels = harmony_streams.setdefault(index, job.harmony.stream())
                    thought, text, calls = channels.feed(text, final=c.finished)
                    called = bool(channels.calls)
                held = (job.tool_calls is not None or job.reasoning_parser is not None
                        or job.harmony is not None)
                if held and not (thought or text or calls or c.finished or job.chat_logprobs):
                    continue  # all held back (a call or a marker in the making): nothing to send yet
                echo = job.echo[prompt_index] if job.echo else ""
                choice = self._choice(job, index, c, text, new_logprobs, final=False, calls=calls,
                                      called=called, text_offset=text_offsets.get(index, len(echo)),
                                      thought=thought)
                if first and job.echo:  # the prompt comes first
                    self._echo(job, choice, prompt_index, output)
                if first and job.prompt_logprobs and job.kind == "completion":
                    choice["prompt_logprobs"] = prompt_logprobs(output)
                if job.kind == "completion" and choice["logprobs"] and choice["logprobs"]["tokens"]:
                    lp = choice["logprobs"]
                    text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                choices.append(choice)
            if not choices:
                continue
            chunk = {**base, "choices": choices}
            if job.prompt_logprobs and job.kind == "chat" and prompt_index not in prompts_scored:
                prompts_scored.add(prompt_index)  # as a whole answer has them: beside the choices
                chunk["prompt_logprobs"] = prompt_logprobs(output)
            yield chunk
        if job.include_usage:
            yield {**base, "choices": [], "usage": self.usage(job)}

    def usage(self, job: Job) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in job.prompts)
        completion_tokens = sum(len(c.token_ids) for f in job.finals if f for c in f.outputs)
        cached_tokens = sum(f.metrics.num_cached_tokens for f in job.finals if f)
        disk_tokens = sum(f.metrics.num_disk_cached_tokens for f in job.finals if f)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens,
                 # cached_tokens as OpenAI reports it; disk_cached_tokens: the part the disk tier served
                 "prompt_tokens_details": {"cached_tokens": cached_tokens, "disk_cached_tokens": disk_tokens}}
        details = {}
        if job.reasoning_parser is not None and self.think_end_id is not None:
            details["reasoning_tokens"] = sum(
                reasoning.num_tokens(job.reasoning_parser, c.text, c.token_ids, self.think_end_id)
                for f in job.finals if f for c in f.outputs)
        if job.params.prediction is not None:  # as OpenAI counts them: drafted from the prediction
            accepted = sum(f.metrics.num_accepted_prediction_tokens for f in job.finals if f)
            details["accepted_prediction_tokens"] = accepted
            details["rejected_prediction_tokens"] = sum(
                f.metrics.num_prediction_tokens for f in job.finals if f) - accepted
        if details:
            usage["completion_tokens_details"] = details
        return usage

    # ---- formatting ----------------------------------------------------------------------------

    def _choice(self, job: Job, index: int, c: CompletionOutput, text: str, logprobs: list[TokenLogprobs],
                final: bool, calls: list[dict[str, Any]] = (), called: bool = False,
                text_offset: int = 0, thought: str = "") -> dict[str, Any]:
        """One choice of a response (final) or of a chunk. With a reasoning parser, a final answer's
        thinking is split off here (a chunk comes with its piece of it, `thought`); with tools, a
        final answer is parsed for calls here; a chunk comes with the calls completed in it and
        whether the answer made any.
        `text_offset`: where a chunk's first token starts in the whole completion (its logprobs'
        text_offset counts from the completion's start, as OpenAI's and vLLM's do)."""
        finish_reason = c.finish_reason if c.finished else None
        token_ids = c.token_ids[len(c.token_ids) - len(logprobs):] if logprobs else []
        if job.kind == "chat":
            lp = chat_logprobs(token_ids, logprobs, job.params.logprobs) if job.chat_logprobs else None
            content: str | None = text
            reasoning_content: str | None = thought or None
            if final and job.reasoning_parser is not None:
                reasoning_content, content = reasoning.split(job.reasoning_parser, text)
            if final and job.tool_calls is not None:
                content, calls = job.tool_calls.parse(content)
                called = bool(calls)
            if final and job.harmony is not None:
                reasoning_content, content, calls = job.harmony.split(text)
                called = bool(calls)
            if called and finish_reason == "stop":
                finish_reason = "tool_calls"
            message = {"role": "assistant", "content": content} if final else {"content": content}
            if reasoning_content is not None:
                message["reasoning_content"] = reasoning_content
            if calls:
                message["tool_calls"] = calls
            key = "message" if final else "delta"
            # stop_reason as vLLM's: the stop string or token id that ended the answer (None: EOS or length)
            return {"index": index, key: message, "logprobs": lp, "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason if c.finished else None}
        num_top = job.params.logprobs
        lp = (completion_logprobs(token_ids, logprobs, num_top, self._decode_token, text_offset)
              if num_top is not None else None)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                "stop_reason": c.stop_reason}

    def _decode_token(self, token_id: int) -> str:
        return self.engine.engine.tokenizer.decode([token_id])

    def _echo(self, job: Job, choice: dict[str, Any], prompt_index: int, output: RequestOutput) -> None:
        """A completion choice with `echo`: the prompt's text before the answer's, and with logprobs,
        the prompt's tokens (the first without a logprob, as OpenAI's) before the answer's."""
        choice["text"] = job.echo[prompt_index] + choice["text"]
        if choice["logprobs"] is not None and output.prompt_logprobs is not None:
            prompt = completion_logprobs(output.prompt_token_ids, output.prompt_logprobs, job.params.logprobs,
                                         self._decode_token)
            choice["logprobs"] = {key: prompt[key] + choice["logprobs"][key] for key in prompt}


async def _final(stream: RequestStream) -> RequestOutput:
    """A final_only request's one output (its error raised)."""
    async for output in stream:
        if output.finished:
            return output
    raise RuntimeError(f"request {stream.request_id} ended without an output")


def _received(job: Job, index: int, item: RequestOutput | Exception) -> RequestOutput:
    """What prompt `index`'s stream gave: an output (the final one kept in job.finals), or the
    error it raised, raised again as an API error."""
    if isinstance(item, Exception):
        raise _api_error(item) from item
    if item.finished:
        job.finals[index] = item
    return item


def _api_error(error: Exception) -> APIError:
    """What an engine-side failure tells the client."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return unavailable(f"the engine stopped and the server is restarting: {error}", retry_after_s=10)
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    if isinstance(error, RequestFailedError):
        return APIError(500, f"the engine failed while running this request: {error}", type_="server_error")
    if isinstance(error, RuntimeError):  # the engine is shutting down
        return unavailable(str(error))
    return APIError(500, f"internal error: {type(error).__name__}: {error}", type_="server_error")


def _pin_refused(reason: str, retryable: bool) -> APIError:
    if retryable:
        return APIError(429, f"cannot pin now: {reason}; retry once pins expire or are deleted",
                        type_="rate_limit_error", code="pin_limit", headers={"Retry-After": "5"})
    return APIError(400, f"cannot pin: {reason}", param="prompt", code="pin_limit")
