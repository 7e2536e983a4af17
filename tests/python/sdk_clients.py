"""Drive a running switchyard-proxy with the official OpenAI and Anthropic SDKs.

Usage: sdk_clients.py BASE_URL. Expects the aliases `chat-model` (a pool that serves /v1/messages
natively) and `claude-compat` (an OpenAI-only pool, so /v1/messages is translated). Prints
`ok: <check>` per check and exits non-zero on the first failure.
"""

import sys

import anthropic
import openai


def main(base: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="test-key", max_retries=0)

    reply = oa.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    # A whole answer from a pool's worker: streamed from the worker (three pieces, usage 7 + 3)
    # and assembled by the gateway into the answer the SDK expects.
    assert reply.choices[0].message.content == "native-0 native-1 native-2 ", reply
    assert reply.choices[0].finish_reason == "stop", reply
    assert reply.model == "chat-model", reply
    assert reply.usage.total_tokens == 10, reply.usage
    print("ok: openai chat")

    pieces = []
    with oa.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": "hello"}], stream=True
    ) as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == "native-0 native-1 native-2 ", pieces
    print("ok: openai stream")

    ids = sorted(m.id for m in oa.models.list())
    assert ids == ["chat-model", "claude-compat", "embedder"], ids
    model = oa.models.retrieve("claude-compat")
    assert (model.id, model.object) == ("claude-compat", "model"), model
    try:
        oa.models.retrieve("no-such-model")
        raise AssertionError("unknown model retrieved")
    except openai.NotFoundError as error:
        assert error.body["code"] == "model_not_found", error.body
    print("ok: openai models")

    vectors = oa.embeddings.create(model="embedder", input=["a river", "a lake"])
    assert [d.index for d in vectors.data] == [0, 1], vectors
    assert vectors.model == "embedder" and vectors.usage.prompt_tokens == 10, vectors
    print("ok: openai embeddings")

    try:
        oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as error:
        assert "GET /v1/models" in error.message, error.message
        assert error.body["code"] == "model_not_found", error.body
    try:
        oa.chat.completions.create(model="chat-model", messages=[])
        raise AssertionError("empty messages accepted")
    except openai.BadRequestError as error:
        assert "at least one message" in error.message, error.message
    print("ok: openai errors")

    an = anthropic.Anthropic(base_url=base, api_key="test-key", max_retries=0)
    info = an.models.retrieve("chat-model")
    assert (info.id, info.type) == ("chat-model", "model"), info
    assert [m.id for m in an.models.list()] == ["chat-model", "claude-compat", "embedder"]
    try:
        an.models.retrieve("no-such-model")
        raise AssertionError("unknown model retrieved")
    except anthropic.NotFoundError as error:
        assert error.body["error"]["type"] == "not_found_error", error.body
    print("ok: anthropic models")

    short = an.messages.count_tokens(model="chat-model", messages=[{"role": "user", "content": "hello"}])
    longer = an.messages.count_tokens(
        model="chat-model",
        system="You are terse.",
        messages=[{"role": "user", "content": "hello there, how are the rivers of Europe today?"}],
    )
    assert 0 < short.input_tokens < longer.input_tokens, (short, longer)
    try:
        an.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model counted")
    except anthropic.NotFoundError as error:
        assert error.body["error"]["type"] == "not_found_error", error.body
    print("ok: anthropic count tokens")
    message = an.messages.create(
        model="chat-model", max_tokens=8, messages=[{"role": "user", "content": "hello"}]
    )
    # Streamed from the worker and assembled by the gateway into the message the SDK expects.
    assert message.content[0].text == "native-0 native-1 native-2 ", message
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3, message
    assert message.model == "chat-model" and message.role == "assistant", message
    print("ok: anthropic native")

    with an.messages.stream(
        model="claude-compat", max_tokens=8, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "openai-only-0 openai-only-1 openai-only-2 ", text
    assert final.stop_reason == "end_turn", final
    assert final.usage.output_tokens == 3, final.usage
    print("ok: anthropic stream translated")

    try:
        an.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as error:
        assert error.body["error"]["type"] == "not_found_error", error.body
    print("ok: anthropic errors")


if __name__ == "__main__":
    main(sys.argv[1])
