"""The official SDKs, streaming through the proxy from a worker that falls silent after its
first events: each raises the proxy's closing error event as an API error (not a broken
connection), with the proxy's message. Usage: sdk_stream_failure.py PROXY_URL"""

import sys

import anthropic
import openai


def main(url: str) -> None:
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    seen = []
    try:
        for chunk in oa.chat.completions.create(
            model="silent-chat",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        ):
            seen.append(chunk)
        raise AssertionError("the stream ended without an error")
    except openai.APIError as error:
        assert not isinstance(error, openai.APIConnectionError), repr(error)
        assert "middle of the stream" in error.message, error.message
        assert error.code == "upstream_timeout", error.body
    assert seen, "the first chunk came before the error"
    print("ok: openai stream failure")

    an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    events = []
    try:
        with an.messages.stream(
            model="silent-messages",
            max_tokens=16,
            messages=[{"role": "user", "content": "hi"}],
        ) as stream:
            for event in stream:
                events.append(event.type)
        raise AssertionError("the stream ended without an error")
    except anthropic.APIStatusError as error:
        assert "middle of the stream" in str(error), str(error)
        assert error.body["error"]["type"] == "api_error", error.body
    assert events[:1] == ["message_start"], events
    print("ok: anthropic stream failure")


if __name__ == "__main__":
    main(sys.argv[1])
