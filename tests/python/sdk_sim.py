"""The official SDKs through switchyard-proxy to simulated vLLM workers.

Usage: sdk_sim.py BASE_URL MODEL. Prints `ok: <check>` per check.
"""

import sys

import anthropic
import openai

PROMPT = "Summarise the history of the printing press in three sentences, please. " * 4


def main(base: str, model: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    first = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6)
    assert first.usage.completion_tokens == 6 and first.usage.prompt_tokens > 40, first.usage
    again = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32, f"the repeated prompt should hit the prefix cache, got {cached}"
    print("ok: openai chat with prefix cache")

    text, usage = [], None
    stream = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                        stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert len(text) == 5 and usage.completion_tokens == 5, (text, usage)
    print("ok: openai stream")

    completion = oa.completions.create(model=model, prompt="Once upon a time", max_tokens=3)
    assert completion.usage.completion_tokens == 3 and completion.choices[0].text
    print("ok: openai completions")

    an = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    with an.messages.stream(model=model, max_tokens=4, system="be brief",
                            messages=[{"role": "user", "content": "hello"}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and final.usage.output_tokens == 4 and final.stop_reason == "max_tokens", final
    print("ok: anthropic stream")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
