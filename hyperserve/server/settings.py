"""ServerSettings: what `hyperserve serve` decides above the engine (names, queue and size limits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    model_name: str
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    max_body_bytes: int = 4 * 2**20
    disconnect_poll_s: float = 0.25
    default_max_tokens: int = 2048  # a chat request that sets no max_tokens gets at most this many
    max_pin_ttl_s: float = 3600.0  # the longest `ttl` a /v1/cache pin may ask for
    # One request fans out into at most this many sequences (prompts x n), as a multiple of
    # max_num_seqs: a single request may fill the batch twice over, never more.
    max_fanout_factor: int = 2

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.default_max_tokens < 1 or self.max_pin_ttl_s <= 0:
            raise ValueError("max_queue, default_max_tokens and max_pin_ttl_s must be positive")
