"""GET /v1/models and GET /v1/models/{id}: the one served model, through the openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from .helpers import MODEL, RunningServer


def test_retrieve_returns_the_served_model_as_the_list_shows_it(client: OpenAI) -> None:
    listed = client.models.list().data
    model = client.models.retrieve(MODEL)
    assert [m.id for m in listed] == [model.id] == [MODEL]
    assert model.object == "model" and model.owned_by == listed[0].owned_by
    assert model.model_dump().keys() == listed[0].model_dump().keys()


@pytest.mark.parametrize("model_id", ["gpt-17", "org/SmolLM2-135M-Instruct"])
def test_retrieve_of_another_model_is_an_openai_404(client: OpenAI, model_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve(model_id)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_retrieves_share_one_metrics_label(server: RunningServer) -> None:
    label = {"endpoint": "/v1/models/{model_id}", "status": "404"}
    before = server.sample("graphguard_server_requests_total", **label)
    for model_id in ("a", "b"):
        assert httpx.get(f"{server.base_url}/v1/models/{model_id}").status_code == 404
    assert server.sample("graphguard_server_requests_total", **label) == before + 2
