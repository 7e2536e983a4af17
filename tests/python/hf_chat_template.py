"""Render OpenAI chat requests as vLLM 0.34 does, with transformers' own chat-template renderer.

Reads one JSON object on stdin: {"cases": [{"template", "special_tokens": {...}, "request": <a
Chat Completions body as text>}]} and prints one JSON line per case: {"text": ..., "format":
"string" | "openai"} or {"error": ...}.

vLLM's own functions are taken from its wheel's sources (unpacked by scripts/test.sh into
`.cache/vllm-0.34.0/`, or `VLLM_SRC`), function by function, since importing their modules
needs torch: the content format detection (`_detect_content_format` and its AST helpers), the
developer-role conversion, `_strip_claude_code_billing_header`, `_postprocess_messages` and
`merge_kwargs`. Messages are validated with the `openai` package's TypedDicts as pydantic does in
vLLM's request model. What is restated here, from `parse_chat_message_content`,
`ChatCompletionRequest.build_chat_params`, `OnlineRenderer.render_chat` and
`ChatCompletionToolsParam.model_dump`, is the glue between those. The text is rendered by
transformers' `render_jinja_template` after the normalisation
`PreTrainedTokenizerBase.apply_chat_template` does first (keys whose value is None dropped),
with the special tokens under the kwargs.
"""

import ast
import collections
import functools
import json
import logging
import os
import pathlib
import sys
from typing import cast

import jinja2
from openai.types.chat import ChatCompletionMessageToolCallParam
from pydantic import TypeAdapter
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM = pathlib.Path(os.environ.get("VLLM_SRC", ROOT / ".cache" / "vllm-0.34.0"))


class VLLMValidationError(ValueError):
    def __init__(self, message, parameter=None):
        super().__init__(message)


def vllm_functions(path, names):
    """The top-level functions and constants `names` of one of vLLM's modules, compiled alone."""
    source = (VLLM / path).read_text()
    tree = ast.parse(source)

    def name_of(node):
        if isinstance(node, ast.FunctionDef):
            return node.name
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
        return None

    body = [node for node in tree.body if name_of(node) in names]
    missing = set(names) - {name_of(node) for node in body}
    assert not missing, f"{path} has no {missing}"
    future = ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[future, *body], type_ignores=[]))
    namespace = {
        "jinja2": jinja2,
        "deque": collections.deque,
        "lru_cache": functools.lru_cache,
        "logger": logging.getLogger("vllm"),
        "json": json,
        "cast": cast,
        "VLLMValidationError": VLLMValidationError,
        # Types the functions name at run time (in `cast`).
        "ChatCompletionContentPartParam": dict,
        "ConversationMessage": dict,
    }
    exec(compile(module, str(VLLM / path), "exec"), namespace)
    return namespace


HF = vllm_functions(
    "vllm/renderers/hf.py",
    [
        "_is_var_access",
        "_is_attr_access",
        "_is_var_or_elems_access",
        "_attr_dotted_name",
        "_iter_nodes_assign_var_or_elems",
        "_iter_nodes_assign_messages_item",
        "_iter_nodes_assign_content_item",
        "_try_extract_ast",
        "_detect_content_format",
        "_detect_developer_role_support",
        "_convert_developer_to_system",
        "_consolidate_system_messages",
    ],
)
MESSAGES = vllm_functions(
    "vllm/renderers/chat_utils/chat_message.py",
    ["_CLAUDE_CODE_BILLING_HEADER", "_strip_claude_code_billing_header", "_postprocess_messages"],
)
PARAMS = vllm_functions("vllm/renderers/params.py", ["merge_kwargs"])
TOOL_CALL = TypeAdapter(ChatCompletionMessageToolCallParam)
TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


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


def conversation(request, content_format):
    out = []
    for message in request["messages"]:
        # ChatCompletionRequest._normalize_messages_before
        reasoning_content = message.pop("reasoning_content", None)
        if reasoning_content is not None and message.get("reasoning") is None:
            message["reasoning"] = reasoning_content
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = content
        if role == "system":
            parts = MESSAGES["_strip_claude_code_billing_header"](parts)
        texts = []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
            elif part.get("type") in TEXT_FIELDS and part.get(TEXT_FIELDS[part["type"]]) is not None:
                texts.append(part[TEXT_FIELDS[part["type"]]])
        if content_format == "openai":
            msg = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:
            msg = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                msg["tool_calls"] = [TOOL_CALL.validate_python(c) for c in message["tool_calls"]]
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
    MESSAGES["_postprocess_messages"](out)
    return out


def render(case):
    request = json.loads(case["request"])
    template = case["template"]
    content_format = HF["_detect_content_format"](template, default="string")
    # build_chat_params, preprocess_chat and ChatParams.with_defaults, in that order.
    user_kwargs = request.get("chat_template_kwargs") or {}
    extra = {
        "add_generation_prompt": request.get("add_generation_prompt", True),
        "continue_final_message": request.get("continue_final_message", False),
        "documents": request.get("documents"),
        "reasoning_effort": request.get("reasoning_effort"),
    }
    effort = request.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in user_kwargs:
        extra["enable_thinking"] = effort != "none"
    merge = PARAMS["merge_kwargs"]
    tools = None if request.get("tools") is None else [tool_dump(t) for t in request["tools"]]
    kwargs = merge(merge({}, {"tools": tools}), merge(user_kwargs, extra))
    chat = conversation(request, content_format)
    if any(m["role"] == "developer" for m in chat) and not HF["_detect_developer_role_support"](template):
        chat = HF["_consolidate_system_messages"](HF["_convert_developer_to_system"](chat))
    chat = [{k: v for k, v in m.items() if v is not None} for m in chat]
    named = {name: kwargs.pop(name, None) for name in ("tools", "documents")}
    rendered, _ = render_jinja_template(
        conversations=[chat],
        tools=named["tools"],
        documents=named["documents"],
        chat_template=template,
        continue_final_message=kwargs.pop("continue_final_message", False),
        add_generation_prompt=kwargs.pop("add_generation_prompt", False),
        **{**case.get("special_tokens", {}), **kwargs},
    )
    return rendered[0], content_format


def main():
    cases = json.load(sys.stdin)["cases"]
    for case in cases:
        try:
            text, content_format = render(case)
            print(json.dumps({"text": text, "format": content_format}))
        except Exception as error:  # the template's own exceptions are answers too
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}))


if __name__ == "__main__":
    main()
