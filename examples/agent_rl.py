"""An agentic RL episode against `hotswap serve`: a calculator tool, several turns, and one
trajectory a trainer can consume, with a weight update between episodes.

Each episode:
1. turn 1 (chat, `tool_choice: "required"`): the policy must call `calculator`; the call
   is generated under the tool's JSON schema, so it always parses. The answer carries the
   prompt's and the completion's token ids, the logprobs and the weight versions;
2. the environment runs the call;
3. turn 2 (token in, token out): the prompt is turn 1's prompt ids + its completion ids +
   the ids of the tool turn, sent as token ids to /v1/completions, so nothing the policy
   generated is re-tokenized (the trainer scores exactly what was sampled);
4. the reward is 1 when the final answer holds the right number.

Between episodes the trainer takes one small step on the episode's sampled tokens (the
ids and logprobs above, nothing re-tokenized) and pushes its weights through shared memory
(the `ipc` backend); the next episode's tokens carry the new weight version.

    .venv/bin/python examples/agent_rl.py [--episodes 2]
"""

from __future__ import annotations

import argparse
import json
import operator
from typing import Any

import httpx
import torch
from _rlhf_http import control, load_trainer_model, serve
from openai import OpenAI

from hotswap.weight_transfer import (
    HTTPWeightSyncClient,
    IPCTrainerInitInfo,
    ModuleSource,
    WeightTransferTrainerFactory,
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Compute a op b",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "op": {"type": "string", "enum": ["+", "-", "*"]},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "op", "b"],
            "additionalProperties": False,
        },
    },
}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
QUESTIONS = [("What is 17 * 23? Use the calculator.", 391), ("What is 45 + 78?", 123)]


def call_tool(call: dict[str, Any]) -> int:
    """The environment: run the calculator on the call's (schema-valid) arguments."""
    args = json.loads(call["function"]["arguments"])
    return OPS[args["op"]](args["a"], args["b"])


def episode(url: str, model: str, question: str, answer: int) -> dict[str, Any]:
    """One multi-turn episode; returns the trajectory (per-turn ids, logprobs, versions)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": question}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[CALCULATOR], tool_choice="required",
        parallel_tool_calls=False, max_tokens=96, temperature=0.7, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = first.choices[0]
    calls = choice.message.tool_calls or []  # none only if cut by max_tokens
    call = calls[0].model_dump() if calls else {"function": {"name": "", "arguments": "{}"}}
    result = call_tool(call) if calls else "error: no call"
    turn1 = {
        "prompt_ids": first.model_extra["prompt_token_ids"],
        "completion_ids": choice.model_extra["token_ids"],
        "logprobs": [c.logprob for c in choice.logprobs.content],
        "weight_versions": choice.model_extra["weight_versions"],
        "tool_call": call["function"],
    }
    tool_turn = f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    suffix = httpx.post(f"{url}/tokenize", json={"prompt": tool_turn, "add_special_tokens": False})
    prompt2 = turn1["prompt_ids"] + turn1["completion_ids"] + suffix.json()["tokens"]
    second = client.completions.create(
        model=model, prompt=prompt2, max_tokens=32, temperature=0.0, logprobs=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    final = second.choices[0]
    turn2 = {
        "prompt_ids": prompt2,
        "completion_ids": final.model_extra["token_ids"],
        "logprobs": final.logprobs.token_logprobs,
        "weight_versions": final.model_extra["weight_versions"],
        "text": final.text,
    }
    reward = float(str(answer) in final.text)
    return {"question": question, "turns": [turn1, turn2], "reward": reward}


def train_step(model: torch.nn.Module, trajectory: dict[str, Any], lr: float = 1e-6) -> float:
    """One step of REINFORCE (reward - 0.5 as the advantage) on every sampled token of the
    trajectory, scored from the very ids the engine sampled."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    advantage = trajectory["reward"] - 0.5
    loss = torch.zeros(())
    for turn in trajectory["turns"]:
        ids = torch.tensor([turn["prompt_ids"] + turn["completion_ids"]])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        start = len(turn["prompt_ids"]) - 1
        sampled = ids[0, start + 1 :]
        loss = loss - advantage * logp[start:].gather(1, sampled[:, None]).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2)
    args = parser.parse_args()
    policy = load_trainer_model().train()
    compact = ["--structured-outputs-config", '{"disable_any_whitespace": true}']
    with serve({"backend": "ipc"}, compact, real_weights=True) as (name, url):
        sync = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(), client=HTTPWeightSyncClient(url), source=ModuleSource(policy)
        )
        for step in range(args.episodes):
            question, answer = QUESTIONS[step % len(QUESTIONS)]
            trajectory = episode(url, name, question, answer)
            turn1, turn2 = trajectory["turns"]
            versions = [s["version"] for t in trajectory["turns"] for s in t["weight_versions"]]
            print(f"episode {step}: {question!r}")
            print(f"  call {turn1['tool_call']} -> final {turn2['text']!r}")
            lengths = [len(t["completion_ids"]) for t in trajectory["turns"]]
            print(f"  reward {trajectory['reward']}, sampled tokens per turn {lengths}, "
                  f"weight versions {sorted(set(versions))}")  # fmt: skip
            prefix = turn2["prompt_ids"][: len(turn1["prompt_ids"]) + len(turn1["completion_ids"])]
            assert prefix == turn1["prompt_ids"] + turn1["completion_ids"]
            print(f"  trainer loss {train_step(policy, trajectory):.3f}")
            control(url, "POST", "/pause?mode=keep")
            committed = sync.send_weights(f"step-{step + 1}")
            control(url, "POST", "/resume")
            print(f"  pushed weights: version {committed.version}")
        sync.shutdown()
    print("trajectory fields:", sorted(trajectory["turns"][0]))


if __name__ == "__main__":
    main()
