"""A differential exactness checker (issue 44): random schedules of requests, pauses,
weight rounds, sleeps and adapter loads, played against hotswap in batch-invariant
float32 mode through the Python API (`AsyncLLM`) or the HTTP server (`hotswap serve` on
127.0.0.1, with the OpenAI client and httpx), every token checked against an independent
reference: transformers (peft for LoRA) on the weights its provenance names, fed exactly
the context before it.

Run it (from the repository root):

    .venv/bin/python -m tests.exactness --seed 3 --budget 60s                 # Python API
    .venv/bin/python -m tests.exactness --seed 3 --budget 5m --transport both
    .venv/bin/python -m tests.exactness --replay '<the JSON a failure printed>'
    .venv/bin/python -m tests.exactness --plant wrong-version-label   # must fail

It prints how many schedules, tokens and routed-expert rows were checked, per minute,
and what the schedules covered (pause modes, round kinds, preemptions, prefix-cache hits,
choices across versions, ...). On a failure it shrinks the schedule (drops steps and
requests, shortens prompts, simplifies the engine) and prints the small one that still
fails, with the command that replays it; the exit status is 1.

Per token, unless its span is stale (check.py says why those are left out): the logprob
within 1e-5 of the reference's, the greedy token the reference's argmax, the version
span's weights (a token labelled with another version's weights fails), and for a
mixture of experts each row of routed experts the reference router's top-k. Per choice:
spans contiguous and monotonic over committed versions, one adapter version, finish
reasons consistent with the request (an abort only after an abort-mode pause or sleep;
`length` exactly at max_tokens and never past a stop string).

The pieces: schedule.py (frozen steps, JSON), generate.py (random schedules),
weights.py (checkpoints, adapters, rounds, the ledger of versions), driver.py with
python_engine.py and http_engine.py (playing a schedule), trainer.py (the trainer side of
rounds), reference.py and check.py (the reference and the checks), shrink.py, runner.py
(the loop and its report), planted.py (bugs planted in-process, to show it finds them).
pytest runs a fixed-seed budget through both transports in the fast suite, long budgets
and planted-bug searches in the slow set (test_exactness.py), and the parts alone
(test_parts.py).

Not covered: stale tokens against the reference (above), tensor and data parallelism,
adapter pushes by a trainer, prompt logprobs and structured outputs.
"""
