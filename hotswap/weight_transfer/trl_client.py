"""Trainer side of TRL's `trl vllm-serve` protocol against `hotswap serve`, with gloo on
CPU (torch NCCL on CUDA): a stand-in for TRL's `VLLMClient`
(trl/generation/vllm_client.py) with its methods, arguments, routes and answers.

TRL's client builds its weight group with vLLM's StatelessProcessGroup and a
PyNcclCommunicator: CUDA only, and a rendezvous torch's process groups do not speak. This
one keeps TRL's layout and route sequence (GET /get_world_size/ -> W; POST
/init_communicator/; join as rank W, the last, of W + 1, the server's first worker hosting
the store at the address this client reaches the server on; per parameter POST
/update_named_param/, then broadcast it from rank W) over a torch ProcessGroupGloo (or
ProcessGroupNCCL), so a TRL trainer on CPU can swap it in where TRL builds a `VLLMClient`.
"""

from __future__ import annotations

import atexit
import socket
import time
from typing import Any
from urllib.parse import urlparse

import httpx
import torch
from torch import nn

from hotswap.weight_transfer.broadcast import DEFAULT_TIMEOUT_S, BroadcastChannel, join_group


class TRLClient:
    """TRL's `VLLMClient` calls, over HTTP and a gloo (or NCCL) broadcast group."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        if base_url is not None:
            parsed = urlparse(base_url)
            self.host = socket.gethostbyname(parsed.hostname or "127.0.0.1")
            self.base_url = f"{parsed.scheme or 'http'}://{parsed.netloc}{parsed.path}"
        else:
            self.host = host
            self.base_url = f"http://{host}:{server_port}"
        self.group_port = group_port
        self.timeout_s = timeout_s  # joining the group and each broadcast
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=None)
        self.communicator: BroadcastChannel | None = None
        self.rank: int | None = None
        self._atexit = False
        self.check_server(connection_timeout)

    # -- HTTP ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"Request failed: {response.status_code}, {response.text}")
        return response.json()

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """Until GET /health/ answers 200, at most `total_timeout` seconds."""
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                status = self.http.get("/health/").status_code
            except httpx.HTTPError as e:
                status, error = None, e
            else:
                error = None
            if status == 200:
                return
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"The server at {self.base_url} is not healthy after {total_timeout} "
                    f"seconds ({error or status})"
                )
            time.sleep(retry_interval)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        images: list | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
    ) -> dict[str, Any]:
        """{prompt_ids, completion_ids, logprobs, logprob_token_ids}, as TRL's."""
        if images:
            raise ValueError("images: hotswap serves text-only models")
        body = {
            "prompts": prompts,
            "images": None,
            "n": n,
            "repetition_penalty": repetition_penalty,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "structured_outputs_regex": structured_outputs_regex,
            "generation_kwargs": generation_kwargs or {},
        }
        return _generated(self._call("POST", "/generate/", body))

    def chat(
        self,
        messages: list[list[dict]],
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        chat_template: str | None = None,
    ) -> dict[str, Any]:
        if chat_template is not None:
            raise NotImplementedError("chat_template: as TRL's client, not supported")
        body = {
            "messages": messages,
            "n": n,
            "repetition_penalty": repetition_penalty,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "structured_outputs_regex": structured_outputs_regex,
            "generation_kwargs": generation_kwargs or {},
            "chat_template_kwargs": chat_template_kwargs or {},
            "tools": tools,
        }
        return _generated(self._call("POST", "/chat/", body))

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache/")

    # -- the weight group ---------------------------------------------------------------
    def init_communicator(self, device: torch.device | str | int = "cpu") -> None:
        """Join the server's workers as the last rank: gloo on CPU, NCCL on CUDA."""
        device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        workers = self._call("GET", "/get_world_size/")["world_size"]
        world_size, self.rank = workers + 1, workers
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
        body = {
            "host": "0.0.0.0",
            "port": self.group_port,
            "world_size": world_size,
            "client_device_uuid": uuid or device.type,
        }
        self._call("POST", "/init_communicator/", body)
        group = join_group(
            self.host, self.group_port, self.rank, world_size, device, self.timeout_s
        )
        self.communicator = BroadcastChannel(group, device, False, 1, 1, src=self.rank)
        if not self._atexit:
            atexit.register(self.close_communicator)
            self._atexit = True

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """Announce the parameter, then broadcast it from this (the last) rank."""
        if self.communicator is None:
            raise RuntimeError("Communicator not initialized. Call `init_communicator` first.")
        body = {"name": name, "dtype": str(weights.dtype), "shape": list(weights.shape)}
        self._call("POST", "/update_named_param/", body)
        self.communicator.send([weights.detach()])

    def update_model_params(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            self.update_named_param(name, param.data)

    def close_communicator(self) -> None:
        try:
            self._call("POST", "/close_communicator/")
        except httpx.HTTPError:
            pass  # the server is gone already
        finally:
            if self.communicator is not None:
                self.communicator.close()
            self.communicator = None


def _generated(answer: dict[str, Any]) -> dict[str, Any]:
    keys = ("prompt_ids", "completion_ids", "logprobs", "logprob_token_ids")
    return {key: answer[key] for key in keys}


VLLMClient = TRLClient  # the name TRL's code constructs
