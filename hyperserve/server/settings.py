"""ServerSettings: what `hyperserve serve` decides above the engine (names, queue and size limits)."""

from __future__ import annotations

from dataclasses import dataclass

from hyperserve.server.reasoning import PARSERS as REASONING_PARSERS
from hyperserve.server.tools import FORMATS as TOOL_FORMATS


@dataclass
class ServerSettings:
    model_name: str
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    max_body_bytes: int = 4 * 2**20
    disconnect_poll_s: float = 0.25
    default_max_tokens: int = 2048  # a chat request that sets no max_tokens gets at most this many
    max_pin_ttl_s: float = 3600.0  # the longest `ttl` a /v1/cache pin may ask for
    # stored /v1/responses answers (as JSON) beyond which the oldest go
    responses_store_bytes: int = 64 * 2**20
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: chat answers' thinking to reasoning_content
    tool_call_parser: str | None = None  # a tools.FORMATS name; None: the chat template's format, else hermes
    files_dir: str | None = None  # where /v1/files keeps the Batch API's files (None: a temporary directory)
    batch_api: bool = True  # serve /v1/files and /v1/batches (off behind a response cache: its front does)
    batch_concurrency: int = 16  # lines of all batches in the engine at once while it serves nothing else
    batch_concurrency_busy: int = 2  # ... and while it does (common/batch_api.py's LineSlots)
    # One request fans out into at most this many sequences (prompts x n), as a multiple of
    # max_num_seqs: a single request may fill the batch twice over, never more.
    max_fanout_factor: int = 2
    # Disaggregated prefill (server/disaggregation.py): "prefill" serves POST /v1/kv/prefill,
    # "decode" sends long prompts to prefill_url first; "both" (the default) does neither.
    role: str = "both"
    prefill_url: str | None = None
    prefill_api_key: str | None = None
    disagg_min_tokens: int = 256  # uncached prompt tokens from which a prompt goes to the prefill server
    prefill_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        counts = (self.max_queue, self.default_max_tokens, self.batch_concurrency,
                  self.batch_concurrency_busy)
        if min(counts) < 1 or self.max_pin_ttl_s <= 0:
            raise ValueError("max_queue, default_max_tokens, max_pin_ttl_s and batch concurrencies "
                             "must be positive")
        if self.responses_store_bytes < 0:
            raise ValueError("responses_store_bytes must be 0 (store nothing) or more")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if (self.role == "decode") != (self.prefill_url is not None):
            raise ValueError("--role decode needs --prefill-url, and --prefill-url needs --role decode")
        if self.disagg_min_tokens < 1 or self.prefill_timeout_s <= 0:
            raise ValueError("disagg_min_tokens and prefill_timeout_s must be positive")
