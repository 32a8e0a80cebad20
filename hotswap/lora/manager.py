"""The engine core's LoRA adapters: which are loaded, under which names and versions.

Invariants: a name maps to its latest loaded version; a request is bound to the version
that was latest when it was admitted and keeps it to the end (a reload under the same
name never changes the weights of a request already running, and its KV stays cached
under the version that computed it). A load is checked in full before anything changes:
a refused adapter leaves the registry as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hotswap.config import LoRAConfig
from hotswap.engine.errors import EngineStateError
from hotswap.engine.handlers import Outputs, handles
from hotswap.engine.verbs import (
    CommitLoraAdapter,
    ListLoraAdapters,
    LoadLoraAdapter,
    UnloadLoraAdapter,
)
from hotswap.errors import InvalidArgument
from hotswap.lora.adapter import AdapterConfig, AdapterWeights, build_adapter, load_adapter
from hotswap.lora.files import CONFIG_FILE, WEIGHTS_FILE
from hotswap.lora.stage import AdapterStage
from hotswap.weight_transfer.disk import check_safetensors, confine

NOT_ENABLED = "LoRA is not enabled: start the engine with --enable-lora"


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig | None,
        model: Any,
        dtype: torch.dtype,
        allowed_dirs: tuple[Path, ...] | None,
        in_use: Callable[[], set[int]] = set,
    ) -> None:
        self.config = config
        self.in_use = in_use  # the adapter versions unfinished requests hold (their uids)
        self.model = model
        self.dtype = dtype
        self.allowed_dirs = allowed_dirs
        # name -> its latest version; order: least recently used first
        self.adapters: OrderedDict[str, AdapterWeights] = OrderedDict()
        # Adapters evicted to stay within --max-cpu-loras: name -> path, read again when a
        # request names one (as vLLM's CPU cache does); unloading forgets them.
        self.evicted: dict[str, str] = {}
        self.pending: dict[str, AdapterWeights] = {}  # loads prepared, not yet committed

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def resolve(self, name: str | None, in_use: set[int]) -> AdapterWeights | None:
        """The version a new request named `name` runs on (None: the base model)."""
        if name is None:
            return None
        if self.config is None:
            raise InvalidArgument("lora_request", f"lora_request: {NOT_ENABLED}")
        if name in self.evicted and name not in self.adapters:
            self.load(name, self.evicted[name], False, in_use)
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidArgument("lora_request", f"lora_request: no adapter named {name!r} "
                                  "is loaded")  # fmt: skip
        self.adapters.move_to_end(name)
        return adapter

    def load(
        self, name: str, path: str, load_inplace: bool, in_use: set[int], prepare: bool = False
    ) -> dict[str, Any]:
        """Load the adapter in `path` under `name`; `load_inplace` replaces a loaded one
        (its running requests finish on their version). `in_use`: uids requests hold,
        never evicted to make room. With `prepare`, everything is checked and the adapter
        is held aside until `commit_pending` (phase one of a load on every DP rank)."""
        config = self._require()
        if name in self.adapters and not load_inplace:
            raise InvalidArgument(
                "lora_name",
                f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
            )
        adapter = load_adapter(name, self._directory(path), self.model, self.dtype,
                               config.max_lora_rank)  # fmt: skip
        if name not in self.adapters:
            self._victim(config.max_cpu_loras, in_use)  # refused now if there is no room
        if prepare:
            self.pending[name] = adapter
            return describe(adapter, self._next_version(name))
        return describe(self._install(adapter, in_use))

    @handles(LoadLoraAdapter)
    def on_load_lora_adapter(self, args: LoadLoraAdapter, out: Outputs) -> dict[str, Any]:
        return self.load(args.lora_name, args.lora_path, args.load_inplace, self.in_use(),
                         args.prepare)  # fmt: skip

    @handles(CommitLoraAdapter)
    def on_commit_lora_adapter(
        self, args: CommitLoraAdapter, out: Outputs
    ) -> dict[str, Any] | None:
        return self.commit_pending(args.lora_name, args.abort, self.in_use())

    def commit_pending(self, name: str, abort: bool, in_use: set[int]) -> dict[str, Any] | None:
        """Phase two: serve the adapter `load(prepare=True)` held aside (or drop it)."""
        adapter = self.pending.pop(name, None)
        if abort:
            return None
        if adapter is None:
            raise EngineStateError(f"lora: no load of {name!r} is prepared")
        return describe(self._install(adapter, in_use))

    def _install(self, adapter: AdapterWeights, in_use: set[int]) -> AdapterWeights:
        """Make `adapter` its name's latest version; never fails (the checks ran before):
        with no idle adapter to evict, --max-cpu-loras is exceeded until one is idle."""
        if adapter.name not in self.adapters:
            victim = self._victim(self._require().max_cpu_loras, in_use, strict=False)
            if victim is not None:
                evicted = self.adapters.pop(victim)
                if evicted.path is not None:
                    self.evicted[victim] = evicted.path
        adapter.version = self._next_version(adapter.name)
        self.adapters[adapter.name] = adapter
        self.adapters.move_to_end(adapter.name)
        self.evicted.pop(adapter.name, None)
        return adapter

    def _next_version(self, name: str) -> int:
        previous = self.adapters.get(name)
        return previous.version + 1 if previous is not None else 1

    def _directory(self, path: str) -> Path:
        """The adapter's real directory, confined to the allowed weight directories (with
        its files: a link inside may not point outside), its tensors' header checked."""
        shown = repr(path[:200])
        try:
            directory = confine(Path(path), self.allowed_dirs, shown)
            if not directory.is_dir():
                raise InvalidArgument("lora_path", f"lora_path: {shown} is not a directory")
            for file in (CONFIG_FILE, WEIGHTS_FILE):
                real = confine(directory / file, self.allowed_dirs, f"{file} in {shown}")
                if file == WEIGHTS_FILE and real.is_file():
                    check_safetensors(real)
        except InvalidArgument as e:  # the disk checks name their own field: model_path
            message = str(e).replace("model_path: ", "lora_path: ", 1)
            raise InvalidArgument("lora_path", message) from None
        except (ValueError, OSError) as e:  # e.g. a NUL byte, a name too long
            raise InvalidArgument("lora_path", f"lora_path: {shown} is not usable ({e})") from None
        return directory

    # -- weight rounds into an adapter (weight_sync.py) -------------------------------------
    def open_stage(
        self, name: str, lora_config: dict[str, Any] | None, in_use: set[int]
    ) -> AdapterStage:
        """Where a round into adapter `name` is received: a copy of its tensors (only those
        sent change), or, for a new adapter or a new `lora_config`, zeros the round must
        fill whole. Nothing served changes until `commit_stage`."""
        config = self._require()
        if name in self.evicted and name not in self.adapters:
            self.load(name, self.evicted[name], False, in_use)
        base = self.adapters.get(name)
        if lora_config is not None:
            declared = AdapterConfig.parse(lora_config, config.max_lora_rank, "lora_config",
                                           "lora_config")  # fmt: skip
            if base is not None and declared != base.config:
                base = None  # another shape or scaling: a new adapter under the old name
        elif base is None:
            raise InvalidArgument(
                "lora_config",
                f"lora_config: no adapter named {name!r} is loaded; a round that creates one "
                "must declare it (r, lora_alpha, target_modules as in adapter_config.json)",
            )
        else:
            declared = base.config
        return AdapterStage(name, declared, base, self.model)

    def commit_stage(self, stage: AdapterStage, in_use: set[int]) -> AdapterWeights:
        """The round's tensors become the adapter's next version (new requests run on it;
        running ones finish on theirs); refused (nothing changes) if a value is bad."""
        path = stage.base.path if stage.base is not None else None
        adapter = build_adapter(stage.name, path, stage.config, stage.tensors, self.model,
                                self.dtype)  # fmt: skip
        return self._install(adapter, in_use)

    @handles(UnloadLoraAdapter)
    def on_unload_lora_adapter(self, args: UnloadLoraAdapter, out: Outputs) -> None:
        self._require()
        name = args.lora_name
        evicted = self.evicted.pop(name, None)
        if self.adapters.pop(name, None) is None and evicted is None:
            raise InvalidArgument("lora_name", f"The lora adapter '{name}' cannot be found.")

    @handles(ListLoraAdapters)
    def on_list_lora_adapters(self, args: ListLoraAdapters, out: Outputs) -> list[dict[str, Any]]:
        return [describe(adapter) for adapter in self.adapters.values()]

    def _victim(self, limit: int, in_use: set[int], strict: bool = True) -> str | None:
        """The adapter a new one evicts when `limit` are loaded: the least recently used
        no request holds (None: there is room). With `strict`, refused when every one is
        in use."""
        if len(self.adapters) < limit:
            return None
        for name, adapter in self.adapters.items():
            if adapter.uid not in in_use:
                return name
        if not strict:
            return None
        raise EngineStateError(
            f"lora: all {limit} loaded adapters (--max-cpu-loras) are in use by running "
            "requests; unload one or retry when they finish"
        )

    def _require(self) -> LoRAConfig:
        if self.config is None:
            raise EngineStateError(NOT_ENABLED)
        return self.config


def describe(adapter: AdapterWeights, version: int | None = None) -> dict[str, Any]:
    return {
        "lora_name": adapter.name,
        "lora_path": adapter.path,
        "version": adapter.version if version is None else version,
        "rank": adapter.rank,
    }
