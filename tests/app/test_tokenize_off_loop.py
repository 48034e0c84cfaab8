"""/tokenize and /detokenize of long inputs run in a worker thread, not on the event loop that serves
every tenant's streams; short ones stay on the loop (a thread hop would cost more than the work)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from app.openai.tokenization import THREAD_DECODE_TOKENS
from app.serving.off_loop import THREAD_TOKENIZE_CHARS
from tests.app.conftest import ServerThread


class ThreadRecorder:
    """Wraps a tokenizer method and notes the thread each call ran on."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.method(*args, **kwargs)


@pytest.mark.parametrize(("path", "method", "payload"), [
    ("/tokenize", "encode", {"prompt": "x" * THREAD_TOKENIZE_CHARS}),
    ("/detokenize", "decode", {"tokens": [65] * THREAD_DECODE_TOKENS}),
])
def test_long_inputs_are_tokenized_off_the_event_loop(instant_server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                                                      path: str, method: str, payload: dict[str, Any]) -> None:
    tokenizer = instant_server.context.tokenizer
    recorder = ThreadRecorder(getattr(tokenizer, method))
    monkeypatch.setattr(tokenizer, method, recorder)
    short = {key: value[:3] for key, value in payload.items()}
    for body in (short, payload):
        assert httpx.post(f"{instant_server.base_url}{path}", json=body, timeout=30).status_code == 200
    loop_thread = "test-uvicorn"  # ServerThread's event loop
    assert recorder.threads[0] == loop_thread
    assert recorder.threads[-1] != loop_thread
