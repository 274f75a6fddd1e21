"""The engine a rollout server owns: it loads the model, samples, and takes new weights in place."""

from __future__ import annotations

import threading

import torch

from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import ConfigError
from grpokit.rollout.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest
from grpokit.server.bodies import TensorMeta
from grpokit.server.weight_sync import dtype_name, parse_dtype


class ServedTransformersEngine(TransformersEngine):
    """``TransformersEngine`` on a model of its own. ``lock`` keeps sampling and weight loading apart, so that no
    ``generate`` call ever sees half-updated weights."""

    def __init__(self, model, template, max_batch_size: int = 256) -> None:
        super().__init__(model, template, max_batch_size=max_batch_size)
        self.lock = threading.Lock()
        model.requires_grad_(False).eval()
        # remove_duplicate=False: tied weights answer to both names (embed_tokens and lm_head)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        first = next(iter(self._params.values()))
        self.dtype, self.device = first.dtype, first.device

    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        with self.lock:
            return super().infer(requests, config)

    def check_weights(self, metas: list[TensorMeta]) -> list[str]:
        """Problems with loading these tensors (unknown name, other shape, dtype that cannot cast); [] if none."""
        problems = []
        for m in metas:
            param = self._params.get(m.name)
            if param is None:
                problems.append(f"{m.name}: no such parameter in the served model")
                continue
            if list(param.shape) != list(m.shape):
                problems.append(f"{m.name}: shape {m.shape} but the served model has {list(param.shape)}")
            try:
                dtype = parse_dtype(m.dtype)
            except ValueError as e:
                problems.append(f"{m.name}: {e}")
                continue
            if dtype.is_floating_point != param.dtype.is_floating_point:
                problems.append(f"{m.name}: dtype {m.dtype} cannot load into {dtype_name(param.dtype)}")
        return problems

    @torch.no_grad()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters in place (casting dtype, moving device). Caller holds ``lock``."""
        for name, tensor in named:
            self._params[name].data.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def info(self) -> dict:
        return {"torch_dtype": dtype_name(self.dtype), "device": str(self.device)}


def build_served_engine(engine: str, model_path: str, torch_dtype_name: str, max_batch_size: int = 256,
                        fast_decode: bool = True):
    """Load ``model_path`` and wrap it in the engine named ``engine`` (``fast_decode``: transformers only)."""
    if engine == "vllm":  # vLLM in this process; weights from the sync group are loaded into it in place
        from grpokit.engines.vllm_engine import VllmEngine, VllmSettings

        return VllmEngine(model_path, VllmSettings(dtype=torch_dtype_name, max_num_seqs=max_batch_size))
    if engine != "transformers":
        raise ConfigError(f"--engine {engine}: unknown engine; use transformers or vllm")
    from grpokit.pipeline.models import load_causal_lm, load_tokenizer, torch_dtype
    from grpokit.template.encode import ChatTemplate

    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path, torch_dtype(torch_dtype_name, for_training_weights=False))
    if torch.cuda.is_available():
        model = model.to("cuda")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    served = ServedTransformersEngine(model, ChatTemplate(tokenizer), max_batch_size=max_batch_size)
    served.fast_decode = fast_decode
    return served
