"""The OpenAPI schema as the server behaves: every error status a route can answer, with the JSON body it sends,
and `text/event-stream` where a route streams.

FastAPI documents 200 and its own 422 body; kvserve answers 400 under /v1 (OpenAI's shape, Anthropic's under
/v1/messages), 401, 413, 429, 503 and 504 too, and streams Server-Sent Events.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERRORS = {  # status -> when
    "401": "a missing or wrong API key (with --api-key)",
    "413": "a body over --max-body-bytes",
    "429": "--max-queue requests already wait (Retry-After)",
    "503": "the model is loading, failed, or no slot freed within --max-queue-wait (Retry-After)",
    "504": "the request ran past --request-timeout",
    "404": "no stored response has this id (never stored, deleted, or evicted)",
}
STREAMING = {"/generate", "/generate_stream", "/", "/v1/completions", "/v1/chat/completions", "/v1/messages",
             "/v1/responses"}
ERROR_BODIES = {
    "TGIError": {"type": "object", "required": ["error", "error_type"],
                 "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}},
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}
OPEN_PATHS = {"/health", "/metrics"}  # never behind the API key


def obj(required: dict, optional: dict | None = None) -> dict:
    """A JSON object schema: these properties always present, those sometimes; others allowed."""
    return {"type": "object", "required": list(required), "properties": required | (optional or {})}


def array(items: dict) -> dict:
    return {"type": "array", "items": items}


INT, NUM, STR, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "boolean"}
MAYBE_NUM, MAYBE_STR = {"type": ["number", "null"]}, {"type": ["string", "null"]}
TGI_TOKEN = obj({"id": INT, "text": STR, "logprob": MAYBE_NUM, "special": BOOL})
TGI_SEQUENCE = {  # what every generated sequence's details hold; the best one adds its alternatives
    "finish_reason": STR, "generated_tokens": INT, "seed": {"type": ["integer", "null"]}, "input_length": INT,
    "cached_input_tokens": INT, "prefill": array(obj({"id": INT, "text": STR, "logprob": MAYBE_NUM})),
    "tokens": array(TGI_TOKEN)}
USAGE = obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT},
            {"prompt_tokens_details": obj({"cached_tokens": INT})})
OPENAI_HEAD = {"id": STR, "object": STR, "created": INT, "model": STR}
CHAT_LOGPROB = obj({"token": STR, "logprob": NUM, "bytes": array(INT)})
RESPONSE_BODIES = {  # the 200 bodies, by schema name
    "TGIGenerated": obj({"generated_text": STR}, {"details": obj(TGI_SEQUENCE, {
        "top_tokens": array(array(TGI_TOKEN)),
        "best_of_sequences": array(obj(TGI_SEQUENCE | {"generated_text": STR}))})}),
    "Tokens": array(obj({"id": INT, "text": STR, "start": INT, "stop": INT})),
    "Detokenized": obj({"prompt": STR}),
    "Completion": obj(OPENAI_HEAD | {"choices": array(obj({
        "index": INT, "text": STR, "finish_reason": MAYBE_STR,
        "logprobs": {"anyOf": [{"type": "null"}, obj({
            "tokens": array(STR), "token_logprobs": array(MAYBE_NUM), "text_offset": array(INT),
            "top_logprobs": {"anyOf": [{"type": "null"},  # null when logprobs is 0
                                       array({"type": ["object", "null"], "additionalProperties": NUM})]}})]}})),
        "usage": USAGE}),
    "ChatCompletion": obj(OPENAI_HEAD | {"choices": array(obj({
        "index": INT, "message": obj({"role": STR, "content": MAYBE_STR}), "finish_reason": MAYBE_STR,
        "logprobs": {"anyOf": [{"type": "null"}, obj({"content": array(
            obj(CHAT_LOGPROB["properties"] | {"top_logprobs": array(CHAT_LOGPROB)}))})]}})),
        "usage": USAGE}),
    "Message": obj({"id": STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STR,
                    "content": array({"anyOf": [obj({"type": {"const": "text"}, "text": STR}),
                                                obj({"type": {"const": "tool_use"}, "id": STR, "name": STR,
                                                     "input": {"type": "object"}})]}),
                    "stop_reason": STR, "stop_sequence": MAYBE_STR,
                    "usage": obj({"input_tokens": INT, "output_tokens": INT, "cache_read_input_tokens": INT,
                                  "draft_tokens": INT, "accepted_draft_tokens": INT})}),
    "TokenCount": obj({"input_tokens": INT}),
    "Response": obj({"id": STR, "object": {"const": "response"}, "created_at": INT, "status": STR, "model": STR,
                     "output": array({"anyOf": [
                         obj({"type": {"const": "message"}, "id": STR, "role": {"const": "assistant"},
                              "content": array(obj({"type": {"const": "output_text"}, "text": STR}))}),
                         obj({"type": {"const": "function_call"}, "id": STR, "call_id": STR, "name": STR,
                              "arguments": STR})]}),
                     "output_text": STR,
                     "usage": obj({"input_tokens": INT, "output_tokens": INT, "total_tokens": INT,
                                   "input_tokens_details": obj({"cached_tokens": INT})})}),
    "ResponseDeleted": obj({"id": STR, "object": {"const": "response"}, "deleted": BOOL}),
    "ModelList": obj({"object": STR, "data": array(obj({"id": STR, "object": STR, "created": INT, "owned_by": STR},
                                                         {"max_model_len": INT}))}),
    "Info": obj({"model_id": STR, "dtype": STR, "device": STR, "max_batch_size": INT, "max_seq_len": INT,
                 "quantized": BOOL, "weights_bytes": INT, "weights_on_huge_pages_bytes": INT, "prefix_caching": BOOL,
                 "compiled_decode": array(STR),
                 "speculative_decoding": obj({"method": {"enum": ["off", "ngram", "suffix", "auto"]},
                                              "num_speculative_tokens": INT, "draft_tokens": INT,
                                              "accepted_tokens": INT}),
                 "linear_layers": array(obj({"matrices": STR, "count": INT, "layer": STR, "reason": STR})),
                 "weights_served": {"type": "object", "additionalProperties": {"type": "object",
                                                                               "additionalProperties": INT}},
                 "kv_cache": obj({"capacity_bytes": INT})}),
    "Health": obj({"status": STR}),
    "Slots": obj({"slots": array(obj({"slot": INT, "state": {"enum": ["free", "prefill", "decode"]}, "tokens": INT,
                                      "kept": INT, "request_id": MAYBE_STR, "age_s": MAYBE_NUM})),
                  "max_seq_len": INT, "waiting": INT, "running": INT,
                  "kv_cache": obj({"capacity_bytes": INT, "used_bytes": INT, "kept_bytes": INT, "mha_capacity_bytes": INT}),
                  "generation_tokens_total": NUM, "time_to_first_token_mean_s": MAYBE_NUM,
                  "inter_token_latency_mean_s": MAYBE_NUM}),
}
RESPONSES = {"/generate": "TGIGenerated", "/": "TGIGenerated", "/tokenize": "Tokens", "/detokenize": "Detokenized",
             "/v1/completions": "Completion", "/v1/chat/completions": "ChatCompletion", "/v1/models": "ModelList",
             "/v1/messages": "Message", "/v1/messages/count_tokens": "TokenCount", "/v1/responses": "Response",
             "/v1/responses/{response_id}": {"get": "Response", "delete": "ResponseDeleted"},
             "/info": "Info", "/health": "Health", "/slots": "Slots"}
# One Server-Sent Event as a client parses it (OpenAPI 3.1 has a streamed media type's schema describe each event):
# a JSON object in `data`, or `[DONE]` to end an OpenAI stream; TGI names its events.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json"}, "event": {"type": "string"},
    "id": {"type": "string"}, "retry": {"type": "integer"}}}


def install_openapi(app: FastAPI) -> None:
    def schema() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = described(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = schema


def described(schema: dict) -> dict:
    schema.setdefault("components", {}).setdefault("schemas", {}).update(ERROR_BODIES | RESPONSE_BODIES)
    for path, operations in schema["paths"].items():
        body = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError" if path.startswith("/v1") else "TGIError"
        error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}
        for method, operation in operations.items():
            responses = operation["responses"]
            if "422" in responses:  # a body that fails validation: 422 for TGI, 400 under /v1
                del responses["422"]
                responses["400" if path.startswith("/v1") else "422"] = {"description": "invalid request",
                                                                           "content": error}
            for status, when in ERRORS.items():
                if applies(status, path, method):
                    responses[status] = {"description": when, "content": error}
            if path in RESPONSES:
                name = RESPONSES[path][method] if isinstance(RESPONSES[path], dict) else RESPONSES[path]
                responses["200"]["content"] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
            if path in STREAMING:
                content = responses["200"].setdefault("content", {})
                content["text/event-stream"] = {"schema": SSE_EVENT,
                                                "description": "Server-Sent Events, when the request streams"}
                if path == "/generate_stream":
                    content.pop("application/json", None)
    health = schema["paths"]["/health"]["get"]["responses"]
    health["503"] = {"description": "loading, or failed: the reason in `error`", "content": {"application/json": {
        "schema": {"type": "object", "properties": {"status": {"type": "string"}, "error": {"type": ["string", "null"]}}}}}}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return schema


def applies(status: str, path: str, method: str) -> bool:
    """Whether a route can answer this error status."""
    if path in OPEN_PATHS:
        return False  # /health has its own 503 body; /metrics always answers
    if status == "413":
        return method == "post"
    if status == "404":
        return path.startswith("/v1/responses")  # a stored response named by id (previous_response_id too)
    if status in ("429", "504"):
        return path in STREAMING  # the generation routes: queued and timed
    return True
