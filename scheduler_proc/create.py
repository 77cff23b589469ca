"""The scheduler --batching asks for."""

from __future__ import annotations

from typing import Callable

from common.messages import ModelInfo, ToTokenizerMsg
from common.server_args import ServerArgs
from scheduler_proc.model_client import LocalModel, ModelClient
from scheduler_proc.padded_batching import PaddedBatchScheduler
from scheduler_proc.scheduler import Scheduler


def create_scheduler(server_args: ServerArgs, model_info: ModelInfo, model: ModelClient | LocalModel,
                     send_output: Callable[[ToTokenizerMsg], None]) -> Scheduler:
    """Continuous batching (Scheduler), or a padded baseline (static, dynamic)."""
    cls = Scheduler if server_args.batching == "continuous" else PaddedBatchScheduler
    return cls(server_args, model_info, model, send_output)
