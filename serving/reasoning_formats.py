"""How reasoning models mark their reasoning, by `--reasoning_parser` name: (start marker, end marker, whether the
output starts inside the reasoning, the chat template having opened it in the prompt). One table for the engine's
grammars (serving.core.structured: a grammar may apply after the reasoning) and the API's parsers
(serving.api.reasoning: reasoning_content apart from content), which may not import each other."""

REASONING_FORMATS: dict[str, tuple[str, str, bool]] = {
    "deepseek_r1": ("<think>", "</think>", True),  # the template opens <think> in the prompt
    "qwen3": ("<think>", "</think>", False),  # the model may open a <think>...</think> block first
}
