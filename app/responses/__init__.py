"""OpenAI's Responses API (`/v1/responses`): one more way into the chat machinery, not a second engine.
A request is translated into a chat completion body (app/responses/translate.py), admitted, queued and
generated as chat completions are, and its result rendered as a `response` object or as Responses'
semantic stream events; stored responses live in the server's SQLite database, one tenant's apart."""
