"""The HTTP side: a real `hotswap serve` on 127.0.0.1 (tests.helpers.server), driven as a
client would: requests streamed through the OpenAI client (`/v1/completions`) or httpx
(`/inference/v1/generate`, which carries routed experts on streams), the control plane's
routes, and a trainer over `HTTPWeightSyncClient`.

Invariants: a server runs per engine spec and is kept across schedules (one at a time); a
schedule starts by reloading the starting checkpoint from disk, so it begins on known
weights at a fresh version whatever ran before (the prefix cache is keyed by version),
and its adapters are named for it alone and unloaded when it ends.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from hotswap.tokenizer import Tokenizer
from hotswap.weight_transfer import HTTPWeightSyncClient
from tests.exactness.check import Span
from tests.exactness.driver import ChoiceSoFar, Stream
from tests.exactness.python_engine import engine_args
from tests.exactness.schedule import EngineSpec, Submit
from tests.exactness.trainer import Trainer
from tests.exactness.weights import WeightBank
from tests.helpers.server import RemoteServer
from tests.helpers.waiting import gauge

MODEL = "base"


def server_flags(spec: EngineSpec, root: Path) -> list[str]:
    """`hotswap serve` flags for the engine arguments the Python side uses."""
    flags = ["--served-model-name", MODEL, "--enable-control", "--log-level", "warning"]
    for name, value in engine_args(spec, root).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not False:
            flags += [flag, str(value)]
    return flags


class ServerPool:
    """One server at a time, for the spec last asked for, with its trainer."""

    def __init__(self, bank: WeightBank) -> None:
        self.bank = bank
        self.spec: EngineSpec | None = None
        self.server: RemoteServer | None = None
        self.trainer: Trainer | None = None

    def get(self, spec: EngineSpec) -> tuple[RemoteServer, Trainer]:
        if spec != self.spec:
            self.close()
            model = self.bank.model_dir(spec.arch)
            self.server = RemoteServer(model, *server_flags(spec, self.bank.root))
            self.trainer = Trainer(HTTPWeightSyncClient(self.server.url), spec.backend)
            self.spec = spec
        return self.server, self.trainer

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        if self.server is not None:
            self.server.stop()
        self.spec = self.server = self.trainer = None


class HttpEngine:
    def __init__(self, pool: ServerPool, spec: EngineSpec, bank: WeightBank, number: int) -> None:
        self.pool, self.spec, self.bank = pool, spec, bank
        self.prefix = f"s{number}-"  # adapter names of this schedule alone
        self.loaded: set[str] = set()
        model = bank.model_dir(spec.arch)
        self.eos_token_id = Tokenizer.from_pretrained(str(model)).eos_token_id

    async def start(self) -> int:
        self.server, self.trainer = self.pool.get(self.spec)
        self.http = self.server.async_client(timeout=120.0)
        self.openai = self.server.async_openai()
        await self._post("/wake_up")
        await self._post("/resume")
        await self.load_from_disk(self.bank.model_dir(self.spec.arch), "start")
        self.preemptions = await self._preemptions()
        return await self.version()

    async def _preemptions(self) -> int:
        metrics = (await self.http.get("/metrics")).text
        return int(gauge(metrics, "hotswap:num_preemptions_total"))

    async def _post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        response = await self.http.post(path, json=body, params=params or None)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {response.status_code}: {response.text}")
        return response.json()

    def submit(self, stream: Stream, adapter: tuple[str, int] | None) -> None:
        model = MODEL if adapter is None else self.prefix + adapter[0]
        consume = self._generate if stream.request.route == "generate" else self._completions
        stream.task = asyncio.ensure_future(consume(stream, model))

    def experts_expected(self, request: Submit) -> bool:
        return self.spec.moe and request.route == "generate"

    async def _completions(self, stream: Stream, model: str) -> None:
        request = stream.request
        chunks = await self.openai.completions.create(
            model=model,
            prompt=list(request.prompt),
            max_tokens=request.max_tokens,
            n=request.n,
            stop=list(request.stop) or None,
            temperature=0.0 if request.seed is None else 1.0,
            seed=request.seed,
            logprobs=0,
            stream=True,
            extra_body={
                "return_token_ids": True,
                "ignore_eos": request.ignore_eos,
                "priority": request.priority,
                "kv_retention_s": request.kv_retention_s,
            },  # fmt: skip
        )
        async for chunk in chunks:
            for part in chunk.choices:
                extra = part.model_extra or {}
                choice = stream.choices[part.index]
                choice.tokens += extra.get("token_ids") or []
                if part.logprobs is not None:
                    choice.logprobs += part.logprobs.token_logprobs
                choice.text += part.text
                for span in extra.get("weight_versions") or []:
                    _extend(choice.spans, self._span(span, span["version"]))
                if part.finish_reason is not None:
                    choice.finish_reason = part.finish_reason
                    choice.stop_reason = extra.get("stop_reason")

    async def _generate(self, stream: Stream, model: str) -> None:
        request = stream.request
        params = {
            "temperature": 0.0 if request.seed is None else 1.0,
            "seed": request.seed,
            "max_tokens": request.max_tokens,
            "n": request.n,
            "stop": list(request.stop) or None,
            "ignore_eos": request.ignore_eos,
            "logprobs": 0,
        }
        body = {"model": model, "token_ids": list(request.prompt), "stream": True,
                "sampling_params": params, "priority": request.priority,
                "kv_retention_s": request.kv_retention_s}  # fmt: skip
        async with self.http.stream("POST", "/inference/v1/generate", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(
                    f"generate: HTTP {response.status_code}: {await response.aread()}"
                )
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for part in json.loads(line[6:])["choices"]:
                        self._generated(stream.choices[part["index"]], part)

    def _generated(self, choice: ChoiceSoFar, part: dict[str, Any]) -> None:
        choice.tokens += part["token_ids"]
        choice.logprobs += [entry["logprob"] for entry in part["logprobs"]["content"]]
        if part["weight_versions"]:  # the final chunk: the whole output's spans
            choice.spans = [self._span(s, s["weight_gen"]) for s in part["weight_versions"]]
        if part["routed_experts"]:
            raw = base64.b64decode(part["routed_experts"])
            choice.experts = np.load(io.BytesIO(raw), allow_pickle=False)
        if part["finish_reason"] is not None:
            choice.finish_reason, choice.stop_reason = part["finish_reason"], part["stop_reason"]

    def _span(self, span: dict[str, Any], version: int) -> Span:
        name = span.get("lora_name")
        if name is not None and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        stale = span["stale"]
        return Span(int(version), span["start"], span["end"], stale, name, span.get("lora_version"))

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self._post("/pause", mode=mode, clear_cache=str(clear_cache).lower())

    async def resume(self) -> None:
        await self._post("/resume")

    async def sleep(self, level: int, mode: str) -> None:
        await self._post("/sleep", level=level, mode=mode)

    async def wake(self) -> None:
        await self._post("/wake_up")

    async def load_adapter(self, name: str, path: Path, inplace: bool) -> None:
        body = {"lora_name": self.prefix + name, "lora_path": str(path), "load_inplace": inplace}
        response = await self.http.post("/v1/load_lora_adapter", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"load_lora_adapter: HTTP {response.status_code}: {response.text}")
        self.loaded.add(self.prefix + name)

    async def load_from_disk(self, path: Path, label: str) -> None:
        await self._post(
            "/update_weights_from_disk", {"model_path": str(path), "weight_version": label}
        )

    async def relabel(self, label: str) -> None:
        await self._post("/update_weight_version", {"new_version": label})

    async def version(self) -> int:
        response = await self.http.get("/weight_info")
        return response.json()["version"]

    async def counters(self) -> dict[str, int]:
        return {"preemptions": await self._preemptions() - self.preemptions}

    async def finish(self) -> None:
        for name in sorted(self.loaded):
            await self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        await self.openai.close()
        await self.http.aclose()


def _extend(spans: list[Span], span: Span) -> None:
    """Stream chunks carry the spans of their own tokens: merge the continuing ones."""
    last = spans[-1] if spans else None
    if (
        last is not None
        and last.end == span.start
        and (
            (last.version, last.stale, last.lora_name, last.lora_version)
            == (span.version, span.stale, span.lora_name, span.lora_version)
        )
    ):
        spans[-1] = Span(last.version, last.start, span.end, last.stale, last.lora_name,
                         last.lora_version)  # fmt: skip
        return
    spans.append(span)
