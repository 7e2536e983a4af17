"""The Responses API through a running switchyard-proxy with the official OpenAI SDK.

Usage: sdk_responses.py BASE_URL MODEL [translated]. Prints `ok: <check>` per check and exits
non-zero on the first failure. With `translated`, the pool speaks only Chat Completions: the
gateway translates, and stored responses are not available.
"""

import sys

import openai


def main(base: str, model: str, translated: bool) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="test-key", max_retries=0)

    first = oa.responses.create(
        model=model,
        instructions="Answer in one short sentence.",
        input="Which river flows through Vienna?",
        max_output_tokens=8,
    )
    assert first.object == "response", first
    assert first.model == model, first.model
    assert first.output_text, first
    assert first.usage.input_tokens > 10 and first.usage.output_tokens == 8, first.usage
    print("ok: responses.create")

    events = []
    text = []
    with oa.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Name three lakes."}]}],
        max_output_tokens=6,
        stream=True,
    ) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "response.output_text.delta":
                text.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert events[0] == "response.created" and events[1] == "response.in_progress", events
    assert events[-1] in ("response.completed", "response.incomplete"), events
    assert "".join(text) == final.output_text and final.output_text, (text, final)
    assert final.model == model, final.model
    assert final.usage.output_tokens == 6, final.usage
    print("ok: responses.create streamed")

    if translated:
        try:
            oa.responses.create(model=model, input="and then?", previous_response_id=first.id)
            raise AssertionError("a stored response was continued through a translation")
        except openai.APIStatusError as error:
            assert error.status_code == 501, error
            assert error.body["code"] == "translation_unsupported", error.body
        print("ok: previous_response_id refused when translated")
        return

    # Each continuation must reach the worker that holds the response it names.
    previous = first
    for turn in range(4):
        previous = oa.responses.create(
            model=model, input=f"and then? ({turn})", previous_response_id=previous.id, max_output_tokens=4
        )
        assert previous.previous_response_id is not None, previous
        assert previous.model == model, previous.model
        # The stored conversation is part of the prompt: it grows with every turn.
        assert previous.usage.input_tokens > first.usage.input_tokens, previous.usage
    streamed_next = oa.responses.create(
        model=model, input="continue the stream", previous_response_id=final.id, max_output_tokens=3
    )
    assert streamed_next.output_text
    print("ok: previous_response_id")

    fetched = oa.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text, fetched
    assert fetched.model == model, fetched.model
    print("ok: responses.retrieve")

    try:
        oa.responses.cancel(first.id)
        raise AssertionError("a finished response was cancelled")
    except openai.BadRequestError as error:
        assert "synchronous" in str(error), error
    print("ok: responses.cancel")

    try:
        oa.responses.delete(first.id)
        raise AssertionError("vLLM 0.34 has no DELETE route")
    except openai.APIStatusError as error:
        # FastAPI's own 405 ({"detail": "Method Not Allowed"}), in OpenAI's error format.
        assert error.status_code == 405, error
        assert error.body["message"] == "Method Not Allowed", error.body
        assert error.body["code"] == "upstream_error", error.body
    print("ok: responses.delete reaches the worker")

    for call in (
        lambda: oa.responses.retrieve("resp_unknown"),
        lambda: oa.responses.create(model=model, input="x", previous_response_id="resp_unknown"),
    ):
        try:
            call()
            raise AssertionError("an unknown response was found")
        except openai.NotFoundError as error:
            assert error.body["code"] == "response_not_found", error.body
    print("ok: unknown ids")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "translated")
