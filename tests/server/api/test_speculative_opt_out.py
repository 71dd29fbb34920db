"""The per-request opt-out of speculative decoding: body field `speculative: false` reaches the engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.api.protocol import SamplingFields


def test_speculative_body_field_sets_the_sampling_flag():
    assert SamplingFields().sampling_params(16, None).speculative is True
    assert SamplingFields(speculative=False).sampling_params(16, None).speculative is False
    with pytest.raises(ValidationError, match="speculative"):
        SamplingFields.model_validate({"speculative": "maybe"})
