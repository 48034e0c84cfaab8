"""Responses' semantic stream events for one response, numbered in the order the client expects.

`response.created` and `response.in_progress` open the stream; a background response's opens with
`response.created` and `response.queued` (status `queued`), and `response.in_progress` comes with its
first output. Text opens a message item and its output_text part, then comes as deltas; a function
call closes the message (text done, part done, item done) and opens a function_call item whose
arguments come as deltas. The end closes what is open and sends the whole response:
`response.completed`, or `response.incomplete` when max_output_tokens cut it, or, after an `error`
event, `response.failed`. A cancelled response has no end event (OpenAI's stream has none for it).
"""

from __future__ import annotations

from typing import Any

from app.plumbing.json_lines import dumps_one_line
from app.responses.objects import ResponseHead, failed, finished
from app.responses.translate import function_call_item, message_item, new_id, output_text_part
from app.serving.generation import Usage


def sse_frame(event: dict[str, Any]) -> bytes:
    """One event, named as OpenAI names them so that clients routing on `event:` see its type."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + dumps_one_line(event) + b"\n\n"


class NumberedEvents:
    """Makes event frames numbered in the order they are made: `sequence_number` 0, 1, 2, ... with no
    gap, so that a frame's number is its position in the stream (app/responses/replay.py relies on it)."""

    def __init__(self) -> None:
        self._sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return sse_frame(event)


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self._head = head
        self._event = NumberedEvents()
        self._is_in_progress_sent = False
        self.output: list[dict[str, Any]] = []  # every item opened, in output_index order; final once ended
        self._message_index: int | None = None  # the open message item, while text may still come
        self._calls: dict[int, int] = {}  # a streamed call's index (tool-call deltas) -> its output index
        self.response: dict[str, Any] | None = None  # the final response object, once ended

    def opening(self) -> list[bytes]:
        """A response generated while the client waits: it is in progress from the start."""
        return [self._event("response.created", response=self._head.render("in_progress")), *self.in_progress()]

    def queued_opening(self) -> list[bytes]:
        """A background response: queued until its generation starts (then `in_progress`)."""
        queued = self._head.render("queued")
        return [self._event("response.created", response=queued), self._event("response.queued", response=queued)]

    def in_progress(self) -> list[bytes]:
        """`response.in_progress`, the first time only."""
        if self._is_in_progress_sent:
            return []
        self._is_in_progress_sent = True
        return [self._event("response.in_progress", response=self._head.render("in_progress"))]

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
        """Tool-call deltas in the chat shape (app/serving/tools.py's ToolStream): the first of a call
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


# ---- rebuilt from a stored response -------------------------------------------------------------

END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def rebuilt_events(response: dict[str, Any]) -> list[bytes]:
    """The stream of a stored background response whose events are no longer kept, rebuilt from the
    response object: its opening, each output item whole (its text or arguments as one delta), then its
    end. Numbered anew, with fewer deltas than the original: a cursor into that one does not apply here."""
    event = NumberedEvents()
    frames = [event("response.created", response=_before_output(response, "queued")),
              event("response.queued", response=_before_output(response, "queued"))]
    if response["status"] == "queued":
        return frames
    frames.append(event("response.in_progress", response=_before_output(response, "in_progress")))
    for index, item in enumerate(response["output"]):
        frames += _message_events(event, index, item) if item["type"] == "message" else \
            _call_events(event, index, item)
    return frames + _end_events(event, response)


def _before_output(response: dict[str, Any], status: str) -> dict[str, Any]:
    """The response as it was in `status`, before any output."""
    return {**response, "status": status, "output": [], "usage": None, "error": None, "incomplete_details": None,
            "completed_at": None}


def _message_events(event: NumberedEvents, index: int, message: dict[str, Any]) -> list[bytes]:
    part = message["content"][0] if message["content"] else output_text_part("")
    fields = {"item_id": message["id"], "output_index": index, "content_index": 0}
    frames = [event("response.output_item.added", output_index=index,
                    item={**message, "status": "in_progress", "content": []}),
              event("response.content_part.added", **fields, part=output_text_part(""))]
    if part["text"]:
        frames.append(event("response.output_text.delta", **fields, delta=part["text"], logprobs=[]))
    return [*frames, event("response.output_text.done", **fields, text=part["text"], logprobs=[]),
            event("response.content_part.done", **fields, part=part),
            event("response.output_item.done", output_index=index, item=message)]


def _call_events(event: NumberedEvents, index: int, call: dict[str, Any]) -> list[bytes]:
    fields = {"item_id": call["id"], "output_index": index}
    frames = [event("response.output_item.added", output_index=index,
                    item={**call, "arguments": "", "status": "in_progress"})]
    if call["arguments"]:
        frames.append(event("response.function_call_arguments.delta", **fields, delta=call["arguments"]))
    return [*frames, event("response.function_call_arguments.done", **fields, arguments=call["arguments"]),
            event("response.output_item.done", output_index=index, item=call)]


def _end_events(event: NumberedEvents, response: dict[str, Any]) -> list[bytes]:
    """The end events of its status; none for a cancelled one (nor for one still active)."""
    kind = END_EVENTS.get(response["status"])
    if kind is None:
        return []
    error = response.get("error") or {}
    errors = [event("error", code=error.get("code"), message=error.get("message"), param=None)] \
        if response["status"] == "failed" else []
    return [*errors, event(kind, response=response)]
