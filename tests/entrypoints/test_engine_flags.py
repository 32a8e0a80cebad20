"""The engine's CLI flags are derived from `EngineArgs`: one flag per field (bar the
declared internal ones), the field's default, type, choices and aliases."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hotswap.engine_args import EngineArgs
from hotswap.entrypoints.cli import build_parser
from hotswap.entrypoints.engine_flags import add_engine_args, engine_kwargs, flag_names
from hotswap.flag_spec import FLAG_KEY

# Fields a user never sets: the data-parallel front-end gives each engine core its rank.
INTERNAL_FIELDS = {"data_parallel_rank"}


def engine_parser() -> tuple[argparse.ArgumentParser, argparse._ArgumentGroup]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    return parser, add_engine_args(parser)


def test_every_field_has_a_flag_and_every_flag_a_field() -> None:
    _, group = engine_parser()
    dests = {action.dest for action in group._group_actions}
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert dests == fields - INTERNAL_FIELDS
    unflagged = {f.name for f in dataclasses.fields(EngineArgs) if FLAG_KEY not in f.metadata}
    assert unflagged == INTERNAL_FIELDS


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_no_flags_give_the_fields_defaults(command: str) -> None:
    args = build_parser().parse_args([command] + (["prompt"] if command == "generate" else []))
    defaults = dataclasses.asdict(EngineArgs())
    kwargs = engine_kwargs(args)
    assert kwargs == {k: v for k, v in defaults.items() if k not in INTERNAL_FIELDS | {"model"}}
    assert args.model is None


def test_each_flag_converts_to_the_fields_type() -> None:
    parser, _ = engine_parser()
    args = parser.parse_args(
        ["--max-num-seqs", "7", "--no-enable-prefix-caching", "--enforce-eager",
         "--allowed-weight-dirs", "/a", "/b", "--ray-address", "auto",
         "--weight-transfer-config", '{"backend": "gloo"}', "--dtype", "float32"]
    )  # fmt: skip
    engine_args = EngineArgs(**engine_kwargs(args))
    assert engine_args.max_num_seqs == 7 and engine_args.enable_prefix_caching is False
    assert engine_args.enforce_eager is True and engine_args.allowed_weight_dirs == ["/a", "/b"]
    assert engine_args.ray_address == "auto" and engine_args.dtype == "float32"
    assert engine_args.weight_transfer_config == '{"backend": "gloo"}'


def test_declared_choices_and_aliases() -> None:
    parser, _ = engine_parser()
    with pytest.raises(argparse.ArgumentError, match="dtype"):
        parser.parse_args(["--dtype", "float8"])
    with pytest.raises(argparse.ArgumentError, match="max-num-seqs"):
        parser.parse_args(["--max-num-seqs", "many"])
    assert parser.parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    with pytest.raises(argparse.ArgumentError, match="scheduling-policy"):
        parser.parse_args(["--scheduling-policy", "sjf"])  # vLLM's choices: fcfs, priority
    flags = {f.name: f.metadata[FLAG_KEY] for f in dataclasses.fields(EngineArgs) if f.metadata}
    aliased = {name: flag.aliases for name, flag in flags.items() if flag.aliases}
    assert aliased == {
        "kv_cache_memory_bytes": ("--kv-cache-memory",),  # hotswap's older one
        "tensor_parallel_size": ("-tp",),  # vLLM's short form
        "quantization": ("-q",),  # vLLM's short form
        "enable_expert_parallel": ("-ep",),  # vLLM's short form
    }
    assert parser.parse_args(["-tp", "2"]).tensor_parallel_size == 2
    assert parser.parse_args(["-ep"]).enable_expert_parallel is True
    assert parser.parse_args([]).enable_expert_parallel is False
    assert parser.parse_args(["-q", "fp8"]).quantization == "fp8"
    with pytest.raises(argparse.ArgumentError, match="quantization"):
        parser.parse_args(["--quantization", "awq"])  # not served: refused by the parser
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(argparse.ArgumentError, match="kv-cache-dtype"):
        parser.parse_args(["--kv-cache-dtype", "fp8_inc"])  # not served: refused by the parser
    assert parser.parse_args(["--calculate-kv-scales"]).calculate_kv_scales is True
    assert parser.parse_args(["--no-calculate-kv-scales"]).calculate_kv_scales is False
    assert parser.parse_args([]).calculate_kv_scales is False
    for name in flag_names("kv_cache_memory_bytes", flags["kv_cache_memory_bytes"]):
        assert parser.parse_args([name, "5"]).kv_cache_memory_bytes == 5
