"""Typed keys for what the app shares with its handlers."""

from __future__ import annotations

from aiohttp import web

from common.messages import ModelInfo
from common.server_args import ServerArgs
from tokenizer_proc.manager import TokenizerManager
from tokenizer_proc.tokenizer import Tokenizer, TokenizerPool

MANAGER = web.AppKey("manager", TokenizerManager)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
MODEL_INFO = web.AppKey("model_info", ModelInfo)
SERVER_ARGS = web.AppKey("server_args", ServerArgs)
HEALTH_GENERATE_TIMEOUT = web.AppKey("health_generate_timeout", float)
TOKENIZER_POOL = web.AppKey("tokenizer_pool", TokenizerPool)  # encode and chat templates, off the loop
PROMPT_CHAR_LIMIT = web.AppKey("prompt_char_limit", object)  # int | None: refused before tokenizing
