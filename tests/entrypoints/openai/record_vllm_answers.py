"""Record vLLM's answer to every body of compat_cases.py (run by hand, not by pytest):

    python tests/entrypoints/openai/record_vllm_answers.py [--vllm-venv ../.venv-vllm]

Starts `vllm serve` (vLLM's CPU build, installed by `make bench-peers`) on the built-in
SmolLM2 model served as "tiny" with max-model-len 512 and no tool flags, as the shared
test server runs, sends each body and writes {case id: status} to data/vllm_answers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from hotswap.default_model import default_model_dir  # noqa: E402
from tests.entrypoints.openai.compat_cases import BASE, CASES  # noqa: E402

ANSWERS = HERE / "data" / "vllm_answers.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(python: Path, port: int) -> subprocess.Popen:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(default_model_dir()), "--served-model-name", "tiny",
           "--max-model-len", "512", "--dtype", "bfloat16", "--port", str(port)]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("vllm serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-venv", default=str(HERE.parents[3] / ".venv-vllm"))
    args = parser.parse_args()
    port = free_port()
    proc = start_vllm(Path(args.vllm_venv) / "bin" / "python", port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        answers = {}
        with httpx.Client(base_url=url, timeout=120) as http:
            for case_id, route, extra in CASES:
                response = http.post(route, json={**BASE[route], **extra})
                answers[case_id] = response.status_code
                print(case_id, response.status_code, response.text[:160].replace("\n", " "))
        ANSWERS.parent.mkdir(exist_ok=True)
        ANSWERS.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
