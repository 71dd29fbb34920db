"""The endpoints vLLM users and their tools call besides completions, against a real server (tiny model):
GET /v1/models/{id} (openai's models.retrieve), POST /tokenize and /detokenize (vLLM's shapes),
/tokenizer_info, /version, /ping, POST /v1/responses (the openai client, streaming and not), and TGI's
body on POST / and /generate_stream driven by Hugging Face's own InferenceClient (offline)."""

from __future__ import annotations

import json
import warnings

import httpx
import openai
import pytest

from engine import SamplingParams

MODEL = "tiny-llama"
PROMPT = "import os\nimport sys\n"


@pytest.fixture(scope="module")
def greedy(offline_engine):
    def run(prompt_ids: list[int], n: int, ignore_eos: bool = True) -> str:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos)
        [r] = offline_engine.generate([prompt_ids], params)
        return r.text

    return run


def test_models_retrieve(client, srv):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_extra["max_model_len"] == srv.runtime.max_model_len
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model"


def test_tokenize_and_detokenize(srv, offline_engine):
    ids = offline_engine.encode(PROMPT)
    r = httpx.post(f"{srv.url}/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == offline_engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == srv.runtime.max_model_len
    assert r["token_strs"] == offline_engine.tokenizer.convert_ids_to_tokens(r["tokens"])
    plain = httpx.post(f"{srv.url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["tokens"] == ids and plain["token_strs"] is None
    msgs = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == offline_engine.apply_chat_template(msgs)
    back = httpx.post(f"{srv.url}/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": PROMPT}
    bad = httpx.post(f"{srv.url}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{srv.url}/tokenize", json={"prompt": "x", "messages": msgs})
    assert both.status_code == 400


def test_version_ping_tokenizer_info(srv, offline_engine):
    assert httpx.get(f"{srv.url}/version").json()["version"]
    assert httpx.get(f"{srv.url}/ping").status_code == 200
    assert httpx.post(f"{srv.url}/ping").status_code == 200
    info = httpx.get(f"{srv.url}/tokenizer_info").json()
    tok = offline_engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["vocab_size"] == len(tok)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == srv.runtime.max_model_len


def test_responses_text_input(client, offline_engine, greedy):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})  # fmt: skip
    ids = offline_engine.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert r.output_text == greedy(ids, 8)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == 8
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"


def test_responses_messages_and_stream(client, offline_engine, greedy):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Bye"}]  # fmt: skip
    kw = dict(model=MODEL, input=items, instructions="Be terse.", max_output_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]  # fmt: skip
    assert streamed == greedy(offline_engine.apply_chat_template(msgs), 6)
    assert events[-1].response.output[0].content[0].text == streamed
    # The SDK's stream helper wants response.completed: a stop string inside the text ends it so.
    stop = streamed.strip()[1:3]
    with client.responses.stream(**{**kw, "extra_body": {"ignore_eos": True, "stop": [stop]}}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == streamed[: streamed.index(stop)]


def test_responses_refuses_what_it_cannot_do(client):
    for extra, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                         ({"input": [{"type": "file_search_call", "id": "fs_1"}]}, "input.0.type")):
        body = {"model": MODEL, "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**body)
        assert e.value.body["param"] == param


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True}]  # fmt: skip


def test_responses_function_tools(client):
    """tool_choice required: the grammar forces one call; it comes back as one function_call item, and
    the stream's events (item added, arguments deltas, done) add up to it."""
    kw = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=120,
              temperature=0, parallel_tool_calls=False)  # fmt: skip
    r = client.responses.create(**kw)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    [call] = r.output
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "response.output_text.delta" not in kinds and kinds.count("response.output_item.added") == 1
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.arguments == ""
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == done.arguments == events[-3].arguments and done.id == added.id == events[-3].item_id
    assert events[-1].response.output[0].arguments == streamed
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output] == ["get_weather"]
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call"


