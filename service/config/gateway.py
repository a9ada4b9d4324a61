"""The OpenAI-compatible front door: ``EMBEDSERVE_GATEWAY__<FIELD>``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from embedserve.settings_errors import ConfigError

API_KEYS_FILE = "EMBEDSERVE_GATEWAY__API_KEYS_FILE"
API_KEYS_FILE_ACCEPTS = "a readable file of API keys, one a line ('#' starts a comment)"


class GatewaySettings(BaseModel):
    """The OpenAI-compatible front door."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_inputs: int = Field(2048, ge=1, description="inputs of one embeddings request; more: 400")
    max_tokens_per_request: int = Field(
        300_000, ge=1, description="tokens of one embeddings request, all its inputs; more: 400"
    )
    max_body_bytes: int = Field(
        16 << 20, ge=64, description="request body; 413 beyond (the smallest request is about 30 bytes)"
    )
    max_head_bytes: int = Field(32 * 1024, ge=1024, description="request line + headers; 431 beyond")
    max_string_chars: int = Field(1_000_000, ge=1, description="longest string accepted before tokenisation")
    max_colbert_tokens_per_request: int = Field(
        16_384,
        ge=1,
        description="tokens of one request that asks a model's ColBERT output (a vector per token: 4 KiB "
        "each at 1,024 dimensions, about three times that as JSON numbers); more: 400",
    )
    batch_max_wait_ms: float = Field(
        0.0, ge=0, description="extra wait for more inputs while all engine calls are busy"
    )
    engine_calls_per_engine: int | None = Field(
        None,
        ge=1,
        description="coalesced calls in flight per engine (default 4 for SGLang, 1 for the CPU "
        "engine, which computes one at a time); while all are busy, "
        "inputs of concurrent requests gather into the next call",
    )
    max_inputs_per_engine_call: int = Field(256, ge=1)
    max_tokens_per_engine_call: int | None = Field(
        None,
        ge=8,
        description="one engine call's token budget, so other requests' inputs interleave with a "
        "large request's. Default: engine.batch_token_budget for SGLang, 512 for the CPU "
        "engine (a fraction of a second of its work on two cores)",
    )
    max_tokens_in_flight: int | None = Field(
        None,
        ge=1,
        description="admission control: beyond this, 429 with Retry-After. Default: 262,144 for "
        "a GPU engine, 32,768 for the CPU engine (tens of seconds of its work, so overload "
        "answers 429 instead of queueing into 504s)",
    )
    request_timeout_s: float = Field(60.0, gt=0, description="per-request deadline (504)")
    priority_aging_s: float = Field(
        10.0,
        gt=0,
        description="a request that has waited this long for the engines takes its turns among the "
        "most urgent waiting work, whatever its priority: less urgent work is delayed, never starved. "
        "Keep it above the wait a bulk client makes for itself, or its work ages into the urgent turns",
    )
    tokenizer_threads: int = Field(2, ge=1)
    inline_tokenize_chars: int | None = Field(
        None,
        ge=0,
        description="requests with at most this many characters are tokenised on the event loop "
        "instead of a tokenizer thread. Default: 0 (all to the threads) in front of SGLang: with "
        "Qwen3's tokenizer the threads cut the loop's time per request by 18-30%, and on one H200 "
        "the 0.6B ran 1.19x on short inputs; 2,048 for the CPU engine",
    )
    event_loop: Literal["asyncio", "uvloop"] = Field(
        "asyncio",
        description="the gateway process's event loop: asyncio's own, or uvloop (libuv) where it "
        "is installed (asyncio otherwise, with a warning). On one H200 the 0.6B measured no faster "
        "with uvloop",
    )
    normalize: bool = True
    accept_token_ids: bool = Field(
        False,
        description="embed token-id input as this model's own ids. Off: ids are refused (400), "
        "because ids from another tokenizer (LangChain's default sends tiktoken's) would give "
        "wrong vectors with no error",
    )
    api_keys: list[SecretStr] = Field(default_factory=list)
    api_keys_file: str | None = Field(
        None,
        description="more keys, one a line ('#' comments); a file that is missing, unreadable or "
        "holds no key is refused at start, never read as 'no authentication'",
    )
    protect_health: bool = False
    protect_metrics: bool = False
    cors_origins: list[str] = Field(default_factory=list)
    graceful_shutdown_s: float = 30.0
    header_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a request head (request line and headers) must arrive within this many "
        "seconds of its first byte (of the connection, for its first request): 408 and closed "
        "beyond, so a client trickling its head cannot hold a connection",
    )
    body_idle_timeout_s: float = Field(
        20.0,
        gt=0,
        description="a request body may stall at most this long, and must average 500 bytes/s "
        "beyond this allowance: 408 and closed beyond",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="idle keep-alive; longer than clients' pools (httpx and the OpenAI SDK 5 s, "
        "aiohttp 15 s) and load balancers' (AWS ALB 60 s), so the server never closes a "
        "connection a client is reusing at that instant",
    )


def api_keys(gw: GatewaySettings) -> list[str]:
    """The keys requests must bear: ``api_keys`` and the file's lines. Someone who names a keys
    file means authentication on, so a file that cannot be read or holds no key (a secret
    mounted empty) is a ``ConfigError``, not an open service."""
    keys = [k.get_secret_value() for k in gw.api_keys]
    if not gw.api_keys_file:
        return keys
    path = Path(gw.api_keys_file)
    refused = f"{API_KEYS_FILE} must be {API_KEYS_FILE_ACCEPTS}, but {path}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{refused} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{refused} cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    lines = (line.strip() for line in text.splitlines())
    found = [line for line in lines if line and not line.startswith("#")]
    if not found:
        raise ConfigError(f"{refused} holds no key (only blank lines and comments): the API would be open")
    return keys + found
