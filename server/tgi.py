"""POST /generate, /generate_stream and / in the shape of text-generation-inference."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FinishReason, TokenEvent, Tokenizer
from server import generation, sse
from server.errors import APIError, error_body
from server.schemas import GenerateRequest

TGI_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS: "eos_token", FinishReason.STOP: "stop_sequence",
              FinishReason.ABORT: "length"}
DEFAULT_MAX_NEW_TOKENS = 100


def token(event: TokenEvent) -> dict:
    return {"id": event.token_id, "text": event.text, "logprob": event.logprob, "special": event.special}


def top_tokens(event: TokenEvent, tokenizer: Tokenizer) -> list[dict]:
    """The `top_n_tokens` most likely tokens at this step, best first, each as its own text."""
    return [{"id": i, "text": tokenizer.token_text(i), "logprob": logprob, "special": i in tokenizer.special_ids}
            for i, logprob in event.top_logprobs]


def prefill(gen: generation.Generation, tokenizer: Tokenizer) -> list[dict]:
    """With decoder_input_details: each prompt token and its logprob given the tokens before it (none for the first)."""
    scored = gen.events[0].prompt_logprobs
    if scored is None:
        return []
    first = gen.stream.prompt_ids[0]
    return [{"id": first, "text": tokenizer.token_text(first), "logprob": None}] + [
        {"id": c.token, "text": tokenizer.token_text(c.token), "logprob": c.logprob} for c in scored]


def details(gen: generation.Generation, input_length: int, with_tokens: bool, tokenizer: Tokenizer) -> dict:
    last, (proposed, accepted) = gen.events[-1], gen.draft_tokens
    body = {"finish_reason": TGI_FINISH[last.finish_reason], "generated_tokens": len(gen.events),
            "seed": None if gen.stream.params.greedy else gen.stream.seed, "input_length": input_length,
            "cached_input_tokens": gen.reused_prompt_tokens,
            # Speculative decoding: draft tokens verified for this request, and those kept (output unchanged).
            "draft_tokens": proposed, "accepted_draft_tokens": accepted}
    if with_tokens:
        body |= {"prefill": prefill(gen, tokenizer), "tokens": [token(e) for e in gen.events]}
        if gen.stream.params.top_logprobs:
            body["top_tokens"] = [top_tokens(e, tokenizer) for e in gen.events]
    return body


async def admit(body: GenerateRequest, request: Request) -> tuple[list[generation.Generation], str]:
    """The request's sequences (best_of of them, else one) and the text its answers start with."""
    runner, metrics = request.app.state.runner, request.app.state.metrics
    prompt_ids = await generation.tokenize_prompt(runner, body.inputs, body.parameters.parse_special)
    if body.parameters.truncate:
        prompt_ids = prompt_ids[-body.parameters.truncate:]
    default = max(1, min(DEFAULT_MAX_NEW_TOKENS, generation.room(runner, prompt_ids)))
    prefix = body.inputs if body.parameters.return_full_text else ""
    gens = await generation.admit(runner, metrics, prompt_ids, lambda: body.parameters.sampling(default),
                                  body.parameters.best_of or 1, "best_of")
    return gens, prefix


def likeliest(gens: list[generation.Generation]) -> generation.Generation:
    """TGI's best_of choice: the highest sum of log-probabilities of the generated tokens."""
    return max(gens, key=lambda gen: sum(e.logprob for e in gen.events))


async def stream_events(gen: generation.Generation, prefix: str, want_details: bool, tokenizer: Tokenizer):
    input_length = len(gen.stream.prompt_ids)
    want_top = gen.stream.params.top_logprobs > 0
    try:
        async for event in gen:
            done = event.finish_reason is not None
            yield sse.event({
                "index": event.index, "token": token(event),
                "top_tokens": top_tokens(event, tokenizer) if want_top else None,
                "generated_text": prefix + gen.text if done else None,
                "details": details(gen, input_length, False, tokenizer) if done and want_details else None,
            }, space=False)
    except APIError as e:  # after the first byte: the error travels as an event, then the stream ends
        yield sse.event(error_body("/generate", e.status, e.message, e.error_type), space=False)


def create_router() -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if body.stream or "text/event-stream" in request.headers.get("accept", ""):
            return await generate_stream(body, request)
        gens, prefix = await admit(body, request)
        await generation.complete_all(gens, request)
        best, tokenizer = likeliest(gens), request.app.state.runner.engine.tokenizer
        result = {"generated_text": prefix + best.text}
        if body.parameters.details:
            input_length = len(best.stream.prompt_ids)
            result["details"] = details(best, input_length, True, tokenizer)
            if len(gens) > 1:
                result["details"]["best_of_sequences"] = [
                    {"generated_text": prefix + gen.text} | details(gen, input_length, True, tokenizer)
                    for gen in gens if gen is not best]
        return JSONResponse(result)

    @router.post("/generate_stream")
    async def generate_stream(body: GenerateRequest, request: Request):
        if body.parameters.decoder_input_details:  # TGI's rule: stream events carry no prefill details
            raise APIError(422, "decoder_input_details is not supported when streaming tokens", "validation")
        if (body.parameters.best_of or 1) > 1:  # TGI's rule too: the likeliest is known only at the end
            raise APIError(422, "best_of > 1 is not supported when streaming tokens", "validation")
        (gen,), prefix = await admit(body, request)
        events = stream_events(gen, prefix, body.parameters.details, request.app.state.runner.engine.tokenizer)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @router.post("/")
    async def compat(body: GenerateRequest, request: Request):
        return await (generate_stream(body, request) if body.stream else generate(body, request))

    return router