def test_responses_tool_history_reaches_the_prompt(client, offline_engine):
    """function_call and function_call_output input items become the chat history's call and result."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C and sunny"}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=4,
                                temperature=0)  # fmt: skip
    assert r.output[0].type == "message" and r.tool_choice == "none"
    with_tools = client.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=4, temperature=0)
    assert with_tools.usage.input_tokens > r.usage.input_tokens  # auto: the tools are described too
    text = offline_engine.tokenizer.decode(offline_engine.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>'},
         {"role": "user", "content": "<tool_response>\n21 C and sunny\n</tool_response>"}]))  # fmt: skip
    assert r.usage.input_tokens == len(offline_engine.tokenizer.encode(text, add_special_tokens=False))


def test_huggingface_inference_client(srv, offline_engine, greedy):
    from huggingface_hub import InferenceClient

    hf = InferenceClient(model=srv.url, timeout=60)
    ids = offline_engine.encode(PROMPT)
    want = greedy(ids, 10, ignore_eos=False)  # TGI's default: greedy
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not served via TGI" fallback
        assert hf.text_generation(PROMPT, max_new_tokens=10) == want
        out = hf.text_generation(PROMPT, max_new_tokens=10, details=True, decoder_input_details=True, top_n_tokens=2,
                                 stop=["\ue000never"])  # fmt: skip
        streamed = list(hf.text_generation(PROMPT, max_new_tokens=10, stream=True))
        detailed = list(hf.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert "".join(streamed) == out.generated_text == detailed[-1].generated_text == want
    d = out.details
    assert d.generated_tokens == len(d.tokens) and d.finish_reason in ("length", "eos_token")
    assert [t.id for t in d.prefill] == ids and d.prefill[0].logprob is None
    assert all(len(top) == 2 for top in d.top_tokens)
    assert detailed[-1].details.finish_reason == d.finish_reason
    full = hf.text_generation(PROMPT, max_new_tokens=3, return_full_text=True)
    assert full.startswith(PROMPT)


def test_huggingface_client_errors(srv):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError

    hf = InferenceClient(model=srv.url, timeout=60)
    with pytest.raises(ValidationError):
        hf.text_generation(PROMPT, max_new_tokens=5000)
    r = httpx.post(f"{srv.url}/generate_stream", json={"inputs": "x", "parameters": {"watermark": True}})
    assert r.status_code == 400 and r.json() == {"error": "parameters.watermark is not supported",
                                                 "error_type": "validation"}


def test_tgi_info(srv, offline_engine):
    """GET /info in TGI's shape (its router's `Info`), read by huggingface_hub's get_endpoint_info."""
    from huggingface_hub import InferenceClient

    info = InferenceClient(model=srv.url, provider="hf-inference", timeout=60).get_endpoint_info()
    assert info == httpx.get(f"{srv.url}/info").json()
    types = {"model_id": str, "model_dtype": str, "model_device_type": str, "model_pipeline_tag": str,
             "max_concurrent_requests": int, "max_best_of": int, "max_input_tokens": int, "max_input_length": int,
             "max_total_tokens": int, "max_batch_size": int, "max_client_batch_size": int, "router": str,
             "version": str}  # fmt: skip
    for name, kind in types.items():
        assert type(info[name]) is kind, (name, info[name])
    for name in ("model_sha", "max_stop_sequences", "sha", "docker_label", "max_batch_total_tokens"):
        assert name in info
    max_len = srv.runtime.max_model_len
    assert info["model_id"] == MODEL and info["model_dtype"] == "torch.float32" and info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == max_len and info["max_input_tokens"] == info["max_input_length"] == max_len - 1
    assert info["max_best_of"] == 1 and info["max_client_batch_size"] == 1 and info["router"] == "tokenmill"
    assert info["version"] == httpx.get(f"{srv.url}/version").json()["version"]
    assert info["max_concurrent_requests"] > info["max_batch_size"] >= 1


def test_a_tgi_body_on_generate_answers_as_tgi_generate(srv, offline_engine, greedy):
    want = greedy(offline_engine.encode(PROMPT), 6, ignore_eos=False)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()  # TGI's /generate: one object (POST / answers a list of them)
    assert isinstance(out, dict) and out["generated_text"] == want
    d = out["details"]
    assert d["generated_tokens"] == len(d["tokens"]) <= 6 and d["finish_reason"] in ("length", "eos_token")
    assert "".join(t["text"] for t in d["tokens"]) == want
    plain = httpx.post(f"{srv.url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6},
                                                    "stream": True}, timeout=60)  # fmt: skip
    assert plain.headers["content-type"].startswith("application/json") and plain.json() == {"generated_text": want}
    compat = httpx.post(f"{srv.url}/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}, timeout=60)
    assert compat.json() == [{"generated_text": want}]
    native = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                     "stream": False}, timeout=60)  # fmt: skip
    assert native.json()["text"] == want  # the native body is served as before


def test_an_ambiguous_or_bad_tgi_body_on_generate_is_a_422_naming_the_field(srv):
    both = httpx.post(f"{srv.url}/generate", json={"inputs": "x", "prompt": "x", "stream": False})
    assert both.status_code == 422 and both.json()["error"]["param"] == "inputs"
    assert "prompt" in both.json()["error"]["message"]
    bad = httpx.post(f"{srv.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 0}})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "parameters.max_new_tokens"
    refused = httpx.post(f"{srv.url}/generate", json={"inputs": "x", "parameters": {"best_of": 2}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "parameters.best_of"
    other = httpx.post(f"{srv.url}/generate", json={"prompt": "x", "nonsense": 1})
    assert other.status_code == 422 and other.json()["error"]["param"] == "nonsense"
