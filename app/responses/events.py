"""Responses' semantic stream events for one response, numbered in the order the client expects.

`response.created` and `response.in_progress` open the stream. Text opens a message item and its
output_text part, then comes as deltas; a function call closes the message (text done, part done,
item done) and opens a function_call item whose arguments come as deltas. The end closes what is
open and sends the whole response: `response.completed`, or `response.incomplete` when
max_output_tokens cut it, or, after an `error` event, `response.failed`.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.responses.objects import ResponseHead, failed, finished
from app.responses.translate import function_call_item, message_item, new_id, output_text_part
from app.serving.generation import Usage


def sse_frame(event: dict[str, Any]) -> bytes:
    """One event, named as OpenAI names them so that clients routing on `event:` see its type."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self._head = head
        self._sequence_number = 0
        self.output: list[dict[str, Any]] = []  # every item opened, in output_index order; final once ended
        self._message_index: int | None = None  # the open message item, while text may still come
        self._calls: dict[int, int] = {}  # a streamed call's index (tool-call deltas) -> its output index
        self.response: dict[str, Any] | None = None  # the final response object, once ended

    def opening(self) -> list[bytes]:
        in_progress = self._head.render("in_progress")
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = self._open_message() if self._message_index is None else []
        assert self._message_index is not None
        message = self.output[self._message_index]
        message["content"][0]["text"] += delta
        events.append(self._event("response.output_text.delta", item_id=message["id"],
                                  output_index=self._message_index, content_index=0, delta=delta, logprobs=[]))
        return events

    def call_deltas(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Tool-call deltas in the chat shape (app/openai/tools.py's ToolStream): the first of a call
        carries its id and name, later ones more of its arguments."""
        events: list[bytes] = []
        for delta in deltas:
            if "id" in delta:
                events += self._close_message() + self._open_call(delta)
            events += self._arguments(delta["index"], delta["function"].get("arguments") or "")
        return events

    def finish(self, finish_reason: str | None, usage: Usage) -> list[bytes]:
        events = self._open_message() if not self.output else []  # an empty answer is an empty message
        status = "incomplete" if finish_reason == "length" else "completed"
        events += self._close_message(status) + self._close_calls(status)
        self.response = finished(self._head, self.output, usage, finish_reason)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response)]

    def fail(self, message: str, code: str) -> list[bytes]:
        self.response = {**failed(self._head, message), "output": self.output}
        return [self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=self.response)]

    # ---- items --------------------------------------------------------------------------------

    def _open_message(self) -> list[bytes]:
        self._message_index = len(self.output)
        message = message_item(new_id("msg_"), "", "in_progress")
        message["content"] = []
        self.output.append(message)
        events = [self._event("response.output_item.added", output_index=self._message_index, item=message)]
        message["content"].append(output_text_part(""))
        events.append(self._event("response.content_part.added", item_id=message["id"],
                                  output_index=self._message_index, content_index=0, part=output_text_part("")))
        return events

    def _close_message(self, status: str = "completed") -> list[bytes]:
        index, self._message_index = self._message_index, None
        if index is None:
            return []
        message = self.output[index]
        part = message["content"][0]
        message["status"] = status
        return [self._event("response.output_text.done", item_id=message["id"], output_index=index,
                            content_index=0, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=message["id"], output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=message)]

    def _open_call(self, delta: dict[str, Any]) -> list[bytes]:
        index = len(self.output)
        self._calls[delta["index"]] = index
        self.output.append(function_call_item(new_id("fc_"), delta["id"], delta["function"]["name"], "",
                                              "in_progress"))
        return [self._event("response.output_item.added", output_index=index, item=dict(self.output[index]))]

    def _arguments(self, call_index: int, arguments: str) -> list[bytes]:
        index = self._calls.get(call_index)
        if index is None or not arguments:
            return []
        call = self.output[index]
        call["arguments"] += arguments
        return [self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                            delta=arguments)]

    def _close_calls(self, status: str) -> list[bytes]:
        events: list[bytes] = []
        for index in self._calls.values():
            call = self.output[index]
            call["status"] = status
            events += [self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                   arguments=call["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=call)]
        self._calls.clear()
        return events

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return sse_frame(event)
