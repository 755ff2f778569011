"""lm-evaluation-harness's `local-completions` with its default `tokenizer_backend="auto"`
works against this server: the HTTP calls its remote tokenizer makes (lm_eval/utils.py,
`check_remote_tokenizer_support` and `RemoteTokenizer`; lm_eval/models/api_models.py and
openai_completions.py for how they are used), replayed with `requests` as lm-eval sends them,
reading the response fields lm-eval reads. lm-eval itself is not a dependency."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

from graphguard.engine.engine import LLMEngine
from graphguard.engine.tokens.tokenizer import Tokenizer

from .conftest import TEST_ENGINE, engine_sharing_weights, serve
from .helpers import MODEL, RunningServer

API_KEY = "sk-lm-eval-0123456789"
SEED = 1234  # lm-eval's default seed


class ReplayedRemoteTokenizer:
    """The requests lm-eval's RemoteTokenizer makes, nothing more."""

    def __init__(self, base_url: str, auth_token: str | None = None) -> None:
        # lm-eval strips the endpoint off the `base_url` it was given.
        self.base_url = base_url.replace("/v1/completions", "").rstrip("/")
        self.session = requests.Session()
        self.session.headers.update(_headers(auth_token))
        self.info = self._get("/tokenizer_info").json()

    def _get(self, path: str) -> requests.Response:
        response = self.session.request("GET", f"{self.base_url}{path}", timeout=30)
        response.raise_for_status()
        return response

    def _post(self, path: str, payload: dict[str, Any]) -> requests.Response:
        response = self.session.request("POST", f"{self.base_url}{path}", json=payload, timeout=30)
        response.raise_for_status()
        return response

    def encode(self, text: str) -> list[int]:
        tokens = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return list(tokens.json().get("tokens"))

    def decode(self, tokens: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": tokens}).json().get("prompt"))

    @property
    def eos_token_id(self) -> int | None:  # lm-eval: the first id of its encoded eos_token
        eos = self.info.get("eos_token")
        return None if eos is None else self.encode(eos)[0]

    @property
    def bos_token_id(self) -> int | None:
        bos = self.info.get("bos_token")
        return None if bos is None else self.encode(bos)[0]


def _headers(auth_token: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if auth_token:
        headers["Authorization"] = f"Bearer {auth_token}"
    return headers


def supports_remote_tokenizer(base_url: str, auth_token: str | None = None) -> bool:
    """lm-eval's `check_remote_tokenizer_support`, which `tokenizer_backend="auto"` runs."""
    session = requests.Session()
    session.headers.update(_headers(auth_token))
    server = base_url.replace("/v1/completions", "").rstrip("/")
    info = session.request("GET", f"{server}/tokenizer_info", timeout=5)
    if not info.ok or not isinstance(info.json(), dict) or "eos_token" not in info.json():
        return False
    test = {"prompt": "test", "add_special_tokens": False}
    tokens = session.request("POST", f"{server}/tokenize", json=test, timeout=5)
    return tokens.ok and isinstance(tokens.json().get("tokens"), list)


@pytest.fixture(scope="module")
def tokenizer(engine: LLMEngine) -> Tokenizer:
    return engine.tokenizer


@pytest.fixture(scope="module")
def keyed(engine: LLMEngine) -> Iterator[RunningServer]:
    yield from serve(engine_sharing_weights(engine), TEST_ENGINE, api_key=API_KEY)


def test_auto_detection_picks_the_remote_tokenizer(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    assert supports_remote_tokenizer(f"{server.base_url}/v1/completions")


def test_with_an_api_key_auto_detection_needs_lm_evals_auth_token(
    keyed: RunningServer, tokenizer: Tokenizer
) -> None:
    base_url = f"{keyed.base_url}/v1/completions"
    assert not supports_remote_tokenizer(base_url)
    assert supports_remote_tokenizer(base_url, auth_token=API_KEY)
    assert ReplayedRemoteTokenizer(base_url, auth_token=API_KEY).eos_token_id == 2


def test_the_remote_tokenizer_is_the_servers_tokenizer(
    server: RunningServer, tokenizer: Tokenizer
) -> None:
    remote = ReplayedRemoteTokenizer(f"{server.base_url}/v1/completions")
    text = "The capital of France is Paris."
    assert remote.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text
    # lm-eval's eot_token_id, its eos_string stop sequence, and its rolling-window prefix.
    assert remote.eos_token_id in tokenizer.eos_token_ids
    assert remote.info["eos_token"] == "<|im_end|>"
    prefix_token_id = remote.bos_token_id or remote.eos_token_id
    assert prefix_token_id == tokenizer.token_to_id("<|im_start|>")


def test_a_loglikelihood_request_scores_the_continuation_lm_eval_encoded(
    server: RunningServer,
) -> None:
    remote = ReplayedRemoteTokenizer(f"{server.base_url}/v1/completions")
    context, continuation = remote.encode("1, 2, 3, 4,"), remote.encode(" 5")
    # LocalCompletionsAPI._create_payload(generate=False), posted to base_url.
    payload = {
        "model": MODEL,
        "prompt": [context + continuation],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": SEED,
        "echo": True,
    }
    response = requests.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    response.raise_for_status()
    # LocalCompletionsAPI.parse_logprobs: the continuation's entries, the generated one dropped.
    (choice,) = response.json()["choices"]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    assert len(token_logprobs) == len(continuation) and sum(token_logprobs) < 0
    is_greedy = all(
        lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs, strict=True)
    )
    assert is_greedy  # " 5" follows "1, 2, 3, 4," (the model's documented continuation)


def test_a_generation_request_stops_at_lm_evals_eos_string(server: RunningServer) -> None:
    remote = ReplayedRemoteTokenizer(f"{server.base_url}/v1/completions")
    # LocalCompletionsAPI._create_payload(generate=True): token ids, `until` plus eos_string.
    payload = {
        "prompt": [remote.encode("The capital of France is")],
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "stop": ["\n\n", remote.info["eos_token"]],
        "seed": SEED,
    }
    response = requests.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    response.raise_for_status()
    (choice,) = response.json()["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert "<|im_end|>" not in choice["text"]
