"""The Responses API assembled: its store (a table of the server's SQLite database), the background
responses and the routes, built from the serving context."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.routing import Route

from app.responses.routes import ResponsesRoutes
from app.responses.store import ResponseStore
from app.serving.context import ServingContext


@dataclass(slots=True)
class ResponsesAPI:
    store: ResponseStore
    handlers: ResponsesRoutes

    @classmethod
    def build(cls, context: ServingContext) -> ResponsesAPI:
        """Opens the database of `settings.batch_db_path` (DatabaseUnusable stops start-up there)."""
        store = ResponseStore(context.settings.batch_db_path)
        return cls(store, ResponsesRoutes(context, store))

    @property
    def routes(self) -> list[Route]:
        return self.handlers.routes()

    async def start(self) -> None:
        await self.handlers.background.start()

    async def stop(self) -> None:
        """Background responses still running are recorded failed, then the store closes."""
        await self.handlers.background.stop()
        await self.store.close()
