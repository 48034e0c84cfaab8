"""A fourth API surface is one translator over app/serving: this plain `/generate` (a prompt in, its
text out) reads its body, admits, submits, waits and answers through the serving core alone, with
the same tenant gate, quotas, model check and errors as the other surfaces get, and nothing of
app/openai, app/anthropic or app/responses."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.plumbing.errors import APIError, json_response
from app.serving.bodies import parsed_body
from app.serving.context import ServingContext
from app.serving.schemas import CompletionBody
from app.serving.submission import ChoiceStarter
from scheduling.request import PriorityClass
from tests.app.conftest import instant_context


class GenerateSurface:
    """The whole surface: its route, its translation in and out."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.starter = ChoiceStarter(context)

    async def generate(self, request: Request) -> Response:
        tenant = self.context.gate.authenticate(request)
        body = await parsed_body(self.context, request, tenant, CompletionBody)
        prompt = self.context.tokenizer.encode(str(body.prompt))
        started = self.starter.start("gen-" + uuid.uuid4().hex, body, [prompt], tenant, "prompt",
                                     PriorityClass.INTERACTIVE)

        async def text() -> dict[str, Any]:
            [result] = await started.choices.collect_all()
            return {"text": result.text, "finish_reason": result.finish_reason}

        return await self.starter.whole_answer(request, text(), started.headers)


def app_of(context: ServingContext) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await context.engine.start()
        try:
            yield
        finally:
            await context.engine.shutdown()

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return json_response(exc.body(), exc.status)

    return Starlette(routes=[Route("/generate", GenerateSurface(context).generate, methods=["POST"])],
                     lifespan=lifespan, exception_handlers={APIError: api_error})


async def test_a_surface_of_one_translator_serves_through_the_core() -> None:
    context = instant_context(script=b"Hello from the core.")
    app = app_of(context)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            answered = await client.post("/generate", json={"model": context.model_name, "prompt": "Hi",
                                                            "max_tokens": 64})
            wrong_model = await client.post("/generate", json={"model": "nope", "prompt": "Hi"})
            invalid = await client.post("/generate", json={"model": context.model_name, "prompt": "Hi",
                                                           "max_tokens": -1})
    assert answered.status_code == 200, answered.text
    assert answered.json() == {"text": "Hello from the core.", "finish_reason": "stop"}
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["code"] == "model_not_found"
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"
    assert context.gate.num_held == 0
