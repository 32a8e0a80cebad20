"""`hotswap serve`'s server flags are derived from `ServerConfig`'s fields (and the two
start-up-only flags of `StartupFlags`): every field is a flag, each flag keeps the spelling,
default and action it had when written by hand, and a command line parses into the
`ServerConfig` it means."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from hotswap.default_model import DEFAULT_MODEL_NAME
from hotswap.entrypoints.cli import StartupFlags, build_parser, main, run_serve
from hotswap.entrypoints.flags import flag_default, flag_dest, flag_names, flagged_fields
from hotswap.entrypoints.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.flag_spec import FLAG_KEY
from hotswap.lora.modules import LoRAModulePath
from hotswap.structured_output import StructuredOutputsConfig

# The server group as written by hand before it was derived: each flag's default, in the
# order of --help; SWITCHES are store_true (no --no-x), LISTS take one or more values.
SERVER_FLAGS = {
    "--host": "127.0.0.1",
    "--port": 8000,
    "--api-key": None,
    "--served-model-name": None,
    "--enable-control": False,
    "--enable-prompt-tokens-details": False,
    "--return-tokens-as-token-ids": False,
    "--log-level": "info",
    "--lora-modules": None,
    "--enable-auto-tool-choice": False,
    "--tool-call-parser": None,
    "--structured-outputs-config": None,
    "--reasoning-parser": None,
    "--max-request-body-bytes": DEFAULT_MAX_REQUEST_BODY_BYTES,
    "--trust-request-chat-template": False,
    "--reject-unknown-fields": False,
    "--api-key-file": None,
    "--allowed-master-addresses": None,
}
SWITCHES = {name for name, default in SERVER_FLAGS.items() if default is False}
LISTS = {"--lora-modules", "--allowed-master-addresses"}
CLEAN_ENV = ("HOTSWAP_API_KEY", "VLLM_API_KEY", "HOTSWAP_SERVER_DEV_MODE")


def serve_groups() -> dict[str, list[argparse.Action]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {g.title: g._group_actions for g in sub.choices["serve"]._action_groups}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CLEAN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_every_config_field_is_a_flag() -> None:
    unflagged = [f.name for f in dataclasses.fields(ServerConfig) if FLAG_KEY not in f.metadata]
    assert unflagged == []
    flagged = [f for cls in (ServerConfig, StartupFlags) for f, _ in flagged_fields(cls)]
    assert len(flagged) == len(SERVER_FLAGS)


def test_server_group_keeps_its_flags_defaults_and_actions() -> None:
    groups = serve_groups()
    assert {"engine", "server"} <= set(groups)
    actions = groups["server"]
    assert [a.option_strings[0] for a in actions] == list(SERVER_FLAGS)
    for action in actions:
        name = action.option_strings[0]
        assert action.option_strings == [name], name
        assert action.default == SERVER_FLAGS[name], name
        assert isinstance(action, argparse._StoreTrueAction) == (name in SWITCHES), name
        assert (action.nargs == "+") == (name in LISTS), name
    extend = [a.option_strings[0] for a in actions if isinstance(a, argparse._ExtendAction)]
    assert extend == ["--lora-modules"]


def test_each_flag_is_its_fields_flag_with_its_default() -> None:
    by_dest = {a.dest: a for a in serve_groups()["server"]}
    for cls in (ServerConfig, StartupFlags):
        for f, flag in flagged_fields(cls):
            action = by_dest.pop(flag_dest(f.name, flag))
            assert tuple(action.option_strings) == flag_names(f.name, flag)
            assert action.default == flag_default(f, flag), f.name
            assert action.help == flag.help and action.metavar == flag.metavar, f.name
            if flag.parse is not None and f.default is not dataclasses.MISSING:
                # A parsed flag's absence (None) means the field's default.
                assert flag.parse(None) == f.default, f.name
    assert by_dest == {}


@pytest.mark.usefixtures("clean_env")
def test_no_flags_give_the_fields_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve(monkeypatch, []) == ServerConfig(served_model_name="some/model")
    assert serve(monkeypatch, [], model=None).served_model_name == DEFAULT_MODEL_NAME


@pytest.mark.usefixtures("clean_env")
def test_a_command_line_gives_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [
        "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--served-model-name", "m",
        "--enable-control", "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
        "--log-level", "debug", "--lora-modules", "a=/a", "--lora-modules", "b=/b",
        "--enable-lora", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
        "--reasoning-parser", "qwen3", "--max-request-body-bytes", "9",
        "--trust-request-chat-template", "--reject-unknown-fields",
    ]  # fmt: skip
    assert serve(monkeypatch, argv) == ServerConfig(
        host="0.0.0.0",
        port=0,
        api_key="k",
        served_model_name="m",
        enable_control=True,
        enable_prompt_tokens_details=True,
        return_tokens_as_token_ids=True,
        log_level="debug",
        lora_modules=(LoRAModulePath("a", "/a"), LoRAModulePath("b", "/b")),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        structured_outputs=StructuredOutputsConfig(disable_any_whitespace=True),
        reasoning_parser="qwen3",
        max_request_body_bytes=9,
        trust_request_chat_template=True,
        reject_unknown_fields=True,
    )


@pytest.mark.usefixtures("clean_env")
def test_fields_resolved_beyond_their_flag(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("HOTSWAP_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert serve(monkeypatch, []).enable_control is True
    assert serve(monkeypatch, []).api_key == "env-key"
    (tmp_path / "key").write_text("file-key\n")
    assert serve(monkeypatch, ["--api-key-file", str(tmp_path / "key")]).api_key == "file-key"


def test_allowed_master_addresses_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.entrypoints.server import app

    calls = []
    monkeypatch.setattr(app, "run_server", lambda *call: calls.append(call))
    argv = ["serve", "m", "--weight-transfer-config", '{"backend": "gloo"}']
    run_serve(build_parser().parse_args([*argv, "--allowed-master-addresses", "10.0.0.0/8"]))
    config = json.loads(calls[0][2]["weight_transfer_config"])
    assert config == {"backend": "gloo", "allowed_master_addresses": ["10.0.0.0/8"]}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-request-body-bytes", "0"], "--max-request-body-bytes: must be at least 1"),
        (["--allowed-master-addresses", "h"], "--allowed-master-addresses: needs --weight-"),
        (["--model", "other"], "model: given twice ('some/model' and --model 'other')"),
        (["--tool-call-parser", "nope"], "--tool-call-parser: unknown parser 'nope'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice: requires --tool-call-parser"),
        (["--structured-outputs-config", "{"], "--structured-outputs-config: not JSON"),
        (["--api-key", "a", "--api-key-file", "b"], "--api-key and --api-key-file: give one"),
    ],
)
def test_start_up_refusals(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    from hotswap.entrypoints.server import app

    monkeypatch.setattr(app, "run_server", lambda *_: pytest.fail("the server started"))
    assert main(["serve", "some/model", *argv]) == 2
    assert f"hotswap: error: {message}" in capsys.readouterr().err


def serve(monkeypatch: pytest.MonkeyPatch, argv: list[str], model: str | None = "some/model"):
    """The ServerConfig `hotswap serve [model] argv` hands the server (which never starts)."""
    from hotswap.entrypoints.server import app

    configs = []
    monkeypatch.setattr(app, "run_server", lambda config, *_: configs.append(config))
    run_serve(build_parser().parse_args(["serve", *([model] if model else []), *argv]))
    return configs[0]
