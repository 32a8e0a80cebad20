"""LoRA on engine actors: a group's load reaches every actor (two phases: a refusal
leaves every actor as it was), and the actors serve the adapter as one in-process engine
does."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # engine cores as Ray actors (a local Ray)

ray = pytest.importorskip("ray")

from hotswap import LLM, LoRARequest, SamplingParams  # noqa: E402
from hotswap.errors import InvalidArgument  # noqa: E402
from hotswap.ray import RayEngineGroup, launch_engines  # noqa: E402
from tests.helpers.tiny_models import write_peft_adapter  # noqa: E402

PROMPTS = [[1, 5, 9, 14], [2, 3], [7, 7, 7, 7, 7, 7], [4, 100, 50]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARGS = {"dtype": "float32", "num_threads": 1, "enable_lora": True, "max_lora_rank": 16}


def test_a_group_load_reaches_every_actor_and_a_refusal_none(
    local_ray, tiny_llama, tmp_path
) -> None:
    path = write_peft_adapter(tiny_llama, tmp_path / "a", 8, ("q_proj", "down_proj"), seed=3)
    bad = write_peft_adapter(tiny_llama, tmp_path / "big", 32, ("q_proj",), seed=4)
    single = LLM(str(tiny_llama), progress=False, **ARGS)
    adapter = LoRARequest("a", 1, str(path))
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY,
                use_tqdm=False, lora_request=adapter)]  # fmt: skip
    engines = launch_engines(2, str(tiny_llama), ARGS, num_cpus_per_engine=0.5)
    try:
        group = RayEngineGroup(engines)
        answers = group.load_lora_adapter("a", str(path))
        assert [a["version"] for a in answers] == [1, 1]
        outputs = group.generate(PROMPTS, GREEDY, LoRARequest("a", 1))
        assert [o.outputs[0].token_ids for o in outputs] == expected
        with pytest.raises(InvalidArgument, match="max-lora-rank"):
            group.load_lora_adapter("big", str(bad))  # r = 32 > 16: refused everywhere
        listed = ray.get([actor.list_lora_adapters.remote() for actor in engines])
        assert [[a["lora_name"] for a in names] for names in listed] == [["a"], ["a"]]
        group.unload_lora_adapter("a")
        listed = ray.get([actor.list_lora_adapters.remote() for actor in engines])
        assert listed == [[], []]
    finally:
        engines.shutdown()
