"""OpenAI request and response shapes (the subset we serve), as pydantic models.

Every field a client controls is typed and bounded here, so the engine only sees values it can
run: numbers within their ranges (no NaN or infinity), seeds in [0, 2**63), at most 20 logprobs,
logit_bias within [-100, 100], content parts of type text, known roles. What needs the model
(token ids within its vocabulary, lengths against its context) is checked by OpenAIServing.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from hyperserve.beam_search import MAX_BEAM_WIDTH, MAX_LENGTH_PENALTY, BeamSearchParams
from hyperserve.common.messages import message_text
from hyperserve.sampling_params import SamplingParams, StructuredOutputs


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


_INT32 = 2**31


def _text_parts(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    message_text(content)  # only text parts are served: anything else is a ValueError that names it
    return content


# a message's content, and a prediction's
TextContent = Annotated[str | list[dict[str, Any]], AfterValidator(_text_parts)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class PredictedOutput(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat in large part (a file being
    edited); where the answer follows it, its tokens are verified several a step. Text parts only."""

    type: Literal["content"]
    content: TextContent

    @property
    def text(self) -> str:
        return message_text(self.content)


# what a beam search cannot honour: its answers are the likeliest token sequences, scored whole
_NOT_WITH_BEAM_SEARCH = ("stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
                         "logit_bias", "allowed_token_ids", "min_tokens", "response_format", "guided_json",
                         "guided_regex", "guided_choice", "guided_grammar", "prediction", "tools")


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, with vLLM's extras."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=16)
    seed: int | None = Field(default=None, ge=0, lt=SamplingParams.MAX_SEED)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    user: str | None = Field(default=None, max_length=1024)
    # vLLM extras
    # shares prefix-cached KV (and n-gram drafts from earlier answers) only with requests of an equal salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    top_k: int | None = Field(default=None, ge=-1, lt=_INT32)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    priority: int = Field(default=0, ge=-_INT32, lt=_INT32)
    skip_special_tokens: bool = True
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=1 << 20)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the prompt's last this many tokens
    # per prompt token
    prompt_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    # structured output: OpenAI's response_format, or one of vLLM's guided_* constraints
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=4096)
    guided_grammar: str | None = None
    prediction: PredictedOutput | None = None
    # vLLM's beam search: the n best answers of a search n beams wide (hyperserve/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Keys must parse as token ids; SamplingParams bounds the values, the engine the ids."""
        for token in bias or {}:
            if not token.strip().isdigit():
                raise ValueError(f"keys are token ids (as strings of digits), got {token!r}")
        return bias

    @model_validator(mode="after")
    def _check_best_of(self) -> _SamplingRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported: ask for n samples and pick among them")
        return self

    @model_validator(mode="after")
    def _check_beam_search(self) -> _SamplingRequest:
        if not self.use_beam_search:
            return self
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"beam search takes n (its width) up to {MAX_BEAM_WIDTH}, got {self.n}")
        fields = type(self).model_fields
        given = [name for name in _NOT_WITH_BEAM_SEARCH if name in fields
                 and getattr(self, name) != fields[name].get_default(call_default_factory=True)]
        if given:
            raise ValueError(f"beam search does not take {', '.join(given)}")
        return self

    def beam_search_params(self, max_tokens: int) -> BeamSearchParams | None:
        if not self.use_beam_search:
            return None
        return BeamSearchParams(self.n, max_tokens, self.ignore_eos, self.length_penalty)

    def structured_outputs(self) -> StructuredOutputs | None:
        """The output constraint asked for; ValueError if more than one is."""
        constraints = dict(json=self.guided_json, regex=self.guided_regex, choice=self.guided_choice,
                           grammar=self.guided_grammar)
        constraints = {kind: value for kind, value in constraints.items() if value is not None}
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            schema = response_format.json_schema.schema_ if response_format.json_schema else None
            if schema is not None:
                constraints["json"] = schema
            else:
                constraints["json_object"] = True
        if not constraints:
            return None
        if len(constraints) > 1:
            raise ValueError(f"give one output constraint, not several: {', '.join(constraints)}")
        return StructuredOutputs(**constraints)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_logprobs,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids,
            logit_bias={int(token): value for token, value in (self.logit_bias or {}).items()},
            structured_outputs=structured_outputs,
            prediction=self.prediction.text if self.prediction is not None else None,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported: this server completes prompts, it does not insert "
                             "text")
        return self

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class FunctionCall(BaseModel):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1 << 20)  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: TextContent | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)  # an assistant's earlier calls
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool message: the call it answers
    name: str | None = Field(default=None, max_length=64)
    reasoning_content: str | None = None  # an assistant's earlier thinking, as answers carry it

    def for_template(self) -> dict[str, Any]:
        """As a chat template takes it (tool calls with their arguments parsed, as Hugging Face's
        templates read them); `developer` is OpenAI's newer name for `system`. Earlier thinking
        goes in as `reasoning_content` (Qwen3's templates read it) and `thinking` (GPT-OSS's, which
        shows the model its thinking before a call it made)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": message_text(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _json_arguments(call.function.arguments)}}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


def _json_arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # passed on as the client wrote it


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=16384)
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments always follow the schema once a call starts


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# apply_chat_template's own parameters and what the server passes it: not template variables
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=SamplingParams.MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    # vLLM's: variables for the model's chat template (Qwen3's {"enable_thinking": false}, say), and
    # whether the answer opens a new assistant turn or goes on with the last message (a prefilled answer)
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's: how hard a reasoning model thinks, a variable of its chat template (GPT-OSS's reads it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def template_variables(self) -> dict[str, Any] | None:
        """The chat template's variables: chat_template_kwargs, and reasoning_effort where given."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets it")
        bad = [key for key in kwargs or {} if not key.isidentifier()]
        if bad:
            raise ValueError(f"chat_template_kwargs keys must be template variable names, not {bad[0]!r}")
        return kwargs

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _check_continuation(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                             "tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_only(self) -> bool:
        """Whether the answer must be tool calls and nothing else ("required", or a named function)."""
        choice = self.tool_choice
        return self.calls_tools and (choice == "required" or isinstance(choice, NamedToolChoice))


class _PromptOrMessages(BaseModel):
    """A request that takes exactly one of `prompt` and `messages` (the subclass declares both)."""

    @model_validator(mode="after")
    def _one_of_prompt_and_messages(self) -> _PromptOrMessages:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeRequest(_PromptOrMessages):
    """POST /tokenize, as vLLM's: the token ids a completion (`prompt`) or a chat request
    (`messages`, with its `tools`) would run, counted without running anything."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(default=None, max_length=128)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    tokens: list[int] = Field(max_length=1 << 20)


class CacheRequest(_PromptOrMessages):
    """POST /v1/cache: pin the KV of a prompt (or of messages rendered without a generation
    prompt, e.g. a system message) for `ttl` seconds."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    ttl: float = Field(default=300, gt=0)  # at most the server's --max-pin-ttl-s
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # as the completions' field


class KVPrefillRequest(BaseModel):
    """POST /v1/kv/prefill (--role prefill): compute a prompt's KV and send its blocks from
    `skip_blocks` on (the decode server has the ones before)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt_token_ids: list[int] = Field(min_length=1)
    skip_blocks: int = Field(default=0, ge=0)
    kv_identity: str = Field(min_length=1, max_length=256)  # the decode engine's: the blocks must fit it
    cache_salt: str = Field(default="", max_length=4096)  # the tenant, as the decode server salts it


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM's."""

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # replace an adapter of this name (new weights; running requests keep the old)


class UnloadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=128)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
