"""`build_engine`: the engine a config asks for (data-parallel replicas, or one Engine, pipelined or not), with the
tokenizer of a directory when one is given; the offline LLM, the instance server and its followers all build theirs
here."""
from __future__ import annotations

from models.tokenizer import Tokenizer
from serving.core.config import EngineConfig
from serving.core.data_parallel import DataParallelEngine
from serving.core.engine import Engine
from serving.core.interface import ServingEngine


def build_engine(config: EngineConfig, tokenizer: Tokenizer | str | None = None) -> ServingEngine:
    """Data-parallel replicas when config.dp > 1 (they refuse pp and speculation with a clear error), else one
    Engine (pipelined when config.pp > 1). tokenizer: a Tokenizer, or the directory of one; None or "": the model's."""
    if isinstance(tokenizer, str):
        tokenizer = Tokenizer.from_pretrained(tokenizer) if tokenizer else None
    if config.dp > 1:
        return DataParallelEngine(config, tokenizer=tokenizer)
    return Engine(config, tokenizer=tokenizer)
