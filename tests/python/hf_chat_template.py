"""Render OpenAI chat requests with transformers' own chat-template renderer, as vLLM does.

Reads one JSON object on stdin: {"cases": [{"template", "content_format" ("string" or
"openai"), "special_tokens": {...}, "request": <a Chat Completions body as text>}]} and prints
one JSON line per case: {"text": ...} or {"error": ...}.

The request becomes the conversation and arguments vLLM 0.34 hands to
`tokenizer.apply_chat_template` (a short restatement of `parse_chat_message_content`,
`_postprocess_messages`, `_convert_developer_to_system`, `_consolidate_system_messages`,
`ChatCompletionRequest.build_chat_params` and `OnlineRenderer.render_chat`); the text is then
rendered by transformers' `render_jinja_template` (the Jinja environment under test), after the
normalisation `PreTrainedTokenizerBase.apply_chat_template` does first (keys whose value is None
dropped) and with its special tokens under the kwargs.
"""

import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template


def tool_dump(tool):
    # ChatCompletionToolsParam.model_dump(): type, function (name, description, parameters,
    # strict and defer_loading when set), defer_loading when set.
    function = tool.get("function") or {}
    defer = tool.get("defer_loading")
    dumped = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    if function.get("defer_loading") is not None or defer is not None:
        dumped["defer_loading"] = (
            function.get("defer_loading") if function.get("defer_loading") is not None else defer
        )
    out = {"type": tool.get("type", "function"), "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def conversation(request, content_format, template):
    out = []
    for message in request["messages"]:
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = content
        texts = [
            part if isinstance(part, str) else part["text"]
            for part in parts
            if isinstance(part, str) or part.get("type") == "text"
        ]
        if content_format == "openai":
            msg = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            msg = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                msg["tool_calls"] = list(message["tool_calls"])
            if message.get("reasoning") is not None:
                msg["reasoning"] = message["reasoning"]
                msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list):
                msg["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        out.append(msg)
    # _postprocess_messages: tool call arguments as objects.
    for msg in out:
        if msg["role"] == "assistant" and "tool_calls" in msg:
            if not msg["tool_calls"]:
                msg.pop("tool_calls")
                continue
            for call in msg["tool_calls"]:
                function = call["function"]
                arguments = function.get("arguments")
                parsed = {}
                if arguments:
                    if isinstance(arguments, str):
                        try:
                            parsed = json.loads(arguments)
                        except json.JSONDecodeError:
                            parsed = {}
                    else:
                        parsed = arguments
                function["arguments"] = parsed if isinstance(parsed, dict) else {}
    # A template without the developer role: developer messages become system ones, merged.
    has_developer = '"developer"' in template or "'developer'" in template
    if any(m["role"] == "developer" for m in out) and not has_developer:
        for m in out:
            if m["role"] == "developer":
                m["role"] = "system"
        systems = [i for i, m in enumerate(out) if m["role"] == "system"]
        if systems and (systems[0] > 0 or len(systems) > 1):
            def text(content):
                if isinstance(content, list):
                    return "\n".join(p["text"] for p in content if "text" in p)
                return content

            merged = "\n\n".join(
                text(out[i]["content"]) for i in systems if text(out[i]["content"])
            )
            out = [{"role": "system", "content": merged}] + [
                m for m in out if m["role"] != "system"
            ]
    return out


def render(case):
    request = json.loads(case["request"])
    template = case["template"]
    kwargs = dict(request.get("chat_template_kwargs") or {})
    effort = request.get("reasoning_effort")
    if effort is not None and effort != "auto":
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    for name in ("add_generation_prompt", "continue_final_message", "documents"):
        kwargs.pop(name, None)
    tools = request.get("tools")
    chat = conversation(request, case["content_format"], template)
    chat = [{k: v for k, v in m.items() if v is not None} for m in chat]
    rendered, _ = render_jinja_template(
        conversations=[chat],
        tools=None if tools is None else [tool_dump(t) for t in tools],
        documents=request.get("documents"),
        chat_template=template,
        continue_final_message=request.get("continue_final_message", False),
        add_generation_prompt=request.get("add_generation_prompt", True),
        **{**case.get("special_tokens", {}), **kwargs},
    )
    return rendered[0]


def main():
    cases = json.load(sys.stdin)["cases"]
    for case in cases:
        try:
            print(json.dumps({"text": render(case)}))
        except Exception as error:  # the template's own exceptions are answers too
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}))


if __name__ == "__main__":
    main()
