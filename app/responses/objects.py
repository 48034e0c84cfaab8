"""The `response` object: what a request asked (echoed back), its status, output and usage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.responses.schemas import ResponsesBody
from app.serving.generation import Usage

ACTIVE_STATUSES = ("queued", "in_progress")  # a background response that may still change
LENGTH_FINISH = "length"


@dataclass(slots=True, frozen=True)
class ResponseHead:
    """What every rendering of one response repeats: its id, when, and the request it answers."""

    id: str
    model: str
    body: ResponsesBody
    created_at: int = field(default_factory=lambda: int(time.time()))

    def render(self, status: str, output: list[dict[str, Any]] | None = None, usage: Usage | None = None,
               *, incomplete_reason: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in this status, in the shape OpenAI's client parses."""
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": body.is_background, "model": self.model, "output": output or [],
            "usage": usage_object(usage) if usage is not None else None, "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason is not None else None,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": body.safety_identifier,
            "service_tier": body.service_tier or "default", "store": body.is_stored,
            "temperature": 1.0 if body.temperature is None else body.temperature, "text": self._text(),
            "tool_choice": self._tool_choice(), "tools": [tool.model_dump(exclude_none=True) for tool in
                                                          body.function_tools],
            "top_logprobs": body.top_logprobs or 0, "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled", "user": body.user,
        }

    def _text(self) -> dict[str, Any]:
        text = self.body.text
        text_format = text.format.model_dump(exclude_none=True, by_alias=True) \
            if text is not None and text.format is not None else {"type": "text"}
        return {"format": text_format, "verbosity": "medium"}

    def _tool_choice(self) -> str | dict[str, Any]:
        choice = self.body.tool_choice
        if choice is None:
            return "auto"
        return choice if isinstance(choice, str | dict) else choice.model_dump()


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def finished(head: ResponseHead, output: list[dict[str, Any]], usage: Usage, finish_reason: str | None
             ) -> dict[str, Any]:
    """A generation that ended: completed, or incomplete when max_output_tokens cut it."""
    if finish_reason == LENGTH_FINISH:
        return head.render("incomplete", output, usage, incomplete_reason="max_output_tokens")
    return head.render("completed", output, usage)


def failed(head: ResponseHead, message: str, code: str = "server_error") -> dict[str, Any]:
    return head.render("failed", error={"code": code, "message": message})
