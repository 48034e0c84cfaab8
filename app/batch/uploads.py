"""Uploads streamed, not held: the multipart body is parsed as it arrives, the file part spooled to a
temporary file by Starlette's parser, and the size limit enforced on the way in. Storage that is
full answers 507 in OpenAI's error shape, not a bare 500.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from app.batch.database import StorageFull, StorageQuotaExceeded, is_disk_full
from app.batch.disk_share import DiskShareExceeded
from app.plumbing.asgi import bounded_body
from app.plumbing.errors import APIError

MAX_FIELD_BYTES = 64 * 1024  # the form's text fields ('purpose'); the file part has the upload limit


async def parse_upload_form(request: Request, max_bytes: int,
                            shape: Callable[[AsyncIterator[bytes]], AsyncGenerator[bytes, None]] | None = None
                            ) -> FormData:
    """The multipart form, its file spooled to disk past 1 MiB; 413 as soon as the body passes max_bytes.
    `shape` paces the body's chunks (the tenant's byte rate)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "Upload files as multipart/form-data with 'file' and 'purpose' parts.")
    body = bounded_body(request, max_bytes)
    parser = MultiPartParser(request.headers, body if shape is None else shape(body), max_files=1, max_fields=8,
                             max_part_size=MAX_FIELD_BYTES)
    try:
        with storage_errors("the upload"):
            return await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"Malformed multipart form: {exc.message}") from None


@contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """A full disk (the database's, or the temporary files') answers 507 Insufficient Storage; the
    tenant's own storage quota, 429."""
    try:
        yield
    except StorageQuotaExceeded as exc:
        raise APIError(429, f"Storage limit reached: {exc}.", type="rate_limit_error",
                       code="storage_limit_exceeded") from None
    except DiskShareExceeded as exc:
        raise APIError(507, f"Not stored: {exc}.", code="insufficient_storage") from None
    except (StorageFull, OSError) as exc:
        if isinstance(exc, OSError) and not is_disk_full(exc):
            raise
        raise APIError(507, f"The server's storage is full, so {what} could not be stored. Nothing was kept; "
                            "try again later.", code="insufficient_storage") from None
