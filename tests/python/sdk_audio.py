"""Speech to text through a running switchyard-proxy with the official OpenAI SDK.

Usage: sdk_audio.py BASE_URL MODEL. Prints `ok: <check>` per check and exits non-zero on the
first failure.
"""

import sys

import openai

# Two seconds of 16 kHz 16-bit mono silence in a WAV container.
PCM = b"\x00\x00" * 32000
WAV = (
    b"RIFF" + (36 + len(PCM)).to_bytes(4, "little") + b"WAVEfmt "
    + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
    + (16000).to_bytes(4, "little") + (32000).to_bytes(4, "little") + (2).to_bytes(2, "little")
    + (16).to_bytes(2, "little") + b"data" + len(PCM).to_bytes(4, "little") + PCM
)


def main(base: str, model: str) -> None:
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="test-key", max_retries=0)
    result = oa.audio.transcriptions.create(model=model, file=("clip.wav", WAV, "audio/wav"))
    assert result.text, result
    print("ok: audio.transcriptions")

    text = oa.audio.transcriptions.create(
        model=model, file=("clip.wav", WAV, "audio/wav"), response_format="text"
    )
    assert isinstance(text, str) and text, text
    print("ok: audio.transcriptions as text")

    translated = oa.audio.translations.create(model=model, file=("clip.wav", WAV, "audio/wav"))
    assert translated.text, translated
    print("ok: audio.translations")

    try:
        oa.audio.transcriptions.create(model="no-such-model", file=("clip.wav", WAV, "audio/wav"))
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as error:
        assert error.body["code"] == "model_not_found", error.body
    print("ok: unknown model")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
