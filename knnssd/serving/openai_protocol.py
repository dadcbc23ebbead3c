"""The OpenAI API's shapes as knnssd takes and answers them: requests to /v1/completions and
/v1/chat/completions (checked whole before any work; a field knnssd does not support, at a value
other than its neutral one, is an ``ApiError`` that names it), their answers and stream chunks, and
errors in OpenAI's form ``{"error": {"message", "type", "param", "code"}}``.

Each choice carries the request's speculative figures under ``"knnssd"``, which OpenAI clients
ignore: drafted and accepted tokens, verification steps, the routed cluster and its drafter.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from knnssd.engine.spec.request_params import GenerateParams
from knnssd.serving.routed import Result

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 1024  # OpenAI's chat has none (up to the context); a bound keeps a slot's cache small
FINISH = {"eos": "stop", "stop_string": "stop", "length": "length"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# fields of OpenAI's requests that knnssd takes only at the value that asks for nothing
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "presence_penalty": 0,
           "frequency_penalty": 0, "logit_bias": None, "suffix": None, "tools": None, "tool_choice": None,
           "functions": None, "function_call": None, "parallel_tool_calls": None, "response_format": None,
           "modalities": None, "audio": None, "prediction": None}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 that names it, not ignored
    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)  # not OpenAI's: vLLM's and llama.cpp's extension
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None  # taken and not used, as OpenAI's own servers keep it for abuse checks
    n: Any = 1
    best_of: Any = 1
    echo: Any = False
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = 0
    frequency_penalty: Any = 0
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    @field_validator(*NEUTRAL)
    @classmethod
    def _supported(cls, value, info):
        neutral = NEUTRAL[info.field_name]
        if value == neutral or value in (None, False, 0, {}, []) and neutral in (None, False, 0):
            return value
        if info.field_name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            return value
        raise ValueError(f"'{info.field_name}' is not supported by knnssd (got {value!r:.60})")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("'stream_options' is only allowed with 'stream': true")
        return value

    def params(self, default_max_tokens: int) -> GenerateParams:
        """The generation this request asks for (OpenAI's defaults: temperature 1, top_p 1)."""
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return GenerateParams(max_new_tokens=self.max_tokens or default_max_tokens,
                              temperature=float(1.0 if self.temperature is None else self.temperature),
                              top_k=self.top_k or 0, top_p=float(1.0 if self.top_p is None else self.top_p),
                              seed=None if self.seed == -1 else self.seed, stop=stop)  # -1: a random seed

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, f"'prompt' must be one string (a list of {len(self.prompt)} prompts asks for a "
                               "batch: send one request each)", "prompt")
            return self.prompt[0]
        return self.prompt


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[dict]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"message content parts must be {{'type': 'text', 'text': ...}}, got "
                               f"{str(part)[:60]}", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    def params(self, default_max_tokens: int) -> GenerateParams:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins over the deprecated max_tokens
            self.max_tokens = self.max_completion_tokens
        return super().params(default_max_tokens)

    def render(self, tokenizer) -> str:
        """The prompt the model's chat template makes of the messages, ready for the assistant's turn."""
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's own rule (e.g. roles that must alternate)
            raise ApiError(400, f"the model's chat template refused the messages: {str(e)[:200]}", "messages") from None


def figures(result: Result, version: str | None) -> dict:
    """The request's speculative decoding, for the choice's ``"knnssd"`` field."""
    s = result.stats
    return {"drafted": s.drafted, "accepted": sum(s.accepted), "steps": s.steps,
            "acceptance_rate": s.acceptance_rate, "cluster": result.cluster, "label": result.label,
            "drafter": result.drafter, "bank_version": version, "prompt_truncated": result.truncated}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """The answer's envelope for one request: its id, time and kind (``chat`` or not)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, extra: dict, use: dict) -> dict:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None, "knnssd": extra}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(False), "choices": [choice], "usage": use}

    def chunk(self, text: str | None, finish: str | None = None, extra: dict | None = None, first: bool = False
              ) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if extra is not None:
            choice["knnssd"] = extra
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, use: dict) -> dict:
        return {**self._envelope(True), "choices": [], "usage": use}
