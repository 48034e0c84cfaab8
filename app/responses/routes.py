"""`/v1/responses` in OpenAI's shapes, so that `client.responses` works.

Create: authenticate -> refuse if draining -> read the body (bounded) -> validate -> start (see
runs.py) -> the whole response while watching for the client to leave, or its stream events, or,
for a background one, the queued response at once (with `stream`, its events, which the client may
leave and re-attach to with GET ?stream=true&starting_after=N; see background.py). A tenant sees and
touches only its own stored responses: another tenant's id answers 404, the same as an id that does
not exist, on every path.
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.plumbing.asgi import EventStreamResponse
from app.plumbing.errors import APIError, deepest_problem, from_validation_error, json_response
from app.responses.background import BackgroundResponses
from app.responses.runs import ResponseRunner
from app.responses.schemas import ResponsesBody
from app.responses.store import ResponseStore, StoredResponse
from app.serving.bodies import BodyErrors, parsed_body
from app.serving.context import ServingContext
from app.serving.submission import shutting_down
from tenancy.tenants import Tenant

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
STREAM_VALUES = {"true": True, "1": True, "false": False, "0": False}


class ResponsesRoutes:
    def __init__(self, context: ServingContext, store: ResponseStore) -> None:
        self.context = context
        self.store = store
        self.runner = ResponseRunner(context, store)
        self.background = BackgroundResponses(self.runner, store)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    async def create(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await self._parse(request, tenant)
        run = await self.runner.start(tenant, body)
        if body.is_background and body.is_streamed:
            log = await self.background.launch_streamed(run)
            return EventStreamResponse(log.frames_after(None), run.started.headers)
        if body.is_background:
            return json_response(await self.background.launch(run), headers=run.started.headers)
        if body.stream:
            return EventStreamResponse(self.runner.events(run), run.started.headers)
        return await self.runner.starter.whole_answer(request, self.runner.whole(run), run.started.headers)

    async def retrieve(self, request: Request) -> Response:
        """The stored response; with `stream=true`, its events after `starting_after` (a background
        response created with stream=true only)."""
        tenant = self.context.gate.authenticate(request)
        is_streamed, starting_after = _stream_params(request)  # checked before the id: a 400 tells nothing of it
        stored = await self._own(tenant, request)
        if not is_streamed:
            return json_response(stored.response)
        return EventStreamResponse(self.background.events_after(tenant.tenant_id, stored, starting_after))

    async def delete(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        response_id = request.path_params["response_id"]
        if not await self.store.delete(tenant.tenant_id, response_id):
            raise _no_such(response_id)
        await self.background.discard(response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        response_id = request.path_params["response_id"]
        cancelled = await self.background.cancel(tenant.tenant_id, response_id)
        if cancelled is None:
            raise _no_such(response_id)
        return json_response(cancelled)

    async def input_items(self, request: Request) -> Response:
        """The items of the response's conversation (earlier turns included), newest first unless
        `order=asc`, a page of `limit` after the item `after`."""
        tenant = self.context.gate.authenticate(request)
        items = (await self._own(tenant, request)).items
        limit, order, after = _list_params(request)
        if order == "desc":
            items = items[::-1]
        if after is not None:
            position = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if position is None:
                raise APIError(400, f"No item '{after}' in this response's input items.", param="after")
            items = items[position + 1:]
        page = items[:limit]
        return json_response({"object": "list", "data": page, "has_more": len(items) > limit,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None})

    async def _parse(self, request: Request, tenant: Tenant) -> ResponsesBody:
        if self.context.is_draining:
            raise shutting_down()
        return await parsed_body(self.context, request, tenant, ResponsesBody, RESPONSES_BODY_ERRORS)

    async def _own(self, tenant: Tenant, request: Request) -> StoredResponse:
        response_id = request.path_params["response_id"]
        stored = await self.store.get(tenant.tenant_id, response_id)
        if stored is None:
            raise _no_such(response_id)
        return stored


def _no_such(response_id: str) -> APIError:
    return APIError(404, f"No such response: '{response_id}'.", param="response_id", code="not_found")


def _invalid(exc: ValidationError) -> APIError:
    """The 400 of an invalid body, naming its deepest problem (see `deepest_problem`)."""
    location, problem = deepest_problem(exc)
    if len(problem["loc"]) <= 1 or exc.errors(include_url=False)[0]["type"] == "json_invalid":
        return from_validation_error(exc)
    return APIError(400, f"Invalid value for '{location}': {problem['msg']}", param=str(problem["loc"][0]),
                    code="invalid_value")


RESPONSES_BODY_ERRORS = BodyErrors(invalid=_invalid)


def _list_params(request: Request) -> tuple[int, str, str | None]:
    """(limit, order, after) of a list request, or the 400 that says which is wrong."""
    query = request.query_params
    raw_limit = query.get("limit", str(DEFAULT_LIST_LIMIT))
    if not _is_non_negative_integer(raw_limit) or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_LIST_LIMIT}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'.", param="order")
    return int(raw_limit), order, query.get("after")


def _stream_params(request: Request) -> tuple[bool, int | None]:
    """(stream, starting_after) of a retrieve request, or the 400 that says which is wrong;
    starting_after None: from the first event."""
    query = request.query_params
    stream = query.get("stream", "false").lower()
    if stream not in STREAM_VALUES:
        raise APIError(400, "stream must be 'true' or 'false'.", param="stream")
    raw_after = query.get("starting_after")
    if raw_after is not None and not _is_non_negative_integer(raw_after):
        raise APIError(400, "starting_after must be a non-negative integer: the sequence number of the last "
                            "event received.", param="starting_after")
    return STREAM_VALUES[stream], None if raw_after is None else int(raw_after)


def _is_non_negative_integer(raw: str) -> bool:
    return raw.isascii() and raw.isdigit()  # isdigit alone takes '²', which int() refuses
