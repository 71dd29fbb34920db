"""POST /v1/feedback: a user's rating of one answer, stored with the model version, LoRA adapter, lane and
cost record of the request that produced it (server/ops/feedback.py). Off (404) unless `feedback_db` is set.

Body: `{"request_id": "...", "choice": 0?, "rating": -1 | 1 | 2..5, "comment": "..."?, "user": "..."?}`.
`request_id` is the response's `id`; `choice` the index of the rated choice (default 0) when the
response had several (a list of prompts, n > 1). Only the request's owner may rate it: the same API key
and the same `user` as the request (server/serving/dispatch.py request_owner). 201 with the stored row;
404 for a request this owner does not have (never seen, older than the record window, or someone
else's: the answers are the same), naming `choice` when the response is there but not that choice; 409
when that choice was rated already (also after a restart: the database remembers).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, Strict

from server.api.protocol import parse_body
from server.http.errors import ApiError
from server.http.numbers import MAX_INT, MIN_INT
from server.ops.feedback import RATINGS, AlreadyRated, RecordKey
from server.serving.dispatch import request_owner
from server.serving.runtime import Runtime

router = APIRouter(prefix="/v1")

MAX_CHOICE = 1023  # choices of one response (server/api/openai.py MAX_CHOICES) are numbered from 0


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
    choice: Annotated[int, Strict(), Field(ge=0, le=MAX_CHOICE)] = 0
    rating: Annotated[int, Strict(), Field(ge=MIN_INT, le=MAX_INT)]
    comment: Annotated[str, Field(max_length=4000)] | None = None
    user: str | None = None  # the request's `user`, when it gave one


@router.post("/feedback")
async def feedback(request: Request) -> JSONResponse:
    rt: Runtime = request.app.state.runtime
    if rt.feedback is None:
        raise ApiError(404, "not_found", "feedback is off on this server (set feedback_db)")
    body = await parse_body(request, FeedbackBody)
    if body.rating not in RATINGS:
        raise ApiError(400, "invalid_request", f"rating must be -1 or 1 (thumbs) or 1-5 (stars), got {body.rating}",
                       param="rating")  # fmt: skip
    key = RecordKey(request_owner(rt, request, body.user), body.request_id, body.choice)
    conflict = ApiError(409, "conflict", f"request {body.request_id!r} choice {body.choice} was rated already",
                        param="request_id")  # fmt: skip
    if await rt.feedback.rated(key):
        raise conflict
    record = rt.records.get(key)
    if record is None:
        raise _not_found(rt, key)
    try:
        row = await rt.feedback.add(record, body.rating, body.comment)
    except AlreadyRated:
        raise conflict from None
    rt.metrics.version(record.model, record.version).observe_feedback(body.rating, record.lora)
    return JSONResponse(row, status_code=201)


def _not_found(rt: Runtime, key: RecordKey) -> ApiError:
    """404 naming `choice` when the owner's response is known but has no such choice, else `request_id`."""
    if key.choice > 0 and rt.records.get(RecordKey(key.owner, key.request_id)) is not None:
        return ApiError(404, "not_found", f"request {key.request_id!r} has no choice {key.choice}", param="choice")
    return ApiError(404, "not_found", f"no recent request {key.request_id!r} (requests can be rated for "
                    f"{rt.settings.request_record_ttl_s:g}s, the last {rt.settings.request_records}, by the "
                    "API key and user that made them)", param="request_id")  # fmt: skip
