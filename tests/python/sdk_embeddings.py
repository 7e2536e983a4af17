"""Embeddings through a running switchyard-proxy with the official OpenAI SDK.

Usage: sdk_embeddings.py BASE_URL MODEL. Prints `ok: <check>` per check and exits non-zero on the
first failure.
"""

import math
import sys

import openai


def main(base: str, model: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="test-key", max_retries=0)
    texts = ["the Danube flows east", "the Rhine flows north", "the Danube flows east"]
    result = oa.embeddings.create(model=model, input=texts)
    assert result.model == model, result.model
    assert [d.index for d in result.data] == [0, 1, 2], result.data
    vectors = [d.embedding for d in result.data]
    assert all(abs(math.sqrt(sum(v * v for v in vector)) - 1.0) < 1e-6 for vector in vectors)
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert result.usage.prompt_tokens > len(texts), result.usage
    print("ok: openai embeddings")

    one = oa.embeddings.create(model=model, input="a single lake")
    assert len(one.data) == 1
    print("ok: openai single embedding")

    try:
        oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("an embedding model generated")
    except openai.BadRequestError as error:
        assert error.body["code"] == "model_task_mismatch", error.body
    print("ok: generation refused")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
