"""POST /v1/feedback: a user's rating of one answer, stored with the model version, lane and cost record
of the request that produced it (server/ops/feedback.py). Off (404) unless `feedback_db` is set.

Body: `{"request_id": "...", "rating": -1 | 1 | 2..5, "comment": "..."?}`. 201 with the stored row;
404 for a request id this server does not know (never seen, or older than the record window); 409 when
that request was rated already (also after a restart: the database remembers).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, Strict

from server.api.protocol import parse_body
from server.http.errors import ApiError
from server.ops.feedback import RATINGS, AlreadyRated
from server.serving.runtime import Runtime

router = APIRouter(prefix="/v1")


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[str, Field(min_length=1, max_length=128)]
    rating: Annotated[int, Strict()]
    comment: Annotated[str, Field(max_length=4000)] | None = None


@router.post("/feedback")
async def feedback(request: Request) -> JSONResponse:
    rt: Runtime = request.app.state.runtime
    if rt.feedback is None:
        raise ApiError(404, "not_found", "feedback is off on this server (set feedback_db)")
    body = await parse_body(request, FeedbackBody)
    if body.rating not in RATINGS:
        raise ApiError(400, "invalid_request", f"rating must be -1 or 1 (thumbs) or 1-5 (stars), got {body.rating}",
                       param="rating")  # fmt: skip
    conflict = ApiError(409, "conflict", f"request {body.request_id!r} was rated already", param="request_id")
    if await rt.feedback.rated(body.request_id):
        raise conflict
    record = rt.records.get(body.request_id)
    if record is None:
        raise ApiError(404, "not_found", f"no recent request {body.request_id!r} (requests can be rated for "
                       f"{rt.settings.request_record_ttl_s:g}s, the last {rt.settings.request_records})",
                       param="request_id")  # fmt: skip
    try:
        row = await rt.feedback.add(record, body.rating, body.comment)
    except AlreadyRated:
        raise conflict from None
    rt.metrics.version(record.model, record.version).observe_feedback(body.rating)
    return JSONResponse(row, status_code=201)
