"""Security configuration: the keys file (`--api-keys-file`, YAML or JSON) with per-key models,
limits, budgets and guardrails, plus request size limits. Validated at start; a wrong key fails
with its path, as the gateway's config does.

Keys are stored as SHA-256 hex digests (`hyperserve keys new --name alice` prints a key and its
entry); the plaintext never needs to be written anywhere the server reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# A block refuses someone's request, so the injection classifier's default favours precision: at 0.9
# its held-out precision is 0.95 (0.88 at 0.5) for an F1 0.005 below its best (BENCHMARKS.md).
INJECTION_THRESHOLD = 0.9

Action = Literal["off", "log", "redact", "block"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Section):
    """Per key; None is unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1, description="prompt + generated")
    concurrent_requests: int | None = Field(default=None, ge=1)
    token_budget: int | None = Field(default=None, ge=1,
                                     description="prompt + generated tokens per budget period")
    budget_period_s: float = Field(default=86400.0, gt=0)


class Guardrails(_Section):
    """What to do on a finding: off, log (audit only), redact (PII only) or block (400)."""

    injection: Literal["off", "log", "block"] = "off"
    pii_request: Action = "off"
    pii_response: Literal["off", "log", "redact"] = "off"  # an answer is filtered, not refused
    reversible_redaction: bool = Field(default=False,
                                       description="put the caller's own PII back into the answer")
    injection_threshold: float = Field(default=INJECTION_THRESHOLD, gt=0, lt=1,
                                       description="classifier probability to flag")

    @field_validator("injection", "pii_request", "pii_response", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML reads a bare `off` as false


class KeyEntry(_Section):
    name: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the key")
    models: list[str] | None = Field(default=None, description="models the key may use; all when unset")
    limits: Limits | None = None
    guardrails: Guardrails | None = None
    cache_scope: str | None = Field(default=None, min_length=1, description=(
        "what the key's requests share: the gateway's cached answers, and a server's prefix-cached KV, "
        "pinned prefixes and n-gram drafts from earlier answers; keys with the same scope share them; "
        "unset: the key's own name, so no other key receives its answers or can time its prompts"))

    @property
    def scope(self) -> str:
        return self.cache_scope or f"key:{self.name}"


def cache_salt(scope: str | None, salt: str | None) -> str:
    """An engine's salt for a request (its prefix cache and n-gram history are shared only among
    equal salts): the API key's scope and, within it, the client's own `cache_salt` (vLLM's
    field), so that no client salt reaches into another key's scope."""
    return "\x1f".join(part for part in (scope and f"scope:{scope}", salt and f"salt:{salt}") if part)


class RequestLimits(_Section):
    """Checked before any engine work; each violation is a 400 naming the limit."""

    max_messages: int = Field(default=256, ge=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_n: int = Field(default=16, ge=1)


class SecurityConfig(_Section):
    keys: list[KeyEntry] = Field(default_factory=list)
    defaults: Limits = Field(default_factory=Limits, description="limits of keys that set none")
    guardrails: Guardrails = Field(default_factory=Guardrails, description="guardrails of keys that set none")
    model_guardrails: dict[str, Guardrails] = Field(
        default_factory=dict, description="per model (a gateway route): for keys that set none")
    request_limits: RequestLimits = Field(default_factory=RequestLimits)
    protect_metrics: bool = False
    redis_url: str | None = Field(default=None, description="share limits between replicas through Redis")
    redis_prefix: str = "hyperserve:limits:"
    redis_timeout_s: float = Field(default=0.5, gt=0,
                                   description="a limiter call slower than this counts as down")
    redis_unavailable: Literal["open", "closed"] = Field(
        default="open", description="Redis down: admit without limits (open) or refuse with 503 (closed)")
    audit_log: str | None = Field(default=None, description="JSON-lines audit log path")
    audit_prompts: bool = Field(default=False, description="also write prompts to the audit log")

    def keys_only(self) -> SecurityConfig:
        """The same keys and request bounds, without limits, guardrails, Redis or audit log: for an
        app behind a front that enforces those (Ray Serve's replicas behind its ingress), which
        still needs each request's key for what belongs to it there: its cache scope. /metrics
        stays open to the front, which gathers every replica's."""
        keys = [key.model_copy(update={"limits": None, "guardrails": None}) for key in self.keys]
        return SecurityConfig(keys=keys, request_limits=self.request_limits)

    @model_validator(mode="after")
    def _unique(self) -> SecurityConfig:
        for attribute in ("name", "sha256"):
            values = [getattr(k, attribute) for k in self.keys]
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                raise ValueError(f"keys: duplicate {attribute} {duplicates}")
        return self


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_security_config(path: str | Path | None, api_key: str | None = None, **overrides) -> SecurityConfig:
    """The keys file (if any), plus a single `--api-key` as a key named "default", plus flag overrides."""
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}  # YAML is a superset of JSON
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"cannot read keys file {path}: {error}") from error
    if api_key is not None:
        data.setdefault("keys", []).append({"name": "default", "sha256": hash_key(api_key)})
    for field, value in overrides.items():
        if value is not None:
            data[field] = value
    try:
        return SecurityConfig.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
                             for e in error.errors())
        raise ValueError(f"invalid security config {path or 'flags'}: {problems}") from None
