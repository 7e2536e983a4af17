"""Official OpenAI and Anthropic SDKs with tenant keys, through the proxy to TLS providers.

Usage: sdk_tenants.py BASE_URL. Expects tenant keys `sk-team` (unlimited) and `sk-limited`
(one request per minute), and the models `claude-cloud` (an Anthropic-format provider) and
`gpt-cloud` (an OpenAI-format provider). Prints `ok: <check>` per check.
"""

import sys

import anthropic
import openai


def main(base: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-team", max_retries=0)
    reply = oa.chat.completions.create(
        model="claude-cloud",
        messages=[{"role": "system", "content": "terse"}, {"role": "user", "content": "hello"}],
        max_tokens=32,
    )
    assert reply.choices[0].message.content.startswith("claude-tls saw"), reply
    assert reply.choices[0].finish_reason == "stop", reply
    assert reply.usage.prompt_tokens == 7 and reply.usage.completion_tokens == 3, reply.usage
    print("ok: openai sdk to anthropic provider")

    pieces = []
    with oa.chat.completions.create(
        model="claude-cloud", messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
    assert "".join(pieces) == "claude-tls-0 claude-tls-1 claude-tls-2 ", pieces
    assert usage is not None and usage.completion_tokens == 3, usage
    print("ok: openai sdk stream from anthropic provider")

    an = anthropic.Anthropic(base_url=base, api_key="sk-team", max_retries=0)
    message = an.messages.create(
        model="gpt-cloud", max_tokens=16, messages=[{"role": "user", "content": "hello"}]
    )
    assert message.content[0].text.startswith("gpt-tls saw"), message
    assert message.usage.output_tokens == 3, message.usage
    print("ok: anthropic sdk to openai provider")

    text = []
    with an.messages.stream(
        model="gpt-cloud", max_tokens=16, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        for piece in stream.text_stream:
            text.append(piece)
    assert "".join(text) == "gpt-tls-0 gpt-tls-1 gpt-tls-2 ", text
    print("ok: anthropic sdk stream from openai provider")

    ids = sorted(m.id for m in oa.models.list())
    assert ids == ["claude-cloud", "gpt-cloud"], ids
    print("ok: models of the tenant")

    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-nope", max_retries=0)
    try:
        bad.chat.completions.create(model="gpt-cloud", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown key accepted")
    except openai.AuthenticationError as error:
        assert error.status_code == 401, error
    bad_an = anthropic.Anthropic(base_url=base, api_key="sk-nope", max_retries=0)
    try:
        bad_an.messages.create(model="gpt-cloud", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown key accepted")
    except anthropic.AuthenticationError as error:
        assert error.status_code == 401, error
    print("ok: unknown keys")

    limited = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-limited", max_retries=0)
    limited.chat.completions.create(model="gpt-cloud", messages=[{"role": "user", "content": "x"}])
    try:
        limited.chat.completions.create(model="gpt-cloud", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("second request within the minute accepted")
    except openai.RateLimitError as error:
        assert int(error.response.headers["retry-after"]) >= 1, error.response.headers
        assert "1 requests per minute" in error.message, error.message
    limited_an = anthropic.Anthropic(base_url=base, api_key="sk-limited", max_retries=0)
    try:
        limited_an.messages.create(model="gpt-cloud", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("rate limit not applied to /v1/messages")
    except anthropic.RateLimitError as error:
        assert error.status_code == 429, error
    print("ok: rate limits")


if __name__ == "__main__":
    main(sys.argv[1])
